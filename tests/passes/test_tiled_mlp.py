"""``tile_mlp``: under ``recompute="lean"`` a transformer's MLPs become ``dcp::tiled_mlp``, whose
forward and backward hold one chunk of tokens' ``ffn``-wide tensors at a time.

The kernel: exact against eager (fp32, every activation, gated and plain, with and without biases,
an uneven last chunk, a chunk longer than the tokens), and its backward's peak of live tensors
within :func:`dcp_compile.tiled_mlp.mlp_chunk_bytes` (what the cost model prices) besides the
gradients it returns. The pass: finds one MLP per layer in the zoo's GPT, Hugging Face Llama and
DiT under ``lean`` and none under ``block``; default deny, with the reason on the record. Parity
on gloo ranks: ``tests/test_tiled_mlp_parity.py``.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import dcp_compile as dcp
from dcp_compile.compiler.passes.tiled_mlp import TILED_MLP, find_mlps
from dcp_compile.kernels import tiled_mlp as kernel
from dcp_compile.tiled_mlp import default_mlp_chunk_tokens, mlp_chunk_bytes
from model_zoo import HAS_TRANSFORMERS, ZOO
from pass_helpers import analyse

ACTIVATION_MODULES = {"silu": nn.SiLU(), "gelu": nn.GELU(), "gelu_tanh": nn.GELU(approximate="tanh"), "relu": nn.ReLU()}


# --- the kernel ----------------------------------------------------------------------------------

def make_mlp(gated: bool, bias: bool, features: int = 16, ffn: int = 40, out: int = 12,
             dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor | None]:
    """``[up_weight, up_bias, gate_weight, gate_bias, down_weight, down_bias]``, leaves that need grad."""
    generator = torch.Generator().manual_seed(seed)

    def parameter(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator, dtype=dtype) / shape[-1] ** 0.5).requires_grad_()

    return [parameter(ffn, features), parameter(ffn) if bias else None,
            parameter(ffn, features) if gated else None, parameter(ffn) if bias and gated else None,
            parameter(out, ffn), parameter(out) if bias else None]


def eager_mlp(x: torch.Tensor, weights: list[torch.Tensor | None], activation: str) -> torch.Tensor:
    up_weight, up_bias, gate_weight, gate_bias, down_weight, down_bias = weights
    act = ACTIVATION_MODULES[activation]
    if gate_weight is None:
        hidden = act(F.linear(x, up_weight, up_bias))
    else:
        hidden = act(F.linear(x, gate_weight, gate_bias)) * F.linear(x, up_weight, up_bias)
    return F.linear(hidden, down_weight, down_bias)


CASES = list(itertools.product([True, False], [True, False], kernel.ACTIVATIONS, [7, 50, 64]))


@pytest.mark.parametrize("gated, bias, activation, chunk", CASES,
                         ids=[f"{'gated' if g else 'plain'}-{'bias' if b else 'nobias'}-{a}-chunk{c}"
                              for g, b, a, c in CASES])
def test_kernel_matches_eager(gated: bool, bias: bool, activation: str, chunk: int) -> None:
    """50 tokens ([2, 25, 16]): chunks of 7 end with a 1-token chunk, 50 is one chunk, 64 more than the tokens."""
    weights = make_mlp(gated, bias)
    x = torch.randn(2, 25, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    expected = eager_mlp(x, weights, activation)
    actual = TILED_MLP(x, *weights, activation, chunk)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2))
    leaves = [x] + [w for w in weights if w is not None]
    expected_grads = torch.autograd.grad(expected, leaves, grad)
    actual_grads = torch.autograd.grad(actual, leaves, grad)
    for got, want in zip(actual_grads, expected_grads):  # weight gradients: summed over chunks, one rounding each
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kernel_on_an_empty_share_and_non_contiguous_inputs() -> None:
    """A rank whose share is empty (0 tokens) gets zero weight gradients; a transposed input and a
    gradient that is an expanded scalar (a sum's) are read correctly."""
    weights = make_mlp(True, True)
    empty = torch.zeros(1, 0, 16, requires_grad=True)
    out = TILED_MLP(empty, *weights, "silu", 4)
    assert out.shape == (1, 0, 12)
    grads = torch.autograd.grad(out.sum(), [empty, weights[0]])
    assert grads[0].shape == empty.shape and not grads[1].any()
    x = torch.randn(16, 9, generator=torch.Generator().manual_seed(3)).t().requires_grad_()  # [9, 16], strided
    expected = torch.autograd.grad(eager_mlp(x, weights, "silu").sum(), [x, weights[4]])
    actual = torch.autograd.grad(TILED_MLP(x, *weights, "silu", 4).sum(), [x, weights[4]])
    for got, want in zip(actual, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_kernel_registration_passes_opcheck() -> None:
    """Schema, fake tensor, autograd registration and AOT dispatch agree with the eager kernel."""
    weights = [w.detach().double().requires_grad_() if w is not None else None for w in make_mlp(True, True)]
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(TILED_MLP, (x, *weights, "gelu", 4))


def test_kernel_in_bfloat16_is_close_to_eager() -> None:
    """A low-precision MLP: the weights' gradients are summed over chunks in bfloat16 (one rounding
    per chunk), so close, not equal."""
    weights = make_mlp(True, False, dtype=torch.bfloat16)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(4), dtype=torch.bfloat16, requires_grad=True)
    expected = eager_mlp(x, weights, "silu")
    actual = TILED_MLP(x, *weights, "silu", 16)
    assert actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual, expected, rtol=2e-2, atol=2e-2)
    for got, want in zip(torch.autograd.grad(actual.sum(), [x, weights[0]]),
                         torch.autograd.grad(expected.sum(), [x, weights[0]])):
        torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops made (besides those of ``known`` tensors) that are still alive,
    checked at every op: its ``peak`` is what a function held at once, at op granularity."""

    def __init__(self, known: list[torch.Tensor]) -> None:
        super().__init__()
        self.known = {StorageWeakRef(t.untyped_storage()).cdata for t in known}
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for key, (reference, size) in list(self.storages.items()):  # what was freed since the last op
            if reference.expired():
                del self.storages[key]
                self.live -= size
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                reference = StorageWeakRef(tensor.untyped_storage())
                if reference.cdata not in self.storages and reference.cdata not in self.known:
                    size = tensor.untyped_storage().nbytes()
                    self.storages[reference.cdata] = (reference, size)
                    self.live += size
        self.peak = max(self.peak, self.live)
        return out


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_backward_holds_at_most_one_chunk_as_priced(gated: bool, bias: bool) -> None:
    """The backward op's peak of live tensors, less the gradients it returns (input- and
    weight-sized), is ``mlp_chunk_bytes``: 5 ``[chunk, ffn]`` tensors gated, 3 plain. The forward
    holds 2. 300 tokens in chunks of 32, ffn 512 (the
    ``ffn``-wide tensors dominate); eager's backward would hold ``[300, 512]`` tensors."""
    features, ffn, tokens, chunk = 16, 512, 300, 32
    weights = [w.detach() if w is not None else None for w in make_mlp(gated, bias, features, ffn, features)]
    x = torch.randn(tokens, features)
    grad = torch.randn(tokens, features)
    inputs = [x] + [w for w in weights if w is not None]
    returned = sum(t.numel() * t.element_size() for t in inputs)  # one gradient per input
    budget = mlp_chunk_bytes(chunk, ffn, gated, 4)
    with LiveBytes(inputs + [grad]) as backward:
        grads = kernel.tiled_mlp_backward._init_fn(grad, x, *weights, "silu", chunk)
    assert sum(g.numel() * g.element_size() for g in grads) == returned
    extra = backward.peak - returned
    assert extra == budget, (extra, budget)
    assert extra == (5 if gated else 3) * chunk * ffn * 4  # what the kernel's docstring says it holds
    with LiveBytes(inputs) as forward:
        kernel.tiled_mlp._init_fn(x, *weights, "silu", chunk)
    assert forward.peak - tokens * features * 4 == 2 * chunk * ffn * 4


# --- the pass on the zoo's models -----------------------------------------------------------------

@functools.cache
def lean_records(name: str, policy: str, mlp_chunk: int | None = None, length: int = 12):
    """The zoo case's variant records at SP 1 under ``policy`` (compiled once per module run)."""
    case = ZOO[name]
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = case.build()
    compiled = torch.compile(model, backend="dcp", dynamic=True,
                             options={"inner": "aot_eager", "sp_size": 1, "recompute": policy, "mlp_chunk": mlp_chunk})
    inputs = case.make_inputs(length)
    case.loss_of(compiled(**inputs)).backward()
    records = dcp.explain(compiled, **inputs).variant_records()
    torch._dynamo.reset()
    return records


EXPECTED = {  # per zoo case: the tiled MLPs' modules and their description
    "gpt": ["layers.0.mlp.down_proj", "layers.1.mlp.down_proj"],
    "hf_llama": ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"],
    "dit": ["blocks.0.mlp.2", "blocks.1.mlp.2"],
}
KINDS = {"gpt": "gated silu MLP of width 64", "hf_llama": "gated silu MLP of width 64",
         "dit": "gelu_tanh MLP of width 128"}


@pytest.mark.parametrize("name", [n if n != "dit" else pytest.param(n, marks=pytest.mark.slow) for n in sorted(EXPECTED)])
def test_one_mlp_per_layer_under_lean_and_none_under_block(name: str) -> None:
    if ZOO[name].requires and not HAS_TRANSFORMERS:
        pytest.skip("the Hugging Face Llama needs `pip install .[hf]`")
    (lean,) = lean_records(name, "lean", 5)
    assert len(lean.tiled_mlps) == len(EXPECTED[name]), lean.tiled_mlps
    for note, module in zip(lean.tiled_mlps, EXPECTED[name]):
        assert f"{module}): {KINDS[name]} tiled over 5-token chunks" in note, note
    targets = [n.target for n in lean.graph.graph.nodes if n.op == "call_function"]
    assert targets.count(TILED_MLP) == len(EXPECTED[name])
    assert lean.forward_graph.count("dcp.tiled_mlp.default(") == len(EXPECTED[name])
    assert lean.backward_graph.count("dcp.tiled_mlp_backward.default(") == len(EXPECTED[name])
    ops = [n for n in lean.graph.graph.nodes if n.target is TILED_MLP]
    assert all("recompute" in n.meta for n in ops)  # in its block's recompute region (tagged after the pass)
    (block,) = lean_records(name, "block")
    assert block.tiled_mlps == [] and block.untiled_mlps == []
    assert "tiled_mlp" not in block.forward_graph


def test_dit_refusals_say_why(caplog) -> None:
    """DiT's timestep embedder (``Linear, SiLU, Linear`` over ``[batch, features]``) is not over the
    tokens; its adaLN ``silu(c)`` reads the embedding every block's modulation reads too. Neither is
    over the tokens: no warning."""
    with caplog.at_level("INFO", logger="dcp_compile.compiler.passes.tiled_mlp"):
        (lean,) = lean_records("dit", "lean", 5)
    logged = [r for r in caplog.records if r.name == "dcp_compile.compiler.passes.tiled_mlp"]
    assert logged and not [r.getMessage() for r in logged if r.levelname == "WARNING"]
    reasons = dict(lean.untiled_mlps)
    embedder = [why for where, why in reasons.items() if "t_embedder" in where]
    assert len(embedder) == 1 and "has no dimension of the sequence" in embedder[0], reasons
    modulations = [why for where, why in reasons.items() if "adaLN_modulation" in where]
    assert len(modulations) == 3 and all("is read elsewhere too" in why for why in modulations), reasons
    assert len(reasons) == 4
    text = str_record(lean)
    assert "tiled MLP linear_" in text and "MLP at silu (L['self'].t_embedder.1) not tiled:" in text


def str_record(record) -> str:
    from dcp_compile.compiler.record import GraphRecord

    graph = GraphRecord(0)
    graph.variants[record.variant] = record
    return str(graph)


@pytest.fixture(scope="module")
def gpt_at_sp2():
    """The zoo's GPT at SP 2 under lean on a fake process group: rank 0's records."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    torch._dynamo.reset()
    try:
        case = ZOO["gpt"]
        torch.manual_seed(0)
        compiled = torch.compile(case.build(), backend="dcp", dynamic=True, options={"inner": "aot_eager",
                                                                                  "mlp_chunk": 4})
        inputs = case.make_inputs(13)
        with dcp.use(dcp.Variant(2, "lean")):
            case.loss_of(compiled(**inputs)).backward()
            records = dcp.explain(compiled, **inputs).variant_records()
        yield records
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def test_under_sequence_parallelism_each_rank_tiles_its_share(gpt_at_sp2) -> None:
    (record,) = gpt_at_sp2
    assert record.is_sharded and len(record.sharded_sites) == 2
    assert len(record.tiled_mlps) == 2 and record.untiled_mlps == []
    for op in [n for n in record.graph.graph.nodes if n.target is TILED_MLP]:
        tokens = op.args[0].meta["val"].shape[1]
        assert isinstance(tokens, torch.SymInt) and "//2" in str(tokens), tokens  # this rank's half
    assert record.backward_graph.count("dcp.tiled_mlp_backward.default(") == 2


# --- default deny on small graphs -----------------------------------------------------------------

class SmallMLP(nn.Module):
    """One attention and one MLP in one of several spellings (``kind``)."""

    def __init__(self, kind: str, hidden: int = 16, ffn: int = 32) -> None:
        super().__init__()
        self.kind = kind
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        bias = kind in ("plain_bias", "gated_bias")
        self.up = nn.Linear(hidden, ffn, bias=bias)
        self.gate = nn.Linear(hidden, ffn, bias=bias)
        self.down = nn.Linear(ffn, hidden, bias=bias)
        self.norm = nn.LayerNorm(ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(-2)
        kind = self.kind
        if kind in ("plain", "plain_bias"):
            return x + self.down(F.gelu(self.up(x)))
        if kind == "relu":
            return x + self.down(F.relu(self.up(x)))
        if kind in ("gated", "gated_bias"):
            return x + self.down(F.silu(self.gate(x)) * self.up(x))
        if kind == "gated_swapped":
            return x + self.down(self.up(x) * F.gelu(self.gate(x), approximate="tanh"))
        if kind == "activation_returned":
            hidden = F.silu(self.up(x))
            return x + self.down(hidden), hidden
        if kind == "product_read_twice":
            product = F.silu(self.gate(x)) * self.up(x)
            return x + self.down(product) + product.sum(-1, keepdim=True)
        if kind == "different_inputs":
            return x + self.down(F.silu(self.gate(x)) * self.up(x * 2))
        if kind == "normed":
            return x + self.down(self.norm(F.gelu(self.up(x))))
        if kind == "times_input":
            hidden = F.silu(self.up(x))
            return x + self.down(hidden * hidden)
        raise ValueError(kind)


FOUND = {"plain": ("gelu", False, False), "plain_bias": ("gelu", False, True), "relu": ("relu", False, False),
         "gated": ("silu", True, False), "gated_bias": ("silu", True, True),
         "gated_swapped": ("gelu_tanh", True, False)}
DENIED = {
    "activation_returned": "the activation (silu) is read elsewhere too (linear_2, the graph's output)",
    "product_read_twice": "the gated product (mul) is read elsewhere too",
    "different_inputs": "the gate (linear_1) and up (linear_2) projections read different inputs",
    "normed": "the activation goes to aten.layer_norm.default",
    "times_input": "the activation is multiplied (mul) by aten.silu.default",
}


def mlp_input(length: int = 10) -> torch.Tensor:
    return torch.randn(2, length, 16, generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("kind", sorted(FOUND))
def test_the_pattern_is_found_in_its_spellings(kind: str) -> None:
    gm, _ = analyse(SmallMLP(kind), mlp_input())
    matches, refused = find_mlps(gm)
    assert refused == [] and len(matches) == 1, refused
    (match,) = matches
    activation, gated, bias = FOUND[kind]
    assert (match.activation, match.gated) == (activation, gated)
    assert (match.weights()[1] is not None) == bias and (match.weights()[5] is not None) == bias


@pytest.mark.parametrize("kind", sorted(DENIED))
def test_an_mlp_that_does_not_match_exactly_is_refused_with_its_reason(kind: str) -> None:
    gm, _ = analyse(SmallMLP(kind), mlp_input())
    matches, refused = find_mlps(gm)
    assert matches == [] and len(refused) == 1, (matches, refused)
    assert refused[0][1].startswith(DENIED[kind]), refused


@pytest.mark.parametrize("kind", ["gated_swapped", "product_read_twice"])
def test_lean_equals_eager_tiled_or_refused(kind: str) -> None:
    """At SP 1 under lean, 3-token chunks: a tiled MLP and a refused one (left as it is) both equal eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = SmallMLP(kind)
    x = mlp_input(11)
    expected = model(x).square().mean()
    used = [p for name, p in model.named_parameters() if not name.startswith("norm")]  # the norm is unused here
    expected_grads = torch.autograd.grad(expected, used)
    compiled = torch.compile(model, backend="dcp", dynamic=True, options={
        "inner": "aot_eager", "sp_size": 1, "recompute": "lean", "mlp_chunk": 3})
    loss = compiled(x).square().mean()
    grads = torch.autograd.grad(loss, used)
    (record,) = dcp.explain(compiled, x).variant_records()
    assert len(record.tiled_mlps) == (kind == "gated_swapped") and len(record.untiled_mlps) == (kind != "gated_swapped")
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


def test_disable_passes_turns_it_off() -> None:
    torch._dynamo.reset()
    compiled = torch.compile(SmallMLP("gated"), backend="dcp", dynamic=True, options={
        "inner": "eager", "sp_size": 1, "recompute": "lean", "disable_passes": ["tile_mlp"]})
    x = mlp_input()
    compiled(x)
    (record,) = dcp.explain(compiled, x).variant_records()
    assert record.tiled_mlps == [] and "tile_mlp_pass" not in [p.name for p in record.passes]
    torch._dynamo.reset()


def test_mlp_chunk_must_be_a_positive_token_count() -> None:
    from dcp_compile.compiler.options import parse_options

    assert parse_options({"mlp_chunk": 128}).mlp_chunk == 128
    assert parse_options({}).mlp_chunk is None
    for wrong in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="mlp_chunk="):
            parse_options({"mlp_chunk": wrong})


def test_the_default_chunk_is_the_shared_rule() -> None:
    """Without ``mlp_chunk`` the pass tiles with ``default_mlp_chunk_tokens`` for the MLP's width,
    gating and dtype: the cost model's rule. Llama-3-8B's (14,336, gated, bf16): 4,096 tokens at
    822 MB; a 65,536-wide fp32 gated MLP: fewer, so that a chunk stays within 1 GiB."""
    assert default_mlp_chunk_tokens(14336, True, 2) == 4096
    assert mlp_chunk_bytes(4096, 14336, True, 2) <= 1 << 30
    wide = default_mlp_chunk_tokens(65536, True, 4)
    assert wide < 4096 and mlp_chunk_bytes(wide, 65536, True, 4) <= 1 << 30 < mlp_chunk_bytes(wide + 1, 65536, True, 4)
    torch._dynamo.reset()
    compiled = torch.compile(SmallMLP("gated"), backend="dcp", dynamic=True,
                             options={"inner": "eager", "sp_size": 1, "recompute": "lean"})
    x = mlp_input()
    compiled(x)
    (record,) = dcp.explain(compiled, x).variant_records()
    assert len(record.tiled_mlps) == 1
    assert f"over {default_mlp_chunk_tokens(32, True, 4)}-token chunks" in record.tiled_mlps[0], record.tiled_mlps
    torch._dynamo.reset()


class AttentionThenSharedProduct(nn.Module):
    """One causal attention, then an MLP whose gated product is read twice (left untiled under lean)."""

    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = SmallMLP("product_read_twice")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, width // self.heads).unbind(2)
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, width))
        return self.mlp(x)


def test_an_untiled_mlp_over_the_tokens_warns_that_lean_under_prices_it(caplog) -> None:
    """The memory model prices ``lean`` with every MLP tiled: one the pass refuses over the tokens
    keeps its ffn-wide tensors whole, so the user is told (with what to do); an MLP over something
    else (a timestep embedding, test_dit_refusals_say_why) stays at info."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    compiled = torch.compile(AttentionThenSharedProduct(), backend="dcp", dynamic=True,
                             options={"inner": "aot_eager", "sp_size": 1, "recompute": "lean", "mlp_chunk": 3})
    with caplog.at_level("WARNING", logger="dcp_compile.compiler.passes.tiled_mlp"):
        compiled(mlp_input(11)).square().mean().backward()
    torch._dynamo.reset()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "not tiled" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert "under recompute=lean the MLP at silu" in warnings[0] and "the gated product (mul) is read elsewhere too" in warnings[0]
    assert "more than the memory model priced" in warnings[0] and "recompute_policies" in warnings[0]
