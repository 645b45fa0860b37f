"""GPU time of a prefill call on raw inputs (fla's flags), preparation in the kernel or before it.

``python -m benchmarks.prep_cost [--only TERMS] [--calls N] [--lower-bound LB]`` times, per
shape, a jitted ``prefill(..., use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
A_log=..., dt_bias=..., use_beta_sigmoid_in_kernel=True)`` with no gate bound (the exact 64-token
forward, fla's softplus gate; with ``--lower-bound LB`` the safe gate with that bound, which
takes the gate-bound kernels) twice: with ``sm90.backend.IN_KERNEL_PREP`` on (the chunk core, or
the gate-bound forward's PREP, prepares the raw inputs as they load) and off (XLA prepares them,
then the plain kernels run), and, for scale, prefill on
inputs prepared ahead. GPU time per call as the harness takes it (`jax_measure`: chained calls on
distinct input copies, back to back). A diagnostic beside the harness, which times prepared
inputs only.
"""

from __future__ import annotations

import argparse
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import jax_kda
from benchmarks import jax_measure


def raw_inputs(lengths, heads: int, seed: int) -> dict:
    """Unnormalised q, k (bf16), v, a raw gate projection, beta logits, A_log, dt_bias."""
    rng = np.random.default_rng(seed)
    total = int(sum(lengths))
    shape = (total, heads, 128)
    bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return {
        "q": bf16(rng.standard_normal(shape, np.float32)),
        "k": bf16(rng.standard_normal(shape, np.float32)),
        "v": bf16(0.5 * rng.standard_normal(shape, np.float32)),
        "g": jnp.asarray(rng.standard_normal(shape, np.float32)),
        "beta": jnp.asarray(rng.standard_normal((total, heads), np.float32)),
        "cu_seqlens": jnp.asarray(cu),
        "A_log": jnp.asarray(rng.uniform(0.0, 1.0, heads).astype(np.float32)),
        "dt_bias": jnp.asarray(0.1 * rng.standard_normal((heads, 128), np.float32)),
    }


def step(args, state, lower_bound=None):
    o, final = jax_kda.prefill(
        args["q"], args["k"], args["v"], args["g"], args["beta"],
        cu_seqlens=args["cu_seqlens"], initial_state=state, backend="sm90",
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=args["A_log"],
        dt_bias=args["dt_bias"], lower_bound=lower_bound, use_beta_sigmoid_in_kernel=True,
    )  # fmt: skip
    return final, (o,)


def prepared_step(args, state, lower_bound=None):
    o, final = jax_kda.prefill(
        args["q"], args["k"], args["v"], args["g"], args["beta"],
        cu_seqlens=args["cu_seqlens"], initial_state=state, backend="sm90",
        gate_lower_bound=lower_bound,
    )  # fmt: skip
    return final, (o,)


def prepare(args, lower_bound=None) -> dict:
    """The raw inputs prepared as prefill would (XLA), for the prepared-ahead row."""
    from jax_kda.gate import kda_gate, l2_normalize

    return {
        **args,
        "q": l2_normalize(args["q"]),
        "k": l2_normalize(args["k"]),
        "g": kda_gate(args["g"], args["A_log"], args["dt_bias"], lower_bound=lower_bound),
        "beta": jax.nn.sigmoid(args["beta"]),
    }


def gpu_us(fn, args, state, calls: int) -> float:
    """GPU us a call of ``fn`` (a step), as the harness takes it: `calls` chained calls in
    executables of up to MAX_CALLS_PER_EXECUTION, back to back, median of three."""
    per_execution = min(jax_measure.MAX_CALLS_PER_EXECUTION, calls)
    executions = math.ceil(calls / per_execution)
    seconds = jax_measure._chained_seconds_per_call(fn, args, state, executions, per_execution, 3)
    return seconds * 1e6


def main(argv=None):
    from benchmarks.selection import parse_only, select
    from benchmarks.shapes import ALL_SHAPES
    from jax_kda import sm90

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="2048x12x1,8192x16x1,33x2x3-ragged")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument(
        "--lower-bound", type=float, default=None, help="the safe gate's bound (e.g. -5)"
    )
    options = parser.parse_args(argv)
    bound = options.lower_bound
    print(f"gate: {'softplus (no bound)' if bound is None else f'safe, lower_bound {bound}'}")
    shapes, _ = select(parse_only(options.only), ALL_SHAPES, [])
    print("| shape | in kernel us | XLA prep + kernels us | prepared ahead us |")
    print("|---|---|---|---|")
    for shape in shapes:
        args = raw_inputs(shape.lengths, shape.heads, seed=0)
        state = jnp.zeros((len(shape.lengths), shape.heads, 128, 128), jnp.float32)
        row = []
        for route in (True, False):
            sm90.backend.IN_KERNEL_PREP = route
            call = functools.partial(step, lower_bound=bound)
            row.append(gpu_us(call, args, state, options.calls))
        ready = jax.block_until_ready(jax.jit(functools.partial(prepare, lower_bound=bound))(args))
        ahead = functools.partial(prepared_step, lower_bound=bound)
        row.append(gpu_us(ahead, ready, state, options.calls))
        print(f"| {shape.name} | " + " | ".join(f"{t:.1f}" for t in row) + " |", flush=True)


if __name__ == "__main__":
    main()
