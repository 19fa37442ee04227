"""`speculative_config` as vLLM takes it: a dict in Python, a JSON object on the command line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
HEAD_METHODS = ("eagle", "eagle3", "mtp")  # a head over the target's hidden states (`spec_decode.eagle`)
MAX_SPECULATIVE_TOKENS = 16  # proposals per step: more only costs forward rows that are rarely accepted
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
         "draft_tensor_parallel_size"}
_UNSUPPORTED = ("medusa", "mlp_speculator", "suffix")
_DEFAULT_LOOKUP = 5  # vLLM's prompt_lookup_min / _max when neither is given


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram", "draft_model", "eagle" or "eagle3"
    num_speculative_tokens: int  # proposals per request and step (k)
    prompt_lookup_min: int = _DEFAULT_LOOKUP  # ngram: shortest suffix matched earlier in the tokens
    prompt_lookup_max: int = _DEFAULT_LOOKUP  # ngram: longest (tried first)
    model: str | None = None  # draft_model: the draft's folder (or .gguf), as given; eagle/eagle3: the head's folder
    draft_tensor_parallel_size: int | None = None  # draft_model: must equal the target's (the draft is sharded alike)
    # draft_model: the draft's resolved portside.config.ModelConfig (set by EngineArgs, which reads its folder)
    draft: Any = None
    # eagle/eagle3: the head's portside.model.eagle.EagleHeadConfig, read and checked by EngineArgs
    head: Any = None

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a request needs past the tokens it verifies: a draft model writes the KV of
        its own proposals (after the step's new token) while it proposes them, as does an EAGLE head."""
        return self.num_speculative_tokens if self.method in ("draft_model", *HEAD_METHODS) else 0

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a dict or a JSON object string (`--speculative-config`); ValueError naming what is wrong."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON ({e.msg}); pass an object such as "
                                 '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be an object, got {type(value).__name__}")
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(_KEYS))}")
        model = value.get("model")
        method = value.get("method") or ("draft_model" if model is not None else None)
        if method in _UNSUPPORTED:
            raise ValueError(f"speculative_config: method {method!r} is not implemented; use 'ngram', 'draft_model' "
                             "(a 'model' with the target's vocabulary), 'eagle' or 'eagle3' (a head's 'model' folder) or 'mtp'")
        if method is None:
            raise ValueError("speculative_config needs 'method' (ngram) or a draft 'model'")
        if method not in METHODS:
            raise ValueError(f"speculative_config: unknown method {method!r}; use one of {', '.join(METHODS)}")
        if method == "mtp" and model is not None:
            raise ValueError("speculative_config: method 'mtp' takes no 'model': the MTP layers are the target's own")
        if method not in ("ngram", "mtp") and not (isinstance(model, str) and model):
            what = "the draft model's folder" if method == "draft_model" else f"the {method} head's folder"
            raise ValueError(f"speculative_config: method {method!r} needs 'model', {what}")
        if method != "ngram" and ("prompt_lookup_min" in value or "prompt_lookup_max" in value):
            raise ValueError("speculative_config: prompt_lookup_min / prompt_lookup_max apply to method 'ngram' only")
        if method == "ngram" and model is not None:
            raise ValueError("speculative_config: method 'ngram' takes no 'model'; drop it or use method 'draft_model'")
        draft_tp = value.get("draft_tensor_parallel_size")
        if draft_tp is not None and not (_is_int(draft_tp) and draft_tp >= 1):
            raise ValueError(f"speculative_config: draft_tensor_parallel_size must be a positive integer, got {draft_tp!r}")
        k = value.get("num_speculative_tokens")
        if not (isinstance(k, int) and _is_int(k) and 1 <= k <= MAX_SPECULATIVE_TOKENS):
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer from 1 to "
                             f"{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        lo, hi = (lo if lo is not None else hi), (hi if hi is not None else lo)
        lo, hi = (_DEFAULT_LOOKUP if lo is None else lo), (_DEFAULT_LOOKUP if hi is None else hi)
        if not (isinstance(lo, int) and isinstance(hi, int) and _is_int(lo) and _is_int(hi) and 1 <= lo <= hi):
            raise ValueError("speculative_config: prompt_lookup_min and prompt_lookup_max must be integers with "
                             f"1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r} and {hi!r}")
        if method != "ngram":
            return cls(method=method, num_speculative_tokens=k, model=model, draft_tensor_parallel_size=draft_tp)
        return cls(method=method, num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi)

    def describe(self) -> str:
        if self.method == "mtp":
            return f"the checkpoint's MTP layer, {self.num_speculative_tokens} tokens"
        if self.method != "ngram":
            what = "draft model" if self.method == "draft_model" else f"{self.method} head"
            return f"{what} {self.model}, {self.num_speculative_tokens} tokens"
        return (f"{self.method}, {self.num_speculative_tokens} tokens, lookup "
                f"{self.prompt_lookup_min}-{self.prompt_lookup_max}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
