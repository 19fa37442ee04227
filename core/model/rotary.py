"""Rotary position embedding (the rotate-half / GPT-NeoX layout Hugging Face Llama uses), with
linear, dynamic-NTK, llama3, YaRN and LongRoPE frequency scaling and partial rotary (the first
`rotary_dim` dims of each head rotated, the rest passed through). Every formula is transformers'
(`transformers.modeling_rope_utils`), written the same way so the fp32 cos/sin are bit-identical."""

from __future__ import annotations

import math

import torch
from torch import nn

from portside.model.args import RopeScaling

__all__ = ["rope_inv_freq", "rope_attention_factor", "RotaryEmbedding", "MRotaryEmbedding", "apply_rotary"]


def _pos_freqs(dim: int, theta: float) -> torch.Tensor:
    return theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)  # [ceil(dim/2)]


def _base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / _pos_freqs(dim, theta)


def _original_len(s: RopeScaling, max_position_embeddings: int) -> int:
    return s.original_max_position_embeddings or max_position_embeddings


def rope_inv_freq(
    dim: int,
    theta: float,
    scaling: RopeScaling | None,
    max_position_embeddings: int,
    max_model_len: int | None = None,
) -> torch.Tensor:
    """Inverse frequencies [ceil(dim / 2)] in fp32, `dim` the rotated dims (head_dim, or less with
    partial rotary).

    Two types depend on the sequence length in transformers, re-chosen per forward pass, which a
    paged cache (whose keys keep the rotation they were written with) cannot follow; here they are
    fixed for the engine's context length ``max_model_len`` (default ``max_position_embeddings``):

    - ``dynamic`` (NTK): the base is stretched for that length when it exceeds
      ``max_position_embeddings``, and left alone otherwise (so within the trained context it
      equals transformers exactly);
    - ``longrope``: the long factors when that length exceeds ``original_max_position_embeddings``,
      the short ones otherwise (transformers uses the long ones only once a sequence is longer).
    """
    if scaling is None:
        return _base_inv_freq(dim, theta)
    s, context_len = scaling, max_model_len or max_position_embeddings
    if s.rope_type == "linear":
        return _base_inv_freq(dim, theta) / s.factor
    if s.rope_type == "dynamic":
        seq_len = max(context_len, max_position_embeddings)
        base = theta * ((s.factor * seq_len / max_position_embeddings) - (s.factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(dim, base)
    if s.rope_type == "llama3":
        return _llama3_inv_freq(_base_inv_freq(dim, theta), s, _original_len(s, max_position_embeddings))
    if s.rope_type == "yarn":
        return _yarn_inv_freq(dim, theta, s, _original_len(s, max_position_embeddings))
    if s.rope_type == "longrope":
        long = context_len > _original_len(s, max_position_embeddings)
        ext_factors = torch.tensor(s.long_factor if long else s.short_factor, dtype=torch.float32)
        return 1.0 / (ext_factors * _pos_freqs(dim, theta))
    raise ValueError(f"rope type {s.rope_type!r} is not supported (portside: default, {', '.join(RopeScaling.TYPES)})")


def rope_attention_factor(scaling: RopeScaling | None, max_position_embeddings: int) -> float:
    """What cos and sin are multiplied by (YaRN's mscale, LongRoPE's attention factor; else 1)."""
    s = scaling
    if s is None or s.rope_type not in ("yarn", "longrope"):
        return 1.0
    if s.attention_factor is not None:
        return s.attention_factor
    if s.rope_type == "longrope":
        if s.factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(s.factor) / math.log(_original_len(s, max_position_embeddings)))
    if s.mscale and s.mscale_all_dim:
        return float(_yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim))
    return _yarn_mscale(s.factor)


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, theta: float, s: RopeScaling, old_len: int) -> torch.Tensor:
    def correction_dim(num_rotations: float) -> float:  # the dim that turns num_rotations times in old_len
        return (dim * math.log(old_len / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # prevent a singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    # Dims below `low` keep their frequency (extrapolation), above `high` are divided by the factor
    # (interpolation), a linear ramp between.
    pos_freqs = _pos_freqs(dim, theta)
    extrapolation = 1 - ramp
    return (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling, old_len: int) -> torch.Tensor:
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
    """Rotate x [T, H, D] by angles whose cos/sin are [T, R/2]: the first R dims (first half of
    them paired with the second), the remaining D - R passed through (partial rotary)."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half : 2 * half]  # [T, H, R/2] each
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, R/2]
    rotated = (x1 * c - x2 * s, x2 * c + x1 * s)
    if 2 * half == x.shape[-1]:
        return torch.cat(rotated, dim=-1)
    return torch.cat((*rotated, x[..., 2 * half :]), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin of the step's positions, looked up once per step in a table computed at start-up
    for every position up to the context length (a gather, exact wherever it runs: also inside a
    compiled graph, whose own cos/sin could differ from eager's in the last bit); every layer
    applies them. The attention factor (YaRN, LongRoPE) is folded into the table, as transformers
    multiplies its cos and sin by it."""

    cos_sin: torch.Tensor  # registered buffer [positions, R] fp32: cos | sin (R = rotary_dim)

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: RopeScaling | None,
        max_position_embeddings: int,
        max_model_len: int | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        dim = rotary_dim or head_dim
        inv_freq = rope_inv_freq(dim, theta, scaling, max_position_embeddings, max_model_len)
        freqs = torch.arange(max_model_len or max_position_embeddings).float().unsqueeze(1) * inv_freq  # [P, R/2]
        cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=1)
        attention_factor = rope_attention_factor(scaling, max_position_embeddings)
        if attention_factor != 1.0:
            cos_sin = cos_sin * attention_factor
        self.register_buffer("cos_sin", cos_sin, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] (below the context length) -> (cos, sin), each [T, R/2] in `dtype`."""
        cos, sin = self.cos_sin.index_select(0, positions).to(dtype).chunk(2, dim=1)
        return cos, sin


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal rotary (Qwen2-VL, Qwen2.5-VL "mrope"): positions are [3, T], a (temporal,
    height, width) position per token, and the rotary frequencies are split into consecutive
    sections of `mrope_section` frequencies (half-dims; summing to R/2), the first rotated by the
    temporal position, the next by the height, the next by the width. Text tokens have three
    equal positions, for which this is plain rotary; 1-D positions [T] are accepted as such."""

    section_of: torch.Tensor  # registered buffer [R/2] int64: which of the 3 positions each frequency takes

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None, max_position_embeddings: int,
                 max_model_len: int | None = None, rotary_dim: int | None = None,
                 mrope_section: tuple[int, ...] = ()) -> None:
        super().__init__(head_dim, theta, scaling, max_position_embeddings, max_model_len, rotary_dim)
        half = self.cos_sin.shape[1] // 2
        if sum(mrope_section) != half:
            raise ValueError(f"mrope_section {list(mrope_section)} must sum to rotary_dim / 2 = {half}")
        section_of = torch.cat([torch.full((n,), i % 3, dtype=torch.int64) for i, n in enumerate(mrope_section)])
        self.register_buffer("section_of", section_of, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, T] (or [T]: the same in all three) -> (cos, sin), each [T, R/2] in `dtype`."""
        if positions.dim() == 1:
            return super().forward(positions, dtype)
        half = self.section_of.shape[0]
        per_freq = positions.index_select(0, self.section_of).t()  # [T, R/2]: each frequency's position
        freq = torch.arange(half, device=positions.device)
        cos = self.cos_sin[per_freq, freq]  # [T, R/2]
        sin = self.cos_sin[per_freq, freq + half]
        return cos.to(dtype), sin.to(dtype)
