"""``dcp.check(model, *args, **kwargs)``: is the compiled model exact on *my* model and inputs?

A user about to start a long run wants one answer: does the sequence-parallel model compute what
eager computes? The check runs the compiled model (every rank of the SP group passes the same
inputs, as in training) and eager on a private copy of the module, back-propagates the same fixed
random cotangent through both, and compares the outputs and the parameter gradients summed over
the SP group. On a mismatch it does what Dynamo's accuracy minifier does for compilers: it
compiles the module's children one at a time with the same backend, feeds each the inputs eager
gave it, and descends into the first child whose outputs diverge, so the report names the deepest
module (by its path, as ``nn_module_stack`` names it) that dcp gets wrong.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from dcp_compile.errors import DCPError
from dcp_compile.runtime.graph_parameters import correct_parameters_outside_graphs
from dcp_compile.compiler.inspection import explain
from dcp_compile.compiler.record import ModelRecord

log = logging.getLogger(__name__)


class CheckFailed(DCPError, AssertionError):
    """The compiled model disagrees with eager; the message names the module and the values."""


@dataclass
class CheckReport:
    """What ``dcp.check`` compared, and how closely."""

    sp_size: int
    outputs_checked: int = 0
    gradients_checked: int = 0
    max_output_error: float = 0.0
    max_gradient_error: float = 0.0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    diverging_module: str | None = None
    record: ModelRecord | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        head = (f"dcp.check at SP {self.sp_size}: {'OK' if self.ok else 'MISMATCH'} - {self.outputs_checked} "
                f"output(s), max error {self.max_output_error:.3g}; {self.gradients_checked} gradient(s), "
                f"max error {self.max_gradient_error:.3g}")
        lines = [head]
        if self.record is not None:
            lines += [f"  {line}" for line in self.record.summary_lines()]
        lines += [f"  {problem}" for problem in self.problems[:20]]
        lines += [f"  note: {note}" for note in self.notes]
        if self.diverging_module is not None:
            lines.append(f"  first diverging module: {self.diverging_module}")
        return "\n".join(lines)


def _original_module(compiled: Any) -> nn.Module:
    module = getattr(compiled, "_orig_mod", None)
    if not isinstance(module, nn.Module):
        raise TypeError("dcp.check needs the model returned by torch.compile(model, backend='dcp', dynamic=True)")
    return module


def _float_tensors(value: Any) -> list[torch.Tensor]:
    if hasattr(value, "to_tuple"):  # Hugging Face / diffusers ModelOutput
        value = value.to_tuple()
    leaves, _ = tree_flatten(value)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()]


def _cotangents(outputs: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=generator, dtype=torch.float32).to(t.device, t.dtype) for t in outputs]


def _objective(outputs: list[torch.Tensor], cotangents: list[torch.Tensor]) -> torch.Tensor:
    return sum(((o * c).sum() for o, c in zip(outputs, cotangents) if o.requires_grad), torch.zeros(()))


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.detach().abs().max().item() if expected.numel() else 0.0
    difference = (actual.detach().float() - expected.detach().float()).abs().nan_to_num(nan=float("inf"))
    return (difference.max().item() if difference.numel() else 0.0) / max(scale, 1e-6)


def check(model: Any, *args: Any, sp_group: Any = None, rtol: float = 1e-4, seed: int = 0, raise_on_mismatch: bool = True,
          **kwargs: Any) -> CheckReport:
    """Compare the compiled ``model`` with eager on ``(*args, **kwargs)`` across the SP group.

    Every rank of the SP group must call it with the same inputs. ``sp_group`` is the process
    group gradients are summed over (default: the world, which is the SP group in static mode).
    Parameter gradients already on the model are left untouched. Raises :class:`CheckFailed`
    naming the first diverging module (or returns the report with ``raise_on_mismatch=False``).
    """
    module = _original_module(model)
    reference = copy.deepcopy(module)
    sp_size = dist.get_world_size(sp_group) if dist.is_available() and dist.is_initialized() else 1
    report = CheckReport(sp_size=sp_size)
    report.record = explain(model, *args, **kwargs)

    saved_grads = {name: p.grad for name, p in module.named_parameters()}
    try:
        module.zero_grad(set_to_none=True)
        actual = _float_tensors(model(*args, **kwargs))
        expected = _float_tensors(reference(*args, **kwargs))
        cotangents = _cotangents(expected, seed)
        _objective(actual, cotangents).backward()
        _objective(expected, cotangents).backward()
        _compare_outputs(report, actual, expected, rtol)
        _compare_gradients(report, module, reference, sp_group, rtol)
    finally:
        for name, parameter in module.named_parameters():
            parameter.grad = saved_grads[name]
    if not report.ok:
        report.diverging_module = _first_diverging_module(model, reference, args, kwargs, rtol)
        if raise_on_mismatch:
            raise CheckFailed(str(report))
    log.info("%s", report)
    return report


def _compare_outputs(report: CheckReport, actual: list[torch.Tensor], expected: list[torch.Tensor], rtol: float) -> None:
    if len(actual) != len(expected):
        report.problems.append(f"{len(actual)} floating-point outputs, eager returns {len(expected)}")
        return
    for index, (got, want) in enumerate(zip(actual, expected)):
        report.outputs_checked += 1
        if got.shape != want.shape:
            report.problems.append(f"output {index}: shape {tuple(got.shape)}, eager {tuple(want.shape)}")
            continue
        error = _relative_error(got, want)
        report.max_output_error = max(report.max_output_error, error)
        if error > rtol:
            report.problems.append(f"output {index}: relative error {error:.3g}")


def _compare_gradients(report: CheckReport, module: nn.Module, reference: nn.Module, group: Any, rtol: float) -> None:
    if report.sp_size > 1:
        try:
            corrected = correct_parameters_outside_graphs(module)
        except RuntimeError as error:  # ParametersOutsideGraphs
            report.problems.append(str(error))
        else:
            report.notes += [f"gradient of {name}: computed in eager code outside the compiled graphs (a graph "
                             f"break), in full on every rank; divided by the SP size ({report.sp_size}) as "
                             "dcp.sync_gradients does" for name in corrected]
    for (name, parameter), (_, expected) in zip(module.named_parameters(), reference.named_parameters()):
        if expected.grad is None and parameter.grad is None:
            continue
        got = parameter.grad.detach().clone() if parameter.grad is not None else torch.zeros_like(expected)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(got, group=group)  # each rank holds the gradient of its share
        want = expected.grad if expected.grad is not None else torch.zeros_like(got)
        report.gradients_checked += 1
        error = _relative_error(got, want)
        report.max_gradient_error = max(report.max_gradient_error, error)
        if error > rtol:
            report.problems.append(f"gradient of {name}: relative error {error:.3g}")


def _first_diverging_module(model: Any, reference: nn.Module, args: tuple, kwargs: dict, rtol: float) -> str | None:
    """The deepest submodule whose compiled outputs differ from eager on the inputs eager gave it."""
    captured: dict[str, tuple[tuple, dict, Any]] = {}
    order: list[str] = []

    def hook(name: str):
        def record(module: nn.Module, inputs: tuple, kw: dict, output: Any) -> None:
            if name not in captured:
                captured[name] = (inputs, kw, output)
                order.append(name)
        return record

    handles = [sub.register_forward_hook(hook(name), with_kwargs=True)
               for name, sub in reference.named_modules() if name]
    try:
        with torch.no_grad():
            reference(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    backend_options = _backend_options(model)

    def called_parent(name: str) -> str:
        """The nearest enclosing module that was itself called (a ModuleList never is)."""
        while "." in name:
            name = name.rsplit(".", 1)[0]
            if name in captured:
                return name
        return ""

    diverging = None
    candidates = [name for name in order if called_parent(name) == ""]
    while candidates:
        found = None
        for name in candidates:
            inputs, kw, expected = captured[name]
            submodule = reference.get_submodule(name)
            if not _has_parameters_or_children(submodule):
                continue
            try:
                compiled = torch.compile(submodule, backend="dcp", dynamic=True, options=backend_options)
                with torch.no_grad():
                    got = _float_tensors(compiled(*inputs, **kw))
                want = _float_tensors(expected)
                mismatch = len(got) != len(want) or any(
                    g.shape != w.shape or _relative_error(g, w) > rtol for g, w in zip(got, want))
            except Exception as error:  # a module that fails to compile alone diverges too
                log.info("dcp.check: %s could not be compiled alone: %s", name, error)
                mismatch = True
            if mismatch:
                found = name
                break
        if found is None:
            break
        diverging = found
        candidates = [name for name in order if called_parent(name) == found]
    return diverging


def _has_parameters_or_children(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.children())


def _backend_options(model: Any) -> dict[str, Any]:
    """The options the user compiled with, so each submodule runs the same variant."""
    compiler = getattr(getattr(model, "dynamo_ctx", None), "callback", None) or getattr(model, "_torchdynamo_orig_callable", None)
    options = getattr(compiler, "kwargs", {}).get("options") if hasattr(compiler, "kwargs") else None
    return dict(options or {"inner": "eager"})


def check_first_call(graph: "torch.fx.GraphModule", variant: Any, args: tuple, run: Any, parameter_indices: frozenset[int],
                     group: Any, rtol: float = 1e-4, seed: int = 0) -> None:
    """``options={"check": True}``: before the first call of each variant returns, the variant is
    run once more and compared with the unsharded graph on the same inputs (outputs, and parameter
    gradients summed over the SP group for a fixed random cotangent). Costs one extra forward and
    two backward passes, once per variant; raises :class:`CheckFailed` on a mismatch."""
    outputs = [t for t in _float_tensors(run())]
    reference_outputs = _float_tensors(torch.fx.Interpreter(graph).run(*args))
    problems = []
    if len(outputs) != len(reference_outputs):
        problems.append(f"{len(outputs)} outputs, the unsharded graph gives {len(reference_outputs)}")
    for index, (got, want) in enumerate(zip(outputs, reference_outputs)):
        if got.shape != want.shape or _relative_error(got, want) > rtol:
            problems.append(f"output {index}: relative error {_relative_error(got, want):.3g}" if got.shape == want.shape
                            else f"output {index}: shape {tuple(got.shape)}, unsharded {tuple(want.shape)}")
    parameters = [args[i] for i in sorted(parameter_indices) if isinstance(args[i], torch.Tensor) and args[i].requires_grad]
    differentiable = [(o, r) for o, r in zip(outputs, reference_outputs) if o.requires_grad and r.requires_grad]
    if parameters and differentiable and not problems:
        cotangents = _cotangents([r for _, r in differentiable], seed)
        got = torch.autograd.grad([o for o, _ in differentiable], parameters, cotangents, allow_unused=True)
        want = torch.autograd.grad([r for _, r in differentiable], parameters, cotangents, allow_unused=True)
        for index, (g, w) in enumerate(zip(got, want)):
            g = torch.zeros_like(parameters[index]) if g is None else g.detach().clone()
            w = torch.zeros_like(parameters[index]) if w is None else w
            if group is not None:
                dist.all_reduce(g, group=group)
            if _relative_error(g, w) > rtol:
                problems.append(f"gradient of parameter input {index}: relative error {_relative_error(g, w):.3g}")
    if problems:
        raise CheckFailed(f"dcp: variant {variant} disagrees with the unsharded graph on its first call: "
                          + "; ".join(problems[:8]) + ". Run dcp.check(model, *inputs) to find the module.")
    log.info("dcp: variant %s checked against the unsharded graph on its first call", variant)
