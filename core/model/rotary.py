"""Rotary position embedding (the rotate-half / GPT-NeoX layout Hugging Face Llama uses), with
linear, dynamic-NTK and llama3 frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from portside.model.args import RopeScaling

__all__ = ["rope_inv_freq", "RotaryEmbedding", "apply_rotary"]


def _base_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    # Same expression as transformers, so the fp32 frequencies are bit-identical.
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # [D/2]


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None,
    max_position_embeddings: int,
    max_model_len: int | None = None,
) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32.

    ``dynamic`` (NTK) scaling is static here: the base is stretched for the engine's context
    length ``max_model_len`` when that exceeds ``max_position_embeddings``, and left alone
    otherwise, so within the trained context it equals transformers exactly. (transformers
    re-stretches per batch as the sequence grows, which a paged cache cannot follow.)
    """
    if scaling is None:
        return _base_inv_freq(head_dim, theta)
    if scaling.rope_type == "linear":
        return _base_inv_freq(head_dim, theta) / scaling.factor
    if scaling.rope_type == "dynamic":
        seq_len = max(max_model_len or 0, max_position_embeddings)
        f = scaling.factor
        base = theta * ((f * seq_len / max_position_embeddings) - (f - 1)) ** (head_dim / (head_dim - 2))
        return _base_inv_freq(head_dim, base)
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(_base_inv_freq(head_dim, theta), scaling, max_position_embeddings)
    raise ValueError(f"unsupported rope scaling {scaling.rope_type!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling, max_position_embeddings: int) -> torch.Tensor:
    old_len = s.original_max_position_embeddings or max_position_embeddings
    low_wavelen = old_len / s.low_freq_factor
    high_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by the factor, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by angles whose cos/sin are [T, D/2] (first half paired with second)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # [T, H, D/2] each
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D/2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin of the step's positions, looked up once per step in a table computed at start-up
    for every position up to the context length (a gather, exact wherever it runs: also inside a
    compiled graph, whose own cos/sin could differ from eager's in the last bit); every layer
    applies them."""

    cos_sin: torch.Tensor  # registered buffer [positions, D] fp32: cos | sin

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: RopeScaling | None,
        max_position_embeddings: int,
        max_model_len: int | None = None,
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling, max_position_embeddings, max_model_len)
        freqs = torch.arange(max_model_len or max_position_embeddings).float().unsqueeze(1) * inv_freq  # [P, D/2]
        self.register_buffer("cos_sin", torch.cat((freqs.cos(), freqs.sin()), dim=1), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] (below the context length) -> (cos, sin), each [T, D/2] in `dtype`."""
        cos, sin = self.cos_sin.index_select(0, positions).to(dtype).chunk(2, dim=1)
        return cos, sin
