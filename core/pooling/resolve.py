"""Which runner a model gets and, for a pooling model, its `PoolerConfig`, as vLLM names the
choices: `--runner auto|generate|pooling` (portside's older `--task generate|embed|classify|
score|reward` is the same flag), `--convert auto|none|embed|classify|reward` (a model made a
pooling model of that task), `--pooling-type`, `--pooler-config` (JSON: pooling_type, normalize,
use_activation) and the `--hf-overrides` keys vLLM's Qwen3-Reranker recipe uses
(`classifier_from_token`, `is_original_qwen3_reranker`, `architectures`).

Precedence, most specific first: the flags, --pooler-config, the folder's sentence-transformers
files (`st_folder`), the architecture's `default_pooling_type`, then "last" and normalised."""

from __future__ import annotations

import json
import logging
from typing import Any

from portside.config import POOLING_TYPES, PoolerConfig
from portside.pooling.st_folder import read_st_folder

logger = logging.getLogger(__name__)

RUNNER_CHOICES = ("auto", "generate", "pooling", "embed", "classify", "score", "reward")
CONVERT_CHOICES = ("auto", "none", "embed", "classify", "reward")
_POOLER_KEYS = {"pooling_type", "normalize", "use_activation", "activation"}
_OVERRIDE_KEYS = {"architectures", "classifier_from_token", "is_original_qwen3_reranker", "method"}


def parse_json_option(value: dict[str, Any] | str | None, name: str, allowed: set[str]) -> dict[str, Any]:
    """A JSON-object option (--pooler-config, --hf-overrides) as a dict; ValueError naming the fix."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}: not valid JSON ({e}); pass a JSON object") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}: expected a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {', '.join(unknown)}; portside reads {', '.join(sorted(allowed))}")
    return value


def resolve_pooler(path: str, hf: dict[str, Any], *, task: str, convert: str | None, pooling_type: str | None,
                   pooler_config: dict[str, Any] | str | None, hf_overrides: dict[str, Any] | str | None,
                   tokenizer: str | None = None) -> PoolerConfig | None:
    """None for a generating model, else the pooling model's `PoolerConfig`."""
    task, convert = (task or "auto").lower(), (convert or "auto").lower()
    if task not in RUNNER_CHOICES:
        raise ValueError(f"unknown task {task!r}; use one of {', '.join(RUNNER_CHOICES)}")
    if convert not in CONVERT_CHOICES:
        raise ValueError(f"unknown convert {convert!r}; use one of {', '.join(CONVERT_CHOICES)}")
    opts = parse_json_option(pooler_config, "pooler_config", _POOLER_KEYS)
    overrides = parse_json_option(hf_overrides, "hf_overrides", _OVERRIDE_KEYS)
    arch, cls = _architecture(hf)
    from_tokens = _from_token_ids(overrides, path, tokenizer)
    has_head = hasattr(cls, "classify") or bool(from_tokens)
    # a model that cannot generate: an encoder (no compute_logits) or a decoder without its LM head
    pooling_only = getattr(cls, "is_pooling_model", False) or (
        getattr(cls, "default_pooling_type", None) is not None and not hasattr(cls, "compute_logits"))
    wanted = convert if convert not in ("auto", "none") else None
    if task == "generate":
        if wanted or pooling_type is not None or opts or from_tokens:
            raise ValueError("convert, pooling_type, pooler_config and classifier_from_token apply to pooling models; "
                             "pass --runner pooling")
        if pooling_only:
            raise ValueError(f"{arch} is a pooling model (it has no LM head to generate with); serve it with "
                             "--runner pooling")
        return None
    if task == "auto" and not (wanted or from_tokens or has_head or getattr(cls, "default_pooling_type", None)
                               or pooling_type is not None or opts):
        return None
    named = {"embed": "embed", "classify": "classify", "reward": "reward"}.get(task)
    if named and wanted and named != wanted:
        raise ValueError(f"task {task!r} and convert {convert!r} disagree; pass one of them")
    pool_task = named or wanted or ("classify" if has_head else "embed")
    if pool_task != "embed" and not has_head:
        raise ValueError(f"{arch} has no classifier: task {pool_task} needs a *ForSequenceClassification checkpoint, or "
                         "the LM head's logits of chosen tokens: --hf-overrides '{\"classifier_from_token\": [\"no\", "
                         "\"yes\"]}' (vLLM's Qwen3-Reranker recipe)")
    return _pooler(path, hf, cls, pool_task, pooling_type, opts, from_tokens)


def _pooler(path: str, hf: dict[str, Any], cls: Any, task: str, pooling_type: str | None, opts: dict[str, Any],
            from_tokens: tuple[int, ...]) -> PoolerConfig:
    st = read_st_folder(path)
    # a classifier reads the pooling its head was trained on (ModernBERT's classifier_pooling), else the class's
    head_pooling = hf.get("classifier_pooling") if task != "embed" else None
    kind = pooling_type or opts.get("pooling_type") or st.pooling_type or head_pooling \
        or getattr(cls, "default_pooling_type", None) or "last"
    kind = str(kind).lower()
    kind = {"lasttoken": "last", "last_token": "last"}.get(kind, kind)
    if kind not in POOLING_TYPES:
        raise ValueError(f"unknown pooling type {kind!r}; use one of {', '.join(POOLING_TYPES)}")
    normalize = opts.get("normalize", True)
    if not isinstance(normalize, bool):
        raise ValueError(f"pooler_config: normalize must be true or false, got {normalize!r}")
    id2label = hf.get("id2label") or {}
    labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(len(id2label)))
    num_labels = (1 if len(from_tokens) == 2 else len(from_tokens)) if from_tokens else \
        int(hf.get("num_labels") or len(labels) or 0)
    if from_tokens:
        labels = ()
    activation = "none"
    if task == "classify" and opts.get("use_activation", opts.get("activation", True)) is not False:
        activation = st.cross_encoder_activation or ("sigmoid" if num_labels == 1 else "softmax")
    dense = tuple(st.dense) if task == "embed" else ()
    return PoolerConfig(
        pooling_type=kind, normalize=normalize if task == "embed" else False, task=task, dense=dense,
        activation=activation, from_token_ids=from_tokens, num_labels=num_labels if task != "embed" else 0,
        labels=labels if task != "embed" else (),
        output_size=(st.dense_out if dense and st.dense_out else int(hf.get("hidden_size") or 0)) if task == "embed" else 0,
        matryoshka_dimensions=tuple(int(d) for d in hf.get("matryoshka_dimensions") or ()),
        prompts=tuple(sorted(st.prompts.items())), default_prompt_name=st.default_prompt_name,
        include_prompt=st.include_prompt,
    )


def _architecture(hf: dict[str, Any]) -> tuple[str, Any]:
    from portside.model.registry import model_class

    archs = hf.get("architectures") or []
    if not archs:
        return "?", object
    try:
        return archs[0], model_class(archs[0])
    except ValueError:
        return archs[0], object  # unsupported: load_model names the supported ones


def _from_token_ids(overrides: dict[str, Any], path: str, tokenizer: str | None) -> tuple[int, ...]:
    """`classifier_from_token` (token strings; with `is_original_qwen3_reranker`, ["no", "yes"] by
    default) as token ids of the model's tokenizer."""
    tokens = overrides.get("classifier_from_token")
    if tokens is None and overrides.get("is_original_qwen3_reranker"):
        tokens = ["no", "yes"]
    if tokens is None:
        arch = (overrides.get("architectures") or [""])[0]
        if arch.endswith("ForSequenceClassification"):
            raise ValueError("hf_overrides: architectures ...ForSequenceClassification on a causal LM needs "
                             "classifier_from_token (the LM head tokens whose logits score), e.g. [\"no\", \"yes\"]")
        return ()
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"hf_overrides: classifier_from_token must be a non-empty list of token strings, got {tokens!r}")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer or path)
    ids = []
    for t in tokens:
        tid = tok.convert_tokens_to_ids(t)
        if tid is None or tid == tok.unk_token_id:
            enc = tok.encode(t, add_special_tokens=False)
            if len(enc) != 1:
                raise ValueError(f"hf_overrides: classifier_from_token {t!r} is not one token of this tokenizer")
            tid = enc[0]
        ids.append(int(tid))
    logger.info("pooling: classifier from the LM head's logits of tokens %s (ids %s)", tokens, ids)
    return tuple(ids)
