"""Pack several sequences into one row, the layout packed (varlen) micro-batches use.

Padding a micro-batch of sequences of different lengths to the longest computes positions that
carry no token; the planner's cost model assumes they are not computed. Packing concatenates the
sequences instead; ``dcp.use(mb, sequence_lengths=packed.sequence_lengths)`` then makes every
attention of the compiled model stop at the boundaries (varlen attention), and the position ids
restart at each sequence, so the model sees exactly what it would see on each sequence alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

IGNORE_INDEX = -100


@dataclass
class PackedBatch:
    """One row holding several sequences back to back (batch dimension 1)."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T], 0..L-1 within each sequence
    labels: torch.Tensor  # [1, T]: the tokens, IGNORE_INDEX at each sequence's first token but the first
    sequence_lengths: list[int]

    @property
    def tokens(self) -> int:
        return sum(self.sequence_lengths)

    def to(self, device: torch.device | str) -> "PackedBatch":
        return PackedBatch(self.input_ids.to(device), self.position_ids.to(device), self.labels.to(device),
                           list(self.sequence_lengths))


def pack_sequences(sequences: Sequence[torch.Tensor]) -> PackedBatch:
    """Concatenate 1-D token sequences into one packed row.

    Labels follow the causal-LM convention where the model shifts them (position ``t`` predicts
    ``labels[t + 1]``): the first token of every sequence after the first is ignored, so no
    sequence is trained to predict the start of the next one, and the mean token loss of the
    packed row equals that of the sequences taken one by one.
    """
    if not sequences:
        raise ValueError("pack_sequences needs at least one sequence")
    lengths = [int(s.numel()) for s in sequences]
    if min(lengths) < 1:
        raise ValueError(f"pack_sequences: empty sequence in {lengths}")
    input_ids = torch.cat([s.reshape(-1) for s in sequences])[None]
    position_ids = torch.cat([torch.arange(n, device=input_ids.device) for n in lengths])[None]
    labels = input_ids.clone()
    starts = torch.tensor(lengths[:-1], dtype=torch.long, device=input_ids.device).cumsum(0)
    labels[0, starts] = IGNORE_INDEX
    return PackedBatch(input_ids, position_ids, labels, lengths)
