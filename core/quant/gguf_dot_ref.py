"""GGUF weights times 8-bit activations, in pure torch: the arithmetic of the cpu backend's
``portside_cpu_native::gguf_dot`` kernels (`backends/cpu/csrc/gguf_dot*.cpp`), llama.cpp's
vec_dot design, written out so the kernels can be checked to the ulp.

The activations x [T, K] are quantized per block (`quantize_activations`): Q8_0 and Q4_0 weights
take blocks of 32 (as Q8_0), the 256-value formats (Q4_K, Q5_K, Q6_K, IQ4_XS) blocks of 256 (as
llama.cpp's Q8_K); scale = amax / 127 in fp32, codes = round-half-even(x / scale) clamped to
[-127, 127], a block of zeros has scale 0. Each weight block then gives one fp32 term
(`block_terms`): its integer codes' dot products with the activation codes are exact integers
(sub-block by sub-block, times the sub-block's integer scale), scaled in fp32 by the weight
block's float scale and the activation block's:

- Q8_0 / Q4_0: ``(d_w * d_x) * dot(w, x)``, w the int8 codes (Q4_0: nibble - 8);
- Q4_K / Q5_K: ``(d_x * d) * sum_j sc_j dot(q_j, x_j) - (d_x * dmin) * sum_j mn_j sum(x_j)``
  over the 8 sub-blocks of 32 (q the unsigned 4- or 5-bit codes: the minimums come from the
  activation's code sums);
- Q6_K: ``(d_x * d) * sum_j sc_j dot(q_j - 32, x_j)`` over 16 sub-blocks of 16 (sc int8);
- IQ4_XS: ``(d_x * d) * sum_j (ls_j - 32) dot(kvalues[q_j], x_j)`` over 8 sub-blocks of 32.

The output is the fp32 sum of a row's terms (+ bias), returned in x's dtype. A kernel differs
from this only in the order of that fp32 sum and in splitting a block's integer sum into SIMD
lanes (each a sum of 4-code dot products) before converting it to fp32: a few ulps of the terms
taken with those pieces' absolute values (`gguf_dot` returns that scale too).
"""

from __future__ import annotations

import torch

from portside.quant.gguf_blocks import (
    IQ4_NL_VALUES,
    _f16,
    _k_scales,
    _nibbles,
    _shr,
    block_shape,
    iq4_xs_scales,
    type_name,
)

__all__ = ["ACT_BLOCK", "quantize_activations", "block_terms", "gguf_dot"]

# the activation block (values per activation scale) each weight type is multiplied with
ACT_BLOCK = {"Q8_0": 32, "Q4_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "IQ4_XS": 256}


def quantize_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (any float dtype, read as fp32) -> (int8 codes [T, K], fp32 scales [T, K / block])."""
    t, k = x.shape
    if k % block:
        raise ValueError(f"{k} activation columns are not whole blocks of {block}")
    xb = x.float().reshape(t, k // block, block)
    d = xb.abs().amax(dim=-1) / 127.0  # fp32, as the kernel divides
    safe = torch.where(d == 0, torch.ones_like(d), d).unsqueeze(-1)
    q = (xb / safe).clamp(-127.0, 127.0).round()  # torch.round: half to even
    q = torch.where(d.unsqueeze(-1) == 0, torch.zeros_like(q), q)
    return q.to(torch.int8).reshape(t, k), d


def _dots(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Integer dot products, exact (float64 holds them): w [N, B, S, g], x [T, B, S, g] -> [T, N, B, S]."""
    return torch.einsum("nbsg,tbsg->tnbs", w.double(), x.double())


def _weight(b: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Blocks [N * B, type_size] (int16) -> (codes [N*B, S, g], integer sub-scales [N*B, S], d [N*B],
    minimums [N*B, S] or None, dmin [N*B] or None)."""
    n = b.shape[0]
    if name == "Q8_0":
        return b[:, 2:].to(torch.uint8).contiguous().view(torch.int8).reshape(n, 1, 32), torch.ones(n, 1), _f16(b[:, :2])[:, 0], None, None
    if name == "Q4_0":
        q = _nibbles(b[:, 2:], 16).reshape(n, 1, 32) - 8
        return q, torch.ones(n, 1), _f16(b[:, :2])[:, 0], None, None
    if name in ("Q4_K", "Q5_K"):
        sc, mn = _k_scales(b[:, 4:16])
        if name == "Q4_K":
            q = _nibbles(b[:, 16:], 32).reshape(n, 8, 32)
        else:
            low = _nibbles(b[:, 48:], 32).reshape(n, 8, 32)
            q = low | (((_shr(b[:, 16:48].reshape(n, 1, 1, 32), list(range(8)), 2)) & 1).reshape(n, 8, 32) << 4)
        return q, sc, _f16(b[:, :2])[:, 0], mn, _f16(b[:, 2:4])[:, 0]
    if name == "Q6_K":
        low = _nibbles(b[:, :128], 64).reshape(n, 8, 32)
        high = ((_shr(b[:, 128:192].reshape(n, -1, 1, 32), [0, 2, 4, 6], 2)) & 3).reshape(n, 8, 32)
        q = ((low | (high << 4)) - 32).reshape(n, 16, 16)
        sc = b[:, 192:208].to(torch.uint8).contiguous().view(torch.int8)
        return q, sc, _f16(b[:, 208:210])[:, 0], None, None
    if name == "IQ4_XS":
        q = torch.tensor(IQ4_NL_VALUES)[_nibbles(b[:, 8:], 16).reshape(n, 8, 32).long()]
        return q, iq4_xs_scales(b), _f16(b[:, :2])[:, 0], None, None
    raise ValueError(f"GGUF type {name} has no 8-bit-activation arithmetic (types: {', '.join(ACT_BLOCK)})")


def block_terms(x: torch.Tensor, qweight: torch.Tensor, ggml_type: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each weight block's fp32 term of y = x . W^T, [T, N, K / block] (block: the weight's), and
    the scale of a kernel's rounding of it: the same term with every integer dot product of 4
    codes (a SIMD lane's share) and every per-16 sum taken by its absolute value."""
    name = type_name(ggml_type)
    if name not in ACT_BLOCK:
        raise ValueError(f"GGUF type {name} has no 8-bit-activation arithmetic (types: {', '.join(ACT_BLOCK)})")
    size, nbytes = block_shape(ggml_type)
    t, k = x.shape
    n = qweight.shape[0]
    nb = k // size
    if k % size or tuple(qweight.shape) != (n, nb * nbytes) or qweight.dtype != torch.uint8:
        raise ValueError(f"{name} rows of {k} values are uint8 [N, {k // size * nbytes}], got {tuple(qweight.shape)}")
    xq, xd = quantize_activations(x, ACT_BLOCK[name])  # xd [T, K / act_block]; act_block == size here
    codes, sc, d, mn, dmin = _weight(qweight.reshape(n * nb, nbytes).to(torch.int16), name)
    s, g = codes.shape[1:]
    xs = xq.reshape(t, nb, s, g)
    dots4 = _dots(codes.reshape(n, nb, s * g // 4, 4), xs.reshape(t, nb, s * g // 4, 4)).unflatten(-1, (s, g // 4))
    scales = sc.reshape(1, n, nb, s).double()
    isum = (dots4.sum(-1) * scales).sum(-1)  # [T, N, B], exact
    iabs = (dots4.abs().sum(-1) * scales.abs()).sum(-1)
    dx = xd.reshape(t, 1, nb)
    terms = (dx * d.reshape(1, n, nb)) * isum.float()
    mags = (dx * d.reshape(1, n, nb)).abs() * iabs.float()
    if mn is not None and dmin is not None:
        xsum = xs.double().reshape(t, nb, s, g // 16, 16).sum(-1)  # [T, B, S, g / 16]: the per-16 sums
        mins = mn.reshape(1, n, nb, s).double()
        msum = (xsum.sum(-1).unsqueeze(1) * mins).sum(-1)
        terms = terms - (dx * dmin.reshape(1, n, nb)) * msum.float()
        mags = mags + (dx * dmin.reshape(1, n, nb)).abs() * (xsum.abs().sum(-1).unsqueeze(1) * mins).sum(-1).float()
    return terms, mags


def gguf_dot(x: torch.Tensor, qweight: torch.Tensor, ggml_type: int,
             bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [T, N] in x's dtype, the scale of a kernel's rounding [T, N] fp32: `block_terms`'
    magnitudes summed)."""
    terms, mags = block_terms(x, qweight, ggml_type)
    y = terms.sum(-1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype), mags.sum(-1)
