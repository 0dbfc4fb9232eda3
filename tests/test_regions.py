"""Regional compilation (``options={"regions": True}``): every variant at parity on real gloo ranks,
sharded, and token-local code compiled once for every variant that repeats it."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import dcp_compile as dcp
from dcp_compile.compiler.regions import REGION_CACHE, canonical_code, canonical_views, compile_region
from dcp_compile.testing.process_world import run_in_process_world
from sharding_checks import sharding_problems
from model_zoo import ZOO
from parity import compare, compiled_run, eager_reference

# (variant, length): SP sizes and recompute policies in the order a planner might meet them;
# selective is compiled whole (it picks ops inside regions) and must still be right beside them.
VARIANTS = ((dcp.Variant(2), 19), (dcp.Variant(1), 14), (dcp.Variant(2, "full"), 23),
            (dcp.Variant(2, "attention"), 17), (dcp.Variant(1, "attention"), 13), (dcp.Variant(1, "full"), 15),
            (dcp.Variant(2, "selective"), 21))


def _parity_worker(rank, world_size, inner, rtol, atol):
    REGION_CACHE.clear()
    case = ZOO["gpt"]
    model = case.build()
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": inner, "regions": True})
    problems, compiles = [], {}
    for variant, length in VARIANTS:
        with dcp.use(variant):
            actual = compiled_run(model, compiled, case, case.make_inputs(length), reduce=variant.sp_size > 1)
        problems += compare(f"gpt-regions-{variant}", length, eager_reference(case, length), actual, rtol=rtol, atol=atol)
        compiles[str(variant)] = REGION_CACHE.compiles
    before = REGION_CACHE.compiles
    for variant, length in VARIANTS[:3]:  # again, at other lengths: every region's guards hold
        with dcp.use(variant):
            actual = compiled_run(model, compiled, case, case.make_inputs(length + 6), reduce=variant.sp_size > 1)
        problems += compare(f"gpt-regions-{variant}", length + 6, eager_reference(case, length + 6), actual,
                            rtol=rtol, atol=atol)
    compiles["again"] = REGION_CACHE.compiles - before
    with dcp.use(dcp.Variant(2)):
        record = dcp.explain(compiled, **case.make_inputs(30))
    problems += sharding_problems(record, 0)
    regions = {str(variant): variant_record.regions for variant_record in record[0].variants.values()
               for variant in [variant_record.variant]}
    if problems:
        raise AssertionError("\n".join(problems))
    return compiles, regions


def _check(results):
    for compiles, regions in results:
        # The recompute variants of an SP size compile nothing but the tiled loss's head (every
        # policy but none tiles the loss, dcp_compile.tiled_loss: new code, at most its two regions
        # around the loss's all-reduce), once per SP size and shared by every policy that tiles:
        # recomputation is applied around the regions the SP size's first variant compiled.
        assert 0 < compiles["sp=2/recompute=full"] - compiles["sp=1/recompute=none"] <= 2
        assert compiles["sp=2/recompute=attention"] == compiles["sp=2/recompute=full"]
        assert 0 < compiles["sp=1/recompute=attention"] - compiles["sp=2/recompute=attention"] <= 2
        assert compiles["sp=1/recompute=full"] == compiles["sp=1/recompute=attention"]
        # SP 1 shares the transformer block's region with SP 2: fewer new compiles than SP 2 made.
        assert compiles["sp=1/recompute=none"] - compiles["sp=2/recompute=none"] < compiles["sp=2/recompute=none"]
        assert "compiled region" in regions["sp=2/recompute=none"]
        assert regions["sp=2/recompute=selective"].startswith("not used: recompute=selective")
        assert compiles["again"] == 0, "a region compiled again at another length: its guards did not hold"


def test_regions_keep_parity_on_two_ranks():
    _check(run_in_process_world(_parity_worker, 2, "aot_eager", 1e-5, 1e-5, timeout=900))


@pytest.mark.slow
def test_a_sequence_shorter_than_the_sp_size_runs_at_parity_on_every_rank():
    """3 tokens at SP 4 leave the last rank no token: a region's views write the chunk's length as
    -1, which a tensor of no elements cannot resolve (Llama's ``[0, -1, 128]``), so the empty rank
    raised while the other three waited in a collective (1 token at SP 2 does not show it: dynamo
    specialises a length of 1). Such a call runs the variant's graph as ATen ops on every rank of
    the group; the regions serve the longer calls. Fails (a hang, then the timeout) without it."""
    from parity import parity_worker

    results = run_in_process_world(parity_worker, 4, ["hf_llama"], [7, 3], "aot_eager", timeout=900)
    assert all(result["checked"] == 2 and result["sharded_variants"] > 0 for result in results), results


@pytest.mark.slow
def test_regions_keep_parity_on_two_ranks_with_inductor():
    _check(run_in_process_world(_parity_worker, 2, "inductor", 1e-4, 1e-5, timeout=1800))


@pytest.mark.slow
def test_packed_rows_with_regions_match_each_sequence_alone():
    """Packed rows (the varlen attention op between regions) at SP 1 and SP 2, full recompute too."""
    from test_packed_batches import _packed_worker

    variants = [(2, "none"), (1, "none"), (2, "full")]
    results = run_in_process_world(_packed_worker, 2, variants, options={"inner": "aot_eager", "regions": True},
                                   timeout=900)
    assert results[0] == ["sp=1/recompute=none/packed", "sp=2/recompute=full/packed", "sp=2/recompute=none/packed"]


@pytest.mark.slow
def test_the_documented_block_runs_as_written(fake_world, capsys):
    """docs/how-it-works.md's regional compilation block, with Inductor (its default inner compiler),
    on a one-process world of 2 ranks (collectives move no data: what is checked here is that the
    block runs and what it prints; parity is the tests above)."""
    from doc_blocks import doc_block, run_python_block

    REGION_CACHE.clear()
    case = ZOO["gpt"]
    run_python_block(doc_block("docs/how-it-works.md", "Regional compilation"), "docs/how-it-works.md",
                     model=case.build(), batch=case.make_inputs(20), loss_of=case.loss_of)
    printed = capsys.readouterr().out
    assert "compiled region(s) (shared by code across variants)" in printed
    assert REGION_CACHE.reuses > 0


@pytest.mark.slow
def test_fsdp2_training_with_regions_equals_one_process():
    """FSDP2 steps of mixed SP sizes (regions compiled under aot_eager) give the parameters one
    process gets on the global batches (tests/test_fsdp.py's check, with regions on)."""
    from test_fsdp import test_fsdp2_steps_equal_one_process_over_the_global_batches as fsdp2_steps

    fsdp2_steps(options={"inner": "aot_eager", "regions": True})


# --- one region, no world -----------------------------------------------------------------------

def _traced(function, *inputs) -> fx.GraphModule:
    return make_fx(function, tracing_mode="symbolic")(*inputs)


def _traced_tokens(function, x) -> fx.GraphModule:
    """Traced as dcp's variants are: batch and tokens symbolic, the hidden size static."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from dcp_compile.compiler.graph_capture import retrace

    mode = FakeTensorMode(shape_env=ShapeEnv())
    dynamic = [DimDynamic.DYNAMIC, DimDynamic.DYNAMIC, DimDynamic.STATIC]
    fake = mode.from_tensor(x, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dynamic,
                                                                         constraint_sizes=[None] * 3))
    return retrace(function, [fake], mode)


def test_two_spellings_of_one_view_are_one_code():
    """dynamo's trace writes ``view(x, [b, s, -1, 8])``, dcp's sharded trace ``view(x, [b, -1, 4, 8])``."""
    x = torch.randn(2, 6, 32)

    def heads_inferred(x):
        return (x.view(x.shape[0], x.shape[1], -1, 8) * 2,)

    def tokens_inferred(x):
        return (x.view(x.shape[0], -1, 4, 8) * 2,)

    first, second = _traced_tokens(heads_inferred, x), _traced_tokens(tokens_inferred, x)
    assert canonical_code(first) != canonical_code(second)
    canonical_views(first), canonical_views(second)
    first.graph.eliminate_dead_code(), second.graph.eliminate_dead_code()
    assert canonical_code(first) == canonical_code(second)


def test_a_region_is_reused_where_its_guards_hold_and_compiled_again_where_they_do_not():
    REGION_CACHE.clear()

    def scale_rows(x):
        return (x.view(x.shape[0], -1) * 3 + 1,)

    region = _traced(scale_rows, torch.randn(4, 5))
    first = torch.randn(4, 5)
    entry = compile_region(region, (first,), "aot_eager")
    torch.testing.assert_close(entry.compiled(first)[0], first * 3 + 1)
    other_length = torch.randn(7, 5)
    assert compile_region(region, (other_length,), "aot_eager") is entry  # a size symbol: reused
    assert REGION_CACHE.compiles == 1 and REGION_CACHE.reuses == 1
    transposed = torch.randn(5, 4).t()  # same sizes, other strides: the compile's stride guards fail
    again = compile_region(region, (transposed,), "aot_eager")
    assert again is not entry and REGION_CACHE.compiles == 2
    torch.testing.assert_close(again.compiled(transposed)[0], transposed * 3 + 1)


def test_a_view_with_an_offset_is_compiled_once():
    """A region input that is a view into a larger buffer (a narrowed chunk, adaLN's ``chunk(6)``) keeps
    its storage offset in the fake input, so the compile's offset guard holds at the next call."""
    REGION_CACHE.clear()

    def double(x):
        return (x * 2,)

    region = _traced(double, torch.randn(4, 5))
    for rows in (6, 9):
        base = torch.randn(rows, 5)
        view = base[2:]  # storage offset 10
        entry = compile_region(region, (view,), "aot_eager")
        torch.testing.assert_close(entry.compiled(view)[0], view * 2)
    assert REGION_CACHE.compiles == 1 and REGION_CACHE.reuses == 1



def test_an_int_input_may_be_negative():
    """OmniGen hands a region a slice end ``-n``: its fresh symbol may not be a (positive) size."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from dcp_compile.compiler.regions import fresh_inputs

    from torch._dynamo.source import ConstantSource

    shape_env = ShapeEnv()
    size = shape_env.create_symintnode(shape_env.create_symbol(15, source=ConstantSource("n")), hint=15)
    fresh = fresh_inputs([-size], (-15,))
    assert isinstance(fresh.values[0], torch.SymInt) and fresh.values[0].node.hint == -15


def test_a_region_with_a_data_dependent_size_compiles_in_its_own_shape_environment():
    """Mochi selects its text tokens with ``nonzero`` inside a region: the variant's trace bound the
    selection's size to a symbol of the variant's shape environment, which the region's own has not."""
    REGION_CACHE.clear()

    def select(x, mask):
        return (x[torch.nonzero(mask).flatten()] * 2,)

    x, mask = torch.randn(6, 4), torch.tensor([True, False, True, True, False, True])
    region = _traced(select, x, mask)
    assert any("unbacked_bindings" in node.meta for node in region.graph.nodes)
    entry = compile_region(region, (x, mask), "aot_eager")
    torch.testing.assert_close(entry.compiled(x, mask)[0], x[mask] * 2)


def test_a_region_whose_input_size_only_the_data_decides_is_compiled():
    """Mochi's region after its text selection takes a tensor whose length is an unbacked symbol of
    the variant's trace (it ran uncompiled: "an input size only the data decides"). In the region's
    own shape environment that length is a size like any other, hinted by the call and held by the
    guards; it may be 0, which a traced backed size may not."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    REGION_CACHE.clear()
    shape_env = ShapeEnv()
    with FakeTensorMode(shape_env=shape_env):
        selected = torch.empty(shape_env.create_unbacked_symint(), 4)
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = selected
    graph.output((graph.call_function(torch.ops.aten.add.Tensor, (graph.call_function(
        torch.ops.aten.mul.Tensor, (x, 2.0)), 1.0)),))
    region = fx.GraphModule(torch.nn.Module(), graph)
    for rows in (3, 5, 0):
        value = torch.randn(rows, 4)
        entry = compile_region(region, (value,), "aot_eager")
        torch.testing.assert_close(entry.compiled(value)[0], value * 2 + 1)
    assert REGION_CACHE.compiles <= 2, REGION_CACHE  # one symbolic compile (0 may take one of its own)


def test_an_empty_share_runs_the_region_uncompiled_and_compiles_nothing():
    """A rank with no token of a short sequence (3 tokens at SP 4) calls each region with empty
    inputs; compiling at size 0 failed with an integer modulo by zero on that rank only, which left
    the other three waiting in a collective (tests/test_tiled_loss_parity.py, four ranks)."""
    from dcp_compile.compiler.regions import Region, RegionKind

    REGION_CACHE.clear()
    weight = torch.randn(4, 8)
    region = Region(_traced(lambda x, w: (torch.nn.functional.linear(x.reshape(-1, 8), w),), torch.randn(2, 3, 8),
                            weight), RegionKind.COMPILED, "aot_eager", recomputed=False)
    empty = torch.randn(2, 0, 8)
    assert region.run(empty, weight)[0].shape == (0, 4)
    assert REGION_CACHE.compiles == 0 and region.uncompiled == []
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(region.run(x, weight)[0], x.reshape(-1, 8) @ weight.T)
    assert REGION_CACHE.compiles == 1


def test_a_failed_region_compile_runs_the_region_uncompiled_with_a_reason(monkeypatch):
    """Never raise where running uncompiled would do: a compile that fails (a bug in it, on one
    rank's shapes) runs that call's region as its ATen graph, says why, and is not tried again for
    calls of the same shapes."""
    import dcp_compile.compiler.regions as regions
    from dcp_compile.compiler.regions import Region, RegionKind

    attempts = []

    def failing(*args, **kwargs):
        attempts.append(1)
        raise ZeroDivisionError("integer modulo by zero")

    monkeypatch.setattr(regions, "compile_region", failing)
    region = Region(_traced(lambda x: (x * 2 + 1,), torch.randn(3, 4)), RegionKind.COMPILED, "aot_eager",
                    recomputed=False)
    x = torch.randn(3, 4)
    for _ in range(2):
        torch.testing.assert_close(region.run(x)[0], x * 2 + 1)
    assert len(attempts) == 1
    assert region.uncompiled == ["its compile failed on this call's shapes (ZeroDivisionError: integer modulo by zero)"]


def test_the_html_report_names_the_regions(fake_world):
    from dcp_compile.report.html_report import model_report_html

    REGION_CACHE.clear()
    case = ZOO["gpt"]
    compiled = torch.compile(case.build(), backend="dcp", dynamic=True, options={"inner": "aot_eager", "regions": True})
    with dcp.use(dcp.Variant(2)):
        page = model_report_html(dcp.explain(compiled, **case.make_inputs(20)))
    assert "compiled region(s) (shared by code across variants)" in page
    assert "as its first call kept them (regions)" in page  # saved bytes, counted at the first call
    assert "reused from the cache at its first call" in page  # the regions' compiles beside the variant's


def test_regions_with_the_same_code_and_other_constants_do_not_share_a_compile():
    """A lifted constant is read by attribute name; the compile bakes its value in."""
    REGION_CACHE.clear()

    def shift(x):
        return (x + torch.tensor([1.0, 2.0, 3.0]),)

    def other_shift(x):
        return (x + torch.tensor([10.0, 20.0, 30.0]),)

    x = torch.randn(4, 3)
    first, second = _traced(shift, x), _traced(other_shift, x)
    assert canonical_code(first) == canonical_code(second)  # both read self._tensor_constant0
    torch.testing.assert_close(compile_region(first, (x,), "aot_eager").compiled(x)[0], x + torch.tensor([1.0, 2.0, 3.0]))
    torch.testing.assert_close(compile_region(second, (x,), "aot_eager").compiled(x)[0],
                               x + torch.tensor([10.0, 20.0, 30.0]))
    assert REGION_CACHE.compiles == 2


def test_a_view_into_a_wider_tensor_keeps_its_traced_strides_at_another_length():
    """adaLN's ``chunk(6, dim=-1)`` hands a region ``[B, S, 32]`` views of ``[B, S, 192]``: stride
    ``192 * S``. Traced at S = 5 and called at S = 7, the traced expression still gives the call's
    stride; comparing the trace's numbers with the call's ran such regions uncompiled (Flux 2, LTX-2)."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from dcp_compile.compiler.regions import fresh_inputs

    shape_env = ShapeEnv()
    batch, tokens = (shape_env.create_symintnode(shape_env.create_symbol(hint, ConstantSource(name)), hint=hint)
                     for hint, name in ((2, "b"), (5, "s")))
    with FakeTensorMode(shape_env=shape_env):
        traced = torch.empty_strided((batch, tokens, 32), (192 * tokens, 192, 1))
    call = torch.randn(2, 7, 192)[..., :32]
    fresh = fresh_inputs([traced], (call,))
    stride = fresh.values[0].stride(0)
    assert isinstance(stride, torch.SymInt) and stride.node.hint == 192 * 7
    assert fresh.values[0].shape[1].node.expr in stride.node.expr.free_symbols  # written in the tokens' symbol


def test_a_size_symbol_the_backward_meets_only_in_a_product_is_bound_with_inductor():
    """A q/k/v projection ``linear(x).reshape(batch, -1, 3, 4, 4)`` whose batch arrives as an int and
    whose input needs no gradient: its backward is handed the matmul's ``[s0*s1, 16]`` input, and
    the int binds ``s0``, but nothing says ``s1`` alone; Inductor's backward raised ``expected [s1]
    to have been codegen-ed`` (HunyuanDiT, QwenImage, HiDream; attention then a convolution at SP 1).
    Dynamo gives a backend every symbol as an input; a region's sizes are lifted the same way, so one
    compile serves both lengths."""
    from torch._inductor.utils import fresh_cache

    from dcp_compile.compiler.regions.cache import lifted_sizes

    REGION_CACHE.clear()

    def project(x, weight, bias, batch):
        qkv = torch.nn.functional.linear(x, weight, bias).reshape(batch, -1, 3, 4, 4).permute(2, 0, 3, 1, 4)
        return qkv[0], qkv[1], qkv[2]

    weight, bias = torch.randn(48, 16, requires_grad=True), torch.randn(48, requires_grad=True)
    region = _traced(project, torch.randn(2, 5, 16), weight, bias, 2)
    with fresh_cache():  # a cached backward would skip the codegen that raised
        for tokens in (5, 7):
            x = torch.randn(2, tokens, 16)  # the model's input: no gradient, so the matmul's input is saved
            entry = compile_region(region, (x, weight, bias, 2), "inductor")
            out = torch.stack(entry.compiled(x, weight, bias, 2))
            grads = torch.autograd.grad(out.square().sum(), (weight, bias))
            expected = torch.stack(project(x, weight, bias, 2))
            torch.testing.assert_close(out, expected)
            for got, want in zip(grads, torch.autograd.grad(expected.square().sum(), (weight, bias))):
                torch.testing.assert_close(got, want)
    assert REGION_CACHE.compiles == 1 and REGION_CACHE.reuses == 1
    assert lifted_sizes([torch.empty(2, 3)]) == ()  # static sizes: nothing to lift


def test_a_region_with_a_data_dependent_size_compiles_its_backward_with_inductor():
    """Mochi's joint attention region: ``cat`` of the tokens and the ``nonzero``-selected text.
    AOTAutograd traces a region twice, each trace making its own symbol for the selection's size,
    and renames one to the other by the graph's ``unbacked_bindings``; a region had none (they named
    the variant's symbols, and were dropped), so the backward's tangent was ``[s0 + u0, ...]`` beside
    saved ``[s0 + u1, ...]`` and Inductor raised ``expected [u0] to have been codegen-ed``."""
    from torch._inductor.utils import fresh_cache

    REGION_CACHE.clear()

    def joint(x, text, mask, weight):
        selected = text[torch.nonzero(mask[0]).flatten()]
        both = torch.cat([x, selected.unsqueeze(0).expand(x.shape[0], -1, -1)], dim=1)
        return (torch.tanh(both @ weight),)

    x, text, mask = torch.randn(2, 6, 8), torch.randn(5, 8), torch.tensor([[True, False, True, True, False]])
    weight = torch.randn(8, 8, requires_grad=True)
    region = _traced(joint, x, text, mask, weight)
    with fresh_cache():
        entry = compile_region(region, (x, text, mask, weight), "inductor")
        (out,) = entry.compiled(x, text, mask, weight)
        (grad,) = torch.autograd.grad(out.square().sum(), (weight,))
    (expected,) = joint(x, text, mask, weight)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grad, torch.autograd.grad(expected.square().sum(), (weight,))[0])


def test_a_region_backward_whose_inductor_compile_fails_runs_uncompiled_with_a_reason(monkeypatch):
    """A region's backward is compiled at the first backward, long after its forward: a failure
    there (an Inductor limit on one model's sizes) runs that backward as its ATen graph, equal to
    eager, and the variant's record says why, instead of raising out of ``loss.backward()``."""
    import torch._inductor.compile_fx as compile_fx
    from torch._inductor.utils import fresh_cache

    from dcp_compile.compiler.regions import Region, RegionKind

    REGION_CACHE.clear()
    original = compile_fx.compile_fx_inner

    def failing_backward(graph, inputs, **kwargs):
        if kwargs.get("is_backward"):
            raise AssertionError("For s0 + u0, expected [u0] to have been codegen-ed.")
        return original(graph, inputs, **kwargs)

    monkeypatch.setattr(compile_fx, "compile_fx_inner", failing_backward)
    weight = torch.randn(4, 4, requires_grad=True)
    region = Region(_traced(lambda x, w: (torch.tanh(x @ w),), torch.randn(3, 4), weight), RegionKind.COMPILED,
                    "inductor", recomputed=False)
    x = torch.randn(3, 4)
    with fresh_cache():
        (out,) = region.run(x, weight)
        (grad,) = torch.autograd.grad(out.square().sum(), (weight,))
    expected = torch.tanh(x @ weight)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grad, torch.autograd.grad(expected.square().sum(), (weight,))[0])
    assert region.uncompiled == ["a region's backward runs uncompiled: its Inductor compile failed "
                                 "(AssertionError: For s0 + u0, expected [u0] to have been codegen-ed.)"]
