"""A compiled model outlives the process-group world it first ran in: ``dcp.profile`` compiles on a
one-process fake world, destroys it, and the same model may then run in another world (the replay
benchmark re-created a fake world of 32 ranks and crashed in its first call with "Could not resolve
the process group registered under the name 5": the variant compiled in the first world named that
world's SP group)."""

from __future__ import annotations

import torch

import dcp_compile as dcp
from dcp_compile.demo.example_models import TinyGPT
from dcp_compile.device_profile.fake_world import fake_world


def test_a_variant_compiled_in_a_destroyed_world_is_compiled_again_in_the_next() -> None:
    torch.manual_seed(0)
    model = TinyGPT(64, 32, 1, 2)
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager", "check_ranks": False})
    ids = torch.randint(1, 64, (1, 12))
    losses = []
    # SP 4 on 8 ranks names rank 0's group "5" (after the four SP-2 groups); on 32 ranks that name
    # belongs to an SP-2 group rank 0 is not in. The third world may even reuse the first one's id.
    for world_size in (8, 32, 8):
        with fake_world(world_size), dcp.use(dcp.Variant(4, "none")):
            loss = compiled(ids, ids)
            loss.backward()
            losses.append(loss.detach())
    # A fake world moves no data: rank 0's loss is its chunk's, the same in every world.
    assert torch.allclose(losses[0], losses[1]) and torch.allclose(losses[0], losses[2])
