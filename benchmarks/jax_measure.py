"""Steps and measurements for implementations that run under JAX (jax_kda, jla).

A step is ``step(args, state) -> (next_state, outputs)``: the forward step chains the final state
into the next call's initial state; the training step runs forward and backward and chains the
initial-state gradient. GPU time comes from one jitted executable of chained calls, each on its own
copy of the inputs (`distinct_copies`), dispatched many times back to back (`chained_calls`), the
way the torch rows replay a CUDA graph of chained calls. The copies keep XLA from computing a call's
input-only work once for all of them (identical custom calls on identical operands are merged), and
the outputs ride along so nothing is dead code.

Until 2026-12-06 the calls ran in a `lax.fori_loop` with the token inputs tied to the chained state
(x + 0 * state): a pass over every input each call, and a host round trip each loop iteration,
costs the torch rows never paid (the same build on an H100: 130.5 against 107.1 us a call at
2048x12x1; benchmarks/README.md, "How the JAX rows were timed").
"""

from __future__ import annotations

import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.inputs import Cotangents
from benchmarks.native import Native
from benchmarks.timing import Settings, Timings, host_seconds, wall_seconds

TOKEN_INPUTS = ("q", "k", "v", "g", "beta")

MAX_CALLS_PER_EXECUTION = 50
"""Most chained calls in one executable of the GPU-time measurement: enough that the host's
dispatch of the next executable (tens of microseconds) hides behind the device time of the last
one for the smallest calls (a decode step), few enough that tracing them stays quick."""
EXECUTION_SECONDS = 2e-3
"""Device time one executable should hold: calls longer than this share executables less (the
XLA path's long calls run one to an executable, which keeps slow rows from compiling many copies
of themselves)."""


def calls_per_execution(loop_calls: int, seconds_per_call: float) -> int:
    """How many chained calls one executable of the GPU-time measurement holds."""
    wanted = math.ceil(EXECUTION_SECONDS / max(seconds_per_call, 1e-7))
    return max(1, min(MAX_CALLS_PER_EXECUTION, loop_calls, wanted))


def distinct_copies(args, count: int) -> tuple:
    """``count`` copies of ``args`` (a pytree of arrays), each array in a device buffer of its
    own (the first is ``args`` itself): chained calls on them read different operands, as a
    model's layers do."""
    copies = [jax.tree.map(lambda x: jnp.array(x, copy=True), args) for _ in range(count - 1)]
    return (args, *copies)


def forward_step(native: Native):
    def step(args, state):
        o, final_state = native.call(args, state)
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

        primals = [args[name] for name in TOKEN_INPUTS]
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
    per_execution = calls_per_execution(loop_calls, pipelined_s)
    executions = math.ceil(loop_calls / per_execution)
    gpu_s = _chained_seconds_per_call(
        step, args, state, executions, per_execution, settings.repeats
    )
    peak_bytes = _call_bytes(single, args, state)
    timings = Timings(
        gpu_us=gpu_s * 1e6,
        gpu_method=(
            f"{executions} back-to-back runs of a jitted executable of {per_execution} chained "
            "calls, each on its own copy of the inputs"
        ),
        gpu_calls=executions * per_execution,
        per_call_us=per_call_s * 1e6,
        pipelined_us=pipelined_s * 1e6,
        first_call_ms=first_call_s * 1e3,
        peak_bytes=peak_bytes,
        peak_method="XLA memory_analysis of one call: arguments + outputs + temporaries - aliased",
    )
    return timings, jax.tree.map(np.asarray, first)


def chained_calls(step):
    """jit(copies, state) -> (state, outputs): ``len(copies)`` chained calls of ``step``, the
    i-th on ``copies[i]`` (each call's next state the next call's state); ``outputs`` holds
    every call's, so that none is dead code (keeping only the last call's would let XLA drop the
    others' output work, a backward's dq, dk, ... of every call but the last)."""

    @jax.jit
    def run(copies, state):
        kept = []
        for args in copies:
            state, outputs = step(args, state)
            kept.append(outputs)
        return state, tuple(kept)

    return run


def _chained_seconds_per_call(
    step, args, state, executions: int, per_execution: int, repeats: int
) -> float:
    """Device time per call: ``executions`` runs of one executable of ``per_execution`` chained
    calls, issued back to back with one wait at the end (the host stays ahead of the device,
    so the wall time is the device's), median of ``repeats``."""
    copies = distinct_copies(args, per_execution)
    run = chained_calls(step)
    jax.block_until_ready(run(copies, state))
    samples = [
        wall_seconds(lambda: back_to_back(run, copies, state, executions)) for _ in range(repeats)
    ]
    return statistics.median(samples) / (executions * per_execution)


def back_to_back(run, copies, state, executions: int) -> None:
    """``executions`` runs of ``run`` (chained_calls' executable) on ``copies``, each run's
    final state the next one's, issued without waiting; one wait at the end."""
    chained, kept = state, None
    for _ in range(executions):
        chained, kept = run(copies, chained)
    jax.block_until_ready((chained, kept))


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
