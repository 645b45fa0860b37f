"""How much product precision the gradients need: the XLA path's forward and gradients against the
float64 oracle, with every product's float32 operands rounded to bfloat16 first (one bf16 pass,
float32 accumulation: what a single wgmma per product gives) or at float32 (HIGHEST).

The sm90 kernels take every product as three bf16 passes (hi*hi + lo*hi + hi*lo), about float32
accuracy, which triples their tensor-core work and doubles their operand images in shared memory.
This measures what that buys against SPEC's bar (rms_ratio <= 1e-2 for o, the final state and
every gradient). Runs anywhere (CPU included):

    python -m benchmarks.precision_study [--lengths 300,0,77,130] [--heads 2]
"""

from __future__ import annotations

import argparse
import contextlib
import types

import jax
import jax.numpy as jnp

import jax_kda
from jax_kda import xla
from jax_kda.oracle import (
    long_memory_inputs,
    production_inputs,
    recurrent_oracle,
    rms_ratio,
)

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def _bf16_einsum(spec, *operands, precision=None, **kwargs):
    """jnp.einsum with float32 operands rounded to bfloat16, then multiplied exactly."""
    del precision
    operands = [
        x.astype(jnp.bfloat16).astype(jnp.float32) if x.dtype == jnp.float32 else x
        for x in operands
    ]
    return jnp.einsum(spec, *operands, precision=jax.lax.Precision.HIGHEST, **kwargs)


@contextlib.contextmanager
def single_pass_bf16_products():
    """Within the block, every einsum of jax_kda.xla (the chunk's products, the solve, the scan,
    and their backward) takes bfloat16-rounded operands."""
    names = {n: getattr(jnp, n) for n in dir(jnp) if not n.startswith("__")}
    saved = xla.jnp
    xla.jnp = types.SimpleNamespace(**{**names, "einsum": _bf16_einsum})
    try:
        yield
    finally:
        xla.jnp = saved


def errors(x, scale: float, seed: int) -> dict[str, float]:
    """rms_ratio of o, the final state and the six gradients of sum(o * w_o) + sum(final * w_f)
    (random weights) against float64 autodiff of the recurrence."""
    import numpy as np

    rng = np.random.default_rng(seed)
    w_o = rng.standard_normal(x.q.shape).astype(np.float32)
    w_f = rng.standard_normal(x.initial_state.shape).astype(np.float32)

    def forward(q, k, v, g, beta, state):
        return jax_kda.prefill(
            q, k, v, g, beta, cu_seqlens=x.cu_seqlens, initial_state=state, scale=scale,
            backend="xla",
        )  # fmt: skip

    def loss(*a):
        o, final = forward(*a)
        return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(final * w_f)

    args = (*x[:5], x.initial_state)
    o, final = jax.jit(forward)(*args)
    grads = jax.jit(jax.grad(loss, argnums=range(6)))(*args)
    ref_o, ref_final = recurrent_oracle(*x, scale=scale)
    with jax.enable_x64(True):

        def loss64(*a):  # the weights as arguments: as constants XLA folds f64 arrays slowly
            o, final = recurrent_oracle(*a[:5], x.cu_seqlens, a[5], scale=scale)
            return jnp.sum(o * a[6]) + jnp.sum(final * a[7])

        ref_grads = jax.jit(jax.grad(loss64, argnums=range(6)))(
            *(jnp.asarray(a, jnp.float64) for a in (*args, w_o, w_f))
        )
    out = {"o": rms_ratio(o, ref_o), "final": rms_ratio(final, ref_final)}
    for name, a, r in zip(NAMES, grads, ref_grads, strict=True):
        out[f"d{name}"] = rms_ratio(a, r)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="300,0,77,130")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--scale", type=float, default=0.3)
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    for data, make in (("production", production_inputs), ("long-memory", long_memory_inputs)):
        x = make(lengths, args.heads, seed=5)
        for mode in ("float32", "bf16 x1"):
            with single_pass_bf16_products() if mode == "bf16 x1" else contextlib.nullcontext():
                result = errors(x, args.scale, seed=7)
            worst = max(result.values())
            cells = " ".join(f"{k} {v:.1e}" for k, v in result.items())
            print(f"{data:12s} {mode:8s} worst {worst:.1e} | {cells}", flush=True)


if __name__ == "__main__":
    main()
