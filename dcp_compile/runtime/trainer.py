"""``transformers.Trainer`` with data-centric steps: ``dcp.huggingface.DataCentricTrainer``.

    from dcp_compile.huggingface import DataCentricArguments, DataCentricTrainer

    trainer = DataCentricTrainer(model=model, args=TrainingArguments(output_dir="out", ...),
                                 train_dataset=dataset, data_collator=collate,
                                 dcp_args=DataCentricArguments(tokens_per_step=65536, cost_model=cost_model))
    trainer.train()                               # or trainer.train(resume_from_checkpoint=True)

What changes against the stock ``Trainer`` (transformers 5.x), and why, override by override:

* ``get_train_dataloader``: one item per optimizer step (:class:`DataCentricStepLoader`): the
  data-centric sampler plans each step for the whole world, and a rank's share (its micro-batches,
  maybe none) is one item. Every rank then sees the same number of items, so the Trainer's
  per-item bookkeeping (accumulation, optimizer step, logging, saving) stays in step across
  ranks. The Trainer's own sampler and ``accelerator.prepare`` sharding are not used: the plan
  already says which rank trains which sample.
* ``_wrap_model``: the model is compiled with ``backend="dcp"`` instead of being wrapped in DDP.
  DDP would all-reduce (and average) inside every backward, but ranks run different numbers of
  micro-batches and exact token weighting needs a SUM; :func:`dcp.sync_gradients` does that once
  per optimizer step. ``self.model`` stays the plain model, so saving is unchanged.
* ``get_batch_samples`` / ``training_step``: a step's micro-batches run under ``dcp.use(mb)``
  (SP group, recompute policy) with the loss weighted by ``mb.loss_scale``, times the step's
  share of the targets of the ``gradient_accumulation_steps`` steps accumulated into one update
  (counted exactly from the plans, as the Trainer counts ``num_items_in_batch``). The gradients
  are synchronised after the last step of the update, before the Trainer clips and steps.
* ``_save_checkpoint`` / ``_init_training_state`` / ``get_resumed_dataloader``: the sampler's
  position goes into each checkpoint folder (``dcp_sampler.json``) and is restored on resume, so
  a resumed run trains exactly the samples not yet seen, instead of skipping batches of a
  re-shuffled loader.

``gradient_accumulation_steps`` here counts data-centric steps per optimizer update; the
micro-batches inside a step are the planner's accumulation and need no setting.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from transformers import Trainer

from dcp_compile.runtime.step_loader import DataCentricStepLoader
from dcp_compile.schedule.data_loading import LoadedStep

log = logging.getLogger(__name__)

SAMPLER_STATE_NAME = "dcp_sampler.json"


@dataclass
class DataCentricArguments:
    """What the data-centric sampler and the backend need beyond ``TrainingArguments``.

    ``lengths``: each sample's tokens (default: ``len(sample["input_ids"])``); ``supervised_tokens``:
    each sample's loss targets (default: ``length - 1`` for a model whose loss shifts labels, as
    a causal LM's does, else the length). ``cost_model``: what the planner prices steps with
    (default ``CostModel.default()``; measure one on your model with ``dcp.ModelProfile.measure``).
    ``compile_options``: the backend's ``options`` (``{"inner": "aot_eager"}``, ``buckets``, ...).
    The shuffling seed is ``TrainingArguments.data_seed`` or ``seed``.
    """

    tokens_per_step: int
    cost_model: Any = None
    max_tokens_per_rank: int | None = None
    lengths: Sequence[int] | None = None
    supervised_tokens: Sequence[int] | None = None
    compile_options: dict[str, Any] = field(default_factory=dict)
    plan_ahead: bool = True


class DataCentricTrainer(Trainer):
    """A ``transformers.Trainer`` whose training loop runs data-centric steps (module docstring)."""

    def __init__(self, *args: Any, dcp_args: DataCentricArguments, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(dcp_args, DataCentricArguments):
            raise TypeError("DataCentricTrainer needs dcp_args=dcp.huggingface.DataCentricArguments(tokens_per_step=...)")
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError("DataCentricTrainer replaces DDP with dcp.sync_gradients and does not run under DeepSpeed "
                             "or the Trainer's FSDP; drop those TrainingArguments (FSDP2: see the FSDP2 loop in docs/training.md)")
        self.dcp_args = dcp_args
        self.step_loader: DataCentricStepLoader | None = None
        self.compiled_model: torch.nn.Module | None = None

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self) -> DataCentricStepLoader:
        """One item per optimizer step; built once, so its position survives a second ``train()``."""
        if self.step_loader is not None:
            return self.step_loader
        if self.train_dataset is None:
            raise ValueError("DataCentricTrainer: training requires a train_dataset")
        import dcp_compile as dcp

        dataset, collator = self.train_dataset, self.data_collator
        try:
            import datasets

            if isinstance(dataset, datasets.Dataset):
                dataset = self._remove_unused_columns(dataset, description="Training")
            else:
                collator = self._get_collator_with_removed_columns(collator, description="Training")
        except ImportError:
            collator = self._get_collator_with_removed_columns(collator, description="Training")
        lengths = list(self.dcp_args.lengths) if self.dcp_args.lengths is not None else _sample_lengths(dataset)
        supervised = self.dcp_args.supervised_tokens
        if supervised is None and getattr(self, "_loss_shifts_labels", False):
            supervised = [max(n - 1, 0) for n in lengths]
        sampler = dcp.DataCentricSampler(
            lengths, self.dcp_args.tokens_per_step, self.dcp_args.cost_model, self.dcp_args.max_tokens_per_rank,
            seed=self.args.data_seed if self.args.data_seed is not None else self.args.seed,
            supervised_tokens=supervised,
        )
        self.step_loader = DataCentricStepLoader(
            dataset, sampler, collator, plan_ahead=self.dcp_args.plan_ahead,
            num_workers=self.args.dataloader_num_workers, pin_memory=self.args.dataloader_pin_memory,
        )
        return self.step_loader

    def get_resumed_dataloader(self, dataloader: Any, num_batches: int) -> Any:
        """The restored sampler already starts at the step to resume; check the Trainer agrees."""
        if isinstance(dataloader, DataCentricStepLoader):
            if dataloader.position[1] != num_batches:
                raise RuntimeError(
                    f"dcp: the checkpoint's sampler position is step {dataloader.position[1]} of epoch "
                    f"{dataloader.position[0]}, but the Trainer resumes after {num_batches} steps of the epoch: the "
                    f"checkpoint's {SAMPLER_STATE_NAME} and trainer_state.json come from different runs"
                )
            return dataloader
        return super().get_resumed_dataloader(dataloader, num_batches)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device) -> tuple[list, int]:
        """The update's steps and their targets over the world (every loss is a share of those)."""
        steps = []
        for _ in range(num_batches):
            try:
                steps.append(next(epoch_iterator))
            except StopIteration:
                break
        loader = self.get_train_dataloader()
        return steps, sum(loader.supervised_tokens(step) for step in steps)

    # ------------------------------------------------------------------ model
    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader: Any = None) -> torch.nn.Module:
        if not training:
            return super()._wrap_model(model, training, dataloader)
        if self.compiled_model is None:
            import dcp_compile as dcp

            dcp.watch_parameters(self.model)  # graph breaks: exact from the first step (docs/limitations.md)
            self.compiled_model = torch.compile(self.model, backend="dcp", dynamic=True,
                                                options=dict(self.dcp_args.compile_options))
        return self.compiled_model

    def training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """Run this rank's micro-batches of one data-centric step; sync after the update's last step.

        Returns the step's loss over the world for logging: each rank returns its share times the
        world size, since the Trainer logs the mean over ranks.
        """
        import dcp_compile as dcp

        if not isinstance(inputs, LoadedStep):
            raise TypeError(f"DataCentricTrainer.training_step expects a data-centric step, got {type(inputs).__name__}; "
                            "the train dataloader must be the one get_train_dataloader builds")
        model.train()
        total = int(num_items_in_batch) if num_items_in_batch is not None else 0
        share = self.get_train_dataloader().supervised_tokens(inputs) / total if total else 0.0
        logged = torch.zeros((), device=self.args.device)
        for microbatch, batch in inputs:
            batch = self._prepare_inputs(batch)
            with dcp.use(microbatch), self.compute_loss_context_manager(), self.accelerator.autocast():
                loss = self.compute_loss(model, batch)
            weighted = loss * (microbatch.loss_scale * share)
            # accelerator.backward divides by its own accumulation count; the weights above are exact already.
            self.accelerator.backward(weighted * self.accelerator.gradient_accumulation_steps)
            logged += weighted.detach() / microbatch.sp_size  # an SP group returns its loss on each of its ranks
        if self.accelerator.sync_gradients:  # the update's last step (the Trainer sets it per item)
            dcp.sync_gradients(self.model)
        return logged * self.args.world_size

    def floating_point_ops(self, inputs: Any) -> int:
        if isinstance(inputs, LoadedStep):
            return sum(super(DataCentricTrainer, self).floating_point_ops(batch) for _, batch in inputs)
        return super().floating_point_ops(inputs)

    def _track_num_input_tokens(self, inputs: Any) -> None:
        if isinstance(inputs, LoadedStep):
            if self.args.include_num_input_tokens_seen not in ("no", False):
                # The plan is global and identical on every rank: its tokens are the world's.
                self.state.num_input_tokens_seen += inputs.plan.tokens
            return
        super()._track_num_input_tokens(inputs)

    # ------------------------------------------------------------------ checkpoints
    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if self.step_loader is None or not self.args.should_save:
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        with open(os.path.join(folder, SAMPLER_STATE_NAME), "w") as file:
            json.dump(self.step_loader.state_dict(), file)

    def _init_training_state(self, max_steps: int, num_update_steps_per_epoch: int, num_train_epochs: int,
                             resume_from_checkpoint: str | None, trial: Any) -> tuple[int, int]:
        trained = super()._init_training_state(max_steps, num_update_steps_per_epoch, num_train_epochs,
                                               resume_from_checkpoint, trial)
        if resume_from_checkpoint is not None:
            path = os.path.join(resume_from_checkpoint, SAMPLER_STATE_NAME)
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"dcp: {path} is missing, so the data-centric sampler cannot resume where the checkpoint stopped; "
                    "resume from a checkpoint a DataCentricTrainer wrote (it saves the sampler's position there)"
                )
            with open(path) as file:
                self.get_train_dataloader().load_state_dict(json.load(file))
        return trained


def _sample_lengths(dataset: Any) -> list[int]:
    """Each sample's token count from its ``input_ids`` (what the sampler plans with)."""
    try:
        column = dataset["input_ids"] if hasattr(dataset, "column_names") else None
        if column is not None:
            return [len(ids) for ids in column]
        return [len(dataset[i]["input_ids"]) for i in range(len(dataset))]
    except (KeyError, TypeError, IndexError) as error:
        raise ValueError(
            "DataCentricTrainer could not read each sample's length from sample['input_ids'] "
            f"({type(error).__name__}: {error}); pass DataCentricArguments(lengths=[tokens of each sample], ...)"
        ) from None
