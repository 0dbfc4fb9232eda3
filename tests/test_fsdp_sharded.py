"""FSDP2 fully sharded during the step (ZeRO-3) with data-centric steps: ``dcp.shard_model(model,
reshard_after_forward=True)`` and a plan in rounds.

On 2 and 4 gloo ranks, a TinyGPT sharded per block and at the root, compiled with ``backend="dcp"``,
trains steps of a ``DataCentricSampler`` whose cost model says ``state_sharding="sharded"``: every
step is cut into rounds, the same count on every rank, and the chosen steps mix SP sizes and leave
some ranks idle in some rounds (an idle round joins the round's all-gathers and reduce-scatters
with zero gradients). Each step: ``dcp.begin_step(model, step)``, the rank's micro-batches with
``loss * loss_scale``, ``dcp.sync_gradients`` (the trailing idle rounds; FSDP2 reduce-scattered a
SUM after every backward), AdamW on the shards. The full parameters afterwards equal one eager
process training each step's global batch (mean token loss), within 1e-5. Inside a micro-batch
only the root's and about one block's parameters are unsharded, and a rank that leaves the plan
gets an error, not a hang.
"""

from __future__ import annotations

import random

import pytest
import torch

import dcp_compile as dcp
from dcp_compile.demo.example_models import TinyGPT
from dcp_compile.demo.training_demo import collate
from dcp_compile.schedule.cost_model import CostModel, ModelProfile
from dcp_compile.schedule.hardware import Hardware
from dcp_compile.testing.process_world import run_in_process_world
from sharding_checks import sharding_problems

VOCAB, HIDDEN, HEADS = 64, 32, 4
LEARNING_RATE = 1e-2
STEPS = 3
SEED = 3
RTOL, ATOL = 1e-5, 1e-5
ADAM_EPS = 1e-6  # see tests/test_fsdp.py: keeps the comparison about the gradients
TOKENS_PER_STEP = 120
MAX_TOKENS_PER_RANK = {2: 40, 4: 20}  # longer samples need SP 2 (and SP 4 on 4 ranks)


def sample_lengths() -> list[int]:
    rng = random.Random(SEED)
    return [rng.choice([5, 7, 9, 12, 16, 30, 60]) for _ in range(64)]


def make_dataset() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(1, VOCAB, (n,), generator=generator) for n in sample_lengths()]


def make_sampler(rank: int, world: int, state_sharding: str = "sharded") -> dcp.DataCentricSampler:
    lengths = sample_lengths()
    cost_model = CostModel(ModelProfile.from_config("llama-3-8b"), Hardware.H200, optimizer_shards=world,
                           state_sharding=state_sharding)
    return dcp.DataCentricSampler(
        lengths, tokens_per_step=TOKENS_PER_STEP, cost_model=cost_model, world_size=world, rank=rank, seed=SEED,
        max_tokens_per_rank=MAX_TOKENS_PER_RANK[world], supervised_tokens=[n - 1 for n in lengths], verify_plan=False,
    )


def chosen_steps(world: int) -> list[int]:
    """Steps of epoch 0 in which some rank is idle in some round, then steps that mix SP sizes."""
    samplers = [make_sampler(rank, world) for rank in range(world)]
    plans = [[s.plan(step) for s in samplers] for step in range(len(samplers[0]))]
    idle = [step for step, ranks in enumerate(plans) if any(mb is None for plan in ranks for mb in plan.rounds)]
    mixed = [step for step, ranks in enumerate(plans) if step not in idle
             and len({mb.sp_size for plan in ranks for mb in plan.microbatches}) > 1]
    return (idle + mixed)[:STEPS]


def make_model(layers: int = 2) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(VOCAB, HIDDEN, layers, HEADS)


def reference_parameters(steps: list[int], world: int, layers: int = 2) -> dict[str, torch.Tensor]:
    """One eager process: each step's loss is the mean token loss over its global batch."""
    dataset = make_dataset()
    sampler = make_sampler(0, world)
    model = make_model(layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, eps=ADAM_EPS)
    for step in steps:
        indices = sampler.steps(0)[step]
        model(*collate(dataset, indices, torch.device("cpu"))).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def unsharded_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of unsharded parameter storage each FSDP module has allocated now, and (under
    ``grad:<name>``) of unsharded gradients not yet reduce-scattered."""
    from dcp_compile.runtime.fsdp import fsdp_modules

    names = {id(module): name or "root" for name, module in model.named_modules()}
    out = {}
    for module in fsdp_modules(model):
        total = gradients = 0
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                parameter = getattr(fsdp_param, "_unsharded_param", None)
                if parameter is not None:
                    total += parameter.untyped_storage().nbytes()
                    if parameter.grad is not None:
                        gradients += parameter.grad.numel() * parameter.grad.element_size()
        out[names[id(module)]] = total
        out[f"grad:{names[id(module)]}"] = gradients
    return out


def train_rank(rank: int, world: int, steps: list[int], layers: int = 2, offload: bool = False,
               explicit_rounds: bool = False) -> dict:
    from torch.distributed.tensor import DTensor

    dcp.runtime.create_sp_groups()
    dataset = make_dataset()
    sampler = make_sampler(rank, world, "sharded_offload" if offload else "sharded")
    model = dcp.shard_model(make_model(layers), reshard_after_forward=True, offload=offload)
    seen: dict[str, list] = {"forward": [], "backward": []}

    def in_last_block(module, args):  # forward, as the last block starts (FSDP2 gathered it): earlier ones resharded
        seen["forward"].append(unsharded_bytes(model))

    def after_first_block(module, args, output):  # its output's gradient arrives once the later blocks are done
        output.register_hook(lambda grad: seen["backward"].append(unsharded_bytes(model)))

    model.blocks[-1].register_forward_pre_hook(in_last_block)
    model.blocks[0].register_forward_hook(after_first_block)
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager"})
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, eps=ADAM_EPS)
    rounds, idle, sp_sizes = [], 0, set()

    def train(mb) -> None:
        sp_sizes.add(mb.sp_size)
        ids, labels = collate(dataset, mb.indices, torch.device("cpu"))
        with dcp.use(mb):
            loss = compiled(ids, labels)
        (loss * mb.loss_scale).backward()

    with dcp.report.recording() as records:  # every graph the steps ran, nothing run again
        for step in steps:
            plan = sampler.plan(step)
            rounds.append(plan.num_rounds)
            idle += sum(mb is None for mb in plan.rounds)
            dcp.begin_step(model, plan)
            for mb in plan.rounds if explicit_rounds else plan.microbatches:
                if mb is None:  # explicit rounds: this rank idles in this one
                    dcp.runtime.idle_round(model)
                else:
                    train(mb)
            dcp.sync_gradients(model)
            assert all(isinstance(p.grad, DTensor) for p in model.parameters())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return {
        "rounds": rounds,
        "idle": idle,
        "unsharded": sharding_problems(records, 0),
        "sp_sizes": sorted(sp_sizes),
        "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
        "local_elements": sum(p.to_local().numel() for p in model.parameters()),
        "parameters": {name: p.full_tensor().tolist() for name, p in model.named_parameters()},
        "seen": seen,
        "on_host": all(p.to_local().device.type == "cpu" for p in model.parameters()),
    }


def check_training(world: int, results: list[dict], steps: list[int], layers: int = 2) -> None:
    assert len({tuple(r["rounds"]) for r in results}) == 1, [r["rounds"] for r in results]
    assert any(r["idle"] for r in results), "some rank should be idle in some round"
    assert set().union(*(r["sp_sizes"] for r in results)) >= {1, 2}, [r["sp_sizes"] for r in results]
    full = sum(p.numel() for p in make_model(layers).parameters())
    for rank, result in enumerate(results):
        assert result["unsharded"] == [], (rank, result["unsharded"])  # every SP>1 variant sharded, no gather
        assert result["sharded"], rank
        assert result["local_elements"] <= full / world + 64, (rank, result["local_elements"], full)
    expected = reference_parameters(steps, world, layers)
    for rank, result in enumerate(results):
        for name, value in expected.items():
            torch.testing.assert_close(
                torch.tensor(result["parameters"][name]), value, rtol=RTOL, atol=ATOL,
                msg=lambda m: f"rank {rank} parameter {name} after {len(steps)} AdamW steps: {m}",
            )
    start = dict(make_model(layers).named_parameters())
    assert any(not torch.allclose(expected[n], start[n].detach()) for n in expected)  # training moved them


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_fully_sharded_steps_equal_one_process_over_the_global_batches(world: int) -> None:
    steps = chosen_steps(world)
    assert len(steps) == STEPS
    results = run_in_process_world(train_rank, world, steps, timeout=900)
    check_training(world, results, steps)


@pytest.mark.slow
def test_an_explicit_loop_over_rounds_with_idle_rounds_trains_the_same() -> None:
    steps = chosen_steps(2)
    results = run_in_process_world(train_rank, 2, steps, explicit_rounds=True, timeout=900)
    check_training(2, results, steps)


@pytest.mark.slow
def test_optimizer_offload_trains_the_same_with_the_shards_on_the_host() -> None:
    steps = chosen_steps(2)
    results = run_in_process_world(train_rank, 2, steps, offload=True, timeout=900)
    check_training(2, results, steps)
    assert all(r["on_host"] for r in results)


def test_only_about_one_block_is_unsharded_inside_a_micro_batch() -> None:
    """Four blocks: as the last block's forward starts, and in backward as the first block's starts,
    the other blocks hold no unsharded storage, and in backward the later blocks' gradients have
    been reduce-scattered (no unsharded gradient left); the root keeps its own parameters (FSDP2
    does not reshard the root after forward)."""
    layers = 4
    steps = chosen_steps(2)[:1]
    results = run_in_process_world(train_rank, 2, steps, layers, timeout=900)
    model = make_model(layers)
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    root_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("blocks."))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for result in results:
        assert result["seen"]["forward"] and result["seen"]["backward"]
        for snapshot in result["seen"]["forward"]:
            assert snapshot[f"blocks.{layers - 1}"] >= block_bytes and snapshot["root"] >= root_bytes
            assert all(snapshot[f"blocks.{i}"] == 0 for i in range(layers - 1)), snapshot
        for snapshot in result["seen"]["backward"]:
            assert snapshot["blocks.0"] >= block_bytes, snapshot
            assert all(snapshot[f"blocks.{i}"] == 0 and snapshot[f"grad:blocks.{i}"] == 0
                       for i in range(1, layers)), snapshot  # reduce-scattered and freed
        for snapshot in result["seen"]["forward"] + result["seen"]["backward"]:
            parameters = sum(v for k, v in snapshot.items() if not k.startswith("grad:"))
            gradients = sum(v for k, v in snapshot.items() if k.startswith("grad:"))
            assert parameters <= root_bytes + block_bytes + 1024, (parameters, root_bytes, block_bytes)
            assert gradients <= root_bytes + block_bytes, (gradients, root_bytes, block_bytes)
            assert parameters + gradients < 0.7 * 2 * model_bytes, (parameters, gradients, model_bytes)


# --- the plan is kept, or the ranks say why --------------------------------------------------------


def _leave_the_plan(rank: int, world: int, steps: list[int]) -> str:
    """Rank 1 skips its last micro-batch of the step; every rank must end in an error, not a hang."""
    dcp.runtime.create_sp_groups()
    dataset = make_dataset()
    sampler = make_sampler(rank, world)
    model = dcp.shard_model(make_model(), reshard_after_forward=True)
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager"})
    plan = sampler.plan(steps[0])
    dcp.begin_step(model, plan)
    microbatches = plan.microbatches[:-1] if rank == 1 else plan.microbatches
    try:
        for mb in microbatches:
            ids, labels = collate(dataset, mb.indices, torch.device("cpu"))
            with dcp.use(mb):
                loss = compiled(ids, labels)
            (loss * mb.loss_scale).backward()
        dcp.sync_gradients(model)
    except Exception as error:  # noqa: BLE001 - the test reads what each rank says
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.slow
def test_a_rank_that_skips_a_micro_batch_gets_an_error_and_its_peers_do_not_hang() -> None:
    world = 2
    samplers = [make_sampler(rank, world) for rank in range(world)]
    # A step where rank 1 has a micro-batch in the last round and rank 0 has one too.
    step = next(s for s in range(len(samplers[0]))
                if all(p.num_rounds >= 2 and p.rounds[-1] is not None for p in (x.plan(s) for x in samplers)))
    outcomes = run_in_process_world(_leave_the_plan, world, [step], timeout=300,
                                    env={"DCP_RANK_CHECK_TIMEOUT": "20"})
    assert "no error" not in outcomes, outcomes
    assert "RuntimeError" in outcomes[1] and "micro-batches this rank's plan gives it" in outcomes[1], outcomes[1]
    assert any(name in outcomes[0] for name in ("RankTimeoutError", "PeerFailureError", "DistBackendError",
                                                "RuntimeError")), outcomes[0]


def _begin_without_rounds(rank: int, world: int) -> list[str]:
    model = dcp.shard_model(make_model(), reshard_after_forward=True)
    errors = []
    for step in (None, make_sampler(rank, world, "replicated").plan(0)):
        try:
            dcp.begin_step(model, step)
        except (ValueError, RuntimeError) as error:
            errors.append(str(error))
    return errors


def test_begin_step_needs_a_plan_in_rounds() -> None:
    for errors in run_in_process_world(_begin_without_rounds, 2, timeout=120):
        assert len(errors) == 2
        assert "needs this rank's step plan" in errors[0]
        assert "state_sharding='sharded'" in errors[1]


# --- the guide's fully sharded loop (docs/training.md, "Fully sharded state (ZeRO-3)"), as written --


def guide_block() -> str:
    from doc_blocks import doc_block

    block = doc_block("docs/training.md", "Fully sharded state (ZeRO-3)")
    for expected in ("dcp.shard_model(model, reshard_after_forward=True)", 'state_sharding="sharded"',
                     "dcp.begin_step(model, step)", "AdamW(model.parameters(), lr=1e-4, eps=1e-6)"):
        assert expected in block, f"the guide's fully sharded block lost {expected!r}"
    return block


def _guide_loop(rank: int, world: int, block: str) -> dict:
    from doc_blocks import run_python_block
    from test_fsdp import GUIDE_MAX_TOKENS_PER_RANK, GUIDE_TOKENS_PER_STEP, guide_dataset, guide_llama

    with dcp.report.recording() as records:
        namespace = run_python_block(block, "docs/training.md", model=guide_llama(), dataset=guide_dataset(),
                                     tokens_per_step=GUIDE_TOKENS_PER_STEP,
                                     max_tokens_per_rank=GUIDE_MAX_TOKENS_PER_RANK, inner="eager")
    sampler = namespace["sampler"]
    plans = [sampler.plan(step, 0) for step in range(len(sampler.steps(0)))]
    return {
        "epochs": sampler.epoch,
        "rounds": [plan.num_rounds for plan in plans],
        "idle": sum(mb is None for plan in plans for mb in plan.rounds),
        "sp_sizes": sorted({mb.sp_size for plan in plans for mb in plan.microbatches}),
        # budget 1: the guide's padded Hugging Face batches gather once per SP-2 variant, at a reshape
        # whose dimensions cannot be matched symbolically (the zoo's unpadded Llama gathers none)
        "unsharded": sharding_problems(records, 1),
        "gathers": sorted({reason for v in records.variant_records() if v.sp_size > 1 for reason in v.gather_reasons()}),
        "parameters": {name: p.full_tensor().tolist() for name, p in namespace["model"].named_parameters()},
    }


def test_the_guide_fully_sharded_loop_trains_the_global_batches() -> None:
    pytest.importorskip("transformers")
    from padded_batches import pad_right
    from test_fsdp import GUIDE_TOKENS_PER_STEP, guide_dataset, guide_llama

    results = run_in_process_world(_guide_loop, 2, guide_block(), timeout=900)
    dataset = guide_dataset()
    steps = dcp.DataCentricSampler([len(s) for s in dataset], tokens_per_step=GUIDE_TOKENS_PER_STEP, seed=0,
                                   world_size=2, rank=0).steps(0)
    model = guide_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, eps=ADAM_EPS)
    for indices in steps:
        model(**pad_right([dataset[i] for i in indices])).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert results[0]["rounds"] == results[1]["rounds"] and all(results[0]["rounds"])
    for rank, result in enumerate(results):
        assert result["epochs"] == 1, "the loop ran one whole epoch"
        assert 2 in result["sp_sizes"], f"rank {rank}: no SP-2 micro-batch was planned: {result['sp_sizes']}"
        assert result["unsharded"] == [], (rank, result["unsharded"])
        assert all("cannot be matched symbolically" in reason for reason in result["gathers"]), result["gathers"]
        for name, value in model.named_parameters():
            torch.testing.assert_close(torch.tensor(result["parameters"][name]), value.detach(), rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
