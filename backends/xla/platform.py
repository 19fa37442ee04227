"""XlaPlatform: Google TPUs through torch-xla (PJRT), or torch-xla's CPU device for tests.

`--device tpu` runs on PJRT TPU. With ``PJRT_DEVICE=CPU`` in the environment the same code runs
on the PJRT CPU device: this is how the xla CI leg proves the backend without a TPU.

Nothing here imports torch_xla at module level: importing it starts the PJRT runtime, and the
probe (`is_available`) must stay cheap. The probe checks importability, the torch/torch-xla
version pair, `PJRT_DEVICE`, and for TPUs the device files (``/dev/accel*``, ``/dev/vfio/*``) or
the TPU environment variables a TPU VM sets.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.metadata
import importlib.util
import os
from typing import Any, ClassVar

import torch

from portside.contract import (
    AttentionBackend,
    Availability,
    BackendOption,
    Communicator,
    DeviceInfo,
    GraphRunner,
    ModelFn,
    ModelOps,
    Platform,
    host_memory,
)

__all__ = ["XlaPlatform", "pjrt_device", "tpu_present", "version_mismatch", "OPTIONS", "BACKEND_OPTIONS"]

PJRT_ENV = "PJRT_DEVICE"
TPU_ENV_VARS = ("TPU_NAME", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_ID", "TPU_CHIPS_PER_HOST_BOUNDS")
INSTALL_HINT = "pip install torch-xla==X.Y.* torch==X.Y.* (the two must share major.minor)"

# the backend options this platform takes (--backend-option KEY=VALUE; values are strings)
FLAG_VALUES = ("0", "1", "false", "true", "no", "yes", "off", "on")  # `_flag`'s
BACKEND_OPTIONS = (
    BackendOption("xla_token_buckets", "comma-separated padded token counts; default: powers of two from 16 to the "
                  "token budget"),
    BackendOption("xla_request_buckets", "comma-separated padded request counts; default: powers of two up to "
                  "max_num_seqs"),
    BackendOption("xla_width_buckets", "comma-separated padded block-table widths; default: powers of two up to "
                  "max_model_len / block_size"),
    BackendOption("xla_strict", "1: a compilation after warm-up raises (tests); 0: it logs a warning with the shape",
                  FLAG_VALUES, "0"),
    BackendOption("xla_attention", "auto: Pallas ragged paged attention on TPU when importable, else gather",
                  ("auto", "pallas", "gather"), "auto"),
    BackendOption("xla_precompile", "1: compile every bucket at start-up; 0: compile lazily on first use",
                  FLAG_VALUES, "1"),
)
OPTIONS = {o.name: o.help for o in BACKEND_OPTIONS}  # (the names and help texts, as before)


def pjrt_device() -> str:
    """The PJRT device kind this process will use: $PJRT_DEVICE, upper-cased; TPU when unset."""
    return os.environ.get(PJRT_ENV, "TPU").strip().upper() or "TPU"


def tpu_present() -> bool:
    """A TPU is attached: its device files exist or a TPU VM's environment variables are set.
    Looks only at the file system and the environment (no runtime is started)."""
    if glob.glob("/dev/accel*"):
        return True
    if any(p for p in glob.glob("/dev/vfio/*") if os.path.basename(p) != "vfio"):
        return True
    return any(os.environ.get(v) for v in TPU_ENV_VARS)


def _major_minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])


def version_mismatch() -> str | None:
    """Why the installed torch-xla cannot load with this torch (it pins no torch version and
    fails only at import), or None."""
    try:
        xla_version = importlib.metadata.version("torch-xla")
    except importlib.metadata.PackageNotFoundError:
        return None  # importable without metadata (a source build): let the import decide
    if _major_minor(xla_version) != _major_minor(torch.__version__):
        return (
            f"torch-xla {xla_version} needs torch {'.'.join(_major_minor(xla_version))}.*, "
            f"but torch {torch.__version__} is installed; {INSTALL_HINT}"
        )
    return None


def _flag(config: Any, key: str, default: str) -> bool:
    return str(config.option(key, default)).strip().lower() in ("1", "true", "yes", "on")


class XlaPlatform(Platform):
    name = "tpu"
    device_type = "xla"
    ray_resource = "TPU"
    dist_backend = "xla"
    priority = 90  # an accelerator: wins over cpu when present
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16)
    block_sizes: ClassVar[tuple[int, ...]] = (8, 16, 32, 64, 128)
    default_block_size = 16
    default_kv_cache_memory = 0.9
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto", "fp8_e4m3", "fp8_e5m2")  # fp8: the gather path
    # core's LoRA reference groups tokens by slot with data-dependent shapes (a new XLA program per
    # slot map); a static-shape kernel is not written yet, so the engine refuses enable_lora here
    supports_lora = False
    # XLA collectives run inside the compiled step, where a blocking point-to-point send between
    # programs on different hosts has no counterpart here yet: the engine refuses pipeline_parallel_size > 1
    supports_pipeline_parallel = False
    attention_name = "pallas|xla-gather"
    graph_name = "xla-buckets"
    collectives_name = "xla"
    backend_options: ClassVar[tuple[BackendOption, ...]] = BACKEND_OPTIONS

    # ---- probe and device ------------------------------------------------------------------

    @classmethod
    def is_available(cls) -> Availability:
        if importlib.util.find_spec("torch_xla") is None:
            return Availability.no(f"torch-xla is not installed; {INSTALL_HINT}")
        mismatch = version_mismatch()
        if mismatch:
            return Availability.no(mismatch)
        kind = pjrt_device()
        if kind == "CPU":
            return Availability.yes()  # PJRT CPU device: tests and development
        if kind != "TPU":
            return Availability.no(f"{PJRT_ENV}={kind} is not a TPU; unset it for TPUs or set {PJRT_ENV}=CPU for tests")
        if not tpu_present():
            return Availability.no(
                "no TPU found (no /dev/accel* or /dev/vfio device, no TPU_* environment); "
                f"set {PJRT_ENV}=CPU to run on torch-xla's CPU device"
            )
        return Availability.yes()

    @classmethod
    def on_cpu(cls) -> bool:
        """Running on the PJRT CPU device (PJRT_DEVICE=CPU), not a TPU."""
        return pjrt_device() == "CPU"

    @classmethod
    def device_info(cls) -> DeviceInfo:
        if cls.on_cpu():
            total, avail = host_memory()
            return DeviceInfo(name="PJRT CPU (torch-xla)", count=1, total_memory=total, free_memory=avail)
        # On a TPU this starts the runtime: only called once a model is being loaded.
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        device = torch_xla.device()
        info = xm.get_memory_info(device)
        limit = int(info.get("bytes_limit", 0))
        used = int(info.get("bytes_used", 0))
        kind = xm.xla_device_hw(device)
        return DeviceInfo(name=f"{kind} (torch-xla)", count=xr.global_runtime_device_count(),
                          total_memory=limit, free_memory=max(0, limit - used))

    @classmethod
    def device(cls, local_rank: int = 0) -> torch.device:
        import torch_xla

        return torch_xla.device()

    @classmethod
    def set_device(cls, local_rank: int) -> None:
        os.environ.setdefault(PJRT_ENV, "TPU")  # torch-xla would otherwise guess (and warn)

    @classmethod
    def synchronize(cls) -> None:
        import torch_xla

        torch_xla.sync()

    @classmethod
    def inference_mode(cls) -> contextlib.AbstractContextManager:
        # no_grad, not inference_mode: XLA tensors made under inference_mode cannot be updated
        # in place later (the KV cache is), and torch-xla traces both the same way.
        return torch.no_grad()

    @classmethod
    def seed(cls, seed: int) -> None:
        torch.manual_seed(seed)
        if cls.is_available():
            import torch_xla.core.xla_model as xm

            xm.set_rng_state(seed)

    @classmethod
    def auto_dtype(cls, checkpoint_dtype: torch.dtype) -> torch.dtype:
        if cls.on_cpu():
            return torch.float32  # the PJRT CPU device is for correctness tests: fp32
        return torch.bfloat16 if checkpoint_dtype in (torch.bfloat16, torch.float16) else checkpoint_dtype

    # ---- configuration -----------------------------------------------------------------------

    @classmethod
    def check_and_update_config(cls, config):
        from portside.backends.xla.buckets import parse_buckets

        for key in ("xla_token_buckets", "xla_request_buckets", "xla_width_buckets"):
            value = config.option(key)
            if value is not None:
                parse_buckets(value, key)
        mode = config.option("xla_attention", "auto")
        if mode == "pallas" and config.cache.kv_cache_dtype != "auto":
            raise ValueError(f"--kv-cache-dtype {config.cache.kv_cache_dtype}: the Pallas kernel path reads only the "
                             "model's dtype here; use xla_attention=gather (or auto) or --kv-cache-dtype auto")
        if config.parallel.tensor_parallel_size > 1:
            raise ValueError(
                "tensor parallelism on the tpu platform is not wired up yet (needs one process per chip "
                "through torch_xla.launch); use tensor_parallel_size=1"
            )
        return super().check_and_update_config(config)

    @classmethod
    def strict(cls, config) -> bool:
        """Compilation after warm-up is an error (env PORTSIDE_XLA_STRICT=1 or option xla_strict=1)."""
        return os.environ.get("PORTSIDE_XLA_STRICT", "0") == "1" or _flag(config, "xla_strict", "0")

    # ---- the three parts -----------------------------------------------------------------------

    @classmethod
    def attention_backend(cls, config) -> AttentionBackend:
        from portside.backends.xla.attention import XlaAttentionBackend, pallas_available

        mode = config.option("xla_attention", "auto")
        use_pallas = mode == "pallas" or (mode == "auto" and not cls.on_cpu() and pallas_available())
        if config.cache.kv_cache_dtype != "auto":  # an fp8 cache: dequantized on read, by the gather path
            use_pallas = False
        return XlaAttentionBackend(use_pallas=use_pallas)

    @classmethod
    def graph_runner(cls, model_fn: ModelFn, config) -> GraphRunner:
        from portside.backends.xla.graph import XlaGraphRunner

        return XlaGraphRunner(model_fn, config, strict=cls.strict(config),
                              precompile=_flag(config, "xla_precompile", "1"))

    @classmethod
    def model_ops(cls, config) -> ModelOps:
        from portside.backends.xla.ops import XlaModelOps

        return XlaModelOps()

    @classmethod
    def communicator(cls, group: Any = None) -> Communicator:
        from portside.backends.xla.communicator import XlaCommunicator

        return XlaCommunicator(group)
