"""Ulysses overhead: the ``dcp`` backend against hand-written DeepSpeed-style Ulysses, same model.

On a 2-process gloo world (CPU), one training step (forward + backward, no optimizer) of
``TinyGPT`` at SP=2 runs two ways on the same weights and the same batch:

* **dcp**: the unchanged model, ``torch.compile(model, backend="dcp", dynamic=True,
  options={"sp_size": 2, "inner": INNER})``. Every rank gets the full batch; the backend shards it.
* **hand-written**: the model rewritten by hand for Ulysses, as one would with DeepSpeed's
  ``DistributedAttention``: each rank embeds its own contiguous sequence chunk (RoPE positions
  offset by the chunk start), q/k/v go sequence-sharded -> head-sharded with
  ``all_to_all_single_autograd``, local SDPA, the output goes back; the loss is the local
  cross-entropy sum plus one all-reduce of ``[sum, count]``, divided by the global count. Compiled
  with plain ``torch.compile(..., dynamic=True)`` and the same inner compiler.

Both issue the same collectives per layer (4 all-to-alls) plus one scalar all-reduce for the
loss. Sanity: both losses (and the SP-group-summed gradients) are checked against eager on the
full batch. Timing: steps alternate dcp / hand-written (ABBA order) after a barrier, a step's time is
the slower rank's, and the ratio is the median of the per-step ratios with a bootstrap 95% interval.
Compile time: first call (forward + backward, so both AOT graphs are built) of the dcp model, the
hand-written model and plain ``torch.compile`` of the unchanged model without SP (inner compiler
alone), each after ``torch._dynamo.reset()``, repeated in rotating order; medians.

Writes ``benchmarks/results/ulysses_overhead.{md,csv}``. Run:
``PYTHONPATH=. python benchmarks/ulysses_overhead.py [--inner aot_eager|inductor] [--lengths 256 1024]``.
"""

from __future__ import annotations

import argparse
import copy
import csv
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_reduce, all_to_all_single_autograd

from dcp_compile.demo.example_models import TinyGPT, rotate

import run_description  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from run_description import library_version  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
LOAD = [float("nan"), float("nan")]  # 1-minute load average at the start and the end of the run
VOCAB, HIDDEN, LAYERS, HEADS = 512, 128, 2, 4


# --------------------------------------------------------------------------- hand-written Ulysses
class DistributedAttention(nn.Module):
    """DeepSpeed-Ulysses attention: sequence-sharded q/k/v in, sequence-sharded output out.

    Inputs are ``[B, S/P, H, D]`` (this rank's chunk, all heads). The forward all-to-all makes
    them ``[B, H/P, S, D]`` (every position of this rank's heads ``[r*H/P, (r+1)*H/P)``); local
    SDPA runs on that; the output goes back to ``[B, S/P, H, D]``. The functional collectives are
    autograd-aware, so the backward all-to-alls come from autograd.
    """

    def __init__(self, group: Any, sp_size: int):
        super().__init__()
        self.group = group
        self.sp_size = sp_size

    def seq_to_head(self, x: torch.Tensor) -> torch.Tensor:
        batch, chunk, heads, dim = x.shape
        p = self.sp_size
        # [P, s, B, H/P, D]: block j (the heads of rank j) goes to rank j.
        send = x.reshape(batch, chunk, p, heads // p, dim).permute(2, 1, 0, 3, 4).contiguous()
        received = all_to_all_single_autograd(send, None, None, self.group)
        # Block j now holds rank j's sequence chunk of this rank's heads: [S, B, H/P, D].
        return received.reshape(p * chunk, batch, heads // p, dim).permute(1, 2, 0, 3)

    def head_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        batch, local_heads, length, dim = x.shape
        p = self.sp_size
        chunk = length // p
        # [P, s, B, H/P, D]: block j (sequence chunk j) goes to rank j.
        send = x.permute(2, 0, 1, 3).reshape(p, chunk, batch, local_heads, dim).contiguous()
        received = all_to_all_single_autograd(send, None, None, self.group)
        # Block j now holds head group j of this rank's chunk: [B, s, H, D].
        return received.permute(2, 1, 0, 3, 4).reshape(batch, chunk, p * local_heads, dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = True) -> torch.Tensor:
        out = F.scaled_dot_product_attention(self.seq_to_head(q), self.seq_to_head(k), self.seq_to_head(v),
                                             is_causal=is_causal)
        return self.head_to_seq(out)


class HandBlock(nn.Module):
    """``example_models.Block`` on a sequence chunk, same parameter names."""

    def __init__(self, hidden: int, heads: int, group: Any, sp_size: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        self.attention = DistributedAttention(group, sp_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, chunk, hidden = x.shape
        # the original's split (a permute, then unpacking), so both backward graphs hold the same select_backward ops
        q, k, v = self.qkv(self.norm1(x)).view(batch, chunk, 3, self.heads, -1).permute(2, 0, 1, 3, 4)  # [B, s, H, D]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        x = x + self.proj(self.attention(q, k, v, is_causal=True).reshape(batch, chunk, hidden))
        return x + self.mlp(self.norm2(x))


class HandShardedGPT(nn.Module):
    """TinyGPT rewritten for Ulysses SP: takes this rank's chunk of ids and (shifted) labels."""

    def __init__(self, group: Any, sp_size: int, vocab: int = VOCAB, hidden: int = HIDDEN,
                 layers: int = LAYERS, heads: int = HEADS):
        super().__init__()
        self.group = group
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(HandBlock(hidden, heads, group, sp_size) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        head_dim = hidden // heads
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim), persistent=False)

    def forward(self, input_ids: torch.Tensor, shifted_labels: torch.Tensor, start: int) -> torch.Tensor:
        positions = (torch.arange(input_ids.shape[1], device=input_ids.device) + start).float()
        angles = torch.outer(positions, self.inv_freq)
        cos = torch.cat([angles, angles], -1).cos()[:, None, :]  # [s, 1, D]: broadcast over heads
        sin = torch.cat([angles, angles], -1).sin()[:, None, :]
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x)).float()
        local_sum = F.cross_entropy(logits.view(-1, logits.shape[-1]), shifted_labels.reshape(-1),
                                    ignore_index=-100, reduction="sum")
        count = (shifted_labels != -100).sum().to(local_sum.dtype)
        totals = all_reduce(torch.stack([local_sum.detach(), count]), "sum", self.group)
        # Value: the global mean; gradient: this rank's share (summed over ranks it is the full one).
        return (local_sum + (totals[0] - local_sum.detach())) / totals[1]


def shard_batch(ids: torch.Tensor, rank: int, sp_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """This rank's chunk of ids and of the labels shifted on the full sequence (labels = ids)."""
    length = ids.shape[1]
    chunk = length // sp_size
    start = rank * chunk
    shifted = F.pad(ids, (0, 1), value=-100)[:, 1:]
    return ids[:, start:start + chunk], shifted[:, start:start + chunk], start


# --------------------------------------------------------------------------- Hugging Face Llama
LLAMA_INTERMEDIATE = 256
_HAND_ATTENTION: list = []  # the DistributedAttention the registered HF attention function uses


def tiny_llama() -> nn.Module:
    """``LlamaForCausalLM`` from a random config of the TinyGPT size (nothing downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=LLAMA_INTERMEDIATE,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                         max_position_embeddings=4096, use_cache=False, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


class LlamaLoss(nn.Module):
    """The unchanged model as a user trains it: ``model(input_ids, labels=...).loss``."""

    def __init__(self, llm: nn.Module):
        super().__init__()
        self.llm = llm

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.llm(input_ids=input_ids, labels=labels, use_cache=False).loss


def _hand_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF attention function for hand-written Ulysses: q/k/v ``[B, H, s, D]`` of this rank's chunk."""
    out = _HAND_ATTENTION[0](query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), is_causal=True)
    return out, None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None  # causal attention over the gathered sequence is is_causal=True inside the all-to-all


class HandShardedLlama(nn.Module):
    """The same Llama run by hand for Ulysses, as a user would with DeepSpeed: each rank feeds its
    chunk of ids with position ids offset by the chunk start, a registered HF attention function
    does the all-to-alls, and the loss is the local sum over pre-shifted labels plus one all-reduce."""

    def __init__(self, group: Any, sp_size: int):
        super().__init__()
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register("ulysses_hand", _hand_attention)
        AttentionMaskInterface.register("ulysses_hand", _no_mask)
        _HAND_ATTENTION[:] = [DistributedAttention(group, sp_size)]
        self.group = group
        self.llm = tiny_llama()
        self.llm.config._attn_implementation = "ulysses_hand"

    def forward(self, input_ids: torch.Tensor, shifted_labels: torch.Tensor, start: int) -> torch.Tensor:
        positions = (torch.arange(input_ids.shape[1], device=input_ids.device) + start).expand(input_ids.shape[0], -1)
        hidden = self.llm.model(input_ids=input_ids, position_ids=positions, use_cache=False).last_hidden_state
        logits = self.llm.lm_head(hidden).float()
        local_sum = F.cross_entropy(logits.view(-1, logits.shape[-1]), shifted_labels.reshape(-1),
                                    ignore_index=-100, reduction="sum")
        count = (shifted_labels != -100).sum().to(local_sum.dtype)
        totals = all_reduce(torch.stack([local_sum.detach(), count]), "sum", self.group)
        return (local_sum + (totals[0] - local_sum.detach())) / totals[1]


# --------------------------------------------------------------------------- worker
def steps_for(cfg: dict, length: int) -> int:
    """``--steps`` at the longest length; shorter (cheaper) lengths get more, up to 4x."""
    return cfg["steps"] * max(1, min(4, max(cfg["lengths"]) // length))


_SP_GROUPS: dict = {}


def sequence_parallel_group(sp_size: int) -> Any:
    """A dedicated SP process group (as DeepSpeed creates one), not the world group the barriers use."""
    if sp_size not in _SP_GROUPS:
        _SP_GROUPS[sp_size] = dist.new_group(list(range(sp_size)))
    return _SP_GROUPS[sp_size]


def _counting(backend: Any, counter: list) -> Any:
    def compile_graph(gm, example_inputs):
        counter.append(len(gm.graph.nodes))
        return backend(gm, example_inputs)
    return compile_graph


def _dcp_backend(options: dict, counter: list) -> Any:
    from dcp_compile.compiler.backend import dcp_backend

    def compile_graph(gm, example_inputs):
        dispatcher = dcp_backend(gm, example_inputs, options=options)
        counter.append(dispatcher)  # the Dispatcher dynamo gets back, kept for its record
        return dispatcher
    return compile_graph


def _build(kind: str, base: nn.Module, inner: str, sp_size: int, counter: list) -> tuple[nn.Module, Any]:
    """(module, compiled callable) for kind in dcp / hand / plain."""
    if kind == "dcp":
        model = copy.deepcopy(base)
        options = {"sp_size": sp_size, "inner": inner}
        return model, torch.compile(model, backend=_dcp_backend(options, counter), dynamic=True)
    if kind == "hand":
        hand_class = HandShardedLlama if isinstance(base, LlamaLoss) else HandShardedGPT
        model = hand_class(sequence_parallel_group(sp_size), sp_size)
        model.load_state_dict(base.state_dict())
        return model, torch.compile(model, backend=_counting(torch._dynamo.lookup_backend(inner), counter), dynamic=True)
    model = copy.deepcopy(base)  # plain: no SP, the inner compiler alone
    return model, torch.compile(model, backend=_counting(torch._dynamo.lookup_backend(inner), counter), dynamic=True)


def _step(kind: str, model: nn.Module, compiled: Any, ids: torch.Tensor, rank: int, sp_size: int) -> tuple[float, float]:
    """One forward + backward; returns (seconds, loss)."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    if kind == "hand":
        chunk_ids, chunk_labels, offset = shard_batch(ids, rank, sp_size)
        loss = compiled(chunk_ids, chunk_labels, offset)
    else:
        loss = compiled(ids, ids)
    loss.backward()
    return time.perf_counter() - start, float(loss.detach())


def _summed_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.detach().clone() if param.grad is not None else torch.zeros_like(param)
        dist.all_reduce(grad)
        grads[name] = grad
    return grads


def worker(rank: int, world_size: int, cfg: dict) -> dict:
    import dcp_compile.compiler.backend  # noqa: F401  (sets dynamo's specialize_float for every model alike)

    torch.manual_seed(0)
    sp = world_size
    inner = cfg["inner"]
    base = LlamaLoss(tiny_llama()) if cfg["model"] == "llama" else TinyGPT(VOCAB, HIDDEN, LAYERS, HEADS)
    out: dict[str, Any] = {"checks": [], "times": {}, "compile": {"dcp": [], "hand": [], "plain": []},
                           "first_call": {}, "graphs": {}, "dcp_record": {}}

    def batch(length: int, seed: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, (cfg["batch"], length), generator=torch.Generator().manual_seed(seed))

    # ---- runtime: both models compiled once, all lengths through the same compiled objects
    counters = {"dcp": [], "hand": []}
    models = {kind: _build(kind, base, inner, sp, counters[kind]) for kind in ("dcp", "hand")}
    for li, length in enumerate(cfg["lengths"]):
        ids = batch(length, 1000 + li)
        # sanity: loss and SP-group-summed gradients against eager on the full batch
        reference = copy.deepcopy(base)
        eager_loss = reference(ids, ids)
        eager_loss.backward()
        check = {"length": length, "eager_loss": float(eager_loss.detach())}
        for kind, (model, compiled) in models.items():
            dist.barrier()
            seconds, loss = _step(kind, model, compiled, ids, rank, sp)
            if li == 0:
                out["first_call"][kind] = seconds
            grads = _summed_grads(model)
            check[f"{kind}_loss"] = loss
            check[f"{kind}_grad_err"] = max(float((grads[n] - p.grad).abs().max()) for n, p in reference.named_parameters())
        out["checks"].append(check)
        for _ in range(cfg["warmup"]):
            for kind, (model, compiled) in models.items():
                dist.barrier()
                _step(kind, model, compiled, ids, rank, sp)
        times = {"dcp": [], "hand": []}
        for i in range(steps_for(cfg, length)):
            order = ("dcp", "hand") if i % 2 == 0 else ("hand", "dcp")  # ABBA
            for kind in order:
                dist.barrier()
                seconds, _ = _step(kind, *models[kind], ids, rank, sp)
                times[kind].append(seconds)
        out["times"][length] = times
    out["graphs"] = {kind: len(counter) for kind, counter in counters.items()}

    # ---- compile time: fresh compiles after dynamo reset, rotating order
    kinds = ["plain", "dcp", "hand"]
    ids = batch(cfg["lengths"][0], 7)
    # (the runtime section above has paid the one-time import and cache costs)
    for repeat in range(cfg["compile_repeats"]):
        for kind in kinds[repeat % 3:] + kinds[:repeat % 3]:
            torch._dynamo.reset()
            counter: list = []
            model, compiled = _build(kind, base, inner, sp, counter)
            dist.barrier()
            seconds, _ = _step(kind, model, compiled, ids, rank, sp)
            out["compile"][kind].append(seconds)
            if kind == "dcp" and repeat == 0:
                for dispatcher in counter[:1]:
                    out["dcp_record"] = {
                        "analysis_seconds": dispatcher.record.trace_seconds,
                        "variant_seconds": {str(v): r.compile_seconds for v, r in dispatcher.record.variants.items()},
                    }
    torch._dynamo.reset()
    return out


# --------------------------------------------------------------------------- report
def _median(values: list[float]) -> float:
    return statistics.median(values)


def paired_ratio(dcp_times: list[float], hand_times: list[float], resamples: int = 2000) -> tuple[float, float, float]:
    """Median of the per-step ratios dcp_i / hand_i (adjacent steps) and its bootstrap 95% interval."""
    ratios = [d / h for d, h in zip(dcp_times, hand_times)]
    rng = random.Random(0)
    medians = sorted(_median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return _median(ratios), medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def summarize(results: list[dict], cfg: dict) -> tuple[list[dict], dict]:
    rows = []
    for index, length in enumerate(cfg["lengths"]):
        # a step's time is the slower rank's
        per_step = {kind: [max(r["times"][length][kind][i] for r in results)
                           for i in range(len(results[0]["times"][length][kind]))] for kind in ("dcp", "hand")}
        ratio, low, high = paired_ratio(per_step["dcp"], per_step["hand"])
        check = results[0]["checks"][index]
        rows.append({
            "length": length,
            "batch": cfg["batch"],
            "steps": len(per_step["dcp"]),
            "dcp_ms": 1000 * _median(per_step["dcp"]),
            "hand_ms": 1000 * _median(per_step["hand"]),
            "ratio_of_medians": _median(per_step["dcp"]) / _median(per_step["hand"]),
            "ratio": ratio,
            "ratio_ci_low": low,
            "ratio_ci_high": high,
            "eager_loss": check["eager_loss"],
            "dcp_loss": check["dcp_loss"],
            "hand_loss": check["hand_loss"],
            "dcp_grad_err": max(r["checks"][index]["dcp_grad_err"] for r in results),
            "hand_grad_err": max(r["checks"][index]["hand_grad_err"] for r in results),
        })
    compile_times = {kind: _median([max(r["compile"][kind][i] for r in results) for i in range(cfg["compile_repeats"])])
                     for kind in ("plain", "dcp", "hand")}
    extra = {"compile": compile_times, "graphs": results[0]["graphs"], "dcp_record": results[0]["dcp_record"],
             "first_call": {k: max(r["first_call"][k] for r in results) for k in ("dcp", "hand")}}
    return rows, extra


def model_description(cfg: dict) -> str:
    if cfg["model"] == "llama":
        return (f"Hugging Face `LlamaForCausalLM` from a random config (vocab {VOCAB}, hidden {HIDDEN}, intermediate "
                f"{LLAMA_INTERMEDIATE}, {LAYERS} layers, {HEADS} heads, SDPA attention, `use_cache=False`); dcp compiles "
                "`model(input_ids, labels=...).loss` unchanged, the hand-written version registers an HF attention "
                "function doing DeepSpeed-style all-to-alls and feeds each rank its chunk with offset position ids")
    return f"TinyGPT (vocab {VOCAB}, hidden {HIDDEN}, {LAYERS} layers, {HEADS} heads)"


def machine() -> str:
    return f"{run_description.machine()}, " + "gloo on localhost, 1 thread per rank"


def write(rows: list[dict], extra: dict, cfg: dict, elapsed: float) -> None:
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / ("ulysses_overhead" + cfg["suffix"])
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["kind", *rows[0], "model", "first_call_s", "inner"])
        writer.writeheader()
        for row in rows:
            writer.writerow({"kind": "step", **{k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()},
                             "inner": cfg["inner"]})
        for model, seconds in extra["compile"].items():
            writer.writerow({"kind": "compile", "length": cfg["lengths"][0], "batch": cfg["batch"], "model": model,
                             "first_call_s": f"{seconds:.3f}", "inner": cfg["inner"]})
    c = extra["compile"]
    lines = [
        "# Ulysses overhead: `dcp` backend vs hand-written Ulysses",
        "",
        f"Library at commit {library_version()}. Machine: {machine()}; 1-minute load average {LOAD[0]:.1f} at the start, {LOAD[1]:.1f} at the end. 2-process world, SP=2, inner compiler `{cfg['inner']}`. "
        f"Model: {model_description(cfg)}, batch {cfg['batch']}, fp32. "
        "A step is forward + backward (no optimizer). Steps alternate dcp / hand-written in ABBA order after a "
        f"barrier; a step's time is the slower rank's; timed steps per model: "
        + ", ".join(f"{steps_for(cfg, n)} at {n}" for n in cfg["lengths"]) + f", after {cfg['warmup']} warm-up "
        f"steps. The hand-written model uses its own SP process group (`new_group`), as dcp does. dcp / hand = median of "
        "the per-step ratios of adjacent dcp and hand-written steps, with a bootstrap 95% interval of that median; the "
        "ratio of the two medians is given too. "
        f"Run took {elapsed:.0f} s: `PYTHONPATH=. python benchmarks/ulysses_overhead.py {' '.join(cfg['argv'])}`.",
        "",
        "| length | steps | dcp ms | hand-written ms | dcp / hand (paired median) | 95% interval | ratio of medians | eager loss | dcp loss | hand loss | max grad err dcp / hand |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['length']} | {r['steps']} | {r['dcp_ms']:.2f} | {r['hand_ms']:.2f} | {r['ratio']:.3f} | "
                     f"{r['ratio_ci_low']:.3f} - {r['ratio_ci_high']:.3f} | {r['ratio_of_medians']:.3f} | "
                     f"{r['eager_loss']:.6f} | {r['dcp_loss']:.6f} | "
                     f"{r['hand_loss']:.6f} | {r['dcp_grad_err']:.1e} / {r['hand_grad_err']:.1e} |")
    rec = extra["dcp_record"]
    lines += [
        "",
        f"Compile time (first call, forward + backward, after `torch._dynamo.reset()`; slower rank; median of "
        f"{cfg['compile_repeats']} in rotating order; includes one step at length {cfg['lengths'][0]}):",
        "",
        "| model | first call s | vs plain |",
        "|---|---|---|",
        f"| plain `torch.compile` (no SP, `{cfg['inner']}`) | {c['plain']:.2f} | 1.00x |",
        f"| hand-written Ulysses (`{cfg['inner']}`) | {c['hand']:.2f} | {c['hand'] / c['plain']:.2f}x |",
        f"| `dcp` backend, SP=2 | {c['dcp']:.2f} | {c['dcp'] / c['plain']:.2f}x |",
        "",
        f"dcp record (rank 0, first repeat): backend analysis (ATen re-trace + find attention + sequence dims) "
        f"{rec.get('analysis_seconds', float('nan')):.2f} s; variant build (shard / all-to-all / recompute passes, AOTAutograd joint trace and partition, forward compile) "
        + ", ".join(f"{k}: {v:.2f} s" for k, v in rec.get("variant_seconds", {}).items())
        + f". Graphs dynamo handed to the backend over all lengths: dcp {extra['graphs']['dcp']}, hand-written {extra['graphs']['hand']}.",
        "",
    ]
    lines += commentary(rows, extra, cfg)
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")


def commentary(rows: list[dict], extra: dict, cfg: dict) -> list[str]:
    lines = ["## Reading", ""]
    verdicts = []
    for r in rows:
        if r["ratio_ci_high"] <= 1.05:
            verdicts.append(f"{r['length']}: within 5% (interval {r['ratio_ci_low']:.3f}-{r['ratio_ci_high']:.3f})")
        elif r["ratio_ci_low"] > 1.05:
            verdicts.append(f"{r['length']}: MORE than 5% slower (interval {r['ratio_ci_low']:.3f}-{r['ratio_ci_high']:.3f})")
        else:
            verdicts.append(f"{r['length']}: not resolved, the interval {r['ratio_ci_low']:.3f}-{r['ratio_ci_high']:.3f} "
                            "contains both 1.0 and 1.05")
    lines.append("- Goal: dcp within 5% of hand-written. " + "; ".join(verdicts) + ".")
    lines.append(
        "- Noise: two ranks with one thread each on two cores that other jobs also use. While other jobs kept the load "
        "average at 5-9, three runs of an earlier version of this benchmark gave dcp/hand medians from 0.89 to 1.11 at "
        "256 and from 0.89 to 1.04 at 1024; in quiet periods (load average 1-2) step times halve and the intervals "
        f"narrow. This run: load average {LOAD[0]:.1f} at the start, {LOAD[1]:.1f} at the end. Rerun when the machine is "
        "idle before reading the third digit.")
    lines.append(
        "- Both compiled graphs do the same work: 4 all-to-alls per attention forward (q, k, v, output) and 4 in backward, "
        "of identical sizes, the same local SDPA, one all-reduce of [loss sum, token count]. dcp's backward has no all-reduce "
        "(the loss's gradient is the same on every rank, so the all-reduce's adjoint is a local multiply by P; until "
        "c8dff51 it was a second all-reduce, a synchronisation point that changed nothing); dcp adds its per-call rank "
        "check (one 6-integer all-gather, about 0.9 ms on this machine: see consistency_overhead.md) and a few small copies. "
        + ("A first version of this benchmark whose "
           "hand-written model split q/k/v with `unbind` (a cheaper backward than the original model's permute and "
           "unpacking) measured dcp/hand = 1.059 (1.008-1.091) at 256 in a quiet period; written as in the original model "
           "the gap disappears, so that model-code difference weighed more than dcp's extra all-reduce. "
           if cfg["model"] == "tinygpt" else
           "Both run Hugging Face's own Llama layers; dcp also runs HF's loss (the label shift on the full sequence, "
           "then the shard-local cross-entropy), the hand-written model a pre-shifted local loss. The main difference "
           "at long lengths was the mask: traced by torch.compile, transformers materialises the causal mask as a "
           "[B, 1, S, S] boolean tensor (its is_causal shortcut is off while tracing), which SDPA then reads in full "
           "on every rank after the all-to-all, while the hand-written attention function passes is_causal=True. "
           "dcp's causal_masks pass proves such a mask causal (built from sizes alone) and runs SDPA with "
           "is_causal=True; before it, this benchmark measured 1.285 (1.212-1.356) at 1024. ")
        + "The per-call dispatcher cost (microseconds, see dispatch_overhead.md) is invisible at this scale.")
    lines.append(
        "- Sanity: dcp, hand-written and eager give the same loss to fp32 rounding, and the gradients summed over the SP "
        "group match eager's full-batch gradients (max abs error in the table).")
    c = extra["compile"]
    lines.append(
        f"- Compile: dcp's first call costs {c['dcp'] / c['plain']:.2f}x a plain torch.compile of the unchanged model and "
        f"{c['dcp'] / c['hand']:.2f}x the hand-written model's: dynamo traces once in all three; dcp adds its ATen "
        "re-trace and analysis, and the sharding pass (which re-traces the graph) and the all-to-all lowering (traced per attention; see the record line). That cost is "
        "paid once per model; a new length does not recompile (one graph for both lengths, above).")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", default="aot_eager", choices=["aot_eager", "inductor"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30,
                        help="timed steps per model at the longest length (shorter lengths: up to 4x more)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile-repeats", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--suffix", default=None, help="results file suffix (default: _llama for --model llama)")
    parser.add_argument("--model", default="tinygpt", choices=["tinygpt", "llama"])
    args = parser.parse_args(argv)
    for length in args.lengths:
        if length % 2:
            parser.error(f"length {length}: the hand-written version needs lengths divisible by the SP size 2")
    if args.suffix is None:
        args.suffix = "_llama" if args.model == "llama" else ""
    cfg = dict(vars(args), argv=sys.argv[1:] if argv is None else argv)
    from dcp_compile.testing.process_world import run_in_process_world

    LOAD[0] = os.getloadavg()[0]
    start = time.perf_counter()
    print(f"ulysses_overhead: 2-process gloo world, model={args.model}, inner={args.inner}, lengths={args.lengths}", flush=True)
    results = run_in_process_world(worker, 2, cfg, timeout=args.timeout)
    elapsed = time.perf_counter() - start
    LOAD[1] = os.getloadavg()[0]
    rows, extra = summarize(results, cfg)
    print(f"{'length':>7} {'dcp ms':>9} {'hand ms':>9} {'dcp/hand':>9} {'95% interval':>13} {'loss dcp':>10} {'loss hand':>10} {'loss eager':>10}")
    for r in rows:
        print(f"{r['length']:>7} {r['dcp_ms']:>9.2f} {r['hand_ms']:>9.2f} {r['ratio']:>9.3f} "
              f"{r['ratio_ci_low']:>6.3f}-{r['ratio_ci_high']:<6.3f} {r['dcp_loss']:>10.6f} {r['hand_loss']:>10.6f} {r['eager_loss']:>10.6f}")
    c = extra["compile"]
    print(f"compile (first call fw+bw): plain {c['plain']:.2f}s  hand {c['hand']:.2f}s  dcp {c['dcp']:.2f}s "
          f"(dcp/plain {c['dcp'] / c['plain']:.2f}x); graphs: {extra['graphs']}; dcp record: {extra['dcp_record']}")
    write(rows, extra, cfg, elapsed)
    print(f"wrote {RESULTS / ('ulysses_overhead' + args.suffix)}.md/.csv ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
