"""Demo: ``python -m jax_kda`` runs prefill on random production-gate data with the default
backend, checks it against the float64 oracle and prints the timings."""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

import jax_kda
from jax_kda.constants import GATE_LOWER_BOUND_MIN
from jax_kda.oracle import RMS_RATIO_BAR, production_inputs, recurrent_oracle, rms_ratio


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_kda", description=__doc__)
    parser.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=[1300, 547, 963, 271],
        help="packed sequence lengths (default: %(default)s)",
    )
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--backend", default="auto", choices=jax_kda.BACKENDS)
    parser.add_argument("--iters", type=int, default=10, help="timed calls")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    x = production_inputs(args.lengths, args.heads, seed=args.seed)
    device_args = [jax.device_put(a) for a in x]
    fn = jax.jit(
        lambda q, k, v, g, b, cu, s: jax_kda.prefill(
            q,
            k,
            v,
            g,
            b,
            cu_seqlens=cu,
            initial_state=s,
            gate_lower_bound=GATE_LOWER_BOUND_MIN,  # production_inputs' gate: -5 * sigmoid(.)
            backend=args.backend,
        )
    )

    start = time.perf_counter()
    o, final = jax.block_until_ready(fn(*device_args))
    first = time.perf_counter() - start
    times = []
    for _ in range(args.iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*device_args))
        times.append(time.perf_counter() - start)

    ref_o, ref_final = recurrent_oracle(*x)
    err_o, err_final = rms_ratio(o, ref_o), rms_ratio(final, ref_final)
    ok = err_o <= RMS_RATIO_BAR and err_final <= RMS_RATIO_BAR
    total = int(np.sum(args.lengths))
    print(
        f"jax_kda {jax_kda.__version__} on {jax.devices()[0].device_kind} "
        f"(jax {jax.__version__}), backend={args.backend}"
    )
    print(f"T={total} H={args.heads} N={len(args.lengths)} lengths={args.lengths}")
    print(f"first call (compile + run): {first * 1e3:.1f} ms")
    print(f"per call, median of {args.iters}: {np.median(times) * 1e3:.2f} ms")
    print(
        f"rms_ratio vs float64 oracle: o {err_o:.2e}, final_state {err_final:.2e} "
        f"(bar {RMS_RATIO_BAR:.0e}): {'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
