"""A grouped GEMM that reads compressed-tensors' packed int4 weights inside the matmul (one Triton kernel).

``int4_grouped_mm(rows, packed, scale, offsets, group)`` is ``torch.nn.functional.grouped_mm(rows, W^T, offs)``
with ``W [E, N, K]`` given packed: ``packed [E, N, K/8]`` int32 and ``scale [E, N, K/group]``
(compressed-tensors ``pack-quantized``, symmetric: weight ``j`` of a row is bits ``4*(j % 8)`` of word
``j // 8``, stored as value + 8, times its group's scale). Rows are sorted by expert; expert ``e`` takes rows
``offsets[e-1]:offsets[e]``; rows past ``offsets[-1]`` are left unset, as torch's grouped GEMM leaves them.

Why eyas writes this kernel instead of calling a library (measured on one H200, docs/BENCHMARKS.md, "int4
verifiers"):

- Dequantizing every expert and multiplying the dense copies with torch's grouped GEMM writes the bf16 weights
  and reads them back each forward, four and a half times the bytes a bf16 model reads: the backbone forward ran
  at 0.30x bf16's tokens/s on 4k-token batches.
- torch's int4 kernel (``_weight_int4pack_mm``, tinygemm, which torchao's int4 weight-only layout runs on CUDA)
  multiplies one matrix in a tile layout of its own (no expert groups, a repack of every weight) and ran 4x and
  23x slower than a bf16 matmul at 128 and 1,024 rows.
- Marlin's MoE GEMM (vLLM's ``fused_marlin_moe``) ships only inside vLLM's compiled extension, built against
  one torch; compressed-tensors only decompresses.

The kernel reads each weight tile as int32 words once (an eighth of the bf16 bytes, plus the scales),
unpacks and scales it in registers, and multiplies it with ``tl.dot`` (fp32 accumulation): the dequantized
weights never reach memory. Rows are grouped as in torch's grouped GEMM, so it takes the place of one
``grouped_mm`` with no host synchronisation (a CUDA graph captures it).

It is registered as a torch custom op (``eyas::int4_grouped_mm``) so ``torch.compile`` (the decoding graphs'
compiled layers) calls it as one opaque kernel.
"""

from __future__ import annotations

import functools

import torch

from eyas.core.triton import interpreting, runs_kernels

#: The Triton tile shapes tried per problem (rows per expert, N, K): small row tiles for decoding, large ones for
#: prefill-sized batches. Autotuned once per shape on first use (outside any CUDA graph capture: the decoders
#: run a forward twice eagerly before recording, eyas.engine.graphs).
_TILES = [
    # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages
    (16, 64, 128, 4, 4),
    (16, 128, 128, 4, 4),
    (32, 128, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (64, 256, 64, 8, 3),
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
]


def supported(x: torch.Tensor, K: int, group: int) -> bool:
    """Whether the kernel multiplies ``x`` by int4 weights of ``K`` inputs in groups of ``group``: Triton
    importable, a CUDA tensor (or the interpreter), bf16 or fp16 rows, groups a power of two of at most 128
    dividing ``K`` in tiles of 64."""
    shapes = group in (16, 32, 64, 128) and K % max(64, group) == 0
    return runs_kernels(x) and shapes and x.dtype in (torch.bfloat16, torch.float16)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, w_ptr, s_ptr, y_ptr, offs_ptr, N, K, E, stride_xm, stride_we, stride_wn, stride_se,
               stride_sn, stride_ym, M_BUCKET, GROUP: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        # Which expert's rows this program multiplies: the experts' row tiles laid end to end, ceil(rows /
        # BLOCK_M) each, found from the group ends on the device (no host read, so a graph can capture it).
        eids = tl.arange(0, E_POW2)
        ends = tl.load(offs_ptr + eids, mask=eids < E, other=0)
        starts = tl.load(offs_ptr + eids - 1, mask=(eids > 0) & (eids < E), other=0)
        tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
        last = tl.cumsum(tiles, 0)  # one past each expert's last tile
        e = tl.sum((last <= pid_m).to(tl.int32), 0)
        valid = e < E  # the grid's spare programs (an upper bound on the tiles) do nothing
        pick = eids == e
        row0 = tl.sum(tl.where(pick, starts + (pid_m - (last - tiles)) * BLOCK_M, 0), 0)
        row_end = tl.sum(tl.where(pick, ends, 0), 0)

        rm = row0 + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = (rm < row_end) & valid
        mask_n = rn < N
        e64 = tl.where(valid, e, 0).to(tl.int64)
        x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + tl.arange(0, BLOCK_K)[None, :]
        w_ptrs = w_ptr + e64 * stride_we + rn[:, None].to(tl.int64) * stride_wn + tl.arange(0, BLOCK_K // 8)[None, :]
        s_ptrs = (
            s_ptr + e64 * stride_se + rn[:, None].to(tl.int64) * stride_sn + tl.arange(0, BLOCK_K // GROUP)[None, :]
        )
        shifts = tl.arange(0, 8) * 4
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        mask_w = mask_n[:, None] & valid  # a spare program reads nothing
        for _ in range(0, K, BLOCK_K):
            x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)  # [BM, BK]
            words = tl.load(w_ptrs, mask=mask_w, other=0)  # [BN, BK/8] int32
            q = (words[:, :, None] >> shifts[None, None, :]) & 0xF  # [BN, BK/8, 8]: weight j = word j//8, nibble j%8
            q = tl.reshape(q, (BLOCK_N, BLOCK_K // GROUP, GROUP)) - 8  # [BN, BK/G, G]
            s = tl.load(s_ptrs, mask=mask_w, other=0.0).to(tl.float32)  # [BN, BK/G]
            # value * scale rounded once to the rows' dtype, as compressed-tensors' dequantization rounds it
            w = tl.reshape(q.to(tl.float32) * s[:, :, None], (BLOCK_N, BLOCK_K)).to(x_ptr.dtype.element_ty)
            acc = tl.dot(x, tl.trans(w), acc)  # [BM, BN], fp32
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K // 8
            s_ptrs += BLOCK_K // GROUP
        y_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])

    def prune(configs, named_args, **kwargs):
        K, group, bucket = named_args["K"], kwargs.get("GROUP", named_args.get("GROUP")), named_args["M_BUCKET"]
        fit = [c for c in configs if K % c.kwargs["BLOCK_K"] == 0 and c.kwargs["BLOCK_K"] % group == 0]
        small = [c for c in fit if c.kwargs["BLOCK_M"] <= max(16, 2 * bucket)]  # no tile far taller than a group
        return small or fit

    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
               for m, n, k, w, s in _TILES]  # fmt: skip
    tuned = triton.autotune(configs=configs, key=["N", "K", "M_BUCKET"],
                            prune_configs_by={"early_config_prune": prune})(kernel)  # fmt: skip
    return triton, kernel, tuned


def _launch(rows: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor,
            group: int) -> torch.Tensor:  # fmt: skip
    triton, kernel, tuned = _kernels()
    S, K = rows.shape
    E, N, words = packed.shape
    if words * 8 != K or tuple(scale.shape) != (E, N, K // group) or offsets.shape != (E,):
        raise ValueError(f"int4_grouped_mm: rows {tuple(rows.shape)}, packed {tuple(packed.shape)}, scale "
                         f"{tuple(scale.shape)}, offsets {tuple(offsets.shape)} do not match (group {group})")  # fmt: skip
    rows, packed, scale = rows.contiguous(), packed.contiguous(), scale.contiguous()
    out = rows.new_empty(S, N)
    if S == 0:
        return out
    bucket = min(256, triton.next_power_of_2(-(-S // E)))  # rows per expert, for the choice of tile
    args = (rows, packed, scale, out, offsets.to(torch.int32), N, K, E, rows.stride(0), packed.stride(0),
            packed.stride(1), scale.stride(0), scale.stride(1), out.stride(0), bucket)  # fmt: skip
    fixed = dict(GROUP=group, E_POW2=triton.next_power_of_2(E))

    # an upper bound on the row tiles: every tile full but one partial tile for each expert that has rows
    def grid(meta):
        return (triton.cdiv(S, meta["BLOCK_M"]) + min(E, S), triton.cdiv(N, meta["BLOCK_N"]))

    if interpreting():  # the CPU interpreter: one small tile, no timing
        kernel[grid](*args, **fixed, BLOCK_M=16, BLOCK_N=32, BLOCK_K=max(64, group))
    else:
        tuned[grid](*args, **fixed)
    return out


@torch.library.custom_op("eyas::int4_grouped_mm", mutates_args=())
def _int4_grouped_mm(rows: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor,
                     group: int) -> torch.Tensor:  # fmt: skip
    return _launch(rows, packed, scale, offsets, group)


@_int4_grouped_mm.register_fake
def _(rows: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor, group: int):
    return rows.new_empty(rows.shape[0], packed.shape[1])


def int4_grouped_mm(rows: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor,
                    group: int) -> torch.Tensor:  # fmt: skip
    """``rows [S, K]`` (sorted by expert) times expert ``e``'s int4 weights ``[N, K]`` for rows
    ``offsets[e-1]:offsets[e]`` -> ``[S, N]`` in the rows' dtype (see the module docstring for the layout)."""
    return _int4_grouped_mm(rows, packed, scale, offsets, group)
