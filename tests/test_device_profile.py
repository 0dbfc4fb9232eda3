"""``dcp.profile``: the cost model measured on the device (here the CPU), fitted and checked on
points it did not see; and how a measured model plans (measured compute, modelled communication)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist

import dcp_compile as dcp
from dcp_compile.demo.example_models import TinyGPT
from dcp_compile.device_profile import default_held_out_lengths
from dcp_compile.device_profile.fake_world import ProfilingWorldError
from dcp_compile.schedule.analytic import ScoreLayout
from dcp_compile.schedule.measured_costs import MeasuredCosts, Measurement, fit_all, fit_variant, markdown_report
from dcp_compile.variant import RecomputePolicy

VOCAB = 256


def _tiny_model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(VOCAB, 64, 2, 4)


def _inputs(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
    return ids, ids


# --------------------------------------------------------------------------- the fit
def test_fit_recovers_the_separable_form_from_exact_points() -> None:
    fixed, per_token, per_key = 2e-3, 5e-6, 3e-9
    points = [Measurement((n,), 2, "none", fixed + per_token * n + per_key * n * n) for n in (64, 128, 256, 512, 1024)]
    fit = fit_variant(points)
    assert fit.fixed == pytest.approx(fixed, rel=1e-6)
    assert fit.per_token == pytest.approx(per_token, rel=1e-6)
    assert fit.per_token_key == pytest.approx(per_key, rel=1e-6)
    assert fit.max_tokens == 1024


def test_packed_rows_give_a_per_sequence_term_apart_from_the_fixed_one() -> None:
    def seconds(lengths):
        return 1e-3 + 4e-6 * sum(lengths) + 2e-9 * sum(n * n for n in lengths) + 5e-4 * (len(lengths) - 1)

    rows = [(n,) for n in (64, 128, 256, 512, 1024)] + [(256,) * 4, (64,) * 16]
    fit = fit_variant([Measurement(row, 1, "none", seconds(row)) for row in rows])
    assert fit.per_sequence == pytest.approx(5e-4, rel=1e-3)
    assert fit.fixed == pytest.approx(1e-3 - 5e-4, rel=1e-3)  # the first sequence's share is per_sequence
    assert fit.seconds([30] * 30) == pytest.approx(seconds([30] * 30), rel=1e-3)


def test_the_profile_design_tells_per_sequence_work_from_attention() -> None:
    """A kernel with per-sequence work (the CPU reference attention loops over sequences) under an
    attention-dominated cost: the fit of the profile's rows (single lengths and packed_rows) must
    price a row of 256 eight-token documents. Without the many-short row it was priced 27x under."""
    from dcp_compile.device_profile.runner import packed_rows

    def seconds(lengths):
        return 2e-3 + 3e-6 * sum(lengths) + 1.8e-6 * sum(n * n for n in lengths) + 3e-3 * len(lengths)

    fit_lengths = (256, 512, 1024, 2048)
    rows = [(n,) for n in fit_lengths] + packed_rows(fit_lengths, ())
    assert any(len(row) == 256 and row[0] == 8 for row in rows)
    noise = itertools.cycle([1.1, 0.9, 1.08, 0.92, 0.95, 1.05, 0.9, 1.1])  # a shared CPU's 10%
    fit = fit_variant([Measurement(row, 1, "none", seconds(row) * next(noise)) for row in rows])
    assert fit.seconds([8] * 256) == pytest.approx(seconds([8] * 256), rel=0.15)  # the old rows: 0.08x
    assert fit.seconds([1847] + [8] * 25) == pytest.approx(seconds([1847] + [8] * 25), rel=0.15)


def test_reference_kernel_computes_the_scores_the_cost_model_counts(monkeypatch) -> None:
    """The CPU kernel picks a whole masked row or one range per sequence; the cost model's
    DENSE_RANGES layout must count the scores it computes, whichever it picks: exactly without a
    causal mask; with one, a causal query block skips the keys after its last query, so the kernel
    computes between half the count and the count (the fit's per-key term absorbs the factor)."""
    from dcp_compile.kernels import varlen_attention_reference as reference
    from dcp_compile.kernels.dense_ranges import dense_scores

    computed: list[int] = []
    original = reference._block_scores

    def counting(q, k, *args):
        computed.append(q.shape[0] * k.shape[0])
        return original(q, k, *args)

    monkeypatch.setattr(reference, "_block_scores", counting)
    for lengths in ([128] * 4, [600, 40, 40], [300, 300], [64] * 16, [700], [500, 20]):
        q = torch.randn(sum(lengths), 2, 8)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        for causal in (False, True):
            computed.clear()
            reference.attention_forward(q, q, q, cu, causal=causal, scale=0.3)
            if causal:
                assert dense_scores(lengths) / 2 <= sum(computed) <= dense_scores(lengths), lengths
            else:
                assert sum(computed) == dense_scores(lengths), lengths
    assert dense_scores([128] * 4) == 512**2 and dense_scores([64] * 16) == 16 * 64**2


def test_a_whole_row_kernel_is_fitted_only_by_counting_its_scores() -> None:
    """Packed rows priced by a kernel that computes the whole row: per-sequence token-keys cannot
    fit them, the kernel's own count fits them exactly."""
    from dcp_compile.kernels.dense_ranges import dense_scores
    from dcp_compile.schedule.analytic import ScoreLayout

    def seconds(lengths):
        return 1e-3 + 4e-6 * sum(lengths) + 2e-8 * dense_scores(lengths) + 5e-4 * (len(lengths) - 1)

    rows = [(n,) for n in (64, 128, 256, 512, 1024)] + [(128,) * 4, (256,) * 4, (64,) * 16]
    points = [Measurement(row, 1, "none", seconds(row)) for row in rows]
    counted = fit_variant(points, ScoreLayout.DENSE_RANGES)
    assert counted.per_token_key == pytest.approx(2e-8, rel=1e-3)
    assert counted.seconds([100] * 5) == pytest.approx(seconds([100] * 5), rel=1e-3)
    per_sequence = fit_variant(points)
    assert abs(per_sequence.seconds([100] * 5) / seconds([100] * 5) - 1) > 0.25


def test_a_recompute_policy_is_fitted_as_no_recompute_plus_extra_work() -> None:
    """Noise that makes recompute look cheaper per token than no recompute (a loaded machine) must
    not price it below no recompute anywhere: the planner would then choose recompute for speed."""
    none = [Measurement((n,), 1, "none", 2e-3 + 6e-6 * n) for n in (64, 256, 1024)]
    noisy_full = [Measurement((64,), 1, "full", 5e-3), Measurement((256,), 1, "full", 3.5e-3 + 6e-6 * 256),
                  Measurement((1024,), 1, "full", 2.5e-3 + 5.5e-6 * 1024)]
    free = fit_variant(noisy_full)
    lengths = (16, 64, 300, 1024, 2048, 8192)
    assert any(free.seconds([n]) < fit_variant(none).seconds([n]) for n in lengths)  # what a free fit says
    fits = {fit.recompute: fit for fit in fit_all(none + noisy_full)}
    for n in lengths:
        assert fits[RecomputePolicy.FULL].seconds([n]) >= fits[RecomputePolicy.NONE].seconds([n])


def test_fit_refuses_mixed_variants_and_drops_the_quadratic_with_two_lengths() -> None:
    with pytest.raises(ValueError, match="one variant at a time"):
        fit_variant([Measurement((64,), 1, "none", 1.0), Measurement((64,), 2, "none", 1.0)])
    line = fit_variant([Measurement((100,), 1, "full", 1.0 + 0.01 * 100), Measurement((200,), 1, "full", 1.0 + 0.01 * 200)])
    assert line.per_token_key == 0.0 and line.per_token == pytest.approx(0.01, rel=1e-6)


def test_memory_fit_from_allocator_peaks() -> None:
    points = [Measurement((n,), 1, "none", 1e-3 * n, peak_bytes=4096 + 1000.0 * n) for n in (64, 128, 256)]
    fit = fit_variant(points)
    assert fit.activation_bytes_per_token == pytest.approx(1000.0)
    assert fit.activation_fixed_bytes == pytest.approx(4096.0)


def test_held_out_lengths_are_between_and_past_the_fitted_ones() -> None:
    assert default_held_out_lengths((256, 512, 1024)) == (362, 724, 1536)


# --------------------------------------------------------------------------- the cost model it makes
def _synthetic_measured(layout: ScoreLayout = ScoreLayout.PER_SEQUENCE) -> MeasuredCosts:
    points = [Measurement((n,), sp, policy, 1e-3 + 4e-6 * n / sp + 2e-9 * n * n / sp)
              for sp in (1, 2) for policy in ("none", "full") for n in (128, 256, 512, 1024)]
    return MeasuredCosts(device="test device", software={"torch": torch.__version__}, fits=fit_all(points, layout),
                         measurements=tuple(points), score_layout=layout)


def test_measured_variants_plan_with_measured_compute_plus_modelled_communication() -> None:
    profile = dcp.ModelProfile.transformer("t", num_layers=2, hidden_size=64, num_heads=4, vocab_size=VOCAB)
    analytic = dcp.CostModel(profile, dcp.Hardware.this_cpu())
    measured = dcp.CostModel(profile, dcp.Hardware.this_cpu(), measured=_synthetic_measured())
    variable = 4e-6 * 512 + 2e-9 * 512 * 512
    assert measured.time([512], 1) == pytest.approx(1e-3 + variable, rel=1e-6)  # SP 1: no communication
    communication = analytic.terms([512], 2)["communication"]
    assert communication > 0
    assert measured.time([512], 2) == pytest.approx(1e-3 + variable / 2 + communication, rel=1e-6)
    assert measured.source(2, "full") == "measured on test device"
    assert measured.source(1, "selective").startswith("analytic prior scaled to sp=1/")
    assert analytic.source(1, "none") == "analytic"
    # An unmeasured SP size: the prior scaled by how the nearest measured variant compared with its own.
    prior_ratio = measured.time([1024], 2, "none") / analytic.time([1024], 2, "none")
    assert 0 < measured.time([4096], 4) < math.inf and prior_ratio > 0


def test_block_plans_with_the_measured_compute_of_full_and_its_own_communication() -> None:
    """``dcp.profile`` does not measure ``block`` by default: on its fake world ``block``'s compute
    is ``full``'s. Where ``full`` was measured at an SP size, ``block`` there costs ``full``'s
    measured compute plus its own modelled communication (the all-to-alls sent again)."""
    profile = dcp.ModelProfile.transformer("t", num_layers=2, hidden_size=64, num_heads=4, vocab_size=VOCAB)
    analytic = dcp.CostModel(profile, dcp.Hardware.this_cpu())
    measured = dcp.CostModel(profile, dcp.Hardware.this_cpu(), measured=_synthetic_measured())
    assert dcp.RecomputePolicy.BLOCK not in dcp.device_profile.MEASURED_POLICIES
    assert measured.source(2, "block") == "measured on test device as full"
    resent = analytic.terms([700], 2, "block")["communication"] - analytic.terms([700], 2, "full")["communication"]
    assert resent > 0
    assert measured.time([700], 2, "block") == pytest.approx(measured.time([700], 2, "full") + resent, rel=1e-9)
    assert measured.time([700], 1, "block") == pytest.approx(measured.time([700], 1, "full"), rel=1e-12)
    # Its memory is its own, modelled (it keeps no all-to-all output), not what full measured.
    assert measured.peak_memory([700], 2, "block") == analytic.peak_memory([700], 2, "block")


def test_measured_cost_model_round_trips_through_json(tmp_path) -> None:
    profile = dcp.ModelProfile.transformer("t", num_layers=2, hidden_size=64, num_heads=4, vocab_size=VOCAB)
    model = dcp.CostModel(profile, dcp.Hardware.this_cpu(), measured=_synthetic_measured(ScoreLayout.DENSE_RANGES))
    model.save(tmp_path / "cost.json")
    loaded = dcp.CostModel.load(tmp_path / "cost.json")
    assert loaded.measured == model.measured
    assert loaded.score_layout == model.score_layout == ScoreLayout.DENSE_RANGES
    for sp in (1, 2, 4):
        assert loaded.time([300, 200], sp, "full") == pytest.approx(model.time([300, 200], sp, "full"))
    # A short packed row is one masked pass on the CPU: priced as 500^2 scores, not 300^2 + 200^2.
    assert model.time([300, 200], 1) == pytest.approx(model.time([500], 1) + model.time_coefficients(1, "none").per_sequence)
    assert "test device" in markdown_report(loaded.measured)


# --------------------------------------------------------------------------- measuring on this CPU
@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> tuple[dcp.CostModel, object]:
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("profile") / "tiny.json"
    model = _tiny_model()
    cost_model = dcp.profile(model, _inputs, lengths=(64, 128, 256, 512), sp_sizes=(1, 2),
                             recompute=("none", "full"), causal=True, inner="aot_eager", repeats=3,
                             path=path, progress=False)
    return cost_model, path


def test_profile_measures_every_variant_and_checks_points_it_did_not_fit(profiled) -> None:
    cost_model, _ = profiled
    measured = cost_model.measured
    assert {(f.sp_size, f.recompute) for f in measured.fits} == {
        (1, RecomputePolicy.NONE), (1, RecomputePolicy.FULL), (2, RecomputePolicy.NONE), (2, RecomputePolicy.FULL)}
    assert len(measured.measurements) == 16 and len(measured.held_out) == 16
    assert {h.measurement.lengths[0] for h in measured.held_out} == {91, 181, 362, 768}
    assert all(m.seconds > 0 and len(m.repeats) == 3 for m in measured.measurements)
    median, worst = measured.held_out_summary()
    # A shared, loaded CPU: the bound is loose, but a fit that is wrong in form (or a prediction
    # for the wrong variant) misses by far more than this.
    assert median < 0.35, markdown_report(measured)
    # Per-rank work at SP 2 is cheaper than the whole sequence at SP 1 once the sequence is long.
    fit1, fit2 = measured.fit_for(1, "none"), measured.fit_for(2, "none")
    assert fit2.seconds([512]) < fit1.seconds([512])


def test_profile_reuses_its_file_and_plans(profiled, monkeypatch) -> None:
    cost_model, path = profiled
    from dcp_compile.device_profile import runner

    def must_not_measure(*args, **kwargs):
        raise AssertionError("the saved profile should have been loaded")

    monkeypatch.setattr(runner, "fake_world", must_not_measure)
    loaded = dcp.profile(_tiny_model(), _inputs, sp_sizes=(1, 2), path=path, progress=False)
    assert loaded.measured == cost_model.measured
    sampler = dcp.DataCentricSampler([40, 700, 90, 300, 500, 60] * 4, tokens_per_step=2048, cost_model=loaded,
                                     max_tokens_per_rank=400, seed=0, world_size=2, rank=0, max_sp_size=2)
    step = next(iter(sampler))
    assert step.microbatches and step.predicted_makespan > 0


def test_profile_refuses_a_real_world_and_names_the_fix(tmp_path) -> None:
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(ProfilingWorldError, match="CostModel.load"):
            dcp.profile(_tiny_model(), _inputs, lengths=(16, 32, 64), sp_sizes=(1, 2), progress=False)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # four variants compiled and profiled: about 40 s on 2 free cores
def test_readme_profile_block_runs_as_written(tmp_path, monkeypatch, capsys) -> None:
    """The guide's "Cost model: measured on your device" block (docs/cost-model.md), exactly as
    written, with the fixtures its first line declares."""
    import re

    from doc_blocks import doc_block, run_python_block

    block = doc_block("docs/cost-model.md", "Cost model: measured on your device")
    assert block.startswith("# needs: model, make_inputs")
    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(1)
    run_python_block(block, "docs/cost-model.md", model=_tiny_model(), make_inputs=_inputs, inner="aot_eager")
    assert (tmp_path / "cost_model.json").exists()
    out = capsys.readouterr().out
    assert re.search(r"held-out error: median \d+%, worst \d+%; SP 4 is analytic prior scaled to sp=2/none", out), out
