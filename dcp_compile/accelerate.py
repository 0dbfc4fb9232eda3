"""``dcp.accelerate``: data-centric steps in a Hugging Face Accelerate loop (what diffusers'
training scripts use). See :mod:`dcp_compile.runtime.accelerate_glue` for the loop and why the
model is prepared without DDP; ``examples/train_video_dit_accelerate.py`` is a complete script."""

from __future__ import annotations

from dcp_compile.runtime.accelerate_glue import prepare_data, prepare_model
from dcp_compile.runtime.step_loader import DataCentricStepLoader

__all__ = ["prepare_model", "prepare_data", "DataCentricStepLoader"]
