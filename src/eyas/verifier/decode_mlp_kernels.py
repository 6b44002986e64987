"""The Triton kernels of :mod:`eyas.verifier.decode_mlp` (imported only where Triton is: a module of its own, since
a kernel calls its helpers through the module's globals). See that module for what they compute and why."""

from __future__ import annotations

import triton
import triton.language as tl

#: tiles tried per shape for several rows (outputs a program takes, the reduction's step, warps), autotuned once
#: per shape: ``tl.dot`` tiles; the wider reduction steps (256, 512, against SmolLM2's rows of 576 and 1,536) issue
#: more of a program's loads at once, where a narrow one waits on memory once a step
TILES = [(16, 64, 2), (16, 128, 4), (32, 64, 4), (32, 128, 4), (64, 64, 4), (64, 128, 8), (16, 256, 4), (16, 512, 8)]
#: the same for one row (a decoding step), where the products are summed without ``tl.dot``: fewer outputs a
#: program, so that more programs read the weights side by side (SmolLM2's down projection has 576 outputs: 36
#: programs of 16 leave most of an H100's 132 SMs idle)
ROW_TILES = [(4, 512, 4), (4, 1024, 4), (8, 256, 2), (8, 512, 4), (8, 1024, 4), (16, 256, 4), (16, 512, 4)]
#: the same for a few rows (a verification's K + 1, at most :data:`eyas.verifier.decode_mlp.FEW_ROWS`), summed as
#: products as one row is: each program holds rows x outputs x reduction step products at once, so its tiles are
#: narrower than one row's (at four rows, 8 outputs by a step of 128 are 4,096 products: 32 a thread of 4 warps)
FEW_TILES = [(4, 128, 4), (4, 256, 4), (8, 64, 2), (8, 128, 4), (8, 256, 8), (16, 64, 4), (16, 128, 8)]


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's input rows and outputs, and their masks."""
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rm, rn, rm < M, rn < N


@triton.jit
def _summed(res_ptr, attn_ptr, offs, mask, dt: tl.constexpr):
    """The residual plus the attention output at ``offs``, rounded to the model's dtype as eager's add rounds
    it, in fp32."""
    s = tl.load(res_ptr + offs, mask=mask, other=0.0) + tl.load(attn_ptr + offs, mask=mask, other=0.0)
    return s.to(dt).to(tl.float32)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr, BLOCK_M: tl.constexpr):
    """``acc + a @ b^T`` (fp32 accumulation; fp32 operands in fp32, not TF32). ``a``: [BLOCK_M, BK], ``b``:
    [BN, BK], ``acc``: [BLOCK_M, BN]. One row, and a few (fewer than 16), are sums of products (a GEMV a row),
    since ``tl.dot`` takes at least 16 rows, most of them padding there."""
    if BLOCK_M == 1:
        out = acc + tl.sum(a.to(tl.float32) * b.to(tl.float32), 1)[None, :]  # [1, BK] * [BN, BK] -> [1, BN]
    elif BLOCK_M < 16:  # [BM, 1, BK] * [1, BN, BK] -> [BM, BN, BK], summed over BK -> [BM, BN]
        out = acc + tl.sum(a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :], 2)
    elif IEEE:
        out = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    else:
        out = tl.dot(a, tl.trans(b), acc)
    return out


@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    """With programmatic dependent launch (PDL, Hopper on), wait for the kernel before this one, then let the
    kernel after this one start: every read of an activation and every write comes after it; the weights, which
    no kernel writes, are read before it, while the kernel before ends."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _weights(w_ptr, rn, mask_n, k0, stride_w, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The ``[BLOCK_N, BLOCK_K]`` tile of a weight at reduction offset ``k0`` (zeros past ``K``: the loops below
    load one tile past the last, all masked, so that each step's tile is loaded a step ahead)."""
    rk = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + rn[:, None] * stride_w + rk[None, :], mask=mask_n[:, None] & (rk < K)[None, :], other=0.0)


@triton.jit
def _gate_up_kernel(res_ptr, attn_ptr, nw_ptr, g_ptr, u_ptr, h_ptr, M, N, eps, stride_x, stride_w, stride_h,
                    K: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    dt = h_ptr.dtype.element_ty
    rm, rn, mask_m, mask_n = _tile(M, N, BLOCK_M, BLOCK_N)
    wg = _weights(g_ptr, rn, mask_n, 0, stride_w, K, BLOCK_K)
    wu = _weights(u_ptr, rn, mask_n, 0, stride_w, K, BLOCK_K)
    _pdl_wait(PDL)
    # the norm's statistic over the whole row: the mean square of the residual sum
    ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        s = _summed(res_ptr, attn_ptr, rm[:, None] * stride_x + rk[None, :], mask_m[:, None] & (rk < K)[None, :], dt)
        ss += tl.sum(s * s, 1)
    rstd = 1.0 / tl.sqrt(ss / K + eps)  # [BM]
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mk = rk < K
        s = _summed(res_ptr, attn_ptr, rm[:, None] * stride_x + rk[None, :], mask_m[:, None] & mk[None, :], dt)
        nw = tl.load(nw_ptr + rk, mask=mk, other=0.0)
        x = nw[None, :] * (s * rstd[:, None]).to(dt)  # the norm's output: weight * normed, in the model's dtype
        acc_g = _dot(x, wg, acc_g, IEEE, BLOCK_M)
        acc_u = _dot(x, wu, acc_u, IEEE, BLOCK_M)
        wg = _weights(g_ptr, rn, mask_n, k0 + BLOCK_K, stride_w, K, BLOCK_K)
        wu = _weights(u_ptr, rn, mask_n, k0 + BLOCK_K, stride_w, K, BLOCK_K)
    g = acc_g.to(dt).to(tl.float32)
    u = acc_u.to(dt).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # SiLU, rounded as its eager output is
    h_offs = rm[:, None] * stride_h + rn[None, :]
    tl.store(h_ptr + h_offs, (act * u).to(dt), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _down_kernel(h_ptr, d_ptr, res_ptr, attn_ptr, out_ptr, M, N, stride_h, stride_w, stride_x,
                 K: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    dt = out_ptr.dtype.element_ty
    rm, rn, mask_m, mask_n = _tile(M, N, BLOCK_M, BLOCK_N)
    w = _weights(d_ptr, rn, mask_n, 0, stride_w, K, BLOCK_K)
    _pdl_wait(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mk = rk < K
        h = tl.load(h_ptr + rm[:, None] * stride_h + rk[None, :], mask=mask_m[:, None] & mk[None, :], other=0.0)
        acc = _dot(h, w, acc, IEEE, BLOCK_M)
        w = _weights(d_ptr, rn, mask_n, k0 + BLOCK_K, stride_w, K, BLOCK_K)
    mo = mask_m[:, None] & mask_n[None, :]
    offs = rm[:, None] * stride_x + rn[None, :]
    out = _summed(res_ptr, attn_ptr, offs, mo, dt) + acc.to(dt).to(tl.float32)  # residual + down, each rounded
    tl.store(out_ptr + offs, out.to(dt), mask=mo)


def _tuned(fn, tiles):
    configs = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w) for n, k, w in tiles]
    return triton.autotune(configs=configs, key=["N", "M"])(fn)  # K is a constexpr: a kernel per K


#: each kernel as written (the interpreter's) and autotuned (the GPU's): over :data:`TILES` for 16 rows' tiles,
#: over :data:`FEW_TILES` for a few rows, over :data:`ROW_TILES` for one
KERNELS = {"gate_up": _gate_up_kernel, "down": _down_kernel}
TUNED = {name: _tuned(fn, TILES) for name, fn in KERNELS.items()}
TUNED_FEW = {name: _tuned(fn, FEW_TILES) for name, fn in KERNELS.items()}
TUNED_ROW = {name: _tuned(fn, ROW_TILES) for name, fn in KERNELS.items()}
