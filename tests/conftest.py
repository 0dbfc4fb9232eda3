import os
import sys

# Spawned ranks import the test helpers (model_zoo, parity) by module name.
sys.path.insert(0, os.path.dirname(__file__))


import pytest


@pytest.fixture
def fake_world():
    """A 2-rank world with the fake process group: collectives trace and compile but move no data
    (graph-structure tests); dynamo starts fresh before and after."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    torch._dynamo.reset()
    yield
    dist.destroy_process_group()
    torch._dynamo.reset()
