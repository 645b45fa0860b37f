"""numpy <-> torch CUDA tensors for the torch peers (torch is imported only when they run)."""

from __future__ import annotations

import numpy as np

from benchmarks.native import Unavailable


def import_torch_cuda():
    """torch, when it is installed and sees a CUDA device; otherwise Unavailable."""
    try:
        import torch
    except ImportError as err:
        raise Unavailable(f"torch is not installed: {err}") from err
    if not torch.cuda.is_available():
        raise Unavailable("torch sees no CUDA device")
    return torch


def to_cuda(x: np.ndarray):
    """The same values on the GPU; bfloat16 (ml_dtypes) travels as its 16 bits."""
    torch = import_torch_cuda()
    if x.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(x)).cuda()


def to_numpy(t) -> np.ndarray:
    """float32 numpy (bfloat16 widened exactly), on the host."""
    torch = import_torch_cuda()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.detach().cpu().numpy()
