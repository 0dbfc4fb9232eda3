"""recompute_pass: the partitioner tags each policy leaves on the graph, at SP 2 on the fake world.

Collective outputs are MUST_SAVE under every policy (recomputing one would re-send it);
``attention`` makes SDPA MUST_RECOMPUTE; ``selective`` also every op that is not a matrix
product; ``full`` gives every block its own ``ac_graph_id`` (one checkpoint region per block).
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from pass_helpers import SDPA, compile_variants
from torch.utils.checkpoint import CheckpointPolicy

import dcp_compile as dcp
from dcp_compile.compiler.passes.recompute import block_of, is_collective
from dcp_compile.variant import RECOMPUTE_POLICIES, Variant, checkpoints_whole_blocks

aten = torch.ops.aten
MATMULS = {aten.linear.default, aten.mm.default, aten.addmm.default, aten.matmul.default, aten.bmm.default}


class Block(nn.Module):
    def __init__(self, hidden: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, length, -1)
        return x + self.fc2(F.gelu(self.fc1(x)))


class Stack(nn.Module):
    def __init__(self, hidden: int = 16, layers: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.out = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x).mean()


@pytest.fixture(scope="module")
def graphs() -> dict[str, fx.GraphModule]:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # One trace, four variants, in a fake world of its own (tests/conftest.py's fake_world is
    # function-scoped); the transformed graphs are kept on the records.
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        variants = [Variant(2, policy) for policy in RECOMPUTE_POLICIES]
        records = compile_variants(Stack(), (torch.randn(2, 12, 16),), variants)
        return {variant.recompute.value: record.graph for variant, record in records.items()}
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def ops(gm: fx.GraphModule) -> list[fx.Node]:
    return [node for node in gm.graph.nodes if node.op == "call_function"]


def tag(node: fx.Node):
    return node.meta.get("recompute") if node.meta.get("dcp_recompute_tag") else None


@pytest.mark.parametrize("policy", [p.value for p in RECOMPUTE_POLICIES if not checkpoints_whole_blocks(p)])
def test_collectives_are_saved_under_every_policy_but_block(graphs, policy):
    collectives = [n for n in ops(graphs[policy]) if is_collective(n)]
    assert len(collectives) >= 2 * 4  # two attentions' all-to-alls (and their waits)
    assert {tag(n) for n in collectives} == {CheckpointPolicy.MUST_SAVE}


@pytest.mark.parametrize("policy", [p.value for p in RECOMPUTE_POLICIES if checkpoints_whole_blocks(p)])
def test_block_recomputes_the_collectives_inside_its_blocks_and_saves_the_others(graphs, policy):
    """``offload`` and ``lean`` tag as ``block`` does (they differ at partitioning and in the MLPs)."""
    collectives = [n for n in ops(graphs[policy]) if is_collective(n)]
    inside = [n for n in collectives if block_of(n) is not None]
    assert len(inside) >= 2 * 4  # two attentions' all-to-alls (and their waits), re-sent in backward
    assert {tag(n) for n in inside} == {CheckpointPolicy.MUST_RECOMPUTE}
    assert {tag(n) for n in collectives if block_of(n) is None} <= {CheckpointPolicy.MUST_SAVE}


def test_none_tags_nothing_else(graphs):
    assert [n.name for n in ops(graphs["none"]) if tag(n) is not None and not is_collective(n)] == []


def test_attention_recomputes_sdpa_only_around_the_all_to_alls(graphs):
    gm = graphs["attention"]
    sdpas = [n for n in ops(gm) if n.target is SDPA]
    assert len(sdpas) == 2 and all(tag(n) == CheckpointPolicy.MUST_RECOMPUTE for n in sdpas)
    # The walk back from SDPA stops at the all-to-alls: the projections and the MLP keep theirs.
    for node in ops(gm):
        if node.target in MATMULS or node.target in (aten.gelu.default, aten.layer_norm.default):
            assert tag(node) is None, node.name


def test_selective_recomputes_everything_but_the_matmuls(graphs):
    gm = graphs["selective"]
    for node in ops(gm):
        if is_collective(node):
            continue
        expected = None if node.target in MATMULS else CheckpointPolicy.MUST_RECOMPUTE
        assert tag(node) == expected, (node.name, node.target, tag(node))
    assert {tag(n) for n in ops(gm) if n.target in (SDPA, aten.gelu.default, aten.layer_norm.default)} == {
        CheckpointPolicy.MUST_RECOMPUTE}


def test_full_gives_each_block_its_own_region(graphs):
    gm = graphs["full"]
    regions: dict[str | None, set[int]] = {}
    for node in ops(gm):
        if is_collective(node):
            continue
        assert tag(node) == CheckpointPolicy.PREFER_RECOMPUTE, node.name
        block = block_of(node)  # "L['self'].blocks.0": the module path as dynamo spells it
        regions.setdefault(block and block.split(".", 1)[-1], set()).add(node.meta["ac_graph_id"])
    assert set(regions) == {"blocks.0", "blocks.1", None}, regions
    assert all(len(ids) == 1 for ids in regions.values()), regions  # one id per block
    assert len({ids.pop() for ids in regions.values()}) == 3  # and no two blocks share one
    # The Ulysses layout ops spliced around each attention keep their block's module stack: no
    # reshape or permute falls in the region outside the blocks (the head and the mean's rewrite).
    layout = {aten.reshape.default, aten.view.default, aten.permute.default, aten.transpose.int, aten.movedim.int}
    assert not [n.name for n in ops(gm) if n.target in layout and block_of(n) is None]


@pytest.mark.parametrize("policy", ["full", "block"])
def test_a_hugging_face_model_gets_one_region_per_decoder_layer(fake_world, policy: str) -> None:
    """transformers 5 wraps ``forward`` in decorators, so Dynamo finds the model as an argument
    (``L['args'][0].model.layers.0``): the argument's index is not a block's, and before this was
    told apart every op of the model fell in one region, recomputed from the model's input as a
    whole instead of layer by layer (and a per-layer mix could not tell its layers apart)."""
    pytest.importorskip("transformers")
    from model_zoo import ZOO

    case = ZOO["hf_llama"]
    torch.manual_seed(0)
    model = case.build()
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager", "sp_size": 2})
    variant = Variant(2, policy)
    with dcp.use(variant):
        record = dcp.explain(compiled, **case.make_inputs(12))[0].variants[variant]
    blocks = {block_of(n) for n in ops(record.graph)} - {None}
    assert len(blocks) == model.config.num_hidden_layers == 2, blocks
    assert all(".layers." in block for block in blocks), blocks
    regions = {n.meta["ac_graph_id"] for n in ops(record.graph)  # collectives saved under full: region 0
               if tag(n) is not None and block_of(n) is not None and not is_collective(n)}
    assert len(regions) == 2, regions
