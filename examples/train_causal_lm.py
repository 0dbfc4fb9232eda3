"""Train a Hugging Face causal LM with data-centric parallelism, FSDP2 and resumable checkpoints.

    torchrun --nproc_per_node 4 examples/train_causal_lm.py                 # a random tiny Llama
    torchrun --nproc_per_node 4 examples/train_causal_lm.py --model PATH    # a local checkpoint
    torchrun --nproc_per_node 4 examples/train_causal_lm.py --resume        # continue the last run

CPU (gloo) or GPUs (NCCL), picked by ``torch.cuda.is_available()``. The model code is not touched;
the lines of the training loop that data-centric parallelism adds or changes end with ``# dcp``
(count them: ``grep -c '# dcp$' examples/train_causal_lm.py``). Everything else is an ordinary
FSDP2 + DataLoader script: read text with the ``datasets`` library (from a JSONL file of texts of
very different lengths that the script writes on its first run), tokenize, pad, AdamW, a progress
bar with tokens/s and each step's plan: the SP group sizes, micro-batches per rank, recompute.

Why each ``# dcp`` line is there:

* the *sampler* plans each step from the samples' lengths: which sequences run on which SP group
  (long ones over several ranks, short ones alone), how many micro-batches each rank runs and
  what it recomputes, identically on every rank; ``supervised_tokens=[n - 1 ...]`` because a
  causal LM predicts the next token, so a sample of ``n`` tokens has ``n - 1`` labels;
* ``dcp.use(mb)`` runs the micro-batch on its SP group, and ``loss * mb.loss_scale`` weights it
  by its share of the step's labels, so the step is exactly the mean token loss;
* with FSDP2, ranks run different numbers of micro-batches, so ``dcp.begin_step`` gathers the
  parameters once per step and ``dcp.sync_gradients`` reduce-scatters once;
* ``dcp.checkpoint.save_checkpoint`` / ``dcp.checkpoint.load_checkpoint`` keep the sampler's position with the model
  and optimizer (``torch.distributed.checkpoint``, written atomically), so ``--resume``
  continues with exactly the samples not yet seen.

``--tiny`` is the size CI runs (a few steps on 2 ranks). ``--max-tokens-per-rank`` caps the tokens
one rank holds in a micro-batch; without it the cost model's memory estimate decides, and a tiny
model on a large machine would never need sequence parallelism, so ``--tiny`` sets a small cap to
show plans that mix SP sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from tqdm import tqdm

import dcp_compile as dcp
from dcp_compile.schedule.cost_model import CostModel, ModelProfile
from dcp_compile.schedule.hardware import Hardware

BYTE_VOCAB = 256 + 1  # the random model reads UTF-8 bytes; id 256 pads (never a label)
WORDS = ("data", "centric", "parallel", "sequence", "token", "attention", "gradient", "rank", "batch",
         "model", "length", "plan", "step", "memory", "the", "a", "of", "and", "to", "in")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a local Hugging Face causal LM directory (default: a random tiny Llama)")
    parser.add_argument("--data", default="example_data/texts.jsonl", help="JSONL file of {'text': ...}; written if absent")
    parser.add_argument("--samples", type=int, default=2000, help="texts to write on the first run")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps to train (in total, across resumes)")
    parser.add_argument("--tokens-per-step", type=int, default=32768, help="tokens per optimizer step, whole world")
    parser.add_argument("--max-tokens-per-rank", type=int, default=None, help="cap on one rank's micro-batch tokens")
    parser.add_argument("--max-length", type=int, default=8192, help="truncate texts to this many tokens")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--checkpoint-dir", default="checkpoints/causal_lm")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="save every this many steps (0: never)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    parser.add_argument("--num-workers", type=int, default=2, help="DataLoader workers per rank")
    parser.add_argument("--tiny", action="store_true", help="CI size: a small model, short texts, small steps")
    args = parser.parse_args()
    if args.tiny:
        args.samples, args.tokens_per_step = min(args.samples, 96), min(args.tokens_per_step, 512)
    return args


def token_cap(args: argparse.Namespace, lengths: list[int], world: int) -> int | None:
    """``--max-tokens-per-rank``, or for ``--tiny`` the smallest cap the longest text fits under on
    the whole world: texts above it then need SP groups, so the plans mix SP sizes."""
    if args.max_tokens_per_rank or not args.tiny:
        return args.max_tokens_per_rank
    return -(-max(lengths) // world)


# --- data: a JSONL file read with `datasets` -------------------------------------------------
def write_texts(path: Path, count: int, tiny: bool) -> None:
    """Texts whose lengths span two orders of magnitude (long-tailed, as real corpora are)."""
    rng = random.Random(0)
    longest = 24 if tiny else 2000
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.tmp", "w") as file:
        for _ in range(count):
            words = min(longest, max(3, int(rng.paretovariate(1.2) * 4)))
            file.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(words))}) + "\n")
    os.replace(f"{path}.tmp", path)


def load_tokenized(path: Path, model_path: str | None, max_length: int, rank: int):
    """The dataset as token ids; rank 0 builds the `datasets` cache first, then the others read it."""
    from datasets import load_dataset

    tokenizer = None
    if model_path:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)

    def tokenize(rows):
        if tokenizer is not None:
            ids = tokenizer(rows["text"], truncation=True, max_length=max_length)["input_ids"]
        else:
            ids = [list(text.encode())[:max_length] for text in rows["text"]]
        return {"input_ids": ids, "length": [len(sample) for sample in ids]}  # lengths: one column, not every row

    for turn in (0, 1):
        if (rank == 0) == (turn == 0):
            texts = load_dataset("json", data_files=str(path), split="train")
            tokenized = texts.map(tokenize, batched=True, remove_columns=["text"])
            # A one-token text has no label after the shift (a micro-batch of only such texts has no loss).
            dataset = tokenized.filter(lambda n: n >= 2, input_columns="length").with_format("torch")
        dist.barrier()
    return dataset, (tokenizer.pad_token_id or 0) if tokenizer is not None else BYTE_VOCAB - 1


@dataclass
class Collate:
    """Right-pad a micro-batch; padded positions get label -100. No attention mask is needed: the
    attention is causal, so padding at the end changes no real token's output."""

    pad_id: int

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(s["input_ids"]) for s in samples)
        ids = torch.full((len(samples), longest), self.pad_id, dtype=torch.long)
        labels = torch.full((len(samples), longest), -100, dtype=torch.long)
        for row, sample in enumerate(samples):
            n = len(sample["input_ids"])
            ids[row, :n] = sample["input_ids"]
            labels[row, :n] = sample["input_ids"]
        return {"input_ids": ids, "labels": labels}


# --- model: untouched ------------------------------------------------------------------------
def build_model(args: argparse.Namespace):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    width, layers = (64, 2) if args.tiny else (512, 8)
    config = LlamaConfig(vocab_size=BYTE_VOCAB, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=16384, use_cache=False,
                         attn_implementation="sdpa", bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(config)


# --- reporting -------------------------------------------------------------------------------
def describe(plan: dcp.schedule.StepPlan) -> str:
    """The step's plan in one line: SP groups by size, micro-batches per rank, recompute policies."""
    groups: dict[int, int] = {}
    for group in plan.groups:
        groups[group.sp_size] = groups.get(group.sp_size, 0) + 1
    sp = " ".join(f"{count}x sp{size}" for size, count in sorted(groups.items(), reverse=True))
    per_rank = [len(plan.rank_microbatches(rank)) for rank in range(plan.world_size)]
    recompute = sorted({mb.recompute.value for group in plan.groups for mb in group.microbatches})
    return f"plan: {sp} | micro-batches per rank {per_rank} | recompute {','.join(recompute)}"


def step_loss(losses: list[tuple[torch.Tensor, float, int]], device: torch.device) -> float:
    """The step's mean token loss over the world (for display): each SP group returns its loss on
    every one of its ranks, so each rank contributes ``loss * loss_scale / sp_size``."""
    total = torch.zeros((), device=device)
    for loss, scale, sp_size in losses:
        total += loss * scale / sp_size
    dist.all_reduce(total)
    return float(total)


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    data = Path(args.data)
    if rank == 0 and not data.exists():
        write_texts(data, args.samples, args.tiny)
    dist.barrier()
    dataset, pad_id = load_tokenized(data, args.model, args.max_length, rank)
    lengths = [int(n) for n in dataset["length"]]

    model = build_model(args).to(device)
    model = dcp.shard_model(model)  # dcp
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "inductor" if cuda else "eager"})  # dcp
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    cost_model = CostModel(ModelProfile.from_config(model.config), Hardware.detect(), optimizer_shards=world)  # dcp
    sampler = dcp.DataCentricSampler(lengths, args.tokens_per_step, cost_model, token_cap(args, lengths, world), supervised_tokens=[n - 1 for n in lengths])  # dcp
    batches = dcp.DataCentricBatchSampler(sampler)  # dcp
    loader = DataLoader(dataset, batch_sampler=batches, num_workers=args.num_workers, collate_fn=Collate(pad_id))  # dcp

    step = 0
    latest = dcp.checkpoint.latest_checkpoint(args.checkpoint_dir) if args.resume else None
    if latest is not None:
        step = dcp.checkpoint.load_checkpoint(latest, model=model, optimizer=optimizer, batches=batches).step  # dcp
    bar = tqdm(total=args.steps, initial=step, disable=rank != 0, unit="step", dynamic_ncols=True)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)
    summary_shown = False
    while step < args.steps:
        for loaded in batches.steps(loader):  # dcp
            started = time.perf_counter()
            dcp.begin_step(model)  # dcp
            losses = []
            with dcp.report.recording() as record:  # what the compiled graphs did: printed once, below
                for mb, batch in loaded:
                    batch = {key: value.to(device, non_blocking=True) for key, value in batch.items()}
                    with dcp.use(mb), autocast:  # dcp
                        loss = compiled(**batch).loss
                    (loss * mb.loss_scale).backward()  # dcp
                    losses.append((loss.detach().float(), mb.loss_scale, mb.sp_size))
            dcp.sync_gradients(model)  # dcp
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            mean_loss = step_loss(losses, device)
            tokens_per_s = loaded.plan.tokens / (time.perf_counter() - started)
            bar.update(1)
            bar.set_postfix_str(f"loss {mean_loss:.3f} | {tokens_per_s:,.0f} tokens/s")
            if rank == 0:
                bar.write(f"step {step}: {loaded.plan.tokens} tokens, {tokens_per_s:,.0f} tokens/s, loss {mean_loss:.4f} | "
                          f"{describe(loaded.plan)}")
                if not summary_shown and len(record):  # sites sharded, gathers, graphs and why
                    bar.write(dcp.report.sharding_summary(record))
                    summary_shown = True
            if args.checkpoint_every and (step % args.checkpoint_every == 0 or step == args.steps):
                dcp.checkpoint.save_checkpoint(dcp.checkpoint.checkpoint_path(args.checkpoint_dir, step), model=model, optimizer=optimizer, batches=batches, step=step)  # dcp
            if step >= args.steps:
                break
    bar.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
