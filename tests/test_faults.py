"""Never silent, never a hang: each way the ranks of a world can disagree, on 2 real gloo ranks.

Every test runs its world under a hard timeout and asserts what *every* rank gets: a clear error
naming the ranks and what differed, or the correct result. One row of the guide's (docs/ranks.md)
"When ranks disagree" table per test.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dcp_compile.testing.process_world import run_in_process_world

# The row that expects a check to time out waits 4 s. Every other row waits 30 s: its ranks meet in
# the first check right after their first compile, and on a loaded CI machine one rank can reach
# it seconds after the other (a 4 s wait made the agreeing guide loop time out).
SHORT_WAIT = {"DCP_RANK_CHECK_TIMEOUT": "4"}
CHECK_WAIT = {"DCP_RANK_CHECK_TIMEOUT": "30"}
VOCAB, WIDTH = 32, 8


class TinyAttentionLM(nn.Module):
    """Token ids in, logits out, one attention: integer inputs the signature digests."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        q, k, v = (t.unflatten(-1, (2, 4)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return self.head(out)


def _compiled(**options):
    torch.manual_seed(0)
    model = TinyAttentionLM()
    return model, torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager", **options})


def _outcome(fn) -> dict:
    """Run ``fn`` and report its result or its error (type and message) as plain data."""
    try:
        return {"ok": True, "value": fn()}
    except Exception as error:  # noqa: BLE001 - the test inspects every rank's error
        return {"ok": False, "type": type(error).__name__, "message": str(error)}


# --- an SP group whose ranks pass different batches ------------------------------------------


def _batches_differ(rank: int, world_size: int, same_shape: bool, check: bool = True) -> dict:
    import dcp_compile as dcp

    _, compiled = _compiled(check_ranks=check)
    generator = torch.Generator().manual_seed(rank)  # the data-loader bug: each rank its own batch
    length = 37 if (same_shape or rank == 0) else 40
    ids = torch.randint(0, VOCAB, (2, length), generator=generator)
    with dcp.use(dcp.Variant(2)):
        return _outcome(lambda: compiled(ids).sum().item())


def test_different_batches_of_one_shape_raise_on_every_rank():
    for rank, result in enumerate(run_in_process_world(_batches_differ, 2, True, timeout=60, env=CHECK_WAIT)):
        assert result["type"] == "RankMismatchError", result
        assert "rank 1 and rank 0: the same shapes, but different integer values" in result["message"], result
        assert "ranks [0, 1] of one SP group disagree" in result["message"], result


def test_different_lengths_raise_naming_each_ranks_length():
    for result in run_in_process_world(_batches_differ, 2, False, timeout=60, env=CHECK_WAIT):
        assert result["type"] == "RankMismatchError", result
        assert "rank 1: length 40" in result["message"] and "rank 0: length 37" in result["message"], result


def _same_batch(rank: int, world_size: int, check: bool) -> list[float]:
    import dcp_compile as dcp

    _, compiled = _compiled(check_ranks=check)
    ids = torch.randint(0, VOCAB, (2, 37), generator=torch.Generator().manual_seed(0))
    with dcp.use(dcp.Variant(2)):
        return compiled(ids).sum().item()


@pytest.mark.parametrize("checked", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_agreeing_ranks_pass_the_check_and_match_eager(checked):
    torch.manual_seed(0)
    eager = TinyAttentionLM()(torch.randint(0, VOCAB, (2, 37), generator=torch.Generator().manual_seed(0))).sum().item()
    results = run_in_process_world(_same_batch, 2, checked, timeout=60, env=CHECK_WAIT)
    assert all(abs(value - eager) < 1e-4 for value in results), (checked, results, eager)


# --- ranks disagree on dcp.use's SP size, then sync_gradients ---------------------------------


def _sp_sizes_differ(rank: int, world_size: int) -> dict:
    import dcp_compile as dcp

    model, compiled = _compiled()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))

    def step():
        with dcp.use(dcp.Variant(2 if rank == 0 else 1)):
            compiled(ids).float().pow(2).mean().backward()
        dcp.sync_gradients(model)

    return _outcome(step)


def test_disagreeing_sp_sizes_stop_every_rank_saying_where_each_waits():
    rank0, rank1 = run_in_process_world(_sp_sizes_differ, 2, timeout=60, env=SHORT_WAIT)
    for result in (rank0, rank1):
        assert result["type"] == "RankTimeoutError", result
        assert "rank 0: waiting in the SP-2 check of graph" in result["message"], result
        assert "rank 1: waiting in sync_gradients" in result["message"], result


def _different_models(rank: int, world_size: int) -> dict:
    import dcp_compile as dcp

    model = nn.Sequential(nn.Linear(4, 4), *([nn.Linear(4, 2)] if rank == 1 else []))
    model(torch.ones(1, 4)).sum().backward()
    return _outcome(lambda: dcp.sync_gradients(model))


def test_sync_gradients_over_different_models_names_what_differs():
    for result in run_in_process_world(_different_models, 2, timeout=60, env=CHECK_WAIT):
        assert result["type"] == "RankMismatchError", result
        assert "rank 0: trainable parameters 2, parameter elements 20" in result["message"], result
        assert "rank 1: trainable parameters 4, parameter elements 30" in result["message"], result


# --- sampler rows ------------------------------------------------------------------------------


def _cost_model():
    from dcp_compile.schedule.cost_model import CostModel, ModelProfile
    from dcp_compile.schedule.hardware import Hardware

    return CostModel(ModelProfile.from_config("llama-3-8b"), Hardware.H200, optimizer_shards=64)


LENGTHS = [64 * (1 + i % 7) for i in range(40)]


def _per_rank_seeds(rank: int, world_size: int) -> dict:
    from dcp_compile.schedule.sampler import DataCentricSampler

    sampler = DataCentricSampler(LENGTHS, tokens_per_step=2048, cost_model=_cost_model(), seed=rank)
    return _outcome(lambda: next(iter(sampler)).plan_hash())


def test_per_rank_sampler_seeds_raise_plan_mismatch_by_default():
    for result in run_in_process_world(_per_rank_seeds, 2, timeout=60):
        assert result["type"] == "PlanMismatchError", result
        assert "ranks [1] derived a different plan than ranks [0]" in result["message"], result


def _sampler_before_init(rank: int, world_size: int, rendezvous_file: str) -> dict:
    import torch.distributed as dist

    from dcp_compile.schedule.sampler import DataCentricSampler

    dist.barrier()
    dist.destroy_process_group()  # the user's order: the sampler first, the process group second
    sampler = DataCentricSampler(LENGTHS, tokens_per_step=2048, cost_model=_cost_model(), seed=0)
    # A fresh rendezvous (a file, not the old port, which a slower rank may still reach).
    dist.init_process_group("gloo", init_method=f"file://{rendezvous_file}", rank=rank, world_size=world_size)
    outcome = _outcome(lambda: next(iter(sampler)))
    # Neither rank leaves before the other's gloo mesh is up: a rank that exits first closes its
    # end while the other still connects ("Connection closed by peer", seen once in CI).
    dist.barrier()
    return outcome


def test_sampler_built_before_init_process_group_refuses_to_iterate(tmp_path):
    for result in run_in_process_world(_sampler_before_init, 2, str(tmp_path / "rendezvous"), timeout=60):
        assert result["type"] == "ValueError", result
        assert "built before torch.distributed.init_process_group" in result["message"], result
        assert "planned for a world of 1" in result["message"], result


def _plan_for_four(rank: int, world_size: int) -> dict:
    from dcp_compile.schedule.sampler import DataCentricSampler

    sampler = DataCentricSampler(LENGTHS, tokens_per_step=2048, cost_model=_cost_model(), seed=0,
                                 world_size=4, rank=rank)
    return _outcome(lambda: next(iter(sampler)))


def test_plan_for_four_ranks_used_on_two_names_both_worlds():
    for rank, result in enumerate(run_in_process_world(_plan_for_four, 2, timeout=60)):
        assert result["type"] == "ValueError", result
        assert f"planned for a world of 4 ranks (as rank {rank}) but runs on rank {rank} of a world of 2" \
            in result["message"], result


# --- faults: a rank fails between forward and backward -----------------------------------------


def _rank_fails(rank: int, world_size: int, where: str) -> dict:
    import dcp_compile as dcp
    from dcp_compile.runtime.consistency import fault_guard

    model, compiled = _compiled()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))

    def step():
        with fault_guard():
            for micro_batch in range(2):
                if rank == 1 and where == "oom" and micro_batch == 1:
                    raise torch.OutOfMemoryError("injected: out of memory in micro-batch 1")
                with dcp.use(dcp.Variant(2)):
                    loss = compiled(ids).float().pow(2).mean()
                if rank == 1 and where == "between":
                    raise ValueError("injected: the user's code failed between forward and backward")
                loss.backward()
            dcp.sync_gradients(model)

    # Rank 1 returns (its process exits, closing its connections) as a crashed rank would; the
    # process group's store lives on rank 0 here, as torchrun's agent store outlives any rank.
    return _outcome(step)


def test_a_rank_failing_between_forward_and_backward_is_named_by_the_others():
    rank0, rank1 = run_in_process_world(_rank_fails, 2, "between", timeout=60, env=CHECK_WAIT)
    assert rank1["type"] == "ValueError", rank1
    assert rank0["type"] == "PeerFailureError", rank0
    assert "rank 1 failed with ValueError: injected" in rank0["message"], rank0


def test_an_injected_out_of_memory_in_a_micro_batch_is_named_by_the_others():
    rank0, rank1 = run_in_process_world(_rank_fails, 2, "oom", timeout=60, env=CHECK_WAIT)
    assert rank1["type"] == "OutOfMemoryError", rank1
    assert rank0["type"] == "PeerFailureError", rank0
    assert "rank 1 failed with OutOfMemoryError: injected" in rank0["message"], rank0


# --- Hugging Face rows: padded batches of changing size, use_cache=True ------------------------


def _tiny_llama(**config):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=256, bos_token_id=0, eos_token_id=1, pad_token_id=0,
        attn_implementation="sdpa", **config,
    ))


def _padded_batch(lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    """A tokenizer's padded batch: right padding, attention_mask, labels -100 on the padding."""
    longest = max(lengths)
    ids = torch.randint(2, 64, (len(lengths), longest), generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(longest) < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


PADDED_BATCHES = [[20], [20, 13, 7]]  # a batch of size 1 (dynamo specializes it), then of size 3


def _padded_batches(rank: int, world_size: int) -> dict:
    import dcp_compile as dcp

    model = _tiny_llama(use_cache=False)
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager"})
    losses, summaries = [], []
    for seed, lengths in enumerate(PADDED_BATCHES):
        batch = _padded_batch(lengths, seed)
        losses.append(compiled(**batch).loss.item())
        record = dcp.explain(compiled, **batch)
        summaries += [{"sharded": len(v.sharded_sites), "sites": v.attention_sites, "gathers": len(v.gathers),
                       "fallback": v.fallback_reason} for graph in record.graphs for v in graph.variants.values()]
    return {"losses": losses, "variants": summaries}


@pytest.mark.slow
def test_padded_hugging_face_batches_of_size_one_then_three_stay_sharded_and_exact():
    model = _tiny_llama(use_cache=False)
    eager = [model(**_padded_batch(lengths, seed)).loss.item() for seed, lengths in enumerate(PADDED_BATCHES)]
    for rank, result in enumerate(run_in_process_world(_padded_batches, 2, timeout=120)):
        torch.testing.assert_close(result["losses"], eager, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}: {m}")
        assert len(result["variants"]) >= 2, result  # the size-1 graph and the dynamic-batch one
        for variant in result["variants"]:
            assert variant["fallback"] is None and variant["gathers"] == 0, (rank, variant)
            assert variant["sharded"] == variant["sites"] == 2, (rank, variant)


def _explain_llama(use_cache: bool | None):
    import dcp_compile as dcp

    model = _tiny_llama(**({} if use_cache is None else {"use_cache": use_cache}))
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager", "sp_size": 2})
    ids = torch.randint(0, 64, (2, 24))
    return dcp.explain(compiled, input_ids=ids, labels=ids)


@pytest.mark.parametrize("use_cache", [None, False], ids=["default", "off"])
def test_use_cache_true_warns_once_naming_use_cache_false(fake_world, monkeypatch, caplog, use_cache):
    """Graph structure on a fake 2-rank group: the K/V cache outputs are gathered to the full
    sequence on every rank after each SP 2 call; the attention itself stays sharded."""
    import logging

    import dcp_compile as dcp
    from dcp_compile.compiler import key_value_outputs

    monkeypatch.setattr(key_value_outputs, "_warned", False)
    caplog.set_level(logging.WARNING, logger="dcp_compile")
    record = _explain_llama(use_cache)
    variant = record.graphs[0].variants[dcp.Variant(2)]
    assert len(variant.sharded_sites) == 2 and not variant.gathers, str(record)
    warnings = [r for r in caplog.records if "use_cache=False" in r.getMessage()]
    if use_cache is False:
        assert not warnings, [r.getMessage() for r in warnings]
        assert record.graphs[0].returned_key_values == 0 and "key/value" not in str(record)
        return
    # dcp.explain says it too, for whoever reads the record rather than the log.
    assert record.graphs[0].returned_key_values == 4
    assert "returns 4 attention key/value tensors (a K/V cache)" in str(record)
    # transformers' default: 2 layers x (K, V) returned in the cache.
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert "returns 4 attention key/value tensors" in warnings[0].getMessage()
    assert warnings[0].exc_info is None  # one line, not a traceback
    torch._dynamo.reset()
    _explain_llama(None)  # a second model in the same process: no second warning
    assert len([r for r in caplog.records if "use_cache=False" in r.getMessage()]) == 1


# --- the guide's loop with fault_guard (docs/ranks.md), as written ---------------------------


def _guide_fault_guard_block() -> str:
    from doc_blocks import doc_block

    return doc_block("docs/ranks.md", "The checks")


class _LossOutput(nn.Module):
    """Hands the guide's loop what it expects of a Hugging Face model: an output with ``.loss``."""

    def __init__(self, compiled: nn.Module) -> None:
        super().__init__()
        self.compiled = compiled

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor):
        from types import SimpleNamespace

        return SimpleNamespace(loss=self.compiled(input_ids, labels))


def _guide_loop(rank: int, world_size: int, block: str) -> list[float]:
    import dcp_compile as dcp
    from dcp_compile.demo.example_models import TinyGPT
    from dcp_compile.schedule.sampler import DataCentricSampler
    from doc_blocks import run_python_block

    dcp.runtime.create_sp_groups()
    torch.manual_seed(0)
    model = TinyGPT(VOCAB, 16, 1, 2)
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager"})
    generator = torch.Generator().manual_seed(0)
    dataset = [torch.randint(0, VOCAB, (n,), generator=generator) for n in (12, 40, 20, 48, 16, 36)]

    def collate(indices):
        longest = max(len(dataset[i]) for i in indices)
        ids = torch.zeros(len(indices), longest, dtype=torch.long)
        labels = torch.full((len(indices), longest), -100, dtype=torch.long)
        for row, index in enumerate(indices):
            ids[row, : len(dataset[index])] = labels[row, : len(dataset[index])] = dataset[index]
        return {"input_ids": ids, "labels": labels}

    sampler = DataCentricSampler([len(s) for s in dataset], tokens_per_step=96, cost_model=_cost_model(), seed=0,
                                 max_tokens_per_rank=32, supervised_tokens=[len(s) - 1 for s in dataset])
    sp_sizes = sorted({group.sp_size for i in range(len(sampler)) for group in sampler.plan(i).groups})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run_python_block(block, "docs/ranks.md", sampler=sampler, model=_LossOutput(compiled), collate=collate,
                     optimizer=optimizer)
    return {"parameters": [p.detach().sum().item() for p in model.parameters()], "sp_sizes": sp_sizes}


def test_the_guide_fault_guard_loop_runs():
    rank0, rank1 = run_in_process_world(_guide_loop, 2, _guide_fault_guard_block(), timeout=120, env=CHECK_WAIT)
    assert 2 in rank0["sp_sizes"], rank0  # the SP-group check ran on real SP-2 micro-batches
    assert rank0["parameters"] == rank1["parameters"]


# --- the check off the critical path (DCP_RANK_CHECK=async; the default on NCCL) ----------------

ASYNC_CHECK = {"DCP_RANK_CHECK": "async"}


def test_the_check_mode_is_sync_on_gloo_and_async_on_nccl_unless_set(monkeypatch):
    from dcp_compile.runtime.consistency import check_mode

    monkeypatch.delenv("DCP_RANK_CHECK", raising=False)
    assert (check_mode("gloo"), check_mode("nccl")) == ("sync", "async")
    monkeypatch.setenv("DCP_RANK_CHECK", "async")
    assert check_mode("gloo") == "async"
    monkeypatch.setenv("DCP_RANK_CHECK", "sync")
    assert check_mode("nccl") == "sync"
    monkeypatch.setenv("DCP_RANK_CHECK", "later")
    with pytest.raises(ValueError, match="DCP_RANK_CHECK='later'"):
        check_mode("gloo")


def _async_steps(rank: int, world_size: int) -> dict:
    """Three agreeing calls and a gradient sync with the check beside each call: exact, nothing left
    outstanding."""
    import dcp_compile as dcp
    from dcp_compile.runtime import consistency

    model, compiled = _compiled()
    values = []
    for length in (37, 40, 37):
        ids = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(length))
        with dcp.use(dcp.Variant(2)):
            out = compiled(ids)
        out.float().pow(2).mean().backward()
        values.append(out.sum().item())
    dcp.sync_gradients(model)
    return {"values": values, "outstanding": len(consistency._pending)}


def test_async_checks_of_agreeing_ranks_pass_and_settle_by_the_sync():
    torch.manual_seed(0)
    model = TinyAttentionLM()
    eager = [model(torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(n))).sum().item()
             for n in (37, 40, 37)]
    for result in run_in_process_world(_async_steps, 2, timeout=120, env={**CHECK_WAIT, **ASYNC_CHECK}):
        assert result["outstanding"] == 0, result
        assert all(abs(a - b) < 1e-4 for a, b in zip(result["values"], eager)), (result, eager)


def test_async_check_of_different_batches_raises_on_every_rank_by_the_end_of_the_call():
    for result in run_in_process_world(_batches_differ, 2, True, timeout=120, env={**CHECK_WAIT, **ASYNC_CHECK}):
        assert result["type"] == "RankMismatchError", result
        assert "rank 1 and rank 0: the same shapes, but different integer values" in result["message"], result


class _NeverDone:
    """A collective's work handle whose peers never arrive."""

    def is_completed(self) -> bool:
        return False

    def wait(self, timeout=None) -> bool:
        raise RuntimeError("Timed out waiting for the peers")


def test_a_check_outstanding_past_the_wait_is_logged_by_the_watchdog_and_raised_by_the_call(fake_world, monkeypatch, caplog):
    """With the check beside the call, a rank whose peers never arrive is blocked in the call's own
    collectives: the watchdog logs where it waits once the bounded wait has passed, and the call's
    broken collective then raises that timeout (not the transport's error)."""
    import time

    from dcp_compile.runtime import consistency

    monkeypatch.setenv("DCP_RANK_CHECK_TIMEOUT", "0.2")
    pending = consistency.PendingCheck(_NeverDone(), [], None, (0, 1), "the SP-2 check of graph 0 (test)", 0, "v", 8,
                                       ((2, 8),), torch.zeros(0, dtype=torch.int64), 0, (), time.monotonic())
    with consistency._pending_lock:
        consistency._pending.append(pending)
    if not consistency._watchdog:
        consistency._start_watchdog()
    deadline = time.monotonic() + 30
    while pending.timeout_message is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pending.timeout_message and "waited 0s in the SP-2 check of graph 0 (test)" in pending.timeout_message
    assert any("SP-2 check of graph 0 (test)" in r.getMessage() for r in caplog.records if r.levelname == "ERROR")
    with pytest.raises(consistency.RankTimeoutError, match="SP-2 check of graph 0") as raised:
        with consistency.SettledAfterCall(pending):
            raise RuntimeError("Connection closed by peer")
    assert "Connection closed by peer" in str(raised.value.__cause__)
    consistency._forget(pending)
