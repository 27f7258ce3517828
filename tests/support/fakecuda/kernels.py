"""CUDA-only kernels, emulated with their contracts checked: SDPA's backend choice, FlashAttention-2
and memory-efficient attention (forward and backward, through the CPU flash kernel), grouped GEMM,
cuBLASLt's fp8 GEMM (torch._scaled_mm).
Each handler takes the op's wrapped arguments and returns wrapped results."""
from __future__ import annotations

import math

import torch

from megaframe.parallel.matmul import onednn_off
from tests.support.fakecuda import ledger
from tests.support.fakecuda.tensor import CudaTensor

aten = torch.ops.aten
FLASH_DTYPES = (torch.float16, torch.bfloat16)
# torch.nn.attention.SDPBackend values
MATH, FLASH, EFFICIENT = 0, 1, 2


def _arg(args, kwargs, position: int, name: str, default=None):
    return args[position] if len(args) > position else kwargs.get(name, default)


def _on_device(func, tensors) -> int:
    """The one device of these tensors; a host one is refused as CUDA refuses it."""
    indices = set()
    for t in tensors:
        if t is None:
            continue
        if not isinstance(t, CudaTensor):
            raise ledger.refuse(f"{func}: Expected all tensors to be on the same device, but found a {t.device} tensor")
        indices.add(t._index)
    if len(indices) != 1:
        raise ledger.refuse(f"{func}: Expected all tensors to be on the same device, found cuda:{sorted(indices)}")
    return indices.pop()


def _flash_supports(q, k, v) -> str | None:
    """Why FlashAttention-2 refuses these inputs (None: it takes them)."""
    if q.dtype not in FLASH_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"FlashAttention only supports fp16 and bf16 (got {q.dtype})"
    if q.dim() != 4:
        return f"FlashAttention takes 4-d (B, H, T, D) inputs (got {q.dim()}-d)"
    head_dim = q.size(-1)
    if head_dim % 8 or head_dim > 256:
        return f"FlashAttention needs a head dim that is a multiple of 8 and at most 256 (got {head_dim})"
    return None


def sdp_choice(func, args, kwargs, index):
    """CUDA's order on sm90: flash, then memory-efficient, then math. Dropout and masks go to math here
    (the tier does not emulate them inside the fused kernels)."""
    q, k, v = args[:3]
    _on_device(func, (q, k, v))
    mask = _arg(args, kwargs, 3, "attn_mask")
    dropout = _arg(args, kwargs, 4, "dropout_p", 0.0)
    gqa = kwargs.get("enable_gqa", False)
    backends = torch.backends.cuda
    if mask is None and dropout == 0.0:
        if _flash_supports(q, k, v) is None and backends.flash_sdp_enabled():
            return FLASH
        if q.dtype == torch.float32 and not gqa and q.size(-1) % 4 == 0 and backends.mem_efficient_sdp_enabled():
            return EFFICIENT
    if backends.math_sdp_enabled():
        return MATH
    raise ledger.refuse("No available kernel. Aborting execution.")


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention as CUDA runs it: C++ asks the choice stub of the query's C++
    device (meta, none), so tensor.py routes the call here, which chooses as CUDA does and calls that
    backend's aten op (autograd then calls its backward op)."""
    choice = sdp_choice(torch.ops.aten._fused_sdp_choice.default, (query, key, value, attn_mask, dropout_p, is_causal),
                        {"scale": scale, "enable_gqa": enable_gqa}, None)
    if choice == FLASH:
        return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    if choice == EFFICIENT:
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return aten._scaled_dot_product_efficient_attention(query, key, value, None, grad, dropout_p, is_causal,
                                                            scale=scale)[0]
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal,
                                                            scale=scale, enable_gqa=enable_gqa)


def _flash_layout(out: torch.Tensor) -> torch.Tensor:
    # the CUDA kernels work in (B, T, H, D) and hand back its (B, H, T, D) transpose
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def _cpu_lse(lse: torch.Tensor) -> torch.Tensor:
    # the CPU kernel's log-sum-exp is (B, H, T) over (B, T, H) memory
    return lse.transpose(1, 2).contiguous().transpose(1, 2)


def flash_forward(func, args, kwargs, index):
    q, k, v = args[:3]
    index = _on_device(func, (q, k, v))
    if (why := _flash_supports(q, k, v)) is not None:
        raise ledger.refuse(f"{func}: {why}")
    dropout = _arg(args, kwargs, 3, "dropout_p", 0.0)
    causal = _arg(args, kwargs, 4, "is_causal", False)
    if dropout:
        raise NotImplementedError("fakecuda: FlashAttention with dropout is not emulated")
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q._elem, k._elem, v._elem, 0.0, causal,
                                                               scale=kwargs.get("scale"))
    wrap = lambda t: CudaTensor(t, index)  # noqa: E731
    empty = torch.empty(0, dtype=torch.int32)
    return (wrap(_flash_layout(out)), wrap(lse.float().contiguous()), wrap(empty), wrap(empty.clone()),
            q.size(2), k.size(2), wrap(torch.zeros(2, dtype=torch.uint64)), wrap(torch.empty(0, dtype=torch.uint64)),
            wrap(torch.empty(0, dtype=q.dtype)))


def flash_backward(func, args, kwargs, index):
    grad_out, q, k, v, out, lse = args[:6]
    index = _on_device(func, (grad_out, q, k, v, out, lse))
    if (why := _flash_supports(q, k, v)) is not None:
        raise ledger.refuse(f"{func}: {why}")
    if lse.dtype != torch.float32 or not lse.is_contiguous() or tuple(lse.shape) != tuple(q.shape[:3]):
        raise ledger.refuse(f"{func}: logsumexp must be a contiguous fp32 (B, H, T) tensor, got {lse.dtype} "
                            f"{tuple(lse.shape)}")
    causal = _arg(args, kwargs, 11, "is_causal", False)
    grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out._elem, q._elem, k._elem, v._elem, out._elem, _cpu_lse(lse._elem), 0.0, causal,
        scale=kwargs.get("scale"))
    return tuple(CudaTensor(g, index) for g in grads)


def efficient_forward(func, args, kwargs, index):
    q, k, v = args[:3]
    bias = _arg(args, kwargs, 3, "attn_bias")
    index = _on_device(func, (q, k, v, bias))
    compute_lse = _arg(args, kwargs, 4, "compute_log_sumexp", False)
    dropout = _arg(args, kwargs, 5, "dropout_p", 0.0)
    causal = _arg(args, kwargs, 6, "is_causal", False)
    if dropout or bias is not None:
        raise NotImplementedError("fakecuda: memory-efficient attention with dropout or a bias is not emulated")
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q._elem, k._elem, v._elem, 0.0, causal,
                                                               scale=kwargs.get("scale"))
    B, H, T = lse.shape
    # the CUDA kernel pads the log-sum-exp's time axis to a multiple of 32 (empty when not asked for)
    padded = torch.zeros(B, H, math.ceil(T / 32) * 32 if compute_lse else 0, dtype=torch.float32)
    if compute_lse:
        padded[:, :, :T] = lse
    seed_offset = torch.zeros((), dtype=torch.int64)
    return (CudaTensor(_flash_layout(out), index), CudaTensor(padded, index), CudaTensor(seed_offset, index),
            CudaTensor(seed_offset.clone(), index))


def efficient_backward(func, args, kwargs, index):
    grad_out, q, k, v, bias, out, lse = args[:7]
    index = _on_device(func, (grad_out, q, k, v, out, lse))
    causal = _arg(args, kwargs, 11, "is_causal", False)
    T = q.size(2)
    if lse.dtype != torch.float32 or lse.size(-1) < T:
        raise ledger.refuse(f"{func}: logsumexp must be fp32 (B, H, >=T), got {lse.dtype} {tuple(lse.shape)}")
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out._elem, q._elem, k._elem, v._elem, out._elem, _cpu_lse(lse._elem[:, :, :T]), 0.0, causal,
        scale=kwargs.get("scale"))
    return (CudaTensor(dq, index), CudaTensor(dk, index), CudaTensor(dv, index), None)


def grouped_mm(func, args, kwargs, index):
    """torch._grouped_mm on sm90: bf16, offsets as int32 on the device; shapes checked by torch's meta
    kernel, values by the CPU kernel."""
    a, b = args[0], args[1]
    offs = _arg(args, kwargs, 2, "offs")
    bias = _arg(args, kwargs, 3, "bias")
    index = _on_device(func, (a, b, offs, bias))
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        raise ledger.refuse(f"{func}: grouped gemm on sm90 takes bf16 inputs (got {a.dtype}, {b.dtype})")
    if offs is not None and offs.dtype != torch.int32:
        raise ledger.refuse(f"{func}: offsets must be int32 (got {offs.dtype})")
    meta = [x._elem.to("meta") if isinstance(x, CudaTensor) else x for x in args]
    func(*meta, **{k: (v._elem.to("meta") if isinstance(v, CudaTensor) else v) for k, v in kwargs.items()})
    plain = [x._elem if isinstance(x, CudaTensor) else x for x in args]
    out = func(*plain, **{k: (v._elem if isinstance(v, CudaTensor) else v) for k, v in kwargs.items()})
    return CudaTensor(out, index)


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def scaled_mm(func, args, kwargs, index):
    """torch._scaled_mm on sm90 (cuBLASLt's fp8 GEMM, which the CPU kernel does not hold to): fp8
    operands (not both e5m2), the first row-major and the second column-major, every dimension of
    the second and the first's reduction dimension multiples of 16, fp32 scales on the device
    (tensorwise: one each; rowwise: one per row of the first and per column of the second)."""
    a, b = args[0], args[1]
    scale_a, scale_b = _arg(args, kwargs, 2, "scale_a"), _arg(args, kwargs, 3, "scale_b")
    index = _on_device(func, (a, b, scale_a, scale_b, _arg(args, kwargs, 4, "bias"),
                              _arg(args, kwargs, 5, "scale_result")))
    if a.dtype not in FP8 or b.dtype not in FP8 or a.dtype == b.dtype == torch.float8_e5m2:
        raise ledger.refuse(f"{func}: fp8 operands, not both e5m2 (got {a.dtype}, {b.dtype})")
    (m, k), n = a.shape, b.shape[1]
    if a._elem.stride(1) != 1 or (n > 1 and b._elem.stride(0) != 1):
        raise ledger.refuse(f"{func}: mat1 must be row-major and mat2 column-major (strides "
                            f"{a._elem.stride()}, {b._elem.stride()})")
    if k % 16 or n % 16:
        raise ledger.refuse(f"{func}: mat2 shape ({k}x{n}) must be divisible by 16")
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
        raise ledger.refuse(f"{func}: scales must be float32 (got {scale_a.dtype}, {scale_b.dtype})")
    if (scale_a.numel(), scale_b.numel()) not in ((1, 1), (m, n)):
        raise ledger.refuse(f"{func}: scales tensorwise (1, 1) or rowwise ({m}, {n}), got "
                            f"({scale_a.numel()}, {scale_b.numel()})")
    plain = [x._elem if isinstance(x, CudaTensor) else x for x in args]
    # torch's CPU kernel without oneDNN, as megaframe runs fp8 kernels on a CPU host (parallel/matmul.py
    # gemm: oneDNN's fp8 path is a reference loop where the host has AMX), so that the device and the
    # plain CPU run of the same layout do the same arithmetic
    with onednn_off():
        out = func(*plain, **{k: (v._elem if isinstance(v, CudaTensor) else v) for k, v in kwargs.items()})
    return CudaTensor(out, index)

HANDLERS = {
    aten._fused_sdp_choice.default: sdp_choice,
    aten._scaled_dot_product_flash_attention.default: flash_forward,
    aten._scaled_dot_product_flash_attention_backward.default: flash_backward,
    aten._scaled_dot_product_efficient_attention.default: efficient_forward,
    aten._scaled_dot_product_efficient_attention_backward.default: efficient_backward,
    aten._grouped_mm.default: grouped_mm,
    aten._scaled_mm.default: scaled_mm,
}
