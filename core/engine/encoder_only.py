"""Engine settings for an encoder-only model (BERT, XLM-R, ModernBERT: registry need
"bidirectional"): its attention sees every token of a prompt at once, so each prompt is computed
whole in one step (no chunked prefill: a prompt over the step's token budget is refused, naming
the limit), nothing comes from a prefix cache, and the context is what its position table holds."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from portside.config import EngineConfig
from portside.model.registry import architecture_needs

__all__ = ["encoder_only_config", "is_encoder_only"]

logger = logging.getLogger(__name__)

_OFFSET_POSITIONS = ("roberta", "xlm-roberta", "camembert")  # positions start after the padding index


def is_encoder_only(hf: dict[str, Any]) -> bool:
    """Whether a config.json (as a dict) names an encoder-only architecture."""
    return "bidirectional" in architecture_needs((hf.get("architectures") or [""])[0])


def _position_limit(hf: dict[str, Any]) -> int | None:
    max_pos = hf.get("max_position_embeddings")
    if max_pos is None:
        return None
    if hf.get("model_type") in _OFFSET_POSITIONS:
        pad = hf.get("pad_token_id")
        return int(max_pos) - (1 if pad is None else int(pad)) - 1
    return int(max_pos)


def _refuse_unsupported(config: EngineConfig, arch: str) -> None:
    """What an encoder-only model does not run with: refused by name rather than ignored."""
    par = config.parallel
    refused = [
        (par.tensor_parallel_size > 1, f"tensor_parallel_size {par.tensor_parallel_size}", "--tensor-parallel-size 1 "
         "(scale out with --data-parallel-size)"),
        (par.pipeline_parallel_size > 1, f"pipeline_parallel_size {par.pipeline_parallel_size}",
         "--pipeline-parallel-size 1"),
        (config.lora is not None, "LoRA adapters (enable_lora)", "drop --enable-lora"),
        (config.cache.kv_cache_dtype not in ("auto", None), f"--kv-cache-dtype {config.cache.kv_cache_dtype} (it keeps no "
         "KV cache)", "drop --kv-cache-dtype"),
    ]
    for bad, what, fix in refused:
        if bad:
            raise ValueError(f"{arch} (an encoder-only model) does not run with {what}; {fix}")


def encoder_only_config(config: EngineConfig, hf: dict[str, Any], max_model_len: int | None,
                        max_num_batched_tokens: int | None) -> EngineConfig:
    """`config` for the model of `hf` (config.json): unchanged for a decoder; for an encoder-only
    model whole prompts (chunked prefill off, a step budget of at least max_model_len), no prefix
    cache, and a context no longer than its positions (XLM-R's start after the padding index).
    `max_model_len` / `max_num_batched_tokens`: what the user asked for (None: the default)."""
    if not is_encoder_only(hf):
        return config
    arch = hf["architectures"][0]
    if config.model.pooler is None:
        raise ValueError(f"{arch} is an encoder-only model: it pools (embed, classify, score), it does not generate; "
                         "drop --task generate (or pass --runner pooling)")
    _refuse_unsupported(config, arch)
    model_len = config.model.max_model_len
    limit = _position_limit(hf)
    if limit is not None and model_len > limit:
        if max_model_len is not None:
            raise ValueError(f"max_model_len {max_model_len}: {arch} has {limit} positions; pass at most {limit}")
        model_len = limit
    budget = config.scheduler.max_num_batched_tokens
    if budget < model_len:
        if max_num_batched_tokens is not None:
            raise ValueError(
                f"max_num_batched_tokens {budget} is below max_model_len {model_len}: {arch} (bidirectional "
                f"attention) computes each prompt whole in one step, so a prompt of up to {model_len} tokens must "
                "fit one step's budget; raise max_num_batched_tokens or lower max_model_len")
        budget = model_len
    if config.scheduler.enable_chunked_prefill:
        logger.info("%s: encoder-only model; each prompt is computed whole in one step (no chunked prefill, "
                    "prompts of up to %d tokens)", arch, model_len)
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, max_model_len=model_len),
        cache=dataclasses.replace(config.cache, enable_prefix_caching=False),
        scheduler=dataclasses.replace(config.scheduler, enable_chunked_prefill=False, max_num_batched_tokens=budget),
    )
