"""The cpu backend's dispatch table: its backend options (``--backend-option KEY=VALUE``,
``platform_options``) declared once (`BACKEND_OPTIONS`: core checks the keys and choices given,
`portside devices` lists them, docs/cpu.md explains them), and what the backend runs, chosen once
per configuration from them, the model's dtype, the KV-cache dtype, the CPU's flags and the native
library's state (`CpuOptions`, `cpu_options`). The platform logs the choice at start-up in one
line; the attention backend, the graph runners, the eager linears and the fused decode step read
it rather than the options.

The native library may still be building in the background when the choice is made
(`native_ops.start`): a path chosen for it ("native" attention, the AMX linears, the fused step)
runs torch's kernels until the library is loaded, then its own, from the first step that finds it
built (`native_ops.ready`); nothing is chosen again. A configuration seen again after the library's
state changed (built, failed, or forgotten by a test) is chosen anew.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from portside.backends.cpu import kernels, native_ops
from portside.backends.cpu.gguf_dot import DEFAULT_GGUF_ACT, GGUF_ACTS
from portside.backends.cpu.host import has_amx_bf16, has_native_bf16
from portside.backends.cpu.int4_dot import DEFAULT_INT4_ACT, INT4_ACTS
from portside.backends.cpu.ipex_attention import ipex_unavailable_reason
from portside.backends.cpu.openvino_runner import openvino_available
from portside.contract import BackendOption

logger = logging.getLogger(__name__)

GRAPH_MODES = ("eager", "inductor", "openvino")
DEFAULT_GRAPH_MODE = "eager"
ATTENTION_IMPLS = ("auto", "native", "torch", "ipex")
BF16_LINEAR_MODES = ("auto", "amx", "native", "widen")
ON_OFF = ("on", "off")
DEFAULT_ALLOCATOR_CACHE_MB = 512

BACKEND_OPTIONS = (
    BackendOption("cpu_graph", "how the model step runs: op by op over native and oneDNN kernels, compiled by "
                  "Inductor, or compiled by OpenVINO", GRAPH_MODES, DEFAULT_GRAPH_MODE),
    BackendOption("cpu_attention", "paged attention: auto (IPEX when installed, else the native C kernels for fp32 "
                  "and bf16, else torch), or one forced", ATTENTION_IMPLS, "auto"),
    BackendOption("cpu_threads", "torch threads (a positive integer; at most the cores this process may use); "
                  "default: $OMP_NUM_THREADS, else every usable core"),
    BackendOption("cpu_allocator_cache_mb", "MiB of freed tensor memory the native caching allocator keeps "
                  "for reuse (0: it caches nothing)", None, str(DEFAULT_ALLOCATOR_CACHE_MB)),
    BackendOption("cpu_fused_decode", "batch-1 decode of a Llama-family fp32/bf16 model in one native call",
                  ON_OFF, "on"),
    BackendOption("cpu_prepack", "multi-row linears over oneDNN-prepacked weights (off: F.linear, no weight copies)",
                  ON_OFF, "on"),
    BackendOption("cpu_bf16_linears", "bf16 linears of several rows: the AMX tile kernel, oneDNN's bf16 kernels "
                  "(native), or fp32 copies of the weights (widen); auto by the CPU's flags", BF16_LINEAR_MODES, "auto"),
    BackendOption("cpu_kv_prefault", "touch the KV cache's pages at start-up (off: as blocks are first written)",
                  ON_OFF, "on"),
    BackendOption("cpu_gguf_act", "GGUF weights (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, IQ4_XS) times activations quantized "
                  "to int8 per block as llama.cpp does, or times fp32 activations", GGUF_ACTS, DEFAULT_GGUF_ACT),
    BackendOption("cpu_int4_act", "weight-only int4 (GPTQ, AWQ, compressed-tensors) times activations quantized "
                  "to int8 per group as the kernel goes, or times fp32 activations", INT4_ACTS, DEFAULT_INT4_ACT),
    BackendOption("cpu_int8_act", "weight-only int8 times activations quantized to int8 per token as the kernel goes "
                  "(the W8A8 kernel), or times fp32 activations", INT4_ACTS, DEFAULT_INT4_ACT),
)
_DEFAULTS = {o.name: o.default for o in BACKEND_OPTIONS}


def requested(config: Any) -> dict[str, Any]:
    """The options as given, or their declared defaults; the numbers as ints (ValueError naming the
    option for one that is not a number). Keys and choices were checked by core."""
    values: dict[str, Any] = {name: config.option(name, default) for name, default in _DEFAULTS.items()}
    threads = values["cpu_threads"]
    if threads is not None and not str(threads).isdigit():
        raise ValueError(f"cpu_threads={threads!r}: give a positive integer")
    values["cpu_threads"] = int(threads) if threads is not None and int(threads) > 0 else None
    cache_mb = values["cpu_allocator_cache_mb"]
    if not str(cache_mb).isdigit():
        raise ValueError(f"cpu_allocator_cache_mb={cache_mb!r}: give a size in MiB (0 turns the caching allocator off)")
    values["cpu_allocator_cache_mb"] = int(cache_mb)
    return values


def check_cpu_options(config: Any) -> None:
    """What the declaration cannot say, ValueError naming the fix: the numbers, and that a path
    forced by an option can run here with this model (building the native library now, and waiting
    for it, where an option needs it from the start)."""
    given = requested(config)
    mode, dtype = given["cpu_graph"], config.model.dtype
    if mode == "openvino":
        quantization = getattr(config.model, "quantization", None)
        if quantization is not None:  # the quantized linears are opaque operators OpenVINO cannot convert
            raise ValueError(f"cpu_graph=openvino does not run quantized models ({quantization.describe()}); use "
                             "cpu_graph=eager or inductor, which run the cpu backend's quantized kernels")
        reason = openvino_available()
        if reason:
            raise ValueError(f"cpu_graph=openvino: {reason}")
        if config.parallel.tensor_parallel_size > 1:
            raise ValueError("cpu_graph=openvino runs at tensor_parallel_size 1; use inductor or eager for TP")
    if given["cpu_bf16_linears"] == "amx":
        reason = native_ops.amx_unavailable_reason()
        if reason:
            raise ValueError(f"cpu_bf16_linears=amx: {reason}; use native, widen or auto")
    if mode == "inductor" and dtype == torch.bfloat16 and not has_native_bf16():
        logger.warning("cpu: cpu_graph=inductor runs bf16 linears in torch's bf16 kernels, several times slower on a "
                       "CPU without AVX-512-BF16/AMX than the eager runner's (fp32 copies of the weights)")
    impl = given["cpu_attention"]
    if impl == "ipex":
        reason = ipex_unavailable_reason()
        if reason:
            raise ValueError(f"cpu_attention=ipex: {reason}")
        if config.cache.kv_cache_dtype != "auto":
            raise ValueError(f"--kv-cache-dtype {config.cache.kv_cache_dtype}: IPEX's paged attention stores only "
                             "the model's dtype; use cpu_attention=native or torch, or --kv-cache-dtype auto")
    if impl == "native":
        reason = kernels.native_unavailable_reason()
        if reason:
            raise ValueError(f"cpu_attention=native: the native kernels are unavailable: {reason}")


@dataclass(frozen=True)
class CpuOptions:
    """What the cpu backend runs for one configuration (`cpu_options`)."""

    dtype: torch.dtype
    """The model's dtype."""
    graph: str
    """The graph runner: "eager", "inductor" or "openvino" (`graph.make_graph_runner`)."""
    attention: str
    """The paged attention backend: "ipex", "native" (the C kernels; while the native library is
    built in the background, the torch path until it is) or "torch" (`CpuPlatform.attention_backend`)."""
    bf16_linears: str
    """A bf16 model's linears of several rows: "amx" (the AMX tile kernel up to `AMX_MAX_ROWS` rows
    once the native library is loaded and the kernel grants the tile state, oneDNN's bf16 kernels
    otherwise), "native" (oneDNN's bf16 kernels) or "widen" (fp32 copies of the weights)."""
    fused_decode: bool
    """One-sequence decode steps in the fused native step where the model qualifies (`fused_decode`)."""
    prepack: bool
    """The eager runner's multi-row linears over oneDNN-prepacked weights (`eager_linears`)."""
    kv_prefault: bool
    """The KV cache's pages touched at allocation (`AttentionBackend.prefault_host_cache`)."""
    threads: int | None
    """torch threads asked for (None: $OMP_NUM_THREADS, else every usable core)."""
    allocator_cache_mb: int
    """MiB the native caching allocator keeps (`platform.install_caching_allocator`)."""
    native: str
    """The native library when this was chosen (`native_ops.status`): "loaded", "building" or "unavailable"."""

    def describe(self) -> str:
        """The choice, for the start-up log line."""
        waiting = self.native == "building"
        attention = {"ipex": "IPEX paged kernels", "torch": "torch (SDPA)",
                     "native": "native C kernels" + (" (torch until built)" if waiting else "")}[self.attention]
        parts = [f"graph {self.graph}", f"attention {attention}"]
        if self.dtype == torch.bfloat16:
            parts.append(f"bf16 linears {self.bf16_linears}" + (" (oneDNN until built)" if waiting and
                                                                 self.bf16_linears == "amx" else ""))
        on = {True: "on", False: "off"}
        parts += [f"fused batch-1 decode {on[self.fused_decode]}", f"prepacked linears {on[self.prepack]}",
                  f"allocator cache {self.allocator_cache_mb} MiB", f"KV prefault {on[self.kv_prefault]}",
                  "native library " + {"building": "building in the background"}.get(self.native, self.native)]
        return ", ".join(parts)


def _attention_path(impl: str, config: Any, native: str) -> str:
    """Option cpu_attention: "auto" takes IPEX's paged kernels when intel_extension_for_pytorch is
    usable (and the KV cache is the model's dtype), else the native C kernels for fp32 and bf16
    models when they load or are being built, else the torch path; the others force one (checked
    in `check_cpu_options`)."""
    if impl == "ipex" or (impl == "auto" and config.cache.kv_cache_dtype == "auto"):
        if ipex_unavailable_reason() is None:
            return "ipex"
    if impl == "native":
        return "native"
    if impl == "auto" and config.model.dtype in (torch.float32, torch.bfloat16):
        reason = native_ops.not_ready_reason() if native == "unavailable" else None
        if native == "loaded":
            reason = kernels.native_unavailable_reason()
        if reason is None:
            return "native"
        logger.warning("cpu attention: native kernels unavailable, using the torch path: %s", reason)
    return "torch"


def _bf16_linears(mode: str, native: str) -> str:
    """Option cpu_bf16_linears: "auto" takes the AMX tile kernel where it runs (where the CPU has
    AMX-BF16 while the library is being built), else oneDNN's bf16 kernels where the CPU has bf16
    arithmetic, else fp32 copies of the weights."""
    if mode != "auto":
        return mode
    if native == "loaded" and native_ops.amx_unavailable_reason(wait=False) is None:
        return "amx"
    if native == "building" and has_amx_bf16():
        return "amx"
    return "native" if has_native_bf16() else "widen"


def resolve(config: Any) -> CpuOptions:
    """`config`'s `CpuOptions`, chosen now (`cpu_options` keeps them)."""
    given = requested(config)
    native_ops.start()  # (nothing when loaded or cached; else the build starts in the background)
    native = "loaded" if native_ops.ready() else "building" if native_ops.pending() else "unavailable"
    return CpuOptions(
        dtype=config.model.dtype,
        graph=given["cpu_graph"],
        attention=_attention_path(given["cpu_attention"], config, native),
        bf16_linears=_bf16_linears(given["cpu_bf16_linears"], native),
        fused_decode=given["cpu_fused_decode"] == "on",
        prepack=given["cpu_prepack"] == "on",
        kv_prefault=given["cpu_kv_prefault"] == "on",
        threads=given["cpu_threads"],
        allocator_cache_mb=given["cpu_allocator_cache_mb"],
        native=native,
    )


_chosen: dict[tuple[Any, ...], CpuOptions] = {}


def cpu_options(config: Any) -> CpuOptions:
    """What the backend runs for `config`: chosen on first use in this process (`resolve`) and the
    same object after, until the native library's state changes (`native_ops.status`)."""
    key = (config.platform_options, config.model.dtype, config.cache.kv_cache_dtype)
    options = _chosen.get(key)
    if options is None or options.native != native_ops.status():
        options = _chosen[key] = resolve(config)
    return options
