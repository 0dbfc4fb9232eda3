"""``python -m dcp_compile inspect SCRIPT_OR_MODULE:FACTORY --sp 2 --out dcp_report.html``.

A user's first question is whether DCP shards *their* model. The factory builds the model and one
batch (``(model, args_tuple)`` or ``(model, kwargs_dict)``); the command compiles it with the dcp
backend on a fake process group of ``--sp`` ranks (collectives trace but move no data, so one
process is enough), runs ``dcp.explain`` once and writes the HTML report.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable


def load_factory(target: str) -> Callable[[], Any]:
    """``path/to/script.py:name`` or ``package.module:name`` -> the callable."""
    location, sep, name = target.rpartition(":")
    if not sep or not location or not name:
        raise SystemExit(f"inspect: expected SCRIPT.py:FACTORY or module.name:FACTORY, got {target!r}")
    if location.endswith(".py") or Path(location).is_file():
        path = Path(location).resolve()
        if not path.is_file():
            raise SystemExit(f"inspect: no such file {location}")
        spec = importlib.util.spec_from_file_location(f"dcp_inspect_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.parent))  # the script's own imports, as `python script.py` finds them
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(path.parent))
    else:
        module = importlib.import_module(location)
    try:
        return getattr(module, name)
    except AttributeError:
        raise SystemExit(f"inspect: {location} has no {name!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dcp_compile inspect", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", help="SCRIPT.py:FACTORY or module.name:FACTORY; FACTORY() returns (model, args or kwargs)")
    parser.add_argument("--sp", type=int, default=2, help="SP size (the fake world's size)")
    parser.add_argument("--out", default="dcp_report.html", help="where to write the report")
    parser.add_argument("--inner", default="aot_eager", choices=["inductor", "aot_eager", "eager"],
                        help="inner compiler (aot_eager: fast, and still measures bytes saved for backward)")
    return parser


def inspect(target: str, sp: int = 2, out: str = "dcp_report.html", inner: str = "aot_eager") -> Any:
    """Build, compile on a fake ``sp``-rank world, explain, write ``out``; returns the record."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dcp_compile.compiler.inspection import explain
    from dcp_compile.report.html_report import save_model_report

    made = load_factory(target)()
    if not (isinstance(made, tuple) and len(made) == 2):
        raise SystemExit("inspect: the factory must return (model, args_tuple) or (model, kwargs_dict)")
    model, inputs = made
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=sp)
    elif dist.get_world_size() < sp:
        raise SystemExit(f"inspect: --sp {sp} is larger than the initialised world ({dist.get_world_size()})")
    try:
        compiled = torch.compile(model, backend="dcp", dynamic=True, options={"sp_size": sp, "inner": inner})
        if isinstance(inputs, dict):
            record = explain(compiled, **inputs)
        else:
            record = explain(compiled, *tuple(inputs))
        save_model_report(record, out)
    finally:
        if created:
            dist.destroy_process_group()
    return record


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    record = inspect(args.target, sp=args.sp, out=args.out, inner=args.inner)
    print("\n".join(record.summary_lines()))
    print(f"report: {args.out}")
    return 0
