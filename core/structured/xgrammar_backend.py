"""xgrammar (vLLM's default grammar engine) behind the backend contract, the alternative to
llguidance (`--structured-outputs-backend xgrammar`). JSON is compiled compact and in strict mode
(no properties the schema does not name) only with `disable_additional_properties`, as llguidance.

xgrammar 0.2.8 lets raw control characters into JSON strings (invalid JSON to a strict parser:
measured in 5-7 of 16 outputs). Compact JSON has no whitespace outside strings, so no raw byte
below 0x20 is ever valid in it: its masks are intersected with the tokens free of such bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import xgrammar

from portside.structured.params import StructuredOutputsParams


@dataclass
class XGrammarMatcher:
    m: xgrammar.GrammarMatcher
    allowed: torch.Tensor | None = None  # [W] int32: tokens the output may ever contain

    def accept_token(self, token_id: int) -> bool:
        return bool(self.m.accept_token(token_id))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)
        if self.allowed is not None:
            bitmask[row] &= self.allowed

    def is_terminated(self) -> bool:
        return bool(self.m.is_terminated())

    def error(self) -> str | None:
        return None

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.m.rollback(num_tokens)


@dataclass
class XGrammarGrammar:
    compiled: xgrammar.CompiledGrammar
    stop_token_ids: list[int] | None
    allowed: torch.Tensor | None = None

    def matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(xgrammar.GrammarMatcher(self.compiled, override_stop_tokens=self.stop_token_ids), self.allowed)


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.vocab_size = max(vocab_size, len(tokenizer))
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size, stop_token_ids=eos_token_ids or None)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.stop_token_ids = eos_token_ids or None
        self.no_control = _tokens_without_control_bytes(info, self.vocab_size)

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
        compact_json = kind in ("json", "json_object") and params.disable_any_whitespace and params.whitespace_pattern is None
        return XGrammarGrammar(compiled, self.stop_token_ids, self.no_control if compact_json else None)


def _tokens_without_control_bytes(info: xgrammar.TokenizerInfo, vocab_size: int) -> torch.Tensor:
    """[ceil(V / 32)] int32: bit t set unless token t's bytes hold one below 0x20 (special
    tokens, which xgrammar lists with their text, stay allowed)."""
    allowed = torch.ones(((vocab_size + 31) // 32) * 32, dtype=torch.int64)
    special = set(info.special_token_ids)
    for t, raw in enumerate(info.decoded_vocab[:vocab_size]):
        if t not in special and any(b < 0x20 for b in raw):
            allowed[t] = 0
    packed = (allowed.view(-1, 32) << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _ebnf_literal(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    return f'"{escaped}"'
