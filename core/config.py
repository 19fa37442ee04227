"""Frozen engine configuration. Adjust with `dataclasses.replace`; each component gets only the
sub-config it needs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from portside.kv_transfer.config import KVTransferConfig
from portside.quant.config import QuantConfig
from portside.spec_decode.config import SpeculativeConfig

POOLING_TYPES = ("last", "mean", "cls", "max")
POOLING_TASKS = ("embed", "classify", "reward")  # what a pooling model's vector is (score: embed or classify)


@dataclass(frozen=True)
class PoolerConfig:
    """A pooling model (vLLM's --runner pooling): how a prompt's final hidden states (after the
    final norm) become its one output vector; resolved by `portside.pooling.resolve`.

    `pooling_type`: `last` (vLLM's default for decoder LMs), `mean` over every prompt token, `cls`
    (the first token's) or `max` (elementwise). `task` embed: the pooled state through the
    sentence-transformers Dense layers (`dense`: their folders), L2-normalised when `normalize`;
    classify / reward: the model's classifier (`num_labels` logits; `from_token_ids`: the LM
    head's logits of those tokens, two of them as one logit, the second's minus the first's).
    `activation` (classify only; applied by the front end): softmax, sigmoid or none."""

    pooling_type: str = "last"
    normalize: bool = True
    task: str = "embed"
    dense: tuple[str, ...] = ()
    activation: str = "none"
    from_token_ids: tuple[int, ...] = ()
    num_labels: int = 0  # classify / reward: logits per input
    labels: tuple[str, ...] = ()  # classify: the config's id2label, in id order
    output_size: int = 0  # embed: the vector's size before any `dimensions` truncation (0: unknown)
    matryoshka_dimensions: tuple[int, ...] = ()  # the sizes a model was trained for (empty: any up to output_size)
    prompts: tuple[tuple[str, str], ...] = ()  # sentence-transformers' named prompts (instructions)
    default_prompt_name: str | None = None
    include_prompt: bool = True  # sentence-transformers' Pooling include_prompt

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"unknown pooling type {self.pooling_type!r}; use one of {', '.join(POOLING_TYPES)}")
        if self.task not in POOLING_TASKS:
            raise ValueError(f"unknown pooling task {self.task!r}; use one of {', '.join(POOLING_TASKS)}")
        if self.activation not in ("softmax", "sigmoid", "none"):
            raise ValueError(f"unknown activation {self.activation!r}; use softmax, sigmoid or none")


@dataclass(frozen=True)
class ModelConfig:
    path: str  # local folder with config.json + safetensors, or a .gguf file
    tokenizer: str | None = None  # defaults to `path`
    dtype: torch.dtype = torch.float32
    max_model_len: int = 2048
    seed: int = 0
    quantization: QuantConfig | None = None  # None: full-precision weights
    pooler: PoolerConfig | None = None  # task embed: requests return a pooled vector, never sample
    max_logprobs: int = 20  # most logprobs / top_logprobs a request may ask for (-1: no limit), as vLLM's
    logprobs_mode: str = "raw_logprobs"  # what logprobs hold: raw_/processed_ logprobs/logits (vLLM's; portside.sample.sampler)

    @property
    def task(self) -> str:
        """The runner: "generate", or "embed" for any pooling model (`pooling_task` says which)."""
        return "generate" if self.pooler is None else "embed"

    @property
    def pooling_task(self) -> str | None:
        """A pooling model's task (`PoolerConfig.task`: embed, classify or reward); None: generate."""
        return None if self.pooler is None else self.pooler.task


@dataclass(frozen=True)
class CacheConfig:
    block_size: int | None = None  # None: the platform's default
    num_kv_blocks: int | None = None  # exact pool size; wins over kv_cache_memory
    # bytes (> 1) or a fraction (0 < x <= 1) of the device's free memory after loading the
    # model; None: the platform's default
    kv_cache_memory: float | None = None
    # vLLM's --gpu-memory-utilization: the fraction (0 < x <= 1) of the device's total memory that
    # weights and KV cache may fill, less what is in use already (see `kv_cache_budget`)
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype), "fp8", "fp8_e4m3", "fp8_e5m2", "int8"
    # hybrid models: the SSM / delta-rule state's dtype ("auto": the checkpoint config's
    # mamba_ssm_cache_dtype, else the model's dtype; "float32" for accuracy at twice the bytes)
    mamba_ssm_cache_dtype: str = "auto"


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget per step
    max_num_seqs: int = 128  # running requests at once
    policy: str = "fcfs"  # "fcfs" or "priority"
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be at least 1")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {self.policy!r}; use 'fcfs' or 'priority'")


@dataclass(frozen=True)
class ParallelConfig:
    """One engine replica runs on `world_size` = TP x PP ranks, rank = pp_rank * TP + tp_rank
    (a pipeline stage's tensor-parallel group is consecutive ranks); `data_parallel_size`
    replicas of it serve behind one API server."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str = "mp"  # "mp" (local worker processes) or "ray" (one actor per rank)
    pipeline_layers: tuple[int, ...] | None = None  # decoder layers per stage (None: balanced by count)
    # scheduled steps the engine keeps in flight so the stages overlap (1: one at a time)
    pipeline_micro_batches: int = 1
    # most tokens one micro-batch computes (None: max_num_batched_tokens / pipeline_micro_batches)
    pipeline_micro_batch_tokens: int | None = None

    @property
    def world_size(self) -> int:
        """Ranks of one engine replica."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def output_rank(self) -> int:
        """The rank whose `ModelRunnerOutput` the engine reads: the first of the last stage (it samples)."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving: adapters in `max_loras` device slots, `max_cpu_loras` kept loaded on
    the host (least recently used evicted), ranks up to `max_lora_rank`."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")

    @property
    def host_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass(frozen=True)
class MultiModalConfig:
    """Images in prompts (vision-language models only; `portside.multimodal`)."""

    # most items of a modality in one prompt (`--limit-mm-per-prompt '{"image": N}'`)
    limit_per_prompt: tuple[tuple[str, int], ...] = (("image", 4),)
    # image embedding rows the encoder may compute in one step (None: the step's token budget)
    max_encoder_tokens_per_step: int | None = None
    encoder_cache_size: int = 8192  # image embedding rows kept for reuse, by content hash

    def limit(self, modality: str) -> int:
        return dict(self.limit_per_prompt).get(modality, 0)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig | None = None  # None: LoRA adapters disabled
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    multimodal: MultiModalConfig = field(default_factory=MultiModalConfig)  # used by vision-language models
    device: str | None = None  # platform name; None: auto-detect
    # options only the platform understands (e.g. {"cpu_graph": "inductor"}; --backend-option KEY=VALUE):
    # checked against `Platform.backend_options` (`portside.contract.check_backend_options`), then by the platform
    platform_options: tuple[tuple[str, str], ...] = ()
    # --batch-invariant: a request's tokens and logprobs do not depend on its batch (portside.ops.batch_invariant)
    batch_invariant: bool = False
    # a KV connector (host and disk tiers behind the device cache, swap preemption; `portside.kv_transfer`); None: none
    kv_transfer: KVTransferConfig | None = None

    def option(self, key: str, default: str | None = None) -> str | None:
        return dict(self.platform_options).get(key, default)
