"""Encoders for llama.cpp's 256-value blocks (the K-quants Q4_K, Q5_K, Q6_K, and IQ4_XS), for
writing test files: the `gguf` package decodes these types but cannot encode them.

Plain round-to-nearest, not llama.cpp's error-minimising search: what matters for tests is that
every block is valid and decodes (with llama.cpp's layouts, ggml-common.h) close to the input.
`quantize_k(rows, "Q4_K")`: float32 [.., K] (K a multiple of 256) -> uint8 [.., K / 256 * bytes].
"""

from __future__ import annotations

import numpy as np

__all__ = ["K_QUANTS", "quantize_k"]

K_QUANTS = ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(float16 bytes [n, 2], the value it holds as float32 [n, 1])."""
    h = x.astype(np.float16).reshape(-1, 1)
    return h.view(np.uint8), h.astype(np.float32)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b > 0, a / np.where(b > 0, b, 1), 0).astype(np.float32)


def _q45_k(blocks: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K / Q5_K: 8 sub-blocks of 32 with a 6-bit scale and minimum each."""
    n = blocks.shape[0]
    levels = (1 << bits) - 1
    sub = blocks.reshape(n, 8, 32)
    lo = np.minimum(sub.min(-1), 0)  # [n, 8]: the value code 0 stands for (<= 0)
    scale = (sub.max(-1) - lo) / levels
    d_bytes, d = _f16(scale.max(-1) / 63)
    m_bytes, dmin = _f16(-lo.min(-1) / 63)
    sc = np.clip(np.rint(_safe_div(scale, d)), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_safe_div(-lo, dmin)), 0, 63).astype(np.uint8)
    step, offset = d * sc, dmin * mn  # what the decoder multiplies by and subtracts
    q = np.clip(np.rint(_safe_div(sub + offset[..., None], np.broadcast_to(step[..., None], sub.shape))), 0, levels)
    q = q.astype(np.uint8)
    packed = np.concatenate([
        (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6),
        (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4),
    ], axis=-1)
    low = q & 0x0F
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(n, 128)  # byte 32g + j: sub-blocks 2g (low), 2g + 1
    parts = [d_bytes, m_bytes, packed]
    if bits == 5:
        high = (q >> 4) & 1  # [n, 8, 32]: bit s of byte j is sub-block s's value j
        parts.append((high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8))
    return np.concatenate([*parts, qs], axis=-1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K: 16 sub-blocks of 16 with an int8 scale each, codes -32..31."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d_bytes, d = _f16(scale.max(-1) / 127)
    sc = np.clip(np.rint(_safe_div(scale, d)), -128, 127).astype(np.int8)
    step = d * sc.astype(np.float32)
    q = np.clip(np.rint(_safe_div(sub, np.broadcast_to(step[..., None], sub.shape))), -32, 31)
    u = (q.astype(np.int16) + 32).astype(np.uint8).reshape(n, 2, 128)  # two halves of 128
    ql = (u[:, :, :64] & 0x0F) | ((u[:, :, 64:] & 0x0F) << 4)  # [n, 2, 64]
    hi = ((u >> 4) & 3).reshape(n, 2, 4, 32)  # value 32s + j of a half: bits 2s of byte j
    qh = (hi << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(2).astype(np.uint8)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d_bytes], axis=-1)


def _iq4_xs(blocks: np.ndarray) -> np.ndarray:
    """IQ4_XS: 8 sub-blocks of 32, each value one of 16 non-linear levels times the sub-block's
    6-bit scale (minus 32) times a float16 one; a sub-block's largest magnitude maps to -127."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    peak = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0]  # [n, 8], signed
    scale = -peak / 127  # peak / scale = -127, the table's largest magnitude
    d_bytes, d = _f16(np.abs(scale).max(-1) / 31)
    ls = np.clip(np.rint(_safe_div(scale, np.broadcast_to(d, scale.shape))), -32, 31)
    step = (d * ls.astype(np.float32))[..., None]  # [n, 8, 1]
    q = np.abs(sub[..., None] - step[..., None] * IQ4_NL_VALUES).argmin(-1).astype(np.uint8)  # [n, 8, 32]
    u = (ls + 32).astype(np.uint16)  # 6 bits: 4 in scales_l, 2 in scales_h
    high = ((u >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(-1).astype(np.uint16).reshape(n, 1)
    low = (u[:, 0::2] & 0x0F) | ((u[:, 1::2] & 0x0F) << 4)
    qs = (q[:, :, :16] | (q[:, :, 16:] << 4)).reshape(n, 128)
    return np.concatenate([d_bytes, high.view(np.uint8), low.astype(np.uint8), qs], axis=-1)


def quantize_k(rows: np.ndarray, qtype: str) -> np.ndarray:
    """float32 [.., K] -> uint8 [.., K / 256 * type_size] blocks of `qtype` (one of `K_QUANTS`)."""
    if qtype not in K_QUANTS:
        raise ValueError(f"quantize_k writes {', '.join(K_QUANTS)}, not {qtype}")
    x = np.asarray(rows, dtype=np.float32)
    if x.shape[-1] % 256:
        raise ValueError(f"{qtype} rows must be a multiple of 256 values, got {x.shape[-1]}")
    blocks = x.reshape(-1, 256)
    if qtype == "IQ4_XS":
        out = _iq4_xs(blocks)
    else:
        out = _q6_k(blocks) if qtype == "Q6_K" else _q45_k(blocks, 4 if qtype == "Q4_K" else 5)
    return out.reshape(*x.shape[:-1], -1)
