"""Sampling: the `Sampler` a platform returns from `Platform.sampler`. It stays core's (one
implementation of every sampling feature); a platform only passes it faster kernels for two
of its steps, each checked by the conformance kit against core's reference:

- ``argmax``: [N, V] -> [N] int64, the first index of each row's maximum (NaN counting as the
  largest), as ``torch.argmax(x, dim=-1)``: greedy rows and the exponential race;
- ``apply_token_bitmask``: structured output's mask (`TokenBitmask`), as `apply_token_bitmask`.
"""

from __future__ import annotations

from portside.sample.bitmask import TokenBitmask, apply_token_bitmask
from portside.sample.sampler import Sampler

__all__ = ["Sampler", "TokenBitmask", "apply_token_bitmask"]
