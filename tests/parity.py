"""Parity workers: run zoo models through the ``dcp`` backend on a real gloo world and compare
outputs and SP-group-summed gradients with eager on the full batch in the same process."""

from __future__ import annotations

import traceback
from typing import Any

import torch
import torch.distributed as dist

import dcp_compile as dcp
from sharding_checks import sharding_problems

from model_zoo import ZOO, eager_reference, output_tensors

RTOL, ATOL = 1e-5, 1e-5


def summed_gradients(model: torch.nn.Module, group=None, reduce: bool = True) -> dict[str, torch.Tensor]:
    """Each parameter's gradient, summed over ``group`` (the SP group; the world if None) unless
    ``reduce`` is False (a rank that ran alone): what DESIGN's parity law compares with eager."""
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        grad = param.grad.detach().clone()
        if reduce and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(grad, group=group)
        grads[name] = grad
    return grads


def compiled_run(model: torch.nn.Module, compiled: Any, case, inputs: dict, group=None, reduce: bool = True) -> tuple[Any, dict]:
    """Outputs and parameter gradients of the compiled model; gradients summed over ``group``
    (the SP group) unless ``reduce`` is False (a rank that ran alone)."""
    model.zero_grad(set_to_none=True)
    outputs = compiled(**inputs)
    case.loss_of(outputs).backward()
    return outputs, summed_gradients(model, group, reduce)


def compare(case_name: str, length: int, reference: tuple, actual: tuple, rtol: float = RTOL, atol: float = ATOL) -> list[str]:
    problems = []
    expected_outputs, expected_grads = reference
    outputs, grads = actual
    expected_tensors, tensors = output_tensors(expected_outputs), output_tensors(outputs)
    if set(expected_tensors) != set(tensors):
        problems.append(f"{case_name}@{length}: outputs {sorted(tensors)} != eager {sorted(expected_tensors)}")
    for key, expected in expected_tensors.items():
        if key not in tensors:
            continue
        got = tensors[key].detach()
        if got.shape != expected.shape:
            problems.append(f"{case_name}@{length}: output {key} shape {tuple(got.shape)} != {tuple(expected.shape)}")
            continue
        if not torch.allclose(got, expected, rtol=rtol, atol=atol, equal_nan=True):
            error = (got - expected).abs().nan_to_num().max().item()
            problems.append(f"{case_name}@{length}: output {key} differs (max abs error {error:.3g})")
    if set(expected_grads) != set(grads):
        problems.append(f"{case_name}@{length}: gradients for {sorted(set(expected_grads) ^ set(grads))} missing on one side")
    for name, expected in expected_grads.items():
        got = grads.get(name)
        if got is None:
            continue
        if not torch.allclose(got, expected, rtol=rtol, atol=atol):
            error = (got - expected).abs().max().item()
            problems.append(f"{case_name}@{length}: grad {name} differs (max abs error {error:.3g})")
    return problems


def parity_worker(rank: int, world_size: int, case_names: list[str], lengths: list[int], inner: str = "aot_eager",
                  sp_size: int | None = None, rtol: float = RTOL, atol: float = ATOL) -> dict[str, Any]:
    """Compile each case once and check every length; raise with all mismatches found."""
    torch.manual_seed(0)
    problems: list[str] = []
    checked = sharded_variants = 0
    for name in case_names:
        case = ZOO[name]
        torch._dynamo.reset()
        model = case.build()
        options = {"inner": inner}
        if sp_size is not None:
            options["sp_size"] = sp_size
        compiled = torch.compile(model, backend="dcp", dynamic=True, options=options)
        for length in lengths:
            try:
                reference = eager_reference(case, length)
                records = dcp.explain(compiled, **case.make_inputs(length))
                actual = compiled_run(model, compiled, case, case.make_inputs(length))
            except Exception:
                problems.append(f"{name}@{length}: raised\n{traceback.format_exc()}")
                continue
            problems += compare(name, length, reference, actual, rtol, atol)
            # Parity alone cannot tell sharded from a whole-graph unsharded run: check both.
            problems += [f"{name}@{length}: {p}" for p in sharding_problems(records, case.gather_budget)]
            sharded_variants += sum(1 for v in records.variant_records() if v.sp_size > 1 and v.sharded_sites)
            checked += 1
    if problems:
        raise AssertionError(f"rank {rank}: {len(problems)} parity problem(s):\n" + "\n".join(problems))
    return {"checked": checked, "sharded_variants": sharded_variants}
