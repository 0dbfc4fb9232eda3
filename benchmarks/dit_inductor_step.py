"""A diffusers video DiT at real width under dcp: training-step time with Inductor vs aot_eager.

The Wan 2.1 1.3B configuration (width 1536, 12 heads of 128, FFN 8960, text width 4096;
``--layers`` of its 30, default 4) as ``diffusers.WanTransformer3DModel``, bf16, AdamW, compiled
``torch.compile(model, backend="dcp", dynamic=True, options={"inner": <inner>, "sp_size": 1})`` on
one device, no process group. Two latent sizes (``--latents``, frames x height x width of the
16-channel latent) run through the one trace; per inner compiler: first-step seconds (compile),
then the median of ``--repeats`` steps (forward, backward, optimizer) per size, and any variant
that fell back from Inductor (``VariantRecord.inner_fallback``: there must be none).

    python benchmarks/dit_inductor_step.py --out-dir $OUT               # GPU
    python benchmarks/dit_inductor_step.py --tiny --inner aot_eager     # CPU smoke run

Writes ``dit_inductor_step_<device>.md`` and ``.json``, rewritten after every (inner compiler, latent
size) row with a status line, so a run stopped by ``timeout --signal=INT`` keeps its rows (marked
partial). ``--tiny`` on a CPU is the dry run of ``gpu_check.sh`` and says so on the page.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from dcp_compile.device_profile.partial_results import DRY_RUN_LABEL, Progress, interruptible, write_atomic

RESULTS = Path(__file__).resolve().parent / "results"
WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=8960, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                eps=1e-6, rope_max_seq_len=1024)
TINY = dict(WAN_1_3B, num_attention_heads=2, attention_head_dim=16, text_dim=32, freq_dim=32, ffn_dim=64, in_channels=4,
            out_channels=4)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(inner: str, config: dict, layers: int, latents: list[tuple[int, int, int]], repeats: int,
        device: torch.device, dtype: torch.dtype, text_len: int,
        on_row: Callable[[dict], None] | None = None) -> dict:
    """One inner compiler's rows; ``on_row`` gets the result so far after each latent size (for the
    page to be rewritten), before the fallback check that closes the run."""
    import diffusers

    import dcp_compile as dcp

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(**config, num_layers=layers).to(device=device, dtype=dtype).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": inner, "sp_size": 1})
    channels = config["in_channels"]

    def inputs(frames: int, height: int, width: int) -> dict:
        g = torch.Generator().manual_seed(frames * 1000 + height)
        return {"hidden_states": torch.randn(1, channels, frames, height, width, generator=g).to(device, dtype),
                "timestep": torch.tensor([500.0], device=device),
                "encoder_hidden_states": torch.randn(1, text_len, config["text_dim"], generator=g).to(device, dtype)}

    def step(batch: dict) -> None:
        out = compiled(**batch, return_dict=False)[0]
        out.float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    result = {"inner": inner, "sizes": {}, "fallbacks": []}
    for frames, height, width in latents:
        tokens = frames * (height // 2) * (width // 2)
        batch = inputs(frames, height, width)
        _sync(device)
        start = time.perf_counter()
        step(batch)
        _sync(device)
        first = time.perf_counter() - start
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            step(batch)
            _sync(device)
            times.append(time.perf_counter() - start)
        result["sizes"][f"{frames}x{height}x{width} ({tokens} tokens)"] = {
            "first_step_s": round(first, 2), "step_ms": round(1e3 * statistics.median(times), 2)}
        print(f"{inner} {frames}x{height}x{width} ({tokens} tokens): first step {first:.1f} s, "
              f"step {1e3 * statistics.median(times):.1f} ms", flush=True)
        if on_row is not None:
            on_row(result)
    record = dcp.explain(compiled, **inputs(*latents[0]), return_dict=False)  # the same call: no new trace
    result["fallbacks"] = [f"graph {g.graph_id} {v.variant}: {v.inner_fallback}" for g in record.graphs
                           for v in g.variants.values() if v.inner_fallback]
    result["fallbacks_checked"] = True
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", nargs="+", default=["inductor", "aot_eager"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--latents", nargs="+", default=["5x60x104", "9x48x80"],
                        help="frames x height x width of the latent (tokens = frames * h/2 * w/2)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="a tiny width (CPU smoke run; the dry run of gpu_check.sh)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    latents = [tuple(int(x) for x in text.split("x")) for text in args.latents]
    config = TINY if args.tiny else WAN_1_3B
    results: list[dict] = []
    progress = Progress(len(args.inner) * len(latents), unit="(inner compiler, latent) rows")

    def flush() -> None:
        write_report(results, args, device, dtype, progress.status())

    def on_row(result: dict) -> None:
        if not results or results[-1] is not result:
            results.append(result)
        progress.done = sum(len(r["sizes"]) for r in results)
        flush()

    flush()
    with interruptible(progress, flush):
        for inner in args.inner:  # the report is rewritten after each row, so a cut-short run keeps what it measured
            result = run(inner, config, args.layers, latents, args.repeats, device, dtype,
                         16 if args.tiny else 512, on_row)
            if not results or results[-1] is not result:
                results.append(result)
            flush()
    flush()
    print(progress.status())
    return 0


def write_report(results: list[dict], args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
                 status: str = "complete") -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    slug = "".join(ch if ch.isalnum() else "-" for ch in name.lower()).strip("-")
    versions = f"torch {torch.__version__}"
    try:
        import triton

        versions += f", Triton {triton.__version__}"
    except ImportError:
        pass
    dry = args.tiny and device.type != "cuda"
    label = [f"**{DRY_RUN_LABEL}** (`--tiny`: toy width and latents; it checks the script and measures nothing "
             "worth reading).", ""] if dry else []
    lines = [f"# Wan 2.1 1.3B width, {args.layers} layers{' (tiny width)' if args.tiny else ''}: dcp step time by inner compiler",
             "", *label, f"Status: {status}.", "",
             f"Measured on {name} ({versions}), {str(dtype).removeprefix('torch.')}, batch 1, AdamW, SP 1, median of "
             f"{args.repeats} steps after the first. `python benchmarks/dit_inductor_step.py`.", "",
             "| inner | latent | first step (s) | step (ms) | fallbacks |", "|---|---|---|---|---|"]
    for result in results:
        fallbacks = (len(result["fallbacks"]) or "none") if result.get("fallbacks_checked") else "not checked (stopped)"
        for size, figures in result["sizes"].items():
            lines.append(f"| {result['inner']} | {size} | {figures['first_step_s']} | {figures['step_ms']} | "
                         f"{fallbacks} |")
    by_inner = {r["inner"]: r for r in results}
    if "inductor" in by_inner and "aot_eager" in by_inner:
        for size in by_inner["inductor"]["sizes"]:
            if size in by_inner["aot_eager"]["sizes"]:
                ratio = by_inner["aot_eager"]["sizes"][size]["step_ms"] / by_inner["inductor"]["sizes"][size]["step_ms"]
                lines.append(f"\n{size}: Inductor {ratio:.2f}x aot_eager's speed.")
    write_atomic(args.out_dir / f"dit_inductor_step_{slug}.md", "\n".join(lines) + "\n")
    write_atomic(args.out_dir / f"dit_inductor_step_{slug}.json", json.dumps(
        {"device": name, "status": status, "dry_run": dry, "label": label[0] if label else "", "results": results},
        indent=1))
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
