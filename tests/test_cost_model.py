"""The cost model: monotone in length, recompute trades memory for time, round trips, calibration."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from dcp_compile.schedule.cost_model import (
    COST_TERMS,
    RECOMPUTE_POLICIES,
    CalibrationPoint,
    CostModel,
    ModelProfile,
    video_attention_span,
)
from dcp_compile.schedule.hardware import Hardware
from dcp_compile.variant import RecomputePolicy

PRESETS = ("stdit3-xl/2", "llama-3-8b")


@pytest.fixture(params=PRESETS)
def cost_model(request) -> CostModel:
    return CostModel(ModelProfile.from_config(request.param), Hardware.H200, optimizer_shards=32)


def test_time_and_memory_grow_with_length(cost_model: CostModel) -> None:
    lengths = [128, 512, 2048, 8192, 32768, 131072]
    for sp in (1, 2, 8, 16):
        for policy in RECOMPUTE_POLICIES:
            times = [cost_model.time([n], sp, policy) for n in lengths]
            memory = [cost_model.peak_memory([n], sp, policy) for n in lengths]
            assert all(a < b for a, b in zip(times, times[1:])), (sp, policy, times)
            assert all(a < b for a, b in zip(memory, memory[1:])), (sp, policy, memory)
    # Attention makes time superlinear in one sequence's length, but not in a packed batch's.
    one_long = cost_model.time([65536], 1, "full")
    many_short = cost_model.time([1024] * 64, 1, "full")
    assert one_long > many_short


def test_recompute_trades_memory_for_time(cost_model: CostModel) -> None:
    """Each policy slower and lighter than the one before, compiled whole. Under regions (the
    default) \`full\` checkpoints each region and keeps more than whole-graph \`selective\` at SP 1 on
    a DiT: test_regional_memory.py; the planner then never picks it there (slower and heavier)."""
    cost_model = replace(cost_model, regions=False)
    for sp in (1, 4):
        # Without sequence parallelism `block` is `full` (no all-to-all to keep or send again).
        policies = RECOMPUTE_POLICIES if sp > 1 else [p for p in RECOMPUTE_POLICIES if p != RecomputePolicy.BLOCK]
        times = [cost_model.time([16384], sp, p) for p in policies]
        assert times == sorted(times) and len(set(times)) == len(times), times
        # `lean`'s tiled MLP holds a chunk (4,096 tokens a rank) whatever the length: it holds less
        # than `offload` only past a chunk per rank; the rest hold less at every length.
        for length in (16384, 262144):
            ladder = policies if length > 4096 * sp * 4 else [p for p in policies if p is not RecomputePolicy.LEAN]
            memory = [cost_model.peak_memory([length], sp, p) for p in ladder]
            assert memory == sorted(memory, reverse=True) and len(set(memory)) == len(memory), (length, memory)
        capacities = [cost_model.token_capacity(sp, p, 100e9) for p in policies]
        assert capacities == sorted(capacities), capacities
    assert cost_model.time([16384], 1, "block") == cost_model.time([16384], 1, "full")
    assert cost_model.peak_memory([16384], 1, "block") == cost_model.peak_memory([16384], 1, "full")
    regional = replace(cost_model, regions=True)  # full keeps each region's inputs; block compiles whole
    assert regional.peak_memory([16384], 1, "block") < regional.peak_memory([16384], 1, "full")


def test_sequence_parallel_splits_work_and_memory(cost_model: CostModel) -> None:
    # More ranks: less time and memory per rank, but more rank-seconds (communication).
    times = [cost_model.time([65536], sp, "full") for sp in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True)
    work = [sp * cost_model.time([65536], sp, "full") for sp in (1, 2, 4, 8)]
    assert work == sorted(work)
    assert cost_model.terms([65536], 1, "full")["communication"] == 0
    assert cost_model.terms([65536], 8, "full")["communication"] > 0
    # Crossing the node boundary (8 GPUs per node) makes the all-to-all slower per byte.
    per_token = {sp: cost_model.raw_term_coefficients(sp, "none")["communication"][1] * sp for sp in (2, 4, 8, 16)}
    assert per_token[16] > 2 * per_token[8]


def test_time_is_separable_over_packed_sequences(cost_model: CostModel) -> None:
    lengths = [300, 5000, 1200]
    coefficients = cost_model.time_coefficients(4, "selective")
    expected = coefficients.fixed + sum(
        coefficients.per_token * n + coefficients.per_token_key * n * n + coefficients.per_sequence for n in lengths
    )
    assert cost_model.time(lengths, 4, "selective") == pytest.approx(expected, rel=1e-12)
    terms = cost_model.terms(lengths, 4, "selective")
    assert set(terms) == set(COST_TERMS)
    assert sum(terms.values()) == pytest.approx(cost_model.time(lengths, 4, "selective"), rel=1e-12)


def test_token_capacity_is_the_memory_boundary(cost_model: CostModel) -> None:
    cap = 0.9 * cost_model.hardware.memory_capacity
    for sp in (1, 2, 8):
        for policy in RECOMPUTE_POLICIES:
            tokens = cost_model.token_capacity(sp, policy, cap)
            assert tokens > 0
            assert cost_model.peak_memory([tokens], sp, policy) <= cap
            assert cost_model.host_peak([tokens], sp, policy) <= cost_model.host_memory_cap
            # one more token passes the device's cap or the host's (offload and lean: a node's
            # 2 TB over 8 ranks binds Llama-sized models at SP 1)
            assert (cost_model.peak_memory([tokens + 1], sp, policy) > cap
                    or cost_model.host_peak([tokens + 1], sp, policy) > cost_model.host_memory_cap)


def test_video_span_makes_spatial_temporal_attention_cheaper() -> None:
    model = CostModel(ModelProfile.from_config("open-sora-v1.2"), Hardware.H200)
    frames, height, width = 120, 45, 80
    tokens = frames * height * width
    full = model.time([tokens], 8, "full")
    factored = model.time([tokens], 8, "full", [video_attention_span(frames, height, width)])
    assert factored < full / 10


def test_save_load_round_trip(tmp_path, cost_model: CostModel) -> None:
    calibrated = cost_model.calibrate(
        lambda lengths, sp, policy: 1.3 * cost_model.time(lengths, sp, policy),
        cost_model.calibration_points(8192, sp_sizes=(1, 2)),
        progress=False,
    )
    path = tmp_path / "cost.json"
    calibrated.save(path)
    loaded = CostModel.load(path)
    assert loaded.profile == calibrated.profile
    assert loaded.hardware == calibrated.hardware
    assert loaded.scales == calibrated.scales
    for sp, policy in ((1, "none"), (4, "full"), (16, "attention")):
        assert loaded.time([777, 4096], sp, policy) == calibrated.time([777, 4096], sp, policy)
        assert loaded.peak_memory([4096], sp, policy) == calibrated.peak_memory([4096], sp, policy)
    with pytest.raises(ValueError, match="not a dcp-compile cost model"):
        (tmp_path / "other.json").write_text('{"profile": {}}')
        CostModel.load(tmp_path / "other.json")


def test_calibration_recovers_known_scales() -> None:
    profile = ModelProfile.from_config("llama-3-8b")
    initial = CostModel(profile, Hardware.H200, optimizer_shards=8)
    true_scales = {"linear": 1.9, "attention": 2.6, "memory": 1.2, "communication": 3.1, "overhead": 0.7}
    truth = CostModel(profile, Hardware.H200, scales=true_scales, optimizer_shards=8)
    points = initial.calibration_points(16384, sp_sizes=(1, 2, 4, 16))

    fitted = initial.calibrate(lambda l, s, r: truth.time(l, s, r), points, progress=False)
    for term, value in true_scales.items():
        assert fitted.scales[term] == pytest.approx(value, rel=1e-6), term
    assert fitted.calibration.max_relative_error < 1e-9

    # With 1% measurement noise the well-determined terms stay within a few percent and the
    # predictions within the noise; the two fixed per-micro-batch terms (weight reads, launch
    # overhead) are nearly collinear, so only their sum is pinned down.
    rng = random.Random(0)
    noisy = initial.calibrate(lambda l, s, r: truth.time(l, s, r) * (1 + rng.gauss(0, 0.01)), points, progress=False)
    for term in ("linear", "attention", "communication"):
        assert noisy.scales[term] == pytest.approx(true_scales[term], rel=0.05), term
    for point in points:
        assert noisy.time(point.lengths, point.sp_size, point.recompute) == pytest.approx(
            truth.time(point.lengths, point.sp_size, point.recompute), rel=0.04
        )


def test_calibration_keeps_terms_it_cannot_see() -> None:
    model = CostModel(ModelProfile.from_config("llama-3-8b"), Hardware.H200)
    points = [CalibrationPoint((n,), 1, "none") for n in (256, 1024, 4096, 16384)]
    fitted = model.calibrate(lambda l, s, r: 2 * model.time(l, s, r), points, progress=False)
    assert "communication" in fitted.calibration.fixed_terms
    assert fitted.scales["communication"] == model.scales["communication"]
    with pytest.raises(ValueError, match="positive seconds"):
        model.calibrate(lambda l, s, r: 0.0, points, progress=False)


def test_presets_have_the_published_shapes() -> None:
    video = ModelProfile.from_config("stdit3-xl/2")
    assert video.num_layers == 56 and video.hidden_size == 1152 and video.num_heads == 16
    assert 1.0e9 < video.parameter_bytes / 2 < 1.3e9  # ~1.1B parameters in bf16
    llm = ModelProfile.from_config("llama-3-8b")
    assert llm.num_kv_heads == 8 and llm.causal
    assert 7.5e9 < llm.parameter_bytes / 2 < 8.5e9
    hf_like = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256, "hidden_act": "silu"}
    assert ModelProfile.from_config(hf_like).linear_flops_per_token == pytest.approx(llm.linear_flops_per_token)
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelProfile.from_config("gpt-17")


def test_a_hugging_face_llama_config_reads_as_rotary_in_either_major_version() -> None:
    """transformers 4 kept ``rope_theta`` on the config, transformers 5 inside ``rope_parameters``:
    either way ``full`` keeps the one RoPE table the model hands every block (under 5 it was read
    as a model without one)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)

    def kept(profile: ModelProfile) -> float:
        return profile.head_activation_bytes_per_token["full"]

    shape = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=128, gated_mlp=True,
                 vocab_size=256)
    with_table = kept(ModelProfile.transformer("t", rotary=True, **shape))
    assert with_table > kept(ModelProfile.transformer("t", rotary=False, **shape))
    assert kept(ModelProfile.from_config(config)) == with_table
    fields = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "vocab_size": 256, "hidden_act": "silu"}
    assert kept(ModelProfile.from_config({**fields, "rope_theta": 5e5})) == with_table
    assert kept(ModelProfile.from_config({**fields, "rope_parameters": {"rope_theta": 5e5}})) == with_table
    assert kept(ModelProfile.from_config(fields)) < with_table


class _TinyBlock(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, -1))
        return x + self.mlp(x)


class _TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 100, width: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(_TinyBlock(width, heads) for _ in range(layers))
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_measure_counts_the_traced_model() -> None:
    torch.manual_seed(0)
    width, vocab, layers = 32, 100, 2
    model = _TinyLM(vocab, width, 4, layers)
    profile = ModelProfile.measure(model, lambda n: (torch.randint(0, vocab, (1, n)),), lengths=(16, 32, 64), causal=True)
    per_block = 2 * (width * 3 * width + width * width + 2 * width * 4 * width)
    assert profile.linear_flops_per_token == pytest.approx(layers * per_block + 2 * width * vocab, rel=1e-6)
    assert profile.attention_flops_per_token_key == pytest.approx(layers * 4 * width / 2, rel=1e-6)
    assert profile.num_attention_layers == layers and profile.num_heads == 4 and profile.hidden_size == width
    # Saved activations: at least the block's own tensors, and no quadratic buffer.
    assert 8 * width * 4 < profile.activation_bytes_per_token["none"] < 100 * width * 4
    model_time = CostModel(profile, Hardware.this_cpu())
    assert model_time.time([64], 1) < model_time.time([128], 1)


@pytest.mark.parametrize("preset", PRESETS)
def test_block_is_what_collectives_recomputed_made_of_full(preset: str) -> None:
    """``block`` is the published whole-block checkpointing that ``collectives_recomputed=True``
    priced ``full`` as (for the published baselines): the same time, terms and peak memory at
    every SP size; without the flag ``full`` keeps the all-to-alls' outputs and sends 8 per layer."""
    profile = ModelProfile.from_config(preset)
    ours = CostModel(profile, Hardware.H100, optimizer_shards=32)
    published = CostModel(profile, Hardware.H100, optimizer_shards=32, collectives_recomputed=True)
    for sp in (1, 2, 8, 32):
        assert ours.terms([20000, 3000], sp, "block") == published.terms([20000, 3000], sp, "full")
        assert ours.terms([20000, 3000], sp, "block") == published.terms([20000, 3000], sp, "block")
        assert ours.memory_coefficients(sp, "block") == published.memory_coefficients(sp, "full")
        assert ours.token_capacity(sp, "block", 70e9) == published.token_capacity(sp, "full", 70e9)
    # A layer sends 12 all-to-alls per micro-batch under block, 8 under full.
    block, full = ours.raw_term_coefficients(8, "block"), ours.raw_term_coefficients(8, "full")
    assert block["communication"][1] == pytest.approx(1.5 * full["communication"][1], rel=1e-12)
    assert ours.memory_coefficients(8, "block").bytes_per_token < ours.memory_coefficients(8, "full").bytes_per_token


def test_block_capacity_grows_linearly_with_the_sp_size() -> None:
    """Llama-3-8B on H100s, optimizer state sharded over the world: under ``block`` a rank keeps
    per token of its share what it keeps at SP 1 (each block's input), so a micro-batch holds about
    ``P`` times the tokens of SP 1. What does depend on the SP size is the working set of one
    block's backward: the all-to-alls' outputs it receives again (KV heads replicated up to the SP
    size) on top of the local q, k, v it rebuilds. Under ``full`` each layer also keeps q, k, v and
    the attention output as the all-to-alls delivered them, and capacity grows sub-linearly."""
    profile = ModelProfile.from_config("llama-3-8b")
    # whole-graph `full` (under regions, the default, it keeps each region's inputs: test_regional_memory.py)
    model = CostModel(profile, Hardware.H100, optimizer_shards=32, regions=False)
    cap = 0.9 * Hardware.H100.memory_capacity
    at_sp1 = model.token_capacity(1, "block", cap)
    assert at_sp1 == model.token_capacity(1, "full", cap) > 0
    saved_sp1 = profile.saved_activation_bytes_per_token("block", 1)
    working_sp1 = profile.backward_working_bytes_per_token("block", 1)
    dtype, head_dim, kv_heads = profile.activation_dtype_bytes, profile.head_dim, profile.num_kv_heads
    for sp in (2, 8, 32):
        assert profile.saved_activation_bytes_per_token("block", sp) == saved_sp1
        received_again = profile.attention_kept_bytes_per_token("full", sp)  # q, k, v delivered, output returned
        replicated_gradients = dtype * 2 * 2 * head_dim * (max(kv_heads, sp) - kv_heads)
        extra = profile.backward_working_bytes_per_token("block", sp) - working_sp1
        assert 0 <= extra <= received_again + replicated_gradients
        assert model.memory_coefficients(sp, "block").bytes_per_token * sp == pytest.approx(saved_sp1 + working_sp1 + extra)
    for sp in (8, 32):
        block, full = model.token_capacity(sp, "block", cap), model.token_capacity(sp, "full", cap)
        # about P times (0.96 P at SP 8, 0.94 P at SP 32): with the loss tiled the head holds no
        # vocabulary-wide gradient per token, so what a block's backward receives again (the
        # all-to-alls' outputs, KV heads replicated up to the SP size) weighs a few percent
        assert block >= 0.93 * sp * at_sp1, (sp, block, at_sp1)
        assert full < 0.8 * sp * at_sp1, (sp, full, at_sp1)


def test_a_cost_model_saved_before_block_existed_loads_and_prices_it() -> None:
    """Profiles written with four policies (before ``block``) load with ``full``'s per-layer
    entries for ``block``, which is what ``block`` keeps and recomputes at SP 1."""
    model = CostModel(ModelProfile.from_config("llama-3-8b"), Hardware.H100, optimizer_shards=8)
    data = model.to_dict()
    for key in ("activation_bytes_per_token", "recompute_forward_fraction", "head_activation_bytes_per_token",
                "recomputed_bytes_per_token"):
        del data["profile"][key]["block"]
    loaded = CostModel.from_dict(data)
    for sp in (1, 8):
        assert loaded.memory_coefficients(sp, "block") == model.memory_coefficients(sp, "block")
        assert loaded.time([8192], sp, "block") == model.time([8192], sp, "block")
