"""The Platform contract: the one module a backend (in-tree or third-party) imports from portside.

A backend supplies a `Platform` subclass and three parts:

- an `AttentionBackend`: writes K/V into its paged cache at `slot_mapping` and attends over
  `block_tables` for a mixed batch of prefill chunks and decodes;
- a `GraphRunner`: runs the model for one step, replaying a captured graph where it can;
- a `Communicator`: the collectives tensor parallelism needs.

It registers through the entry-point group ``portside.platforms`` with a cheap ``register()``
function that returns the dotted path of its `Platform` class (``"pkg.module:Class"``), or None
when the package knows at once that it cannot run here. Nothing in this module imports a vendor
runtime.
"""

from __future__ import annotations

import contextlib
import enum
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch

from portside.ops.lora import LoRAMapping  # what `ModelOps.lora_shrink` / `lora_expand` receive
from portside.sample.bitmask import TokenBitmask, apply_token_bitmask  # the reference a sampler may replace
from portside.sample.sampler import Sampler  # what `Platform.sampler` returns

if TYPE_CHECKING:  # config imports nothing from here; this only names the type.
    from portside.config import EngineConfig
    from portside.quant.weight import QuantWeight

__all__ = [
    "HUGE_PAGE",
    "Availability",
    "DeviceInfo",
    "host_memory",
    "host_zeros",
    "KV_CACHE_DTYPES",
    "QUANTIZED_KV_CACHE_DTYPES",
    "KV_SCALE_BYTES",
    "kv_cache_dtype_name",
    "kv_cache_torch_dtype",
    "is_quantized_kv",
    "kv_row_bytes",
    "quantize_kv",
    "dequantize_kv",
    "KVCacheSpec",
    "AttentionMetadata",
    "ForwardContext",
    "GraphCaptureSupport",
    "ATTENTION_FEATURES",
    "AttentionBackend",
    "ModelOps",
    "LoRAMapping",
    "GraphRunner",
    "EagerGraphRunner",
    "ModelFn",
    "PiecewiseModel",
    "Communicator",
    "SingleRankCommunicator",
    "TorchDistributedCommunicator",
    "Sampler",
    "TokenBitmask",
    "apply_token_bitmask",
    "Platform",
]


# --------------------------------------------------------------------------------------------
# Identity and probing
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Availability:
    """Result of `Platform.is_available()`: usable, or the reason why not."""

    available: bool
    reason: str = ""

    @classmethod
    def yes(cls) -> Availability:
        return cls(True, "")

    @classmethod
    def no(cls, reason: str) -> Availability:
        return cls(False, reason)

    def __bool__(self) -> bool:
        return self.available


@dataclass(frozen=True)
class DeviceInfo:
    name: str  # human-readable, e.g. "NVIDIA H200" or "x86_64 CPU (AVX2)"
    count: int  # devices of this kind visible to the process
    total_memory: int  # bytes, per device
    free_memory: int  # bytes, per device


def host_memory() -> tuple[int, int]:
    """(total, available) host memory in bytes from /proc/meminfo; (0, 0) where unreadable.
    For platforms whose device memory is host memory (cpu, CPU-emulated devices)."""
    total = avail = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key == "MemTotal":
                total = int(value.split()[0]) * 1024
            elif key == "MemAvailable":
                avail = int(value.split()[0]) * 1024
    return total, avail


HUGE_PAGE = 2 * 2**20  # x86-64 and aarch64 transparent huge page size


def host_zeros(nbytes: int, prefault: bool = False) -> torch.Tensor:
    """`nbytes` zeroed bytes of host memory as a uint8 tensor, for large long-lived buffers
    (KV caches, packed weights). Anonymous memory is mapped lazily (gigabytes cost nothing until
    written) and, where the kernel offers it, advised to use transparent huge pages with a 2 MiB
    aligned start: streaming reads then avoid a TLB miss every 4 KiB (weights read by a batch-1
    decode: 24 -> 34 GB/s on the CI machine's Zen 4). `prefault`: every page is touched now
    (torch's parallel fill), not by whichever step first writes it."""
    import mmap

    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared would be shmem
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # THP disabled ("never") or unsupported: plain pages
            buf.madvise(mmap.MADV_HUGEPAGE)
    flat = torch.frombuffer(buf, dtype=torch.uint8)  # keeps `buf` alive
    start = -flat.data_ptr() % HUGE_PAGE
    out = flat[start : start + nbytes]
    if prefault:
        out.zero_()
    return out


# --------------------------------------------------------------------------------------------
# KV-cache dtypes
# --------------------------------------------------------------------------------------------

# `--kv-cache-dtype` values -> what the cache tensor holds (None: the model's dtype). "fp8" is
# "fp8_e4m3" (as in vLLM). The 8-bit formats, as core's reference stores them (`quantize_kv`):
#   fp8_e4m3 / fp8_e5m2: each element cast to OCP float8 (e4m3fn: +-448; e5m2: +-57344),
#     saturating, round to nearest even. Per-layer scales (a checkpoint's k_scale / v_scale) are
#     applied by the model, not the backend: it stores k / k_scale and v / v_scale and
#     compensates in q and in the attention output, so a backend stores and reads scale-free fp8.
#   int8: each (token, KV head) row of head_size values symmetric-quantized with its own fp32
#     scale (amax / 127, round half to even): head_size int8 values, then the scale's 4 bytes.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
QUANTIZED_KV_CACHE_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
KV_SCALE_BYTES = 4  # int8: one fp32 scale per (token, KV head) row, after its values


def kv_cache_dtype_name(name: str) -> str:
    """The canonical name of a `--kv-cache-dtype` value ("fp8" -> "fp8_e4m3"); ValueError if unknown."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown --kv-cache-dtype {name!r}; use one of {list(KV_CACHE_DTYPES)}")
    return "fp8_e4m3" if name == "fp8" else name


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the cache tensor for `--kv-cache-dtype name` with a model in `model_dtype`."""
    return KV_CACHE_DTYPES[kv_cache_dtype_name(name)] or model_dtype


def is_quantized_kv(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype holds 8-bit values (with scales), not the model's own."""
    return dtype in QUANTIZED_KV_CACHE_DTYPES


def kv_row_bytes(head_size: int, cache_dtype: torch.dtype) -> int:
    """Bytes one (token, KV head) row of K (or of V) takes in a cache of `cache_dtype`; the pool is
    sized by this, and a backend's `kv_cache_shape` must hold exactly that many bytes per row."""
    if cache_dtype == torch.int8:
        return head_size + KV_SCALE_BYTES
    return head_size * torch.empty((), dtype=cache_dtype).element_size()


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """K or V rows x [..., head_size] as stored in a cache of the 8-bit `cache_dtype` (core's
    reference formats, above): fp8 -> [..., head_size] in that dtype; int8 -> [..., head_size + 4]
    int8, the row's fp32 scale in the last 4 bytes. Computed in fp32."""
    xf = x.float()
    if cache_dtype == torch.int8:
        amax = xf.abs().amax(dim=-1, keepdim=True)
        scale = amax / 127.0
        q = torch.where(amax > 0, torch.round(xf / torch.where(amax > 0, scale, 1.0)), 0.0)
        q = q.clamp(-127, 127).to(torch.int8)
        return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)
    if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        fmax = torch.finfo(cache_dtype).max
        return xf.clamp(-fmax, fmax).to(cache_dtype)
    raise ValueError(f"{cache_dtype} is not an 8-bit KV-cache dtype {QUANTIZED_KV_CACHE_DTYPES}")


def dequantize_kv(rows: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_kv` (by the rows' dtype), in fp32: int8 [..., head_size + 4] or fp8
    [..., head_size] -> [..., head_size]."""
    if rows.dtype == torch.int8:
        d = rows.shape[-1] - KV_SCALE_BYTES
        scale = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]
        return rows[..., :d].float() * scale
    return rows.float()


@dataclass(frozen=True)
class KVCacheSpec:
    """What one attention layer stores per token; the pool is sized from this."""

    num_layers: int
    num_kv_heads: int  # per tensor-parallel rank
    head_size: int
    dtype: torch.dtype  # the model's
    cache_dtype: torch.dtype | None = None  # what the cache holds (`--kv-cache-dtype`); None: `dtype`

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.cache_dtype or self.dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * kv_row_bytes(self.head_size, self.storage_dtype)

    def bytes_per_block(self, block_size: int) -> int:
        return self.bytes_per_token * block_size


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built once per batch by the model runner.

    The batch is a flat list of tokens, grouped by request in `query_start_loc` order. Request i
    owns query tokens ``query_start_loc[i]:query_start_loc[i+1]``; these are the *last*
    ``query_len_i`` tokens of its sequence of ``seq_lens[i]`` tokens, so a decode has
    query_len 1 and a prefill chunk attends causally to its cached prefix plus itself.

    Tensors live on the model's device. The `*_cpu` lists are host copies made while building
    the batch, so backends that loop or bucket on the host need no device sync.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot (block * block_size + offset); -1 = skip
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_reqs] int32: cached + new tokens, per request
    block_tables: torch.Tensor  # [num_reqs, max_num_blocks] int32 (padding entries are 0)
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_start_loc_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    num_decode_tokens: int = 0  # decodes come first in the batch: requests [0, num_decodes) have query_len 1
    backend_data: Any = None  # whatever `AttentionBackend.prepare` adds

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


class GraphCaptureSupport(enum.Enum):
    """How far an attention backend can be captured in a graph."""

    NEVER = "never"  # eager only
    DECODE_ONLY = "decode_only"  # uniform batches of query_len 1
    ALWAYS = "always"  # any batch shape (static metadata buffers)


# Per-layer attention features a model may ask for, passed to `AttentionBackend.forward` as
# keyword arguments of these names (never when a layer does not use them; semantics in
# `portside.attention.reference`):
#   sliding_window: int   a query at position p sees keys at positions p - window < k <= p
#   logit_softcap: float  scores -> cap * tanh(scores / cap) before the mask and the softmax
ATTENTION_FEATURES = ("sliding_window", "logit_softcap")


class AttentionBackend(ABC):
    """Paged attention for one platform. Stateless apart from configuration.

    The cache of one layer is a single tensor whose shape the backend chooses (see
    `kv_cache_shape`); core only allocates it and hands it back.

    Per-layer features (`ATTENTION_FEATURES`): a backend lists in `features` those its `forward`
    takes as keyword arguments. For a layer that needs one it does not list, core runs its own
    reference over the backend's `write_kv`/`read_kv` instead (correct whatever the layout, slow,
    eager only); a backend whose graphs cannot run that lists the feature in
    `unsupported_features`, and the platform then refuses the model, naming the feature.

    8-bit caches (`--kv-cache-dtype`, `KV_CACHE_DTYPES`): a backend lists in `kv_cache_dtypes`
    the formats it stores besides the model's dtype ("auto"); core refuses any other. For such a
    cache, `kv_cache_shape` is called with `cache_dtype` (the cache tensor's dtype) and the
    tensor's dtype tells `write_kv` / `read_kv` / `forward` which format it holds: they quantize
    on write, and `read_kv` returns fp32 values. The layout (scales included) is the backend's,
    but its bytes per (token, KV head) row must be `kv_row_bytes` (core sizes the pool by it);
    `quantize_kv` / `dequantize_kv` are the reference formats, which an implementation must match
    within `portside.testing.tolerances`.
    """

    name: ClassVar[str] = "abstract"
    graph_support: ClassVar[GraphCaptureSupport] = GraphCaptureSupport.NEVER
    features: ClassVar[frozenset[str]] = frozenset()
    unsupported_features: ClassVar[frozenset[str]] = frozenset()
    kv_cache_dtypes: ClassVar[frozenset[str]] = frozenset({"auto"})  # canonical `KV_CACHE_DTYPES` names

    @abstractmethod
    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Shape of one layer's cache (K and V together). A backend that lists 8-bit formats in
        `kv_cache_dtypes` takes a keyword argument ``cache_dtype: torch.dtype | None = None``,
        which core passes (only) for such a cache."""

    @abstractmethod
    def write_kv(
        self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store key/value ([num_tokens, num_kv_heads, head_size]) at `slot_mapping` (-1: skip),
        quantized when the cache is 8-bit."""

    @abstractmethod
    def read_kv(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Read back K and V ([len(slots), num_kv_heads, head_size]) at `slots`, dequantized to
        fp32 from an 8-bit cache. For tests and the conformance kit; not on the hot path."""

    def cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype: torch.dtype
    ) -> tuple[int, ...]:
        """`kv_cache_shape` for a cache of `cache_dtype`: with ``cache_dtype=`` for an 8-bit one,
        without it otherwise (so a backend written before 8-bit caches keeps its signature)."""
        if is_quantized_kv(cache_dtype):
            return self.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype=cache_dtype)  # type: ignore[call-arg]
        return self.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write key/value into `kv_cache`, then attend. Returns [num_tokens, num_heads, head_size]."""

    def encoder_attention(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_heads, head_size]
        cu_seqlens: torch.Tensor,  # [num_seqs + 1] int32 on the device: sequence s is rows [cu[s], cu[s+1])
        max_seqlen: int,
        scale: float,
    ) -> torch.Tensor:
        """Non-causal attention within each sequence, no KV cache (vision encoders: one image,
        or one window of an image, per sequence). Returns [num_tokens, num_heads, head_size] in
        the query's dtype. Default: core's reference (`portside.attention.reference.encoder_attention`)."""
        from portside.attention.reference import encoder_attention

        return encoder_attention(query, key, value, cu_seqlens, max_seqlen, scale)

    # Host caches only: map every page at allocation (`host_zeros(prefault=True)`) rather than
    # when a step first writes its blocks. A platform sets it on the backend it returns.
    prefault_host_cache: bool = False

    def allocate_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed cache tensor for one layer. On host memory it comes from `host_zeros`: pages
        are mapped lazily as blocks are first written (or all now, `prefault_host_cache`), and
        huge where the kernel allows."""
        if device.type == "cpu":
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            return host_zeros(nbytes, prefault=self.prefault_host_cache).view(dtype).view(shape)
        return torch.zeros(shape, dtype=dtype, device=device)

    def prepare(self, metadata: AttentionMetadata) -> AttentionMetadata:
        """Add backend-specific data (`metadata.backend_data`) once per step. Default: nothing."""
        return metadata

    def supports(self, head_size: int, dtype: torch.dtype, block_size: int) -> str | None:
        """None if this configuration is supported, else the reason why not."""
        return None


@dataclass
class ForwardContext:
    """Everything attention layers need for one forward pass, passed explicitly (no globals)."""

    backend: AttentionBackend
    kv_caches: Sequence[torch.Tensor]  # one per layer (may be empty for a cache-less forward)
    metadata: AttentionMetadata

    def attention(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, **features: Any
    ) -> torch.Tensor:
        """Layer `layer_idx`'s paged attention. `features`: the layer's `ATTENTION_FEATURES`
        (`PiecewiseModel.attention_features`), None values meaning not used."""
        used = {name: value for name, value in features.items() if value is not None}
        cache = self.kv_caches[layer_idx]
        if not used:
            return self.backend.forward(q, k, v, cache, self.metadata, scale)
        if used.keys() <= self.backend.features:
            return self.backend.forward(q, k, v, cache, self.metadata, scale, **used)
        from portside.attention.reference import attention_through_read_kv

        return attention_through_read_kv(self.backend, q, k, v, cache, self.metadata, scale, **used)


# --------------------------------------------------------------------------------------------
# Graph capture
# --------------------------------------------------------------------------------------------

# model_fn(input_ids [T], positions [T], ctx) -> hidden states [T, hidden] (before the LM head).
ModelFn = Callable[[torch.Tensor, torch.Tensor, ForwardContext], torch.Tensor]
# (query, key, value, cu_seqlens, max_seqlen, scale) -> out: `AttentionBackend.encoder_attention`
EncoderAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


@runtime_checkable
class PiecewiseModel(Protocol):
    """A model cut at its attention calls. The runner hands graph runners the model itself as
    `model_fn`; one that compiles only the dense parts (OpenVINO segments, piecewise graphs)
    checks ``isinstance(model_fn, PiecewiseModel)`` and runs paged attention between the pieces:

        h, aux = embed(input_ids, positions)          # aux: per-token tensors every layer uses (rotary)
        for i in range(num_layers):
            q, k, v = pre_attention(i, h, aux)        # q [T, H, D]; k, v [T, KVH, D]
            o = ctx.attention(i, q, k, v, attention_scale(i), **attention_features(i))
            h = post_attention(i, h, o)               # o [T, H, D] -> h [T, hidden]
        hidden = final_norm(h)

    equals ``model_fn(input_ids, positions, ctx)``. `attention_features(i)` is layer i's
    `ATTENTION_FEATURES` as keyword arguments (empty for a Llama); a runner written before it
    existed may read it with ``getattr(model, "attention_features", None)``.
    """

    @property
    def num_layers(self) -> int: ...

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]: ...

    def pre_attention(self, i: int, h: torch.Tensor, aux: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...

    def post_attention(self, i: int, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor: ...

    def final_norm(self, h: torch.Tensor) -> torch.Tensor: ...

    def attention_scale(self, i: int) -> float: ...

    def attention_features(self, i: int) -> dict[str, Any]: ...


class GraphRunner(ABC):
    """Runs the model for one step; may capture and replay graphs for shapes it prepared.

    `capture` is called once after the KV cache exists (it may run the model on dummy inputs);
    `__call__` then runs every step with exactly the arguments `model_fn` takes.
    """

    name: ClassVar[str] = "abstract"
    # Pipeline parallelism: whether it can run one stage of a model, whose `embed` returns the
    # previous stage's hidden states (the model's `stage_input`, set by the runner before each
    # call; zeros in a call without one, such as a warm-up on dummy inputs), and which has no LM
    # head unless it is the last stage. A runner that captures or compiles the embedding leaves
    # this False; the engine then runs such stages with `EagerGraphRunner`. The same goes for a
    # vision-language model's steps with image rows: `stage_input` then holds the step's token
    # embeddings with the images' merged in.
    supports_pipeline_stages: ClassVar[bool] = False

    def __init__(self, model_fn: ModelFn, config: EngineConfig) -> None:
        self.model_fn = model_fn
        self.config = config

    def capture(self, make_dummy_context: Callable[[int], ForwardContext]) -> None:
        """Prepare graphs. `make_dummy_context(num_decodes)` builds a decode-only context
        (with valid scratch KV slots) for a padded batch of that size. Default: nothing."""

    @abstractmethod
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head: hidden [N, hidden] of the sampled rows -> logits [N, vocab]. Default: the
        model's own (`model_fn.compute_logits`); a runner may compile it with the model."""
        return self.model_fn.compute_logits(hidden)  # type: ignore[attr-defined]

    def logits(self, hidden: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] of rows `indices` ([N] int64) of this step's `hidden` (what the last
        `__call__` returned), called at most once per step. Default: `compute_logits` of those
        rows; a runner that already computed them in the step's graph returns those."""
        return self.compute_logits(hidden[indices])


class EagerGraphRunner(GraphRunner):
    """No capture: every step runs the model eagerly. The fallback every platform can use."""

    name = "eager"
    supports_pipeline_stages = True

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model_fn(input_ids, positions, ctx)


# --------------------------------------------------------------------------------------------
# Collectives
# --------------------------------------------------------------------------------------------


class Communicator(ABC):
    """Collectives over one tensor-parallel group. All methods are collective calls."""

    name: ClassVar[str] = "abstract"

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.rank = rank
        self.world_size = world_size

    @abstractmethod
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks; returns the result (may be `x` reduced in place)."""

    @abstractmethod
    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in rank order."""

    @abstractmethod
    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`src`'s tensor on every rank."""

    @abstractmethod
    def barrier(self) -> None: ...

    def destroy(self) -> None:
        """Release the group. Default: nothing."""

    # Point-to-point, between pipeline-parallel stages (each rank sends its stage's output to the
    # same tensor-parallel rank of the next stage). Ranks here are global ranks of the world, not
    # of this group. The defaults use torch.distributed's default group (blocking send / recv),
    # so a communicator written before pipeline parallelism works unchanged; a platform whose
    # collectives are not torch.distributed's overrides both, or sets
    # `Platform.supports_pipeline_parallel = False`.

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Send `x` to global rank `dst`, which calls `recv` with a tensor of its shape and dtype."""
        import torch.distributed as dist

        dist.send(x.contiguous(), dst=dst)

    def recv(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Receive global rank `src`'s `send` into `x` (shape and dtype agreed beforehand); returns `x`."""
        import torch.distributed as dist

        dist.recv(x, src=src)
        return x


class SingleRankCommunicator(Communicator):
    """World size 1: every collective is the identity."""

    name = "single"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        return x

    def barrier(self) -> None:
        return None


class TorchDistributedCommunicator(Communicator):
    """Collectives through an initialised torch.distributed process group (gloo, nccl, ...).

    Backends whose collectives torch.distributed already speaks subclass this and only choose
    the process-group backend name (`Platform.dist_backend`). Traced by `torch.compile`, the
    collectives are the opaque `portside::` operators (`portside.distributed.collectives`), which
    find the group by name when they run: a compiled graph that held the group itself would keep
    it alive past `destroy_process_group`.
    """

    name = "torch.distributed"

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        from portside.distributed import collectives  # registers the operators before any tracing

        self._dist = dist
        self._ops = collectives
        self.group = group
        pg = dist.group.WORLD if group is None else group
        if pg is None:
            raise RuntimeError("TorchDistributedCommunicator needs an initialised torch.distributed process group")
        self.group_name = pg.group_name
        super().__init__(dist.get_rank(group), dist.get_world_size(group))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            if torch.compiler.is_compiling():
                self._ops.all_reduce(x, self.group_name)
            else:
                self._dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return x
        if torch.compiler.is_compiling():
            return self._ops.all_gather(x, dim, self.world_size, self.group_name)
        return self._ops.gather(x, dim, self.world_size, self.group)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`src` is a rank of this group (torch.distributed takes a global one)."""
        if self.world_size > 1:
            if self.group is not None:
                src = self._dist.get_global_rank(self.group, src)
            if torch.compiler.is_compiling():
                self._ops.broadcast(x, src, self.group_name)
            else:
                self._dist.broadcast(x, src=src, group=self.group)
        return x

    def barrier(self) -> None:
        if self.world_size > 1:
            self._dist.barrier(group=self.group)


# --------------------------------------------------------------------------------------------
# Model-layer kernels
# --------------------------------------------------------------------------------------------


class ModelOps:
    """Kernels of model layers other than attention (`Platform.model_ops`). Every method's
    default is core's pure-torch reference (`portside.ops`), so a platform that overrides none
    runs every model correctly; a backend overrides what it has a faster kernel for, and the
    conformance kit tests each override against the reference.

    Mixture-of-experts (shapes in `portside.ops.moe`): `fused_moe` routes (`select_experts`)
    then computes the experts (`moe_experts`); a backend usually overrides `moe_experts` only.

    Quantized weights (`portside.quant.weight.QuantWeight`): `prepare_quantized` re-lays a
    loaded weight once, `quantized_linear` multiplies by it; a backend overrides the formats it
    has kernels for and hands the rest to ``super()``.

    Batched multi-LoRA (shapes in `portside.ops.lora`): `lora_shrink` multiplies each token by
    its adapter slot's A, `lora_expand` adds its product with the slot's B into a column range of
    the layer's output; the `LoRAMapping` (token -> slot) is shared by every layer of a step. On
    a platform with ``supports_lora = False`` neither is called.
    """

    name: ClassVar[str] = "reference"

    @staticmethod
    def activate(gate: torch.Tensor, activation: str) -> torch.Tensor:
        """An expert's activation by name ("silu", "gelu_tanh"), for kernels that need it in torch."""
        from portside.ops.moe import activate

        return activate(gate, activation)

    def select_experts(
        self, router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits [T, E] -> (weights [T, top_k] fp32, expert ids [T, top_k] int64)."""
        from portside.ops.moe import select_experts

        return select_experts(router_logits, top_k, renormalize, scoring)

    def moe_experts(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: str = "silu",
    ) -> torch.Tensor:
        """x [T, hidden], w13 [E, 2I, hidden], w2 [E, hidden, I] -> [T, hidden] in x's dtype."""
        from portside.ops.moe import moe_experts

        return moe_experts(x, w13, w2, topk_weights, topk_ids, activation)

    # ---- quantized weights (`portside.quant`: canonical layouts in `portside.quant.weight`) ---

    def prepare_quantized(self, weight: QuantWeight) -> QuantWeight:
        """Called once per quantized layer after loading: re-lay `weight` the way this
        platform's kernels read it (register further buffers on it, set ``weight.layout``), or
        return another `QuantWeight`. The canonical buffers should stay valid: the reference
        (and a kernel declining an input) reads them. Default: as loaded."""
        return weight

    def quantized_linear(self, x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] -> [T, N] in x's dtype: x @ dequantize(weight)^T + bias, activations first
        rounded per token where ``weight.act`` says (W8A8). Default: dequantize, then matmul."""
        from portside.quant.weight import quantized_linear

        return quantized_linear(x, weight, bias)

    def quantized_embedding(self, ids: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
        """Rows `ids` [T] of a quantized embedding table -> fp32 [T, hidden] (GGUF embeddings)."""
        from portside.quant.weight import quantized_embedding

        return quantized_embedding(ids, weight)

    def quantized_moe_experts(
        self,
        x: torch.Tensor,
        w13: QuantWeight,
        w2: QuantWeight,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: str = "silu",
    ) -> torch.Tensor:
        """`moe_experts` with stacked quantized experts (w13 [E, 2I, hidden], w2 [E, hidden, I]
        as `QuantWeight`s; w13 a `QuantParts` [gate, up] where their act orders differ). Default:
        each expert routed to through `quantized_linear`."""
        from portside.ops.moe import moe_experts

        return moe_experts(x, w13, w2, topk_weights, topk_ids, activation, linear=self._expert_parts_linear)

    def _expert_parts_linear(self, x: torch.Tensor, w: Any, e: int) -> torch.Tensor:
        if isinstance(w, torch.nn.ModuleList):  # `QuantParts`: each part's expert e, concatenated
            parts: list[Any] = list(w)
            return torch.cat([self._expert_linear(x, part, e) for part in parts], dim=-1)
        return self._expert_linear(x, w, e)

    def _expert_linear(self, x: torch.Tensor, w: QuantWeight, e: int) -> torch.Tensor:
        return self.quantized_linear(x, w.expert(e))

    # ---- batched multi-LoRA (`portside.ops.lora`) -------------------------------------------

    def lora_shrink(self, x: torch.Tensor, a: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
        """x [T, in], a [S, R, in] -> y [T, R] in x's dtype: y[t] = x[t] @ a[slot[t]].T (fp32
        accumulation); 0 for tokens without an adapter."""
        from portside.ops.lora import lora_shrink

        return lora_shrink(x, a, mapping)

    def lora_expand(
        self, y: torch.Tensor, b: torch.Tensor, mapping: LoRAMapping, out: torch.Tensor, out_offset: int = 0
    ) -> None:
        """In place: out[t, out_offset : out_offset + N] += y[t] @ b[slot[t]].T for tokens with an
        adapter; y [T, R] (possibly a column slice of a wider tensor), b [S, N, R], out [T, M]."""
        from portside.ops.lora import lora_expand

        lora_expand(y, b, mapping, out, out_offset)

    def fused_moe(
        self,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        top_k: int,
        renormalize: bool,
        scoring: str = "softmax",
        activation: str = "silu",
    ) -> torch.Tensor:
        weights, ids = self.select_experts(router_logits, top_k, renormalize, scoring)
        return self.moe_experts(x, w13, w2, weights, ids, activation)


# --------------------------------------------------------------------------------------------
# The platform
# --------------------------------------------------------------------------------------------


class Platform(ABC):
    """One kind of hardware. Capabilities are class-level data; parts are built on request.

    Subclasses set the class variables and implement the abstract methods. `is_available` must be
    cheap and must not initialise the device runtime (no context creation, no allocation).
    """

    name: ClassVar[str]  # the --device value: "cuda", "rocm", "tpu", "cpu", or a vendor's
    device_type: ClassVar[str]  # torch device type: "cuda", "xla", "cpu", "privateuseone", ...
    dist_backend: ClassVar[str]  # torch.distributed backend: "nccl", "gloo", "xla", ...
    priority: ClassVar[int] = 0  # auto-selection: highest available wins (cpu is 0)
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
    block_sizes: ClassVar[tuple[int, ...]] = (16,)  # allowed KV block sizes
    default_block_size: ClassVar[int] = 16
    # `--kv-cache-dtype` values accepted (canonical `KV_CACHE_DTYPES` names); the attention
    # backend built for one must list it in its own `kv_cache_dtypes`
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    # batched multi-LoRA (`enable_lora`): the model calls `ModelOps.lora_shrink` / `lora_expand`
    # (the defaults are core's references); False makes the engine refuse LoRA, naming it
    supports_lora: ClassVar[bool] = True
    # pipeline parallelism (`pipeline_parallel_size` > 1): stages exchange hidden states through
    # `Communicator.send` / `recv` (defaults: torch.distributed); False makes the engine refuse it
    supports_pipeline_parallel: ClassVar[bool] = True

    # ---- probe and device ------------------------------------------------------------------

    @classmethod
    @abstractmethod
    def is_available(cls) -> Availability:
        """Can this platform run here? Cheap; never initialises the device runtime."""

    @classmethod
    @abstractmethod
    def device_info(cls) -> DeviceInfo: ...

    @classmethod
    def device(cls, local_rank: int = 0) -> torch.device:
        return torch.device(cls.device_type, local_rank) if cls.device_type != "cpu" else torch.device("cpu")

    @classmethod
    def set_device(cls, local_rank: int) -> None:
        """Make `local_rank`'s device current for this process. Default: nothing."""

    @classmethod
    def synchronize(cls) -> None:
        """Wait for queued device work. Default: nothing (synchronous devices)."""

    @classmethod
    def inference_mode(cls) -> contextlib.AbstractContextManager:
        return torch.inference_mode()

    @classmethod
    def seed(cls, seed: int) -> None:
        torch.manual_seed(seed)

    # KV-cache size when the user gives none: a fraction (<= 1) of free memory, or bytes (> 1)
    default_kv_cache_memory: ClassVar[float] = 0.9
    # pipeline parallelism: the most tokens a micro-batch takes by default (a stage waits one
    # micro-batch's time while the pipeline fills and drains, so the smallest count at which
    # the device is still efficient; --pipeline-micro-batch-tokens overrides it); None: no cap,
    # a micro-batch takes max_num_batched_tokens / pipeline_micro_batches
    pipeline_micro_batch_tokens: ClassVar[int | None] = None
    # platform options that --enforce-eager (EngineArgs.enforce_eager) sets: no graph capture or
    # compilation; None: the platform has no eager mode (the flag only warns)
    eager_options: ClassVar[dict[str, str] | None] = None

    @classmethod
    def auto_dtype(cls, checkpoint_dtype: torch.dtype) -> torch.dtype:
        """What dtype "auto" means here for a checkpoint stored in `checkpoint_dtype`.
        Default: the checkpoint's own dtype when supported, else the first supported one."""
        return checkpoint_dtype if checkpoint_dtype in cls.supported_dtypes else cls.supported_dtypes[0]

    # ---- configuration -----------------------------------------------------------------------

    @classmethod
    def check_and_update_config(cls, config: EngineConfig) -> EngineConfig:
        """Return a (new, frozen) config adjusted for this platform, or raise ValueError naming the
        fix. Default: fill in the block size and check it, the dtype and the KV-cache dtype
        (naming "fp8" by its canonical name, "fp8_e4m3")."""
        import dataclasses

        cache = config.cache
        if cache.block_size is None:
            cache = dataclasses.replace(cache, block_size=cls.default_block_size)
        kv_dtype = kv_cache_dtype_name(cache.kv_cache_dtype)
        if kv_dtype not in cls.kv_cache_dtypes:
            raise ValueError(
                f"--kv-cache-dtype {cache.kv_cache_dtype} is not supported by the {cls.name} platform; "
                f"use one of {list(cls.kv_cache_dtypes)}"
            )
        if kv_dtype != cache.kv_cache_dtype:
            cache = dataclasses.replace(cache, kv_cache_dtype=kv_dtype)
        if cache.block_size not in cls.block_sizes:
            raise ValueError(
                f"block size {cache.block_size} is not supported by the {cls.name} platform; "
                f"use one of {list(cls.block_sizes)}"
            )
        if config.model.dtype not in cls.supported_dtypes:
            raise ValueError(
                f"dtype {config.model.dtype} is not supported by the {cls.name} platform; "
                f"use one of {[str(d).removeprefix('torch.') for d in cls.supported_dtypes]}"
            )
        return dataclasses.replace(config, cache=cache)

    @classmethod
    def prepare_model(cls, model: torch.nn.Module, config: EngineConfig) -> None:
        """Called once after the weights are loaded, before the graph runner is built: place or
        re-lay weights the way this platform's kernels read them fastest. Default: nothing."""

    # ---- the three parts -----------------------------------------------------------------------

    @classmethod
    @abstractmethod
    def attention_backend(cls, config: EngineConfig) -> AttentionBackend: ...

    @classmethod
    def graph_runner(cls, model_fn: ModelFn, config: EngineConfig) -> GraphRunner:
        return EagerGraphRunner(model_fn, config)

    @classmethod
    def sampler(cls, config: EngineConfig) -> Sampler:
        """The sampler the model runner uses. Default: core's, all torch ops; a platform may pass
        faster kernels for its steps (`Sampler`'s `argmax`)."""
        return Sampler()

    @classmethod
    def model_ops(cls, config: EngineConfig) -> ModelOps:
        """The kernels model layers call beyond attention (mixture-of-experts, ...). Default:
        core's references (`ModelOps`)."""
        return ModelOps()

    @classmethod
    def communicator(cls, group: Any = None) -> Communicator:
        """Collectives over `group` (None: the default process group, or world size 1 when
        torch.distributed is not initialised)."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return SingleRankCommunicator()
        return TorchDistributedCommunicator(group)

    # ---- description ---------------------------------------------------------------------------

    @classmethod
    def describe(cls) -> dict[str, str]:
        """Implementation names for `portside devices`, without building anything heavy."""
        return {
            "attention": getattr(cls, "attention_name", "?"),
            "graph": getattr(cls, "graph_name", "eager"),
            "collectives": getattr(cls, "collectives_name", cls.dist_backend),
        }

