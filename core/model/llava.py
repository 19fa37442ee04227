"""LLaVA and LLaVA-Next: a CLIP or SigLIP vision tower, a two-layer projector into the language
model's embedding space, and a decoder-only language model (Llama, Mistral or Qwen2 style).

The language model is the `DecoderForCausalLM` itself (its args are the config's text_config);
the vision tower (`portside.model.vision.clip`), the projector and LLaVA-Next's image_newline
sit beside it, on the first pipeline stage only, replicated on every tensor-parallel rank.
`embed_image` turns one image's processor output into its placeholder rows; the runner merges
them into the prompt's embeddings (`SupportsMultiModal`).

LLaVA-Next ("anyres"): the processor splits an image into a base tile (the whole image, resized)
and a grid of tiles at the best-fitting `image_grid_pinpoints` resolution. The grid's features are
put back in their spatial layout, the padding the resize added is cut off, and a learnt
`image_newline` row ends each row of features; the base tile's features come first.

Checkpoint names: both what transformers' `save_pretrained` writes (``language_model.model.*``,
``language_model.lm_head.*``, ``vision_tower[.vision_model].*``, ``multi_modal_projector.*``,
``image_newline``) and transformers 5's module names (``model.language_model.*``,
``model.vision_tower.*``, ``model.multi_modal_projector.*``, ``model.image_newline``, ``lm_head.*``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from portside.contract import EncoderAttention
from portside.model.args import ModelArgs
from portside.model.decoder import DecoderForCausalLM
from portside.model.vision.clip import VisionTransformer, hidden_state_indices, vision_activation
from portside.multimodal.inputs import MultiModalFeature

__all__ = ["LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration", "best_resolution", "unpad_features"]

_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "image_newline")


class MultiModalProjector(nn.Module):
    """linear_2(act(linear_1(features))): vision features (of every selected layer, concatenated)
    into the language model's hidden size."""

    def __init__(self, in_features: int, hidden: int, bias: bool, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, hidden, bias=bias, dtype=dtype)
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias, dtype=dtype)
        self.act = vision_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def _checkpoint_name(name: str) -> tuple[str, str]:
    """("text", DecoderForCausalLM's name) or ("vision", this model's name) for a checkpoint
    tensor in either naming (see the module docstring)."""
    if name.startswith("model.") and name[6:].startswith(("language_model.", *_VISION_PREFIXES)):
        name = name[6:]  # transformers 5: model.language_model.*, model.vision_tower.*, ...
    if name.startswith("language_model."):
        rest = name[len("language_model."):]
        if rest.startswith(("model.", "lm_head.")):  # save_pretrained: language_model.model.*, language_model.lm_head.*
            return "text", rest
        return "text", "model." + rest  # transformers 5: model.language_model.layers.* (model. stripped above)
    if name.startswith("vision_tower.vision_model."):  # CLIPVisionModel / SiglipVisionModel of transformers 4
        return "vision", "vision_tower." + name[len("vision_tower.vision_model."):]
    if name.startswith(_VISION_PREFIXES):
        return "vision", name
    return "text", name  # lm_head.*, or a name the decoder rejects


class LlavaForConditionalGeneration(DecoderForCausalLM):
    """LLaVA(-1.5): every image is one tile; its rows are the selected patches, projected."""

    supports_multimodal = True
    uses_mrope = False

    def __init__(self, args: ModelArgs, *rest: Any, **kwargs: Any) -> None:  # DecoderForCausalLM's arguments
        super().__init__(args, *rest, **kwargs)
        hf = args.hf_config
        if hf is None:
            raise ValueError(f"{type(self).__name__} needs the whole transformers config (ModelArgs.hf_config)")
        token = getattr(hf, "image_token_id", None)
        self.image_token_id = int(token if token is not None else hf.image_token_index)
        vision = hf.vision_config
        self.feature_layers = hidden_state_indices(hf.vision_feature_layer, vision.num_hidden_layers)
        self.select_strategy = hf.vision_feature_select_strategy
        if self.select_strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {self.select_strategy!r}: expected 'default' or 'full'")
        self.vision_tower: VisionTransformer | None = None
        self.multi_modal_projector: MultiModalProjector | None = None
        if self.stage.is_first:  # only the first pipeline stage embeds
            self.vision_tower = VisionTransformer(vision, self.dtype)
            self.multi_modal_projector = MultiModalProjector(
                vision.hidden_size * len(self.feature_layers), args.hidden_size,
                bool(getattr(hf, "multimodal_projector_bias", True)), getattr(hf, "projector_hidden_act", "gelu"), self.dtype,
            )

    # ---- images -------------------------------------------------------------------------------

    def image_features(self, pixel_values: torch.Tensor, attention: EncoderAttention) -> torch.Tensor:
        """Tiles [B, C, H, W] -> projected features [B, rows per tile, hidden] in the model's dtype."""
        assert self.vision_tower is not None and self.multi_modal_projector is not None, \
            "only the first pipeline stage embeds images"
        device = self.multi_modal_projector.linear_1.weight.device
        states = self.vision_tower(pixel_values.to(device=device, dtype=self.dtype), self.feature_layers, attention)
        if self.select_strategy == "default":  # drop the class token
            states = [s[:, 1:] for s in states]
        return self.multi_modal_projector(torch.cat(states, dim=-1))

    @torch.no_grad()
    def embed_image(self, data: dict[str, torch.Tensor], attention: EncoderAttention) -> torch.Tensor:
        """One image's processor output ({"pixel_values": [1, C, H, W]}) -> [rows, hidden]."""
        features = self.image_features(data["pixel_values"], attention)
        return features.reshape(-1, features.shape[-1])

    @torch.no_grad()
    def embed_images(self, datas: list[dict[str, torch.Tensor]], attention: EncoderAttention) -> list[torch.Tensor]:
        """`embed_image` of each: the images of one size in one vision-tower call."""
        out: list[torch.Tensor | None] = [None] * len(datas)
        sizes: dict[tuple[int, ...], list[int]] = {}
        for i, d in enumerate(datas):
            sizes.setdefault(tuple(d["pixel_values"].shape), []).append(i)
        for group in sizes.values():
            features = self.image_features(torch.cat([datas[i]["pixel_values"] for i in group]), attention)
            for i, f in zip(group, features.unbind(0)):
                out[i] = f
        return [f for f in out if f is not None]

    def mrope_positions(self, prompt_token_ids: list[int], features: list[MultiModalFeature]) -> tuple[torch.Tensor, int]:
        raise NotImplementedError(f"{type(self).__name__} uses 1-D positions (uses_mrope is False)")

    # ---- loading ------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[tuple[str, object]]:
        """The language model's tensors go to `DecoderForCausalLM.load_weights` under its names,
        the vision tower's, projector's and image_newline here (skipped on a later pipeline stage;
        the tower's post-layernorm and pooling head, which LLaVA never reads, skipped always)."""
        own = {name: p for name, p in self.named_parameters() if name.startswith(_VISION_PREFIXES)}
        loaded: set[tuple[str, object]] = set()

        def text_tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                kind, target = _checkpoint_name(name)
                if kind == "text":
                    yield target, tensor
                    continue
                if not self.stage.is_first:
                    continue
                if target.startswith("vision_tower.") and VisionTransformer.unused(target[len("vision_tower."):]):
                    continue
                param = own.get(target)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(f"checkpoint tensor {name!r} {tuple(tensor.shape)}: expected {tuple(param.shape)}")
                with torch.no_grad():
                    param.copy_(tensor)
                loaded.add((target, None))

        return super().load_weights(text_tensors()) | loaded


def best_resolution(image_size: Sequence[int], pinpoints: Sequence[Sequence[int]]) -> tuple[int, int]:
    """The (height, width) of `pinpoints` an image of `image_size` (height, width) fits best: the
    most of its pixels kept when scaled to fit inside, then the least area wasted."""
    h, w = int(image_size[0]), int(image_size[1])
    best, best_kept, best_waste = None, -1, math.inf
    for ph, pw in pinpoints:
        scale = min(pw / w, ph / h)
        kept = min(int(w * scale) * int(h * scale), w * h)
        waste = pw * ph - kept
        if kept > best_kept or (kept == best_kept and waste < best_waste):
            best, best_kept, best_waste = (int(ph), int(pw)), kept, waste
    assert best is not None, "image_grid_pinpoints is empty"
    return best


def unpad_features(features: torch.Tensor, image_size: Sequence[int]) -> torch.Tensor:
    """[C, H, W] features of an image resized to fit (aspect kept) and padded centred -> the rows
    or columns of the image only; `image_size` is the original (height, width)."""
    h, w = int(image_size[0]), int(image_size[1])
    cur_h, cur_w = features.shape[1:]
    if w / h > cur_w / cur_h:  # relatively wider: padded above and below
        kept = int(round(h * (cur_w / w), 7))
        pad = (cur_h - kept) // 2
        return features[:, pad : cur_h - pad, :]
    kept = int(round(w * (cur_h / h), 7))
    pad = (cur_w - kept) // 2
    return features[:, :, pad : cur_w - pad]


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA-Next (LLaVA-1.6): anyres tiles, unpadded, with an image_newline after each row."""

    def __init__(self, args: ModelArgs, *rest: Any, **kwargs: Any) -> None:  # DecoderForCausalLM's arguments
        super().__init__(args, *rest, **kwargs)
        hf: Any = args.hf_config
        self.pinpoints = [tuple(int(x) for x in p) for p in hf.image_grid_pinpoints]
        self.tile = int(hf.vision_config.image_size)
        self.grid_side = self.tile // int(hf.vision_config.patch_size)  # features per tile side
        self.image_newline = nn.Parameter(torch.empty(args.hidden_size, dtype=self.dtype)) if self.stage.is_first else None

    def num_tiles(self, image_size: Sequence[int]) -> tuple[int, int]:
        """(rows, columns) of the grid of tiles for an image of (height, width) (the base tile apart)."""
        h, w = best_resolution(image_size, self.pinpoints)
        return h // self.tile, w // self.tile

    @torch.no_grad()
    def embed_image(self, data: dict[str, torch.Tensor], attention: EncoderAttention) -> torch.Tensor:
        """{"pixel_values": [1, tiles (padded), C, H, W], "image_sizes": [1, 2]} -> [rows, hidden]."""
        pixel_values, sizes = data["pixel_values"], data["image_sizes"]
        if pixel_values.dim() == 4:
            pixel_values = pixel_values[None]
        out = []
        for pixels, size in zip(pixel_values, sizes.tolist()):
            h, w = best_resolution(size, self.pinpoints)
            n = math.ceil(h / self.tile) * math.ceil(w / self.tile) + 1  # the grid's tiles and the base one
            out.append(self._pack(self.image_features(pixels[:n], attention), size))
        return torch.cat(out)

    def embed_images(self, datas: list[dict[str, torch.Tensor]], attention: EncoderAttention) -> list[torch.Tensor]:
        return [self.embed_image(d, attention) for d in datas]  # tiles per image differ: one at a time

    def _pack(self, features: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
        """[tiles, side * side, hidden] -> [rows, hidden]: the base tile's rows, then the grid's
        features in image order, unpadded, each feature row ended by image_newline."""
        assert self.image_newline is not None
        newline = self.image_newline.to(features.dtype)
        base, grid = features[0], features[1:]
        if grid.shape[0] == 0:
            return torch.cat([base, newline[None]])
        rows, cols = self.num_tiles(size)
        s, c = self.grid_side, features.shape[-1]
        if grid.shape[0] != rows * cols or grid.shape[1] != s * s:
            raise ValueError(f"{grid.shape[0]} tiles of {grid.shape[1]} features do not make a {rows} x {cols} grid "
                             f"of {s} x {s} (a 'default' feature strategy on a tower without a class token?)")
        # [rows, cols, s, s, C] -> [C, rows * s, cols * s]: the features in the resized image's layout
        spatial = grid.view(rows, cols, s, s, c).permute(4, 0, 2, 1, 3).reshape(c, rows * s, cols * s)
        spatial = unpad_features(spatial, size)
        spatial = torch.cat([spatial, newline[:, None, None].expand(c, spatial.shape[1], 1)], dim=2)
        return torch.cat([base, spatial.flatten(1).T])
