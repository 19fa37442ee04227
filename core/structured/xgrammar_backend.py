"""xgrammar (vLLM's default grammar engine) behind the backend contract, the alternative to
llguidance (`--structured-outputs-backend xgrammar`). JSON is compiled compact and in strict mode
(no properties the schema does not name) only with `disable_additional_properties`, as llguidance."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import xgrammar

from portside.structured.params import StructuredOutputsParams


@dataclass
class XGrammarMatcher:
    m: xgrammar.GrammarMatcher

    def accept_token(self, token_id: int) -> bool:
        return bool(self.m.accept_token(token_id))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self.m.is_terminated())

    def error(self) -> str | None:
        return None


@dataclass
class XGrammarGrammar:
    compiled: xgrammar.CompiledGrammar
    stop_token_ids: list[int] | None

    def matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(xgrammar.GrammarMatcher(self.compiled, override_stop_tokens=self.stop_token_ids))


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.vocab_size = max(vocab_size, len(tokenizer))
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size, stop_token_ids=eos_token_ids or None)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.stop_token_ids = eos_token_ids or None

    def compile(self, params: StructuredOutputsParams) -> XGrammarGrammar:
        kind = params.kind
        try:
            if kind in ("json", "json_object"):
                compact = params.disable_any_whitespace and params.whitespace_pattern is None
                compiled = self.compiler.compile_json_schema(
                    params.schema(),  # type: ignore[arg-type]
                    any_whitespace=not compact,
                    separators=(",", ":") if compact else None,
                    strict_mode=params.disable_additional_properties,
                )
            elif kind == "regex":
                compiled = self.compiler.compile_regex(params.spec)
            elif kind == "choice":
                grammar = "root ::= " + " | ".join(_ebnf_literal(c) for c in params.choice or [])
                compiled = self.compiler.compile_grammar(grammar)
            else:
                compiled = self.compiler.compile_grammar(params.spec)
        except (RuntimeError, ValueError) as e:  # xgrammar reports grammar errors as RuntimeError
            raise ValueError(f"structured_outputs: invalid {kind}: {e}") from None
        return XGrammarGrammar(compiled, self.stop_token_ids)


def _ebnf_literal(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    return f'"{escaped}"'
