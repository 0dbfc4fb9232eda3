"""The vocabulary the compiler and the scheduler share: recompute policies and variants.

The scheduler prices a ``Variant`` by name and the compiler builds it; both read the names from
here, so the planner can never choose a policy the compiler does not build, and neither package
imports the other.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RecomputePolicy(str, enum.Enum):
    """What a variant's backward recomputes instead of keeping from the forward.

    * ``none``: keep every activation the backward needs;
    * ``attention``: recompute each attention and what makes its queries, keys and values back to
      (and including) their projections (the projections' inputs stay saved);
    * ``selective``: ``attention``, plus every op that is not a matrix product (norms, activation
      functions, elementwise ops, views): only matmul outputs are kept, not the block inputs (a
      residual stream is recomputed from the matmul outputs that sum to it);
    * ``full``: checkpoint per block (each repeated module ``blocks.N`` is one recompute region):
      each block's input is kept and the block recomputed from it in backward. The ops outside
      the blocks form one region of their own: what they hand every block (a RoPE table built
      once) is kept like a block input, and what the head needs (final norm, output head, loss)
      is recomputed, together with the last block, from the last block's input; the last block's
      output is not kept. The all-to-alls' outputs inside a block (q, k, v as they arrive, the
      attention output as it returns) are kept too, as under every policy but ``block``: backward
      recomputes the block from them and its input without communicating.
    * ``block``: checkpoint whole blocks as ``torch.utils.checkpoint`` does: each block keeps only
      its input, and backward re-runs the block's forward, its all-to-alls included. It differs
      from ``full`` in what happens to the collectives inside a block: ``full`` keeps their
      outputs, so each layer still holds q, k, v and the attention output at SP > 1 (what a rank
      keeps per token grows with the SP size); ``block`` sends them again in backward (a layer
      sends 12 all-to-alls per micro-batch instead of 8) and keeps nothing per layer but the
      block's input, so what a rank holds per token no longer depends on the SP size. Ops
      outside the blocks and their collectives are handled as under ``full``.
    * ``offload``: ``block``, and the blocks' kept inputs live in host memory between the forward
      and their block's backward (torch's activation offloading in the min-cut partitioner: on a
      GPU, pinned buffers copied on a side stream and prefetched before they are read): the device
      holds a block input or two at a time, not one per layer (8 KB per token per layer for
      Llama-3-8B, the largest term ``block`` keeps). Priced with the copies over the host link.
    * ``lean``: ``offload``, and every MLP computed over chunks of tokens in forward and backward
      (``dcp::tiled_mlp``): its wide hidden activations (``ffn`` per token, three of them for a
      gated MLP, and their gradients) exist a chunk at a time, for one more MLP forward in
      backward. With the tiled loss it is the set of memory policies ALST trains with
      (arXiv 2506.13996): the planner takes it only for micro-batches nothing faster holds.

    Collective outputs are kept under every other policy (re-sending an all-to-all costs more
    than storing its result), and outside the blocks under ``block`` too. The values are strings,
    so ``policy == "full"`` and JSON work as before. ``RECOMPUTE_POLICIES`` lists them fastest
    first, least memory last: the planner takes the first that fits.
    """

    NONE = "none"
    ATTENTION = "attention"
    SELECTIVE = "selective"
    FULL = "full"
    BLOCK = "block"
    OFFLOAD = "offload"
    LEAN = "lean"

    def __str__(self) -> str:
        return self.value

    def __hash__(self) -> int:  # equal to its name as a string, so hash like it (dict keys)
        return hash(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def parse(cls, value: "RecomputePolicy | str | None") -> "RecomputePolicy":
        """A policy from its name (``None`` means ``none``), with an error that lists the names."""
        if value is None:
            return cls.NONE
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(policy.value for policy in cls)
            raise ValueError(f"dcp: unknown recompute policy {value!r}; use one of {names}") from None


RECOMPUTE_POLICIES: tuple[RecomputePolicy, ...] = tuple(RecomputePolicy)


WHOLE_BLOCK_POLICIES = frozenset({RecomputePolicy.BLOCK, RecomputePolicy.OFFLOAD, RecomputePolicy.LEAN})


def checkpoints_whole_blocks(recompute: RecomputePolicy | str) -> bool:
    """Whether each block keeps only its input and backward re-runs it whole, all-to-alls
    included: ``block`` and the policies built on it (``offload``, ``lean``)."""
    return RecomputePolicy.parse(recompute) in WHOLE_BLOCK_POLICIES


def offloads_block_inputs(recompute: RecomputePolicy | str) -> bool:
    """Whether the blocks' kept inputs wait in host memory for their backward (``offload``, ``lean``)."""
    return RecomputePolicy.parse(recompute) in (RecomputePolicy.OFFLOAD, RecomputePolicy.LEAN)


def tiles_mlp(recompute: RecomputePolicy | str) -> bool:
    """Whether the MLPs run over chunks of tokens (``lean``)."""
    return RecomputePolicy.parse(recompute) is RecomputePolicy.LEAN


# Whether the backend compiles in regions unless ``options={"regions": ...}`` says otherwise; the cost
# model's ``CostModel.regions`` defaults to it too, so that the memory it prices is what runs.
REGIONS_BY_DEFAULT = True

# Policies that regional compilation (``options={"regions": True}``) applies at run time with
# ``torch.utils.checkpoint`` around its regions, so that what they keep is the regions' inputs,
# not what the whole-graph partitioner keeps (the compiler's ``REGIONAL_POLICIES`` less ``none``,
# which checkpoints nothing; the others compile whole under regions too).
REGION_CHECKPOINTED_POLICIES = frozenset({RecomputePolicy.ATTENTION, RecomputePolicy.FULL})


def checkpoints_regions(recompute: RecomputePolicy | str, regions: bool) -> bool:
    """Whether a variant under ``recompute`` keeps what run-time checkpointing around regions keeps:
    ``attention`` (each attention op's inputs) and ``full`` (every region's inputs), where the
    compile is regional; every other policy compiles whole and keeps what it keeps without regions."""
    return regions and RecomputePolicy.parse(recompute) in REGION_CHECKPOINTED_POLICIES


def resends_collectives(recompute: RecomputePolicy | str, collectives_recomputed: bool = False) -> bool:
    """Whether a variant's backward re-sends its blocks' all-to-alls (whole-block checkpointing):
    under ``block`` (and ``offload``, ``lean``), and under ``full`` where ``collectives_recomputed``
    prices ``full`` as the published system builds it (``CostModel.collectives_recomputed``, the
    published baselines). Such a block keeps only its input, and its layer sends 12 all-to-alls
    per micro-batch, not 8."""
    recompute = RecomputePolicy.parse(recompute)
    return checkpoints_whole_blocks(recompute) or (collectives_recomputed and recompute is RecomputePolicy.FULL)


@dataclass(frozen=True)
class Variant:
    """What one compiled graph is specialized for: an SP size, a recompute policy, packing."""

    sp_size: int = 1
    recompute: RecomputePolicy = RecomputePolicy.NONE
    packed: bool = False  # several sequences concatenated in one row: attention runs varlen over them
    # Packed only, set by the dispatcher from the measured kernel table per call (never by a plan):
    # None runs the dcp:: varlen op, "flex" FlexAttention with a document mask.
    attention: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", RecomputePolicy.parse(self.recompute))
        if not isinstance(self.sp_size, int) or self.sp_size < 1:
            raise ValueError(f"dcp: sp_size must be a positive int, got {self.sp_size!r}")
        if not isinstance(self.packed, bool):
            raise TypeError(f"dcp: Variant.packed must be a bool, got {self.packed!r} (memory_budget is gone: "
                            "recompute='selective' now keeps exactly the matmul outputs)")
        if self.attention is not None and not (self.packed and isinstance(self.attention, str)):
            raise ValueError(f"dcp: Variant.attention ({self.attention!r}) names a packed micro-batch's attention "
                             "implementation: the dispatcher sets it; leave it None")

    def __str__(self) -> str:
        attention = f"/{self.attention}" if self.attention else ""
        return f"sp={self.sp_size}/recompute={self.recompute.value}{'/packed' if self.packed else ''}{attention}"
