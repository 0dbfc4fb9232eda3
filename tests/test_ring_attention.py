"""SP beyond the head count: ring and Ulysses x ring attention instead of padded heads.

At SP 4 with 2 query heads, padded Ulysses gives every rank one (repeated) head: twice the total
attention work. The compiler instead factors the group (all-to-all over the heads that divide,
ring over the rest); these tests check the layout choice, the block kernel and its merge against
SDPA on one process, and parity (outputs and SP-summed gradients) on real gloo worlds, with the
record naming the layout and each rank's counted attention work exactly its ring share (1/P of
the whole for bidirectional attention).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from dcp_compile.attention_layout import AttentionLayoutKind, choose_attention_layout
from dcp_compile.compiler import ring_attention
from dcp_compile.testing.process_world import run_in_process_world
from ring_models import expected_work, ring_worker


def test_layout_choice_keeps_ulysses_where_the_heads_divide_and_never_pads_otherwise():
    assert choose_attention_layout(8, 2, 4).kind is AttentionLayoutKind.ULYSSES  # KV replicated, no padding
    assert choose_attention_layout(4, 4, 4).describe() == "Ulysses x4"
    hybrid = choose_attention_layout(2, 2, 4)
    assert (hybrid.ulysses, hybrid.ring, hybrid.describe()) == (2, 2, "ring x2 over Ulysses x2")
    assert choose_attention_layout(2, 1, 4).describe() == "ring x4"  # one KV head: no head split
    assert choose_attention_layout(2, 2, 8).describe() == "ring x4 over Ulysses x2"
    assert choose_attention_layout(3, 3, 2).describe() == "ring x2"
    assert choose_attention_layout(6, 2, 4).describe() == "ring x2 over Ulysses x2"
    for heads, kv_heads, sp_size in [(2, 2, 4), (2, 1, 4), (2, 2, 8), (3, 3, 2), (6, 2, 4), (1, 1, 8)]:
        layout = choose_attention_layout(heads, kv_heads, sp_size)
        assert layout.padded_head_slots(heads) == 0
        assert layout.attention_work_fraction(heads) == pytest.approx(1 / sp_size)
    # What padding would cost: 2 heads at SP 4 is one head per rank, half the whole each.
    assert ring_attention.AttentionPlan(choose_attention_layout(2, 2, 4), 2, 2, "attention dropout").padded_head_slots == 2


def test_plan_falls_back_to_padding_only_where_the_ring_cannot_run(monkeypatch):
    assert ring_attention.plan_attention(2, 2, 4).uses_ring
    assert not ring_attention.plan_attention(2, 2, 4, dropout_p=0.1).uses_ring
    assert "cross-attention" in ring_attention.plan_attention(2, 2, 4, self_attention=False).describe()
    assert "joint" in ring_attention.plan_attention(2, 2, 4, joint=True).describe()
    # A packed micro-batch's varlen attention needs each rank's heads whole (cu_seqlens per head).
    assert "packed" in ring_attention.plan_attention(2, 2, 4, packed=True).describe()
    monkeypatch.setenv("DCP_RING_ATTENTION", "0")
    assert "DCP_RING_ATTENTION=0" in ring_attention.plan_attention(2, 2, 4).describe()


@pytest.mark.parametrize("causal,bias", [(False, False), (True, False), (False, True)])
def test_blocks_merged_by_log_sum_exp_equal_sdpa(causal: bool, bias: bool):
    """Queries and keys cut into blocks (one of them empty), GQA 4/2: forward and every gradient,
    the learned bias's included, equal one SDPA over the whole sequence."""
    torch.manual_seed(0)
    batch, heads, kv_heads, length, dim = 2, 4, 2, 11, 8
    q = torch.randn(batch, heads, length, dim, requires_grad=True)
    k = torch.randn(batch, kv_heads, length, dim, requires_grad=True)
    v = torch.randn(batch, kv_heads, length, dim, requires_grad=True)
    b = torch.randn(1, heads, length, length, requires_grad=True) if bias else None
    leaves = [q, k, v] + ([b] if bias else [])
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=b, is_causal=causal, enable_gqa=True)
    weight = torch.randn_like(reference)
    expected = torch.autograd.grad((reference * weight).sum(), leaves)
    bounds = [0, 3, 3, 7, 11]
    rows = []
    for i in range(4):
        outs, lses = [], []
        for j in range(4):
            if causal and j > i:
                continue
            mask = b[:, :, bounds[i]:bounds[i + 1], bounds[j]:bounds[j + 1]] if bias else None
            out, lse = torch.ops.dcp.attention_block(q[:, :, bounds[i]:bounds[i + 1]], k[:, :, bounds[j]:bounds[j + 1]],
                                                     v[:, :, bounds[j]:bounds[j + 1]], mask, dim ** -0.5, causal and i == j)
            outs.append(out)
            lses.append(lse)
        rows.append(ring_attention.merge_blocks(outs, lses))
    merged = torch.cat(rows, 2)
    torch.testing.assert_close(merged, reference, rtol=1e-5, atol=1e-5)
    for got, want in zip(torch.autograd.grad((merged * weight).sum(), leaves), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def check_world(world_size: int, names: list[str], lengths: list[int], layouts: dict[str, str],
                inner: str = "eager") -> None:
    results = run_in_process_world(ring_worker, world_size, names, lengths, inner, timeout=2400)
    for rank, rank_results in enumerate(results):
        for name in names:
            result = rank_results[name]
            assert not result["problems"], "\n".join(result["problems"])
            assert result["layouts"] == [layouts[name]], (name, result["layouts"], rank_results["summaries"])
            assert result["padded"] == 0
            # dcp.explain's one-line summary names the layout
            summaries = [text for label, text in rank_results["summaries"].items() if label.startswith(name + "@")]
            assert summaries and all("attention: " + layouts[name].split(" (")[0] in text for text in summaries), summaries
            assert all("site(s) as ring attention" in text for label, text in rank_results["sharding"].items()
                       if label.startswith(name + "@")), rank_results["sharding"]
    for name in names:
        found = re.search(r"Ulysses x(\d+)", layouts[name])
        ulysses = int(found.group(1)) if found else 1
        for length in lengths:
            total, per_rank = expected_work(name, length, world_size, ulysses)
            counted = [rank_results[name]["work"][length] for rank_results in results]
            assert counted == per_rank, (name, length, counted, per_rank)
            if "causal" not in name:  # bidirectional: the ranks' shares add up to the whole, no more
                assert sum(counted) == total
                if length % world_size == 0:
                    assert all(share * world_size == total for share in counted)


HYBRID_AT_4 = "ring x2 over Ulysses x2 (2 query / 2 KV heads at SP 4, no padded heads)"
RING_AT_4 = "ring x4 (2 query / 1 KV heads at SP 4, no padded heads)"


@pytest.mark.slow
def test_four_ranks_two_heads_ring_and_hybrid_at_parity():
    # Causal (the ring skips blocks after the queries: every rank must still pass every block),
    # hybrid and pure ring with GQA 2q/1kv; 16 splits evenly, 7 unevenly (2/2/2/1).
    layouts = {"causal_2h": HYBRID_AT_4, "gqa_2q1kv_causal": RING_AT_4}
    check_world(4, list(layouts), [16, 7], layouts)


@pytest.mark.slow
def test_four_ranks_bidirectional_masks_bias_and_an_empty_chunk():
    # Bidirectional: each rank's share is exactly 1/4 of the whole at 16; 3 leaves a rank empty.
    layouts = {"bidirectional_2h": HYBRID_AT_4, "gqa_2q1kv_bidirectional": RING_AT_4,
               "padding_mask_2h": HYBRID_AT_4, "learned_bias_2h": HYBRID_AT_4}
    check_world(4, list(layouts), [16, 7, 3], layouts)


@pytest.mark.slow
def test_four_ranks_under_aot_eager():
    # AOTAutograd traces the block's backward from its fake: the strides must match what runs.
    layouts = {"gqa_2q1kv_causal": RING_AT_4, "bidirectional_2h": HYBRID_AT_4}
    check_world(4, list(layouts), [16, 7], layouts, inner="aot_eager")


@pytest.mark.slow
def test_eight_ranks_two_heads():
    layouts = {
        "bidirectional_2h": "ring x4 over Ulysses x2 (2 query / 2 KV heads at SP 8, no padded heads)",
        "gqa_2q1kv_causal": "ring x8 (2 query / 1 KV heads at SP 8, no padded heads)",
    }
    check_world(8, list(layouts), [16, 11], layouts)


def test_the_cost_model_prices_the_layout_the_compiler_builds():
    """Heads that divide: the Ulysses price as before (4 all-to-alls each way per layer). Two heads
    at SP 4 and 8: the hybrid's all-to-all over 2 ranks plus r - 1 ring steps of K/V; the
    attention FLOPs per rank stay 1/P of the whole (nothing padded to pay for)."""
    from dcp_compile.schedule.analytic import raw_term_coefficients
    from dcp_compile.schedule.attention_communication import attention_communication, attention_layout
    from dcp_compile.schedule.hardware import Hardware
    from dcp_compile.schedule.model_profile import ModelProfile

    hardware = Hardware.H200
    wide = ModelProfile.transformer("wide", num_layers=4, hidden_size=1024, num_heads=8, num_kv_heads=8)
    fixed, per_token = attention_communication(wide, hardware, 4, passes=2)
    bytes_per_token = wide.activation_dtype_bytes * 4 * wide.hidden_size
    assert per_token == pytest.approx(2 * 4 * bytes_per_token / 4 * hardware.all_to_all_seconds_per_byte(4))
    assert fixed == pytest.approx(4 * 2 * 4 * hardware.all_to_all_latency(4))
    narrow = ModelProfile.transformer("narrow", num_layers=4, hidden_size=128, num_heads=2, num_kv_heads=2)
    assert attention_layout(narrow, 4).describe() == "ring x2 over Ulysses x2"
    assert attention_layout(narrow, 8).describe() == "ring x4 over Ulysses x2"
    steps = {sp: attention_communication(narrow, hardware, sp, passes=2)[0] for sp in (2, 4, 8)}
    assert steps[2] < steps[4] < steps[8]  # more ring steps, more latency
    ring_bytes = 2 * narrow.activation_dtype_bytes * 3 * 2 * narrow.hidden_size  # r-1 = 3 steps of K+V, both ways
    _, per_token_8 = attention_communication(narrow, hardware, 8, passes=2)
    assert per_token_8 > 4 * ring_bytes / 8 / hardware.intra_node_bandwidth  # includes the ring (4 layers)
    attention = {sp: raw_term_coefficients(narrow, hardware, sp, "none")["attention"][2] for sp in (1, 4, 8)}
    assert attention[4] == pytest.approx(attention[1] / 4) and attention[8] == pytest.approx(attention[1] / 8)
