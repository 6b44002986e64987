"""What inductor generated while a test's code ran: its output code, one text per compiled graph."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch

#: a matmul in inductor's output code: aten's extern kernels (cuBLAS on CUDA), or on CPU the MKL / oneDNN linear
#: that freezing swaps in for a matmul by a constant weight
MATMUL = re.compile(
    r"extern_kernels\.(?:mm|addmm|bmm)\(|torch\.ops\.mkl\._mkl_linear\.default\("
    r"|torch\.ops\.mkldnn\._linear_pointwise\.default\("
)


#: a kernel inductor generated (Triton on CUDA, C++ on CPU): its name, where the output code compiles it
KERNEL = re.compile(r"^(\w+) = async_compile\.", re.M)


def kernels(code: str) -> list[str]:
    """The names of the kernels one graph's output code compiles, in order (extern matmuls and custom ops aside)."""
    return KERNEL.findall(code)


def output_code(fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    """``fn()`` and the output code of every graph compiled while it ran. Dynamo's caches are cleared first, so
    nothing compiled by an earlier test is reused, as ``torch._inductor.utils.run_and_get_code`` does; unlike it,
    every graph's text is kept, also when two graphs' texts are equal."""
    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    torch._dynamo.reset()
    with mock.patch.object(GraphLowering, "save_output_code", codes.append):
        out = fn()
    return out, codes


def matmuls(codes: list[str]) -> int:
    """Matmul calls in ``codes`` (see :data:`MATMUL`)."""
    return sum(len(MATMUL.findall(c)) for c in codes)
