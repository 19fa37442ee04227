"""CpuPlatform: runs anywhere torch does."""

from __future__ import annotations

import logging
import os
import platform as _platform
from functools import lru_cache
from typing import ClassVar

import torch

from portside.backends.cpu.communicator import select_dist_backend
from portside.backends.cpu.options import BACKEND_OPTIONS, DEFAULT_ALLOCATOR_CACHE_MB, DEFAULT_GRAPH_MODE
from portside.contract import (
    AttentionBackend,
    Availability,
    BackendOption,
    DeviceInfo,
    GraphRunner,
    ModelFn,
    ModelOps,
    Platform,
    Sampler,
    host_memory,
)

logger = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags from /proc/cpuinfo (empty where unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_native_bf16() -> bool:
    """AVX-512-BF16 or AMX: bf16 matmuls run at full speed. Without them they are ~100x slower."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask), not every CPU of the machine."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def configure_threads(requested: int | None = None) -> int:
    """Keep torch's intra-op threads within the cores this process is given (never more
    threads than cores: oversubscribed OpenMP threads spin against each other). `requested`
    (platform option ``cpu_threads``) wins; else an explicit OMP_NUM_THREADS, or a smaller
    torch.set_num_threads by the caller, is kept.

    On a machine shared with other busy processes even threads == cores oversubscribes: every
    OpenMP barrier waits for a descheduled thread (measured here: batch-1 decode 4x slower with
    2 threads than with 1 while the load average was 5 on 2 cores). Pass ``cpu_threads`` then."""
    cores = usable_cores()
    if requested:
        torch.set_num_threads(max(1, min(requested, cores)))
    elif "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() > cores:
        torch.set_num_threads(cores)
    return torch.get_num_threads()


def install_caching_allocator(cache_mb: int) -> bool:
    """Serve torch's CPU tensors from the native caching allocator (`csrc/cpu_allocator.cpp`),
    keeping up to `cache_mb` MiB of freed blocks for reuse (0: none; once installed it stays,
    only caching nothing). Every decode step allocates and frees the same few hundred small
    buffers, which glibc serves from a heap fragmented by model load and compilation (batch-1
    decode of the default model, 2 threads, same process: 0.29 ms a step less, median). Process-wide,
    like preloading tcmalloc or jemalloc (the fix vLLM's and IPEX's CPU guides give). Returns
    whether it is installed; without the native library (no C++ compiler) nothing changes, and
    while it is built in the background it is installed once built (`native_ops.when_ready`)."""
    from portside.backends.cpu import native_ops

    reason = native_ops.not_ready_reason()
    if reason:
        logger.debug("cpu: no caching allocator yet (native library: %s)", reason)
        native_ops.when_ready(lambda: install_caching_allocator(cache_mb))  # (when built in the background)
        return False
    ops = torch.ops.portside_cpu_native
    if cache_mb <= 0 and not ops.caching_allocator_stats()[0]:
        return False
    ops.set_caching_allocator(max(cache_mb, 0) << 20)
    return cache_mb > 0


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    host_device = True  # no device index; ranks on one machine split its cores
    worker_start_method = "forkserver"  # workers forked from a server that imported torch once
    ray_resource = "CPU"
    dist_backend = select_dist_backend()  # "gloo", or "ccl" when oneCCL's bindings are installed
    priority = 0
    block_sizes: ClassVar[tuple[int, ...]] = (1, 2, 4, 8, 16, 32, 64, 128)
    default_block_size = 16
    default_kv_cache_memory = 4 * 2**30  # bytes, like vLLM's CPU default; capped by free memory
    # oneDNN's prepacked linears cost within ~3% per row from 256 rows up (one thread, Zen 3:
    # 177 us per row of a 768-wide layer at 256 and 512 rows, 182 at 128, 236 at 24); with the
    # default 2048-token budget PP 2 filled its pipeline with 1024-token micro-batches, and a
    # stage sat idle ~1.7 s of a 6.5 s run (ci/bench/parallel.py --what pp)
    pipeline_micro_batch_tokens = 256
    eager_options: ClassVar[dict[str, str] | None] = {"cpu_graph": "eager"}  # --enforce-eager
    backend_options: ClassVar[tuple[BackendOption, ...]] = BACKEND_OPTIONS  # docs/cpu.md
    kv_cache_dtypes = ("auto", "fp8_e4m3", "fp8_e5m2", "int8")  # 8-bit: the torch and native paths, not IPEX
    attention_name = "native-paged|torch-sdpa|ipex-paged"
    graph_name = "eager|inductor|openvino"
    collectives_name = dist_backend

    @classmethod
    def is_available(cls) -> Availability:
        return Availability.yes()

    @classmethod
    def device_info(cls) -> DeviceInfo:
        total, avail = host_memory()
        isa = "AVX-512" if "avx512f" in cpu_flags() else ("AVX2" if "avx2" in cpu_flags() else "baseline")
        name = f"{_platform.machine()} CPU ({isa}, {torch.get_num_threads()} threads)"
        return DeviceInfo(name=name, count=1, total_memory=total, free_memory=avail)

    @classmethod
    def auto_dtype(cls, checkpoint_dtype: torch.dtype) -> torch.dtype:
        if checkpoint_dtype in (torch.bfloat16, torch.float16) and not has_native_bf16():
            logger.info("dtype auto -> float32: this CPU has no native bf16/fp16 matmul (AVX-512-BF16/AMX)")
            return torch.float32
        logger.info("dtype auto -> %s (the checkpoint's)", str(checkpoint_dtype).removeprefix("torch."))
        return checkpoint_dtype

    @classmethod
    def prepare_model(cls, model, config) -> None:
        """Weights into one huge-page buffer in read order (`weights.pack_weights`); tensors
        allocated from then on come from the caching allocator (`install_caching_allocator`)."""
        from portside.backends.cpu.weights import pack_weights

        pack_weights(model)
        install_caching_allocator(int(config.option("cpu_allocator_cache_mb", DEFAULT_ALLOCATOR_CACHE_MB)))

    @classmethod
    def check_and_update_config(cls, config):
        config = super().check_and_update_config(config)  # the options' keys and choices, the block size, dtypes
        mode = config.option("cpu_graph", DEFAULT_GRAPH_MODE)
        if mode == "openvino":
            quantization = getattr(config.model, "quantization", None)
            if quantization is not None:  # the quantized linears are opaque operators OpenVINO cannot convert
                raise ValueError(
                    f"--cpu-graph openvino does not run quantized models ({quantization.describe()}); "
                    "use --cpu-graph eager or inductor, which run the cpu backend's quantized kernels"
                )
            from portside.backends.cpu.openvino_runner import openvino_available

            reason = openvino_available()
            if reason:
                raise ValueError(f"--cpu-graph openvino: {reason}")
            if config.parallel.tensor_parallel_size > 1:
                raise ValueError("--cpu-graph openvino runs at tensor_parallel_size 1; use inductor or eager for TP")
        bf16_linears = config.option("cpu_bf16_linears", "auto")
        if bf16_linears == "amx":
            from portside.backends.cpu.eager_linears import amx_unavailable_reason

            reason = amx_unavailable_reason()
            if reason:
                raise ValueError(f"cpu_bf16_linears=amx: {reason}; use native, widen or auto")
        if mode == "inductor" and config.model.dtype == torch.bfloat16 and not has_native_bf16():
            logger.warning("cpu: --cpu-graph inductor runs bf16 linears in torch's bf16 kernels, several times slower "
                           "on a CPU without AVX-512-BF16/AMX than the eager runner's (fp32 copies of the weights)")
        impl = config.option("cpu_attention", "auto")
        if impl == "ipex":
            from portside.backends.cpu.ipex_attention import ipex_unavailable_reason

            reason = ipex_unavailable_reason()
            if reason:
                raise ValueError(f"cpu_attention=ipex: {reason}")
            if config.cache.kv_cache_dtype != "auto":
                raise ValueError(f"--kv-cache-dtype {config.cache.kv_cache_dtype}: IPEX's paged attention stores only "
                                 "the model's dtype; use cpu_attention=native or torch, or --kv-cache-dtype auto")
        if impl == "native":
            from portside.backends.cpu.kernels import native_unavailable_reason

            reason = native_unavailable_reason()
            if reason:
                raise ValueError(f"cpu_attention=native: the native kernels are unavailable: {reason}")
        cache_mb = config.option("cpu_allocator_cache_mb", DEFAULT_ALLOCATOR_CACHE_MB)
        if not str(cache_mb).isdigit():
            raise ValueError(f"cpu_allocator_cache_mb={cache_mb!r}: give a size in MiB (0 turns the caching allocator off)")
        threads = config.option("cpu_threads")
        if threads is not None and not str(threads).isdigit():
            raise ValueError(f"cpu_threads={threads!r}: give a positive integer")
        configure_threads(int(threads) if threads else None)
        logger.info("cpu: dtype %s, graph %s, %d threads", str(config.model.dtype).removeprefix("torch."), mode,
                    torch.get_num_threads())
        from portside.backends.cpu import native_ops

        native_ops.start()  # not cached: built in the background while the torch paths answer
        return config

    @classmethod
    def attention_backend(cls, config) -> AttentionBackend:
        """`_attention_backend`'s choice, its KV cache touched at allocation unless option
        cpu_kv_prefault is "off": a first touch of a fresh huge page costs its zeroing, and on a VM
        whose host has not backed the memory yet far more (800 MB: 1.2 s on an AMX Xeon VM,
        0.08 s once backed), paid inside the first steps that write those blocks otherwise (10% of
        the samples of a 64-sequence prefill there). vLLM's CPU backend zero-fills its cache at
        start-up too."""
        backend = cls._attention_backend(config)
        backend.prefault_host_cache = config.option("cpu_kv_prefault", "on") == "on"
        return backend

    @classmethod
    def _attention_backend(cls, config) -> AttentionBackend:
        """Option cpu_attention: "auto" picks IPEX's paged kernels when intel_extension_for_pytorch
        is usable (and the KV cache is the model's dtype), else the native C kernels for fp32
        and bf16 models when they build (while they are built in the background, the native
        backend runs the torch path until they are: `NativeAttentionBackend`), else the torch
        path; "native", "torch" and "ipex" force one (checked in `check_and_update_config`)."""
        from portside.backends.cpu.attention import CpuAttentionBackend, NativeAttentionBackend

        impl = config.option("cpu_attention", "auto")
        if impl == "ipex" or (impl == "auto" and config.cache.kv_cache_dtype == "auto"):
            from portside.backends.cpu.ipex_attention import IpexAttentionBackend, ipex_unavailable_reason

            if ipex_unavailable_reason() is None:
                logger.info("cpu attention: IPEX PagedAttention kernels")
                return IpexAttentionBackend()
        if impl == "native" or (impl == "auto" and config.model.dtype in (torch.float32, torch.bfloat16)):
            from portside.backends.cpu import native_ops
            from portside.backends.cpu.kernels import native_unavailable_reason

            if impl == "native":  # built (or waited for) in check_and_update_config
                reason = native_unavailable_reason()
            else:
                reason = native_ops.not_ready_reason() or native_unavailable_reason()
                if reason is not None and native_ops.pending():
                    logger.info("cpu attention: the torch path until the native C kernels are built in the background")
                    return NativeAttentionBackend()
            if reason is None:
                logger.info("cpu attention: native C kernels (decodes, K/V writes), SDPA for prefill chunks")
                return NativeAttentionBackend()
            logger.warning("cpu attention: native kernels unavailable, using the torch path: %s", reason)
        return CpuAttentionBackend()

    @classmethod
    def sampler(cls, config) -> Sampler:
        """Core's sampler with the native row argmax (`csrc/argmax.cpp`) and grammar mask
        (`csrc/token_bitmask.cpp`) when the operators build: torch's CPU argmax reads a row one
        element at a time (~40 us for one 49k-token row, 1.3 ms for 64 rows here; 8 us and 0.41 ms
        native). While the library is built in the background, core's until it is (`native_ops.ready`)."""
        from portside.backends.cpu import native_ops

        if native_ops.ready():
            ops = torch.ops.portside_cpu_native
            return Sampler(argmax=ops.argmax_rows, apply_token_bitmask=ops.apply_token_bitmask)
        if native_ops.pending():
            core = Sampler()

            def argmax(x: torch.Tensor) -> torch.Tensor:
                return torch.ops.portside_cpu_native.argmax_rows(x) if native_ops.ready() else core.argmax(x)

            def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
                if native_ops.ready():
                    return torch.ops.portside_cpu_native.apply_token_bitmask(logits, bitmask, rows)
                return core.apply_token_bitmask(logits, bitmask, rows)

            return Sampler(argmax=argmax, apply_token_bitmask=apply_token_bitmask)
        return Sampler()

    @classmethod
    def model_ops(cls, config) -> ModelOps:
        """Core's references, but mixture-of-experts grouped by expert, native quantized linears and
        multi-LoRA grouped by adapter (`moe.CpuModelOps`). A quantized model waits for a native
        library built in the background: its weights are laid out for the kernels as they load."""
        from portside.backends.cpu.moe import CpuModelOps

        return CpuModelOps(wait=getattr(getattr(config, "model", None), "quantization", None) is not None)

    @classmethod
    def graph_runner(cls, model_fn: ModelFn, config) -> GraphRunner:
        from portside.backends.cpu.graph import make_graph_runner

        return make_graph_runner(model_fn, config)
