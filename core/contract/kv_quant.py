"""8-bit KV caches (`--kv-cache-dtype`): the accepted values, the bytes a cache row takes, and
core's reference formats (`quantize_kv` / `dequantize_kv`), which a backend's 8-bit attention
must match within `portside.testing.tolerances`.

The formats, as the reference stores them:

- fp8_e4m3 / fp8_e5m2: each element cast to OCP float8 (e4m3fn: +-448; e5m2: +-57344),
  saturating, round to nearest even. Per-layer scales (a checkpoint's k_scale / v_scale) are
  applied by the model, not the backend: it stores k / k_scale and v / v_scale and compensates
  in q and in the attention output, so a backend stores and reads scale-free fp8.
- int8: each (token, KV head) row of head_size values symmetric-quantized with its own fp32
  scale (amax / 127, round half to even): head_size int8 values, then the scale's 4 bytes.
"""

from __future__ import annotations

import torch

__all__ = [
    "KV_CACHE_DTYPES",
    "QUANTIZED_KV_CACHE_DTYPES",
    "KV_SCALE_BYTES",
    "kv_cache_dtype_name",
    "kv_cache_torch_dtype",
    "is_quantized_kv",
    "kv_row_bytes",
    "quantize_kv",
    "dequantize_kv",
]

KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
"""`--kv-cache-dtype` values -> what the cache tensor holds (None: the model's dtype). "fp8" is
"fp8_e4m3" (as in vLLM); the other keys are the canonical names platforms and backends list."""

QUANTIZED_KV_CACHE_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
"""The cache tensor dtypes that hold 8-bit values (with scales, for int8)."""

KV_SCALE_BYTES = 4
"""int8: one fp32 scale per (token, KV head) row, after its values."""


def kv_cache_dtype_name(name: str) -> str:
    """The canonical name of a `--kv-cache-dtype` value ("fp8" -> "fp8_e4m3"); ValueError if unknown."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown --kv-cache-dtype {name!r}; use one of {list(KV_CACHE_DTYPES)}")
    return "fp8_e4m3" if name == "fp8" else name


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the cache tensor for `--kv-cache-dtype name` with a model in `model_dtype`."""
    return KV_CACHE_DTYPES[kv_cache_dtype_name(name)] or model_dtype


def is_quantized_kv(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype holds 8-bit values (with scales), not the model's own."""
    return dtype in QUANTIZED_KV_CACHE_DTYPES


def kv_row_bytes(head_size: int, cache_dtype: torch.dtype) -> int:
    """Bytes one (token, KV head) row of K (or of V) takes in a cache of `cache_dtype`; the pool is
    sized by this, and a backend's `kv_cache_shape` must hold exactly that many bytes per row."""
    if cache_dtype == torch.int8:
        return head_size + KV_SCALE_BYTES
    return head_size * torch.empty((), dtype=cache_dtype).element_size()


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """K or V rows x [..., head_size] as stored in a cache of the 8-bit `cache_dtype` (the
    reference formats, above): fp8 -> [..., head_size] in that dtype; int8 -> [..., head_size + 4]
    int8, the row's fp32 scale in the last 4 bytes. Computed in fp32."""
    xf = x.float()
    if cache_dtype == torch.int8:
        amax = xf.abs().amax(dim=-1, keepdim=True)
        scale = amax / 127.0
        q = torch.where(amax > 0, torch.round(xf / torch.where(amax > 0, scale, 1.0)), 0.0)
        q = q.clamp(-127, 127).to(torch.int8)
        return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)
    if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        fmax = torch.finfo(cache_dtype).max
        return xf.clamp(-fmax, fmax).to(cache_dtype)
    raise ValueError(f"{cache_dtype} is not an 8-bit KV-cache dtype {QUANTIZED_KV_CACHE_DTYPES}")


def dequantize_kv(rows: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_kv` (by the rows' dtype), in fp32: int8 [..., head_size + 4] or fp8
    [..., head_size] -> [..., head_size]."""
    if rows.dtype == torch.int8:
        d = rows.shape[-1] - KV_SCALE_BYTES
        scale = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]
        return rows[..., :d].float() * scale
    return rows.float()
