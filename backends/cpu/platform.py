"""CpuPlatform: runs anywhere torch does.

The top of the backend's import graph: it imports the parts it builds (attention backends, graph
runners, model ops) and the choice of what runs (`options.cpu_options`), none of which imports it.
"""

from __future__ import annotations

import logging
import os
import platform as _platform
from typing import ClassVar

import torch

from portside.backends.cpu import native_ops
from portside.backends.cpu.attention import CpuAttentionBackend, NativeAttentionBackend
from portside.backends.cpu.communicator import select_dist_backend
from portside.backends.cpu.graph import make_graph_runner
from portside.backends.cpu.host import cpu_flags, has_native_bf16, usable_cores
from portside.backends.cpu.ipex_attention import IpexAttentionBackend
from portside.backends.cpu.moe import CpuModelOps
from portside.backends.cpu.options import (
    BACKEND_OPTIONS,
    DEFAULT_ALLOCATOR_CACHE_MB,
    check_cpu_options,
    cpu_options,
)
from portside.backends.cpu.weight_sleep import SleepingBuffer, offload_packed, restore_packed
from portside.backends.cpu.weights import pack_weights
from portside.contract import (
    AttentionBackend,
    Availability,
    BackendOption,
    BatchInvariantAttention,
    DeviceInfo,
    EagerGraphRunner,
    GraphRunner,
    ModelFn,
    ModelOps,
    Platform,
    Sampler,
    host_memory,
)

__all__ = ["CpuPlatform", "configure_threads", "install_caching_allocator", "DEFAULT_ALLOCATOR_CACHE_MB",
           "cpu_flags", "has_native_bf16", "usable_cores"]  # (the last three: `host`'s, kept importable here)

logger = logging.getLogger(__name__)


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
    # the host itself: no device index, ranks on one machine split its cores, and (the defaults
    # that follow) workers forked from a server that imported torch once, a Ray "CPU" per rank
    host_device = True
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
    # --batch-invariant: core's batch-invariant layers, eager, attention over the torch backend's cache
    supports_batch_invariant = True
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
        pack_weights(model)
        install_caching_allocator(cpu_options(config).allocator_cache_mb)

    @classmethod
    def offload_weights(cls, model, keep):
        """The packed weights' pages go back to the OS, saved to a temporary file first at level 1
        (`weight_sleep`); weights that were not packed: core's default."""
        handle = offload_packed(model, keep)
        return handle if handle is not None else super().offload_weights(model, keep)

    @classmethod
    def restore_weights(cls, model, handle) -> None:
        if isinstance(handle, SleepingBuffer):
            restore_packed(handle)
        else:
            super().restore_weights(model, handle)

    @classmethod
    def check_and_update_config(cls, config):
        """The options' keys and choices (core's check, again for direct callers), then what only
        this backend can check (`options.check_cpu_options`); then the native library's build is
        started in the background when it is not cached, and what runs is chosen and logged in
        one line (`options.cpu_options`)."""
        config = super().check_and_update_config(config)
        check_cpu_options(config)
        native_ops.start()  # not cached: built in the background while the torch paths answer
        options = cpu_options(config)
        configure_threads(options.threads)
        logger.info("cpu: dtype %s, %d threads, %s", str(config.model.dtype).removeprefix("torch."),
                    torch.get_num_threads(), options.describe())
        return config

    @classmethod
    def attention_backend(cls, config) -> AttentionBackend:
        """The backend `CpuOptions.attention` names (option cpu_attention: `options._attention_path`),
        its KV cache touched at allocation unless option cpu_kv_prefault is "off": a first touch of
        a fresh huge page costs its zeroing, and on a VM whose host has not backed the memory yet far
        more (800 MB: 1.2 s on an AMX Xeon VM, 0.08 s once backed), paid inside the first steps that
        write those blocks otherwise (10% of the samples of a 64-sequence prefill there). vLLM's CPU
        backend zero-fills its cache at start-up too. The native backend runs the torch path until
        a library built in the background is loaded (`NativeAttentionBackend`)."""
        options = cpu_options(config)
        backend: AttentionBackend = {"ipex": IpexAttentionBackend, "native": NativeAttentionBackend,
                                     "torch": CpuAttentionBackend}[options.attention]()
        if getattr(config, "batch_invariant", False):  # core's invariant attention over this cache layout
            backend = BatchInvariantAttention(CpuAttentionBackend())
            backend.inner.prefault_host_cache = options.kv_prefault
        backend.prefault_host_cache = options.kv_prefault
        return backend

    @classmethod
    def sampler(cls, config) -> Sampler:
        """Core's sampler with the native row argmax (`csrc/argmax.cpp`) and grammar mask
        (`csrc/token_bitmask.cpp`) when the operators build: torch's CPU argmax reads a row one
        element at a time (~40 us for one 49k-token row, 1.3 ms for 64 rows here; 8 us and 0.41 ms
        native). While the library is built in the background, core's until it is (`native_ops.ready`)."""
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
        """Core's references, but mixture-of-experts grouped by expert, native quantized linears (GGUF
        weights with the activations option cpu_gguf_act asks for) and multi-LoRA grouped by
        adapter (`moe.CpuModelOps`). A quantized model waits for a native
        library built in the background: its weights are laid out for the kernels as they load."""
        ops = CpuModelOps(wait=getattr(getattr(config, "model", None), "quantization", None) is not None)
        if hasattr(config, "option"):  # GGUF weights' activations: option cpu_gguf_act
            ops.gguf_act = config.option("cpu_gguf_act", ops.gguf_act)
            ops.int4_act = config.option("cpu_int4_act", ops.int4_act)  # int4 weights' activations
            ops.int8_act = config.option("cpu_int8_act", ops.int8_act)  # weight-only int8's
        return ops

    @classmethod
    def graph_runner(cls, model_fn: ModelFn, config) -> GraphRunner:
        """The runner `CpuOptions.graph` names (option cpu_graph: `graph.make_graph_runner`)."""
        if getattr(config, "batch_invariant", False):  # op by op in core's kernels: no fused or native linears
            return EagerGraphRunner(model_fn, config)
        return make_graph_runner(model_fn, config)
