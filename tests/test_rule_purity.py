"""The sequence rules are registrations of pure functions: one rule per op (a second registration
raises, as a second lowering does), and a rule only reads the analysis (issue 35, item 1)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import dcp_compile.compiler.passes
from dcp_compile.compiler.passes.sequence_dims.inplace_writes import unproven_writes
from dcp_compile.compiler.passes.sequence_dims.model import (
    Decompositions, GridRegion, NodeRole, ReadOnlyAnalysis, Refusal, RefusalKind, Rewrite, Role, SequenceAnalysis, SequenceDim,
    fx_to_networkx, read_only,
)
from dcp_compile.compiler.passes.sequence_dims.propagation import attempt
from dcp_compile.compiler.passes.sequence_dims.registry import RULES, STAGE_RULES, Stage, classify, rule, stage_rule
from dcp_compile.compiler.passes.sequence_dims.symbolic import expression

aten = torch.ops.aten


def test_a_second_rule_for_an_op_raises_and_keeps_the_first():
    first = RULES[aten.amax.default]
    with pytest.raises(ValueError, match="two sequence rules registered for aten.amax.default"):
        rule(aten.amax.default)(lambda node, analysis: None)
    assert RULES[aten.amax.default] is first


def test_a_rule_registration_that_collides_registers_none_of_its_ops():
    unused = aten.cummax.default  # no rule of its own (see test_registry)
    assert unused not in RULES
    with pytest.raises(ValueError):
        rule(unused, aten.amax.default)(lambda node, analysis: None)
    assert unused not in RULES


def test_a_second_rule_for_a_stage_raises():
    first = STAGE_RULES[Stage.GRID_ENTRY]
    with pytest.raises(ValueError, match="two rules registered"):
        stage_rule(Stage.GRID_ENTRY)(lambda node, analysis: None)
    assert STAGE_RULES[Stage.GRID_ENTRY] is first


def test_amax_has_the_reduction_rule():
    """``amax.default`` was registered twice (the full-reduction rule won, and handed it straight
    back to the reduction rule): it is one registration now."""
    assert RULES[aten.amax.default].__name__ == "reduction_rule"


# --- no module state under compiler/passes ------------------------------------------------------

PASSES = Path(dcp_compile.compiler.passes.__file__).resolve().parent
_CACHES = {
    ("use_varlen_attention.py", "_choose"): "the packed-attention kernel choice per call shape (runtime dispatch, "
                                            "a pure function of its key; not analysis state)",
}
_CACHES = {"lru_cache", "cache", "cached_property"}
_CONTAINERS = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque"}


def _module_state(path: Path) -> list[str]:
    """``global`` statements, module-level caches, and module-level mutable containers that are not
    upper-case tables (registries filled at import and constant op sets are named in capitals)."""
    tree = ast.parse(path.read_text())
    found = [f"global {', '.join(node.names)} (line {node.lineno})" for node in ast.walk(tree)
             if isinstance(node, ast.Global)]
    for statement in tree.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for decorator in statement.decorator_list:
                name = decorator.func if isinstance(decorator, ast.Call) else decorator
                name = name.attr if isinstance(name, ast.Attribute) else getattr(name, "id", "")
                if name in _CACHES:
                    found.append(f"@{name} on {statement.name} (line {statement.lineno})")
        targets, value = [], None
        if isinstance(statement, ast.Assign):
            targets, value = statement.targets, statement.value
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            targets, value = [statement.target], statement.value
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
            isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", "")) in _CONTAINERS)
        for target in targets:
            if mutable and isinstance(target, ast.Name) and target.id != "__all__" and not target.id.lstrip("_").isupper():
                found.append(f"{target.id} = a mutable {type(value).__name__} (line {statement.lineno})")
    return found


def test_no_module_level_caches_or_counters_under_passes():
    """Analysis state lives on the analysis: a module-global cache (the decomposition rule's
    ``_cache``) outlives the graph it was filled for, and a global counter (its ``_depth``) breaks
    the moment two analyses interleave. The one runtime cache a pass kept (the packed-attention
    kernel choice per call shape) lives with the kernel choice in ``kernels/attention_choice.py``."""
    found = {str(path.relative_to(PASSES)): state for path in sorted(PASSES.rglob("*.py"))
             if (state := _module_state(path))}
    assert not found, found


def test_the_decomposition_memo_belongs_to_one_analysis():
    from dcp_compile.compiler.passes.sequence_dims import decomposition_rules
    from dcp_compile.compiler.passes.sequence_dims.model import SequenceAnalysis

    assert not hasattr(decomposition_rules, "_cache") and not hasattr(decomposition_rules, "_depth")
    first, second = SequenceAnalysis(length=None), SequenceAnalysis(length=None)
    assert first.decompositions is not second.decompositions and first.depth == 0


# --- rules read the analysis through a read-only view ------------------------------------------

def _trace(function, *inputs: torch.Tensor) -> fx.GraphModule:
    return make_fx(function, tracing_mode="symbolic", pre_dispatch=True)(*inputs)


def _size(gm: fx.GraphModule, index: int, dim: int) -> Any:
    return expression(list(gm.graph.find_nodes(op="placeholder"))[index].meta["val"].shape[dim])


def _nodes(gm: fx.GraphModule, target: Any) -> list[fx.Node]:
    return list(gm.graph.find_nodes(op="call_function", target=target))


def mix_ffn(image: torch.Tensor) -> torch.Tensor:
    """Sana's Mix-FFN: tokens to a grid, a 3x3 depthwise conv, back to tokens (a grid region)."""
    b, h, w, c = image.shape
    grid = image.flatten(1, 2).unflatten(1, (h, w)).permute(0, 3, 1, 2)
    return F.conv2d(grid, torch.ones(c, 1, 3, 3), padding=1, groups=c).flatten(2).transpose(1, 2)


def two_grids(image: torch.Tensor) -> torch.Tensor:
    """Two grids combined: both entries refused while their regions are discovered."""
    b, h, w, c = image.shape
    tokens = image.flatten(1, 2)
    first = F.conv2d(tokens.unflatten(1, (h, w)).permute(0, 3, 1, 2), torch.ones(c, 1, 3, 3), padding=1, groups=c)
    second = (tokens * 2).unflatten(1, (h, w)).permute(0, 3, 1, 2)
    return (first + second).flatten(2).transpose(1, 2)


def moe_dispatch(x: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
    """Top-2 (token, expert) pairs sorted by expert, rows gathered and added back (token_sets)."""
    tokens = x.flatten(0, 1)
    experts = (tokens @ router).topk(2, dim=-1).indices.flatten()
    order = experts.argsort(stable=True)
    token_of_row = order // 2
    rows = tokens.index_select(0, token_of_row) * 2
    return tokens.new_zeros(tokens.shape).index_add_(0, token_of_row, rows)


def sorted_with_inverse(x: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
    """A local sort, its values and indices, and the inverse permutation back to token order."""
    tokens = x.flatten(0, 1)
    _, order = (tokens @ router).argmax(-1).sort(stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.shape[0])
    return tokens[order][inverse]


def capacity(x: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
    """A capacity read off a local sort's counts: the sort is refused (runs on gathered tokens)."""
    tokens = x.flatten(0, 1)
    ids, order = (tokens @ router).argmax(-1).sort(stable=True)
    counts = torch.histc(ids.float(), bins=4, min=0, max=3).long()
    place = torch.arange(ids.shape[0]) - (counts.cumsum(0) - counts)[ids]
    rows = tokens.index_select(0, order) * (place < 3)[:, None]
    return tokens.new_zeros(tokens.shape).index_add_(0, order, rows)


def decomposed_and_written(x: torch.Tensor) -> torch.Tensor:
    """Ops read through their decomposition, and a buffer written in place by slice assignment."""
    n = x.shape[1]
    out = torch.full_like(F.logsigmoid(x) + F.glu(x, dim=-1).repeat(1, 1, 2), 0.5)
    out[:, : n - 1] = x[:, 1:]
    return out + torch.cat([x[:, :1], x], dim=1)[:, 1:]


def every_rule(x, ids, w, image):
    """One op (at least) of every registered rule's ops but the custom autograd.Function's."""
    b, s, d = x.shape
    q = x.view(b, s, 2, d // 2).transpose(1, 2)
    a = F.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape(b, s, d)
    h = F.linear(a, w) + torch.addmm(torch.zeros(d), x.reshape(-1, d), w).view(b, s, d)
    h = F.layer_norm(h, (d,)) + F.embedding(ids, w).type_as(h)
    h = F.pad(h, (0, 0, 1, 1))[:, 1:-1].expand(b, s, d)
    p, r = h.split([d // 2, d // 2], dim=-1)
    h = torch.cat([p, r], -1).flip([-1]).repeat(1, 1, 2)[..., :d] + F.one_hot(ids, d).float()
    h = h.repeat_interleave(2, dim=-1)[..., ::2] + torch.outer(torch.ones(d), torch.ones(d))[0]
    t = torch.view_as_real(torch.view_as_complex(h.reshape(b, s, d // 2, 2))).flatten(-2)
    loss = F.cross_entropy(t.reshape(-1, d), ids.reshape(-1))
    h, _ = torch.broadcast_tensors(h, torch.zeros(1, 1, d))
    c = F.conv2d(image, torch.ones(4, 4, 3, 3), padding=1)
    c = F.avg_pool2d(F.group_norm(torch.ops.aten.convolution(c, torch.ones(4, 4, 1, 1), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1), 2), 1)
    return h.select(1, 0).sum() + loss + t.sum() + c.sum() + h.new_zeros(()) + h.zero_().sum()


@pytest.fixture(scope="module")
def programs() -> list[tuple[str, fx.GraphModule, Any]]:
    """The programs, traced once for the module's tests."""
    programs = []
    for name, function, inputs, length in [
        ("mix_ffn", mix_ffn, (torch.randn(2, 3, 4, 8),), lambda gm: _size(gm, 0, 1) * _size(gm, 0, 2)),
        ("two_grids", two_grids, (torch.randn(2, 3, 4, 8),), lambda gm: _size(gm, 0, 1) * _size(gm, 0, 2)),
        ("moe_dispatch", moe_dispatch, (torch.randn(2, 7, 8), torch.randn(8, 4)), lambda gm: _size(gm, 0, 1)),
        ("sorted_with_inverse", sorted_with_inverse, (torch.randn(2, 7, 8), torch.randn(8, 4)),
         lambda gm: _size(gm, 0, 1)),
        ("capacity", capacity, (torch.randn(2, 7, 8), torch.randn(8, 4)), lambda gm: _size(gm, 0, 1)),
        ("decomposed_and_written", decomposed_and_written, (torch.randn(2, 7, 8),), lambda gm: _size(gm, 0, 1)),
        ("every_rule", every_rule, (torch.randn(2, 7, 8), torch.randint(0, 8, (2, 7)), torch.randn(8, 8),
                                    torch.randn(2, 4, 5, 6)), lambda gm: _size(gm, 0, 1)),
    ]:
        gm = _trace(function, *inputs)
        programs.append((name, gm, length(gm)))
    return programs


def _analyse(gm: fx.GraphModule, length: Any) -> tuple[SequenceAnalysis, list[Refusal]]:
    """The driver's loop over attempts (``analyze_sequence_dims`` with ``length`` given)."""
    refused: dict[RefusalKind, dict[fx.Node, str]] = {kind: {} for kind in RefusalKind}
    refusals, written, decompositions = [], {}, Decompositions()
    while True:
        analysis = SequenceAnalysis(length=length, graph=fx_to_networkx(gm.graph), written_aliases=dict(written),
                                    refused_grids=dict(refused[RefusalKind.GRID]),
                                    refused_dispatches=dict(refused[RefusalKind.DISPATCH]),
                                    decompositions=decompositions)
        refusal = attempt([], analysis)
        if refusal is not None:
            refusals.append(refusal)
            refused[refusal.kind][refusal.node] = refusal.reason
            continue
        forced = unproven_writes(analysis, gm.graph)
        if not forced:
            return analysis, refusals
        written.update(forced)


def _snapshot(analysis: SequenceAnalysis) -> dict[str, str]:
    """Every fact of the analysis, as text (the decomposition memo is a cache, not a fact)."""
    return {f.name: repr(getattr(analysis, f.name)) for f in dataclasses.fields(analysis) if f.name != "decompositions"}


def test_the_view_refuses_every_write():
    analysis = SequenceAnalysis(length=sympy.Symbol("L"))
    view = read_only(analysis)
    with pytest.raises(AttributeError, match="never sets 'length'"):
        view.length = 3
    with pytest.raises(AttributeError):
        view.positions = {}
    with pytest.raises(AttributeError):
        del view.roles
    for name in ("roles", "positions", "grid_regions", "grid_members", "grid_exits", "refused_grids",
                 "written_aliases", "refused_dispatches", "regions", "region_members"):
        with pytest.raises(TypeError):
            getattr(view, name)["x"] = 1
    assert read_only(view) is view and view.length == analysis.length
    assert _snapshot(analysis) == _snapshot(SequenceAnalysis(length=sympy.Symbol("L")))


def test_every_rule_gets_the_read_only_view(monkeypatch, programs):
    """Wrap every registered rule: across the programs (grids found and refused, a local dispatch
    and its refusal, decompositions, in-place writes) each call gets a ``ReadOnlyAnalysis``."""
    seen: dict[str, int] = {}

    def spy(function):
        def checked(node, analysis):
            assert isinstance(analysis, ReadOnlyAnalysis), (function.__name__, type(analysis))
            seen[function.__name__] = seen.get(function.__name__, 0) + 1
            return function(node, analysis)
        return checked

    for target, function in list(RULES.items()):
        monkeypatch.setitem(RULES, target, spy(function))
    for stage, function in list(STAGE_RULES.items()):
        monkeypatch.setitem(STAGE_RULES, stage, spy(function))
    refusals, refused_grids = [], {}
    for _, gm, length in programs:
        analysis, found = _analyse(gm, length)
        refusals += found
        refused_grids.update(analysis.refused_grids)
    assert RefusalKind.DISPATCH in {refusal.kind for refusal in refusals} and refused_grids
    for name in ("grid_entry_rule", "member_rule", "exit_rule", "select_along_rule", "position_of_token",
                 "getitem_rule", "inverse_permutation_rule", "rows_added_back_rule", "decomposition_rule",
                 "written_alias_rule", "view_rule", "fill_rule" if "fill_rule" in seen else "view_rule"):
        assert seen.get(name), f"the programs never reach {name}: {sorted(seen)}"


def test_no_rule_writes_the_analysis(programs):
    """Call ``classify`` and the op's own rule on every node of the analysed programs: every fact
    of the analysis is as before (what a rule finds comes back in its role's findings)."""
    found_positions = found_grid = 0
    for name, gm, length in programs:
        analysis, _ = _analyse(gm, length)
        before = _snapshot(analysis)
        for current in gm.graph.nodes:
            if current.op != "call_function":
                continue
            role = classify(current, analysis)
            found_positions += bool(role.findings.positions)
            found_grid += role.findings.grid_region is not None
            if current.target in RULES:
                RULES[current.target](current, read_only(analysis))
            assert _snapshot(analysis) == before, f"{name}: classifying {current.name} wrote the analysis"
    assert found_positions and found_grid  # the programs exercise the rules that used to write


def test_a_rule_is_called_with_no_analysis_setup():
    """No driver, no propagation: the roles a rule reads, given directly. The grid entry and a
    local sort report the region and the positions they found; the analysis stays empty."""
    gm = _trace(mix_ffn, torch.randn(2, 3, 4, 8))
    flatten = _nodes(gm, aten.flatten.using_ints)[0]  # image.flatten(1, 2): the tokens
    (entry,) = _nodes(gm, aten.unflatten.int)
    analysis = SequenceAnalysis(length=_size(gm, 0, 1) * _size(gm, 0, 2), graph=fx_to_networkx(gm.graph),
                                roles={flatten: NodeRole(Role.TOKEN_LOCAL, (SequenceDim(1),), token_order=None)})
    role = STAGE_RULES[Stage.GRID_ENTRY](entry, read_only(analysis))
    assert role.rewrite is Rewrite.ENTER_GRID_WINDOW and role.findings.grid_region.entry is entry
    assert not analysis.grid_regions and not analysis.grid_members and not analysis.refused_grids

    gm = _trace(lambda ids: ids.argsort(stable=True), torch.randint(0, 4, (14,)))
    (ids,) = gm.graph.find_nodes(op="placeholder")
    (argsort,) = _nodes(gm, aten.argsort.stable)
    analysis = SequenceAnalysis(length=_size(gm, 0, 0),
                                roles={ids: NodeRole(Role.SOURCE, (SequenceDim(0),), token_order=None)})
    role = RULES[aten.argsort.stable](argsort, read_only(analysis))
    ((index, positions),) = role.findings.positions
    assert index is None and positions.sort is argsort and role.token_order is argsort
    assert not analysis.positions


def test_a_grid_member_reports_its_refusal_instead_of_raising():
    """A member that reads a sequence-indexed value from outside its window stops the attempt
    through its role's findings (the driver's loop starts the next one); given the facts by hand."""
    gm = _trace(mix_ffn, torch.randn(2, 3, 4, 8))
    flatten = _nodes(gm, aten.flatten.using_ints)[0]
    (entry,) = _nodes(gm, aten.unflatten.int)
    (conv,) = _nodes(gm, aten.conv2d.default)
    region = GridRegion(entry, 1, _size(gm, 0, 1), _size(gm, 0, 2), outside_inputs={conv: {flatten}})
    analysis = SequenceAnalysis(length=_size(gm, 0, 1) * _size(gm, 0, 2), grid_members={conv: region},
                                roles={flatten: NodeRole(Role.TOKEN_LOCAL, (SequenceDim(1),), token_order=None)})
    role = STAGE_RULES[Stage.GRID_MEMBER](conv, read_only(analysis))
    refusal = role.findings.refusal
    assert refusal.kind is RefusalKind.GRID and refusal.node is entry
    assert refusal.reason == f"conv2d reads {flatten.name}, which is sequence-indexed, from outside the grid"
    assert not analysis.refused_grids


def test_each_rule_runs_on_an_empty_view(programs):
    """Every op rule, called on a node of its op with a view of an analysis that holds nothing but
    the length (no driver, no roles): it answers a role and the analysis stays empty."""
    covered = set()
    for name, gm, length in programs:
        for current in gm.graph.nodes:
            if current.op != "call_function" or current.target not in RULES:
                continue
            analysis = SequenceAnalysis(length=length, graph=fx_to_networkx(gm.graph))
            empty = _snapshot(analysis)
            role = RULES[current.target](current, read_only(analysis))
            assert isinstance(role, NodeRole), (name, current.name)
            assert _snapshot(analysis) == empty, (name, current.name)
            covered.add(RULES[current.target].__name__)
    assert {function.__name__ for function in RULES.values()} - covered == {"custom_autograd_function_rule"}
