"""A first compile is never silent: one line per compiled variant (rank 0), a heartbeat while one
runs long, a bar over a warm-up; a plan compiles only the variants it runs."""

from __future__ import annotations

import logging
import re
import time

import torch
from torch import nn

import dcp_compile as dcp
from dcp_compile.compiler import progress
from dcp_compile.compiler.progress import compile_progress, compile_stage, compiling
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


BEAT = re.compile(r"^dcp: compiling (.+): \d+s so far \((.+)\)$")


def _beats(text: str) -> list[tuple[str, str]]:
    return [m.groups() for m in map(BEAT.match, text.splitlines()) if m]


def test_a_long_compile_beats_with_its_stage_and_stops_when_done(capsys, monkeypatch):
    monkeypatch.delenv("DCP_PROGRESS", raising=False)
    monkeypatch.setattr(progress, "HEARTBEAT_SECONDS", 0.02)
    with compiling("graph 7 variant sp=2/recompute=none", "variant passes"):
        time.sleep(0.15)
        with compile_stage("Inductor: backward"):
            time.sleep(0.15)
    time.sleep(0.1)  # no beat after the body
    beats = _beats(capsys.readouterr().err)
    assert {what for what, _ in beats} == {"graph 7 variant sp=2/recompute=none"}, beats
    stages = [stage for _, stage in beats]
    assert stages[0] == "variant passes" and stages[-1] == "Inductor: backward", stages
    assert "Inductor: backward" not in stages[:stages.index("Inductor: backward")], stages  # in order, then done


def test_variant_compiles_beat_through_their_stages_and_dcp_progress_0_silences_them(capsys, monkeypatch):
    monkeypatch.delenv("DCP_PROGRESS", raising=False)
    monkeypatch.setattr(progress, "HEARTBEAT_SECONDS", 0.001)  # every compile outlasts it
    _compile_two_variants()
    beats = _beats(capsys.readouterr().err)
    variants = {what for what, _ in beats if " variant " in what}
    assert {re.sub(r"graph \d+ ", "", what) for what in variants} == {
        "variant sp=1/recompute=none", "variant sp=1/recompute=full"}, beats
    assert {"ATen re-trace", "variant passes"} <= {stage for _, stage in beats}, beats
    monkeypatch.setenv("DCP_PROGRESS", "0")
    _compile_two_variants()
    assert not _beats(capsys.readouterr().err)


def test_a_plan_compiles_only_the_variants_it_runs(fake_world):
    """Without sp_size the static variant is SP = world size: a plan that never runs it never
    compiles it (issue 25: it used to compile at the first trace)."""
    compiled = torch.compile(_Attention(), backend="dcp", dynamic=True, options={"inner": "eager"})
    with dcp.use(dcp.Variant(1, "full")):
        compiled(torch.randn(2, 12, 8)).backward()
        explained = dcp.explain(compiled, torch.randn(2, 12, 8))
    assert list(explained[0].variants) == [dcp.Variant(1, "full")]
