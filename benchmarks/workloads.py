"""The fair comparisons' workloads: length distributions from published statistics, read from
``workloads.json`` (fixed there before any run: seeds, setups, sources, assumptions).

``steps(distribution, seed, tokens_per_step, count, context_window)`` draws the steps every
scheduler of a comparison trains (iso-batch): samples drawn with a seeded generator until a step
holds ``tokens_per_step`` tokens (the last sample may overshoot). A video step also gives each
clip's (latent frames, rows, columns), scaled by a setup's ``latent_scale`` where one is given
(``distribution(name, latent_scale)``: a coarser patch along each axis, the same for every clip, so
that a CPU stand-in runs the published bucket mix). A text distribution's documents can be scaled
alike (``distribution(name, length_scale=n)``: every document ``n`` times shorter, so that a CPU
stand-in trains the published mix's shape at lengths it can run). ``python benchmarks/workloads.py`` prints each
distribution's statistics beside its source's figures.
"""

from __future__ import annotations

import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner import RESOLUTIONS, FRAMES, video_shape, _zipf_counts  # noqa: E402

from dcp_compile.schedule.model_profile import video_attention_span  # noqa: E402

WORKLOADS_FILE = Path(__file__).resolve().parent / "workloads.json"


def load() -> dict[str, Any]:
    return json.loads(WORKLOADS_FILE.read_text())


Shape = tuple[int, int, int]  # (latent frames, rows, columns) of patches


@dataclass(frozen=True)
class Step:
    """One step's samples: token lengths, attention spans (None: full attention) and, for video,
    each clip's shape (frames, rows, columns; their product is the clip's length)."""

    lengths: list[int]
    spans: list[float] | None
    shapes: list[Shape] | None = None


def scaled_shape(shape: Shape, latent_scale: dict[str, int] | None) -> Shape:
    """``shape`` with latent frames, rows and columns divided by ``latent_scale``'s ``frames``,
    ``rows`` and ``columns``, rounded up; an image (one frame) keeps its frame."""
    if not latent_scale:
        return shape
    frames, rows, columns = shape
    return (1 if frames == 1 else math.ceil(frames / latent_scale["frames"]), math.ceil(rows / latent_scale["rows"]),
            math.ceil(columns / latent_scale["columns"]))


SHORTEST_SCALED_DOCUMENT = 8  # tokens: a scaled document is never shorter (a packed row of 1-token documents is no workload)


class Distribution:
    """Draws samples of one distribution of ``workloads.json`` (video clips scaled by
    ``latent_scale``, if given: see :func:`scaled_shape`; text documents divided by
    ``length_scale``, rounded up, at least :data:`SHORTEST_SCALED_DOCUMENT` tokens)."""

    def __init__(self, name: str, spec: dict[str, Any], latent_scale: dict[str, int] | None = None,
                 length_scale: int | None = None) -> None:
        self.name, self.spec, self.kind = name, spec, spec["kind"]
        self.latent_scale, self.length_scale = latent_scale, length_scale
        if length_scale is not None and (spec["kind"] == "opensora_buckets" or length_scale < 1):
            raise ValueError(f"{name}: a length scale applies to text documents only, and is at least 1")
        if self.kind == "opensora_buckets":
            self._buckets = _opensora_buckets(spec["num_videos"], spec["image_multiple"], latent_scale)
        elif latent_scale:
            raise ValueError(f"{name}: a latent scale applies to video clips only")
        elif self.kind not in ("mixture_exponential", "log_uniform_bins"):
            raise ValueError(f"unknown distribution kind {self.kind!r} in {WORKLOADS_FILE}")

    @property
    def video(self) -> bool:
        return self.kind == "opensora_buckets"

    @property
    def buckets(self) -> list[tuple[int, float, Shape]]:
        """A video distribution's buckets: (tokens, span, shape), in the mix's order."""
        return list(self._buckets[0])

    def document(self, rng: random.Random) -> tuple[int, float | None]:
        """One document's (tokens, span) before the context window applies."""
        tokens, span, _ = self.sample(rng)
        return tokens, span

    def sample(self, rng: random.Random) -> tuple[int, float | None, Shape | None]:
        """One document's (tokens, span, shape) before the context window applies (a shape for
        video clips only)."""
        tokens, span, shape = self._published_sample(rng)
        if self.length_scale is not None:
            tokens = max(SHORTEST_SCALED_DOCUMENT, math.ceil(tokens / self.length_scale))
        return tokens, span, shape

    def _published_sample(self, rng: random.Random) -> tuple[int, float | None, Shape | None]:
        spec = self.spec
        if self.kind == "mixture_exponential":
            categories = spec["categories"]
            _, _, mean = rng.choices(categories, weights=[c[1] for c in categories])[0]
            return max(spec["min_tokens"], int(round(rng.expovariate(1.0 / mean)))), None, None
        if self.kind == "log_uniform_bins":
            bins = spec["bins"]
            low, high, _ = rng.choices(bins, weights=[b[2] for b in bins])[0]
            return int(math.exp(rng.uniform(math.log(low), math.log(high)))), None, None
        return rng.choices(self._buckets[0], weights=self._buckets[1])[0]

    def samples(self, rng: random.Random, context_window: int) -> list[tuple[int, float | None, Shape | None]]:
        """The samples one drawn document gives under ``context_window``: (tokens, span, shape)."""
        tokens, span, shape = self.sample(rng)
        if tokens <= context_window:
            return [(tokens, span, shape)]
        policy = self.spec["over_context"]
        if policy == "truncate":
            return [(context_window, None, None)]
        if policy == "split":
            chunks = [(context_window, None, None)] * (tokens // context_window)
            if tokens % context_window:
                chunks.append((tokens % context_window, None, None))
            return chunks
        return []  # "reject": a clip over the window is not trained by this setup


def _opensora_buckets(num_videos: int, image_multiple: float, latent_scale: dict[str, int] | None = None
                      ) -> tuple[list[tuple[int, float, Shape]], list[int]]:
    videos = sorted(((r, f) for r in RESOLUTIONS for f in FRAMES if f > 1), key=lambda b: math.prod(video_shape(*b)))
    counts = _zipf_counts(videos, num_videos)
    counts.update(_zipf_counts([(r, 1) for r in RESOLUTIONS], int(image_multiple * num_videos)))
    population, weights = [], []
    for bucket, count in counts.items():
        shape = scaled_shape(video_shape(*bucket), latent_scale)
        population.append((math.prod(shape), video_attention_span(*shape), shape))
        weights.append(count)
    return population, weights


def distribution(name: str, latent_scale: dict[str, int] | None = None, length_scale: int | None = None) -> Distribution:
    """The distribution ``name`` of ``workloads.json``; video clips scaled by ``latent_scale``,
    text documents by ``length_scale``."""
    specs = load()["distributions"]
    if name not in specs:
        raise KeyError(f"no distribution {name!r} in {WORKLOADS_FILE}; it has {sorted(specs)}")
    return Distribution(name, specs[name], latent_scale, length_scale)


def steps(dist: Distribution, seed: int, tokens_per_step: int, count: int, context_window: int) -> list[Step]:
    """``count`` steps of at least ``tokens_per_step`` tokens each, drawn with ``seed``."""
    rng = random.Random(f"{dist.name}/{seed}")
    out, pending = [], []
    for _ in range(count):
        lengths: list[int] = []
        spans: list[float] = []
        shapes: list[Shape] = []
        while sum(lengths) < tokens_per_step:
            if not pending:
                pending = dist.samples(rng, context_window)
                continue
            tokens, span, shape = pending.pop(0)
            lengths.append(tokens)
            spans.append(float(tokens) if span is None else span)
            shapes.append(shape)
        out.append(Step(lengths, spans if dist.video else None, shapes if dist.video else None))
    return out


def _statistics() -> None:
    rng_draws = 200_000
    for name in load()["distributions"]:
        dist = distribution(name)
        rng = random.Random(0)
        documents = [dist.document(rng)[0] for _ in range(rng_draws)]
        total = sum(documents)
        ordered = sorted(documents)
        quantiles = {q: ordered[int(q * (len(ordered) - 1))] for q in (0.5, 0.8, 0.99, 0.9995)}
        print(f"{name}: mean {total / len(documents):,.0f} tokens; quantiles " +
              ", ".join(f"p{100 * q:g} {v:,}" for q, v in quantiles.items()))
        if dist.kind == "log_uniform_bins":
            for threshold in (131072, 2097152):
                share = sum(d for d in documents if d >= threshold) / total
                print(f"  tokens in documents >= {threshold:,}: {100 * share:.1f}%")


if __name__ == "__main__":
    _statistics()
