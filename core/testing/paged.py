"""Drive a portside model over one sequence through a paged KV cache, without an engine.

For model and loader tests: `single_sequence_metadata` builds the `AttentionMetadata` of one
request, and `PagedSequence` prefills and decodes it step by step (greedy).
"""

from __future__ import annotations

import dataclasses

import torch

from portside.contract import AttentionBackend, AttentionMetadata, ForwardContext
from portside.runner.kv_cache import layer_cache_shape

__all__ = ["single_sequence_metadata", "PagedSequence"]


def single_sequence_metadata(
    num_cached: int, num_new: int, block_table: list[int], block_size: int, device: torch.device | str = "cpu"
) -> AttentionMetadata:
    """Metadata for one request whose first `num_cached` tokens are in the cache and whose next
    `num_new` tokens are computed now (a prefill, a prefill chunk, or a decode when num_new=1)."""
    seq_len = num_cached + num_new
    needed = -(-seq_len // block_size)
    if needed > len(block_table):
        raise ValueError(f"{seq_len} tokens need {needed} blocks, the block table has {len(block_table)}")
    positions = range(num_cached, seq_len)
    slots = [block_table[p // block_size] * block_size + p % block_size for p in positions]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor([0, num_new], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=device),
        block_tables=torch.tensor([block_table], dtype=torch.int32, device=device),
        max_query_len=num_new,
        max_seq_len=seq_len,
        block_size=block_size,
        query_start_loc_cpu=[0, num_new],
        seq_lens_cpu=[seq_len],
        num_decode_tokens=1 if num_new == 1 and num_cached > 0 else 0,
    )


class PagedSequence:
    """One sequence in a private paged cache. Blocks are handed out in a scrambled order so that
    the block table is not the identity."""

    def __init__(
        self, model: torch.nn.Module, backend: AttentionBackend, block_size: int = 4, max_tokens: int = 256,
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        """`cache_dtype`: what the cache holds (an 8-bit `--kv-cache-dtype`; None: the model's dtype)."""
        self.model, self.backend, self.block_size = model, backend, block_size
        spec = model.kv_cache_spec()  # type: ignore[operator]
        num_blocks = -(-max_tokens // block_size)
        device = next(model.parameters()).device
        self.device = device
        dtype = cache_dtype or spec.dtype
        shape = layer_cache_shape(backend, dataclasses.replace(spec, cache_dtype=cache_dtype), num_blocks, block_size)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
        self.block_table = [(7 * i + 3) % num_blocks for i in range(num_blocks)] if num_blocks % 7 else list(
            reversed(range(num_blocks))
        )
        self.num_cached = 0

    @torch.no_grad()
    def forward(self, token_ids: list[int], inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Compute `token_ids` after the cached ones; return fp32 logits [len(token_ids), vocab].
        `inputs_embeds` [len(token_ids), hidden]: the step's input in place of the token
        embeddings (`ForwardContext.inputs_embeds`)."""
        n = len(token_ids)
        meta = self.backend.prepare(
            single_sequence_metadata(self.num_cached, n, self.block_table, self.block_size, self.device)
        )
        ctx = ForwardContext(backend=self.backend, kv_caches=self.kv_caches, metadata=meta, inputs_embeds=inputs_embeds)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        positions = torch.arange(self.num_cached, self.num_cached + n, device=self.device)
        hidden = self.model(ids, positions, ctx)  # [n, hidden]
        self.num_cached += n
        return self.model.compute_logits(hidden)  # type: ignore[operator]

    def greedy(self, prompt_ids: list[int], max_new_tokens: int, prefill_chunk: int | None = None) -> list[int]:
        """Prefill (in chunks of `prefill_chunk` tokens if given), then decode one token a step."""
        chunk = prefill_chunk or len(prompt_ids)
        for i in range(0, len(prompt_ids), chunk):
            logits = self.forward(prompt_ids[i : i + chunk])
        out: list[int] = []
        for _ in range(max_new_tokens):
            out.append(int(logits[-1].argmax()))
            if len(out) < max_new_tokens:
                logits = self.forward([out[-1]])
        return out
