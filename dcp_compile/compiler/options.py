"""The backend's options, validated once, with errors that list what is valid."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dcp_compile.compiler.passes import check_disable_passes
from dcp_compile.compiler.variant_selection import Bucket
from dcp_compile.tiled_loss import LOSS_CHUNK_BYTES, LOSS_CHUNK_TOKENS
from dcp_compile.tiled_mlp import MLP_CHUNK_BYTES, MLP_CHUNK_TOKENS
from dcp_compile.variant import REGIONS_BY_DEFAULT, RecomputePolicy, Variant

INNER_COMPILERS = ("inductor", "aot_eager", "eager")


@dataclass(frozen=True)
class DCPOptions:
    sp_size: int | None = None  # static mode: one SP size for every batch (default: the world)
    inner: str = "inductor"
    buckets: tuple[Bucket, ...] = ()
    recompute: RecomputePolicy = RecomputePolicy.NONE  # policy of the static variant
    disable_passes: tuple[str, ...] = ()
    debug_dir: str | None = None
    check: bool = False  # compare each variant's first call with the unsharded graph (dcp.check's light form)
    check_ranks: bool = True  # the SP group agrees on variant and inputs before each call (runtime/consistency.py)
    regions: bool = REGIONS_BY_DEFAULT  # compile token-local regions once for every variant (compiler/regions/)
    loss_chunk: int | None = None  # tokens per chunk of the tiled loss (None: tiled_loss.default_chunk_tokens)
    mlp_chunk: int | None = None  # tokens per chunk of the tiled MLP under lean (None: tiled_mlp.default_mlp_chunk_tokens)

    @property
    def valid_names(self) -> list[str]:
        return sorted(self.__dataclass_fields__)


def _parse_bucket(entry: Any, index: int) -> Bucket:
    if isinstance(entry, Bucket):
        return entry
    if not isinstance(entry, dict):
        raise TypeError(f"dcp: bucket {index} must be a dict like "
                        "{'max_len': 2048, 'sp_size': 1, 'recompute': 'none'}, got " f"{entry!r}")
    known = {"max_len", "sp_size", "recompute"}
    unknown = set(entry) - known
    if unknown:
        raise ValueError(f"dcp: bucket {index} has unknown keys {sorted(unknown)}; valid keys: {sorted(known)}")
    if "max_len" not in entry:
        raise ValueError(f"dcp: bucket {index} needs 'max_len' (an int, or None for no upper bound)")
    max_len = entry["max_len"]
    if max_len is not None and (not isinstance(max_len, int) or max_len < 1):
        raise ValueError(f"dcp: bucket {index} has max_len={max_len!r}; use a positive int or None")
    from dcp_compile.runtime.process_groups import validate_sp_size

    sp_size = validate_sp_size(entry.get("sp_size", 1))
    return Bucket(max_len, Variant(sp_size, RecomputePolicy.parse(entry.get("recompute", "none"))))


def parse_options(options: dict[str, Any] | None) -> DCPOptions:
    options = dict(options or {})
    valid = sorted(DCPOptions.__dataclass_fields__)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"dcp: unknown option(s) {unknown}; valid options are {valid}")
    inner = options.get("inner", "inductor")
    if inner not in INNER_COMPILERS:
        raise ValueError(f"dcp: unknown inner compiler {inner!r}; use one of {list(INNER_COMPILERS)}")
    sp_size = options.get("sp_size")
    if sp_size is not None:
        from dcp_compile.runtime.process_groups import validate_sp_size

        sp_size = validate_sp_size(sp_size)
    recompute = RecomputePolicy.parse(options.get("recompute", "none"))
    buckets = tuple(_parse_bucket(entry, i) for i, entry in enumerate(options.get("buckets") or ()))
    max_lens = [b.max_len for b in buckets]
    if len(set(max_lens)) != len(max_lens):
        raise ValueError(f"dcp: two buckets share a max_len ({max_lens}); each bucket needs its own bound")
    disable_passes = tuple(options.get("disable_passes", ()))
    loss_chunk = options.get("loss_chunk")
    if loss_chunk is not None and (isinstance(loss_chunk, bool) or not isinstance(loss_chunk, int) or loss_chunk < 1):
        raise ValueError(f"dcp: loss_chunk={loss_chunk!r}: give the tiled loss's chunk as a positive number of tokens "
                         f"(default: up to {LOSS_CHUNK_TOKENS}, fewer where a chunk's logits would pass "
                         f"{LOSS_CHUNK_BYTES >> 20} MiB)")
    mlp_chunk = options.get("mlp_chunk")
    if mlp_chunk is not None and (isinstance(mlp_chunk, bool) or not isinstance(mlp_chunk, int) or mlp_chunk < 1):
        raise ValueError(f"dcp: mlp_chunk={mlp_chunk!r}: give the tiled MLP's chunk as a positive number of tokens "
                         f"(default: up to {MLP_CHUNK_TOKENS}, fewer where a chunk's ffn-wide tensors would pass "
                         f"{MLP_CHUNK_BYTES >> 20} MiB)")
    check_disable_passes(disable_passes)
    return DCPOptions(
        sp_size=sp_size,
        inner=inner,
        buckets=buckets,
        recompute=recompute,
        disable_passes=disable_passes,
        debug_dir=options.get("debug_dir"),
        check=bool(options.get("check", False)),
        check_ranks=bool(options.get("check_ranks", True)),
        regions=bool(options.get("regions", REGIONS_BY_DEFAULT)),
        loss_chunk=loss_chunk,
        mlp_chunk=mlp_chunk,
    )
