"""The rule registry and the one place that says which rule decides a node.

Rules are registered the way DTensor registers its op strategies: a rule module decorates a
function with ``@rule(*targets)`` (by op) or ``@stage_rule(Stage.X)`` (for a link of the chain
below that is not keyed by op), and ``sequence_dims/__init__`` imports every rule module once.
A rule is ``(node, view) -> NodeRole``: it reads the analysis through a read-only view
(``model.ReadOnlyAnalysis``, which :func:`classify` hands it) and writes nothing, not even module
state. What it finds besides the node's role (token positions, a grid region, a refusal) it
returns in ``NodeRole.findings``; the driver records them (:func:`record_findings`).

:func:`classify` is the precedence chain, top to bottom. Default deny: an op with a sequence
input and no rule is sequence-mixing, with the reason "no sharding rule".

The fallbacks the chain itself needs live here as well: :func:`pointwise` (the elementwise rule,
which other rules reuse) and :func:`sized_source` (a value created with the sequence's size).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from enum import Enum
from typing import Any, Callable

import torch
import torch.fx as fx

from dcp_compile.compiler.passes.sequence_dims.model import (
    NO_FINDINGS, AnalysisView, Findings, NodeRole, Rewrite, Role, SequenceAnalysis, SequenceDim, read_only,
)
from dcp_compile.compiler.passes.sequence_dims.symbolic import equal, shape_of, value_of

aten = torch.ops.aten
log = logging.getLogger(__name__)

Rule = Callable[[fx.Node, AnalysisView], NodeRole]
StageRule = Callable[[fx.Node, AnalysisView], "NodeRole | None"]

POINTWISE_EXTRA = {
    aten.clone.default, aten.contiguous.default, aten._to_copy.default, aten.to.dtype,
    aten.to.dtype_layout, aten.to.device, aten.to.other, aten.detach.default, aten.alias.default,
    aten.lift_fresh_copy.default, aten.dropout.default, aten.where.self, aten.where.ScalarOther,
    aten.where.ScalarSelf, aten.masked_fill.Scalar, aten.masked_fill.Tensor,
    aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
    aten.rand_like.default, aten.randn_like.default, aten.copy.default, aten.copy_.default,
    aten.native_dropout.default, aten.feature_dropout.default, aten.alpha_dropout.default,
}
VIEWS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
    aten.unflatten.int, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.squeeze.default, aten.view_as.default, aten.reshape_as.default,
}

# Arguments an op reads only for their dtype, device and layout, never their values or shape:
# factories by example (``x.new_zeros(())``) and ``a.type_as(b)``'s ``b``. What the op makes of
# them is the same on every rank whatever layout they are in, so the sharding interpreter hands
# them the layout at hand and never gathers them. The factories' rule is
# ``elementwise_rules.metadata_read_rule``; ``type_as`` keeps its own.
METADATA_READS: dict[Any, tuple[int, ...]] = {
    aten.new_zeros.default: (0,), aten.new_ones.default: (0,), aten.new_empty.default: (0,),
    aten.new_full.default: (0,), aten.new_empty_strided.default: (0,), aten.type_as.default: (1,),
}
FACTORIES_BY_EXAMPLE = (aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default,
                        aten.new_full.default, aten.new_empty_strided.default)

RULES: dict[Any, Rule] = {}


class Stage(Enum):
    """Links of the precedence chain decided by what the analysis knows of a node, not by its op."""

    GRID_EXIT = "a reshape that flattens a grid window back into tokens"
    GRID_MEMBER = "an op inside a grid window"
    ATTENTION_REGION = "the output of a hand-written attention"
    GRID_ENTRY = "a reshape that splits the tokens into a grid (may open a grid window)"
    GROUPED_MATMUL = "a grouped matmul (an MoE's experts)"
    SCHEMA_REDUCTION = "a reduction with no rule of its own, read off its schema (dim, keepdim) and shapes"
    WRITTEN_ALIAS = "a buffer (or a view of one) written in place where no rule proved the write chunk-aligned"
    DECOMPOSITION = "an op with no rule of its own, read through its decomposition"


STAGE_RULES: dict[Stage, StageRule] = {}


def rule(*targets: Any) -> Callable[[Rule], Rule]:
    """Register ``function`` as the rule of each op in ``targets``. An op has one rule: a second
    registration raises (as ``lowering`` does) instead of silently replacing the first."""

    def register(function: Rule) -> Rule:
        for target in targets:
            if target in RULES:
                raise ValueError(f"two sequence rules registered for {target}: {RULES[target].__name__} and "
                                 f"{function.__name__}")
        for target in targets:
            RULES[target] = function
        return function

    return register


def stage_rule(stage: Stage) -> Callable[[StageRule], StageRule]:
    """Register ``function`` as the rule of a link of the precedence chain."""

    def register(function: StageRule) -> StageRule:
        if stage in STAGE_RULES:
            raise ValueError(f"two rules registered for {stage}: {STAGE_RULES[stage].__name__} and {function.__name__}")
        STAGE_RULES[stage] = function
        return function

    return register


# --- helpers every rule uses ------------------------------------------------------------------

def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return [n for n in node.all_input_nodes if isinstance(value_of(n), torch.Tensor)]


def sequence_inputs(node: fx.Node, analysis: AnalysisView) -> list[fx.Node]:
    return [n for n in node.all_input_nodes if analysis.dims_of(n)]


def single(dims: tuple[SequenceDim, ...]) -> SequenceDim | None:
    return dims[0] if len(dims) == 1 else None


def mixing(reason: str, rewrite: Rewrite | None = None, aligned: tuple[fx.Node, ...] = ()) -> NodeRole:
    """Sequence-mixing: gathered with ``reason``, unless ``rewrite`` lowers it on chunks."""
    return NodeRole(Role.MIXING, (), aligned, reason, rewrite)


def argument(node: fx.Node, name: str, default: Any = None) -> Any:
    """The argument called ``name`` in the op's schema, positional or keyword, or its default."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return default
    for position, spec in enumerate(target._schema.arguments):
        if spec.name == name:
            if position < len(node.args):
                return node.args[position]
            return node.kwargs.get(name, spec.default_value if spec.has_default_value() else default)
    return default


def op_name(node: fx.Node) -> str:
    return str(node.target).replace("aten.", "").replace(".default", "")


def is_pointwise(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and (
        torch.Tag.pointwise in target.tags or target in POINTWISE_EXTRA)


def is_grouped_matmul(target: Any) -> bool:
    """``aten._grouped_mm`` and the eager fallbacks libraries register for it (transformers')."""
    name = str(target)
    return "grouped_mm" in name and "backward" not in name


# --- the fallbacks of the chain -----------------------------------------------------------------

def pointwise(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    """Elementwise (with broadcasting): the output keeps its inputs' sequence dimension."""
    out = value_of(node)
    out_value = out[0] if isinstance(out, (tuple, list)) else out
    out_rank = out_value.dim()
    mapped: dict[int, SequenceDim] = {}
    aligned = []
    for source in sequence_inputs(node, analysis):
        source_rank = value_of(source).dim()
        for seq in analysis.dims_of(source):
            out_dim = seq.dim + out_rank - source_rank
            existing = mapped.get(out_dim)
            if existing is not None and existing != seq.moved(out_dim):
                return mixing("combines sequence dimensions of different layouts")
            mapped[out_dim] = seq.moved(out_dim)
        aligned.append(source)
    if len(mapped) > 1:
        return mixing("combines two sequence positions (an outer product)")
    dims = tuple(mapped.values())
    partners: tuple[tuple[fx.Node, SequenceDim], ...] = ()
    if len(dims) == 1:
        full = full_length_operands(node, analysis, dims[0], out_rank)
        if full:
            return mixing(f"pairs the sequence chunk with {full[0].name}, the full-length result of a "
                          "sequence-mixing op whose sizes the analysis does not read as the sequence")
        partners = broadcast_partners(node, analysis, dims[0], out_rank)
        aligned += [partner for partner, _ in partners]
    elements = None
    if isinstance(out, (tuple, list)):
        elements = tuple(dims if isinstance(e, torch.Tensor) and e.dim() == out_rank else () for e in out)
    return NodeRole(Role.TOKEN_LOCAL, dims, tuple(aligned), element_dims=elements, partners=partners)


def broadcast_partners(node: fx.Node, analysis: AnalysisView, seq: SequenceDim,
                       out_rank: int) -> tuple[tuple[fx.Node, SequenceDim], ...]:
    """Operands with no sequence dimension of their own that still span the sequence.

    ``x + pos_embed`` where ``x`` is ``[B, (H//2)**2, D]`` and ``pos_embed`` a ``[1, 9, D]``
    buffer: broadcasting makes the sizes equal at run time although the expressions differ, so the
    buffer is sequence-indexed too and must be cut to the same chunk (a size of 1 broadcasts).
    The same holds for flattened tokens: a ``[B*L, 1, D]`` modulation built by
    ``repeat_interleave`` next to ``[B*L, F, D]`` activations is cut to the rows the rank holds,
    whatever its own expression, because an elementwise op pairs rows by index. The driver
    records each as a source of the dimension returned with it.
    """
    partners = []
    for source, position in _spanning_operands(node, analysis, seq, out_rank):
        role = analysis.roles.get(source)
        if role is not None and role.role not in (Role.NONE, Role.SOURCE):
            continue
        partners.append((source, seq.moved(position)))
    return tuple(partners)


def full_length_operands(node: fx.Node, analysis: AnalysisView, seq: SequenceDim, out_rank: int) -> list[fx.Node]:
    """Operands with no sequence dimension that span the sequence position as a sequence-mixing
    op left them: at full length (a gathered value whose size expression the analysis did not
    read as the sequence, e.g. ``Min(s0, 2*((s0+1)//2))`` after a fold into pairs and a slice).
    Such an operand cannot be cut like a broadcast partner, and pairing it with the rank's chunk
    is a shape error, or a silent broadcast when the chunk has one position (default deny)."""
    return [source for source, _ in _spanning_operands(node, analysis, seq, out_rank)
            if (role := analysis.roles.get(source)) is not None and role.role in (Role.MIXING, Role.ATTENTION)]


def _spanning_operands(node: fx.Node, analysis: AnalysisView, seq: SequenceDim,
                       out_rank: int) -> list[tuple[fx.Node, int]]:
    """Tensor operands without a sequence dimension whose size at the sequence position is not 1."""
    spanning = []
    for source in tensor_inputs(node):
        if analysis.dims_of(source):
            continue
        shape = shape_of(value_of(source))
        position = seq.dim - (out_rank - len(shape))
        if position < 0 or equal(shape[position], 1):
            continue
        spanning.append((source, position))
    return spanning


def record_partners(result: NodeRole, analysis: SequenceAnalysis) -> None:
    """Record the broadcast partners a rule found as sources of the sequence."""
    for partner, dim in result.partners:
        analysis.roles[partner] = NodeRole(Role.SOURCE, (dim,), reason="spans the sequence by broadcasting",
                                           token_order=None)


def record_findings(node: fx.Node, result: NodeRole, analysis: SequenceAnalysis) -> None:
    """What the driver records of ``node``'s classification besides its role: the broadcast
    partners, the positions its values hold, the grid region it enters or why it enters none.
    The one writer of these facts (the rules only report them); a refusal is the caller's."""
    record_partners(result, analysis)
    found = result.findings
    for index, positions in found.positions:
        analysis.positions[node if index is None else (node, index)] = positions
    if found.grid_region is not None:
        analysis.enter_grid(found.grid_region)
    if found.refused_grid is not None:
        analysis.refused_grids[node] = found.refused_grid
        log.info("dcp: %s gathers: no grid window: %s", node.name, found.refused_grid)


def sized_source(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    """A value whose size at some dimension is the attention length, so indexed by tokens.

    Not a parameter: its sizes come from the model's configuration, never from the data, and a
    constant attention length may equal one of them (Z-Image pads its tokens to a multiple of 32
    and has a width of 32 in the zoo). A parameter that does span the tokens (a position table
    added to the activations) is found as a broadcast partner of the value it is added to."""
    value = value_of(node)
    if not isinstance(value, torch.Tensor) or analysis.length is None or node in analysis.parameters:
        return NodeRole(Role.NONE)
    dims = tuple(SequenceDim(d) for d, size in enumerate(shape_of(value)) if equal(size, analysis.length))
    if not dims:
        return NodeRole(Role.NONE)
    if analysis.token_dims is not None:
        # A constant length that another size may equal (a width of 32 at 32 tokens): a
        # computed value holds tokens where an attention reads them from; an input, unless
        # an attention reads its tokens from another of its dimensions.
        hinted = tuple(d for d in dims if d.dim in analysis.token_dims.get(node, ()))
        if node.op not in ("placeholder", "get_attr") or (node in analysis.token_dims and hinted):
            dims = hinted
        if not dims:
            return NodeRole(Role.NONE)
    if len(dims) > 1:
        return NodeRole(Role.MIXING, (), (), "creates a value with several sequence dimensions")
    return NodeRole(Role.SOURCE, dims, (), "creates the sequence dimension")


def token_set_inputs(node: fx.Node, analysis: AnalysisView) -> NodeRole | None:
    """An op over token-set values alone (``cumsum`` of per-expert counts) stays a token-set value."""
    if node.op != "call_function":
        return None
    inputs = [n for n in node.all_input_nodes if n in analysis.roles]
    sets = [n for n in inputs if analysis.roles[n].role is Role.TOKEN_SET]
    if not sets or any(analysis.dims_of(n) for n in inputs):
        return None
    return NodeRole(Role.TOKEN_SET, (), tuple(sets), "computed from this rank's token set")


# --- the precedence chain -----------------------------------------------------------------------

def classify(node: fx.Node, analysis: AnalysisView) -> NodeRole:
    """The role of ``node``, given its inputs' roles. The first link that applies decides:

    1. an op over token-set values alone stays a token-set value;
    2. a graph input or attribute is a source where it has the sequence's size; a buffer written
       in place where no rule proved the write chunk-aligned is mixing (``Stage.WRITTEN_ALIAS``);
    3. a grid window's exit, then a grid window's member (``Stage.GRID_EXIT``, ``GRID_MEMBER``);
    4. a hand-written attention's output (``Stage.ATTENTION_REGION``); its other nodes are
       attention (they run on the rank's heads with it);
    5. a grouped matmul over the sequence (``Stage.GROUPED_MATMUL``);
    6. the op's rule (``RULES``); a reshape that splits the tokens may first open a grid window
       (``Stage.GRID_ENTRY``);
    7. an elementwise op (``pointwise``);
    8. a reduction read off its schema and shapes (``Stage.SCHEMA_REDUCTION``: token-local over
       other dimensions, whatever the op);
    9. an op torch can decompose, read through its decomposition (``Stage.DECOMPOSITION``:
       token-local only where every op of it is and none can tell a chunk from the sequence);
    10. anything else over the sequence: sequence-mixing, "no sharding rule".

    Then :func:`_settle` corrects what a rule cannot see: a value created with the sequence's
    size is a source, and a second sequence dimension appearing makes the op mixing.

    Every rule gets ``analysis`` read-only; the answer carries what the rules found
    (``NodeRole.findings``, a grid entry's refusal included when its view rule decided).
    """
    analysis = read_only(analysis)
    from_sets = token_set_inputs(node, analysis)
    if from_sets is not None:
        return from_sets
    if node.op in ("placeholder", "get_attr"):
        return sized_source(node, analysis)
    if node in analysis.written_aliases:
        return _settle(node, analysis, STAGE_RULES[Stage.WRITTEN_ALIAS](node, analysis), True)
    if node in analysis.grid_exits:
        return STAGE_RULES[Stage.GRID_EXIT](node, analysis)
    if node in analysis.grid_members:
        return STAGE_RULES[Stage.GRID_MEMBER](node, analysis)
    if node in analysis.regions:
        return STAGE_RULES[Stage.ATTENTION_REGION](node, analysis)
    if node in analysis.region_members:
        return NodeRole(Role.ATTENTION, (), (), "inside a hand-written attention (runs on the rank's heads)")
    if node.op == "output":
        return NodeRole(Role.NONE)
    has_sequence_input = bool(sequence_inputs(node, analysis))
    target = node.target
    result: NodeRole | None = None
    declined: Findings = NO_FINDINGS  # what a link found although it did not decide (a refused grid)
    if has_sequence_input and is_grouped_matmul(target):
        result = STAGE_RULES[Stage.GROUPED_MATMUL](node, analysis)
    elif has_sequence_input and target in VIEWS:
        result = STAGE_RULES[Stage.GRID_ENTRY](node, analysis)
        if result is not None and result.findings.refused_grid is not None:
            declined, result = result.findings, None  # no grid window: the view rule decides
    if result is not None:
        pass
    elif target in RULES:
        result = RULES[target](node, analysis)
    elif is_pointwise(target):
        result = pointwise(node, analysis) if has_sequence_input else NodeRole(Role.NONE)
    elif has_sequence_input and (reduction := STAGE_RULES[Stage.SCHEMA_REDUCTION](node, analysis)) is not None:
        result = reduction
    elif has_sequence_input and (decomposed := STAGE_RULES[Stage.DECOMPOSITION](node, analysis)) is not None:
        result = decomposed
    elif has_sequence_input:
        result = mixing(f"no sharding rule for {op_name(node)}")
    else:
        result = NodeRole(Role.NONE)
    settled = _settle(node, analysis, result, has_sequence_input)
    found = replace(result.findings, refused_grid=declined.refused_grid) if declined else result.findings
    return replace(settled, findings=found) if settled.findings is not found else settled


def _settle(node: fx.Node, analysis: AnalysisView, result: NodeRole, has_sequence_input: bool) -> NodeRole:
    """What the rule's answer means for the value it produces, with a reason wherever a
    sequence-indexed input is not kept on the chunk (the sharding gathers it and says why)."""
    settled = _settle_role(node, analysis, result, has_sequence_input)
    if not settled.reason and settled.role in (Role.NONE, Role.TOKEN_LOCAL, Role.MIXING):
        unaligned = [n.name for n in sequence_inputs(node, analysis) if n not in settled.aligned_inputs]
        if unaligned:
            settled.reason = (f"{op_name(node)} reads {', '.join(unaligned)} whole: its rule keeps no chunk of "
                              f"{'it' if len(unaligned) == 1 else 'them'}")
    return settled


def _settle_role(node: fx.Node, analysis: AnalysisView, result: NodeRole, has_sequence_input: bool) -> NodeRole:
    if result.role is Role.NONE or (result.role is Role.TOKEN_LOCAL and not result.sequence_dims):
        if not has_sequence_input or result.role is Role.NONE:
            created = sized_source(node, analysis)
            if created.role is not Role.NONE:
                return created
        if result.role is Role.TOKEN_LOCAL and not result.sequence_dims:
            return NodeRole(Role.NONE, partners=result.partners)
    elif result.role is Role.TOKEN_LOCAL:
        # An op that keeps one sequence dimension but creates another (an expand of a mask, or a
        # bias over keys broadcast against a [B, 1, S, S] mask as Falcon's ALiBi is) mixes.
        value = value_of(node)
        if isinstance(value, torch.Tensor) and analysis.length is not None:
            sized = {d for d, size in enumerate(shape_of(value)) if equal(size, analysis.length)}
            if analysis.token_dims is not None:
                # A constant length: another size may equal it by coincidence (heads x head size
                # = 32 = the padded token count); only a dimension an attention reads its tokens
                # from counts as a second sequence dimension.
                sized &= analysis.token_dims.get(node, set())
            if sized - {d.dim for d in result.sequence_dims}:
                return NodeRole(Role.MIXING, (), (), "creates a second sequence dimension", partners=result.partners)
    elif result.role is Role.MIXING and not result.rewrite and not result.sequence_dims:
        # A sequence-mixing op runs on the full sequence, but its output (a cumsum of a mask, a
        # gathered unpatchify's neighbour) may still be indexed by it: record where, so that
        # token-local consumers take their chunk of it instead of broadcasting the full value.
        created = sized_source(node, analysis)
        if created.role is Role.SOURCE:
            result.sequence_dims = created.sequence_dims
        else:
            result.sequence_dims = flattened_tokens_kept(node, analysis)
    return result


def flattened_tokens_kept(node: fx.Node, analysis: AnalysisView) -> tuple[SequenceDim, ...]:
    """The one flattened token dimension (``[B*S, E]``) a gathered op's output keeps from its
    inputs: a ``cumsum`` over the flattened tokens of an MoE router is indexed by them as its input
    is, and its token-local consumers must take their chunk of it, as they would of a dimension of
    the sequence's own size (see :func:`sized_source`)."""
    value = value_of(node)
    if not isinstance(value, torch.Tensor):
        return ()
    flattened = {seq for source in sequence_inputs(node, analysis) for seq in analysis.dims_of(source)
                 if not seq.unflattened}
    sizes = {seq: analysis.length * seq.outer * seq.inner for seq in flattened}
    found = [seq.moved(d) for d, size in enumerate(shape_of(value)) for seq in flattened if equal(size, sizes[seq])]
    return (found[0],) if len(found) == 1 else ()
