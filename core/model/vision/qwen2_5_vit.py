"""Qwen2.5-VL's vision transformer, replicated on every tensor-parallel rank.

An image arrives as the Qwen2-VL processor's patch rows (`portside.multimodal.qwen_vl_preprocess`):
[num_patches, C * temporal_patch * patch^2], grouped by merge unit (spatial_merge_size^2
neighbouring patches consecutive), and its grid (t, h, w) in patches. The tower:

- embeds each patch with one matmul (the checkpoint's Conv3d, whose kernel equals its stride);
- reorders the merge units window by window (windows of `window_size` pixels, i.e.
  window_size / patch / merge merge units a side, row-major within the image and within a
  window), so that a window is a contiguous run of rows;
- runs RMSNorm blocks with a gated MLP; the blocks of `fullatt_block_indexes` attend within each
  image frame, the others within each window; each sequence is a `cu_seqlens` range of the
  platform's non-causal `encoder_attention`; q and k are rotated by 2-D rotary: the first half of
  the rotated frequencies by the patch's row, the second half by its column;
- merges each merge unit into one row (RMSNorm, then an MLP over the unit's concatenated rows)
  and puts the rows back in the image's order: [t * h * w / merge^2, out_hidden_size].

Parameter names are the checkpoint's (`visual.` stripped).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from portside.contract import EncoderAttention
from portside.model.decoder import activation
from portside.model.layers import RMSNorm
from portside.model.rotary import apply_rotary

__all__ = ["Qwen2_5_VisionTransformer", "vision_windows", "patch_positions"]


def _cfg(config: Any, name: str, default: Any = None) -> Any:
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


class _Linear(nn.Linear):
    """nn.Linear left uninitialised: every weight comes from the checkpoint."""

    def reset_parameters(self) -> None:
        pass


def _conv_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
    """The checkpoint's Conv3d weight [out, C, t, p, p] as the patch matmul's [out, C * t * p * p]."""
    if loaded.numel() != param.numel() or loaded.shape[0] != param.shape[0]:
        raise ValueError(f"patch embedding weight {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
    param.data.copy_(loaded.reshape(param.shape))


class _PatchEmbed(nn.Module):
    def __init__(self, patch_dim: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = _Linear(patch_dim, hidden, bias=False, dtype=dtype)
        self.proj.weight.weight_loader = _conv_weight_loader  # type: ignore[attr-defined]

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, patch_dim] -> [N, hidden]
        return self.proj(pixels)


class _VisionMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = _Linear(hidden, inter, bias=True, dtype=dtype)
        self.up_proj = _Linear(hidden, inter, bias=True, dtype=dtype)
        self.down_proj = _Linear(inter, hidden, bias=True, dtype=dtype)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _VisionAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv = _Linear(hidden, 3 * hidden, bias=True, dtype=dtype)
        self.proj = _Linear(hidden, hidden, bias=True, dtype=dtype)
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
                max_seqlen: int, attention: EncoderAttention) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv(x).view(T, 3, self.heads, self.head_dim).unbind(1)  # [T, H, D] each
        # rotary in fp32 (as transformers does), back to the activations' dtype
        q = apply_rotary(q.float(), cos, sin).to(x.dtype)
        k = apply_rotary(k.float(), cos, sin).to(x.dtype)
        o = attention(q, k, v.contiguous(), cu_seqlens, max_seqlen, self.scale)  # [T, H, D]
        return self.proj(o.reshape(T, self.heads * self.head_dim))


class _VisionBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, inter: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm1 = RMSNorm(hidden, 1e-6, dtype)
        self.norm2 = RMSNorm(hidden, 1e-6, dtype)
        self.attn = _VisionAttention(hidden, heads, dtype)
        self.mlp = _VisionMLP(hidden, inter, act, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
                max_seqlen: int, attention: EncoderAttention) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens, max_seqlen, attention)
        return x + self.mlp(self.norm2(x))


class _PatchMerger(nn.Module):
    """RMSNorm per patch, then an MLP over each merge unit's concatenated patches."""

    def __init__(self, context_dim: int, out_dim: int, unit: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.width = context_dim * unit
        self.ln_q = RMSNorm(context_dim, 1e-6, dtype)
        self.mlp = nn.Sequential(_Linear(self.width, self.width, dtype=dtype), nn.GELU(),
                                 _Linear(self.width, out_dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, context] -> [N / unit, out]
        return self.mlp(self.ln_q(x).reshape(-1, self.width))


def patch_positions(grid_thw: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """(row, column) of every patch [N, 2] int64, in the processor's order (merge unit by merge
    unit, row-major within a unit), every frame of an image alike."""
    out = []
    for t, h, w in grid_thw:
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
        # [h/m, m, w/m, m] -> [h/m, w/m, m, m]: merge units in order, patches within one
        rc = torch.stack([rows.transpose(1, 2).reshape(-1), cols.transpose(1, 2).reshape(-1)], dim=-1)
        out.append(rc.repeat(t, 1))
    return torch.cat(out)


def vision_windows(grid_thw: list[tuple[int, int, int]], merge: int, window_units: int) -> tuple[torch.Tensor, list[int]]:
    """(order [U] int64: the merge units (indices into all images' units, frame by frame) window by
    window; window lengths in patches). A window is `window_units` merge units a side, the last
    ones in a row or column cut by the image's edge; windows row-major, and units within one."""
    order: list[torch.Tensor] = []
    lengths: list[int] = []
    base = 0
    for t, h, w in grid_thw:
        uh, uw = h // merge, w // merge
        units = torch.arange(t * uh * uw).view(t, uh, uw) + base
        for f in range(t):
            for y in range(0, uh, window_units):
                for x in range(0, uw, window_units):
                    win = units[f, y : y + window_units, x : x + window_units].reshape(-1)
                    order.append(win)
                    lengths.append(win.numel() * merge * merge)
        base += t * uh * uw
    return torch.cat(order), lengths


def _cu_seqlens(lengths: list[int], device: torch.device) -> tuple[torch.Tensor, int]:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return cu.to(device), max(lengths)


class Qwen2_5_VisionTransformer(nn.Module):
    """`forward(pixel_values [N, C * t * p * p], grid_thw [n, 3], attention) -> [N / merge^2, out_hidden_size]`.
    `config`: transformers' Qwen2_5_VLVisionConfig (or its dict)."""

    inv_freq: torch.Tensor  # registered buffer [head_dim / 4] fp32: the 2-D rotary's frequencies

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        hidden, heads = int(_cfg(config, "hidden_size")), int(_cfg(config, "num_heads"))
        self.patch_size = int(_cfg(config, "patch_size", 14))
        self.merge = int(_cfg(config, "spatial_merge_size", 2))
        self.window_size = int(_cfg(config, "window_size", 112))
        self.full_attention_blocks = frozenset(int(i) for i in _cfg(config, "fullatt_block_indexes", ()))
        channels, temporal = int(_cfg(config, "in_channels", 3)), int(_cfg(config, "temporal_patch_size", 2))
        self.dtype = dtype
        self.patch_embed = _PatchEmbed(channels * temporal * self.patch_size**2, hidden, dtype)
        act = _cfg(config, "hidden_act", "silu")
        self.blocks = nn.ModuleList(
            _VisionBlock(hidden, heads, int(_cfg(config, "intermediate_size")), act, dtype)
            for _ in range(int(_cfg(config, "depth")))
        )
        self.merger = _PatchMerger(hidden, int(_cfg(config, "out_hidden_size")), self.merge**2, dtype)
        rope = _cfg(config, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", 10000.0))
        # 2-D rotary: head_dim / 4 frequencies over a quarter-dim grid, each used for rows and for columns
        quarter = (hidden // heads) // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=torch.int64).float() / quarter))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N, 2] -> cos, sin [N, head_dim / 2] fp32: rows' angles, then columns'."""
        angles = positions.to(self.inv_freq.device).float()[:, :, None] * self.inv_freq  # [N, 2, head_dim/4]
        angles = angles.reshape(positions.shape[0], -1)
        return angles.cos(), angles.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, attention: EncoderAttention) -> torch.Tensor:
        grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw.reshape(-1, 3).tolist()]
        N = sum(t * h * w for t, h, w in grids)
        if pixel_values.shape[0] != N:
            raise ValueError(f"{pixel_values.shape[0]} patch rows for image grids {grids} ({N} patches)")
        device, unit = pixel_values.device, self.merge**2
        window_units = self.window_size // self.merge // self.patch_size
        order, window_lengths = vision_windows(grids, self.merge, window_units)
        order = order.to(device)
        frames_cu, frames_max = _cu_seqlens([h * w for t, h, w in grids for _ in range(t)], device)
        windows_cu, windows_max = _cu_seqlens(window_lengths, device)

        def by_window(x: torch.Tensor) -> torch.Tensor:  # [N, ...] in the processor's order -> window order
            return x.reshape(N // unit, unit, -1).index_select(0, order).reshape(N, -1)

        x = by_window(self.patch_embed(pixel_values.to(self.dtype)))
        cos, sin = (by_window(c) for c in self._rotary(patch_positions(grids, self.merge).to(device)))
        for i, block in enumerate(self.blocks):
            full = i in self.full_attention_blocks
            x = block(x, cos, sin, frames_cu if full else windows_cu, frames_max if full else windows_max, attention)
        merged = self.merger(x)  # [N / unit, out] in window order
        return merged.index_select(0, torch.argsort(order))
