"""The kit's shape set and batch builder: requests -> tensors and `AttentionMetadata`.

A request is ``(num_cached, num_new)``: `num_cached` tokens already in the cache, `num_new`
computed now. A request with num_new == 1 is a decode; decodes come first in a batch, as the
model runner orders them.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from portside.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from portside.contract import (
    AttentionMetadata,
    Platform,
    RecurrentMetadata,
    is_quantized_kv,
    kv_cache_torch_dtype,
    kv_row_bytes,
)

Request = tuple[int, int]  # (num_cached, num_new)

GQA_SHAPES = ((4, 4), (8, 2), (8, 1))  # (num_heads, num_kv_heads): GQA ratios 1, 4, 8
HEAD_SIZES = (64, 128)
POOL_BYTES = 16 * 2**20  # per case: the block pool is as large as this allows (<= MAX_POOL)
MAX_POOL = 4096
FULL_ENV = "PORTSIDE_CONFORMANCE_FULL"  # "1": every dtype x block size x GQA x head size
# What the feature check tries: each of `ATTENTION_FEATURES`, and the pairs models have (Gemma 2: window and
# soft-cap; gpt-oss: window and sinks).
FEATURE_SETS = ("sliding_window", "logit_softcap", "sinks", "sliding_window+logit_softcap", "sliding_window+sinks")
SOFTCAP = 1.5  # small enough that capping changes most scores (random q, k give scores ~N(0, 1))


def batches(block_size: int) -> dict[str, tuple[Request, ...]]:
    """The standard batches for one block size: kv_len 1, block_size, block_size + 1, ragged
    decodes, ragged prefills, and mixed prefill chunks (with a cached prefix) plus decodes."""
    bs = block_size
    return {
        "kv_len_1": ((0, 1),),
        "decodes": ((bs - 1, 1), (bs, 1), (0, 1), (3 * bs + 1, 1)),  # seq_lens bs, bs+1, 1, 3bs+2
        "prefills": ((0, bs), (0, bs + 1), (0, 3)),
        "mixed": ((bs, 1), (0, 1), (bs + 1, 3), (2 * bs, bs + 2), (0, 5)),
    }


def feature_batches(block_size: int) -> dict[str, tuple[Request, ...]]:
    """The standard batches long enough for a sliding window to matter: decodes, and prefill
    chunks over cached prefixes plus decodes."""
    return {name: reqs for name, reqs in batches(block_size).items() if name in ("decodes", "mixed")}


def feature_settings(feature: str, block_size: int, num_heads: int = 8) -> list[dict[str, object]]:
    """The values the kit tries for one of `FEATURE_SETS`, as `ForwardContext.attention` keyword
    arguments (on the host: the caller moves tensors to the device). Windows: the token itself
    only, ending inside a block, crossing a block boundary, longer than every sequence. Sinks:
    one fp32 logit per query head (`num_heads`), from well below to well above the scores
    (random q, k give scores ~N(0, 1)), so some heads barely see theirs and others mostly do."""
    windows = sorted({1, block_size // 2 + 2, block_size + 3, 8 * block_size})
    sinks = torch.linspace(-3.0, 4.0, num_heads)
    settings: dict[str, list[dict[str, object]]] = {
        "sliding_window": [{"sliding_window": w} for w in windows],
        "logit_softcap": [{"logit_softcap": SOFTCAP}],
        "sinks": [{"sinks": sinks}],
        "sliding_window+logit_softcap": [{"sliding_window": block_size // 2 + 2, "logit_softcap": SOFTCAP}],
        "sliding_window+sinks": [{"sliding_window": w, "sinks": sinks} for w in (1, block_size + 3)],
    }
    return settings[feature]


@dataclass(frozen=True)
class AttentionCase:
    block_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype  # the model's: queries, new K/V, output
    kv_cache_dtype: str = "auto"  # `--kv-cache-dtype` (canonical name)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The cache tensor's dtype."""
        return kv_cache_torch_dtype(self.kv_cache_dtype, self.dtype)

    @property
    def quantized(self) -> bool:
        return is_quantized_kv(self.cache_dtype)

    @property
    def id(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        kv = "" if self.kv_cache_dtype == "auto" else f"-kv_{self.kv_cache_dtype}"
        return f"bs{self.block_size}-h{self.num_heads}-kv{self.num_kv_heads}-d{self.head_size}-{dt}{kv}"


def standard_cases(block_sizes: tuple[int, ...], dtypes: tuple[torch.dtype, ...], default_block_size: int) -> list[AttentionCase]:
    """fp32 (when declared) over every declared block size; each reduced-precision dtype at the
    default block size (cheap enough on any machine). Every case runs every standard batch."""
    full = os.environ.get(FULL_ENV) == "1"
    cases = []
    for dtype in dtypes:
        sizes = block_sizes if dtype == torch.float32 or full else (default_block_size,)
        for bs in sizes:
            for heads, kv_heads in GQA_SHAPES:
                # Both head sizes at the default block size; head size 64 at the others (all with
                # PORTSIDE_CONFORMANCE_FULL=1).
                for d in HEAD_SIZES if bs == default_block_size or full else HEAD_SIZES[:1]:
                    cases.append(AttentionCase(bs, heads, kv_heads, d, dtype))
    return cases


def feature_cases(block_sizes: tuple[int, ...], dtypes: tuple[torch.dtype, ...], default_block_size: int) -> list[AttentionCase]:
    """Fewer shapes for the attention features: every dtype at the default block size (GQA 4,
    head size 64), and fp32 at the smallest block size (GQA 1, head size 128);
    PORTSIDE_CONFORMANCE_FULL=1 runs the standard set."""
    if os.environ.get(FULL_ENV) == "1":
        return standard_cases(block_sizes, dtypes, default_block_size)
    cases = [AttentionCase(default_block_size, 8, 2, 64, dtype) for dtype in dtypes]
    if torch.float32 in dtypes and min(block_sizes) != default_block_size:
        cases.append(AttentionCase(min(block_sizes), 4, 4, 128, torch.float32))
    return cases


def kv_cache_cases(
    kv_cache_dtypes: tuple[str, ...], dtypes: tuple[torch.dtype, ...], default_block_size: int, features: bool = False
) -> list[AttentionCase]:
    """The 8-bit caches the platform declares (`Platform.kv_cache_dtypes`), each at the default
    block size with the model in fp32 (when declared, else the first declared dtype): every GQA
    ratio at head size 64 and GQA 4 at 128, or (`features`) one shape (GQA 4, head size 64).
    PORTSIDE_CONFORMANCE_FULL=1 runs every declared dtype, GQA ratio and head size."""
    full = os.environ.get(FULL_ENV) == "1"
    models = dtypes if full else ((torch.float32,) if torch.float32 in dtypes else dtypes[:1])
    shapes = [(h, kvh, d) for h, kvh in GQA_SHAPES for d in HEAD_SIZES if full or d == HEAD_SIZES[0] or h // kvh == 4]
    if features:
        shapes = [(8, 2, 64)]
    return [
        AttentionCase(default_block_size, h, kvh, d, dtype, name)
        for name in kv_cache_dtypes if name != "auto"
        for dtype in models
        for h, kvh, d in shapes
    ]


def pool_size(needed: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype) -> int:
    """A large pool (so block ids are big and scattered), bounded by POOL_BYTES. `dtype`: the
    cache's (an 8-bit one's rows are `kv_row_bytes`)."""
    per_block = 2 * block_size * num_kv_heads * kv_row_bytes(head_size, dtype)
    return max(2 * needed + 1, min(MAX_POOL, POOL_BYTES // per_block))


def unused_slots(requests: tuple[Request, ...], tables: list[list[int]], block_size: int, pool: int,
                 gen: torch.Generator, extra_blocks: int = 4) -> torch.Tensor:
    """Slots a batch never reads: each request's last block past its sequence, and every slot of
    `extra_blocks` blocks no request holds (where an 8-bit case writes noise through write_kv)."""
    slots: list[int] = []
    held = {b for t in tables for b in t}
    for (cached, new), table in zip(requests, tables):
        end = cached + new
        slots += [table[p // block_size] * block_size + p % block_size for p in range(end, len(table) * block_size)]
    free = [b for b in torch.randperm(pool, generator=gen).tolist() if b not in held][:extra_blocks]
    for b in free:
        slots += range(b * block_size, (b + 1) * block_size)
    return torch.tensor(slots, dtype=torch.int64)


def random_block_tables(requests: tuple[Request, ...], block_size: int, pool: int, gen: torch.Generator) -> list[list[int]]:
    """Distinct, non-contiguous block ids from the whole pool, per request."""
    counts = [-(-(c + n) // block_size) for c, n in requests]
    ids = torch.randperm(pool, generator=gen)[: sum(counts)].tolist()
    tables, at = [], 0
    for n in counts:
        tables.append(ids[at : at + n])
        at += n
    return tables


def ordered(requests: tuple[Request, ...]) -> tuple[Request, ...]:
    """Decodes first (stable), as the model runner orders a batch."""
    return tuple(sorted(requests, key=lambda r: r[1] != 1))


def build_metadata(
    requests: tuple[Request, ...], tables: list[list[int]], block_size: int, device: torch.device, extra_columns: int = 1
) -> AttentionMetadata:
    """Metadata for a batch (decodes must come first). The block table gets `extra_columns`
    padding entries (0) beyond the widest row, as real tables are wider than needed."""
    slots: list[int] = []
    qsl, seq_lens = [0], []
    for (cached, new), table in zip(requests, tables):
        for p in range(cached, cached + new):
            slots.append(table[p // block_size] * block_size + p % block_size)
        qsl.append(qsl[-1] + new)
        seq_lens.append(cached + new)
    width = max(len(t) for t in tables) + extra_columns
    table_t = torch.zeros((len(requests), width), dtype=torch.int32)
    for i, t in enumerate(tables):
        table_t[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    num_decodes = sum(1 for _, n in requests if n == 1)
    if any(n == 1 for _, n in requests[num_decodes:]):
        raise ValueError("decodes must come first in a batch")
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=table_t.to(device),
        max_query_len=max(n for _, n in requests),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        num_decode_tokens=num_decodes,
    )


def contract_failure(part: str, message: str) -> None:
    """Fail the current test, naming the part of the backend contract that broke."""
    pytest.fail(f"portside conformance [{part}]: {message}", pytrace=False)


def on_cpu(md: AttentionMetadata) -> AttentionMetadata:
    """A copy of `md` with every tensor on the CPU (for the reference)."""
    return dataclasses.replace(
        md,
        slot_mapping=md.slot_mapping.cpu(),
        query_start_loc=md.query_start_loc.cpu(),
        seq_lens=md.seq_lens.cpu(),
        block_tables=md.block_tables.cpu(),
        backend_data=None,
    )


def engine_config(
    platform: type[Platform],
    dtype: torch.dtype,
    block_size: int,
    model_path: str = "",
    max_model_len: int | None = None,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
    kv_cache_dtype: str = "auto",
) -> EngineConfig:
    """A config for building a platform's parts outside an engine, adjusted by the platform.
    The limits (None: the engine's defaults) bound what a graph runner prepares for, so a check
    sets them to what its workload needs, as the engine does for the user's workload."""
    model = ModelConfig(path=model_path, dtype=dtype)
    if max_model_len is not None:
        model = dataclasses.replace(model, max_model_len=max_model_len)
    scheduler = SchedulerConfig()
    if max_num_batched_tokens is not None:
        scheduler = dataclasses.replace(scheduler, max_num_batched_tokens=max_num_batched_tokens)
    if max_num_seqs is not None:
        scheduler = dataclasses.replace(scheduler, max_num_seqs=max_num_seqs)
    cache = CacheConfig(block_size=block_size, kv_cache_dtype=kv_cache_dtype)
    config = EngineConfig(model=model, cache=cache, scheduler=scheduler, device=platform.name)
    return platform.check_and_update_config(config)


# ---- recurrent layers ---------------------------------------------------------------------------

# A recurrent kernel (chunked scans, a different summation order) against core's fp32 reference on
# the same rounded inputs, elementwise |got - want| <= atol + rtol * |want|; outputs and states O(1).
RECURRENT_TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"atol": 2e-4, "rtol": 2e-4},
    torch.float16: {"atol": 3e-2, "rtol": 3e-2},
    torch.bfloat16: {"atol": 5e-2, "rtol": 5e-2},
}


def recurrent_metadata(lengths: list[int], slots: list[int], has_initial_state: list[bool],
                       device: torch.device | str = "cpu", token_state_slots: list[list[int]] | None = None
                       ) -> RecurrentMetadata:
    """A step's `RecurrentMetadata`: request i has lengths[i] tokens, state slot slots[i]; the
    leading one-token requests are its decodes (decodes must come first, as the runner orders).
    `token_state_slots`: speculative verify rows' slots for their per-token states."""
    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    num_decodes = next((i for i, n in enumerate(lengths) if n != 1), len(lengths))
    return RecurrentMetadata(
        state_slots=torch.tensor(slots, dtype=torch.int64, device=device),
        has_initial_state=torch.tensor(has_initial_state, dtype=torch.bool, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        query_start_loc_cpu=qsl,
        state_slots_cpu=list(slots),
        has_initial_state_cpu=list(has_initial_state),
        num_decodes=num_decodes,
        token_state_slots_cpu=[list(k) for k in token_state_slots or []],
    )


# Inputs of the recurrent kernels, fp32 on the CPU, scaled as trained models' are (outputs and
# states O(1)); `gen` seeds them.


def conv_inputs(T: int, C: int, K: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(x [T, C], weight [C, K], bias [C]) for `causal_conv1d`."""
    return torch.randn(T, C, generator=gen), torch.randn(C, K, generator=gen) / math.sqrt(K), torch.randn(C, generator=gen) * 0.1


def ssd_inputs(T: int, H: int, G: int, P: int, N: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(x, dt, A, B, C, D, dt_bias) for `ssd_scan`: softplus(dt + dt_bias) about 0.1 to 1, A in [-7.4, -1]."""
    x = torch.randn(T, H, P, generator=gen)
    dt = torch.randn(T, H, generator=gen) - 1.0
    A = -torch.exp(torch.rand(H, generator=gen) * 2)
    B, C = (torch.randn(T, G, N, generator=gen) / math.sqrt(N) for _ in range(2))
    return x, dt, A, B, C, torch.randn(H, generator=gen), torch.rand(H, generator=gen) * 0.5


def selective_inputs(T: int, Dm: int, N: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(x, dt, A, B, C, D, z, dt_bias) for `selective_scan`, A as Mamba-1 initialises it (S4D-real)."""
    x = torch.randn(T, Dm, generator=gen)
    dt = torch.randn(T, Dm, generator=gen) - 2.0
    A = -torch.arange(1, N + 1, dtype=torch.float32).repeat(Dm, 1) * (0.5 + torch.rand(Dm, 1, generator=gen))
    B, C = (torch.randn(T, N, generator=gen) / math.sqrt(N) for _ in range(2))
    return x, dt, A, B, C, torch.randn(Dm, generator=gen), torch.randn(T, Dm, generator=gen), torch.randn(Dm, generator=gen) * 0.2


def gdr_inputs(T: int, Hk: int, Hv: int, K: int, V: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(q, k, v, g, beta) for `gated_delta_rule`: g = -softplus(...) / 2 <= 0, beta in (0, 1)."""
    q, k = torch.randn(T, Hk, K, generator=gen), torch.randn(T, Hk, K, generator=gen)
    v = torch.randn(T, Hv, V, generator=gen)
    g = -F.softplus(torch.randn(T, Hv, generator=gen)) * 0.5
    return q, k, v, g, torch.sigmoid(torch.randn(T, Hv, generator=gen))
