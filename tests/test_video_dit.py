"""The demo's video DiT (:class:`~dcp_compile.demo.example_models.VideoDiT`) under the dcp backend.

What the end-to-end CPU benchmark relies on: the model compiles once for every clip shape, its
self- and cross-attention all run sharded at SP 2 with no gather (the caption stays replicated on
every rank, the loss is a local sum and an all-reduce), and the compiled SP-2 loss and the
gradients summed over the group equal eager's on the full batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dcp_compile as dcp
from dcp_compile.demo.example_models import VideoDiT, video_dit_inputs
from dcp_compile.testing.process_world import run_in_process_world
from sharding_checks import sharding_problems

SHAPES = (((2, 4, 4), 2), ((1, 8, 8), 3), ((3, 2, 2), 1))  # (frames, rows, columns) of patches, batch


def test_eager_loss_depends_on_every_input_and_has_every_gradient() -> None:
    torch.manual_seed(0)
    model = VideoDiT(layers=1)
    inputs = video_dit_inputs((2, 2, 4), 2, torch.Generator().manual_seed(0))
    loss = model(**inputs)
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    generator = torch.Generator().manual_seed(1)
    for name in ("text", "coords", "t"):  # the conditioning reaches the loss
        changed = dict(inputs, **{name: inputs[name] + torch.randn(inputs[name].shape, generator=generator)})
        assert not torch.allclose(model(**changed), loss)


def _parity_worker(rank: int, world_size: int) -> list[str]:
    torch.manual_seed(0)
    model = VideoDiT()
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "aot_eager"})
    generator = torch.Generator().manual_seed(1)
    problems = []
    for shape, batch in SHAPES:
        inputs = video_dit_inputs(shape, batch, generator)
        model.zero_grad(set_to_none=True)
        expected = model(**inputs)
        expected.backward()
        expected_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        with dcp.use(dcp.Variant(world_size, "none")):
            records = dcp.explain(compiled, **inputs)
            loss = compiled(**inputs)
        loss.backward()
        if not torch.allclose(loss.detach(), expected.detach(), rtol=1e-5, atol=1e-6):
            problems.append(f"{shape}: loss {loss.item()} != eager {expected.item()}")
        for name, param in model.named_parameters():
            grad = param.grad.clone()
            dist.all_reduce(grad)  # the SP group is the world: summed over it, as DESIGN's parity law
            if not torch.allclose(grad, expected_grads[name], rtol=1e-4, atol=1e-6):
                problems.append(f"{shape}: grad {name} differs by {(grad - expected_grads[name]).abs().max():.3g}")
        problems += [f"{shape}: {p}" for p in sharding_problems(records, gather_budget=0)]
        variant = [v for v in records.variant_records() if v.sp_size == world_size][0]
        if len(variant.sharded_sites) != 4:  # 2 blocks x (self, cross): every site under the all-to-all
            problems.append(f"{shape}: sharded sites {variant.sharded_sites}")
    return problems


@pytest.mark.slow
def test_compiled_sp2_matches_eager_sharded_without_gathers() -> None:
    results = run_in_process_world(_parity_worker, 2, timeout=900)
    assert results == [[], []], results
