"""Qwen2.5-VL against transformers on a tiny random checkpoint: the torchvision-free image
preprocessing (pixel for pixel against both of transformers' image processors, and the one
transformers picks chosen), the vision tower's image features, the 3-D rope positions,
full-prompt logits with images and a decode step after them; checkpoint names of both
transformers layouts; the vision tower on the first pipeline stage only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from portside.attention.reference import ReferenceAttentionBackend, encoder_attention
from portside.config import ModelConfig
from portside.contract import ForwardContext
from portside.model.registry import load_model
from portside.multimodal.inputs import MultiModalFeature, PlaceholderRange, content_hash
from portside.multimodal.qwen_vl_preprocess import num_image_tokens, preprocess_qwen2_5_vl_image
from portside.testing.paged import PagedSequence, single_sequence_metadata
from portside.testing.tiny_qwen_vl import make_tiny_qwen2_5_vl

pytest.importorskip("transformers.models.qwen2_5_vl")

ATOL = RTOL = 2e-5  # fp32; the checkpoint's Conv3d patch embedding is a matmul here (other summation order)
MERGE = 2


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl") / "model")


@pytest.fixture(scope="module")
def preprocessor_config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "preprocessor_config.json").read_text())


@pytest.fixture(scope="module")
def hf_model(folder: Path) -> Any:
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32,
                                                              attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def model(folder: Path) -> Any:
    return load_model(ModelConfig(str(folder), max_model_len=512), torch.device("cpu"))


def _image(h: int, w: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((h, w, 4)) * 255).astype(np.uint8), "RGBA").convert(mode)


# ---- preprocessing --------------------------------------------------------------------------


def _torchvision_works() -> bool:
    try:
        import torchvision.transforms.v2.functional  # noqa: F401
    except Exception:  # not installed, or a build that does not load against this torch
        return False
    return True


# "default": whichever image processor transformers picks here (its torchvision one where
# torchvision is installed, else its PIL one), against portside's default
BACKENDS = ["default", "pil", pytest.param("torchvision", marks=pytest.mark.skipif(
    not _torchvision_works(), reason="transformers' torchvision image processor needs a working torchvision"))]


def _hf_image_processor(folder: Path, backend: str, **overrides: Any) -> Any:
    from transformers import AutoImageProcessor

    chosen = {} if backend == "default" else {"backend": backend}
    return AutoImageProcessor.from_pretrained(str(folder), **chosen, **overrides)


def _portside(image: Image.Image, config: dict[str, Any], backend: str) -> dict[str, torch.Tensor]:
    return preprocess_qwen2_5_vl_image(image, config, None if backend == "default" else backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("h, w, mode", [(70, 100, "RGB"), (56, 56, "RGB"), (200, 90, "RGBA"), (33, 47, "L"),
                                        (120, 130, "P"), (300, 30, "RGB"), (112, 84, "LA"), (400, 260, "RGB")])
def test_preprocessing_equals_transformers(folder: Path, preprocessor_config: dict[str, Any], backend: str, h: int,
                                           w: int, mode: str) -> None:
    processor = _hf_image_processor(folder, backend)
    image = _image(h, w, mode, seed=h * w)
    ref = processor(images=[image], return_tensors="pt")
    got = _portside(image, preprocessor_config, backend)
    assert got["pixel_values"].dtype == ref["pixel_values"].dtype == torch.float32
    assert torch.equal(got["image_grid_thw"], ref["image_grid_thw"])
    assert torch.equal(got["pixel_values"], ref["pixel_values"])
    grid = got["image_grid_thw"][0]
    assert num_image_tokens(grid, MERGE) == int(grid.prod()) // MERGE**2
    side = preprocessor_config["patch_size"] * MERGE
    assert preprocessor_config["min_pixels"] <= int(grid[1] * grid[2]) * 14 * 14 <= preprocessor_config["max_pixels"]
    assert int(grid[1]) * 14 % side == 0 and int(grid[2]) * 14 % side == 0


@pytest.mark.parametrize("backend", BACKENDS[1:])
@pytest.mark.parametrize("overrides", [{"resample": 2}, {"resample": 0}, {"do_rescale": False}, {"do_normalize": False},
                                       {"min_pixels": 28 * 28 * 8, "max_pixels": 28 * 28 * 100}])
def test_preprocessing_options_equal_transformers(folder: Path, preprocessor_config: dict[str, Any], backend: str,
                                                  overrides: dict[str, Any]) -> None:
    """Resampling filters, rescale / normalise switched off, other pixel limits; several images in
    one processor call (transformers resizes images of one size together)."""
    processor = _hf_image_processor(folder, backend, **overrides)
    images = [_image(h, w, mode, seed=i) for i, (h, w, mode) in enumerate(
        [(70, 100, "RGB"), (300, 30, "RGBA"), (70, 100, "RGB"), (33, 47, "L"), (520, 410, "RGB")])]
    ref = processor(images=images, return_tensors="pt")
    got = [_portside(im, {**preprocessor_config, **overrides}, backend) for im in images]
    assert torch.equal(torch.cat([g["image_grid_thw"] for g in got]), ref["image_grid_thw"])
    assert torch.equal(torch.cat([g["pixel_values"] for g in got]), ref["pixel_values"].float())


def test_images_are_resized_as_the_image_processor_transformers_picks(folder: Path, preprocessor_config: dict[str, Any],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' `AutoImageProcessor` (and `Qwen2_5_VLProcessor`, which needs torchvision)
    resize with torchvision where it is installed, with PIL otherwise; the two differ on any image
    that is resized, and the engine's processor follows the one transformers would use."""
    import transformers.utils
    from transformers import AutoConfig, AutoTokenizer

    from portside.config import MultiModalConfig
    from portside.multimodal.processor import MultiModalProcessor
    from portside.multimodal.qwen_vl_preprocess import default_backend

    image = _image(70, 100, seed=3)  # resized to 56 x 112
    by_backend = {b: preprocess_qwen2_5_vl_image(image, preprocessor_config, b) for b in ("pil", "torchvision")}
    assert not torch.equal(by_backend["pil"]["pixel_values"], by_backend["torchvision"]["pixel_values"])
    for available, backend in ((False, "pil"), (True, "torchvision")):
        monkeypatch.setattr(transformers.utils, "is_torchvision_available", lambda available=available: available)
        assert default_backend() == backend
        processor = MultiModalProcessor(folder, AutoConfig.from_pretrained(str(folder)),
                                        AutoTokenizer.from_pretrained(str(folder)), MultiModalConfig())
        data, n = processor.process_image(image)
        assert torch.equal(data["pixel_values"], by_backend[backend]["pixel_values"]) and n == 8


@pytest.mark.parametrize("resample", [1, 4, 5])  # lanczos, box, hamming
def test_torchvision_preprocessing_refuses_other_filters(preprocessor_config: dict[str, Any], resample: int) -> None:
    with pytest.raises(ValueError, match=f"resample={resample}"):
        preprocess_qwen2_5_vl_image(_image(70, 100), {**preprocessor_config, "resample": resample}, "torchvision")
    with pytest.raises(ValueError, match="image backend"):
        preprocess_qwen2_5_vl_image(_image(70, 100), preprocessor_config, "cv2")


# ---- the vision tower -----------------------------------------------------------------------


@pytest.mark.parametrize("h, w", [(70, 100), (112, 112), (56, 56), (200, 90)])
def test_image_features_equal_transformers(model: Any, hf_model: Any, preprocessor_config: dict[str, Any],
                                           h: int, w: int) -> None:
    from portside.model.vision.qwen2_5_vit import vision_windows

    data = preprocess_qwen2_5_vl_image(_image(h, w), preprocessor_config)
    grid = [tuple(data["image_grid_thw"][0].tolist())]
    if max(grid[0][1:]) > 4:  # several windows of 2x2 merge units (window_size 56 px)
        assert len(vision_windows(grid, MERGE, 2)[1]) > 1
    with torch.no_grad():
        got = model.embed_image(data, encoder_attention)
        ref = hf_model.model.get_image_features(data["pixel_values"], data["image_grid_thw"]).pooler_output[0]
    assert got.shape == (num_image_tokens(data["image_grid_thw"], MERGE), model.config.hidden_size)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)


def test_vision_tower_batches_images(model: Any, hf_model: Any, preprocessor_config: dict[str, Any]) -> None:
    """Several images in one call: each attends within itself (and its windows), rows in order."""
    images = [preprocess_qwen2_5_vl_image(_image(h, w, seed=h), preprocessor_config) for h, w in [(112, 84), (56, 56), (84, 112)]]
    pixels, grids = torch.cat([d["pixel_values"] for d in images]), torch.cat([d["image_grid_thw"] for d in images])
    with torch.no_grad():
        got = model.visual(pixels, grids, encoder_attention)
        ref = torch.cat(hf_model.model.get_image_features(pixels, grids).pooler_output)
        alone = torch.cat([model.embed_image(d, encoder_attention) for d in images])
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got, alone, atol=ATOL, rtol=RTOL)


def test_mrope_rotary_is_transformers_bit_for_bit(folder: Path, model: Any) -> None:
    from transformers import AutoConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

    hf_rotary = Qwen2_5_VLRotaryEmbedding(AutoConfig.from_pretrained(str(folder)).text_config)
    positions = torch.randint(0, 500, (3, 41), generator=torch.Generator().manual_seed(0))
    cos, sin = model.model.rotary(positions, torch.float32)
    hf_cos, hf_sin = hf_rotary(torch.zeros(1), positions[:, None])
    half = cos.shape[-1]
    assert torch.equal(cos, hf_cos[0, :, :half]) and torch.equal(sin, hf_sin[0, :, :half])
    assert torch.equal(hf_cos[0, :, half:], hf_cos[0, :, :half])
    flat = positions[0]  # 1-D positions: the same in all three
    torch.testing.assert_close(model.model.rotary(flat, torch.float32), model.model.rotary(flat.expand(3, -1), torch.float32),
                               rtol=0, atol=0)


def test_vision_tower_on_first_pipeline_stage_only(folder: Path) -> None:
    from portside.model.loader import load_checkpoint
    from portside.model.pipeline import pipeline_stages
    from portside.model.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
    from portside.model.registry import read_model_args

    args = read_model_args(folder)
    first, last = (Qwen2_5_VLForConditionalGeneration(args, stage=s) for s in pipeline_stages(args.num_layers, 2))
    for stage_model in (first, last):
        load_checkpoint(stage_model, folder)
    assert first.visual is not None and last.visual is None
    assert not any(name.startswith("visual.") for name, _ in last.named_parameters())


# ---- positions ------------------------------------------------------------------------------


def _prompt(folder: Path, images: list[dict[str, torch.Tensor]], texts: list[str]) -> tuple[list[int], list[MultiModalFeature]]:
    """A chat prompt with the images between the texts, each image's <|image_pad|> expanded to its
    token count (what the processor does), and the images as the engine carries them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    content: list[dict[str, Any]] = [{"type": "text", "text": texts[0]}]
    for text in texts[1:]:
        content += [{"type": "image"}, {"type": "text", "text": text}]
    rendered = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    pieces = rendered.split("<|image_pad|>")
    assert len(pieces) == len(images) + 1
    text = pieces[0]
    for data, piece in zip(images, pieces[1:]):
        text += "<|image_pad|>" * num_image_tokens(data["image_grid_thw"], MERGE) + piece
    ids = tok(text, add_special_tokens=False)["input_ids"]
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    features, i = [], 0
    for data in images:
        while ids[i] != image_id:
            i += 1
        n = num_image_tokens(data["image_grid_thw"], MERGE)
        assert ids[i : i + n] == [image_id] * n
        features.append(MultiModalFeature("image", content_hash(data), PlaceholderRange(i, n), data))
        i += n
    return ids, features


def _hf_rope_index(hf_model: Any, ids: list[int], features: list[MultiModalFeature]) -> tuple[torch.Tensor, int]:
    input_ids = torch.tensor([ids])
    types = (input_ids == hf_model.config.image_token_id).int()
    grids = torch.cat([f.data["image_grid_thw"] for f in features]) if features else None
    positions, delta = hf_model.model.get_rope_index(input_ids, mm_token_type_ids=types, image_grid_thw=grids)
    return positions[:, 0], int(delta.reshape(-1)[0])


@pytest.mark.parametrize("sizes", [[(70, 100)], [(112, 56), (56, 112)], [(200, 90), (56, 56)]])
def test_mrope_positions_equal_transformers(folder: Path, model: Any, hf_model: Any,
                                            preprocessor_config: dict[str, Any], sizes: list[tuple[int, int]]) -> None:
    images = [preprocess_qwen2_5_vl_image(_image(h, w, seed=i), preprocessor_config) for i, (h, w) in enumerate(sizes)]
    texts = ["Look at this:", "and then at", "What differs?"][: len(images) + 1]
    ids, features = _prompt(folder, images, texts)
    positions, delta = model.mrope_positions(ids, features)
    ref, ref_delta = _hf_rope_index(hf_model, ids, features)
    assert positions.dtype == torch.int64 and positions.shape == (3, len(ids))
    assert torch.equal(positions, ref)
    assert delta == ref_delta and delta != 0


def test_mrope_positions_text_only_and_errors(folder: Path, model: Any, preprocessor_config: dict[str, Any]) -> None:
    positions, delta = model.mrope_positions([5, 6, 7, 8], [])
    assert torch.equal(positions, torch.arange(4).expand(3, -1)) and delta == 0
    data = preprocess_qwen2_5_vl_image(_image(70, 100), preprocessor_config)
    ids, features = _prompt(folder, [data], ["a", "b"])
    with pytest.raises(ValueError, match="video"):
        model.mrope_positions(ids + [model.video_token_id], features)
    with pytest.raises(ValueError, match="image tokens"):
        model.mrope_positions(ids, [])


# ---- the whole model ------------------------------------------------------------------------


class _Paged:
    """One sequence in a paged cache, driven with the given embeddings and [3, T] positions."""

    def __init__(self, model: Any) -> None:
        self.model, self.backend = model, ReferenceAttentionBackend()
        self.seq = PagedSequence(model, self.backend, block_size=4, max_tokens=256)

    @torch.no_grad()
    def forward(self, ids: list[int], positions: torch.Tensor, embeds: torch.Tensor | None = None) -> torch.Tensor:
        n, seq = len(ids), self.seq
        meta = self.backend.prepare(single_sequence_metadata(seq.num_cached, n, seq.block_table, seq.block_size))
        ctx = ForwardContext(backend=self.backend, kv_caches=seq.kv_caches, metadata=meta, inputs_embeds=embeds)
        hidden = self.model(torch.tensor(ids), positions, ctx)
        seq.num_cached += n
        return self.model.compute_logits(hidden)


@pytest.mark.parametrize("sizes", [[(70, 100)], [(112, 84), (56, 112)]])
def test_logits_with_images_equal_transformers(folder: Path, model: Any, hf_model: Any,
                                               preprocessor_config: dict[str, Any], sizes: list[tuple[int, int]]) -> None:
    images = [preprocess_qwen2_5_vl_image(_image(h, w, seed=7 + i), preprocessor_config) for i, (h, w) in enumerate(sizes)]
    ids, features = _prompt(folder, images, ["Describe", "then compare with", "please."][: len(images) + 1])
    P = len(ids)
    # portside: text embeddings with the image rows written over their placeholders
    with torch.no_grad():
        embeds = model.embed_input_ids(torch.tensor(ids))
        for f in features:
            embeds[f.placeholder.offset : f.placeholder.end] = model.embed_image(f.data, encoder_attention)
    positions, delta = model.mrope_positions(ids, features)
    paged = _Paged(model)
    logits = paged.forward(ids, positions, embeds)
    next_id = int(logits[-1].argmax())
    decode = paged.forward([next_id], torch.full((3, 1), P + delta, dtype=torch.int64))
    # transformers: the prompt and the next token in one forward (its position is max + 1 = P + delta)
    with torch.no_grad():
        full = torch.tensor([ids + [next_id]])
        ref = hf_model(input_ids=full, pixel_values=torch.cat([d["pixel_values"] for d in images]),
                       image_grid_thw=torch.cat([d["image_grid_thw"] for d in images]),
                       mm_token_type_ids=(full == hf_model.config.image_token_id).int()).logits[0].float()
    torch.testing.assert_close(logits, ref[:P], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(decode[0], ref[P], atol=1e-4, rtol=1e-4)
    assert int(ref[P - 1].argmax()) == next_id


# ---- checkpoint names -----------------------------------------------------------------------


def _rewrite(folder: Path, dest: Path, rename: Any) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dest)
    tensors = load_file(str(folder / "model.safetensors"))
    renamed = {new: t for name, t in tensors.items() if (new := rename(name)) is not None}
    save_file(renamed, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def test_transformers5_native_names_load(folder: Path, model: Any, tmp_path: Path) -> None:
    def native(name: str) -> str:
        if name.startswith("visual."):
            return "model." + name
        return name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name

    other = load_model(ModelConfig(str(_rewrite(folder, tmp_path / "native", native)), max_model_len=512),
                       torch.device("cpu"))
    theirs = dict(other.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, theirs[name]), name


@pytest.mark.parametrize("dropped", ["visual.blocks.1.attn.qkv.bias", "visual.merger.mlp.2.weight",
                                     "visual.patch_embed.proj.weight", "model.layers.1.self_attn.k_proj.weight"])
def test_missing_tensor_is_reported(folder: Path, tmp_path: Path, dropped: str) -> None:
    path = _rewrite(folder, tmp_path / "missing", lambda name: None if name == dropped else name)
    with pytest.raises(ValueError, match="missing") as e:
        load_model(ModelConfig(str(path), max_model_len=512), torch.device("cpu"))
    assert dropped in str(e.value)
