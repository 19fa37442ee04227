"""Incremental detokenization and stop strings for one generated sequence."""

from __future__ import annotations

from typing import Any

# Prompt tokens decoded along with the output, so tokenizers that drop a leading space at the
# start of a decode (SentencePiece) still produce the right first characters.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Appends text token by token; a token that ends mid-character (byte-level BPE) waits for
    the next one. Decoding only a short window keeps each step O(1) in the sequence length."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 enabled: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.enabled = enabled  # False (SamplingParams.detokenize): no text, `add` decodes nothing
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Add one token; return the new text it completes (possibly empty)."""
        if not self.enabled:
            return ""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""


def find_stop(text: str, num_new_chars: int, stops: list[str], include: bool) -> tuple[str, str] | None:
    """If a stop string occurs in `text` overlapping its last `num_new_chars` characters, return
    (truncated text, the stop string); else None. The earliest occurrence wins."""
    if not stops or num_new_chars == 0:
        return None
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    if best is None:
        return None
    idx, stop = best
    return (text[: idx + len(stop)] if include else text[:idx]), stop
