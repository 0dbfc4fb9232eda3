"""FSDP2's "returned a view tensor" warning on the diffusers video DiT: its cause, and exact gradients.

``examples/train_video_dit.py`` prints torch's warning "FSDP2-wrapped module
(FSDPWanTransformer3DModel) returned a view tensor ...". The cause is the model's own unpatchify:
``WanTransformer3DModel.forward`` ends with ``permute(...).flatten(6, 7).flatten(4, 5).flatten(2, 3)``,
which with a one-frame temporal patch is a view of the permuted tensor, in eager and under dcp
alike (``test_the_video_dit_returns_a_view_in_eager_without_dcp``). FSDP2 registers its
pre-backward hook on each output and warns because an *in-place* op on a view would drop that hook
and skip the backward all-gather. Neither can hurt here: the training loop uses the prediction
out of place (``F.mse_loss``), and ``dcp.shard_model`` keeps the parameters unsharded from
``dcp.begin_step`` to ``dcp.sync_gradients`` (there is no backward all-gather to skip).

The 2-rank test proves the gradients: one step with an SP-2 micro-batch that both ranks share and
an SP-1 micro-batch per rank, weighted 0.5 / 0.25 / 0.25; the reduce-scattered FSDP2 gradients,
gathered, equal the unsharded model's gradient of the same weighted loss in one process.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("diffusers")

import dcp_compile as dcp
from dcp_compile.testing.process_world import run_in_process_world

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from train_video_dit import CHANNELS, TEXT_TOKENS, TINY, build_model  # noqa: E402

VIEW_WARNING = "returned a view tensor"
# (frames, height, width) of each micro-batch's latents: the shared SP-2 one, then one per rank
SHAPES = ((3, 8, 10), (3, 6, 8), (5, 6, 8))
WEIGHTS = (0.5, 0.25, 0.25)


def inputs(index: int) -> tuple[dict, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + index)
    frames, height, width = SHAPES[index]
    latents = torch.randn(1, CHANNELS, frames, height, width, generator=generator)
    model_inputs = {"hidden_states": latents, "timestep": torch.tensor([float(17 * index + 3)]),
                    "encoder_hidden_states": torch.randn(1, TEXT_TOKENS, TINY.text_dim, generator=generator),
                    "return_dict": False}
    return model_inputs, torch.randn(latents.shape, generator=generator)


def test_the_video_dit_returns_a_view_in_eager_without_dcp() -> None:
    model = build_model(TINY)
    model_inputs, _ = inputs(0)
    output = model(**model_inputs)[0]
    assert output._base is not None, "the unpatchify no longer returns a view: update docs/training.md (FSDP2) and this test"


def _fsdp_step(rank: int, world_size: int) -> dict:
    from torch.distributed.tensor import DTensor

    model = dcp.shard_model(build_model(TINY))
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager"})
    dcp.runtime.create_sp_groups()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.begin_step(model)
        for index, sp_size in ((0, 2), (1 + rank, 1)):
            model_inputs, noise = inputs(index)
            with dcp.use(dcp.Variant(sp_size)):
                prediction = compiled(**model_inputs)[0]
            (F.mse_loss(prediction.float(), noise) * WEIGHTS[index]).backward()
        dcp.sync_gradients(model)
    assert all(isinstance(p.grad, DTensor) for p in model.parameters() if p.requires_grad)
    return {
        "warned": any(VIEW_WARNING in str(w.message) for w in caught),
        "gradients": {name: p.grad.full_tensor().tolist() for name, p in model.named_parameters() if p.requires_grad},
    }


@pytest.mark.slow
def test_fsdp2_video_dit_gradients_equal_the_unsharded_model() -> None:
    results = run_in_process_world(_fsdp_step, 2, timeout=900)
    model = build_model(TINY)
    for index, weight in enumerate(WEIGHTS):
        model_inputs, noise = inputs(index)
        (F.mse_loss(model(**model_inputs)[0], noise) * weight).backward()
    for rank, result in enumerate(results):
        assert result["warned"], "FSDP2's view warning is what this test documents; if it is gone, update docs/training.md (FSDP2)"
        for name, parameter in model.named_parameters():
            if parameter.requires_grad:
                torch.testing.assert_close(torch.tensor(result["gradients"][name]), parameter.grad, rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"rank {rank} gradient of {name}: {m}")
