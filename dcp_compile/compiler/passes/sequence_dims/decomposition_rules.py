"""Ops with no rule of their own, read through their decomposition.

The pre-dispatch graph keeps composite ops whole (``isclose``, ``prelu``, ``logsigmoid``,
``cosine_similarity``, ``hsplit``, ``movedim``) and some ops torch tags neither pointwise nor
reduction (``rsub.Tensor``, ``hardswish``, ``glu``), although what they compute is a handful of
ops the rules know. One rule for all of them: trace the op's decomposition (its
CompositeImplicitAutograd kernel, else ``torch._decomp``'s entry) on the node's shapes, with the
sequence dimension as a fresh symbol, functionalized, and classify every op of it with the same
rules (recursively, a few levels deep). The op is token-local only when every op of its
decomposition is, and nothing in it could tell the rank's chunk from the whole sequence, since
the op itself, not its decomposition, runs on the chunk:

* no op of it creates a value of the sequence's size (an ``arange`` over the positions: ``tril``'s
  mask, ``roll``'s indices) or reads the length as a number rather than as a view's size;
* it writes none of its inputs in place and draws no random numbers;
* it takes no symbolic argument, and every operand that spans the sequence is one the analysis
  knows as sequence-indexed, with a plain (unflattened, unjoined) sequence dimension.

Anything else stays sequence-mixing (default deny), with the reason found inside the
decomposition. A wrong "token-local" here would be silently wrong, so the fuzzer and the OpInfo
sweep check this rule like any other.
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from dcp_compile.compiler.passes.sequence_dims.model import (
    AnalysisView, NodeRole, Role, SequenceAnalysis, fx_to_networkx,
)
from dcp_compile.compiler.passes.sequence_dims.registry import (
    VIEWS, Stage, classify, op_name, record_findings, sequence_inputs, stage_rule,
)
from dcp_compile.compiler.passes.sequence_dims.symbolic import equal, expression, shape_of, traced_size, value_of

aten = torch.ops.aten
log = logging.getLogger(__name__)

MAX_DEPTH = 3  # decompositions of decompositions: isclose -> its ops; prelu -> _prelu_kernel -> where
SIZE_USES = VIEWS | {aten.expand.default, aten.sym_size.int}  # a length read as a view's size is consistent on a chunk


class Refused(Exception):
    """Why an op is not proven token-local by its decomposition."""


def decomposition_of(target: Any) -> Callable[..., Any] | None:
    """What the op computes in terms of other ops, or None where torch has no decomposition."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    if torch._C._dispatch_has_kernel_for_dispatch_key(target.name(), "CompositeImplicitAutograd"):
        return target  # traced below the autograd key, its composite kernel runs op by op
    return torch._decomp.decomposition_table.get(target)


@stage_rule(Stage.DECOMPOSITION)
def decomposition_rule(node: fx.Node, analysis: AnalysisView) -> NodeRole | None:
    """Token-local where the op's decomposition proves it; None where the op has no decomposition;
    sequence-mixing (with what the decomposition does) otherwise. The analysis of a
    decomposition is nested one level deeper than ``analysis``; past ``MAX_DEPTH`` none is read.
    What a decomposition proves is memoised on ``analysis.decompositions``, keyed by all it reads
    (the depth included: a deeper read may stop sooner)."""
    function = decomposition_of(node.target)
    if function is None or analysis.depth >= MAX_DEPTH:
        return None
    try:
        key = (analysis.depth, _cache_key(node, analysis))
    except Refused as why:
        return NodeRole(Role.MIXING, (), (), f"no sharding rule for {op_name(node)} ({why})")
    found = analysis.decompositions.get(key, lambda: _decompose(node, analysis, function))
    if isinstance(found, str):
        return NodeRole(Role.MIXING, (), (), f"no sharding rule for {op_name(node)}; its decomposition {found}")
    aligned = tuple(sequence_inputs(node, analysis))
    return NodeRole(Role.TOKEN_LOCAL, found.sequence_dims, aligned, found.reason, element_dims=found.element_dims)


def _decompose(node: fx.Node, analysis: AnalysisView, function: Callable[..., Any]) -> "NodeRole | str":
    """The role the decomposition proves, or why it proves none."""
    try:
        return _classify_decomposition(node, analysis, function)
    except Refused as why:
        return str(why)
    except Exception as error:  # noqa: BLE001 - a decomposition that does not trace proves nothing
        log.debug("dcp: decomposition of %s does not trace: %s", node.target, error, exc_info=True)
        return f"does not trace ({type(error).__name__})"


def _operands(node: fx.Node) -> tuple[list[Any], Any]:
    return tree_flatten((tuple(node.args), dict(node.kwargs)))


def _cache_key(node: fx.Node, analysis: AnalysisView) -> Any:
    """The op, its literal arguments, and per tensor operand its shape (with ``L`` at its sequence
    dimension), dtype and device: all the classification depends on."""
    leaves, spec = _operands(node)
    key: list[Any] = [node.target, str(spec)]
    for leaf in leaves:
        if not isinstance(leaf, fx.Node):
            key.append(repr(leaf))
            continue
        value = value_of(leaf)
        if not isinstance(value, torch.Tensor):
            raise Refused("it takes a symbolic argument")
        dims = analysis.dims_of(leaf)
        if any(not seq.plain for seq in dims):
            raise Refused("an operand's sequence dimension is flattened or joint")
        sequence = {seq.dim for seq in dims}
        shape = shape_of(value)
        if any(equal(size, analysis.length) for d, size in enumerate(shape) if d not in sequence):
            raise Refused("an operand spans the sequence at a dimension not known as sequence-indexed")
        key.append((tuple("L" if d in sequence else traced_size(value.shape[d]) for d in range(value.dim())),
                     value.dtype, value.device.type))
    return tuple(key)


def _fake_operands(node: fx.Node, analysis: AnalysisView, fake_mode: Any, length: Any) -> tuple[list[Any], list[int], Any]:
    """The node's operands as fresh fake tensors, ``length`` at every sequence dimension."""
    leaves, spec = _operands(node)
    fakes, positions = list(leaves), []
    with fake_mode:
        for position, leaf in enumerate(leaves):
            if not isinstance(leaf, fx.Node):
                continue
            value = value_of(leaf)
            sequence = {seq.dim for seq in analysis.dims_of(leaf)}
            sizes = [length if d in sequence else traced_size(size) for d, size in enumerate(value.shape)]
            fakes[position] = torch.empty(sizes, dtype=value.dtype, device=value.device)
            positions.append(position)
    return fakes, positions, spec


def _classify_decomposition(node: fx.Node, analysis: AnalysisView, function: Callable[..., Any]) -> NodeRole:
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    shape_env = ShapeEnv()
    fake_mode = FakeTensorMode(shape_env=shape_env)
    hint = 37  # no sample size: the decomposition must not take a size-1 or size-0 path
    source = ConstantSource("dcp_decomposed_sequence")
    symbol = shape_env.create_symbol(hint, source=source, dynamic_dim=DimDynamic.DYNAMIC)
    length = shape_env.create_symintnode(symbol, hint=hint, source=source)
    fakes, positions, spec = _fake_operands(node, analysis, fake_mode, length)

    def run(*tensors: torch.Tensor) -> Any:
        leaves = list(fakes)
        for position, tensor in zip(positions, tensors):
            leaves[position] = tensor
        args, kwargs = tree_unflatten(leaves, spec)
        result = function(*args, **kwargs)
        # A flat tuple (a decomposition may return a named tuple where the op returns a plain one)
        return tuple(tree_flatten(result)[0]) if isinstance(result, (tuple, list)) else result

    with fake_mode:
        traced = make_fx(torch.func.functionalize(run), record_module_stack=False)(*[fakes[p] for p in positions])
    placeholders = list(traced.graph.find_nodes(op="placeholder"))
    inner = SequenceAnalysis(length=expression(length), graph=fx_to_networkx(traced.graph), depth=analysis.depth + 1,
                             decompositions=analysis.decompositions)
    for placeholder, position in zip(placeholders, positions):
        dims = analysis.dims_of(_operands(node)[0][position])
        inner.roles[placeholder] = NodeRole(Role.SOURCE, dims) if dims else NodeRole(Role.NONE)
    for current in traced.graph.nodes:
        if current.op == "call_function":
            _check(current, inner, placeholders)
            role = classify(current, inner)
            if role.findings.refusal is not None:
                raise Refused(f"refuses what it assumed at {op_name(current)}: {role.findings.refusal.reason}")
            _check_role(current, role)
            record_findings(current, role, inner)
            inner.roles[current] = role
    return _result(node, traced, inner)


def _reads_length(current: fx.Node, length: Any) -> bool:
    value = value_of(current)
    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)) and bool(
        value.node.expr.free_symbols & length.free_symbols)


def _check(current: fx.Node, inner: SequenceAnalysis, placeholders: list[fx.Node]) -> None:
    """Refuse what would tell the chunk from the whole sequence, before the rules see the op."""
    target = current.target
    if isinstance(target, torch._ops.OpOverload):
        if torch.Tag.nondeterministic_seeded in target.tags:
            raise Refused(f"draws random numbers ({op_name(current)})")
        if target._schema.is_mutable and any(arg in placeholders for arg in current.args[:1]):
            raise Refused(f"writes an input in place ({op_name(current)})")
    if _reads_length(current, inner.length):
        # A length read only as a view's size is the chunk's own size on the rank, consistently;
        # read as a number (``arange(n)``, ``x / n``, a slice bound) it would be the chunk's.
        stack, seen = [current], set()
        while stack:
            for user in stack.pop().users:
                if user in seen:
                    continue
                seen.add(user)
                if user.target in SIZE_USES:
                    continue
                if _reads_length(user, inner.length) and user.target in (operator.mul, operator.floordiv):
                    stack.append(user)
                    continue
                raise Refused(f"reads the sequence length as a number ({op_name(user)})")


def _check_role(current: fx.Node, role: NodeRole) -> None:
    if role.role in (Role.MIXING, Role.ATTENTION, Role.TOKEN_SET):
        raise Refused(f"has {op_name(current)}: {role.reason or role.role.value}")
    if role.role is Role.SOURCE:
        raise Refused(f"creates a value of the sequence's size ({op_name(current)}: positions of its own)")
    if role.partners:
        raise Refused(f"broadcasts a value that spans the sequence ({op_name(current)})")
    if isinstance(role.token_order, fx.Node):
        raise Refused(f"permutes the tokens ({op_name(current)})")


def _result(node: fx.Node, traced: fx.GraphModule, inner: SequenceAnalysis) -> NodeRole:
    """The op's role from its decomposition's outputs: each keeps exactly the dimensions of the
    sequence's size that the rules found in it."""
    (output,) = traced.graph.find_nodes(op="output")
    results = output.args[0]
    single_output = not isinstance(value_of(node), (tuple, list))
    outputs = [results] if single_output and not isinstance(results, (tuple, list)) else list(results)
    elements = []
    for result in outputs:
        value = value_of(result) if isinstance(result, fx.Node) else None
        if not isinstance(value, torch.Tensor):
            elements.append(())
            continue
        dims = inner.dims_of(result)
        sized = {d for d, size in enumerate(shape_of(value)) if size.free_symbols & inner.length.free_symbols}
        if sized != {seq.dim for seq in dims} or any(not equal(shape_of(value)[seq.dim],
                                                                inner.length * seq.outer * seq.inner) for seq in dims):
            raise Refused("returns a value whose sequence dimension the rules cannot follow")
        elements.append(dims)
    if not any(elements):
        raise Refused("returns no sequence-indexed value")
    reason = "token-local by its decomposition"
    if single_output:
        if len(elements) != 1:
            raise Refused("returns more values than the op")
        return NodeRole(Role.TOKEN_LOCAL, elements[0], reason=reason)
    return NodeRole(Role.TOKEN_LOCAL, elements[0], reason=reason, element_dims=tuple(elements))
