"""Seconds the attention collectives of one micro-batch cost, under the layout the compiler builds.

The compiler runs Ulysses (4 all-to-alls per attention) when the SP size divides the query heads,
and otherwise ring or Ulysses x ring attention (:mod:`dcp_compile.attention_layout`): all-to-alls
over the ``u`` ranks that split the heads, then ``r - 1`` ring steps, each passing the rank's K/V
block (``S/P`` tokens' worth of K and V) to its ring neighbour. Backward sends the same again
(all-to-all adjoints; the K/V gradients travel back around the ring), and whole-block
recomputation sends the forward's once more. Both layouts leave every rank ``1/P`` of the
attention FLOPs (for bidirectional attention; a causal ring is not load-balanced: its last
position computes up to ``(2r - 1)/r`` times the mean, which this model does not price).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dcp_compile.attention_layout import AttentionLayout, choose_attention_layout

from .hardware import Hardware

if TYPE_CHECKING:
    from .model_profile import ModelProfile


def attention_layout(profile: "ModelProfile", sp_size: int) -> AttentionLayout:
    return choose_attention_layout(profile.num_heads, max(1, profile.num_kv_heads), sp_size)


def attention_communication(profile: "ModelProfile", hardware: Hardware, sp_size: int,
                            passes: int) -> tuple[float, float]:
    """``(fixed seconds, seconds per token of the micro-batch)`` of the attention collectives,
    over ``passes`` traversals (2: forward and backward; 3 when blocks recompute their forward)."""
    if sp_size <= 1:
        return 0.0, 0.0
    layout = attention_layout(profile, sp_size)
    dtype = profile.activation_dtype_bytes
    layers = passes * profile.num_attention_layers
    if layout.ring == 1:
        kv_width = profile.head_dim * max(profile.num_kv_heads, sp_size)  # GQA replicates KV heads
        bytes_per_token = dtype * (2 * profile.hidden_size + 2 * kv_width)
        per_token = layers * bytes_per_token / sp_size * hardware.all_to_all_seconds_per_byte(sp_size)
        return 4 * layers * hardware.all_to_all_latency(sp_size), per_token
    kv_width = profile.head_dim * profile.num_kv_heads
    fixed = per_token = 0.0
    if layout.ulysses > 1:
        bytes_per_token = dtype * (2 * profile.hidden_size + 2 * kv_width)
        per_token += layers * bytes_per_token / sp_size * hardware.all_to_all_seconds_per_byte(layout.ulysses)
        fixed += 4 * layers * hardware.all_to_all_latency(layout.ulysses)
    # Ring steps are synchronous: the slowest hop decides (off-node once the group spans nodes).
    off_node = sp_size > hardware.gpus_per_node
    bandwidth = hardware.inter_node_bandwidth if off_node else hardware.intra_node_bandwidth
    latency = hardware.inter_node_latency if off_node else hardware.intra_node_latency
    ring_bytes = dtype * layout.ring_elements_per_local_token(2 * kv_width)
    per_token += layers * ring_bytes / sp_size / bandwidth
    fixed += (layout.ring - 1) * layers * latency
    return fixed, per_token
