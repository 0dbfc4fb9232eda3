"""The interface between the sharding interpreter and its lowerings (issue 35, item 2).

A lowering gets a ``LoweringContext``, a read-only view of the interpreter for one node, and
returns a ``Lowered`` record; the interpreter alone writes its value maps and its record. These
tests hold that contract: the context takes no assignment and exposes no map, every lowering
takes the context alone and returns the record on real compiles (attention, a CLS position,
replicated queries, views and slices on chunks, scalar reads, grid windows, a returned cache
slice, per-sample selections), and a lowering that returns a bare value is refused.
"""

from __future__ import annotations

import inspect
from collections import Counter
from typing import Any

import pytest
import torch
import torch.fx as fx

import dcp_compile as dcp
from dcp_compile.compiler.passes.sequence_dims import Rewrite, Role
from dcp_compile.compiler.passes.shard_sequence import (
    LOWERINGS, Layout, Lowered, LoweringContext, OpForm, Path, ShardingInterpreter,
)
from dcp_compile.compiler.passes.shard_sequence.lowerings import FORM_RULES
from dcp_compile.variant import Variant
from model_zoo import ZOO
from test_batch_selections import PerSampleTail
from test_output_tails import AttentionWithWindowCache

# What the interpreter keeps and a lowering must never reach: its maps and its record.
INTERPRETER_STATE = ("full", "chunk", "gathers", "rewrites", "grid_windows", "sharded_sites", "rank_local_sites",
                     "replicated_sites", "unsharded_sites", "local_fallbacks", "write_groups", "unsummed",
                     "refused_writes", "symbolic")


class _Analysis:
    roles: dict = {}


class _Interpreter:
    """Just what the context's constructor reads."""

    analysis = _Analysis()
    full: dict = {}
    chunk: dict = {}
    scalar_values: dict = {}


def _context() -> LoweringContext:
    graph = fx.Graph()
    node = graph.placeholder("x")
    return LoweringContext(_Interpreter(), node, Path.FULL)  # type: ignore[arg-type]


def test_the_context_takes_no_assignment_and_exposes_no_map():
    context = _context()
    for name in (*INTERPRETER_STATE, "node", "role", "value", "anything"):
        with pytest.raises(AttributeError):
            setattr(context, name, {})
    with pytest.raises(AttributeError):
        del context.node
    public = {name for name in dir(context) if not name.startswith("_")}
    assert not public & set(INTERPRETER_STATE), public & set(INTERPRETER_STATE)
    with pytest.raises(TypeError):
        context.scalar_values[context.node] = 1.0  # a read-only mapping


def test_the_record_is_frozen():
    lowered = Lowered(torch.zeros(1), Layout.CHUNK)
    with pytest.raises(AttributeError):
        lowered.value = None  # type: ignore[misc]


def test_every_lowering_takes_the_context_alone():
    assert set(LOWERINGS) == set(Rewrite) | {Role.ATTENTION} | set(OpForm)
    for key, function in LOWERINGS.items():
        (parameter,) = inspect.signature(function).parameters.values()
        assert parameter.annotation in ("LoweringContext", LoweringContext), (key, parameter)


def test_every_op_form_applies_on_one_path():
    assert Counter(rule.form for rule in FORM_RULES) == Counter(set(OpForm))


def _compile(model: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager", "sp_size": 2})
    with dcp.use(Variant(2)):
        record = dcp.explain(compiled, *args, **kwargs)
    for variant in record.variant_records():
        assert variant.fallback_reason is None, variant.fallback_reason


def test_lowerings_return_the_record_on_real_compiles(fake_world, monkeypatch):
    seen: Counter = Counter()

    def recording(key: Any, function: Any) -> Any:
        def lower(context: LoweringContext) -> Lowered:
            assert isinstance(context, LoweringContext)
            lowered = function(context)
            assert isinstance(lowered, Lowered), (key, type(lowered))
            assert isinstance(lowered.layout, Layout)
            if context.path is not Path.CHUNK:
                assert lowered.layout is Layout.FULL, key  # off the chunks, every value is full
            assert lowered.output_gather == (key is OpForm.GATHER_FOR_OUTPUT), key
            seen[key] += 1
            return lowered

        return lower

    for key, function in list(LOWERINGS.items()):
        monkeypatch.setitem(LOWERINGS, key, recording(key, function))
    for name in ("vit", "two_stream", "grid_conv_video"):
        _compile(ZOO[name].build(), **ZOO[name].make_inputs(12))
    torch.manual_seed(0)
    _compile(AttentionWithWindowCache(), torch.randn(2, 9, 16))  # a returned slice of the keys
    _compile(PerSampleTail(), torch.randn(3, 11, 16))  # per-sample selections of one value
    expected = {Role.ATTENTION, Rewrite.SELECT_POSITION, Rewrite.REPLICATED_QUERY_ATTENTION, Rewrite.ENTER_GRID_WINDOW,
                Rewrite.LEAVE_GRID_WINDOW, OpForm.VIEW_ON_CHUNK, OpForm.SLICE_ON_CHUNK, OpForm.SCALAR_READ,
                OpForm.WHOLE_ATTENTION, OpForm.VIEW_ON_WINDOW, OpForm.GATHER_FOR_OUTPUT,
                OpForm.SELECTION_OF_GATHERED_SOURCE}
    assert expected <= set(seen), expected - set(seen)


def test_a_lowering_that_returns_a_bare_value_is_refused(monkeypatch):
    monkeypatch.setitem(LOWERINGS, Role.ATTENTION, lambda context: torch.zeros(1))
    with pytest.raises(TypeError, match="not Lowered"):
        ShardingInterpreter._lower(None, Role.ATTENTION, _context())  # type: ignore[arg-type]
