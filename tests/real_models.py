"""A zoo of real models at tiny size: the ``diffusers`` DiTs and ``transformers`` families that
users actually hand to ``torch.compile(model, backend="dcp", dynamic=True)``.

``tests/model_zoo.py`` holds hand-written models that imitate real code; this module builds the
real classes instead (nothing is downloaded: every model is constructed from a config object with a
fixed seed), so the compiler meets the exact spellings of the libraries: joint text+image
attention with ``torch.cat``, RoPE tables built from ``arange`` and Python ints, patchify convs,
``unflatten``/``permute`` unpatchify, ALiBi, relative position buckets, softcapped eager
attention, MoE routing, Hugging Face ``DynamicCache`` objects, label-shifted losses...

Every :class:`RealCase` bundles:

* ``build()``: the model, seeded, fp32, in training mode with every dropout at ``p=0`` (so eager
  and compiled runs are deterministic and comparable);
* ``make_inputs(tokens)``: forward kwargs for (about) ``tokens`` attended tokens, and the actual
  token count. Image/video DiTs choose their latent H/W/frames so that the patch grid has that
  many patches (:func:`grid_2d`, :func:`grid_3d`); language models take ``tokens`` as the sequence
  length; ViT adds its CLS token;
* ``loss_of(outputs)``: the scalar to backpropagate (``.loss`` of a model given labels, else
  ``sample.float().pow(2).mean()`` of a DiT's output);
* ``lengths``: the (odd, even) token counts the zoo tests;
* ``gather_budget``: how many mid-graph all-gathers an SP>1 variant may contain (with the reason
  in ``budget_note``);
* ``slow``: True for the cases outside the quick tier (:data:`QUICK`).

Sizes are chosen so that no sequence-like input sizes coincide at the first (odd) length: with
``dynamic=True`` Dynamo "duck sizes" equal sizes to one symbol, which would couple, say, the
number of latent frames to the text length. Every grid side is >= 3 (Dynamo specialises sizes 0
and 1; 2 is the batch everywhere); text prompts have :data:`TEXT_LEN` tokens. Feature-like sizes
of 2 (crop coordinates ``[B, 2]``) do share the batch's symbol, as they would for a user.

The second half of the module is the worker shared by ``tests/test_real_model_zoo.py`` and
``benchmarks/real_model_zoo.py``: :func:`run_case` spawns a gloo world, :func:`zoo_worker`
compiles the case once with the ``dcp`` backend and, per length, reads ``dcp.explain`` (sharding
checks) and compares forward+backward with eager (parity), returning one result row per length
even when something fails.

:data:`SKIPPED` lists the ``diffusers.models.transformers`` classes that are not in the zoo, with
the reason.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import Tensor, nn

__all__ = [
    "RealCase",
    "CASES",
    "QUICK",
    "SKIPPED",
    "TEXT_LEN",
    "grid_2d",
    "grid_3d",
    "first_tensor",
    "zoo_worker",
    "run_case",
    "format_row",
    "totals",
]

BUILD_SEED = 1234
BATCH = 2
TEXT_LEN = 11  # prompt tokens of the DiTs: odd, prime, equal to no latent size
TEXT_DIM = 16  # text-encoder feature width fed to the DiTs
VOCAB = 128

IMAGE_LENGTHS = (15, 24)  # 3x5 and 4x6 patches
VIDEO_LENGTHS = (105, 60)  # 3x5x7 and 3x4x5 patches (every side >= 3: no size-1/2 specialisation)
TEXT_LENGTHS = (15, 24)

DIT_BUDGET = 1
DIT_BUDGET_NOTE = "the final unpatchify (tokens -> [B, C, (F,) H, W]) may be gathered"
PACKED_DIT_BUDGET = 0
PACKED_DIT_NOTE = "tokens in, tokens out: no unpatchify inside the graph"
LM_BUDGET = 0
LM_NOTE = "decoder LMs: every op is token-local, attention or the (rewritten) shifted loss"


# ---------------------------------------------------------------------------------------------
# The case record
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RealCase:
    name: str
    family: str
    library: str  # "diffusers" | "transformers"
    model_class: str
    factory: Callable[[], nn.Module]
    inputs_fn: Callable[[int, int, torch.Generator], tuple[dict[str, Any], int]]
    loss_of: Callable[[Any], Tensor]
    lengths: tuple[int, int]
    gather_budget: int
    budget_note: str
    slow: bool = False
    notes: str = ""
    seed: int = BUILD_SEED
    # torch._dynamo.config settings the case is compiled under, as its users must set them
    dynamo_config: tuple[tuple[str, Any], ...] = ()

    def build(self) -> nn.Module:
        """The model, built under a fixed seed without disturbing the caller's RNG state."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = self.factory()
            model = model.float().train()
            _redraw_zero_parameters(model)
        _zero_dropout(model)
        return model

    def make_inputs(self, tokens: int, batch_size: int = BATCH, seed: int = 0) -> tuple[dict[str, Any], int]:
        """``(forward kwargs, actual token count)`` for about ``tokens`` attended tokens."""
        if tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {tokens}")
        generator = torch.Generator().manual_seed(seed)
        return self.inputs_fn(tokens, batch_size, generator)


def _redraw_zero_parameters(model: nn.Module) -> None:
    """Parameters initialised to all zeros (adaLN-zero gates, zero-initialised output layers,
    biases) are redrawn from N(0, 0.02), as in a trained model: otherwise a DiT's output can be
    exactly zero and most gradients vanish, which would make the parity check vacuous."""
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point() and param.numel() and not bool(param.count_nonzero()):
                param.normal_(0.0, 0.02)


def _zero_dropout(model: nn.Module) -> None:
    """Dropout at p=0 everywhere, including the class-label dropout of DiT conditioning
    (``LabelEmbedding.dropout_prob``) that would otherwise draw random numbers in training mode."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for attr in ("dropout_prob", "attention_dropout", "dropout_p"):
            value = getattr(module, attr, None)
            if isinstance(value, float) and value > 0:
                setattr(module, attr, 0.0)


def first_tensor(outputs: Any) -> Tensor:
    """The first output of a model as one tensor (``sample`` of a diffusers output, ``logits``...);
    a list of per-sample tensors (Z-Image returns one) is flattened and concatenated."""
    if isinstance(outputs, Tensor):
        return outputs
    if isinstance(outputs, Mapping):
        values = list(outputs.values())
    elif isinstance(outputs, (tuple, list)):
        if outputs and all(isinstance(value, Tensor) for value in outputs) and isinstance(outputs, list):
            return torch.cat([value.flatten() for value in outputs])
        values = list(outputs)
    else:
        raise TypeError(f"unsupported output type {type(outputs).__name__}")
    for value in values:
        if isinstance(value, Tensor):
            return value
        if isinstance(value, list) and value and all(isinstance(item, Tensor) for item in value):
            return torch.cat([item.flatten() for item in value])
    raise TypeError(f"no tensor in {type(outputs).__name__}")


def sample_loss(outputs: Any) -> Tensor:
    return first_tensor(outputs).float().pow(2).mean()


def hf_loss(outputs: Any) -> Tensor:
    return outputs["loss"] if isinstance(outputs, Mapping) else outputs[0]


# ---------------------------------------------------------------------------------------------
# Grids: latent sizes for a requested token count
# ---------------------------------------------------------------------------------------------


def _best_grid(n: int, dims: int) -> tuple[int, ...]:
    """Factors >= 3 (no size 1 or 2: Dynamo specialises 1, and 2 is the batch) whose product has
    the parity of ``n`` and is closest to it; ties prefer distinct factors, then balanced ones."""
    best: tuple[Any, ...] | None = None
    limit = max(n, 3) * 2

    def visit(prefix: tuple[int, ...], start: int) -> None:
        nonlocal best
        product = math.prod(prefix)
        if len(prefix) == dims:
            if product % 2 != n % 2:
                return
            key = (abs(product - n), len(set(prefix)) != dims, max(prefix) - min(prefix), prefix)
            if best is None or key < best:
                best = key
            return
        for factor in range(start, limit + 1):
            if product * factor ** (dims - len(prefix)) > 3 * limit:
                break
            visit(prefix + (factor,), factor)

    visit((), 3)
    assert best is not None
    return best[-1]


def grid_2d(n: int) -> tuple[int, int]:
    """(rows, columns) of patches, about ``n`` of them, same parity: 15 -> (3, 5), 24 -> (4, 6)."""
    h, w = _best_grid(n, 2)
    return h, w


def grid_3d(n: int) -> tuple[int, int, int]:
    """(frames, rows, columns) of patches: 105 -> (3, 5, 7), 60 -> (3, 4, 5)."""
    t, h, w = _best_grid(n, 3)
    return t, h, w


# ---------------------------------------------------------------------------------------------
# Input helpers
# ---------------------------------------------------------------------------------------------


def _randn(generator: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=generator)


def _text(generator: torch.Generator, batch: int, dim: int = TEXT_DIM, length: int = TEXT_LEN) -> Tensor:
    return _randn(generator, batch, length, dim)


def _timestep(generator: torch.Generator, batch: int) -> Tensor:
    """Integer-valued float timesteps in [0, 1000), as schedulers produce them."""
    return torch.randint(0, 1000, (batch,), generator=generator).float()


def _image_latent(generator: torch.Generator, batch: int, channels: int, n: int, patch: int,
                  square: bool = False) -> tuple[Tensor, tuple[int, int]]:
    h, w = (round(math.sqrt(n)),) * 2 if square else grid_2d(n)
    return _randn(generator, batch, channels, h * patch, w * patch), (h, w)


def _video_latent(generator: torch.Generator, batch: int, channels: int, n: int, patch: int, patch_t: int = 1,
                  frames_first: bool = False) -> tuple[Tensor, tuple[int, int, int]]:
    t, h, w = grid_3d(n)
    shape = (batch, t * patch_t, channels, h * patch, w * patch) if frames_first else (batch, channels, t * patch_t, h * patch, w * patch)
    return _randn(generator, *shape), (t, h, w)


def _flux_ids(h: int, w: int, length: int = TEXT_LEN) -> tuple[Tensor, Tensor]:
    """Flux-style position ids: (0, row, column) per image token, zeros for text tokens."""
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] = torch.arange(h)[:, None]
    img_ids[..., 2] = torch.arange(w)[None, :]
    return img_ids.reshape(h * w, 3), torch.zeros(length, 3)


# Parameters some diffusers classes create with torch.empty and never initialise: garbage that
# differs between two builds (so eager and compiled copies would disagree) and can be inf/NaN.
_UNINITIALISED: dict[str, tuple[str, ...]] = {"LuminaNextDiT2DModel": ("pad_token",)}


def _diffusers(class_name: str, **config: Any) -> Callable[[], nn.Module]:
    def factory() -> nn.Module:
        import diffusers

        model = getattr(diffusers, class_name)(**config)
        for name in _UNINITIALISED.get(class_name, ()):
            with torch.no_grad():
                model.get_parameter(name).normal_(0.0, 0.02)
        return model

    factory.__name__ = f"build_{class_name}"
    return factory


# ---------------------------------------------------------------------------------------------
# diffusers: image DiTs
# ---------------------------------------------------------------------------------------------


def _dit_inputs(n, batch, g):
    latent, (h, w) = _image_latent(g, batch, 4, n, 2, square=True)  # DiT's unpatchify assumes a square grid
    return {
        "hidden_states": latent,
        "timestep": torch.randint(0, 1000, (batch,), generator=g),
        "class_labels": torch.randint(0, 10, (batch,), generator=g),
    }, h * w


def _pixart_inputs(n, batch, g):
    latent, (h, w) = _image_latent(g, batch, 4, n, 2)
    return {
        "hidden_states": latent,
        "encoder_hidden_states": _text(g, batch),
        "timestep": torch.randint(0, 1000, (batch,), generator=g),
        "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
    }, h * w


def _sd3_inputs(n, batch, g):
    latent, (h, w) = _image_latent(g, batch, 4, n, 2)
    return {
        "hidden_states": latent,
        "encoder_hidden_states": _text(g, batch),
        "pooled_projections": _randn(g, batch, 24),
        "timestep": _timestep(g, batch),
    }, h * w


def _flux_inputs(n, batch, g, pooled: bool = True, guidance: bool = False, channels: int = 16):
    h, w = grid_2d(n)
    img_ids, txt_ids = _flux_ids(h, w)
    inputs = {
        "hidden_states": _randn(g, batch, h * w, channels),
        "encoder_hidden_states": _text(g, batch),
        "timestep": torch.rand(batch, generator=g),
        "img_ids": img_ids,
        "txt_ids": txt_ids,
    }
    if pooled:
        inputs["pooled_projections"] = _randn(g, batch, 24)
    if guidance:
        inputs["guidance"] = torch.full((batch,), 3.5)
    return inputs, h * w


def _flux2_inputs(n, batch, g):
    h, w = grid_2d(n)
    image_ids = torch.cartesian_prod(torch.arange(1), torch.arange(h), torch.arange(w), torch.arange(1))
    text_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(TEXT_LEN))
    return {
        "hidden_states": _randn(g, batch, h * w, 16),
        "encoder_hidden_states": _text(g, batch),
        "timestep": torch.rand(batch, generator=g),
        "img_ids": image_ids.unsqueeze(0).expand(batch, -1, -1).clone(),
        "txt_ids": text_ids.unsqueeze(0).expand(batch, -1, -1).clone(),
        "guidance": torch.full((batch,), 3.5),
    }, h * w


def _flux3_inputs(n, batch, g):
    inputs, tokens = _flux2_inputs(n, batch, g)
    del inputs["guidance"]
    inputs["img_ids"], inputs["txt_ids"] = inputs["img_ids"][0], inputs["txt_ids"][0]  # (seq, 4) per the docstring
    return inputs, tokens


def _hunyuan_image_inputs(n, batch, g):
    latent, (h, w) = _image_latent(g, batch, 16, n, 1)
    return {
        "hidden_states": latent,
        "timestep": _timestep(g, batch),
        "encoder_hidden_states": _text(g, batch),
        "encoder_attention_mask": torch.ones(batch, TEXT_LEN),
    }, h * w


def _auraflow_inputs(n, batch, g):
    latent, (h, w) = _image_latent(g, batch, 4, n, 2)
    return {"hidden_states": latent, "encoder_hidden_states": _text(g, batch), "timestep": _timestep(g, batch)}, h * w


def _cogview_inputs(n, batch, g):
    latent, (h, w) = _image_latent(g, batch, 4, n, 2)
    size = torch.tensor([[h * 16.0, w * 16.0]]).repeat(batch, 1)
    return {
        "hidden_states": latent,
        "encoder_hidden_states": _text(g, batch),
        "timestep": _timestep(g, batch),
        "original_size": size,
        "target_size": size.clone(),
        "crop_coords": torch.zeros(batch, 2),
    }, h * w


def _lumina2_inputs(n, batch, g):
    latent, (h, w) = _image_latent(g, batch, 4, n, 2)
    return {
        "hidden_states": latent,
        "timestep": torch.rand(batch, generator=g),
        "encoder_hidden_states": _text(g, batch),
        "encoder_attention_mask": torch.ones(batch, TEXT_LEN, dtype=torch.bool),
    }, h * w


def _lumina_next_inputs(n, batch, g):
    from diffusers.models.embeddings import get_2d_rotary_pos_embed_lumina

    latent, (h, w) = _image_latent(g, batch, 4, n, 2)
    return {
        "hidden_states": latent,
        "timestep": torch.rand(batch, generator=g),
        "encoder_hidden_states": _text(g, batch),
        "encoder_mask": torch.ones(batch, TEXT_LEN),
        "image_rotary_emb": get_2d_rotary_pos_embed_lumina(8, 384, 384),  # head_dim 8, as the pipeline builds it
        "cross_attention_kwargs": {},
    }, h * w


def _sana_inputs(n, batch, g):
    latent, (h, w) = _image_latent(g, batch, 4, n, 1)
    return {"hidden_states": latent, "encoder_hidden_states": _text(g, batch), "timestep": _timestep(g, batch)}, h * w


def _hunyuan_dit_inputs(n, batch, g):
    from diffusers.models.embeddings import get_2d_rotary_pos_embed
    from diffusers.pipelines.hunyuandit.pipeline_hunyuandit import get_resize_crop_region_for_grid

    latent, (h, w) = _image_latent(g, batch, 4, n, 2)
    crops = get_resize_crop_region_for_grid((h, w), 8)  # as the pipeline does, base grid 8
    rope = get_2d_rotary_pos_embed(8, crops, (h, w), output_type="pt")
    return {
        "hidden_states": latent,
        "timestep": _timestep(g, batch),
        "encoder_hidden_states": _text(g, batch),
        "text_embedding_mask": torch.ones(batch, TEXT_LEN),
        "encoder_hidden_states_t5": _randn(g, batch, 13, TEXT_DIM),
        "text_embedding_mask_t5": torch.ones(batch, 13),
        "image_meta_size": torch.tensor([[1024.0, 1024.0, h * 16.0, w * 16.0, 0.0, 0.0]]).repeat(batch, 1),
        "style": torch.zeros(batch, dtype=torch.long),
        "image_rotary_emb": rope,
    }, h * w


def _qwenimage_inputs(n, batch, g):
    h, w = grid_2d(n)
    return {
        "hidden_states": _randn(g, batch, h * w, 16),
        "encoder_hidden_states": _text(g, batch),
        "encoder_hidden_states_mask": torch.ones(batch, TEXT_LEN, dtype=torch.long),
        "timestep": torch.rand(batch, generator=g),
        "img_shapes": [[(1, h, w)]] * batch,
    }, h * w


def _hidream_inputs(n, batch, g):
    latent, (h, w) = _image_latent(g, batch, 4, n, 2)
    return {
        "hidden_states": latent,
        "timesteps": _timestep(g, batch),
        "encoder_hidden_states_t5": _randn(g, batch, TEXT_LEN, 8),
        "encoder_hidden_states_llama3": _randn(g, 3, batch, TEXT_LEN, 4),  # 3 LLM layers' states, 2 of them used
        "pooled_embeds": _randn(g, batch, 8),
    }, h * w


def _glm_image_inputs(n, batch, g):
    latent, (h, w) = _image_latent(g, batch, 4, n, 2)
    return {
        "hidden_states": latent,
        "encoder_hidden_states": _randn(g, batch, TEXT_LEN, 32),
        "prior_token_id": torch.randint(0, 64, (batch, h * w), generator=g),
        "prior_token_drop": torch.zeros(batch, dtype=torch.bool),
        "timestep": _timestep(g, batch),
        "target_size": torch.tensor([[h * 2.0, w * 2.0]]).repeat(batch, 1),
        "crop_coords": torch.zeros(batch, 2),
    }, h * w


def _ernie_inputs(n, batch, g):
    latent, (h, w) = _image_latent(g, batch, 16, n, 1)
    return {
        "hidden_states": latent,
        "timestep": torch.rand(batch, generator=g),
        "text_bth": _text(g, batch),
        "text_lens": torch.full((batch,), TEXT_LEN),
    }, h * w


def _prx_inputs(n, batch, g):
    latent, (h, w) = _image_latent(g, batch, 16, n, 2)
    return {"hidden_states": latent, "timestep": torch.rand(batch, generator=g), "encoder_hidden_states": _randn(g, batch, TEXT_LEN, 32)}, h * w


def _nucleus_inputs(n, batch, g):
    h, w = grid_2d(n)
    return {
        "hidden_states": _randn(g, batch, h * w, 16),
        "img_shapes": [(1, h, w)] * batch,
        "encoder_hidden_states": _text(g, batch),
        "encoder_hidden_states_mask": torch.ones(batch, TEXT_LEN, dtype=torch.long),
        "timestep": torch.rand(batch, generator=g),
    }, h * w


def _omnigen_inputs(n, batch, g):
    latent, (h, w) = _image_latent(g, batch, 4, n, 2)
    text = 9
    total = text + 1 + h * w  # prompt, time token, image tokens
    return {
        "hidden_states": latent,
        "timestep": torch.rand(batch, generator=g),
        "input_ids": torch.randint(1, 100, (batch, text), generator=g),
        "input_img_latents": [],
        "input_image_sizes": {},
        "attention_mask": torch.ones(batch, total, total),
        "position_ids": torch.arange(total).repeat(batch, 1),
    }, h * w


def _z_image_inputs(n, batch, g):
    h, w = grid_2d(n)
    return {
        "x": [_randn(g, 16, 1, 2 * h, 2 * w) for _ in range(batch)],
        "t": torch.rand(batch, generator=g),
        "cap_feats": [_randn(g, TEXT_LEN, TEXT_DIM) for _ in range(batch)],
    }, h * w


# ---------------------------------------------------------------------------------------------
# diffusers: video DiTs
# ---------------------------------------------------------------------------------------------


def _latte_inputs(n, batch, g):
    latent, (t, h, w) = _video_latent(g, batch, 4, n, 2)
    return {
        "hidden_states": latent,
        "timestep": torch.randint(0, 1000, (batch,), generator=g),
        "encoder_hidden_states": _text(g, batch),
        "enable_temporal_attentions": True,
    }, t * h * w


def _cogvideox_inputs(n, batch, g, rope: bool = False, patch_t: int = 1):
    latent, (t, h, w) = _video_latent(g, batch, 4, n, 2, patch_t=patch_t, frames_first=True)
    inputs = {"hidden_states": latent, "encoder_hidden_states": _text(g, batch), "timestep": torch.randint(0, 1000, (batch,), generator=g)}
    if rope:  # CogVideoX 1.5: the pipeline computes the 3D RoPE tables and passes them in
        from diffusers.models.embeddings import get_3d_rotary_pos_embed

        inputs["image_rotary_emb"] = get_3d_rotary_pos_embed(
            embed_dim=16, crops_coords=None, grid_size=(h, w), temporal_size=t, grid_type="slice", max_size=(8, 8),
        )
    return inputs, t * h * w


def _hunyuan_video_inputs(n, batch, g):
    latent, (t, h, w) = _video_latent(g, batch, 4, n, 2)
    return {
        "hidden_states": latent,
        "timestep": _timestep(g, batch),
        "encoder_hidden_states": _text(g, batch),
        "encoder_attention_mask": torch.ones(batch, TEXT_LEN),
        "pooled_projections": _randn(g, batch, 8),
        "guidance": torch.full((batch,), 3500.0),
    }, t * h * w


def _hunyuan_video15_inputs(n, batch, g):
    latent, (t, h, w) = _video_latent(g, batch, 4, n, 2)
    return {
        "hidden_states": latent,
        "timestep": _timestep(g, batch),
        "encoder_hidden_states": _text(g, batch),
        "encoder_attention_mask": torch.ones(batch, TEXT_LEN),
        "encoder_hidden_states_2": _randn(g, batch, 7, 8),
        "encoder_attention_mask_2": torch.ones(batch, 7),
        "image_embeds": torch.zeros(batch, 5, 12),
    }, t * h * w


def _wan_inputs(n, batch, g, channels: int = 4):
    latent, (t, h, w) = _video_latent(g, batch, channels, n, 2)
    return {"hidden_states": latent, "timestep": _timestep(g, batch), "encoder_hidden_states": _text(g, batch)}, t * h * w


def _wan_vace_inputs(n, batch, g):
    inputs, tokens = _wan_inputs(n, batch, g)
    _, c, f, hh, ww = inputs["hidden_states"].shape
    inputs["control_hidden_states"] = _randn(g, batch, 12, f, hh, ww)
    return inputs, tokens


def _mochi_inputs(n, batch, g):
    latent, (t, h, w) = _video_latent(g, batch, 4, n, 2)
    return {
        "hidden_states": latent,
        "encoder_hidden_states": _text(g, batch),
        "timestep": _timestep(g, batch),
        "encoder_attention_mask": _prompt_mask(batch),
    }, t * h * w


def _prompt_mask(batch: int) -> Tensor:
    """Every other sample's prompt is 3 tokens shorter: the text tokens a sample attends to
    differ across the batch, as they do with real captions."""
    mask = torch.ones(batch, TEXT_LEN, dtype=torch.bool)
    mask[1::2, -3:] = False
    return mask


def _ltx_inputs(n, batch, g):
    t, h, w = grid_3d(n)
    return {
        "hidden_states": _randn(g, batch, t * h * w, 8),
        "encoder_hidden_states": _text(g, batch),
        "timestep": _timestep(g, batch),
        "encoder_attention_mask": torch.ones(batch, TEXT_LEN, dtype=torch.bool),
        "num_frames": t,
        "height": h,
        "width": w,
    }, t * h * w


def _ltx2_inputs(n, batch, g):
    t, h, w = grid_3d(n)
    audio_frames = 9
    return {
        "hidden_states": _randn(g, batch, t * h * w, 8),
        "audio_hidden_states": _randn(g, batch, audio_frames, 4),
        "encoder_hidden_states": _text(g, batch),
        "audio_encoder_hidden_states": _text(g, batch),
        "timestep": _timestep(g, batch),
        "encoder_attention_mask": torch.ones(batch, TEXT_LEN, dtype=torch.bool),
        "num_frames": t,
        "height": h,
        "width": w,
        "audio_num_frames": audio_frames,
        "fps": 25.0,
    }, t * h * w


def _allegro_inputs(n, batch, g):
    latent, (t, h, w) = _video_latent(g, batch, 4, n, 2)
    return {"hidden_states": latent, "encoder_hidden_states": _text(g, batch), "timestep": torch.randint(0, 1000, (batch,), generator=g)}, t * h * w


def _easyanimate_inputs(n, batch, g):
    latent, (t, h, w) = _video_latent(g, batch, 4, n, 2)
    return {"hidden_states": latent, "timestep": _timestep(g, batch), "encoder_hidden_states": _text(g, batch)}, t * h * w


def _cosmos_inputs(n, batch, g):
    latent, (t, h, w) = _video_latent(g, batch, 4, n, 2)
    return {
        "hidden_states": latent,
        "timestep": _timestep(g, batch),
        "encoder_hidden_states": _text(g, batch),
        "attention_mask": torch.ones(batch, TEXT_LEN),
        "fps": 24,
    }, t * h * w


def _kandinsky6_inputs(n, batch, g):
    t, h, w = grid_3d(n)
    return {
        "hidden_states": _randn(g, batch, t, 2 * h, 2 * w, 4),  # (B, T, H, W, C)
        "encoder_hidden_states": _text(g, batch),
        "pooled_projections": _randn(g, batch, 8),
        "timestep": _timestep(g, batch),
    }, t * h * w


def _sana_video_inputs(n, batch, g):
    latent, (t, h, w) = _video_latent(g, batch, 4, n, 2)
    return {"hidden_states": latent, "encoder_hidden_states": _text(g, batch), "timestep": _timestep(g, batch)}, t * h * w


def _motif_inputs(n, batch, g):
    latent, (t, h, w) = _video_latent(g, batch, 4, n, 2)
    return {"hidden_states": latent, "encoder_hidden_states": _text(g, batch), "timestep": _timestep(g, batch)}, t * h * w


def _anyflow_inputs(n, batch, g):
    latent, (t, h, w) = _video_latent(g, batch, 4, n, 2, frames_first=True)
    return {
        "hidden_states": latent,
        "timestep": torch.full((batch, t), 500.0),
        "r_timestep": torch.full((batch, t), 250.0),
        "encoder_hidden_states": _text(g, batch),
    }, t * h * w


def _consisid_inputs(n, batch, g):
    latent, (t, h, w) = _video_latent(g, batch, 4, n, 2, frames_first=True)
    return {
        "hidden_states": latent,
        "encoder_hidden_states": _text(g, batch),
        "timestep": torch.randint(0, 1000, (batch,), generator=g),
        "id_vit_hidden": [torch.ones(batch, 5, 3)],
        "id_cond": torch.ones(batch, 3),
    }, t * h * w


# ---------------------------------------------------------------------------------------------
# transformers: language models, encoders, encoder-decoder, ViT
# ---------------------------------------------------------------------------------------------


def _transformers(model_class: str, config_class: str, attn: str | None, **config: Any) -> Callable[[], nn.Module]:
    def factory() -> nn.Module:
        import transformers

        kwargs = dict(config)
        if attn is not None:
            kwargs["attn_implementation"] = attn
        cfg = getattr(transformers, config_class)(**kwargs)
        if attn is not None:  # some releases ignore the kwarg on the config: ask the model too
            return getattr(transformers, model_class)._from_config(cfg, attn_implementation=attn)
        return getattr(transformers, model_class)(cfg)

    factory.__name__ = f"build_{model_class}_{attn}"
    return factory


def _lm_inputs(n, batch, g, low: int = 2):
    ids = torch.randint(low, VOCAB, (batch, n), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}, n


def _t5_inputs(n, batch, g):
    ids = torch.randint(2, VOCAB, (batch, n), generator=g)
    labels = torch.randint(2, VOCAB, (batch, n), generator=g)
    return {"input_ids": ids, "labels": labels}, n


def _vit_inputs(n, batch, g):
    h, w = grid_2d(max(n - 1, 9))
    return {
        "pixel_values": _randn(g, batch, 3, 4 * h, 4 * w),
        "labels": torch.randint(0, 5, (batch,), generator=g),
        "interpolate_pos_encoding": True,
    }, h * w + 1


_DECODER_COMMON = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=None)
_LLAMA_LIKE = dict(
    _DECODER_COMMON, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=64, max_position_embeddings=256, attention_dropout=0.0,
)


def _decoder_configs() -> list[tuple[str, str, str, str, dict[str, Any], tuple[str, ...], bool, str]]:
    """(name, family, model class, config class, config, attention implementations, MoE?, notes)."""
    return [
        ("llama", "decoder LM", "LlamaForCausalLM", "LlamaConfig", dict(_LLAMA_LIKE), ("sdpa", "eager"), False, "GQA 4/2, RoPE"),
        ("qwen2", "decoder LM", "Qwen2ForCausalLM", "Qwen2Config", dict(_LLAMA_LIKE), ("sdpa",), False, "GQA 4/2, qkv bias"),
        ("qwen3", "decoder LM", "Qwen3ForCausalLM", "Qwen3Config", dict(_LLAMA_LIKE, head_dim=8), ("sdpa",), False, "q/k RMSNorm"),
        ("mistral", "decoder LM", "MistralForCausalLM", "MistralConfig", dict(_LLAMA_LIKE, sliding_window=None), ("sdpa",), False, ""),
        ("phi3", "decoder LM", "Phi3ForCausalLM", "Phi3Config", dict(_LLAMA_LIKE, pad_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0), ("sdpa",), False, "fused qkv and gate_up"),
        ("gemma2", "decoder LM", "Gemma2ForCausalLM", "Gemma2Config",
         dict(_LLAMA_LIKE, head_dim=8, sliding_window=8, query_pre_attn_scalar=8), ("eager",), False,
         "attention logit softcapping (eager; this transformers release refuses sdpa for Gemma 2), sliding window 8 "
         "on alternate layers, final logit softcapping"),
        ("gpt2", "decoder LM", "GPT2LMHeadModel", "GPT2Config",
         dict(_DECODER_COMMON, n_embd=32, n_layer=2, n_head=4, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
         ("eager", "sdpa"), False, "learned positions, Conv1D, graph break at the loss (loss_type warning)"),
        ("gpt_neox", "decoder LM", "GPTNeoXForCausalLM", "GPTNeoXConfig",
         dict(_DECODER_COMMON, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=256, rotary_pct=0.25, attention_dropout=0.0, hidden_dropout=0.0),
         ("sdpa",), False, "partial rotary, parallel residual"),
        ("opt", "decoder LM", "OPTForCausalLM", "OPTConfig",
         dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4, max_position_embeddings=256,
              word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=1, pad_token_id=127),
         ("sdpa",), False, "learned positions from the attention mask (cumsum)"),
        ("falcon", "decoder LM", "FalconForCausalLM", "FalconConfig",
         dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True, multi_query=False,
              new_decoder_architecture=False, parallel_attn=False, bias=True, attention_dropout=0.0, hidden_dropout=0.0,
              bos_token_id=0, eos_token_id=1),
         ("sdpa",), False, "ALiBi"),
        ("bloom", "decoder LM", "BloomForCausalLM", "BloomConfig",
         dict(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, attention_dropout=0.0, hidden_dropout=0.0, bos_token_id=0, eos_token_id=1, pad_token_id=3),
         ("eager",), False, "ALiBi, eager attention only"),
        ("mixtral", "MoE decoder LM", "MixtralForCausalLM", "MixtralConfig",
         dict(_LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2, sliding_window=None, router_jitter_noise=0.0),
         ("sdpa",), True, "top-2 of 4 experts"),
        ("qwen2_moe", "MoE decoder LM", "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
         dict(_LLAMA_LIKE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
              decoder_sparse_step=1, mlp_only_layers=[]),
         ("sdpa",), True, "top-2 of 4 experts + gated shared expert"),
        ("qwen3_moe", "MoE decoder LM", "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
         dict(_LLAMA_LIKE, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[]),
         ("sdpa",), True, "top-2 of 4 experts"),
    ]


def _hf_cases() -> list[RealCase]:
    cases = []
    for name, family, model_class, config_class, config, attns, moe, notes in _decoder_configs():
        for attn in attns:
            for cache in ("cache", "nocache"):
                cfg = dict(config)
                if cache == "nocache":
                    cfg["use_cache"] = False
                label = f"{name}-{attn}" + ("-nocache" if cache == "nocache" else "")
                cases.append(RealCase(
                    label, family, "transformers", model_class,
                    _transformers(model_class, config_class, attn, **cfg),
                    _lm_inputs, hf_loss, TEXT_LENGTHS, LM_BUDGET, LM_NOTE,
                    notes=(notes + ("; " if notes else "") + ("use_cache default (a DynamicCache is built and returned)" if cache == "cache" else "use_cache=False")),
                ))
    encoder = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                   max_position_embeddings=256, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    for attn in ("sdpa", "eager"):
        cases.append(RealCase(
            f"bert-{attn}", "encoder", "transformers", "BertForMaskedLM",
            _transformers("BertForMaskedLM", "BertConfig", attn, **encoder, pad_token_id=0),
            _lm_inputs, hf_loss, TEXT_LENGTHS, 0, "encoder MLM: token-local loss",
            notes="absolute positions and token types sliced from buffers by the length",
        ))
    cases.append(RealCase(
        "roberta-sdpa", "encoder", "transformers", "RobertaForMaskedLM",
        _transformers("RobertaForMaskedLM", "RobertaConfig", "sdpa", **encoder, pad_token_id=1, bos_token_id=0, eos_token_id=2),
        _lm_inputs, hf_loss, TEXT_LENGTHS, 0, "encoder MLM: token-local loss (positions: cumsum over the sequence)",
        notes="position ids from a cumsum of the non-padding mask",
    ))
    vit = dict(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=5)
    for attn in ("sdpa", "eager"):
        cases.append(RealCase(
            f"vit-{attn}", "vision encoder", "transformers", "ViTForImageClassification",
            _transformers("ViTForImageClassification", "ViTConfig", attn, **vit),
            _vit_inputs, hf_loss, (16, 25), 1, "the classifier reads the CLS token (one token of the sequence): 1 gather",
            notes="CLS token + interpolated position embeddings; tokens = patches + 1",
        ))
    t5 = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
              relative_attention_num_buckets=8, relative_attention_max_distance=32, dropout_rate=0.0,
              decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    for cache in ("cache", "nocache"):
        cfg = dict(t5)
        if cache == "nocache":
            cfg["use_cache"] = False
        cases.append(RealCase(
            "t5" + ("-nocache" if cache == "nocache" else ""), "encoder-decoder", "transformers", "T5ForConditionalGeneration",
            _transformers("T5ForConditionalGeneration", "T5Config", None, **cfg),
            _t5_inputs, hf_loss, TEXT_LENGTHS, 0, "encoder-decoder: token-local loss, relative position bias sliced per shard",
            notes="relative position buckets (eager attention); labels shifted right into decoder inputs"
                  + ("; use_cache default" if cache == "cache" else "; use_cache=False"),
        ))
    return cases


# ---------------------------------------------------------------------------------------------
# The zoo
# ---------------------------------------------------------------------------------------------


def _dit(name, family, class_name, config, inputs_fn, lengths, budget=DIT_BUDGET, note=DIT_BUDGET_NOTE, notes=""):
    return RealCase(name, family, "diffusers", class_name, _diffusers(class_name, **config), inputs_fn, sample_loss,
                    lengths, budget, note, notes=notes)


IMAGE = "image DiT"
VIDEO = "video DiT"
_HEADS = dict(num_attention_heads=4, attention_head_dim=8)  # inner dim 32, heads divisible by SP 2

_DIFFUSERS_CASES = [
    _dit("dit", IMAGE, "DiTTransformer2DModel",
         dict(in_channels=4, out_channels=8, num_layers=2, patch_size=2, sample_size=8, norm_type="ada_norm_zero",
              num_embeds_ada_norm=10, activation_fn="gelu-approximate", attention_bias=True, **_HEADS),
         _dit_inputs, (25, 16), notes="class-conditional, sincos positions recomputed for the grid; square grids only (5x5, 4x4)"),
    _dit("pixart", IMAGE, "PixArtTransformer2DModel",
         dict(sample_size=8, num_layers=2, patch_size=2, in_channels=4, out_channels=8, cross_attention_dim=32,
              caption_channels=TEXT_DIM, attention_bias=True, activation_fn="gelu-approximate", num_embeds_ada_norm=1000,
              norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6, use_additional_conditions=False, **_HEADS),
         _pixart_inputs, IMAGE_LENGTHS, notes="cross-attention to the caption"),
    _dit("sd3", IMAGE, "SD3Transformer2DModel",
         dict(sample_size=16, patch_size=2, in_channels=4, num_layers=2, caption_projection_dim=32, joint_attention_dim=TEXT_DIM,
              pooled_projection_dim=24, out_channels=4, pos_embed_max_size=32, qk_norm="rms_norm", **_HEADS),
         _sd3_inputs, IMAGE_LENGTHS, notes="MMDiT joint attention (cat text+image), cropped position table"),
    _dit("flux", IMAGE, "FluxTransformer2DModel",
         dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, joint_attention_dim=TEXT_DIM,
              pooled_projection_dim=24, axes_dims_rope=[2, 2, 4], **_HEADS),
         _flux_inputs, IMAGE_LENGTHS, PACKED_DIT_BUDGET, PACKED_DIT_NOTE, notes="packed tokens in, RoPE from img_ids/txt_ids inputs"),
    _dit("flux2", IMAGE, "Flux2Transformer2DModel",
         dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, joint_attention_dim=TEXT_DIM,
              timestep_guidance_channels=32, axes_dims_rope=[2, 2, 2, 2], **_HEADS),
         _flux2_inputs, IMAGE_LENGTHS, PACKED_DIT_BUDGET, PACKED_DIT_NOTE, notes="4-axis RoPE ids"),
    _dit("flux3", IMAGE, "Flux3Transformer2DModel",
         dict(in_channels=16, cond_in_channels=16, num_layers=1, num_single_layers=1, joint_attention_dim=TEXT_DIM,
              timestep_channels=32, mlp_ratio=2.0, axes_dims_rope=(2, 2, 2, 2), **_HEADS),
         _flux3_inputs, IMAGE_LENGTHS, PACKED_DIT_BUDGET, PACKED_DIT_NOTE, notes="per-mode blocks then joint blocks"),
    _dit("hunyuan_image", IMAGE, "HunyuanImageTransformer2DModel",
         dict(in_channels=16, out_channels=16, num_layers=1, num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0,
              patch_size=(1, 1), text_embed_dim=TEXT_DIM, rope_axes_dim=(4, 4), **_HEADS),
         _hunyuan_image_inputs, IMAGE_LENGTHS, notes="HunyuanVideo-style dual/single stream, 2D"),
    _dit("chroma", IMAGE, "ChromaTransformer2DModel",
         dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, joint_attention_dim=TEXT_DIM,
              axes_dims_rope=[2, 2, 4], approximator_num_channels=8, approximator_hidden_dim=16, approximator_layers=1, **_HEADS),
         lambda n, b, g: _flux_inputs(n, b, g, pooled=False), IMAGE_LENGTHS, PACKED_DIT_BUDGET, PACKED_DIT_NOTE),
    _dit("longcat_image", IMAGE, "LongCatImageTransformer2DModel",
         dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, joint_attention_dim=TEXT_DIM,
              pooled_projection_dim=24, axes_dims_rope=[2, 2, 4], **_HEADS),
         lambda n, b, g: _flux_inputs(n, b, g, pooled=False, guidance=True), IMAGE_LENGTHS, PACKED_DIT_BUDGET, PACKED_DIT_NOTE),
    _dit("ovis_image", IMAGE, "OvisImageTransformer2DModel",
         dict(patch_size=1, in_channels=16, out_channels=16, num_layers=1, num_single_layers=1, joint_attention_dim=TEXT_DIM,
              axes_dims_rope=(2, 2, 4), **_HEADS),
         lambda n, b, g: _flux_inputs(n, b, g, pooled=False), IMAGE_LENGTHS, PACKED_DIT_BUDGET, PACKED_DIT_NOTE),
    _dit("bria", IMAGE, "BriaTransformer2DModel",
         dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, joint_attention_dim=TEXT_DIM,
              pooled_projection_dim=None, axes_dims_rope=[0, 4, 4], **_HEADS),
         lambda n, b, g: _flux_inputs(n, b, g, pooled=False), IMAGE_LENGTHS, PACKED_DIT_BUDGET, PACKED_DIT_NOTE),
    _dit("qwenimage", IMAGE, "QwenImageTransformer2DModel",
         dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, joint_attention_dim=TEXT_DIM, guidance_embeds=False,
              axes_dims_rope=(2, 2, 4), **_HEADS),
         _qwenimage_inputs, IMAGE_LENGTHS, PACKED_DIT_BUDGET, PACKED_DIT_NOTE, notes="grid given as Python ints (img_shapes)"),
    _dit("auraflow", IMAGE, "AuraFlowTransformer2DModel",
         dict(sample_size=16, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1, caption_projection_dim=32,
              joint_attention_dim=TEXT_DIM, out_channels=4, pos_embed_max_size=256, **_HEADS),
         _auraflow_inputs, IMAGE_LENGTHS, notes="register tokens, learned position table"),
    _dit("cogview3plus", IMAGE, "CogView3PlusTransformer2DModel",
         dict(patch_size=2, in_channels=4, num_layers=2, out_channels=4, text_embed_dim=TEXT_DIM, time_embed_dim=16,
              condition_dim=4, pos_embed_max_size=16, sample_size=16, **_HEADS),
         _cogview_inputs, IMAGE_LENGTHS),
    _dit("cogview4", IMAGE, "CogView4Transformer2DModel",
         dict(patch_size=2, in_channels=4, num_layers=2, out_channels=4, text_embed_dim=TEXT_DIM, time_embed_dim=16,
              condition_dim=4, rope_axes_dim=(4, 4), **_HEADS),
         _cogview_inputs, IMAGE_LENGTHS, notes="2D RoPE computed from the grid inside the model"),
    _dit("lumina2", IMAGE, "Lumina2Transformer2DModel",
         dict(sample_size=16, patch_size=2, in_channels=4, hidden_size=32, num_layers=2, num_refiner_layers=1,
              num_attention_heads=4, num_kv_heads=2, multiple_of=16, norm_eps=1e-5, scaling_factor=1.0,
              axes_dim_rope=(4, 2, 2), axes_lens=(128, 128, 128), cap_feat_dim=TEXT_DIM),
         _lumina2_inputs, IMAGE_LENGTHS, notes="per-sample padding of text+image into one sequence, GQA"),
    _dit("lumina_next", IMAGE, "LuminaNextDiT2DModel",
         dict(sample_size=16, patch_size=2, in_channels=4, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2,
              multiple_of=16, qk_norm=True, cross_attention_dim=TEXT_DIM, learn_sigma=False),
         _lumina_next_inputs, IMAGE_LENGTHS, notes="complex RoPE table input sliced by the grid"),
    _dit("sana", IMAGE, "SanaTransformer2DModel",
         dict(patch_size=1, in_channels=4, out_channels=4, num_layers=2, num_cross_attention_heads=4,
              cross_attention_head_dim=8, cross_attention_dim=32, caption_channels=TEXT_DIM, sample_size=16, **_HEADS),
         _sana_inputs, IMAGE_LENGTHS,
         notes="linear self-attention (sums over the sequence: local sums + all-reduce); Mix-FFN convolutions over "
               "the token grid on each rank's window of rows (halo exchange)"),
    _dit("hunyuan_dit", IMAGE, "HunyuanDiT2DModel",
         dict(sample_size=16, patch_size=2, in_channels=4, num_layers=2, cross_attention_dim=TEXT_DIM, cross_attention_dim_t5=TEXT_DIM,
              pooled_projection_dim=8, hidden_size=32, text_len=TEXT_LEN, text_len_t5=13, activation_fn="gelu-approximate", **_HEADS),
         _hunyuan_dit_inputs, IMAGE_LENGTHS, notes="RoPE tables computed by the pipeline and passed in; U-Net style skips"),
    _dit("hidream", IMAGE, "HiDreamImageTransformer2DModel",
         dict(patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, caption_channels=[8, 4],
              text_emb_dim=8, num_routed_experts=2, num_activated_experts=2, axes_dims_rope=(4, 2, 2), max_resolution=(32, 32),
              llama_layers=(0, 2), force_inference_output=True, **_HEADS),
         _hidream_inputs, IMAGE_LENGTHS, notes="MoE feed-forward"),
    _dit("glm_image", IMAGE, "GlmImageTransformer2DModel",
         dict(patch_size=2, in_channels=4, out_channels=4, num_layers=2, text_embed_dim=32, time_embed_dim=16, condition_dim=8,
              prior_vq_quantizer_codebook_size=64, **_HEADS),
         _glm_image_inputs, IMAGE_LENGTHS),
    _dit("ernie_image", IMAGE, "ErnieImageTransformer2DModel",
         dict(hidden_size=32, num_attention_heads=4, num_layers=2, ffn_hidden_size=64, in_channels=16, out_channels=16, patch_size=1,
              text_in_dim=TEXT_DIM, rope_theta=256, rope_axes_dim=(4, 2, 2), eps=1e-6, qk_layernorm=True),
         _ernie_inputs, IMAGE_LENGTHS),
    _dit("prx", IMAGE, "PRXTransformer2DModel",
         dict(in_channels=16, patch_size=2, context_in_dim=32, hidden_size=32, mlp_ratio=2.0, num_heads=4, depth=2,
              axes_dim=[4, 4], theta=10_000),
         _prx_inputs, IMAGE_LENGTHS),
    _dit("nucleus_moe_image", IMAGE, "NucleusMoEImageTransformer2DModel",
         dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, joint_attention_dim=TEXT_DIM, axes_dims_rope=(4, 2, 2),
              moe_enabled=False, **_HEADS),
         _nucleus_inputs, IMAGE_LENGTHS, PACKED_DIT_BUDGET, PACKED_DIT_NOTE),
    _dit("omnigen", IMAGE, "OmniGenTransformer2DModel",
         dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64, num_layers=2, pad_token_id=0,
              vocab_size=100, in_channels=4, time_step_dim=8, rope_scaling={"long_factor": [1.0] * 4, "short_factor": [1.0] * 4}),
         _omnigen_inputs, IMAGE_LENGTHS, notes="Phi-3 style LM over text + time + image tokens, dense mask input"),
    _dit("z_image", IMAGE, "ZImageTransformer2DModel",
         dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=1, n_heads=4,
              n_kv_heads=4, qk_norm=True, cap_feat_dim=TEXT_DIM, rope_theta=256.0, t_scale=1000.0, axes_dims=[4, 2, 2],
              axes_lens=[256, 32, 32]),
         _z_image_inputs, IMAGE_LENGTHS, notes="batch as a list of per-sample tensors, padded inside"),
    # ---- video ----
    _dit("latte", VIDEO, "LatteTransformer3DModel",
         dict(sample_size=16, num_layers=2, patch_size=2, caption_channels=TEXT_DIM, in_channels=4, cross_attention_dim=32,
              out_channels=8, attention_bias=True, activation_fn="gelu-approximate", num_embeds_ada_norm=1000,
              norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6, video_length=3, **_HEADS),
         _latte_inputs, VIDEO_LENGTHS,
         notes="factorised spatial/temporal attention (the spatial tokens are sharded, so temporal attention is "
               "rank-local); learned temporal table for exactly 3 latent frames (both grids have 3)"),
    _dit("cogvideox", VIDEO, "CogVideoXTransformer3DModel",
         dict(in_channels=4, out_channels=4, time_embed_dim=8, text_embed_dim=TEXT_DIM, num_layers=2, sample_width=16,
              sample_height=16, sample_frames=9, patch_size=2, temporal_compression_ratio=4, max_text_seq_length=TEXT_LEN, **_HEADS),
         _cogvideox_inputs, VIDEO_LENGTHS, notes="CogVideoX 1.0: text+video joint attention, sincos positions recomputed"),
    _dit("cogvideox15", VIDEO, "CogVideoXTransformer3DModel",
         dict(in_channels=4, out_channels=4, time_embed_dim=8, text_embed_dim=TEXT_DIM, num_layers=2, sample_width=16,
              sample_height=16, sample_frames=9, patch_size=2, patch_size_t=2, temporal_compression_ratio=4,
              max_text_seq_length=TEXT_LEN, use_rotary_positional_embeddings=True, use_learned_positional_embeddings=False,
              num_attention_heads=4, attention_head_dim=16),
         lambda n, b, g: _cogvideox_inputs(n, b, g, rope=True, patch_t=2), VIDEO_LENGTHS,
         notes="CogVideoX 1.5: temporal patch 2, 3D RoPE tables from the pipeline; head dim 16 (RoPE splits it 4/6/6)"),
    _dit("hunyuan_video", VIDEO, "HunyuanVideoTransformer3DModel",
         dict(in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1,
              guidance_embeds=True, text_embed_dim=TEXT_DIM, pooled_projection_dim=8, rope_axes_dim=(2, 2, 4), **_HEADS),
         _hunyuan_video_inputs, VIDEO_LENGTHS, notes="dual-stream then single-stream blocks, token refiner"),
    _dit("hunyuan_video15", VIDEO, "HunyuanVideo15Transformer3DModel",
         dict(in_channels=4, out_channels=4, num_layers=2, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
              text_embed_dim=TEXT_DIM, text_embed_2_dim=8, image_embed_dim=12, rope_axes_dim=(2, 2, 4), target_size=16,
              task_type="t2v", **_HEADS),
         _hunyuan_video15_inputs, VIDEO_LENGTHS),
    _dit("wan", VIDEO, "WanTransformer3DModel",
         dict(patch_size=(1, 2, 2), in_channels=4, out_channels=4, text_dim=TEXT_DIM, freq_dim=32, ffn_dim=64, num_layers=2,
              cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32, **_HEADS),
         _wan_inputs, VIDEO_LENGTHS, notes="3D RoPE, cross-attention to text"),
    _dit("wan_vace", VIDEO, "WanVACETransformer3DModel",
         dict(patch_size=(1, 2, 2), in_channels=4, out_channels=4, text_dim=TEXT_DIM, freq_dim=32, ffn_dim=64, num_layers=2,
              cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32, vace_layers=[0], vace_in_channels=12, **_HEADS),
         _wan_vace_inputs, VIDEO_LENGTHS, notes="control branch over a second latent sequence"),
    _dit("skyreels_v2", VIDEO, "SkyReelsV2Transformer3DModel",
         dict(patch_size=(1, 2, 2), in_channels=4, out_channels=4, text_dim=TEXT_DIM, freq_dim=32, ffn_dim=64, num_layers=2,
              cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32, **_HEADS),
         _wan_inputs, VIDEO_LENGTHS),
    _dit("chronoedit", VIDEO, "ChronoEditTransformer3DModel",
         dict(patch_size=(1, 2, 2), in_channels=4, out_channels=4, text_dim=TEXT_DIM, freq_dim=32, ffn_dim=64, num_layers=2,
              cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32, **_HEADS),
         _wan_inputs, VIDEO_LENGTHS),
    replace(_dit("mochi", VIDEO, "MochiTransformer3DModel",
                 dict(patch_size=2, num_layers=2, pooled_projection_dim=16, in_channels=4, qk_norm="rms_norm",
                      text_embed_dim=TEXT_DIM, time_embed_dim=4, activation_fn="swiglu", max_sequence_length=TEXT_LEN, **_HEADS),
                 _mochi_inputs, VIDEO_LENGTHS,
                 notes="asymmetric joint attention over each sample's valid text tokens (torch.nonzero): "
                       "compiled with capture_dynamic_output_shape_ops, else every attention runs in eager code"),
            dynamo_config=(("capture_dynamic_output_shape_ops", True),)),
    _dit("ltx", VIDEO, "LTXVideoTransformer3DModel",
         dict(in_channels=8, out_channels=8, cross_attention_dim=32, num_layers=2, qk_norm="rms_norm_across_heads",
              caption_channels=TEXT_DIM, **_HEADS),
         _ltx_inputs, VIDEO_LENGTHS, PACKED_DIT_BUDGET, PACKED_DIT_NOTE, notes="packed tokens in; grid given as Python ints"),
    _dit("ltx2", VIDEO, "LTX2VideoTransformer3DModel",
         dict(in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, cross_attention_dim=32, audio_in_channels=4,
              audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8,
              num_layers=2, qk_norm="rms_norm_across_heads", caption_channels=TEXT_DIM, rope_double_precision=False, **_HEADS),
         _ltx2_inputs, VIDEO_LENGTHS, PACKED_DIT_BUDGET, PACKED_DIT_NOTE, notes="audio+video streams with cross-modal attention"),
    _dit("allegro", VIDEO, "AllegroTransformer3DModel",
         dict(in_channels=4, out_channels=4, num_layers=2, cross_attention_dim=32, sample_width=16, sample_height=16, sample_frames=16,
              caption_channels=TEXT_DIM, **_HEADS),
         _allegro_inputs, VIDEO_LENGTHS, notes="3D RoPE computed inside"),
    _dit("easyanimate", VIDEO, "EasyAnimateTransformer3DModel",
         dict(in_channels=4, out_channels=4, mmdit_layers=2, num_layers=2, patch_size=2, sample_height=60, sample_width=90,
              text_embed_dim=TEXT_DIM, time_embed_dim=8, time_position_encoding_type="3d_rope", timestep_activation_fn="silu",
              num_attention_heads=4, attention_head_dim=16),
         _easyanimate_inputs, VIDEO_LENGTHS, notes="head dim 16 (its 3D RoPE splits the head in thirds of multiples of 4)"),
    _dit("cosmos", VIDEO, "CosmosTransformer3DModel",
         dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=12, num_layers=2, mlp_ratio=2, text_embed_dim=TEXT_DIM,
              adaln_lora_dim=4, max_size=(8, 16, 16), patch_size=(1, 2, 2), rope_scale=(2.0, 1.0, 1.0), concat_padding_mask=False,
              extra_pos_embed_type="learnable"),
         _cosmos_inputs, VIDEO_LENGTHS, notes="head dim 12 (3D RoPE in thirds), learnable extra position table; no padding-mask channel (its resize needs torchvision, not installed)"),
    _dit("kandinsky6", VIDEO, "Kandinsky6Transformer3DModel",
         dict(in_visual_dim=4, out_visual_dim=4, in_text_dim=TEXT_DIM, in_text_dim2=8, time_dim=16, patch_size=(1, 2, 2),
              model_dim=32, ff_dim=64, num_text_blocks=1, num_visual_blocks=2, axes_dims=(2, 2, 4), visual_cond=False,
              in_audio_dim=4, out_audio_dim=4),
         _kandinsky6_inputs, VIDEO_LENGTHS, notes="channels-last video latents, audio branch unused"),
    _dit("sana_video", VIDEO, "SanaVideoTransformer3DModel",
         dict(in_channels=4, out_channels=4, num_layers=2, num_cross_attention_heads=4, cross_attention_head_dim=8,
              cross_attention_dim=32, caption_channels=TEXT_DIM, mlp_ratio=2.5, attention_bias=False, sample_size=8,
              patch_size=(1, 2, 2), norm_elementwise_affine=False, norm_eps=1e-6, qk_norm="rms_norm_across_heads",
              rope_max_seq_len=32, **_HEADS),
         _sana_video_inputs, VIDEO_LENGTHS,
         notes="linear self-attention (local sums + all-reduce); Mix-FFN and temporal convolutions on each rank's "
               "window of frames (halo exchange)"),
    _dit("motif_video", VIDEO, "MotifVideoTransformer3DModel",
         dict(in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, num_decoder_layers=0, mlp_ratio=2.0, patch_size=2,
              patch_size_t=1, qk_norm="rms_norm", norm_type="layer_norm", text_embed_dim=TEXT_DIM, image_embed_dim=None,
              rope_theta=256.0, rope_axes_dim=(2, 2, 4), **_HEADS),
         _motif_inputs, VIDEO_LENGTHS),
    _dit("anyflow", VIDEO, "AnyFlowTransformer3DModel",
         dict(patch_size=(1, 2, 2), in_channels=4, out_channels=4, text_dim=TEXT_DIM, freq_dim=32, ffn_dim=64, num_layers=2,
              cross_attn_norm=True, rope_max_seq_len=32, num_attention_heads=4, attention_head_dim=12),
         _anyflow_inputs, VIDEO_LENGTHS, notes="per-frame timesteps"),
    _dit("consisid", VIDEO, "ConsisIDTransformer3DModel",
         dict(in_channels=4, out_channels=4, time_embed_dim=8, text_embed_dim=TEXT_DIM, num_layers=2, sample_width=16, sample_height=16,
              sample_frames=9, patch_size=2, temporal_compression_ratio=4, max_text_seq_length=TEXT_LEN, cross_attn_interval=1,
              is_kps=False, is_train_face=True, cross_attn_dim_head=1, cross_attn_num_heads=1, LFE_id_dim=3, LFE_vit_dim=3,
              LFE_depth=5, LFE_dim_head=8, LFE_num_heads=2, LFE_num_id_token=1, LFE_num_querie=1, LFE_output_dim=32,
              LFE_ff_mult=1, LFE_num_scale=1, num_attention_heads=4, attention_head_dim=12),
         _consisid_inputs, VIDEO_LENGTHS, notes="CogVideoX + identity cross-attention; inner dim 48 (its face-token width is 2/3 of it)"),
]


# The quick tier (not marked slow): one case per architecture the issue names, the attention
# spellings it calls out (GPT-2 and Gemma 2 eager, SDPA, ALiBi, relative buckets) and both cache
# settings of one decoder. The rest are clones of these architectures (Wan -> SkyReels/ChronoEdit,
# Flux -> Chroma/Bria/...) or heavier compiles; each case takes 0.5-2 minutes on 2 CPU cores.
QUICK = {  # 10-20 s each on CI's 2 cores: the rest (dit, latte, gemma2, mixtral among them) run after
    # the quick tier while the time budget lasts, and all of them under `pytest -m slow`
    "wan", "llama-sdpa",
    "flux",  # joint text+image attention
}

# Cases with a known sharding gap, by mechanism (see docs/limitations.md and
# benchmarks/results/real_model_zoo.md). They are expected to fail the sharding assertions (never
# parity: a gap means extra gathers or an unsharded site, which stay exact); non-strict because a
# fix of the mechanism turns them green one by one. The next plan takes them from here.
KNOWN_GAPS: dict[str, str] = {
}

CASES: dict[str, RealCase] = {
    case.name: replace(case, slow=case.name not in QUICK) for case in _DIFFUSERS_CASES + _hf_cases()
}
assert QUICK <= set(CASES), sorted(QUICK - set(CASES))

# diffusers.models.transformers classes that are not in the zoo, and why.
SKIPPED: dict[str, str] = {
    "PriorTransformer": "not a DiT over latents: the unCLIP prior maps one CLIP embedding (no token sequence to shard)",
    "Transformer2DModel": "the generic U-Net block transformer; its DiT/PixArt configurations remap to DiTTransformer2DModel/PixArtTransformer2DModel, which are in the zoo",
    "DualTransformer2DModel": "two U-Net Transformer2DModels mixed for Versatile Diffusion; a U-Net component, not a DiT",
    "TransformerTemporalModel": "a U-Net temporal layer (AnimateDiff/ModelScope), attends over frames of a U-Net feature map; not a DiT",
    "T5FilmDecoder": "spectrogram diffusion (audio), not an image/video DiT",
    "StableAudioDiTModel": "audio DiT (1D waveform latents), not image/video",
    "StableAudio3DiTModel": "audio DiT, not image/video",
    "AceStepTransformer1DModel": "audio/music DiT, not image/video",
    "LongCatAudioDiTTransformer": "audio DiT, not image/video",
    "MiniMaxMusic3Transformer1DModel": "music DiT, not image/video",
    "MiniMaxMusic3RVQDepthDecoder": "audio codec depth decoder, not a DiT",
    "RFD4ProteinaTransformer": "protein structure model, not image/video",
    "Cosmos3OmniTransformer": "an omni LM over packed text/vision index inputs (und_len, sequence indexes): no fixed latent grid input to size",
    "WanAnimateTransformer3DModel": "Wan + motion/face encoders over 77-frame face videos (a face encoder conv stack dominates): too heavy at tiny size; Wan core is in the zoo",
    "WanAnimate2Transformer3DModel": "inputs are per-sample lists plus a KV cache and a cache mode (reference/generation passes): not a single training forward",
    "AnyFlowFARTransformer3DModel": "needs a prebuilt block-causal flex-attention mask and a chunk partition; AnyFlowTransformer3DModel is in the zoo",
    "HunyuanVideoFramepackTransformer3DModel": "needs clean-latent histories at 2x/4x with index tensors (framepack inference state); HunyuanVideo is in the zoo",
    "HeliosTransformer3DModel": "needs short/mid/long history latents with index tensors (autoregressive inference state)",
    "Kandinsky5Transformer3DModel": "casts its RoPE output to bfloat16 (hard-coded .to(torch.bfloat16)), so the fp32 parity check is not meaningful",
    "BriaFiboTransformer2DModel": "Bria with per-layer text encoder inputs; BriaTransformer2DModel is in the zoo",
    "BriaFibo2Transformer2DModel": "Bria Fibo variant; BriaTransformer2DModel is in the zoo",
    "Ideogram4Transformer2DModel": "inputs are a pre-packed text+image sequence with indicator/segment ids and 3-axis position ids built by the pipeline",
    "Krea2Transformer2DModel": "text encoder layers inside the model plus pipeline-built 3-axis position ids",
    "JoyImageEditTransformer3DModel": "image-edit model with pipeline-built shape lists",
    "JoyImageEditPlusTransformer3DModel": "multi-image edit model with per-sample shape lists",
    "MiniMaxH3Transformer3DModel": "video+audio model over pre-packed tokens with a packed-layout dict built by the pipeline",
    "Kandinsky6SRTransformer3DModel": "super-resolution stage with NABLA sparse block attention (thresholds, windows, fixed tile sizes): not the dense attention this zoo checks",
    "DreamLiteTransformer2DModel": "a Transformer2DModel-style U-Net block (GroupNorm over a conv feature map) for DreamLite's U-Net, not a DiT",
    "QwenImage21Transformer2DModel": "inputs are a VLM token sequence with image slots (img_mask expanded by repeat_interleave) and nested img_shapes built by the pipeline; QwenImageTransformer2DModel is in the zoo",
    "SanaWMTransformer3DModel": "world model: camera/raymap (Plucker) conditioning and chunked causal linear attention over frames; SanaVideoTransformer3DModel is in the zoo",
    "SanaWMLTX2RefinerTransformer3DModel": "refiner stage driven by precomputed video_rotary_emb and a KV cache mode; LTX2VideoTransformer3DModel is in the zoo",
}


# ---------------------------------------------------------------------------------------------
# The worker: sharding record + parity on a real gloo world (shared by the test and the report)
# ---------------------------------------------------------------------------------------------

RTOL = 1e-4  # fp32 parity: outputs and SP-group-summed gradients, torch.allclose(rtol, atol)
ATOL = 1e-4
CASE_TIMEOUT = 900.0  # seconds per case (both lengths, one process world)


def flatten_outputs(outputs: Any, prefix: str = "", depth: int = 0) -> dict[str, Tensor]:
    """Every tensor of a model output by a path name: ModelOutput/dict fields, tuple/list
    entries, and the key/value tensors of Hugging Face cache objects (``past_key_values`` is an
    output too: a sharded cache would be wrong for generation)."""
    found: dict[str, Tensor] = {}
    if depth > 6 or outputs is None:
        return found
    if isinstance(outputs, Tensor):
        found[prefix or "output"] = outputs
    elif isinstance(outputs, Mapping):
        for key, value in outputs.items():
            found.update(flatten_outputs(value, f"{prefix}.{key}" if prefix else str(key), depth + 1))
    elif isinstance(outputs, (tuple, list)):
        for index, value in enumerate(outputs):
            found.update(flatten_outputs(value, f"{prefix}[{index}]", depth + 1))
    elif type(outputs).__module__.startswith("transformers.cache_utils"):
        for key, value in vars(outputs).items():
            if isinstance(value, (Tensor, list, tuple, dict)) or type(value).__module__.startswith("transformers.cache_utils"):
                found.update(flatten_outputs(value, f"{prefix}.{key}", depth + 1))
    return found


def eager_run(case: RealCase, tokens: int) -> tuple[dict[str, Tensor], dict[str, Tensor], "AttentionCounter"]:
    """Eager fp32 forward + backward of a fresh model on the full batch: (outputs, grads, the
    attention calls its forward made)."""
    model = case.build()
    inputs, _ = case.make_inputs(tokens)
    counter = AttentionCounter()
    with counter:
        outputs = model(**inputs)
    case.loss_of(outputs).backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return {k: v.detach().clone() for k, v in flatten_outputs(outputs).items()}, grads, counter


class AttentionCounter(torch.overrides.TorchFunctionMode):
    """Counts SDPA calls: each one an attention site the compiled graphs must hold, unless it ran
    in eager code after a graph break."""

    def __init__(self) -> None:
        super().__init__()
        self.sdpa_calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention:
            self.sdpa_calls += 1
        return func(*args, **(kwargs or {}))


def sdpa_runs_in_graphs(record: Any, calls_seen: dict[int, int]) -> int:
    """SDPA calls the compiled graphs made during one ``dcp.explain`` call: each graph's SDPA
    sites (hand-written regions not counted) times the calls it got in this one (a block compiled
    once runs once per layer). ``calls_seen`` holds each graph's dispatches before it, updated."""
    total = 0
    for graph in record.graphs:
        calls = len(graph.dispatches) - calls_seen.get(graph.graph_id, 0)
        calls_seen[graph.graph_id] = len(graph.dispatches)
        total += calls * sum(1 for site in graph.attention_sites if "(hand-written region" not in site)
    return total


def check_eager_attention(row: dict[str, Any], eager_sdpa_calls: int, graph_sdpa_calls: int) -> None:
    """Attention that ran in eager code (after a graph break) is not sharded, and no record of
    the compiled graphs shows it: the eager forward's SDPA calls must all be in the graphs."""
    row["eager_sdpa_calls"], row["graph_sdpa_calls"] = eager_sdpa_calls, graph_sdpa_calls
    if eager_sdpa_calls > graph_sdpa_calls:
        row["failures"].append(
            f"{eager_sdpa_calls - graph_sdpa_calls} of {eager_sdpa_calls} SDPA calls ran outside the compiled "
            f"graphs (eager code after a graph break): not sharded")


def compiled_run(model: nn.Module, compiled: Any, case: RealCase, tokens: int, group=None,
                 local_only: bool = False) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Outputs and parameter gradients of the compiled model, gradients summed over the SP group
    (``local_only``: a model compiled without dcp, whose gradients are already whole)."""
    import torch.distributed as dist

    model.zero_grad(set_to_none=True)
    inputs, _ = case.make_inputs(tokens)
    outputs = compiled(**inputs)
    case.loss_of(outputs).backward()
    if dist.is_initialized() and dist.get_world_size() > 1 and not local_only:
        from dcp_compile.runtime.graph_parameters import correct_parameters_outside_graphs

        correct_parameters_outside_graphs(model)  # what dcp.sync_gradients does first
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        grad = param.grad.detach().clone()
        if dist.is_initialized() and dist.get_world_size() > 1 and not local_only:
            dist.all_reduce(grad, group=group)
        grads[name] = grad
    return {k: v.detach().clone() for k, v in flatten_outputs(outputs).items()}, grads


def compare(expected: tuple[dict, dict], actual: tuple[dict, dict], rtol: float = RTOL, atol: float = ATOL,
            reference64: tuple[dict, dict] | None = None, zero_grad_is_none: bool = False) -> tuple[float, list[str]]:
    """(max abs error over outputs and gradients, problems).

    With ``zero_grad_is_none``, a gradient of zeros where eager has none matches: AOTAutograd (under
    ``aot_eager`` and Inductor) gives a parameter whose output the loss never reads a zero gradient,
    where eager autograd leaves ``None``; plain ``torch.compile`` (``aot_eager`` and Inductor) gives
    the same zeros on HunyuanVideo 1.5, so it is not dcp's to match.

    With ``reference64`` (the same eager run in float64), a tensor that ``allclose`` refuses still
    passes when it is as close to float64 as eager float32 is: PyTorch's own accuracy rule for
    Inductor (``torch._dynamo.utils.same`` with ``fp64_ref``: RMSE to float64 at most twice eager
    float32's, plus ``tol / 10``). Inductor reorders float arithmetic (fused reductions), so an
    Inductor build can differ from eager by more than ``rtol`` with or without dcp."""
    problems: list[str] = []
    worst = 0.0
    for side_index, (kind, want_all, got_all) in enumerate((("output", expected[0], actual[0]), ("grad", expected[1], actual[1]))):
        compiled_only = sorted(key for key in set(got_all) - set(want_all)
                               if not (zero_grad_is_none and kind == "grad" and not got_all[key].any()))
        for side, names in (("eager only", sorted(set(want_all) - set(got_all))), ("compiled only", compiled_only)):
            if names:
                problems.append(f"{len(names)} {kind}(s) in {side}: {', '.join(names[:4])}{'...' if len(names) > 4 else ''}")
        bad = []
        for key, want in want_all.items():
            got = got_all.get(key)
            if got is None:
                continue
            if got.shape != want.shape:
                problems.append(f"{kind} {key}: shape {tuple(got.shape)} != eager {tuple(want.shape)}")
                worst = math.inf
                continue
            if not want.is_floating_point():
                if not torch.equal(got, want):
                    problems.append(f"{kind} {key}: differs")
                    worst = math.inf
                continue
            error = (got.double() - want.double()).abs().nan_to_num(nan=math.inf)
            error = error.masked_fill(got.isnan() & want.isnan(), 0.0)
            err = float(error.max()) if error.numel() else 0.0
            worst = max(worst, err)
            if not torch.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True):
                if reference64 is not None and _as_close_as_eager(want, got, reference64[side_index].get(key), rtol):
                    continue
                bad.append((err, key, bool((got.isnan() & ~want.isnan()).any())))
        if bad:
            bad.sort(reverse=True)
            names = ", ".join(f"{key} ({'NaN' if nan else f'{err:.2g}'})" for err, key, nan in bad[:3])
            rule = " and from float64 more than 2x eager float32" if reference64 is not None else ""
            problems.append(f"{len(bad)} {kind}(s) differ beyond rtol={rtol:g} atol={atol:g}{rule}: "
                            f"{names}{'...' if len(bad) > 3 else ''}")
    return worst, problems


def _as_close_as_eager(eager: Tensor, compiled: Tensor, eager64: Tensor | None, tol: float) -> bool:
    if eager64 is None or eager64.shape != eager.shape:
        return False
    from torch._dynamo.utils import same

    return bool(same(eager, compiled, fp64_ref=eager64, tol=tol, log_error=lambda *args, **kwargs: None))


def plain_inductor_run(case: RealCase, tokens: int) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A fresh model under plain ``torch.compile`` with Inductor (no dcp), on the full batch: what the
    user gets without dcp, the reference when Inductor itself is further from eager than ``rtol``
    and than PyTorch's float64 rule allows (AuraFlow)."""
    model = case.build()
    return compiled_run(model, torch.compile(model, backend="inductor", dynamic=True), case, tokens, local_only=True)


def eager_run_float64(case: RealCase, tokens: int) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """:func:`eager_run` in float64 (model and floating inputs): the ground truth that Inductor's
    float32 result is judged against when it differs from eager float32 beyond ``rtol``."""
    model = case.build().double()
    inputs, _ = case.make_inputs(tokens)
    inputs = {k: v.double() if isinstance(v, Tensor) and v.is_floating_point() else v for k, v in inputs.items()}
    outputs = model(**inputs)
    case.loss_of(outputs).backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return {k: v.detach().clone() for k, v in flatten_outputs(outputs).items()}, grads


def _first_line(exc: BaseException) -> str:
    """``Type: first line``; for a wrapper whose first line only says who raised
    (``BackendCompilerFailed: backend='dcp' raised:``), the wrapped error's line follows it."""
    text = [line for line in str(exc).strip().splitlines() if line.strip()]
    line = f"{type(exc).__name__}: {text[0][:300] if text else ''}"
    if text and text[0].rstrip().endswith("raised:") and len(text) > 1:
        line += " " + text[1][:300]
    return line


def _where(exc: BaseException) -> str:
    """The innermost frame of the traceback inside dcp_compile (else the innermost frame)."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "dcp_compile" in f.filename]
    frame = (ours or frames or [None])[-1]
    if frame is None:
        return ""
    path = frame.filename.split("site-packages/")[-1]
    if "dcp_compile/" in path:
        path = path[path.index("dcp_compile/"):]
    return f"{path}:{frame.lineno} ({frame.name})"


def new_row(case: RealCase, tokens: int) -> dict[str, Any]:
    return {
        "model": case.name, "family": case.family, "library": case.library, "class": case.model_class,
        "requested": tokens, "tokens": None, "budget": case.gather_budget,
        "parity_ok": None, "max_error": None, "parity_problems": [], "parity_rule": "allclose",
        "attention_sites": 0, "sites_covered": 0, "eager_sdpa_calls": None, "graph_sdpa_calls": None,
        "gathers": 0, "gather_reasons": {}, "fallbacks": [], "inner_fallbacks": [], "unsharded": [], "graphs": 0, "graph_ids": [],
        "summary_lines": [], "error": None, "error_where": None, "traceback": None,
        "failures": [], "compile_seconds": None, "seconds": None,
    }


def _record_sharding(row: dict[str, Any], record: Any, budget: int) -> None:
    """Fill the sharding columns from a ModelRecord and add the sharding assertion failures."""
    import collections

    row["summary_lines"] = list(record.summary_lines())
    row["graph_ids"] = [graph.graph_id for graph in record.graphs]
    row["graphs"] = len(record.graphs)
    reasons: collections.Counter = collections.Counter()
    for graph in record.graphs:
        for variant in graph.variants.values():
            row.setdefault("uncompiled_regions", []).extend(  # regional compilation: regions run as ATen graphs
                f"graph {graph.graph_id} {variant.variant}: {reason}" for reason in variant.uncompiled_regions)
            if variant.sp_size <= 1 or not variant.attention_sites:
                continue
            covered = len(variant.sharded_sites) + len(variant.rank_local_sites) + len(variant.replicated_sites)
            row["attention_sites"] += variant.attention_sites
            row["sites_covered"] += covered if variant.fallback_reason is None else 0
            reasons.update(variant.gather_reasons())
            row["gathers"] += len(variant.gathers)
            label = f"graph {graph.graph_id} {variant.variant}"
            if variant.inner_fallback:  # the variant runs under another inner compiler than asked
                row["inner_fallbacks"].append(f"{label}: {variant.inner_fallback}")
            if variant.fallback_reason is not None:
                row["fallbacks"].append(variant.fallback_reason)
                row["failures"].append(f"{label}: whole graph UNSHARDED: {variant.fallback_reason}")
                continue
            if not variant.is_sharded:
                row["unsharded"] += [f"{site}: {why}" for site, why in variant.unsharded_sites]
                row["failures"].append(
                    f"{label}: {covered}/{variant.attention_sites} attention sites sharded"
                    + "".join(f"; {site} UNSHARDED: {why}" for site, why in variant.unsharded_sites))
            if len(variant.gathers) > budget:
                listed = "; ".join(f"{r} x{c}" for r, c in variant.gather_reasons().most_common())
                row["failures"].append(f"{label}: {len(variant.gathers)} gathers > budget {budget} [{listed}]")
    row["gather_reasons"] = dict(reasons)
    if not row["attention_sites"] and any(v.sp_size > 1 for g in record.graphs for v in g.variants.values()):
        row["failures"].append("no attention found: no SP>1 variant of any graph has an attention site")


def zoo_worker(rank: int, world_size: int, case_name: str, lengths: tuple[int, ...] | None = None,
               sp_size: int | None = None, inner: str = "eager", rtol: float = RTOL, atol: float = ATOL,
               regions: bool | None = None) -> list[dict[str, Any]]:
    """Compile one case with the dcp backend once, then for each length: ``dcp.explain`` (sharding
    checks against the case's gather budget) and forward+backward parity with eager on the full
    batch. Never raises: every exception becomes the row's ``error`` (and a failure). ``regions``:
    the compile option, left to the backend's default when ``None``."""
    import time
    import traceback

    import dcp_compile as dcp

    torch.set_num_threads(1)
    case = CASES[case_name]
    for setting, value in case.dynamo_config:  # this process runs this case only
        setattr(torch._dynamo.config, setting, value)
    lengths = tuple(lengths or case.lengths)
    rows = [new_row(case, n) for n in lengths]
    try:
        torch._dynamo.reset()
        model = case.build()
        options = {"inner": inner, "sp_size": sp_size or world_size}
        if regions is not None:
            options["regions"] = regions
        compiled = torch.compile(model, backend="dcp", dynamic=True, options=options)
    except Exception as exc:  # noqa: BLE001
        for row in rows:
            row.update(error=f"build/compile: {_first_line(exc)}", error_where=_where(exc), traceback=traceback.format_exc()[-6000:])
            row["failures"].append(row["error"])
        return rows
    calls_seen: dict[int, int] = {}
    for row, n in zip(rows, lengths):
        start = time.perf_counter()
        _, row["tokens"] = case.make_inputs(n)
        stage = "explain"
        try:
            inputs, _ = case.make_inputs(n)
            record = dcp.explain(compiled, **inputs)
            row["compile_seconds"] = round(time.perf_counter() - start, 1)
            _record_sharding(row, record, case.gather_budget)
            graph_sdpa_calls = sdpa_runs_in_graphs(record, calls_seen)
            stage = "eager reference"
            outputs, grads, counter = eager_run(case, n)
            check_eager_attention(row, counter.sdpa_calls, graph_sdpa_calls)
            stage = "compiled forward+backward"
            actual = compiled_run(model, compiled, case, n)
            calls_seen.update((graph.graph_id, len(graph.dispatches)) for graph in record.graphs)
            through_aot_autograd = inner in ("inductor", "aot_eager")
            row["max_error"], row["parity_problems"] = compare((outputs, grads), actual, rtol, atol,
                                                               zero_grad_is_none=through_aot_autograd)
            if row["parity_problems"] and inner == "inductor":
                stage = "float64 reference"
                row["parity_rule"] = "float64 reference"
                row["max_error"], row["parity_problems"] = compare((outputs, grads), actual, rtol, atol,
                                                                   reference64=eager_run_float64(case, n),
                                                                   zero_grad_is_none=True)
            if row["parity_problems"] and inner == "inductor":
                stage = "plain torch.compile reference"
                plain = plain_inductor_run(case, n)
                plain_error, _ = compare((outputs, grads), plain, rtol, atol, zero_grad_is_none=True)
                _, problems = compare(plain, actual, rtol, atol, zero_grad_is_none=True)
                if not problems:
                    row["parity_rule"] = (f"plain torch.compile with Inductor: dcp within allclose of it, "
                                          f"both {plain_error:.1e} from eager")
                    row["parity_problems"] = []
                else:
                    row["parity_problems"].append(f"and from plain torch.compile with Inductor: {'; '.join(problems)}")
            row["parity_ok"] = not row["parity_problems"]
            row["failures"] += [f"parity: {p}" for p in row["parity_problems"]]
        except Exception as exc:  # noqa: BLE001
            row.update(error=f"{stage}: {_first_line(exc)}", error_where=_where(exc), traceback=traceback.format_exc()[-6000:])
            row["failures"].append(row["error"])
            if row["parity_ok"] is None:
                row["parity_ok"] = False
        row["seconds"] = round(time.perf_counter() - start, 1)
    return rows


_PEER_GONE = "Connection closed by peer"


def run_case(case_name: str, world_size: int = 2, timeout: float = CASE_TIMEOUT, **kwargs: Any) -> list[dict[str, Any]]:
    """Run :func:`zoo_worker` on ``world_size`` gloo ranks; rank 0's rows, with any failure
    only another rank saw appended. A world that dies or times out gives error rows."""
    import time

    from dcp_compile.testing.process_world import ProcessWorldError, run_in_process_world

    case = CASES[case_name]
    start = time.perf_counter()
    try:
        per_rank = run_in_process_world(zoo_worker, world_size, case_name, timeout=timeout,
                                        env={"TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}, **kwargs)
    except ProcessWorldError as exc:
        rows = [new_row(case, n) for n in kwargs.get("lengths") or case.lengths]
        lines = str(exc).strip().splitlines()
        last = next((line for line in reversed(lines) if line.strip() and not line.startswith(" ")), lines[0])
        for row in rows:
            row.update(error=f"process world: {lines[0][:200]}" + (f" | {last[:200]}" if last != lines[0] else ""),
                       traceback=str(exc)[-6000:], parity_ok=False)
            row["failures"].append(row["error"])
        return rows
    rows = per_rank[0]
    for other_rank, other in enumerate(per_rank[1:], start=1):
        for row, other_row in zip(rows, other):
            row["failures"] += [f"rank {other_rank}: {f}" for f in other_row["failures"] if f not in row["failures"]]
            if row["error"] and _PEER_GONE in row["error"] and other_row["error"] and _PEER_GONE not in other_row["error"]:
                # rank 0 only saw its peer die in a collective: the peer's exception is the cause
                row.update(error=f"rank {other_rank}: {other_row['error']}", error_where=other_row["error_where"],
                           traceback=other_row["traceback"])
    for row in rows:
        row["world_seconds"] = round(time.perf_counter() - start, 1)
    return rows


def format_row(row: dict[str, Any]) -> str:
    """``model@tokens | parity | sites sharded | gathers [reasons]`` (+ the error, if any)."""
    if row["parity_ok"] is None:
        parity = "-"
    elif row["parity_ok"]:
        rule = row.get("parity_rule", "allclose")
        parity = f"ok ({row['max_error']:.1e}{'' if rule == 'allclose' else ', ' + rule})"
    elif row["max_error"] is not None:
        parity = f"FAIL ({row['max_error']:.1e})"
    else:
        parity = "FAIL"
    sites = f"{row['sites_covered']}/{row['attention_sites']}"
    reasons = "; ".join(f"{reason} x{count}" for reason, count in sorted(row["gather_reasons"].items(), key=lambda kv: -kv[1]))
    gathers = f"{row['gathers']} (budget {row['budget']})" + (f" [{reasons}]" if reasons else "")
    line = f"{row['model']}@{row['tokens'] or row['requested']} | parity {parity} | sites sharded {sites} | gathers {gathers}"
    if row["fallbacks"]:
        line += f" | UNSHARDED: {row['fallbacks'][0][:160]}"
    if row["error"]:
        line += f" | ERROR {row['error'][:240]}"
    return line


def totals(rows: list[dict[str, Any]]) -> dict[str, int]:
    cases = {row["model"] for row in rows}
    failing = {row["model"] for row in rows if row["failures"]}
    return {
        "cases": len(cases),
        "cases_passing": len(cases - failing),
        "runs": len(rows),
        "parity_ok": sum(bool(row["parity_ok"]) for row in rows),
        "fully_sharded": sum(bool(row["attention_sites"]) and row["sites_covered"] == row["attention_sites"] for row in rows),
        "within_budget": sum(bool(row["attention_sites"]) and not any("gathers > budget" in f for f in row["failures"]) for row in rows),
        "errors": sum(bool(row["error"]) for row in rows),
        "sites": sum(row["attention_sites"] for row in rows),
        "sites_covered": sum(row["sites_covered"] for row in rows),
    }
