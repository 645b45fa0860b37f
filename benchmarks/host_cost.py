"""Host time of a jitted prefill call, against a trivial jitted function of the same arguments.

``python -m benchmarks.host_cost [--only TERMS] [--backend sm90] [--calls N]`` prints, per shape,
the median host time of dispatching one call (the time until the jitted function returns, the
device still working, the queue drained between calls so it never blocks) for prefill and for
``lambda *args: args[0][0, 0, 0]`` on the same arguments, and jax_kda's share: the difference.
SPEC's goal: under 20 us (JAX's own dispatch of the trivial function is 90-160 us a blocked call
on the H200 machine). A diagnostic: results tables come from ``benchmarks.run``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp

import jax_kda


@dataclass(frozen=True)
class HostCost:
    prefill_us: float
    trivial_us: float

    @property
    def share_us(self) -> float:
        """jax_kda's part of a call's host time: what prefill adds to the trivial dispatch."""
        return self.prefill_us - self.trivial_us


def dispatch_seconds(fn, args, calls: int) -> float:
    """Median seconds until ``fn(*args)`` returns, over ``calls`` calls, each on an idle queue
    (the previous call waited for outside the timed span). ``fn`` is compiled first."""
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        out = fn(*args)
        samples.append(time.perf_counter() - start)
        jax.block_until_ready(out)
    return statistics.median(samples)


def host_cost(inputs, backend: str, gate_lower_bound: float | None, calls: int) -> HostCost:
    """inputs: (q, k, v, g, beta, cu_seqlens, initial_state), device arrays."""

    @jax.jit
    def prefill(q, k, v, g, beta, cu, state):
        return jax_kda.prefill(
            q, k, v, g, beta, cu_seqlens=cu, initial_state=state, backend=backend,
            gate_lower_bound=gate_lower_bound,
        )  # fmt: skip

    @jax.jit
    def trivial(q, k, v, g, beta, cu, state):
        return q[0, 0, 0]

    return HostCost(
        prefill_us=dispatch_seconds(prefill, inputs, calls) * 1e6,
        trivial_us=dispatch_seconds(trivial, inputs, calls) * 1e6,
    )


def _main():
    from benchmarks.selection import parse_only, select
    from benchmarks.shapes import ALL_SHAPES
    from jax_kda.oracle import production_inputs

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="spec", help="shapes or groups, as benchmarks.run's")
    parser.add_argument("--backend", default="auto", choices=jax_kda.BACKENDS)
    parser.add_argument("--calls", type=int, default=200, help="calls per median")
    parser.add_argument(
        "--exact",
        action="store_true",
        help="state no gate bound (the exact 64-token forward on sm90), instead of lb = -5",
    )
    options = parser.parse_args()
    shapes, _ = select(parse_only(options.only), ALL_SHAPES, [])
    for shape in shapes:
        x = production_inputs(list(shape.lengths), shape.heads, seed=0)
        inputs = [jnp.asarray(a) for a in x]
        cost = host_cost(inputs, options.backend, None if options.exact else -5.0, options.calls)
        print(
            f"{shape.name:>20}: prefill {cost.prefill_us:7.1f} us, trivial "
            f"{cost.trivial_us:7.1f} us, jax_kda's share {cost.share_us:7.1f} us"
        )


if __name__ == "__main__":
    _main()
