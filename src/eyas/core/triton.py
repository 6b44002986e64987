"""Where eyas' own Triton kernels can run: Triton importable, and a CUDA tensor or Triton's CPU interpreter
(``TRITON_INTERPRET=1``, with which the CPU tests run them)."""

from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (``TRITON_INTERPRET=1``): the kernels then run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def runs_kernels(x: torch.Tensor) -> bool:
    """Whether a Triton kernel can take ``x``: Triton importable, ``x`` on CUDA or the interpreter on."""
    return (x.device.type == "cuda" or interpreting()) and triton_available()


@functools.cache
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def pdl_capable(device: torch.device) -> bool:
    """Whether a kernel on ``device`` can start with programmatic dependent launch (CUDA, Hopper on: Triton's
    ``launch_pdl`` with ``gdc_wait``)."""
    return device.type == "cuda" and _capability_major(device.index if device.index is not None else 0) >= 9
