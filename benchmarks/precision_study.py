"""How much product precision the gradients need: the XLA path's forward and gradients against the
float64 oracle, with every product's float32 operands rounded to bfloat16 first (one bf16 pass,
float32 accumulation: what a single wgmma per product gives) or at float32 (HIGHEST).

The sm90 kernels take every product as three bf16 passes (hi*hi + lo*hi + hi*lo), about float32
accuracy, which triples their tensor-core work and doubles their operand images in shared memory.
This measures what that buys against SPEC's bar (rms_ratio <= 1e-2 for o, the final state and
every gradient). Runs anywhere (CPU included):

    python -m benchmarks.precision_study [--lengths 300,0,77,130] [--heads 2]

--decayed-products asks which products of the decayed products' backward need three passes:
the sm90 backward's structure in XLA (the chunk operands' and state scan's custom VJPs of
jax_kda.sm90.backend around XLA stand-ins, every other product one bf16 pass) with a model of
the kernel's anchored decomposition (anchored_decayed_bwd) whose two product kinds, P (the
cotangent in the anchors' packing x the right factors) and back (the transposed ones), take
float32 or bf16-rounded operands each.

--intermediates asks which per-chunk arrays the sm90 backward could keep in bfloat16 (half their
HBM traffic): the training path's structure (sm90.backend.differentiable_chunks around XLA
stand-ins, every product one bf16 pass) with the chunk core's outputs, the chunk states or the
states' cotangents rounded to bfloat16 where they are stored (bf16_intermediates).

--storage asks the same of the next two arrays to halve, with the core's and the dense
backward's outputs in bf16 as the kernels store them: the chunk states (what the dense backward
reads as S) and the reverse scan's addend (the outputs' part of each chunk's state cotangent),
on production, long-memory and harsh-gate data and the GPU test's two pinned 257-token calls.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np

import jax_kda
from jax_kda import xla
from jax_kda.oracle import (
    long_memory_inputs,
    production_inputs,
    recurrent_oracle,
    rms_ratio,
)
from jax_kda.sm90 import backend as sm90_backend
from jax_kda.sm90.kernels.chunk64 import BLOCK, MIDDLE

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
    and their backward) and of jax_kda.sm90.backend (its custom VJPs' products) takes
    bfloat16-rounded operands."""
    names = {n: getattr(jnp, n) for n in dir(jnp) if not n.startswith("__")}
    saved = xla.jnp, sm90_backend.jnp
    xla.jnp = sm90_backend.jnp = types.SimpleNamespace(**{**names, "einsum": _bf16_einsum})
    try:
        yield
    finally:
        xla.jnp, sm90_backend.jnp = saved


def _rounded(x, bf16: bool):
    return x.astype(jnp.bfloat16).astype(jnp.float32) if bf16 else x


def anchored_decayed_bwd(
    bf16_p: bool, bf16_back: bool, exact_diagonal_blocks: bool = False, anchor: int = MIDDLE
):
    """xla._decayed_products_bwd's contract computed the way kernels/kda_decayed_bwd_sm90.py
    does, every block anchored at its row `anchor` (the middle by default, what the kernel
    takes wherever a half block's decay is under 60 e-folds, every gate >= -7.5 included; the
    model does not choose, so give it such data): with r_i = exp(Gamma_i - Gamma_m(i)),
      P(w, x)_i = r_i sum_{j <= i} w_ij [x_j exp(Gamma_m(i) - Gamma_j)],
      back_j = sum over blocks I of exp(Gamma_mI - Gamma_j) sum_{i in I} (d_kk_ij k_i r_i +
        d_qk_ij q_i r_i),
    the bracketed operands of each product bf16-rounded where asked (one wgmma pass), the rest
    float32. exact_diagonal_blocks: the products take the cotangents of the pairs j < i in
    earlier blocks only, and the diagonal blocks' pairs (where the decay is largest) are added in
    float32, as the kernel's pair-by-pair pass does for chunks that forbid middle anchors.
    anchor: 0 for the kernel's first-row anchors, which it pairs with the diagonal blocks
    taken pair by pair (exact_diagonal_blocks=True)."""
    block = BLOCK
    hi = jax.lax.Precision.HIGHEST

    def bwd(residuals, cotangents):
        if not exact_diagonal_blocks:
            return products(residuals, cotangents, bf16_p, bf16_back)
        rows = jnp.arange(cotangents[0].shape[-1]) // block
        same = rows[:, None] == rows[None, :]
        earlier = products(residuals, [jnp.where(same, 0.0, c) for c in cotangents], bf16_p,
                           bf16_back)  # fmt: skip
        diagonal = products(residuals, [jnp.where(same, c, 0.0) for c in cotangents], False, False)
        return tuple(a + b for a, b in zip(earlier, diagonal, strict=True))

    def products(residuals, cotangents, bf16_p, bf16_back):
        q, k, gamma = (x.astype(jnp.float32) for x in residuals)
        rows = jnp.arange(gamma.shape[-2])
        d_kk, d_qk = (jnp.where(rows[:, None] >= rows[None, :], c, 0.0) for c in cotangents)
        anchors = [block * b + anchor for b in range(gamma.shape[-2] // block)]
        r = jnp.exp(gamma - gamma[..., (rows // block) * block + anchor, :])

        def forward(w, x):
            parts = []
            for b, m in enumerate(anchors):
                n = block * (b + 1)
                right = x[..., :n, :] * jnp.exp(gamma[..., m, None, :] - gamma[..., :n, :])
                w_b = w[..., block * b : n, :n]
                w_b, right = _rounded(w_b, bf16_p), _rounded(right, bf16_p)
                parts.append(jnp.einsum("...ij,...jd->...id", w_b, right, precision=hi))
            return r * jnp.concatenate(parts, axis=-2)

        back = jnp.zeros(gamma.shape, jnp.float32)
        for b, m in enumerate(anchors):
            rs = slice(block * b, block * (b + 1))
            w_b = jnp.concatenate([d_kk[..., rs, :], d_qk[..., rs, :]], axis=-2)
            left = jnp.concatenate([k[..., rs, :], q[..., rs, :]], axis=-2)
            left = left * jnp.concatenate([r[..., rs, :]] * 2, axis=-2)
            w_b, left = _rounded(w_b, bf16_back), _rounded(left, bf16_back)
            inner = jnp.einsum("...cj,...cd->...jd", w_b, left, precision=hi)
            paired = (rows < block * (b + 1))[:, None]  # rows j this block's anchor pairs with
            decay = jnp.exp(jnp.where(paired, gamma[..., m, None, :] - gamma, 0.0))
            back = back + jnp.where(paired, decay * inner, 0.0)
        p_kk, p_qk = forward(d_kk, k), forward(d_qk, k)
        return p_qk, p_kk + back, k * (p_kk - back) + q * p_qk

    return bwd


def sm90_structure(decayed_bwd):
    """prefill's signature on the sm90 backward's structure in XLA: the chunk operands' custom
    VJP (its backward with `decayed_bwd` for the decayed products) and the state scan's."""

    def forward(q, k, v, g, beta, cu_seqlens=None, initial_state=None, scale=None, backend=None):
        del backend
        return xla.forward(
            q, k, v, g, beta, cu_seqlens, initial_state, scale,
            scan=sm90_backend.differentiable_state_scan(xla.state_scan),
            operands=sm90_backend.differentiable_chunk_operands(
                sm90_backend.xla_chunk_core, decayed_bwd=decayed_bwd
            ),
        )  # fmt: skip

    return forward


def errors(x, scale: float, seed: int, prefill=jax_kda.prefill) -> dict[str, float]:
    """rms_ratio of o, the final state and the six gradients of sum(o * w_o) + sum(final * w_f)
    (random weights) against float64 autodiff of the recurrence; `prefill`: jax_kda.prefill on
    the XLA path, or sm90_structure(...)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    w_o = rng.standard_normal(x.q.shape).astype(np.float32)
    w_f = rng.standard_normal(x.initial_state.shape).astype(np.float32)

    def forward(q, k, v, g, beta, state):
        return prefill(
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


def _rounded_bf16(x):
    return x.astype(jnp.bfloat16).astype(jnp.float32)


def bf16_intermediates(
    core_outputs: bool,
    states: bool,
    state_cotangents: bool,
    dense_outputs: bool = False,
    addend: bool = False,
):
    """prefill's signature on the sm90 training path's structure in XLA (differentiable_chunks
    around xla_chunk_core, xla.state_scan and xla_chunk_bwd) with stored arrays rounded to
    bfloat16: core_outputs, the chunk core's W, U, Qg, Aqk, Kd and T^-1 (the element-wise
    backward, xla._elementwise_bwd, recomputes its float32 Qg and Kd from the tokens and
    Gamma); states,
    the chunk states the forward scan writes; state_cotangents, those the reverse scan writes
    (G); dense_outputs, the dense backward's d_rhs, d_qg, d_attn, d_kd and d_kk (what
    sm90.dense_bwd_results stores in bf16); addend, the reverse scan's addend, the outputs' part
    of each chunk's state cotangent (what the state cotangent kernel writes)."""

    def core(*args):
        out = list(sm90_backend.xla_chunk_core(*args))
        if core_outputs:  # W, U, Qg, Aqk, Kd and T^-1: what the kernel stores in bf16
            out[:5] = [_rounded_bf16(x) for x in out[:5]]
            out[8] = _rounded_bf16(out[8])
        return tuple(out)

    def scan(*args, reverse):
        per_slot, final = xla.state_scan(*args, reverse=reverse)
        if state_cotangents if reverse else states:
            per_slot = _rounded_bf16(per_slot)
        return per_slot, final

    def dense(*args):
        out = list(sm90_backend.xla_dense_bwd(*args))
        if dense_outputs:  # d_decay (4) and d_beta_kk (6) stay float32
            out = [x if i in (4, 6) else _rounded_bf16(x) for i, x in enumerate(out)]
        return tuple(out)

    def state_cotangent(*args):
        d_states = sm90_backend.xla_state_cotangent(*args)
        return _rounded_bf16(d_states) if addend else d_states

    chunk_bwd = functools.partial(sm90_backend.xla_chunk_bwd, dense_bwd=dense)
    chunks = sm90_backend.differentiable_chunks(
        core, scan, chunk_bwd, state_cotangent=state_cotangent
    )

    def forward(q, k, v, g, beta, cu_seqlens=None, initial_state=None, scale=None, backend=None):
        del backend
        return xla.forward(q, k, v, g, beta, cu_seqlens, initial_state, scale, chunks=chunks)

    return forward


def _intermediates_study(lengths, heads: int, scale: float) -> None:
    """Production, long-memory and harsh-gate data (g = -30 on every other channel); every
    product one bf16 pass (the sm90 default)."""
    variants = {
        "all float32": (False, False, False),
        "core outputs bf16": (True, False, False),
        "states bf16": (False, True, False),
        "state cotangents bf16": (False, False, True),
        "core and dense bf16": (True, False, False, True),
        "all four bf16": (True, True, True, True),
    }

    def harsh(lengths, heads, seed):
        x = production_inputs(lengths, heads, seed=seed)
        g = np.array(x.g)
        g[:, :, ::2] = -30.0
        return x._replace(g=g)

    data_sets = (("production", production_inputs), ("long-memory", long_memory_inputs))
    for data, make in (*data_sets, ("g -30", harsh)):
        x = make(lengths, heads, seed=5)
        for name, options in variants.items():
            with single_pass_bf16_products():
                result = errors(x, scale, seed=7, prefill=bf16_intermediates(*options))
            worst = max(result.values())
            cells = " ".join(f"{k} {v:.1e}" for k, v in result.items())
            print(f"{data:12s} {name:22s} worst {worst:.1e} | {cells}", flush=True)


def _storage_study(lengths, heads: int, scale: float) -> None:
    """The next traffic cut's precision: with the chunk core's and the dense backward's outputs
    in bf16 as the kernels store them, the chunk states (the dense backward's S) and the reverse
    scan's addend (the state cotangent kernel's output) in float32 or bf16; production,
    long-memory and harsh-gate data, and the two pinned 257-token calls of the GPU test where
    G's rounding in Kd G had put dbeta near SPEC's bar (tests/test_sm90_backward_gpu.py,
    test_grads_where_one_pass_of_the_state_cotangent_misses)."""
    variants = {
        "as stored now": (True, False, False, True, False),
        "states bf16": (True, True, False, True, False),
        "addend bf16": (True, False, False, True, True),
        "both bf16": (True, True, False, True, True),
    }

    def harsh(lengths, heads, seed):
        x = production_inputs(lengths, heads, seed=seed)
        g = np.array(x.g)
        g[:, :, ::2] = -30.0
        return x._replace(g=g)

    cases = [
        (name, make(lengths, heads, seed=5), 7)
        for name, make in (("production", production_inputs),
                           ("long-memory", long_memory_inputs), ("g -30", harsh))
    ]  # fmt: skip
    cases += [(f"pinned {seed}", production_inputs([257], 2, seed=seed + 10), seed + 5)
              for seed in (1666, 1814)]  # fmt: skip
    for data, x, weights_seed in cases:
        for name, options in variants.items():
            with single_pass_bf16_products():
                result = errors(x, scale, seed=weights_seed, prefill=bf16_intermediates(*options))
            worst = max(result.values())
            cells = " ".join(f"{k} {v:.1e}" for k, v in result.items())
            print(f"{data:12s} {name:14s} worst {worst:.1e} | {cells}", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="300,0,77,130")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--scale", type=float, default=0.3)
    parser.add_argument(
        "--decayed-products", action="store_true",
        help="which products of the decayed products' backward need three passes (read above)",
    )  # fmt: skip
    parser.add_argument(
        "--intermediates", action="store_true",
        help="which per-chunk arrays the sm90 backward could store in bfloat16 (read above)",
    )  # fmt: skip
    parser.add_argument(
        "--storage", action="store_true",
        help="the chunk states and the reverse scan's addend in bf16 (read _storage_study)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.storage:
        _storage_study(lengths, args.heads, args.scale)
        return
    if args.decayed_products:
        _decayed_products_study(lengths, args.heads, args.scale)
        return
    if args.intermediates:
        _intermediates_study(lengths, args.heads, args.scale)
        return
    for data, make in (("production", production_inputs), ("long-memory", long_memory_inputs)):
        x = make(lengths, args.heads, seed=5)
        for mode in ("float32", "bf16 x1"):
            with single_pass_bf16_products() if mode == "bf16 x1" else contextlib.nullcontext():
                result = errors(x, args.scale, seed=7)
            worst = max(result.values())
            cells = " ".join(f"{k} {v:.1e}" for k, v in result.items())
            print(f"{data:12s} {mode:8s} worst {worst:.1e} | {cells}", flush=True)


def _decayed_products_study(lengths, heads: int, scale: float) -> None:
    """Production data (middle anchors valid throughout), two seeds; every product outside the
    decayed products' backward one bf16 pass (the sm90 default)."""
    variants = {
        "P, back float32": (False, False, False),
        "P bf16, back float32": (True, False, False),
        "P float32, back bf16": (False, True, False),
        "P, back bf16": (True, True, False),
        "P, back bf16 off the diagonal blocks": (True, True, True),
        "the same, first-row anchors": (True, True, True, 0),
    }
    for seed in (5, 11):
        x = production_inputs(lengths, heads, seed=seed)
        for name, options in variants.items():
            forward = sm90_structure(anchored_decayed_bwd(*options))
            with single_pass_bf16_products():
                result = errors(x, scale, seed=7, prefill=forward)
            cells = " ".join(f"{k} {v:.1e}" for k, v in result.items())
            print(f"seed {seed:2d} {name:36s} | {cells}", flush=True)


if __name__ == "__main__":
    main()
