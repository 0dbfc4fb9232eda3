"""Every op of torch's OpInfo database between an attention and the outputs, for the OpInfo sweep.

As PyTorch tests DTensor's sharding rules (``test/distributed/tensor/test_dtensor_ops.py`` runs
every OpInfo sample through DTensor and compares with the local result), each op's float32 sample
is run with one dimension of its first float tensor carried as the sequence: that tensor (and every
float tensor argument of the same shape) is the sample tiled to the run's length ``n`` along that
dimension, plus a small per-token projection of an attention's output, so its size along the
dimension is the attention's symbolic length. The op's outputs are returned (full, as every rank
returns them); the loss is a fixed weighting of them, so the projections' gradients exercise the
op's backward. Many ops share one compiled graph (one ``CaseModule`` each, so a gather's consumer
names its op through ``nn_module_stack``); a graph that raises is split in halves until the raising
op is alone.

:func:`select_cases` runs in one process (no ranks): it picks each op's sample and dimension by
trying them in eager, and says why an op is skipped. :func:`sweep_worker` runs on the ranks.
"""

from __future__ import annotations

import json
import math
import os
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_unflatten

from parity import summed_gradients

D, HEADS = 8, 2
LENGTHS = (13, 22)  # odd and even; unlike any size in the samples, so no other dimension shares the symbol
SCALE = 0.05  # the projection's share: the op sees the sample's values, moved per token
SAMPLES_SEEN, SAMPLES_TRIED = 40, 6
NO_REASON = "(NO REASON RECORDED)"  # a gather whose record says nothing: a failure of the sweep
PRESCREEN_BATCH = 24


@dataclass
class OpCase:
    """One op with one sample, the dimension carried as the sequence and the tensors that carry it."""

    index: int  # into op_db
    name: str
    sample: tuple[Any, tuple, dict]  # (input, args, kwargs), tensors detached
    dim: int
    varied: tuple[int, ...]  # pytree leaf positions of the tensors carried on the sequence
    backward: bool = True  # the op's backward runs (else only its outputs are compared)

    def label(self) -> str:
        return f"{self.name} (dim {self.dim} of {self.shape()})"

    def shape(self) -> tuple[int, ...]:
        leaves, _ = tree_flatten(self.sample)
        return tuple(leaves[self.varied[0]].shape)


@dataclass
class Skip:
    name: str
    why: str


@dataclass
class Outcome:
    name: str
    label: str
    kind: str  # "sharded", "gathered", "replicated", "raises", "WRONG"
    detail: str = ""
    gathers: list[str] = field(default_factory=list)


def op_name(op: Any) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def _tile(t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    return t.index_select(dim, torch.arange(n) % t.shape[dim])


def _varied_sample(case_sample: Any, varied: tuple[int, ...], dim: int, n: int) -> Any:
    leaves, spec = tree_flatten(case_sample)
    leaves = [(_tile(leaf, dim, n) if i in varied else leaf) for i, leaf in enumerate(leaves)]
    return tree_unflatten(leaves, spec)


def _call(op: Any, sample: Any) -> Any:
    inp, args, kwargs = sample
    return op.op(inp, *args, **kwargs)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor)]


def _is_random(op: Any, sample: Any) -> bool:
    outputs = []
    for seed_value in (0, 1):
        torch.manual_seed(seed_value)
        outputs.append(_tensors(_call(op, sample)))
    return any(a.shape != b.shape or not torch.equal(a.nan_to_num(), b.nan_to_num())
               for a, b in zip(*outputs))


def _works(op: Any, sample: Any, varied: tuple[int, ...], dim: int) -> tuple[bool, bool]:
    """Whether the op runs with ``varied`` at other sizes along ``dim`` (and returns a tensor), and
    whether its backward runs from them too (some ops have no derivative, or none for an argument)."""
    try:
        for n in LENGTHS:
            if not _tensors(_call(op, _varied_sample(sample, varied, dim, n))):
                return False, False
    except Exception:
        return False, False
    try:
        leaves, spec = tree_flatten(_varied_sample(sample, varied, dim, LENGTHS[0]))
        for i in varied:
            leaves[i] = leaves[i].clone().requires_grad_(True)
        outputs = [o for o in _tensors(_call(op, tree_unflatten(leaves, spec))) if o.requires_grad]
        if not outputs:
            return True, False
        sum(o.nan_to_num().sum() for o in outputs).backward()
    except Exception:
        return True, False
    return True, True


def _compile_alone(cases: list[OpCase]) -> list[str]:
    """Why each case fails under plain ``torch.compile(backend="eager", dynamic=True)`` ("" where it
    does not): a graph break at the op (it then runs eagerly between graphs, on full tensors), a
    raise or a wrong result of torch's own. Many ops share one compile; a batch with a problem
    is split in halves until each problem has its op."""
    from torch.testing._internal.common_methods_invocations import op_db

    graphs: list[Any] = []

    def count(gm: Any, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    def run(*tensors: torch.Tensor) -> list[Any]:
        outputs, start = [], 0
        for case in cases:
            leaves, spec = tree_flatten(case.sample)
            for position in case.varied:
                leaves[position] = tensors[start] * 1.0
                start += 1
            outputs.append(_tensors(_call(op_db[case.index], tree_unflatten(leaves, spec))))
        return outputs

    torch._dynamo.reset()
    compiled = torch.compile(run, backend=count, dynamic=True)
    failure = ""
    try:
        for n in LENGTHS:
            tensors = []
            for case in cases:
                leaves = tree_flatten(_varied_sample(case.sample, case.varied, case.dim, n))[0]
                tensors += [leaves[i] for i in case.varied]
            expected, got = run(*tensors), compiled(*tensors)
            if any(len(g) != len(e) or any(a.shape != b.shape or not torch.allclose(
                    a.double(), b.double(), rtol=1e-4, atol=1e-5, equal_nan=True) for a, b in zip(g, e))
                   for g, e in zip(got, expected)):
                failure = "torch.compile(backend='eager') alone differs from eager"
                break
    except Exception as error:  # noqa: BLE001 - torch's own compile failing is a reason to skip, recorded
        failure = f"torch.compile(backend='eager') alone raises: {type(error).__name__}: {str(error).splitlines()[0][:120]}"
    finally:
        torch._dynamo.reset()
    if not failure and len(graphs) > 1:
        failure = (f"torch.compile breaks the graph at this op ({len(graphs)} graphs: a data-dependent shape or "
                   "value); it runs eagerly between graphs, on full tensors")
    if not failure:
        return [""] * len(cases)
    if len(cases) == 1:
        return [failure]
    middle = len(cases) // 2
    return _compile_alone(cases[:middle]) + _compile_alone(cases[middle:])


def select_cases(names: list[str] | None = None, per_op: int = 1,
                 shard: tuple[int, int] | None = None) -> tuple[list[OpCase], list[Skip]]:
    """Each op's first float32 sample (up to ``per_op`` cases, on different dimensions) whose first
    float tensor can carry the sequence on some dimension, or why the op is skipped."""
    from torch.testing._internal.common_methods_invocations import op_db

    cases: list[OpCase] = []
    skips: list[Skip] = []
    for index, op in enumerate(op_db):
        name = op_name(op)
        if names is not None and name not in names and op.name not in names:
            continue
        if shard is not None and index % shard[1] != shard[0]:
            continue
        if torch.float32 not in op.supported_dtypes("cpu"):
            skips.append(Skip(name, "no float32 on CPU"))
            continue
        found: list[OpCase] = []
        why = "no float32 tensor argument of one dimension or more in any sample (a factory or scalar op)"
        torch.manual_seed(0)
        try:
            samples = [s for _, s in zip(range(SAMPLES_SEEN), op.sample_inputs("cpu", torch.float32, requires_grad=False))]
        except Exception as error:  # noqa: BLE001
            skips.append(Skip(name, f"sample_inputs raises: {type(error).__name__}"))
            continue
        # Samples whose first tensor is a matrix or a 3-d tensor first: the op then acts along
        # some dimensions and not others, so the carried one is sometimes each.
        samples = sorted(samples, key=lambda s: 0 if isinstance(s.input, torch.Tensor) and 2 <= s.input.dim() <= 3 else 1)
        samples = samples[:SAMPLES_TRIED]
        random = False
        for sample_input in samples:
            sample = (sample_input.input, tuple(sample_input.args), dict(sample_input.kwargs))
            leaves, _ = tree_flatten(sample)
            floats = [i for i, leaf in enumerate(leaves)
                      if isinstance(leaf, torch.Tensor) and leaf.dtype == torch.float32 and leaf.dim() >= 1
                      and leaf.numel() > 0 and leaf.layout == torch.strided]
            if not floats:
                continue
            sample = tree_unflatten([leaf.detach() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves],
                                    tree_flatten(sample)[1])
            try:
                if _is_random(op, sample):
                    random = True
                    break
            except Exception:
                continue
            why = ("no dimension of the sample's float tensor can take another size (the op rejects it, "
                   "or returns no tensor)")
            primary = leaves[floats[0]]
            same_shape = tuple(i for i in floats if leaves[i].shape == primary.shape)
            try:
                pickle.dumps(sample)  # the ranks receive it
            except Exception:
                continue
            dims = list(dict.fromkeys([0, primary.dim() - 1, *range(primary.dim())]))  # first and last first
            for dim in dims:
                if any(c.dim == dim for c in found):
                    continue
                tried = {varied: _works(op, sample, varied, dim) for varied in dict.fromkeys((same_shape, (floats[0],)))}
                # the first choice whose backward runs, else the first whose forward does
                ranked = [v for v, (fwd, bwd) in tried.items() if bwd] + [v for v, (fwd, _) in tried.items() if fwd]
                if ranked:
                    found.append(OpCase(index, name, sample, dim, ranked[0], tried[ranked[0]][1]))
                if len(found) >= per_op:
                    break
            if len(found) >= per_op:
                break
        if random:
            skips.append(Skip(name, "random: two seeds give different outputs"))
            continue
        if not found:
            skips.append(Skip(name, why))
            continue
        cases += found
    kept = []
    for start in range(0, len(cases), PRESCREEN_BATCH):
        batch = cases[start:start + PRESCREEN_BATCH]
        for case, failure in zip(batch, _compile_alone(batch)):
            if failure:
                skips.append(Skip(case.name, failure))
            else:
                kept.append(case)
    # An op with several cases is skipped only where all of them are.
    names_kept = {case.name for case in kept}
    skips = [skip for skip in skips if skip.name not in names_kept]
    return kept, list({skip.name: skip for skip in skips}.values())


# --- the ranks' side ---------------------------------------------------------------------------


class CaseModule(nn.Module):
    """One op applied to its sample with the carried tensors moved per token by ``h``."""

    def __init__(self, case: OpCase, op: Any) -> None:
        super().__init__()
        self.case, self.op = case, op
        leaves, self.spec = tree_flatten(case.sample)
        self.constants = {i: leaf for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor)}
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and i not in case.varied:
                self.register_buffer(f"fixed_{i}", leaf.clone(), persistent=False)
        self.rest = []
        self.embeds = nn.ModuleList()
        for i in case.varied:
            rest = list(leaves[i].shape)
            del rest[case.dim]
            self.rest.append(rest)
            self.embeds.append(nn.Linear(D, max(1, math.prod(rest))))
        self.count = len(leaves)

    def carry(self, h: torch.Tensor, base: torch.Tensor, j: int) -> torch.Tensor:
        """``base`` moved per token by ``h`` (its own method, so a gather here is told from the op's)."""
        moved = self.embeds[j](h).reshape(h.shape[0], *self.rest[j])
        if self.case.dim:
            order = list(range(1, moved.dim()))
            moved = moved.permute(order[:self.case.dim] + [0] + order[self.case.dim:])
        return base + SCALE * moved

    def forward(self, h: torch.Tensor, bases: list[torch.Tensor]) -> Any:
        leaves: list[Any] = []
        carried = dict(zip(self.case.varied, range(len(self.case.varied))))
        for i in range(self.count):
            if i in self.constants:
                leaves.append(self.constants[i])
            elif i in carried:
                j = carried[i]
                carried_tensor = self.carry(h, bases[j], j)
                # an op without a derivative runs forward only (no backward to trace through it)
                leaves.append(carried_tensor if self.case.backward else carried_tensor.detach())
            else:
                leaves.append(getattr(self, f"fixed_{i}"))
        inp, args, kwargs = tree_unflatten(leaves, self.spec)
        return tuple(_tensors(self.op.op(inp, *args, **kwargs)))


class SweepModel(nn.Module):
    """An attention over ``x`` [1, n, D], then every case on its (detached) output."""

    def __init__(self, cases: list[OpCase], ops: list[Any]) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.cases = nn.ModuleList(CaseModule(case, op) for case, op in zip(cases, ops))
        self.bases_per_case = [len(case.varied) for case in cases]
        self.case_list = list(cases)

    def forward(self, x: torch.Tensor, *bases: torch.Tensor) -> Any:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = (x + self.out(a.transpose(1, 2).reshape(b, n, D)))[0].detach()
        outputs, start = [], 0
        for module, count in zip(self.cases, self.bases_per_case):
            outputs.append(module(h, list(bases[start:start + count])))
            start += count
        return tuple(outputs)


def _inputs(cases: list[OpCase], n: int) -> list[torch.Tensor]:
    x = torch.randn(1, n, D, generator=torch.Generator().manual_seed(n))
    bases = []
    for case in cases:
        leaves = tree_flatten(_varied_sample(case.sample, case.varied, case.dim, n))[0]
        bases += [leaves[i] for i in case.varied]
    return [x, *bases]


def _loss(outputs: Any, cases: list[OpCase]) -> torch.Tensor:
    """A fixed weighting of every float output (linear, so a large output cannot swamp the rest)."""
    loss = torch.zeros(())
    for case_outputs, case in zip(outputs, cases):
        if not case.backward:
            continue
        for out in case_outputs:
            if out.requires_grad and out.dtype.is_floating_point:
                weights = torch.linspace(-1.0, 1.0, out.numel()).reshape(out.shape)
                loss = loss + (out.nan_to_num(0.0, 0.0, 0.0) * weights).sum() / max(1, out.numel())
    return loss


def _run(model: SweepModel, call: Any, inputs: list[torch.Tensor], reduce: bool) -> tuple[Any, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    outputs = call(*inputs)
    loss = _loss(outputs, model.case_list)
    if loss.requires_grad:
        loss.backward()
    return [[o.detach() for o in case] for case in outputs], summed_gradients(model, reduce=reduce)


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return False
    if not expected.dtype.is_floating_point:
        return torch.equal(got, expected)
    finite = expected[expected.isfinite()]
    scale = max(1.0, finite.abs().max().item()) if finite.numel() else 1.0
    return torch.allclose(got, expected, rtol=1e-4, atol=1e-5 * scale, equal_nan=True)


def _case_of(node_name: str, graph: Any) -> tuple[int | None, bool]:
    """The case whose ``CaseModule`` made ``node_name`` in the analysed graph (by its module stack),
    and whether the node is the harness' ``carry`` rather than the op (by its stack trace)."""
    if graph is None:
        return None, False
    for node in graph.graph.nodes:
        if node.name == node_name:
            in_carry = "in carry" in (node.meta.get("stack_trace") or "")
            for path, _ in reversed(list((node.meta.get("nn_module_stack") or {}).values())):
                parts = path.replace("L['self'].", "").replace("L__self___", "").replace("_", ".").split(".")
                for i, part in enumerate(parts):
                    if part == "cases" and i + 1 < len(parts) and parts[i + 1].isdigit():
                        return int(parts[i + 1]), in_carry
            return None, in_carry
    return None, False


def check_batch(cases: list[OpCase]) -> list[Outcome]:
    """Compile ``cases`` as one graph at SP = the world size and compare each op with eager."""
    import dcp_compile as dcp
    from torch.testing._internal.common_methods_invocations import op_db

    ops = [op_db[case.index] for case in cases]

    def build() -> SweepModel:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return SweepModel(cases, ops)

    torch._dynamo.reset()
    model = build()
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager"})
    problems: dict[int, list[str]] = {i: [] for i in range(len(cases))}
    gathers: dict[int, list[str]] = {i: [] for i in range(len(cases))}
    replicated: list[str] = []
    unattributed: list[str] = []
    for n in LENGTHS:
        eager_model = build()
        expected, expected_grads = _run(eager_model, eager_model, _inputs(cases, n), reduce=False)
        records = dcp.explain(compiled, *_inputs(cases, n))
        got, got_grads = _run(model, compiled, _inputs(cases, n), reduce=True)
        for i, (g, e) in enumerate(zip(got, expected)):
            if len(g) != len(e) or not all(_close(a, b) for a, b in zip(g, e)):
                errors = [(a.double() - b.double()).abs().nan_to_num().max().item() if a.shape == b.shape else float("nan")
                          for a, b in zip(g, e)]
                problems[i].append(f"@{n}: output differs (max abs error {max(errors, default=float('nan')):.3g})")
        for param, grad in expected_grads.items():
            i = int(param.split(".")[1]) if param.startswith("cases.") else None
            if not _close(got_grads.get(param, torch.full_like(grad, float("nan"))), grad):
                error = (got_grads[param] - grad).abs().max().item() if param in got_grads else float("nan")
                target = problems[i] if i is not None else unattributed
                target.append(f"@{n}: grad {param} differs (max abs error {error:.3g})")
        for graph_record in records:
            for variant in graph_record.variants.values():
                if variant.sp_size == 1:
                    continue
                if variant.attention_sites == 0 or not variant.is_sharded:
                    replicated.append(f"{variant.fallback_reason or variant.summary()} (one of {len(records)} graphs "
                                      f"the model ran as)")
                for gather in variant.gathers:
                    i, in_carry = _case_of(gather.op, graph_record.graph)
                    text = f"{'harness ' if in_carry else ''}{gather.op}: {gather.reason or NO_REASON}"
                    (gathers[i] if i is not None else unattributed).append(text)
    outcomes = []
    for i, case in enumerate(cases):
        if problems[i]:
            outcomes.append(Outcome(case.name, case.label(), "WRONG", "; ".join(problems[i][:3])))
        elif replicated:
            outcomes.append(Outcome(case.name, case.label(), "replicated", replicated[0]))
        elif gathers[i]:
            outcomes.append(Outcome(case.name, case.label(), "gathered", gathers[i][0], sorted(set(gathers[i]))))
        else:
            outcomes.append(Outcome(case.name, case.label(), "sharded"))
    if unattributed:
        for outcome in outcomes:
            outcome.detail += f" [batch: {'; '.join(sorted(set(unattributed))[:2])}]"
    return outcomes


def _eager_error(case: OpCase) -> str:
    """Why the harness' model of ``case`` raises in eager (its perturbed values out of the op's domain,
    say), or "" where eager runs: then a raise is dcp's."""
    from torch.testing._internal.common_methods_invocations import op_db

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = SweepModel([case], [op_db[case.index]])
    try:
        for n in LENGTHS:
            _run(model, model, _inputs([case], n), reduce=False)
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return ""


def check_cases(cases: list[OpCase]) -> list[Outcome]:
    """``check_batch``, split in halves where a batch raises; a wrong op is confirmed alone."""
    try:
        outcomes = check_batch(cases)
    except Exception as raised:  # noqa: BLE001
        if len(cases) > 1:
            middle = len(cases) // 2
            return check_cases(cases[:middle]) + check_cases(cases[middle:])
        lines = [line for line in str(raised).splitlines() if line.strip()]
        error = f"{type(raised).__name__}: {' '.join(lines[:2])[:300]}"
        eager_error = _eager_error(cases[0])
        if eager_error:
            return [Outcome(cases[0].name, cases[0].label(), "skipped", f"eager raises with the carried tensors: {eager_error}")]
        return [Outcome(cases[0].name, cases[0].label(), "raises", error)]
    if len(cases) > 1 and any(outcome.kind == "replicated" for outcome in outcomes):
        middle = len(cases) // 2  # one op made the whole graph fall back: which one?
        return check_cases(cases[:middle]) + check_cases(cases[middle:])
    if len(cases) > 1:
        for position, outcome in enumerate(outcomes):
            if outcome.kind == "WRONG":  # alone: is it this op, or another op of the batch?
                outcomes[position] = check_cases([cases[position]])[0]
    return outcomes


def sweep_worker(rank: int, world_size: int, cases: list[OpCase], batch: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    outcomes: list[Outcome] = []
    log_path = os.environ.get("DCP_OPINFO_LOG") if rank == 0 else None
    for start in range(0, len(cases), batch):
        done = check_cases(cases[start:start + batch])
        outcomes += done
        if log_path:  # a long sweep that is stopped still leaves what it checked
            with open(log_path, "a") as log:
                log.writelines(json.dumps(outcome.__dict__) + "\n" for outcome in done)
    return [outcome.__dict__ for outcome in outcomes]
