import jax
import pytest


def _has_hopper() -> bool:
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return False
    return any(getattr(d, "compute_capability", "") == "9.0" for d in devices)


HAS_HOPPER = _has_hopper()


def pytest_collection_modifyitems(config, items):
    if HAS_HOPPER:
        return
    skip = pytest.mark.skip(reason="needs a Hopper (sm90) GPU; none is present")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
