"""The eager cpu runner's linears: `F.linear` calls sent to faster kernels than torch's default.

- one fp32 or bf16 row (batch-1 decode outside the fused step, a single sequence's LM head):
  `portside_cpu_native::linear_row`, which streams the weight at 35-49 GB/s where MKL's GEMV
  gets ~10 on the CI machine (bf16 weights are streamed as bf16 and widened in the dot products);
- several rows (prefill, batched decode): oneDNN's linear over a copy of the weight prepacked
  for it (`torch.ops.mkldnn._reorder_linear_weight`, what Inductor's frozen linears use), made
  on first use, which the runner's `capture` makes a dummy step at start-up. On AMD CPUs
  `F.linear` runs MKL's sgemm, which takes its AVX2 path there: on session 11's Zen 5 VM a
  2048^3 product ran at ~210 GFLOP/s through it and ~480-520 through oneDNN, and the eager
  engine's offline throughput (64 x 128 -> 128 tokens, default model) went from ~275 to ~500
  tok/s. The copies double the memory the weights take (option ``cpu_prepack=off`` keeps only
  the dense weights).

bf16 linears of several rows (option ``cpu_bf16_linears``, `CpuOptions.bf16_linears`): ``native`` packs
the bf16 weights for oneDNN's bf16 kernels (AMX, AVX-512-BF16); ``amx`` does too, but runs the
linears of 2..`AMX_MAX_ROWS` rows (batched decode steps) in the native AMX tile kernel
(`portside_cpu_native::linear_amx`, csrc/linear_amx.cpp), which streams the weights faster at
those sizes (default model's 120 decode linears, 2 threads, Sapphire Rapids VM: 64 rows 13.6 ->
11.4 ms, 16 rows 10.1 -> 7.0, 256 rows 25.3 -> 28.3: oneDNN wins there, hence the bound);
``widen`` packs an fp32 copy instead, widens the bf16 activations and rounds the output to bf16
once (torch's bf16 linear also sums in fp32). ``auto`` picks amx where the CPU has AMX-BF16 (and
the kernel grants the tile state), native where it has other bf16 arithmetic (AVX-512-BF16) and
widen elsewhere: on the Zen 3 (AVX2) oneDNN cannot pack bf16 weights at all and torch's bf16
linear of 64 x 768 x 768 took 18.3 ms against 3.2 ms widened (1 thread). The fp32 copies take
twice the bf16 weights' memory; the AMX kernel keeps its own tile-ordered copy of each weight it
has run (made on first use, as large as the bf16 weight).

oneDNN builds a primitive (JIT kernels) for every input row count it sees and keeps it in two
1024-entry caches (its primitive cache and ideep's), about 0.6 MiB per (rows, weight shape): fed
the raw row counts of a server's steps (every prefill and decode batch size), resident memory
grew by megabytes a round for hours. So rows are padded to a bucket (`padded_rows`: at most 24
sizes up to `CHUNK_ROWS`, at most 25% padding; past it, the next multiple of `CHUNK_ROWS`, so at
most ceil(max_num_batched_tokens / CHUNK_ROWS) more sizes, built on first use); the caches then
stop growing once the buckets a workload uses have been seen. Inputs over `CHUNK_ROWS` rows used
to run in calls of that many rows concatenated: on the shared 2-core Zen 4 VM that was 5-10x
slower than one call (8192 x 384 -> 384, fp32, 2 threads: 16 calls + cat 256 ms, one call 25 ms;
torch's F.linear 39 ms), the cat's and every call's fresh outputs page-faulting there.

Both are hooks of one `TorchFunctionMode`, entered only around the steps that can use them: a
mode's Python hook on every torch call costs a few percent of a step.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from portside.backends.cpu.encoder_linears import LINEAR_ADD, fused_dense
from portside.backends.cpu.native_ops import amx_unavailable_reason
from portside.backends.cpu.options import cpu_options

__all__ = ["EagerLinears", "PackedWeights", "packed_linear", "padded_rows", "row_buckets", "amx_linears",
           "amx_unavailable_reason", "make_packed_weights", "prepack_unavailable_reason", "AMX_MAX_ROWS", "CHUNK_ROWS"]

logger = logging.getLogger(__name__)

AMX_MAX_ROWS = 128  # the most rows `linear_amx` runs (oneDNN is faster past ~200)
PACKED_DTYPES = (torch.float32, torch.bfloat16)
ROW_DTYPES = (torch.float32, torch.bfloat16)  # what linear_row streams
CHUNK_ROWS = 512  # longer inputs are padded to a multiple of this many rows (`padded_rows`) rows


def row_buckets(max_rows: int) -> list[int]:
    """Every row count `padded_rows` gives for 2..max_rows rows up to `CHUNK_ROWS` (what `warm`
    builds at start-up; the multiples of `CHUNK_ROWS` past it are built on first use)."""
    return sorted({padded_rows(r) for r in range(2, min(max_rows, CHUNK_ROWS) + 1)})


def padded_rows(rows: int) -> int:
    """The row count oneDNN runs `rows` rows as: the next power of two from 2 to 16, then the
    next of 4 steps per octave (20, 24, 28, 32, 40, .., 448, 512), past `CHUNK_ROWS` the next
    multiple of it."""
    if rows > CHUNK_ROWS:
        return -(-rows // CHUNK_ROWS) * CHUNK_ROWS
    if rows <= 16:
        return max(2, 1 << (rows - 1).bit_length())
    step = 1 << ((rows - 1).bit_length() - 3)
    return -(-rows // step) * step


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a 2-D `x` through oneDNN's prepacked linear, in one
    call with the rows padded to `padded_rows` so that oneDNN only ever sees a bounded set of
    shapes."""
    rows = x.shape[0]
    pad = padded_rows(rows) - rows
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")[:rows]


def prepack_unavailable_reason() -> str | None:
    """None when oneDNN's prepacked linear is usable in this torch build, else why not."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight") or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this torch build lacks oneDNN's prepacked linear operators"
    return None


class PackedWeights:
    """oneDNN-prepacked copies of the weights `F.linear` is called with, made on first use and
    kept for the runner's lifetime (a model's weights do not move once the runner exists)."""

    def __init__(self, batch_hint: int, widen_bf16: bool = False) -> None:
        self.batch_hint = batch_hint  # the row count oneDNN picks its packed layout for
        self.widen_bf16 = widen_bf16  # bf16 weights packed as fp32 copies (`CpuOptions.bf16_linears` "widen")
        self._packed: dict[tuple[int, tuple[int, ...], torch.dtype], torch.Tensor | None] = {}
        # one (packed weight, bias) per kind of call seen while `recording` (the runner's capture
        # step): what oneDNN builds a primitive for
        self.recording = False
        self.kinds: dict[tuple[tuple[int, ...], torch.dtype, bool], tuple[torch.Tensor, torch.Tensor | None]] = {}

    def warm(self, max_rows: int) -> int:
        """Run every kind of call seen at every padded row count up to `max_rows` once, so that
        oneDNN builds (and caches) all its primitives now rather than while serving: memory
        is then flat from start-up. Returns the calls made."""
        calls = 0
        for (shape, dtype, _), (packed, bias) in self.kinds.items():  # dtype: the packed weight's
            for rows in row_buckets(max_rows):
                packed_linear(torch.zeros(rows, shape[1], dtype=dtype), packed, bias)
                calls += 1
        return calls

    def __len__(self) -> int:
        return sum(p is not None for p in self._packed.values())

    def get(self, weight: torch.Tensor) -> torch.Tensor | None:
        if not isinstance(weight, torch.nn.Parameter):
            return None  # a temporary (a dequantized weight): its address is reused, never cache it
        key = (weight.data_ptr(), tuple(weight.shape), weight.dtype)
        if key not in self._packed:
            packed = None
            if weight.dim() == 2 and weight.dtype in PACKED_DTYPES and weight.device.type == "cpu":
                dense = weight.detach()
                if dense.dtype == torch.bfloat16 and self.widen_bf16:
                    dense = dense.float()
                try:
                    packed = torch.ops.mkldnn._reorder_linear_weight(dense, self.batch_hint)
                except RuntimeError as e:  # a shape or dtype this oneDNN build does not pack
                    logger.info("cpu eager: weight %s %s stays dense: %s", tuple(weight.shape), weight.dtype, e)
            self._packed[key] = packed
        return self._packed[key]


class EagerLinears(torch.overrides.TorchFunctionMode):
    """Sends `F.linear` of one fp32 or bf16 row to the native operator (`native`), of 2..
    `AMX_MAX_ROWS` bf16 rows to the AMX tile kernel (`amx`), of several rows to oneDNN's prepacked
    linear (`packed`; bf16 over a widened fp32 copy: the activations widened, the output rounded
    once); everything else, and what none covers, runs on."""

    def __init__(self, native: bool, packed: PackedWeights | None, amx: bool = False) -> None:
        super().__init__()
        self.native, self.packed, self.amx = native, packed, amx

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if getattr(func, "fusion", None) == LINEAR_ADD:  # an encoder's dense layer + residual (`encoder_linears`)
            out = fused_dense(func, args, self.packed, padded_rows) if self.packed is not None and not kwargs else None
            if out is not None:
                return out
            with self:  # the reference, its linear through this mode
                return func.reference(*args, **kwargs)
        if func is F.linear:
            x = args[0] if args else kwargs["input"]
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if x.dim() == 2 and x.dtype == weight.dtype:
                if x.shape[0] == 1 and self.native and x.dtype in ROW_DTYPES:
                    return torch.ops.portside_cpu_native.linear_row(x, weight, bias)
                if (self.amx and x.dtype == torch.bfloat16 and x.shape[0] <= AMX_MAX_ROWS
                        and isinstance(weight, torch.nn.Parameter)):  # (a temporary would be repacked every call)
                    return torch.ops.portside_cpu_native.linear_amx(x, weight, bias)
                if x.shape[0] > 1 and self.packed is not None:
                    packed = self.packed.get(weight)
                    if packed is not None:
                        widened = packed.dtype != x.dtype
                        if widened:
                            x, bias = x.float(), None if bias is None else bias.float()
                        if self.packed.recording:
                            self.packed.kinds.setdefault((tuple(weight.shape), packed.dtype, bias is not None), (packed, bias))
                        out = packed_linear(x, packed, bias)
                        return out.to(weight.dtype) if widened else out
        return func(*args, **kwargs)


def amx_linears(config: Any) -> bool:
    """Whether a runner sends a bf16 model's linears of 2..`AMX_MAX_ROWS` rows to `linear_amx` now:
    the AMX linears chosen (`CpuOptions.bf16_linears`), and the native library loaded with the
    kernel granted the tile state (a runner asks again once a library built in the background is)."""
    return (config.model.dtype == torch.bfloat16 and cpu_options(config).bf16_linears == "amx"
            and amx_unavailable_reason(wait=False) is None)


def make_packed_weights(config: Any) -> PackedWeights | None:
    """The prepacked-weights cache of an eager runner: None with ``cpu_prepack=off`` or without
    oneDNN (logged); bf16 weights packed as fp32 copies where the choice is to widen them
    (`CpuOptions.bf16_linears`; amx packs them as native does, for oneDNN's rows above `AMX_MAX_ROWS`)."""
    options = cpu_options(config)
    if not options.prepack:
        return None
    reason = prepack_unavailable_reason()
    if reason:
        logger.info("cpu eager: multi-row linears run in F.linear: %s", reason)
        return None
    return PackedWeights(batch_hint=max(2, config.scheduler.max_num_seqs), widen_bf16=options.bf16_linears == "widen")
