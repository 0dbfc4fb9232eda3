"""Train a diffusers video DiT with data-centric parallelism on latents of mixed resolutions and lengths.

    torchrun --nproc_per_node 4 examples/train_video_dit.py              # a small random video DiT
    torchrun --nproc_per_node 4 examples/train_video_dit.py --resume     # continue the last run

CPU (gloo) or GPUs (NCCL), picked by ``torch.cuda.is_available()``. The model code is not touched;
the lines of the training loop that data-centric parallelism adds or changes end with ``# dcp``
(count them: ``grep -c '# dcp$' examples/train_video_dit.py``).

The data is what a video pipeline trains on after its VAE and text encoder: one ``.pt`` file per
clip holding its latent ``[channels, frames, height, width]`` and its caption embedding, plus a
``manifest.json`` with every clip's latent shape, so the token counts are known without opening
the files. The script writes a synthetic set on its first run: clips of several resolutions and
frame counts, from a few dozen to thousands of tokens. Each sample's *token count* (latent frames
x patches per frame) is what the sampler plans with: a long clip runs on an SP group of several
ranks, short ones run alone, several to a micro-batch.

The model is Wan's ``WanTransformer3DModel`` at a small random configuration: a video DiT with
3D RoPE, so one model takes any frame count and resolution. (A Latte-style model learns a
temporal position table for one fixed frame count, and CogVideoX 1.0 builds its sin-cos table with
numpy inside ``forward``, which this library's tracer cannot shard yet; docs/zoo.md.)
The loss is the usual noise-prediction MSE at a random timestep.

Clips of different shapes cannot be stacked, so ``collate`` groups a micro-batch's clips by shape
and the loop runs one forward per group, weighting each by its share of the micro-batch's tokens:
the step is still exactly the mean over every latent element of the step. Noise and timesteps are
drawn from a generator seeded by the step and the group's first sample: the ranks of an SP group
must pass identical inputs, and a run resumed from a checkpoint draws the same noise again, so it
continues exactly as if it had never stopped.

``--tiny`` is the size CI runs (a few steps on 2 ranks); it also caps the tokens one rank may hold
so that the plans mix SP sizes (a tiny model on a large machine would never need them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

import dcp_compile as dcp
from dcp_compile.schedule.cost_model import CostModel, ModelProfile
from dcp_compile.schedule.hardware import Hardware

CHANNELS, TEXT_TOKENS = 4, 13
PATCH = (1, 2, 2)  # frames, height, width of one token
DIFFUSION_STEPS = 1000


@dataclass(frozen=True)
class ModelSize:
    heads: int
    head_dim: int
    ffn: int
    layers: int
    text_dim: int

    @property
    def width(self) -> int:
        return self.heads * self.head_dim


TINY = ModelSize(heads=4, head_dim=8, ffn=64, layers=2, text_dim=16)
SMALL = ModelSize(heads=8, head_dim=32, ffn=1024, layers=8, text_dim=64)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="example_data/video_latents", help="latent clip directory; written if absent")
    parser.add_argument("--samples", type=int, default=512, help="clips to write on the first run")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps to train (in total, across resumes)")
    parser.add_argument("--tokens-per-step", type=int, default=65536, help="latent tokens per optimizer step, whole world")
    parser.add_argument("--max-tokens-per-rank", type=int, default=None, help="cap on one rank's micro-batch tokens")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", default="checkpoints/video_dit")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="save every this many steps (0: never)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    parser.add_argument("--num-workers", type=int, default=2, help="DataLoader workers per rank")
    parser.add_argument("--tiny", action="store_true", help="CI size: a tiny model, small clips, small steps")
    args = parser.parse_args()
    args.size = TINY if args.tiny else SMALL
    if args.tiny:
        args.samples, args.tokens_per_step = min(args.samples, 32), min(args.tokens_per_step, 600)
    return args


# --- data: one .pt file per clip, a manifest of shapes ---------------------------------------
def write_latents(root: Path, count: int, tiny: bool, text_dim: int) -> None:
    """Synthetic latents at mixed resolutions and frame counts, long-tailed like real video sets."""
    rng = random.Random(0)
    frames = (3, 5) if tiny else (3, 5, 9, 13)
    sizes = ((6, 8), (8, 10), (10, 14)) if tiny else ((16, 16), (24, 32), (32, 48), (48, 64))
    generator = torch.Generator().manual_seed(0)
    root.mkdir(parents=True, exist_ok=True)
    manifest = []
    for index in range(count):
        shape = (CHANNELS, rng.choices(frames, weights=[2 ** -i for i in range(len(frames))])[0],
                 *rng.choices(sizes, weights=[2 ** -i for i in range(len(sizes))])[0])
        name = f"clip_{index:06d}.pt"
        torch.save({"latent": torch.randn(shape, generator=generator),
                    "caption": torch.randn(TEXT_TOKENS, text_dim, generator=generator)}, root / name)
        manifest.append({"file": name, "shape": list(shape)})
    (root / "manifest.tmp").write_text(json.dumps(manifest))
    os.replace(root / "manifest.tmp", root / "manifest.json")  # last: its presence means the set is complete


class LatentClips(Dataset):
    """Reads one clip per ``__getitem__`` (in a DataLoader worker); shapes come from the manifest."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.entries = json.loads((root / "manifest.json").read_text())

    def __len__(self) -> int:
        return len(self.entries)

    def tokens(self, index: int) -> int:
        _, frames, height, width = self.entries[index]["shape"]
        return (frames // PATCH[0]) * (height // PATCH[1]) * (width // PATCH[2])

    def __getitem__(self, index: int) -> dict:
        return {"index": index, **torch.load(self.root / self.entries[index]["file"])}


@dataclass
class ClipGroup:
    """Clips of one shape, stacked; ``share``: their part of the micro-batch's tokens."""

    indices: list[int]
    latents: torch.Tensor  # [B, C, F, H, W]
    captions: torch.Tensor  # [B, text tokens, text dim]
    share: float


def collate(samples: list[dict]) -> list[ClipGroup]:
    """Group a micro-batch's clips by latent shape (clips of different shapes cannot be stacked)."""
    by_shape: dict[tuple[int, ...], list[dict]] = {}
    for sample in samples:
        by_shape.setdefault(tuple(sample["latent"].shape), []).append(sample)
    total = sum(math.prod(shape) * len(group) for shape, group in by_shape.items())
    return [ClipGroup([s["index"] for s in group], torch.stack([s["latent"] for s in group]),
                      torch.stack([s["caption"] for s in group]), math.prod(shape) * len(group) / total)
            for shape, group in sorted(by_shape.items())]


# --- model: untouched diffusers transformer ----------------------------------------------------
def build_model(size: ModelSize):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=PATCH, num_attention_heads=size.heads, attention_head_dim=size.head_dim, in_channels=CHANNELS,
        out_channels=CHANNELS, text_dim=size.text_dim, freq_dim=32 if size is TINY else 256, ffn_dim=size.ffn,
        num_layers=size.layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=1024,
    )


def profile(size: ModelSize) -> ModelProfile:
    """The cost model's view of the DiT: full 3D self-attention, cross-attention to the caption."""
    return ModelProfile.transformer("wan-example", num_layers=size.layers, hidden_size=size.width, num_heads=size.heads,
                                    ffn_hidden_size=size.ffn, causal=False, cross_attention_tokens=TEXT_TOKENS,
                                    output_channels=CHANNELS * math.prod(PATCH), rotary=True)


def noised(group: ClipGroup, step: int, seed: int, device: torch.device) -> tuple[dict, torch.Tensor]:
    """The model's inputs at a random timestep and the noise to predict (a cosine schedule).

    Seeded by the step and the group's first clip: identical on every rank of the SP group that runs
    it, and the same again in a resumed run."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 10_007 + group.indices[0])
    noise = torch.randn(group.latents.shape, generator=generator)
    timestep = torch.randint(0, DIFFUSION_STEPS, (len(group.indices),), generator=generator)
    alpha_bar = torch.cos((timestep.float() / DIFFUSION_STEPS + 0.008) / 1.008 * math.pi / 2) ** 2
    scale = alpha_bar.view(-1, 1, 1, 1, 1)
    latents = scale.sqrt() * group.latents + (1 - scale).sqrt() * noise
    inputs = {"hidden_states": latents.to(device), "timestep": timestep.float().to(device),
              "encoder_hidden_states": group.captions.to(device), "return_dict": False}
    return inputs, noise.to(device)


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
    """The step's mean loss over the world (for display): an SP group returns its loss on each of
    its ranks, so each rank contributes ``loss * weight / sp_size``."""
    total = torch.zeros((), device=device)
    for loss, weight, sp_size in losses:
        total += loss * weight / sp_size
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

    root = Path(args.data)
    if rank == 0 and not (root / "manifest.json").exists():
        write_latents(root, args.samples, args.tiny, args.size.text_dim)
    dist.barrier()
    dataset = LatentClips(root)
    tokens = [dataset.tokens(i) for i in range(len(dataset))]
    token_cap = args.max_tokens_per_rank or (-(-max(tokens) // world) if args.tiny else None)

    model = build_model(args.size).to(device)
    model = dcp.shard_model(model)  # dcp
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "inductor" if cuda else "eager"})  # dcp
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    cost_model = CostModel(profile(args.size), Hardware.detect(), optimizer_shards=world)  # dcp
    sampler = dcp.DataCentricSampler(tokens, args.tokens_per_step, cost_model, token_cap, seed=args.seed)  # dcp
    batches = dcp.DataCentricBatchSampler(sampler)  # dcp
    loader = DataLoader(dataset, batch_sampler=batches, num_workers=args.num_workers, collate_fn=collate)  # dcp

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
                for mb, clip_groups in loaded:
                    for group in clip_groups:
                        inputs, noise = noised(group, step, args.seed, device)
                        with dcp.use(mb), autocast:  # dcp
                            prediction = compiled(**inputs)[0]
                        loss = F.mse_loss(prediction.float(), noise)
                        (loss * mb.loss_scale * group.share).backward()  # dcp
                        losses.append((loss.detach(), mb.loss_scale * group.share, mb.sp_size))
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
