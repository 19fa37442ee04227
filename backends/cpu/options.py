"""The cpu platform's backend options (``--backend-option KEY=VALUE``, ``platform_options``),
declared once: core checks the keys and choices given against `BACKEND_OPTIONS`, `portside devices`
lists them, docs/cpu.md explains them."""

from __future__ import annotations

from portside.contract import BackendOption

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
)
