"""Prompt-lookup proposals: the tokens that followed the latest earlier occurrence of the
sequence's own suffix.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the last n tokens are looked up in
everything before them; at the first n with a match, the up to k tokens that followed its most
recent occurrence are the proposal. No model runs: the cost is a scan of the context per step
(numpy, about 10 us per 1000 tokens), and nothing is proposed when nothing repeats.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from portside.spec_decode.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: list[int] | np.ndarray, k: int | None = None) -> list[int]:
        """Up to `k` (default: the configured number) proposed next tokens; [] when none."""
        k = self.k if k is None else k
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        if k <= 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n :]
            # windows starting at 0 .. length - n - 1: every occurrence that ends before the last token
            windows = sliding_window_view(tokens[: length - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []
