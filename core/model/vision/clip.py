"""CLIP and SigLIP vision transformers, as LLaVA uses them: the hidden states of chosen layers.

Parameter names are Hugging Face's `CLIPVisionModel` / `SiglipVisionModel` ones (``embeddings.*``,
``pre_layrnorm.*`` (CLIP), ``encoder.layers.N.*``), so a checkpoint's tensors load by name. The
post-layernorm and SigLIP's pooling head are not used (LLaVA reads hidden states, not the pooled
output): `VisionTransformer.unused` names them for the loader to skip.

Attention runs through the `EncoderAttention` callable the caller passes (the platform's
`AttentionBackend.encoder_attention`): every image (or tile) is one sequence of the batch.
The tower is replicated on every tensor-parallel rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from portside.contract import EncoderAttention

__all__ = ["VisionTransformer", "vision_activation", "hidden_state_indices"]


def vision_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A vision tower's or projector's `hidden_act`."""
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name == "silu":
        return F.silu
    if name == "relu":
        return F.relu
    raise ValueError(f"vision activation {name!r} is not supported (quick_gelu, gelu, gelu_pytorch_tanh, silu, relu)")


def hidden_state_indices(layers: int | Sequence[int], num_layers: int) -> list[int]:
    """HF's `hidden_states` indices (0: the encoder's input, i: layer i's output; negative from
    the end of num_layers + 1) as non-negative ones."""
    out = []
    for i in [layers] if isinstance(layers, int) else list(layers):
        j = i + num_layers + 1 if i < 0 else i
        if not 0 <= j <= num_layers:
            raise ValueError(f"vision feature layer {i} is out of range for a {num_layers}-layer vision tower")
        out.append(j)
    return out


class VisionEmbeddings(nn.Module):
    """Patch embedding (a strided conv), CLIP's class token first, learnt position embeddings."""

    def __init__(self, hidden: int, image_size: int, patch_size: int, channels: int, class_token: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.patch_size, self.image_size = patch_size, image_size
        num_positions = (image_size // patch_size) ** 2 + int(class_token)
        self.class_embedding = nn.Parameter(torch.empty(hidden, dtype=dtype)) if class_token else None
        # CLIP's patch conv has no bias, SigLIP's has
        self.patch_embedding = nn.Conv2d(channels, hidden, patch_size, patch_size, bias=not class_token, dtype=dtype)
        self.position_embedding = nn.Embedding(num_positions, hidden, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [B, C, H, W] -> [B, N, hidden]
        if pixel_values.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(f"pixel_values of {tuple(pixel_values.shape)}: the vision tower takes "
                             f"{self.image_size} x {self.image_size} images")
        w = self.patch_embedding.weight
        x = self.patch_embedding(pixel_values.to(w.dtype)).flatten(2).transpose(1, 2)  # [B, patches, hidden]
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        return x + self.position_embedding.weight


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"vision hidden size {hidden} is not a multiple of its {heads} heads")
        self.heads, self.head_dim = heads, hidden // heads
        self.scale = self.head_dim ** -0.5
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            nn.Linear(hidden, hidden, dtype=dtype) for _ in range(4)
        )

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                attention: EncoderAttention) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        T = x.shape[0]
        q, k, v = (p(x).view(T, self.heads, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        o = attention(q, k, v, cu_seqlens, max_seqlen, self.scale)
        return self.out_proj(o.reshape(T, self.heads * self.head_dim))


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, inter, dtype=dtype)
        self.fc2 = nn.Linear(inter, hidden, dtype=dtype)
        self.act = vision_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residuals."""

    def __init__(self, hidden: int, heads: int, inter: int, act: str, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.self_attn = VisionAttention(hidden, heads, dtype)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.mlp = VisionMLP(hidden, inter, act, dtype)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                attention: EncoderAttention) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), cu_seqlens, max_seqlen, attention)
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, layers: list[VisionLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)


class VisionTransformer(nn.Module):
    """A CLIP (`model_type` "clip_vision_model": class token, pre-layernorm) or SigLIP
    ("siglip_vision_model") vision tower built from its HF vision config. `forward` returns the
    hidden states LLaVA selects."""

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        kind = getattr(config, "model_type", "")
        if kind not in ("clip_vision_model", "siglip_vision_model"):
            raise ValueError(f"vision tower {kind!r} is not supported; portside supports CLIP and SigLIP")
        self.is_clip = kind == "clip_vision_model"
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.patch_size, self.image_size = config.patch_size, config.image_size
        self.num_layers = config.num_hidden_layers
        self.embeddings = VisionEmbeddings(hidden, config.image_size, config.patch_size,
                                           getattr(config, "num_channels", 3), self.is_clip, dtype)
        self.pre_layrnorm = nn.LayerNorm(hidden, eps=eps, dtype=dtype) if self.is_clip else None  # HF's spelling
        self.encoder = VisionEncoder([
            VisionLayer(hidden, config.num_attention_heads, config.intermediate_size, config.hidden_act, eps, dtype)
            for _ in range(config.num_hidden_layers)
        ])

    @staticmethod
    def unused(name: str) -> bool:
        """Whether checkpoint tensor `name` (relative to the tower) is one LLaVA never reads."""
        return name.startswith(("post_layernorm.", "head.")) or name.endswith("position_ids")

    def forward(self, pixel_values: torch.Tensor, layers: Sequence[int],
                attention: EncoderAttention) -> list[torch.Tensor]:
        """pixel_values [B, C, H, W] (B images, or tiles of one) -> for each index of `layers`
        (`hidden_state_indices`: 0 is the encoder's input, i layer i's output), the hidden
        states [B, N, hidden], N patches (plus CLIP's class token first)."""
        x = self.embeddings(pixel_values)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        B, N, C = x.shape
        cu_seqlens = torch.arange(0, (B + 1) * N, N, dtype=torch.int32, device=x.device)
        states = {0: x}
        h = x.reshape(B * N, C)
        for i in range(max(layers)):
            h = self.encoder.layers[i](h, cu_seqlens, N, attention)
            states[i + 1] = h.view(B, N, C)
        return [states[i] for i in layers]
