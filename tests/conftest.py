"""Shared test configuration.

* ``gpu`` tests skip with the driver's reason when no GPU is present.
* ``oracle`` tests (independent cross-checks against torch / transformers) skip with a reason when
  those are not installed (``pip install ".[oracle]"``), and so does any test that fails only because
  torch, transformers or accelerate cannot be imported (the tiny-model factory builds its models
  with transformers).
"""

from __future__ import annotations

import importlib.util

import pytest
from hypothesis import HealthCheck, settings

from realizar import cuda

settings.register_profile(
    "default", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
settings.register_profile(
    "gpu", deadline=None, max_examples=40,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile("default")


ORACLE_PACKAGES = ("torch", "transformers", "accelerate")
ORACLE_HINT = 'pip install ".[oracle]"'


def _importable(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def _missing_oracle_packages() -> list[str]:
    return [p for p in ORACLE_PACKAGES if not _importable(p)]


def pytest_collection_modifyitems(config, items):
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


def _oracle_import_error(excinfo) -> str | None:
    """The missing package when ``excinfo`` is an import error of an oracle package, else None."""
    if excinfo is None or not excinfo.errisinstance(ModuleNotFoundError):
        return None
    name = (excinfo.value.name or "").split(".")[0]
    return name if name in ORACLE_PACKAGES else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that fails only on ``import torch`` (or transformers, accelerate) is skipped, saying so."""
    outcome = yield
    report = outcome.get_result()
    name = _oracle_import_error(call.excinfo) if report.failed else None
    if name is not None:
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"needs {name} ({ORACLE_HINT})")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """The same for a test module that imports torch at its top."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        text = str(report.longrepr)
        for name in ORACLE_PACKAGES:
            if f"No module named '{name}'" in text:
                report.outcome = "skipped"
                report.longrepr = (str(collector.path), 0, f"needs {name} ({ORACLE_HINT})")
                break


@pytest.fixture(scope="session")
def device():
    """The CUDA device (tests using it must carry @pytest.mark.gpu)."""
    return cuda.current_device()


@pytest.fixture(scope="session")
def kernels(device):
    """The process-wide module cache of the device."""
    return cuda.module_cache(device)
