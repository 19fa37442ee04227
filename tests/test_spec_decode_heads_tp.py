"""EAGLE, EAGLE-3 and MTP heads under tensor parallelism (the head's attention heads, MLP or
experts and vocabulary split as the target's layers are), and their refusal under pipeline
parallelism.

- the head alone on two ranks (threads over real collectives): a prompt row block and a chained
  decode row through its paged one-layer cache give the single rank's hidden states and the same
  draft tokens (an EAGLE-3 head's draft vocabulary, GLM-4.5's MTP layer with its experts and own
  ``shared_head.head``);
- end to end on two worker processes over gloo (cpu backend): greedy tokens equal transformers'
  for EAGLE, EAGLE-3 and MTP; the distilled EAGLE head's per-position acceptance equals the
  single rank's (the same proposals);
- ``--pipeline-parallel-size 2`` with a head exits 2 naming the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import test_spec_decode_eagle as eagle_tests
import torch
from test_models import run_ranks
from test_spec_decode_eagle import greedy, make_llm

from portside import LLM
from portside.attention.reference import ReferenceAttentionBackend
from portside.config import ModelConfig
from portside.contract import Communicator, ForwardContext
from portside.model.eagle import EagleHead, EagleHeadConfig
from portside.model.registry import load_model
from portside.runner.kv_cache import layer_cache_shape
from portside.spec_decode.mtp import MTPHead
from portside.testing.paged import single_sequence_metadata
from portside.testing.tiny import hf_greedy
from portside.testing.tiny_glm4_moe import make_tiny_glm4_moe

BLOCK, BLOCKS = 4, 16
# the EAGLE tests' module fixtures: the Llama target, its prompts and greedy tokens, the heads
target, ps, want, heads = eagle_tests.target, eagle_tests.ps, eagle_tests.want, eagle_tests.heads


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_glm4_moe(tmp_path_factory.mktemp("glm_mtp_tp"), seed=3)


def _run_head(method: str, target_path: Path, head_path: Path | None, comm: Communicator, rank: int,
              size: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The head over 9 prompt rows, then one chained decode row: (hidden for the logits [10, h],
    draft tokens [10])."""
    model = load_model(ModelConfig(path=str(target_path), max_model_len=128), torch.device("cpu"), comm, rank, size)
    head: Any
    if method == "mtp":
        head = MTPHead(model)
    else:
        assert head_path is not None
        hf = json.loads((target_path / "config.json").read_text())
        head = EagleHead(EagleHeadConfig.read(str(head_path), method, hf, 128), model.tp, model.dtype)
        head.load(model)
    backend = ReferenceAttentionBackend()
    cache = [torch.zeros(layer_cache_shape(backend, head.kv_cache_spec(), BLOCKS, BLOCK))]
    gen = torch.Generator().manual_seed(0)
    T, width = 9, model.config.hidden_size * (3 if method == "eagle3" else 1)
    ids, hidden = torch.randint(3, 300, (T,), generator=gen), torch.randn(T, width, generator=gen)
    table = [(5 * i + 3) % BLOCKS for i in range(BLOCKS)]
    outs, tokens = [], []
    with torch.no_grad():
        rows = head.combine(hidden) if method == "eagle3" else hidden
        for start in (0, T):  # the prompt's rows, then the first proposal's row (the head's own output as hidden)
            n = rows.shape[0]
            ctx = ForwardContext(backend, cache, backend.prepare(single_sequence_metadata(start, n, table, BLOCK)))
            out, nxt = head(ids, torch.arange(start, start + n), rows, ctx)
            outs.append(out)
            tokens.append(head.draft_tokens(out))
            ids, rows = tokens[-1][-1:], nxt[-1:]
    return torch.cat(outs), torch.cat(tokens)


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_the_head_on_two_ranks_equals_one(method: str, target: Path, heads: dict[str, Path], glm: Path) -> None:
    path, head = (glm, None) if method == "mtp" else (target, heads[method])
    (want_out, want_tokens), = run_ranks(1, lambda comm, r: _run_head(method, path, head, comm, r, 1))
    for out, tokens in run_ranks(2, lambda comm, r: _run_head(method, path, head, comm, r, 2)):
        torch.testing.assert_close(out, want_out, atol=1e-4, rtol=1e-4)
        assert tokens.tolist() == want_tokens.tolist()


@pytest.mark.slow  # two worker processes per engine (~15-30 s each on 2 cores): CI's legs run it
@pytest.mark.parametrize("name", ["eagle-distilled", "eagle3", "mtp"])
def test_tensor_parallel_2_greedy_equals_transformers(name: str, target: Path, heads: dict[str, Path], ps, want,
                                                      glm: Path) -> None:  # fmt: skip
    if name == "mtp":
        llm = LLM(model=str(glm), device="cpu", max_model_len=128, block_size=4, max_num_batched_tokens=16,
                  tensor_parallel_size=2, speculative_config={"method": "mtp", "num_speculative_tokens": 3})
        expected = {tuple(p): hf_greedy(glm, p, 12) for p in ps[:3]}
    else:
        llm = make_llm(target, heads[name], max_num_batched_tokens=16, tensor_parallel_size=2)
        expected = {tuple(p): want[tuple(p)][:12] for p in ps[:3]}
    try:
        for p, got in zip(ps[:3], greedy(llm, ps[:3], 12)):
            assert got == expected[tuple(p)], f"prompt of {len(p)} tokens"
        s = llm.engine.stats()
        assert s.spec_decode.num_drafts > 0 and s.num_used_blocks == 0
    finally:
        llm.shutdown()
    if name == "eagle-distilled":  # the same proposals as on one rank
        one = make_llm(target, heads[name], max_num_batched_tokens=16)
        greedy(one, ps[:3], 12)
        assert one.engine.stats().spec_decode == s.spec_decode
        assert s.spec_decode.num_accepted_tokens > 0


def test_pipeline_parallelism_is_refused_naming_the_fix(target: Path, heads: dict[str, Path], glm: Path,
                                                        capsys) -> None:  # fmt: skip
    from portside.cli import main

    for model, spec in ((target, {"method": "eagle3", "model": str(heads["eagle3"])}), (glm, {"method": "mtp"})):
        rc = main(["generate", "hi", "--model", str(model), "--device", "cpu", "--pipeline-parallel-size", "2",
                   "--speculative-config", json.dumps({**spec, "num_speculative_tokens": 2})])
        err = capsys.readouterr().err
        assert rc == 2, err
        assert f"method {spec['method']!r} with pipeline parallelism (pipeline_parallel_size 2) is not supported" in err
        assert "--tensor-parallel-size 2 --pipeline-parallel-size 1" in err
