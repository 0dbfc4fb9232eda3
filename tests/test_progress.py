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


# --- regional compilation: the regions compile at a variant's first call, and its line says so ----

REGIONS_LINE = re.compile(r"^dcp: compiled graph \d+ variant (\S+) in \d+\.\ds \(\+ (\d+) regions? compiled"
                          r"(?: in (\d+\.\d)s)?, (\d+) reused from the cache\) \(aot_eager\)$")


def test_a_variant_in_regions_counts_its_region_compiles_and_their_time(caplog, monkeypatch):
    """Its line comes after its first call, when its regions compiled (issue 34: "in 1.0s" for a
    step of 60 s); the record and dcp.explain carry the same counts; the first call beats per region."""
    from dcp_compile.compiler.regions import REGION_CACHE

    caplog.set_level(logging.INFO, logger="dcp_compile")
    monkeypatch.setattr(progress, "HEARTBEAT_SECONDS", 0.001)
    monkeypatch.setattr(progress, "shows_progress", lambda: True)  # beats are logged too (caplog sees them)
    REGION_CACHE.clear()
    torch._dynamo.reset()
    torch.manual_seed(0)
    compiled = torch.compile(_Attention(), backend="dcp", dynamic=True, options={"inner": "aot_eager", "regions": True})
    for variant in (dcp.Variant(1, "none"), dcp.Variant(1, "full")):
        with dcp.use(variant):
            compiled(torch.randn(2, 12, 8)).backward()
    with dcp.use(dcp.Variant(1, "none")):
        record = dcp.explain(compiled, torch.randn(2, 12, 8))[0]
    messages = [r.getMessage() for r in caplog.records]
    lines = [m for m in map(REGIONS_LINE.match, messages) if m]
    assert [m.group(1) for m in lines] == ["sp=1/recompute=none", "sp=1/recompute=full"], messages
    by_name = {str(key): variant for key, variant in record.variants.items()}
    for line in lines:
        counts = by_name[line.group(1)].region_compiles
        assert (int(line.group(2)), int(line.group(4))) == (counts.compiled, counts.reused)
        assert line.group(3) == (f"{counts.seconds:.1f}" if counts.compiled else None)
    first, second = (record.variants[dcp.Variant(1, policy)].region_compiles for policy in ("none", "full"))
    assert first.compiled == REGION_CACHE.compiles > 0 and first.seconds > 0 and first.reused == 0
    assert second.compiled == 0 and second.reused == first.compiled  # the same code: every region shared
    assert f"+ {first}" in str(record) and "regions: 2 compiled region(s)" in str(record), str(record)
    beats = _beats("\n".join(messages))
    assert any(stage.startswith("aot_eager: region 1 of 2") for _, stage in beats), beats


def _batch_then(shape: tuple[int, int, int], first: tuple[int, int, int] = (2, 12, 8)) -> list[str | None]:
    """Why the graph that ``shape`` runs was compiled, after a call of ``first`` (dcp.explain's record)."""
    torch._dynamo.reset()
    compiled = torch.compile(_Attention(), backend="dcp", dynamic=True, options={"inner": "eager"})
    with dcp.use(dcp.Variant(1)):
        compiled(torch.randn(*first))
        compiled(torch.randn(*shape))
        record = dcp.explain(compiled, torch.randn(*shape))
    return [graph.new_graph_reason for graph in record.graphs]


def test_a_micro_batch_of_one_sample_says_why_it_is_a_new_graph(caplog):
    caplog.set_level(logging.INFO, logger="dcp_compile")
    reasons = _batch_then((1, 12, 8))
    messages = [r.getMessage() for r in caplog.records]
    first, second = (int(m.split()[3]) for m in messages if m.startswith("dcp: analysed graph"))
    said = [m for m in messages if m.startswith(f"dcp: graph {second} is ")]
    assert len(said) == 1 and messages.index(said[0]) < messages.index(  # said before its analysis ends
        next(m for m in messages if m.startswith(f"dcp: analysed graph {second} "))), messages
    why = said[0].removeprefix(f"dcp: graph {second} is ")
    assert re.fullmatch(r"a new graph for a micro-batch of 1 sample: Dynamo specialises a dimension of size 1 "
                        rf"\(x dim 0, s\d+ in graph {first}\); its variants compile once more, other sizes "
                        rf"keep running graph {first}", why), why
    assert reasons == [why], reasons  # dcp.explain's record carries it
    reasons = _batch_then((2, 1, 8))
    assert reasons[0].startswith("a new graph for a sequence of 1 token: Dynamo specialises"), reasons
    reasons = _batch_then((2, 12, 8), first=(1, 12, 8))  # the other way round
    assert re.fullmatch(r"a new graph for sizes other than 1: graph \d+ was traced for a micro-batch of 1 sample "
                        r"and Dynamo specialises .*; its variants compile once more, a micro-batch of 1 sample "
                        r"keeps running graph \d+", reasons[0]), reasons
