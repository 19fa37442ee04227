"""Device-graph capture over padded decode-batch buckets: shared by the cuda and rocm backends.

torch exposes both CUDA graphs and HIP graphs as ``torch.cuda.CUDAGraph``, so one runner serves
both platforms; it lives here, in the shared Triton package, because a backend never imports
another backend's module. Nothing in this module imports triton: bucket selection and padding
are plain torch and run on CPU in the tests.

How it works: after the KV cache exists, `capture` records one graph per bucket size (largest
first, one shared memory pool) over *static* input buffers. Each step, a decode-only batch of
``n <= max(bucket)`` requests is copied into the buffers of the smallest bucket ``>= n``; rows
``n..bucket`` are padding (slot -1 so nothing is written, seq_len 1 over a scratch block) and
their outputs are dropped. Other batches (prefill chunks, mixed, or too large) run eagerly.

Per-layer attention features (sliding window, softcap) are Python constants of each layer's
``ctx.attention`` call, so a graph bakes them in like the scale. A layer whose features the
backend does not take runs core's eager fallback, which no graph can hold: then nothing is
captured (`fallback_features`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from portside.contract import (
    AttentionBackend,
    AttentionMetadata,
    ForwardContext,
    GraphCaptureSupport,
    GraphRunner,
    ModelFn,
)

if TYPE_CHECKING:
    from portside.config import EngineConfig

__all__ = [
    "GRAPH_SIZES_OPTION",
    "default_graph_sizes",
    "parse_graph_sizes",
    "format_graph_sizes",
    "select_bucket",
    "is_decode_only",
    "StaticDecodeBatch",
    "DeviceGraphRunner",
    "fallback_features",
    "with_graph_sizes",
]

logger = logging.getLogger(__name__)

GRAPH_SIZES_OPTION = "graph_sizes"  # EngineConfig.platform_options key: "1,2,4,8" ("" = eager)
MAX_GRAPH_SIZE = 512  # larger decode batches are compute-bound enough to run eagerly


def default_graph_sizes(max_num_seqs: int, limit: int = MAX_GRAPH_SIZE) -> tuple[int, ...]:
    """Powers of two up to ``min(max_num_seqs, limit)``, plus that bound itself."""
    top = max(1, min(max_num_seqs, limit))
    sizes = [1 << i for i in range(top.bit_length()) if (1 << i) <= top]
    if sizes[-1] != top:
        sizes.append(top)
    return tuple(sizes)


def parse_graph_sizes(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> (1, 2, 4), sorted and de-duplicated; ``""`` -> () (no graphs)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        sizes = sorted({int(p) for p in parts})
    except ValueError:
        raise ValueError(f"graph sizes must be comma-separated integers, got {text!r}") from None
    if sizes and sizes[0] < 1:
        raise ValueError(f"graph sizes must be >= 1, got {text!r}")
    return tuple(sizes)


def format_graph_sizes(sizes: tuple[int, ...]) -> str:
    return ",".join(str(s) for s in sizes)


def select_bucket(num_reqs: int, sizes: tuple[int, ...]) -> int | None:
    """Smallest captured size that holds `num_reqs` requests, or None (run eagerly)."""
    if num_reqs < 1:
        return None
    for size in sorted(sizes):
        if size >= num_reqs:
            return size
    return None


def is_decode_only(metadata: AttentionMetadata) -> bool:
    """Every request contributes exactly one query token."""
    return metadata.max_query_len == 1 and metadata.num_tokens == metadata.num_reqs


@dataclass
class StaticDecodeBatch:
    """Fixed input buffers for the largest bucket; a bucket of size b uses the first b rows."""

    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    slot_mapping: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32, always arange: one token per request
    block_tables: torch.Tensor  # [B, W] int32
    block_size: int
    max_seq_len: int  # upper bound used for every captured launch (the model's max length)
    scratch_block: int  # block that padding rows point at (never written: their slot is -1)

    @classmethod
    def allocate(
        cls, max_size: int, max_blocks_per_seq: int, block_size: int, max_seq_len: int, device: torch.device, scratch_block: int = 0
    ) -> StaticDecodeBatch:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            input_ids=zeros(max_size, dtype=torch.int64),
            positions=zeros(max_size, dtype=torch.int64),
            slot_mapping=torch.full((max_size,), -1, dtype=torch.int64, device=device),
            seq_lens=torch.ones(max_size, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(max_size + 1, dtype=torch.int32, device=device),
            block_tables=torch.full((max_size, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=device),
            block_size=block_size,
            max_seq_len=max_seq_len,
            scratch_block=scratch_block,
        )

    @property
    def max_size(self) -> int:
        return self.input_ids.shape[0]

    def fits(self, metadata: AttentionMetadata) -> bool:
        return (
            metadata.block_size == self.block_size
            and metadata.block_tables.shape[1] <= self.block_tables.shape[1]
            and metadata.max_seq_len <= self.max_seq_len
        )

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata, size: int) -> None:
        """Copy a decode batch of n <= size requests into rows [0, n); pad rows [n, size)."""
        n = metadata.num_reqs
        assert n <= size <= self.max_size, (n, size, self.max_size)
        width = metadata.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(metadata.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(metadata.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(metadata.block_tables, non_blocking=True)
        # Padding rows: a one-token sequence over the scratch block; nothing is written.
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[n:size].fill_(1)
        self.block_tables[n:size, 0].fill_(self.scratch_block)

    def metadata(self, size: int) -> AttentionMetadata:
        """Metadata over the first `size` rows (views: a replay sees whatever `fill` wrote)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
            block_size=self.block_size,
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[],  # unknown at capture time: graph-capturable backends read the tensors
            num_decode_tokens=size,
        )

    def context(self, size: int, like: ForwardContext) -> ForwardContext:
        metadata = like.backend.prepare(self.metadata(size))
        return ForwardContext(backend=like.backend, kv_caches=like.kv_caches, metadata=metadata)


def fallback_features(model: object, backend: AttentionBackend) -> set[str]:
    """Attention features a layer of `model` needs that `backend` does not take itself (core runs
    those layers through its eager fallback); empty for a model without `attention_features`."""
    features = getattr(model, "attention_features", None)
    if features is None:
        return set()
    used = {name for i in range(model.num_layers) for name, value in features(i).items() if value is not None}  # type: ignore[attr-defined]
    return used - backend.features


@dataclass
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph
    output: torch.Tensor  # [size, hidden], the graph's static output
    ctx: ForwardContext


def _cache_key(kv_caches: Any) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in kv_caches)


class DeviceGraphRunner(GraphRunner):
    """Captures ``torch.cuda`` graphs (CUDA or HIP) for padded decode buckets; eager otherwise."""

    name = "device_graph"

    def __init__(self, model_fn: ModelFn, config: EngineConfig, sizes: tuple[int, ...] | None = None) -> None:
        super().__init__(model_fn, config)
        if sizes is None:
            option = config.option(GRAPH_SIZES_OPTION)
            sizes = parse_graph_sizes(option) if option is not None else default_graph_sizes(config.scheduler.max_num_seqs)
        self.sizes = tuple(sorted(sizes))
        self._graphs: dict[int, _Captured] = {}
        self._batch: StaticDecodeBatch | None = None
        self._cache_key: tuple[int, ...] = ()
        self.num_replays = 0  # steps served by a graph (for checks and metrics)

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def capture(self, make_dummy_context: Callable[[int], ForwardContext]) -> None:
        if not self.sizes:
            return
        largest = make_dummy_context(self.sizes[-1])
        if largest.backend.graph_support is GraphCaptureSupport.NEVER or not largest.kv_caches:
            return
        missing = fallback_features(self.model_fn, largest.backend)
        if missing:
            logger.warning("no device graphs: attention backend %r does not take the model's feature(s) %s, "
                           "which run in core's eager fallback", largest.backend.name, sorted(missing))  # fmt: skip
            return
        device = largest.kv_caches[0].device
        md = largest.metadata
        max_len = self.config.model.max_model_len
        self._batch = StaticDecodeBatch.allocate(
            max_size=self.sizes[-1],
            max_blocks_per_seq=-(-max_len // md.block_size),
            block_size=md.block_size,
            max_seq_len=max_len,
            device=device,
            scratch_block=int(md.block_tables[0, 0]),
        )
        self._cache_key = _cache_key(largest.kv_caches)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its pool
            dummy = largest if size == self.sizes[-1] else make_dummy_context(size)
            ids = torch.zeros(size, dtype=torch.int64, device=device)
            positions = (dummy.metadata.seq_lens - 1).to(torch.int64)
            self._batch.fill(ids, positions, dummy.metadata, size)
            ctx = self._batch.context(size, dummy)
            args = (self._batch.input_ids[:size], self._batch.positions[:size], ctx)
            self.model_fn(*args)  # warm-up outside capture: Triton compiles here
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                output = self.model_fn(*args)
            self._graphs[size] = _Captured(graph, output, ctx)
        torch.cuda.synchronize(device)

    def bucket_for(self, ctx: ForwardContext) -> int | None:
        """The captured size this step replays, or None to run eagerly."""
        if not self._graphs or self._batch is None or not is_decode_only(ctx.metadata):
            return None
        if not self._batch.fits(ctx.metadata) or _cache_key(ctx.kv_caches) != self._cache_key:
            return None
        return select_bucket(ctx.metadata.num_reqs, self.captured_sizes)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        size = self.bucket_for(ctx)
        if size is None:
            return self.model_fn(input_ids, positions, ctx)
        assert self._batch is not None
        self._batch.fill(input_ids, positions, ctx.metadata, size)
        captured = self._graphs[size]
        captured.graph.replay()
        self.num_replays += 1
        return captured.output[: ctx.metadata.num_reqs].clone()  # the next replay overwrites output


def with_graph_sizes(config: EngineConfig, sizes: tuple[int, ...]) -> EngineConfig:
    """`config` with the graph buckets recorded in its platform options."""
    options = dict(config.platform_options)
    options[GRAPH_SIZES_OPTION] = format_graph_sizes(sizes)
    return dataclasses.replace(config, platform_options=tuple(sorted(options.items())))
