"""prefill under explicit sharding (sharding in types: ``jax.make_mesh``'s default axes, under
``jax.set_mesh``).

The XLA path's reshapes and scatters have no sharding rule for arrays whose types carry a mesh
axis, and the sm90 kernels are custom calls that the partitioner cannot split. So a call made
under a mesh with Explicit axes runs per shard: rows of the batched form and heads are
independent, and prefill runs once per device on its rows and heads, inside ``jax.shard_map``
(the other inputs resharded to match q). Where q is split along its tokens or channels there is
no such form: the call then runs under ``jax.sharding.auto_axes`` and the partitioner decides
(the sm90 kernels' inputs are then gathered onto every device). Not served per device:
``jax.vmap`` over an axis that is itself sharded (the types inside vmap do not show it; shard
the batched form's rows instead).
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P


def explicit_axes() -> tuple[str, ...]:
    """The current mesh's Explicit axes (none outside a mesh, or inside shard_map)."""
    get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
    mesh = get_mesh() if get_mesh is not None else None
    if mesh is None or mesh.empty:
        return ()
    explicit = jax.sharding.AxisType.Explicit
    return tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == explicit)


def _spec(x) -> tuple:
    """x's partition spec, one entry a dimension."""
    spec = tuple(jax.typeof(x).sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def per_shard(
    call, q, k, v, g, beta, cu_seqlens, initial_state, *, batched: bool, state_given: bool
):
    """(o, final_state) of call(q, k, v, g, beta, cu_seqlens, initial_state) under a mesh with
    Explicit axes: per device on its rows (batched form) and heads, as q is split, else under
    auto_axes. cu_seqlens: the boundaries, or the batched form's placeholder (the call gets
    None there). o takes q's sharding; the final state
    takes the given initial state's (so that a lax.scan carry keeps its type), or without one
    (state_given False) q's rows and heads."""
    axes = explicit_axes()

    def local(q, k, v, g, beta, cu_seqlens, initial_state):
        return call(q, k, v, g, beta, None if batched else cu_seqlens, initial_state)

    spec = _spec(q)
    rows = spec[0] if batched else None
    tokens, heads, channels = spec[-3:]
    if tokens is not None or channels is not None:
        out_sharding = (jax.typeof(q).sharding, jax.typeof(initial_state).sharding)
        return jax.sharding.auto_axes(local, axes=axes, out_sharding=out_sharding)(
            q, k, v, g, beta, cu_seqlens, initial_state
        )
    lead = (rows,) if batched else ()
    token_like = P(*lead, None, heads, None)
    beta_spec = P(*lead, None, heads)
    state_spec = P(rows, heads, None, None)

    in_specs = (token_like,) * 4 + (beta_spec, P(), state_spec)
    args = [
        jax.sharding.reshard(x, s)
        for x, s in zip((q, k, v, g, beta, cu_seqlens, initial_state), in_specs, strict=True)
    ]
    sharded = jax.shard_map(
        local, in_specs=in_specs, out_specs=(token_like, state_spec), axis_names=set(axes)
    )
    o, final = sharded(*args)
    if state_given:
        final = jax.sharding.reshard(final, jax.typeof(initial_state).sharding.spec)
    return o, final
