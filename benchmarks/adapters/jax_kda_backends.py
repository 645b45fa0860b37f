"""jax_kda itself, on one backend: ``jax_kda.prefill`` in its packed (THD) form, with the
production gate's bound stated (lb = -5: on sm90 the gate-bound forward kernels) or without it
(gate_lower_bound=None: on sm90 the exact 64-token forward, what autodiff differentiates)."""

from __future__ import annotations

import jax

import jax_kda
from benchmarks.native import Native, Unavailable
from jax_kda.constants import GATE_LOWER_BOUND_MIN, default_scale
from jax_kda.oracle import Inputs


def bind(inputs: Inputs, *, backend: str, gate_lower_bound=GATE_LOWER_BOUND_MIN) -> Native:
    args = {
        "q": jax.device_put(inputs.q),
        "k": jax.device_put(inputs.k),
        "v": jax.device_put(inputs.v),
        "g": jax.device_put(inputs.g),
        "beta": jax.device_put(inputs.beta),
        "cu_seqlens": jax.device_put(inputs.cu_seqlens),
    }
    state = jax.device_put(inputs.initial_state)

    def call(args, state):
        return jax_kda.prefill(
            args["q"],
            args["k"],
            args["v"],
            args["g"],
            args["beta"],
            cu_seqlens=args["cu_seqlens"],
            initial_state=state,
            scale=default_scale(),
            gate_lower_bound=gate_lower_bound,  # production_inputs' gate: lb = -5 holds
            backend=backend,
        )

    try:
        jax.eval_shape(call, args, state)
    except jax_kda.BackendUnavailableError as err:
        raise Unavailable(str(err)) from err
    return Native(
        framework="jax",
        args=args,
        initial_state=state,
        call=call,
        state_is_kv=False,
        notes=(
            "jax_kda.prefill(q, k, v, g, beta as [T, H, ...], cu_seqlens int32, "
            f"initial_state [N,H,V,K], scale=128**-0.5, gate_lower_bound={gate_lower_bound}, "
            f"backend={backend!r})"
        ),
    )
