"""dcp's scoped Inductor fixes (compiler/workarounds/inductor_patches.py), on by default.

Quick: the sort of an image's token tensor ``[B, H*W, C]`` (strides ``16*H*W, 16, 1``, a product of
two size symbols) fails in torch 2.13's Inductor, succeeds inside the patch with the right order,
and is back to torch's own function after it; the gates and the off switch; the forward's output
strides handed to the backward symbolically; the cache tag. Slow: a grid model (tokens ``H*W``)
and a model with a convolution over a one-symbol sequence, through dcp with ``inner="inductor"``,
forward and backward at two lengths, exact and with no fallback.
"""

from __future__ import annotations

import types

import pytest
import torch

from dcp_compile.compiler.workarounds import inductor_patches as patches


def _token_strides():
    """Sympy strides of ``latent.flatten(2).transpose(1, 2).contiguous()`` for a latent ``[2, 16, H, W]``
    with symbolic ``H`` and ``W``, and the shape environment that knows their ranges."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)
    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.STATIC, DimDynamic.STATIC, DimDynamic.DYNAMIC, DimDynamic.DYNAMIC])
    latent = mode.from_tensor(torch.empty(2, 16, 3, 5), symbolic_context=dynamic, source=ConstantSource("latent"))
    with mode:
        tokens = latent.flatten(2).transpose(1, 2).contiguous()
    strides = [s.node.expr if isinstance(s, torch.SymInt) else s for s in tokens.stride()]
    assert len(strides[0].free_symbols) == 2, strides  # 16*H*W: a product of two size symbols
    return strides, shape_env


def _lowering(shape_env):
    """Inductor's current graph, as far as the stride sort reads it."""
    from torch._inductor.virtualized import V

    return V.set_graph_handler(types.SimpleNamespace(sizevars=types.SimpleNamespace(shape_env=shape_env)))


def _affected() -> bool:
    return patches._torch_release() <= patches.LAST_AFFECTED


requires_affected_torch = pytest.mark.skipif(not _affected(), reason="the patches are for torch <= 2.13")


@pytest.fixture(autouse=True)
def patches_as_default(monkeypatch):
    """The fixes as a user gets them: on unless DCP_INDUCTOR_PATCHES=0."""
    monkeypatch.delenv(patches.ENV_SWITCH, raising=False)


@requires_affected_torch
def test_the_patch_orders_an_image_token_tensor_and_is_restored_after():
    from torch._inductor import ir

    strides, shape_env = _token_strides()
    original = ir.get_fill_order
    with _lowering(shape_env):
        with pytest.raises(TypeError, match="cannot determine truth value of Relational"):
            ir.get_stride_order(strides)  # torch 2.13 as shipped: the bug
        before = patches.rescued_stride_sorts()
        with patches.stride_sort_with_shape_env() as patch:
            assert ir.get_fill_order is not original
            assert ir.get_stride_order(strides) == [2, 1, 0]  # the contiguous order
            assert ir.get_stride_order([15, 1, 3]) == [2, 0, 1]  # static strides: torch's own path
            with patches.stride_sort_with_shape_env() as nested:  # a nested compile: no double wrap
                assert ir.get_stride_order(strides) == [2, 1, 0]
            assert nested.rescued == 0
        assert patch.rescued == 2 and patches.rescued_stride_sorts() == before + 2
        assert ir.get_fill_order is original
        with pytest.raises(TypeError):
            ir.get_stride_order(strides)


@requires_affected_torch
def test_the_patch_passes_on_what_it_cannot_fix():
    """Without a shape environment anywhere, or for another TypeError, the error stays torch's."""
    from torch._inductor import ir

    strides, _ = _token_strides()
    with patches.stride_sort_with_shape_env() as patch:  # no graph is being lowered
        with pytest.raises(TypeError, match="Relational"):
            ir.get_stride_order(strides)
        with pytest.raises(TypeError):
            ir.get_stride_order([1, "a", 2])
    assert patch.rescued == 0


def test_the_patch_is_gated_on_the_torch_release_and_the_switch(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    assert patches.stride_sort_patch_applies() and patches.value_range_patch_applies()  # on by default
    assert patches.symbolic_output_strides_apply()
    monkeypatch.setenv(patches.ENV_SWITCH, "0")  # the off switch turns all three off
    assert not patches.stride_sort_patch_applies() and not patches.value_range_patch_applies()
    assert not patches.symbolic_output_strides_apply()
    monkeypatch.setenv(patches.ENV_SWITCH, "1")
    monkeypatch.setattr(torch, "__version__", "2.14.0+cu128")
    assert not patches.stride_sort_patch_applies() and not patches.value_range_patch_applies()
    assert patches.symbolic_output_strides_apply()  # dcp's own: not tied to the torch release
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    assert patches.stride_sort_patch_applies()
    monkeypatch.setattr(torch._inductor.ir, "get_fill_order", None)
    assert not patches.stride_sort_patch_applies()  # the function it wraps is gone: do nothing
    from torch._inductor import ir

    with patches.stride_sort_with_shape_env() as patch:
        assert ir.get_fill_order is None
    assert patch.rescued == 0


def test_the_backward_is_handed_the_forward_output_strides_symbolically(monkeypatch):
    """What Inductor reports for a forward's outputs (strings it printed from its layouts) reaches
    AOTAutograd, which restrides the backward's inputs with it, as expressions in the size symbols:
    at its compile length, ``16*H*W`` is 240, which the backward would otherwise assert at every
    length. Static strides and outputs with no stride stay as torch reported them; off, nothing changes."""
    import types

    from torch._guards import TracingContext, tracing

    strides, shape_env = _token_strides()
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(shape_env=shape_env)
    hints = {int(shape_env.backed_var_to_val[symbol]): symbol for symbol in strides[0].free_symbols}
    h, w = hints[3], hints[5]  # the latent is 3 x 5
    example = [mode.from_tensor(torch.empty(1))]
    compiled = types.SimpleNamespace(output_strides=[(f"16*{h}*{w}", "1", f"16*{w}", "16"), ("4", "1"), None])
    for switch, expected in (("1", 1), ("0", 0)):
        monkeypatch.setenv(patches.ENV_SWITCH, switch)
        with tracing(TracingContext(mode)), TracingContext.report_output_strides() as reported:
            reported.extend([(240, 1, 80, 16), (4, 1), None])  # as torch 2.13 reports them: values at 3 x 5
            before = patches.symbolic_saved_strides()
            assert patches.symbolic_forward_output_strides(compiled, example) == expected
            assert patches.symbolic_saved_strides() == before + expected
            assert reported[1] == (4, 1) and reported[2] is None
            if expected:
                first = reported[0]
                assert [s.node.expr if isinstance(s, torch.SymInt) else s for s in first] == [16 * h * w, 1, 16 * w, 16]
                assert [int(s) for s in first] == [240, 1, 80, 16]  # the same values at 3 x 5
            else:
                assert reported[0] == (240, 1, 80, 16)
    assert patches.symbolic_forward_output_strides(compiled, example) == 0  # no tracing context: nothing to do


def test_the_fix_keys_the_compile_caches_with_its_tag(monkeypatch):
    """A cache entry written without the fix (its backward asserting one length's strides) must not
    be served to a compile that relies on it: the compile's cache key carries the fix's tag."""
    config = torch.compiler.config
    before = config.cache_key_tag
    with patches.caches_keyed_by_the_fix():
        assert patches.CACHE_TAG in config.cache_key_tag
        with patches.caches_keyed_by_the_fix():  # nested: tagged once
            assert config.cache_key_tag.count(patches.CACHE_TAG) == 1
    assert config.cache_key_tag == before
    monkeypatch.setenv(patches.ENV_SWITCH, "0")
    with patches.caches_keyed_by_the_fix():
        assert config.cache_key_tag == before


class ConvOverSequence(torch.nn.Module):
    """Attention, then a 3-tap convolution over the tokens ``[B, S, D] -> [B, D, S, 1]``: one size
    symbol, no stride sort to rescue, and still a 4-d attention output that Inductor's CPU layout
    optimisation saves channels-last for the backward (what the third fix is for)."""

    def __init__(self, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.conv = torch.nn.Conv2d(dim, dim, (3, 1), padding=(1, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        h = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, S, D)
        return x + self.conv(h.transpose(1, 2).unsqueeze(-1)).squeeze(-1).transpose(1, 2)


def _grid_model():
    from model_zoo import GridConvModel

    return GridConvModel(), (torch.randn(2, 4, 7, 3), torch.randn(2, 4, 5, 4))


def _sequence_model():
    return ConvOverSequence(), (torch.randn(2, 21, 16), torch.randn(2, 20, 16))


@pytest.mark.slow
@pytest.mark.parametrize("build", [_grid_model, _sequence_model], ids=["grid_HxW", "conv_over_sequence"])
def test_a_conv_model_compiles_with_inductor_at_two_lengths_and_no_fallback(build, fake_world, request):
    """Forward and backward through Inductor under dcp, equal to eager at two lengths (the backward
    is compiled at the first; it asserted that length's strides at the second before the third fix),
    no aot_eager fallback in explain. The grid model (tokens ``H*W`` from a patchify conv, attention,
    convolutions over the token grid) meets pytorch/pytorch#172204 on torch <= 2.13."""
    import dcp_compile as dcp
    from torch._inductor.utils import fresh_cache

    fresh = fresh_cache()  # a cached compile would skip the lowering (and a cached backward, the bug)
    fresh.__enter__()
    request.addfinalizer(lambda: fresh.__exit__(None, None, None))
    torch.manual_seed(0)
    model, inputs = build()
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "inductor", "sp_size": 1})
    sorts, saved = patches.rescued_stride_sorts(), patches.symbolic_saved_strides()
    for index, x in enumerate(inputs):
        # The second length runs the variant (and the backward) compiled at the first: no re-trace.
        with torch.compiler.set_stance("fail_on_recompile" if index else "default"):
            model.zero_grad()
            out = compiled(x)
            out.pow(2).mean().backward()
        got = {name: p.grad.clone() for name, p in model.named_parameters()}
        model.zero_grad()
        expected = model(x)
        expected.pow(2).mean().backward()
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
        for name, p in model.named_parameters():
            torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-5)
    assert patches.symbolic_saved_strides() > saved, "no forward output had symbolic strides: the fix did nothing"
    if build is _grid_model and _affected():
        assert patches.rescued_stride_sorts() > sorts, "the grid model no longer meets the bug: pick one that does"
    explained = dcp.explain(compiled, inputs[0])
    variants = explained.variant_records()
    assert variants and all(variant.inner_fallback is None for variant in variants), str(explained)
    assert "aot_eager instead of inductor" not in str(explained), str(explained)


@requires_affected_torch
def test_a_negative_power_gets_an_unknown_value_range_inside_the_patch_only():
    """The range of ``x**-1`` for ``x`` in [-3, -2] (a true division in a sharded window's size)
    raises in torch 2.13's value-range analysis; inside the patch it is unknown (sound), other powers
    keep their ranges, and the classmethod is restored after."""
    from torch.utils._sympy.value_ranges import SymPyValueRangeAnalysis, ValueRanges

    original = SymPyValueRangeAnalysis.__dict__["pow_by_natural"]
    with pytest.raises(ValueError, match="Exponent must be non-negative"):
        SymPyValueRangeAnalysis.pow_by_natural(ValueRanges(-3, -2), ValueRanges(-1, -1))
    with patches.scoped_inductor_fixes() as patch:
        assert SymPyValueRangeAnalysis.pow_by_natural(ValueRanges(-3, -2), ValueRanges(-1, -1)) == ValueRanges.unknown_int()
        assert SymPyValueRangeAnalysis.pow_by_natural(ValueRanges(2, 3), ValueRanges(2, 2)) == ValueRanges(4, 9)
    assert patch.unknown_ranges == 1
    assert SymPyValueRangeAnalysis.__dict__["pow_by_natural"] is original
