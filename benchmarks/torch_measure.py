"""Steps and measurements for implementations that run under torch (cuDNN frontend, fla).

Steps have the shape of ``benchmarks.jax_measure``'s: ``step(args, state) -> (next_state,
outputs)``, chaining the final state (forward) or the initial-state gradient (training). GPU time
comes from replaying a CUDA graph of chained calls, each on its own copy of the inputs (as the JAX
rows' chained executables), timed with CUDA events; an implementation that cannot be captured is
timed with events around eager calls instead, and the row says so.
"""

from __future__ import annotations

import math
import statistics
import time

from benchmarks.adapters.torch_tensors import import_torch_cuda, to_cuda, to_numpy
from benchmarks.inputs import Cotangents
from benchmarks.native import Native
from benchmarks.timing import Settings, Timings, host_seconds

TOKEN_INPUTS = ("q", "k", "v", "g", "beta")
GRAPH_CALLS = 10
"""Chained calls captured in one CUDA graph (the graph is replayed to reach the loop count)."""


def forward_step(native: Native):
    torch = import_torch_cuda()

    def step(args, state):
        with torch.no_grad():
            o, final_state = native.call(args, state)
        return final_state, (o,)

    return step, native.args


def train_step(native: Native, cotangents: Cotangents):
    """Forward plus backward; outputs ``(o, dq, dk, dv, dg, dbeta)``, next state ``d_state``."""
    torch = import_torch_cuda()
    args = {
        **native.args,
        "d_o": to_cuda(cotangents.d_o).reshape(native.args["q"].shape),
        "d_final_state": to_cuda(native.state_from_vk(cotangents.d_final_state)),
    }
    for name in TOKEN_INPUTS:
        args[name] = args[name].detach().requires_grad_(True)

    def step(args, state):
        with torch.enable_grad():
            state = state.detach().requires_grad_(True)
            o, final_state = native.call(args, state)
            primals = [args[name] for name in TOKEN_INPUTS]
            *grads, d_state = torch.autograd.grad(
                (o, final_state), (*primals, state), (args["d_o"], args["d_final_state"])
            )
        return d_state, (o.detach(), *grads)

    return step, args


def measure(step, args, state, settings: Settings) -> tuple[Timings, tuple]:
    """Time ``step``; returns the timings and the first call's ``(next_state, outputs)`` (numpy)."""
    torch = import_torch_cuda()
    sync = torch.cuda.synchronize

    def one_call():
        result = step(args, state)
        sync()
        return result

    start = time.perf_counter()
    first = one_call()
    first_call_s = time.perf_counter() - start
    first_numpy = (to_numpy(first[0]), tuple(to_numpy(x) for x in first[1]))
    del first

    def pipelined():
        chained = state
        for _ in range(settings.pipelined_calls):
            chained, _ = step(args, chained)
        sync()

    per_call_s, pipelined_s = host_seconds(one_call, pipelined, settings)

    sync()
    torch.cuda.reset_peak_memory_stats()
    one_call()
    peak_bytes = int(torch.cuda.max_memory_allocated())

    loop_calls = settings.loop_calls(per_call_s)
    try:
        gpu_s = _graph_seconds_per_call(torch, step, args, state, loop_calls, settings.repeats)
        method = f"CUDA graph of {min(GRAPH_CALLS, loop_calls)} chained calls, replayed, events"
    except Exception as err:  # capture is the peer's business; fall back and say why
        sync()
        gpu_s = _eager_seconds_per_call(torch, step, args, state, loop_calls, settings.repeats)
        method = f"CUDA events around {loop_calls} eager calls (graph capture failed: {err!r})"
    timings = Timings(
        gpu_us=gpu_s * 1e6,
        gpu_method=method,
        gpu_calls=loop_calls,
        per_call_us=per_call_s * 1e6,
        pipelined_us=pipelined_s * 1e6,
        first_call_ms=first_call_s * 1e3,
        peak_bytes=peak_bytes,
        peak_method="torch.cuda.max_memory_allocated over one call (inputs included)",
    )
    return timings, first_numpy


def _distinct_copies(torch, args: dict, count: int) -> list[dict]:
    """``count`` copies of ``args``, each tensor in memory of its own (the first is ``args``
    itself), leaves that want gradients still wanting them."""

    def copy(x):
        if not isinstance(x, torch.Tensor):
            return x
        return x.detach().clone().requires_grad_(x.requires_grad)

    return [args] + [{name: copy(x) for name, x in args.items()} for _ in range(count - 1)]


def _event_seconds(torch, launch, repeats: int) -> float:
    """Median over ``repeats`` of the device time ``launch()`` takes, by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        launch()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(samples)


def _graph_seconds_per_call(torch, step, args, state, calls: int, repeats: int) -> float:
    per_graph = min(GRAPH_CALLS, calls)
    replays = math.ceil(calls / per_graph)
    copies = _distinct_copies(torch, args, per_graph)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on a side stream, as capture requires
        for _ in range(2):
            step(args, state)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chained = state
        for call_args in copies:
            chained, _ = step(call_args, chained)
    graph.replay()
    torch.cuda.synchronize()

    def launch():
        for _ in range(replays):
            graph.replay()

    return _event_seconds(torch, launch, repeats) / (replays * per_graph)


def _eager_seconds_per_call(torch, step, args, state, calls: int, repeats: int) -> float:
    copies = _distinct_copies(torch, args, min(GRAPH_CALLS, calls))

    def launch():
        chained = state
        for call in range(calls):
            chained, _ = step(copies[call % len(copies)], chained)

    return _event_seconds(torch, launch, repeats) / calls
