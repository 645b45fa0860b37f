"""Opt-in checks of values that prefill never reads on the host (reading them would synchronise).

`check_cu_seqlens(cu_seqlens, total_tokens)` checks the packed boundaries: cu[0] = 0, every step
non-decreasing, cu[N] = T. prefill trusts them: bad boundaries give finite garbage on the XLA
path, and the sm90 kernels may read and write outside their buffers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify


def check_cu_seqlens(cu_seqlens, total_tokens: int) -> None:
    """Check cu_seqlens ([N + 1] int32) for T = total_tokens packed tokens; the first bad entry
    is named.

    On a concrete array (outside jit) it reads the values on the host and raises ValueError.
    Inside a jitted function it adds a `jax.experimental.checkify` check instead: wrap the
    function with `checkify.checkify` and call `.throw()` on the error it returns (a JaxRuntimeError
    then names the entry); without checkify, tracing it raises.
    """
    try:
        cu = np.asarray(cu_seqlens)
    except jax.errors.TracerArrayConversionError:
        _traced_check(cu_seqlens, total_tokens)
        return
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(f"cu_seqlens: got shape {cu.shape}, expected [N + 1], N >= 1")
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens[0]: got {cu[0]}, expected 0")
    steps = np.diff(cu)
    if np.any(steps < 0):
        i = int(np.argmax(steps < 0)) + 1
        raise ValueError(
            f"cu_seqlens[{i}]: got {cu[i]} after cu_seqlens[{i - 1}] = {cu[i - 1]}, expected "
            "non-decreasing boundaries"
        )
    if cu[-1] != total_tokens:
        raise ValueError(
            f"cu_seqlens[{cu.shape[0] - 1}]: got {cu[-1]}, expected T = {total_tokens} "
            "(the packed token count)"
        )


def _traced_check(cu, total_tokens: int) -> None:
    """The same checks as checkify checks; each names the first bad index and its value."""
    last = cu.shape[0] - 1
    checkify.check(cu[0] == 0, "cu_seqlens[0]: got {value}, expected 0", value=cu[0])
    decreasing = cu[1:] < cu[:-1]
    i = jnp.argmax(decreasing) + 1
    checkify.check(
        ~jnp.any(decreasing),
        "cu_seqlens[{i}]: got {value} after {previous}, expected non-decreasing boundaries",
        i=i,
        value=cu[i],
        previous=cu[i - 1],
    )
    checkify.check(
        cu[last] == total_tokens,
        f"cu_seqlens[{last}]: got {{value}}, expected T = {total_tokens}",
        value=cu[last],
    )
