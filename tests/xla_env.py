"""Environments for the tests' fresh processes: XLA_FLAGS as this process has them (conftest.py
may have added one that keeps jaxlib 0.10.2's CPU backend from crashing) plus the subprocess's
own, so that no test drops the other's."""

import os


def with_xla_flags(flags: str, **extra: str) -> dict:
    """os.environ with `flags` appended to XLA_FLAGS and the `extra` variables set."""
    merged = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
    return {**os.environ, "XLA_FLAGS": merged, **extra}


def host_devices(count: int, **extra: str) -> dict:
    """with_xla_flags for a CPU process with `count` host devices."""
    return with_xla_flags(f"--xla_force_host_platform_device_count={count}", **extra)
