"""Small programs over a sequence-indexed tensor between attention layers, for differential tests.

A program is a tuple of op names (picklable, so a spawned rank can rebuild it); ``ProgramModel``
runs ``attention, op_1, ..., op_n, attention`` on ``[B, S, D]`` activations. Each op keeps the
shape ``[B, S, D]`` so that any sequence composes. ``TOKEN_LOCAL`` ops keep positions apart;
``MIXING`` ops read across positions, each in a different spelling (slice assignment into a
buffer, ``index_put_``, scatter, roll, convolutions over positions, sorts, reductions): the
compiler must shard the first and gather (or exactly rewrite) the second, never be wrong.

:func:`program_worker` compiles every program once on a gloo world and checks each length against
eager in the same process: outputs, SP-group-summed gradients, and the sharding record.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from parity import summed_gradients

D, HEADS = 16, 2
Op = Callable[["ProgramModel", torch.Tensor], torch.Tensor]


def _positions(h: torch.Tensor) -> torch.Tensor:
    return torch.arange(h.shape[1], device=h.device)


def _shift_by_slice_assignment(m: "ProgramModel", h: torch.Tensor) -> torch.Tensor:
    # A multi-token-prediction head's look-ahead: a shifted copy written into a fresh buffer.
    n = h.shape[1]
    out = torch.full_like(h, 0.5)
    out[:, : n - 1] = h[:, 1:]
    return out


def _shift_right_by_slice_assignment(m: "ProgramModel", h: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(h)
    out[:, 1:] = h[:, :-1]
    return out


def _copy_into_view(m: "ProgramModel", h: torch.Tensor) -> torch.Tensor:
    out = h.clone()
    out.narrow(1, 0, 1).copy_(h[:, -1:])
    return out


def _index_put_along_sequence(m: "ProgramModel", h: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(h)
    out.index_put_((torch.arange(h.shape[0])[:, None], _positions(h).flip(0)[None, :]), h)
    return out


def _index_put_accumulate(m: "ProgramModel", h: torch.Tensor) -> torch.Tensor:
    index = _positions(h) // 2
    out = torch.zeros_like(h)
    return out.index_put((torch.arange(h.shape[0])[:, None], index[None, :]), h, accumulate=True)


def _scatter_along_sequence(m: "ProgramModel", h: torch.Tensor) -> torch.Tensor:
    index = _positions(h).flip(0)[None, :, None].expand_as(h)
    return torch.zeros_like(h).scatter(1, index, h)


def _gather_along_sequence(m: "ProgramModel", h: torch.Tensor) -> torch.Tensor:
    index = (_positions(h) // 2)[None, :, None].expand_as(h)
    return torch.gather(h, 1, index)


def _index_select_along_sequence(m: "ProgramModel", h: torch.Tensor) -> torch.Tensor:
    return h.index_select(1, _positions(h).flip(0))


def _narrow_cat(m: "ProgramModel", h: torch.Tensor) -> torch.Tensor:
    return torch.cat([h.narrow(1, 1, h.shape[1] - 1), h.narrow(1, 0, 1)], dim=1)


def _pad_shift(m: "ProgramModel", h: torch.Tensor) -> torch.Tensor:
    return F.pad(h[:, :-1], (0, 0, 1, 0))


def _conv_over_positions(m: "ProgramModel", h: torch.Tensor) -> torch.Tensor:
    return m.conv(h.transpose(1, 2)).transpose(1, 2)


def _strided_conv_over_positions(m: "ProgramModel", h: torch.Tensor) -> torch.Tensor:
    # An audio encoder's downsampling (stride 2), brought back to S positions for the next layer.
    n = h.shape[1]
    down = m.strided_conv(h.transpose(1, 2)).transpose(1, 2)
    return down.repeat_interleave(2, dim=1)[:, :n]


def _sort_over_positions(m: "ProgramModel", h: torch.Tensor) -> torch.Tensor:
    order = h[..., :1].argsort(dim=1)
    return torch.gather(h, 1, order.expand_as(h))


def _topk_over_positions(m: "ProgramModel", h: torch.Tensor) -> torch.Tensor:
    values, _ = h.topk(1, dim=1)
    return h - values


def _unfold_over_positions(m: "ProgramModel", h: torch.Tensor) -> torch.Tensor:
    windows = F.pad(h, (0, 0, 0, 1)).unfold(1, 2, 1)  # [B, S, D, 2]
    return windows.mean(-1)


def _positional_mask(m: "ProgramModel", h: torch.Tensor) -> torch.Tensor:
    n = h.shape[1]
    keep = _positions(h) < (n // 2)
    return h * keep[None, :, None]


def _fold_into_batch(m: "ProgramModel", h: torch.Tensor) -> torch.Tensor:
    b, n, d = h.shape
    pairs = F.pad(h, (0, 0, 0, n % 2)).reshape(b * ((n + 1) // 2), 2, d)  # folds neighbouring positions
    mixed = pairs.flip(1).reshape(b, -1, d)
    return mixed[:, :n]


def _index_add_along_sequence(m: "ProgramModel", h: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(h).index_add(1, _positions(h) // 2, h)


def _diff_over_positions(m: "ProgramModel", h: torch.Tensor) -> torch.Tensor:
    return F.pad(torch.diff(h, dim=1), (0, 0, 1, 0))


def _pool_over_positions(m: "ProgramModel", h: torch.Tensor) -> torch.Tensor:
    return F.avg_pool1d(h.transpose(1, 2), 3, stride=1, padding=1, count_include_pad=False).transpose(1, 2)


def _resample_positions(m: "ProgramModel", h: torch.Tensor) -> torch.Tensor:
    n = h.shape[1]
    # size, not scale_factor=0.5: half of one position is no position, and eager itself raises there
    down = F.interpolate(h.transpose(1, 2), size=max(1, n // 2), mode="linear")
    return F.interpolate(down, size=n, mode="nearest").transpose(1, 2)


def _write_through_alias(m: "ProgramModel", h: torch.Tensor) -> torch.Tensor:
    # A view taken before the buffer is written through another view: it sees the write.
    b, n, d = h.shape
    out = h * 1.0
    alias = out.view(b, n, d)
    out[:, 1:] = h[:, :-1]
    return alias


def _positional_mask_assign(m: "ProgramModel", h: torch.Tensor) -> torch.Tensor:
    out = h.clone()
    out[:, _positions(h) % 2 == 0] = 0.0
    return out


MIXING: dict[str, Op] = {
    "shift_slice_assign": _shift_by_slice_assignment,
    "shift_right_slice_assign": _shift_right_by_slice_assignment,
    "copy_into_view": _copy_into_view,
    "index_put_": _index_put_along_sequence,
    "index_put_accumulate": _index_put_accumulate,
    "scatter": _scatter_along_sequence,
    "gather": _gather_along_sequence,
    "index_select": _index_select_along_sequence,
    "roll": lambda m, h: torch.roll(h, 1, dims=1),
    "flip": lambda m, h: h.flip(1),
    "narrow_cat": _narrow_cat,
    "pad_shift": _pad_shift,
    "cumsum": lambda m, h: h.cumsum(1) / h.shape[1],
    "cumprod": lambda m, h: torch.tanh(h).cumprod(1),
    "conv1d": _conv_over_positions,
    "strided_conv1d": _strided_conv_over_positions,
    "sort": _sort_over_positions,
    "topk": _topk_over_positions,
    "unfold": _unfold_over_positions,
    "positional_mask": _positional_mask,
    "mean_over_sequence": lambda m, h: h - h.mean(1, keepdim=True),
    "max_over_sequence": lambda m, h: h - h.amax(1, keepdim=True),
    "fold_into_batch": _fold_into_batch,
    "index_add": _index_add_along_sequence,
    "diff": _diff_over_positions,
    "avg_pool": _pool_over_positions,
    "resample": _resample_positions,
    "sum_over_sequence": lambda m, h: h + h.sum(1, keepdim=True) / h.shape[1],
    "write_through_alias": _write_through_alias,
    "positional_mask_assign": _positional_mask_assign,
}


def _feature_slice_assign(m: "ProgramModel", h: torch.Tensor) -> torch.Tensor:
    out = h.clone()
    out[..., :4] = 0.0
    return out


def _inplace_scale(m: "ProgramModel", h: torch.Tensor) -> torch.Tensor:
    out = h.clone()
    out.mul_(0.5).add_(0.25)
    return out


def _flatten_tokens(m: "ProgramModel", h: torch.Tensor) -> torch.Tensor:
    b, n, d = h.shape
    return m.linear(h.reshape(b * n, d)).reshape(b, n, d)


def _copy_whole(m: "ProgramModel", h: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(h)
    out.copy_(h * 0.5)  # every op keeps magnitudes bounded: a chain must not blow up the logits
    return out


def _fresh_buffer_feature_writes(m: "ProgramModel", h: torch.Tensor) -> torch.Tensor:
    # A buffer created with the sequence's size, written per feature on chunks, then read whole.
    b, n, d = h.shape
    out = torch.zeros(b, n, d, dtype=h.dtype)
    out[..., : d // 2] = h[..., : d // 2]
    out[..., d // 2:] = -h[..., d // 2:]
    return out


TOKEN_LOCAL: dict[str, Op] = {
    "copy_whole": _copy_whole,
    "fresh_buffer_feature_writes": _fresh_buffer_feature_writes,
    "gelu": lambda m, h: F.gelu(h),
    "linear": lambda m, h: m.linear(h),
    "layer_norm": lambda m, h: m.norm(h),
    "vector_norm": lambda m, h: h / torch.linalg.vector_norm(h, dim=-1, keepdim=True).clamp_min(1e-6),
    "feature_slice_assign": _feature_slice_assign,
    "inplace_scale": _inplace_scale,
    "flatten_tokens": _flatten_tokens,
    "feature_cumsum": lambda m, h: h.cumsum(-1) / D,
}

OPS: dict[str, Op] = {**TOKEN_LOCAL, **MIXING}


class ProgramModel(nn.Module):
    """``attention, *ops, attention`` over ``[B, S, D]``; the loss is the mean square output."""

    def __init__(self, program: tuple[str, ...], causal: bool = True) -> None:
        super().__init__()
        self.program, self.causal = tuple(program), causal
        self.qkv = nn.ModuleList(nn.Linear(D, 3 * D) for _ in range(2))
        self.out = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.linear, self.norm = nn.Linear(D, D), nn.LayerNorm(D)
        self.conv = nn.Conv1d(D, D, 3, padding=1)
        self.strided_conv = nn.Conv1d(D, D, 3, stride=2, padding=1)

    def attention(self, index: int, h: torch.Tensor) -> torch.Tensor:
        b, n, _ = h.shape
        q, k, v = self.qkv[index](h).view(b, n, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return h + self.out[index](a.transpose(1, 2).reshape(b, n, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention(0, x)
        for name in self.program:
            h = OPS[name](self, h)
        return self.attention(1, h)


def build(program: tuple[str, ...]) -> ProgramModel:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return ProgramModel(program)


def inputs(length: int, batch: int = 2) -> torch.Tensor:
    generator = torch.Generator().manual_seed(length)
    return torch.randn(batch, length, D, generator=generator)


def run(model: nn.Module, call: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
        group: Any = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = call(x)
    out.square().mean().backward()
    return out.detach(), summed_gradients(model, reduce=group is not None)


def check_program(program: tuple[str, ...], lengths: list[int], rtol: float = 1e-5,
                  atol: float = 1e-5, shard_required: bool = True,
                  scaled_atol: bool = False) -> tuple[list[str], dict[str, Any]]:
    """Parity problems of one program at ``lengths`` and what its SP>1 variants did."""
    return check_model("+".join(program) or "identity", lambda: build(program), inputs, lengths, rtol, atol,
                       shard_required=shard_required, scaled_atol=scaled_atol)


def shrink(program: tuple[str, ...], length: int) -> tuple[str, ...]:
    """The shortest sub-program (ops dropped greedily) still wrong at ``length``: the regression test.
    Every rank shrinks alike: outputs are full and gradients summed on each rank."""
    current = program
    changed = True
    while changed and len(current) > 1:
        changed = False
        for index in range(len(current)):
            candidate = current[:index] + current[index + 1:]
            problems, _ = check_program(candidate, [length], FUZZ_RTOL, FUZZ_ATOL, shard_required=False,
                                       scaled_atol=True)
            if problems:
                current, changed = candidate, True
                break
    return current


# The fuzzer's tolerance: fp32 partial gradients of P ranks summed in another order differ from
# eager by ~1e-7 of the terms summed, and a program's products (x8 through three doublings) make
# those terms large, so atol scales with each tensor's largest magnitude (``scaled_atol``). A
# sharding error is of the values' own size (a loss error of 4e-2, gradients 40x off in issue 24).
FUZZ_RTOL, FUZZ_ATOL = 1e-5, 1e-5


def fuzz_worker(rank: int, world_size: int, cases: list[tuple[tuple[str, ...], tuple[int, ...]]]) -> dict[str, Any]:
    """Check each (program, lengths) case for parity; shrink the failing ones. Sharding is
    recorded, not required (a program the compiler cannot shard must gather, never be wrong)."""
    torch.manual_seed(0)
    failures, gathers, not_sharded, checked = [], 0, 0, 0
    log_path = os.environ.get("DCP_FUZZ_LOG") if rank == 0 else None
    for program, lengths in cases:
        began = time.process_time()  # this rank's CPU time for the program (a shared machine's load does not move it)
        problems, seen = check_program(tuple(program), list(lengths), FUZZ_RTOL, FUZZ_ATOL, shard_required=False,
                                       scaled_atol=True)
        checked += len(lengths)
        gathers += len(seen["gathers"])
        not_sharded += len(seen["not_sharded"])
        failure = None
        if problems:
            length = next((n for n in lengths if any(f"@{n}:" in p for p in problems)), lengths[0])
            failure = {"program": tuple(program), "length": length, "problems": problems[:3],
                       "shrunk": shrink(tuple(program), length)}
            failures.append(failure)
        if log_path:  # one line per program as it finishes: a long run that is stopped still counts
            with open(log_path, "a") as log:
                log.write(json.dumps({"world_size": world_size, "program": list(program), "lengths": list(lengths),
                                      "gathers": len(seen["gathers"]), "not_sharded": len(seen["not_sharded"]),
                                      "failure": failure, "cpu_s": round(time.process_time() - began, 3)}) + "\n")
    return {"failures": failures, "checked": checked, "gathers": gathers, "not_sharded": not_sharded}


def check_model(name: str, factory: Callable[[], nn.Module], make_input: Callable[[int], torch.Tensor],
                lengths: list[int], rtol: float = 1e-5, atol: float = 1e-5,
                gather_budget: int = 8, shard_required: bool = True,
                scaled_atol: bool = False) -> tuple[list[str], dict[str, Any]]:
    """Parity problems of ``factory()`` compiled once and run at ``lengths`` (the loss is the mean
    square output), and what its SP>1 variants did: sites sharded, gathers with their reasons.
    With ``shard_required`` False, a variant that is not fully sharded is recorded under
    ``not_sharded`` instead of being a problem (the fuzzer asks for parity first). With
    ``scaled_atol``, ``atol`` is relative to each tensor's largest magnitude (fp32 sums of large
    terms reordered over ranks cancel to small entries with an absolute error of ~1e-7 x the terms)."""
    def close(got: torch.Tensor, expected: torch.Tensor) -> bool:
        scale = max(1.0, expected.abs().max().item()) if scaled_atol and expected.numel() else 1.0
        return torch.allclose(got, expected, rtol=rtol, atol=atol * scale)

    import dcp_compile as dcp
    from sharding_checks import sharding_problems

    problems: list[str] = []
    seen: dict[str, Any] = {"sharded_sites": 0, "unsharded": [], "gathers": [], "attention_sites": 0,
                            "not_sharded": []}
    torch._dynamo.reset()
    model = factory()
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager"})
    for length in lengths:
        label = f"{name}@{length}"
        try:
            eager_model = factory()
            reference = run(eager_model, eager_model, make_input(length))
            with dcp.report.recording() as records:  # the records of this call, no extra forward, no graph snapshots
                actual = run(model, compiled, make_input(length), group=True)
            if not records.graphs:  # as dcp.explain would refuse: the check must have run dcp's code
                raise RuntimeError("the call ran no graph compiled by the dcp backend")
        except Exception:
            problems.append(f"{label}: raised\n{traceback.format_exc()}")
            continue
        (out_ref, grads_ref), (out, grads) = reference, actual
        if out.shape != out_ref.shape or not close(out, out_ref):
            error = (out - out_ref).abs().max().item() if out.shape == out_ref.shape else float("nan")
            problems.append(f"{label}: SILENTLY WRONG output (max abs error {error:.3g})")
        for param, expected in grads_ref.items():
            got = grads.get(param)
            if got is None or not close(got, expected):
                error = float("nan") if got is None else (got - expected).abs().max().item()
                problems.append(f"{label}: SILENTLY WRONG grad {param} (max abs error {error:.3g})")
        unsharded = [f"{label}: {p}" for p in sharding_problems(records, gather_budget=gather_budget)]
        if shard_required:
            problems += unsharded
        else:
            seen["not_sharded"] += unsharded
        for variant in records.variant_records():
            if variant.sp_size == 1:
                continue
            seen["attention_sites"] += variant.attention_sites
            seen["sharded_sites"] += len(variant.sharded_sites)
            seen["unsharded"] += list(variant.unsharded_sites)
            seen["gathers"] += [getattr(g, "reason", str(g)) for g in variant.gathers]
            for gather in variant.gathers:
                if not getattr(gather, "reason", ""):
                    problems.append(f"{label}: a gather without a reason: {gather}")
    return problems, seen


def program_worker(rank: int, world_size: int, programs: list[tuple[str, ...]], lengths: list[int]) -> dict[str, Any]:
    """Check every program at every length on this rank; all problems and records come back."""
    torch.manual_seed(0)
    results = {}
    for program in programs:
        problems, seen = check_program(tuple(program), lengths)
        results["+".join(program)] = {"problems": problems, **seen}
    return results


class MultiTokenPrediction(nn.Module):
    """A multi-token-prediction head as model libraries write it: the labels ``k`` tokens ahead are
    a shifted copy of the ids written into a ``full_like`` buffer of ignore indices."""

    def __init__(self, vocab: int = 32, ahead: int = 2) -> None:
        super().__init__()
        self.vocab, self.ahead = vocab, ahead
        self.embed = nn.Embedding(vocab, D)
        self.body = ProgramModel(())
        self.heads = nn.ModuleList(nn.Linear(D, vocab) for _ in range(ahead))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.body(self.embed(ids))
        n, loss = ids.shape[1], h.new_zeros(())
        for k, head in enumerate(self.heads, start=1):
            labels = torch.full_like(ids, -100)
            labels[:, : n - k] = ids[:, k:]
            loss = loss + F.cross_entropy(head(h).flatten(0, 1), labels.flatten(), ignore_index=-100)
        return loss


def build_multi_token_prediction() -> MultiTokenPrediction:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return MultiTokenPrediction()


def token_ids(length: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 32, (batch, length), generator=torch.Generator().manual_seed(length))


def multi_token_prediction_worker(rank: int, world_size: int, lengths: list[int]) -> dict[str, Any]:
    problems, seen = check_model("multi_token_prediction", build_multi_token_prediction, token_ids, lengths)
    return {"problems": problems, **seen}
