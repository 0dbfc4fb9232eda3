"""bf16 training: variants compiled under ``torch.autocast("cpu", torch.bfloat16)`` and with bf16
parameters, on 2 real gloo ranks against eager on the full batch under the same precision
(SP-summed gradients), at bf16 tolerances, with every attention sharded."""

from __future__ import annotations

import torch

from dcp_compile.testing.process_world import run_in_process_world

LOSS_RTOL = 1e-2
GRAD_RTOL = 3e-2  # bf16 keeps 8 bits of mantissa: a different summation order moves the last ones


def _worker(rank: int, world_size: int) -> dict:
    import contextlib

    import torch.distributed as dist

    import dcp_compile as dcp
    from model_zoo import ZOO

    case = ZOO["gpt"]
    inputs = case.make_inputs(13)
    results = {}
    for mode in ("autocast", "bf16 parameters"):
        torch._dynamo.reset()
        model, reference = case.build(), case.build()
        if mode == "bf16 parameters":
            model, reference = model.to(torch.bfloat16), reference.to(torch.bfloat16)
        precision = (lambda: torch.autocast("cpu", torch.bfloat16)) if mode == "autocast" else contextlib.nullcontext
        compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager", "sp_size": world_size})
        with precision():
            loss = case.loss_of(compiled(**inputs))
            expected = case.loss_of(reference(**inputs))
        loss.backward()
        expected.backward()
        worst = 0.0
        for (name, parameter), (_, wanted) in zip(model.named_parameters(), reference.named_parameters()):
            gradient = parameter.grad.float().clone()
            dist.all_reduce(gradient)
            scale = wanted.grad.float().abs().max().item() + 1e-6
            worst = max(worst, (gradient - wanted.grad.float()).abs().max().item() / scale)
        record = dcp.explain(compiled, **inputs)
        results[mode] = {"loss": loss.item(), "expected": expected.item(), "parameter_dtype": str(next(model.parameters()).dtype),
                         "grad_error": worst, "summary": record.summary_lines(),
                         "sharded": all(v.is_sharded for v in record.variant_records() if v.sp_size > 1)}
    return results


def test_bf16_autocast_and_bf16_parameters_at_parity_and_sharded():
    for results in run_in_process_world(_worker, 2, timeout=600):
        for mode, result in results.items():
            assert abs(result["loss"] / result["expected"] - 1) < LOSS_RTOL, (mode, result)
            assert result["grad_error"] < GRAD_RTOL, (mode, result)
            assert result["sharded"] and any("sharded 2/2 attention sites" in line for line in result["summary"]), (mode, result)
        assert results["bf16 parameters"]["parameter_dtype"] == "torch.bfloat16"
