"""Launch configurations for the Triton kernels, chosen per architecture by simple heuristics.

Pure functions over small dataclasses, so the choices are unit-testable without a GPU. Every
`tl.dot` tile the kernels use is at least 16 on each side (the interpreter accepts smaller
tiles; GPUs do not). Importing it does not import triton (the cuda and rocm probes read it);
only `interpreter_int8_dot`, asked for interpreter launches, does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "ArchInfo",
    "AttentionLaunch",
    "detect_arch",
    "next_power_of_2",
    "choose_attention_launch",
    "choose_num_splits",
    "MoeLaunch",
    "choose_moe_launch",
    "LoRALaunch",
    "choose_lora_launch",
    "QuantLaunch",
    "choose_quant_launch",
    "interpreter_int8_dot",
]

MIN_TILE = 16  # smallest tl.dot tile side a GPU accepts
MAX_SPLITS = 16  # split-KV partitions at most (scratch is num_tokens * num_heads * MAX_SPLITS * head)
SPLIT_MIN_CONTEXT = 512  # below this many keys, one partition is always enough
TILES_PER_SPLIT_MIN = 4  # a partition covers at least this many KV blocks
MAX_SPLIT_K = 8  # quantized GEMMs: K slices at most
MIN_K_TILES_PER_SPLIT = 2  # a K slice covers at least this many K tiles


@dataclass(frozen=True)
class ArchInfo:
    """What the heuristics need to know about the device."""

    vendor: str  # "nvidia", "amd" or "interpreter" (TRITON_INTERPRET on CPU tensors)
    num_sms: int  # streaming multiprocessors (NVIDIA) / compute units (AMD)
    warp_size: int = 32  # 64 on AMD CDNA (wave64)
    capability: tuple[int, int] = (0, 0)  # NVIDIA compute capability; (0, 0) elsewhere
    arch_name: str = ""  # e.g. "gfx942" on AMD

    @property
    def is_amd(self) -> bool:
        return self.vendor == "amd"


@dataclass(frozen=True)
class AttentionLaunch:
    """Tile sizes and compiler hints for one attention launch."""

    block_m: int  # query rows (tokens x query heads of one KV head) per program, >= 16
    num_warps: int
    num_stages: int
    input_precision: str  # tl.dot precision for fp32 operands: "ieee" or "tf32"
    extra: tuple[tuple[str, Any], ...] = ()  # vendor-only launch options (AMD: waves_per_eu, ...)

    def kernel_options(self) -> dict[str, Any]:
        """Keyword arguments for the kernel launch (the interpreter ignores them)."""
        return {"num_warps": self.num_warps, "num_stages": self.num_stages, **dict(self.extra)}


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


_INTERPRETER = ArchInfo(vendor="interpreter", num_sms=2)


def detect_arch(device: torch.device) -> ArchInfo:
    """Describe `device`. CPU tensors mean the Triton interpreter; CUDA tensors on a ROCm build
    of torch mean AMD."""
    if device.type != "cuda":
        return _INTERPRETER
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip is not None:
        name = getattr(props, "gcnArchName", "") or ""
        return ArchInfo(vendor="amd", num_sms=props.multi_processor_count, warp_size=64, arch_name=name.split(":")[0])
    return ArchInfo(vendor="nvidia", num_sms=props.multi_processor_count, capability=(props.major, props.minor))


def choose_attention_launch(
    arch: ArchInfo, head_size: int, num_queries_per_kv: int, max_query_len: int, dtype: torch.dtype
) -> AttentionLaunch:
    """Pick tiles for the paged-attention kernel.

    Decode-only batches get the smallest row tile that holds one token's query heads (the
    kernel is bandwidth-bound: more rows would only waste registers). Batches with prefill
    chunks get 64 rows (NVIDIA) / 32 rows (AMD, whose 64-wide waves already fill the MFMA
    units) so a program reuses each K/V tile for several query tokens.
    """
    head_p2 = next_power_of_2(head_size)
    group_p2 = next_power_of_2(num_queries_per_kv)
    if max_query_len <= 1:
        block_m = max(MIN_TILE, group_p2)
    else:
        block_m = max(32 if arch.is_amd else 64, group_p2)
    # fp16/bf16 operands are upcast to fp32 on load (see the kernel); their products are exact in
    # tf32, so tensor cores may be used. fp32 inputs keep full precision.
    precision = "ieee" if dtype == torch.float32 or arch.is_amd else "tf32"
    if arch.is_amd:
        num_warps = 8 if head_p2 >= 256 else 4  # 4 waves of 64 lanes = 256 threads
        extra: tuple[tuple[str, Any], ...] = (("waves_per_eu", 2),)
        if arch.arch_name.startswith("gfx9"):
            extra += (("matrix_instr_nonkdim", 16),)  # CDNA MFMA 16x16 instructions
        return AttentionLaunch(block_m, num_warps, 1, precision, extra)
    num_warps = 8 if (head_p2 >= 256 or block_m >= 64 and head_p2 >= 128) else 4
    num_stages = 3 if arch.capability >= (8, 0) else 2
    return AttentionLaunch(block_m, num_warps, num_stages, precision)


def choose_num_splits(
    arch: ArchInfo, num_reqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, block_size: int
) -> int:
    """How many KV partitions (flash-decoding) a decode-only batch should use; 1 = no split.

    Splitting pays when the grid (one program per request and KV head) cannot fill the device
    and contexts are long: each partition then reads a slice of the context in parallel, and a
    small reduce kernel merges the partial softmaxes.
    """
    if max_query_len > 1 or max_seq_len < SPLIT_MIN_CONTEXT:
        return 1
    programs = num_reqs * num_kv_heads
    target = 2 * arch.num_sms
    if programs >= target:
        return 1
    wanted = -(-target // programs)
    by_length = max(1, max_seq_len // (block_size * TILES_PER_SPLIT_MIN))
    return max(1, min(MAX_SPLITS, wanted, by_length))


@dataclass(frozen=True)
class MoeLaunch:
    """Tiles and compiler hints for the fused-MoE grouped GEMMs."""

    block_m: int  # sorted (token, slot) rows per program; each expert's rows are padded to it
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    input_precision: str  # tl.dot precision: "ieee" for fp32 operands (and on AMD), else the default "tf32"
    upcast: bool  # load half-precision operands as fp32 (the interpreter's bf16 dot is wrong)

    def kernel_options(self) -> dict[str, Any]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


def choose_moe_launch(arch: ArchInfo, num_pairs: int, num_experts: int, dtype: torch.dtype) -> MoeLaunch:
    """Pick tiles for the fused-MoE kernels from the routed pairs (tokens x top_k) per expert.

    Few pairs per expert (decode) get 16-row tiles, so padding wastes little; prefill gets 64
    rows so each weight tile is reused over more tokens. The choice depends on shapes only.
    """
    per_expert = num_pairs / max(num_experts, 1)
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64
    precision = "ieee" if dtype == torch.float32 or arch.is_amd else "tf32"  # half operands: the MMA either way
    if arch.vendor == "interpreter":
        return MoeLaunch(block_m, 32, 32, 4, 1, precision, upcast=True)
    num_stages = 2 if arch.is_amd else 3 if arch.capability >= (8, 0) else 2
    block_k, num_warps = (64, 4) if block_m <= 32 else (32, 8)
    return MoeLaunch(block_m, 64, block_k, num_warps, num_stages, precision, upcast=False)


@dataclass(frozen=True)
class LoRALaunch:
    """Tiles and compiler hints for one multi-LoRA shrink or expand launch (`lora.py`)."""

    block_m: int  # tokens of one slot per program
    block_n: int  # output columns (shrink: of the rank; expand: of the layer's slice)
    block_k: int  # reduction (shrink: the input features; expand: the rank)
    num_warps: int
    num_stages: int
    input_precision: str  # tl.dot precision: "ieee" for fp32 operands (and on AMD), else "tf32"
    upcast: bool  # load half-precision operands as fp32 (the interpreter's bf16 dot is wrong)

    def kernel_options(self) -> dict[str, Any]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


def choose_lora_launch(arch: ArchInfo, num_tokens: int, num_slots: int, n: int, k: int, dtype: torch.dtype) -> LoRALaunch:
    """Pick tiles for a LoRA shrink (n = rank, k = input features) or expand (n = output columns,
    k = rank) from shapes only (no host read of the slot map): rows by the tokens per slot if
    spread evenly (a decode batch: 16), columns and reduction covering a small rank in one tile."""
    per_slot = num_tokens / max(num_slots, 1)
    block_m = 16 if per_slot <= 16 else 32 if per_slot <= 64 else 64
    block_n = min(64, max(MIN_TILE, next_power_of_2(n)))
    block_k = min(64, max(MIN_TILE, next_power_of_2(k)))
    precision = "ieee" if dtype == torch.float32 or arch.is_amd else "tf32"
    if arch.vendor == "interpreter":
        return LoRALaunch(block_m, min(block_n, 32), min(block_k, 32), 4, 1, precision, upcast=True)
    num_stages = 2 if arch.is_amd else 3 if arch.capability >= (8, 0) else 2
    return LoRALaunch(block_m, block_n, block_k, 4, num_stages, precision, upcast=False)


@dataclass(frozen=True)
class QuantLaunch:
    """Tiles, split-K and compiler hints for one quantized GEMM launch (`dequant_gemm`, `scaled_mm`)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int  # K slices; > 1 sums fp32 partials after the launch
    num_warps: int
    num_stages: int
    input_precision: str  # tl.dot precision for fp32 operands: "ieee" or "tf32"
    upcast: bool  # interpreter: half-precision x loaded as fp32, bf16 rounding done in fp32
    operand: str = "native"  # scaled path: "native" MMA on the codes, else "fp16" / "fp32" upcast
    fp8_bytes: bool = False  # FP8 tensors read as bytes and decoded in integer ops (NVIDIA < sm89)

    def kernel_options(self) -> dict[str, Any]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


def interpreter_int8_dot() -> bool:
    """Whether the installed Triton's interpreter runs an int8 x int8 -> int32 `tl.dot`: before
    3.8 it asserts on one (the CI leg's pinned 3.7.1 does; 3.9 runs it), and there the int8
    scaled path upcasts to fp32, which is exact for the tested K (127 * 127 * K < 2^24)."""
    import triton  # only asked for interpreter launches, which have triton

    return tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 8)


def _pow2_divisor(n: int) -> int:
    return n & -n


def choose_quant_launch(
    arch: ArchInfo,
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    *,
    group_size: int | None = None,
    scaled: str | None = None,
) -> QuantLaunch:
    """Pick tiles for an [m, k] x [k, n] quantized GEMM.

    `group_size`: the K groups of a weight-only weight without g_idx (None: one group per row, or
    act order), so a K tile can be kept inside one group. `scaled`: "int8" / "fp8" for the W8A8
    path. Small M is weight-bandwidth bound: 16-row tiles, the widest K step, and split-K when
    the (M, N) tiles cannot fill the device (twice its SMs). Depends on shapes only.
    """
    precision = "ieee" if dtype == torch.float32 or arch.is_amd else "tf32"
    if arch.vendor == "interpreter":
        bm, bn, bk, warps, stages = (16 if m <= 16 else 32), 32, 32, 4, 1
    elif m <= 16:
        bm, bn, bk, warps, stages = 16, 64, 128, 4, 4
    elif m <= 64:
        bm, bn, bk, warps, stages = (32 if m <= 32 else 64), 64, 64, 4, 4
    elif m <= 256:
        bm, bn, bk, warps, stages = 64, 128, 64, 4, 3
    else:
        bm, bn, bk, warps, stages = 128, 128, 64, 8, 3
    if arch.is_amd or (arch.vendor == "nvidia" and arch.capability < (8, 0)):
        stages = 2
    if group_size is not None and group_size < k and group_size % bk:
        step = _pow2_divisor(group_size)  # a K step inside one group keeps the scale per tile
        if step >= 16:
            bk = min(bk, step)
    split = 1
    tiles = -(-m // bm) * -(-n // bn)
    k_tiles = -(-k // bk)
    if m <= 64 and tiles < 2 * arch.num_sms:
        split = max(1, min(MAX_SPLIT_K, -(-2 * arch.num_sms // tiles), k_tiles // MIN_K_TILES_PER_SPLIT))
    fp8_bytes = arch.vendor == "nvidia" and arch.capability < (8, 9)  # triton has no e4m3 type there
    operand = "native"
    if scaled == "fp8" and not (arch.vendor == "nvidia" and arch.capability >= (8, 9)):
        operand = "fp32" if arch.vendor == "interpreter" else "fp16"  # no fp8 MMA (AMD: e4m3fnuz only)
    if scaled == "int8" and arch.vendor == "interpreter" and not interpreter_int8_dot():
        operand = "fp32"
    upcast = arch.vendor == "interpreter" and dtype != torch.float32
    return QuantLaunch(bm, bn, bk, split, warps, stages, precision, upcast, operand, fp8_bytes)
