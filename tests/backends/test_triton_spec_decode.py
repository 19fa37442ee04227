"""EAGLE, EAGLE-3 and MTP speculative decoding through the Triton kernels the cuda and rocm
platforms launch, on CPU tensors in the interpreter (device `triton-interp`, plugins/triton_interp,
installed by the `triton_plugin` fixture): the target's verification steps and the head's own
paged layer through `TritonAttentionBackend` (DeepSeek-V3's MTP layer through its latent-attention
kernel, the GLM-4.5 and DeepSeek-V3 MTP layers' experts through the Triton fused-MoE kernel).

Greedy tokens equal transformers' for two prompts batched, the longer prefilled in chunks (a
16-token budget at block size 16); the distilled EAGLE head's proposals are accepted at some
depth; the EAGLE-3 head's and GLM-4.5 MTP layer's proposals equal the pure-torch references of
tests/test_spec_decode_eagle.py and tests/test_spec_decode_mtp.py; every block is freed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("triton")
pytestmark = [
    pytest.mark.slow,  # the triton leg runs it (-m "triton or xgrammar"); ~15 s an engine under the interpreter
    pytest.mark.triton,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs Triton on CPU tensors: interpreter only"),
]

import test_spec_decode_eagle as eagle_tests  # noqa: E402  (tests/ is on sys.path: rootdir conftest)
from test_spec_decode_eagle import RefHead  # noqa: E402
from test_spec_decode_mtp import RefMTP  # noqa: E402

N = 8  # tokens generated per prompt
# the EAGLE tests' module fixtures: the Llama target, its prompts and greedy tokens, the heads
target, ps, want, heads = eagle_tests.target, eagle_tests.ps, eagle_tests.want, eagle_tests.heads


def _mtp_target(name: str, root: Path) -> Path:
    if name == "mtp-glm":
        from portside.testing.tiny_glm4_moe import make_tiny_glm4_moe

        return make_tiny_glm4_moe(root / "glm")
    from portside.testing.eagle import add_mtp_layer
    from portside.testing.tiny_deepseek import make_tiny_deepseek

    return add_mtp_layer(make_tiny_deepseek(root / "v3", "v3", num_nextn_predict_layers=1, seed=6, num_hidden_layers=2,
                                            first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                                            topk_group=1, norm_topk_prob=True))  # fmt: skip


@pytest.mark.parametrize("name", ["eagle-distilled", "eagle3", "mtp-glm", "mtp-v3"])
def test_greedy_equals_transformers_through_triton_kernels(triton_plugin, name: str, target: Path,
                                                           heads: dict[str, Path], ps, want, tmp_path: Path,
                                                           monkeypatch) -> None:  # fmt: skip
    from portside import LLM, SamplingParams
    from portside.spec_decode.eagle import EagleProposer
    from portside.testing.engine_parity import assert_all_blocks_free
    from portside.testing.tiny import hf_greedy

    seen: list[tuple[list[int], list[int]]] = []
    propose = EagleProposer.propose

    def spy(self: Any, states: list[Any]) -> dict[str, list[int]]:
        out = propose(self, states)
        seen.extend((s.prompt_token_ids + s.output_token_ids, out[s.req_id]) for s in states if s.req_id in out)
        return out

    monkeypatch.setattr(EagleProposer, "propose", spy)
    prompts = [ps[3], ps[0]]  # 21 tokens (two prefill chunks), 5
    if name.startswith("mtp"):
        path = _mtp_target(name, tmp_path)
        spec: dict[str, Any] = {"method": "mtp", "num_speculative_tokens": 2}
        expected = [hf_greedy(path, p, N) for p in prompts]
    else:
        path = target
        spec = {"method": "eagle3" if name == "eagle3" else "eagle", "model": str(heads[name]), "num_speculative_tokens": 3}
        expected = [want[tuple(p)][:N] for p in prompts]
    llm = LLM(model=str(path), device="triton-interp", max_model_len=64, block_size=16, max_num_batched_tokens=16,
              speculative_config=spec)  # fmt: skip
    runner = llm.engine.executor.runner
    assert runner.attn_backend.name == "triton" and runner.draft.attn_backend is runner.attn_backend
    if name.startswith("mtp"):
        assert type(runner.draft.head.layer.mlp.ops).__name__ == "TritonModelOps"
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    s = llm.engine.stats().spec_decode
    assert s.num_drafts > 0, s
    if name == "eagle-distilled":
        assert s.num_accepted_tokens > 0, s
    assert_all_blocks_free(llm)
    ref: Any = RefHead(heads[name], target) if name == "eagle3" else RefMTP(path) if name == "mtp-glm" else None
    if ref is not None:
        assert len(seen) >= 4
        for seq, drafted in seen[:: max(1, len(seen) // 4)]:
            assert drafted == ref.proposals(seq, len(drafted))[: len(drafted)], f"sequence of {len(seq)} tokens"
