"""cuDNN frontend's Hopper KDA engines through ``cudnn.linear_attention.kimi_delta_attention``.

Conventions (read in nvidia-cudnn-frontend 1.32.0, ``cudnn/linear_attention/ops/kda.py`` and
``hopper/kda_engine.py``, ``hopper/cuda_engine.py``): THD tensors ``[T, H, 128]``, q/k/v bf16,
g float32 natural-log decay (``gate_domain="log"``, the default), beta float32 post-sigmoid,
cu_seqlens int32 ``[N + 1]`` (the CuTe DSL engine declines int64), states float32 ``[N, H, V, K]``
(jax_kda's layout). ``safe_gate`` stays off: under it g would be read as raw logits. The engine is
pinned with ``plan_name``; an engine that cannot serve a graph (``kda_hopper`` has no backward)
raises, and the harness reports the message.
"""

from __future__ import annotations

from benchmarks.adapters.torch_tensors import import_torch_cuda, to_cuda
from benchmarks.native import Native, Unavailable
from jax_kda.constants import default_scale
from jax_kda.oracle import Inputs


def bind(inputs: Inputs, *, plan_name: str) -> Native:
    import_torch_cuda()
    try:
        from cudnn.linear_attention import kimi_delta_attention
    except ImportError as err:
        raise Unavailable(f"cudnn.linear_attention does not import: {err}") from err

    args = {
        name: to_cuda(getattr(inputs, name)) for name in ("q", "k", "v", "g", "beta", "cu_seqlens")
    }

    def call(args, state):
        return kimi_delta_attention(
            args["q"],
            args["k"],
            args["v"],
            args["g"],
            args["beta"],
            args["cu_seqlens"],
            scale=default_scale(),
            initial_state=state,
            output_final_state=True,
            plan_name=plan_name,
        )

    return Native(
        framework="torch",
        args=args,
        initial_state=to_cuda(inputs.initial_state),
        call=call,
        state_is_kv=False,
        notes=(
            "cudnn.linear_attention.kimi_delta_attention(q, k, v, g, beta, cu_seqlens int32, "
            f"scale=128**-0.5, initial_state [N,H,V,K], output_final_state=True, "
            f"plan_name={plan_name!r}); log-space g, post-sigmoid beta, no in-kernel fusions"
        ),
    )
