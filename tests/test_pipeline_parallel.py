"""Pipeline parallelism (`pipeline_parallel_size`): the layer split, greedy and seeded tokens equal
to PP = 1 and transformers with PP = 2, 3 and TP = 2 x PP = 2 (batched, block boundaries, chunked
prefill, preemption, prefix-cache hits), a killed stage worker failing fast, and the refusals."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from test_tensor_parallel import alive, spawned_workers, wait_gone

from portside import LLM, SamplingParams
from portside.model.pipeline import pipeline_stages
from portside.testing.tiny import hf_greedy, make_tiny_model

ENGINE = {"device": "cpu", "max_model_len": 96, "block_size": 4}
TEXT = "the quick brown fox jumps over the lazy dog while a small cat sleeps in the warm sun " * 3


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:  # 3 layers: an uneven split; tied embeddings: the last stage's head
    return make_tiny_model(tmp_path_factory.mktemp("pp"), "llama", num_hidden_layers=3, tie_word_embeddings=True)


def prompts(llm: LLM, lengths=(5, 9, 13, 3, 21, 30)) -> list[list[int]]:
    ids = llm.get_tokenizer().encode(TEXT)
    return [ids[i : i + n] for i, n in enumerate(lengths)]


def test_stage_split():
    assert [(s.start, s.end) for s in pipeline_stages(7, 3)] == [(0, 3), (3, 5), (5, 7)]
    assert [(s.start, s.end) for s in pipeline_stages(4, 2, (1, 3))] == [(0, 1), (1, 4)]
    stages = pipeline_stages(5, 2)
    assert (stages[0].is_first, stages[0].is_last, stages[1].is_first, stages[1].is_last) == (True, False, False, True)
    with pytest.raises(ValueError, match="exceeds the model's 2 decoder layers"):
        pipeline_stages(2, 3)
    with pytest.raises(ValueError, match="summing to the model's 4 decoder layers"):
        pipeline_stages(4, 2, (1, 2))


def test_stage_models_hold_only_their_layers(model):
    import torch

    from portside.config import ModelConfig
    from portside.model.registry import load_model

    cfg = ModelConfig(path=str(model))
    first, last = (load_model(cfg, torch.device("cpu"), pp_rank=r, pp_size=2) for r in (0, 1))
    assert (first.num_layers, last.num_layers) == (2, 1)
    assert first.kv_cache_spec().num_layers == 2 and last.kv_cache_spec().num_layers == 1
    assert first.lm_head is None and first.model.norm is None and last.model.embed_tokens is None
    names = {n for n, _ in last.named_parameters()}
    assert "lm_head.weight" in names and not any(n.startswith(("model.layers.0.", "model.layers.1.")) for n in names)
    full = load_model(cfg, torch.device("cpu"))
    assert torch.equal(last.lm_head.weight, full.model.embed_tokens.weight)  # the tied head, loaded from the embedding
    # the cpu backend runs a stage with its eager runner's linears, never in the fused whole-model step
    from portside.backends.cpu.fused_decode import unsupported_reason
    from portside.backends.cpu.graph import EagerGraphRunner, InductorGraphRunner

    assert EagerGraphRunner.supports_pipeline_stages and not InductorGraphRunner.supports_pipeline_stages
    assert "pipeline-parallel stage" in (unsupported_reason(first) or "")
    ids = torch.tensor([3, 5, 7])
    h, _ = last.embed(ids, torch.arange(3))
    assert torch.equal(h, torch.zeros(3, 64))  # no stage input (a warm-up on dummy inputs): zeros
    given = torch.ones(3, 64)  # the previous stage's output (`ForwardContext.inputs_embeds`)
    assert torch.equal(last.embed(ids, torch.arange(3), given)[0], given)
    assert not hasattr(last, "stage_input")  # the stage's input is an argument, never state on the model


@pytest.mark.slow  # spawns the stage workers: CI's legs run it
@pytest.mark.parametrize(("tp", "pp", "layers", "micro", "micro_tokens"),
                         [(1, 2, None, None, None), (1, 2, None, 1, None), (1, 3, None, None, 3), (2, 2, "1,2", None, None)],
                         ids=["pp2", "pp2-one-batch-in-flight", "pp3-micro-batches-of-3-tokens", "tp2xpp2-layers-1-2"])
def test_greedy_and_seeded_tokens_equal_pp1_and_transformers(model, tp, pp, layers, micro, micro_tokens):
    """Chunked prefill (a 16-token budget), a pool small enough to preempt, then the same prompts
    again (prefix-cache hits), greedy and seeded sampling, against PP = 1 and transformers; with
    micro-batches in flight (one per stage, the default) and without, and micro-batches capped
    below budget / P (--pipeline-micro-batch-tokens)."""
    kwargs = ENGINE | {"max_num_batched_tokens": 16, "num_kv_blocks": 40, "max_num_seqs": 6}
    llm = LLM(model=str(model), tensor_parallel_size=tp, pipeline_parallel_size=pp, pipeline_layers=layers,
              pipeline_micro_batches=micro, pipeline_micro_batch_tokens=micro_tokens, **kwargs)
    assert llm.engine.max_in_flight == (micro or pp)
    assert llm.engine.scheduler.micro_batch_tokens == (micro_tokens or 256)  # the flag, else the cpu platform's cap
    pids = llm.engine.executor.pids
    try:
        assert len(pids) == tp * pp
        ps = prompts(llm)
        greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        for round_ in range(2):
            outs = llm.generate([{"prompt_token_ids": p} for p in ps], greedy, use_tqdm=False)
            for p, o in zip(ps, outs):
                assert o.outputs[0].token_ids == hf_greedy(model, p, 24), f"round {round_}, prompt of {len(p)} tokens"
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.num_used_blocks == 0
        seeded = [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=16, seed=7 + i, logprobs=1) for i in range(len(ps))]
        got = llm.generate([{"prompt_token_ids": p} for p in ps], seeded, use_tqdm=False)
    finally:
        llm.shutdown()
    assert wait_gone(pids) == [], "stage workers outlived shutdown()"
    plain = LLM(model=str(model), **kwargs)
    want = plain.generate([{"prompt_token_ids": p} for p in ps], seeded, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].cumulative_logprob == pytest.approx(w.outputs[0].cumulative_logprob, abs=1e-3)


@pytest.mark.slow
def test_killed_stage_worker_fails_fast_with_clear_error(model):
    llm = LLM(model=str(model), pipeline_parallel_size=2, **ENGINE)
    pids = llm.engine.executor.pids
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    for i, p in enumerate(prompts(llm)[:3]):
        llm.engine.add_request(str(i), {"prompt_token_ids": p}, params)
    for _ in range(3):
        llm.engine.step()
    os.kill(pids[0], signal.SIGKILL)  # the first stage: the last one then waits for its hidden states
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 0 \(pid \d+\) was killed by SIGKILL"):
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    assert time.monotonic() - start < 10, "the engine took too long to notice"
    assert wait_gone(pids) == [] and not spawned_workers() & set(pids)
    assert not any(alive(p) for p in pids)
    with pytest.raises(RuntimeError, match="rank 0"):  # later steps fail the same way at once, never idle
        llm.engine.step()
    llm.engine.shutdown()


def test_refusals(model, capsys):
    from portside.cli import main

    with pytest.raises(ValueError, match="pipeline_layers needs 2 positive layer counts"):
        LLM(model=str(model), pipeline_parallel_size=2, pipeline_layers="3", **ENGINE)
    with pytest.raises(ValueError, match="summing to the model's 3 decoder layers"):
        LLM(model=str(model), pipeline_parallel_size=2, pipeline_layers=[1, 1], **ENGINE)
    with pytest.raises(ValueError, match="exceeds the model's 3 decoder layers"):
        LLM(model=str(model), pipeline_parallel_size=4, **ENGINE)
    with pytest.raises(ValueError, match="LoRA adapters with pipeline parallelism are not supported"):
        LLM(model=str(model), pipeline_parallel_size=2, enable_lora=True, **ENGINE)
    with pytest.raises(ValueError, match="draft-model speculative decoding with pipeline parallelism"):
        LLM(model=str(model), pipeline_parallel_size=2, speculative_config={"model": str(model), "num_speculative_tokens": 2},
            **ENGINE)
    assert main(["generate", "hi", "--model", str(model), "--device", "cpu", "-pp", "0"]) == 2
    assert "pipeline_parallel_size must be an integer of at least 1" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", str(model), "--device", "cpu", "-pp", "2", "--pipeline-layers", "1,x"]) == 2
    assert "pipeline_layers must be comma-separated" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", str(model), "--device", "cpu", "-pp", "2",
                 "--pipeline-micro-batch-tokens", "0"]) == 2
    assert "pipeline_micro_batch_tokens must be an integer of at least 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="pipeline_micro_batch_tokens applies to pipeline parallelism"):
        LLM(model=str(model), pipeline_micro_batch_tokens=64, **ENGINE)
    with pytest.raises(ValueError, match="it needs chunked prefill"):
        LLM(model=str(model), pipeline_parallel_size=2, pipeline_micro_batch_tokens=64, enable_chunked_prefill=False,
            **ENGINE)


@pytest.mark.slow
def test_embeddings_and_prompt_logprobs_equal_pp1(model):
    """The last stage pools (task embed) and computes prompt logprobs as PP 1 does, over chunks."""
    import torch

    kwargs = ENGINE | {"max_num_batched_tokens": 8}
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    results = {}
    for pp in (1, 2):
        llm = LLM(model=str(model), pipeline_parallel_size=pp, **kwargs)
        ps = prompts(llm, lengths=(5, 13, 21))
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        llm.shutdown()
        embedder = LLM(model=str(model), pipeline_parallel_size=pp, task="embed", pooling_type="mean", **kwargs)
        vectors = [o.outputs.embedding for o in embedder.embed([{"prompt_token_ids": p} for p in ps], use_tqdm=False)]
        embedder.shutdown()
        results[pp] = ([o.prompt_logprobs for o in outs], vectors)
    for got, want in zip(results[2][0], results[1][0], strict=True):
        assert got[0] is None and len(got) == len(want)
        for g, w in zip(got[1:], want[1:]):
            assert g.keys() == w.keys() and all(g[t].logprob == pytest.approx(w[t].logprob, abs=1e-4) for t in g)
    for got, want in zip(results[2][1], results[1][1], strict=True):
        assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-5)
