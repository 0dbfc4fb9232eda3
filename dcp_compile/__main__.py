"""``python -m dcp_compile demo`` (the project's main job), ``python -m dcp_compile bench kernels`` and
``python -m dcp_compile inspect SCRIPT.py:FACTORY --sp 2 --out dcp_report.html`` (HTML report)."""

from __future__ import annotations

import argparse
import sys


def positive_int(text: str) -> int:
    """An argparse type for counts: 0 steps or 0 processes would run nothing (or divide by zero
    minutes later), so it is refused at once, with the value and the rule."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def run_kernel_benchmarks(argv: list[str]) -> int:
    """``benchmarks/kernel_benchmarks.py`` of a source checkout (the benchmark CLI is not part of
    the installed library)."""
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "kernel_benchmarks.py"
    if not script.exists():
        raise SystemExit(f"bench kernels: {script} not found; the kernel benchmark runs from a source checkout "
                         "(git clone the repository, then `python benchmarks/kernel_benchmarks.py`)")
    return runpy.run_path(str(script))["main"](argv) or 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["inspect"]:
        # Its own parser (dcp_compile.report.cli), so that `inspect --help` lists its options; as a
        # subparser with a REMAINDER argument, --help showed only `rest`.
        from dcp_compile.report.cli import main as inspect_main

        return inspect_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m dcp_compile", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a small GPT on variable-length data with backend='dcp'")
    demo.add_argument("--world-size", type=positive_int, default=2, help="local gloo processes to spawn (ignored under torchrun)")
    demo.add_argument("--steps", type=positive_int, default=6, help="training steps to time (at least 1)")
    demo.add_argument("--inner", default="aot_eager", choices=["inductor", "aot_eager", "eager"])
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", metavar="PATH", help="also write what rank 0 measured and predicted to PATH (JSON)")
    bench = commands.add_parser("bench", help="benchmarks")
    bench.add_argument("what", choices=["kernels"])
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    inspect = commands.add_parser("inspect", help="write an HTML report of what DCP does to a model (fake process group)")
    inspect.add_argument("rest", nargs=argparse.REMAINDER,
                         help="SCRIPT.py:FACTORY [--sp 2] [--out dcp_report.html] (`inspect --help` for all options)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from dcp_compile.demo.training_demo import run_demo

        return run_demo(world_size=args.world_size, steps=args.steps, inner=args.inner, seed=args.seed,
                        json_path=args.json)
    if args.command == "bench":
        return run_kernel_benchmarks(args.rest)
    if args.command == "inspect":
        from dcp_compile.report.cli import main as inspect_main

        return inspect_main(args.rest)
    return 1


if __name__ == "__main__":
    sys.exit(main())
