"""Context parallelism: the tokens of one sequence (or of a packed batch) split over a mesh axis.

Each device holds T / D consecutive tokens of the packed [T, H, 128] arrays; a sequence may
start on one device and end several devices later. Per sequence and head, with the state S
([K, V]) and A_t = (I - beta_t k_t k_t^T) Diag(exp g_t), the recurrence is affine in the state:
S_t = A_t S_{t-1} + beta_t k_t v_t^T, so a span that starts from S_0 has

    S_t = P_t S_0 + C_t,   P_t = A_t ... A_1,   C_t = S_t from a zero start,
    o_t = scale S_t^T q_t = o_t(zero start) + S_0^T (scale P_t^T q_t).

Per device, one prefill call on twice the heads runs the shard from the start twice: as given
(a sequence carried in from the previous device starts from zero: its outputs o_t(zero start)
and final state C) and with v = 0 from the identity state (then S_t = P_t: its outputs are
scale P_t^T q_t and its final state P). In the stored layout St = S^T ([V, K]) a span's map is
St_end = St_0 @ M + Ct, with M = P^T and Ct = C^T exactly the two runs' stored final states.
Across devices, each device's pair (M, Ct) for the sequence live at its last token is gathered
and folded in device order, which gives every device the exact state entering its shard. Per
device, that state corrects the outputs of the carried-in sequence (one [128, 128] product a
token and head: o_t += St_0 @ (scale P_t^T q_t)) and its final state. Every piece is
differentiable (prefill's custom VJP, jnp ops, collectives), so jax.grad works through it.

Cost per device, against a plain prefill of its shard: a prefill of twice the heads (two passes
over the local tokens), the correction product, and an all_gather of one pair, 2 x [H, 128,
128] float32 (128 KiB a head), from every device; the final states ([N, H, 128, 128] float32)
are summed over the axis (psum), each sequence's from the device that holds its last token.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_kda import api
from jax_kda.constants import HEAD_DIM

_PRECISION = lax.Precision.HIGHEST  # float32 products (GPUs' default would be TF32)


def context_parallel_prefill(
    q,
    k,
    v,
    g,
    beta,
    *,
    axis_name,
    cu_seqlens=None,
    initial_state=None,
    scale=None,
    output_final_state=True,
    gate_lower_bound=None,
    backend="auto",
    residuals="saved",
):
    """prefill of packed tokens split over the mesh axis `axis_name`; call it inside
    jax.shard_map (the default check_vma works).

    Per device, its shard of the packed form: device d of the axis's D holds tokens
    [d * T / D, (d + 1) * T / D) of the T packed tokens.
      q, k, v, g: [T / D, H, 128]; beta: [T / D, H] (dtypes as jax_kda.prefill).
      cu_seqlens: [N + 1] int32, the global boundaries (cu[N] = T), the same on every device;
        None means one sequence of T tokens. Sequences may straddle any device boundary.
      initial_state: [N, H, 128, 128] float32 ([V, K]), the same on every device; None: zeros.
      scale, gate_lower_bound, backend, residuals: as jax_kda.prefill (per device).
    Returns:
      (o, final_state): o, this device's [T / D, H, 128] shard of the outputs, in q's dtype;
      final_state [N, H, 128, 128] float32, the same on every device (summed over the axis), or
      None when output_final_state is False (which saves that sum).
    """
    if not isinstance(output_final_state, bool):
        raise TypeError(f"output_final_state: got {output_final_state!r}, expected a bool")
    if getattr(q, "ndim", None) != 3:
        raise ValueError(
            f"q: got shape {getattr(q, 'shape', None)}, expected this device's shard of the "
            "packed form, [T / D, H, 128] (pack a batched [B, T, H, 128] input as B sequences)"
        )
    api._validate(q, k, v, g, beta, cu_seqlens, initial_state)
    if v.shape[1] != q.shape[1]:
        raise ValueError(
            f"v: got {v.shape[1]} heads for q's {q.shape[1]}: grouped value heads are not served "
            "here yet; repeat q and k over the groups (jnp.repeat(q, G, axis=1))"
        )
    shard_tokens, heads = q.shape[0], q.shape[1]
    devices = lax.axis_size(axis_name)
    device = lax.axis_index(axis_name)
    if cu_seqlens is None:
        cu_seqlens = jnp.array([0, shard_tokens * devices], jnp.int32)
    num_sequences = cu_seqlens.shape[0] - 1
    if initial_state is None:
        initial_state = jnp.zeros((num_sequences, heads, HEAD_DIM, HEAD_DIM), jnp.float32)

    # Every sequence is a (possibly empty) piece of this shard; one piece at most, the first,
    # continues a sequence from the previous device: it starts here from zero (and from the
    # identity in the second run) and is corrected once the state entering the shard is known.
    start = device * shard_tokens
    local_cu = jnp.clip(cu_seqlens - start, 0, shard_tokens)
    carried = ((cu_seqlens[:-1] < start) & (cu_seqlens[1:] > start))[:, None, None, None]
    identity = jnp.broadcast_to(jnp.eye(HEAD_DIM, dtype=jnp.float32), initial_state.shape)
    both = partial(jnp.concatenate, axis=1)  # the two runs side by side, as 2H heads
    o_both, final_both = api.prefill(
        both([q, q]),
        both([k, k]),
        both([v, jnp.zeros_like(v)]),
        both([g, g]),
        both([beta, beta]),
        cu_seqlens=local_cu,
        initial_state=both(
            [jnp.where(carried, 0.0, initial_state), jnp.where(carried, identity, 0.0)]
        ),
        scale=scale,
        gate_lower_bound=gate_lower_bound,
        backend=backend,
        residuals=residuals,
    )
    o_zero, o_map = o_both[:, :heads], o_both[:, heads:]  # o_map: scale P_t^T q_t, else 0
    final_zero, final_map = final_both[:, :heads], final_both[:, heads:]  # final_map: P^T, else 0

    # The pair of the sequence that holds this shard's last token is what the next device needs.
    last_token = start + shard_tokens - 1
    # (the sequence of token t is the count of boundaries cu[1:] at or before t: no search loop)
    last = jnp.minimum(jnp.sum(cu_seqlens[1:] <= last_token), num_sequences - 1)
    maps, offsets = lax.all_gather((final_map[last], final_zero[last]), axis_name)
    entering = _entering_state(maps, offsets, device)  # [H, V, K]

    correction = jnp.einsum(
        "hvk,thk->thv", entering, o_map.astype(jnp.float32), precision=_PRECISION
    )
    o = (o_zero.astype(jnp.float32) + correction).astype(q.dtype)
    if not output_final_state:
        return o, None
    finals = final_zero + jnp.einsum("hvk,shkw->shvw", entering, final_map, precision=_PRECISION)
    # Sequence s ends on the device of its last token. An empty one is never carried, so every
    # device passes its initial state through; the device of token cu[s] - 1 (or 0) gives it.
    owner = jnp.clip((cu_seqlens[1:] - 1) // max(shard_tokens, 1), 0, devices - 1)
    mine = (owner == device)[:, None, None, None]
    return o, lax.psum(jnp.where(mine, finals, 0.0), axis_name)


def _entering_state(maps, offsets, device):
    """The state entering device `device`'s shard, [H, V, K]: with the devices' pairs (maps,
    offsets: [D, H, 128, 128], stored transposed), X_0 = 0 and X_{j+1} = X_j @ maps[j] +
    offsets[j]. A device whose last sequence starts on it has maps[j] = 0, which cuts the chain;
    X_d is used only where a sequence enters device d from device d - 1. D - 1 small products in
    line (no device-side loop, in the forward or the backward)."""
    state = jnp.zeros_like(offsets[0])  # as varying over the shard_map axes as the pairs
    for j in range(maps.shape[0] - 1):
        advanced = jnp.einsum("hvk,hkw->hvw", state, maps[j], precision=_PRECISION) + offsets[j]
        state = jnp.where(j < device, advanced, state)
    return state


def prefill_on_mesh(
    q,
    k,
    v,
    g,
    beta,
    *,
    mesh,
    token_axis,
    head_axis=None,
    cu_seqlens=None,
    initial_state=None,
    scale=None,
    output_final_state=True,
    gate_lower_bound=None,
    backend="auto",
    residuals="saved",
):
    """jax_kda.prefill with the packed tokens split over the mesh axis `token_axis` (context
    parallelism) and, optionally, the heads over `head_axis`: context_parallel_prefill inside
    jax.shard_map.

    q, k, v, g: [T, H, 128]; beta: [T, H]; cu_seqlens: [N + 1] int32 or None; initial_state:
    [N, H, 128, 128] float32 or None; the rest as jax_kda.prefill. T must be a multiple of the
    devices on `token_axis` (and H of those on `head_axis`).
    Returns (o [T, H, 128] split like q, final_state [N, H, 128, 128] or None).
    """
    devices = mesh.shape[token_axis]
    if getattr(q, "ndim", None) == 3 and q.shape[0] % devices:
        raise ValueError(
            f"q: got T = {q.shape[0]} tokens, expected a multiple of the {devices} devices on "
            f"mesh axis {token_axis!r}; pad the packed batch with a trailing sequence (one more "
            "cu_seqlens entry) to the next multiple"
        )
    if cu_seqlens is None and getattr(q, "ndim", None) == 3:
        cu_seqlens = jnp.array([0, q.shape[0]], jnp.int32)
    token_like = P(token_axis, head_axis)
    state_like = P(None, head_axis)
    parallel = partial(
        context_parallel_prefill,
        axis_name=token_axis,
        scale=scale,
        output_final_state=output_final_state,
        gate_lower_bound=gate_lower_bound,
        backend=backend,
        residuals=residuals,
    )

    def local(q, k, v, g, beta, cu_seqlens, *states):  # states: (initial_state,) or ()
        initial_state = states[0] if states else None
        return parallel(q, k, v, g, beta, cu_seqlens=cu_seqlens, initial_state=initial_state)

    states = () if initial_state is None else (initial_state,)
    sharded = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(token_like,) * 5 + (P(),) + (state_like,) * len(states),
        out_specs=(token_like, state_like if output_final_state else P()),
    )
    return sharded(q, k, v, g, beta, cu_seqlens, *states)
