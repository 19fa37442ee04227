"""Graph capture for XLA is precompilation over padded shape buckets.

torch-xla traces each step lazily and compiles one XLA program per distinct graph, i.e. per
input shape. `XlaGraphRunner` makes the shapes few and known:

- every step is padded to a `BucketShape` (token count, request count, block-table width):
  padding tokens have slot -1 (the attention backend writes them nowhere) and belong to padding
  requests with no query tokens, so they change no real row; the output is sliced back to the
  real tokens (the contract: hidden states ``[num_tokens, hidden]``);
- `capture` compiles every bucket at startup (a tqdm progress bar) by running the model once per
  shape on dummy inputs;
- after warm-up each step compares torch-xla's compile counter before and after: a compilation
  means a shape escaped the buckets (an error when strict, else a warning naming the shape).

The padded inputs are built on the host (numpy) from the step's tensors and copied to the
device, so the step's graph holds only device data and the model: the same program for every
step of a bucket, whatever its values. The model passes each layer's attention features (sliding
window, logit softcap) to the backend as Python constants of the layer, so they are part of the
bucket's program, traced at warm-up like everything else.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from portside.backends.xla.buckets import Buckets, BucketShape, parse_buckets
from portside.contract import AttentionMetadata, ForwardContext, GraphRunner, ModelFn

__all__ = ["XlaGraphRunner", "RecompilationError", "compile_count", "CompileStats"]

logger = logging.getLogger(__name__)


class RecompilationError(RuntimeError):
    """A step compiled a new XLA program after warm-up while strict mode is on."""


def compile_count() -> int:
    """XLA programs compiled by this process so far (torch_xla.debug.metrics)."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


@dataclass
class CompileStats:
    warmup_compiles: int = 0  # programs compiled by `capture`
    warmup_seconds: float = 0.0
    steps: int = 0
    recompiles: int = 0  # programs compiled by steps after warm-up
    recompiled_shapes: list[BucketShape] = field(default_factory=list)


class XlaGraphRunner(GraphRunner):
    name = "xla-bucketed"

    def __init__(self, model_fn: ModelFn, config: Any, strict: bool = False, precompile: bool = True) -> None:
        super().__init__(model_fn, config)
        self.strict = strict
        self.precompile = precompile
        self.buckets = _buckets_for(config)
        self.stats = CompileStats()
        self.warmed_up = False

    # ---- startup ------------------------------------------------------------------------------

    def capture(self, make_dummy_context: Callable[[int], ForwardContext]) -> None:
        """Compile every bucket shape once; afterwards any compilation is reported."""
        import torch_xla

        dummy = make_dummy_context(1)
        backend, kv_caches, block_size = dummy.backend, dummy.kv_caches, dummy.metadata.block_size
        del dummy  # its lazy tensors must not be traced into the bucket graphs
        torch_xla.sync()  # materialise weights and the zeroed caches: no setup ops in the graphs
        if not kv_caches:
            self.warmed_up = True
            return
        device = kv_caches[0].device
        start, before = time.perf_counter(), compile_count()
        if self.precompile:
            from tqdm import tqdm

            shapes = self.buckets.shapes()
            for shape in tqdm(shapes, desc="XLA precompile", unit="graph", disable=None):
                ctx = ForwardContext(backend, kv_caches, _dummy_metadata(shape, block_size))
                self._run_padded(*_pad_inputs(shape, ctx, block_size, device, dummy=True), backend, kv_caches)
        self.stats.warmup_compiles = compile_count() - before
        self.stats.warmup_seconds = time.perf_counter() - start
        logger.info("XLA precompile: %d programs for %d bucket shapes in %.1f s", self.stats.warmup_compiles,
                    len(self.buckets.shapes()) if self.precompile else 0, self.stats.warmup_seconds)
        self.warmed_up = True

    # ---- one step -----------------------------------------------------------------------------

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        md = ctx.metadata
        num_tokens = input_ids.shape[0]
        shape, inside = self.buckets.select(num_tokens, md.num_reqs, md.block_tables.shape[1])
        ids, pos, padded = _pad_inputs(shape, ctx, md.block_size, input_ids.device, input_ids=input_ids, positions=positions)
        before = compile_count()
        hidden = self._run_padded(ids, pos, padded, ctx.backend, ctx.kv_caches)
        compiled = compile_count() - before
        self.stats.steps += 1
        if compiled and self.warmed_up:
            self._report(shape, inside, compiled, num_tokens, md.num_reqs, md.block_tables.shape[1])
        return hidden[:num_tokens]

    def _run_padded(self, ids: torch.Tensor, pos: torch.Tensor, md: AttentionMetadata, backend, kv_caches) -> torch.Tensor:
        import torch_xla

        md = backend.with_data(md) if hasattr(backend, "with_data") else backend.prepare(md)
        hidden = self.model_fn(ids, pos, ForwardContext(backend, kv_caches, md))  # [T_pad, hidden]
        torch_xla.sync()  # compile (first time per shape) and run the step; caches updated in place
        return hidden

    def _report(self, shape: BucketShape, inside: bool, compiled: int, tokens: int, reqs: int, width: int) -> None:
        self.stats.recompiles += compiled
        self.stats.recompiled_shapes.append(shape)
        where = "inside" if inside else "outside"
        msg = (
            f"XLA compiled {compiled} new program(s) after warm-up for a step of {tokens} tokens, {reqs} requests, "
            f"block-table width {width}, padded to {shape} ({where} the buckets "
            f"tokens={list(self.buckets.tokens)} requests={list(self.buckets.requests)} widths={list(self.buckets.widths)})"
        )
        if self.strict:
            raise RecompilationError(msg)
        logger.warning(msg)


# ---- bucket configuration -----------------------------------------------------------------------


def _buckets_for(config: Any) -> Buckets:
    """Buckets from the platform options, defaulting to powers of two up to the engine's limits."""
    block_size = config.cache.block_size or 16
    max_width = -(-config.model.max_model_len // block_size)
    default = Buckets.from_limits(
        config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs, max_width
    )

    def option(key: str, fallback: tuple[int, ...]) -> tuple[int, ...]:
        value = config.option(key)
        return parse_buckets(value, key) if value is not None else fallback

    return Buckets(
        tokens=option("xla_token_buckets", default.tokens),
        requests=option("xla_request_buckets", default.requests),
        widths=option("xla_width_buckets", default.widths),
    )


# ---- padding (host side) -----------------------------------------------------------------------


def _dummy_metadata(shape: BucketShape, block_size: int) -> AttentionMetadata:
    """Host metadata of a bucket's shape: one request holding every token, nothing written."""
    t, r, w = shape.num_tokens, shape.num_reqs, shape.width
    qsl = [0] + [t] * r
    seq_lens = [t] + [0] * (r - 1)
    return AttentionMetadata(
        slot_mapping=torch.full((t,), -1, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.zeros((r, w), dtype=torch.int32),
        max_query_len=t,
        max_seq_len=t,
        block_size=block_size,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        num_decode_tokens=0,
    )


def _host(x: torch.Tensor) -> np.ndarray:
    return x.detach().cpu().numpy()  # device data only (no pending ops): a transfer, no compile


def _pad_inputs(
    shape: BucketShape,
    ctx: ForwardContext,
    block_size: int,
    device: torch.device,
    input_ids: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    dummy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Inputs and metadata padded to `shape`, built on the host and copied to `device`.

    Padding tokens: id 0, position 0, slot -1 (written nowhere). Padding requests: no
    query tokens (query_start_loc repeats the real token count), seq_len 0, block table of 0s.
    """
    md = ctx.metadata
    t_pad, r_pad, w_pad = shape.num_tokens, shape.num_reqs, shape.width
    n, r, w = md.num_tokens, md.num_reqs, md.block_tables.shape[1]
    ids = np.zeros(t_pad, dtype=np.int64)
    pos = np.zeros(t_pad, dtype=np.int64)
    slots = np.full(t_pad, -1, dtype=np.int64)
    table = np.zeros((r_pad, w_pad), dtype=np.int32)
    if not dummy:
        assert input_ids is not None and positions is not None
        ids[:n] = _host(input_ids)
        pos[:n] = _host(positions)
    slots[:n] = _host(md.slot_mapping)
    table[:r, :w] = _host(md.block_tables)
    qsl_cpu = list(md.query_start_loc_cpu) if md.query_start_loc_cpu else _host(md.query_start_loc).tolist()
    lens_cpu = list(md.seq_lens_cpu) if md.seq_lens_cpu else _host(md.seq_lens).tolist()
    qsl = np.full(r_pad + 1, qsl_cpu[-1], dtype=np.int32)
    qsl[: r + 1] = qsl_cpu
    seq_lens = np.zeros(r_pad, dtype=np.int32)
    seq_lens[:r] = lens_cpu

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    padded = AttentionMetadata(
        slot_mapping=dev(slots),
        query_start_loc=dev(qsl),
        seq_lens=dev(seq_lens),
        block_tables=dev(table),
        max_query_len=md.max_query_len,
        max_seq_len=md.max_seq_len,
        block_size=block_size,
        query_start_loc_cpu=qsl.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
        num_decode_tokens=md.num_decode_tokens,
    )
    return dev(ids), dev(pos), padded
