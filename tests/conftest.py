"""Shared test configuration.

* ``gpu`` tests skip with the driver's reason when no GPU is present.
* ``full`` tests (the exhaustive sweeps, and every test that reads the real default model: a download on a
  fresh machine) and ``oracle`` tests run only when asked for: ``-m full``, ``-m oracle``
  or ``--full`` (CI's full run); the default run is the fast suite. Hypothesis example counts follow
  ``HYPOTHESIS_PROFILE`` (below).
* ``oracle`` tests (independent cross-checks against torch / transformers) skip with a reason when
  those are not installed (``pip install ".[oracle]"``). Every other test runs without them: the
  tiny-model factory builds its models with NumPy and safetensors.
"""

from __future__ import annotations

import importlib.util

import pytest
from hypothesis import HealthCheck, settings

from realizar import cuda
from tests.helpers import PROFILE

_QUIET = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
# HYPOTHESIS_PROFILE: "dev" (default: the fast suite), "ci" (the example counts written in the tests; CI's full
# run), "full" (four times those). Tests with explicit counts scale them by tests.helpers.examples.
settings.register_profile("dev", max_examples=10, **_QUIET)
settings.register_profile("ci", max_examples=100, **_QUIET)
settings.register_profile("full", max_examples=400, **_QUIET)
settings.load_profile(PROFILE)


ORACLE_PACKAGES = ("torch", "transformers", "accelerate")
ORACLE_HINT = 'pip install ".[oracle]"'


def _importable(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def _missing_oracle_packages() -> list[str]:
    return [p for p in ORACLE_PACKAGES if not _importable(p)]


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="also run the exhaustive tier and the oracle tests (marked full / oracle): CI's full run")


def _tiers_left_out(config) -> tuple[str, ...]:
    """The markers whose tests the run leaves out: ``full`` and ``oracle`` unless ``--full`` or a ``-m``
    expression that names them asks for them (the fast suite does not depend on what else is installed)."""
    if config.getoption("--full"):
        return ()
    expr = config.getoption("-m") or ""
    return tuple(m for m in ("full", "oracle") if m not in expr)


# fixtures that reach the real default model (a download on a fresh machine): their tests are in the full tier
_DEFAULT_MODEL_FIXTURES = {"smol_path", "smol_md", "smol", "smol_hf", "smollm2_path", "real_model_file"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _DEFAULT_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.full)
    out = _tiers_left_out(config)
    if out:
        dropped = [item for item in items if any(m in item.keywords for m in out)]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item in items if not any(m in item.keywords for m in out)]
    reason = cuda.unavailable_reason()
    if reason is not None:
        skip = pytest.mark.skip(reason=f"needs a GPU: {reason}")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    missing = _missing_oracle_packages()
    if missing:
        skip = pytest.mark.skip(reason=f"oracle test: needs {', '.join(missing)} ({ORACLE_HINT})")
        for item in items:
            if "oracle" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def device():
    """The CUDA device (tests using it must carry @pytest.mark.gpu)."""
    return cuda.current_device()


@pytest.fixture(scope="session")
def kernels(device):
    """The process-wide module cache of the device."""
    return cuda.module_cache(device)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Skipped tests as one line per reason (the GPU tests' driver message once, not once per file),
    most frequent first."""
    reasons: dict[str, int] = {}
    for rep in terminalreporter.stats.get("skipped", []):
        longrepr = rep.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    if reasons:
        terminalreporter.section("skipped, by reason", sep="-")
        for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
            terminalreporter.line(f"SKIPPED {n}: {reason}")
