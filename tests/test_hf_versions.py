"""The Trainer and Accelerate integrations on the oldest transformers and accelerate we declare.

The quick tier runs ``tests/test_hf_trainer.py`` and ``tests/test_accelerate.py`` with what is
installed (CI installs the newest releases: ``pip install -e ".[test,hf]"``). This slow case runs
the same two files on the other end of the range: it reads the lower bounds of transformers and
accelerate from pyproject.toml's ``hf`` extra, installs exactly those releases into a virtual
environment layered over the current one (``--system-site-packages``: the same torch and the same
dcp-compile, imported from this checkout), and requires both files to pass there.

Optional packages that transformers imports whenever they are installed (``kernels``) are held to
the range that transformers release declares for them, as a user's resolver would: a newer one
can break its import. Without the package index (no network, or pip cannot find the releases at
all) the case is skipped and says so; a skip is reported as a skip (``-ra``), never as a pass.

Why the lower bounds are what they are (each found by running this file's two tests):
transformers before 5.18 (5.0.0 and 5.17.0 tried) cannot resume a multi-process CPU run (its
``torch.load`` of the optimizer maps to the device ``cpu:0``, which torch refuses; fixed in 5.18),
and transformers 5.x calls ``Accelerator.unwrap_model(keep_torch_compile=...)``, which accelerate
has from 1.3 (5.18.0 with 1.3.0 passes; the newest transformers with accelerate 1.3.0 passes too).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = ("tests/test_hf_trainer.py", "tests/test_accelerate.py")
PINNED = ("transformers", "accelerate")
IMPORTED_WHEN_INSTALLED = ("kernels",)  # transformers imports these if present; held to its declared range
UNREACHABLE = ("(from versions: none)", "Failed to establish a new connection", "Temporary failure in name resolution",
               "Network is unreachable", "NewConnectionError", "ProxyError", "Connection refused")


def oldest_declared() -> dict[str, str]:
    """The ``>=`` bound of each pinned package in pyproject.toml's ``hf`` extra."""
    from packaging.requirements import Requirement

    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml on Python 3.10 needs tomli")
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["hf"]
    bounds = {}
    for line in extra:
        requirement = Requirement(line)
        lower = [spec.version for spec in requirement.specifier if spec.operator == ">="]
        if requirement.name in PINNED and lower:
            bounds[requirement.name] = lower[0]
    assert set(bounds) == set(PINNED), f"pyproject.toml's hf extra needs a >= bound for each of {PINNED}: {extra}"
    return bounds


def pip_install(python: Path, requirements: list[str]) -> None:
    """Install into the environment; skip if the index cannot be reached, fail on anything else."""
    result = subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check", *requirements],
                            capture_output=True, text=True, timeout=900)
    output = result.stdout + result.stderr
    if result.returncode == 0:
        return
    if any(sign in output for sign in UNREACHABLE):
        pytest.skip(f"pip could not reach {' '.join(requirements)}, so the oldest declared releases were not "
                    f"tested: {output.strip().splitlines()[-1]}")
    raise AssertionError(f"pip install {' '.join(requirements)} failed:\n{output[-4000:]}")


def optional_pins(python: Path) -> list[str]:
    """Installed packages that the environment's transformers imports but whose versions lie
    outside the range it declares, as requirements in that range."""
    script = (
        "import json, importlib.metadata as md\n"
        "from packaging.requirements import Requirement\n"
        "from transformers.dependency_versions_table import deps\n"
        f"names = {list(IMPORTED_WHEN_INSTALLED)!r}\n"
        "out = []\n"
        "for name in names:\n"
        "    try:\n"
        "        version = md.version(name)\n"
        "    except md.PackageNotFoundError:\n"
        "        continue\n"
        "    if name in deps and not Requirement(deps[name]).specifier.contains(version, prereleases=True):\n"
        "        out.append(deps[name])\n"
        "print(json.dumps(out))\n"
    )
    result = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def installed_versions(python: Path) -> dict[str, str]:
    script = f"import json, importlib.metadata as md; print(json.dumps({{n: md.version(n) for n in {list(PINNED)!r}}}))"
    result = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_trainer_and_accelerate_tests_pass_on_the_oldest_declared_releases(tmp_path: Path) -> None:
    pins = oldest_declared()
    environment = tmp_path / "oldest"
    venv.create(environment, system_site_packages=True, with_pip=True)
    python = environment / "bin" / "python"
    pip_install(python, [f"{name}=={version}" for name, version in pins.items()])
    extra = optional_pins(python)
    if extra:
        pip_install(python, [*extra, *(f"{name}=={version}" for name, version in pins.items())])
    from packaging.version import Version

    installed = installed_versions(python)
    assert all(Version(installed[name]) == Version(version) for name, version in pins.items()), (installed, pins)

    env = {key: value for key, value in os.environ.items() if key != "DCP_TEST_DURATIONS_OUT"}
    run = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1800)
    output = run.stdout + run.stderr
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    assert run.returncode == 0 and f"{len(TESTS)} passed" in summary and "skipped" not in summary, (
        f"with {installed} (Python {sys.version.split()[0]}): {summary}\n{output[-8000:]}")
