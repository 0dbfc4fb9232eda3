"""The compiled packed path runs the attention the measured table chooses (issue 22, item 2).

A packed call's sequence lengths are known on the host, so the dispatcher asks
``attention_choice`` per call and runs the variant lowered to that implementation: the ``dcp::``
varlen op, or FlexAttention with a document mask traced into the graph (its backward derived by
AOTAutograd). On CPU without a table nothing changes (the reference kernel); these tests supply the
fixture table ``tests/data/varlen_choice_cpu_fixture.json`` (``DCP_VARLEN_TABLE``), which prefers
FlexAttention for short packed sequences and the ``dcp::`` op for long ones, and count which
kernel really ran, forward and backward.
"""

from __future__ import annotations

import contextlib
import os
import random
from pathlib import Path
from typing import Iterator

import pytest
import torch

import dcp_compile as dcp
from dcp_compile.kernels.attention_choice import PackedSite, choose_packed_attention
from dcp_compile.kernels import varlen_attention_reference as reference
from dcp_compile.kernels.attention_choice import TABLE_ENV, VarlenKernel, VarlenShape, available_in_graph
from dcp_compile.kernels.varlen_flex import (
    document_block_bitmaps,
    document_ids,
    document_mask_mod,
    flex_document_attention_traceable,
)
from dcp_compile.testing.process_world import run_in_process_world

FIXTURE = Path(__file__).resolve().parent / "data" / "varlen_choice_cpu_fixture.json"
SHORT = (5, 9, 4)  # nearest the fixture's short case: FlexAttention
LONG = (40, 41)  # nearest its long case: the dcp:: op (the reference on CPU)


@contextlib.contextmanager
def counting_kernels() -> Iterator[dict[str, int]]:
    """Calls of FlexAttention's forward and backward operators and of the varlen reference kernels,
    counted where they run (the operators' CPU implementations, the reference module)."""
    from torch._C import DispatchKey
    from torch._higher_order_ops.flex_attention import flex_attention, flex_attention_backward

    counts = {"flex_fwd": 0, "flex_bwd": 0, "reference_fwd": 0, "reference_bwd": 0}
    patched = []
    for operator, name in ((flex_attention, "flex_fwd"), (flex_attention_backward, "flex_bwd")):
        kernel = operator.py_kernels[DispatchKey.CompositeExplicitAutograd]

        def counted(*args, _kernel=kernel, _name=name, **kwargs):
            counts[_name] += 1
            return _kernel(*args, **kwargs)

        operator.py_kernels[DispatchKey.CompositeExplicitAutograd] = counted
        operator._dispatch_cache.clear()  # it would keep serving the kernel it resolved before
        patched.append((operator, kernel))
    originals = (reference.attention_forward, reference.attention_backward)

    def forward(*args, **kwargs):
        counts["reference_fwd"] += 1
        return originals[0](*args, **kwargs)

    def backward(*args, **kwargs):
        counts["reference_bwd"] += 1
        return originals[1](*args, **kwargs)

    reference.attention_forward, reference.attention_backward = forward, backward
    try:
        yield counts
    finally:
        reference.attention_forward, reference.attention_backward = originals
        for operator, kernel in patched:
            operator.py_kernels[DispatchKey.CompositeExplicitAutograd] = kernel
            operator._dispatch_cache.clear()


def _lengths_cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_document_block_bitmaps_cover_exactly_the_document_mask():
    """Full blocks lie wholly inside the mask, partial ones plus the mask give it exactly, and the
    counts equal create_block_mask's (where the token count fills the blocks)."""
    from torch.nn.attention.flex_attention import create_block_mask

    rng = random.Random(0)
    cases = [([17], 4, True), ([16], 8, False), ([16], 16, True)]  # one sequence
    for _ in range(30):
        lengths = [rng.choice([0, 1, 2, 3, 5, 8, 13, 16, 17, 31]) for _ in range(rng.randint(1, 6))] + [3]
        cases.append((lengths, rng.choice([1, 2, 4, 8, 16]), rng.random() < 0.5))
    for lengths, block, causal in cases:
        total = sum(lengths)
        documents = document_ids(_lengths_cu(lengths), total)
        partial, full = document_block_bitmaps(documents, total, causal, block)
        index = torch.arange(partial.shape[0] * block)
        inside = index < total
        ids = documents[index.clamp(max=total - 1)]
        truth = (ids[:, None] == ids[None, :]) & inside[:, None] & inside[None, :]
        if causal:
            truth &= index[:, None] >= index[None, :]

        def dense(blocks):
            return blocks.repeat_interleave(block, 0).repeat_interleave(block, 1)

        assert not (dense(full) & ~truth).any(), (lengths, block, causal)
        assert torch.equal(dense(full) | (dense(partial) & truth), truth), (lengths, block, causal)
        if total % block == 0:
            expected = create_block_mask(document_mask_mod(documents, causal), None, None, total, total,
                                         device="cpu", BLOCK_SIZE=block)
            assert int(expected.kv_num_blocks.sum()) == int(partial.sum()), (lengths, block, causal)
            assert int(expected.full_kv_num_blocks.sum()) == int(full.sum()), (lengths, block, causal)


@pytest.mark.parametrize("causal", [True, False])
def test_traced_flex_attention_matches_the_reference_forward_and_backward(causal):
    """The lowering the graph holds, traced once with a symbolic token count (AOTAutograd, dynamic)
    and run at two packings, GQA 4/2, an empty sequence: exact against the varlen reference."""
    from functorch.compile import aot_function, nop

    traced = aot_function(lambda q, k, v, cu: flex_document_attention_traceable(q, k, v, cu, causal, 0.3),
                          fw_compiler=nop, bw_compiler=nop, dynamic=True)
    for lengths in ([5, 1, 0, 9, 3], [7, 7, 2], [12]):
        cu = _lengths_cu(lengths)
        generator = torch.Generator().manual_seed(len(lengths))
        q = torch.randn(sum(lengths), 4, 8, dtype=torch.float64, generator=generator).requires_grad_()
        k, v = (torch.randn(sum(lengths), 2, 8, dtype=torch.float64, generator=generator).requires_grad_()
                for _ in range(2))
        out = traced(q, k, v, cu)
        grad = torch.randn_like(out)
        out.backward(grad)
        want, lse = reference.attention_forward(q.detach(), k.detach(), v.detach(), cu, causal, 0.3)
        grads = reference.attention_backward(grad, q.detach(), k.detach(), v.detach(), want, lse, cu, causal, 0.3)
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
        for leaf, expected in zip((q, k, v), grads):
            torch.testing.assert_close(leaf.grad, expected, rtol=1e-6, atol=1e-6)  # the reference's lse is fp32


def test_the_choice_a_graph_can_run(monkeypatch):
    """FlexAttention in a graph: on CUDA only under Inductor (unfused it is never faster), on CPU
    only unfused (Inductor has no CPU FlexAttention backward); equal-length SDPA never."""
    monkeypatch.delenv("DCP_KERNELS", raising=False)
    cuda = VarlenShape(64, 4, 16, 8, torch.bfloat16, True, "cuda", "NVIDIA H200")
    cpu = VarlenShape(64, 4, 16, 8, torch.float32, True, "cpu")
    assert VarlenKernel.FLEX in available_in_graph(cuda, "inductor")
    assert VarlenKernel.FLEX not in available_in_graph(cuda, "aot_eager")
    assert available_in_graph(cpu, "inductor") == {VarlenKernel.REFERENCE}
    assert available_in_graph(cpu, "aot_eager") == {VarlenKernel.REFERENCE, VarlenKernel.FLEX}
    assert VarlenKernel.EQUAL_SDPA not in available_in_graph(cuda, "inductor")
    sites = (PackedSite(True, 8, torch.float32),)
    cu = _lengths_cu(SHORT)
    monkeypatch.delenv(TABLE_ENV, raising=False)
    assert choose_packed_attention(sites, cu, torch.device("cpu"), "aot_eager").kernel is VarlenKernel.REFERENCE
    monkeypatch.setenv(TABLE_ENV, str(FIXTURE))
    assert choose_packed_attention(sites, cu, torch.device("cpu"), "aot_eager").kernel is VarlenKernel.FLEX
    assert choose_packed_attention(sites, _lengths_cu(LONG), torch.device("cpu"), "aot_eager").kernel \
        is VarlenKernel.REFERENCE
    assert choose_packed_attention(sites, cu, torch.device("cpu"), "inductor").kernel is VarlenKernel.REFERENCE
    mixed = (*sites, PackedSite(False, 8, torch.float32), PackedSite(True, 16, torch.float32))
    assert choose_packed_attention(mixed, cu, torch.device("cpu"), "aot_eager").kernel is VarlenKernel.FLEX
    with pytest.raises(ValueError, match="the dispatcher sets it"):
        dcp.Variant(1, attention="flex")
    monkeypatch.setenv(TABLE_ENV, str(FIXTURE.parent / "missing.json"))
    with pytest.raises(FileNotFoundError, match="DCP_VARLEN_TABLE"):
        choose_packed_attention(sites, cu, torch.device("cpu"), "aot_eager")


def test_eager_varlen_attention_on_cpu_with_a_table_keeps_a_backward(monkeypatch):
    """With a table on CPU, eager varlen_attention() may pick FlexAttention for inference only:
    torch has no CPU FlexAttention backward, so with gradients it runs the reference."""
    from dcp_compile.kernels.varlen_attention import last_varlen_choice, varlen_attention

    monkeypatch.setenv(TABLE_ENV, str(FIXTURE))
    monkeypatch.delenv("DCP_KERNELS", raising=False)
    cu = _lengths_cu(SHORT)
    q, k, v = (torch.randn(sum(SHORT), 2, 8, dtype=torch.float64) for _ in range(3))
    with torch.no_grad():
        varlen_attention(q, k, v, cu, max(SHORT), causal=True)
    assert last_varlen_choice().kernel is VarlenKernel.FLEX
    leaves = [x.requires_grad_() for x in (q, k, v)]
    varlen_attention(*leaves, cu, max(SHORT), causal=True).sum().backward()
    assert last_varlen_choice().kernel is VarlenKernel.REFERENCE and q.grad is not None


def _choice_worker(rank, world_size, variants, table):
    """TinyGPT, compiled once: packed rows of short sequences (FlexAttention by the table) and long
    ones (the dcp:: op), each against eager on every sequence alone; returns per-variant facts."""
    import torch.distributed as dist

    from test_packed_batches import _mismatches, _model, _reference, _sequences

    os.environ[TABLE_ENV] = table
    model = _model()
    # compiled whole: which kernel ran is read off the partitioned forward and backward graphs
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "aot_eager", "regions": False})
    problems, ran = [], {}
    for index, lengths in enumerate((SHORT, LONG)):
        sequences = _sequences(lengths, seed=index)
        expected_loss, expected_grads = _reference(model, sequences)
        packed = dcp.pack_sequences(sequences)
        for sp_size, recompute in variants:
            model.zero_grad(set_to_none=True)
            with counting_kernels() as counts, dcp.use(dcp.Variant(sp_size, recompute),
                                                       sequence_lengths=packed.sequence_lengths):
                loss = compiled(packed.input_ids, packed.labels, packed.position_ids)
                loss.backward()
            problems += _mismatches(f"{lengths} sp={sp_size}/{recompute}", model, loss, expected_loss,
                                    expected_grads, summed_over_world=sp_size > 1)
            ran[f"{lengths} sp={sp_size}/{recompute}"] = dict(counts)
    with dcp.use(dcp.Variant(*variants[-1]), sequence_lengths=packed.sequence_lengths):  # no other variant compiles
        record = dcp.explain(compiled, packed.input_ids, packed.labels, packed.position_ids)
    if len(record) != 1:
        problems.append(f"{len(record)} graphs: a new packing retraced the model")
    if problems:
        raise AssertionError("\n".join(problems))
    variants_seen = {}
    for key, variant in record[0].variants.items():
        if key.packed:
            plain = record[0].variants.get(dcp.Variant(key.sp_size, key.recompute))
            variants_seen[str(key)] = {
                "flex_in_forward": "flex_attention" in (variant.forward_graph or ""),
                "flex_in_backward": "flex_attention" in (variant.backward_graph or ""),
                "varlen_op_in_forward": "varlen_attention_fwd" in (variant.forward_graph or ""),
                "packed_attention": variant.packed_attention,
                "sharded": variant.is_sharded,
                "all_to_all": variant.collectives.get("all_to_all_single", 0),
                "plain_all_to_all": plain.collectives.get("all_to_all_single", 0) if plain else None,
            }
    summary = dcp.report.sharding_summary(record)
    if world_size > 1:
        dist.barrier()
    return ran, variants_seen, summary


def _check_the_choice(ran, seen, sp_size, recomputes):
    for recompute in recomputes:
        short, long = ran[f"{SHORT} sp={sp_size}/{recompute}"], ran[f"{LONG} sp={sp_size}/{recompute}"]
        # TinyGPT has 2 attention layers: FlexAttention ran forward and backward, the reference not at all
        recomputed = 2 if recompute == "attention" else 0  # the attention policy recomputes it in backward
        assert short == {"flex_fwd": 2 + recomputed, "flex_bwd": 2, "reference_fwd": 0, "reference_bwd": 0}, short
        assert long["flex_fwd"] == long["flex_bwd"] == 0 and long["reference_fwd"] >= 2 and long["reference_bwd"] >= 2
        flex = seen[f"sp={sp_size}/recompute={recompute}/packed/flex"]
        assert flex["flex_in_forward"] and flex["flex_in_backward"] and not flex["varlen_op_in_forward"]
        assert "short docs causal (fixture)" in flex["packed_attention"]
        op = seen[f"sp={sp_size}/recompute={recompute}/packed"]
        assert op["varlen_op_in_forward"] and not op["flex_in_forward"]
        assert "long docs causal (fixture)" in op["packed_attention"]


def test_packed_calls_run_the_kernel_the_table_chooses_at_sp1(monkeypatch):
    """One compiled model: short packed rows run FlexAttention (forward and backward, and again
    forward in backward: recompute='attention' recomputes it), long ones the dcp:: op; outputs and gradients equal eager on each
    sequence alone; one trace; explain and the sharding summary name the choice and the table's case."""
    monkeypatch.setenv(TABLE_ENV, str(FIXTURE))  # restored after the test (the worker sets it too)
    ran, seen, summary = _choice_worker(0, 1, [(1, "attention")], str(FIXTURE))
    _check_the_choice(ran, seen, 1, ("attention",))
    assert "packed attention: flex (nearest cpu (test fixture) case 'short docs causal" in summary
    assert "packed attention: reference (nearest cpu (test fixture) case 'long docs causal" in summary


@pytest.mark.slow
def test_packed_calls_run_the_kernel_the_table_chooses_at_sp2():
    """2 gloo ranks, SP 2: FlexAttention between Ulysses' all-to-alls, every attention site sharded
    and the same all-to-alls as the unpacked variant; gradients summed over the group equal eager's."""
    results = run_in_process_world(_choice_worker, 2, [(2, "none"), (2, "attention")], str(FIXTURE), timeout=1500)
    for ran, seen, summary in results:
        _check_the_choice(ran, seen, 2, ("none", "attention"))
        for facts in seen.values():
            assert facts["sharded"] and facts["all_to_all"] == 8  # 2 attentions x (q, k, v, out)
        assert "packed attention: flex (nearest cpu (test fixture) case 'short docs causal" in summary


def _huggingface_flex_worker(rank, world_size, table):
    """Hugging Face LlamaForCausalLM (GQA 4/2) with attn_implementation='dcp', packed rows at SP 1
    and 2 against its own sdpa attention on each sequence alone, with the fixture table."""
    from test_packed_batches import _mismatches, packed_tiny_llama

    os.environ[TABLE_ENV] = table
    model, compiled, packed, expected, expected_grads = packed_tiny_llama()
    inputs = dict(input_ids=packed.input_ids, labels=packed.labels, position_ids=packed.position_ids)
    problems = []
    with counting_kernels() as counts:
        for sp_size in (1, 2):
            model.zero_grad(set_to_none=True)
            with dcp.use(dcp.Variant(sp_size), sequence_lengths=packed.sequence_lengths):
                loss = compiled(**inputs).loss
            loss.backward()
            problems += _mismatches(f"sp={sp_size}", model, loss, expected, expected_grads,
                                    summed_over_world=sp_size > 1)
    if problems:
        raise AssertionError("\n".join(problems))
    with dcp.use(dcp.Variant(2), sequence_lengths=packed.sequence_lengths):
        record = dcp.explain(compiled, **inputs)
    variant = record[0].variants[dcp.Variant(2, packed=True, attention="flex")]
    return variant.collectives.get("all_to_all_single", 0) - variant.output_gathers, variant.is_sharded, counts


@pytest.mark.slow
def test_huggingface_llama_packed_runs_flex_attention_at_sp2():
    pytest.importorskip("transformers", reason="needs `pip install .[hf]`")
    results = run_in_process_world(_huggingface_flex_worker, 2, str(FIXTURE), timeout=1500)
    for all_to_all, sharded, counts in results:
        assert all_to_all == 8 and sharded  # Ulysses only: 2 attentions x (q, k, v, out)
        assert counts == {"flex_fwd": 4, "flex_bwd": 4, "reference_fwd": 0, "reference_bwd": 0}, counts


def _inductor_worker(rank, world_size, table):
    from test_packed_batches import _mismatches, _model, _reference, _sequences

    os.environ[TABLE_ENV] = table
    model = _model()
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "inductor"})
    sequences = _sequences(SHORT, seed=0)
    expected_loss, expected_grads = _reference(model, sequences)
    packed = dcp.pack_sequences(sequences)
    model.zero_grad(set_to_none=True)
    with counting_kernels() as counts, dcp.use(dcp.Variant(1), sequence_lengths=packed.sequence_lengths):
        loss = compiled(packed.input_ids, packed.labels, packed.position_ids)
        loss.backward()
    problems = _mismatches("inductor", model, loss, expected_loss, expected_grads, summed_over_world=False)
    if problems:
        raise AssertionError("\n".join(problems))
    record = dcp.explain(compiled, packed.input_ids, packed.labels, packed.position_ids)
    return dict(counts), sorted(str(key) for key in record[0].variants if key.packed)


@pytest.mark.slow
def test_under_inductor_on_cpu_the_packed_path_keeps_the_dcp_op():
    """Inductor has no CPU FlexAttention backward: with a table that prefers FlexAttention, the
    Inductor-compiled packed path still runs the dcp:: op, exact."""
    [(counts, variants)] = run_in_process_world(_inductor_worker, 1, str(FIXTURE), timeout=1500)
    assert variants == ["sp=1/recompute=none/packed"]
    assert counts["flex_fwd"] == counts["flex_bwd"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_inductor_packed_path_runs_flex_attention(monkeypatch):
    """On a GPU under Inductor (gpu_check.sh runs ``-k cuda``): with the fixture table, whose only
    CUDA-runnable entry is FlexAttention, a packed row compiles to the FlexAttention variant (fused
    forward and backward) and matches eager on each sequence alone."""
    from test_packed_batches import _model, _sequences

    monkeypatch.setenv(TABLE_ENV, str(FIXTURE))
    monkeypatch.delenv("DCP_KERNELS", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model().cuda()
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "inductor", "regions": False})
    sequences = [s.cuda() for s in _sequences(SHORT, seed=0)]
    targets = sum(s.numel() - 1 for s in sequences)
    expected = sum(model(s[None], s[None]) * (s.numel() - 1) for s in sequences) / targets
    expected.backward()
    expected_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    packed = dcp.pack_sequences(sequences)
    with dcp.use(dcp.Variant(1), sequence_lengths=packed.sequence_lengths):
        loss = compiled(packed.input_ids, packed.labels, packed.position_ids)
        loss.backward()
        record = dcp.explain(compiled, packed.input_ids, packed.labels, packed.position_ids)
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected_grads[name], rtol=1e-3, atol=1e-5, msg=name)
    variant = record[0].variants[dcp.Variant(1, packed=True, attention="flex")]
    assert "flex_attention" in variant.forward_graph and "flex_attention" in variant.backward_graph
    assert variant.inner_fallback is None
