"""jax-linear-attention's Pallas Mosaic GPU KDA, ``jla.ops.mosaic_gpu.kda.kda``.

Conventions (read in jax-linear-attention 0.1.0, ``jla/ops/mosaic_gpu/kda.py``,
``vector_gate_ops.py`` and the recurrence in ``jla/ops/reference.py``): ``[B, T, H, K]`` bf16 q/k/v,
g the natural-log decay per key channel (float32), beta ``[B, T, H]`` post-sigmoid, decay before
the delta rule and ``o_t = scale * q_t S_t`` as in jax_kda; the state is float32 ``[B, H, K, V]``
(transposed from jax_kda's). It takes no ``cu_seqlens``: packed documents go through
``segment_ids``, which restart each document from a zero state, so it cannot seed N sequences from
N initial states. Equal-length shapes therefore run batched (``B = N``); ragged ones are reported
unavailable.
"""

from __future__ import annotations

import jax
import numpy as np

from benchmarks.native import Native, Unavailable
from jax_kda.constants import default_scale
from jax_kda.oracle import Inputs


def bind(inputs: Inputs) -> Native:
    try:
        from jla.ops.mosaic_gpu.kda import kda
    except ImportError as err:
        raise Unavailable(f"jla.ops.mosaic_gpu.kda does not import: {err}") from err

    lengths = np.diff(inputs.cu_seqlens)
    if len(set(lengths.tolist())) != 1 or lengths[0] == 0:
        raise Unavailable(
            "jla takes segment_ids, not cu_seqlens, and restarts each segment from a zero state: "
            "it cannot seed ragged packed sequences from their own initial states"
        )
    batch, length = len(lengths), int(lengths[0])

    def batched(x: np.ndarray) -> jax.Array:
        return jax.device_put(x.reshape(batch, length, *x.shape[1:]))

    args = {name: batched(getattr(inputs, name)) for name in ("q", "k", "v", "g", "beta")}
    state = jax.device_put(np.ascontiguousarray(np.swapaxes(inputs.initial_state, -1, -2)))

    def call(args, state):
        return kda(
            args["q"],
            args["k"],
            args["v"],
            args["g"],
            args["beta"],
            scale=default_scale(),
            initial_state=state,
            output_final_state=True,
        )

    try:
        jax.eval_shape(call, args, state)
    except ValueError as err:  # jla's own check of the call (GPU, dtypes, shapes)
        raise Unavailable(str(err)) from err
    return Native(
        framework="jax",
        args=args,
        initial_state=state,
        call=call,
        state_is_kv=True,
        notes=(
            "jla.ops.mosaic_gpu.kda.kda(q, k, v, g, beta as [N, T/N, H, ...], scale=128**-0.5, "
            "initial_state [N,H,K,V], output_final_state=True)"
        ),
    )
