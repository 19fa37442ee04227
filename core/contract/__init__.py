"""The Platform contract: the one path a backend (in-tree or third-party) imports from portside.

A backend supplies a `Platform` subclass and its parts:

- an `AttentionBackend`: writes K/V into its paged cache at `slot_mapping` and attends over
  `block_tables` for a mixed batch of prefill chunks and decodes;
- a `GraphRunner`: runs the model for one step, replaying a captured graph where it can;
- a `Communicator`: the collectives tensor and pipeline parallelism need;
- optionally `ModelOps` (layer kernels beyond attention) and `Sampler` kernels, whose defaults
  are core's pure-torch references.

It registers through the entry-point group ``portside.platforms`` with a cheap ``register()``
function that returns the dotted path of its `Platform` class (``"pkg.module:Class"``), or None
when the package knows at once that it cannot run here. Nothing here imports a vendor runtime.

One module per part (each name is also importable from here):

- `platform`: `Platform`, `Availability`, `DeviceInfo`;
- `options`: `BackendOption` (what `Platform.backend_options` declares), `check_backend_options`;
- `attention`: `AttentionBackend`, `AttentionMetadata`, `ForwardContext`, `KVCacheSpec`,
  `GraphCaptureSupport`, `ATTENTION_FEATURES`, `ENCODER_ATTENTION_FEATURES`, `EncoderAttention`;
- `batch_invariant`: `BatchInvariantAttention` (any backend's cache, core's batch-invariant attention);
- `latent`: `LatentKVCacheSpec`, `LatentAttention` (multi-head latent attention, mixed into
  `AttentionBackend`);
- `kv_transfer`: `KVBlockLayout`, `KVBlockIO` (KV blocks in a layout-neutral form, for tiers and connectors);
- `kv_quant`: 8-bit KV caches, `KV_CACHE_DTYPES` and the reference formats (`quantize_kv`, ...);
- `graph`: `GraphRunner`, `EagerGraphRunner`, `ModelFn`, `PiecewiseModel`;
- `collectives`: `Communicator`, `SingleRankCommunicator`, `TorchDistributedCommunicator`;
- `model_ops`: `ModelOps`, `LoRAMapping`, `QuantWeight` / `QuantParts` and their layout helpers;
- `recurrent`: `StateSpec`, `RecurrentMetadata`, `RecurrentKernels` (recurrent layers' state and kernels);
- `sampling`: `Sampler`, `TokenBitmask`, `apply_token_bitmask`;
- `memory`: `host_memory`, `host_zeros`, `HUGE_PAGE`.

`portside.backend_api`, the contract's single module before, still resolves every name it had
(with a `DeprecationWarning`) for one release.
"""

# ruff: noqa: F401  (the names below are re-exported: `__all__` is computed from the parts' own)
from portside.contract import (
    attention,
    batch_invariant,
    collectives,
    graph,
    kv_quant,
    kv_transfer,
    latent,
    memory,
    model_ops,
    options,
    platform,
    recurrent,
    sampling,
)
from portside.contract.attention import (
    ATTENTION_FEATURES,
    ENCODER_ATTENTION_FEATURES,
    AttentionBackend,
    AttentionMetadata,
    EncoderAttention,
    ForwardContext,
    GraphCaptureSupport,
    KVCacheSpec,
    reference_encoder_attention,
)
from portside.contract.batch_invariant import BatchInvariantAttention
from portside.contract.collectives import Communicator, SingleRankCommunicator, TorchDistributedCommunicator
from portside.contract.graph import EagerGraphRunner, GraphRunner, ModelFn, PiecewiseModel
from portside.contract.kv_quant import (
    KV_CACHE_DTYPES,
    KV_SCALE_BYTES,
    QUANTIZED_KV_CACHE_DTYPES,
    dequantize_kv,
    is_quantized_kv,
    kv_cache_dtype_name,
    kv_cache_torch_dtype,
    kv_row_bytes,
    quantize_kv,
)
from portside.contract.kv_transfer import LATENT_ELEMENT_ORDER, NEUTRAL_ELEMENT_ORDER, KVBlockIO, KVBlockLayout
from portside.contract.latent import LatentAttention, LatentKVCacheSpec
from portside.contract.memory import HUGE_PAGE, host_memory, host_zeros, release_free_memory
from portside.contract.model_ops import (
    LoRAMapping,
    ModelOps,
    QuantParts,
    QuantWeight,
    pack_int4,
    quantize_activation,
    unpack_int4,
)
from portside.contract.options import BackendOption, check_backend_options
from portside.contract.platform import Availability, DeviceInfo, Platform
from portside.contract.recurrent import RECURRENT_KERNELS, RecurrentKernels, RecurrentMetadata, StateSpec, kernels_for
from portside.contract.sampling import Sampler, TokenBitmask, apply_token_bitmask

# every part's public names, in the order of the module map above
__all__ = [name for part in (platform, options, attention, batch_invariant, latent, kv_quant, kv_transfer, graph, collectives, model_ops, recurrent, sampling, memory)
           for name in part.__all__]
