"""Graph runner for the example NPU: fixed decode batch sizes, padded batches, eager otherwise.

Devices that execute captured graphs (CUDA graphs, ACL graphs, compiled XLA programs) can only
replay the exact shapes they captured. The general recipe, which this runner shows without a
real graph API:

1. `capture`: for each batch size in `batch_sizes`, build a dummy decode batch and run the model
   once on it. VENDOR: this is where you record/compile your graph for that shape.
2. `__call__`: a decode-only batch of n requests is padded up to the smallest captured size
   >= n (padding tokens write nowhere: slot -1; they attend to one scratch slot) and "replayed";
   the padding rows of the result are dropped. Anything else (prefill chunks, mixed batches,
   batches larger than every captured size) runs eagerly.

`num_replays` / `num_eager` count which path ran, so tests can prove replay happened.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from portside.backend_api import AttentionMetadata, ForwardContext, GraphRunner, ModelFn

DEFAULT_BATCH_SIZES = (1, 2, 4, 8)  # VENDOR: choose the buckets your device memory allows


class PaddedDecodeGraphRunner(GraphRunner):
    name = "padded-decode"

    def __init__(self, model_fn: ModelFn, config, batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES) -> None:
        super().__init__(model_fn, config)
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.captured: dict[int, int] = {}  # batch size -> scratch block id its padding attends to
        self.num_replays = 0
        self.num_eager = 0

    def capture(self, make_dummy_context: Callable[[int], ForwardContext]) -> None:
        for n in self.batch_sizes:
            ctx = make_dummy_context(n)
            zeros = torch.zeros(n, dtype=torch.long, device=ctx.metadata.slot_mapping.device)
            self.model_fn(zeros, zeros, ctx)  # VENDOR: capture the graph for this shape here
            self.captured[n] = int(ctx.metadata.block_tables[0, 0])

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        md = ctx.metadata
        n = md.num_reqs
        bucket = next((b for b in self.batch_sizes if b >= n and b in self.captured), None)
        if bucket is None or md.num_decode_tokens != md.num_tokens:
            self.num_eager += 1
            return self.model_fn(input_ids, positions, ctx)
        self.num_replays += 1
        if bucket == n:
            return self.model_fn(input_ids, positions, ctx)  # VENDOR: replay the graph
        pad = bucket - n
        padded = ForwardContext(ctx.backend, ctx.kv_caches, ctx.backend.prepare(_pad_decode(md, pad, self.captured[bucket])))
        ids = torch.cat([input_ids, input_ids.new_zeros(pad)])
        pos = torch.cat([positions, positions.new_zeros(pad)])
        return self.model_fn(ids, pos, padded)[:n]  # VENDOR: replay, then drop the padding rows


def _pad_decode(md: AttentionMetadata, pad: int, scratch_block: int) -> AttentionMetadata:
    """`md` (decode-only, one token per request) plus `pad` dummy requests of length 1."""
    dev = md.slot_mapping.device
    n = md.num_reqs
    width = max(md.block_tables.shape[1], 1)
    table = torch.full((n + pad, width), scratch_block, dtype=md.block_tables.dtype, device=dev)
    table[:n, : md.block_tables.shape[1]] = md.block_tables
    return replace(
        md,
        slot_mapping=torch.cat([md.slot_mapping, md.slot_mapping.new_full((pad,), -1)]),  # written nowhere
        query_start_loc=torch.arange(n + pad + 1, dtype=md.query_start_loc.dtype, device=dev),
        seq_lens=torch.cat([md.seq_lens, md.seq_lens.new_ones(pad)]),
        block_tables=table,
        query_start_loc_cpu=list(range(n + pad + 1)),
        seq_lens_cpu=list(md.seq_lens_cpu) + [1] * pad,
        num_decode_tokens=n + pad,
        backend_data=None,
    )
