"""The longest sequence the planner places, per the cost model, beside ALST's measured figures.

For Llama-3-8B and a Wan-2.1-1.3B-shaped video DiT on 1, 8 and 32 H100s and H200s: the most tokens
one micro-batch holds on any SP group under any recompute policy the compiler builds, with the
model state as the runtime keeps it (bf16 parameters and fp32 gradients whole on every rank during
the step, Adam state sharded over the world: ``dcp.shard_model`` / ZeRO-1, the project's documented
setting), under the planner's default cap (0.9 of the device's memory). Beside it, per (SP size,
policy), where the bytes per token go, so the table says why.

ALST (Arctic Long Sequence Training, arXiv 2506.13996, its Table 1 / abstract, measured): Llama-3-8B
trains 500K tokens on 1 H100, 3.7M on 8 and 15M on 32, with Ulysses SP, ZeRO-3 with optimizer
offload, a tiled loss, a tiled MLP and activation checkpoints offloaded to host memory.

Label: **simulated** (the cost model's memory terms; ``benchmarks/results/memory_peaks_cpu.md``
measures them against the runtime on a CPU). Writes ``benchmarks/results/capacity.md`` / ``.json``.
Run: ``PYTHONPATH=. python benchmarks/capacity.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from dcp_compile.schedule.cost_model import CostModel, ModelProfile
from dcp_compile.schedule.hardware import Hardware
from dcp_compile.schedule.planner import Planner
from dcp_compile.variant import RECOMPUTE_POLICIES

RESULTS = Path(__file__).resolve().parent / "results"
ALST_LLAMA_8B = {1: 500_000, 8: 3_700_000, 32: 15_000_000}  # tokens on H100s, arXiv 2506.13996
WORLDS = (1, 8, 32)
HARDWARE = {"H100": Hardware.H100, "H200": Hardware.H200}


def wan_2_1_1_3b() -> ModelProfile:
    """Wan 2.1 T2V 1.3B's transformer shape (Wan-Video/Wan2.1 ``wan/configs/wan_t2v_1_3B.py``: dim 1536,
    ffn_dim 8960, 12 heads, 30 layers, patch (1, 2, 2), 16 latent channels; 512 umT5 text tokens):
    full 3-D self-attention, cross-attention to the text, adaLN modulation, a GELU MLP."""
    return ModelProfile.transformer(
        "wan-2.1-1.3b", num_layers=30, hidden_size=1536, num_heads=12, ffn_hidden_size=8960, causal=False,
        cross_attention_tokens=512, output_channels=16 * 2 * 2, adaptive_norm=True,
        extra_parameters=4096 * 1536 + 1536 * 1536 + 256 * 1536 + 1536 * 1536 * 7,  # text and time embedders
    )


def models() -> dict[str, ModelProfile]:
    return {"llama-3-8b": ModelProfile.from_config("llama-3-8b"), "wan-2.1-1.3b (shape)": wan_2_1_1_3b()}


def capacity_row(profile: ModelProfile, hardware: Hardware, world: int) -> dict[str, Any]:
    cost_model = CostModel(profile, hardware, optimizer_shards=world)
    planner = Planner(cost_model, world)
    best_level = max(range(planner.levels), key=lambda j: planner.max_capacity[j])
    tokens = planner.max_capacity[best_level]
    size = planner.sizes[best_level]
    policy = RECOMPUTE_POLICIES[planner.capacity[best_level].index(tokens)] if tokens else None
    state = cost_model.memory_coefficients(1, RECOMPUTE_POLICIES[-1]).fixed_bytes
    per_policy = {
        p.value: {str(s): cost_model.token_capacity(s, p, planner.memory_cap) for s in planner.sizes}
        for p in RECOMPUTE_POLICIES
    }
    bytes_per_token = {
        p.value: cost_model.memory_coefficients(size, p).bytes_per_token * size for p in RECOMPUTE_POLICIES
    }
    return {
        "model": profile.name, "hardware": hardware.name, "world": world, "memory_cap": planner.memory_cap,
        "state_bytes": state, "tokens": tokens, "sp_size": size, "policy": policy.value if policy else None,
        "capacity": per_policy, "bytes_per_token_at_best_sp": bytes_per_token,
    }


def report(rows: list[dict[str, Any]]) -> str:
    lines = [
        "# The longest sequence the planner places (simulated, the cost model's memory terms)", "",
        "Model state as the runtime keeps it: bf16 parameters and fp32 gradients whole on every rank for the step, "
        "Adam state (12 bytes per parameter) sharded over the world (`dcp.shard_model`, ZeRO-1); cap 0.9 of the "
        "device's memory; every SP size up to the world and every recompute policy the compiler builds ("
        + ", ".join(p.value for p in RECOMPUTE_POLICIES) + ").", "",
        "| model | GPUs | model state per rank | longest sequence (SP size, policy) | ALST, measured |",
        "|---|---|---:|---|---:|",
    ]
    for r in rows:
        alst = f"{ALST_LLAMA_8B[r['world']]:,}" if r["model"] == "llama-3-8b" and r["hardware"] == "H100" else "-"
        where = f"{r['tokens']:,} (SP {r['sp_size']}, {r['policy']})" if r["tokens"] else (
            f"none: the model state exceeds the {r['memory_cap'] / 1e9:.0f} GB cap")
        lines.append(f"| {r['model']} | {r['world']} x {r['hardware']} | {r['state_bytes'] / 1e9:.1f} GB | {where} | {alst} |")
    lines += ["", "What fills the cap: bytes a rank holds per token of its own share of the micro-batch (the micro-batch's "
              "tokens / SP size), at the best SP size, per policy:", "",
              "| model | GPUs | " + " | ".join(p.value for p in RECOMPUTE_POLICIES) + " |",
              "|---|---|" + "---:|" * len(RECOMPUTE_POLICIES)]
    for r in rows:
        if r["tokens"]:
            lines.append(f"| {r['model']} | {r['world']} x {r['hardware']} | " + " | ".join(
                f"{r['bytes_per_token_at_best_sp'][p.value] / 1e3:,.0f} KB" for p in RECOMPUTE_POLICIES) + " |")
    lines += ["", "ALST: Arctic Long Sequence Training (arXiv 2506.13996), measured on H100s with Ulysses SP, ZeRO-3 "
              "and optimizer offload, a tiled loss, a tiled MLP and activation checkpoints offloaded to host memory. "
              "The gap is what those mechanisms hold that this runtime does not yet build."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(RESULTS))
    args = parser.parse_args(argv)
    rows = [capacity_row(profile, hardware, world) for profile in models().values()
            for hardware in HARDWARE.values() for world in WORLDS]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = report(rows)
    (out / "capacity.md").write_text(text)
    (out / "capacity.json").write_text(json.dumps(rows, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
