"""The implementations the harness measures, each a small adapter with one interface:
``bind(inputs) -> Native`` (see ``benchmarks.native``). Peers are imported inside ``bind``, so the
harness imports on a machine without torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from benchmarks.adapters import cudnn_frontend, fla_chunk_kda, jax_kda_backends, jla_mosaic_gpu
from benchmarks.native import Native
from jax_kda.oracle import Inputs


@dataclass(frozen=True)
class Implementation:
    name: str
    bind: Callable[[Inputs], Native]


IMPLEMENTATIONS = (
    Implementation("jax_kda/xla", partial(jax_kda_backends.bind, backend="xla")),
    Implementation("jax_kda/sm90", partial(jax_kda_backends.bind, backend="sm90")),
    Implementation(
        "jax_kda/sm90_exact",
        partial(jax_kda_backends.bind, backend="sm90", gate_lower_bound=None),
    ),
    Implementation("cudnn/kda_hopper", partial(cudnn_frontend.bind, plan_name="kda_hopper")),
    Implementation(
        "cudnn/kda_hopper_cuda", partial(cudnn_frontend.bind, plan_name="kda_hopper_cuda")
    ),
    Implementation("fla/chunk_kda", fla_chunk_kda.bind),
    Implementation("jla/mosaic_gpu", jla_mosaic_gpu.bind),
)

IMPLEMENTATION_NAMES = tuple(impl.name for impl in IMPLEMENTATIONS)

REFERENCE_ORDER = ("jax_kda/sm90", "jax_kda/xla")
"""The implementation the ratios are taken against: the first of these with results."""


def implementation(name: str) -> Implementation:
    return next(impl for impl in IMPLEMENTATIONS if impl.name == name)
