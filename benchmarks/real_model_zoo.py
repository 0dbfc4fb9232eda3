"""Real-model zoo report: does sequence sharding hold on the real ``diffusers`` and ``transformers``
models, and does it stay exact?

Every case of ``tests/real_models.py`` (tiny random configs, nothing downloaded) is compiled with
``torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager", "sp_size": 2})`` on
a 2-rank gloo world, the same worker as ``tests/test_real_model_zoo.py``: ``dcp.explain`` gives the
sharding record (attention sites under Ulysses' all-to-all, mid-graph gathers and their reasons,
whole-graph fallbacks), then forward+backward parity with eager on the full batch (fp32, outputs
and SP-group-summed gradients, ``rtol = atol = 1e-4``), at an odd and an even token count.

Cases run one at a time, each in its own process world with a timeout; failures and exceptions
are recorded and the run goes on. The table is rewritten after every case (``--resume`` skips
the cases already in the JSON file, so an interrupted run can continue):

    PYTHONPATH=. python benchmarks/real_model_zoo.py                 # every case, ~1-2 h on 2 CPU cores
    PYTHONPATH=. python benchmarks/real_model_zoo.py --quick         # the cases not marked slow
    PYTHONPATH=. python benchmarks/real_model_zoo.py --cases llama-sdpa,wan --out /tmp/zoo.md
    PYTHONPATH=. python benchmarks/real_model_zoo.py --render        # rebuild the .md from the .json

``--world-size 1`` runs the same parity at SP 1 (no sharding): a check of the zoo itself (every
case must match eager there), not of the sharding.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # tests/real_models.py: the zoo's cases (not shipped)

import real_models as rm  # noqa: E402
from run_description import library_version, machine  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

ROOT = Path(__file__).resolve().parent.parent

RESULTS = Path(__file__).resolve().parent / "results"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _join_lengths(values: list[str]) -> str:
    return values[0] if len(set(values)) == 1 else " / ".join(values)


def _parity(row: dict[str, Any]) -> str:
    if row["parity_ok"] is None:
        return "-"
    if row["max_error"] is None:
        return "FAIL"
    error = "nan/inf" if row["max_error"] == float("inf") else f"{row['max_error']:.0e}"
    return f"{'ok' if row['parity_ok'] else 'FAIL'} {error}"


def _reasons(rows: list[dict[str, Any]]) -> str:
    merged: collections.Counter = collections.Counter()
    for row in rows[:1]:  # the lengths share one graph: list the first length's reasons
        merged.update(row["gather_reasons"])
    return "; ".join(f"{reason} x{count}" for reason, count in merged.most_common())


def _eager_sdpa(row: dict[str, Any]) -> str:
    """``+N eager`` when N of the eager forward's SDPA calls ran outside the compiled graphs."""
    eager, graphs = row.get("eager_sdpa_calls"), row.get("graph_sdpa_calls")
    return f" +{eager - graphs} eager" if eager is not None and graphs is not None and eager > graphs else ""


def case_line(rows: list[dict[str, Any]], regions: bool = False) -> str:
    """One table row; ``regions``: with the count of regions that ran uncompiled (the goal is 0)."""
    first = rows[0]
    tokens = ", ".join(str(row["tokens"] or row["requested"]) for row in rows)
    parity = _join_lengths([_parity(row) for row in rows])
    sites = _join_lengths([f"{row['sites_covered']}/{row['attention_sites']}" + _eager_sdpa(row) for row in rows])
    gathers = _join_lengths([str(row["gathers"]) for row in rows]) + f" (≤{first['budget']})"
    reasons = _reasons(rows)
    if any(row["fallbacks"] for row in rows):
        fallback = next(row["fallbacks"][0] for row in rows if row["fallbacks"])
        reasons = (reasons + "; " if reasons else "") + f"UNSHARDED: {fallback[:200]}"
    errors = []
    for row in rows:
        if row["error"] and row["error"] not in errors:
            errors.append(row["error"])
    error = " / ".join(e[:220] for e in errors)
    where = next((row["error_where"] for row in rows if row.get("error_where")), "")
    if where:
        error += f" (at {where})"
    verdict = "pass" if not any(row["failures"] for row in rows) else "FAIL"
    seconds = rows[0].get("world_seconds") or sum(row["seconds"] or 0 for row in rows)
    graphs = str(first["graphs"] or "-")
    if len(rows) > 1 and set(rows[1]["graph_ids"]) - set(first["graph_ids"]):
        graphs += " +retrace"
    uncompiled = ""
    if regions:
        recorded = any("uncompiled_regions" in row for row in rows)
        uncompiled = f" {len({r for row in rows for r in row.get('uncompiled_regions', [])}) if recorded else '-'} |"
    return (f"| {first['model']} | {first['family']} | {tokens} | {verdict} | {parity} | {sites} | {gathers} "
            f"| {_cell(reasons)} | {graphs} |{uncompiled} {_cell(error)} | {seconds:.0f} |")


def _normalise(text: str) -> str:
    """A failure message without the numbers and names that differ between models."""
    text = re.sub(r"graph \d+ sp=\S+", "graph", text)
    text = re.sub(r"\bs\d+\b", "sN", text)  # symbolic sizes: s18, s42...
    text = re.sub(r"\b\d+(\.\d+)?(e-?\d+)?\b", "N", text)
    text = re.sub(r"'[^']*'", "'…'", text)
    return text[:200]


def mechanisms(by_case: dict[str, list[dict[str, Any]]]) -> list[tuple[str, str, list[str]]]:
    """(kind, mechanism, cases) for every distinct failure mechanism, most cases first."""
    groups: dict[tuple[str, str], set[str]] = collections.defaultdict(set)
    for name, rows in by_case.items():
        for row in rows:
            for reason in row["gather_reasons"]:
                if row["gathers"] > row["budget"]:
                    groups[("gather over budget", reason)].add(name)
            for fallback in row["fallbacks"]:
                groups[("whole graph unsharded", _normalise(fallback.split(":")[0] if len(fallback) > 120 else fallback))].add(name)
            for site in row["unsharded"]:
                groups[("attention site unsharded", _normalise(site.split(": ", 1)[-1]))].add(name)
            if row["error"]:
                key = _normalise(row["error"])
                if row.get("error_where"):
                    key += f" (at {row['error_where'].split(' (')[0].rsplit(':', 1)[0]})"
                groups[("exception", key)].add(name)
            for failure in row["failures"]:
                if "SDPA calls ran outside the compiled graphs" in failure:
                    groups[("attention in eager code", "SDPA calls after a graph break, outside every compiled graph")].add(name)
                if failure.startswith("no attention found"):
                    groups[("no attention found", "no attention site in any SP>1 graph")].add(name)
                if failure.startswith("parity:") and not row["error"]:
                    kind = ("parity: outputs" if " output" in failure else "parity: gradients")
                    if "eager only" in failure or "compiled only" in failure:
                        kind += " missing on one side"
                    groups[(kind, re.sub(r":.*", "", _normalise(failure.split("parity: ", 1)[1])))].add(name)
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[0]))
    return [(kind, mechanism, sorted(cases)) for (kind, mechanism), cases in ordered]


REGIONS_OPTION = ', "regions": True'


def _flags(meta: dict[str, Any]) -> str:
    """The command-line flags of a run other than the default one (and where it writes)."""
    if meta.get("inner", "eager") == "eager" and not meta.get("regions"):
        return ""
    return (f" --inner {meta.get('inner', 'eager')}" + (" --regions" if meta.get("regions") else "")
            + f" --out benchmarks/results/{meta.get('out_name', 'real_model_zoo.md')}")


def render(by_case: dict[str, list[dict[str, Any]]], meta: dict[str, Any]) -> str:
    all_rows = [row for rows in by_case.values() for row in rows]
    total = rm.totals(all_rows) if all_rows else {}
    lines = [
        "# Real-model zoo: sharding and parity on real diffusers / transformers models",
        "",
        f"Library: {meta.get('library', '?')}. Machine: {meta.get('machine', '?')}. Run: {meta.get('date', '?')}, "
        f"world size {meta.get('world_size', 2)} (gloo), inner compiler `{meta.get('inner', 'eager')}`"
        + (", regional compilation (`\"regions\": True`)" if meta.get("regions") else "")
        + f", fp32, parity rtol = atol = {rm.RTOL:g}.",
        "",
        (f"Regenerate: `PYTHONPATH=. python benchmarks/real_model_zoo.py{_flags(meta)}` (`--quick` for the cases not "
         "marked slow; `--render` rebuilds this file from its JSON)." if meta.get("world_size", 2) != 1 else
         "Regenerate: `PYTHONPATH=. python benchmarks/real_model_zoo.py --world-size 1 --out "
         "benchmarks/results/real_model_zoo_sp1.md`."),
        "",
        f"Each case is compiled once (`torch.compile(model, backend=\"dcp\", dynamic=True, options={{\"inner\": \"{meta.get('inner', 'eager')}\", "
        f"\"sp_size\": {meta.get('world_size', 2)}{REGIONS_OPTION if meta.get('regions') else ''}}})`) and run at an odd and an even token count (image/video DiTs: patches after patchify; ViT: "
        "patches + CLS). A case passes when, for every SP>1 variant with attention, nothing fell back to running the "
        "whole graph unsharded, every attention site ran sharded, the mid-graph gathers stay within the case's budget "
        "(0 for LMs, encoders and token-in/token-out DiTs; 1 for the unpatchify of a latent-in DiT; stated per case in "
        "`tests/real_models.py`), and outputs and SP-summed gradients match eager.",
        "",
        "Columns: *sites* = attention sites run sharded / attention sites found (summed over the graphs of one call; "
        "*+N eager*: N of the eager forward's SDPA calls ran outside every compiled graph, after graph breaks, so "
        "unsharded: a failure); "
        "*gathers* = mid-graph all-gathers (≤ budget) with their recorded reasons (first length); *graphs* = graphs "
        "the dcp backend compiled for one call (more than one: graph breaks; *+retrace*: the second length was "
        "traced again); *s* = seconds for the case's process world (both lengths, including compilation).",
        "",
    ]
    if total:
        lines += [
            f"**Totals:** {total['cases_passing']}/{total['cases']} cases pass; of {total['runs']} runs (case x length): "
            f"parity ok {total['parity_ok']}, every attention site sharded {total['fully_sharded']}, gathers within "
            f"budget {total['within_budget']}, exceptions {total['errors']}; attention sites sharded "
            f"{total['sites_covered']}/{total['sites']}.",
            "",
        ]
    recorded = any("uncompiled_regions" in row for rows in by_case.values() for row in rows)
    if meta.get("regions") and not recorded:
        lines += ["**Regions run uncompiled:** not recorded by this run (rows from before the report kept them).", ""]
    elif meta.get("regions"):
        uncompiled = {name: sorted({reason for row in rows for reason in row.get("uncompiled_regions", [])})
                      for name, rows in by_case.items()}
        uncompiled = {name: reasons for name, reasons in uncompiled.items() if reasons}
        lines += [f"**Regions run uncompiled** (correct, not compiled: `VariantRecord.uncompiled_regions`): "
                  f"{sum(len(r) for r in uncompiled.values())} in {len(uncompiled)} case(s)"
                  + ("." if not uncompiled else ": " + "; ".join(f"{name}: {' / '.join(reasons)[:300]}"
                                                               for name, reasons in sorted(uncompiled.items()))), ""]
    regions = bool(meta.get("regions"))
    lines += [
        "| model | family | tokens | verdict | parity (max abs err) | sites | gathers | gather reasons / fallback | graphs | "
        + ("uncompiled regions | " if regions else "") + "error | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if regions else ""),
    ]
    for name in sorted(by_case, key=lambda n: (by_case[n][0]["library"], by_case[n][0]["family"], n)):
        lines.append(case_line(by_case[name], regions))
    groups = mechanisms(by_case)
    if groups:
        lines += ["", "## Failures by mechanism", "", "| kind | mechanism | cases |", "|---|---|---|"]
        for kind, mechanism, cases in groups:
            lines.append(f"| {kind} | {_cell(mechanism)} | {len(cases)}: {', '.join(cases)} |")
    if meta.get("world_size", 2) == 1:
        lines += ["", "At world size 1 nothing is sharded (no SP>1 variant): this run checks the zoo and the "
                  "unsharded path of the backend; sites and gathers are 0 by construction."]
    lines += ["", "## Not in the zoo", "", "| diffusers class | why |", "|---|---|"]
    for name, why in sorted(rm.SKIPPED.items()):
        lines.append(f"| {name} | {_cell(why)} |")
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--quick", action="store_true", help="only the cases not marked slow")
    parser.add_argument("--timeout", type=float, default=rm.CASE_TIMEOUT, help="seconds per case (default %(default)s)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "real_model_zoo.md")
    parser.add_argument("--resume", action="store_true", help="keep the cases already in the JSON next to --out")
    parser.add_argument("--render", action="store_true", help="only rebuild the markdown from the JSON")
    parser.add_argument("--inner", default="eager", choices=["eager", "aot_eager", "inductor"],
                        help="the inner compiler (default %(default)s)")
    parser.add_argument("--regions", action="store_true", help="options={'regions': True} (regional compilation)")
    args = parser.parse_args()

    json_path = args.out.with_suffix(".json")
    by_case: dict[str, list[dict[str, Any]]] = {}
    meta = {"library": library_version(), "machine": machine(), "world_size": args.world_size,
            "inner": args.inner, "regions": args.regions, "out_name": args.out.name,
            "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M")}
    if (args.resume or args.render) and json_path.exists():
        saved = json.loads(json_path.read_text())
        by_case = saved["cases"]
        meta = saved.get("meta", meta) if args.render else meta
    if args.render:
        args.out.write_text(render(by_case, meta))
        print(f"wrote {args.out}")
        return

    names = [n for n in args.cases.split(",") if n] or list(rm.CASES)
    unknown = [n for n in names if n not in rm.CASES]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; known: {', '.join(rm.CASES)}")
    if args.quick:
        names = [n for n in names if not rm.CASES[n].slow]
    todo = [n for n in names if n not in by_case]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for index, name in enumerate(todo, 1):
        case_start = time.perf_counter()
        rows = rm.run_case(name, world_size=args.world_size, timeout=args.timeout, inner=args.inner,
                           regions=args.regions)
        for row in rows:  # keep the JSON readable: the head of each traceback is enough to find it
            if row.get("traceback"):
                row["traceback"] = row["traceback"][-3000:]
        by_case[name] = rows
        verdict = "pass" if not any(row["failures"] for row in rows) else "FAIL"
        print(f"[{index}/{len(todo)}] {verdict} {time.perf_counter() - case_start:5.0f}s  "
              + "  ||  ".join(rm.format_row(row) for row in rows), flush=True)
        json_path.write_text(json.dumps({"meta": meta, "cases": by_case}, indent=1, default=str))
        args.out.write_text(render(by_case, meta))
    print(f"{len(todo)} case(s) in {time.perf_counter() - start:.0f}s; wrote {args.out} and {json_path}")


if __name__ == "__main__":
    main()
