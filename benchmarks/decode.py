"""``python -m benchmarks.decode``: GPU time of ``jax_kda.decode`` against its HBM floor.

Latest H200 run (benchmarks/results/2026-12-03-h200-decode.md): the sm90 kernel 1.37x to
1.57x the floor from 64 sequences x 16 heads up, dense or pooled, the plain-JAX step 2.07x to
3.90x; small calls are bound by the step's fixed cost (the CPU, where the floor means nothing,
runs only --quick). The step is memory-bound: each (sequence, head) state, 64 KiB of float32,
is read and written once, beside a token's q, k, v, g, beta and o; the floor is those bytes at the
H200's bandwidth (benchmarks/hbm.py), and the goal is a step within 2x of it.

Per shape (N sequences x H heads), two rows: the states as one [N, H, 128, 128] array, and as a
pool of 2N rows of which the step gathers and scatters N by index. GPU time comes from the
harness's executables of chained steps (benchmarks/jax_measure.py: the state carried from step to
step, each step on its own copy of the token inputs); accuracy from the float64 oracle.

    python -m benchmarks.decode [--only 64x32,pool] [--backends auto,xla] [--quick] [--seed N]

--backends: the decode backends to time, each a row per shape and layout ("auto": the sm90
kernel on a Hopper GPU for these bf16 inputs, plain JAX elsewhere).
"""

from __future__ import annotations

import argparse
import functools

import jax
import numpy as np

import jax_kda
from benchmarks.hbm import HBM_BYTES_PER_SECOND, decode_bytes, decode_floor_us
from benchmarks.jax_measure import measure
from benchmarks.timing import FULL, QUICK
from jax_kda.oracle import production_inputs, recurrent_oracle, rms_ratio

DECODE_SHAPES = ((1, 16), (8, 16), (64, 16), (256, 16), (64, 32), (256, 32), (1024, 32))
"""(sequences, heads) per step: one sequence to a large serving batch, Kimi Linear's head counts."""
QUICK_SHAPES = ((2, 1), (3, 2))
POOL_ROWS_PER_SEQUENCE = 2
LAYOUTS = ("dense", "pool")


def step(args, state, backend="auto"):
    """One decode step in the harness's form: (next state, outputs)."""
    o, new_state = jax_kda.decode(
        args["q"], args["k"], args["v"], args["g"], args["beta"], state,
        state_indices=args.get("state_indices"), backend=backend,
    )  # fmt: skip
    return new_state, (o,)


def decode_inputs(num_sequences: int, heads: int, pooled: bool, seed: int):
    """(args, state, rows): SPEC's production data for one token per sequence; with `pooled`,
    the states in a pool of 2N rows and `state_indices` a random choice of N of them; `rows`
    the pool rows the sequences use (numpy)."""
    x = production_inputs([1] * num_sequences, heads, seed=seed)
    args = dict(q=x.q, k=x.k, v=x.v, g=x.g, beta=x.beta)
    if not pooled:
        return args, x.initial_state, np.arange(num_sequences)
    rng = np.random.default_rng(seed + 1)
    pool_rows = POOL_ROWS_PER_SEQUENCE * num_sequences
    pool = (0.05 * rng.standard_normal((pool_rows, *x.initial_state.shape[1:]))).astype(np.float32)
    rows = rng.permutation(pool_rows)[:num_sequences].astype(np.int32)
    return {**args, "state_indices": rows}, pool, rows


def measure_decode(
    num_sequences: int, heads: int, layout: str, settings, seed: int, backend: str = "auto"
) -> dict:
    pooled = layout == "pool"
    args, state, rows = decode_inputs(num_sequences, heads, pooled, seed)
    timings, (new_state, (o,)) = measure(
        functools.partial(step, backend=backend), jax.device_put(args), jax.device_put(state),
        settings,
    )  # fmt: skip
    cu = np.arange(num_sequences + 1, dtype=np.int32)
    ref_o, ref_state = recurrent_oracle(
        args["q"], args["k"], args["v"], args["g"], args["beta"], cu, state[rows]
    )
    floor = decode_floor_us(num_sequences, heads, pooled=pooled)
    return {
        "shape": f"{num_sequences}x{heads}",
        "layout": layout,
        "backend": backend,
        "bytes": decode_bytes(num_sequences, heads, pooled=pooled),
        "floor_us": floor,
        "gpu_us": timings.gpu_us,
        "floor_ratio": timings.gpu_us / floor,
        "per_call_us": timings.per_call_us,
        "o_rms_ratio": rms_ratio(o, ref_o),
        "state_rms_ratio": rms_ratio(new_state[rows], ref_state),
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated shapes (64x32) or layouts")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, few calls (CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backends", default="auto", help="comma-separated: auto, sm90, xla")
    options = parser.parse_args(argv)
    backends = [b for b in options.backends.split(",") if b]
    terms = {t for t in options.only.split(",") if t}
    shapes = QUICK_SHAPES if options.quick else DECODE_SHAPES
    settings = QUICK if options.quick else FULL
    device = jax.devices()[0]
    print(
        f"benchmarks.decode on {device.device_kind}; floor at "
        f"{HBM_BYTES_PER_SECOND / 1e12:.1f} TB/s (the H200's HBM"
        f"{'' if device.platform == 'gpu' else '; meaningless off the GPU'})",
        flush=True,
    )
    columns = ("N x H", "states", "backend", "MB moved", "floor us", "gpu us", "x floor", "o rms",
               "state rms")  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for num_sequences, heads in shapes:
        for layout in LAYOUTS:
            name = f"{num_sequences}x{heads}"
            if terms and not terms & {name, layout}:
                continue
            for backend in backends:
                row = measure_decode(num_sequences, heads, layout, settings, options.seed, backend)
                rows.append(row)
                print(
                    f"| {name} | {layout} | {backend} | {row['bytes'] / 1e6:.2f} | "
                    f"{row['floor_us']:.2f} | {row['gpu_us']:.2f} | {row['floor_ratio']:.2f} | "
                    f"{row['o_rms_ratio']:.1e} | {row['state_rms_ratio']:.1e} |",
                    flush=True,
                )
    return rows


if __name__ == "__main__":
    main()
