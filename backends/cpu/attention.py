"""Paged attention for CPUs: vectorized torch (`CpuAttentionBackend`), and the same with decodes
and K/V writes in the native C kernels of `kernels.py` (`NativeAttentionBackend`).

Cache layout (one layer): ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (the
canonical one). Everything that depends only on the batch (gather indices, masks, valid slots)
is built once per step in `prepare`, not once per layer. Decodes are attended in one batched SDPA
call over their gathered blocks; each prefill chunk is one SDPA call over its gathered prefix.
GQA folds the query heads of a KV head into the query-length axis, so K/V are never repeated.

The cache must hold finite values everywhere (the runner zero-initialises it): padded key
positions are masked out of the softmax, and 0 * finite = 0.

The native path reads each decode's K/V rows in place from the paged cache (no gather copy, no
padding) and writes new K/V rows with one call; it runs when the queries and new K/V are fp32 (the
cache fp32, 8-bit or bf16) or bf16 over a bf16 cache (a bf16 model: the kernels convert the rows
to fp32 by a 16-bit shift, attend in fp32 and round the output to bf16), and otherwise falls back
to the torch path call by call. Prefill chunks always use SDPA: a request's first chunk over the
step's own K/V (causal, no mask, no gather; runs of equal-length chunks in one call; bf16 ones in
the native backend on AMX tiles where the CPU has them), a later chunk over its gathered prefix.

8-bit caches (`--kv-cache-dtype` fp8_e4m3, fp8_e5m2, int8): the canonical layout in that dtype,
int8 rows followed by their fp32 scale (`portside.backend_api.quantize_kv`). Writes quantize;
the torch path dequantizes the blocks it gathers to fp32 and attends in fp32; the native kernels
dequantize each row as they read it.

Both take the attention features (`portside.backend_api.ATTENTION_FEATURES`). A sliding window
is a mask, and only the blocks holding keys inside some query's window are gathered (a windowed
decode reads the last `window` keys only; the native kernel skips the rest too). SDPA cannot
soft-cap scores, so a soft-capped layer computes its scores explicitly (`_attend`, fp32). Attention
sinks (gpt-oss: a per-head logit in the softmax's denominator) scale a prefill's SDPA output by
sigmoid(lse - sink), the log-sum-exp from torch's CPU flash kernel (`_sdpa_sinks`); the native
decode kernels add e^(sink - max) to each row's denominator, the torch decodes a sink column.

Encoder attention (non-causal, no cache; `AttentionBackend.encoder_attention`) is SDPA over the
sequences batched by length (`encoder_attention.py`), for both classes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from portside.backends.cpu import kernels, native_ops
from portside.backends.cpu.encoder_attention import encoder_attention
from portside.backends.cpu.mla import CpuLatentAttention
from portside.contract import (
    AttentionBackend,
    AttentionMetadata,
    GraphCaptureSupport,
    dequantize_kv,
    is_quantized_kv,
    kv_row_bytes,
    quantize_kv,
)

# The most rows of a one-sequence step the fused multi-row step takes (csrc/fused_decode.cpp's kMaxRows).
MAX_FUSED_ROWS = 16
KV_CACHE_DTYPES = frozenset({"auto", "fp8_e4m3", "fp8_e5m2", "int8"})


@dataclass
class _Prefill:
    start: int  # query rows [start, end) of the batch
    end: int
    block_ids: torch.Tensor  # [n] int64: the blocks holding the first seq_len tokens
    seq_len: int
    block_size: int
    views: dict[int | None, tuple[torch.Tensor, int, torch.Tensor]] = field(default_factory=dict)  # `view`

    def view(self, window: int | None) -> tuple[torch.Tensor, int, torch.Tensor]:
        """What the chunk attends with sliding window `window` (None: all keys), built once per
        step: (the blocks holding those keys, the position of their first key k0, the mask
        [Q, seq_len - k0] bool: key visible to query)."""
        if window not in self.views:
            q0 = self.seq_len - (self.end - self.start)  # the first query's position
            first = 0 if window is None else max(0, q0 - window + 1) // self.block_size  # its first visible key's block
            q_pos = torch.arange(q0, self.seq_len).unsqueeze(1)  # (Q, 1)
            k_pos = torch.arange(first * self.block_size, self.seq_len).unsqueeze(0)  # (1, S')
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            self.views[window] = (self.block_ids[first:], first * self.block_size, mask)
        return self.views[window]


@dataclass
class TorchAttentionPlan:
    """What `CpuAttentionBackend.prepare` computes once per step (`metadata.backend_data`)."""

    keep: torch.Tensor | None  # [T'] int64 rows with a valid slot, or None when all are valid
    slots: torch.Tensor | None  # [T'] int64 slots to write (None: not computed yet, `NativeAttentionBackend`)
    num_decodes: int
    prefills: list[_Prefill]
    # sliding window (None: none) -> the torch decode path's (block tables [B, n] int64, padded
    # with 0; key mask [B, 1, 1, n * block_size] bool), built on first use (`_decode_view`)
    decode_views: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    native_tables: torch.Tensor | None = None  # [B, n] int32, contiguous: the native decode kernel's
    native_lens: torch.Tensor | None = None  # [B] int32, contiguous
    native_slots: torch.Tensor | None = None  # [T] int64, contiguous: every row's slot (-1 skips)
    native_step: kernels.DecodeStep | None = None  # when every row is a decode
    # (block tables [1, n] int32, seq_lens [1] int32, slots [M] int64) of a one-sequence step of
    # 2..MAX_FUSED_ROWS rows (a speculative verification, a short prefill chunk): the plan
    # `set_decode_step` installs for the fused multi-row step (`fused_decode`, `step_rows`)
    native_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # the prefills that are a request's first chunk (no earlier keys), as runs of consecutive
    # chunks of one length: (first row, chunks, length, their indices in `prefills`); `causal_runs`
    fresh_runs: list[tuple[int, int, int, range]] | None = None
    # `NativeAttentionBackend`'s plan of a step before its kernels were built (in the background): the torch path
    torch_only: bool = False

    def causal_runs(self) -> list[tuple[int, int, int, range]]:
        if self.fresh_runs is None:
            self.fresh_runs = runs = []
            for i, p in enumerate(self.prefills):
                length = p.end - p.start
                if p.seq_len != length:
                    continue
                last = runs[-1] if runs else None
                if last and last[2] == length and last[0] + last[1] * length == p.start and last[3].stop == i:
                    runs[-1] = (last[0], last[1] + 1, length, range(last[3].start, i + 1))
                else:
                    runs.append((p.start, 1, length, range(i, i + 1)))
        return self.fresh_runs


def valid_slots(slot_mapping: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(rows to keep or None when every slot is >= 0, the slots of those rows)."""
    keep = slot_mapping >= 0
    if bool(keep.all()):
        return None, slot_mapping
    rows = keep.nonzero().squeeze(1)
    return rows, slot_mapping[rows]


class CpuAttentionBackend(CpuLatentAttention, AttentionBackend):
    name = "torch-sdpa"
    graph_support = GraphCaptureSupport.NEVER
    features = frozenset({"sliding_window", "logit_softcap", "sinks"})
    encoder_features = frozenset({"sliding_window"})
    kv_cache_dtypes = KV_CACHE_DTYPES

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype: torch.dtype | None = None
    ) -> tuple[int, ...]:
        row = kv_row_bytes(head_size, cache_dtype) if cache_dtype is not None and is_quantized_kv(cache_dtype) else head_size
        return (2, num_blocks, block_size, num_kv_heads, row)

    def prepare(self, metadata: AttentionMetadata) -> AttentionMetadata:
        md = metadata
        keep, slots = valid_slots(md.slot_mapping)
        nd = md.num_decode_tokens
        md.backend_data = plan = TorchAttentionPlan(keep, slots, nd, plan_prefills(md))
        if nd:
            _decode_view(plan, md, None)
        return md

    def write_kv(self, kv_cache, key, value, slot_mapping) -> None:
        keep, slots = valid_slots(slot_mapping)
        self._write(kv_cache, key, value, keep, slots)

    @staticmethod
    def _write(kv_cache, key, value, keep, slots) -> None:
        _, nb, bs, kvh, row = kv_cache.shape
        if keep is not None:
            key, value = key[keep], value[keep]
        if is_quantized_kv(kv_cache.dtype):  # float8 has no index_copy_: copy the bytes
            flat = kv_cache.view(torch.uint8).view(2, nb * bs, kvh, row)
            key, value = quantize_kv(key, kv_cache.dtype).view(torch.uint8), quantize_kv(value, kv_cache.dtype).view(torch.uint8)
        else:
            flat = kv_cache.view(2, nb * bs, kvh, row)
            key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
        flat[0].index_copy_(0, slots, key)
        flat[1].index_copy_(0, slots, value)

    def read_kv(self, kv_cache, slots):
        _, nb, bs, kvh, row = kv_cache.shape
        flat = _bytes(kv_cache).view(2, nb * bs, kvh, row)
        k, v = flat[0, slots.long()], flat[1, slots.long()]
        if is_quantized_kv(kv_cache.dtype):
            return dequantize_kv(k.view(kv_cache.dtype)), dequantize_kv(v.view(kv_cache.dtype))
        return k, v

    def forward(
        self, query, key, value, kv_cache, metadata: AttentionMetadata, scale: float,
        sliding_window: int | None = None, logit_softcap: float | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        plan = self.prepared(metadata, TorchAttentionPlan)
        self._write(kv_cache, key, value, plan.keep, plan.slots)
        return _attend_batch(query, key, value, kv_cache, metadata, plan, scale, sliding_window, logit_softcap,
                             sinks=sinks)

    # non-causal attention within each sequence (vision encoders, encoder-only models): one SDPA per
    # sequence length, a band mask for a local window (`encoder_attention.py`)
    encoder_attention = staticmethod(encoder_attention)  # type: ignore[assignment]


def _attend_batch(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata,
    plan: TorchAttentionPlan, scale: float, window: int | None, softcap: float | None, decodes: bool = True,
    native: bool = False, sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The torch path over a cache already written: the decodes in one call (unless not
    `decodes`: the caller attends them), each prefill chunk in one. query [T, H, D] -> [T, H, D].

    A request's first chunk (no earlier keys) attends over the step's own `key` / `value` when the
    cache holds them unchanged (same dtype, not 8-bit) and no feature needs a mask (no soft-cap nor
    sinks, a window no shorter than the chunk): causal SDPA without a mask or a gather, one call for each
    run of consecutive chunks of one length (`TorchAttentionPlan.causal_runs`); with `native` (the
    native kernels' backend), bf16 ones on AMX tiles where the CPU has them (`native_causal`)."""
    out = torch.empty(query.shape, dtype=query.dtype)  # contiguous whatever query's strides
    nd = plan.num_decodes
    if nd and decodes:
        tables, mask = _decode_view(plan, md, window)
        out[:nd] = _decode(query[:nd], kv_cache, tables, mask, scale, softcap, sinks)
    done: set[int] = set()
    if plan.prefills and softcap is None and query.dtype == key.dtype == value.dtype == kv_cache.dtype:
        for start, n, length, members in plan.causal_runs():
            if window is None or window >= length:
                end = start + n * length
                out[start:end] = _attend_causal(query[start:end], key[start:end], value[start:end], n, scale, native,
                                                sinks)  # fmt: skip
                done.update(members)
    for i, p in enumerate(plan.prefills):
        if i not in done:
            out[p.start : p.end] = _prefill(query[p.start : p.end], kv_cache, p, scale, window, softcap, sinks)
    return out


def _attend_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, scale: float,
                   native: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`n` sequences of one length, each attending causally to itself only: q (n * L, H, D), k, v
    (n * L, KVH, D) -> (n * L, H, D), in one SDPA call over (n, heads, L, D) views, or with
    `native` and bf16 in the AMX kernel (`native_causal`)."""
    if native and q.dtype == torch.bfloat16 and sinks is None and native_causal(q.shape[-1]):
        return torch.ops.portside_cpu_native.causal_attention(_dense_rows(q), _dense_rows(k), _dense_rows(v), n, scale)
    def seqs(t: torch.Tensor) -> torch.Tensor:
        return t.view(n, -1, *t.shape[1:]).transpose(1, 2)

    if sinks is not None:
        return _sdpa_sinks(seqs(q), seqs(k), seqs(v), None, scale, sinks).transpose(1, 2).reshape(q.shape)
    o = F.scaled_dot_product_attention(seqs(q), seqs(k), seqs(v), is_causal=True, scale=scale,
                                       enable_gqa=q.shape[1] > k.shape[1])
    return o.transpose(1, 2).reshape(q.shape)


def _sdpa_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                sinks: torch.Tensor) -> torch.Tensor:
    """q (B, H, L, D) over k, v (B, KVH, S, D) with sinks [H], in k's dtype: the CPU flash kernel's output
    times sigmoid(lse - sink), its rows' log-sum-exp (the sink's share). `mask` (L, S) bool; None: causal."""
    group = q.shape[1] // k.shape[1]
    k, v = (k, v) if group == 1 else (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
    bias = None if mask is None else torch.zeros(mask.shape, dtype=k.dtype).masked_fill_(~mask, float("-inf"))
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.to(k.dtype), k, v, 0.0, mask is None, attn_mask=bias, scale=scale)[:2]  # fmt: skip
    return (o.float() * torch.sigmoid(lse - sinks.float().view(-1, 1))[..., None]).to(k.dtype)


@functools.cache
def native_causal(head_size: int) -> bool:
    """Whether `portside_cpu_native::causal_attention` (csrc/causal_attention.cpp) runs bf16 prompts
    of this head size here: built with AMX-BF16, the tile state granted, a multiple of 32 up to 256.
    (On AMX it takes 16 x 128-token prompts, 9 / 3 heads of 64, in ~0.8 ms against ~1.2-1.4 for
    torch's flash kernel, 2 threads.) Only asked by the native backend, whose library is loaded."""
    return bool(torch.ops.portside_cpu_native.causal_attention_supported(head_size))


def _decode_view(plan: TorchAttentionPlan, md: AttentionMetadata, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The decodes' block tables (B, n) int64 and key mask (B, 1, 1, n * bs) under sliding window
    `window` (None: every key), once per step: a windowed row starts at the block of its first
    visible key, so only about `window` keys are gathered."""
    if window in plan.decode_views:
        return plan.decode_views[window]
    nd, bs = md.num_decode_tokens, md.block_size
    if window is None:
        n = -(-max(md.seq_lens_cpu[:nd]) // bs)
        tables = md.block_tables[:nd, :n].long()
        mask = torch.arange(n * bs).unsqueeze(0) < md.seq_lens[:nd].unsqueeze(1)  # (B, S)
    else:
        lens = md.seq_lens[:nd].long().unsqueeze(1)  # (B, 1)
        first = (lens - window).clamp(min=0) // bs  # (B, 1): each row's first block
        num_blocks = (lens + bs - 1) // bs
        n = int((num_blocks - first).max())
        cols = first + torch.arange(n)  # (B, n): table columns, past a row's end masked below
        tables = md.block_tables[:nd].long().gather(1, torch.minimum(cols, num_blocks - 1))
        k_pos = first * bs + torch.arange(n * bs)  # (B, n * bs)
        mask = (k_pos < lens) & (k_pos >= lens - window)
    plan.decode_views[window] = tables, mask[:, None, None, :]
    return plan.decode_views[window]


class NativeAttentionBackend(CpuAttentionBackend):
    """`CpuAttentionBackend` with decodes and K/V writes in the native C kernels (fp32, 8-bit or
    bf16 caches; fp32 queries, or bf16 over a bf16 cache), which take the attention features too.

    The platform picks this backend when the kernels load, or while they are built in the
    background (`native_ops.ready`): until then each step runs the torch path (a plan with
    `torch_only`, the cache layout being the same), and from the first step that finds them
    built, the kernels."""

    name = "native-paged"
    latent_native = True  # MLA decodes in csrc/mla.cpp (`CpuLatentAttention`)
    _ready = False  # the kernels are loaded (asked again at each step until they are)

    def _kernels_ready(self) -> bool:
        if not self._ready:
            self._ready = native_ops.ready() and kernels.native_unavailable_reason() is None
        return self._ready

    def prepare(self, metadata: AttentionMetadata) -> AttentionMetadata:
        md = metadata
        if not self._kernels_ready():
            md = super().prepare(md)
            md.backend_data.torch_only = True
            return md
        nd = md.num_decode_tokens
        decode_only = nd == md.slot_mapping.shape[0]
        # The torch path's slot filter is only needed when a step falls back to it (`forward`):
        # in a decode-only step the native kernels skip slot -1 themselves.
        keep, slots = (None, None) if decode_only else valid_slots(md.slot_mapping)
        plan = TorchAttentionPlan(keep, slots, nd, [] if decode_only else plan_prefills(md))
        plan.native_slots = md.slot_mapping.long().contiguous()
        if nd:
            n = -(-max(md.seq_lens_cpu[:nd]) // md.block_size)
            plan.native_tables = md.block_tables[:nd, :n].to(torch.int32).contiguous()
            plan.native_lens = md.seq_lens[:nd].to(torch.int32).contiguous()
            if decode_only:
                plan.native_step = kernels.DecodeStep(plan.native_tables, plan.native_lens, plan.native_slots)
        elif md.num_reqs == 1 and 2 <= md.num_tokens <= MAX_FUSED_ROWS and bool((plan.native_slots >= 0).all()):
            n = -(-md.seq_lens_cpu[0] // md.block_size)
            plan.native_rows = (md.block_tables[:1, :n].to(torch.int32).contiguous(),
                                md.seq_lens[:1].to(torch.int32).contiguous(), plan.native_slots)
        md.backend_data = plan
        return md

    def write_kv(self, kv_cache, key, value, slot_mapping) -> None:
        if self._kernels_ready() and _native(kv_cache, key, value):
            kernels.write_kv(kv_cache, _dense_rows(key), _dense_rows(value), slot_mapping.long().contiguous())
        else:
            super().write_kv(kv_cache, key, value, slot_mapping)

    def forward(
        self, query, key, value, kv_cache, metadata: AttentionMetadata, scale: float,
        sliding_window: int | None = None, logit_softcap: float | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        plan = metadata.backend_data
        if not isinstance(plan, TorchAttentionPlan) or (plan.native_slots is None and not plan.torch_only):
            plan = self.prepare(metadata).backend_data
        if plan.torch_only:
            return super().forward(query, key, value, kv_cache, metadata, scale, sliding_window, logit_softcap, sinks)
        native = _native(kv_cache, query, key, value)
        if native and plan.native_step is not None:
            return plan.native_step(_dense_rows(query), _dense_rows(key), _dense_rows(value), kv_cache, scale,
                                    sliding_window, logit_softcap, sinks)
        if native:
            kernels.write_kv(kv_cache, _dense_rows(key), _dense_rows(value), plan.native_slots)
        else:
            if plan.slots is None:
                plan.keep, plan.slots = valid_slots(plan.native_slots)
            self._write(kv_cache, key, value, plan.keep, plan.slots)
        out = _attend_batch(query, key, value, kv_cache, metadata, plan, scale, sliding_window, logit_softcap,
                            decodes=not native, native=native, sinks=sinks)
        nd = plan.num_decodes
        if nd and native:
            kernels.paged_decode(out[:nd], _dense_rows(query[:nd]), kv_cache, plan.native_tables, plan.native_lens,
                                 scale, sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks)
        return out


def plan_prefills(md: AttentionMetadata, first: int | None = None) -> list[_Prefill]:
    """Each prefill chunk's blocks (requests from `first` on; default: those after the decodes)."""
    prefills = []
    qsl, lens, bs = md.query_start_loc_cpu, md.seq_lens_cpu, md.block_size
    for i in range(md.num_decode_tokens if first is None else first, len(lens)):
        start, end, seq_len = qsl[i], qsl[i + 1], lens[i]
        if end == start:
            continue
        n = -(-seq_len // bs)
        prefills.append(_Prefill(start, end, md.block_tables[i, :n].long(), seq_len, bs))
    return prefills


def _native(kv_cache: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Whether the native kernels take these: a cache they read (fp32, 8-bit or bf16) and fp32
    queries / K / V, or bf16 ones over a bf16 cache (a bf16 model's)."""
    if kv_cache.dtype not in kernels.FORMATS:
        return False
    dtype = tensors[0].dtype
    ok = dtype == torch.float32 or (dtype == torch.bfloat16 and kv_cache.dtype == torch.bfloat16)
    return ok and all(t.dtype == dtype for t in tensors)


def _bytes(kv_cache: torch.Tensor) -> torch.Tensor:
    """An 8-bit cache as uint8 (float8 has no CPU indexing kernels), else the cache itself."""
    return kv_cache.view(torch.uint8) if is_quantized_kv(kv_cache.dtype) else kv_cache


def _dense_rows(t: torch.Tensor) -> torch.Tensor:
    """t [N, heads, D] with each row's heads dense (what the kernels index), copying only if not."""
    if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]:
        return t
    return t.contiguous()


def _gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """K and V of `block_ids` ([N] int64) as (2, N * block_size, kvh, D) values: one copy, then
    for an 8-bit cache one dequantizing pass (fp32).

    `index_select` on the flattened blocks: advanced indexing (`kv_cache[:, ids]`) on this
    non-leading axis is ~500x slower on CPU for small batches."""
    _, nb, bs, kvh, row = kv_cache.shape
    kv = _bytes(kv_cache).view(2, nb, -1).index_select(1, block_ids).view(2, -1, kvh, row)
    if is_quantized_kv(kv_cache.dtype):
        return dequantize_kv(kv.view(kv_cache.dtype))
    return kv


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA of q (..., L, D) over k, v (..., S, D) with a boolean mask (True: visible), in k's
    dtype; with `softcap` the scores are soft-capped (cap * tanh(scores / cap)) before the mask,
    and with `sinks` (fp32, broadcast to (..., L, 1): each query row's head's sink) one more logit
    joins each row's softmax and its probability is dropped; SDPA can do neither, so the scores
    are then computed explicitly, in fp32."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q.to(k.dtype), k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # (..., L, S)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        probs = torch.softmax(torch.cat([scores, sinks.float().expand(*scores.shape[:-1], 1)], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v.float()).to(k.dtype)


def _prefill(q: torch.Tensor, kv_cache: torch.Tensor, p: _Prefill, scale: float, window: int | None = None,
             softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One request's query chunk (the last Q of its seq_len tokens), causal. q: (Q, H, D)."""
    blocks, k0, mask = p.view(window)
    kv = _gather_kv(kv_cache, blocks)[:, : p.seq_len - k0]  # (2, S', kvh, D)
    return _attend_chunk(q, kv[0], kv[1], mask, scale, softcap, sinks)


def _attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                  softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One request's queries q (Q, H, D) over its keys k, v (S, KVH, D); mask (Q, S) bool.

    Without a soft-cap this is one 4-D SDPA call over head-major views with `enable_gqa`, which
    torch runs in its flash kernel (bf16 and fp32); a 3-D call with the query groups folded into
    the query axis took the math path instead (11x slower in bf16 at 128 tokens, 2x in fp32)."""
    num_q, num_heads, d = q.shape
    kvh = k.shape[1]
    group = num_heads // kvh
    if softcap is None and sinks is not None:
        o = _sdpa_sinks(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, scale, sinks)
        return o[0].transpose(0, 1).to(q.dtype)
    if softcap is None:
        o = F.scaled_dot_product_attention(q.to(k.dtype).transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                           enable_gqa=group > 1)  # (1, H, Q, D)
        return o[0].transpose(0, 1).to(q.dtype)
    qg = q.view(num_q, kvh, group, d).permute(1, 2, 0, 3).reshape(kvh, group * num_q, d)  # (kvh, G*Q, D)
    mask = mask if group == 1 else mask.repeat(group, 1)  # row g*Q + j is query token j
    row_sinks = None if sinks is None else sinks.view(kvh, group).repeat_interleave(num_q, dim=1)[..., None]
    o = _attend(qg, k.transpose(0, 1), v.transpose(0, 1), mask, scale, softcap, row_sinks)  # (kvh, G*Q, D)
    return o.view(kvh, group, num_q, d).permute(2, 0, 1, 3).reshape(num_q, num_heads, d).to(q.dtype)


def attend_read_kv(
    backend: AttentionBackend, query: torch.Tensor, kv_cache: torch.Tensor, chunks: list[_Prefill], scale: float,
    window: int | None, softcap: float | None,
) -> torch.Tensor:  # fmt: skip
    """The requests `chunks` (`plan_prefills(md, 0)`: every request) attended over the keys each
    sees, read back with `backend.read_kv` (any cache layout, already written), one request at a
    time: the feature layers of a backend whose own kernels do not take the features."""
    out = torch.empty(query.shape, dtype=query.dtype)
    for p in chunks:
        _, k0, mask = p.view(window)
        pos = torch.arange(k0, p.seq_len)
        k, v = backend.read_kv(kv_cache, p.block_ids[pos // p.block_size] * p.block_size + pos % p.block_size)
        out[p.start : p.end] = _attend_chunk(query[p.start : p.end], k, v, mask, scale, softcap)
    return out


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A batch of single-token queries. q: (B, H, D); tables (B, n); mask (B, 1, 1, n*bs)."""
    batch, num_heads, d = q.shape
    kvh = kv_cache.shape[3]
    kv = _gather_kv(kv_cache, tables.reshape(-1))  # (2, B*n*bs, kvh, D)
    kv = kv.view(2, batch, -1, kvh, d).transpose(2, 3)  # (2, B, kvh, S, D)
    group = num_heads // kvh
    qg = q.view(batch, kvh, group, d)  # (B, kvh, G, D): the group is the query axis
    o = _attend(qg, kv[0], kv[1], mask, scale, softcap, None if sinks is None else sinks.view(kvh, group, 1))
    return o.reshape(batch, num_heads, d).to(q.dtype)
