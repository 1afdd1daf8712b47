"""Fused mixture-of-experts on int8 / int4 experts (W8A16 / W4A16): ``kernels/fused_moe.py``'s
grouped GEMMs with each expert's weights dequantized in registers from the packed integers and
group scales of ``kernels/quant_gemm.py``, by its tile loop (``quant_gemm.wq_dot_acc``; no
dequantized copy of the experts ever exists).

``op(x, gu_q, gu_s, dn_q, dn_s, bits, topk_ids, topk_weights)``: the experts as
``quant_gemm.quantize`` lays them out, per expert: ``gu_q [E, 2I, d]`` int8 (or ``[E, 2I, d/2]``
uint8, two int4 per byte, even column in the low nibble) with ``gu_s [E, 2I, d/group]`` float16
scales; ``dn_q [E, d, I(/2)]``, ``dn_s [E, d, I/group]``. 8 bits may also be e4m3 codes
(``--quantization fp8``'s experts: float8_e4m3fn with one float32 scale per output row, i.e.
``gu_s [E, 2I, 1]``, ``dn_s [E, d, 1]``: each part its own group, its whole input). Everything else (routing, alignment,
the SwiGLU epilogue, the mixing weights, the deterministic sum over a token's k slots, ids outside
``[0, E)`` contributing nothing) is ``fused_moe``'s; each weight tile meets x through
``quant_gemm.wq_dot_acc`` (dequantized and rounded to x's dtype when the tile crosses scale
groups, else the integers themselves with the group scale applied to the fp32 partial sum), so
the reference is ``fused_moe_reference`` on the dequantized experts (``fused_moe_quant_reference``),
to the dtype's rounding.

Bytes: an int4 expert is 0.5 + 2 / group bytes per weight (0.27x bf16's at group 128), which is
the whole cost of a batch-1 MoE step (``fused_moe``'s floors table); int4 takes each byte once,
its nibbles read as ``quant_gemm.INT4_READ`` says. A part whose codes are int32 words
(``quant_decode.interleave_int4``: int32 ``[E, N, K / 8]``, 128-column K tiles inside its scale
groups) is read by the word read instead (``JOIN = 3``, K tiles of 128), each part on its own.
"""
from __future__ import annotations

import torch

from flash_dllm.kernels import fused_moe, quant_decode, quant_gemm
from flash_dllm.kernels._triton import HAS_TRITON, check, check_device, pdl_args, use_triton

INTERPRET = fused_moe.INTERPRET

if HAS_TRITON:
    import triton
    import triton.language as tl

    from flash_dllm.kernels._triton import pdl_wait

    @triton.jit
    def _gate_up_wq_kernel(x_ptr, q_ptr, s_ptr, h_ptr, sorted_ptr, expert_ptr, total_ptr, P,
                           TOPK, D, I, GROUP: tl.constexpr, stride_xt, stride_qe, stride_qn,
                           stride_se, stride_sn, stride_ht, num_n, BITS: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           UPCAST: tl.constexpr, PREC: tl.constexpr, JOIN: tl.constexpr,
                           FP8: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        pid_m = tl.program_id(0) // num_n
        if pid_m * BLOCK_M >= tl.load(total_ptr):
            return
        e, offs_m, pair, m_ok = fused_moe._rows(pid_m, sorted_ptr, expert_ptr, P, BLOCK_M)
        offs_n = (tl.program_id(0) % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < I
        a_rows = x_ptr + (pair // TOPK).to(tl.int64)[:, None] * stride_xt
        g_q = q_ptr + e * stride_qe + offs_n[:, None].to(tl.int64) * stride_qn
        g_s = s_ptr + e * stride_se + offs_n[:, None].to(tl.int64) * stride_sn
        zero = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_g = quant_gemm.wq_dot_acc(zero, a_rows, m_ok, g_q, g_s, n_ok, 0, D, GROUP, BITS,
                                      BLOCK_K, UPCAST, PREC, JOIN, FP8)
        acc_u = quant_gemm.wq_dot_acc(zero, a_rows, m_ok, g_q + I * stride_qn,
                                      g_s + I * stride_sn, n_ok, 0, D, GROUP, BITS, BLOCK_K,
                                      UPCAST, PREC, JOIN, FP8)
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u              # SwiGLU in fp32, rounded once
        tl.store(h_ptr + offs_m[:, None].to(tl.int64) * stride_ht + offs_n[None, :],
                 h.to(h_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _down_wq_kernel(h_ptr, q_ptr, s_ptr, out_ptr, tw_ptr, sorted_ptr, expert_ptr, total_ptr,
                        P, D, I, GROUP: tl.constexpr, stride_ht, stride_qe, stride_qn,
                        stride_se, stride_sn, stride_ot, num_n, BITS: tl.constexpr,
                        BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                        PREC: tl.constexpr, JOIN: tl.constexpr, FP8: tl.constexpr,
                        PDL: tl.constexpr):
        pdl_wait(PDL)
        pid_m = tl.program_id(0) // num_n
        if pid_m * BLOCK_M >= tl.load(total_ptr):
            return
        e, offs_m, pair, m_ok = fused_moe._rows(pid_m, sorted_ptr, expert_ptr, P, BLOCK_M)
        offs_n = (tl.program_id(0) % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < D
        a_rows = h_ptr + offs_m[:, None].to(tl.int64) * stride_ht
        w_q = q_ptr + e * stride_qe + offs_n[:, None].to(tl.int64) * stride_qn
        w_s = s_ptr + e * stride_se + offs_n[:, None].to(tl.int64) * stride_sn
        acc = quant_gemm.wq_dot_acc(tl.zeros((BLOCK_M, BLOCK_N), tl.float32), a_rows, m_ok,
                                    w_q, w_s, n_ok, 0, I, GROUP, BITS, BLOCK_K, UPCAST, PREC, JOIN,
                                    FP8)
        acc *= tl.load(tw_ptr + pair, mask=m_ok, other=0.0)[:, None]        # mixing weight
        tl.store(out_ptr + pair[:, None].to(tl.int64) * stride_ot + offs_n[None, :], acc,
                 mask=m_ok[:, None] & n_ok[None, :])


def _shapes(x, gu_q, gu_s, dn_q, dn_s, bits: int) -> tuple[int, int, int, int, int]:
    """(d, E, I, gate/up group, down group) after checking the packed experts against x (one
    size from ``quantize``; e4m3 codes have one scale per row: each part its whole input)."""
    check(bits in quant_gemm.INT_BITS, f"fused_moe_quant: bits must be one of "
                                       f"{quant_gemm.INT_BITS}, got {bits}")
    d, per = x.shape[1], _per(gu_q, bits)
    check(gu_q.dim() == 3 and gu_q.shape[2] * per == d and gu_q.shape[1] % 2 == 0,
          f"fused_moe_quant: gu_q must be [E, 2I, {d // per}], got {tuple(gu_q.shape)}")
    E, I, per = gu_q.shape[0], gu_q.shape[1] // 2, _per(dn_q, bits)
    check(tuple(dn_q.shape) == (E, d, I // per),
          f"fused_moe_quant: dn_q must be [{E}, {d}, {I // per}], got {tuple(dn_q.shape)}")
    check(gu_s.shape[:2] == gu_q.shape[:2] and d % gu_s.shape[2] == 0,
          f"fused_moe_quant: gu_s must be [{E}, {2 * I}, d / group], got {tuple(gu_s.shape)}")
    group = d // gu_s.shape[2]
    check(dn_s.dim() == 3 and tuple(dn_s.shape[:2]) == (E, d) and dn_s.shape[2] >= 1
          and I % dn_s.shape[2] == 0,
          f"fused_moe_quant: dn_s must be [{E}, {d}, I / group] with I = {I}, got "
          f"{tuple(dn_s.shape)}")
    dn_group = I // dn_s.shape[2]            # each part's group from its own scales
    layouts = {torch.uint8, torch.int32}        # int4: bytes or words, either part its own
    check(gu_q.dtype == dn_q.dtype or (bits == 4 and {gu_q.dtype, dn_q.dtype} <= layouts),
          f"fused_moe_quant: gu_q and dn_q hold one code (int4: uint8 bytes or int32 words "
          f"each), got {gu_q.dtype} and {dn_q.dtype}")
    for part, q, k, g in (("gu_q", gu_q, d, group), ("dn_q", dn_q, I, dn_group)):
        check(q.dtype != torch.int32 or quant_decode.takes_words(k, g),
              f"fused_moe_quant: {part} is int4 words, whose K tiles of "
              f"{quant_decode.WORD_TILE} must lie inside its scale groups; group {g}")
    return d, E, I, group, dn_group


def _per(q: torch.Tensor, bits: int) -> int:
    """Weights a stored element holds: int8 / e4m3 1, int4 bytes 2, int4 words 8."""
    check(q.dtype != torch.int32 or bits == 4,
          f"fused_moe_quant: int32 words are int4's layout, not int{bits}")
    return 8 if q.dtype == torch.int32 else 1 if bits == 8 else 2


def _read(q: torch.Tensor, bits: int, k_tile: int) -> tuple[torch.Tensor, int, int]:
    """(the codes as the kernel takes them, its ``JOIN``, its K tile) of one part."""
    if q.dtype == torch.int32:                                 # words: the word read
        return q.view(torch.uint8), quant_gemm.WORD_READ["JOIN"], quant_gemm.WORD_READ["BLOCK_K"]
    if q.dtype == quant_gemm.FP8:                              # (e4m3 codes travel as bytes)
        return q.view(torch.uint8), 0, k_tile
    return q, quant_gemm.INT4_READ if bits == 4 else 0, k_tile


def fused_moe_quant_reference(x, gu_q, gu_s, dn_q, dn_s, bits, topk_ids, topk_weights):
    """The experts dequantized to x's dtype, then ``fused_moe_reference`` (the CPU path)."""
    _shapes(x, gu_q, gu_s, dn_q, dn_s, bits)
    return fused_moe.fused_moe_reference(
        x, quant_gemm.dequantize(gu_q, gu_s, bits, x.dtype),
        quant_gemm.dequantize(dn_q, dn_s, bits, x.dtype), topk_ids, topk_weights)


def fused_moe_quant_triton(x, gu_q, gu_s, dn_q, dn_s, bits, topk_ids, topk_weights, *,
                           config: dict | None = None) -> torch.Tensor:
    """The fused layer on packed experts (module docstring); ``config`` as ``fused_moe``'s
    (``GU_K`` / ``DN_K`` >= 32 for int4: each dot takes half of them)."""
    check(HAS_TRITON, "fused_moe_quant_triton: triton is not importable")
    d, E, I, group, dn_group = _shapes(x, gu_q, gu_s, dn_q, dn_s, bits)
    T, k = topk_ids.shape
    check(x.is_contiguous() and all(t.is_contiguous() for t in (gu_q, gu_s, dn_q, dn_s)),
          "fused_moe_quant: x and the packed experts must be contiguous")
    check_device("fused_moe_quant", INTERPRET, x, gu_q, gu_s, dn_q, dn_s, topk_ids, topk_weights)
    cfg = fused_moe._resolve_config(T, k, E, config)
    check(bits == 8 or (cfg["GU_K"] >= 32 and cfg["DN_K"] >= 32),
          "fused_moe_quant: int4 needs GU_K and DN_K >= 32")
    out = torch.empty((T, d), dtype=x.dtype, device=x.device)
    if T == 0 or k == 0 or E == 0:
        return out.zero_()
    P, bm = T * k, cfg["BLOCK_M"]
    ids, tw = topk_ids.contiguous().view(-1), topk_weights.contiguous().view(-1)
    sorted_ids, block_expert, total = fused_moe.moe_align_triton(ids, E, bm)
    h = torch.empty((sorted_ids.shape[0], I), dtype=x.dtype, device=x.device)
    prec = fused_moe.FP32_PRECISION if x.dtype == torch.float32 else "tf32"
    fp8 = gu_q.dtype == quant_gemm.FP8
    (gu_q, gu_join, gu_k), (dn_q, dn_join, dn_k) = (_read(gu_q, bits, cfg["GU_K"]),
                                                    _read(dn_q, bits, cfg["DN_K"]))
    launch = {"BITS": bits, "BLOCK_M": bm, "UPCAST": INTERPRET, "PREC": prec, "FP8": fp8,
              "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    pdl = pdl_args(x)
    launch.update(pdl)
    blocks, n_gu, n_dn = sorted_ids.shape[0] // bm, -(-I // cfg["GU_N"]), -(-d // cfg["DN_N"])
    _gate_up_wq_kernel[(blocks * n_gu,)](
        x, gu_q, gu_s, h, sorted_ids, block_expert, total, P, k, d, I, group, x.stride(0),
        gu_q.stride(0), gu_q.stride(1), gu_s.stride(0), gu_s.stride(1), h.stride(0), n_gu,
        BLOCK_N=cfg["GU_N"], BLOCK_K=gu_k, JOIN=gu_join, **launch)
    buf = torch.empty((P, d), dtype=torch.float32, device=x.device)
    _down_wq_kernel[(blocks * n_dn,)](
        h, dn_q, dn_s, buf, tw, sorted_ids, block_expert, total, P, d, I, dn_group, h.stride(0),
        dn_q.stride(0), dn_q.stride(1), dn_s.stride(0), dn_s.stride(1), buf.stride(0), n_dn,
        BLOCK_N=cfg["DN_N"], BLOCK_K=dn_k, JOIN=dn_join, **launch)
    block = min(1024, max(16, triton.next_power_of_2(d)))
    fused_moe._sum_kernel[(T, -(-d // block))](buf, ids, out, k, E, d, BLOCK=block, num_warps=4,
                                               **pdl)
    return out


def op(x, gu_q, gu_s, dn_q, dn_s, bits, topk_ids, topk_weights) -> torch.Tensor:
    """Triton on CUDA tensors, the PyTorch reference otherwise."""
    if use_triton(x, gu_q, gu_s, dn_q, dn_s, topk_ids, topk_weights):
        return fused_moe_quant_triton(x, gu_q, gu_s, dn_q, dn_s, bits, topk_ids, topk_weights)
    return fused_moe_quant_reference(x, gu_q, gu_s, dn_q, dn_s, bits, topk_ids, topk_weights)
