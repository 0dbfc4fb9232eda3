"""Train a diffusers video DiT with data-centric parallelism from a Hugging Face Accelerate loop.

    accelerate launch --num_processes 4 examples/train_video_dit_accelerate.py
    torchrun --nproc_per_node 4 examples/train_video_dit_accelerate.py --resume   # continue the last run

The loop is shaped like diffusers' training scripts (``Accelerator``, ``accelerator.prepare`` of the
optimizer and learning-rate scheduler, ``accelerator.backward``, ``clip_grad_norm_``,
``save_state``/``load_state`` checkpoints, ``get_scheduler``); the lines data-centric parallelism
adds or changes end with ``# dcp``: the model is prepared by ``dcp.accelerate.prepare_model``
(placed and cast by the Accelerator, not wrapped in DDP, compiled with ``backend="dcp"``), the data
by ``dcp.accelerate.prepare_data`` (one item per optimizer step: this rank's micro-batches of the
step's plan), each micro-batch runs under ``dcp.use(mb)`` with its loss weighted by
``mb.loss_scale``, and ``dcp.sync_gradients`` replaces DDP's all-reduce. No
``accelerator.accumulate``: the planner's micro-batches are the accumulation.

The data, the model (Wan's ``WanTransformer3DModel`` at a small random size) and the
noise-prediction loss are those of ``examples/train_video_dit.py`` (imported from it): latent clips
of mixed resolutions and frame counts, one ``.pt`` file per clip, grouped by shape inside a
micro-batch. ``--tiny`` is the size CI runs (``tests/test_examples.py``, 2 gloo ranks).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_video_dit import SMALL, TINY, LatentClips, build_model, collate, describe, noised, profile, write_latents  # noqa: E402

import dcp_compile as dcp  # noqa: E402
from dcp_compile.schedule.cost_model import CostModel  # noqa: E402
from dcp_compile.schedule.hardware import Hardware  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="example_data/video_latents", help="latent clip directory; written if absent")
    parser.add_argument("--samples", type=int, default=512, help="clips to write on the first run")
    parser.add_argument("--max_train_steps", "--steps", type=int, default=100, dest="steps",
                        help="optimizer steps to train (in total, across resumes)")
    parser.add_argument("--tokens-per-step", type=int, default=65536, help="latent tokens per optimizer step, whole world")
    parser.add_argument("--max-tokens-per-rank", type=int, default=None, help="cap on one rank's micro-batch tokens")
    parser.add_argument("--learning_rate", "--lr", type=float, default=1e-4, dest="lr")
    parser.add_argument("--lr_scheduler", default="constant_with_warmup")
    parser.add_argument("--lr_warmup_steps", type=int, default=10)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--mixed_precision", default=None, choices=[None, "no", "bf16", "fp16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output_dir", "--checkpoint-dir", default="checkpoints/video_dit_accelerate", dest="output_dir")
    parser.add_argument("--checkpointing_steps", "--checkpoint-every", type=int, default=50, dest="checkpoint_every",
                        help="save_state every this many steps (0: never)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output_dir")
    parser.add_argument("--num-workers", type=int, default=2, help="DataLoader workers per rank")
    parser.add_argument("--tiny", action="store_true", help="CI size: a tiny model, small clips, small steps")
    args = parser.parse_args()
    args.size = TINY if args.tiny else SMALL
    if args.tiny:
        args.samples, args.tokens_per_step = min(args.samples, 32), min(args.tokens_per_step, 600)
    return args


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest ``checkpoint-N`` folder that ``save_state`` completed (diffusers' naming)."""
    done = [path for path in output_dir.glob("checkpoint-*") if (path / "complete").is_file()]
    return max(done, key=lambda path: int(path.name.split("-")[1]), default=None)


def main() -> None:
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from diffusers.optimization import get_scheduler

    args = parse_args()
    accelerator = Accelerator(mixed_precision=args.mixed_precision, cpu=not torch.cuda.is_available())
    set_seed(args.seed)
    rank, world = accelerator.process_index, accelerator.num_processes

    root = Path(args.data)
    if accelerator.is_main_process and not (root / "manifest.json").exists():
        write_latents(root, args.samples, args.tiny, args.size.text_dim)
    accelerator.wait_for_everyone()
    dataset = LatentClips(root)
    tokens = [dataset.tokens(i) for i in range(len(dataset))]
    token_cap = args.max_tokens_per_rank or (-(-max(tokens) // world) if args.tiny else None)

    inner = "inductor" if torch.cuda.is_available() else "eager"
    model, compiled = dcp.accelerate.prepare_model(accelerator, build_model(args.size), options={"inner": inner})  # dcp
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    lr_scheduler = get_scheduler(args.lr_scheduler, optimizer=optimizer, num_warmup_steps=args.lr_warmup_steps,
                                 num_training_steps=args.steps)
    optimizer, lr_scheduler = accelerator.prepare(optimizer, lr_scheduler)
    cost_model = CostModel(profile(args.size), Hardware.detect())  # dcp
    sampler = dcp.DataCentricSampler(tokens, args.tokens_per_step, cost_model, token_cap, seed=args.seed)  # dcp
    loader = dcp.accelerate.prepare_data(accelerator, dataset, sampler, collate_fn=collate,  # dcp
                                         num_workers=args.num_workers)

    output_dir, step = Path(args.output_dir), 0
    latest = latest_checkpoint(output_dir) if args.resume else None
    if latest is not None:
        accelerator.load_state(str(latest))  # model, optimizer, scheduler, RNG and the sampler's position
        step = int(latest.name.split("-")[1])
    bar = tqdm(total=args.steps, initial=step, disable=not accelerator.is_main_process, unit="step", dynamic_ncols=True)
    summary_shown = False
    while step < args.steps:
        for loaded in loader:  # dcp: one item per optimizer step, on every rank
            started = time.perf_counter()
            with dcp.report.recording() as record:  # what the compiled graphs did: printed once, below
                loss_sum = torch.zeros((), device=accelerator.device)
                for mb, clip_groups in loaded:
                    for group in clip_groups:
                        inputs, noise = noised(group, step, args.seed, accelerator.device)
                        with dcp.use(mb):  # dcp
                            prediction = compiled(**inputs)[0]
                        loss = F.mse_loss(prediction.float(), noise)
                        accelerator.backward(loss * mb.loss_scale * group.share)  # dcp
                        loss_sum += loss.detach() * mb.loss_scale * group.share / mb.sp_size
            dcp.sync_gradients(model)  # dcp
            accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            mean_loss = float(accelerator.reduce(loss_sum, reduction="sum"))
            tokens_per_s = loaded.plan.tokens / (time.perf_counter() - started)
            bar.update(1)
            bar.set_postfix_str(f"loss {mean_loss:.3f} | {tokens_per_s:,.0f} tokens/s")
            if accelerator.is_main_process:
                bar.write(f"step {step}: {loaded.plan.tokens} tokens, {tokens_per_s:,.0f} tokens/s, loss {mean_loss:.4f} | "
                          f"{describe(loaded.plan)}")
                if not summary_shown and len(record):  # sites sharded, gathers, graphs and why
                    bar.write(dcp.report.sharding_summary(record))
                    summary_shown = True
            if args.checkpoint_every and (step % args.checkpoint_every == 0 or step == args.steps):
                path = output_dir / f"checkpoint-{step}"
                accelerator.save_state(str(path))  # the loader is registered: the sampler's position too
                accelerator.wait_for_everyone()  # every rank's RNG state is written before "complete"
                if accelerator.is_main_process:
                    (path / "complete").touch()
            if step >= args.steps:
                break
    bar.close()
    accelerator.end_training()


if __name__ == "__main__":
    main()
