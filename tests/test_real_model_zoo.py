"""Sharding that holds on real models: the ``diffusers`` DiTs and ``transformers`` families of
``tests/real_models.py`` (tiny random configs, nothing downloaded), each on a 2-rank gloo world.

For every case, compiled once with ``torch.compile(model, backend="dcp", dynamic=True,
options={"inner": "eager", "sp_size": 2})`` and run at an odd and an even token count:

1. sharding (``dcp.explain``): every SP>1 variant that has attention sites has no whole-graph
   fallback, runs every attention site sharded, and has at most the case's gather budget of
   mid-graph all-gathers (0 for decoder LMs, encoders, T5 and token-in/token-out DiTs, 1 for the
   unpatchify of a latent-in DiT; other budgets are stated with their reason in the zoo). At
   least one attention site must be found;
2. parity: outputs (including any returned KV cache) and SP-group-summed parameter gradients
   equal eager's on the full batch, fp32, ``rtol = atol = 1e-4``.

Each case prints ``model@tokens | parity | sites sharded | gathers [reasons]`` per length; after
the module, one line per model, the totals and the failing cases are written to the terminal.
Heavy cases are marked ``slow``. The same worker writes ``benchmarks/results/real_model_zoo.md``
(``PYTHONPATH=. python benchmarks/real_model_zoo.py``).

    pytest tests/test_real_model_zoo.py -m "not slow"        # the quick tier
    pytest tests/test_real_model_zoo.py -k "wan or llama"     # some cases
"""

from __future__ import annotations

import time

import pytest
import torch

import real_models as rm

_ROWS: list[dict] = []


def _zoo_params(predicate=lambda case: True, for_eager: bool = False):
    for case in rm.CASES.values():
        if predicate(case):
            marks = [pytest.mark.slow] if case.slow else []
            if case.name in rm.KNOWN_GAPS and not for_eager:
                marks.append(pytest.mark.xfail(strict=False, reason=f"known gap: {rm.KNOWN_GAPS[case.name]}"))
            yield pytest.param(case.name, id=case.name, marks=marks)


@pytest.fixture(scope="module", autouse=True)
def _zoo_summary(request):
    """After the module: one line per model and length, the totals, the failing cases."""
    yield
    if not _ROWS:
        return
    lines = [rm.format_row(row) for row in _ROWS]
    total = rm.totals(_ROWS)
    lines.append(
        f"TOTAL {total['cases_passing']}/{total['cases']} cases pass | runs {total['runs']}: parity ok {total['parity_ok']}, "
        f"every site sharded {total['fully_sharded']}, gathers within budget {total['within_budget']}, "
        f"exceptions {total['errors']} | attention sites sharded {total['sites_covered']}/{total['sites']}")
    failing = sorted({row["model"] for row in _ROWS if row["failures"]})
    if failing:
        lines.append(f"FAILING ({len(failing)}): {', '.join(failing)}")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        print("\n".join(lines))
        return
    reporter.write_sep("=", "real-model zoo")
    for line in lines:
        reporter.write_line(line)


@pytest.mark.parametrize("name", _zoo_params())
def test_real_model_shards_and_matches_eager(name: str) -> None:
    case = rm.CASES[name]
    pytest.importorskip(case.library)
    rows = rm.run_case(name, world_size=2, timeout=rm.CASE_TIMEOUT)
    _ROWS.extend(rows)
    for row in rows:
        print(rm.format_row(row))
    failures = [f"{row['model']}@{row['tokens'] or row['requested']}: {failure}" for row in rows for failure in row["failures"]]
    tracebacks = [row["traceback"] for row in rows if row["traceback"]]
    assert not failures, "\n".join(failures) + ("\n\n" + tracebacks[0] if tracebacks else "")


# ---------------------------------------------------------------------------------------------
# The zoo itself (one process, eager): the cases build, run and stay tiny
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", _zoo_params(lambda case: True, for_eager=True))
def test_zoo_case_runs_eagerly(name: str) -> None:
    """Each case builds deterministically and runs forward+backward eagerly at both of its token
    counts, well under the zoo's 2 s budget, with a finite loss and the token count it reports."""
    case = rm.CASES[name]
    pytest.importorskip(case.library)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = case.build()
        again = case.build()
        for (key, p), q in zip(model.state_dict().items(), again.state_dict().values()):
            assert torch.equal(p, q), f"{name}: {key} differs between two builds"
        tokens_seen = []
        for n in case.lengths:
            inputs, tokens = case.make_inputs(n)
            tokens_seen.append(tokens)
            start = time.perf_counter()
            model.zero_grad(set_to_none=True)
            loss = case.loss_of(model(**inputs))
            loss.backward()
            elapsed = time.perf_counter() - start
            assert torch.isfinite(loss), f"{name}@{tokens}: loss {loss}"
            assert elapsed < 2.0, f"{name}@{tokens}: eager forward+backward took {elapsed:.2f}s"
        assert {t % 2 for t in tokens_seen} == {0, 1}, f"{name}: token counts {tokens_seen} are not one odd, one even"
    finally:
        torch.set_num_threads(threads)


def test_grids_match_the_requested_token_counts() -> None:
    assert rm.grid_2d(15) == (3, 5) and rm.grid_2d(24) == (4, 6)
    assert rm.grid_3d(105) == (3, 5, 7) and rm.grid_3d(60) == (3, 4, 5)
    for n in range(9, 130):
        assert rm.grid_2d(n)[0] * rm.grid_2d(n)[1] % 2 == n % 2
        assert min(rm.grid_2d(n)) >= 3


def test_every_diffusers_transformer_is_in_the_zoo_or_skipped_with_a_reason() -> None:
    diffusers = pytest.importorskip("diffusers")
    from diffusers.models import transformers as dt

    classes = {name for name in dir(dt) if name[0].isupper() and isinstance(getattr(dt, name), type)
               and issubclass(getattr(dt, name), torch.nn.Module)}
    in_zoo = {case.model_class for case in rm.CASES.values() if case.library == "diffusers"}
    missing = sorted(classes - in_zoo - set(rm.SKIPPED))
    assert not missing, f"diffusers {diffusers.__version__} transformers neither in the zoo nor in SKIPPED: {missing}"
    assert not in_zoo & set(rm.SKIPPED), f"both in the zoo and skipped: {sorted(in_zoo & set(rm.SKIPPED))}"
