"""`speculative_config` as vLLM takes it: a dict in Python, a JSON object on the command line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16  # proposals per step: more only costs forward rows that are rarely accepted
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model"}
_DEFAULT_LOOKUP = 5  # vLLM's prompt_lookup_min / _max when neither is given


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram"
    num_speculative_tokens: int  # proposals per request and step (k)
    prompt_lookup_min: int = _DEFAULT_LOOKUP  # ngram: shortest suffix matched earlier in the tokens
    prompt_lookup_max: int = _DEFAULT_LOOKUP  # ngram: longest (tried first)

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
        method = value.get("method")
        if value.get("model") is not None or method in ("draft_model", "eagle", "eagle3", "medusa", "mtp"):
            raise ValueError("speculative_config: draft-model speculation (a 'model' or method "
                             f"{method or 'draft_model'!r}) is not implemented; use method 'ngram'")
        if method is None:
            raise ValueError("speculative_config needs 'method' (ngram)")
        if method not in METHODS:
            raise ValueError(f"speculative_config: unknown method {method!r}; use one of {', '.join(METHODS)}")
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
        return cls(method=method, num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi)

    def describe(self) -> str:
        return (f"{self.method}, {self.num_speculative_tokens} tokens, lookup "
                f"{self.prompt_lookup_min}-{self.prompt_lookup_max}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
