"""The public entry point, ``jax_kda.prefill``: validation, backend choice and the custom VJP."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_kda import sharding, sm90, xla
from jax_kda.constants import HEAD_DIM, default_scale
from jax_kda.gate import check_lower_bound, kda_gate, l2_normalize

BACKENDS = ("auto", "xla", "sm90")
_QKV_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot serve this call (the message says why)."""


RESIDUALS = ("saved", "recompute")
"""prefill's `residuals` choices: what a differentiated call keeps for its backward."""


@dataclass(frozen=True)
class _Call:
    """Static description of one prefill call (hashable: it is a custom_vjp static argument)."""

    scale: float
    backend: str
    batched: bool
    save_residuals: bool = False


def prefill(
    q,
    k,
    v,
    g,
    beta,
    *,
    cu_seqlens=None,
    initial_state=None,
    scale=None,
    output_final_state=True,
    gate_lower_bound=None,
    backend="auto",
    use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False,
    A_log=None,
    dt_bias=None,
    lower_bound=None,
    use_beta_sigmoid_in_kernel=False,
    residuals="saved",
):
    """Kimi Delta Attention prefill (forward pass), jittable and differentiable.

    Packed (THD) form, N sequences of total length T:
      q, k, v: [T, H, 128] bfloat16 (float16 and float32 are accepted by the XLA backend).
      g: [T, H, 128] float32, the per-channel natural-log decay (<= 0).
      beta: [T, H] float32, in (0, 1).
      cu_seqlens: [N + 1] int32 on the device: cu[0] = 0, non-decreasing, cu[N] = T.
        None means one sequence. Its values are not checked (that would need a host sync).
    Batched form: q, k, v, g: [B, T, H, 128], beta: [B, T, H], one sequence per row (N = B);
      cu_seqlens must be None.

    initial_state: [N, HV, 128, 128] float32, stored transposed ([V, K]); None means zeros
      (HV = H without grouped value heads, below).
    scale: finite Python float; None means 128 ** -0.5.
    output_final_state: when False, the second result is None.
    gate_lower_bound: None, or a float in [-5, 0) that the caller guarantees every g is at least
      (the safe gate lb * sigmoid(.) with lb = -5 satisfies -5). On sm90 it picks the fast
      forward, which factorises the in-chunk decay (float32 overflows below about -5.5 per
      step; g cannot be checked without a host sync). Without it the sm90 backend runs the
      exact 64-token forward (the chunk-core and state-scan kernels, XLA's dense products).
      The XLA path and every backward are exact for any g <= 0.
    backend: "auto" (the sm90 kernels on Hopper when the call fits them, else "xla"), "sm90" or
      "xla". An explicit backend that cannot serve the call raises BackendUnavailableError.

    Input preparation, with fla's names (code ports one to one; differentiable for the raw
    inputs). On sm90, a call that is not differentiated prepares the raw inputs in the kernels
    as they load them (no prepared copy through HBM; grouped q and k read at their own heads):
    with a gate bound (the safe gate's included) in the gate-bound forward's PREP kernel,
    without one in the chunk core; elsewhere (the XLA path, a differentiated call) plain JAX
    before the recurrence, one element-wise pass over q, k, g and beta that XLA may fuse:
      use_qk_l2norm_in_kernel: q, k are taken as x * rsqrt(sum(x^2) + 1e-6) per head.
      use_gate_in_kernel: g is the raw gate projection a (any float dtype), made the decay by
        jax_kda.kda_gate: with lower_bound (in [-5, 0)) the safe gate
        lower_bound * sigmoid(exp(A_log[h]) * (a + dt_bias[h])), which also states
        gate_lower_bound = lower_bound; without, -exp(A_log[h]) * softplus(a + dt_bias[h]).
        A_log: [HV] or None (amplitude 1); dt_bias: [HV, 128] or [HV * 128] or None.
      use_beta_sigmoid_in_kernel: beta holds logits (any float dtype); sigmoid(beta) is used.
    residuals: what a differentiated call (jax.grad, jax.vjp) keeps for its backward; a call
      that is not differentiated runs the same forward under either.
      "saved" (default): the forward keeps what the backward needs, which then recomputes
        nothing. On sm90 the forward runs the exact 64-token kernels (gate bound or not) and
        keeps the chunk operands and chunk states, plan_prefill(...).saved_residual_bytes
        (about 4.8 KiB per token and value head); under jax.vmap of a differentiated call each
        element then runs its own kernels. On the XLA path it keeps autodiff's residuals.
      "recompute": the forward keeps only the inputs (with a gate bound, on sm90 it runs the
        fast gate-bound kernels) and the backward recomputes the rest from them: less memory,
        more time (H200, training step at 2048x12x1: 557 us against 493 with "saved"); under
        jax.vmap the sm90 backward is one call for the whole batch.
    Grouped value heads (GVA, fla's convention): q and k may have H heads and v, g, beta and
    the states HV = G * H; value head j reads q and k head j // G (as fla's reference repeats
    them G times; on sm90 a call that is not differentiated reads them at head j // G in the
    kernels, a differentiated one repeats them in XLA).

    Returns:
      (o, final_state): o has v's shape and q's dtype (q's shape without grouped value heads);
      final_state is [N, HV, 128, 128] float32 ([V, K]) or None.
    """
    _check_flags(use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel)
    batched = _validate(
        q, k, v, g, beta, cu_seqlens, initial_state, raw_gate=use_gate_in_kernel,
        beta_logits=use_beta_sigmoid_in_kernel,
    )  # fmt: skip
    scale = _validate_scale(scale)
    if backend not in BACKENDS:
        raise ValueError(f"backend: got {backend!r}, expected one of {BACKENDS}")
    if not isinstance(output_final_state, bool):
        raise TypeError(f"output_final_state: got {output_final_state!r}, expected a bool")
    _validate_gate_lower_bound(gate_lower_bound)
    if residuals not in RESIDUALS:
        raise ValueError(f"residuals: got {residuals!r}, expected one of {RESIDUALS}")
    raw = _Raw(q, k, g, beta, A_log, dt_bias)
    q, k, g, beta, gate_lower_bound = _prepare_inputs(
        q, k, g, beta, gate_lower_bound, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log,
        dt_bias, lower_bound, use_beta_sigmoid_in_kernel,
    )  # fmt: skip

    num_heads = v.shape[-2]
    if batched:
        num_sequences = q.shape[0]
        cu_seqlens = jnp.zeros((2,), jnp.int32)  # unused: each row is one sequence
    elif cu_seqlens is None:
        num_sequences = 1
        cu_seqlens = jnp.array([0, q.shape[0]], jnp.int32)
    else:
        num_sequences = cu_seqlens.shape[0] - 1
    state_given = initial_state is not None
    if initial_state is None:
        initial_state = jnp.zeros((num_sequences, num_heads, HEAD_DIM, HEAD_DIM), jnp.float32)
    if sharding.explicit_axes():  # sharding in types: run per device (sharding.py)

        def call(q, k, v, g, beta, cu, state):
            return prefill(q, k, v, g, beta, cu_seqlens=cu, initial_state=state, scale=scale,
                           gate_lower_bound=gate_lower_bound, backend=backend,
                           residuals=residuals)  # fmt: skip

        o, final_state = sharding.per_shard(
            call, q, k, v, g, beta, cu_seqlens, initial_state, batched=batched,
            state_given=state_given,
        )  # fmt: skip
        return o, (final_state if output_final_state else None)

    # grouped value heads: value head j reads q and k head j // G (after the per-device branch
    # above, where each device's block of value heads reads its own block of q and k heads)
    groups = num_heads // q.shape[-2]
    if groups > 1:
        q, k = jnp.repeat(q, groups, axis=-2), jnp.repeat(k, groups, axis=-2)
    total_tokens = q.shape[0] * q.shape[1] if batched else q.shape[0]
    chosen = _resolve_backend(
        backend, q.dtype, total_tokens, num_heads, num_sequences, gate_lower_bound
    )
    call = _Call(scale=scale, backend=chosen, batched=batched, save_residuals=residuals == "saved")
    prep = _Prep(use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound,
                 use_beta_sigmoid_in_kernel, groups)  # fmt: skip
    if chosen in ("sm90", "sm90_exact") and sm90.backend.in_kernel_prep(
        prep.qk_l2norm, prep.gate, prep.beta_logits, prep.groups > 1
    ):
        # the raw inputs to the kernels, which prepare them as they load (_prepared_prefill)
        a_log = jnp.zeros((num_heads,), jnp.float32) if raw.a_log is None else raw.a_log
        bias = jnp.zeros((num_heads, HEAD_DIM), jnp.float32) if raw.dt_bias is None else raw.dt_bias
        o, final_state = _prepared_prefill(
            call, prep, raw.q, raw.k, v, raw.g, raw.beta, a_log, bias, cu_seqlens, initial_state
        )
        return o, (final_state if output_final_state else None)
    o, final_state = _prefill(call, q, k, v, g, beta, cu_seqlens, initial_state)
    return o, (final_state if output_final_state else None)


class _Raw(NamedTuple):
    """prefill's inputs before _prepare_inputs (A_log and dt_bias as given, None or arrays)."""

    q: Any
    k: Any
    g: Any
    beta: Any
    a_log: Any
    dt_bias: Any


class _Prep(NamedTuple):
    """prefill's use_*_in_kernel preparations and its grouped value heads (groups = HV / H),
    all that stands between the inputs as given and as the recurrence takes them (all off:
    nothing)."""

    qk_l2norm: bool = False
    gate: bool = False
    lower_bound: float | None = None
    beta_logits: bool = False
    groups: int = 1

    def apply(self, q, k, g, beta, a_log, dt_bias):
        """The preparations in XLA (_prepare_inputs, then q and k repeated over the groups):
        (q, k, g, beta) as the recurrence takes them; a_log and dt_bias arrays (zeros: fla's
        defaults), read where gate."""
        q, k, g, beta, _ = _prepare_inputs(
            q, k, g, beta, None, self.qk_l2norm, self.gate, a_log if self.gate else None,
            dt_bias if self.gate else None, self.lower_bound, self.beta_logits,
        )  # fmt: skip
        if self.groups > 1:
            q, k = (jnp.repeat(x, self.groups, axis=-2) for x in (q, k))
        return q, k, g, beta


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _prepared_prefill(call, prep, q, k, v, g, beta, a_log, dt_bias, cu_seqlens, initial_state):
    """prefill on the sm90 kernels with the use_*_in_kernel preparations and the grouped value
    heads (`prep`) done as the kernels load the inputs, where the call is not differentiated:
    on the gate-bound forward (call.backend "sm90": the safe gate, or a stated bound) in its
    PREP kernel (sm90.forward), on the no-bound forward in the chunk core
    (sm90.prepared_forward); q and k raw with H heads, g and beta raw, a_log [HV] and dt_bias
    [HV, 128] or [HV * 128] arrays. Differentiated, the preparations run in XLA before the
    plain kernels' forward (_prefill_fwd) and their VJP after its backward, so the gradients
    reach the raw inputs, A_log and dt_bias."""

    def run(q, k, v, g, beta, cu_seqlens, initial_state, a_log, dt_bias):
        def kernels(q, k, v, g, beta, cu_seqlens, initial_state, scale):
            gate = {"a_log": a_log, "dt_bias": dt_bias} if prep.gate else {}
            if call.backend == "sm90":
                from jax_kda.sm90.kernels.input_prep import InputPrep  # CuTe DSL: imported late

                kernel_prep = InputPrep(
                    prep.qk_l2norm, prep.gate, prep.lower_bound, prep.beta_logits,
                    prep.groups > 1,
                )  # fmt: skip
                return sm90.forward(
                    q, k, v, g, beta, cu_seqlens, initial_state, scale, prep=kernel_prep, **gate
                )
            return sm90.prepared_forward(
                q, k, v, g, beta, cu_seqlens, initial_state, scale, qk_l2norm=prep.qk_l2norm,
                gate=prep.gate, lower_bound=prep.lower_bound, beta_logits=prep.beta_logits,
                grouped_qk=prep.groups > 1, **gate,
            )  # fmt: skip

        return _on_packed(kernels, call, q, k, v, g, beta, cu_seqlens, initial_state)

    # under jax.vmap one call on the packed batch, as _forward's
    one_call = _one_call_under_vmap(run, call, num_token_like=5, num_shared=2)
    return one_call(q, k, v, g, beta, cu_seqlens, initial_state, a_log, dt_bias)


def _prepared_prefill_fwd(call, prep, q, k, v, g, beta, a_log, dt_bias, cu_seqlens, state):
    prepared, pullback = jax.vjp(prep.apply, q, k, g, beta, a_log, dt_bias)
    pq, pk, pg, pbeta = prepared
    out, saved = _prefill_fwd(call, pq, pk, v, pg, pbeta, cu_seqlens, state)
    return out, (saved, pullback)


def _prepared_prefill_bwd(call, prep, residuals, cotangents):
    del prep  # in the pullback
    saved, pullback = residuals
    dq, dk, dv, dg, dbeta, _, dstate = _prefill_bwd(call, saved, cotangents)
    dq, dk, dg, dbeta, da_log, ddt_bias = pullback((dq, dk, dg, dbeta))
    return dq, dk, dv, dg, dbeta, da_log, ddt_bias, None, dstate


_prepared_prefill.defvjp(_prepared_prefill_fwd, _prepared_prefill_bwd)


def _resolve_backend(
    backend: str, dtype, total_tokens, num_heads, num_sequences, gate_lower_bound
) -> str:
    """'auto' takes the sm90 kernels when they can serve the call; 'sm90' insists on them. With
    gate_lower_bound the fast forward ("sm90"); without, the exact 64-token one ("sm90_exact":
    the chunk-core and state-scan kernels with XLA's dense products, exact for any g <= 0)."""
    if backend == "xla":
        return "xla"
    reason = sm90.unavailable_reason(dtype, total_tokens, num_heads, num_sequences)
    if reason is None and gate_lower_bound is None:
        reason = sm90.scan_unavailable_reason(total_tokens, num_heads, num_sequences)
    if reason is None:
        return "sm90" if gate_lower_bound is not None else "sm90_exact"
    if backend == "auto":
        return "xla"
    raise BackendUnavailableError(f"backend='sm90' cannot serve this call: {reason}")


def _forward(call: _Call, q, k, v, g, beta, cu_seqlens, initial_state):
    if call.backend in ("sm90", "sm90_exact"):
        path = sm90.forward if call.backend == "sm90" else sm90.training_forward
        run = _one_call_under_vmap(partial(_on_packed, path, call), call, num_token_like=5)
        return run(q, k, v, g, beta, cu_seqlens, initial_state)
    if call.batched:
        row_cu = jnp.array([0, q.shape[1]], jnp.int32)
        per_row = partial(xla.forward, cu_seqlens=row_cu, scale=call.scale)

        def one_row(q, k, v, g, beta, state):
            o, final = per_row(q, k, v, g, beta, initial_state=state[None])
            return o, final[0]

        return jax.vmap(one_row)(q, k, v, g, beta, initial_state)
    return xla.forward(q, k, v, g, beta, cu_seqlens, initial_state, call.scale)


def _on_packed(kernel_path, call: _Call, q, k, v, g, beta, cu_seqlens, initial_state):
    """Run an sm90 path (sm90.forward, sm90.training_forward), which takes packed THD: a batch of
    B rows of length T is B sequences of length T."""
    if not call.batched:
        return kernel_path(q, k, v, g, beta, cu_seqlens, initial_state, call.scale)
    rows, length = q.shape[:2]
    row_cu = jnp.arange(rows + 1, dtype=jnp.int32) * length
    packed = [x.reshape(rows * length, *x.shape[2:]) for x in (q, k, v, g, beta)]
    o, final_state = kernel_path(*packed, row_cu, initial_state, call.scale)
    return o.reshape(*v.shape[:-1], o.shape[-1]), final_state  # v's heads (q's may be fewer)


def _one_call_under_vmap(fn, call: _Call, num_token_like: int, num_shared: int = 0):
    """fn(*token_like, cu_seqlens, *state_like, *shared) with `num_token_like` arrays of q's
    leading layout ([T, ...] packed, [B, T, ...] batched; the third, v, with every value
    head), then the arrays per sequence ([N, ...]), then `num_shared` arrays that are the
    call's whatever its sequences (per-head parameters: A_log, dt_bias), wrapped so that
    jax.vmap runs it once on the whole batch: a batch of V calls is one call on V times the
    tokens, with each call's sequences as sequences of their own (cu_seqlens offset by v * T),
    not V calls (the custom call's own vmap rule runs them one after another). A batch whose
    shared arrays differ between its elements runs element by element."""

    @jax.custom_batching.custom_vmap
    def wrapped(*args):
        return fn(*args)

    @wrapped.def_vmap
    def rule(axis_size, in_batched, *args):
        shared_batched = any(in_batched[len(args) - num_shared :])
        shared = args[len(args) - num_shared :]
        args = [
            a if batched else jnp.broadcast_to(a, (axis_size, *a.shape))
            for a, batched in zip(args, in_batched, strict=True)
        ]
        tokens, cu_seqlens, per_sequence = (
            args[:num_token_like],
            args[num_token_like],
            args[num_token_like + 1 : len(args) - num_shared],
        )
        if (
            axis_size == 0
            or shared_batched
            or _too_big_for_one_call(call, tokens[2], per_sequence[0])
        ):
            # An empty batch, or one whose packing would pass the kernels' limits (32-bit
            # indexing, grid extents): the same kernels, one batch element after another.
            out = jax.lax.map(lambda xs: wrapped(*xs), tuple(args))
            return out, tuple(True for _ in out)
        merge = lambda x: x.reshape(axis_size * x.shape[1], *x.shape[2:])  # noqa: E731
        if call.batched:  # [V, B, T, ...]: V * B rows; cu_seqlens unused
            packed_cu = cu_seqlens[0]
        else:  # [V, T, ...]: V * N sequences at offsets v * T
            length = tokens[0].shape[1]
            offsets = (jnp.arange(axis_size, dtype=jnp.int32) * length)[:, None]
            starts = (cu_seqlens[:, :-1] + offsets).reshape(-1)
            packed_cu = jnp.concatenate([starts, jnp.full((1,), axis_size * length, jnp.int32)])
        # `wrapped`, not `fn`: an enclosing vmap (vmap of vmap) packs its batch again
        out = wrapped(*map(merge, tokens), packed_cu, *map(merge, per_sequence), *shared)
        split = lambda x: x.reshape(axis_size, x.shape[0] // axis_size, *x.shape[1:])  # noqa: E731
        return tuple(map(split, out)), tuple(True for _ in out)

    return wrapped


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _prefill(call, q, k, v, g, beta, cu_seqlens, initial_state):
    return _forward(call, q, k, v, g, beta, cu_seqlens, initial_state)


def _prefill_fwd(call, q, k, v, g, beta, cu_seqlens, initial_state):
    if call.save_residuals and call.backend in ("sm90", "sm90_exact"):
        o, final_state, saved = _saving_forward(call, q, k, v, g, beta, cu_seqlens, initial_state)
        return (o, final_state), saved
    if call.save_residuals:  # the XLA path: autodiff's residuals (the pullback is a pytree)

        def f(q, k, v, g, beta, initial_state):
            return _forward(call, q, k, v, g, beta, cu_seqlens, initial_state)

        return jax.vjp(f, q, k, v, g, beta, initial_state)
    out = _forward(call, q, k, v, g, beta, cu_seqlens, initial_state)
    return out, (q, k, v, g, beta, cu_seqlens, initial_state)


def _prefill_bwd(call, residuals, cotangents):
    """Pull the cotangents back. residuals="saved": on sm90 through the saved backward
    (sm90.training_residual_backward), on the XLA path through autodiff's pullback.
    "recompute": recompute from the inputs, on sm90 through the training kernels, else through
    the XLA path. All are exact for any g <= 0."""
    d_o, d_final = cotangents
    if call.save_residuals and call.backend in ("sm90", "sm90_exact"):
        dq, dk, dv, dg, dbeta, dstate = _saved_backward(call, d_o, d_final, residuals)
        return dq, dk, dv, dg, dbeta, None, dstate
    if call.save_residuals:
        dq, dk, dv, dg, dbeta, dstate = residuals(cotangents)
        return dq, dk, dv, dg, dbeta, None, dstate
    q, k, v, g, beta, cu_seqlens, initial_state = residuals
    if call.backend in ("sm90", "sm90_exact"):
        # Under jax.vmap the whole backward runs once on the packed batch (the custom calls' own
        # vmap rule would run them once per element).
        run = _one_call_under_vmap(partial(_sm90_bwd, call), call, num_token_like=6)
        dq, dk, dv, dg, dbeta, dstate = run(q, k, v, g, beta, d_o, cu_seqlens, initial_state,
                                            d_final)  # fmt: skip
        return dq, dk, dv, dg, dbeta, None, dstate

    def f(q, k, v, g, beta, initial_state):
        return _forward(call, q, k, v, g, beta, cu_seqlens, initial_state)

    _, pullback = jax.vjp(f, q, k, v, g, beta, initial_state)
    dq, dk, dv, dg, dbeta, dstate = pullback(cotangents)
    return dq, dk, dv, dg, dbeta, None, dstate


def _saving_forward(call: _Call, q, k, v, g, beta, cu_seqlens, initial_state):
    """(o, final_state, saved): the sm90 training forward keeping its residuals
    (sm90.training_residual_forward; `saved` its arrays). No vmap rule of its own: under
    jax.vmap JAX batches it as any function (each custom call once per element), so `saved`
    always has one call's shapes per element, whatever transformation surrounds it."""
    rows = q.shape[0] * q.shape[1] if call.batched else q.shape[0]
    reason = sm90.scan_unavailable_reason(rows, q.shape[-2], initial_state.shape[0])
    if reason is not None:
        raise BackendUnavailableError(f"the sm90 training forward cannot serve this call: {reason}")
    if not call.batched:
        return sm90.training_residual_forward(
            q, k, v, g, beta, cu_seqlens, initial_state, call.scale
        )
    count, length = q.shape[:2]
    row_cu = jnp.arange(count + 1, dtype=jnp.int32) * length
    packed = [x.reshape(count * length, *x.shape[2:]) for x in (q, k, v, g, beta)]
    o, final_state, saved = sm90.training_residual_forward(
        *packed, row_cu, initial_state, call.scale
    )
    return o.reshape(*q.shape[:-1], o.shape[-1]), final_state, saved


def _saved_backward(call: _Call, d_o, d_final, saved):
    """(dq, dk, dv, dg, dbeta, d_initial_state) from _saving_forward's `saved` arrays."""
    shape = d_o.shape
    if call.batched:
        d_o = d_o.reshape(shape[0] * shape[1], *shape[2:])
    grads = sm90.training_residual_backward(saved, d_o, d_final, call.scale)
    if call.batched:
        grads = (*(x.reshape(*shape[:2], *x.shape[1:]) for x in grads[:5]), grads[5])
    return grads


def _too_big_for_one_call(call: _Call, q, state) -> bool:
    """Whether the packed batch (q [V, T or B, ...], state [V, N or B, ...]) is past what the
    sm90 kernels take in one call."""
    rows = q.shape[0] * q.shape[1]
    tokens = rows * q.shape[2] if call.batched else rows
    sequences = state.shape[0] * state.shape[1]
    heads = q.shape[-2]
    return (
        sm90.unavailable_reason(q.dtype, tokens, heads, sequences) is not None
        or sm90.scan_unavailable_reason(tokens, heads, sequences) is not None
    )


def _sm90_bwd(call: _Call, q, k, v, g, beta, d_o, cu_seqlens, initial_state, d_final):
    """The sm90 backward of one packed (or batched-form) call: the recompute through
    sm90.training_forward, pulled back; (dq, dk, dv, dg, dbeta, d_initial_state)."""
    rows = q.shape[0] * q.shape[1] if call.batched else q.shape[0]
    reason = sm90.scan_unavailable_reason(rows, q.shape[-2], initial_state.shape[0])
    if reason is not None:
        raise BackendUnavailableError(f"the sm90 backward cannot serve this call: {reason}")

    def f(q, k, v, g, beta, initial_state):
        args = (q, k, v, g, beta, cu_seqlens, initial_state)
        return _on_packed(sm90.training_forward, call, *args)

    _, pullback = jax.vjp(f, q, k, v, g, beta, initial_state)
    return pullback((d_o, d_final))


_prefill.defvjp(_prefill_fwd, _prefill_bwd)


def _describe(x) -> str:
    return f"shape {tuple(x.shape)} dtype {x.dtype}"


def _require_array(name, x):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name}: got {type(x).__name__}, expected a jax or numpy array")


def _validate(
    q, k, v, g, beta, cu_seqlens, initial_state, *, raw_gate=False, beta_logits=False
) -> bool:
    """Check shapes and dtypes; returns True for the batched [B, T, H, 128] form."""
    _validate_tokens(
        q, k, v, g, beta, layouts={3: "[T, H, 128]", 4: "[B, T, H, 128]"}, raw_gate=raw_gate,
        beta_logits=beta_logits,
    )  # fmt: skip
    batched = q.ndim == 4
    if batched and q.shape[0] == 0:
        raise ValueError(
            f"q: got {_describe(q)}, expected at least one row (B >= 1); an empty packed batch "
            "is q of shape [0, H, 128] with cu_seqlens of N + 1 zeros"
        )
    if cu_seqlens is not None:
        if batched:
            raise ValueError(
                "cu_seqlens: must be None for the batched [B, T, H, 128] form (one sequence per "
                "row); pack the sequences as [T, H, 128] to pass cu_seqlens"
            )
        num_sequences = _validate_cu_seqlens(cu_seqlens)
    else:
        num_sequences = q.shape[0] if batched else 1
    if initial_state is not None:
        _validate_state("initial_state", initial_state, num_sequences, v.shape[-2])
    return batched


def _validate_tokens(
    q, k, v, g, beta, *, layouts: dict[int, str], raw_gate=False, beta_logits=False
) -> None:
    """Shapes and dtypes of the per-token inputs: q, k [..., H, 128], v, g [..., HV, 128] with
    HV a multiple of H (grouped value heads; HV = H without them), q, k, v of one float dtype,
    g float32 (any float dtype where raw_gate: the gate projection) and beta [..., HV] float32
    (any float dtype where beta_logits); `layouts` maps each rank q may have to the name of its
    layout, for the messages."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _require_array(name, x)
    if q.ndim not in layouts:
        expected = " or ".join(f"rank {rank} {layout}" for rank, layout in layouts.items())
        raise ValueError(f"q: got {_describe(q)}, expected {expected}")
    layout = layouts[q.ndim]
    if q.shape[-1] != HEAD_DIM:
        raise ValueError(f"q: got head dim {q.shape[-1]} ({_describe(q)}), expected {HEAD_DIM}")
    if q.shape[-2] == 0:
        raise ValueError(f"q: got {_describe(q)}, expected at least one head (H >= 1)")
    if q.dtype not in _QKV_DTYPES:
        raise TypeError(f"q: got dtype {q.dtype}, expected bfloat16 (or float16, float32)")
    if k.shape != q.shape:
        raise ValueError(f"k: got {_describe(k)}, expected shape {tuple(q.shape)} {layout}")
    heads = q.shape[-2]
    value_heads = v.shape[-2] if v.ndim == q.ndim else None
    if (
        value_heads is None
        or v.shape[:-2] != q.shape[:-2]
        or v.shape[-1] != HEAD_DIM
        or value_heads == 0
        or value_heads % heads
    ):
        raise ValueError(
            f"v: got {_describe(v)}, expected shape {tuple(q.shape)} {layout}, or with a "
            f"multiple of q's {heads} heads (grouped value heads)"
        )
    if g.shape != v.shape:
        raise ValueError(f"g: got {_describe(g)}, expected v's shape {tuple(v.shape)}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: got dtype {x.dtype}, expected q's dtype {q.dtype}")
    _check_float_dtype("g", g, raw_gate, "the gate input", " (the log-decay)")
    if beta.shape != v.shape[:-1]:
        raise ValueError(f"beta: got {_describe(beta)}, expected shape {tuple(v.shape[:-1])}")
    _check_float_dtype("beta", beta, beta_logits, "logits", "")


def _check_float_dtype(name, x, any_float: bool, raw: str, meaning: str) -> None:
    """x's dtype: float32, or any float dtype where any_float (raw inputs prefill prepares)."""
    if any_float and x.dtype not in _QKV_DTYPES:
        raise TypeError(
            f"{name}: got dtype {x.dtype}, expected bfloat16, float16 or float32 ({raw})"
        )
    if not any_float and x.dtype != jnp.float32:
        raise TypeError(f"{name}: got dtype {x.dtype}, expected float32{meaning}")


def _check_flags(use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel):
    """The input-preparation flags are bools (a truthy array or string would be ambiguous)."""
    for name, flag in (
        ("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel),
        ("use_gate_in_kernel", use_gate_in_kernel),
        ("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel),
    ):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: got {flag!r}, expected a bool")


def _prepare_inputs(
    q, k, g, beta, gate_lower_bound, use_qk_l2norm, use_gate, a_log, dt_bias, lower_bound,
    use_beta_sigmoid,
):  # fmt: skip
    """prefill's input preparation (its docstring): returns (q, k, g, beta, gate_lower_bound)
    as the recurrence takes them (q and k still with their own heads: prefill repeats them over
    grouped value heads after its per-device branch)."""
    if not use_gate:
        for name, value in (("A_log", a_log), ("dt_bias", dt_bias), ("lower_bound", lower_bound)):
            if value is not None:
                raise ValueError(
                    f"{name}: given without use_gate_in_kernel=True, which is what reads it "
                    "(g is then the log-decay itself)"
                )
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    if use_gate:
        for name, value in (("A_log", a_log), ("dt_bias", dt_bias)):
            if value is not None:
                _require_array(name, value)
        if lower_bound is not None:
            check_lower_bound(lower_bound)
            if gate_lower_bound is not None and gate_lower_bound > lower_bound:
                raise ValueError(
                    f"gate_lower_bound: got {gate_lower_bound}, above lower_bound "
                    f"{lower_bound}, which the gate can reach: leave it out"
                )
            if gate_lower_bound is None:
                gate_lower_bound = float(lower_bound)
        elif gate_lower_bound is not None:
            raise ValueError(
                f"gate_lower_bound: got {gate_lower_bound} with the softplus gate "
                "(use_gate_in_kernel without lower_bound), which has no lower bound: pass "
                "lower_bound for the bounded (safe) gate, or leave gate_lower_bound out"
            )
        g = kda_gate(g, a_log, dt_bias, lower_bound=lower_bound)
    if use_beta_sigmoid:
        beta = jax.nn.sigmoid(beta.astype(jnp.float32))
    return q, k, g, beta, gate_lower_bound


def _validate_cu_seqlens(cu_seqlens) -> int:
    """cu_seqlens: [N + 1] int32 with N >= 1 (its values are not read); returns N."""
    _require_array("cu_seqlens", cu_seqlens)
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens: got {_describe(cu_seqlens)}, expected shape [N + 1], N >= 1")
    if cu_seqlens.dtype != jnp.int32:
        raise TypeError(f"cu_seqlens: got dtype {cu_seqlens.dtype}, expected int32")
    return cu_seqlens.shape[0] - 1


def _validate_state(name, state, rows, heads, rows_name="N") -> None:
    """state: [rows, heads, 128, 128] float32 ([V, K]); rows None: any count (a pool)."""
    _require_array(name, state)
    expected = (rows, heads, HEAD_DIM, HEAD_DIM)
    if state.ndim != 4 or any(
        want is not None and got != want for got, want in zip(state.shape, expected, strict=True)
    ):
        shown = ", ".join(rows_name if want is None else str(want) for want in expected)
        raise ValueError(
            f"{name}: got {_describe(state)}, expected shape ({shown}) "
            f"[{rows_name}, H, 128(V), 128(K)]"
        )
    if state.dtype != jnp.float32:
        raise TypeError(f"{name}: got dtype {state.dtype}, expected float32")


def _validate_gate_lower_bound(bound) -> None:
    if bound is not None:
        check_lower_bound(bound, "gate_lower_bound")


def _validate_scale(scale) -> float:
    if scale is None:
        return default_scale()
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(
            f"scale: got {type(scale).__name__}, expected a Python float (it is static; "
            "multiply q instead to use a traced scale)"
        )
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale: got {scale}, expected a finite number")
    return float(scale)
