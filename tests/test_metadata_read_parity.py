"""Ops that read a sequence-indexed value only for its dtype and device (``h.new_zeros(())``,
``h.new_ones(h.shape[:2])``, ``h.new_full((D,), c)``, ``w.type_as(h)``) between attention layers
on 2 gloo ranks: at parity with eager and with no gather at all (each once gathered ``h``, one
of them without a reason)."""

from __future__ import annotations

import torch
import torch.nn as nn

from dcp_compile.testing.process_world import run_in_process_world
from sequence_programs import D, ProgramModel, inputs


class MetadataReads(ProgramModel):
    def __init__(self) -> None:
        super().__init__(())
        self.gain = nn.Parameter(torch.full((D,), 0.5, dtype=torch.float64))
        self.shift = nn.Parameter(torch.tensor(0.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention(0, x)
        total = h.new_zeros(()) + self.shift  # a scalar accumulator
        keep = h.new_ones(h.shape[:2])  # a fresh sequence-sized value
        bias = h.new_full((D,), 0.125)
        h = (h * self.gain.type_as(h) + total + bias) * keep[..., None]
        return self.attention(1, h)


def build() -> MetadataReads:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return MetadataReads()


def _worker(rank: int, world_size: int, lengths: list[int]) -> dict:
    from sequence_programs import check_model

    problems, seen = check_model("metadata_reads", build, inputs, lengths)
    return {"problems": problems, **seen}


def test_metadata_reads_never_gather_and_match_eager():
    for result in run_in_process_world(_worker, 2, [8, 7], timeout=900):
        assert not result["problems"], "\n".join(result["problems"])
        assert result["sharded_sites"] == result["attention_sites"] == 4, result
        assert result["gathers"] == [], result["gathers"]
