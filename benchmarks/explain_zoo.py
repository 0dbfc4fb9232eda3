"""Is ``dcp.explain`` the same on the real-model zoo at two commits? The check a refactor of the
analysis or of the lowerings must pass (issue 35: "dcp.explain output unchanged on the real-model zoo").

Every case of ``tests/real_models.py`` (tiny random configs, nothing downloaded) is compiled with
``torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager", "sp_size": 2,
"regions": False})`` in a one-process fake 2-rank world (``dcp_compile.device_profile.fake_world``:
collectives return at once, so values are meaningless but every compile decision is the one a real
rank 0 makes) and explained at the case's two token counts. One file per case holds what the
compiler decided, with times and dynamo's graph counters taken out so two runs can be compared
byte for byte: ``str(record)``, every node's classification row, and each variant's graph after
every pass.

    PYTHONPATH=. python benchmarks/explain_zoo.py --out /tmp/explain_head
    PYTHONPATH=/tmp/wt python benchmarks/explain_zoo.py --out /tmp/explain_base   # a worktree at the base commit
    python benchmarks/explain_zoo.py --compare /tmp/explain_base /tmp/explain_head \
        --write benchmarks/results/explain_zoo_unchanged.md

The cases come from *this* checkout's ``tests/real_models.py`` whichever ``dcp_compile`` is
imported, so both runs build the same models with the same inputs. Each case runs in its own
process (a fresh dynamo, a timeout); ``--resume`` skips cases whose file exists.
"""

from __future__ import annotations

import argparse
import difflib
import multiprocessing
import re
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # tests/real_models.py: the zoo's cases (not shipped)

OPTIONS = {"inner": "eager", "sp_size": 2, "regions": False}
CASE_TIMEOUT = 900.0

_TIMES = [
    (re.compile(r"\(\d+ ms\)"), "(<t>)"),
    (re.compile(r"compiled in \d+\.\d+s"), "compiled in <t>"),
    (re.compile(r"in \d+\.\d+s, "), "in <t>, "),
]
_GRAPH_ID = re.compile(r"\b(DCP graph|graph) (\d+)\b")


def normalised(text: str) -> str:
    """Times out, and dynamo's global graph counters renumbered in order of first appearance."""
    for pattern, replacement in _TIMES:
        text = pattern.sub(replacement, text)
    numbers: dict[str, int] = {}

    def renumber(match: re.Match) -> str:
        return f"{match.group(1)} G{numbers.setdefault(match.group(2), len(numbers))}"

    return _GRAPH_ID.sub(renumber, text)


def explain_case(name: str) -> str:
    """The compiler's decisions for one case, as text (runs in a child process)."""
    import torch

    import dcp_compile as dcp
    import real_models as rm
    from dcp_compile.device_profile.fake_world import fake_world

    torch.manual_seed(0)
    torch.set_num_threads(1)
    case = rm.CASES[name]
    for setting, value in case.dynamo_config:
        setattr(torch._dynamo.config, setting, value)
    sections: list[str] = [f"# {name} (options {OPTIONS})"]
    with fake_world(2):
        torch._dynamo.reset()
        compiled = torch.compile(case.build(), backend="dcp", dynamic=True, options=dict(OPTIONS))
        for n in case.lengths:
            inputs, tokens = case.make_inputs(n)
            try:
                record = dcp.explain(compiled, **inputs)
            except Exception as exc:  # noqa: BLE001  (an error is an answer to compare, too)
                sections.append(f"## {tokens} tokens: raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                continue
            sections.append(f"## {tokens} tokens\n{record}")
            for graph in record.graphs:
                sections.append(f"### graph {graph.graph_id} classification")
                sections += [repr(row) for row in graph.classification]
                for key, variant in graph.variants.items():
                    for step in variant.passes:
                        sections.append(f"### graph {graph.graph_id} variant {key} after {step.name}\n{step.after or '(not kept)'}")
    return normalised("\n".join(sections)) + "\n"


def _child(name: str, path: str) -> None:
    try:
        text = explain_case(name)
    except Exception:  # noqa: BLE001
        text = f"# {name}\nBUILD/COMPILE FAILED\n{traceback.format_exc(limit=3)}"
    Path(path).write_text(text)


def _revision() -> str:
    """The commit of the ``dcp_compile`` this run imports (the checkout it lives in), and torch's version."""
    import subprocess

    import torch

    import dcp_compile

    checkout = Path(dcp_compile.__file__).resolve().parent.parent
    commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "-C", str(checkout), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return f"dcp_compile at {commit}{' (uncommitted changes)' if dirty else ''}, torch {torch.__version__}"


def run(names: list[str], out: Path, resume: bool, timeout: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "RUN").write_text(f"{_revision()}; run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    context = multiprocessing.get_context("spawn")
    for index, name in enumerate(names, 1):
        path = out / f"{name}.txt"
        if resume and path.exists():
            continue
        start = time.perf_counter()
        process = context.Process(target=_child, args=(name, str(path)))
        process.start()
        process.join(timeout)
        if process.is_alive():
            process.kill()
            path.write_text(f"# {name}\nTIMED OUT after {timeout:.0f}s\n")
        elif not path.exists():
            path.write_text(f"# {name}\nCHILD DIED (exit code {process.exitcode})\n")
        print(f"[{index}/{len(names)}] {name}: {time.perf_counter() - start:.0f}s", flush=True)


def compare(base: Path, head: Path, write: Path | None) -> int:
    names = sorted({p.stem for p in base.glob("*.txt")} | {p.stem for p in head.glob("*.txt")})
    rows, diffs = [], []
    for name in names:
        a, b = base / f"{name}.txt", head / f"{name}.txt"
        if not a.exists() or not b.exists():
            rows.append((name, "missing in " + ("base" if not a.exists() else "head")))
            continue
        left, right = a.read_text().splitlines(), b.read_text().splitlines()
        if left == right:
            rows.append((name, "identical"))
            continue
        diff = list(difflib.unified_diff(left, right, f"base/{name}", f"head/{name}", n=1, lineterm=""))
        changed = sum(1 for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---")))
        rows.append((name, f"differs ({changed} lines)"))
        diffs.append("\n".join(diff[:80]))
    identical = sum(1 for _, verdict in rows if verdict == "identical")

    def described(run_dir: Path) -> str:
        return (run_dir / "RUN").read_text().strip() if (run_dir / "RUN").exists() else str(run_dir)

    report = ["# dcp.explain on the real-model zoo: base against head", "",
              f"Base: {described(base)}. Head: {described(head)}. Options {OPTIONS}, one-process fake world of 2 "
              "ranks, each case at its two token counts; compared: `str(record)`, every node's classification "
              "row and each variant's graph after every pass, with times and dynamo's graph counters taken out "
              "(`benchmarks/explain_zoo.py`).", "",
              f"**{identical}/{len(rows)} cases identical**", "", "| case | explain |", "|---|---|"]
    report += [f"| {name} | {verdict} |" for name, verdict in rows]
    text = "\n".join(report)
    print(text)
    for diff in diffs:
        print("\n" + diff)
    if write:
        write.write_text(text + "\n" + "".join(f"\n```diff\n{diff}\n```\n" for diff in diffs))
    return 0 if identical == len(rows) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write one normalised explain file per case here")
    parser.add_argument("--cases", help="comma-separated case names (default: every case)")
    parser.add_argument("--resume", action="store_true", help="skip cases whose file exists")
    parser.add_argument("--timeout", type=float, default=CASE_TIMEOUT)
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BASE", "HEAD"))
    parser.add_argument("--write", type=Path, help="with --compare: the table and diffs as markdown")
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare, args.write)
    if not args.out:
        parser.error("give --out DIR (run) or --compare BASE HEAD")
    import real_models as rm

    names = args.cases.split(",") if args.cases else list(rm.CASES)
    run(names, args.out, args.resume, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
