"""Attention: the paged `AttentionBackend` a platform supplies, the per-step `AttentionMetadata`
it reads, the `ForwardContext` models call it through, and what a layer's cache holds
(`KVCacheSpec`). Core's references (`portside.ops.attention`, `portside.attention.reference`)
are the oracle every backend is tested against.
"""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch

from portside.contract.kv_quant import is_quantized_kv
from portside.contract.kv_spec import KVCacheSpec
from portside.contract.latent import LatentAttention
from portside.contract.memory import host_zeros
from portside.ops.attention import attention_through_read_kv
from portside.ops.attention import encoder_attention as reference_encoder_attention

__all__ = [
    "ATTENTION_FEATURES",
    "reference_encoder_attention",
    "ENCODER_ATTENTION_FEATURES",
    "AttentionBackend",
    "AttentionMetadata",
    "EncoderAttention",
    "ForwardContext",
    "GraphCaptureSupport",
    "KVCacheSpec",
]

ATTENTION_FEATURES = ("sliding_window", "logit_softcap", "sinks")
"""Per-layer attention features a model may ask for, passed to `AttentionBackend.forward` as
keyword arguments of these names (never when a layer does not use them; semantics in
`portside.attention.reference`):

- ``sliding_window: int``: a query at position p sees keys at positions p - window < k <= p;
- ``logit_softcap: float``: scores -> cap * tanh(scores / cap) before the mask and the softmax;
- ``sinks: torch.Tensor``: [num_heads on this rank] fp32 learned logits (gpt-oss), one per query
  head, that join each query's softmax denominator and contribute no value: the output is
  ``sum_k exp(s_k) v_k / (exp(sink) + sum_k exp(s_k))``.
"""

ENCODER_ATTENTION_FEATURES = ("sliding_window",)
"""Features of bidirectional (encoder) attention a layer may ask for, passed to
`AttentionBackend.encoder_attention` as keyword arguments of these names by a backend that lists
them in `encoder_features` (core's reference, `portside.ops.attention.encoder_attention`, runs
them for any other):

- ``sliding_window: int``: local attention (ModernBERT's local layers): a query at position p
  of its sequence sees the keys at positions k with ``|p - k| <= window``.
"""

EncoderAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]
"""(query, key, value, cu_seqlens, max_seqlen, scale) -> out: `AttentionBackend.encoder_attention`."""


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

    slot_mapping: torch.Tensor
    """[num_tokens] int64: each token's cache slot (block * block_size + offset); -1: skip."""
    query_start_loc: torch.Tensor
    """[num_reqs + 1] int32: cumulative query lengths."""
    seq_lens: torch.Tensor
    """[num_reqs] int32: cached + new tokens, per request."""
    block_tables: torch.Tensor
    """[num_reqs, max_num_blocks] int32: each request's blocks (padding entries are 0)."""
    max_query_len: int
    """The longest query of the batch."""
    max_seq_len: int
    """The longest sequence of the batch."""
    block_size: int
    """Tokens per KV block."""
    query_start_loc_cpu: list[int] = field(default_factory=list)
    """`query_start_loc` on the host."""
    seq_lens_cpu: list[int] = field(default_factory=list)
    """`seq_lens` on the host."""
    num_decode_tokens: int = 0
    """Decodes come first in the batch: requests [0, num_decode_tokens) have query_len 1."""
    backend_data: Any = None
    """Whatever `AttentionBackend.prepare` adds."""

    @property
    def num_reqs(self) -> int:
        """Requests in the batch."""
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        """Tokens in the batch (padding included)."""
        return self.slot_mapping.shape[0]


class GraphCaptureSupport(enum.Enum):
    """How far an attention backend can be captured in a graph."""

    NEVER = "never"
    """Eager only."""
    DECODE_ONLY = "decode_only"
    """Uniform batches of query_len 1."""
    ALWAYS = "always"
    """Any batch shape (static metadata buffers)."""


_Plan = TypeVar("_Plan")


class AttentionBackend(LatentAttention, ABC):
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
    within `portside.testing.tolerances`. The KV connectors move the rows as stored
    (`read_stored_kv` / `write_stored_kv`): a backend with its own int8 layout overrides both.

    Latent attention (MLA, DeepSeek-V2/V3): the `LatentAttention` methods (`latent_cache_shape`,
    `write_latent`, `read_latent`, `latent_attention`), inherited with core's reference as their
    defaults; see `portside.contract.latent`.
    """

    name: ClassVar[str] = "abstract"
    """The implementation's name, in logs and in the errors that refuse a model or a cache."""
    graph_support: ClassVar[GraphCaptureSupport] = GraphCaptureSupport.NEVER
    """How far a graph runner may capture this backend's `forward`."""
    features: ClassVar[frozenset[str]] = frozenset()
    """The `ATTENTION_FEATURES` its `forward` takes as keyword arguments."""
    unsupported_features: ClassVar[frozenset[str]] = frozenset()
    """Features core's eager fallback cannot stand in for here (the platform's graphs cannot run
    it): the model runner refuses a model that needs one, naming it."""
    encoder_features: ClassVar[frozenset[str]] = frozenset()
    """The `ENCODER_ATTENTION_FEATURES` its `encoder_attention` takes as keyword arguments; for a
    layer that needs another one, core runs its reference (plain torch, eager) instead."""
    kv_cache_dtypes: ClassVar[frozenset[str]] = frozenset({"auto"})
    """The cache formats it stores (canonical `KV_CACHE_DTYPES` names; "auto": the model's dtype)."""
    prefault_host_cache: bool = False
    """Host caches only: map every page at allocation (`host_zeros(prefault=True)`) rather than
    when a step first writes its blocks. A platform sets it on the backend it returns."""

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

    def read_stored_kv(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows at `slots` exactly as the cache stores them, [len(slots), num_kv_heads, row]
        in the cache's dtype: the model's values, an fp8 cache's float8 values, or an int8 cache's
        `quantize_kv` rows (head_size int8 values, then the 4 bytes of the row's fp32 scale). The
        KV connectors move these (`portside.contract.kv_transfer`), so a block saved and restored
        is bit-exact. Default: `read_kv` cast back to the cache's dtype (exact for those values),
        and for int8 core's layout (``[2, num_blocks, block_size, num_kv_heads, head_size + 4]``,
        the reference's and the cpu backend's) read directly; a backend storing int8 otherwise
        overrides this and `write_stored_kv` (the conformance kit checks both)."""
        if kv_cache.dtype == torch.int8:
            flat, s = _core_int8_rows(kv_cache, self.name), slots.long()
            return flat[0, s], flat[1, s]
        k, v = self.read_kv(kv_cache, slots)
        return k.to(kv_cache.dtype), v.to(kv_cache.dtype)

    def write_stored_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """Store rows `read_stored_kv` returned ([len(slots), num_kv_heads, row] in the cache's
        dtype) at `slots` unchanged: no quantization again. Default: `write_kv` (fed fp32 for an
        fp8 cache: its values convert back exactly) and core's int8 layout written directly."""
        if kv_cache.dtype == torch.int8:
            flat, s = _core_int8_rows(kv_cache, self.name), slots.long()
            flat[0, s] = key.to(torch.int8)
            flat[1, s] = value.to(torch.int8)
            return
        if is_quantized_kv(kv_cache.dtype):
            key, value = key.float(), value.float()
        self.write_kv(kv_cache, key, value, slots)

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
        """Write key/value into `kv_cache`, then attend. Returns [num_tokens, num_heads, head_size].
        Takes the `features` it lists as further keyword arguments."""

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
        or one window of an image, per sequence; encoder-only models: one prompt per sequence,
        `ForwardContext.encoder_attention`). Returns [num_tokens, num_heads, head_size] in the
        query's dtype. Takes the `encoder_features` it lists as further keyword arguments.
        Default: core's reference (`portside.ops.attention.encoder_attention`)."""
        return reference_encoder_attention(query, key, value, cu_seqlens, max_seqlen, scale)

    def allocate_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed cache tensor for one layer. On host memory it comes from `host_zeros`: pages
        are mapped lazily as blocks are first written (or all now, `prefault_host_cache`), and
        huge where the kernel allows."""
        if torch.empty(0, device=device).is_cpu:  # the device's memory is the host's
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            return host_zeros(nbytes, prefault=self.prefault_host_cache).view(dtype).view(shape)
        return torch.zeros(shape, dtype=dtype, device=device)

    def prepare(self, metadata: AttentionMetadata) -> AttentionMetadata:
        """Add backend-specific data (`metadata.backend_data`) once per step. Default: nothing."""
        return metadata

    def prepared(self, metadata: AttentionMetadata, kind: type[_Plan]) -> _Plan:
        """The step's plan: `metadata.backend_data` when `prepare` made one of type `kind`, else
        `prepare` run now (a caller that skipped it: a test, a captured graph's dummy step).
        A helper for backends whose `prepare` stores a plan object; not meant to be overridden."""
        plan = metadata.backend_data
        return plan if isinstance(plan, kind) else self.prepare(metadata).backend_data

    def supports(self, head_size: int, dtype: torch.dtype, block_size: int) -> str | None:
        """None if this configuration is supported, else the reason why not."""
        return None


@dataclass
class ForwardContext:
    """Everything one forward pass needs besides the token ids and positions, passed explicitly
    (no globals, nothing set on the model): what its attention layers need, and the step's input
    embeddings where the model does not embed the ids itself."""

    backend: AttentionBackend
    """The platform's attention backend."""
    kv_caches: Sequence[torch.Tensor]
    """One cache per layer (may be empty for a cache-less forward)."""
    metadata: AttentionMetadata
    """This step's metadata, after `AttentionBackend.prepare`."""
    inputs_embeds: torch.Tensor | None = None
    """This step's input [T, hidden] in place of the token embeddings, or None (the model embeds
    `input_ids`). Set per step by the runner: on a later pipeline stage the previous stage's hidden
    states; on a vision-language model's first stage, in a step with image rows, the tokens'
    embeddings with the images' rows merged in. Only a graph runner with
    `GraphRunner.supports_pipeline_stages` is handed a step with it set; it passes the context on
    to the model (``model_fn(input_ids, positions, ctx)``), or, calling `PiecewiseModel.embed`
    itself, passes this as its `inputs_embeds`."""

    state_caches: Sequence[tuple[torch.Tensor, ...]] = ()
    """Recurrent layers' states: per recurrent layer (counted from this stage's first), its state
    tensors ``[num_state_slots + 1, *shape]`` (`portside.contract.recurrent.StateSpec`); empty
    for a model without recurrent layers."""
    recurrent: Any = None
    """This step's `portside.contract.recurrent.RecurrentMetadata` (None without recurrent layers)."""
    token_type_ids: torch.Tensor | None = None
    """[T] int64 segment ids of the step's tokens (BERT's token types: 0 for the first text of a
    pair, 1 for the second), for an encoder-only model; None: all 0."""

    def attention(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, **features: Any
    ) -> torch.Tensor:
        """Layer `layer_idx`'s paged attention. `features`: the layer's `ATTENTION_FEATURES`
        (`PiecewiseModel.attention_features`), None values meaning not used. A feature the
        backend does not list runs core's reference over its `write_kv` / `read_kv`."""
        used = {name: value for name, value in features.items() if value is not None}
        cache = self.kv_caches[layer_idx]
        if not used:
            return self.backend.forward(q, k, v, cache, self.metadata, scale)
        if used.keys() <= self.backend.features:
            return self.backend.forward(q, k, v, cache, self.metadata, scale, **used)
        return attention_through_read_kv(self.backend, q, k, v, cache, self.metadata, scale, **used)

    def encoder_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          **features: Any) -> torch.Tensor:
        """Bidirectional attention of an encoder-only model's layer (BERT): each request's tokens
        of this step attend to all of its tokens of this step, no causal mask, nothing written to
        or read from a cache (the step holds each request's whole prompt: the runner never
        chunks such a model's prompts). q, k, v: [T, H, D]. `features`: the layer's
        `ENCODER_ATTENTION_FEATURES`, None values meaning not used; one the backend does not
        list in `encoder_features` runs core's reference."""
        md = self.metadata
        used = {name: value for name, value in features.items() if value is not None}
        if used.keys() <= self.backend.encoder_features:
            return self.backend.encoder_attention(q, k, v, md.query_start_loc, md.max_query_len, scale, **used)
        return reference_encoder_attention(q, k, v, md.query_start_loc, md.max_query_len, scale, **used)


def _core_int8_rows(kv_cache: torch.Tensor, backend: str) -> torch.Tensor:
    """An int8 cache in core's layout as [2, slots, num_kv_heads, head_size + 4] (a view)."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise NotImplementedError(
            f"attention backend {backend!r} stores its int8 KV cache as {tuple(kv_cache.shape)}, not core's "
            "[2, num_blocks, block_size, num_kv_heads, head_size + 4]: it must override read_stored_kv and "
            "write_stored_kv for the KV connectors (offload, swap, disaggregation) to move its blocks")
    two, nb, bs, kvh, row = kv_cache.shape
    return kv_cache.view(two, nb * bs, kvh, row)
