"""Paged attention for the example NPU, in plain batched torch.

VENDOR: this file is where your fused paged-attention kernel goes. The cache layout is yours to
choose; core only allocates the tensor `kv_cache_shape` describes and hands it back. This plugin
picks a block-major layout (one block's K and V side by side, heads before tokens), as many
accelerator kernels prefer, and deliberately not core's canonical one:

    kv_cache: [num_blocks, 2, num_kv_heads, block_size, head_size]   (index 1: 0 = K, 1 = V)

Slot ``s`` is block ``s // block_size``, offset ``s % block_size``; slot -1 means "skip" (padding).
The forward pass is one batched computation over the whole mixed batch (prefill chunks and
decodes alike): every request's blocks are gathered and padded to the longest sequence, every
request's query tokens are padded to the longest query, and a causal mask does the rest.
"""

from __future__ import annotations

import torch

from portside.backend_api import AttentionBackend, AttentionMetadata, GraphCaptureSupport


class NpuExampleAttentionBackend(AttentionBackend):
    name = "npu-example-batched"
    # VENDOR: say honestly what your kernel can run inside a captured graph. Ours sizes its
    # padding from host-side lengths, so only uniform decode batches are captured (see graph.py).
    graph_support = GraphCaptureSupport.DECODE_ONLY

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (num_blocks, 2, num_kv_heads, block_size, head_size)

    @staticmethod
    def _slot_view(kv_cache: torch.Tensor) -> torch.Tensor:
        """The cache seen as [num_blocks, block_size, 2, num_kv_heads, head_size] (a view)."""
        return kv_cache.permute(0, 3, 1, 2, 4)

    def write_kv(self, kv_cache, key, value, slot_mapping) -> None:
        block_size = kv_cache.shape[3]
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        view = self._slot_view(kv_cache)
        blocks, offsets = slots // block_size, slots % block_size
        view[blocks, offsets, 0] = key[keep].to(kv_cache.dtype)  # [n, kvh, D]
        view[blocks, offsets, 1] = value[keep].to(kv_cache.dtype)

    def read_kv(self, kv_cache, slots):
        block_size = kv_cache.shape[3]
        slots = slots.long()
        view = self._slot_view(kv_cache)
        return view[slots // block_size, slots % block_size, 0], view[slots // block_size, slots % block_size, 1]

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        self.write_kv(kv_cache, key, value, metadata.slot_mapping)
        num_tokens, num_heads, head_size = query.shape
        num_blocks_pool, _, num_kv_heads, block_size, _ = kv_cache.shape
        group = num_heads // num_kv_heads  # query heads per KV head (GQA)
        device = query.device

        qsl = metadata.query_start_loc_cpu
        q_lens = torch.tensor([qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)], device=device)  # [R]
        num_reqs = q_lens.shape[0]
        max_q = int(q_lens.max())
        max_blocks = -(-metadata.max_seq_len // block_size)

        # Gather every request's blocks: (2, R, kvh, S, D) with S = max_blocks * block_size.
        kv = kv_cache[metadata.block_tables[:, :max_blocks].long()]  # (R, nb, 2, kvh, bs, D)
        kv = kv.permute(2, 0, 3, 1, 4, 5).reshape(2, num_reqs, num_kv_heads, max_blocks * block_size, head_size)
        k, v = kv[0].float(), kv[1].float()

        # Scatter the flat query tokens into a padded (R, Q, H, D) batch.
        req_of_token = torch.repeat_interleave(torch.arange(num_reqs, device=device), q_lens)  # [T]
        starts = metadata.query_start_loc[:-1].long().to(device)
        col_of_token = torch.arange(num_tokens, device=device) - starts[req_of_token]  # [T]
        q = query.new_zeros((num_reqs, max_q, num_heads, head_size), dtype=torch.float32)
        q[req_of_token, col_of_token] = query.float()
        q = q.view(num_reqs, max_q, num_kv_heads, group, head_size).permute(0, 2, 3, 1, 4)  # (R, kvh, G, Q, D)

        scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale  # (R, kvh, G, Q, S)
        # Query j of request r sits at position seq_len - q_len + j and sees keys up to it.
        q_pos = (metadata.seq_lens.long() - q_lens).unsqueeze(1) + torch.arange(max_q, device=device)  # (R, Q)
        k_pos = torch.arange(k.shape[2], device=device)  # (S,)
        visible = k_pos.view(1, 1, -1) <= q_pos.unsqueeze(-1)  # (R, Q, S); padded query rows are discarded
        scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), v.unsqueeze(2))  # (R, kvh, G, Q, D)
        out = out.permute(0, 3, 1, 2, 4).reshape(num_reqs, max_q, num_heads, head_size)  # (R, Q, H, D)
        return out[req_of_token, col_of_token].to(query.dtype)  # (T, H, D)
