"""The cpu backend's one native library: every C/C++ kernel, built once per compiler, CPU and torch
version against the running torch with the system C++ compiler (`native_build`: on first use, in
the background from `CpuPlatform.check_and_update_config`, or ahead of time with
``python -m portside.backends.cpu.native_ops``). Without a compiler the backend runs its torch
paths. It holds:

- the paged-attention kernels' C entry points (`ps_*`, `csrc/paged_attention_abi.cpp`: the C
  kernels of `csrc/paged_attention.c` with C linkage), called through ctypes by `kernels.py`;
- `portside_cpu_native::linear_row`: the one-row fp32 or bf16 linear (`csrc/linear_row.cpp`);
- `portside_cpu_native::linear_amx`: the bf16 linear of a batched decode step's rows on AMX tiles
  (`csrc/linear_amx.cpp`; `linear_amx_supported()`: built with AMX-BF16, tile state granted);
- `portside_cpu_native::causal_attention`: bf16 prompts attending to themselves (a request's
  first prefill chunk) on AMX tiles (`csrc/causal_attention.cpp`, `attention._attend_causal`);
- `portside_cpu_native::attention`: decode-only paged attention (`csrc/decode_attention.cpp`,
  the kernels of `csrc/paged_attention.c`) for the plan `set_decode_step` installs, else the
  Python operator `portside_cpu::attention` (`attention_op`);
- `portside_cpu_native.LlamaDecoder` (a torch class): a whole batch-1 decode step of a
  Llama-family fp32 or bf16 model in one call (`csrc/fused_decode.cpp`, `fused_decode.py`);
- `portside_cpu_native::argmax_rows`: row-wise argmax of fp32 logits for the sampler
  (`csrc/argmax.cpp`, `CpuPlatform.sampler`);
- `portside_cpu_native::apply_token_bitmask`: structured output's grammar mask on fp32 logits
  (`csrc/token_bitmask.cpp`, `CpuPlatform.sampler`);
- `portside_cpu_native::moe_experts`: fp32 mixture-of-experts grouped by expert (`csrc/moe.cpp`,
  `moe.CpuModelOps`);
- `portside_cpu_native::set_caching_allocator`: the caching CPU allocator
  (`csrc/cpu_allocator.cpp`, installed by `platform.install_caching_allocator`);
- `portside_cpu_native::quant_linear` / `quant_linear_w8a8`: linears over quantized weights
  (int8/int4/fp8 codes, GGUF blocks; int8 x int8) (`csrc/quant_gemm.cpp`, `quant.CpuQuantOps`).

The operators are C++ torch operators, so a compiled graph (`cpp_wrapper`) calls them through the
dispatcher without a trip through Python: 121 linears and 30 attention calls a step for the
default model.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from pathlib import Path

import torch

from portside.backends.cpu import native_build
from portside.backends.cpu.native_build import NativeBuildError

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    CSRC / "paged_attention_abi.cpp",
    CSRC / "linear_row.cpp",
    CSRC / "linear_amx.cpp",
    CSRC / "decode_attention.cpp",
    CSRC / "causal_attention.cpp",
    CSRC / "fused_decode.cpp",
    CSRC / "cpu_allocator.cpp",
    CSRC / "argmax.cpp",
    CSRC / "token_bitmask.cpp",
    CSRC / "moe.cpp",
    CSRC / "quant_gemm.cpp",
)
INCLUDED = (CSRC / "paged_attention.c", CSRC / "decode_plan.h", CSRC / "row_dot.h", CSRC / "amx_tiles.h")
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-std=c++20", "-w")


def _torch_flags() -> tuple[tuple[str, ...], tuple[str, ...]]:
    from torch.utils import cpp_extension

    lib_dir = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    compile_flags = (*FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in cpp_extension.include_paths()))
    return compile_flags, (f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}", "-ltorch_cpu", "-lc10")


def _build() -> tuple[Path, bool]:
    """The library's path, compiling it first unless it is cached; and whether this call compiled it."""
    cxx = native_build.compiler()
    compile_flags, libs = _torch_flags()
    key = native_build.build_key(cxx, SOURCES + INCLUDED, compile_flags + libs, extra=torch.__version__)
    target = native_build.cache_dir() / key / "portside_cpu_native.so"
    return target, native_build.build(cxx, SOURCES, compile_flags, libs, target)


@functools.lru_cache(maxsize=1)
def prebuild_in_background() -> threading.Thread:
    """Start compiling the library on a thread, once per process, so a first run's build overlaps
    tokenizer and weight loading; `load()` then waits for it (`native_build.build` holds a lock)
    or finds the .so cached. Nothing is loaded here, and a failure is left for `load()` /
    `unavailable_reason()` to report."""

    def work() -> None:
        try:
            _build()
        except Exception as e:  # noqa: BLE001 - whatever it is, load() meets it again and reports it
            logger.debug("cpu: background native build failed (reported on first use): %s", e)

    thread = threading.Thread(target=work, name="portside-native-build", daemon=True)
    thread.start()
    return thread


@functools.lru_cache(maxsize=1)
def load() -> Path:
    """Build (once per cache key) and register the operators; the library's path (`kernels` opens
    it with ctypes for the C entry points). Raises `NativeBuildError` with why not."""
    from portside.backends.cpu import attention_op  # the Python operator attention falls back to

    target, _ = _build()
    try:
        torch.ops.load_library(str(target))
    except OSError as e:
        raise NativeBuildError(f"loading {target} failed: {e}") from e
    if not hasattr(load, "fakes"):  # once per process, whatever clears load's cache
        load.fakes = (  # type: ignore[attr-defined]
            torch.library.register_fake("portside_cpu_native::linear_row", _linear_row_fake),
            torch.library.register_fake("portside_cpu_native::linear_amx", _linear_row_fake),
            torch.library.register_fake("portside_cpu_native::causal_attention", _causal_attention_fake),
            torch.library.register_fake("portside_cpu_native::attention", attention_op.attention_fake),
            torch.library.register_fake("portside_cpu_native::argmax_rows", _argmax_rows_fake),
            torch.library.register_fake("portside_cpu_native::apply_token_bitmask", _apply_token_bitmask_fake),
            torch.library.register_fake("portside_cpu_native::moe_experts", _moe_experts_fake),
            torch.library.register_fake("portside_cpu_native::quant_linear", _quant_linear_fake),
            torch.library.register_fake("portside_cpu_native::quant_linear_w8a8", _quant_linear_w8a8_fake),
        )
    return target


def _linear_row_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def _causal_attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: int, scale: float) -> torch.Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def _apply_token_bitmask_fake(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return torch.empty(logits.shape, dtype=torch.float32, device=logits.device)


def _argmax_rows_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[:-1], dtype=torch.long)


def _moe_experts_fake(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _quant_linear_fake(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor | None, zeros: torch.Tensor | None,
                       bias: torch.Tensor | None, fmt: int, group_size: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], qweight.shape[0]))


def _quant_linear_w8a8_fake(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                            input_scale: torch.Tensor | None, bias: torch.Tensor | None, group_size: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], qweight.shape[0]))


def unavailable_reason() -> str | None:
    """None when the operators are registered (building them on first call), else why not."""
    try:
        load()
    except NativeBuildError as e:
        return str(e)
    return None


def main() -> int:
    """Build the library ahead of first use (a container image, a shared cache): prints its path,
    or why it cannot be built (exit 2)."""
    try:
        target, compiled = _build()
    except NativeBuildError as e:
        print(f"portside: the native cpu library cannot be built here: {e}", file=sys.stderr)
        return 2
    print(f"{target} ({'built' if compiled else 'already built'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
