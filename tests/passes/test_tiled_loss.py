"""``tile_loss``: a language model's output projection and cross-entropy become
``dcp::tiled_cross_entropy``, and nothing ``[tokens, vocab]``-sized is left in the compiled graphs.

Graph structure on one process (SP 2 on the fake process group): the op is there, the loss stays
a shard-local sum plus one all-reduce under sequence parallelism, no node of the variant's graph
and no tensor of the compiled forward or backward graph has both the vocabulary and a token count
(a symbolic size) among its dimensions, and backward keeps at least a whole ``[tokens, vocab]``
fp32 tensor less than under ``none``. Default deny: a loss that is not exactly the pattern is left
as it is, with the reason on the record (and still equals eager). Parity on gloo ranks:
``tests/test_tiled_loss_parity.py``.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dcp_compile as dcp
from dcp_compile.compiler.passes.tiled_loss import TILED_CROSS_ENTROPY, find_losses
from dcp_compile.demo.example_models import TinyGPT
from dcp_compile.tiled_loss import tiles_loss
from dcp_compile.variant import RECOMPUTE_POLICIES, Variant
from pass_helpers import analyse

VOCAB, HIDDEN, LENGTH, CHUNK = 512, 32, 96, 40  # 96 tokens: chunks of 40, 40 and 16 (48: 40 and 8 at SP 2)
SHAPE = re.compile(r'"[a-z]+\d*\[([^\]]*)\]"')


def vocab_by_tokens(graph_text: str) -> list[str]:
    """Tensor types in a readable graph whose sizes hold the vocabulary and a symbolic size (a
    token count): what a tiled loss must not build outside its op."""
    found = []
    for sizes in SHAPE.findall(graph_text):
        dims = [d.strip() for d in sizes.split(",")]
        if str(VOCAB) in dims and any(re.search(r"\bs\d+", d) for d in dims):
            found.append(sizes)
    return found


def vocab_by_tokens_nodes(gm: torch.fx.GraphModule) -> list[str]:
    """Nodes of the variant's graph whose value is ``[..., tokens, ..., vocab]``-shaped."""
    found = []
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and VOCAB in [s for s in value.shape if isinstance(s, int)] \
                and any(isinstance(s, torch.SymInt) for s in value.shape):
            found.append(f"{node.name}: {tuple(value.shape)}")
    return found


@pytest.fixture(scope="module")
def tinygpt_records():
    """TinyGPT's variants at SP 1 and 2 (fake world) under none and the policies that tile."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        model = TinyGPT(vocab=VOCAB, hidden=HIDDEN, layers=2, heads=4)
        # compiled whole: the tests read the partitioned forward and backward graphs
        compiled = torch.compile(model, backend="dcp", dynamic=True, options={
            "inner": "aot_eager", "regions": False, "loss_chunk": CHUNK, "buckets": [{"max_len": None, "sp_size": 2}]})
        ids = torch.randint(0, VOCAB, (1, LENGTH), generator=torch.Generator().manual_seed(0))
        records = {}
        for variant in [Variant(1, "none"), Variant(1, "attention"), Variant(2, "none"), Variant(2, "selective"),
                        Variant(2, "block")]:
            with dcp.use(variant):
                compiled(ids, ids).backward()  # the backward graph is compiled on the first backward
                record = dcp.explain(compiled, ids, ids)
            records[variant] = record[0].variants[variant]
        yield records
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def test_every_policy_but_none_tiles() -> None:
    assert [tiles_loss(p) for p in RECOMPUTE_POLICIES] == [False] + [True] * (len(RECOMPUTE_POLICIES) - 1)
    assert tiles_loss("none1of4+block")  # a per-layer mix's head is checkpointed: it tiles


@pytest.mark.parametrize("variant", [Variant(1, "attention"), Variant(2, "selective"), Variant(2, "block")], ids=str)
def test_the_head_is_one_op_and_nothing_vocab_sized_is_left(tinygpt_records, variant: Variant) -> None:
    record = tinygpt_records[variant]
    assert len(record.tiled_losses) == 1 and f"{CHUNK}-token chunks" in record.tiled_losses[0], record.tiled_losses
    assert record.untiled_losses == []
    targets = [n.target for n in record.graph.graph.nodes if n.op == "call_function"]
    assert targets.count(TILED_CROSS_ENTROPY) == 1
    assert torch.ops.aten.cross_entropy_loss.default not in targets
    assert "dcp.tiled_cross_entropy.default(" in record.forward_graph
    assert "dcp.tiled_cross_entropy_backward.default(" in record.backward_graph
    assert vocab_by_tokens_nodes(record.graph) == []
    assert vocab_by_tokens(record.forward_graph) == [], vocab_by_tokens(record.forward_graph)
    assert vocab_by_tokens(record.backward_graph) == [], vocab_by_tokens(record.backward_graph)


def test_under_sequence_parallelism_the_loss_stays_a_local_sum_plus_one_all_reduce(tinygpt_records) -> None:
    """The op replaces the shard-local summed cross-entropy only: its sum goes, with the count of
    counted tokens, into the one all-reduce the shard_sequence rewrite issues."""
    record = tinygpt_records[Variant(2, "selective")]
    assert record.collectives.get("all_reduce") == 1, record.collectives
    assert any("shard-local cross_entropy_loss" in rewrite for rewrite in record.rewrites), record.rewrites
    (op,) = [n for n in record.graph.graph.nodes if n.target is TILED_CROSS_ENTROPY]
    assert op.args[4] is None  # TinyGPT returns only its loss: nothing hands the op logits
    (stack,) = op.users
    assert stack.target is torch.ops.aten.stack.default
    reduced = [n for n in record.graph.graph.nodes if "all_reduce" in str(n.target)]
    assert reduced and reduced[0].args[0].args[0] is stack  # all_reduce(detach(stack([sum, count])))
    hidden = op.args[0].meta["val"]
    assert "//2" in str(hidden.shape[0])  # this rank's half of the tokens


@pytest.mark.parametrize("sp", [1, 2])
def test_none_keeps_the_logits_and_says_so(tinygpt_records, sp: int) -> None:
    record = tinygpt_records[Variant(sp, "none")]
    assert record.tiled_losses == []
    assert [why for _, why in record.untiled_losses] == [
        "recompute=none keeps the logits (the fastest policy; every other policy tiles the loss)"]
    assert vocab_by_tokens(record.forward_graph)  # the detector sees the whole sequence's logits here
    assert "loss cross_entropy_loss not tiled: recompute=none" in str_record(record)


def str_record(record) -> str:
    from dcp_compile.compiler.record import GraphRecord

    graph = GraphRecord(0)
    graph.variants[record.variant] = record
    return str(graph)


def test_backward_keeps_no_log_probabilities(tinygpt_records) -> None:
    """Under ``none`` backward keeps the fp32 log-probabilities, ``[tokens, vocab]``; tiled, it keeps
    the hidden states and targets instead: the saved bytes drop by at least that much at SP 1 less
    what ``attention`` itself gives up (q, k, v, the attention output)."""
    none, tiled = tinygpt_records[Variant(1, "none")], tinygpt_records[Variant(1, "attention")]
    log_probabilities = LENGTH * VOCAB * 4
    assert none.saved_activation_bytes - tiled.saved_activation_bytes >= log_probabilities


# --- default deny --------------------------------------------------------------------------------

class SmallLM(nn.Module):
    """Embedding, one causal attention, a head, and one of several losses (``kind``)."""

    def __init__(self, kind: str, vocab: int = 64, hidden: int = 16) -> None:
        super().__init__()
        self.kind = kind
        self.embed = nn.Embedding(vocab, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.head = nn.Linear(hidden, vocab, bias=kind == "bias")
        self.register_buffer("class_weight", torch.linspace(0.5, 1.5, vocab))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(-2)
        logits = self.head(x)
        flat, targets = logits.float().view(-1, logits.shape[-1]), labels.reshape(-1)
        if self.kind in ("plain", "bias"):
            return F.cross_entropy(flat, targets, ignore_index=-100)
        if self.kind == "sum":
            return F.cross_entropy(flat, targets, reduction="sum", ignore_index=0)
        if self.kind == "nll":
            return F.nll_loss(F.log_softmax(flat, dim=-1), targets)
        if self.kind == "smoothing":
            return F.cross_entropy(flat, targets, label_smoothing=0.1)
        if self.kind == "weights":
            return F.cross_entropy(flat, targets, weight=self.class_weight)
        if self.kind == "per_token":
            return F.cross_entropy(flat, targets, reduction="none").sum()
        if self.kind == "softcap":  # Gemma-2's logit soft-capping: not a plain projection
            return F.cross_entropy(torch.tanh(flat / 30) * 30, targets)
        if self.kind == "class_dim_1":
            return F.cross_entropy(logits.transpose(1, 2), labels)
        raise ValueError(self.kind)


DENIED = {
    "smoothing": "label smoothing",
    "weights": "class weights",
    "per_token": "per-token losses (reduction='none'): nothing is summed over the tokens",
    "softcap": "the logits are not a linear output projection of the hidden states",
    "class_dim_1": "logits of 3 dimensions (the class dimension must be the last of 2)",
}


def lm_inputs(length: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(1))
    return ids, ids.roll(-1, 1)


@pytest.mark.parametrize("kind", ["plain", "bias", "sum", "nll"])
def test_the_pattern_is_found_in_its_spellings(kind: str) -> None:
    gm, _ = analyse(SmallLM(kind), *lm_inputs())
    matches, refused = find_losses(gm)
    assert refused == [] and len(matches) == 1
    (match,) = matches
    assert match.projection.target is torch.ops.aten.linear.default
    assert (match.bias is not None) == (kind == "bias")
    assert match.reduction == (2 if kind == "sum" else 1) and match.ignore_index == (0 if kind == "sum" else -100)
    assert match.upcast and not match.logits_read_elsewhere


@pytest.mark.parametrize("kind", sorted(DENIED))
def test_a_loss_that_does_not_match_exactly_is_refused_with_its_reason(kind: str) -> None:
    gm, _ = analyse(SmallLM(kind), *lm_inputs())
    matches, refused = find_losses(gm)
    assert matches == [] and len(refused) == 1
    assert refused[0][1].startswith(DENIED[kind]), refused


def test_a_logits_input_after_a_graph_break_is_refused() -> None:
    """The loss in a graph of its own (a graph break between the head and the loss: Hugging Face
    GPT-2 in the zoo) receives the logits as an input: no projection to tile."""
    def loss_only(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))

    gm, _ = analyse(loss_only, torch.randn(2, 10, 64), lm_inputs()[1])
    matches, refused = find_losses(gm)
    assert matches == [] and refused[0][1].startswith("the logits are an input of this graph"), refused


@pytest.mark.parametrize("kind", ["smoothing", "softcap"])
def test_a_refused_loss_is_left_alone_and_still_equals_eager(kind: str) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = SmallLM(kind)
    ids, labels = lm_inputs(11)
    expected = model(ids, labels)
    expected_grads = torch.autograd.grad(expected, list(model.parameters()))
    compiled = torch.compile(model, backend="dcp", dynamic=True,
                             options={"inner": "aot_eager", "sp_size": 1, "recompute": "selective", "loss_chunk": 4})
    loss = compiled(ids, labels)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    (record,) = dcp.explain(compiled, ids, labels).variant_records()
    assert record.tiled_losses == [] and [why for _, why in record.untiled_losses][0].startswith(DENIED[kind])
    assert "dcp.tiled_cross_entropy" not in record.forward_graph
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


def test_disable_passes_turns_it_off() -> None:
    torch._dynamo.reset()
    compiled = torch.compile(SmallLM("plain"), backend="dcp", dynamic=True, options={
        "inner": "eager", "sp_size": 1, "recompute": "full", "disable_passes": ["tile_loss"]})
    ids, labels = lm_inputs()
    compiled(ids, labels)
    (record,) = dcp.explain(compiled, ids, labels).variant_records()
    assert record.tiled_losses == [] and "tile_loss_pass" not in [p.name for p in record.passes]
    torch._dynamo.reset()


def test_loss_chunk_must_be_a_positive_token_count() -> None:
    from dcp_compile.compiler.options import parse_options

    assert parse_options({"loss_chunk": 128}).loss_chunk == 128
    with pytest.raises(ValueError, match="loss_chunk=0"):
        parse_options({"loss_chunk": 0})


@pytest.mark.parametrize("vocab, chunk", [(64, 4096), (65536, 2048)])
def test_the_default_chunk_holds_at_most_a_gibibyte_of_logits(vocab: int, chunk: int) -> None:
    """Without ``loss_chunk`` the pass tiles with ``tiled_loss.default_chunk_tokens``: 4,096 tokens,
    fewer where a chunk's fp32 logits and log-probabilities (8 bytes per entry) would pass 1 GiB:
    a 65,536-entry vocabulary gets 2,048-token chunks; the cost model prices the same rule."""
    from dcp_compile.tiled_loss import default_chunk_tokens

    assert default_chunk_tokens(vocab, 4) == chunk
    torch._dynamo.reset()
    compiled = torch.compile(SmallLM("plain", vocab=vocab), backend="dcp", dynamic=True,
                             options={"inner": "eager", "sp_size": 1, "recompute": "full"})
    ids, labels = lm_inputs()
    compiled(ids, labels)
    (record,) = dcp.explain(compiled, ids, labels).variant_records()
    assert len(record.tiled_losses) == 1 and f"over {chunk}-token chunks" in record.tiled_losses[0], record.tiled_losses
    torch._dynamo.reset()
