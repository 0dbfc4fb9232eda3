"""Mixture-of-experts dispatch on the rank's own tokens: sort by expert, gather rows, per-row
expert weights, inverse permutation. Parity on 2 real gloo ranks (outputs and SP-summed
gradients against eager on the full batch) with every attention sharded and no gather; the
analysis checks (token orders, positions, refusal to gather a permuted value) need no process.
"""

from __future__ import annotations

import torch

from dcp_compile.compiler.passes.sequence_dims import Rewrite, Role
from dcp_compile.compiler.passes.sequence_dims.propagation import CAPACITY_REASON
from dcp_compile.variant import Variant
from dcp_compile.testing.process_world import run_in_process_world
from model_zoo import ZOO, SortedExperts
from parity import parity_worker
from passes.pass_helpers import analyse, compile_variants

aten = torch.ops.aten


def test_sorted_expert_dispatch_at_parity_and_sharded_on_two_ranks():
    results = run_in_process_world(parity_worker, 2, ["moe"], [13, 8], "eager", timeout=600)
    assert all(result["checked"] == 2 for result in results)
    assert all(result["sharded_variants"] >= 2 for result in results), results


def _moe_analysis():
    case = ZOO["moe"]
    return analyse(case.build(), *case.make_inputs(11).values())


def test_the_dispatch_is_tracked_not_gathered():
    gm, analysis = _moe_analysis()
    roles = analysis.sequence.roles
    sorts = list(gm.graph.find_nodes(op="call_function", target=aten.sort.default))
    assert len(sorts) == 2 and all(roles[s].role == Role.TOKEN_LOCAL and roles[s].token_order is s for s in sorts)
    inverses = [n for n, r in roles.items() if r.rewrite is Rewrite.INVERSE_PERMUTATION]
    assert len(inverses) == 2
    in_experts = [n for n in roles if "SortedExperts" in str(n.meta.get("nn_module_stack", ""))
                  or "self.w_in" in (n.meta.get("stack_trace") or "") or "inverse" in (n.meta.get("stack_trace") or "")]
    assert len(in_experts) > 20
    mixing = [(n.name, roles[n].reason) for n in in_experts if roles[n].role == Role.MIXING and not roles[n].rewrite]
    assert not mixing, mixing
    # Back in token order after the inverse permutation: the sum over the top-k rows reads it.
    for inverse in inverses:
        (restored,) = [u for u in inverse.users if u.target is aten.index.Tensor]
        assert roles[restored].token_order is None


def test_a_permuted_value_is_never_gathered(fake_world):
    """A sorted-order value read by a sequence-mixing op: gathering it would interleave the ranks'
    local orders. The analysis refuses the local sort instead (the interpreter's refusal to
    gather a permuted value stays the net below it)."""

    class LeakySort(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = x.unflatten(-1, (2, 4)).transpose(1, 2)
            x = torch.nn.functional.scaled_dot_product_attention(q, q, q).transpose(1, 2).flatten(2)
            keys, order = x[..., 0].reshape(-1).sort()
            return keys.cumsum(0)  # a scan over the permuted rows

    gm, analysis = analyse(LeakySort(), torch.randn(2, 9, 8, requires_grad=True))
    # The analysis refuses the local sort whose order a scan would read across tokens: the sort
    # runs on the gathered tokens (no permuted value is ever gathered), the graph stays sharded.
    (sort,) = gm.graph.find_nodes(op="call_function", target=aten.sort.default)
    assert analysis.sequence.roles[sort].role == Role.MIXING and analysis.sequence.roles[sort].token_order is None
    assert analysis.sequence.roles[sort].reason == CAPACITY_REASON
    (record,) = compile_variants(LeakySort(), (torch.randn(2, 9, 8, requires_grad=True),), [Variant(2)]).values()
    assert record.fallback_reason is None and record.is_sharded, record.summary()
    assert CAPACITY_REASON in [gather.reason for gather in record.gathers], record.gathers


def test_sorted_experts_is_a_per_token_function():
    """The zoo's MoE really is token-local (what makes the local dispatch exact)."""
    torch.manual_seed(0)
    block = SortedExperts(8, 16)
    x = torch.randn(2, 6, 8)
    whole = block(x)
    halves = torch.cat([block(x[:, :3]), block(x[:, 3:])], dim=1)
    torch.testing.assert_close(whole, halves)
