"""End-to-end vision-language models: portside's greedy tokens equal transformers' `generate` with
the same images (one and two per prompt, batched with text-only requests), across block
boundaries, chunked prefill that cuts through images, a small encoder budget, and prefix-cache
hits (which must tell two images behind the same placeholder tokens apart)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from portside import LLM, SamplingParams
from portside.testing.tiny_llava import make_tiny_llava
from portside.testing.vlm import hf_vlm_greedy, make_image

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _llava(kind: str):
    def make(path: Path) -> Path:
        if kind == "llava-clip":
            return make_tiny_llava(path, vision="clip")
        if kind == "llava-siglip":
            return make_tiny_llava(path, vision="siglip")
        return make_tiny_llava(path, vision="clip", next=True)
    return make


def _qwen(path: Path) -> Path:
    from portside.testing.tiny_qwen_vl import make_tiny_qwen2_5_vl

    return make_tiny_qwen2_5_vl(path)


MAKERS = {"llava-clip": _llava("llava-clip"), "llava-siglip": _llava("llava-siglip"),
          "llava-next": _llava("llava-next"), "qwen2.5-vl": _qwen}
PLACEHOLDER = {"qwen2.5-vl": "<|vision_start|><|image_pad|><|vision_end|>"}


@pytest.fixture(scope="module", params=["llava-clip", pytest.param("llava-siglip", marks=pytest.mark.slow),
                                        "llava-next", "qwen2.5-vl"])
def vlm(request, tmp_path_factory) -> tuple[str, Path]:
    if request.param == "qwen2.5-vl":
        pytest.importorskip("portside.testing.tiny_qwen_vl")
    return request.param, MAKERS[request.param](tmp_path_factory.mktemp(request.param.replace(".", "")))


def prompts_for(kind: str) -> list[tuple[str, list[Any]]]:
    """(text, images): two images of different sizes, one image, text only, the first image again."""
    ph = PLACEHOLDER.get(kind, "<image>")
    big, small, wide = make_image(1, (56, 56)), make_image(2, (30, 40)), make_image(3, (84, 42))
    return [
        (f"USER: {ph}\nthe quick {ph} brown fox\nASSISTANT:", [big, wide]),
        (f"USER: {ph} what is in the picture?\nASSISTANT:", [small]),
        ("USER: the lazy dog sleeps in the sun\nASSISTANT:", []),
        (f"USER: describe {ph}\nASSISTANT:", [big]),
    ]


def run(path: Path, prompts: list[tuple[str, list[Any]]], max_model_len: int = 512, **engine: Any) -> tuple[LLM, list[list[int]]]:
    llm = LLM(model=str(path), device="cpu", max_model_len=max_model_len, **engine)
    inputs = [{"prompt": t, "multi_modal_data": {"image": ims}} if ims else t for t, ims in prompts]
    outs = llm.generate(inputs, GREEDY, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def expected(path: Path, prompts: list[tuple[str, list[Any]]]) -> list[list[int]]:
    return [hf_vlm_greedy(path, t, ims, MAX_TOKENS) for t, ims in prompts]


def assert_clean(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.num_running == stats.num_waiting == stats.num_used_blocks == 0
    llm.engine.scheduler.check_integrity()


def test_batched_greedy_equals_transformers(vlm: tuple[str, Path]):
    kind, path = vlm
    prompts = prompts_for(kind)
    llm, got = run(path, prompts, block_size=16)
    assert got == expected(path, prompts)
    assert_clean(llm)


@pytest.mark.parametrize("budget", [8, 20])
def test_chunked_prefill_through_images_and_small_encoder_budget(vlm: tuple[str, Path], budget: int):
    kind, path = vlm
    prompts = prompts_for(kind)
    llm, got = run(path, prompts, block_size=4, max_num_batched_tokens=budget, max_num_encoder_input_tokens=budget)
    assert got == expected(path, prompts)
    assert_clean(llm)


def test_prefix_cache_hits_keep_images_apart(vlm: tuple[str, Path]):
    kind, path = vlm
    ph = PLACEHOLDER.get(kind, "<image>")
    text = f"USER: a long shared instruction about the picture that follows {ph} and then some more words\nASSISTANT:"
    a, b = make_image(11, (56, 56)), make_image(12, (56, 56))  # same size: the same placeholder tokens
    llm = LLM(model=str(path), device="cpu", max_model_len=512, block_size=4)
    first = llm.generate([{"prompt": text, "multi_modal_data": {"image": a}}], GREEDY, use_tqdm=False)
    hits_before = llm.engine.stats().prefix_cache_hits
    again = llm.generate([{"prompt": text, "multi_modal_data": {"image": a}},
                          {"prompt": text, "multi_modal_data": {"image": b}}], GREEDY, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > hits_before  # the same image: the whole prompt but its last block
    assert first[0].outputs[0].token_ids == again[0].outputs[0].token_ids == hf_vlm_greedy(path, text, [a], MAX_TOKENS)
    assert again[1].outputs[0].token_ids == hf_vlm_greedy(path, text, [b], MAX_TOKENS)
    assert_clean(llm)


def test_preemption_recomputes_images(vlm: tuple[str, Path]):
    """A pool too small for every request at once: preempted image requests are recomputed
    (their images encoded again or read from the encoder cache) with unchanged tokens."""
    kind, path = vlm
    prompts = prompts_for(kind)
    llm, got = run(path, prompts, max_model_len=128, block_size=4, num_kv_blocks=40, max_num_batched_tokens=32)
    assert got == expected(path, prompts)
    assert llm.engine.stats().num_preemptions > 0
    assert_clean(llm)


@torch.no_grad()
def test_beam_search_with_an_image_equals_transformers(tmp_path: Path):
    from portside import BeamSearchParams
    from portside.testing.vlm import hf_model_and_processor

    path = make_tiny_llava(tmp_path / "llava", vision="clip")
    text, image = "USER: <image>\nwhat is it?\nASSISTANT:", make_image(5, (56, 56))
    llm = LLM(model=str(path), device="cpu", max_model_len=256, block_size=4)
    out = llm.beam_search([{"prompt": text, "multi_modal_data": {"image": image}}],
                          BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True))[0]
    model, processor = hf_model_and_processor(path)
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    want = model.generate(**inputs, num_beams=2, num_return_sequences=2, do_sample=False, max_new_tokens=6,
                          min_new_tokens=6, length_penalty=1.0, temperature=None, top_p=None, top_k=None)
    n = inputs["input_ids"].shape[1]
    assert [s.tokens[n:] for s in out.sequences] == [row[n:] for row in want.tolist()]
    assert all(s.tokens[:n] == inputs["input_ids"][0].tolist() for s in out.sequences)


@pytest.mark.slow  # spawns worker processes: CI's legs run it
@pytest.mark.parametrize("kind", ["llava-next", "qwen2.5-vl"])
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_tensor_and_pipeline_parallel(kind: str, tp: int, pp: int, tmp_path: Path):
    """The vision tower on every tensor-parallel rank / the first pipeline stage only; 3-D
    positions on every stage; chunked prefill through images."""
    path = MAKERS[kind](tmp_path / "m")
    prompts = prompts_for(kind)
    llm, got = run(path, prompts, block_size=4, max_num_batched_tokens=24, tensor_parallel_size=tp,
                   pipeline_parallel_size=pp)
    try:
        assert got == expected(path, prompts)
        assert_clean(llm)
    finally:
        llm.shutdown()


def test_parallel_samples_and_prompt_logprobs_with_an_image(vlm: tuple[str, Path]):
    """n = 2 samples fork the image prompt's blocks (no second encoding needed); prompt_logprobs
    over a prompt with image rows equal transformers' log-softmax."""
    kind, path = vlm
    text, images = prompts_for(kind)[1]
    llm = LLM(model=str(path), device="cpu", max_model_len=512, block_size=4)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=0)
    out = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}}], params, use_tqdm=False)[0]
    want = hf_vlm_greedy(path, text, images, MAX_TOKENS)
    assert [c.token_ids for c in out.outputs] == [want, want]
    from portside.testing.vlm import hf_model_and_processor

    model, processor = hf_model_and_processor(path)
    inputs = processor(text=[text], images=images, return_tensors="pt")
    with torch.no_grad():
        logprobs = torch.log_softmax(model(**inputs).logits[0].float(), dim=-1)
    ids = inputs["input_ids"][0].tolist()
    assert out.prompt_token_ids == ids and out.prompt_logprobs[0] is None
    got = torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    want_lp = logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(got, want_lp, atol=2e-4, rtol=1e-4)
    assert_clean(llm)


def test_embed_images_batched_equals_one_at_a_time(vlm: tuple[str, Path]):
    """The runner encodes a step's new images together (`embed_images`): same rows as one by one."""
    kind, path = vlm
    llm = LLM(model=str(path), device="cpu", max_model_len=512, block_size=16)
    runner = llm.engine.executor.runner
    images = [make_image(21, (56, 56)), make_image(22, (30, 40)), make_image(23, (56, 56)), make_image(24, (84, 42))]
    ph = PLACEHOLDER.get(kind, "<image>")
    features = llm.engine.process_multimodal({"prompt": ph * 4, "multi_modal_data": {"image": images}})["mm_features"]
    attention = runner.attn_backend.encoder_attention
    together = runner.model.embed_images([f.data for f in features], attention)
    for f, emb in zip(features, together, strict=True):
        torch.testing.assert_close(emb, runner.model.embed_image(f.data, attention), atol=1e-5, rtol=1e-5)
