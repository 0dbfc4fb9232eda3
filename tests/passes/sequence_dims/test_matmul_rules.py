"""Matrix-product and norm rules, called directly on tiny traced graphs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from rule_helpers import analysed, node, size, trace

from dcp_compile.compiler.passes.sequence_dims import Rewrite, Role, SequenceDim
from dcp_compile.compiler.passes.sequence_dims.matmul_rules import linear_rule, matmul_rule, norm_rule

aten = torch.ops.aten


def test_a_linear_over_the_features_keeps_the_tokens():
    gm = trace(lambda x, w: F.linear(x, w), torch.randn(2, 7, 8), torch.randn(4, 8))
    role = linear_rule(node(gm, aten.linear.default), analysed(gm, size(gm, 0, 1)))
    assert role.role is Role.TOKEN_LOCAL and role.sequence_dims == (SequenceDim(1),)


def test_a_norm_over_the_features_keeps_the_tokens():
    gm = trace(lambda x: F.layer_norm(x, (8,)), torch.randn(2, 7, 8))
    role = norm_rule(node(gm, aten.layer_norm.default), analysed(gm, size(gm, 0, 1)))
    assert role.role is Role.TOKEN_LOCAL


def test_keys_transposed_times_values_sum_over_the_tokens():
    """Linear attention's ``k^T @ v``: a local product over the chunk plus one all-reduce."""
    gm = trace(lambda k, v: k.transpose(1, 2) @ v, torch.randn(2, 7, 8), torch.randn(2, 7, 8))
    product = node(gm, aten.matmul.default)
    role = matmul_rule(product, analysed(gm, size(gm, 0, 1)))
    assert role.rewrite is Rewrite.CONTRACT_OVER_SEQUENCE and role.aligned_inputs == tuple(product.args[:2])


def test_a_product_contracting_a_token_indexed_right_operand_mixes():
    gm = trace(lambda w, v: w @ v, torch.randn(2, 4, 7), torch.randn(2, 7, 8))
    role = matmul_rule(node(gm, aten.matmul.default), analysed(gm, size(gm, 1, 1)))
    assert role.role is Role.MIXING
