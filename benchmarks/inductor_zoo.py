"""Which diffusers DiTs of the real-model zoo compile with Inductor under dcp, and which fall back?

Each diffusers case of ``tests/real_models.py`` is compiled with
``torch.compile(model, backend="dcp", dynamic=True, options={"inner": "inductor", "sp_size": 2})``
in its own process, on a 2-rank *fake* process group (collectives compile but move no data: this is
a compile survey, parity is ``tests/test_inductor_zoo.py``'s job on gloo), and run forward and
backward at each of the case's two token counts, so both the forward and the (lazily compiled)
backward meet Inductor, and the second token count runs what was compiled at the first (a compiled
backward that asserted the first length's strides failed there). Per case it records every variant whose inner compiler fell back
(``VariantRecord.inner_fallback``, the line ``dcp.explain`` prints) and any exception.

    PYTHONPATH=. python benchmarks/inductor_zoo.py                      # every diffusers DiT
    PYTHONPATH=. python benchmarks/inductor_zoo.py --cases sana,flux --out /tmp/x.md
    PYTHONPATH=. python benchmarks/inductor_zoo.py --no-patch           # torch's Inductor as shipped
    PYTHONPATH=. python benchmarks/inductor_zoo.py --regions            # compiled in regions

``--no-patch`` sets ``DCP_INDUCTOR_PATCHES=0`` (dcp_compile/compiler/workarounds/inductor_patches.py, whose
fixes are on by default), so the run shows what torch's own Inductor does. Inductor on CPU generates
and compiles C++: 3 to 25 minutes per case on a loaded 2-core machine; run one case at a time. The table is rewritten after every case; ``--resume``
keeps the cases already in the JSON file (``--resume --redo --cases a,b`` runs a and b again). A
variant's fallback is read after the runs: a backward compiled at the first backward may fall back
only then (``inner_compilers.backward_without_inductor``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # tests/real_models.py: the zoo's cases (not shipped)
RESULTS = Path(__file__).resolve().parent / "results"


def survey_one(name: str, tokens: int | None, rank: int = 0, regions: bool = False) -> dict[str, Any]:
    """Compile and run one case on a fake 2-rank world as ``rank`` (the ranks' chunk bounds differ,
    and so do the size expressions Inductor meets); ``regions``: compiled in regions, whose
    uncompiled ones (``VariantRecord.uncompiled_regions``) the row counts."""
    import logging
    import traceback

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import dcp_compile as dcp
    import real_models as rm

    torch.set_num_threads(1)
    case = rm.CASES[name]
    for setting, value in case.dynamo_config:
        setattr(torch._dynamo.config, setting, value)
    lengths = (tokens,) if tokens else tuple(case.lengths)
    row: dict[str, Any] = {"model": name, "rank": rank, "class": case.model_class, "tokens": None, "fallbacks": [],
                           "error": None, "where": None, "seconds": None, "lengths_run": [], "regions": regions,
                           "uncompiled_regions": []}
    warnings: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("dcp_compile.compiler.inner_compilers").addHandler(Catch(logging.WARNING))
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
    start = time.perf_counter()
    record = None
    try:
        model = case.build()
        compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "inductor", "sp_size": 2,
                                                                                "regions": regions})
        inputs, first = case.make_inputs(lengths[0])
        row["tokens"] = first
        record = dcp.explain(compiled, **inputs)
        for n in lengths:  # the second runs the forward and backward compiled at the first
            inputs, actual = case.make_inputs(n)
            case.loss_of(compiled(**inputs)).backward()
            row["lengths_run"].append(actual)
    except Exception as error:  # noqa: BLE001 - the survey records every failure
        row["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300] if str(error).strip() else ''}"
        frames = traceback.extract_tb(error.__traceback__)
        row["where"] = f"{frames[-1].filename.split('site-packages/')[-1]}:{frames[-1].lineno} ({frames[-1].name})" if frames else None
        row["traceback"] = traceback.format_exc()[-4000:]
    row["seconds"] = round(time.perf_counter() - start, 1)
    # Read after the runs: a backward is compiled at the first backward, and may fall back then.
    for graph in record.graphs if record is not None else []:
        for variant in graph.variants.values():
            if variant.inner_fallback:
                row["fallbacks"].append(f"graph {graph.graph_id} {variant.variant}: {variant.inner_fallback}")
            row["uncompiled_regions"] += [f"graph {graph.graph_id} {variant.variant}: {why}"
                                          for why in variant.uncompiled_regions]
    row["fallback_warnings"] = len(warnings)
    from dcp_compile.compiler.workarounds.inductor_patches import rescued_stride_sorts, symbolic_saved_strides, unknown_value_ranges

    row["patched_sorts"] = rescued_stride_sorts()  # > 0: torch's Inductor as shipped would have failed
    row["unknown_ranges"] = unknown_value_ranges()  # > 0: the second fix was needed too
    row["symbolic_strides"] = symbolic_saved_strides()  # forward outputs handed to the backward symbolically
    return row


def render(rows: list[dict[str, Any]], patched: bool, regions: bool = False) -> str:
    import torch

    fallbacks = [row["model"] for row in rows if row["fallbacks"] and not row["error"]]
    unfinished = [row["model"] for row in rows if row["error"] and row["error"].startswith("timeout")]
    errors = [row["model"] for row in rows if row["error"] and row["model"] not in unfinished]
    import real_models as rm

    surveyed = {row["model"] for row in rows}
    not_run = [case.name for case in rm.CASES.values() if case.library == "diffusers" and case.name not in surveyed]
    lines = [
        "# Inductor on the zoo's diffusers DiTs under dcp (SP 2, fake world, CPU"
        + (", compiled in regions)" if regions else ")"),
        "",
        f"Measured {datetime.date.today()} with torch {torch.__version__} on CPU, "
        f"dcp's Inductor patches {'on' if patched else 'off (DCP_INDUCTOR_PATCHES=0)'}; "
        "`PYTHONPATH=. python benchmarks/inductor_zoo.py"
        f"{'' if patched else ' --no-patch'}{' --regions' if regions else ''}`. Each case: compile with `inner=\"inductor\"`, SP 2 on a "
        "fake 2-rank process group, forward and backward at each token count run (compile survey; "
        "parity on gloo is `tests/test_inductor_zoo.py`).",
        "",
        f"**{len(rows)} runs: {len(rows) - len(fallbacks) - len(errors) - len(unfinished)} compile with Inductor, "
        f"{len(fallbacks)} fall back to aot_eager ({', '.join(fallbacks) or 'none'}), "
        f"{len(errors)} raise ({', '.join(errors) or 'none'}), {len(unfinished)} did not finish in time "
        f"({', '.join(unfinished) or 'none'}).**",
        "",
        f"Not run yet: {', '.join(not_run) or 'none'}.",
        "",
        "Patched sorts: Inductor stride sorts that dcp's patch (dcp_compile/compiler/workarounds/inductor_patches.py, "
        "pytorch/pytorch#172204) redid with the shape environment; more than 0 means torch's Inductor as "
        "shipped fails on this model (a forward sort: the variant falls back to aot_eager; a backward one: "
        "the first backward raises). Unknown ranges: negative powers whose value range the second fix left "
        "unknown (before it, the backward failed on rank 1 of Sana). Symbolic strides: forward outputs whose "
        "strides dcp handed to the backward as expressions (the third fix; '-': a run before it).",
        "",
        *([f"**Regions run uncompiled** (correct, not compiled): "
           f"{sum(len(row.get('uncompiled_regions') or []) for row in rows)} in "
           f"{sum(1 for row in rows if row.get('uncompiled_regions'))} case(s) (goal 0).", ""] if regions else []),
        "| model | class | rank | tokens run | Inductor | patched sorts | unknown ranges | symbolic strides | seconds |"
        + (" uncompiled regions |" if regions else "") + " revision |",
        "|---|---|---|---|---|---|---|---|---|" + ("---|" if regions else "") + "---|",
    ]
    for row in rows:
        if row["error"]:
            status = f"ERROR {row['error']}" + (f" at {row['where']}" if row["where"] else "")
        elif row["fallbacks"]:
            status = f"FALLBACK in {len(row['fallbacks'])} variant(s): {row['fallbacks'][0][:200]}"
        else:
            status = "ok"
        status += f" ({row['note']})" if row.get("note") else ""
        run = ", ".join(str(n) for n in row.get("lengths_run") or []) or row["tokens"]
        lines.append(f"| {row['model']} | {row['class']} | {row.get('rank', 0)} | {run} | {status.replace('|', '/')} | "
                     f"{row.get('patched_sorts', '-')} | {row.get('unknown_ranges', '-')} | "
                     f"{row.get('symbolic_strides', '-')} | {row['seconds']} |"
                     + (f" {len(row.get('uncompiled_regions') or [])} |" if regions else "")
                     + f" {row.get('revision', '-')} |")
    return "\n".join(lines) + "\n"


def source_revision() -> str:
    """The commit the survey runs, marked ``+changes`` where dcp_compile/ differs from it."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    changed = subprocess.run(["git", "status", "--porcelain", "--", "dcp_compile"], capture_output=True, text=True,
                             cwd=ROOT).stdout.strip()
    return (head or "unknown") + ("+changes" if changed else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=None, help="comma-separated case names (default: every diffusers case)")
    parser.add_argument("--out", default=str(RESULTS / "inductor_zoo_cpu.md"))
    parser.add_argument("--no-patch", action="store_true", help="torch's Inductor as shipped (DCP_INDUCTOR_PATCHES=0)")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--redo", action="store_true",
                        help="with --resume: run the --cases again, replacing their rows (default: keep them)")
    parser.add_argument("--render", action="store_true", help="rewrite the table from the JSON file only")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--rank", type=int, default=0, help="the fake world's rank this process plays (0 or 1)")
    parser.add_argument("--jobs", type=int, default=1, help="cases compiled at once, each in its own process")
    parser.add_argument("--regions", action="store_true",
                        help="compile in regions (options={'regions': True}); default out: inductor_zoo_regions_cpu.md")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("ROW " + json.dumps(survey_one(args.one, None, args.rank, args.regions)))
        return
    import real_models as rm

    names = args.cases.split(",") if args.cases else [c.name for c in rm.CASES.values() if c.library == "diffusers"]
    out = Path(args.out)
    if args.regions and args.out == parser.get_default("out"):
        out = RESULTS / "inductor_zoo_regions_cpu.md"
    json_path = out.with_suffix(".json")
    rows: list[dict[str, Any]] = json.loads(json_path.read_text()) if (args.resume or args.render) and json_path.exists() else []
    if args.render:
        out.write_text(render(rows, not args.no_patch, args.regions))
        return
    if args.redo:
        rows = [row for row in rows if row["model"] not in names]
    done = {row["model"] for row in rows}
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    env.pop("DCP_INDUCTOR_PATCHES", None)  # dcp's fixes are on by default
    if args.no_patch:
        env["DCP_INDUCTOR_PATCHES"] = "0"
    def survey(name: str) -> dict[str, Any]:
        start = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, __file__, "--one", name, "--rank", str(args.rank)]
                                  + (["--regions"] if args.regions else []), capture_output=True, text=True,
                                  timeout=args.timeout, env=env, cwd=ROOT)
            found = [line[4:] for line in proc.stdout.splitlines() if line.startswith("ROW ")]
            if found:
                return json.loads(found[-1])
            last = proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else ""
            return {"model": name, "class": rm.CASES[name].model_class, "tokens": None, "fallbacks": [],
                    "error": f"process exited {proc.returncode}: {last}", "where": None,
                    "seconds": round(time.perf_counter() - start, 1)}
        except subprocess.TimeoutExpired:
            return {"model": name, "class": rm.CASES[name].model_class, "tokens": None, "fallbacks": [],
                    "error": f"timeout after {args.timeout:.0f} s", "where": None, "seconds": args.timeout}

    order = {name: index for index, name in enumerate(rm.CASES)}  # the zoo's order, whatever ran first
    revision = source_revision()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for row in pool.map(survey, [name for name in names if name not in done]):
            row["revision"] = revision
            rows.append(row)
            rows.sort(key=lambda r: order.get(r["model"], len(order)))
            status = "ERROR " + row["error"] if row["error"] else ("FALLBACK" if row["fallbacks"] else "ok")
            print(f"{row['model']}: {status}, {row.get('patched_sorts')} patched sorts ({row['seconds']} s)", flush=True)
            json_path.write_text(json.dumps(rows, indent=1))
            out.write_text(render(rows, not args.no_patch, args.regions))


if __name__ == "__main__":
    main()
