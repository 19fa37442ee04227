"""End-to-end greedy parity through the Triton attention backend, on CPU tensors in the interpreter.

A test-only platform, ``triton-interp`` (the cpu platform's device handling with
`TritonAttentionBackend` as its attention), is registered the way a third-party plugin registers:
a distribution's entry point in the ``portside.platforms`` group (a throw-away ``.dist-info`` on
sys.path). The engine then selects it with ``device="triton-interp"``; its greedy tokens must
equal transformers' on a tiny random-weight model (head_dim 64, GQA 2), alone and batched, with
chunked prefill across block boundaries.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from portside.backend_api import AttentionBackend, EagerGraphRunner, GraphRunner
from portside.backends.cpu.platform import CpuPlatform
from portside.testing.tiny import hf_greedy, make_tiny_model

pytest.importorskip("triton")
pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs Triton on CPU tensors: interpreter only"),
]

MAX_TOKENS = 10
WORDS = "the quick brown fox jumps over the lazy dog while a small cat sleeps in the warm sun".split()


class TritonInterpPlatform(CpuPlatform):
    """CPU tensors, Triton kernels (run by the interpreter). Never auto-selected."""

    name = "triton-interp"
    priority = -1
    block_sizes = (16, 32, 64)
    attention_name = "triton"

    @classmethod
    def attention_backend(cls, config) -> AttentionBackend:
        from portside.backends.triton.attention import TritonAttentionBackend

        return TritonAttentionBackend()

    @classmethod
    def graph_runner(cls, model_fn, config) -> GraphRunner:
        return EagerGraphRunner(model_fn, config)


def register() -> str:
    return f"{__name__}:TritonInterpPlatform"


@pytest.fixture(scope="module")
def triton_plugin(tmp_path_factory: pytest.TempPathFactory):
    """Install the test platform's entry point for this module's tests."""
    site = tmp_path_factory.mktemp("site")
    info = site / "portside_triton_interp_test-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: portside-triton-interp-test\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(f"[portside.platforms]\ntriton-interp = {__name__}:register\n")
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(site))
    mp.delenv("PORTSIDE_PLUGINS", raising=False)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def tiny_gqa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_hd64"), "llama", head_dim=64)


def test_greedy_parity_through_triton_backend(triton_plugin, tiny_gqa_model: Path) -> None:
    from portside import LLM, SamplingParams

    llm = LLM(
        model=str(tiny_gqa_model),
        device="triton-interp",
        max_model_len=128,
        block_size=16,
        max_num_batched_tokens=24,  # a 37-token prompt is prefilled in chunks
    )
    runner = llm.engine.executor.runner
    assert llm.engine.platform is TritonInterpPlatform and runner.attn_backend.name == "triton"
    base = llm.get_tokenizer().encode(" ".join(WORDS * 4))
    prompts = [base[:5], base[3:20], base[1:38]]  # ends within a block, at one, past two
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        expected = hf_greedy(tiny_gqa_model, prompt, MAX_TOKENS)
        assert out.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens"
