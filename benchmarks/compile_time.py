"""Time to the first training step: ``backend="dcp"`` against plain ``torch.compile``.

For a tiny Hugging Face Llama and a small diffusers DiT (the real-model zoo's ``llama-sdpa`` and
``dit`` cases), each with the same inner compiler on both sides:

* **plain**: ``torch.compile(model, dynamic=True, backend=<inner>)``; the first forward and
  backward, from a cold compile cache.
* **dcp**: ``torch.compile(model, backend="dcp", dynamic=True, options={"inner": <inner>})`` on a
  one-process fake world of 2 ranks (collectives move no data: this is the compile work, not a
  distributed run), from its own cold cache. The first step runs the SP-2 variant; each further
  variant (SP 1, SP 2 with full recompute, SP 1 with attention recompute) is timed at its first
  call, as a training run meets it, with the caches the earlier variants warmed.

Every configuration runs in a fresh subprocess with fresh ``TORCHINDUCTOR_CACHE_DIR`` and
``TRITON_CACHE_DIR``, one torch thread, and ``TORCHINDUCTOR_COMPILE_THREADS=1`` (Inductor's C++
compiles then run as the process's own children, not in a worker pool). A second step is timed too
(no compile). Results are *measured* on the machine that runs it, which the report names.

The ratios are of **CPU time**: the process's own plus its finished children's (the C++
compiler), which other jobs on a shared machine do not move. The wall clock is reported beside
it: on this project's shared 2-core machine it moved single timings by up to 10x, so a wall-clock
ratio of two runs minutes apart said little about dcp's own cost.

Each timed call is split into stages: Dynamo's bytecode trace, AOTAutograd (metadata, joint
trace, joint passes, partition) and Inductor (``compile_fx_inner``: lowering, code generation, the
C++ compile) from ``torch._dynamo.utils.compilation_time_metrics`` (what ``compile_times()``
prints), dcp's ATen re-trace with its analysis and its variant passes from dcp's own log records;
"other" is the rest of the call (running the step, cache look-ups, what no timer covers).
Beside the stages, each call reports the CPU seconds of Inductor's C++ compiles (its children) and
how many C++ kernels it compiled of those its generated code asked for: a kernel whose source an
earlier variant compiled comes from Inductor's code cache, so the two counts measure how much
compiled code a further variant shares with the ones before it.

    PYTHONPATH=. python benchmarks/compile_time.py --inner inductor aot_eager \\
        --out benchmarks/results/compile_time.md

``--regions`` runs dcp with ``options={"regions": True}`` (regional compilation: token-local regions
compiled once and shared by every variant that repeats them); each variant then also records how many
regions the process had compiled and reused by its end:

    PYTHONPATH=. python benchmarks/compile_time.py --regions --inner inductor aot_eager \\
        --out benchmarks/results/compile_time_regions.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # tests/real_models.py: the zoo's cases (not shipped)
MODELS = {"llama": ("llama-sdpa", 64), "dit": ("dit", 64)}  # zoo case, about this many tokens
# Deeper builds of a zoo case's model (its inputs and loss): what compile time does with depth.
DEEPER = {"llama8": ("llama-sdpa", 64, 8)}  # (zoo case, tokens, decoder layers)


def deeper_case(model_name: str):
    """The zoo case with its Hugging Face config's ``num_hidden_layers`` raised (``DEEPER``)."""
    import dataclasses

    from real_models import CASES, _LLAMA_LIKE, _transformers

    case_name, _, layers = DEEPER[model_name]
    factory = _transformers("LlamaForCausalLM", "LlamaConfig", "sdpa", **dict(_LLAMA_LIKE, num_hidden_layers=layers))
    return dataclasses.replace(CASES[case_name], factory=factory)
DCP_VARIANTS = ((2, "none"), (1, "none"), (2, "full"), (1, "attention"))  # the first is the first step


def child_cpu_seconds() -> float:
    """CPU time of this process's finished children: Inductor's C++ compiles (one thread)."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return children.ru_utime + children.ru_stime


def cpu_seconds() -> float:
    """CPU time of this process and of its children that have finished (the C++ compiles)."""
    return time.process_time() + child_cpu_seconds()


class CppKernels:
    """C++ kernels Inductor asked for, and how many it compiled (the rest its code cache served).

    Inductor's CPU kernels go through ``AsyncCompile.cpp_pybinding``, keyed by their source in
    ``CppPythonBindingsCodeCache``: a kernel whose source an earlier variant compiled costs no
    C++ compile. Counting both says how much compiled code variants share.
    """

    def __init__(self) -> None:
        from torch._inductor.async_compile import AsyncCompile

        self.requested = 0
        original = AsyncCompile.cpp_pybinding
        counter = self

        def counted(compiler, argtypes, source_code):
            counter.requested += 1
            return original(compiler, argtypes, source_code)

        AsyncCompile.cpp_pybinding = counted

    @staticmethod
    def compiled() -> int:
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        return len(CppPythonBindingsCodeCache.cache)


def _step(compiled, inputs, loss_of) -> float:
    start = time.perf_counter()
    loss = loss_of(compiled(**inputs))
    loss.backward()
    return time.perf_counter() - start


# Stages of torch's compile, by the names torch times them under (compilation_time_metrics).
TORCH_STAGES = {
    "dynamo": ("bytecode_tracing",),
    "AOTAutograd": ("aot_collect_metadata", "aot_trace_joint_graph", "_recursive_joint_graph_passes",
                    "min_cut_rematerialization_partition"),
    "Inductor": ("compile_fx_inner",),
}


# Inductor's FX graph cache and AOTAutograd's cache: hits and misses during a timed call.
CACHE_COUNTERS = (("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"),
                  ("aot_autograd", "autograd_cache_hit"), ("aot_autograd", "autograd_cache_miss"))


class StageClock:
    """Seconds per stage spent during one timed call (see the module docstring)."""

    def __init__(self) -> None:
        import logging

        self.dcp_records: list[logging.LogRecord] = []
        self.kernels = CppKernels()
        clock = self

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                clock.dcp_records.append(record)

        for name, level in (("dcp_compile.compiler.passes.pipeline", logging.DEBUG),
                            ("dcp_compile.compiler.progress", logging.INFO)):
            logger = logging.getLogger(name)
            logger.setLevel(level)
            logger.addHandler(Keep())
            logger.propagate = False

    @staticmethod
    def _torch_totals() -> dict[str, float]:
        from torch._dynamo.utils import compilation_time_metrics

        return {stage: sum(sum(compilation_time_metrics.get(key, ())) for key in keys)
                for stage, keys in TORCH_STAGES.items()}

    @staticmethod
    def _cache_counts() -> dict[str, int]:
        from torch._dynamo.utils import counters

        return {f"{group}.{name}": counters[group][name] for group, name in CACHE_COUNTERS}

    def timed(self, call) -> tuple[float, dict[str, float]]:
        before, first_record = self._torch_totals(), len(self.dcp_records)
        counts_before = self._cache_counts()
        kernels_before = (self.kernels.requested, self.kernels.compiled())
        cpu_before, child_before = cpu_seconds(), child_cpu_seconds()
        seconds = call()
        self.cpu = cpu_seconds() - cpu_before
        self.compiler_cpu = child_cpu_seconds() - child_before  # the C++ compiles
        self.cpp_kernels = {"requested": self.kernels.requested - kernels_before[0],
                            "compiled": self.kernels.compiled() - kernels_before[1]}
        after = self._torch_totals()
        self.cache_hits = {key: value - counts_before[key] for key, value in self._cache_counts().items()}
        stages = {stage: after[stage] - before[stage] for stage in TORCH_STAGES}
        analysis = passes = 0.0
        for record in self.dcp_records[first_record:]:
            if record.name.endswith("pipeline") and record.msg.startswith("dcp: %s [%s] took"):
                name, variant, pass_seconds = record.args
                if variant == "analysis":
                    continue  # inside the analysed-graph line below
                passes += pass_seconds
            elif record.name.endswith("progress") and str(record.args[0]).startswith("dcp: analysed graph"):
                analysis += float(str(record.args[0]).rsplit(" in ", 1)[1].rstrip("s"))
        if analysis or passes:
            stages["dcp ATen re-trace + analysis"] = analysis
            stages["dcp variant passes"] = passes
        stages["other"] = seconds - sum(stages.values())
        return seconds, {stage: round(value, 2) for stage, value in stages.items()}


def worker(model_name: str, mode: str, inner: str, regions: bool = False) -> dict:
    """One configuration in this process; returns the timings."""
    import torch

    torch.set_num_threads(max(1, int(os.environ.get("COMPILE_TIME_THREADS", "1"))))
    from real_models import CASES

    if model_name in DEEPER:
        case_name, tokens, _ = DEEPER[model_name]
        case = deeper_case(model_name)
    else:
        case_name, tokens = MODELS[model_name]
        case = CASES[case_name]
    model = case.build()
    if getattr(getattr(model, "config", None), "use_cache", False):
        model.config.use_cache = False  # training keeps no K/V cache (dcp warns, and gathers one, otherwise)
    inputs, actual = case.make_inputs(tokens, seed=0)
    later_inputs, _ = case.make_inputs(tokens + 6, seed=1)  # another length: no recompile expected
    result = {"model": model_name, "case": case_name, "mode": mode, "inner": inner, "tokens": actual,
              "torch": torch.__version__, "load_average_1m": os.getloadavg()[0]}  # a shared machine's other work
    clock = StageClock()
    if mode == "plain":
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=inner, dynamic=True)
        result["first_step_s"], result["first_step_stages"] = clock.timed(lambda: _step(compiled, inputs, case.loss_of))
        result["first_step_cpu_s"] = clock.cpu
        result["first_step_cxx_cpu_s"], result["first_step_cpp_kernels"] = clock.compiler_cpu, clock.cpp_kernels
        result["next_step_s"] = _step(compiled, later_inputs, case.loss_of)
        return result

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import dcp_compile as dcp

    os.environ.setdefault("DCP_PROGRESS", "0")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": inner, "regions": regions})
        result["regions"] = regions
        from dcp_compile.compiler.regions import REGION_CACHE
        variants = []
        for sp_size, recompute in DCP_VARIANTS:
            with dcp.use(dcp.Variant(sp_size, recompute)):
                seconds, stages = clock.timed(lambda: _step(compiled, inputs, case.loss_of))
            variants.append({"variant": f"sp={sp_size}/recompute={recompute}", "first_call_s": seconds,
                             "first_call_cpu_s": clock.cpu, "first_call_cxx_cpu_s": clock.compiler_cpu,
                             "first_call_cpp_kernels": clock.cpp_kernels, "stages": stages, "caches": clock.cache_hits,
                             "regions_compiled": REGION_CACHE.compiles, "regions_reused": REGION_CACHE.reuses})
        with dcp.use(dcp.Variant(*DCP_VARIANTS[0])):
            result["next_step_s"] = _step(compiled, later_inputs, case.loss_of)
        result["first_step_s"] = variants[0]["first_call_s"]
        result["first_step_stages"] = variants[0]["stages"]
        result["first_step_cpu_s"] = variants[0]["first_call_cpu_s"]
        result["first_step_cxx_cpu_s"] = variants[0]["first_call_cxx_cpu_s"]
        result["first_step_cpp_kernels"] = variants[0]["first_call_cpp_kernels"]
        result["variants"] = variants
    finally:
        dist.destroy_process_group()
    return result


def run_isolated(model_name: str, mode: str, inner: str, timeout: float, regions: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="compile_time_") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor", "TRITON_CACHE_DIR": f"{cache}/triton",
               "TORCHINDUCTOR_COMPILE_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, __file__, "--worker", model_name, mode, inner] + (["--regions"] if regions else [])
        started = time.perf_counter()
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"model": model_name, "mode": mode, "inner": inner, "error": f"over {timeout:.0f}s"}
        wall = time.perf_counter() - started
    if done.returncode != 0:
        last = [line for line in done.stderr.strip().splitlines() if line.strip()][-1:] or ["?"]
        return {"model": model_name, "mode": mode, "inner": inner, "error": last[0][:300]}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = wall
    return result


def markdown(results: list[dict], machine: str) -> str:
    loads = [r["load_average_1m"] for r in results if "load_average_1m" in r]
    lines = [
        "# Time to the first step: dcp vs plain torch.compile"
        + (" (dcp with regional compilation, `options={'regions': True}`)" if any(r.get("regions") for r in results) else ""),
        "",
        f"**Measured** on {machine}, torch {results[0].get('torch', '?')}, by `benchmarks/compile_time.py` "
        "(each configuration in a fresh process with a cold Inductor/Triton cache; dcp on a one-process "
        "fake world of 2 ranks, so its SP-2 variants compute one rank's share and move no data). "
        + (f"Load average (1 min) when each configuration started: {min(loads):.1f}-{max(loads):.1f} on "
           f"{os.cpu_count()} CPUs (other jobs share this machine). " if loads else "")
        + "Goal (issue 25): first step <= 1.5x plain, each further variant <= 0.5x plain's first step. "
        "Times are CPU seconds (the process and its C++ compiles; see the script's docstring), wall seconds in "
        "brackets; ratios are of CPU time. "
        "Pass 1 runs plain first, pass 2 dcp first, so that a change in the machine's load does not "
        "favour one side; the two passes show the noise.",
        "",
        "| model | inner | plain first step, CPU s [wall s] | dcp first step, SP 2, CPU s [wall s] | ratio (CPU) | further variants: first call, CPU s [wall s], ratio to plain | plain / dcp next step, another length (wall s) |",
        "| --- | --- | ---: | ---: | ---: | --- | --- |",
    ]
    by_key = {(r["model"], r["inner"], r["mode"], r.get("pass", 0)): r for r in results}
    passes = sorted({r.get("pass", 0) for r in results})
    models = [m for m in [*MODELS, *DEEPER] if any(r["model"] == m for r in results)]
    rows = [(m, i, p) for m in models for i in sorted({r["inner"] for r in results}) for p in passes]
    for model_name, inner, run in rows:
        plain, dcp = by_key.get((model_name, inner, "plain", run)), by_key.get((model_name, inner, "dcp", run))
        if plain is None or dcp is None:
            continue
        if "error" in plain or "error" in dcp:
            cells = [r.get("error") or f"{r['first_step_s']:.1f}" for r in (plain, dcp)]
            lines.append(f"| {model_name} | {inner} | {cells[0]} | {cells[1]} | - | - | - |")
            continue
        base = _cpu(plain)
        further = "; ".join(f"{v['variant']}: {_cpu(v, 'first_call'):.1f} [{v['first_call_s']:.1f}] "
                            f"({_cpu(v, 'first_call') / base:.2f}x)" for v in dcp["variants"][1:])
        lines.append(f"| {model_name} ({dcp['case']}, {dcp['tokens']} tokens), pass {run + 1} | {inner} | {base:.1f} "
                     f"[{plain['first_step_s']:.1f}] | {_cpu(dcp):.1f} [{dcp['first_step_s']:.1f}] | "
                     f"{_cpu(dcp) / base:.2f}x | {further} | "
                     f"{plain['next_step_s']:.3f} / {dcp['next_step_s']:.3f} |")
    lines += ["", "Against the goal (every pass):", ""]
    for model_name in models:
        for inner in sorted({r["inner"] for r in results}):
            pairs = [(by_key.get((model_name, inner, "plain", p)), by_key.get((model_name, inner, "dcp", p))) for p in passes]
            pairs = [(a, b) for a, b in pairs if a and b and "error" not in a and "error" not in b]
            if not pairs:
                continue
            first = [_cpu(b) / _cpu(a) for a, b in pairs]
            further = [_cpu(v, "first_call") / _cpu(a) for a, b in pairs for v in b["variants"][1:]]
            lines.append(
                f"- {model_name}, {inner}: first step {', '.join(f'{x:.2f}x' for x in first)} of plain "
                f"({'within' if max(first) <= 1.5 else 'over'} the 1.5x goal); further variants "
                f"{min(further):.2f}x-{max(further):.2f}x of plain's first step "
                f"({sum(x <= 0.5 for x in further)} of {len(further)} within the 0.5x goal)")
    lines += stage_table(results, rows, by_key)
    lines += ["", "Raw results:", "", "```json", json.dumps(results, indent=1), "```", ""]
    return "\n".join(lines)


def _cpu(record: dict, prefix: str = "first_step") -> float:
    """CPU seconds of a timed call; results from before CPU time was kept have only the wall clock."""
    return record.get(f"{prefix}_cpu_s", record[f"{prefix}_s"])


def _stages(stages: dict[str, float] | None) -> str:
    if not stages:
        return "-"
    return ", ".join(f"{name} {seconds:.1f}" for name, seconds in stages.items() if abs(seconds) >= 0.05)


def _caches(counts: dict[str, int] | None) -> str:
    if not counts or not any(counts.values()):  # aot_eager uses neither cache
        return ""
    return (f" (FX graph cache {counts['inductor.fxgraph_cache_hit']} hit(s) / {counts['inductor.fxgraph_cache_miss']} "
            f"miss(es), AOTAutograd cache {counts['aot_autograd.autograd_cache_hit']} / "
            f"{counts['aot_autograd.autograd_cache_miss']})")


def _cxx(record: dict, prefix: str) -> str:
    """The C++ compiles' CPU seconds and C++ kernels compiled of those asked for (results from before
    they were kept have neither)."""
    kernels = record.get(f"{prefix}_cpp_kernels")
    if not kernels or not kernels["requested"]:
        return ""
    return (f" [C++ compiles {record[f'{prefix}_cxx_cpu_s']:.1f} CPU s, {kernels['compiled']} of "
            f"{kernels['requested']} C++ kernels compiled]")


def stage_table(results: list[dict], rows: list[tuple], by_key: dict) -> list[str]:
    """Where each timed call went, stage by stage (seconds; see the module docstring)."""
    if not any("first_step_stages" in r for r in results):
        return []
    lines = ["", "Where the time went (wall seconds per stage of each timed call, as torch and dcp time them; "
             "stages under 0.05 s left out; in brackets the CPU seconds of Inductor's C++ compiles, and how many "
             "C++ kernels it compiled of those the call asked for: the rest its code cache served, compiled by "
             "an earlier variant with the same source):", "",
             "| model | inner | plain first step | dcp first step (SP 2) | dcp further variants |",
             "| --- | --- | --- | --- | --- |"]
    for model_name, inner, run in rows:
        plain, dcp = by_key.get((model_name, inner, "plain", run)), by_key.get((model_name, inner, "dcp", run))
        if not plain or not dcp or "error" in plain or "error" in dcp:
            continue
        further = "; ".join(f"{v['variant']}: {_stages(v.get('stages'))}{_caches(v.get('caches'))}"
                            f"{_cxx(v, 'first_call')}" for v in dcp["variants"][1:])
        lines.append(f"| {model_name}, pass {run + 1} | {inner} | {_stages(plain.get('first_step_stages'))}"
                     f"{_cxx(plain, 'first_step')} | {_stages(dcp.get('first_step_stages'))}{_cxx(dcp, 'first_step')} | "
                     f"{further} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=[*MODELS, *DEEPER])
    parser.add_argument("--inner", nargs="+", default=["inductor"], choices=["inductor", "aot_eager", "eager"])
    parser.add_argument("--repeats", type=int, default=2, help="passes; odd passes run dcp first (0 with --merge: "
                        "rewrite the report of earlier results)")
    parser.add_argument("--only-pass", type=int, default=None, help="run this pass alone (0: plain first, 1: dcp first)")
    parser.add_argument("--merge", type=Path, default=None,
                        help="an earlier report of this script: its raw results join this run's (another pass)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per configuration")
    parser.add_argument("--out", type=Path, default=None, help="write the Markdown report here")
    parser.add_argument("--worker", nargs=3, metavar=("MODEL", "MODE", "INNER"), help=argparse.SUPPRESS)
    parser.add_argument("--regions", action="store_true",
                        help="dcp with options={'regions': True} (compiler/regions/): token-local regions compiled "
                             "once for every variant")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(*args.worker, regions=args.regions)))
        return 0
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs visible ({platform.node()})"
    results = []
    if args.merge:
        results = json.loads(args.merge.read_text().split("```json\n", 1)[1].split("```", 1)[0])
    runs = [args.only_pass] if args.only_pass is not None else range(args.repeats)
    configurations = [(run, model_name, inner, mode) for run in runs for model_name in args.models
                      for inner in args.inner for mode in (("plain", "dcp") if run % 2 == 0 else ("dcp", "plain"))]
    for run, model_name, inner, mode in configurations:
        result = run_isolated(model_name, mode, inner, args.timeout, regions=args.regions and mode == "dcp")
        result["pass"] = run
        print(json.dumps(result), flush=True)
        results.append(result)
        if args.out:  # partial results survive an interrupted run
            args.out.write_text(markdown(results, machine))
    report = markdown(results, machine)
    print(report)
    if args.out:
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
