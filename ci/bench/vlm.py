"""Image requests on a vision-language model, portside against transformers side by side in one
run, on the cpu backend: time to first token of one image request (processing, vision encoder,
prefill) and the throughput of a batch of image requests (output tokens per second and requests
per second), greedy, fp32. The greedy tokens of both are checked equal.

    python ci/bench/vlm.py [--requests 16] [--tokens 32] [--repeats 3] [--threads 2]

The model is a random-weight LLaVA-1.5-shaped folder built here (no model hub): CLIP ViT tower
at 224 px / patch 14 (256 image tokens, 6 layers of 384), a Llama language model (8 layers of
512), the LLaVA processor and chat template. transformers runs each measurement as a user
would: its processor on the text and images, then `generate` on the whole batch (left-padded).

Writes ci/bench/results/vlm.json and vlm.md. Each repeat runs both engines in turn; the best
repeat of each is kept (a shared machine's noise only ever adds time).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from machine import cpu_name  # ci/bench/machine.py, beside this script

from portside import LLM, SamplingParams
from portside.testing.vlm import make_image

RESULTS = Path(__file__).parent / "results"
IMAGE_SIZE = 224
PROMPT = "USER: <image>\nDescribe the picture in detail.\nASSISTANT:"


def build_model(path: Path) -> Path:
    """A LLaVA-1.5-shaped folder with random weights (fp32)."""
    import transformers

    from portside.testing.tiny import make_tiny_tokenizer
    from portside.testing.tiny_llava import _CLIP_MEAN, _CLIP_STD, IMAGE_TOKEN, LLAVA_TEMPLATE

    tok = make_tiny_tokenizer(path, added_tokens=(IMAGE_TOKEN,), chat_template=LLAVA_TEMPLATE)
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    text = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                                    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                                    eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    vision = transformers.CLIPVisionConfig(hidden_size=384, intermediate_size=1536, num_hidden_layers=6,
                                           num_attention_heads=6, image_size=IMAGE_SIZE, patch_size=14,
                                           hidden_act="quick_gelu", projection_dim=384)
    config = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=tok.convert_tokens_to_ids(IMAGE_TOKEN),
                                      vision_feature_layer=-2, vision_feature_select_strategy="default")
    config.architectures = ["LlavaForConditionalGeneration"]
    config.eos_token_id = eos
    torch.manual_seed(0)
    # transformers' own init (std 0.02): activations of a trained model's scale (the tests' wider
    # init drives the projector's GELU deep into its tail, and the denormals it returns slow every
    # CPU matmul after it, in both engines)
    model = transformers.LlavaForConditionalGeneration(config).to(torch.float32)
    model.save_pretrained(str(path), safe_serialization=True)
    image_processor = transformers.CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        image_mean=_CLIP_MEAN, image_std=_CLIP_STD)
    transformers.LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=14,
                                vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                chat_template=LLAVA_TEMPLATE, image_token=IMAGE_TOKEN).save_pretrained(str(path))
    return path


def portside_run(llm: LLM, images: list[Any], tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in images], params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


@torch.no_grad()
def hf_run(model: Any, processor: Any, images: list[Any], tokens: int) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    processor.tokenizer.padding_side = "left"
    inputs = processor(text=[PROMPT] * len(images), images=images, return_tensors="pt", padding=True)
    out = model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, eos_token_id=None,
                         pad_token_id=processor.tokenizer.pad_token_id or 0, temperature=None, top_p=None, top_k=None)
    return time.perf_counter() - start, out[:, inputs["input_ids"].shape[1]:].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp))
        llm = LLM(model=str(path), device="cpu", max_model_len=1024, max_num_seqs=args.requests)
        hf_model = transformers.LlavaForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
        processor = transformers.AutoProcessor.from_pretrained(str(path))
        best: dict[str, float] = {}
        seed = 100
        for _ in range(args.repeats):
            # distinct images every time: no encoder- or prefix-cache reuse across repeats
            batch = [make_image(seed + i, (320, 240)) for i in range(args.requests)]
            one = [make_image(seed + 999, (320, 240))]
            seed += 1000
            times = {}
            times["portside_ttft"], p1 = portside_run(llm, one, 1)
            times["hf_ttft"], h1 = hf_run(hf_model, processor, one, 1)
            times["portside_batch"], pb = portside_run(llm, batch, args.tokens)
            times["hf_batch"], hb = hf_run(hf_model, processor, batch, args.tokens)
            assert p1 == h1, f"first tokens differ: portside {p1} transformers {h1}"
            same = sum(a == b for a, b in zip(pb, hb))
            assert same >= len(pb) - 1, f"only {same} of {len(pb)} batched outputs equal transformers'"
            for k, v in times.items():
                best[k] = min(best.get(k, float("inf")), v)
    n, t = args.requests, args.tokens
    result = {
        "cpu": cpu_name(), "threads": args.threads, "requests": n, "new_tokens": t, "image_tokens": 256,
        "ttft_ms": {"portside": best["portside_ttft"] * 1e3, "transformers": best["hf_ttft"] * 1e3},
        "output_tok_s": {"portside": n * t / best["portside_batch"], "transformers": n * t / best["hf_batch"]},
        "requests_s": {"portside": n / best["portside_batch"], "transformers": n / best["hf_batch"]},
    }
    result["ttft_speedup"] = best["hf_ttft"] / best["portside_ttft"]
    result["throughput_ratio"] = best["hf_batch"] / best["portside_batch"]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "vlm.json").write_text(json.dumps(result, indent=1) + "\n")
    table = (
        f"## {time.strftime('%Y-%m-%d')}: {result['cpu']}, {args.threads} threads, fp32, {n} image requests x {t} tokens\n\n"
        "| engine | TTFT, 1 image (ms) | output tok/s | requests/s |\n|---|---:|---:|---:|\n"
        + "".join(f"| {e} | {result['ttft_ms'][e]:.0f} | {result['output_tok_s'][e]:.1f} | {result['requests_s'][e]:.2f} |\n"
                  for e in ("portside", "transformers"))
        + f"\nportside against transformers: TTFT speed-up {result['ttft_speedup']:.2f}x (transformers' time / portside's), "
          f"throughput {result['throughput_ratio']:.2f}x\n"
    )
    md = RESULTS / "vlm.md"
    old = md.read_text().split("\n", 2)[2] if md.exists() else ""
    md.write_text("# Vision-language requests (ci/bench/vlm.py)\n\n" + table + "\n" + old)
    print(table)


if __name__ == "__main__":
    main()
