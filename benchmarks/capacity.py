"""The longest sequence the planner places, per the cost model, beside ALST's measured figures.

For Llama-3-8B and a Wan-2.1-1.3B-shaped video DiT on 1, 8 and 32 H100s and H200s: the most tokens
one micro-batch holds on any SP group under any recompute policy the compiler builds, under the
planner's default cap (0.9 of the device's memory), for each way the runtime can keep the model
state (``CostModel.state_sharding``; each is what the named ``dcp.shard_model`` call does):

* **gathered** (``dcp.shard_model(model)``, ``state_sharding="replicated"``): bf16 parameters and fp32
  gradients whole on every rank during the step, Adam state sharded over the world (ZeRO-1/2 peak);
* **ZeRO-3** (``dcp.shard_model(model, reshard_after_forward=True)``, ``"sharded"``): parameters,
  gradients and Adam state / world, plus the root's and two blocks' unsharded parameters and
  gradients; plans in rounds, each round paying the world's all-gathers and reduce-scatters;
* **ZeRO-3 + optimizer offload** (``... reshard_after_forward=True, offload=True``,
  ``"sharded_offload"``): FSDP2's ``CPUOffloadPolicy``, the shards in host memory and the optimizer
  step on the host; on the device only what is unsharded.

Beside it, per (SP size, policy), where the bytes per token go, so the table says why; and per
sharded mode, what a round's collectives and the host's optimizer step cost.

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

from dcp_compile.schedule.cost_model import CostModel, ModelProfile, StateSharding
from dcp_compile.schedule.hardware import Hardware
from dcp_compile.schedule.planner import Planner
from dcp_compile.variant import RECOMPUTE_POLICIES

RESULTS = Path(__file__).resolve().parent / "results"
ALST_LLAMA_8B = {1: 500_000, 8: 3_700_000, 32: 15_000_000}  # tokens on H100s, arXiv 2506.13996
WORLDS = (1, 8, 32)
HARDWARE = {"H100": Hardware.H100, "H200": Hardware.H200}
# How the runtime keeps the model state: the table's name, the cost model's mode, the runtime call.
STATES = {
    "gathered": (StateSharding.REPLICATED, "dcp.shard_model(model)"),
    "ZeRO-3": (StateSharding.SHARDED, "dcp.shard_model(model, reshard_after_forward=True)"),
    "ZeRO-3 + offload": (StateSharding.SHARDED_OFFLOAD, "dcp.shard_model(model, reshard_after_forward=True, offload=True)"),
}


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


def capacity_row(profile: ModelProfile, hardware: Hardware, world: int, state: str = "gathered") -> dict[str, Any]:
    mode, call = STATES[state]
    cost_model = CostModel(profile, hardware, optimizer_shards=world, state_sharding=mode)
    planner = Planner(cost_model, world)
    best_level = max(range(planner.levels), key=lambda j: planner.max_capacity[j])
    tokens = planner.max_capacity[best_level]
    size = planner.sizes[best_level]
    policy = RECOMPUTE_POLICIES[planner.capacity[best_level].index(tokens)] if tokens else None
    state_bytes = cost_model.memory_coefficients(1, RECOMPUTE_POLICIES[-1]).fixed_bytes
    per_policy = {
        p.value: {str(s): cost_model.token_capacity(s, p, planner.memory_cap) for s in planner.sizes}
        for p in RECOMPUTE_POLICIES
    }
    bytes_per_token = {
        p.value: cost_model.memory_coefficients(size, p).bytes_per_token * size for p in RECOMPUTE_POLICIES
    }
    return {
        "model": profile.name, "hardware": hardware.name, "world": world, "state": state, "runtime": call,
        "state_sharding": mode.value, "memory_cap": planner.memory_cap,
        "state_bytes": state_bytes, "host_state_bytes": cost_model.host_state_bytes(),
        "round_seconds": cost_model.state_round_seconds(), "optimizer_step_seconds": cost_model.optimizer_step_seconds(),
        "tokens": tokens, "sp_size": size, "policy": policy.value if policy else None,
        # offload and lean: the block inputs a rank's share keeps, waiting in host memory for backward
        "host_activation_bytes": (profile.host_activation_bytes_per_token(policy) * tokens / size) if policy else 0.0,
        "capacity": per_policy, "bytes_per_token_at_best_sp": bytes_per_token,
    }


def _longest(r: dict[str, Any]) -> str:
    if r["tokens"]:
        return f"{r['tokens']:,} (SP {r['sp_size']}, {r['policy']})"
    return f"none: state over the {r['memory_cap'] / 1e9:.0f} GB cap"


def _host(r: dict[str, Any]) -> str:
    """Host memory per rank at the longest sequence: the state's shards and optimizer (offload) and
    the offloaded block inputs."""
    return f"{(r['host_state_bytes'] + r['host_activation_bytes']) / 1e9:.0f} GB"


def report(rows: list[dict[str, Any]]) -> str:
    by_key: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_key.setdefault((r["model"], r["hardware"], r["world"]), {})[r["state"]] = r
    states = [s for s in STATES if any(s in v for v in by_key.values())]
    lines = [
        "# The longest sequence the planner places (simulated, the cost model's memory terms)", "",
        "Cap 0.9 of the device's memory; every SP size up to the world and every recompute policy the compiler builds ("
        + ", ".join(p.value for p in RECOMPUTE_POLICIES) + "); a language model's loss tiled under every policy but "
        "none (the compiler's tile_loss pass, its default chunk: up to 4,096 tokens and 1 GiB of logits, 837 tokens for Llama-3-8B). Model state per rank on the device, per way the runtime "
        "keeps it (`CostModel.state_sharding`; the runtime call that does it):", "",
    ]
    lines += [f"* **{name}**: `{call}`, `state_sharding=\"{mode.value}\"`" for name, (mode, call) in STATES.items()
              if name in states]
    lines += [
        "", "Gathered: bf16 parameters and fp32 gradients whole on every rank for the step, Adam state (12 bytes per "
        "parameter) / world. ZeRO-3: all of it / world, plus the root's and two blocks' unsharded parameters and "
        "gradients. ZeRO-3 + offload: only the latter on the device (the shards in host memory).", "",
        "| model | GPUs | " + " | ".join(f"{s}: state | {s}: longest sequence" for s in states)
        + " | host memory per rank (last mode) | ALST, measured |",
        "|---|---|" + "---:|---|" * len(states) + "---:|---:|",
    ]
    for (model, hardware, world), entry in by_key.items():
        alst = f"{ALST_LLAMA_8B[world]:,}" if model == "llama-3-8b" and hardware == "H100" else "-"
        cells = []
        for s in states:
            r = entry.get(s)
            cells += ["-", "-"] if r is None else [f"{r['state_bytes'] / 1e9:.1f} GB", _longest(r)]
        last = entry.get(states[-1])
        host = _host(last) if last is not None and last["tokens"] else "-"
        lines.append(f"| {model} | {world} x {hardware} | " + " | ".join(cells) + f" | {host} | {alst} |")
    sharded = [r for r in rows if r["state"] != "gathered"]
    if sharded:
        lines += ["", "What the sharded modes cost: every micro-batch (and idle round) pays one round of the state's "
                  "all-gathers and reduce-scatters over the world (`CostModel.state_round_seconds`: one collective per "
                  "sharded module, ring traffic over NVLink inside a node and the NIC across nodes, plus the host copies "
                  "when offloaded); the optimizer step runs once per step (`CostModel.optimizer_step_seconds`: a bandwidth "
                  "bound, on the host when offloaded):", "",
                  "| model | GPUs | mode | per round | optimizer step | host memory per rank |", "|---|---|---|---:|---:|---:|"]
        for r in sharded:
            lines.append(f"| {r['model']} | {r['world']} x {r['hardware']} | {r['state']} | {r['round_seconds']:.3f} s | "
                         f"{r['optimizer_step_seconds']:.3f} s | {r['host_state_bytes'] / 1e9:.1f} GB |")
    lines += ["", "What fills the cap: bytes a rank holds per token of its own share of the micro-batch (the micro-batch's "
              "tokens / SP size), at the best SP size under ZeRO-3, per policy. Variants compile in regions (the "
              "default): `attention` and `full` checkpoint each region and keep its inputs (more than whole-graph "
              "`full`'s block inputs at SP 1; a ring layout, Wan at SP 8 and 32, keeps what `none` keeps), so the "
              "longest sequences run under `block`, `offload` or `lean`, which compile whole:", "",
              "| model | GPUs | " + " | ".join(p.value for p in RECOMPUTE_POLICIES) + " |",
              "|---|---|" + "---:|" * len(RECOMPUTE_POLICIES)]
    for r in rows:
        if r["tokens"] and r["state"] == ("ZeRO-3" if "ZeRO-3" in states else states[0]):
            lines.append(f"| {r['model']} | {r['world']} x {r['hardware']} | " + " | ".join(
                f"{r['bytes_per_token_at_best_sp'][p.value] / 1e3:,.0f} KB" for p in RECOMPUTE_POLICIES) + " |")
    lines += ["", "ALST: Arctic Long Sequence Training (arXiv 2506.13996), measured on H100s with Ulysses SP, ZeRO-3 "
              "and optimizer offload, a tiled loss, a tiled MLP and activation checkpoints offloaded to host memory. "
              "The runtime builds each of them: Ulysses SP and whole-block checkpoints (`block`), ZeRO-3 with "
              "offload (`dcp.shard_model`), the tiled loss (every policy but `none`), the checkpoints offloaded to "
              "host memory (`offload`) and the tiled MLP with them (`lean`). The planner takes `offload` and `lean` "
              "only where nothing faster holds a micro-batch: their host copies are priced unoverlapped and "
              "`lean` runs each MLP's forward once more. The memory terms of `full`, `block`, `offload` and `lean` "
              "are within 4.1% of a step's peak measured on a CPU (`memory_peaks_lean_cpu.md`, TinyGPT at SP 1 "
              "and 2); no GPU has measured these lengths.", "",
              "Host memory: the last column is what a rank's host side holds at that length under the last mode "
              "(the state's shards and Adam state, and the offloaded block inputs), within the planner's host cap: "
              "a node's host memory (`Hardware.host_memory_per_node`, 2 TB on a DGX H100 / H200) over its ranks "
              "(the world, up to 8)."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(RESULTS))
    args = parser.parse_args(argv)
    rows = [capacity_row(profile, hardware, world, state) for profile in models().values()
            for hardware in HARDWARE.values() for world in WORLDS for state in STATES]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = report(rows)
    (out / "capacity.md").write_text(text)
    (out / "capacity.json").write_text(json.dumps(rows, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
