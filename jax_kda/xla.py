"""The pure-XLA KDA forward pass: the chunked (WY/UT) form with 64-token chunks.

It runs on any backend, is the default off Hopper, the fallback the sm90 kernels are compared
with, and (through JAX autodiff, with a hand-written backward for the in-chunk decayed products)
the backward pass.

Varlen layout. Packed tokens are mapped to *chunk slots* on the device, without a host sync:
sequence s owns slots ``cu[s] // 64 + s + c`` for its chunks c = 0 .. ceil(len_s / 64) - 1.
Slots of different sequences never overlap, and ``T // 64 + N`` slots always suffice, so every
static shape is known from T and N alone. Unused rows and whole gap slots hold k = v = q = 0,
g = 0 and beta = 0, which makes their chunk map the identity on the state.

Overflow. The in-chunk decay between tokens i >= j, exp(Gamma_i - Gamma_j) <= 1, is never
factorised into exp(Gamma_i) * exp(-Gamma_j): it is taken pairwise per channel within 4-row
blocks, and split at a row r between i and j otherwise (both factors <= 1; _decayed_products),
so no operand can overflow whatever the gate: the path is exact for any g <= 0, not only g >= -5.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_kda.constants import GATE_FLOOR, SCAN_CHUNK

_PRECISION = lax.Precision.HIGHEST
"""The products' precision: float32 (float32 FMAs on GPUs). Measured on the H200 (2026-12-01,
2048x12x1 training step through the sm90 backend): HIGHEST 2043 us, bf16_6x 2159, bf16_3x 1860;
HIGH runs as TF32 there, 2e-4 to 2e-3 off float32, too coarse for the path the kernels are
checked against. The step's time is in the number of XLA kernels, not in these products."""


XLA_CHUNK = SCAN_CHUNK
"""Tokens per chunk of this path: a quarter of the serial scan steps of 16-token chunks, and
more of the work in the parallel per-chunk part; the sm90 backward's state scan shares it."""

BLOCK = 16
"""Rows per block of the triangular solve (16-row diagonal blocks inverted, then block
substitution)."""

BLOCKS = XLA_CHUNK // BLOCK


def chunk_slot_count(total_tokens: int, num_sequences: int) -> int:
    """Static number of chunk slots that covers any packing of T tokens in N sequences."""
    return total_tokens // XLA_CHUNK + num_sequences


def _token_slots(cu_seqlens: jax.Array, total_tokens: int):
    """Per token: its sequence index and its row in the flattened [slots * 64] chunk grid."""
    t = jnp.arange(total_tokens, dtype=jnp.int32)
    # The sequence of token t: how many interior boundaries cu[1..N-1] are <= t (a scatter and
    # a cumsum: no loop, and T may be symbolic under jax.export).
    boundaries = jnp.zeros((total_tokens,), jnp.int32).at[cu_seqlens[1:-1]].add(1, mode="drop")
    seq = jnp.cumsum(boundaries, dtype=jnp.int32)
    start = cu_seqlens[seq]
    local = t - start
    slot = start // XLA_CHUNK + seq + local // XLA_CHUNK
    return seq, slot * XLA_CHUNK + local % XLA_CHUNK


def _sequence_slots(cu_seqlens: jax.Array):
    """Per sequence: first chunk slot and chunk count (0 for an empty sequence)."""
    num_sequences = cu_seqlens.shape[0] - 1
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    first = cu_seqlens[:-1] // XLA_CHUNK + jnp.arange(num_sequences, dtype=jnp.int32)
    count = (lengths + XLA_CHUNK - 1) // XLA_CHUNK
    return first, count


def _to_chunks(x: jax.Array, rows: jax.Array, num_slots: int) -> jax.Array:
    """[T, H, ...] -> [slots, H, 64, ...], zero in rows no token maps to."""
    grid = jnp.zeros((num_slots * XLA_CHUNK, *x.shape[1:]), x.dtype)
    grid = grid.at[rows].set(x, unique_indices=True)
    grid = grid.reshape(num_slots, XLA_CHUNK, *x.shape[1:])
    return jnp.moveaxis(grid, 1, 2)


def _unit_lower_solve(lower: jax.Array, rhs: jax.Array) -> jax.Array:
    """Solve (I + lower) X = rhs by forward substitution; lower [..., n, n] strictly lower.

    Plain XLA ops instead of lax.linalg.triangular_solve: on CPU that lowers to jaxlib's LAPACK
    trsm custom call, which splits large batches over XLA's intra-op thread pool and blocks a pool
    thread waiting for them; two such calls running concurrently (forward and backward) can take
    every pool thread and deadlock (seen with jax 0.10.2 on a 2-core host).
    """
    x = rhs
    for i in range(1, lower.shape[-1]):
        # Rows j < i of x are final; lower[..., i, j] is 0 for j >= i.
        x = x.at[..., i, :].add(
            -jnp.einsum("...j,...jd->...d", lower[..., i, :], x, precision=_PRECISION)
        )
    return x


def _blocked_unit_lower_solve(lower: jax.Array, rhs: jax.Array) -> jax.Array:
    """Solve (I + lower) X = rhs for a strictly lower [..., 64, 64] by 16-row blocks: invert the
    unit-diagonal blocks (forward substitution on the identity), then block substitution."""
    batch = lower.shape[:-2]
    blocks = lower.reshape(*batch, BLOCKS, BLOCK, BLOCKS, BLOCK)
    diagonal = jnp.stack([blocks[..., b, :, b, :] for b in range(BLOCKS)], axis=-3)
    identity = jnp.broadcast_to(jnp.eye(BLOCK, dtype=lower.dtype), diagonal.shape)
    inverses = _unit_lower_solve(diagonal, identity)  # [..., BLOCKS, 16, 16]
    rhs_blocks = rhs.reshape(*batch, BLOCKS, BLOCK, rhs.shape[-1])
    solved = []
    for b in range(BLOCKS):
        r = rhs_blocks[..., b, :, :]
        for c in range(b):
            r = r - jnp.einsum(
                "...ij,...jd->...id", blocks[..., b, :, c, :], solved[c], precision=_PRECISION
            )
        solved.append(
            jnp.einsum("...ij,...jd->...id", inverses[..., b, :, :], r, precision=_PRECISION)
        )
    return jnp.concatenate(solved, axis=-2)


PAIRWISE_ROWS = 4
"""Blocks of at most this many rows take the decay pairwise, per channel."""

SPLIT = 4
"""Blocks a larger row range is split into, at each level."""


def _materialised(x):
    """x computed on its own. XLA's GPU compiler otherwise fuses these per-channel pairwise
    reductions into the concatenation that assembles the [64, 64] block matrix, whose emitter runs
    them about 50x slower (H200 profile of a training step, 2048x12x1: 850 of 2870 us)."""
    return lax.optimization_barrier(x)


def _pairwise_decay(gamma):
    """[..., n, n, D]: exp(Gamma_i - Gamma_j) for i >= j, and 1 above the diagonal (callers mask
    it), so neither the value nor its gradient can overflow; with the lower mask [n, n]."""
    rows = gamma.shape[-2]
    incl = jnp.arange(rows)[:, None] >= jnp.arange(rows)[None, :]
    diff = gamma[..., :, None, :] - gamma[..., None, :, :]
    return jnp.exp(jnp.where(incl[:, :, None], diff, 0.0)), incl


class _Blocks:
    """Rows split into SPLIT blocks, and the factors of the decay across blocks: with r(c) the
    last row of block c, exp(Gamma_i - Gamma_j) = from_ref(b, c)_i * into_ref[c]_j for i in
    block b > c, j in block c, and both factors are <= 1."""

    def __init__(self, gamma):
        *self.lead, rows, self.dim = gamma.shape
        self.size = rows // SPLIT
        self.gamma = self.split(gamma)
        self.reference = self.gamma[..., -1, :]  # [..., SPLIT, D]
        self.into_ref = jnp.exp(self.reference[..., :, None, :] - self.gamma)

    def split(self, x):
        """[..., n, D] -> [..., SPLIT, n / SPLIT, D]."""
        return x.reshape(*self.lead, SPLIT, self.size, x.shape[-1])

    def from_ref(self, b, c):
        return jnp.exp(self.gamma[..., b, :, :] - self.reference[..., c, None, :])


@jax.custom_vjp
def _decayed_products(q, k, gamma):
    """[..., n, n] pairs (i, j), i >= j: sum_d x_i,d k_j,d exp(Gamma_i,d - Gamma_j,d) for x = k
    and x = q (zero above the diagonal), without an operand that can overflow for any g <= 0.

    Rows are split into SPLIT blocks. Within a block, recursively the same, down to blocks of
    PAIRWISE_ROWS rows whose decay is taken pairwise. For i in a later block than j, the decay is
    split at the last row r of j's block: exp(Gamma_i - Gamma_r) and exp(Gamma_r - Gamma_j) are
    both <= 1, and their product is the decay, so each block pair is one matrix product.
    """
    if gamma.shape[-2] <= PAIRWISE_ROWS:
        decay, incl = _pairwise_decay(gamma)
        kk = jnp.sum(k[..., :, None, :] * k[..., None, :, :] * decay, -1)
        qk = jnp.sum(q[..., :, None, :] * k[..., None, :, :] * decay, -1)
        return _materialised((jnp.where(incl, kk, 0.0), jnp.where(incl, qk, 0.0)))
    blocks = _Blocks(gamma)
    k_b, q_b = blocks.split(k), blocks.split(q)
    kk_diag, qk_diag = _decayed_products(q_b, k_b, blocks.gamma)  # [..., SPLIT, size, size]
    right = k_b * blocks.into_ref
    zero = jnp.zeros((*blocks.lead, blocks.size, blocks.size), gamma.dtype)
    kk_rows, qk_rows = [], []
    for b in range(SPLIT):
        kk_row, qk_row = [], []
        for c in range(SPLIT):
            if c < b:
                from_ref = blocks.from_ref(b, c)
                kk_row.append(_rows_times(k_b[..., b, :, :] * from_ref, right[..., c, :, :]))
                qk_row.append(_rows_times(q_b[..., b, :, :] * from_ref, right[..., c, :, :]))
            elif c == b:
                kk_row.append(kk_diag[..., b, :, :])
                qk_row.append(qk_diag[..., b, :, :])
            else:
                kk_row.append(zero)
                qk_row.append(zero)
        kk_rows.append(jnp.concatenate(kk_row, axis=-1))
        qk_rows.append(jnp.concatenate(qk_row, axis=-1))
    return jnp.concatenate(kk_rows, axis=-2), jnp.concatenate(qk_rows, axis=-2)


def _rows_times(a, b):
    """[..., i, d] x [..., j, d] -> [..., i, j]."""
    return jnp.einsum("...id,...jd->...ij", a, b, precision=_PRECISION)


def _decayed_apply(w, x, gamma, transposed: bool):
    """With E_ijd = exp(Gamma_id - Gamma_jd) and w [..., n, n] zero above the diagonal:
    out_id = sum_j w_ij x_jd E_ijd, or (transposed) out_jd = sum_i w_ij x_id E_ijd, on the
    blocks of _decayed_products."""
    if gamma.shape[-2] <= PAIRWISE_ROWS:
        weighted = _pairwise_decay(gamma)[0] * w[..., None]
        if transposed:
            return _materialised(jnp.sum(weighted * x[..., :, None, :], axis=-3))
        return _materialised(jnp.sum(weighted * x[..., None, :, :], axis=-2))
    blocks = _Blocks(gamma)
    x_b = blocks.split(x)
    w_b = w.reshape(*blocks.lead, SPLIT, blocks.size, SPLIT, blocks.size)
    diagonal = jnp.stack([w_b[..., b, :, b, :] for b in range(SPLIT)], axis=-3)
    out = list(jnp.moveaxis(_decayed_apply(diagonal, x_b, blocks.gamma, transposed), -3, 0))
    for b in range(SPLIT):
        for c in range(b):
            from_ref, into_ref = blocks.from_ref(b, c), blocks.into_ref[..., c, :, :]
            w_bc = w_b[..., b, :, c, :]
            if transposed:
                inner = jnp.einsum(
                    "...ij,...id->...jd", w_bc, x_b[..., b, :, :] * from_ref, precision=_PRECISION
                )
                out[c] = out[c] + into_ref * inner
            else:
                inner = jnp.einsum(
                    "...ij,...jd->...id", w_bc, x_b[..., c, :, :] * into_ref, precision=_PRECISION
                )
                out[b] = out[b] + from_ref * inner
    return jnp.concatenate(out, axis=-2)


def _decayed_products_fwd(q, k, gamma):
    return _decayed_products(q, k, gamma), (q, k, gamma)


def _decayed_products_bwd(residuals, cotangents):
    """kk_ij = sum_d k_id k_jd E_ijd and qk_ij = sum_d q_id k_jd E_ijd, i >= j, differentiated
    with four decayed applications instead of the autodiff of every block:
    dq = P(B, k); dk = P(A, k) + P^T(A, k) + P^T(B, q);
    dGamma = k P(A, k) + q P(B, k) - k (P^T(A, k) + P^T(B, q))."""
    q, k, gamma = residuals
    rows = gamma.shape[-2]
    incl = jnp.arange(rows)[:, None] >= jnp.arange(rows)[None, :]
    d_kk, d_qk = (jnp.where(incl, c, 0.0) for c in cotangents)
    forward_kk = _decayed_apply(d_kk, k, gamma, transposed=False)
    forward_qk = _decayed_apply(d_qk, k, gamma, transposed=False)
    back = _decayed_apply(d_kk, k, gamma, transposed=True) + _decayed_apply(
        d_qk, q, gamma, transposed=True
    )
    d_gamma = k * forward_kk + q * forward_qk - k * back
    return forward_qk, forward_kk + back, d_gamma


_decayed_products.defvjp(_decayed_products_fwd, _decayed_products_bwd)


_ROWS = np.arange(XLA_CHUNK)
_LOWER_INCL = _ROWS[:, None] >= _ROWS[None, :]  # numpy: importing the module starts no backend
_LOWER_STRICT = _ROWS[:, None] > _ROWS[None, :]


def _chunk_operands_with_residuals(q, k, v, g, beta, scale):
    gamma = jnp.cumsum(g, axis=2)
    gamma_last = gamma[:, :, -1:, :]
    kk, qk = _decayed_products(q, k, gamma)
    lower = jnp.where(_LOWER_STRICT, beta[..., :, None] * kk, 0.0)
    attn = jnp.where(_LOWER_INCL, scale * qk, 0.0)
    rhs = jnp.concatenate([beta[..., None] * k * jnp.exp(gamma), beta[..., None] * v], axis=-1)
    solved = _blocked_unit_lower_solve(lower, rhs)
    w, u = jnp.split(solved, 2, axis=-1)
    qg = scale * q * jnp.exp(gamma)
    kd = k * jnp.exp(gamma_last - gamma)
    decay_chunk = jnp.exp(gamma_last[:, :, 0, :])
    residuals = (q, k, v, beta, gamma, kk, lower, solved)
    return (w, u, qg, attn, kd, decay_chunk), residuals


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _chunk_operands(q, k, v, g, beta, scale):
    """State-independent per-chunk operands, all chunks in parallel.

    Inputs are float32 [slots, H, 64, D] (beta: [slots, H, 64]). Returns, with S the [K, V] state
    at the chunk start: V_new = U - W S; O = Qg S + Aqk V_new; S' = a * S + Kd^T V_new.
    Its backward (_chunk_operands_bwd) is written out: the statement of what a per-chunk
    backward kernel computes.
    """
    return _chunk_operands_with_residuals(q, k, v, g, beta, scale)[0]


def _chunk_operands_fwd(q, k, v, g, beta, scale):
    return _chunk_operands_with_residuals(q, k, v, g, beta, scale)


def _chunk_operands_bwd(
    scale, residuals, cotangents, decayed_bwd=None, t_inverse=None, precision=_PRECISION
):
    """With Gamma the in-chunk cumsum of g, E = exp(Gamma), T = I + L (L = strictLower(beta kk)):
    [W | U] = T^-1 [beta k E | beta v], Qg = scale q E, Aqk = scale inclLower(qk),
    Kd = k exp(Gamma_last - Gamma), a = exp(Gamma_last). Backward:
      dRhs = T^-T [dW | dU];  dL = -strictLower(dRhs [W | U]^T)
      dkk = beta dL, dbeta = rowsum(dL kk) + rowsum(dRhs [k E | v])
      (dq, dk, dGamma) += decayed products' backward of (dkk, scale dAqk)
      then the elementwise terms of E, Qg, Kd and a, and dg = the reverse cumsum of dGamma.
    decayed_bwd: the decayed products' backward (_decayed_products_bwd's contract), for the
    sm90 kernel of it; None: this module's. t_inverse: T^-1 where the forward has it (the sm90
    chunk core): dRhs is then one product instead of a blocked triangular solve. precision: of
    that product and dL's (the sm90 backward's bf16x3)."""
    _, _, _, beta, _, kk, lower, solved = residuals
    d_w, d_u, d_qg, d_attn, d_kd, d_decay = cotangents
    d_rhs, d_kk, d_beta_kk = _solve_bwd(d_w, d_u, beta, kk, lower, solved, t_inverse, precision)
    return _chunk_operands_bwd_tail(
        scale, residuals, (d_rhs, d_kk, d_beta_kk, d_qg, d_attn, d_kd, d_decay), decayed_bwd
    )


def _solve_bwd(d_w, d_u, beta, kk, lower, solved, t_inverse=None, precision=_PRECISION):
    """The backward of [W | U] = T^-1 R, T = I + L, L = strictLower(beta kk), to R and kk:
    d_rhs = T^-T [dW | dU] ([..., 64, 256]), d_kk = beta dL with dL = -strictLower(d_rhs
    [W | U]^T), and d_beta_kk = rowsum(dL kk), L's part of dbeta. t_inverse: T^-1 where the
    forward has it (d_rhs is then one product), else a blocked triangular solve with `lower`."""
    d_solved = jnp.concatenate([d_w, d_u], axis=-1)
    if t_inverse is not None:
        d_rhs = jnp.einsum("...ji,...jn->...in", t_inverse, d_solved, precision=precision)
    else:
        # (I + L)^T X = d_solved: reversing rows and columns makes the system unit-lower again.
        flipped = jnp.flip(jnp.swapaxes(lower, -1, -2), axis=(-2, -1))
        d_rhs = jnp.flip(_blocked_unit_lower_solve(flipped, jnp.flip(d_solved, -2)), -2)
    d_lower = -jnp.einsum("...id,...jd->...ij", d_rhs, solved, precision=precision)
    d_lower = jnp.where(_LOWER_STRICT, d_lower, 0.0)
    return d_rhs, beta[..., :, None] * d_lower, jnp.sum(d_lower * kk, axis=-1)


def _chunk_operands_bwd_tail(scale, residuals, cotangents, decayed_bwd=None):
    """_chunk_operands_bwd past the solve: from (d_rhs, d_kk, d_beta_kk) (_solve_bwd's) and the
    cotangents of Qg, Aqk, Kd and a, the gradients of the chunked (q, k, v, g, beta)."""
    q, k, v, beta, gamma = residuals[:5]
    d_rhs, d_kk, d_beta_kk, d_qg, d_attn, d_kd, d_decay = cotangents
    d_qk = jnp.where(_LOWER_INCL, scale * d_attn, 0.0)
    d_decayed = (decayed_bwd or _decayed_products_bwd)((q, k, gamma), (d_kk, d_qk))
    return _elementwise_bwd(
        scale, (q, k, v, beta, gamma), d_decayed, (d_rhs, d_beta_kk, d_qg, d_kd, d_decay)
    )


def _elementwise_bwd(scale, chunked, d_decayed, cotangents):
    """The chunk core's backward past its products: from the chunked (q, k, v, beta) and gamma
    (the in-chunk cumsum of g), the decayed products' backward (dq, dk, dGamma) and the
    cotangents (d_rhs [..., 64, 256], d_beta_kk, d_qg, d_kd, d_decay), the gradients of the
    chunked (q, k, v, g, beta): the element-wise terms of E = exp(Gamma), Qg = scale q E,
    Kd = k exp(Gamma_last - Gamma) and a = exp(Gamma_last), and dg = the reverse cumsum of
    dGamma over the rows. The sm90 tokens-backward kernel's statement."""
    q, k, v, beta, gamma = chunked
    d_q, d_k, d_gamma = d_decayed
    d_rhs, d_beta_kk, d_qg, d_kd, d_decay = cotangents
    e = jnp.exp(gamma)
    gamma_last = gamma[:, :, -1:, :]
    d_rhs_w, d_rhs_u = jnp.split(d_rhs, 2, axis=-1)
    k_e = k * e
    d_beta = d_beta_kk + jnp.sum(d_rhs_w * k_e, axis=-1) + jnp.sum(d_rhs_u * v, axis=-1)
    d_k = d_k + beta[..., None] * e * d_rhs_w
    d_gamma = d_gamma + beta[..., None] * k_e * d_rhs_w
    d_v = beta[..., None] * d_rhs_u
    d_q = d_q + scale * e * d_qg
    d_gamma = d_gamma + scale * q * e * d_qg
    kd_factor = jnp.exp(gamma_last - gamma)
    d_k = d_k + kd_factor * d_kd
    kd_terms = k * kd_factor * d_kd
    last = jnp.sum(kd_terms, axis=2) + jnp.exp(gamma_last[:, :, 0, :]) * d_decay  # Gamma_last
    d_gamma = (d_gamma - kd_terms).at[:, :, -1, :].add(last)
    d_g = jnp.flip(jnp.cumsum(jnp.flip(d_gamma, 2), axis=2), 2)
    return d_q, d_k, d_v, d_g, d_beta


_chunk_operands.defvjp(_chunk_operands_fwd, _chunk_operands_bwd)


def slot_flags(cu_seqlens: jax.Array, num_slots: int):
    """Per chunk slot: the sequence that starts there, the sequence that ends there (-1: none),
    and whether any sequence's chunk lies there (gap slots hold none). [slots] each."""
    num_sequences = cu_seqlens.shape[0] - 1
    first, count = _sequence_slots(cu_seqlens)
    seq_ids = jnp.arange(num_sequences, dtype=jnp.int32)
    no_slot = jnp.full((num_slots,), -1, jnp.int32)
    # Out-of-range indices (empty sequences) are dropped, leaving -1: no reset / no final there.
    start_seq = no_slot.at[jnp.where(count > 0, first, num_slots)].set(seq_ids, mode="drop")
    last_seq = no_slot.at[jnp.where(count > 0, first + count - 1, num_slots)].set(
        seq_ids, mode="drop"
    )
    edges = jnp.zeros((num_slots + 1,), jnp.int32)
    edges = edges.at[first].add(1).at[first + count].add(-1)
    used = jnp.cumsum(edges)[:num_slots] > 0
    return start_seq, last_seq, used


def state_scan(a_op, b_op, decay, addend, cu_seqlens, y0, *, reverse: bool, emit=None, extras=()):
    """The serial pass over chunk slots, in XLA: what the sm90 state-scan kernel computes
    (kernels/kda_state_scan_sm90.py has the math), and the XLA path's scan.

    a_op, b_op: [slots, H, 64, K]; decay: [slots, H, K]; addend: [slots, H, 64, V] (forward) or
    [slots, H, K, V] (reverse); y0: [N, H, K, V], all float32. Returns (states [slots, H, K, V],
    the value of Y entering each slot, zero in gap slots; final [N, H, K, V]).

    emit: instead of the states, return emit(Y, X, *extras of the slot) per slot (zero in gap
    slots), computed inside the loop: the XLA path's outputs, without a [slots, H, K, V] array.
    """
    num_slots = a_op.shape[0]
    start_seq, last_seq, used = slot_flags(cu_seqlens, num_slots)
    # Reversed, a sequence is entered at its last slot and left at its first.
    enter, leave = (last_seq, start_seq) if reverse else (start_seq, last_seq)
    sign = 1.0 if reverse else -1.0

    def step(carry, xs):
        y, finals = carry
        a_c, b_c, d_c, add_c, enter_c, leave_c, *extras_c = xs
        y = jnp.where(enter_c >= 0, y0[jnp.maximum(enter_c, 0)], y)
        x = sign * jnp.einsum("hik,hkv->hiv", a_c, y, precision=_PRECISION)
        if not reverse:
            x = x + add_c
        update = jnp.einsum("hik,hiv->hkv", b_c, x, precision=_PRECISION)
        y_next = d_c[:, :, None] * y - sign * update
        if reverse:
            y_next = y_next + add_c
        index = jnp.maximum(leave_c, 0)
        finals = finals.at[index].set(jnp.where(leave_c >= 0, y_next, finals[index]))
        return (y_next, finals), (y if emit is None else emit(y, x, *extras_c))

    y_start = jnp.zeros_like(y0[0])  # as varying over a shard_map axis as y0 is
    xs = (a_op, b_op, decay, addend, enter, leave, *extras)
    (_, finals), per_slot = lax.scan(step, (y_start, y0), xs, reverse=reverse)
    return jnp.where(used[:, None, None, None], per_slot, 0.0), finals


def _chunk_output(states, v_new, qg, attn, precision=_PRECISION):
    """O = Qg S + Aqk V_new for one slot or all of them (any leading dims)."""
    out = jnp.einsum("...ik,...kv->...iv", qg, states, precision=precision)
    return out + jnp.einsum("...ij,...jv->...iv", attn, v_new, precision=precision)


def chunk_operands(q, k, v, g, beta, cu_seqlens, rows, num_slots: int, scale: float):
    """The per-chunk operands (w, u, qg, attn, kd, decay) from packed tokens: the inputs copied
    into chunk slots (float32), then _chunk_operands. `rows`: each token's row in the slot grid."""
    del cu_seqlens  # the slot rows say it all here; a kernel reads the boundaries instead
    as_chunks = [_to_chunks(x.astype(jnp.float32), rows, num_slots) for x in (q, k, v, g, beta)]
    return _chunk_operands(*as_chunks, scale)


def gate_floor_grad(g: jax.Array, dg: jax.Array) -> jax.Array:
    """The cotangent of g from that of max(g, GATE_FLOOR): dg where g is above the floor, half
    of it at the floor (jnp.maximum's rule at a tie), zero below it and where g is NaN."""
    return jnp.where(g > GATE_FLOOR, dg, jnp.where(g == GATE_FLOOR, 0.5 * dg, 0.0))


def from_chunks(x: jax.Array, rows: jax.Array) -> jax.Array:
    """[slots, H, 64, ...] -> [T, H, ...]: each token's row (the inverse of _to_chunks)."""
    grid = jnp.moveaxis(x, 2, 1)
    return grid.reshape(grid.shape[0] * grid.shape[1], *grid.shape[2:])[rows]


def forward(
    q, k, v, g, beta, cu_seqlens, initial_state, scale, *, scan=None, operands=chunk_operands,
    precision=_PRECISION, chunks=None,
):  # fmt: skip
    """KDA forward, packed THD.

    Args:
      q, k, v: [T, H, 128], any float dtype (computed in float32).
      g: [T, H, 128] float32 log-decay (<= 0). beta: [T, H] float32.
      cu_seqlens: [N + 1] int32 on the device. initial_state: [N, H, 128(V), 128(K)] float32.
      scale: Python float.
      scan: None: the outputs are computed inside the serial pass (state_scan with emit), so no
        state per chunk is kept beyond what autodiff saves. Else a serial pass with
        state_scan's signature (forward direction) that returns every chunk's state, from which
        the outputs are computed in parallel: the sm90 kernel (with its own backward) in the
        sm90 backend's training path.
      operands: chunk_operands's signature: this module's, or the sm90 kernel's.
      precision: of the products around a `scan` (V_new and the outputs; default float32).
      chunks: instead of `operands`, `scan` and the products around them, one function of (q, k,
        v, g, beta, cu_seqlens, rows, state [N, H, K, V], num_slots, scale) returning (o
        [T, H, V] in the tokens' rows, any float dtype, final [N, H, K, V]): the sm90 training
        path's, one custom VJP (sm90.backend.differentiable_chunks). It takes g as given and
        applies the gate floor itself, forward and backward (gate_floor_grad), so that no
        XLA pass over g stands before or after it.
    Returns:
      o: [T, H, 128] in q's dtype; final_state: [N, H, 128(V), 128(K)] float32.
    """
    total_tokens = q.shape[0]
    num_sequences = cu_seqlens.shape[0] - 1
    num_slots = chunk_slot_count(total_tokens, num_sequences)
    cu_seqlens = jnp.asarray(cu_seqlens, jnp.int32)
    _, rows = _token_slots(cu_seqlens, total_tokens)
    state_kv = jnp.swapaxes(initial_state.astype(jnp.float32), -1, -2)
    if chunks is not None:
        o, finals = chunks(q, k, v, g, beta, cu_seqlens, rows, state_kv, num_slots, scale)
        return o.astype(q.dtype), jnp.swapaxes(finals, -1, -2)
    g = jnp.maximum(g, GATE_FLOOR)  # NaN stays NaN
    w, u, qg, attn, kd, decay_chunk = operands(q, k, v, g, beta, cu_seqlens, rows, num_slots, scale)
    operands = (w, kd, decay_chunk, u, cu_seqlens, state_kv)
    if scan is None:
        out, finals = state_scan(*operands, reverse=False, emit=_chunk_output, extras=(qg, attn))
    else:
        # Everything but the state's chain is parallel over chunks: V_new = U - W S.
        states, finals = scan(*operands, reverse=False)
        v_new = u - jnp.einsum("shik,shkv->shiv", w, states, precision=precision)
        out = _chunk_output(states, v_new, qg, attn, precision)
    o = from_chunks(out, rows).astype(q.dtype)
    return o, jnp.swapaxes(finals, -1, -2)
