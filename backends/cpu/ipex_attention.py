"""Paged attention through intel-extension-for-pytorch's `PagedAttention` kernels.

Optional: used when `intel_extension_for_pytorch` imports (the ipex leg: torch 2.8, IPEX 2.8,
transformers < 5). IPEX is no longer developed upstream after 2.8, so the torch path
(`attention.py`) stays the default everywhere else.

Cache layout (one layer): ``[2, num_blocks, num_kv_heads, block_size, head_size]``: index 0 is
IPEX's key cache, 1 its value cache, each ``[num_blocks, num_kv_heads, block_size, head_size]``
(IPEX's real layout, whatever its docstrings say).

- writes: `reshape_and_cache`;
- decodes (the first `num_decode_tokens` requests): `single_query_cached_kv_attention`;
- prefill chunks (the rest): `flash_attn_varlen_func`, causal, over the paged prefix;
- layers with attention features (sliding window, logit soft-cap): the torch path's attention
  over the K/V `read_kv` reads back (`attention.attend_read_kv`), one request at a time (IPEX 2.8's
  CPU kernels are not tested with them here).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from portside.backends.cpu.attention import attend_read_kv, plan_prefills, valid_slots
from portside.backends.cpu.encoder_attention import encoder_attention
from portside.backends.cpu.mla import CpuLatentAttention
from portside.contract import AttentionBackend, AttentionMetadata, GraphCaptureSupport


@functools.lru_cache(maxsize=1)
def ipex_unavailable_reason() -> str | None:
    """None when IPEX's paged-attention kernels can be used here, else why not."""
    try:
        from intel_extension_for_pytorch.llm.modules import PagedAttention  # noqa: F401
    except Exception as e:  # ImportError, or IPEX's own version checks (torch / transformers)
        return f"intel_extension_for_pytorch is not usable: {type(e).__name__}: {e}"
    return None


def _kernels():
    from intel_extension_for_pytorch.llm.modules import PagedAttention

    return PagedAttention


@dataclass
class IpexAttentionPlan:
    """Built once per step by `IpexAttentionBackend.prepare`."""

    keep: torch.Tensor | None  # [T'] rows with a valid slot, or None when all are (IPEX does
    slots: torch.Tensor  # [T'] int32                      not skip slot -1: it writes out of bounds)
    num_decodes: int
    decode_tokens: int  # query rows of the decodes (== num_decodes)
    decode_lens: torch.Tensor | None  # [B] int32
    decode_tables: torch.Tensor | None  # [B, max_blocks] int32
    decode_max_len: int
    prefill_cu_q: torch.Tensor | None  # [P + 1] int32, rebased to the first prefill row
    prefill_cu_kv: torch.Tensor | None  # [P + 1] int32
    prefill_tables: torch.Tensor | None  # [P, max_blocks] int32
    prefill_max_q: int
    prefill_max_kv: int
    chunks: list = field(default_factory=list)  # every request (`plan_prefills`), for feature layers; lazily


class IpexAttentionBackend(CpuLatentAttention, AttentionBackend):  # MLA: the torch paths
    name = "ipex-paged"
    graph_support = GraphCaptureSupport.NEVER
    features = frozenset({"sliding_window", "logit_softcap"})

    def __init__(self) -> None:
        reason = ipex_unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        self._pa = _kernels()
        self._head_mapping: dict[tuple[int, int], torch.Tensor] = {}

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, num_kv_heads, block_size, head_size)

    def supports(self, head_size: int, dtype: torch.dtype, block_size: int) -> str | None:
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"IPEX paged attention has no {dtype} kernel"
        return None

    def encoder_attention(self, query, key, value, cu_seqlens, max_seqlen: int, scale: float) -> torch.Tensor:  # type: ignore[no-untyped-def]
        """Vision encoders: the cpu backend's (one SDPA per sequence length; no paged cache involved)."""
        return encoder_attention(query, key, value, cu_seqlens, max_seqlen, scale)

    def prepare(self, metadata: AttentionMetadata) -> AttentionMetadata:
        md = metadata
        nd = md.num_decode_tokens
        qsl, lens = md.query_start_loc_cpu, md.seq_lens_cpu
        keep, slots = valid_slots(md.slot_mapping)
        plan = IpexAttentionPlan(
            keep=keep,
            slots=slots.to(torch.int32),
            num_decodes=nd,
            decode_tokens=qsl[nd] if nd else 0,
            decode_lens=md.seq_lens[:nd].to(torch.int32) if nd else None,
            decode_tables=md.block_tables[:nd].to(torch.int32).contiguous() if nd else None,
            decode_max_len=max(lens[:nd]) if nd else 0,
            prefill_cu_q=None,
            prefill_cu_kv=None,
            prefill_tables=None,
            prefill_max_q=0,
            prefill_max_kv=0,
        )
        if len(lens) > nd:
            base = qsl[nd]
            q_lens = [qsl[i + 1] - qsl[i] for i in range(nd, len(lens))]
            cu_kv = [0]
            for s in lens[nd:]:
                cu_kv.append(cu_kv[-1] + s)
            plan.prefill_cu_q = torch.tensor([q - base for q in qsl[nd:]], dtype=torch.int32)
            plan.prefill_cu_kv = torch.tensor(cu_kv, dtype=torch.int32)
            plan.prefill_tables = md.block_tables[nd:].to(torch.int32).contiguous()
            plan.prefill_max_q = max(q_lens)
            plan.prefill_max_kv = max(lens[nd:])
        md.backend_data = plan
        return md

    def write_kv(self, kv_cache, key, value, slot_mapping) -> None:
        keep, slots = valid_slots(slot_mapping)
        self._write(kv_cache, key, value, keep, slots.to(torch.int32))

    def _write(self, kv_cache, key, value, keep, slots) -> None:
        if keep is not None:
            key, value = key[keep], value[keep]
        self._pa.reshape_and_cache(key.contiguous(), value.contiguous(), kv_cache[0], kv_cache[1], slots)

    def read_kv(self, kv_cache, slots):
        bs = kv_cache.shape[3]
        slots = slots.long()
        blocks, offsets = slots // bs, slots % bs
        return kv_cache[0, blocks, :, offsets], kv_cache[1, blocks, :, offsets]  # [n, kvh, D]

    def _mapping(self, num_heads: int, num_kv_heads: int) -> torch.Tensor:
        key = (num_heads, num_kv_heads)
        if key not in self._head_mapping:
            group = num_heads // num_kv_heads
            self._head_mapping[key] = torch.arange(num_kv_heads, dtype=torch.int32).repeat_interleave(group)
        return self._head_mapping[key]

    def forward(
        self, query, key, value, kv_cache, metadata: AttentionMetadata, scale: float,
        sliding_window: int | None = None, logit_softcap: float | None = None,
    ) -> torch.Tensor:  # fmt: skip
        plan = self.prepared(metadata, IpexAttentionPlan)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        self._write(kv_cache, key, value, plan.keep, plan.slots)
        if sliding_window is not None or logit_softcap is not None:
            if not plan.chunks:
                plan.chunks = plan_prefills(metadata, 0)
            return attend_read_kv(self, query, kv_cache, plan.chunks, scale, sliding_window, logit_softcap)
        query = query.contiguous()
        out = torch.empty_like(query)
        nt = plan.decode_tokens
        if plan.num_decodes:
            self._pa.single_query_cached_kv_attention(
                out[:nt], query[:nt], k_cache, v_cache,
                self._mapping(query.shape[1], k_cache.shape[1]), scale,
                plan.decode_tables, plan.decode_lens, k_cache.shape[2], plan.decode_max_len, None,
            )  # fmt: skip
        if plan.prefill_cu_q is not None:
            self._pa.flash_attn_varlen_func(
                out[nt:], query[nt:], k_cache, v_cache,
                plan.prefill_cu_q, plan.prefill_cu_kv, plan.prefill_max_q, plan.prefill_max_kv,
                scale, True, plan.prefill_tables, None,
            )  # fmt: skip
        return out
