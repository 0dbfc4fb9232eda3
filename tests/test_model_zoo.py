"""Fast sanity checks of the model zoo itself, so parity failures can be blamed on the compiler.

Everything runs eagerly on CPU in one process; the only compiler used is the stock
``aot_eager`` backend, as a baseline the dcp backend's parity tests can be read against.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

try:  # tests/conftest.py puts tests/ on sys.path; import by the same name as parity.py does
    from model_zoo import ZOO, ZooCase, dit_image_hw, eager_reference, output_tensors
except ImportError:  # only the repo root on sys.path
    from tests.model_zoo import ZOO, ZooCase, dit_image_hw, eager_reference, output_tensors

EAGER_LENGTHS = (1, 3, 7, 16)
# Two lengths for the compile check, chosen so that no size in any input equals another size of
# the same inputs (B=2, C=4, text 77x48, ViT in_dim 24): with dynamic=True, Dynamo "duck sizes"
# equal sizes to one symbol, so e.g. a DiT image of height 4 would share C's symbol and get
# specialised by the conv (seq_len 6 -> H=4 recompiles at the next length). DiT grids: 3x4, 4x5.
COMPILE_LENGTHS = (12, 20)
LM_CASES = {"gpt", "gqa", "hf_llama", "hf_gpt2", "custom_function", "moe", "moe_capacity", "alibi"}
# aot_eager compiles with dynamic shapes cost ~10-25 s of CPU per model (fwd + bwd), so only these
# run in the quick tier; the rest are marked slow (deselect with -m "not slow").
QUICK_COMPILE_CASES = {"gpt", "vit", "no_attention"}


@pytest.fixture(autouse=True, scope="module")
def _single_intra_op_thread():
    """The zoo's tensors are tiny, so intra-op threads only add sync overhead; on a loaded CPU
    box OpenMP spin-waiting made a ViT forward+backward ~100x slower (0.5 s vs 5 ms)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _case(name: str) -> ZooCase:
    case = ZOO[name]
    for pkg in case.requires:
        pytest.importorskip(pkg)
    return case


def _logits(outputs: object) -> torch.Tensor:
    """Logits of a causal-LM case: the zoo's own models return ``(loss, logits)``, HF a ModelOutput."""
    return outputs["logits"] if isinstance(outputs, dict) else outputs[1]


def _run(case: ZooCase, model: torch.nn.Module, seq_len: int) -> tuple[object, dict[str, torch.Tensor]]:
    """Forward + backward of ``case.loss_of``; returns outputs and grads by parameter name."""
    model.zero_grad(set_to_none=True)
    outputs = model(**case.make_inputs(seq_len))
    case.loss_of(outputs).backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return outputs, grads


@pytest.mark.parametrize("seq_len", EAGER_LENGTHS)
@pytest.mark.parametrize("name", list(ZOO))
def test_eager_forward_backward(name: str, seq_len: int) -> None:
    case = _case(name)
    model = case.build()
    outputs, grads = _run(case, model, seq_len)

    for key, value in output_tensors(outputs).items():
        if name in LM_CASES and seq_len == 1 and key in ("0", "loss"):
            # Shifted labels leave no target at length 1: mean over nothing, NaN as in HF.
            assert value.isnan(), "LM loss at seq_len 1 should be NaN (no targets)"
            continue
        assert value.dtype == torch.float32, key
        assert torch.isfinite(value).all(), f"{name}: output {key} not finite"
    assert torch.isfinite(case.loss_of(outputs))

    params = dict(model.named_parameters())
    assert set(grads) == {n for n, p in params.items() if p.requires_grad}, "some parameters got no grad"
    for param_name, grad in grads.items():
        assert torch.isfinite(grad).all(), param_name
        # At length 1 softmax over a single key has zero gradient wrt q and k; from length 3 on,
        # every parameter must actually be reached.
        if seq_len >= 3:
            assert grad.abs().sum() > 0, f"{name}: zero grad for {param_name} at seq_len {seq_len}"


@pytest.mark.parametrize("name", list(ZOO))
def test_build_and_inputs_are_deterministic(name: str) -> None:
    case = _case(name)
    a, b = case.build().state_dict(), case.build().state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x, y = case.make_inputs(5, seed=3), case.make_inputs(5, seed=3)
    assert all(torch.equal(x[k], y[k]) for k in x)
    z = case.make_inputs(5, seed=4)
    assert any(not torch.equal(x[k], z[k]) for k in x)


@pytest.mark.parametrize("seq_len", EAGER_LENGTHS)
@pytest.mark.parametrize("name", ["gpt", "dit", "vit", "handwritten_attention", "gqa", "no_attention"])
def test_seq_len_of(name: str, seq_len: int) -> None:
    case = ZOO[name]
    inputs = case.make_inputs(seq_len, batch_size=3)
    expected = seq_len + 1 if name == "vit" else seq_len  # ViT prepends a CLS token
    assert case.seq_len_of(inputs) == expected
    assert next(iter(inputs.values())).shape[0] == 3


@pytest.mark.parametrize("seq_len, hw", [(1, (2, 2)), (7, (2, 14)), (12, (6, 8)), (16, (8, 8)), (30, (10, 12))])
def test_dit_image_hw(seq_len: int, hw: tuple[int, int]) -> None:
    assert dit_image_hw(seq_len) == hw
    assert ZOO["dit"].make_inputs(seq_len)["x"].shape[-2:] == hw


def test_vit_rejects_too_long() -> None:
    with pytest.raises(ValueError):
        ZOO["vit"].make_inputs(257)


@pytest.mark.parametrize("name", sorted(n for n, c in ZOO.items() if c.causal))
def test_causal_outputs_depend_only_on_prefix(name: str) -> None:
    case = _case(name)
    model = case.build()
    full = case.make_inputs(16)
    with torch.no_grad():
        full_logits = _logits(model(**full))
        for prefix in (1, 5, 11):
            inputs = {k: v[:, :prefix] for k, v in full.items()}
            logits = _logits(model(**inputs))
            torch.testing.assert_close(logits, full_logits[:, :prefix], rtol=1e-5, atol=1e-5)
        # Changing a later token must not change earlier positions but must change its own.
        changed = dict(full)
        changed["input_ids"] = full["input_ids"].clone()
        changed["input_ids"][:, 9] = (changed["input_ids"][:, 9] + 1) % 128
        changed.pop("labels")
        logits = _logits(model(**changed))
    torch.testing.assert_close(logits[:, :9], full_logits[:, :9], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits[:, 9:], full_logits[:, 9:])


def test_bidirectional_models_are_not_causal() -> None:
    """Guards against a zoo bug that would make the non-causal cases trivially shardable."""
    case = ZOO["handwritten_attention"]
    model = case.build()
    inputs = case.make_inputs(8)
    with torch.no_grad():
        base = model(**inputs)
        inputs["input_ids"][:, -1] = (inputs["input_ids"][:, -1] + 1) % 128
        changed = model(**inputs)
    assert not torch.allclose(base[0, 0], changed[0, 0])  # sample 0 has no padding


def test_padding_mask_hides_padded_keys() -> None:
    case = ZOO["handwritten_attention"]
    model = case.build()
    inputs = case.make_inputs(8)
    assert inputs["attention_mask"][1].tolist() == [1, 1, 1, 1, 1, 1, 0, 0]
    with torch.no_grad():
        base = model(**inputs)
        inputs["input_ids"][1, -1] = (inputs["input_ids"][1, -1] + 1) % 128
        changed = model(**inputs)
    torch.testing.assert_close(changed[1, :-1], base[1, :-1], rtol=0, atol=1e-6)


def test_eager_reference_matches_manual_run() -> None:
    case = ZOO["vit"]
    outputs, grads = eager_reference(case, 7)
    manual_outputs, manual_grads = _run(case, case.build(), 7)
    torch.testing.assert_close(outputs[0], manual_outputs[0].detach(), rtol=0, atol=0)
    assert grads.keys() == manual_grads.keys()
    assert all(torch.equal(grads[k], manual_grads[k]) for k in grads)
    assert all(not t.requires_grad for t in output_tensors(outputs).values())


@pytest.mark.parametrize("name", list(ZOO))
def test_graph_breaks(name: str) -> None:
    """``torch._dynamo.explain`` reports exactly the case's known graph breaks (cheap: no AOT)."""
    case = _case(name)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(case.build())(**case.make_inputs(COMPILE_LENGTHS[0]))
    torch._dynamo.reset()
    reasons = [r.reason for r in explanation.break_reasons]
    assert explanation.graph_break_count == case.expected_graph_breaks, reasons


@pytest.mark.parametrize(
    "name", [n if n in QUICK_COMPILE_CASES else pytest.param(n, marks=pytest.mark.slow) for n in ZOO]
)
def test_compile_aot_eager_matches_eager(name: str) -> None:
    """``torch.compile(dynamic=True)`` with aot_eager: same outputs/grads, one compile, no surprises.

    Also pins the graph count (1 + the case's known graph breaks) and that the second length
    reuses the first compile, so a zoo change that adds a graph break or a shape specialisation
    is caught here rather than showing up as a confusing dcp parity failure.
    """
    case = _case(name)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    model = case.build()
    compiled = torch.compile(model, backend=counter, dynamic=True)
    graphs_after_first = None
    for seq_len in COMPILE_LENGTHS:
        ref_outputs, ref_grads = eager_reference(case, seq_len)
        outputs, grads = _run(case, compiled, seq_len)
        got, want = output_tensors(outputs), output_tensors(ref_outputs)
        assert got.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5, msg=f"{name} output {key}")
        assert {k.removeprefix("_orig_mod.") for k in grads} == ref_grads.keys()
        for key, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[key.removeprefix("_orig_mod.")], rtol=1e-4, atol=1e-5)
        # CompileCounterWithBackend('aot_eager') also records an empty graph per compile
        # (torch 2.13); count only graphs that compute something.
        graphs = sum(1 for g in counter.graphs if any(n.op.startswith("call_") for n in g.graph.nodes))
        if graphs_after_first is None:
            graphs_after_first = graphs
            assert graphs == 1 + case.expected_graph_breaks, f"{name}: {graphs} graphs"
        else:
            assert graphs == graphs_after_first, f"{name}: recompiled at seq_len {seq_len}"
    torch._dynamo.reset()


def test_zoo_imports_without_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    path = Path(__file__).with_name("model_zoo.py")
    spec = importlib.util.spec_from_file_location("_model_zoo_without_hf", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    assert not module.HAS_TRANSFORMERS
    assert not module.ZOO["hf_llama"].available and module.ZOO["gpt"].available
    with pytest.raises(ImportError):
        module.ZOO["hf_llama"].build()
    module.ZOO["gpt"].build()
