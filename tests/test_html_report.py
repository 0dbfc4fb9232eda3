"""The HTML report (``save_model_report``, ``plan_html``, ``python -m dcp_compile inspect``).

The GPT-style and DiT-style zoo models are compiled once at SP 2 on the fake process group
(collectives trace, no data moves); the reports are checked for what a reader needs (summary
line, module groups, roles, gathers linked to the model line that caused them, pass diffs) and
opened in headless Chromium, which must run the page's script with no console message and show
the summary line. ``.ci/run`` installs Chromium from the Debian packages; the browser test is
skipped only where no Chromium binary exists, and says so.

Regenerate the guide's screenshots (docs/report_*.png) with
``DCP_REPORT_SCREENSHOT_DIR=docs python -m pytest -q tests/test_html_report.py -k chromium``.
"""

from __future__ import annotations

import html
import inspect
import os
import re
import shutil
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
import torch

import dcp_compile as dcp
from dcp_compile.report import plan_html, plan_svg, save_model_report
from dcp_compile.report.graph_view import clean_module_path
from dcp_compile.report.source_lines import source_line
from dcp_compile.schedule.plan import Schedule, ScheduledMicroBatch, StepPlan
from dcp_compile.variant import RecomputePolicy
from doc_blocks import doc_block, run_python_block
from model_zoo import ZOO

REPO = Path(__file__).resolve().parent.parent
SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def zoo_reports(tmp_path_factory):
    """Compiled GPT and DiT (SP 2, aot_eager: saved bytes are measured), their records and reports.
    The fake world stays up for the module so the guide's snippet can call the compiled GPT."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    out = tmp_path_factory.mktemp("reports")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    torch._dynamo.reset()
    reports = {}
    try:
        for name in ("gpt", "dit"):
            case = ZOO[name]
            compiled = torch.compile(case.build(), backend="dcp", dynamic=True,
                                     options={"sp_size": 2, "inner": "aot_eager"})
            inputs = case.make_inputs(16)
            if name == "gpt":  # model(input_ids=ids, labels=ids), as the guide calls it (no recompile there)
                inputs["labels"] = inputs["input_ids"]
            record = dcp.explain(compiled, **inputs)
            path = out / f"report_{name}.html"
            assert save_model_report(record, str(path)) == str(path)
            reports[name] = {"record": record, "path": path, "html": path.read_text(),
                             "compiled": compiled, "inputs": inputs}
        yield reports
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def _text(page: str) -> str:
    """The page's visible text, roughly (tags dropped, entities decoded)."""
    return html.unescape(re.sub(r"<[^>]+>", "", page))


@pytest.mark.parametrize("name", ["gpt", "dit"])
def test_report_has_the_summary_line_and_the_numbers(zoo_reports, name):
    report = zoo_reports[name]
    record, page = report["record"], report["html"]
    text = _text(page)
    assert record.summary_lines()
    for line in record.summary_lines():
        assert line in text
    variant = record.variant_records()[0]
    assert variant.sp_size == 2 and variant.saved_activation_bytes
    assert f"{variant.attention_sites} / {variant.attention_sites}" in text  # sharded / total
    assert f"{variant.saved_activation_bytes:,} bytes" in text
    assert f"all_to_all_single x{variant.collectives['all_to_all_single']}" in text


@pytest.mark.parametrize("name, blocks, first", [("gpt", "layers", "GPTBlock"), ("dit", "blocks", "DiTBlock")])
def test_the_graph_is_grouped_by_module_with_every_layer(zoo_reports, name, blocks, first):
    page = zoo_reports[name]["html"]
    model = ZOO[name].build()
    layers = len(getattr(model, blocks))
    assert layers >= 2
    assert re.search(rf"<details class='module'[^>]*><summary><b>{blocks}</b>", page)
    for index in range(layers):
        assert re.search(rf"<summary><b>{index}</b> <span class='muted'>\({first}\)</span>", page), index


@pytest.mark.parametrize("name", ["gpt", "dit"])
def test_ops_are_coloured_by_the_analysis_roles(zoo_reports, name):
    report = zoo_reports[name]
    graph = report["record"][0]
    page = report["html"]
    variant = report["record"].variant_records()[0]
    gathered = {gather.op for gather in variant.gathers}
    roles = {role for _, _, role, _ in graph.classification}
    assert {"token_local", "attention"} <= roles
    for role in roles:  # every classified op, once, with its role; the gathered consumers marked so
        expected = sum(1 for name, _, r, _ in graph.classification if r == role and name not in gathered)
        assert page.count(f"class='op r-{role}'") == expected, role
    assert page.count("class='op r-gathered'") == len(gathered)
    # one attention op per attention site the analysis found, coloured as attention
    assert page.count("class='op r-attention'") == len(graph.attention_sites)
    # one collective chip per collective the variant inserted (waits are not drawn)
    inserted = sum(report["record"].variant_records()[0].collectives.values())
    assert page.count("class='op r-collective'") == inserted


def test_a_gather_links_to_the_model_line_that_caused_it(zoo_reports):
    report = zoo_reports["dit"]
    variant = report["record"].variant_records()[0]
    assert len(variant.gathers) == 1  # the unpatchify
    page = report["html"]
    assert "class='op r-gathered'" in page
    source_lines, first = inspect.getsourcelines(ZOO["dit"].factory.forward)
    reshape = next(first + i for i, line in enumerate(source_lines) if "x.view(B, H // 2" in line)  # unpatchify
    assert f"model_zoo.py:{reshape} in forward" in page
    assert f"href='{Path(inspect.getsourcefile(ZOO['dit'].factory)).as_uri()}#L{reshape}'" in page


def test_each_pass_has_a_side_by_side_diff(zoo_reports):
    report = zoo_reports["gpt"]
    variant = report["record"].variant_records()[0]
    page = report["html"]
    changed = [p for p in variant.passes if p.before != p.after]
    assert any(p.name == "shard_sequence_pass" for p in changed)
    assert page.count('<table class="diff"') >= len(changed)
    assert "after shard_sequence_pass" in page and "all_to_all_single" in page


def test_the_page_fetches_nothing(zoo_reports):
    page = zoo_reports["dit"]["html"]
    assert "<link" not in page and " src=" not in page
    assert not re.search(r"(href|src)=['\"]https?:", page)


def test_module_paths_are_spelled_as_the_user_writes_them():
    assert clean_module_path("L['self'].layers.0.attn") == "layers.0.attn"
    assert clean_module_path("L['self']._modules['layers']._modules['0'].mlp") == "layers.0.mlp"
    assert clean_module_path("L['self'].blocks[3]") == "blocks.3"
    assert clean_module_path("L['self']") == ""
    # a Hugging Face forward behind a *args decorator: self is args[0], the tree's root
    assert clean_module_path("L['args'][0].model.layers.0.self_attn") == "model.layers.0.self_attn"


def test_a_module_reached_through_a_global_does_not_root_the_tree():
    # transformers 5 wraps apply_rotary_pos_emb as a hub kernel module that Dynamo finds through a
    # module global: its ops stay under the attention that called it, not a top-level "G[...]" group.
    import torch.fx as fx

    from dcp_compile.report.graph_view import module_path

    node = fx.Graph().placeholder("x")
    attention = type("LlamaAttention", (), {})
    node.meta["nn_module_stack"] = {
        "a": ("L['args'][0].model.layers.0.self_attn", attention),
        "b": ("G['__import_transformers_dot_models_dot_llama_dot_modeling_llama'].apply_rotary_pos_emb", object),
    }
    assert module_path(node) == ("model.layers.0.self_attn", "LlamaAttention")


def test_the_source_line_is_the_innermost_frame():
    trace = ('  File "/m/model.py", line 10, in forward\n    x = self.block(x)\n'
             '  File "/m/block.py", line 42, in forward\n    return x.cumsum(1)\n')
    line = source_line(trace)
    assert (line.file, line.line, line.function, line.code) == ("/m/block.py", 42, "forward", "return x.cumsum(1)")
    assert line.uri == "file:///m/block.py#L42"
    assert source_line(None) is None and source_line("no frames") is None


# --- the planner's timeline -----------------------------------------------------------------


def _two_rank_plan() -> StepPlan:
    """Ranks 0-1 run an SP-2 micro-batch (1.0 s), then rank 0 one SP-1 micro-batch with selective
    recompute (0.5 s) and rank 1 one without (0.25 s): makespan 1.5 s, rank 1 idle 0.25 s."""
    schedule = Schedule(2, [
        ScheduledMicroBatch([0], 2, 0, RecomputePolicy.NONE, 1.0, 100),
        ScheduledMicroBatch([1], 1, 0, RecomputePolicy.SELECTIVE, 0.5, 40),
        ScheduledMicroBatch([2, 3], 1, 1, RecomputePolicy.NONE, 0.25, 30),
    ])
    return StepPlan.from_schedule(schedule, step=3, epoch=0, rank=0, indices=[10, 11, 12, 13], lengths=[100, 40, 15, 15])


def _rects(svg: str, css_class: str | None = None) -> list[ElementTree.Element]:
    root = ElementTree.fromstring(svg)
    rects = []
    for group in root.iter():
        if css_class is None and group.tag == f"{SVG}g" and "mb" in group.get("class", "").split():
            rects.append(group.find(f"{SVG}rect"))
        elif css_class is not None and group.tag == f"{SVG}rect" and group.get("class") == css_class:
            rects.append(group)
    return rects


def test_the_timeline_lays_micro_batches_out_by_rank_and_time():
    plan = _two_rank_plan()
    svg = plan_svg(plan)
    bars = _rects(svg)
    assert len(bars) == 3
    by_width = sorted(bars, key=lambda rect: float(rect.get("width")))
    unit = float(by_width[-1].get("width"))  # the 1.0 s bar
    assert [round(float(rect.get("width")) / unit, 3) for rect in by_width] == [0.25, 0.5, 1.0]
    sp2 = by_width[-1]
    assert float(sp2.get("height")) > float(by_width[0].get("height"))  # spans both ranks' rows
    # the SP-1 bars start where the SP-2 bar ends
    assert all(abs(float(rect.get("x")) - (float(sp2.get("x")) + unit)) < 0.2 for rect in by_width[:2])
    idle = _rects(svg, "idle")
    assert len(idle) == 1 and abs(float(idle[0].get("width")) / unit - 0.25) < 1e-3
    recompute = _rects(svg, "recompute")
    assert len(recompute) == 1 and abs(float(recompute[0].get("width")) / unit - 0.5) < 1e-3


def test_plan_html_draws_every_micro_batch_of_sampled_steps(tmp_path):
    from dcp_compile.schedule.cost_model import CostModel, ModelProfile
    from dcp_compile.schedule.hardware import Hardware

    cost_model = CostModel(ModelProfile.from_config("llama-3-8b"), Hardware.H200, optimizer_shards=64)
    lengths = [256 * (1 + (i * 37) % 64) for i in range(200)]
    sampler = dcp.DataCentricSampler(lengths, tokens_per_step=300_000, cost_model=cost_model, seed=0,
                                     world_size=8, rank=0)
    plans = [sampler.plan(0), sampler.plan(1)]
    path = plan_html(plans, tmp_path / "plan.html")
    page = Path(path).read_text()
    svgs = re.findall(r"<svg.*?</svg>", page, flags=re.S)
    assert len(svgs) == 2
    for plan, svg in zip(plans, svgs):
        assert len(_rects(svg)) == sum(len(group.microbatches) for group in plan.groups)
        assert f"makespan {plan.predicted_makespan:.3f} s" in svg or f"makespan {plan.predicted_makespan * 1000:.1f} ms" in svg
    with pytest.raises(ValueError):
        plan_html([], tmp_path / "empty.html")


# --- the guide's snippets (docs/inspection.md, "HTML report"), as written, and the CLI ---------


def test_the_guide_snippet_runs_as_written(zoo_reports, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    gpt = zoo_reports["gpt"]
    sampler = dcp.DataCentricSampler([64 * (1 + i % 16) for i in range(64)], tokens_per_step=4096,
                                     seed=0, world_size=2, rank=0)
    ids = gpt["inputs"]["input_ids"]
    run_python_block(doc_block("docs/inspection.md", "HTML report", 0), "docs/inspection.md",
                     model=gpt["compiled"], ids=ids, sampler=sampler)
    report = (tmp_path / "dcp_report.html").read_text()
    assert gpt["record"].summary_lines()[0].split(": ", 1)[1] in _text(report)
    assert (tmp_path / "dcp_plan.html").read_text().count("<svg") == 2


FACTORY = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class TinyAttention(nn.Module):
    def __init__(self, hidden=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, s, h))


class TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList([TinyAttention(), TinyAttention()])

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return x.cumsum(1)  # mixes the sequence: one gather, linked to this line


def build():
    torch.manual_seed(0)
    return TinyModel(), {"input_ids": torch.randint(0, 32, (2, 12))}
'''


def test_the_guide_cli_command_writes_a_report_for_a_factory_script(tmp_path):
    """The guide's shell block, as written, in a folder holding the ``my_model.py`` it needs."""
    (tmp_path / "my_model.py").write_text(textwrap.dedent(FACTORY))
    command = doc_block("docs/inspection.md", "HTML report", 1)
    assert "python -m dcp_compile inspect my_model.py:build" in command
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])}  # "python" is this one
    result = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sharded 2/2 attention sites" in result.stdout
    page = (tmp_path / "dcp_report.html").read_text()
    assert "sharded 2/2 attention sites" in _text(page)
    assert "my_model.py:" in page and "return x.cumsum(1)" in html.unescape(page)
    assert "<summary><b>layers</b>" in page


def test_the_cli_loads_a_factory_by_module_name():
    from dcp_compile.report.cli import load_factory

    assert load_factory("model_zoo:GPTModel") is ZOO["gpt"].factory
    with pytest.raises(SystemExit, match="has no"):
        load_factory("model_zoo:no_such_factory")
    with pytest.raises(SystemExit, match="expected"):
        load_factory("model_zoo")


HF_FACTORY = """
import torch
from model_zoo import tiny_llama


def build():
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    return tiny_llama(), {"input_ids": ids, "labels": ids}
"""


@pytest.mark.slow
def test_the_cli_reports_a_hugging_face_model_by_module_name(zoo_reports, tmp_path, monkeypatch, capsys):
    """The issue's "done when": a Hugging Face model factory, named as ``module:factory``, gives a
    report whose first screen says whether DCP shards it (here in-process, on the module's world)."""
    pytest.importorskip("transformers")
    from dcp_compile.report.cli import main

    (tmp_path / "hf_factory.py").write_text(textwrap.dedent(HF_FACTORY))
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "llama.html"
    assert main(["hf_factory:build", "--sp", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    page = out.read_text()
    first = printed.splitlines()[0]
    assert "sharded 2/2 attention sites" in first
    assert first in _text(page.split("<div class='toolbar'>", 1)[0])  # on the first screen
    for index in (0, 1):
        assert re.search(rf"<summary><b>{index}</b> <span class='muted'>\(LlamaDecoderLayer\)</span>", page)


# --- the page in a browser ------------------------------------------------------------------


def _chromium() -> str | None:
    return next(filter(None, (shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome"))), None)


@pytest.mark.parametrize("name", ["gpt", "dit"])
def test_the_report_renders_in_headless_chromium(zoo_reports, name, tmp_path):
    browser = _chromium()
    if browser is None:
        pytest.skip("no Chromium binary (chromium, chromium-browser, google-chrome) on PATH; "
                    ".ci/run installs the Debian package 'chromium'")
    report = zoo_reports[name]
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
             f"--user-data-dir={tmp_path / 'profile'}"]
    url = report["path"].as_uri()
    dom = subprocess.run([*flags, "--enable-logging=stderr", "--v=0", "--dump-dom", url],
                         capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    console = [line for line in dom.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, console  # the page logs nothing: any console line is an error or a warning
    assert 'data-rendered="1"' in dom.stdout  # its script ran to the end
    assert report["record"].summary_lines()[0] in _text(dom.stdout)
    shot_dir = Path(os.environ.get("DCP_REPORT_SCREENSHOT_DIR") or tmp_path).resolve()
    shot_dir.mkdir(parents=True, exist_ok=True)
    shot = shot_dir / f"report_{name}.png"
    subprocess.run([*flags, "--window-size=1280,1000", f"--screenshot={shot}", url],
                   capture_output=True, text=True, timeout=120, check=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
