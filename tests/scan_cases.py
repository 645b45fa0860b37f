"""Random operands for the state scan in the chunk-slot layout (CPU and GPU tests share them)."""

import jax.numpy as jnp
import numpy as np

from jax_kda import xla
from jax_kda.constants import HEAD_DIM, SCAN_CHUNK


def scan_operands(lengths, heads, seed, *, reverse=False):
    """(a_op, b_op, decay, addend, cu_seqlens, y0) for xla.state_scan: A, B and a forward
    addend zero in rows past a sequence's end and in gap slots (as xla.forward's are), decays in
    (0, 1], a reverse addend [slots, H, K, V] zero in gap slots. float32 jax arrays."""
    rng = np.random.default_rng(seed)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    slots = xla.chunk_slot_count(int(cu[-1]), len(lengths))
    _, rows = xla._token_slots(jnp.asarray(cu), int(cu[-1]))
    live = np.zeros(slots * SCAN_CHUNK, bool)
    live[np.asarray(rows)] = True
    live = live.reshape(slots, 1, SCAN_CHUNK, 1)
    chunk = (slots, heads, SCAN_CHUNK, HEAD_DIM)
    a_op, b_op = (0.1 * rng.standard_normal(chunk) * live for _ in range(2))
    if reverse:
        used = live.any(axis=2, keepdims=True)
        addend = rng.standard_normal((slots, heads, HEAD_DIM, HEAD_DIM)) * used
    else:
        addend = rng.standard_normal(chunk) * live
    decay = np.exp(-0.05 * rng.random((slots, heads, HEAD_DIM)))
    y0 = rng.standard_normal((len(lengths), heads, HEAD_DIM, HEAD_DIM))
    as32 = [jnp.asarray(a, jnp.float32) for a in (a_op, b_op, decay, addend)]
    return (*as32, jnp.asarray(cu), jnp.asarray(y0, jnp.float32))
