"""Parameters that a graph break leaves in eager code get their full gradient on every rank of an
SP group; hooks divide each micro-batch's share by its SP size so the sum over the group is exact.
The first compiled call hooks the module being called; a model used by a compiled *function* (no
module call on the stack) is hooked by ``dcp.sync_gradients`` instead, which divides a first step
of one SP size at the sync and refuses a first step of mixed SP sizes it cannot split any more;
``dcp.check`` names the parameters. Two real gloo ranks, against eager on the full batch (see
also tests/test_graph_break_gradients.py: the README's loop, without any sync call)."""

from __future__ import annotations

import torch
from torch import nn

from dcp_compile.testing.process_world import run_in_process_world


class AttentionThenEagerHead(nn.Module):
    """Attention compiled by dcp; the head runs eagerly (``torch.compiler.disable``), as code after
    a graph break inside a loop does in real models (diffusers' HunyuanVideo 1.5)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.head = nn.Linear(8, 8)

    @torch.compiler.disable
    def eager_head(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (2, 4)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.eager_head(self.attend(x))


def _eager_gradients(model: nn.Module, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    model.zero_grad()
    for x in batches:
        model(x).pow(2).mean().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _worker(rank: int, world_size: int, as_function: bool, first_step_mixed: bool = False) -> dict:
    """Two steps of the data-centric loop (``dcp.sync_gradients`` per step). ``as_function``:
    the compiled object is a function that uses the model's parameters through its methods, not
    the module: no module call is on the stack, so no module is hooked before the sync."""
    import torch.distributed as dist

    import dcp_compile as dcp
    from dcp_compile.runtime.graph_parameters import ParametersOutsideGraphs

    torch.manual_seed(0)
    model = AttentionThenEagerHead()
    options = {"inner": "eager", "sp_size": world_size}
    if as_function:
        compiled = torch.compile(lambda sample: model.eager_head(model.attend(sample)), backend="dcp", dynamic=True, options=options)
    else:
        compiled = torch.compile(model, backend="dcp", dynamic=True, options=options)
    x, y = torch.randn(2, 9, 8), torch.randn(2, 7, 8)
    report = None if as_function else dcp.check(compiled, x, raise_on_mismatch=False)
    sharded = report is None or all(v.is_sharded for v in report.record.variant_records() if v.sp_size > 1)
    errors = {}
    steps = [[(x, 2), (y, 1)], [(x, 2), (y, 1)]] if first_step_mixed else [[(x, 2)], [(x, 2), (y, 1)]]
    for step, batches in enumerate(steps):
        # One step at SP 2, then one mixing SP 2 (both ranks, the same sample) and SP 1 (each rank
        # its own half of the step's weight, so the world sum equals eager on both samples).
        model.zero_grad()
        for sample, sp_size in batches:
            with dcp.use(dcp.Variant(sp_size)):
                loss = compiled(sample).pow(2).mean()
            (loss * (1.0 if sp_size == world_size else 1.0 / world_size)).backward()
        try:
            dcp.sync_gradients(model)
        except ParametersOutsideGraphs as error:
            errors[step] = str(error)
            continue
        synced = {name: p.grad.clone() for name, p in model.named_parameters()}
        expected = _eager_gradients(model, [sample for sample, _ in batches])  # overwrites .grad
        errors[step] = max((synced[name] - expected[name]).abs().max().item() for name in expected)
    dist.barrier()
    return {"errors": errors, "check": str(report), "sharded": sharded}


def test_eager_parameters_are_divided_by_the_sp_size():
    """Hooked by the first compiled call: a first step that mixes SP sizes is exact too."""
    for result in run_in_process_world(_worker, 2, False, True, timeout=300):
        assert result["sharded"], result["check"]
        assert "note: gradient of head.weight: computed in eager code" in result["check"], result["check"]
        assert "OK" in result["check"].splitlines()[0], result["check"]
        assert result["errors"][0] < 1e-6 and result["errors"][1] < 1e-6, result["errors"]


def test_a_model_compiled_as_a_function_is_divided_at_its_first_sync():
    """No module call on the stack: a first step of one SP size is divided at the sync."""
    for result in run_in_process_world(_worker, 2, True, timeout=300):
        assert result["errors"][0] < 1e-6 and result["errors"][1] < 1e-6, result["errors"]


def test_a_first_step_of_mixed_sp_sizes_is_refused_without_watch():
    """No module call on the stack and a first step of mixed SP sizes: refused at the sync."""
    for result in run_in_process_world(_worker, 2, True, True, timeout=300):
        refused = result["errors"][0]
        assert isinstance(refused, str) and "head.weight" in refused and "mixed SP sizes [1, 2]" in refused, refused
        assert "qkv" not in refused
        assert result["errors"][1] < 1e-6, result["errors"]  # the hooks are on from then on
