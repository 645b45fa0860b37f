"""Steps and measurements for implementations that run under JAX (jax_kda, jla).

A step is ``step(args, state) -> (next_state, outputs)``: the forward step chains the final state
into the next call's initial state; the training step runs forward and backward and chains the
initial-state gradient. Chaining makes every call depend on the one before, so a loop of calls can
neither be hoisted nor overlapped, and the outputs ride along so nothing is dead code. The token
inputs are tied to the chained state too (`tied_to_state`): otherwise XLA hoists out of the loop
whatever part of a call depends on them alone (a recompute of per-chunk operands, say), and the
loop times less than a call costs.
"""

from __future__ import annotations

import math
import statistics
import time

import jax
import numpy as np
from jax import lax

from benchmarks.inputs import Cotangents
from benchmarks.native import Native
from benchmarks.timing import Settings, Timings, host_seconds, wall_seconds

TOKEN_INPUTS = ("q", "k", "v", "g", "beta")

UNROLLED_CALLS = 10
"""Most chained calls in one iteration of the GPU-time loop (the torch graphs hold 10)."""
ITERATION_SECONDS = 2e-3
"""Enough device time per loop iteration that the iteration's own cost (tens of microseconds)
is about 1% of it: calls longer than this are not unrolled, which keeps slow rows (the XLA path)
from compiling ten copies of themselves."""


def calls_per_iteration(loop_calls: int, seconds_per_call: float) -> int:
    """How many chained calls one iteration of the GPU-time loop holds."""
    wanted = math.ceil(ITERATION_SECONDS / max(seconds_per_call, 1e-7))
    return max(1, min(UNROLLED_CALLS, loop_calls, wanted))


def tied_to_state(args: dict, state) -> dict:
    """args with the token inputs plus 0 * (an element of the chained state): the same values,
    but computed from the state, so no work on them is loop-invariant (XLA keeps 0 * x for
    floats: it is NaN for a NaN x). One fused add over the inputs per call."""
    zero = 0.0 * jax.numpy.ravel(state)[0].astype(jax.numpy.float32)
    return {
        name: (x + zero.astype(x.dtype)) if name in TOKEN_INPUTS else x for name, x in args.items()
    }


def forward_step(native: Native):
    def step(args, state):
        o, final_state = native.call(tied_to_state(args, state), state)
        return final_state, (o,)

    return step, native.args


def train_step(native: Native, cotangents: Cotangents):
    """Forward plus backward; outputs ``(o, dq, dk, dv, dg, dbeta)``, next state ``d_state``."""
    args = {
        **native.args,
        "d_o": jax.device_put(cotangents.d_o.reshape(native.args["q"].shape)),
        "d_final_state": jax.device_put(native.state_from_vk(cotangents.d_final_state)),
    }

    def step(args, state):
        def forward(q, k, v, g, beta, state):
            return native.call({**args, "q": q, "k": k, "v": v, "g": g, "beta": beta}, state)

        tied = tied_to_state(args, state)
        primals = [tied[name] for name in TOKEN_INPUTS]
        (o, _), pullback = jax.vjp(forward, *primals, state)
        *grads, d_state = pullback((args["d_o"], args["d_final_state"]))
        return d_state, (o, *grads)

    return step, args


def measure(step, args, state, settings: Settings) -> tuple[Timings, tuple]:
    """Time ``step``; returns the timings and the first call's ``(next_state, outputs)`` (numpy)."""
    single = jax.jit(step)
    start = time.perf_counter()
    first = jax.block_until_ready(single(args, state))
    first_call_s = time.perf_counter() - start

    def one_call():
        jax.block_until_ready(single(args, state))

    def pipelined():
        chained = state
        for _ in range(settings.pipelined_calls):
            chained, outputs = single(args, chained)
        jax.block_until_ready((chained, outputs))

    per_call_s, pipelined_s = host_seconds(one_call, pipelined, settings)

    # Pipelined calls are nearer the device time than one waited-for call (no round trip).
    loop_calls = settings.loop_calls(pipelined_s)
    per_iteration = calls_per_iteration(loop_calls, pipelined_s)
    iterations = math.ceil(loop_calls / per_iteration)
    gpu_s = _loop_seconds_per_call(
        step, args, state, first[1], iterations, per_iteration, settings.repeats
    )
    peak_bytes = _call_bytes(single, args, state)
    timings = Timings(
        gpu_us=gpu_s * 1e6,
        gpu_method=(
            f"jitted lax.fori_loop of {iterations} iterations x {per_iteration} chained calls"
        ),
        gpu_calls=iterations * per_iteration,
        per_call_us=per_call_s * 1e6,
        pipelined_us=pipelined_s * 1e6,
        first_call_ms=first_call_s * 1e3,
        peak_bytes=peak_bytes,
        peak_method="XLA memory_analysis of one call: arguments + outputs + temporaries - aliased",
    )
    return timings, jax.tree.map(np.asarray, first)


def chained_loop(step, per_iteration: int):
    """jit(args, state, outputs, count): `count` iterations of `per_iteration` chained calls of
    `step` (each call's next state the next call's state). The loop carries every call's
    outputs (`outputs`: `per_iteration` copies of one call's), so none is dead code: carrying
    only the last call's would let XLA drop the others' output work (a backward's dq, dk, ... of
    every call but the last) and time less than a call does. An optimization barrier does not
    stop that: XLA removes barriers before dead-code elimination."""

    @jax.jit
    def loop(args, state, outputs, count):
        def body(_, carry):
            state, kept = carry
            kept = list(kept)
            for i in range(per_iteration):
                state, kept[i] = step(args, state)
            return state, tuple(kept)

        return lax.fori_loop(0, count, body, (state, outputs))

    return loop


def _loop_seconds_per_call(
    step, args, state, outputs, iterations: int, per_iteration: int, repeats: int
) -> float:
    """Device time per call: a jitted loop of ``iterations`` iterations, each ``per_iteration``
    chained calls. Every iteration of an XLA GPU while loop costs host round trips for its
    condition (tens of microseconds, more than a small call); unrolling calls into the body
    shares that cost between them, as the torch rows share one CUDA-graph launch."""

    loop = chained_loop(step, per_iteration)
    outputs = (outputs,) * per_iteration

    jax.block_until_ready(loop(args, state, outputs, 1))
    samples = [
        wall_seconds(lambda: jax.block_until_ready(loop(args, state, outputs, iterations)))
        for _ in range(repeats)
    ]
    return statistics.median(samples) / (iterations * per_iteration)


def _call_bytes(single, args, state) -> int | None:
    analysis = single.lower(args, state).compile().memory_analysis()
    if analysis is None:
        return None
    return int(
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        + analysis.temp_size_in_bytes
        - analysis.alias_size_in_bytes
    )
