"""A length that fits only under the lean memory policies trains at parity with eager.

The issue's acceptance line: on CPU with a stand-in memory cap, a tiny LM at a length that does not
fit without the new policies trains at parity with them. So, for a 4-layer TinyGPT and its
``ModelProfile`` of the same shape (fp32), a stand-in cap is set between what the cost model
prices the target policy's peak at and the least peak of every policy before it, at every SP size
of a 2-rank world:

* the cost model's token capacities say it: under the cap the sample fits at SP 2 under the
  target policy and under no policy up to ``block`` at SP 1 or 2;
* the planner (every policy allowed) plans the sample as one SP-2 micro-batch under the target
  policy, and the planner restricted to the policies up to ``block`` refuses it (``PlanningError``);
* that plan then runs for real on 2 gloo ranks: a few SGD steps through ``dcp.use(mb)`` with
  ``mb.loss_scale`` and ``dcp.sync_gradients``, as docs/training.md's loop, against eager on the
  full batch in the same process: every step's loss and synced gradients, and the parameters
  after the last step, equal; the attention ran sharded; the records say the block inputs went to
  host memory (``offloaded_activation_bytes``) and, under ``lean``, that every MLP was tiled.

Which policy a cap can single out depends on the length: ``offload`` keeps 2 block inputs per
rank where ``block`` keeps one per layer, so it holds less than ``block`` at any length; ``lean``
prices its MLP chunk whole (``mlp_chunk_tokens``, 4,096 tokens for this model), so it holds less
than ``offload`` only once each rank's share is well past a chunk (~12K tokens at SP 2). The quick
case trains ``offload`` at 1,024 tokens; ``lean`` at 16,384 tokens is slow.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

import dcp_compile as dcp
from dcp_compile.demo.example_models import TinyGPT
from dcp_compile.schedule.cost_model import CostModel, ModelProfile
from dcp_compile.schedule.plan import Schedule, StepPlan
from dcp_compile.schedule.planner import Planner, PlannerConfig, PlanningError
from dcp_compile.testing.process_world import run_in_process_world
from sharding_checks import sharding_problems
from dcp_compile.variant import RECOMPUTE_POLICIES, RecomputePolicy

VOCAB, HIDDEN, LAYERS, HEADS = 256, 64, 4, 4
WORLD = 2
STEPS, LR = 3, 0.5  # a large step so that the parameters move and later steps run on moved weights
OLD_POLICIES = RECOMPUTE_POLICIES[:RECOMPUTE_POLICIES.index(RecomputePolicy.BLOCK) + 1]
RTOL, ATOL = 1e-4, 1e-5  # fp32; the SP path sums gradients in another order than eager


def tinygpt_profile() -> ModelProfile:
    """What the planner knows of the model below: the same shape, fp32."""
    return ModelProfile.transformer(
        "tinygpt", num_layers=LAYERS, hidden_size=HIDDEN, num_heads=HEADS, ffn_hidden_size=4 * HIDDEN,
        vocab_size=VOCAB, causal=True, rotary=True, dtype_bytes=4,
    )


def capped_cost_model(length: int, policy: RecomputePolicy) -> tuple[CostModel, float]:
    """The cost model with a stand-in memory capacity whose planner cap lies halfway between the
    peak ``policy`` is priced at on the whole world and the least peak of any policy the planner
    would take before it (or of the old ones), at any SP size; and that planner cap."""
    model = CostModel(tinygpt_profile(), dcp.Hardware.detect())
    fits = model.peak_memory([length], WORLD, policy)
    before = RECOMPUTE_POLICIES[:RECOMPUTE_POLICIES.index(policy)]
    rivals = min(model.peak_memory([length], sp, q) for sp in (1, WORLD) for q in before)
    assert fits < rivals, f"{policy} at {length} tokens holds no less than a policy before it: {fits} >= {rivals}"
    cap = (fits + rivals) / 2
    fraction = PlannerConfig().memory_fraction
    return replace(model, hardware=replace(model.hardware, memory_capacity=cap / fraction)), cap


def planned_schedule(length: int, policy: RecomputePolicy) -> Schedule:
    """The planner's step for the one sample, after checking that the cap singles ``policy`` out."""
    model, cap = capped_cost_model(length, policy)
    for sp in (1, WORLD):
        for old in OLD_POLICIES:
            assert model.token_capacity(sp, old, cap) < length, (sp, old, model.token_capacity(sp, old, cap))
    assert model.token_capacity(WORLD, policy, cap) >= length
    assert model.token_capacity(1, policy, cap) < length  # one rank cannot hold it either way
    with pytest.raises(PlanningError, match="fits on no SP group"):
        Planner(model, WORLD, config=PlannerConfig(recompute_policies=OLD_POLICIES)).plan([length])
    schedule = Planner(model, WORLD).plan([length])
    (microbatch,) = schedule.microbatches
    assert (microbatch.sp_size, RecomputePolicy.parse(microbatch.recompute)) == (WORLD, policy), microbatch
    return schedule


def _training_worker(rank: int, world_size: int, length: int, policy: str) -> dict[str, object]:
    """Plan the step on this rank (every rank plans alike), train ``STEPS`` SGD steps with the
    compiled model under the plan's micro-batch and, in the same process, eager on the full batch."""
    torch.manual_seed(0)
    schedule = planned_schedule(length, RecomputePolicy.parse(policy))
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, hidden=HIDDEN, layers=LAYERS, heads=HEADS)
    reference, initial = copy.deepcopy(model), copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "aot_eager"})
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    problems: list[str] = []
    step_losses: list[float] = []
    with dcp.report.recording() as records:
        for step in range(STEPS):
            plan = StepPlan.from_schedule(schedule, step=step, epoch=0, rank=rank, indices=[0], lengths=[length])
            (mb,) = plan.microbatches  # the one sample on both ranks: the loop of docs/training.md
            with dcp.use(mb):
                loss = compiled(ids, ids) * mb.loss_scale
            loss.backward()
            dcp.sync_gradients(model)
            step_losses.append(loss.item())
            expected = reference(ids, ids)
            expected.backward()
            if not torch.allclose(loss.detach(), expected.detach(), rtol=RTOL, atol=ATOL):
                problems.append(f"step {step}: loss {loss.item()} != eager {expected.item()}")
            for (name, param), want in zip(model.named_parameters(), reference.parameters()):
                if not torch.allclose(param.grad, want.grad, rtol=RTOL, atol=ATOL):
                    error = (param.grad - want.grad).abs().max().item()
                    problems.append(f"step {step}: grad {name} differs (max abs error {error:.3g})")
            optimizer.step(), optimizer.zero_grad(set_to_none=True)
            reference_optimizer.step(), reference_optimizer.zero_grad(set_to_none=True)
    for (name, param), want in zip(model.named_parameters(), reference.parameters()):
        if not torch.allclose(param.detach(), want.detach(), rtol=RTOL, atol=ATOL):
            problems.append(f"after {STEPS} steps: parameter {name} differs")
    moved = max((a - b).abs().max().item() for a, b in zip(reference.parameters(), initial.parameters()))
    if moved < 1e-3:  # else the comparison after the steps would say little
        problems.append(f"the steps moved no parameter by more than {moved:.3g}")
    problems += sharding_problems(records, 0)
    ran = [r for r in records.variant_records() if r.variant == mb.variant]
    if not any(r.sharded_sites and r.is_sharded for r in ran):
        problems.append(f"no attention site ran sharded: {[r.summary() for r in ran]}")
    return {
        "problems": problems,
        "losses": step_losses,
        "offloaded": [r.offloaded_activation_bytes for r in ran],
        "saved": [r.saved_activation_bytes for r in ran],
        "offload_ops": [("cpu_offload_" in r.forward_graph, "gpu_reload_" in (r.backward_graph or "")) for r in ran],
        "tiled": [note for r in ran for note in r.tiled_mlps],
        "untiled": [note for r in ran for note in r.untiled_mlps],
        "variants": sorted({str(r.variant) for r in records.variant_records()}),
    }


def train_planned(length: int, policy: RecomputePolicy) -> None:
    results = run_in_process_world(_training_worker, WORLD, length, policy.value, timeout=900)
    for rank, result in enumerate(results):
        assert not result["problems"], f"rank {rank}:\n" + "\n".join(result["problems"])
        assert result["variants"] == [f"sp={WORLD}/recompute={policy.value}"], result["variants"]  # the plan's only
        # The kept block inputs went to the host in forward and came back in backward, and the
        # device kept (nearly) nothing else of them: the layers' inputs are what ``block`` keeps.
        host = tinygpt_profile().host_activation_bytes_per_token(policy) * length / WORLD
        assert result["offloaded"] and all(b == pytest.approx(host, rel=0.03) for b in result["offloaded"]), \
            (result["offloaded"], host)
        assert all(forward and backward for forward, backward in result["offload_ops"]), result["offload_ops"]
        assert all(saved < 0.25 * host for saved in result["saved"]), (result["saved"], host)
        if policy == RecomputePolicy.LEAN:
            # every layer's MLP, over the chunk the cost model priced (the backend's default)
            chunk = tinygpt_profile().mlp_chunk_tokens()
            assert len(result["tiled"]) == LAYERS, (result["tiled"], result["untiled"])
            assert all(f"over {chunk}-token chunks" in note for note in result["tiled"]), result["tiled"]
        else:
            assert result["tiled"] == [], result["tiled"]


def test_offload_trains_a_length_only_it_fits() -> None:
    """1,024 tokens on 2 ranks under a cap ``offload`` fits and nothing up to ``block`` does."""
    train_planned(1024, RecomputePolicy.OFFLOAD)


@pytest.mark.slow
def test_lean_trains_a_length_only_it_fits() -> None:
    """16,384 tokens on 2 ranks under a cap only ``lean`` fits (each rank's share holds 2 MLP chunks)."""
    train_planned(16384, RecomputePolicy.LEAN)


def test_lean_is_planned_only_past_its_mlp_chunk() -> None:
    """The planner's side of the slow case, quick: at 16,384 tokens a cap singles ``lean`` out."""
    planned_schedule(16384, RecomputePolicy.LEAN)
