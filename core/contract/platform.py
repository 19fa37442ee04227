"""The platform: one kind of hardware. A `Platform` subclass declares its capabilities as class
data and builds its parts on request: the attention backend, the graph runner, the communicator,
the model ops and the sampler's kernels. `is_available` (an `Availability`) and `device_info` (a
`DeviceInfo`) probe it without initialising its runtime.
"""

from __future__ import annotations

import contextlib
import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from portside.contract.attention import AttentionBackend
from portside.contract.collectives import Communicator, SingleRankCommunicator, TorchDistributedCommunicator
from portside.contract.graph import EagerGraphRunner, GraphRunner, ModelFn
from portside.contract.kv_quant import kv_cache_dtype_name
from portside.contract.kv_spec import KVCacheSpec
from portside.contract.kv_transfer import KVBlockIO, KVBlockLayout
from portside.contract.model_ops import ModelOps
from portside.contract.options import BackendOption, check_backend_options
from portside.contract.sampling import Sampler
from portside.contract.weight_offload import offload_to_host, restore_from_host

if TYPE_CHECKING:  # config imports nothing from the contract; this only names the type
    from portside.config import EngineConfig

__all__ = ["Availability", "DeviceInfo", "Platform"]

_HOST = torch.device("cpu")  # torch's host device (`Platform.host_device`'s default)


@dataclass(frozen=True)
class Availability:
    """Result of `Platform.is_available()`: usable, or the reason why not."""

    available: bool
    """Whether the platform can run here."""
    reason: str = ""
    """Why not (empty when available), as `portside devices` shows it."""

    @classmethod
    def yes(cls) -> Availability:
        """Available."""
        return cls(True, "")

    @classmethod
    def no(cls, reason: str) -> Availability:
        """Unavailable, for `reason`."""
        return cls(False, reason)

    def __bool__(self) -> bool:
        return self.available


@dataclass(frozen=True)
class DeviceInfo:
    """What `Platform.device_info` reports: the KV-cache budget is sized from its memory."""

    name: str
    """Human-readable, e.g. "NVIDIA H200" or "x86_64 CPU (AVX2)"."""
    count: int
    """Devices of this kind visible to the process."""
    total_memory: int
    """Bytes, per device."""
    free_memory: int
    """Bytes, per device."""


class Platform(ABC):
    """One kind of hardware. Capabilities are class-level data; parts are built on request.

    Subclasses set the class variables and implement the abstract methods. `is_available` must be
    cheap and must not initialise the device runtime (no context creation, no allocation).
    """

    # ---- identity and capabilities (class data) -----------------------------------------------

    name: ClassVar[str]
    """The --device value: "cuda", "rocm", "tpu", "cpu", or a vendor's. Required."""
    device_type: ClassVar[str]
    """The torch device type: "cuda", "xla", "cpu", "privateuseone", ... Required."""
    dist_backend: ClassVar[str]
    """The torch.distributed backend: "nccl", "gloo", "xla", ... Required."""
    priority: ClassVar[int] = 0
    """Auto-selection: the highest available platform wins (cpu is 0)."""
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
    """Model dtypes it runs; the first is `auto_dtype`'s fallback."""
    block_sizes: ClassVar[tuple[int, ...]] = (16,)
    """Allowed KV block sizes."""
    default_block_size: ClassVar[int] = 16
    """The block size when the user gives none (one of `block_sizes`)."""
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    """`--kv-cache-dtype` values accepted (canonical `KV_CACHE_DTYPES` names); the attention
    backend built for one must list it in its own `kv_cache_dtypes`."""
    supports_lora: ClassVar[bool] = True
    """Batched multi-LoRA (`enable_lora`): the model calls `ModelOps.lora_shrink` / `lora_expand`
    (the defaults are core's references); False makes the engine refuse LoRA, naming it."""
    supports_pipeline_parallel: ClassVar[bool] = True
    """Pipeline parallelism (`pipeline_parallel_size` > 1): stages exchange hidden states through
    `Communicator.send` / `recv` (defaults: torch.distributed); False makes the engine refuse it."""
    supports_batch_invariant: ClassVar[bool] = False
    """Batch-invariant mode (`EngineConfig.batch_invariant`, --batch-invariant): with it set, the
    platform's attention backend, graph runner and model ops give each token the same bits
    whatever its batch (`portside.contract.BatchInvariantAttention` wraps any attention backend;
    the layers' kernels are core's, `portside.ops.batch_invariant`); False makes the engine
    refuse the mode, naming the platform."""
    default_kv_cache_memory: ClassVar[float] = 0.9
    """KV-cache size when the user gives none: a fraction (<= 1) of free memory, or bytes (> 1)."""
    pipeline_micro_batch_tokens: ClassVar[int | None] = None
    """Pipeline parallelism: the most tokens a micro-batch takes by default (a stage waits one
    micro-batch's time while the pipeline fills and drains, so the smallest count at which the
    device is still efficient; --pipeline-micro-batch-tokens overrides it); None: no cap, a
    micro-batch takes max_num_batched_tokens / pipeline_micro_batches."""
    eager_options: ClassVar[dict[str, str] | None] = None
    """Backend options that --enforce-eager (EngineArgs.enforce_eager) sets: no graph capture or
    compilation; None: the platform has no eager mode (the flag only warns). Each key must be one
    of `backend_options`."""
    backend_options: ClassVar[tuple[BackendOption, ...]] = ()
    """The options only this platform understands (``--backend-option KEY=VALUE``,
    ``platform_options={KEY: VALUE}``): core refuses any other key, and a value outside an
    option's `choices`, before `check_and_update_config` runs; `portside devices` lists them."""

    # ---- how the engine runs its ranks here (class data) ---------------------------------------

    host_device: ClassVar[bool] = False
    """The device is the host CPU itself: `device()` has no index, the ranks on one machine share
    it (each takes its share of the machine's cores for torch's threads, and a world of any size
    runs on one device), and its memory is the host's. Default: whether `device_type` is torch's
    host device type, so that a plugin written before this attribute keeps its behaviour; declare it."""
    worker_start_method: ClassVar[str | None] = None
    """How multiprocess workers start unless $PORTSIDE_WORKER_MULTIPROC_METHOD says: "forkserver"
    (each worker forked from one server process that imported torch and the model code once: faster,
    but only where the device runtime survives a fork) or "spawn" (a fresh interpreter, safe with
    any runtime). None: "forkserver" on a `host_device`, else "spawn"."""
    ray_resource: ClassVar[str | None] = None
    """The Ray resource one rank reserves under the Ray executor ("CPU", "GPU", "TPU", or a custom
    resource your nodes advertise). None: "CPU" on a `host_device`, else "GPU"."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "device_type" in vars(cls) and "host_device" not in vars(cls):
            cls.host_device = cls.device_type == _HOST.type

    # ---- names for `portside devices` (`describe`), read without building anything ------------

    attention_name: ClassVar[str | None] = None
    """The attention implementation(s) it may build (e.g. "triton", "native-paged|torch-sdpa");
    None: listed as "?"."""
    graph_name: ClassVar[str] = "eager"
    """The graph runner(s) it may build (e.g. "cuda-graphs", "eager|inductor|openvino")."""
    collectives_name: ClassVar[str | None] = None
    """What its collectives run on (e.g. "nccl"); None: `dist_backend`."""

    # ---- probe and device ----------------------------------------------------------------------

    @classmethod
    @abstractmethod
    def is_available(cls) -> Availability:
        """Can this platform run here? Cheap; never initialises the device runtime."""

    @classmethod
    @abstractmethod
    def device_info(cls) -> DeviceInfo:
        """The visible devices and their memory (`host_memory` where device memory is host memory)."""

    @classmethod
    def device(cls, local_rank: int = 0) -> torch.device:
        """The torch device of `local_rank` (a `host_device` has no index)."""
        return torch.device(cls.device_type) if cls.host_device else torch.device(cls.device_type, local_rank)

    @classmethod
    def start_method(cls) -> str:
        """`worker_start_method`, or its default."""
        return cls.worker_start_method or ("forkserver" if cls.host_device else "spawn")

    @classmethod
    def ray_resource_name(cls) -> str:
        """`ray_resource`, or its default."""
        return cls.ray_resource or ("CPU" if cls.host_device else "GPU")

    @classmethod
    def set_device(cls, local_rank: int) -> None:
        """Make `local_rank`'s device current for this process. Default: nothing."""

    @classmethod
    def synchronize(cls) -> None:
        """Wait for queued device work. Default: nothing (synchronous devices)."""

    @classmethod
    def inference_mode(cls) -> contextlib.AbstractContextManager:
        """The context every step runs in. Default: `torch.inference_mode()`."""
        return torch.inference_mode()

    @classmethod
    def seed(cls, seed: int) -> None:
        """Seed the device's random generators. Default: `torch.manual_seed`."""
        torch.manual_seed(seed)

    @classmethod
    def auto_dtype(cls, checkpoint_dtype: torch.dtype) -> torch.dtype:
        """What dtype "auto" means here for a checkpoint stored in `checkpoint_dtype`.
        Default: the checkpoint's own dtype when supported, else the first supported one."""
        return checkpoint_dtype if checkpoint_dtype in cls.supported_dtypes else cls.supported_dtypes[0]

    # ---- configuration -------------------------------------------------------------------------

    @classmethod
    def check_and_update_config(cls, config: EngineConfig) -> EngineConfig:
        """Return a (new, frozen) config adjusted for this platform, or raise ValueError naming the
        fix. Default: check the backend options given against `backend_options` (core does so too,
        before calling this), fill in the block size and check it, the dtype and the KV-cache dtype
        (naming "fp8" by its canonical name, "fp8_e4m3")."""
        check_backend_options(cls, config.platform_options)
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

    @classmethod
    def offload_weights(cls, model: torch.nn.Module, keep: bool) -> Any:
        """Sleep: release the memory `model`'s weights hold on the device. `keep` (level 1): a
        host copy comes back with `restore_weights`; else (level 2) the weights come back with
        undefined values, for a weight update to fill. Returns what `restore_weights` takes.
        Default: the data of every parameter and buffer moves to host memory
        (`weight_offload.offload_to_host`), then `empty_cache`."""
        handle = offload_to_host(model, keep)
        cls.empty_cache()
        return handle

    @classmethod
    def restore_weights(cls, model: torch.nn.Module, handle: Any) -> None:
        """Wake: put back what `offload_weights` returned `handle` for, at the same shapes and dtypes."""
        restore_from_host(handle)

    @classmethod
    def empty_cache(cls) -> None:
        """Return the memory the device allocator caches but no tensor uses (after a sleep).
        Default: torch's current accelerator's, if any."""
        accel = getattr(torch, "accelerator", None)
        if accel is not None and accel.is_available() and hasattr(accel, "empty_cache"):
            accel.empty_cache()

    # ---- the parts -----------------------------------------------------------------------------

    @classmethod
    @abstractmethod
    def attention_backend(cls, config: EngineConfig) -> AttentionBackend:
        """The paged attention backend for this configuration."""

    @classmethod
    def graph_runner(cls, model_fn: ModelFn, config: EngineConfig) -> GraphRunner:
        """What runs the model each step. Default: `EagerGraphRunner`."""
        return EagerGraphRunner(model_fn, config)

    @classmethod
    def sampler(cls, config: EngineConfig) -> Sampler:
        """The sampler the model runner uses. Default: core's, all torch ops; a platform may pass
        faster kernels for its steps (`Sampler`'s `argmax`, `apply_token_bitmask`)."""
        return Sampler()

    @classmethod
    def model_ops(cls, config: EngineConfig) -> ModelOps:
        """The kernels model layers call beyond attention (mixture-of-experts, quantized weights,
        multi-LoRA). Default: core's references (`ModelOps`)."""
        return ModelOps()

    @classmethod
    def communicator(cls, group: Any = None) -> Communicator:
        """Collectives over `group` (None: the default process group, or world size 1 when
        torch.distributed is not initialised). Default: torch.distributed's."""
        if not dist.is_available() or not dist.is_initialized():
            return SingleRankCommunicator()
        return TorchDistributedCommunicator(group)

    @classmethod
    def kv_block_layout(cls, spec: KVCacheSpec, block_size: int) -> KVBlockLayout:
        """How a KV block leaving the device is laid out (`portside.contract.kv_transfer`): the
        neutral form, built from the spec (K/V, an 8-bit cache's stored rows, or latent rows;
        core adds a speculative draft's layers with `KVBlockLayout.with_draft`). A platform
        overrides it only to refuse a spec."""
        return KVBlockLayout.from_spec(spec, block_size)

    @classmethod
    def kv_block_io(cls, backend: AttentionBackend, layout: KVBlockLayout) -> KVBlockIO:
        """What copies whole blocks between `backend`'s caches and the neutral form. Default:
        through the backend's `read_stored_kv` / `write_stored_kv` (by default its `read_kv` /
        `write_kv`) and `read_latent` / `write_latent`; a faster one must produce the same bytes."""
        return KVBlockIO(backend, layout)

    # ---- description ---------------------------------------------------------------------------

    @classmethod
    def describe(cls) -> dict[str, str]:
        """Implementation names for `portside devices` (`attention_name`, `graph_name`,
        `collectives_name`), without building anything heavy."""
        return {
            "attention": cls.attention_name or "?",
            "graph": cls.graph_name,
            "collectives": cls.collectives_name or cls.dist_backend,
        }
