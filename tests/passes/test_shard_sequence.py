"""shard_sequence_pass at SP 2 on the fake 2-rank world: the rank's chunk is cut from the graph
inputs, a cumsum over the sequence gets exactly one gather (with its reason), and a cross-entropy
over flattened ``[B*S, V]`` tokens with a symbolic batch runs shard-local, without a whole-graph
fallback."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from pass_helpers import compile_variants

from dcp_compile.variant import Variant

aten = torch.ops.aten
LENGTH = 12


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 32, hidden: int = 16, heads: int = 2, cumsum: bool = True):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.head = nn.Linear(hidden, vocab)
        self.heads, self.cumsum = heads, cumsum

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        batch, length = ids.shape
        x = self.embed(ids)
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, length, -1)
        if self.cumsum:
            x = x.cumsum(1)
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))


class RotaryWholeHead(TinyLM):
    """Rotary split ``cat((rotate(x[..., :rot]), x[..., rot:]), -1)`` with ``rot`` the whole head
    (ERNIE-Image): the pass-through part is empty along the cat dimension yet indexed by the
    sequence, so it must be chunked with the rotated part."""

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        batch, length = ids.shape
        x = self.embed(ids)
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        rot = q.shape[-1]
        q = torch.cat((q[..., :rot] * 2.0, q[..., rot:]), dim=-1)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, length, -1)
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))


def sharded(model: nn.Module):
    torch.manual_seed(0)
    inputs = (torch.randint(0, 32, (2, LENGTH)), torch.randint(0, 32, (2, LENGTH)))
    (record,) = compile_variants(model, inputs, [Variant(2)]).values()
    return record


def calls(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [node for node in gm.graph.nodes if node.op == "call_function" and node.target == target]


@pytest.fixture(scope="module")
def records():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # Two compiles for the module, in a fake world of its own (what tests/conftest.py's
    # function-scoped fake_world does per test); the records are plain data once compiled.
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    torch._dynamo.reset()
    try:
        return {"plain": sharded(TinyLM(cumsum=False)), "cumsum": sharded(TinyLM(cumsum=True)),
                "rotary_whole_head": sharded(RotaryWholeHead(cumsum=False))}
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def chunk(size: torch.SymInt | int) -> int:
    """Rank 0's share of ``size`` positions: the first ceil(size/2)."""
    return (int(size.node.hint if isinstance(size, torch.SymInt) else size) + 1) // 2


def test_graph_inputs_are_narrowed_to_the_rank_chunk(records):
    gm = records["plain"].graph
    tokens = [p for p in gm.graph.find_nodes(op="placeholder")
              if isinstance(p.meta.get("val"), torch.Tensor) and p.meta["val"].dtype == torch.int64]
    assert len(tokens) == 2  # ids, labels
    for placeholder in tokens:
        (narrow,) = [user for user in placeholder.users if user.target is aten.narrow.default]
        _, dim, start, _ = narrow.args
        assert dim == 1 and start == 0  # rank 0's chunk: the first ceil(S/2) positions
        assert narrow.meta["val"].shape[1].node.hint == chunk(placeholder.meta["val"].shape[1]) == LENGTH // 2
        assert all(user is narrow for user in placeholder.users)  # nothing reads the full input


def test_flattened_cross_entropy_is_rewritten_shard_local(records):
    record = records["plain"]
    assert record.fallback_reason is None
    assert record.is_sharded, record.summary()
    assert record.gathers == []
    assert [r for r in record.rewrites if r.startswith("cross_entropy_loss: shard-local")], record.rewrites
    (loss,) = calls(record.graph, aten.cross_entropy_loss.default)
    logits = loss.args[0].meta["val"]
    assert isinstance(logits.shape[0], torch.SymInt)  # [B*S/2, V], the batch symbolic
    assert logits.shape[0].node.hint == 2 * (LENGTH // 2)
    # Partial loss sums and token counts are summed over the group: one all-reduce.
    assert record.collectives.get("all_reduce") == 1


def test_cumsum_over_the_sequence_gets_one_gather_with_its_reason(records):
    record = records["cumsum"]
    assert record.fallback_reason is None
    assert [(g.op, g.reason) for g in record.gathers] == [("cumsum", "cumsum along the sequence dimension")]
    (cumsum,) = calls(record.graph, aten.cumsum.default)
    assert cumsum.meta["val"].shape[1].node.hint == LENGTH  # it runs on the gathered sequence
    assert record.local_fallbacks == []


def test_the_ops_after_a_gathered_cumsum_run_on_the_chunk(records):
    record = records["cumsum"]
    (cumsum,) = calls(record.graph, aten.cumsum.default)
    # The head reads the rank's chunk of the gathered cumsum (a view of it), not the full value.
    downstream, frontier = set(), [cumsum]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user not in downstream:
                downstream.add(user)
                frontier.append(user)
    heads = [n for n in downstream if n.target is aten.linear.default]
    assert heads and all(head.meta["val"].shape[1].node.hint == LENGTH // 2 for head in heads)


def test_an_empty_rotary_pass_through_is_chunked_with_the_rest(records):
    record = records["rotary_whole_head"]
    assert record.fallback_reason is None
    assert record.is_sharded, record.summary()
    assert record.gathers == []
    empty_cats = [c for c in calls(record.graph, aten.cat.default)
                  if any(0 in t.meta["val"].shape for t in c.args[0] if isinstance(t, fx.Node))]
    assert empty_cats
    for cat in empty_cats:  # every operand runs on the chunk: LENGTH // 2 positions at dim 2
        assert {t.meta["val"].shape[2].node.hint for t in cat.args[0]} == {LENGTH // 2}
