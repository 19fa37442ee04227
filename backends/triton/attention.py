"""`TritonAttentionBackend`: the portable Triton kernels behind the `AttentionBackend` contract.

Used by the cuda and rocm platforms (and open to any plugin whose device Triton targets). On CPU
tensors it runs under the Triton interpreter (``TRITON_INTERPRET=1``), which is how it is tested
without a GPU.
"""

from __future__ import annotations

import torch

from portside.backends.triton import kv_cache as _kv
from portside.backends.triton.encoder_attention import choose_encoder_launch, encoder_attention
from portside.backends.triton.launch import ArchInfo, choose_attention_launch, choose_num_splits, detect_arch
from portside.backends.triton.mla import TritonLatentAttention
from portside.backends.triton.paged_attention import paged_attention
from portside.contract import (
    AttentionBackend,
    AttentionMetadata,
    GraphCaptureSupport,
    dequantize_kv,
    is_quantized_kv,
)

__all__ = ["TritonAttentionBackend"]

SUPPORTED_HEAD_SIZES = (64, 80, 96, 128, 256)
SUPPORTED_BLOCK_SIZES = (16, 32, 64)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class TritonAttentionBackend(TritonLatentAttention, AttentionBackend):
    """Paged attention in one Triton launch per layer (plus a reduce kernel on the split-KV path).

    Cache layout: the canonical ``[2, num_blocks, block_size, num_kv_heads, head_size]``.

    Graph support is DECODE_ONLY. The kernels read every per-request value (query offsets,
    sequence lengths, block tables, slots) from device tensors and size their grids from tensor
    shapes alone, so a captured decode batch replays correctly at any context length. The only
    host-side choice, the number of KV splits, is made from ``metadata.max_seq_len``; a graph
    runner captures with ``max_seq_len`` set to the model's maximum length, an upper bound valid
    for every replay. Mixed prefill/decode batches change ``num_tokens`` and the row tiling each
    step, so they run eagerly.

    Features: ``sliding_window`` and ``logit_softcap`` are kernel arguments (constexpr flags), so
    a layer's values are baked into a captured graph like its scale; ``sinks`` (a layer's
    per-head logits, a device tensor) join each row's softmax denominator in the kernel.

    Encoder attention (non-causal, no cache: vision towers) is one launch of the varlen flash
    kernel of `encoder_attention.py` (any head size; fp32, fp16, bf16).

    KV-cache dtypes: the model's, or fp8 (e4m3fn, e5m2) in the same layout, cast on write and
    decoded in the attention kernel (`paged_attention._kv_values`). No int8: its per-row scales
    are a cpu format here.

    Latent attention (MLA models): `TritonLatentAttention` (`mla.py`), over the reference's
    ``[num_blocks, block_size, head_size]`` latent cache.
    """

    name = "triton"
    graph_support = GraphCaptureSupport.DECODE_ONLY
    features = frozenset({"sliding_window", "logit_softcap", "sinks"})
    encoder_features = frozenset({"sliding_window"})
    kv_cache_dtypes = frozenset({"auto", "fp8_e4m3", "fp8_e5m2"})

    def __init__(self, arch: ArchInfo | None = None, num_splits: int | None = None) -> None:
        """`arch`: override device detection (tests, heuristics studies). `num_splits`: force the
        split-KV partition count (None: chosen per batch by `choose_num_splits`)."""
        self._arch = arch
        self._num_splits = num_splits

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype: torch.dtype | None = None
    ) -> tuple[int, ...]:
        if cache_dtype is not None and cache_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) and is_quantized_kv(cache_dtype):
            raise ValueError(f"the Triton kernels store no {cache_dtype} KV cache (fp8_e4m3, fp8_e5m2 or the model's dtype)")
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def supports(self, head_size: int, dtype: torch.dtype, block_size: int) -> str | None:
        if head_size not in SUPPORTED_HEAD_SIZES:
            return f"head size {head_size} is not supported by the Triton kernels (supported: {list(SUPPORTED_HEAD_SIZES)})"
        if block_size not in SUPPORTED_BLOCK_SIZES:
            return f"block size {block_size} is not supported by the Triton kernels (supported: {list(SUPPORTED_BLOCK_SIZES)})"
        if dtype not in SUPPORTED_DTYPES:
            return f"dtype {dtype} is not supported by the Triton kernels (use float16, bfloat16 or float32)"
        return None

    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        _kv.write_kv(kv_cache, key, value, slot_mapping)

    def read_kv(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
        if is_quantized_kv(kv_cache.dtype):  # fp8: index the bytes, dequantize to fp32
            flat = kv_cache.view(torch.uint8).view(2, num_blocks * block_size, num_kv_heads, head_size)
            k, v = flat[0, slots.long()], flat[1, slots.long()]
            return dequantize_kv(k.view(kv_cache.dtype)), dequantize_kv(v.view(kv_cache.dtype))
        flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_size)
        return flat[0, slots.long()], flat[1, slots.long()]

    def arch(self, device: torch.device) -> ArchInfo:
        if self._arch is None:
            self._arch = detect_arch(device)
        return self._arch

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _kv.write_kv(kv_cache, key, value, metadata.slot_mapping)
        query = query.contiguous() if query.stride(-1) != 1 else query
        out = torch.empty_like(query)  # [num_tokens, num_heads, head_size]
        arch = self.arch(query.device)
        num_heads, head_size = query.shape[1], query.shape[2]
        num_kv_heads = kv_cache.shape[3]
        launch = choose_attention_launch(arch, head_size, num_heads // num_kv_heads, metadata.max_query_len, query.dtype)
        span = min(metadata.max_seq_len, sliding_window or metadata.max_seq_len)  # keys a decode reads at most
        splits = self._num_splits or choose_num_splits(
            arch, metadata.num_reqs, num_kv_heads, metadata.max_query_len, span, metadata.block_size
        )
        return paged_attention(
            query,
            kv_cache,
            out,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_tables,
            scale,
            launch,
            num_splits=splits,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
            sinks=sinks,
        )

    def encoder_attention(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,
        value: torch.Tensor,
        cu_seqlens: torch.Tensor,  # [num_seqs + 1] int32, on the device
        max_seqlen: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        launch = choose_encoder_launch(self.arch(query.device), query.shape[2], max_seqlen, query.dtype)
        return encoder_attention(query, key, value, cu_seqlens, max_seqlen, scale, launch, sliding_window)
