"""Shared test configuration: the `gpu` marker skips with the driver's reason when no GPU is present."""

from __future__ import annotations

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


def pytest_collection_modifyitems(config, items):
    reason = cuda.unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"needs a GPU: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device():
    """The CUDA device (tests using it must carry @pytest.mark.gpu)."""
    return cuda.current_device()


@pytest.fixture(scope="session")
def kernels(device):
    """The process-wide module cache of the device."""
    return cuda.module_cache(device)
