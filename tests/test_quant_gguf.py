"""GGUF files served quantized (`portside.quant.gguf`): llama.cpp's blocks decoded bit for bit as
its reference does, every architecture's tiny model written quantized (`make_tiny_gguf`) giving
portside's greedy tokens equal to transformers' on the *dequantized* weights (the folder
`convert_gguf` dequantizes through gguf's own code, not portside's) with the weights resident
in about the file's bytes, tensor-parallel slices, broken files named, and (where
llama-cpp-python is installed) llama.cpp itself on the same files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from portside import LLM, SamplingParams
from portside.model.gguf_loader import convert_gguf, resolve_model_path
from portside.quant.gguf_blocks import GGML_TYPES, block_shape, dequantize_blocks, row_bytes, type_from_name
from portside.testing.gguf_quants import quantize_k
from portside.testing.tiny import hf_greedy, make_tiny_gguf, make_tiny_model

PROMPT = [12, 250, 31, 99, 8, 120, 64, 300, 45, 77, 390, 6, 7]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
K_SHAPE = dict(hidden_size=256, intermediate_size=512, head_dim=64)  # K-quant rows are blocks of 256 values


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PORTSIDE_CACHE", str(tmp_path / "cache"))


def _llm(path: Path | str, **kwargs: Any) -> LLM:
    return LLM(model=str(path), device="cpu", max_model_len=128, platform_options={"cpu_fused_decode": "off"}, **kwargs)


def _greedy(llm: LLM, prompts: list[list[int]], n: int = 12) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def _file_tensor_bytes(path: Path) -> int:
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)


# ---- the block formats ---------------------------------------------------------------------------

# byte ranges of each block holding float16 scales (random bytes there could be NaN or inf)
_HALF_FIELDS = {
    "Q4_0": [(0, 2)], "Q5_0": [(0, 2)], "Q8_0": [(0, 2)], "Q4_1": [(0, 4)], "Q5_1": [(0, 4)],
    "Q2_K": [(80, 84)], "Q3_K": [(108, 110)], "Q4_K": [(0, 4)], "Q5_K": [(0, 4)], "Q6_K": [(208, 210)],
    "IQ4_NL": [(0, 2)], "IQ4_XS": [(0, 2)],
}


def _random_rows(name: str, lead: tuple[int, ...], blocks: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [*lead, blocks * type_size]: random codes, finite random scales."""
    size, nbytes = block_shape(type_from_name(name))
    if name in ("F32", "F16", "BF16"):
        values = rng.standard_normal((*lead, blocks * size)).astype(np.float32)
        if name == "F16":
            return values.astype(np.float16).view(np.uint8)
        return values.view(np.uint8) if name == "F32" else (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, size=(*lead, blocks, nbytes), dtype=np.uint8)
    for lo, hi in _HALF_FIELDS[name]:
        scales = (rng.standard_normal((*lead, blocks, (hi - lo) // 2)) * 0.05).astype(np.float16)
        raw[..., lo:hi] = scales.view(np.uint8)
    return raw.reshape(*lead, blocks * nbytes)


@pytest.mark.parametrize("name", GGML_TYPES)
def test_dequantize_blocks_equals_llama_cpp_reference_bit_for_bit(name: str) -> None:
    import gguf

    rng = np.random.default_rng(0)
    ggml_type = type_from_name(name)
    for lead, blocks in (((1,), 1), ((3,), 4), ((2, 5), 3)):  # rows (with an expert dim), blocks per row
        raw = _random_rows(name, lead, blocks, rng)
        k = blocks * block_shape(ggml_type)[0]
        expected = np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(ggml_type)), dtype=np.float32)
        got = dequantize_blocks(torch.from_numpy(raw), ggml_type, k)
        assert got.dtype == torch.float32 and tuple(got.shape) == (*lead, k)
        np.testing.assert_array_equal(got.numpy().view(np.uint32), expected.view(np.uint32))


def test_block_shapes_and_row_sizes() -> None:
    assert block_shape(type_from_name("Q8_0")) == (32, 34)
    assert block_shape(type_from_name("Q4_K")) == (256, 144)
    assert block_shape(type_from_name("Q6_K")) == (256, 210)
    assert row_bytes(type_from_name("Q4_0"), 64) == 36
    with pytest.raises(ValueError, match="not a whole number of Q4_K blocks of 256"):
        row_bytes(type_from_name("Q4_K"), 320)
    with pytest.raises(ValueError, match=r"Q8_0 rows of 64 values are uint8 \[.., 68\], got torch.uint8 \(4, 66\)"):
        dequantize_blocks(torch.zeros(4, 66, dtype=torch.uint8), type_from_name("Q8_0"), 64)
    with pytest.raises(ValueError, match="'IQ2_XXS' is not supported"):
        type_from_name("IQ2_XXS")


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_test_encoder_writes_blocks_llama_cpp_decodes(qtype: str) -> None:
    """The encoder behind the K-quant test files: gguf's reference decodes its blocks close to
    the input (round to nearest; llama.cpp's own quantizer searches harder)."""
    import gguf

    x = (np.random.default_rng(1).standard_normal((8, 512)) * 0.25).astype(np.float32)
    x[0, :256] = 0.0  # an all-zero block
    x[1] = np.abs(x[1])  # no negative values
    blocks = quantize_k(x, qtype)
    assert blocks.shape == (8, 2 * block_shape(type_from_name(qtype))[1])
    y = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype])
    step = {"Q4_K": 15, "Q5_K": 31, "Q6_K": 62}[qtype]
    assert np.abs(y - x).max() <= 1.5 * (np.ptp(x) / step)
    assert np.all(y[0, :256] == 0)


# ---- served quantized, against transformers on the dequantized weights ---------------------------

# case -> (tiny arch, config overrides, file type, per-tensor types as llama.cpp's mixes write them)
CASES: dict[str, tuple[str, dict[str, Any], str, dict[str, str] | None]] = {
    "llama-Q8_0": ("llama", {}, "Q8_0", None),
    "llama-Q4_0": ("llama", {}, "Q4_0", None),
    "llama-Q4_K": ("llama", K_SHAPE, "Q4_K", None),
    "llama-Q5_K": ("llama", K_SHAPE, "Q5_K", None),
    "llama-Q6_K": ("llama", K_SHAPE, "Q6_K", None),
    "llama-IQ4_XS": ("llama", K_SHAPE, "IQ4_XS", None),  # served in its blocks (no weight-only kernel: the reference)
    "qwen2-Q4_1": ("qwen2", {}, "Q4_1", None),  # qkv bias
    "phi3-Q5_0": ("phi3", {}, "Q5_0", None),  # q/k/v and gate/up fused in the checkpoint
    # tied embedding / LM head: one table; Gemma's sandwich norms and soft-caps
    "gemma2-Q8_0": ("gemma2", {"query_pre_attn_scalar": 24, "tie_word_embeddings": True}, "Q8_0", None),
    # Q4_K_M-like: v in Q6_K, k kept F16 (q, k, v computed part by part), down in Q8_0
    "llama-mixed": ("llama", K_SHAPE, "Q4_K", {"attn_v": "Q6_K", "attn_k": "F16", "ffn_down": "Q8_0"}),
    "qwen3_moe-Q4_K": ("qwen3_moe", K_SHAPE | {"moe_intermediate_size": 256}, "Q4_K", None),
    # the experts' gate and up differ (w13 dequantized at load), their down in another type
    "mixtral-mixed": ("mixtral", {}, "Q4_0", {"ffn_up_exps": "Q8_0", "ffn_down_exps": "Q5_1"}),
}
_SLOW = {"qwen3_moe-Q4_K", "llama-Q4_K", "llama-Q5_K", "mixtral-mixed", "llama-mixed", "llama-Q4_0"}  # CI runs them
_DEQUANTIZED_AT_LOAD = {"mixtral-mixed"}  # by design: more than the file's bytes


def _quantized_file(case: str, tmp_path: Path) -> tuple[Path, Path]:
    """(the .gguf, its dequantized HF folder for transformers)."""
    arch, overrides, qtype, types = CASES[case]
    hf = make_tiny_model(tmp_path / case, arch, seed=5, **overrides)
    path = make_tiny_gguf(hf, tmp_path / f"{case}.gguf", qtype, tensor_types=types)
    return path, convert_gguf(path, tmp_path / f"{case}-dequantized")


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in _SLOW else c for c in CASES])
def test_quantized_gguf_matches_transformers_on_its_dequantized_weights(case: str, tmp_path: Path) -> None:
    path, dequantized = _quantized_file(case, tmp_path)
    llm = _llm(path)
    assert _greedy(llm, [PROMPT]) == [hf_greedy(dequantized, PROMPT, 12)]
    # served in blocks: the converted folder lists the quantized tensors, and memory is the file's
    quant = json.loads((resolve_model_path(path) / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "gguf"
    q = next(t for n, t in quant["tensors"].items() if n.endswith("q_proj.weight") or n.endswith("qkv_proj.weight"))
    assert q["type"] == CASES[case][2]
    ratio = llm.engine.weight_bytes / _file_tensor_bytes(path)
    assert (ratio > 1.2) if case in _DEQUANTIZED_AT_LOAD else (ratio <= 1.2), f"weights take {ratio:.2f}x the file's tensor bytes"


# cases run with int8 activations (backend option cpu_gguf_act=int8: the cpu backend's `gguf_dot` kernels)
INT8_CASES = ("llama-Q8_0", "llama-Q4_0", "llama-IQ4_XS", "llama-mixed", "qwen3_moe-Q4_K")
N_INT8 = 24
INT8_CLEAR_MARGIN = 1.0  # logits: twice what rounding the activations to 8 bits moves them by here (<= 0.47)


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in _SLOW else c for c in INT8_CASES])
def test_int8_activations_agree_with_transformers_where_the_margin_is_clear(case: str, tmp_path: Path) -> None:
    """With cpu_gguf_act=int8 the activations are rounded to 8 bits per block inside the dot
    products, as llama.cpp does, which moves a tiny random model's logits by up to ~0.5: free-
    running greedy may part from transformers' (on the dequantized weights) where two tokens are
    nearly tied. Teacher-forced on transformers' tokens, portside's next token must equal
    transformers' wherever its top-2 margin is clear, and the logprobs must differ from the fp32
    activations' (the int8 kernels ran)."""
    from transformers import AutoModelForCausalLM

    path, dequantized = _quantized_file(case, tmp_path)
    theirs = hf_greedy(dequantized, PROMPT, N_INT8)
    model = AutoModelForCausalLM.from_pretrained(str(dequantized), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + theirs])).logits[0, len(PROMPT) - 1 : len(PROMPT) - 1 + N_INT8]
    top2 = logits.topk(2).values
    clear = ((top2[:, 0] - top2[:, 1]) > INT8_CLEAR_MARGIN).tolist()
    assert sum(clear) >= N_INT8 // 6  # (Q4_0's tiny llama: 4 of 24)
    prompts = [{"prompt_token_ids": PROMPT + theirs[:i]} for i in range(N_INT8)]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=1)
    runs = {}
    for act in ("int8", "fp32"):
        llm = LLM(model=str(path), device="cpu", max_model_len=128,
                  platform_options={"cpu_fused_decode": "off", "cpu_gguf_act": act})
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[act] = ([o.outputs[0].token_ids[0] for o in outs], [o.outputs[0].cumulative_logprob for o in outs])
        llm.engine.shutdown()
    forced, logprobs = runs["int8"]
    assert [a for a, c in zip(forced, clear) if c] == [b for b, c in zip(theirs, clear) if c]
    assert runs["fp32"][0] == theirs  # fp32 activations: every step, as the parity test above
    assert max(abs(a - b) for a, b in zip(logprobs, runs["fp32"][1])) > 1e-4


def test_embedded_default_conversion_still_dequantizes(tmp_path: Path) -> None:
    """`convert_gguf` (the default model's path, and what transformers loads) keeps dequantizing;
    only `resolve_model_path`'s cached folder keeps the blocks."""
    path, dequantized = _quantized_file("llama-Q8_0", tmp_path)
    assert "quantization_config" not in json.loads((dequantized / "config.json").read_text())
    assert all(t.dtype == torch.float32 for t in load_file(str(dequantized / "model.safetensors")).values())
    kept = load_file(str(resolve_model_path(path) / "model.safetensors"))
    assert kept["model.layers.0.self_attn.q_proj.weight"].dtype == torch.uint8
    assert kept["model.layers.0.input_layernorm.weight"].dtype == torch.float32  # norms stay dense


# ---- tensor parallelism: each rank's slice ---------------------------------------------------------


def _rank_models(folder: Path, tp: int) -> list[Any]:
    """The model as each of `tp` ranks loads it (no collectives run while loading)."""
    from portside.config import ModelConfig
    from portside.model.registry import load_model
    from portside.quant.config import QuantConfig

    quant = QuantConfig.resolve(json.loads((folder / "config.json").read_text())["quantization_config"], None)
    config = ModelConfig(path=str(folder), max_model_len=128, quantization=quant)
    return [load_model(config, torch.device("cpu"), tp_rank=r, tp_size=tp) for r in range(tp)]


def _dense(w: Any) -> torch.Tensor:
    from portside.quant.weight import dequantize

    return dequantize(w)


def test_tensor_parallel_ranks_keep_their_rows_and_whole_blocks(tmp_path: Path) -> None:
    """Q8_0 (blocks of 32) over 2 ranks: the column-parallel layers' rows (fused q/k/v parts
    each), the row-parallel layers' whole blocks of input columns, the vocabulary rows; the
    ranks' pieces put together are the whole dequantized weight."""
    path, dequantized = _quantized_file("llama-Q8_0", tmp_path)
    full = load_file(str(dequantized / "model.safetensors"))
    ranks = _rank_models(resolve_model_path(path), 2)
    layer = "model.layers.1"

    def part(name: str) -> torch.Tensor:
        return full[f"{layer}.{name}.weight"]

    qkv = [_dense(m.model.layers[1].self_attn.qkv_proj.quant) for m in ranks]
    q, k, v = part("self_attn.q_proj"), part("self_attn.k_proj"), part("self_attn.v_proj")
    for r, w in enumerate(qkv):  # 4 heads / 2 KV heads of 16: rank r has q heads 2r, 2r+1 and KV head r
        expected = torch.cat([q[32 * r : 32 * (r + 1)], k[16 * r : 16 * (r + 1)], v[16 * r : 16 * (r + 1)]])
        torch.testing.assert_close(w, expected, rtol=0, atol=0)
    o = torch.cat([_dense(m.model.layers[1].self_attn.o_proj.quant) for m in ranks], dim=1)
    torch.testing.assert_close(o, part("self_attn.o_proj"), rtol=0, atol=0)
    down = torch.cat([_dense(m.model.layers[1].mlp.down_proj.quant) for m in ranks], dim=1)
    torch.testing.assert_close(down, part("mlp.down_proj"), rtol=0, atol=0)
    gate_up = [_dense(m.model.layers[1].mlp.gate_up_proj.quant) for m in ranks]
    gate, up = part("mlp.gate_proj"), part("mlp.up_proj")
    for r, w in enumerate(gate_up):
        torch.testing.assert_close(w, torch.cat([gate[64 * r : 64 * (r + 1)], up[64 * r : 64 * (r + 1)]]), rtol=0, atol=0)
    vocab = full["model.embed_tokens.weight"].shape[0]
    table = torch.cat([_dense(m.model.embed_tokens.quant) for m in ranks])[:vocab]
    torch.testing.assert_close(table, full["model.embed_tokens.weight"], rtol=0, atol=0)


def test_tensor_parallel_split_inside_a_block_is_refused(tmp_path: Path) -> None:
    """Q4_K's blocks are 256 values: o_proj's 256 input features cannot go 128 to each of 2 ranks."""
    path, _ = _quantized_file("llama-Q4_K", tmp_path)
    with pytest.raises(ValueError, match=r"o_proj.weight'.*Q4_K blocks of 256 values cannot be split over 2 ranks "
                                         r"\(128 input features each\).*must divide 1"):
        _rank_models(resolve_model_path(path), 2)


@pytest.mark.slow
def test_tensor_parallel_two_workers_match_transformers(tmp_path: Path) -> None:
    path, dequantized = _quantized_file("llama-Q8_0", tmp_path)
    llm = _llm(path, tensor_parallel_size=2)
    try:
        assert _greedy(llm, [PROMPT]) == [hf_greedy(dequantized, PROMPT, 12)]
    finally:
        llm.engine.shutdown()


# ---- broken files ------------------------------------------------------------------------------


def test_truncated_file_names_the_tensor_and_the_cli_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from portside.cli import main

    path, _ = _quantized_file("llama-Q8_0", tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:-5000])  # the last tensors' rows run past the end
    with pytest.raises(ValueError, match=r"GGUF tensor '[\w.]+': .*\(a truncated or inconsistent file\)"):
        convert_gguf(path, tmp_path / "out", dequantize=False)
    assert main(["generate", "hello", "--model", str(path), "--device", "cpu", "--max-tokens", "2"]) == 2
    assert "a truncated or inconsistent file" in capsys.readouterr().err


def test_rows_that_do_not_fit_their_type_are_named_at_load(tmp_path: Path) -> None:
    """A converted folder whose quantized tensor lost bytes per row, or whose listed type is
    wrong for its bytes: loading names the tensor."""
    path, _ = _quantized_file("llama-Q4_0", tmp_path)
    folder = resolve_model_path(path)
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors = load_file(str(folder / "model.safetensors"))
    good = tensors[name]
    tensors[name] = good[:, :-2].contiguous()  # 34 of the 36 bytes of a Q4_0 row of 64
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{name}.*has shape \(32, 34\), but 32 rows of 64 Q4_0 values are \[32, 36\] bytes"):
        _llm(folder)
    tensors[name] = good
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["tensors"][name]["type"] = "Q8_0"  # 68 bytes a row
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"{name}.*\[32, 68\] bytes \(truncated or not Q8_0\)"):
        _llm(folder)


# ---- llama.cpp -----------------------------------------------------------------------------------

N_PARITY = 24
CLEAR_MARGIN = 1.0  # logits: twice what llama.cpp's 8-bit activations move them by on this model


def _llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError:
        pytest.skip("llama-cpp-python is not installed (pip install llama-cpp-python builds llama.cpp)")
    return llama_cpp


def _llama_cpp_greedy(path: Path, n: int) -> tuple[list[int], np.ndarray]:
    """llama.cpp's greedy continuation of PROMPT and, at each step, its top-2 logit margin."""
    llama_cpp = _llama_cpp()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, logits_all=False, verbose=False, n_threads=2)
    llm.reset()
    llm.eval(PROMPT)
    tokens, margins = [], []
    for _ in range(n):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),)).copy()
        top2 = np.sort(logits)[-2:]
        tokens.append(int(logits.argmax()))
        margins.append(float(top2[1] - top2[0]))
        llm.eval([tokens[-1]])
    llm.close()
    return tokens, np.array(margins)


def _llama_cpp_quantize(src: Path, dst: Path, ftype: str, requantize: bool = False) -> Path:
    """llama.cpp's own quantizer (llama-quantize): `ftype` a LLAMA_FTYPE_* name."""
    llama_cpp = _llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{ftype}")
    params.allow_requantize = requantize
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) == 0
    return dst


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q4_K_M"])
def test_same_greedy_tokens_as_llama_cpp(qtype: str, tmp_path: Path) -> None:
    """The Q8_0 and Q4_K files are written by gguf's Python package (the Q4_K blocks by
    `gguf_quants`); "Q4_K_M" is llama.cpp's own quantizer's mix (attn_v and some ffn_down in Q6_K).

    1. Weights: llama.cpp's dequantization (its quantizer writing the file back as F32) is
       bit for bit what portside serves.
    2. llama.cpp computing on that F32 file and portside on the quantized one: the same
       N_PARITY greedy tokens (both with fp32 activations).
    3. llama.cpp on the quantized file rounds activations to 8 bits (Q8_0 / Q8_K blocks) inside
       its dot products, which moves this random model's logits by up to ~0.5, so free-running
       greedy may part where two tokens are nearly tied. Teacher-forced on llama.cpp's own tokens,
       portside's next token must equal llama.cpp's wherever llama.cpp's top-2 margin is clear
       (> CLEAR_MARGIN); the agreement counts are reported.
    """
    import gguf

    _llama_cpp()
    hf = make_tiny_model(tmp_path / "hf", "llama", seed=5, **K_SHAPE)
    if qtype == "Q4_K_M":
        path = _llama_cpp_quantize(make_tiny_gguf(hf, tmp_path / "f32.gguf"), tmp_path / "q4km.gguf", "MOSTLY_Q4_K_M")
    else:
        path = make_tiny_gguf(hf, tmp_path / f"{qtype}.gguf", qtype)
    back = _llama_cpp_quantize(path, tmp_path / "back-f32.gguf", "ALL_F32", requantize=True)
    ours = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    types = set()
    for t in gguf.GGUFReader(str(back)).tensors:  # 1.
        src = ours[t.name]
        types.add(src.tensor_type.name)
        k = int(src.shape[0])
        w = dequantize_blocks(torch.from_numpy(np.array(src.data).view(np.uint8)).reshape(-1, row_bytes(int(src.tensor_type), k)),
                              int(src.tensor_type), k)
        np.testing.assert_array_equal(w.numpy().reshape(-1), np.asarray(t.data, dtype=np.float32).reshape(-1), err_msg=t.name)
    if qtype == "Q4_K_M":
        assert {"Q4_K", "Q6_K"} <= types

    llm = _llm(path)
    ours_free = _greedy(llm, [PROMPT], N_PARITY)[0]
    assert ours_free == _llama_cpp_greedy(back, N_PARITY)[0]  # 2.

    theirs, margins = _llama_cpp_greedy(path, N_PARITY)  # 3.
    forced = [t[0] for t in _greedy(llm, [PROMPT + theirs[:i] for i in range(N_PARITY)], 1)]
    clear = margins > CLEAR_MARGIN
    agree_free = next((i for i, (a, b) in enumerate(zip(ours_free, theirs)) if a != b), N_PARITY)
    agree_forced = sum(a == b for a, b in zip(forced, theirs))
    print(f"{qtype}: free-running greedy agrees for {agree_free}/{N_PARITY} tokens; teacher-forced "
          f"{agree_forced}/{N_PARITY}; at the {int(clear.sum())} clear-margin steps "
          f"{sum(a == b for a, b, c in zip(forced, theirs, clear) if c)}")
    assert clear.sum() >= N_PARITY // 4
    assert [a for a, c in zip(forced, clear) if c] == [b for b, c in zip(theirs, clear) if c]


def test_unsupported_quant_type_exits_2_naming_tensor_type_and_the_supported_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A tensor in a type neither portside's decoders nor the `gguf` package read (Q8_1: llama.cpp's
    intermediate activation format). The file is written by the real writer; only its encoder for
    Q8_1, which gguf-py lacks, is filled in here (random blocks)."""
    import gguf

    from portside.cli import main

    real = gguf.quants.quantize

    def quantize(w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
        if qtype != gguf.GGMLQuantizationType.Q8_1:
            return real(w, qtype)
        size, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        return np.random.default_rng(0).integers(0, 256, (*w.shape[:-1], w.shape[-1] // size * nbytes), dtype=np.uint8)

    monkeypatch.setattr(gguf.quants, "quantize", quantize)
    hf = make_tiny_model(tmp_path / "hf", "llama", seed=5)
    path = make_tiny_gguf(hf, tmp_path / "q8_1.gguf", "Q8_0", tensor_types={"attn_q": "Q8_1"})
    assert main(["generate", "hello", "--model", str(path), "--device", "cpu", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"GGUF tensor 'blk\.0\.attn_q\.weight' has type Q8_1, which portside cannot read \(and \d+ more tensors\)", err)
    assert "supported types: F32, F16, BF16, Q4_0" in err and "IQ4_XS" in err and "IQ2_XXS" in err
