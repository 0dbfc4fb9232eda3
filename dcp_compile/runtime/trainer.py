"""``transformers.Trainer`` with data-centric steps: ``dcp.huggingface.DataCentricTrainer``.

    from dcp_compile.huggingface import DataCentricArguments, DataCentricTrainer

    trainer = DataCentricTrainer(model=model, args=TrainingArguments(output_dir="out", ...),
                                 train_dataset=dataset, data_collator=collate,
                                 dcp_args=DataCentricArguments(tokens_per_step=65536, cost_model=cost_model))
    trainer.train()                               # or trainer.train(resume_from_checkpoint=True)

Built on the Trainer's public extension points, so that one code path runs on every supported
release (the range in pyproject.toml, both ends tested by ``tests/test_hf_versions.py``):

* ``get_train_dataloader``: one item per optimizer step (:class:`DataCentricStepLoader`, shaped
  like a ``DataLoader``): the data-centric sampler plans each step for the whole world, and a
  rank's share (its micro-batches, maybe none) is one item. Every rank sees the same number of
  items, so the Trainer's per-item bookkeeping (accumulation, optimizer step, logging, saving)
  stays in step across ranks. A resumed run is skipped forward by the Trainer itself
  (``skip_first_batches``), which the loader's shape supports.
* ``model_wrapped`` (the documented "most external model"): set to the model compiled with
  ``backend="dcp"`` before training, so the Trainer neither wraps it in DDP nor hands it to
  ``accelerator.prepare``. DDP would all-reduce (and average) inside every backward, but ranks
  run different numbers of micro-batches and exact token weighting needs a SUM;
  :func:`dcp.sync_gradients` does that once per optimizer update. ``self.model`` stays the plain
  model, so saving and evaluation are unchanged.
* ``get_batch_samples`` / ``training_step`` / ``compute_loss``: a step's micro-batches run under
  ``dcp.use(mb)`` (SP group, recompute policy) through the Trainer's ``compute_loss``, each loss
  weighted by ``mb.loss_scale`` times the step's share of the targets of the update's
  ``gradient_accumulation_steps`` steps (counted exactly from the plans). The gradients are
  synchronised after the update's last step, before the Trainer clips and steps.
  ``training_step`` returns the step's loss over the whole world (one all-reduce), the same on
  every rank, so every rank logs the global loss and the same ``train_loss``.
* a callback's ``on_save``: the sampler's position goes into each checkpoint folder
  (``dcp_sampler.json``); ``train(resume_from_checkpoint=...)`` validates it against the data and
  settings and checks that the Trainer resumes at the step it names.

Private Trainer API still used, each because no public hook does it: ``_remove_unused_columns`` /
``_get_collator_with_removed_columns`` (the Trainer's own column filtering, so a dataset behaves
as under the stock Trainer) and ``_track_num_input_tokens`` (overridden only to stop the Trainer
from counting tokens in a step it cannot read; the count is the plans', kept in ``training_step``;
releases without that method count inline and log a warning instead).

``gradient_accumulation_steps`` here counts data-centric steps per optimizer update; the
micro-batches inside a step are the planner's accumulation and need no setting.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
from transformers import Trainer, TrainerCallback

from dcp_compile.runtime.accelerate_glue import check_world
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


class SamplerCheckpoint(TrainerCallback):
    """Write the sampler's position into each checkpoint folder the Trainer saves.

    The Trainer's own state says how many updates ran; this says which samples they were and
    with which settings, so a resume can be checked against the data.
    """

    def on_save(self, args: Any, state: Any, control: Any, train_dataloader: Any = None, **kwargs: Any) -> None:
        if not isinstance(train_dataloader, DataCentricStepLoader) or not args.should_save:
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"dcp: the Trainer saved no checkpoint folder {folder} to write "
                                    f"{SAMPLER_STATE_NAME} into (hyperparameter-search runs are not supported)")
        with open(os.path.join(folder, SAMPLER_STATE_NAME), "w") as file:
            json.dump(train_dataloader.state_dict(), file)


class DataCentricTrainer(Trainer):
    """A ``transformers.Trainer`` whose training loop runs data-centric steps (module docstring)."""

    def __init__(self, *args: Any, dcp_args: DataCentricArguments, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(dcp_args, DataCentricArguments):
            raise TypeError("DataCentricTrainer needs dcp_args=dcp.huggingface.DataCentricArguments(tokens_per_step=...)")
        _check_setup(self)
        self.dcp_args = dcp_args
        self.step_loader: DataCentricStepLoader | None = None
        self.compiled_model: torch.nn.Module | None = None
        self._resume_at: tuple[int, int] | None = None  # the step a resumed run must train first
        self.add_callback(SamplerCheckpoint())

    # ------------------------------------------------------------------ entry point
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """Compile the model, build the step loader (its sampler's position checked against the
        checkpoint when resuming), then run the stock training loop."""
        if resume_from_checkpoint is True:
            from transformers.trainer_utils import get_last_checkpoint

            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir) or True  # None: the Trainer says so
        self._use_compiled_model()
        self.step_loader = self._build_step_loader()
        self._resume_at = None
        if isinstance(resume_from_checkpoint, str):
            self._restore_sampler(resume_from_checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _use_compiled_model(self) -> None:
        """Compile once; as ``model_wrapped`` it is what the Trainer trains, without DDP."""
        if self.compiled_model is None:
            import dcp_compile as dcp

            dcp.runtime.watch_parameters(self.model)  # graph breaks: exact from the first step (docs/limitations.md)
            self.compiled_model = torch.compile(self.model, backend="dcp", dynamic=True,
                                                options=dict(self.dcp_args.compile_options))
        self.model_wrapped = self.compiled_model

    def _restore_sampler(self, checkpoint: str) -> None:
        """Validate the checkpoint's sampler state; the Trainer skips the epoch's trained steps itself."""
        path = os.path.join(checkpoint, SAMPLER_STATE_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"dcp: {path} is missing, so the data-centric sampler cannot check where the checkpoint stopped; "
                "resume from a checkpoint a DataCentricTrainer wrote (it saves the sampler's position there)"
            )
        with open(path) as file:
            self.step_loader.load_state_dict(json.load(file))  # raises if the data or settings differ
        epoch, next_step = self.step_loader.position
        self.step_loader.batch_sampler.move_to(epoch, 0)
        if not self.args.ignore_data_skip:
            self._resume_at = (epoch, next_step)

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self) -> DataCentricStepLoader:
        """One item per optimizer step (built by ``train``; here for callers outside it)."""
        if self.step_loader is None:
            self.step_loader = self._build_step_loader()
        return self.step_loader

    def _build_step_loader(self) -> DataCentricStepLoader:
        if self.train_dataset is None:
            raise ValueError("DataCentricTrainer: training requires a train_dataset")
        import dcp_compile as dcp

        dataset, collator = self._filtered_dataset_and_collator()
        lengths = list(self.dcp_args.lengths) if self.dcp_args.lengths is not None else _sample_lengths(dataset)
        supervised = self.dcp_args.supervised_tokens
        if supervised is None and _loss_shifts_labels(self.model):
            supervised = [max(n - 1, 0) for n in lengths]
        sampler = dcp.DataCentricSampler(
            lengths, self.dcp_args.tokens_per_step, self.dcp_args.cost_model, self.dcp_args.max_tokens_per_rank,
            seed=self.args.data_seed if self.args.data_seed is not None else self.args.seed,
            supervised_tokens=supervised,
        )
        return DataCentricStepLoader(
            dataset, sampler, collator, plan_ahead=self.dcp_args.plan_ahead,
            num_workers=self.args.dataloader_num_workers, pin_memory=self.args.dataloader_pin_memory,
        )

    def _filtered_dataset_and_collator(self) -> tuple[Any, Any]:
        """Drop the columns the model does not take, as the stock Trainer does (private helpers)."""
        dataset, collator = self.train_dataset, self.data_collator
        try:
            import datasets
        except ImportError:
            datasets = None
        if datasets is not None and isinstance(dataset, datasets.Dataset):
            return self._remove_unused_columns(dataset, description="Training"), collator
        return dataset, self._get_collator_with_removed_columns(collator, description="Training")

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int, device: Any = None) -> tuple[list, int]:
        """The update's steps and their targets over the world (every loss is a share of those)."""
        steps = []
        for _ in range(num_batches):
            try:
                steps.append(next(epoch_iterator))
            except StopIteration:
                break
        loader = self.get_train_dataloader()
        return steps, sum(loader.supervised_tokens(step) for step in steps)

    # ------------------------------------------------------------------ training
    def training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None,
                      *args: Any) -> torch.Tensor:
        """Run this rank's micro-batches of one data-centric step; sync after the update's last step.

        Returns the step's share of the update's loss over the whole world, the same on every
        rank: what the Trainer logs is then the global loss, whichever rank logs it.
        """
        import dcp_compile as dcp
        from accelerate.utils import send_to_device

        if not isinstance(inputs, LoadedStep):
            raise TypeError(f"DataCentricTrainer.training_step expects a data-centric step, got {type(inputs).__name__}; "
                            "the train dataloader must be the one get_train_dataloader builds")
        self._hand_out(inputs)
        model.train()
        total = int(num_items_in_batch) if num_items_in_batch is not None else 0
        share = self.get_train_dataloader().supervised_tokens(inputs) / total if total else 0.0
        local = torch.zeros((), device=self.args.device)
        for microbatch, batch in inputs:
            batch = send_to_device(batch, self.args.device)
            with dcp.use(microbatch), self.compute_loss_context_manager(), self.accelerator.autocast():
                loss = self.compute_loss(model, batch)
            weighted = loss * (microbatch.loss_scale * share)
            # accelerator.backward divides by its own accumulation count; the weights above are exact already.
            self.accelerator.backward(weighted * self.accelerator.gradient_accumulation_steps)
            local += weighted.detach().float() / microbatch.sp_size  # an SP group returns its loss on each of its ranks
        if self.accelerator.sync_gradients:  # the update's last step (the Trainer sets it per item)
            dcp.sync_gradients(self.model)
        if self.args.include_num_input_tokens_seen not in ("no", False):
            self.state.num_input_tokens_seen += inputs.plan.tokens  # the plan is global: the world's tokens
        return self.accelerator.reduce(local, reduction="sum")

    def _hand_out(self, step: LoadedStep) -> None:
        """Check the plan across ranks and advance the loader (also for the Trainer's skipped
        copy of it on resume); the first step of a resumed run must be the checkpoint's next."""
        if self._resume_at is not None:
            expected, self._resume_at = self._resume_at, None
            if (step.plan.epoch, step.plan.step) != expected:
                raise RuntimeError(
                    f"dcp: the checkpoint's sampler position is step {expected[1]} of epoch {expected[0]}, but the "
                    f"Trainer resumed at step {step.plan.step} of epoch {step.plan.epoch}: the checkpoint's "
                    f"{SAMPLER_STATE_NAME} and trainer_state.json come from different runs or settings"
                )
        self.get_train_dataloader().consume(step)

    def floating_point_ops(self, inputs: Any) -> int:
        """The step's FLOPs on this rank: an SP group shares each micro-batch's work."""
        if isinstance(inputs, LoadedStep):
            return int(sum(Trainer.floating_point_ops(self, batch) / mb.sp_size for mb, batch in inputs))
        return super().floating_point_ops(inputs)

    def _track_num_input_tokens(self, inputs: Any) -> None:
        """Private hook, overridden only so the Trainer does not count a step it cannot read
        (``training_step`` counts the plan's tokens)."""
        if not isinstance(inputs, LoadedStep):
            super()._track_num_input_tokens(inputs)


def _check_setup(trainer: Trainer) -> None:
    """Refuse what data-centric steps cannot run under, naming the fix."""
    args = trainer.args
    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        raise ValueError("DataCentricTrainer replaces DDP with dcp.sync_gradients and does not run under DeepSpeed "
                         "or the Trainer's FSDP; drop those TrainingArguments (FSDP2: see the FSDP2 loop in docs/training.md)")
    if trainer.model_init is not None:
        raise ValueError("DataCentricTrainer compiles the model it is given: pass model=..., not model_init "
                         "(hyperparameter search is not supported)")
    if args.n_gpu > 1:
        raise ValueError(f"DataCentricTrainer runs one process per device, but this process sees {args.n_gpu} GPUs "
                         "(the Trainer would use nn.DataParallel): launch with torchrun or accelerate launch")
    check_world(args.world_size, "the Trainer",
                "pass TrainingArguments(use_cpu=True) on CPU (or launch with `accelerate launch --cpu`)")


def _loss_shifts_labels(model: torch.nn.Module) -> bool:
    """A causal LM's loss predicts token i + 1 at position i: each sample has ``length - 1`` targets."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return False
    if getattr(model, "loss_type", None) == "ForCausalLM":  # PEFT wrappers forward the attribute
        return True
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


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
