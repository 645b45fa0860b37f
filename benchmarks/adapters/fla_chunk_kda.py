"""fla's Triton ``fla.ops.kda.chunk_kda``.

Conventions (read in fla-core 0.6.0, ``fla/ops/kda/chunk.py`` and ``chunk_fwd.py``):
``[B, T, H, K]`` tensors with B = 1 for packed sequences; cu_seqlens int64, with
``cu_seqlens_cpu`` too (it spares the host copy that sizes the grid); g the natural-log decay,
precomputed, so ``use_gate_in_kernel=False`` (fla turns it into log2 itself: its chunk cumsum
scales by ``RCP_LN2``); ``safe_gate=True`` with ``lower_bound=-5``, which fla documents for
precomputed gates bounded in [lower_bound, 0), as ours are; beta post-sigmoid
(``use_beta_sigmoid_in_kernel=False``); q and k already normalised
(``use_qk_l2norm_in_kernel=False``); ``state_v_first=True``, so the float32 state is
``[N, H, V, K]`` as in jax_kda.
"""

from __future__ import annotations

import numpy as np

from benchmarks.adapters.torch_tensors import import_torch_cuda, to_cuda
from benchmarks.native import Native, Unavailable
from jax_kda.constants import GATE_LOWER_BOUND_MIN, default_scale
from jax_kda.oracle import Inputs


def bind(inputs: Inputs) -> Native:
    torch = import_torch_cuda()
    try:
        from fla.ops.kda import chunk_kda
    except ImportError as err:
        raise Unavailable(f"fla.ops.kda does not import: {err}") from err

    args = {name: to_cuda(getattr(inputs, name))[None] for name in ("q", "k", "v", "g", "beta")}
    cu_seqlens = inputs.cu_seqlens.astype(np.int64)
    args["cu_seqlens"] = to_cuda(cu_seqlens)
    args["cu_seqlens_cpu"] = torch.from_numpy(cu_seqlens)

    def call(args, state):
        o, final_state = chunk_kda(
            args["q"],
            args["k"],
            args["v"],
            args["g"],
            args["beta"],
            scale=default_scale(),
            initial_state=state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=False,
            use_gate_in_kernel=False,
            use_beta_sigmoid_in_kernel=False,
            safe_gate=True,
            lower_bound=GATE_LOWER_BOUND_MIN,
            state_v_first=True,
            cu_seqlens=args["cu_seqlens"],
            cu_seqlens_cpu=args["cu_seqlens_cpu"],
        )
        return o, final_state

    return Native(
        framework="torch",
        args=args,
        initial_state=to_cuda(inputs.initial_state),
        call=call,
        state_is_kv=False,
        notes=(
            "fla.ops.kda.chunk_kda(q, k, v, g, beta as [1, T, H, ...], scale=128**-0.5, "
            "initial_state [N,H,V,K], output_final_state=True, use_gate_in_kernel=False, "
            "safe_gate=True, lower_bound=-5, use_beta_sigmoid_in_kernel=False, "
            "use_qk_l2norm_in_kernel=False, state_v_first=True, cu_seqlens int64, cu_seqlens_cpu)"
        ),
    )
