import os

import jaxlib.version

# jaxlib 0.10.2's CPU backend crashes (a segfault at run time) on some machines, seen on a
# 2-core AMD EPYC without AVX-512 on 2026-12-07, in the compiled gradient of the XLA path on a
# call shorter than one chunk (T = 40 or 45 with H = 2; T = 64, 130 or H = 1 ran) while its
# YNNPACK fusions are on; with them off the same program runs and passes. Set before any test
# starts a backend (the subprocesses the tests start inherit it); a setting of the caller's is
# kept, and other jaxlib versions are left alone (the flag may not exist there).
YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type"
if jaxlib.version.__version__.startswith("0.10.") and YNN_FLAG not in os.environ.get(
    "XLA_FLAGS", ""
):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {YNN_FLAG}=".strip()

import pytest  # noqa: E402

from jax_kda.sm90 import has_hopper  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if has_hopper():
        return
    skip = pytest.mark.skip(reason="needs a Hopper (sm90) GPU as JAX's default device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
