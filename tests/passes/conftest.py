"""The pass tests: tiny graphs, one thread (the work is tracing, not arithmetic). ``fake_world``
comes from ``tests/conftest.py``; the modules that compile one graph for several tests open a
module-scoped fake world of their own instead."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
