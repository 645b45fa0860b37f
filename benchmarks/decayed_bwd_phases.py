"""``python -m benchmarks.decayed_bwd_phases [--only TERMS]``: where a CTA of the training
backward's largest kernel spends its time, phase by phase, read from the CTAs' own clocks (a
GPU-machine diagnostic, benchmarks/chunk_core_phases.py's for the chunk core).

The fused decayed products' and tokens' backward (kernels/kda_decayed_bwd_sm90.py,
DecayedTokensBwdSm90: one CTA a (64-token chunk, head, half of the channels)) takes about a third
of a training step's backward (H100, 2026-12-06: 107.6 of 311.4 us at 2048x12x1, 508.0 of
1410.3 at 8192x16x1, `results/2026-12-06-h100-b-profile-train.log`). Its stamps variant
(sm90.backend.decayed_tokens_bwd_stamps) has thread 0 of every CTA read the SM's cycle counter
at each phase's end (DECAYED_PHASES) and the global timer at the CTA's start and end; this
prints, per shape, the median cycles of each phase and its share of a CTA, the CTAs'
durations, how many ran at once on average, the kernel's span, and per phase how many CTAs
were in it at once (mean and 90th percentile over the span: loads that run in step, every CTA
loading together, show a 90th percentile far above the mean). Its inputs: production-gate data
(the kernel sums g into Gamma itself, so the anchors are the ones a real step takes) and random
cotangents (the kernel's work does not depend on their values).
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks.chunk_core_phases import format_table, phase_table


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="2048x12x1,8192x16x1,33x2x3-ragged")
    options = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from benchmarks.selection import parse_only, select
    from benchmarks.shapes import ALL_SHAPES
    from jax_kda import sm90, xla
    from jax_kda.constants import default_scale
    from jax_kda.oracle import production_inputs
    from jax_kda.sm90.ffi_call import register
    from jax_kda.sm90.kernels.kda_decayed_bwd_sm90 import DECAYED_PHASES

    register()
    shapes, _ = select(parse_only(options.only), ALL_SHAPES, [])
    scale = default_scale()
    run = jax.jit(sm90.backend.decayed_tokens_bwd_stamps, static_argnums=0)
    for shape in shapes:
        x = production_inputs(list(shape.lengths), shape.heads, seed=0)
        tokens = [jnp.asarray(a) for a in x[:5]]
        cu = jnp.asarray(x.cu_seqlens)
        slots = xla.chunk_slot_count(x.q.shape[0], len(shape.lengths))
        rng = np.random.default_rng(0)
        chunk = (slots, shape.heads, 64)

        def random(shape, dtype=jnp.bfloat16, rng=rng):
            return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)

        d_kk, d_attn = random((*chunk, 64)), random((*chunk, 64))
        # d_rhs, d_beta_kk, d_qg, d_kd, d_decay, as the dense kernel gives them
        cotangents = (
            random((*chunk, 256)),
            random(chunk, jnp.float32),
            random((*chunk, 128)),
            random((*chunk, 128)),
            random((slots, shape.heads, 128), jnp.float32),
        )
        call = (scale, tuple(tokens), cu, d_kk, d_attn, cotangents)
        jax.block_until_ready(run(*call))  # compile, and a first run
        stamps = np.asarray(run(*call))
        print(format_table(shape.name, phase_table(stamps, DECAYED_PHASES)), flush=True)


if __name__ == "__main__":
    main()
