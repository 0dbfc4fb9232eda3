"""insert_all_to_all_pass at SP 2 on the fake 2-rank world: Ulysses' all-to-alls around each
attention, counted in the transformed graph's text: q, k, v and the output for a self-attention;
q and the output for a cross-attention (its keys and values come from a context every rank holds
whole, so each rank cuts its heads locally)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from pass_helpers import A2A, SDPA, compile_variants, pass_record

from torch.utils.checkpoint import CheckpointPolicy

from dcp_compile.variant import Variant

LENGTH, CONTEXT, HEADS = 12, 5, 4


class Block(nn.Module):
    """Self-attention over ``x``, and cross-attention to ``context`` when one is given."""

    def __init__(self, hidden: int = 16, heads: int = HEADS, cross: bool = False):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.q, self.kv = (nn.Linear(hidden, hidden), nn.Linear(hidden, 2 * hidden)) if cross else (None, None)

    def split(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, hidden] -> [B, heads, S, head_dim]
        return x.view(x.shape[0], x.shape[1], self.heads, -1).transpose(1, 2)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = (self.split(t) for t in self.qkv(x).chunk(3, dim=-1))
        x = x + F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        if context is not None:
            k, v = (self.split(t) for t in self.kv(context).chunk(2, dim=-1))
            x = x + F.scaled_dot_product_attention(self.split(self.q(x)), k, v).transpose(1, 2).flatten(2)
        return x


def lowered(block: nn.Module, *inputs: torch.Tensor):
    torch.manual_seed(0)
    (record,) = compile_variants(block, inputs, [Variant(2)]).values()
    lowering = pass_record(record, "insert_all_to_all_pass")
    return record, lowering.after.count(A2A) - lowering.before.count(A2A)


def test_four_all_to_alls_per_self_attention(fake_world):
    record, inserted = lowered(Block(), torch.randn(2, LENGTH, 16))
    assert inserted == 4
    assert record.sharded_sites == ["scaled_dot_product_attention"] and record.is_sharded
    # Between the all-to-alls each rank holds every position of its half of the heads.
    (sdpa,) = [n for n in record.graph.graph.nodes if n.target is SDPA]
    _, heads, length, _ = sdpa.args[0].meta["val"].shape
    assert heads == HEADS // 2 and length.node.hint == LENGTH


def test_two_all_to_alls_per_cross_attention(fake_world):
    record, inserted = lowered(Block(cross=True), torch.randn(2, LENGTH, 16), torch.randn(2, CONTEXT, 16))
    assert inserted == 4 + 2
    assert len(record.sharded_sites) == 2 and record.is_sharded, record.summary()
    cross = [n for n in record.graph.graph.nodes if n.target is SDPA][1]
    query, key = cross.args[0].meta["val"], cross.args[1].meta["val"]
    assert query.shape[1] == key.shape[1] == HEADS // 2  # the context's heads cut locally
    assert query.shape[2].node.hint == LENGTH and key.shape[2].node.hint == CONTEXT


class TwoBlocks(nn.Module):
    """Two alike self-attention layers, the second checkpointed (its ops tagged for recompute)."""

    def __init__(self):
        super().__init__()
        self.first, self.second = Block(), Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.second, self.first(x), use_reentrant=False)


def test_alike_sites_are_traced_once_and_keep_their_own_meta(fake_world, monkeypatch):
    from dcp_compile.compiler.passes import insert_all_to_all

    traces = []
    retrace = insert_all_to_all.retrace
    monkeypatch.setattr(insert_all_to_all, "retrace", lambda *a, **k: traces.append(1) or retrace(*a, **k))
    record, inserted = lowered(TwoBlocks(), torch.randn(2, LENGTH, 16))
    assert inserted == 8 and len(record.sharded_sites) == 2 and record.is_sharded
    assert len(traces) == 1  # the second layer's lowering is a copy of the first's trace
    first, second = [n for n in record.graph.graph.nodes if n.target is SDPA]
    assert first.meta.get("recompute") is None
    assert second.meta.get("recompute") is CheckpointPolicy.PREFER_RECOMPUTE  # the second site's own tag
    assert first.args[0] is not second.args[0] and first.args[0].meta["val"].shape == second.args[0].meta["val"].shape
