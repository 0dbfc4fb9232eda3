"""Packed micro-batches: several sequences in one row, attention kept apart by the varlen kernel.

The reference is eager on each sequence alone (the token-weighted mean of their losses): a packed
row through the compiled model must give the same loss and, summed over the SP group, the same
gradients, and must differ from eager on the packed row (which attends across sequences).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

import dcp_compile as dcp
from dcp_compile.demo.example_models import TinyGPT
from dcp_compile.compiler.passes.use_varlen_attention import CannotPack
from dcp_compile.testing.process_world import run_in_process_world
from sharding_checks import sharding_problems
from model_zoo import ZOO

PACKINGS = [(5, 9, 4), (7, 1, 6, 2, 3), (11,)]  # a length-1 sequence; a single sequence


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab=64, hidden=32, layers=2, heads=4)


def _sequences(lengths, seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 64, (n,), generator=generator) for n in lengths]


def _tinygpt_loss(model, sequence):
    return model(sequence[None], sequence[None])


def _reference(model, sequences, loss_of=_tinygpt_loss):
    """Loss and gradients of the token-weighted mean loss over the sequences, each run alone."""
    model.zero_grad(set_to_none=True)
    targets = sum(s.numel() - 1 for s in sequences)
    loss = sum(loss_of(model, s) * (s.numel() - 1) for s in sequences if s.numel() > 1) / targets
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _mismatches(where, model, loss, expected_loss, expected_grads, summed_over_world):
    """What differs from the reference: the loss, and each gradient (summed over the SP group)."""
    problems = []
    if not torch.allclose(loss.detach(), expected_loss, rtol=1e-5, atol=1e-6):
        problems.append(f"{where}: loss {loss.item()} != {expected_loss.item()}")
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        if summed_over_world:
            dist.all_reduce(grad)
        if not torch.allclose(grad, expected_grads[name], rtol=1e-4, atol=1e-6):
            problems.append(f"{where}: grad {name} differs by {(grad - expected_grads[name]).abs().max().item():.3g}")
    return problems


def _packed_worker(rank, world_size, variants, packings=PACKINGS, options=None):
    model = _model()
    compiled = torch.compile(model, backend="dcp", dynamic=True, options=options or {"inner": "aot_eager"})
    problems = []
    for index, lengths in enumerate(packings):
        sequences = _sequences(lengths, seed=index)
        expected_loss, expected_grads = _reference(model, sequences)
        packed = dcp.pack_sequences(sequences)
        for sp_size, recompute in variants:
            model.zero_grad(set_to_none=True)
            with dcp.use(dcp.Variant(sp_size, recompute), sequence_lengths=packed.sequence_lengths):
                loss = compiled(packed.input_ids, packed.labels, packed.position_ids)
            loss.backward()
            problems += _mismatches(f"{lengths} sp={sp_size}/{recompute}", model, loss, expected_loss,
                                    expected_grads, summed_over_world=sp_size > 1)
        if len(lengths) > 1:  # the check can fail: eager on the packed row attends across sequences
            with torch.no_grad():
                crossing = model(packed.input_ids, packed.labels, packed.position_ids)
            if torch.allclose(crossing, expected_loss, rtol=1e-5, atol=1e-6):
                problems.append(f"{lengths}: eager on the packed row matches the reference; the test is blind")
    record = dcp.explain(compiled, packed.input_ids, packed.labels, packed.position_ids)
    problems += sharding_problems(record, 0)  # every SP>1 variant: every site sharded, no gather
    if len(record) != 1:
        problems.append(f"{len(record)} graphs: a new packing retraced the model")
    if problems:
        raise AssertionError("\n".join(problems))
    return sorted(str(v) for v in record[0].variants if v.packed)


def test_packed_rows_match_each_sequence_alone_on_two_ranks():
    variants = [(1, "none"), (2, "none"), (2, "attention")]
    results = run_in_process_world(_packed_worker, 2, variants, timeout=900)
    assert results[0] == ["sp=1/recompute=none/packed", "sp=2/recompute=attention/packed", "sp=2/recompute=none/packed"]


@pytest.mark.slow
def test_packed_rows_through_the_triton_kernels():
    """The real varlen and layout kernels (Triton interpreter on CPU) inside the compiled graph."""
    env = {"DCP_KERNELS": "triton", "TRITON_INTERPRET": "1"}
    results = run_in_process_world(_packed_worker, 2, [(2, "none")], [(5, 1, 6)], timeout=1500, env=env)
    assert results[0] == ["sp=2/recompute=none/packed"]


def packed_tiny_llama():
    """A tiny Hugging Face Llama (GQA 4/2) with attn_implementation='dcp', compiled with dcp, four
    sequences packed in one row, and the eager reference (its own sdpa attention, one sequence at a
    time): (model, compiled, packed, expected loss, expected gradients)."""
    from dcp_compile.runtime.huggingface import use_packed_attention
    from model_zoo import tiny_llama

    torch.manual_seed(0)
    model = tiny_llama()
    sequences = [torch.randint(2, 100, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9, 1, 6)]
    expected, expected_grads = _reference(model, sequences, lambda m, s: m(input_ids=s[None], labels=s[None]).loss)
    use_packed_attention(model)
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "aot_eager"})
    return model, compiled, dcp.pack_sequences(sequences), expected, expected_grads


def _huggingface_worker(rank, world_size):
    """LlamaForCausalLM (GQA 4/2) with attn_implementation='dcp': packed rows at SP 1 and SP 2."""
    model, compiled, packed, expected, expected_grads = packed_tiny_llama()
    problems = []
    for sp_size in (1, 2):
        model.zero_grad(set_to_none=True)
        with dcp.use(dcp.Variant(sp_size), sequence_lengths=packed.sequence_lengths):
            loss = compiled(input_ids=packed.input_ids, labels=packed.labels, position_ids=packed.position_ids).loss
        loss.backward()
        problems += _mismatches(f"sp={sp_size}", model, loss, expected, expected_grads, summed_over_world=sp_size > 1)
    with dcp.use(dcp.Variant(2), sequence_lengths=packed.sequence_lengths):
        variant = dcp.explain(compiled, input_ids=packed.input_ids, labels=packed.labels,
                              position_ids=packed.position_ids)[0].variants[dcp.Variant(2, packed=True)]
    if problems:
        raise AssertionError("\n".join(problems))
    return variant.collectives.get("all_to_all_single", 0) - variant.output_gathers


@pytest.mark.slow
def test_huggingface_llama_packed_with_dcp_attention():
    pytest.importorskip("transformers", reason="needs `pip install .[hf]`")
    # Ulysses only, 2 attentions x (q, k, v, out): the packed-mask arithmetic Hugging Face would do on
    # the position ids is dead code under attn_implementation='dcp', so nothing is gathered for it
    assert run_in_process_world(_huggingface_worker, 2, timeout=900) == [8, 8]


def test_huggingface_dcp_attention_refuses_padding_masks():
    pytest.importorskip("transformers", reason="needs `pip install .[hf]`")
    from dcp_compile.runtime.huggingface import use_packed_attention
    from model_zoo import tiny_llama

    model = use_packed_attention(tiny_llama())
    ids = torch.randint(2, 100, (2, 6))
    with pytest.raises(ValueError, match="attn_implementation='dcp' got an attention mask"):
        model(input_ids=ids, attention_mask=torch.tensor([[1] * 6, [1] * 4 + [0] * 2]))


def test_packed_variant_replaces_every_attention_and_adds_no_collective(fake_world):
    model = _model()
    # compiled whole: the test reads the partitioned forward and backward graphs
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "aot_eager", "regions": False})
    packed = dcp.pack_sequences(_sequences((6, 10), seed=0))
    for packed_call in (False, True):
        lengths = packed.sequence_lengths if packed_call else None
        with dcp.use(dcp.Variant(2), sequence_lengths=lengths):
            compiled(packed.input_ids, packed.labels, packed.position_ids).backward()
    graph = dcp.explain(compiled, packed.input_ids, packed.labels, packed.position_ids)[0]
    plain, varlen = graph.variants[dcp.Variant(2)], graph.variants[dcp.Variant(2, packed=True)]
    sdpa_call = re.compile(r"torch\.ops\.aten\._?scaled_dot_product")
    assert "varlen_attention_fwd" not in plain.forward_graph and sdpa_call.search(plain.forward_graph)
    assert varlen.forward_graph.count("dcp.varlen_attention_fwd.default(") == 2
    assert varlen.backward_graph.count("dcp.varlen_attention_bwd.default(") == 2
    assert not sdpa_call.search(varlen.forward_graph + varlen.backward_graph)
    assert plain.collectives["all_to_all_single"] == 8  # Ulysses: 2 attentions x (q, k, v, out)
    assert varlen.collectives == plain.collectives  # packing changes the attention, not the communication


def test_masked_attention_cannot_be_packed(fake_world):
    case = ZOO["handwritten_attention"]
    model = case.build()
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager"})
    inputs = case.make_inputs(8, batch_size=1)
    with pytest.raises(CannotPack, match="attention mask"), dcp.use(dcp.Variant(2), sequence_lengths=[3, 5]):
        compiled(**inputs)


def test_sequence_lengths_must_cover_the_row(fake_world):
    model = _model()
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={"inner": "eager"})
    packed = dcp.pack_sequences(_sequences((6, 10), seed=0))
    with pytest.raises(Exception, match="cu_seqlens ends at 15 but q has 16 tokens"):
        with dcp.use(dcp.Variant(1), sequence_lengths=[6, 9]):
            compiled(packed.input_ids, packed.labels, packed.position_ids)


def test_pack_sequences_layout():
    packed = dcp.pack_sequences([torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10])])
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 10]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert packed.labels.tolist() == [[5, 6, 7, -100, -100, 10]]
    assert packed.sequence_lengths == [3, 1, 2]
    with pytest.raises(ValueError, match="sequence_lengths must be positive"):
        with dcp.use(dcp.Variant(1), sequence_lengths=[3, 0]):
            pass
