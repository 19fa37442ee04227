"""The grammar-engine contract: compile a constraint once, then one matcher per sequence.

A backend turns `StructuredOutputsParams` into a `CompiledGrammar` (ValueError naming the
problem when the constraint is invalid or can never match); each sequence gets its own
`Matcher` from it, which fills that sequence's row of the packed token bitmask (int32 words, bit
t of the row = token t allowed), accepts the tokens sampled under it, and rolls back tokens it
accepted (a refused token leaves it as it was).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from portside.structured.params import StructuredOutputsParams


class Matcher(Protocol):
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` ([B, ceil(V / 32)] int32, host)."""

    def is_terminated(self) -> bool:
        """True once the output is complete: nothing but the end may follow."""

    def error(self) -> str | None:
        """Why the matcher failed (a resource limit, an unexpected token), or None."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding advances through the
        proposals to build each verified position's mask, then rolls back). A backend's matcher
        without it is never speculated (`StructuredState.can_speculate`)."""


class CompiledGrammar(Protocol):
    def matcher(self) -> Matcher: ...


class StructuredOutputBackend(Protocol):
    name: str

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar: ...


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(V / 32)] int32, every token allowed."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def make_backend(name: str, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> StructuredOutputBackend:
    """The backend called `name` ("auto" = llguidance) for a Hugging Face tokenizer whose logits
    are `vocab_size` wide (tokens past the tokenizer's own are never allowed)."""
    if name in ("auto", "llguidance", "guidance"):
        from portside.structured.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer, vocab_size, eos_token_ids)
    if name == "xgrammar":
        from portside.structured.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size, eos_token_ids)
    raise ValueError(f"structured-outputs backend {name!r} is not one of auto, llguidance, xgrammar")
