"""What the cost model needs to know about one model: per-token FLOPs, saved bytes, model state.

Build one from a transformer's shape (:meth:`ModelProfile.transformer`, accounting in
:mod:`.presets`), a preset name or Hugging Face config (:meth:`ModelProfile.from_config`), or by
counting a real model (:meth:`ModelProfile.measure`, in :mod:`.profiling`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from dcp_compile.attention_layout import AttentionLayout, choose_attention_layout
from dcp_compile.tiled_loss import loss_chunk_bytes, tiles_loss
from dcp_compile.tiled_mlp import default_mlp_chunk_tokens, mlp_chunk_bytes
from dcp_compile.variant import (
    RECOMPUTE_POLICIES, RecomputePolicy, checkpoints_regions, checkpoints_whole_blocks, offloads_block_inputs,
    resends_collectives, tiles_mlp,
)

from .presets import FP32_BYTES, TARGET_BYTES, config_shape, preset_shape, transformer_fields
from .profiling import measure_fields


# Block inputs an offloading variant holds on the device at once: the one a block's backward reads
# and the next one, being prefetched (forward: the one a block reads and the one it makes).
OFFLOAD_RESIDENT_BLOCK_INPUTS = 2


@dataclass(frozen=True)
class BackwardPhase:
    """One phase of backward (a layer's attention, a layer's MLP, the head): bytes per token of a
    rank's share it holds on top of what is kept, and the chunk of a tiled op alive in it (the
    tiled loss's in the head's, the tiled MLP's in an MLP's): a rank's whole share up to
    ``chunk_tokens``, ``chunk_bytes`` beyond."""

    name: str
    bytes_per_token: float
    chunk_bytes: float = 0.0
    chunk_tokens: int = 0


@dataclass(frozen=True)
class ModelProfile:
    """What the cost model needs to know about one transformer, per token.

    Attributes:
        num_layers: blocks that keep activations for backward and pay a launch overhead.
        num_attention_layers: self-attention layers over the sharded sequence; each costs 4
            all-to-alls (q, k, v, out) forward and 4 backward under sequence parallelism.
        linear_flops_per_token: forward FLOPs per token of everything but the attention core
            (projections, MLPs, cross-attention to a fixed-length context, the output head).
        attention_flops_per_token_key: forward FLOPs per (query, key) pair, summed over the
            attention layers and already halved for causal masks (see the module docstring of
            :mod:`.cost_model` for ``span``).
        activation_bytes_per_token: bytes per token *per layer* kept for backward at SP 1, per
            recompute policy (:class:`~dcp_compile.variant.RecomputePolicy` names; what each
            keeps is spelled out in :mod:`.presets`).
        recompute_forward_fraction: per policy, the fractions of the forward's (linear, attention,
            memory-bound) work that backward runs again.
        memory_traffic_bytes_per_token: forward bytes read and written per token by memory-bound
            ops over all layers.
        output_bytes_per_token: transient bytes per token of the head and loss in backward: the
            gradients of the loss's input (a language model: fp32 gradients of the log-probabilities
            and of the logits, :func:`.presets.loss_gradient_bytes`).
        parameter_bytes / gradient_bytes / optimizer_bytes: model state per replica (the optimizer
            state may be sharded, see ``CostModel.optimizer_shards``).
        head_activation_bytes_per_token: bytes per token kept for backward outside the blocks
            (final norm, output head, loss; under ``full`` only what every block reads from
            outside, such as a shared RoPE table), per policy; zeros when not given.
        context_flops_per_sequence: forward FLOPs per *sample* that do not depend on its length
            and that every rank of an SP group repeats: the key/value projections of a
            conditioning context (a DiT's text) in every cross-attention. The context is not a
            sequence-indexed value, so neither the published model nor our compiler shards it.
        ffn_hidden_size / gated_mlp: the MLP's width (0: ``4 * hidden_size``) and whether it is
            gated (SwiGLU): what the gradients its backward holds at once add up to.
        recomputed_bytes_per_token: per policy, ``(attention part, MLP part)``: bytes per token one
            layer's backward rebuilds at SP 1 (:func:`.presets.layer_recomputed_bytes`); when not
            given, both parts are the whole ``none`` set less what the policy keeps.
        num_cross_attention_layers: attentions whose queries are the sharded tokens and whose keys
            and values are a per-sample context (a DiT's text): under sequence parallelism each
            sends its queries and its output through all-to-alls too.
        vocab_size / loss_chunk_tokens: a language model's vocabulary and the chunk (tokens) of its
            tiled loss, which the compiler builds under every policy but ``none``
            (:mod:`dcp_compile.tiled_loss`); ``loss_chunk_tokens=0`` (the default of a profile not
            built from a transformer's shape): the loss is priced untiled.
    """

    name: str
    num_layers: int
    num_attention_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    linear_flops_per_token: float
    attention_flops_per_token_key: float
    activation_bytes_per_token: dict[str, float]
    recompute_forward_fraction: dict[str, tuple[float, float, float]]
    memory_traffic_bytes_per_token: float
    output_bytes_per_token: float
    parameter_bytes: float
    gradient_bytes: float
    optimizer_bytes: float
    activation_dtype_bytes: int = 2
    causal: bool = False
    head_activation_bytes_per_token: dict[str, float] = field(default_factory=dict)
    context_flops_per_sequence: float = 0.0
    ffn_hidden_size: int = 0
    gated_mlp: bool = False
    recomputed_bytes_per_token: dict[str, tuple[float, float]] = field(default_factory=dict)
    num_cross_attention_layers: int = 0
    vocab_size: int = 0
    loss_chunk_tokens: int = 0
    attention_input_storage_bytes_per_token: float = 0.0

    def __post_init__(self) -> None:
        # `block` keeps and recomputes at SP 1 what `full` does (it differs only in the all-to-alls):
        # profiles written before it existed, or built by hand with the four older policies, get
        # `full`'s entries for it.
        for key in ("activation_bytes_per_token", "recompute_forward_fraction", "head_activation_bytes_per_token",
                    "recomputed_bytes_per_token"):
            entries = getattr(self, key)
            if RecomputePolicy.FULL in entries and RecomputePolicy.BLOCK not in entries:
                object.__setattr__(self, key, {**entries, RecomputePolicy.BLOCK.value: entries[RecomputePolicy.FULL]})
                entries = getattr(self, key)
            # `offload` and `lean` keep and rebuild what `block` does (where the kept inputs live,
            # and the tiled MLP's chunk, are priced below): a profile without them gets `block`'s.
            for policy in (RecomputePolicy.OFFLOAD, RecomputePolicy.LEAN):
                if RecomputePolicy.BLOCK in entries and policy not in entries:
                    object.__setattr__(self, key, {**entries, policy.value: entries[RecomputePolicy.BLOCK]})
                    entries = getattr(self, key)
        if not self.head_activation_bytes_per_token:
            object.__setattr__(self, "head_activation_bytes_per_token", {p.value: 0.0 for p in RECOMPUTE_POLICIES})
        if not self.recomputed_bytes_per_token and all(p in self.activation_bytes_per_token for p in RECOMPUTE_POLICIES):
            none = self.activation_bytes_per_token[RecomputePolicy.NONE]
            rebuilt = {p.value: max(0.0, none - self.activation_bytes_per_token[p]) for p in RECOMPUTE_POLICIES}
            object.__setattr__(self, "recomputed_bytes_per_token", {p: (v, v) for p, v in rebuilt.items()})
        missing = [p for p in RECOMPUTE_POLICIES if p not in self.activation_bytes_per_token]
        missing += [p for p in RECOMPUTE_POLICIES if p not in self.recompute_forward_fraction]
        missing += [p for p in RECOMPUTE_POLICIES if p not in self.head_activation_bytes_per_token]
        missing += [p for p in RECOMPUTE_POLICIES if p not in self.recomputed_bytes_per_token]
        if missing:
            raise ValueError(
                f"ModelProfile {self.name!r} lacks entries for recompute policies {sorted({str(p) for p in missing})}; "
                f"give activation_bytes_per_token, recompute_forward_fraction (and head_activation_bytes_per_token and "
                f"recomputed_bytes_per_token, if any) for all of {tuple(p.value for p in RECOMPUTE_POLICIES)}"
            )
        if self.num_heads % max(1, self.num_kv_heads):
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    # ------------------------------------------------------------------ tiled loss
    def tiles_loss(self, recompute: RecomputePolicy | str) -> bool:
        """Whether the compiler tiles this model's loss under ``recompute``: a language model
        (``vocab_size``) priced with a chunk, under every policy but ``none``."""
        return self.vocab_size > 0 and self.loss_chunk_tokens > 0 and tiles_loss(recompute)

    def loss_chunk_bytes(self, recompute: RecomputePolicy | str, tokens_per_rank: float | None = None) -> float:
        """Bytes the tiled loss holds at once, whatever the micro-batch's length: one chunk's logits
        and the fp32 tensors made from them (:func:`dcp_compile.tiled_loss.loss_chunk_bytes`); 0
        where the loss is not tiled. ``tokens_per_rank``: a rank's share, where it is shorter than
        a chunk (the planner prices the whole chunk: a fixed amount, the most a share holds)."""
        if not self.tiles_loss(recompute):
            return 0.0
        chunk = self.loss_chunk_tokens
        if tokens_per_rank is not None:
            chunk = min(chunk, max(0, int(-(-tokens_per_rank // 1))))
        return float(loss_chunk_bytes(chunk, self.vocab_size, self.activation_dtype_bytes))

    # ------------------------------------------------------------------ offload and tiled MLP
    def host_activation_bytes_per_token(self, recompute: RecomputePolicy | str) -> float:
        """Bytes per token of a rank's share that wait in host memory for backward: under
        ``offload`` and ``lean`` all that ``block`` keeps (every block's input, and what the blocks
        read from outside, a RoPE table), 0 otherwise. What the host link carries twice (out in
        forward, back in backward), priced as time by :func:`.analytic.raw_term_coefficients`."""
        recompute = RecomputePolicy.parse(recompute)
        if not offloads_block_inputs(recompute):
            return 0.0
        return float(self.num_layers * self.activation_bytes_per_token[recompute]
                     + self.head_activation_bytes_per_token[recompute])

    def reloaded_bytes_per_token(self, recompute: RecomputePolicy | str) -> float:
        """Bytes per token of a rank's share copied back from the host while a block's backward runs
        (``offload``, ``lean``; 0 otherwise): the block input it reads and the next one, prefetched
        (:data:`OFFLOAD_RESIDENT_BLOCK_INPUTS`), and what the blocks read from outside (a RoPE table)."""
        recompute = RecomputePolicy.parse(recompute)
        if not offloads_block_inputs(recompute):
            return 0.0
        return float(OFFLOAD_RESIDENT_BLOCK_INPUTS * self.activation_bytes_per_token[recompute]
                     + self.head_activation_bytes_per_token[recompute])

    def mlp_chunk_tokens(self) -> int:
        """The tiled MLP's chunk the backend uses by default (:func:`dcp_compile.tiled_mlp.default_mlp_chunk_tokens`)."""
        ffn = self.ffn_hidden_size or 4 * self.hidden_size
        return default_mlp_chunk_tokens(ffn, self.gated_mlp, self.activation_dtype_bytes)

    def mlp_chunk_bytes(self, recompute: RecomputePolicy | str) -> float:
        """Bytes the tiled MLP's backward holds at once beyond its per-token terms, whatever the
        length (``lean``; 0 otherwise): one chunk's ffn-wide tensors and gradients, priced whole
        (a share shorter than a chunk holds less)."""
        if not tiles_mlp(recompute):
            return 0.0
        ffn = self.ffn_hidden_size or 4 * self.hidden_size
        return float(mlp_chunk_bytes(self.mlp_chunk_tokens(), ffn, self.gated_mlp, self.activation_dtype_bytes))

    def attention_layout(self, sp_size: int) -> AttentionLayout:
        """How the compiler splits a self-attention over ``sp_size`` ranks (Ulysses, ring or both)."""
        return choose_attention_layout(self.num_heads, max(1, self.num_kv_heads), sp_size)

    # ------------------------------------------------------------------ saved activations
    def saved_activation_bytes_per_token(
        self, recompute: RecomputePolicy | str, sp_size: int = 1, collectives_recomputed: bool = False,
        regions: bool = False,
    ) -> float:
        """Bytes per token of a rank's share that backward keeps under ``recompute`` on ``sp_size``
        ranks: the layers' activations, what the head and loss keep and, under sequence
        parallelism, the all-to-all outputs that every policy keeps (re-sending one costs more
        than storing it).

        At SP > 1 each attention layer keeps q, k and v as the all-to-alls deliver them (KV heads
        replicated up to the SP size), in place of the local q, k, v that ``none`` keeps at SP 1;
        ``attention`` keeps them too (its recomputation stops at the all-to-alls), and
        ``selective`` and ``full`` also keep the output all-to-all's result. Where the SP size
        does not divide the heads the compiler runs ring (or Ulysses x ring) attention, which
        keeps more: see :meth:`attention_kept_bytes_per_token`.

        ``block`` (whole-block checkpointing, as ``torch.utils.checkpoint`` around each block does
        it): a block keeps only its input, the all-to-alls inside it run again in backward (priced
        as time by :func:`.analytic.raw_term_coefficients`), so nothing per layer depends on the
        SP size. ``collectives_recomputed`` prices ``full`` as ``block`` (the published system's
        ``full``, which the published baselines plan with).

        ``regions``: the variant is compiled in regions (``options={"regions": True}``), where
        ``attention`` and ``full`` are checkpoints around regions at run time and keep the regions'
        inputs (:meth:`regional_saved_bytes_per_token`); the other policies compile whole.
        """
        recompute = self.regional_pricing(self.priced_policy(recompute, collectives_recomputed), sp_size, regions)
        if checkpoints_regions(recompute, regions):
            return self.regional_saved_bytes_per_token(recompute, sp_size)
        if offloads_block_inputs(recompute):  # all of it waits in host memory: host_activation_bytes_per_token
            return 0.0
        saved = self.num_layers * self.activation_bytes_per_token[recompute]
        saved += self.head_activation_bytes_per_token[recompute]
        if checkpoints_whole_blocks(recompute):
            return float(saved)
        if sp_size > 1:
            saved += self.num_attention_layers * self.attention_kept_bytes_per_token(recompute, sp_size)
            saved += self.num_cross_attention_layers * self.cross_attention_kept_bytes_per_token(recompute, sp_size)
            if regions and recompute is RecomputePolicy.NONE:
                saved += self.num_attention_layers * self.eager_ring_merge_bytes_per_token(sp_size)
        return float(saved)

    def eager_ring_merge_bytes_per_token(self, sp_size: int) -> float:
        """Bytes per token of a rank's share that a ring attention's merge keeps when it runs eagerly
        between regions (``merge_blocks``: ``sum_i w_i * out_i / sum_i w_i``): autograd keeps the
        division's numerator (fp32, the rank's heads at its ring chunk: ``hidden`` per token of its
        share) and denominator (one fp32 per head), which a whole graph's partitioner recomputes
        (``tests/test_memory_model.py`` counts both). Nothing where the attention is not a ring."""
        if sp_size <= 1 or self.attention_layout(sp_size).ring == 1:
            return 0.0
        return float(FP32_BYTES * (self.hidden_size + self.num_heads))

    def cross_attention_kept_bytes_per_token(self, recompute: RecomputePolicy | str, sp_size: int) -> float:
        """Bytes per token of a rank's share that one cross-attention (queries from the sharded
        tokens, keys and values from a per-sample context) keeps at ``sp_size`` > 1 beyond its
        SP-1 set: the queries as their all-to-all delivers them in place of the local ones
        (``attention`` keeps them: its recomputation stops at the all-to-all) and, under
        ``selective`` and ``full``, the output all-to-all's result. The ring does not run
        cross-attention: where the SP size does not divide the heads they are padded to the next
        multiple, and the all-to-alls carry the padded heads. ``block`` keeps none of them."""
        recompute = RecomputePolicy.parse(recompute)
        if sp_size <= 1 or checkpoints_whole_blocks(recompute):
            return 0.0
        dtype, h = self.activation_dtype_bytes, self.hidden_size
        padded = dtype * self.head_dim * sp_size * -(-self.num_heads // sp_size)
        return float({
            RecomputePolicy.NONE: padded - dtype * h,
            RecomputePolicy.ATTENTION: padded,
            RecomputePolicy.SELECTIVE: 2 * padded,
            RecomputePolicy.FULL: 2 * padded,
        }[recompute])

    def attention_kept_bytes_per_token(self, recompute: RecomputePolicy | str, sp_size: int) -> float:
        """Bytes per token of a rank's share that one self-attention layer keeps at ``sp_size`` > 1
        beyond what the layer keeps at SP 1 (``activation_bytes_per_token``).

        Ulysses (the SP size divides the query heads): q, k, v as the all-to-alls deliver them,
        KV heads replicated up to the SP size, in place of the local ones; ``selective`` and
        ``full`` also keep the output all-to-all's result.

        Ring, or Ulysses x ring (``P = u * r``, :mod:`dcp_compile.compiler.ring_attention`), as the
        compiled graphs keep it (``tests/test_memory_model.py`` compares):

        * the ``r - 1`` K/V blocks received from the ring (``S/P`` tokens' worth of K and V each),
          under every policy: collective outputs are never recomputed, and the backward computes
          each block's gradients from the block it received;
        * under ``none``: for each of the ``r`` blocks its fp32 output, log-sum-exp and merge
          weight (``dcp::attention_block`` saves its output and log-sum-exp, the online-softmax
          merge its weights) in place of one attention output and log-sum-exp (causal: the last
          ring position uses all ``r`` blocks, the earlier ones fewer; the busiest rank is priced);
        * ``attention`` keeps what ``none`` keeps: its recomputation starts from SDPA, which a ring
          site no longer holds;
        * at ``u > 1`` the head all-to-alls' q, k, v (no KV replication: ``u`` divides the KV
          heads) and, under ``selective`` and ``full``, the output all-to-all's result; at
          ``u = 1`` ``selective`` keeps the q, k, v projections' outputs (the projections are not
          in an attention region, so they are not recomputed).

        What the ring does not price: ``dcp::attention_block`` builds its block's scores and
        probabilities, ``[heads/u, S/r, S/r]`` fp32, forward and backward: a quadratic buffer
        that no per-token price holds (see ``benchmarks/results/memory_peaks_cpu.md``).

        ``block`` keeps none of this: its backward receives the all-to-alls' and the ring's
        blocks again.
        """
        recompute = RecomputePolicy.parse(recompute)
        if sp_size <= 1 or checkpoints_whole_blocks(recompute):
            return 0.0
        dtype, h = self.activation_dtype_bytes, self.hidden_size
        kv_width = self.head_dim * self.num_kv_heads
        local = dtype * (h + 2 * kv_width)
        output = dtype * h
        layout = self.attention_layout(sp_size)
        if layout.ring == 1:
            delivered = dtype * (h + 2 * self.head_dim * max(self.num_kv_heads, sp_size))
            # ``none`` drops the local q, k, v as SP 1 keeps them: with the storages behind them
            # (a fused projection kept alive by v's view), which nothing at SP > 1 reads again.
            return float({
                RecomputePolicy.NONE: delivered - self.attention_input_bytes_per_token(1),
                RecomputePolicy.ATTENTION: delivered,
                RecomputePolicy.SELECTIVE: delivered + output,
                RecomputePolicy.FULL: delivered + output,
            }[recompute])
        received = (layout.ring - 1) * 2 * kv_width * dtype
        heads = self.num_heads
        blocks = layout.ring * (h + 2 * heads) * FP32_BYTES - (dtype * h + heads * FP32_BYTES)
        head_all_to_alls = local + output if layout.ulysses > 1 else 0.0
        return float({
            RecomputePolicy.NONE: received + blocks,
            RecomputePolicy.ATTENTION: received + blocks + self.activation_bytes_per_token[RecomputePolicy.NONE]
            - self.activation_bytes_per_token[RecomputePolicy.ATTENTION],
            RecomputePolicy.SELECTIVE: received + (head_all_to_alls if layout.ulysses > 1 else local),
            RecomputePolicy.FULL: received + head_all_to_alls,
        }[recompute])

    # ------------------------------------------------------------------ regional compilation
    def regional_pricing(self, recompute: RecomputePolicy, sp_size: int, regions: bool) -> RecomputePolicy:
        """The policy priced for a regional variant: ``recompute`` itself, but ``none`` for a
        checkpointed policy where the attention runs as a ring: the ring's blocks are an exchange
        region, which regions never recompute, so what it keeps is at least ``none``'s there
        (an upper bound, not measured)."""
        if checkpoints_regions(recompute, regions) and self.attention_layout(sp_size).ring > 1:
            return RecomputePolicy.NONE
        return recompute

    def attention_input_bytes_per_token(self, sp_size: int) -> float:
        """Bytes per token of a rank's share of one self-attention's q, k and v as the attention op
        receives them: the local ones at SP 1, the all-to-alls' outputs (KV heads replicated up to
        the SP size) beyond. At SP 1, where q, k and v are views of one fused projection whose q
        and k are rotated (or normalised) into copies, the projection stays alive too: the storages
        behind them (:attr:`attention_input_storage_bytes_per_token`, measured by
        :meth:`measure`, or ``fused_qkv`` in :meth:`transformer`) are what a checkpoint keeps."""
        dtype, h = self.activation_dtype_bytes, self.hidden_size
        kv_heads = max(1, self.num_kv_heads)
        priced = float(dtype * (h + 2 * self.head_dim * (max(kv_heads, sp_size) if sp_size > 1 else kv_heads)))
        if sp_size > 1:  # the all-to-alls' outputs are tensors of their own
            return priced
        # At SP 1 a kept view keeps its whole storage: ``attention_input_storage_bytes_per_token``.
        return max(priced, float(self.attention_input_storage_bytes_per_token))

    def cross_attention_width_bytes(self, sp_size: int) -> float:
        """Bytes per token of a rank's share of a cross-attention's queries (or output) as the
        attention op sees them: hidden-wide at SP 1, the heads padded to the SP size beyond."""
        dtype = self.activation_dtype_bytes
        if sp_size <= 1:
            return float(dtype * self.hidden_size)
        return float(dtype * self.head_dim * sp_size * -(-self.num_heads // sp_size))

    def regional_saved_bytes_per_token(self, recompute: RecomputePolicy | str, sp_size: int = 1) -> float:
        """Bytes per token of a rank's share that a regional variant keeps for backward under
        ``attention`` or ``full`` (``torch.utils.checkpoint`` around regions: each checkpoint keeps
        its inputs and frees what runs inside it; ``dcp_compile/compiler/regions``).

        ``attention``: what whole-graph ``attention`` keeps, plus each attention op's inputs, which
        its checkpoint keeps: at SP 1 the local q, k, v (and a cross-attention's queries) that the
        whole graph recomputes from their projections' input; at SP > 1 those are the all-to-alls'
        outputs, which whole-graph ``attention`` keeps already.

        ``full`` (every region and attention op checkpointed; collectives are not, and keep nothing):
        per attention op the residual stream that the region after it reads, the attention's q, k,
        v as it receives them (:meth:`attention_input_bytes_per_token`) and its output as the next
        region receives it (at SP > 1 the output all-to-all's result); a cross-attention's queries
        and output. Outside the layers: what every block reads from outside (a RoPE table, as
        whole-graph ``full``) and, where the loss is tiled, the tiled loss's input and targets:
        ``dcp::tiled_cross_entropy`` is one of dcp's ops, an exchange region, not checkpointed.
        At SP > 1 that is whole-graph ``full``'s set plus a residual per cross-attention and the
        tiled loss's; at SP 1, where whole-graph ``full`` keeps one block input per layer, about
        five hidden-wide tensors per layer.
        """
        recompute = RecomputePolicy.parse(recompute)
        dtype, h = self.activation_dtype_bytes, self.hidden_size
        cross = self.cross_attention_width_bytes(sp_size)
        if recompute is RecomputePolicy.ATTENTION:
            whole = self.saved_activation_bytes_per_token(recompute, sp_size)
            if sp_size > 1:
                return whole
            return float(whole + self.num_attention_layers * self.attention_input_bytes_per_token(1)
                         + self.num_cross_attention_layers * cross)
        if recompute is not RecomputePolicy.FULL:
            raise ValueError(f"recompute={recompute} is not checkpointed around regions")
        residuals = (self.num_attention_layers + self.num_cross_attention_layers) * dtype * h
        self_attention = self.num_attention_layers * (self.attention_input_bytes_per_token(sp_size) + dtype * h)
        cross_attention = self.num_cross_attention_layers * 2 * cross
        head = self.head_activation_bytes_per_token[RecomputePolicy.FULL]
        if self.tiles_loss(recompute):
            head += dtype * h + TARGET_BYTES
        return float(residuals + self_attention + cross_attention + head)

    # ------------------------------------------------------------------ backward working set
    def backward_working_bytes_per_token(
        self, recompute: RecomputePolicy | str, sp_size: int = 1, collectives_recomputed: bool = False,
        regions: bool = False,
    ) -> float:
        """Bytes per token of a rank's share that backward holds *on top of* what is kept
        (:meth:`saved_activation_bytes_per_token`), at its largest: the largest per-token part of
        :meth:`backward_phases` (a tiled op's chunk is a fixed amount, apart)."""
        phases = self.backward_phases(recompute, sp_size, collectives_recomputed, regions)
        return max(phase.bytes_per_token for phase in phases)

    def attention_gradient_bytes(self, sp_size: int) -> float:
        """Bytes per token of a rank's share of the activation gradients a layer's attention
        backward holds at once: of its output, and of q, k, v twice (as the attention backward
        returns them, and as the ops back to the projections rebuild them), the KV heads as wide
        as the all-to-alls deliver them; a ring also passes a K/V gradient block back."""
        dtype, h = self.activation_dtype_bytes, self.hidden_size
        head_dim, kv_heads = self.head_dim, max(1, self.num_kv_heads)
        layout = self.attention_layout(sp_size)
        delivered_kv = max(kv_heads, sp_size) if sp_size > 1 and layout.ring == 1 else kv_heads
        gradients = dtype * (h + 2 * (h + 2 * head_dim * delivered_kv))
        if layout.ring > 1:
            gradients += dtype * 2 * (2 * head_dim * kv_heads)
        return float(gradients)

    def mlp_gradient_bytes(self) -> float:
        """Bytes per token of the activation gradients a layer's MLP backward holds at once: of its
        hidden activations (3 ``ffn``-wide for a gated MLP, 2 otherwise) and of its input."""
        ffn = self.ffn_hidden_size or 4 * self.hidden_size
        return float(self.activation_dtype_bytes * ((3 if self.gated_mlp else 2) * ffn + self.hidden_size))

    def backward_phases(
        self, recompute: RecomputePolicy | str, sp_size: int = 1, collectives_recomputed: bool = False,
        regions: bool = False,
    ) -> tuple[BackwardPhase, ...]:
        """What backward holds on top of what is kept, phase by phase (a layer's attention, a
        layer's MLP, the head): the peak is the largest, and a tiled op's chunk counts only in
        its own phase (the loss's in the head's, the MLP's in an MLP's).

        Backward runs the head first, then the layers one at a time; each phase holds what it
        rebuilds and the activation gradients alive while it runs, and the peak is the largest:

        * a layer's MLP: what it rebuilds (``recomputed_bytes_per_token``; under ``full`` the
          whole block at once: at SP > 1 all but the attention cores, as the output all-to-all's
          result is kept) and the gradients of its hidden activations: of ``fc2``'s
          input and of ``fc1``'s output(s), each ``ffn`` wide (3 for a gated MLP: of the product,
          of the up projection and of the activation; 2 otherwise; one fewer where the hidden
          activation is rebuilt, as it is freed before the next gradient is allocated), and of
          its input;
        * a layer's attention: what it rebuilds, the gradient of the attention output and the
          gradients of q, k, v twice (as the attention backward returns them, and as the ops
          between the projections and the attention (RoPE, head layout, all-to-all adjoints)
          rebuild them before the first are freed), with the KV heads as wide as the all-to-alls
          deliver them (replicated up to the SP size); a ring also passes a K/V gradient block
          back (received and sent);
        * the head: under ``selective``, ``full`` and ``block`` what it rebuilds (under ``full`` and
          ``block`` with the last block: the compiler recomputes the two from the last block's
          input) and the loss's gradients (``output_bytes_per_token``). Where the loss is tiled
          (:meth:`tiles_loss`) neither holds a vocabulary-wide tensor per token: the log-probabilities
          are not rebuilt and the loss's gradients exist a chunk at a time (:meth:`loss_chunk_bytes`,
          a fixed amount priced with the model state);

        plus the residual stream's gradient, alive through every layer's backward. ``block``
        rebuilds what ``full`` does and the all-to-alls' outputs that ``full`` keeps (each block
        whole, before its MLP's backward); ``collectives_recomputed`` prices ``full`` as ``block``.
        ``regions``: a regional variant's phases (:meth:`regional_backward_phases`).
        """
        recompute = self.regional_pricing(self.priced_policy(recompute, collectives_recomputed), sp_size, regions)
        if checkpoints_regions(recompute, regions):
            return self.regional_backward_phases(recompute, sp_size)
        dtype, h = self.activation_dtype_bytes, self.hidden_size
        head_dim, kv_heads = self.head_dim, max(1, self.num_kv_heads)
        kv_width = head_dim * kv_heads
        ffn = self.ffn_hidden_size or 4 * h
        layout = self.attention_layout(sp_size)
        attention_gradients = self.attention_gradient_bytes(sp_size)
        mlp_gradients = self.mlp_gradient_bytes()

        attention_rebuilt, mlp_rebuilt = self.recomputed_bytes_per_token[recompute]
        resent = checkpoints_whole_blocks(recompute)
        whole_block = recompute is RecomputePolicy.FULL or resent
        if sp_size > 1 and recompute != RecomputePolicy.NONE:
            if resent:
                # Whole-block checkpointing re-sends the all-to-alls: the rebuilt block holds q, k, v
                # and the attention output as they arrive, in place of the local ones it rebuilds at
                # SP 1, so what it holds beyond SP 1's set is what `none` keeps beyond it: the KV
                # heads' replication (and a ring's received blocks). Measured on CPU:
                # benchmarks/results/memory_peaks_lean_cpu.md (priced with the FULL set before: +15-23%).
                attention_rebuilt += self.attention_kept_bytes_per_token(RecomputePolicy.NONE, sp_size)
            elif layout.ring > 1 and recompute == RecomputePolicy.ATTENTION:
                attention_rebuilt = 0.0  # `attention` does not reach a ring site (see attention_kept_bytes_per_token)
            else:
                # What the all-to-alls delivered is kept: backward rebuilds neither the local q, k, v
                # nor (selective, full) the output all-to-all's result.
                kept = dtype * (h + 2 * kv_width) + (dtype * h if recompute != RecomputePolicy.ATTENTION else 0)
                attention_rebuilt = max(0.0, attention_rebuilt - kept)
        if tiles_mlp(recompute):
            # The tiled MLP's ffn-wide gradients exist a chunk at a time (mlp_chunk_bytes, a fixed
            # amount): per token only the gradient of its input.
            mlp_gradients = dtype * h
        elif mlp_rebuilt > 0:
            # A rebuilt hidden activation (the activation function's output, the gated product) is
            # freed once fc2's weight gradient is taken, before the activation's backward allocates
            # the next ffn-wide gradient: one ffn-wide tensor fewer alive at once than when it is kept.
            mlp_gradients -= dtype * ffn
        # Under `full` the MLP's input is rebuilt before the MLP's backward: at SP 1 that runs the
        # whole attention again; at SP > 1 the output all-to-all's result is kept, so only the
        # residual path is rebuilt then and the attention cores (output, logsumexp) wait for the
        # attention's backward.
        block_rebuilt = attention_rebuilt
        if whole_block and sp_size > 1 and not resent:
            attentions = 1 + self.num_cross_attention_layers / max(1, self.num_layers)
            block_rebuilt = max(0.0, attention_rebuilt - attentions * (dtype * h + self.num_heads * FP32_BYTES))
        attention_phase = attention_rebuilt + attention_gradients
        mlp_phase = mlp_rebuilt + mlp_gradients + (block_rebuilt if whole_block else 0.0)
        head_rebuilt = 0.0
        tiled = self.tiles_loss(recompute)
        if recompute in (RecomputePolicy.SELECTIVE, RecomputePolicy.FULL) or resent:
            head_rebuilt = self.head_activation_bytes_per_token[RecomputePolicy.NONE]
            if tiled:  # the tiled loss rebuilds the final norm's output, not the log-probabilities
                head_rebuilt -= self.vocab_size * FP32_BYTES
        if whole_block:
            head_rebuilt += block_rebuilt + mlp_rebuilt
        head_phase = head_rebuilt + (0.0 if tiled else self.output_bytes_per_token)
        loss_chunk = self.loss_chunk_bytes(recompute)
        residual_gradient = dtype * h
        alive = residual_gradient + self.reloaded_bytes_per_token(recompute)  # through every phase
        mlp_chunk = self.mlp_chunk_bytes(recompute)
        return (
            BackwardPhase("attention", float(alive + attention_phase)),
            BackwardPhase("mlp", float(alive + mlp_phase), mlp_chunk, self.mlp_chunk_tokens() if mlp_chunk else 0),
            BackwardPhase("head", float(alive + head_phase), loss_chunk, self.loss_chunk_tokens if loss_chunk else 0),
        )

    def regional_backward_phases(self, recompute: RecomputePolicy | str, sp_size: int = 1) -> tuple[BackwardPhase, ...]:
        """:meth:`backward_phases` of a regional variant under ``attention`` or ``full``: a
        checkpoint's backward runs its region again, then the region's backward, one region at a time.

        ``attention``: as whole-graph ``attention`` at SP > 1, where the attention's recomputation
        stops at its inputs (the all-to-alls' outputs); at SP 1 too, as the checkpoint keeps the
        local q, k, v: the attention's phase rebuilds only its output and log-sum-exp.

        ``full``: the attention's phase rebuilds its output and log-sum-exp beside its gradients;
        the region after it (output projection, MLP, the next layer's norm and projections) rebuilds
        what whole-graph ``attention`` keeps of a layer (norm inputs and statistics, projections'
        inputs, the MLP's activations), beside the MLP's gradients (less the rebuilt hidden
        activation, freed first); the head's phase holds the tiled loss's chunk (its input is kept)
        or, untiled, rebuilds the last region with the head. The residual stream's gradient is
        alive through all of them."""
        recompute = RecomputePolicy.parse(recompute)
        if recompute is RecomputePolicy.ATTENTION:
            phases = self.backward_phases(recompute, sp_size)
            if sp_size > 1:
                return phases
            kept = self.attention_input_bytes_per_token(1)
            return tuple(replace(p, bytes_per_token=p.bytes_per_token - kept) if p.name == "attention" else p
                         for p in phases)
        dtype, h = self.activation_dtype_bytes, self.hidden_size
        ffn = self.ffn_hidden_size or 4 * h
        alive = dtype * h  # the residual stream's gradient
        attention_core = dtype * h + self.num_heads * FP32_BYTES  # output and log-sum-exp, rebuilt
        region = self.activation_bytes_per_token[RecomputePolicy.ATTENTION]
        mlp_gradients = self.mlp_gradient_bytes() - dtype * ffn
        loss_chunk = self.loss_chunk_bytes(recompute)
        head = 0.0 if self.tiles_loss(recompute) else (
            region + self.head_activation_bytes_per_token[RecomputePolicy.NONE] + self.output_bytes_per_token)
        return (
            BackwardPhase("attention", float(alive + attention_core + self.attention_gradient_bytes(sp_size))),
            BackwardPhase("mlp", float(alive + region + mlp_gradients)),
            BackwardPhase("head", float(alive + head), loss_chunk, self.loss_chunk_tokens if loss_chunk else 0),
        )

    @staticmethod
    def priced_policy(recompute: RecomputePolicy | str, collectives_recomputed: bool = False) -> RecomputePolicy:
        """The policy whose memory is priced: ``block`` where ``collectives_recomputed`` makes
        ``full`` the published whole-block checkpointing, else ``recompute`` itself."""
        recompute = RecomputePolicy.parse(recompute)
        if recompute is RecomputePolicy.FULL and resends_collectives(recompute, collectives_recomputed):
            return RecomputePolicy.BLOCK
        return recompute

    def saved_activation_bytes(
        self, tokens: int, recompute: RecomputePolicy | str, sp_size: int = 1, collectives_recomputed: bool = False,
        regions: bool = False,
    ) -> float:
        """Bytes each rank keeps for backward for a micro-batch of ``tokens`` tokens: the priced
        counterpart of the compiler's ``VariantRecord.saved_activation_bytes``."""
        return self.saved_activation_bytes_per_token(recompute, sp_size, collectives_recomputed, regions) * tokens / sp_size

    # ------------------------------------------------------------------ constructors
    @classmethod
    def transformer(
        cls,
        name: str,
        *,
        num_layers: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        ffn_hidden_size: int | None = None,
        gated_mlp: bool = False,
        vocab_size: int = 0,
        causal: bool = True,
        cross_attention_tokens: int = 0,
        output_channels: int = 0,
        rotary: bool = False,
        adaptive_norm: bool = False,
        dtype_bytes: int = 2,
        gradient_dtype_bytes: int = 4,
        optimizer_bytes_per_parameter: int = 12,
        extra_parameters: int = 0,
        loss_chunk_tokens: int | None = None,
        fused_qkv: bool = False,
    ) -> "ModelProfile":
        """A profile from the shape of a standard pre-norm transformer.

        Counts matmul FLOPs exactly (2 per multiply-add) and the bytes each recompute policy keeps
        as the compiler builds it, with flash-attention accounting (no quadratic buffer); see
        :mod:`.presets`. ``cross_attention_tokens`` adds a cross-attention sub-block per layer to a
        context of that many tokens (a DiT's text). ``rotary``: the model builds one RoPE table
        (cos, sin) outside its blocks and hands it to every block, so ``full`` keeps it as a
        block input. ``adaptive_norm``: adaLN modulation and gates (a DiT): the modulated norms'
        outputs and the gated branches' outputs are kept too. ``loss_chunk_tokens``: the chunk of the tiled loss the
        compiler builds for a language model under every policy but ``none`` (the backend's
        ``loss_chunk``; None: its default for the vocabulary; 0: price the loss untiled).
        ``fused_qkv``: q, k and v are slices of one projection (GPT-NeoX's ``query_key_value``,
        Phi-3's ``qkv_proj``); with ``rotary`` the rotated q and k are copies, so an attention
        checkpoint at SP 1 keeps the projection beside them.
        """
        return cls(**transformer_fields(
            name, num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
            ffn_hidden_size=ffn_hidden_size, gated_mlp=gated_mlp, vocab_size=vocab_size, causal=causal,
            cross_attention_tokens=cross_attention_tokens, output_channels=output_channels, rotary=rotary,
            adaptive_norm=adaptive_norm, dtype_bytes=dtype_bytes,
            gradient_dtype_bytes=gradient_dtype_bytes, optimizer_bytes_per_parameter=optimizer_bytes_per_parameter,
            extra_parameters=extra_parameters, loss_chunk_tokens=loss_chunk_tokens, fused_qkv=fused_qkv,
        ))

    @classmethod
    def from_config(cls, config: str | Mapping[str, Any] | Any) -> "ModelProfile":
        """A profile from a preset name, a dict, or a Hugging Face-style config object.

        Presets: ``"stdit3-xl/2"`` (alias ``"open-sora-v1.2"``): Open-Sora v1.2's 1.1B video DiT,
        28 spatial + 28 temporal blocks of width 1152, 16 heads, cross-attention to 300 T5 tokens
        (give samples ``span = (latent_frames + height_tokens * width_tokens) / 2``, see
        :func:`video_attention_span`); ``"llama-3-8b"``: 32 layers, width 4096, 32 heads with 8 KV
        heads, SwiGLU 14336, vocabulary 128256, causal. A dict or object is read for the usual Hugging
        Face field names (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
        ``num_key_value_heads``, ``intermediate_size``, ``vocab_size``).
        """
        name, shape = preset_shape(config) if isinstance(config, str) else config_shape(config)
        return cls.transformer(name, **shape)

    @classmethod
    def measure(
        cls,
        model: Any,
        make_inputs: Callable[[int], Any],
        lengths: Sequence[int] = (64, 128, 256),
        *,
        name: str | None = None,
        causal: bool = False,
        num_layers: int | None = None,
    ) -> "ModelProfile":
        """Count the model's forward FLOPs and saved-activation bytes at a few lengths and fit them.

        ``make_inputs(length)`` returns the model's inputs for one sample of ``length`` tokens (a
        dict of keyword arguments or a tuple). Details in :func:`.profiling.measure_fields`. Cheap
        at the default lengths on a small model; no backward is run.
        """
        return cls(**measure_fields(model, make_inputs, lengths, name=name, causal=causal, num_layers=num_layers))

    # ------------------------------------------------------------------ io
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("activation_bytes_per_token", "head_activation_bytes_per_token"):
            data[key] = {str(k): float(v) for k, v in data[key].items()}
        data["recompute_forward_fraction"] = {str(k): list(v) for k, v in self.recompute_forward_fraction.items()}
        data["recomputed_bytes_per_token"] = {str(k): [float(x) for x in v] for k, v in self.recomputed_bytes_per_token.items()}
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelProfile":
        """The profile :meth:`to_dict` wrote (files without ``head_activation_bytes_per_token``, from
        before it was priced, load with zeros there; without the MLP shape and
        ``recomputed_bytes_per_token``, with a 4x MLP and the whole ``none`` set rebuilt)."""
        data = dict(data)
        data["recompute_forward_fraction"] = {
            k: tuple(float(x) for x in v) for k, v in data["recompute_forward_fraction"].items()
        }
        if "recomputed_bytes_per_token" in data:
            data["recomputed_bytes_per_token"] = {
                k: tuple(float(x) for x in v) for k, v in data["recomputed_bytes_per_token"].items()
            }
        for key in ("activation_bytes_per_token", "head_activation_bytes_per_token"):
            if key in data:
                data[key] = {k: float(v) for k, v in data[key].items()}
        return cls(**data)


def video_attention_span(latent_frames: int, height_tokens: int, width_tokens: int) -> float:
    """Mean keys per query of a spatial-temporal DiT (half its layers attend within a frame, half
    along time): the ``span`` to give the cost model and the sampler for such a sample."""
    return (latent_frames + height_tokens * width_tokens) / 2
