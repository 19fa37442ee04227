"""llama.cpp's block formats (GGML types), decoded in pure torch: `dequantize_blocks` turns rows
of blocks as a GGUF file stores them (uint8 ``[.., rows, row_bytes]``) into fp32 ``[.., rows, K]``,
bit for bit what llama.cpp's own reference (``gguf.quants.dequantize``) gives.

Each row of K values is K / block_size blocks of ``type_size`` bytes (`block_shape`). Within a
block, llama.cpp's layouts (ggml-common.h): a float16 scale ``d`` (and a minimum ``m`` for the
``_1`` types) and packed codes; the K-quants group 256 values as 8 or 16 sub-blocks with
6- or 8-bit sub-scales under float16 super-scales; IQ4_NL and IQ4_XS map 4-bit codes through a
table of 16 non-linear values (IQ4_XS: 8 sub-blocks of 32 with 6-bit scales under a float16
one). Types read: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
IQ4_NL, IQ4_XS.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = ["GGML_TYPES", "IQ4_NL_VALUES", "block_shape", "row_bytes", "type_name", "type_from_name", "dequantize_blocks", "is_float_type"]

_FLOAT_TYPES = ("F32", "F16", "BF16")


def type_name(ggml_type: int) -> str:
    """"Q4_K" for GGML type 12; raises ValueError for a number that is no GGML type."""
    try:
        return GGMLQuantizationType(int(ggml_type)).name
    except ValueError:
        raise ValueError(f"GGML type {ggml_type!r} does not exist") from None


def type_from_name(name: str) -> int:
    """GGML type 12 for "Q4_K"; raises ValueError naming the types portside reads."""
    if name not in GGML_TYPES:
        raise ValueError(f"GGML type {name!r} is not supported; portside reads {', '.join(GGML_TYPES)}")
    return int(GGMLQuantizationType[name])


def is_float_type(ggml_type: int) -> bool:
    """F32, F16 or BF16: plain floats, not blocks."""
    return type_name(ggml_type) in _FLOAT_TYPES


def block_shape(ggml_type: int) -> tuple[int, int]:
    """(values per block, bytes per block) of a GGML type: (32, 34) for Q8_0, (256, 144) for Q4_K."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(int(ggml_type))]


def row_bytes(ggml_type: int, k: int) -> int:
    """Bytes of one row of `k` values; raises ValueError when k is not a whole number of blocks."""
    size, nbytes = block_shape(ggml_type)
    if k % size:
        raise ValueError(f"{k} values per row are not a whole number of {type_name(ggml_type)} blocks of {size}")
    return k // size * nbytes


# ---- one function per type: blocks [n, type_size] (bytes as int16) -> fp32 [n, block_size] ---


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian float16 bytes [n, 2] -> fp32 [n, 1]."""
    return b.to(torch.uint8).contiguous().view(torch.float16).float()


def _shr(x: torch.Tensor, amounts: list[int], dim: int) -> torch.Tensor:
    """x (size 1 along `dim`) shifted right by each of `amounts`, concatenated along `dim`: what
    ``x >> tensor(amounts)`` broadcasts to, with Python shift amounts (XLA mis-shifts some
    broadcast tensor amounts)."""
    return torch.cat([x >> a for a in amounts], dim=dim)


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """[n, B] bytes -> [n, B / group, 2 * group]: each group of bytes' low nibbles, then high ones."""
    n = qs.shape[0]
    q = _shr(qs.reshape(n, -1, 1, group), [0, 4], 2)
    return (q & 0x0F).reshape(n, -1, 2 * group)


def _bits(b: torch.Tensor, count: int) -> torch.Tensor:
    """[n, count / 8] bytes -> [n, count] single bits, little-endian (bit j of byte i is value 8i + j)."""
    return ((_shr(b.unsqueeze(-1), list(range(8)), 2)) & 1).reshape(b.shape[0], count)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].to(torch.uint8).contiguous().view(torch.int8).float() * _f16(b[:, :2])


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:], 16).reshape(b.shape[0], 32).to(torch.int8) - 8
    return _f16(b[:, :2]) * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 4:], 16).reshape(b.shape[0], 32).float()
    return _f16(b[:, :2]) * q + _f16(b[:, 2:4])


def _q5(b: torch.Tensor, offset: int) -> torch.Tensor:
    """Q5_0 / Q5_1 codes (5 bits: a low nibble and one high bit from the block's 32-bit mask)."""
    high = _bits(b[:, offset : offset + 4], 32)
    low = _nibbles(b[:, offset + 4 :], 16).reshape(b.shape[0], 32)
    return low | (high << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * (_q5(b, 2).to(torch.int8) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * _q5(b, 4).float() + _f16(b[:, 2:4])


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0x0F).float()).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    q = (_shr(qs.reshape(n, -1, 1, 32), [0, 2, 4, 6], 2)) & 3
    return (dl * q.reshape(n, 16, 16).float() - ml).reshape(n, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, scales, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    low = (_shr(scales[:, :8].reshape(n, 1, 8), [0, 4], 1)).reshape(n, 16)
    high = (_shr(scales[:, 8:].reshape(n, 1, 4), [0, 2, 4, 6], 1)).reshape(n, 16)
    sc = ((low & 0x0F) | ((high & 3) << 4)).to(torch.int8) - 32
    dl = (d * sc.float()).reshape(n, 16, 1)
    ql = ((_shr(qs.reshape(n, -1, 1, 32), [0, 2, 4, 6], 2)).reshape(n, 16, 16)) & 3
    qh = ((_shr(hmask.reshape(n, -1, 1, 32), list(range(8)), 2)).reshape(n, 16, 16)) & 1
    q = ql.to(torch.int8) - ((qh ^ 1) << 2).to(torch.int8)  # a set mask bit means no offset
    return (dl * q.float()).reshape(n, 256)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit minimums, each [n, 8]."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    d = (_f16(b[:, :2]) * sc.float()).reshape(n, 8, 1)
    dm = (_f16(b[:, 2:4]) * mn.float()).reshape(n, 8, 1)
    q = _nibbles(b[:, 16:], 32).reshape(n, 8, 32).float()
    return (d * q - dm).reshape(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    d = (_f16(b[:, :2]) * sc.float()).reshape(n, 8, 1)
    dm = (_f16(b[:, 2:4]) * mn.float()).reshape(n, 8, 1)
    low = _nibbles(b[:, 48:], 32).reshape(n, 8, 32)
    high = ((_shr(b[:, 16:48].reshape(n, 1, 1, 32), list(range(8)), 2)) & 1).reshape(n, 8, 32)
    return (d * (low | (high << 4)).float() - dm).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh, scales = b[:, :128], b[:, 128:192], b[:, 192:208]
    d = (_f16(b[:, 208:210]) * scales.to(torch.uint8).contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    low = _nibbles(ql, 64).reshape(n, 8, 32)
    high = ((_shr(qh.reshape(n, -1, 1, 32), [0, 2, 4, 6], 2)) & 3).reshape(n, 8, 32)
    q = (low | (high << 4)).to(torch.int8) - 32
    return (d * q.reshape(n, 16, 16).float()).reshape(n, 256)


# IQ4_NL / IQ4_XS: the 16 values a 4-bit code stands for (llama.cpp's kvalues_iq4nl)
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _iq4_values(codes: torch.Tensor) -> torch.Tensor:
    return torch.tensor(IQ4_NL_VALUES, dtype=torch.float32, device=codes.device)[codes.long()]


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * _iq4_values(_nibbles(b[:, 2:], 16).reshape(b.shape[0], 32))


def iq4_xs_scales(b: torch.Tensor) -> torch.Tensor:
    """IQ4_XS blocks [n, 136] -> the 8 sub-block scales [n, 8] (6 bits: 4 low from scales_l, 2 high
    from scales_h) minus 32."""
    n = b.shape[0]
    high = (_bits(b[:, 2:4], 16).reshape(n, 8, 2) * torch.tensor([1, 2], dtype=b.dtype, device=b.device)).sum(-1)
    low = (_shr(b[:, 4:8].reshape(n, 4, 1), [0, 4], 2) & 0x0F).reshape(n, 8)
    return (low | (high << 4)) - 32


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    dl = (_f16(b[:, :2]) * iq4_xs_scales(b).float()).reshape(n, 8, 1)
    return (dl * _iq4_values(_nibbles(b[:, 8:], 16).reshape(n, 8, 32))).reshape(n, 256)


_DECODERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
    "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs,
}
_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
GGML_TYPES = (*_FLOAT_TYPES, *_DECODERS)  # the types portside reads


def dequantize_blocks(data: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """uint8 rows of blocks [.., rows, row_bytes] -> fp32 [.., rows, k] (the float types are
    reinterpreted). Raises ValueError when the rows are not `k` values of `ggml_type`."""
    name = type_name(ggml_type)
    if name not in GGML_TYPES:
        raise ValueError(f"GGML type {name} is not supported; portside reads {', '.join(GGML_TYPES)}")
    if data.dtype != torch.uint8 or data.dim() < 1 or data.shape[-1] != row_bytes(ggml_type, k):
        raise ValueError(f"{name} rows of {k} values are uint8 [.., {row_bytes(ggml_type, k)}], "
                         f"got {data.dtype} {tuple(data.shape)}")
    lead = data.shape[:-1]
    if name in _FLOATS:
        return data.contiguous().view(_FLOATS[name]).float().reshape(*lead, k)
    size, nbytes = block_shape(ggml_type)
    # bytes widened to int16: the decoders shift them, and XLA shifts uint8 as if it were signed
    blocks = data.contiguous().reshape(-1, nbytes).to(torch.int16)
    return _DECODERS[name](blocks).reshape(*lead, k)
