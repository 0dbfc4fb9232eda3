"""Models with fewer query heads than SP ranks, and the worker that checks them on a gloo world.

The worker compiles each model once, runs it at several lengths, and compares outputs and the
SP-summed parameter gradients with eager on the full batch; it also reads the compile record
(every site sharded, the layout named, no padded heads) and counts the score elements each rank
computed in ``dcp::attention_block`` during one forward (the ring's share of the work).
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from parity import summed_gradients

RTOL = ATOL = 1e-5
HEAD_DIM = 8
BATCH = 2


class FewHeads(nn.Module):
    """Two pre-norm attention + MLP blocks; SDPA with ``heads`` query and ``kv_heads`` KV heads
    (``enable_gqa`` when they differ). ``mask``: "none", "padding" (a bool key-padding mask
    ``[B, 1, 1, S]`` built from the input) or "bias" (a learned per-head relative-position bias
    ``[1, H, S, S]``, whose gradient the ring returns)."""

    def __init__(self, heads: int = 2, kv_heads: int = 2, causal: bool = False, mask: str = "none") -> None:
        super().__init__()
        self.heads, self.kv_heads, self.causal, self.mask = heads, kv_heads, causal, mask
        hidden = heads * HEAD_DIM
        self.hidden = hidden
        self.inp = nn.Linear(8, hidden)
        self.blocks = nn.ModuleList()
        for _ in range(2):
            self.blocks.append(nn.ModuleDict({
                "norm": nn.LayerNorm(hidden),
                "q": nn.Linear(hidden, heads * HEAD_DIM),
                "k": nn.Linear(hidden, kv_heads * HEAD_DIM),
                "v": nn.Linear(hidden, kv_heads * HEAD_DIM),
                "o": nn.Linear(heads * HEAD_DIM, hidden),
                "mlp": nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 2 * hidden), nn.GELU(),
                                     nn.Linear(2 * hidden, hidden)),
            }))
        self.slopes = nn.Parameter(torch.linspace(-0.5, -0.1, heads)) if mask == "bias" else None
        self.out = nn.Linear(hidden, 8)

    def attention_mask(self, x: torch.Tensor) -> torch.Tensor | None:
        length = x.shape[1]
        if self.mask == "padding":  # a key is masked where its first feature is below -1
            return (x[:, :, 0] > -1.0)[:, None, None, :]
        if self.mask == "bias":
            positions = torch.arange(length, device=x.device)
            distance = (positions[None, :] - positions[:, None]).abs().float()
            return self.slopes[None, :, None, None] * distance[None, None]
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        mask = self.attention_mask(x)
        h = self.inp(x)
        for block in self.blocks:
            y = block["norm"](h)
            q = block["q"](y).view(batch, length, self.heads, HEAD_DIM).transpose(1, 2)
            k = block["k"](y).view(batch, length, self.kv_heads, HEAD_DIM).transpose(1, 2)
            v = block["v"](y).view(batch, length, self.kv_heads, HEAD_DIM).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal,
                                               enable_gqa=self.kv_heads != self.heads)
            h = h + block["o"](a.transpose(1, 2).reshape(batch, length, self.heads * HEAD_DIM))
            h = h + block["mlp"](h)
        return self.out(h)


CASES: dict[str, dict[str, Any]] = {
    "bidirectional_2h": {"heads": 2, "kv_heads": 2},
    "causal_2h": {"heads": 2, "kv_heads": 2, "causal": True},
    "gqa_2q1kv_causal": {"heads": 2, "kv_heads": 1, "causal": True},
    "gqa_2q1kv_bidirectional": {"heads": 2, "kv_heads": 1},
    "padding_mask_2h": {"heads": 2, "kv_heads": 2, "mask": "padding"},
    "learned_bias_2h": {"heads": 2, "kv_heads": 2, "mask": "bias"},
}


def build(name: str) -> FewHeads:
    torch.manual_seed(0)
    return FewHeads(**CASES[name])


def make_input(length: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(length)
    return torch.randn(BATCH, length, 8, generator=generator)


def _run(model: nn.Module, call: Any, x: torch.Tensor, reduce: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = call(x)
    out.square().mean().backward()
    return out.detach(), summed_gradients(model, reduce=reduce)


def ring_worker(rank: int, world_size: int, names: list[str], lengths: list[int], inner: str = "eager") -> dict[str, Any]:
    """Per case: parity problems, the layouts the record names, padded head slots, and the score
    elements this rank computed per length (one forward, both blocks)."""
    import dcp_compile as dcp
    from dcp_compile.compiler import ring_attention
    from sharding_checks import sharding_problems

    results: dict[str, Any] = {}
    for name in names:
        problems: list[str] = []
        layouts: set[str] = set()
        padded = 0
        work: dict[int, int] = {}
        torch._dynamo.reset()
        model = build(name)
        compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": inner})
        for length in lengths:
            label = f"{name}@{length}"
            try:
                eager = build(name)
                out_ref, grads_ref = _run(eager, eager, make_input(length), reduce=False)
                records = dcp.explain(compiled, make_input(length))
                before = ring_attention.WORK_COUNTER["score_elements"]  # counted in forward only
                out, grads = _run(model, compiled, make_input(length), reduce=True)
                work[length] = ring_attention.WORK_COUNTER["score_elements"] - before
            except Exception:
                problems.append(f"{label}: raised\n{traceback.format_exc()}")
                continue
            if out.shape != out_ref.shape or not torch.allclose(out, out_ref, rtol=RTOL, atol=ATOL):
                problems.append(f"{label}: output differs (max abs error {(out - out_ref).abs().max().item():.3g})")
            for param, expected in grads_ref.items():
                got = grads.get(param)
                if got is None or not torch.allclose(got, expected, rtol=RTOL, atol=ATOL):
                    error = float("nan") if got is None else (got - expected).abs().max().item()
                    problems.append(f"{label}: grad {param} differs (max abs error {error:.3g})")
            problems += [f"{label}: {p}" for p in sharding_problems(records, gather_budget=0)]
            for variant in records.variant_records():
                if variant.sp_size > 1:
                    layouts |= {layout for _, layout, _ in variant.attention_layouts}
                    padded += sum(slots for _, _, slots in variant.attention_layouts)
                    if len(variant.attention_layouts) != variant.attention_sites:
                        problems.append(f"{label}: {len(variant.attention_layouts)} layouts recorded for "
                                        f"{variant.attention_sites} sites")
            summary = "\n".join(records.summary_lines())
            results.setdefault("summaries", {})[label] = summary
            results.setdefault("sharding", {})[label] = dcp.report.sharding_summary(records)
        results[name] = {"problems": problems, "layouts": sorted(layouts), "padded": padded, "work": work}
    return results


def expected_work(name: str, length: int, sp_size: int, ulysses: int) -> tuple[int, list[int]]:
    """(the whole attention's score elements over both blocks, each rank's under the ring):
    bidirectional, rank ``(g, j)`` computes ``H/u`` heads x its super-chunk's queries x every
    key; causal skips the blocks after its super-chunk."""
    from dcp_compile.compiler.sequence_chunks import chunk_lengths

    case = CASES[name]
    heads, causal = case["heads"], case.get("causal", False)
    ring = sp_size // ulysses
    lengths = chunk_lengths(length, sp_size)
    supers = [sum(lengths[c * ulysses:(c + 1) * ulysses]) for c in range(ring)]
    per_rank = []
    for rank in range(sp_size):
        position = rank // ulysses
        keys = sum(supers[: position + 1]) if causal else length
        per_rank.append(2 * BATCH * (heads // ulysses) * supers[position] * keys)
    return 2 * BATCH * heads * length * length, per_rank
