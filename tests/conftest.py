import pytest

from jax_kda.sm90 import has_hopper


def pytest_collection_modifyitems(config, items):
    if has_hopper():
        return
    skip = pytest.mark.skip(reason="needs a Hopper (sm90) GPU as JAX's default device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
