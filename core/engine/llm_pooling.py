"""`LLM`'s pooling methods (an engine made with --runner pooling), as vLLM's: `embed`,
`classify`, `score` (cross-encoder pairs, or the cosine of two embeddings), `reward` and
`encode` (the runner's raw vectors). Every prompt of a call is submitted at once, so the
scheduler batches them (`LLM._run`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from portside.config import PoolerConfig
from portside.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from portside.pooling.inputs import as_prompt_list, pair_prompt, resolve_prompt, score_pairs, truncate_ids, with_prompt
from portside.pooling.outputs import (
    ClassificationOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    activate,
    check_dimensions,
    cosine,
    truncate_dimensions,
)
from portside.pooling.params import PoolingParams

_METHOD = {"embed": "LLM.embed", "classify": "LLM.classify (or LLM.score)", "reward": "LLM.reward"}


class LLMPooling:
    """Mixed into `LLM`: needs its `engine` and `_run`."""

    engine: Any
    _run: Callable[..., list[RequestOutput]]  # LLM._run

    def _pooler(self, method: str, *tasks: str) -> PoolerConfig:
        """The engine's PoolerConfig; ValueError naming the mismatch for another task's method."""
        pooler: PoolerConfig | None = self.engine.config.model.pooler
        if pooler is None:
            raise ValueError(f"LLM.{method} needs a pooling model: make the LLM with runner='pooling' (--runner pooling), "
                             "or task='embed' / 'classify' / 'reward'")
        if pooler.task not in tasks:
            raise ValueError(f"LLM.{method} does not apply to this model: its pooling task is {pooler.task!r}; use "
                             f"{_METHOD[pooler.task]}")
        return pooler

    def _pool(self, prompts: list[Any], truncate_prompt_tokens: int | None, use_tqdm: bool, lora_request: Any,
              add_special_tokens: bool = True) -> list[RequestOutput]:
        if truncate_prompt_tokens is not None:
            prompts = [self._truncated(p, truncate_prompt_tokens) for p in prompts]
        return self._run(prompts, None, use_tqdm, None, add_special_tokens=add_special_tokens, lora_request=lora_request,
                         task="embed")

    def _truncated(self, prompt: Any, k: int) -> list[int]:
        value: Any = prompt.get("prompt_token_ids", prompt.get("prompt", "")) if isinstance(prompt, dict) else prompt
        ids: list[int] = self.engine.tokenizer.encode(value) if isinstance(value, str) else list(value)
        return truncate_ids(ids, k, self.engine.max_model_len)

    def embed(
        self,
        prompts: Any,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        lora_request: Any = None,
        prompt_name: str | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in prompt order: the pooled final hidden states through the
        model's Dense layers, L2-normalised. `truncate_prompt_tokens`: keep a prompt's last k
        tokens (-1: the last max_model_len); `pooling_params.dimensions`: Matryoshka truncation;
        `prompt_name`: one of the folder's sentence-transformers prompts before each text (its
        default_prompt_name where it has one)."""
        pooler = self._pooler("embed", "embed")
        params = pooling_params or PoolingParams()
        check_dimensions(pooler, params.dimensions)
        if params.normalize is not None and params.normalize != pooler.normalize:
            raise ValueError(f"pooling_params.normalize: this engine's embeddings are {'' if pooler.normalize else 'not '}"
                             "normalised; set it with --pooler-config '{\"normalize\": ...}'")
        prefix = resolve_prompt(pooler, prompt_name=prompt_name)
        items = as_prompt_list(prompts)
        if prompt_name is not None and prefix and any(with_prompt(prefix, p) is p for p in items):
            raise ValueError("prompt_name: applies to text prompts; these are token ids (put the prompt's tokens first)")
        items = [with_prompt(prefix, p) for p in items]
        outs = self._pool(items, truncate_prompt_tokens, use_tqdm, lora_request)
        return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(truncate_dimensions(list(o.pooled or []),
                                       params.dimensions, pooler.normalize)), o.prompt_token_ids, o.finished)
                for o in outs]

    def classify(self, prompts: Any, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
                 pooling_params: PoolingParams | None = None,
                 lora_request: Any = None) -> list[PoolingRequestOutput[ClassificationOutput]]:
        """Each prompt's class probabilities (the classifier's logits through softmax, or sigmoid
        for one label; `pooling_params.use_activation=False`: the logits)."""
        pooler = self._pooler("classify", "classify")
        use = (pooling_params or PoolingParams()).use_activation
        outs = self._pool(as_prompt_list(prompts), truncate_prompt_tokens, use_tqdm, lora_request)
        return [PoolingRequestOutput(o.request_id, ClassificationOutput(activate(pooler, list(o.pooled or []), use)),
                                     o.prompt_token_ids, o.finished) for o in outs]

    def reward(self, prompts: Any, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
               lora_request: Any = None) -> list[PoolingRequestOutput[PoolingOutput]]:
        """Each prompt's reward: the reward model's (a *ForSequenceClassification served with
        task reward) raw output for its last token."""
        self._pooler("reward", "reward")
        outs = self._pool(as_prompt_list(prompts), truncate_prompt_tokens, use_tqdm, lora_request)
        return [PoolingRequestOutput(o.request_id, PoolingOutput(list(o.pooled or [])), o.prompt_token_ids, o.finished)
                for o in outs]

    def encode(self, prompts: Any, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
               lora_request: Any = None) -> list[PoolingRequestOutput[PoolingOutput]]:
        """Each prompt's vector as the runner computes it (any pooling task; no activation)."""
        self._pooler("encode", "embed", "classify", "reward")
        outs = self._pool(as_prompt_list(prompts), truncate_prompt_tokens, use_tqdm, lora_request)
        return [PoolingRequestOutput(o.request_id, PoolingOutput(list(o.pooled or [])), o.prompt_token_ids, o.finished)
                for o in outs]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, pooling_params: PoolingParams | None = None,
              lora_request: Any = None) -> list[PoolingRequestOutput[ScoringOutput]]:
        """A score per (data_1, data_2) pair (one data_1 against each data_2, or two lists zipped):
        a cross-encoder (a classifier of one label) reads each pair as one prompt, tokenized as a
        text pair, and its score is the activated logit; an embedding model's score is the cosine
        of the two texts' embeddings."""
        pooler = self._pooler("score", "embed", "classify")
        pairs = score_pairs(data_1, data_2, ("data_1", "data_2"))
        if pooler.task == "embed":
            return self._cosine_scores(pairs, truncate_prompt_tokens, use_tqdm, lora_request)
        if pooler.num_labels != 1:
            raise ValueError(f"LLM.score needs a classifier of one label (a cross-encoder); this one has {pooler.num_labels}: "
                             "use LLM.classify")
        engine = self.engine
        prompts = [pair_prompt(engine.tokenizer, engine.config.model.path, a, b, truncate_prompt_tokens, engine.max_model_len)
                   for a, b in pairs]
        outs = self._run(prompts, None, use_tqdm, None, add_special_tokens=False, lora_request=lora_request, task="embed")
        use = (pooling_params or PoolingParams()).use_activation
        return [PoolingRequestOutput(o.request_id, ScoringOutput(activate(pooler, list(o.pooled or []), use)[0]),
                                     o.prompt_token_ids, o.finished) for o in outs]

    def _cosine_scores(self, pairs: list[tuple[str, str]], truncate: int | None, use_tqdm: bool,
                       lora_request: Any) -> list[PoolingRequestOutput[ScoringOutput]]:
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # each distinct text embedded once
        outs = self._pool(list(texts), truncate, use_tqdm, lora_request)
        vec = {t: list(o.pooled or []) for t, o in zip(texts, outs)}
        ids = {t: o.prompt_token_ids for t, o in zip(texts, outs)}
        return [PoolingRequestOutput(f"score-{i}", ScoringOutput(cosine(vec[a], vec[b])), ids[a] + ids[b])
                for i, (a, b) in enumerate(pairs)]
