"""The working state of one planning call, and the moves every planning phase makes on it.

A :class:`PlanState` holds the step's sequences (``lengths``, ``keys`` = length x span), the
micro-batches on each rank block and each rank's load. The phases (:mod:`.levels`,
:mod:`.placement`, :mod:`.local_search`, :mod:`.exact_search`) change it only through the moves
here: :meth:`PlanState.first_fit` (the one rule for where a sequence joins a block),
:meth:`PlanState.add` and :meth:`PlanState.remove`.

The state reads the planner's tables (:class:`~.plan_tables.PlanTables`: block numbering, time
coefficients, capacities) and never the planner itself, which drives the phases.
"""

from __future__ import annotations

from dcp_compile.errors import DCPError
from dcp_compile.variant import RECOMPUTE_POLICIES

from .plan import Schedule, ScheduledMicroBatch
from .plan_tables import EPSILON, PlanTables


PACKING_SCAN = 4  # micro-batches of a block tried when adding a sequence


class PlanningError(DCPError, ValueError):
    """A step cannot be planned (a sequence fits nowhere)."""


class DraftMicroBatch:
    """A micro-batch while the step is being planned (mutable; becomes a ``ScheduledMicroBatch``).

    ``policy`` indexes ``RECOMPUTE_POLICIES``; ``time`` is the cost model's time of the whole
    micro-batch on its block (its per-sequence context work included).
    """

    __slots__ = ("level", "block", "policy", "tokens", "keys", "time", "members")

    def __init__(self, level: int, block: int, policy: int, tokens: int, keys: float, time: float, members: list[int]):
        self.level = level
        self.block = block
        self.policy = policy
        self.tokens = tokens
        self.keys = keys
        self.time = time
        self.members = members


class PlanState:
    """Working state of one planning call."""

    def __init__(self, tables: PlanTables, lengths: list[int], keys: list[float], dense_rows: bool = False) -> None:
        self.tables = tables
        self.lengths = lengths
        self.keys = keys
        # keys are squared lengths and the device's kernel may compute a packed row's whole T^2
        # (``ScoreLayout.DENSE_RANGES``): a micro-batch's scores then follow from its sums alone.
        self.dense_rows = dense_rows
        self._scores_from_sums = None
        if dense_rows:
            from dcp_compile.kernels.dense_ranges import scores_from_sums

            self._scores_from_sums = scores_from_sums
        self.n = len(lengths)
        self.level = [0] * self.n
        self.world = tables.world_size
        self.loads = [0.0] * self.world
        self.block_mbs: list[list[DraftMicroBatch]] = [[] for _ in range(tables.num_blocks)]
        self.seq_mb: list[DraftMicroBatch | None] = [None] * self.n
        self.alone_time: list[float] = []  # each sequence's time alone at its chosen level
        self.average_load = 0.0
        self._options_cache: dict[tuple[int, float], list[tuple[int, int, float]]] = {}
        self._neighbour_cache: dict[tuple[int, float, int], list[int]] = {}

    def micro_batch_time(self, level: int, policy: int, tokens: int, keys: float, sequences: int) -> float:
        """The cost model's time of a micro-batch with these sums (``keys``: its sequences' own
        token-keys), counting the scores the device's kernel computes for the packed row."""
        if self._scores_from_sums is not None:
            keys = self._scores_from_sums(tokens, keys, sequences)
        return self.tables.micro_batch_time(level, policy, tokens, keys, sequences)

    # ------------------------------------------------------------------ per-sequence options
    def options(self, i: int) -> list[tuple[int, int, float]]:
        """(level, fastest policy, time alone) for every level sequence ``i`` fits on."""
        signature = (self.lengths[i], self.keys[i])
        cached = self._options_cache.get(signature)
        if cached is None:
            planner = self.tables
            length, key = signature
            cached = []
            for j in range(planner.levels):
                p = planner.policy_for(j, length)
                if p >= 0:
                    cached.append((j, p, planner.micro_batch_time(j, p, length, key, 1)))
            self._options_cache[signature] = cached
        return cached

    def neighbour_levels(self, i: int, level: int) -> list[int]:
        """The sequence's own level and the nearest feasible levels above and below it."""
        signature = (self.lengths[i], self.keys[i], level)
        cached = self._neighbour_cache.get(signature)
        if cached is None:
            feasible = [j for j, _, _ in self.options(i)]
            position = feasible.index(level)
            cached = self._neighbour_cache[signature] = feasible[max(0, position - 1) : position + 2]
        return cached

    # ------------------------------------------------------------------ blocks
    def block_ranks(self, level: int, block: int) -> range:
        size = self.tables.sizes[level]
        k = block - self.tables.block_offset[level]
        return range(k * size, (k + 1) * size)

    def block_maxima(self) -> list[float]:
        """The maximum rank load of every block (a rank's load is its level-0 block's)."""
        planner = self.tables
        maxima = [0.0] * planner.num_blocks
        maxima[: self.world] = self.loads
        for level in range(1, planner.levels):
            offset = planner.block_offset[level]
            child_offset = planner.block_offset[level - 1]
            for k in range(planner.blocks_per_level[level]):
                a = maxima[child_offset + 2 * k]
                b = maxima[child_offset + 2 * k + 1]
                maxima[offset + k] = a if a > b else b
        return maxima

    def subtree_micro_batches(self, level: int, k: int, limit: int | None = None) -> list[DraftMicroBatch] | None:
        """Micro-batches on the block and every block inside it (None past ``limit`` of them)."""
        planner = self.tables
        found: list[DraftMicroBatch] = []
        for down in range(level, -1, -1):
            width = 1 << (level - down)
            start = planner.block_offset[down] + k * width
            for block in range(start, start + width):
                found.extend(self.block_mbs[block])
            if limit is not None and len(found) > limit:
                return None
        return found

    # ------------------------------------------------------------------ moves
    def first_fit(self, block: int, level: int, i: int) -> tuple[float, DraftMicroBatch | None, int]:
        """Cheapest way to add sequence ``i`` to ``block``: (delta time, micro-batch or None for a
        new one, policy); ``(inf, None, -1)`` if it fits no micro-batch there.

        First fit over the block's most recent micro-batches: items arrive longest first, so older
        micro-batches are the full ones, and bounding the scan keeps placement linear. Joining one
        wins over opening a new micro-batch only when it adds less time.
        """
        planner = self.tables
        length = self.lengths[i]
        key = self.keys[i]
        capacity = planner.capacity[level]
        max_capacity = planner.max_capacity[level]
        fixed, per_token, per_key = planner.fixed[level], planner.per_token[level], planner.per_key[level]
        per_sequence = planner.per_sequence[level]
        p = planner.policy_for(level, length)
        if p < 0:
            return float("inf"), None, -1
        best_delta = fixed[p] + per_token[p] * length + per_key[p] * key + per_sequence[p]
        best_mb = None
        best_policy = p
        policy_count = len(capacity)
        mbs = self.block_mbs[block]
        mixed = planner.mixed_packing
        lengths = self.lengths
        dense = self.dense_rows
        for mb in (mbs if len(mbs) <= PACKING_SCAN else mbs[-PACKING_SCAN:]):
            tokens = mb.tokens + length
            if tokens > max_capacity or not (mixed or lengths[mb.members[0]] == length):
                continue
            # The policy can only get slower as tokens grow: scan on from the current one.
            q = mb.policy
            while q < policy_count and tokens > capacity[q]:
                q += 1
            if q == policy_count:
                continue
            if dense:
                delta = self.micro_batch_time(level, q, tokens, mb.keys + key, len(mb.members) + 1) - mb.time
            else:
                delta = (fixed[q] + per_token[q] * tokens + per_key[q] * (mb.keys + key)
                         + per_sequence[q] * (len(mb.members) + 1) - mb.time)
            if delta < best_delta - EPSILON:
                best_delta, best_mb, best_policy = delta, mb, q
        return best_delta, best_mb, best_policy

    def removal(self, i: int) -> tuple[float, int]:
        """(delta time, new policy) of taking sequence ``i`` out of its micro-batch (policy -1: the
        micro-batch goes away)."""
        mb = self.seq_mb[i]
        if len(mb.members) == 1:
            return -mb.time, -1
        tokens = mb.tokens - self.lengths[i]
        planner = self.tables
        q = planner.policy_for(mb.level, tokens)
        new_time = self.micro_batch_time(mb.level, q, tokens, mb.keys - self.keys[i], len(mb.members) - 1)
        return new_time - mb.time, q

    def add(self, i: int, level: int, block: int, mb: DraftMicroBatch | None, policy: int, delta: float,
            update_loads: bool = True) -> DraftMicroBatch:
        """Put sequence ``i`` into ``mb`` (or a new micro-batch on ``block`` when None), as
        :meth:`first_fit` priced it. ``update_loads=False``: the caller adds ``delta`` to the block's
        ranks itself (placement batches those updates)."""
        if mb is None:
            mb = DraftMicroBatch(level, block, policy, self.lengths[i], self.keys[i], delta, [i])
            self.block_mbs[block].append(mb)
        else:
            mb.tokens += self.lengths[i]
            mb.keys += self.keys[i]
            mb.policy = policy
            mb.time += delta
            mb.members.append(i)
        self.seq_mb[i] = mb
        self.level[i] = level
        if update_loads:
            for r in self.block_ranks(level, block):
                self.loads[r] += delta
        return mb

    def remove(self, i: int) -> None:
        delta, policy = self.removal(i)
        mb = self.seq_mb[i]
        if policy < 0:
            self.block_mbs[mb.block].remove(mb)
        else:
            mb.members.remove(i)
            mb.tokens -= self.lengths[i]
            mb.keys -= self.keys[i]
            mb.policy = policy
            mb.time += delta
        self.seq_mb[i] = None
        for r in self.block_ranks(mb.level, mb.block):
            self.loads[r] += delta

    def packable(self, members_a: list[int], members_b: list[int]) -> bool:
        """May these two groups of sequences share a micro-batch (``pack_equal_lengths_only``)?"""
        return self.tables.mixed_packing or self.lengths[members_a[0]] == self.lengths[members_b[0]]

    def snapshot(self, *blocks: int):
        """What :meth:`restore` needs to undo changes to ``blocks``."""
        saved = []
        for block in blocks:
            saved.append((block, [(mb, mb.policy, mb.tokens, mb.keys, mb.time, list(mb.members)) for mb in self.block_mbs[block]]))
        return saved

    def restore(self, saved, loads: list[float]) -> None:
        for block, mbs in saved:
            restored = []
            for mb, policy, tokens, keys, time, members in mbs:
                mb.policy, mb.tokens, mb.keys, mb.time, mb.members = policy, tokens, keys, time, members
                restored.append(mb)
                for i in members:
                    self.seq_mb[i] = mb
                    self.level[i] = mb.level
            self.block_mbs[block] = restored
        self.loads = loads

    # ------------------------------------------------------------------ output
    def to_schedule(self) -> Schedule:
        planner = self.tables
        microbatches = []
        for level in range(planner.levels - 1, -1, -1):
            size = planner.sizes[level]
            offset = planner.block_offset[level]
            for k in range(planner.blocks_per_level[level]):
                for mb in self.block_mbs[offset + k]:
                    microbatches.append(
                        ScheduledMicroBatch(
                            positions=mb.members,
                            sp_size=size,
                            first_rank=k * size,
                            recompute=RECOMPUTE_POLICIES[mb.policy],
                            predicted_time=mb.time,
                            tokens=mb.tokens,
                        )
                    )
        return Schedule(self.world, microbatches, scheduler="dcp")
