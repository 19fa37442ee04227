"""The cpu backend's one native library: every C/C++ kernel, built once per compiler, CPU and torch
version against the running torch with the system C++ compiler (`native_build`), or ahead of time
with ``python -m portside.backends.cpu.native_ops``. Without a compiler the backend runs its torch
paths.

An engine never waits for the build (`ready`): when the library is not in the cache,
`CpuPlatform.check_and_update_config` starts it in a detached process at nice 19 (`start`; ~1.5-4
minutes of compiling on 2 cores) and the engine answers on its torch paths meanwhile.
Its runners, attention backend and sampler ask `ready()` at each step and take the native kernels
from the first step after the build has finished (docs/cpu.md, "Native kernels"); a one-shot
command that ends first leaves the build running for the next one. Tests and explicit options
(``cpu_attention=native``, ``cpu_bf16_linears=amx``) use `unavailable_reason()`, which builds or
waits. It holds:

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
  (int8/int4/fp8 codes, GGUF blocks; int8 x int8) (`csrc/quant_gemm.cpp`, `quant.CpuQuantOps`);
- `portside_cpu_native::gguf_dot`: GGUF blocks times activations quantized to int8 per block, as
  llama.cpp's vec_dot (`csrc/gguf_dot*.cpp`, `gguf_dot`, `quant.CpuQuantOps` with ``cpu_gguf_act=int8``);
- `portside_cpu_native::int4_dot`: GPTQ/AWQ int4 times activations quantized to int8 per group
  (`csrc/int4_dot.cpp`, `int4_dot`, `quant.CpuQuantOps` with ``cpu_int4_act=int8``);
- `portside_cpu_native::block_quant_linear`: linears over block-wise fp8 and mxfp4 weights,
  decoded 32 columns at a time (`csrc/block_quant.cpp`, `block_quant`);
- `portside_cpu_native::causal_conv1d` / `ssd_scan` / `selective_scan` / `gated_delta_rule`: the
  recurrent layers' kernels (`csrc/recurrent.cpp`, `recurrent.CpuRecurrentOps`).
- `portside_cpu_native::mla_decode`: latent-attention (MLA) decodes over the paged latent cache
  (`csrc/mla.cpp`, `mla.CpuLatentAttention`).

The operators are C++ torch operators, so a compiled graph (`cpp_wrapper`) calls them through the
dispatcher without a trip through Python: 121 linears and 30 attention calls a step for the
default model.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from portside.backends.cpu import attention_op, native_build
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
    CSRC / "block_quant.cpp",
    CSRC / "recurrent.cpp",
    CSRC / "mla.cpp",
    CSRC / "gguf_dot.cpp",
    CSRC / "gguf_dot_q8.cpp",
    CSRC / "gguf_dot_k.cpp",
    CSRC / "gguf_tile.cpp",
    CSRC / "int4_dot.cpp",
)
INCLUDED = (CSRC / "paged_attention.c", CSRC / "decode_plan.h", CSRC / "row_dot.h", CSRC / "row_tile.h", CSRC / "amx_tiles.h",
            CSRC / "recurrent.h", CSRC / "gguf_dot.h", CSRC / "gguf_tile_rows.h")
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-std=c++20", "-w")


def _torch_flags() -> tuple[tuple[str, ...], tuple[str, ...]]:
    from torch.utils import cpp_extension

    lib_dir = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    compile_flags = (*FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in cpp_extension.include_paths()))
    return compile_flags, (f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}", "-ltorch_cpu", "-lc10")


def _target() -> tuple[list[str], tuple[str, ...], tuple[str, ...], Path]:
    """(compiler, compile flags, link flags, the library's path in the cache)."""
    cxx = native_build.compiler()
    compile_flags, libs = _torch_flags()
    key = native_build.build_key(cxx, SOURCES + INCLUDED, compile_flags + libs, extra=torch.__version__)
    return cxx, compile_flags, libs, native_build.cache_dir() / key / "portside_cpu_native.so"


def _build(timeout: float = 300, lock_fd: int | None = None) -> tuple[Path, bool]:
    """The library's path, compiling it first unless it is cached; and whether this call compiled it."""
    cxx, compile_flags, libs, target = _target()
    return target, native_build.build(cxx, SOURCES, compile_flags, libs, target, timeout=timeout, lock_fd=lock_fd)


POLL_S = 1.0  # how often `ready` looks for a background build's library (a stat, at a step's start)
BACKGROUND_TIMEOUT_S = 1800  # a compiler call's limit in a background build (lowest priority, busy machine)


class _State:
    """This process's view of a library it has not loaded yet (`start`, `ready`)."""

    def __init__(self) -> None:
        self.started = False
        self.reason: str | None = None  # why the library cannot be used in this process
        self.build: native_build.BackgroundBuild | None = None
        self.next_poll = 0.0
        self.callbacks: list[Callable[[], None]] = []
        self.lock = threading.RLock()


_state = _State()


def loaded() -> bool:
    """Whether the operators are registered in this process (`load` succeeded)."""
    return load.cache_info().currsize > 0


def start() -> None:
    """Make the library usable without waiting for it (`ready`), once per process: nothing when it
    is loaded or cached; else start its build in a detached process at nice 19
    (`native_build.start_background`), or follow the process building it already, and say so on
    stderr. A missing compiler, or a failure a background build recorded, becomes the reason the
    torch paths run (`not_ready_reason`)."""
    with _state.lock:
        if _state.started or loaded():
            return
        _state.started = True
        try:
            target = _target()[3]
        except NativeBuildError as e:
            _state.reason = str(e)
            return
        if target.exists():
            return
        failed = native_build.recorded_failure(target)
        if failed is not None:
            _state.reason = (f"their build failed ({failed}); `python -m portside.backends.cpu.native_ops` "
                             "builds them again and shows why")
            _notice(f"the native cpu kernels are unavailable, so the torch paths run: {_state.reason}")
            return
        argv = [sys.executable, "-m", "portside.backends.cpu.native_ops", "--background", str(target)]
        try:
            _state.build = native_build.start_background(argv, target)
        except OSError as e:
            _state.reason = f"the background build could not start: {e}"
            return
        if _state.build is None:  # built meanwhile
            return
        what, estimate = native_build.describe(SOURCES)
        if _state.build.proc is not None:
            _notice(f"building native cpu kernels in the background ({what}, at low priority; first run, "
                    f"~{estimate} s on an idle machine); the torch paths answer until they are built")
        else:
            _notice("native cpu kernels are being built by another process; the torch paths answer until they are built")
        atexit.register(_say_still_building)


def ready() -> bool:
    """Whether the native operators are registered in this process, never waiting for a build:
    True when they are loaded, or cached (loading them now), or a background build (`start`,
    which this starts if need be) has just finished (its library is looked for at most every
    `POLL_S` seconds; then loaded, stderr told, and the `when_ready` callbacks run). A caller
    asks at a step's start and takes the native kernels from there on."""
    if loaded():
        return True
    start()
    with _state.lock:
        if _state.reason is not None:
            return False
        bg = _state.build
        if bg is not None:
            now = time.monotonic()
            if now < _state.next_poll:
                return False
            _state.next_poll = now + POLL_S
            try:
                if not bg.done():
                    return False
            except NativeBuildError as e:
                _state.reason = f"their background build failed: {e}"
                _notice(f"the native cpu kernels are unavailable, so the torch paths go on: {_state.reason}")
                return False
        reason = unavailable_reason()  # built (or cached): loads it without compiling
        if reason is not None:
            _state.reason = reason
            return False
        callbacks, _state.callbacks = _state.callbacks, []
    if bg is not None:
        _notice(f"native cpu kernels built in the background in {time.monotonic() - bg.started:.0f} s; "
                "the native paths run from now on")
    for fn in callbacks:
        fn()
    return True


def pending() -> bool:
    """Whether a background build may still make `ready` true in this process."""
    start()
    return not loaded() and _state.build is not None and _state.reason is None


def not_ready_reason() -> str | None:
    """None when `ready()`, else why the torch paths run now (a build in the background, or why
    the library is unavailable)."""
    if ready():
        return None
    if _state.reason is not None:
        return _state.reason
    return "they are being built in the background (the torch paths run until then)"


def status() -> str:
    """This process's view of the library, read without side effects (no build started, nothing
    loaded): "loaded", "cached" (built, loaded by the next `ready`), "building" (in the background),
    "unavailable" (`not_ready_reason` says why) or "not started" (before `start`)."""
    if loaded():
        return "loaded"
    with _state.lock:
        if _state.reason is not None:
            return "unavailable"
        if _state.build is not None:
            return "building"
        return "cached" if _state.started else "not started"


def amx_unavailable_reason(wait: bool = True) -> str | None:
    """None when the native AMX tile linear runs here (`portside_cpu_native::linear_amx`), else why
    not; without `wait`, also while the library is built in the background (`ready`)."""
    reason = unavailable_reason() if wait else not_ready_reason()
    if reason:
        return f"the native operators are unavailable ({reason})"
    if not torch.ops.portside_cpu_native.linear_amx_supported():
        return "this CPU has no AMX-BF16, or the kernel does not grant the tile state (arch_prctl)"
    return None


def wait(why: str) -> bool:
    """`ready()`, after waiting for a background build to end (`why`: what needs the library from
    the start, said on stderr)."""
    if ready():
        return True
    bg = _state.build
    if bg is not None and _state.reason is None:
        _notice(f"waiting for the native cpu kernels being built in the background ({why}) ...")
        while True:
            try:
                if bg.done():
                    break
            except NativeBuildError:
                break  # `ready` reports it
            time.sleep(0.5)
        _state.next_poll = 0.0
    return ready()


def when_ready(fn: Callable[[], None]) -> None:
    """Call `fn` now when `ready()`, else once a background build's library is loaded (never when
    the library is unavailable)."""
    if ready():
        fn()
    elif pending():
        with _state.lock:
            _state.callbacks.append(fn)


def forget() -> None:
    """Forget this process's library state (tests: another cache or compiler). Operators once
    registered stay registered."""
    global _state
    load.cache_clear()
    _state = _State()


def _notice(msg: str) -> None:
    print(f"portside: {msg}", file=sys.stderr, flush=True)


def _say_still_building() -> None:
    bg = _state.build
    if bg is not None and not loaded() and _state.reason is None and not bg.target.exists():
        who = f"pid {bg.proc.pid}" if bg.proc is not None else "another process"
        _notice(f"the native cpu kernels are still building in the background ({who}); later runs use them once built")


@functools.lru_cache(maxsize=1)
def load() -> Path:
    """Build (once per cache key) and register the operators; the library's path (`kernels` opens
    it with ctypes for the C entry points). Raises `NativeBuildError` with why not."""
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
            torch.library.register_fake("portside_cpu_native::mla_decode", _mla_decode_fake),
            torch.library.register_fake("portside_cpu_native::block_quant_linear", _block_quant_linear_fake),
            torch.library.register_fake("portside_cpu_native::gguf_dot", _gguf_dot_fake),
            torch.library.register_fake("portside_cpu_native::int4_dot", _int4_dot_fake),
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


def _block_quant_linear_fake(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                             fmt: int, block_n: int, block_k: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], qweight.shape[0]))


def _gguf_dot_fake(x: torch.Tensor, qweight: torch.Tensor, ggml_type: int, bias: torch.Tensor | None,
                   isa: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], qweight.shape[0]))


def _int4_dot_fake(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                   group_size: int, bias: torch.Tensor | None, isa: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], qweight.shape[0]))


def _mla_decode_fake(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, latent_dim: int) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1], latent_dim))


def unavailable_reason() -> str | None:
    """None when the operators are registered (building them on first call), else why not."""
    return native_build.unavailable_reason(load)


def main(argv: list[str] | None = None) -> int:
    """Build the library ahead of first use (a container image, a shared cache): prints its path,
    or why it cannot be built (exit 2). ``--background TARGET``: the detached build `start` runs."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "--background":
        return _background_build(Path(args[1]))
    try:
        target, compiled = _build()
    except NativeBuildError as e:
        print(f"portside: the native cpu library cannot be built here: {e}", file=sys.stderr)
        return 2
    print(f"{target} ({'built' if compiled else 'already built'})")
    return 0


def _background_build(expected: Path) -> int:
    """The child of `native_build.start_background`: build `expected`, the library its parent waits
    for, with the lock it inherited (anything else, e.g. after the sources were edited, is not
    built under that library's lock); a failure (other than a compiler call running out of time)
    is recorded for later starts, and the log of a build that succeeded removed."""
    lock_fd = native_build.inherited_lock()
    try:
        if _target()[3] != expected:
            print(f"portside: not building {expected}: the sources or the compiler changed since it was asked for",
                  file=sys.stderr, flush=True)
            return 2
        target, _ = _build(timeout=BACKGROUND_TIMEOUT_S, lock_fd=lock_fd)
    except NativeBuildError as e:
        print(f"portside: the native cpu library cannot be built here: {e}", file=sys.stderr, flush=True)
        if not isinstance(e, native_build.NativeBuildTimeout):
            with contextlib.suppress(OSError):
                native_build.record_failure(expected, str(e))
        return 2
    (target.parent / "build.log").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
