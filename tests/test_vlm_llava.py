"""LLaVA and LLaVA-Next against transformers: image embeddings, full-prompt logits with images,
checkpoint naming variants, missing tensors."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from portside.attention.reference import ReferenceAttentionBackend, encoder_attention
from portside.config import ModelConfig
from portside.model.interface import is_multimodal
from portside.model.registry import load_model
from portside.testing.paged import PagedSequence
from portside.testing.tiny_llava import make_tiny_llava

CPU = torch.device("cpu")
TOL = {"atol": 1e-4, "rtol": 1e-4}

# name -> make_tiny_llava arguments
VARIANTS: dict[str, dict[str, Any]] = {
    "clip": {"vision": "clip"},
    "siglip": {"vision": "siglip", "seed": 1, "tie_word_embeddings": True},  # lm_head tied to the embeddings
    "next": {"vision": "clip", "next": True, "seed": 2},
    "next-siglip": {"vision": "siglip", "next": True, "seed": 3},
}
# (height, width): a wide one and a tall one (LLaVA-Next picks different grids, unpads rows / columns)
IMAGE_SIZES = ((30, 50), (64, 40), (20, 90))


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def llava(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llava(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])


@functools.lru_cache(maxsize=4)
def _hf(path: Path) -> tuple[Any, Any]:
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(str(path))
    model = transformers.AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
    return processor, model


def _load(path: Path, **kw: Any) -> Any:
    return load_model(ModelConfig(path=str(path), max_model_len=512, **kw), CPU)


def _image(i: int) -> Any:
    from PIL import Image

    h, w = IMAGE_SIZES[i]
    return Image.fromarray(np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _per_image(out: Any, i: int) -> dict[str, torch.Tensor]:
    """Image i's share of a processor output, batch dimension kept (what the engine passes)."""
    return {k: out[k][i : i + 1] for k in ("pixel_values", "image_sizes") if k in out}


def _runs(ids: torch.Tensor, token: int) -> list[tuple[int, int]]:
    """(start, end) of each run of `token` in `ids`."""
    runs, start = [], None
    for j, t in enumerate([*ids.tolist(), -1]):
        if t == token and start is None:
            start = j
        elif t != token and start is not None:
            runs.append((start, j))
            start = None
    return runs


def test_model_interface(llava: Path) -> None:
    model = _load(llava)
    processor, hf = _hf(llava)
    assert is_multimodal(model) and model.supports_multimodal and model.uses_mrope is False
    assert model.image_token_id == hf.config.image_token_id == processor.image_token_id
    with pytest.raises(NotImplementedError):
        model.mrope_positions([1, 2, 3], [])


def test_embed_image_matches_transformers(llava: Path) -> None:
    processor, hf = _hf(llava)
    model = _load(llava)
    images = [_image(i) for i in range(3)]
    out = processor(text="USER: " + "<image>\n" * 3, images=images, return_tensors="pt")
    cfg = hf.config
    kw = {"vision_feature_layer": cfg.vision_feature_layer, "vision_feature_select_strategy": cfg.vision_feature_select_strategy}
    with torch.no_grad():
        if "image_sizes" in out:
            expected = hf.model.get_image_features(out["pixel_values"], out["image_sizes"], **kw).pooler_output
        else:
            expected = hf.model.get_image_features(out["pixel_values"], **kw).pooler_output
    counts = [b - a for a, b in _runs(out["input_ids"][0], model.image_token_id)]
    for i in range(3):
        got = model.embed_image(_per_image(out, i), encoder_attention)
        want = expected[i].reshape(-1, cfg.text_config.hidden_size)
        assert got.dtype == torch.float32 and got.shape == (counts[i], cfg.text_config.hidden_size)
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("num_images", [1, 2])
def test_prompt_logits_match_transformers(llava: Path, num_images: int) -> None:
    processor, hf = _hf(llava)
    model = _load(llava)
    text = "USER: <image>\nWhat is in the harbour?" + (" And here <image>\nthe market" if num_images == 2 else "") \
        + "\nASSISTANT:"
    out = processor(text=text, images=[_image(i) for i in range(num_images)], return_tensors="pt")
    ids = out["input_ids"][0]
    runs = _runs(ids, model.image_token_id)
    assert len(runs) == num_images
    with torch.no_grad():
        expected = hf(**out).logits[0].float()
        h = model.embed_input_ids(ids)
        for i, (a, b) in enumerate(runs):
            h[a:b] = model.embed_image(_per_image(out, i), encoder_attention)
    seq = PagedSequence(model, ReferenceAttentionBackend(), block_size=4)
    logits = seq.forward(ids.tolist(), inputs_embeds=h)
    assert logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, **TOL)
    # a decode step after the images (token embeddings again, the images' keys in the cache)
    nxt = int(logits[-1].argmax())
    step = seq.forward([nxt])
    with torch.no_grad():
        full = {**out, "input_ids": torch.cat([out["input_ids"], torch.tensor([[nxt]])], dim=1),
                "attention_mask": torch.ones(1, ids.shape[0] + 1, dtype=torch.long)}
        want = hf(**full).logits[0, -1].float()
    torch.testing.assert_close(step[0], want, **TOL)


def _rewrite(src: Path, dst: Path, rename: Any, drop: tuple[str, ...] = (), add: dict[str, torch.Tensor] | None = None) -> Path:
    """A copy of folder `src` whose checkpoint tensors are renamed by `rename(name)`, without
    those named in `drop` (original names), with `add` extra tensors."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    out = {rename(k): v for k, v in tensors.items() if k not in drop}
    out.update(add or {})
    save_file(out, str(dst / "model.safetensors"))
    return dst


def _transformers5(name: str) -> str:
    for old, new in (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                     ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."),
                     ("image_newline", "model.image_newline")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _transformers4_hub(name: str) -> str:  # CLIPVisionModel / SiglipVisionModel nested their vision_model
    return "vision_tower.vision_model." + name[len("vision_tower."):] if name.startswith("vision_tower.") else name


def _same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def test_checkpoint_name_variants_load(llava: Path, tmp_path: Path) -> None:
    reference = _load(llava)
    with open(llava / "config.json") as f:
        side = json.load(f)["vision_config"]["image_size"] // 14
    position_ids = torch.arange(side * side + 1)[None]  # an old checkpoint's buffer, skipped
    for name, rename, add in (
        ("t5", _transformers5, None),
        ("hub", _transformers4_hub, {"vision_tower.vision_model.embeddings.position_ids": position_ids}),
    ):
        folder = _rewrite(llava, tmp_path / name, rename, add=add)
        _same_parameters(_load(folder), reference)


def test_missing_and_unknown_vision_tensors_are_reported(llava: Path, tmp_path: Path) -> None:
    missing = "vision_tower.encoder.layers.0.self_attn.q_proj.weight"
    folder = _rewrite(llava, tmp_path / "missing", lambda n: n, drop=(missing,))
    with pytest.raises(ValueError, match=r"missing 1 tensors.*" + missing.replace(".", r"\.")):
        _load(folder)
    folder = _rewrite(llava, tmp_path / "missing-projector", lambda n: n, drop=("multi_modal_projector.linear_2.weight",))
    with pytest.raises(ValueError, match=r"multi_modal_projector\.linear_2\.weight"):
        _load(folder)
    folder = _rewrite(llava, tmp_path / "unknown", lambda n: n, add={"vision_tower.encoder.layers.9.mlp.fc1.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"layers\.9\.mlp\.fc1\.weight"):
        _load(folder)


def test_missing_image_newline_is_reported(tmp_path: Path) -> None:
    path = make_tiny_llava(tmp_path / "next", next=True)
    folder = _rewrite(path, tmp_path / "no-newline", lambda n: n, drop=("image_newline",))
    with pytest.raises(ValueError, match="image_newline"):
        _load(folder)


def test_later_pipeline_stage_has_no_vision_tower(tmp_path: Path) -> None:
    path = make_tiny_llava(tmp_path / "next", next=True)
    first = load_model(ModelConfig(path=str(path), max_model_len=512), CPU, pp_rank=0, pp_size=2)
    last = load_model(ModelConfig(path=str(path), max_model_len=512), CPU, pp_rank=1, pp_size=2)
    assert first.vision_tower is not None and first.image_newline is not None
    assert last.vision_tower is None and last.multi_modal_projector is None and last.image_newline is None


def test_embed_image_in_model_dtype(tmp_path: Path) -> None:
    path = make_tiny_llava(tmp_path / "clip")
    processor, _ = _hf(path)
    model = _load(path, dtype=torch.bfloat16)
    out = processor(text="<image>", images=[_image(0)], return_tensors="pt")
    rows = model.embed_image(_per_image(out, 0), encoder_attention)
    assert rows.dtype == torch.bfloat16 and rows.shape[0] == int((out["input_ids"] == model.image_token_id).sum())
