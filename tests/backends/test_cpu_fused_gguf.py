"""The fused native batch-1 decode step over GGUF blocks (`backends/cpu/fused_decode.py`,
`LlamaDecoder.step_h` in `csrc/fused_decode.cpp`): with ``cpu_gguf_act=int8`` every batch-1 decode
of a GGUF Llama runs in it, and computes what the op-by-op ``gguf_dot`` linears compute (the same
kernels, the same activation rounding: only fp32 sums in other orders differ), on 1 and 2 threads,
for one-type files and a fused q/k/v or gate/up whose parts differ in type (Q4_K_M-like); models
it cannot run (fp32 activations, a matrix without an int8-activation kernel) stay op by op."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from portside import LLM, SamplingParams
from portside.testing.tiny import make_tiny_gguf, make_tiny_model

native_ops = pytest.importorskip("portside.backends.cpu.native_ops")
if native_ops.unavailable_reason() is not None:
    pytest.skip(f"the native operators do not build here: {native_ops.unavailable_reason()}", allow_module_level=True)

from portside.backends.cpu.fused_decode import FusedDecoder, unsupported_reason  # noqa: E402

PROMPT = [12, 250, 31, 99, 8, 120, 64, 300, 45, 77, 390, 6, 7]
N = 10
K_SHAPE = dict(hidden_size=256, intermediate_size=512, head_dim=64)  # K-quant rows are blocks of 256 values
# case -> (config overrides, file type, per-tensor types, threads)
CASES: dict[str, tuple[dict[str, Any], str, dict[str, str] | None, int]] = {
    "Q8_0": ({}, "Q8_0", None, 1),
    "Q4_0-2threads": ({}, "Q4_0", None, 2),
    # q/k Q4_K, v Q6_K (q/k/v in parts of two types), down Q8_0, the LM head Q6_K
    "Q4_K-mixed-2threads": (K_SHAPE, "Q4_K", {"attn_v": "Q6_K", "ffn_down": "Q8_0", "output": "Q6_K"}, 2),
}


def _file(case: str, tmp_path: Path) -> Path:
    overrides, qtype, types, _ = CASES[case]
    hf = make_tiny_model(tmp_path / case, "llama", seed=3, **overrides)
    return make_tiny_gguf(hf, tmp_path / f"{case}.gguf", qtype, tensor_types=types)


def _run(path: Path, threads: int, fused: bool, act: str = "int8") -> tuple[LLM, list[int], list[float]]:
    llm = LLM(model=str(path), device="cpu", max_model_len=128, block_size=8,
              platform_options={"cpu_gguf_act": act, "cpu_fused_decode": "on" if fused else "off",
                                "cpu_threads": str(threads)})
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True,
                                                                      logprobs=1), use_tqdm=False)[0].outputs[0]
    lps = [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]
    return llm, list(out.token_ids), lps


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_int8_decode_runs_fused_as_the_op_by_op_linears(case, tmp_path, monkeypatch):
    path = _file(case, tmp_path)
    threads = CASES[case][3]
    calls: list[int] = []
    fused_call = FusedDecoder.__call__

    def counting(self, input_ids, positions, ctx):
        calls.append(int(positions[0]))
        return fused_call(self, input_ids, positions, ctx)

    monkeypatch.setattr(FusedDecoder, "__call__", counting)
    llm, tokens, lps = _run(path, threads, fused=True)
    fused = llm.engine.executor.runner.graph_runner._fused
    assert fused is not None and fused.quantized
    assert calls == list(range(len(PROMPT), len(PROMPT) + N - 1))  # every decode step
    llm.engine.shutdown()
    calls.clear()
    llm, ref_tokens, ref_lps = _run(path, threads, fused=False)
    llm.engine.shutdown()
    assert not calls
    assert tokens == ref_tokens
    # same kernels and activation codes; attention, norms and the sums' order differ in fp32 only
    assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-3


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_8bit_kv_caches_with_the_int8_kernels(kv, tmp_path):
    """An 8-bit KV cache stays available with the GGUF int8-activation kernels: the fused step and
    the op-by-op linears (a 39-token prompt: the prefill's linears take the tiles) give the same
    greedy tokens over the same cache format."""
    path = _file("Q8_0", tmp_path)
    prompt = PROMPT * 3
    got = []
    for fused in ("on", "off"):
        llm = LLM(model=str(path), device="cpu", max_model_len=128, block_size=8, kv_cache_dtype=kv,
                  platform_options={"cpu_gguf_act": "int8", "cpu_fused_decode": fused})
        assert (llm.engine.executor.runner.graph_runner._fused is not None) == (fused == "on")
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        got.append(list(out.token_ids))
        llm.engine.shutdown()
    assert got[0] == got[1] and len(got[0]) == N


def test_fp32_activations_stay_op_by_op(tmp_path):
    path = _file("Q8_0", tmp_path)
    llm = LLM(model=str(path), device="cpu", max_model_len=64, platform_options={"cpu_gguf_act": "fp32"})
    runner = llm.engine.executor.runner
    assert runner.graph_runner._fused is None
    assert "cpu_gguf_act=int8" in (unsupported_reason(runner.model) or "")
    llm.engine.shutdown()
