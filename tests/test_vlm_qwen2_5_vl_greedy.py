"""Qwen2.5-VL end to end: portside's greedy tokens equal transformers' `generate` on the same
tiny random checkpoints, the reference built by transformers itself (`hf_vlm_greedy`: the
model's own `Qwen2_5_VLProcessor` where transformers can build it, i.e. with torchvision, else
its image processor, as transformers picks it). Images of several sizes: resized down, resized
up, non-square, one taken as it is, several windows, windows cut by the image's edge; batch
mixes: one image alone, two images of different sizes next to a text-only request, three images
in one prompt. Two geometries: the tiny default (windows of 2 x 2 merge units, block 1 full
attention) and windows of 3 x 3 units with two full-attention blocks, another mrope_section and
rope theta, and larger images."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from portside import LLM, SamplingParams
from portside.testing.vlm import hf_vlm_greedy, make_image

pytest.importorskip("transformers.models.qwen2_5_vl")

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PH = "<|vision_start|><|image_pad|><|vision_end|>"

GEOMETRIES: dict[str, dict[str, Any]] = {
    "windows-2x2": {},
    "windows-3x3": {
        "text_config": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 3, 4]}},
        "vision_config": {"window_size": 84, "depth": 4, "fullatt_block_indexes": [0, 2]},
        "max_pixels": 28 * 28 * 48,  # up to 24 x 24 patches: several windows, the last ones cut
    },
}

# (text, image sizes (width, height)): one image (non-square, resized); two of different sizes;
# text only; three (a large one shrunk to max_pixels, a small one grown to min_pixels, one
# already a multiple of 28)
BATCH = [
    (f"USER: {PH} describe it\nASSISTANT:", [(100, 70)]),
    (f"USER: {PH}\nand {PH} compare them\nASSISTANT:", [(300, 130), (60, 110)]),
    ("USER: the lazy dog sleeps in the sun\nASSISTANT:", []),
    (f"USER: {PH} {PH} then {PH} which one?\nASSISTANT:", [(640, 400), (30, 20), (112, 84)]),
]


@pytest.fixture(scope="module", params=list(GEOMETRIES))
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from portside.testing.tiny_qwen_vl import make_tiny_qwen2_5_vl

    overrides = dict(GEOMETRIES[request.param])
    max_pixels = overrides.pop("max_pixels", None)
    path = make_tiny_qwen2_5_vl(tmp_path_factory.mktemp(request.param) / "model", **overrides)
    if max_pixels is not None:
        config = json.loads((path / "preprocessor_config.json").read_text())
        (path / "preprocessor_config.json").write_text(json.dumps({**config, "max_pixels": max_pixels}))
    return path


def _prompts(seed: int) -> list[tuple[str, list[Any]]]:
    return [(text, [make_image(seed + 10 * i + j, size) for j, size in enumerate(sizes)])
            for i, (text, sizes) in enumerate(BATCH)]


def _generate(llm: LLM, prompts: list[tuple[str, list[Any]]]) -> list[list[int]]:
    inputs = [{"prompt": t, "multi_modal_data": {"image": ims}} if ims else t for t, ims in prompts]
    return [list(o.outputs[0].token_ids) for o in llm.generate(inputs, GREEDY, use_tqdm=False)]


def test_greedy_equals_transformers(folder: Path) -> None:
    prompts = _prompts(seed=1)
    llm = LLM(model=str(folder), device="cpu", max_model_len=512)
    batched = _generate(llm, prompts)
    alone = _generate(llm, prompts[:1])  # one image, a batch of its own
    want = [hf_vlm_greedy(folder, text, images, MAX_TOKENS) for text, images in prompts]
    for (_, images), got, ref in zip(prompts, batched, want):
        assert got == ref, f"{[im.size for im in images]}: {got} != transformers' {ref}"
    assert alone[0] == want[0]
    stats = llm.engine.stats()
    assert stats.num_running == stats.num_waiting == stats.num_used_blocks == 0
