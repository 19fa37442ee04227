"""The cpu backend's paged-attention kernels (`csrc/paged_attention.c`), called through ctypes.

Their C entry points are part of the backend's one native library (`native_ops`, built by
`native_build` on first use or ahead of time); `load_library()` opens it with ctypes. Without a
compiler, `native_unavailable_reason()` says why and the backend runs its torch path.

The wrappers take torch tensors, check dtype / device / layout / shapes and raise `ValueError`
with what is wrong; the C code then trusts the sizes it is given (it still checks block ids and
slots against the cache, returning an error code rather than reading out of bounds).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from portside.backends.cpu import native_build, native_ops
from portside.backends.cpu.native_build import NativeBuildError
from portside.contract import KV_SCALE_BYTES

ABI_VERSION = 5
_ERRORS = {
    1: "a block id outside the cache",
    2: "out of memory for the kernel's scratch buffers",
    3: "a seq_len longer than its block-table row holds",
    4: "a slot outside the cache",
    5: "an unknown cache format",
}
# Cache dtype -> the C kernels' format (csrc/paged_attention.c, PS_KV_*): fp32, an 8-bit cache as
# portside.contract.quantize_kv lays it out (the canonical layout, int8 rows + fp32 scale), or a
# bf16 model's bf16 cache (read as fp32 by a 16-bit shift; queries and K/V rows bf16 or fp32).
FORMATS = {torch.float32: 0, torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3, torch.bfloat16: 4}
BF16 = FORMATS[torch.bfloat16]
# The query / K / V dtypes the kernels take: fp32 always, bf16 with a bf16 cache.
INPUT_DTYPES = (torch.float32, torch.bfloat16)

_i64, _i32, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p


@dataclass(frozen=True)
class NativeLibrary:
    lib: ctypes.CDLL
    path: Path


def _declare(lib: ctypes.CDLL) -> None:
    lib.ps_abi_version.restype = _i32
    lib.ps_abi_version.argtypes = []
    lib.ps_paged_decode_f32.restype = _i32
    lib.ps_paged_decode_f32.argtypes = [_ptr] * 5 + [_i64] * 12 + [_f32, _i64, _f32, _i32, _ptr]
    lib.ps_write_kv_f32.restype = _i32
    lib.ps_write_kv_f32.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64]
    lib.ps_paged_decode_q8.restype = _i32
    lib.ps_paged_decode_q8.argtypes = [_ptr, _ptr, _ptr, _i32, _ptr, _ptr] + [_i64] * 12 + [_f32, _i64, _f32, _i32, _ptr]
    lib.ps_write_kv_q8.restype = _i32
    lib.ps_write_kv_q8.argtypes = [_ptr, _i32, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64]
    lib.ps_write_kv_bf16.restype = _i32
    lib.ps_write_kv_bf16.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _i32, _ptr, _i64]


@functools.lru_cache(maxsize=1)
def load_library() -> NativeLibrary:
    """Build (once per cache key) and load the native library, then open its C entry points.
    Raises `NativeBuildError` with the reason."""
    target = native_ops.load()
    try:
        lib = ctypes.CDLL(str(target))
        _declare(lib)
    except (OSError, AttributeError) as e:
        raise NativeBuildError(f"loading {target} failed: {e}") from e
    if lib.ps_abi_version() != ABI_VERSION:
        raise NativeBuildError(f"{target} has ABI {lib.ps_abi_version()}, expected {ABI_VERSION}")
    return NativeLibrary(lib, target)


def native_unavailable_reason() -> str | None:
    """None when the native kernels build and load here, else why not (builds on first call)."""
    return native_build.unavailable_reason(load_library)


def _check(t: torch.Tensor, name: str, dtype: torch.dtype, dims: int) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"{name}: native cpu kernels need cpu tensors, got {t.device}")
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected {dtype}, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name}: expected {dims} dims, got shape {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dim must be contiguous, strides {t.stride()}")


def _raise_on(rc: int, what: str) -> None:
    if rc:
        raise ValueError(f"{what}: {_ERRORS.get(rc, f'error {rc}')}")


def _cache_geometry(kv_cache: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(format, num_blocks, block_size, KV heads, head size) of a contiguous canonical cache:
    fp32 or bf16 [2, num_blocks, block_size, KVH, D], or 8-bit (`FORMATS`; int8 rows are D + 4 bytes)."""
    fmt = FORMATS.get(kv_cache.dtype)
    if kv_cache.device.type != "cpu" or fmt is None or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype} on {kv_cache.device}: need a cpu "
                         f"[2, num_blocks, block_size, KVH, row] cache of {list(FORMATS)}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    _, num_blocks, block_size, kv_heads, row = kv_cache.shape
    return fmt, num_blocks, block_size, kv_heads, row - (KV_SCALE_BYTES if kv_cache.dtype == torch.int8 else 0)


def paged_decode(
    out: torch.Tensor,  # [B, H, D] fp32 (or bf16: the query's dtype), written
    query: torch.Tensor,  # [B, H, D] fp32, or bf16 over a bf16 cache
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D] fp32, bf16 or 8-bit (`FORMATS`), contiguous
    block_tables: torch.Tensor,  # [B, max_blocks] int32, rows contiguous
    seq_lens: torch.Tensor,  # [B] int32, contiguous
    scale: float,
    num_threads: int | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [H] fp32, contiguous
) -> None:
    """Decode attention of B single-token queries over their paged K/V (GQA: H % KVH == 0), with
    the attention features of `portside.contract.ATTENTION_FEATURES` (None: not used).
    Softmax and sums in fp32; bf16 queries are converted first and the output rounded to bf16
    after (the kernels' queries and outputs are fp32)."""
    lib = load_library().lib
    fmt, num_blocks, block_size, kv_heads, d_cache = _cache_geometry(kv_cache)
    if query.dtype == torch.bfloat16 and fmt == BF16:
        _check(out, "out", torch.bfloat16, 3)
        if out.shape != query.shape:
            raise ValueError(f"out {tuple(out.shape)} / query {tuple(query.shape)}: need matching shapes")
        out32 = torch.empty(query.shape, dtype=torch.float32)
        paged_decode(out32, query.float(), kv_cache, block_tables, seq_lens, scale, num_threads, sliding_window,
                     logit_softcap, sinks)
        out.copy_(out32)
        return
    for t, name in ((out, "out"), (query, "query")):
        _check(t, name, torch.float32, 3)
    _check(block_tables, "block_tables", torch.int32, 2)
    _check(seq_lens, "seq_lens", torch.int32, 1)
    batch, heads, d = query.shape
    if d_cache != d or heads % kv_heads:
        raise ValueError(f"query {tuple(query.shape)} does not fit kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype}")
    if out.shape != query.shape or query.stride(1) != d or out.stride(1) != d:
        raise ValueError(f"out {tuple(out.shape)} / query {tuple(query.shape)}: need matching shapes, heads dense")
    if not seq_lens.is_contiguous():
        raise ValueError("seq_lens must be contiguous")
    if block_tables.shape[0] != batch or seq_lens.shape[0] != batch:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} / seq_lens {tuple(seq_lens.shape)} "
                         f"do not match batch {batch}")
    if batch == 0:
        return
    args = (
        block_tables.data_ptr(), seq_lens.data_ptr(), batch, heads, kv_heads, d, num_blocks, block_size,
        block_tables.shape[1], query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        scale, sliding_window or 0, logit_softcap or 0.0, num_threads or torch.get_num_threads(), _sinks(sinks, heads),
    )  # fmt: skip
    if fmt:
        rc = lib.ps_paged_decode_q8(out.data_ptr(), query.data_ptr(), kv_cache.data_ptr(), fmt, *args)
    else:
        rc = lib.ps_paged_decode_f32(out.data_ptr(), query.data_ptr(), kv_cache.data_ptr(), *args)
    _raise_on(rc, "paged_decode")


def _sinks(sinks: torch.Tensor | None, heads: int) -> int | None:
    """The kernels' `sinks` pointer: [heads] fp32 contiguous, or None (NULL: none)."""
    if sinks is None:
        return None
    _check(sinks, "sinks", torch.float32, 1)
    if sinks.shape[0] != heads or not sinks.is_contiguous():
        raise ValueError(f"sinks {tuple(sinks.shape)}: one fp32 logit per query head ({heads}), contiguous")
    return sinks.data_ptr()


def _check_kv(t: torch.Tensor, name: str, fmt: int) -> None:
    """key/value [T, KVH, D]: fp32, or bf16 for a bf16 cache."""
    _check(t, name, torch.bfloat16 if fmt == BF16 and t.dtype == torch.bfloat16 else torch.float32, 3)


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """kv_cache [2, num_blocks, block_size, KVH, D] (fp32; bf16: rounded; 8-bit: quantized) at
    `slots` ([T] int64; -1 skips) <- fp32 key/value [T, KVH, D] (bf16 too for a bf16 cache)."""
    lib = load_library().lib
    fmt, num_blocks, block_size, kv_heads, d = _cache_geometry(kv_cache)
    _check_kv(key, "key", fmt)
    _check_kv(value, "value", fmt)
    if key.dtype != value.dtype:
        raise ValueError(f"key {key.dtype} and value {value.dtype} differ")
    _check(slots, "slots", torch.int64, 1)
    for t, name in ((key, "key"), (value, "value")):
        if t.shape[1:] != (kv_heads, d) or t.stride(1) != d or t.shape[0] != slots.shape[0]:
            raise ValueError(f"{name} {tuple(t.shape)} does not fit kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype} "
                             f"and {slots.shape[0]} slots (or its heads are not dense)")
    if not slots.is_contiguous():
        raise ValueError("slots must be contiguous")
    if slots.shape[0] == 0:
        return
    _raise_on(_write(lib, fmt, kv_cache.data_ptr(), num_blocks * block_size, kv_heads, d, key, value, slots.data_ptr(),
                     slots.shape[0]), "write_kv")


def _write(lib: ctypes.CDLL, fmt: int, cache: int, num_slots: int, kv_heads: int, d: int, key: torch.Tensor,
           value: torch.Tensor, slots: int, n: int) -> int:
    """The C write for the cache's format (arguments checked by the caller)."""
    if fmt == BF16:
        return lib.ps_write_kv_bf16(cache, num_slots, kv_heads * d, key.data_ptr(), key.stride(0), value.data_ptr(),
                                    value.stride(0), int(key.dtype == torch.bfloat16), slots, n)
    if fmt:
        return lib.ps_write_kv_q8(cache, fmt, num_slots, kv_heads, d, key.data_ptr(), key.stride(0), value.data_ptr(),
                                  value.stride(0), slots, n)
    return lib.ps_write_kv_f32(cache, num_slots, kv_heads * d, key.data_ptr(), key.stride(0), value.data_ptr(),
                               value.stride(0), slots, n)


class DecodeStep:
    """One step's decode-only native attention, for every layer: the block tables, lengths and
    slots are checked and converted once per step here, so each layer's call (`__call__`: K/V
    write, then decode) only checks its own tensors. At batch 1 a layer's attention is ~30 us of
    kernel; the checks and conversions `write_kv` + `paged_decode` repeat cost more than that."""

    def __init__(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor) -> None:
        _check(block_tables, "block_tables", torch.int32, 2)
        _check(seq_lens, "seq_lens", torch.int32, 1)
        _check(slots, "slots", torch.int64, 1)
        batch = seq_lens.shape[0]
        if block_tables.shape[0] != batch or slots.shape[0] != batch:
            raise ValueError(f"block_tables {tuple(block_tables.shape)} / slots {tuple(slots.shape)} do not "
                             f"match {batch} decodes")
        if not seq_lens.is_contiguous() or not slots.is_contiguous():
            raise ValueError("seq_lens and slots must be contiguous")
        self._lib = load_library().lib
        self.tensors = (block_tables, seq_lens, slots)  # the pointers below point into these
        self._batch = batch
        self._tables = (block_tables.data_ptr(), seq_lens.data_ptr())
        self._table_shape = (block_tables.shape[1], block_tables.stride(0))
        self._slots = slots.data_ptr()

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 scale: float, sliding_window: int | None = None, logit_softcap: float | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 query [B, H, D], key/value [B, KVH, D] with dense heads -> attention output [B, H, D]
        (contiguous); key/value are first written at the step's slots of `kv_cache` (fp32, bf16 or
        8-bit, `FORMATS`). Over a bf16 cache all three may be bf16 (the output is then bf16:
        fp32 inside). The features as in `paged_decode`."""
        fmt, num_blocks, block_size, kv_heads, d = _cache_geometry(kv_cache)
        batch, heads = self._batch, query.shape[1]
        bf16 = fmt == BF16 and query.dtype == torch.bfloat16
        want = torch.bfloat16 if bf16 else torch.float32
        for t in (query, key, value):
            if t.dtype != want or t.shape[0] != batch or t.shape[2] != d or t.stride(2) != 1 or t.stride(1) != d:
                raise ValueError(f"query/key/value {tuple(t.shape)} {t.dtype} strides {t.stride()} do not fit "
                                 f"{batch} decodes over kv_cache {tuple(kv_cache.shape)} (fp32, dense heads)")
        if key.shape[1] != kv_heads or value.shape[1] != kv_heads or heads % kv_heads:
            raise ValueError(f"key/value heads {key.shape[1]}/{value.shape[1]} and {heads} query heads do not "
                             f"fit {kv_heads} cached KV heads")
        cache = kv_cache.data_ptr()
        _raise_on(_write(self._lib, fmt, cache, num_blocks * block_size, kv_heads, d, key, value, self._slots, batch),
                  "write_kv")
        if bf16:
            query = query.float()  # contiguous
        out = torch.empty(query.shape, dtype=torch.float32)
        args = (
            *self._tables, batch, heads, kv_heads, d, num_blocks, block_size, self._table_shape[0], query.stride(0), d,
            heads * d, d, self._table_shape[1], scale, sliding_window or 0, logit_softcap or 0.0, torch.get_num_threads(),
            _sinks(sinks, heads),
        )  # fmt: skip
        if fmt:
            rc = self._lib.ps_paged_decode_q8(out.data_ptr(), query.data_ptr(), cache, fmt, *args)
        else:
            rc = self._lib.ps_paged_decode_f32(out.data_ptr(), query.data_ptr(), cache, *args)
        _raise_on(rc, "paged_decode")
        return out.to(torch.bfloat16) if bf16 else out
