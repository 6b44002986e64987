"""eyas' int4 grouped GEMM (eyas.verifier.int4_matmul: the packed words read inside the matmul, one Triton kernel)
against the dequantized weights multiplied in fp32, at Kimi-K2.5's expert shapes and at the edges (experts
without rows, fewer rows than experts, rows past the groups); the packed MoE layer through it against the same
layer dequantized; the kernel under a CUDA graph and under torch.compile.

    PYTHONPATH=src python3 -m pytest -q tests/gpu/test_int4_gpu.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tiny  # noqa: E402

from eyas.verifier.int4_matmul import int4_grouped_mm, supported  # noqa: E402
from eyas.verifier.load import build_text_model, resolve  # noqa: E402
from eyas.verifier.packed import PackedExperts, _dequantize_int4  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton)")


def _problem(E: int, N: int, K: int, group: int, counts: list[int], extra: int = 0, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    packed = torch.randint(-(2**31), 2**31 - 1, (E, N, K // 8), dtype=torch.int32, device="cuda", generator=g)
    scale = (torch.rand(E, N, K // group, device="cuda", generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    rows = torch.randn(int(offsets[-1]) + extra, K, device="cuda", generator=g).to(torch.bfloat16)
    return rows, packed, scale, offsets


def _reference(rows, packed, scale, offsets, group) -> list[tuple[int, int, torch.Tensor]]:
    """Each expert's rows times its dequantized weights (bf16, as compressed-tensors rounds them), in fp32."""
    out, start = [], 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            w = _dequantize_int4(packed[e], scale[e], group, torch.bfloat16).float()
            out.append((start, end, rows[start:end].float() @ w.T))
        start = end
    return out


@pytest.mark.parametrize(
    "E,N,K,group,counts,extra",
    [
        (128, 4096, 7168, 32, "online", 0),  # gate_up at an online batch's rows per expert
        (128, 7168, 2048, 32, "online", 0),  # down
        (128, 4096, 7168, 32, [1] * 8 + [0] * 120, 0),  # decoding: 8 routed rows, most experts without rows
        (6, 256, 512, 128, [0, 37, 0, 0, 200, 5], 3),  # group 128, empty experts, rows past the groups
        (3, 200, 64, 32, [17, 0, 1], 0),  # N not a tile multiple
    ],
    ids=["gate_up", "down", "decode", "group128-empty", "ragged-n"],
)
def test_int4_grouped_mm_equals_the_dequantized_matmul(E, N, K, group, counts, extra):
    if counts == "online":  # 4k tokens x top-8 spread unevenly over the experts
        g = torch.Generator().manual_seed(1)
        counts = torch.multinomial(torch.rand(E, generator=g) + 0.2, 4096 * 8, replacement=True, generator=g)
        counts = torch.bincount(counts, minlength=E).tolist()
    rows, packed, scale, offsets = _problem(E, N, K, group, counts, extra)
    assert supported(rows, K, group)
    got = int4_grouped_mm(rows, packed, scale, offsets, group)
    assert got.shape == (rows.shape[0], N) and got.dtype == torch.bfloat16
    for start, end, want in _reference(rows, packed, scale, offsets, group):
        err = (got[start:end].float() - want).norm() / want.norm()
        assert err < 1e-2, (start, end, float(err))  # bf16 output rounding: about 3e-3


@pytest.fixture(scope="module")
def experts(tmp_path_factory) -> PackedExperts:
    t = tiny.kimi_like(tmp_path_factory.mktemp("int4") / "v", int4=True, n_routed_experts=32, moe_intermediate_size=128)
    model = build_text_model(resolve(t.path), dtype=torch.bfloat16).to("cuda")
    m = next(m for m in model.modules() if isinstance(m, PackedExperts))
    assert m.stacked and supported(m.gate_up_packed.new_empty(1, dtype=torch.bfloat16), m.hidden, m.group_size)
    return m


def _route(m: PackedExperts, tokens: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, m.hidden, device="cuda", generator=g).to(torch.bfloat16)
    index = torch.randint(0, m.num_experts, (tokens, 2), device="cuda", generator=g)
    index[1, 0] = m.num_experts  # an expert held by another rank contributes nothing
    return x, index, torch.rand(tokens, 2, device="cuda", generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("tokens", [5, 300], ids=["fewer-rows-than-experts", "grouped"])
def test_packed_experts_through_the_kernel_equal_them_dequantized(experts, tokens, monkeypatch):
    x, index, weights = _route(experts, tokens, seed=tokens)
    with torch.no_grad():
        got = experts(x, index, weights)
        monkeypatch.setattr(PackedExperts, "kernel", "grouped")  # dequantized, torch's grouped GEMM
        want = experts(x, index, weights)
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-2


def test_the_kernel_replays_in_a_cuda_graph_and_compiles(experts):
    """A decoding step's MoE layer: captured once and replayed on new inputs, and compiled (the custom op is one
    opaque call), it gives what the eager kernel gives."""
    x, index, weights = _route(experts, 4, seed=7)
    static = [t.clone() for t in (x, index, weights)]
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            experts(*static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = experts(*static)
        for seed in (8, 9):
            new = _route(experts, 4, seed=seed)
            for s, t in zip(static, new):
                s.copy_(t)
            graph.replay()
            torch.testing.assert_close(out, experts(*new), rtol=0, atol=0)
        compiled = torch.compile(experts, fullgraph=False)
        torch.testing.assert_close(compiled(x, index, weights), experts(x, index, weights), rtol=2e-2, atol=2e-2)
