"""A first compile is never silent: one line per compiled variant (rank 0), a bar over a warm-up."""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

import dcp_compile as dcp
from dcp_compile.compiler.progress import compile_progress
from dcp_compile.testing.process_world import run_in_process_world

LINE = re.compile(r"^dcp: compiled graph \d+ variant (\S+) in \d+\.\ds \(eager\)$")


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (2, 4)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v).sum()


def _compile_two_variants() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    compiled = torch.compile(_Attention(), backend="dcp", dynamic=True, options={"inner": "eager"})
    for variant in compile_progress([dcp.Variant(1, "none"), dcp.Variant(1, "full")]):
        with dcp.use(variant):
            compiled(torch.randn(2, 12, 8)).backward()


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("dcp: compiled")]


def test_one_line_per_compiled_variant_and_a_bar_by_default(capsys, monkeypatch):
    monkeypatch.delenv("DCP_PROGRESS", raising=False)
    _compile_two_variants()
    err = capsys.readouterr().err
    lines = _lines(err)
    assert [LINE.match(line).group(1) for line in lines] == ["sp=1/recompute=none", "sp=1/recompute=full"], err
    analysed = [line for line in err.splitlines() if line.startswith("dcp: analysed")]
    assert len(analysed) == 1 and re.fullmatch(r"dcp: analysed graph \d+ \(1 attention sites\) in \d+\.\ds", analysed[0]), err
    assert "dcp: compiling variants" in err and "2/2" in err, err  # the tqdm bar over the warm-up


def test_configured_logging_shows_the_line_once_and_dcp_progress_0_silences_the_print(capsys, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="dcp_compile")
    _compile_two_variants()
    assert not _lines(capsys.readouterr().err)  # the user's logging shows it: not printed twice
    assert len([r for r in caplog.records if r.getMessage().startswith("dcp: compiled graph")]) == 2
    caplog.set_level(logging.WARNING, logger="dcp_compile")
    monkeypatch.setenv("DCP_PROGRESS", "0")
    _compile_two_variants()
    err = capsys.readouterr().err
    assert not _lines(err) and "compiling variants" not in err, err


def _rank_prints(rank: int, world_size: int) -> list[str]:
    import contextlib
    import io

    stream = io.StringIO()
    with contextlib.redirect_stderr(stream):
        compiled = torch.compile(_Attention(), backend="dcp", dynamic=True, options={"inner": "eager"})
        with dcp.use(dcp.Variant(2)):
            compiled(torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(0))).backward()
    return _lines(stream.getvalue())


def test_only_rank_zero_prints():
    rank0, rank1 = run_in_process_world(_rank_prints, 2, timeout=60)
    assert len(rank0) == 1 and LINE.match(rank0[0]).group(1) == "sp=2/recompute=none", rank0
    assert rank1 == [], rank1
