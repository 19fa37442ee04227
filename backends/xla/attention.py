"""Paged attention that traces to static shapes under XLA.

Cache layout (one layer): ``[num_blocks, block_size, 2 * num_kv_heads, head_size]`` with K and V
interleaved on the head axis (head ``2h`` is K of KV head h, ``2h + 1`` its V): the layout
torch-xla's Pallas ragged paged-attention kernel reads. The write is a single unconditional
scatter (`index_copy_`) with no data-dependent control flow: a skipped write (slot -1, i.e.
padding) is given the index one past the last slot, and XLA's scatter drops updates whose index
is out of bounds (torch-xla lowers `index_copy_` to an HLO scatter on the raw indices; vLLM's TPU
runner pads slots the same way). The conformance kit's KV round trip checks that nothing lands.

Two attention paths:

- ``pallas``: `torch_xla.experimental.custom_kernel.ragged_paged_attention`, on TPUs.
- ``gather`` (everywhere, and the one the CPU leg proves): each token gathers its request's block
  table into a padded ``[S = width * block_size]`` key/value layout and attends under a mask
  ``key_pos <= token_pos``. Memory is O(tokens x S): fine for decode and tests, the Pallas kernel
  is the production path for long prefills.

Both paths take the per-layer features (`ATTENTION_FEATURES`): a sliding window narrows the mask
to ``token_pos - window < key_pos`` and a logit softcap is a ``tanh`` on the scores; the window
and the cap are Python constants of the layer, so each layer traces to one fixed graph. Attention
sinks (gpt-oss: a device tensor of per-head logits) join the gather path's softmax as one more
column; a layer with sinks takes the gather path on TPUs too (the Pallas kernel has none).

Nothing reads a device tensor on the host (`.item()`, `.tolist()`, Python `if` on values): the
per-token request index and position are computed on the device in `prepare`.

Encoder attention (`AttentionBackend.encoder_attention`: non-causal within each packed
sequence, no cache; vision towers) is one dense attention over all T packed tokens under a
block-diagonal mask built on the device from cu_seqlens (`encoder_attention_masked`): the graph
depends only on T, H, D and the number of sequences, never on their lengths, so one compiled
program serves every image layout of a size (a loop over sequences would compile one per
layout). It costs O(H * T^2) scores where the sequences need O(H * sum of len^2), which is
what static shapes buy; vision towers have T in the hundreds to a few thousand.

fp8 caches (`--kv-cache-dtype fp8_e4m3 / fp8_e5m2`): the same layout in float8; K/V are cast on
write (saturating, `portside.contract.quantize_kv`) and the gather path upcasts what it
gathers to fp32 (a plain dequantize-on-read); the platform does not pick Pallas for them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass

import torch

from portside.contract import AttentionBackend, AttentionMetadata, GraphCaptureSupport, is_quantized_kv, quantize_kv

__all__ = ["XlaAttentionBackend", "XlaAttentionData", "encoder_attention_masked", "pallas_available"]


def pallas_available() -> bool:
    """torch-xla ships the Pallas ragged paged-attention kernel (and jax, which it needs)."""
    try:
        if importlib.util.find_spec("jax") is None:
            return False
        from torch_xla.experimental import custom_kernel
    except Exception:  # noqa: BLE001 - any import failure means: use the gather path
        return False
    return hasattr(custom_kernel, "ragged_paged_attention")


@dataclass
class XlaAttentionData:
    """Per-step tensors shared by every layer (built once in `prepare`, traced into the graph)."""

    token_req: torch.Tensor  # [T] int64: request of each query token (padding: clamped, masked)
    token_pos: torch.Tensor  # [T] int64: absolute position of each query token
    key_mask: torch.Tensor  # [T, S] bool: key position s is visible to token t
    num_seqs: torch.Tensor  # [1] int32: requests with at least one query token (Pallas)


class XlaAttentionBackend(AttentionBackend):
    name = "xla-gather"
    graph_support = GraphCaptureSupport.ALWAYS
    features = frozenset({"sliding_window", "logit_softcap", "sinks"})
    encoder_features = frozenset({"sliding_window"})
    kv_cache_dtypes = frozenset({"auto", "fp8_e4m3", "fp8_e5m2"})

    def __init__(self, use_pallas: bool = False) -> None:
        self.use_pallas = use_pallas
        if use_pallas:
            self.name = "pallas-ragged-paged"

    # ---- cache ------------------------------------------------------------------------------

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype: torch.dtype | None = None
    ) -> tuple[int, ...]:
        if cache_dtype == torch.int8:
            raise ValueError("the xla backend stores no int8 KV cache (fp8_e4m3, fp8_e5m2 or the model's dtype)")
        return (num_blocks, block_size, 2 * num_kv_heads, head_size)

    def write_kv(self, kv_cache, key, value, slot_mapping) -> None:
        nb, bs, kvh2, d = kv_cache.shape
        flat = kv_cache.view(nb * bs, kvh2, d)
        dropped = nb * bs  # one past the last slot: XLA's scatter drops out-of-bounds updates
        slots = torch.where(slot_mapping < 0, dropped, slot_mapping)  # [T]
        kv = torch.stack([key, value], dim=2).reshape(key.shape[0], kvh2, d)  # [T, 2*kvh, D] interleaved
        kv = quantize_kv(kv, kv_cache.dtype) if is_quantized_kv(kv_cache.dtype) else kv.to(kv_cache.dtype)
        flat.index_copy_(0, slots, kv)

    def write_latent(self, cache, latent, slot_mapping) -> None:
        """Latent attention (MLA) keeps core's layout and reference (`portside.ops.mla`), whose
        masked write would read the mask back to the host: one unconditional scatter instead, a
        skipped row (slot -1) sent one past the last slot, which XLA's scatter drops (as `write_kv`)."""
        flat = cache.view(-1, cache.shape[-1])
        slots = torch.where(slot_mapping < 0, flat.shape[0], slot_mapping)
        flat.index_copy_(0, slots, latent.to(cache.dtype))

    def read_kv(self, kv_cache, slots):
        nb, bs, kvh2, d = kv_cache.shape
        kv = kv_cache.view(nb * bs, kvh2, d)[slots.long()]  # [N, 2*kvh, D]
        if is_quantized_kv(kv_cache.dtype):
            kv = kv.float()
        return kv[:, 0::2], kv[:, 1::2]

    # ---- metadata ---------------------------------------------------------------------------

    def prepare(self, metadata: AttentionMetadata) -> AttentionMetadata:
        """Nothing: the model runner calls this on the unpadded batch, and lazy tensors built
        here would be traced into the padded step's graph (changing its hash every step). The
        graph runner calls `with_data` on the padded metadata instead."""
        return metadata

    def with_data(self, metadata: AttentionMetadata) -> AttentionMetadata:
        """`metadata` with this backend's per-step tensors (`XlaAttentionData`) attached."""
        md = metadata
        device = md.slot_mapping.device
        num_tokens = md.slot_mapping.shape[0]
        num_reqs = md.seq_lens.shape[0]
        qsl = md.query_start_loc.to(torch.int64)  # [R + 1]
        t = torch.arange(num_tokens, device=device, dtype=torch.int64)  # [T]
        # request of token t: number of requests whose query ends at or before t
        token_req = (qsl[1:].unsqueeze(0) <= t.unsqueeze(1)).sum(dim=1).clamp(max=num_reqs - 1)  # [T]
        # absolute position of token t: seq_len - (query end - t)
        seq_lens = md.seq_lens.to(torch.int64)
        token_pos = seq_lens[token_req] - qsl[1:][token_req] + t  # [T]
        s_max = md.block_tables.shape[1] * md.block_size
        k_pos = torch.arange(s_max, device=device, dtype=torch.int64)  # [S]
        key_mask = (k_pos.unsqueeze(0) <= token_pos.unsqueeze(1)) | (k_pos.unsqueeze(0) == 0)  # [T, S]
        num_seqs = (qsl[1:] > qsl[:-1]).sum().to(torch.int32).reshape(1)
        data = XlaAttentionData(token_req=token_req, token_pos=token_pos, key_mask=key_mask, num_seqs=num_seqs)
        return dataclasses.replace(md, backend_data=data)

    # ---- attention --------------------------------------------------------------------------

    def forward(
        self, query, key, value, kv_cache, metadata: AttentionMetadata, scale: float,
        sliding_window: int | None = None, logit_softcap: float | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        data = metadata.backend_data
        if not isinstance(data, XlaAttentionData):
            metadata = self.with_data(metadata)
            data = metadata.backend_data
        self.write_kv(kv_cache, key, value, metadata.slot_mapping)
        if self.use_pallas and not is_quantized_kv(kv_cache.dtype) and sinks is None:
            return self._pallas(query, kv_cache, metadata, data, scale, sliding_window, logit_softcap)
        return _gather_attention(query, kv_cache, metadata.block_tables, data, scale, sliding_window, logit_softcap,
                                 sinks)  # fmt: skip

    def encoder_attention(self, query, key, value, cu_seqlens, max_seqlen: int, scale: float,
                          sliding_window: int | None = None) -> torch.Tensor:
        """One masked attention over the packed tokens (`encoder_attention_masked`); nothing is
        read back to the host, and `max_seqlen` is not needed."""
        return encoder_attention_masked(query, key, value, cu_seqlens, scale, sliding_window)

    def _pallas(
        self, query, kv_cache, md: AttentionMetadata, data: XlaAttentionData, scale: float,
        sliding_window: int | None, logit_softcap: float | None,
    ) -> torch.Tensor:
        from torch_xla.experimental.custom_kernel import ragged_paged_attention

        # Pallas: q [T, H, D]; kv_pages [pages, page_size, 2*kvh, D]; per-request kv lengths,
        # page indices and cumulative query lengths; num_seqs real requests.
        return ragged_paged_attention(
            query,
            kv_cache,
            md.seq_lens.to(torch.int32),
            md.block_tables.to(torch.int32),
            md.query_start_loc.to(torch.int32),
            data.num_seqs,
            sm_scale=scale,
            sliding_window=sliding_window,
            soft_cap=logit_softcap,
        )


def _gather_attention(
    query: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [NB, bs, 2*kvh, D]
    block_tables: torch.Tensor,  # [R, W]
    data: XlaAttentionData,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [H] fp32
) -> torch.Tensor:
    num_tokens, num_heads, d = query.shape
    _, bs, kvh2, _ = kv_cache.shape
    kvh = kvh2 // 2
    group = num_heads // kvh
    width = block_tables.shape[1]
    blocks = block_tables.to(torch.int64)[data.token_req]  # [T, W]
    kv = kv_cache[blocks].reshape(num_tokens, width * bs, kvh2, d)  # [T, S, 2*kvh, D]
    k = kv[:, :, 0::2].float()  # [T, S, kvh, D]
    v = kv[:, :, 1::2].float()
    q = query.float().reshape(num_tokens, kvh, group, d)  # [T, kvh, G, D]
    scores = torch.einsum("tkgd,tskd->tkgs", q, k) * scale  # [T, kvh, G, S]
    if logit_softcap is not None:
        scores = logit_softcap * torch.tanh(scores / logit_softcap)
    mask = data.key_mask
    if sliding_window is not None:
        k_pos = torch.arange(width * bs, device=query.device, dtype=torch.int64)  # [S]
        mask = mask & (k_pos.unsqueeze(0) > (data.token_pos - sliding_window).unsqueeze(1))
        # a padding token past its block table may now see no key: give it key 0 (no NaN rows)
        mask = mask | (~mask.any(dim=1, keepdim=True) & (k_pos.unsqueeze(0) == 0))
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # one more logit per head in the denominator, its probability dropped
        sink = sinks.float().view(1, kvh, group, 1).expand(num_tokens, kvh, group, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = torch.einsum("tkgs,tskd->tkgd", probs, v)  # [T, kvh, G, D]
    return out.reshape(num_tokens, num_heads, d).to(query.dtype)


def encoder_attention_masked(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, H, D]
    value: torch.Tensor,  # [T, H, D]
    cu_seqlens: torch.Tensor,  # [S + 1] int32, on the device
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Non-causal attention within each sequence as one attention over all T tokens: token t
    belongs to sequence ``#{s : cu_seqlens[s + 1] <= t}`` and sees the keys of its sequence only
    (rows past cu_seqlens[-1], padding, form one more sequence, so no row is empty); with
    `sliding_window` W only those at most W rows away (a sequence's rows are consecutive, so
    that is ``|p - k| <= W`` in its positions). fp32 math, [T, H, D] in the query's dtype.
    Shapes depend on T, H, D and S alone: traced once per size."""
    num_tokens = query.shape[0]
    t = torch.arange(num_tokens, device=query.device, dtype=torch.int64)
    ends = cu_seqlens[1:].to(torch.int64)  # [S]
    seq = (ends.unsqueeze(0) <= t.unsqueeze(1)).sum(dim=1)  # [T]: each token's sequence
    same = seq.unsqueeze(0) == seq.unsqueeze(1)  # [T, T] block diagonal
    if sliding_window is not None:
        same &= (t.unsqueeze(0) - t.unsqueeze(1)).abs() <= sliding_window
    scores = torch.einsum("qhd,khd->hqk", query.float(), key.float()) * scale  # [H, T, T]
    probs = torch.softmax(scores.masked_fill(~same, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, value.float()).to(query.dtype)
