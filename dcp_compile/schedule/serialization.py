"""The cost model as a JSON file, so a job plans with measured numbers without a second launch.

The published system profiles, writes files and relaunches; here :meth:`CostModel.calibrate`
returns a calibrated model in the same process, and :func:`save` / :func:`load` keep it for the
next job. Format: ``{"format": FORMAT, "version": VERSION, "profile": ..., "hardware": ...,
"scales": ..., "optimizer_shards": ..., "reserved_bytes": ..., "state_sharding": ..., "regions": ...,
"measured": ...}`` (``measured``:
what ``dcp.profile`` timed, see :mod:`.measured_costs`); version 1 and 2 files (profiles
without ``head_activation_bytes_per_token``) still load.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Mapping, TypeVar

from .analytic import GiB
from .hardware import Hardware
from .measured_costs import MeasuredCosts
from .model_profile import ModelProfile

if TYPE_CHECKING:
    from .cost_model import CostModel

FORMAT = "dcp-compile cost model"
VERSION = 3  # 2: profiles price what the head and loss keep per recompute policy; 3: measured costs

Model = TypeVar("Model", bound="CostModel")


def cost_model_to_dict(model: "CostModel") -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "profile": model.profile.to_dict(),
        "hardware": model.hardware.to_dict(),
        "scales": dict(model.scales),
        "optimizer_shards": model.optimizer_shards,
        "reserved_bytes": model.reserved_bytes,
        "collectives_recomputed": model.collectives_recomputed,
        "state_sharding": model.state_sharding.value,
        "regions": model.regions,
        "measured": None if model.measured is None else model.measured.to_dict(),
    }


def cost_model_from_dict(cls: type[Model], data: Mapping[str, Any]) -> Model:
    if data.get("format") != FORMAT:
        raise ValueError("not a dcp-compile cost model file (missing format tag); write it with CostModel.save")
    return cls(
        profile=ModelProfile.from_dict(data["profile"]),
        hardware=Hardware.from_dict(data["hardware"]),
        scales={k: float(v) for k, v in data["scales"].items()},
        optimizer_shards=int(data.get("optimizer_shards", 1)),
        reserved_bytes=float(data.get("reserved_bytes", GiB)),
        collectives_recomputed=bool(data.get("collectives_recomputed", False)),
        measured=MeasuredCosts.from_dict(data["measured"]) if data.get("measured") else None,
        state_sharding=data.get("state_sharding", "replicated"),
        regions=bool(data.get("regions", False)),  # files from before it: whole-graph variants
    )


def save(model: "CostModel", path: str | os.PathLike[str]) -> None:
    """Write the model as JSON (write-then-rename, so a reader never sees half a file)."""
    temporary = f"{os.fspath(path)}.tmp"
    with open(temporary, "w") as handle:
        json.dump(cost_model_to_dict(model), handle, indent=2, sort_keys=True)
    os.replace(temporary, path)


def load(cls: type[Model], path: str | os.PathLike[str]) -> Model:
    with open(path) as handle:
        return cost_model_from_dict(cls, json.load(handle))
