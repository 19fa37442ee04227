"""`StructuredOutputsParams`: what a request constrains its output to, as vLLM names it.

Exactly one of `json`, `regex`, `choice`, `grammar`, `json_object` is set. `key` identifies the
compiled grammar, so requests with the same constraint share one compilation.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None  # a JSON schema (object or its text)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF / GBNF (llama.cpp) or Lark
    json_object: bool | None = None  # any JSON object
    # whitespace inside JSON: compact by default (unbounded whitespace lets a model loop forever);
    # False allows the flexible whitespace JSON permits, a regex string chooses it
    disable_any_whitespace: bool = True
    whitespace_pattern: str | None = None
    # a JSON schema without `additionalProperties` allows none (OpenAI strict mode does the same)
    disable_additional_properties: bool = False
    # with a --reasoning-parser: the constraint applies to the answer after the reasoning (False:
    # from the first token, as the completions endpoint, which returns raw text, asks)
    after_reasoning: bool = True

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text: schema JSON, regex, choices as a JSON list, or grammar text."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            return value if isinstance(value, str) else _json.dumps(value, sort_keys=True)
        if self.kind == "choice":
            return _json.dumps(value)
        return "" if self.kind == "json_object" else value

    @property
    def key(self) -> tuple[Any, ...]:
        return (self.kind, self.spec, self.disable_any_whitespace, self.whitespace_pattern, self.disable_additional_properties)

    def validate(self) -> None:
        """Raise ValueError (naming `structured_outputs`) unless exactly one constraint is set and
        it has the right type."""
        kinds = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(
                f"structured_outputs: exactly one of {', '.join(_KINDS)} must be set, got "
                + (", ".join(kinds) if kinds else "none")
            )
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = _json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"structured_outputs: json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs: json must be a JSON schema (an object)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs: {name} must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured_outputs: choice must be a non-empty list of non-empty strings")
        if self.json_object not in (None, True, False):
            raise ValueError("structured_outputs: json_object must be a boolean")

    def schema(self) -> dict[str, Any] | bool | None:
        """The JSON schema as an object (json / json_object kinds), else None."""
        if self.kind == "json_object":
            return {"type": "object"}
        if self.kind != "json":
            return None
        schema = _json.loads(self.json) if isinstance(self.json, str) else self.json
        return _closed(schema) if self.disable_additional_properties else schema  # type: ignore[arg-type]


def _closed(node: Any) -> Any:
    """A copy of a schema in which every object schema without `additionalProperties` has it false."""
    if isinstance(node, list):
        return [_closed(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _closed(v) for k, v in node.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name
