"""Right-padded language-model batches for tests (a collate_fn for token-id samples).

Why one module: the FSDP2, checkpoint and data-loader tests each need the same collate as the guide's data-centric
loop (pad ids with 0 on the right, labels -100 there); one copy keeps them collating alike.
"""

from __future__ import annotations

import torch


def pad_right(samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{"input_ids", "labels"}`` of shape ``[len(samples), longest]``; padded labels are -100."""
    longest = max(len(s) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    labels = torch.full((len(samples), longest), -100, dtype=torch.long)
    for row, sample in enumerate(samples):
        ids[row, : len(sample)] = sample
        labels[row, : len(sample)] = sample
    return {"input_ids": ids, "labels": labels}
