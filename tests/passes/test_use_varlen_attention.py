"""use_varlen_attention_pass: a packed variant (several sequences in one row) replaces each SDPA by
``dcp::varlen_attention_fwd`` over the row's tokens, with the sequence boundaries (cu_seqlens) as
one new graph input; the unpacked variant of the same graph keeps SDPA."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from pass_helpers import A2A, SDPA, call_targets, compile_variants, pass_record

from dcp_compile.compiler.passes.use_varlen_attention import VARLEN_ATTENTION
from dcp_compile.variant import Variant

LENGTHS = [5, 7]  # two sequences packed in one row of 12 tokens


class Attention(nn.Module):
    def __init__(self, hidden: int = 16, heads: int = 2):
        super().__init__()
        self.qkv, self.heads = nn.Linear(hidden, 3 * hidden), heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).sum()


def placeholders(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return list(gm.graph.find_nodes(op="placeholder"))


def test_packed_variant_uses_varlen_attention_with_one_more_input(fake_world):
    torch.manual_seed(0)
    plain, packed = Variant(2), Variant(2, packed=True)
    records = compile_variants(Attention(), (torch.randn(1, sum(LENGTHS), 16),), [plain, packed], LENGTHS)

    unpacked_graph, packed_graph = records[plain].graph, records[packed].graph
    assert call_targets(unpacked_graph).count(SDPA) == 1
    assert VARLEN_ATTENTION not in call_targets(unpacked_graph)
    assert SDPA not in call_targets(packed_graph)
    assert call_targets(packed_graph).count(VARLEN_ATTENTION) == 1

    # One new graph input: the boundaries, read by the varlen op.
    assert len(placeholders(packed_graph)) == len(placeholders(unpacked_graph)) + 1
    boundaries = placeholders(packed_graph)[-1]
    (varlen,) = [n for n in packed_graph.graph.nodes if n.target is VARLEN_ATTENTION]
    assert varlen.args[3] is boundaries

    # The pass itself: SDPA in, the varlen op out, the Ulysses all-to-alls around it untouched.
    record = pass_record(records[packed], "use_varlen_attention_pass")
    sdpa_call, varlen_call = "torch.ops.aten.scaled_dot_product_attention.default(", "torch.ops.dcp.varlen_attention_fwd.default("
    assert record.before.count(sdpa_call) == 1 and sdpa_call not in record.after
    assert varlen_call not in record.before and record.after.count(varlen_call) == 1
    assert record.before.count(A2A) == record.after.count(A2A) == 4
