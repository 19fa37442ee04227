"""llguidance (Microsoft's Rust grammar engine) behind the backend contract: JSON schemas,
regexes, choices and Lark / GBNF grammars, with its per-step resource limits (a mask step never
runs away on a pathological grammar: the matcher errors instead)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import llguidance
import llguidance.hf
import torch

from portside.structured.params import StructuredOutputsParams


@dataclass
class LLGuidanceMatcher:
    m: llguidance.LLMatcher
    spelled: dict[int, list[int]]  # added token -> ordinary tokens of its text
    consumed: list[int] = field(default_factory=list)  # llguidance tokens each accepted token took

    def accept_token(self, token_id: int) -> bool:
        # llguidance counts every added token (Qwen's <tool_call>, <think>) as special: a mask that
        # reaches one through its text allows it, then consuming it fails. Feed its text instead.
        # A refused token is checked first, not consumed: the matcher stays usable (speculation
        # probes proposals the grammar may refuse).
        ids = [token_id]
        if self.m.validate_tokens(ids) != 1:
            ids = self.spelled.get(token_id) or []
            if not ids or self.m.validate_tokens(ids) != len(ids):
                return False
        ok = self.m.consume_tokens(ids)
        if ok:
            self.consumed.append(len(ids))
        return ok

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            n = sum(self.consumed[-num_tokens:])
            del self.consumed[-num_tokens:]
            self.m.rollback(n)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[row]  # a contiguous int32 row of a CPU tensor
        self.m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)

    def is_terminated(self) -> bool:
        return self.m.is_stopped()

    def error(self) -> str | None:
        return self.m.get_error() or None


@dataclass
class LLGuidanceGrammar:
    template: llguidance.LLMatcher  # in its start state; each sequence gets a copy
    spelled: dict[int, list[int]]

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.template.deep_copy(), self.spelled)


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.vocab_size = max(vocab_size, len(tokenizer))
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size, eos_token=eos_token_ids or None)
        self._executor: llguidance.LLExecutor | None = None
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.spelled = {t: self.tokenizer.greedy_tokenize(a.content) for t, a in added.items()
                        if not a.special and a.content and t not in eos_token_ids}  # fmt: skip

    def grammar_text(self, params: StructuredOutputsParams) -> str:
        kind = params.kind
        if kind in ("json", "json_object"):
            options: dict[str, Any] = {"whitespace_flexible": not params.disable_any_whitespace}
            if params.whitespace_pattern is not None:
                options["whitespace_pattern"] = params.whitespace_pattern
            return llguidance.LLMatcher.grammar_from_json_schema(params.schema(), overrides=options)  # type: ignore[arg-type]
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(params.spec)
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice or []))
        try:
            return llguidance.grammar_from("grammar", params.spec)  # Lark, or GBNF converted to Lark
        except ValueError as e:
            raise ValueError(f"structured_outputs: grammar: {e}") from None

    def compile(self, params: StructuredOutputsParams) -> LLGuidanceGrammar:
        try:
            text = self.grammar_text(params)
        except ValueError as e:
            raise ValueError(f"structured_outputs: {params.kind}: {e}") from None
        problem = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        if problem:
            raise ValueError(f"structured_outputs: invalid {params.kind}: {problem}")
        template = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if template.is_error():
            raise ValueError(f"structured_outputs: invalid {params.kind}: {template.get_error()}")
        return LLGuidanceGrammar(template, self.spelled)

    def fill_batch(self, rows: list[tuple[LLGuidanceMatcher, int]], bitmask: torch.Tensor) -> None:
        """Every row's mask at once, on llguidance's own thread pool (outside the GIL)."""
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        # what llguidance.torch does, without importing it: that module torch.compiles at import,
        # pulling in Dynamo (seconds, holding the GIL) on the first constrained request
        assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and not bitmask.is_cuda
        self._executor.unsafe_compute_mask_ptr([(m.m, r) for m, r in rows], bitmask.data_ptr(), bitmask.shape[1] * 4,
                                               bitmask.shape[0])
