"""The public API fits on one screen: ``dir(dcp)`` lists at most 20 names, each a real export; the
rest is in namespaces reachable as attributes; the names that moved still resolve for one release
with a warning that names the new spelling; docs/api.md lists what ``dir`` does."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import dcp_compile as dcp

REPO = Path(__file__).resolve().parent.parent
NAMESPACES = ("schedule", "checkpoint", "report", "errors", "runtime")


def test_dir_lists_at_most_20_public_names_and_only_exports():
    names = dir(dcp)
    assert len(names) <= 20, names
    assert names == sorted(dcp.__all__) and all(not name.startswith("_") for name in names), names
    assert set(names) == {*dcp._EXPORTS, *dcp._NAMESPACES, "DCPError", "RecomputePolicy", "Variant"}
    for leak in ("Any", "importlib", "warnings", "annotations", "variant", "_EXPORTS"):
        assert leak not in names
    assert not set(names) & set(dcp._MOVED)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in names:
            assert getattr(dcp, name) is not None, name


def test_each_namespace_is_an_attribute_without_a_prior_import():
    """One fresh process (quick tier): none is loaded before its first attribute access, and every name
    each lists resolves without a warning. ``dcp.errors`` is loaded with the package (``dcp.DCPError``)."""
    code = ("import sys, dcp_compile as dcp\n"
            f"names = {NAMESPACES + ('huggingface', 'accelerate')!r}\n"
            "loaded = [n for n in names if n != 'errors' and 'dcp_compile.' + n in sys.modules]\n"
            "assert not loaded, loaded\n"
            "for n in names:\n"
            "    module = getattr(dcp, n)\n"
            "    assert module is sys.modules['dcp_compile.' + n], n\n"
            "    if n in ('huggingface', 'accelerate'):\n"
            "        continue  # integrations: their names import transformers and accelerate\n"
            "    for name in module.__all__:\n"
            "        getattr(module, name)\n"
            "print('ok')\n")
    run = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code],
                         capture_output=True, text=True, timeout=120)
    assert run.stdout.strip() == "ok", run.stderr


@pytest.mark.parametrize("name", sorted(dcp._MOVED))
def test_a_moved_name_warns_with_its_new_spelling_and_is_the_same_object(name):
    new = dcp._MOVED[name]
    with pytest.warns(DeprecationWarning, match=re.escape(f"dcp.{name} is deprecated: use {new}.{name}")):
        old = getattr(dcp, name)
    module = new.replace("dcp.", "dcp_compile.", 1) if new.startswith("dcp.") else new
    assert old is getattr(sys.modules[module], name)
    if new.startswith("dcp."):
        assert old is getattr(getattr(dcp, new.split(".")[1]), name)


def test_the_docs_api_page_lists_what_dir_and_each_namespace_export():
    page = (REPO / "docs" / "api.md").read_text()
    top = page.split("## The top level", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^\| `(\w+)` \|", top, re.M) and sorted(re.findall(r"^\| `(\w+)` \|", top, re.M)) == dir(dcp)
    rows = dict(re.findall(r"^\| `dcp\.(\w+)` \| (.*) \|$", page, re.M))
    assert set(rows) == set(NAMESPACES), rows
    for namespace, cell in rows.items():
        assert re.findall(r"`(\w+)`", cell) == sorted(getattr(dcp, namespace).__all__), namespace
    for name in dcp._MOVED:
        assert f"`{name}`" in page or name in ("GroupPlan", "MicroBatch", "Schedule", "StepPlan", "CheckpointInfo",
                                               "checkpoint_path", "latest_checkpoint", "load_checkpoint",
                                               "save_checkpoint", "RankMismatchError", "RankTimeoutError",
                                               "PeerFailureError", "PlanningError", "PlanMismatchError",
                                               "ParametersOutsideGraphs", "CheckFailed", "CannotPack"), name


def test_the_guide_and_examples_use_no_moved_name():
    pattern = re.compile(r"(?<![\w.])dcp\.(" + "|".join(dcp._MOVED) + r")\b")
    paths = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "examples").glob("*.py"))]
    offenders = [f"{path.relative_to(REPO)}: dcp.{match}" for path in paths
                 for match in pattern.findall(path.read_text()) if path.name != "api.md"]
    assert not offenders, offenders
