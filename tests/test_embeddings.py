"""Task embed, offline: `LLM.embed` equals transformers' final hidden states (after the final
norm) pooled last / mean / cls and L2-normalised, for a batch of prompts of different lengths
(text and token ids), across block boundaries and with chunked prefill; no KV block
stays in use afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from portside import LLM, SamplingParams
from portside.config import PoolerConfig

WORDS = ("the quick brown fox jumps over the lazy dog while a small cat sleeps in the warm sun "
         "and the river runs to the sea under a bright sky full of birds").split()
LENGTHS = [1, 3, 4, 5, 9, 17, 31]  # with block size 4: inside one block, at its edge and across several


@torch.no_grad()
def hf_embedding(path: Path, ids: list[int], pooling: str) -> torch.Tensor:
    """transformers' last hidden state (its final norm applied) pooled and L2-normalised, fp32."""
    from portside.testing.tiny import hf_model

    hidden = hf_model(path)(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].float()
    vec = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling]
    return torch.nn.functional.normalize(vec, dim=0)


def prompts_of(llm: LLM, lengths: list[int]) -> list[list[int]]:
    base = llm.get_tokenizer().encode(" ".join(WORDS * 4))
    return [base[2 * i :][:n] for i, n in enumerate(lengths)]


def assert_matches(path: Path, prompts: list[list[int]], outs, pooling: str) -> None:
    assert len(outs) == len(prompts)
    for ids, out in zip(prompts, outs):
        assert out.prompt_token_ids == ids
        got = torch.tensor(out.outputs.embedding)
        want = hf_embedding(path, ids, pooling)
        assert got.shape == want.shape
        note = f"{len(ids)} tokens, {pooling}"
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=lambda m, note=note: f"{note}: {m}")


def assert_idle(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_used_blocks == 0, f"{stats.num_used_blocks} KV blocks still in use"
    llm.engine.scheduler.check_integrity()


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_embed_matches_transformers(tiny_llama: Path, pooling: str) -> None:
    with LLM(model=str(tiny_llama), device="cpu", max_model_len=64, block_size=4, task="embed", pooling_type=pooling) as llm:
        prompts = prompts_of(llm, LENGTHS)
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        assert_matches(tiny_llama, prompts, outs, pooling)
        assert_idle(llm)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_embed_chunked_prefill(tiny_llama: Path, pooling: str) -> None:
    """A 7-token budget splits every longer prompt over several steps (and batches the start of
    one prompt with the end of another); the pool holds just one max_model_len request."""
    with LLM(model=str(tiny_llama), device="cpu", max_model_len=64, block_size=4, num_kv_blocks=16,
             max_num_batched_tokens=7, task="embed", pooling_type=pooling) as llm:
        prompts = prompts_of(llm, [*LENGTHS, 40, 33, 29])
        outs = llm.embed(prompts, use_tqdm=False)
        assert_matches(tiny_llama, prompts, outs, pooling)
        assert_idle(llm)


def test_embed_text_prompts_and_truncation(tiny_llama: Path) -> None:
    with LLM(model=str(tiny_llama), device="cpu", max_model_len=32, block_size=4, task="embed") as llm:
        tok = llm.get_tokenizer()
        texts = ["the quick brown fox", "a small cat sleeps in the warm sun and the river runs to the sea"]
        outs = llm.embed(texts, use_tqdm=False)
        assert_matches(tiny_llama, [tok.encode(t) for t in texts], outs, "last")
        long_ids = prompts_of(llm, [60])[0]
        (cut,) = llm.embed([long_ids], truncate_prompt_tokens=10, use_tqdm=False)
        assert cut.prompt_token_ids == long_ids[-10:]
        (full,) = llm.embed([long_ids[:32]], use_tqdm=False)  # a prompt of max_model_len tokens is fine
        assert len(full.outputs.embedding) == len(outs[0].outputs.embedding)
        with pytest.raises(ValueError, match="more than max_model_len 32"):
            llm.embed([long_ids[:33]], use_tqdm=False)
        assert_idle(llm)


def test_task_and_api_disagree(tiny_llama: Path) -> None:
    with LLM(model=str(tiny_llama), device="cpu", max_model_len=32, task="embed") as llm:
        assert not llm.engine.config.cache.enable_prefix_caching  # pooling reads every prompt token
        with pytest.raises(ValueError, match="use LLM.embed"):
            llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
        with pytest.raises(ValueError, match="n and structured outputs"):
            llm.engine.add_request("x", "hello", SamplingParams(n=2))
    with LLM(model=str(tiny_llama), device="cpu", max_model_len=32) as llm:
        with pytest.raises(ValueError, match="task='embed'"):
            llm.embed(["hello"], use_tqdm=False)


def test_pooling_config_errors(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="unknown pooling type"):
        PoolerConfig("sum")
    with pytest.raises(ValueError, match="unknown task"):
        LLM(model=str(tiny_llama), device="cpu", task="rank")
    with pytest.raises(ValueError, match="has no classifier"):
        LLM(model=str(tiny_llama), device="cpu", task="classify")
    with pytest.raises(ValueError, match="--runner pooling"):
        LLM(model=str(tiny_llama), device="cpu", task="generate", pooling_type="mean")


def test_runner_pooling_spelling(tiny_llama: Path) -> None:
    """vLLM's current spelling, `--runner pooling`, is task embed for a causal LM."""
    import argparse

    from portside.engine.args import EngineArgs
    from portside.engine.args_cli import add_engine_args, engine_kwargs
    from portside.platform import resolve_platform

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for flags in (["--runner", "pooling"], ["--task", "embed"]):
        args = EngineArgs(model=str(tiny_llama), **engine_kwargs(parser.parse_args([*flags, "--pooling-type", "MEAN"])))
        config = args.create_engine_config(resolve_platform("cpu"))
        pooler = config.model.pooler
        assert config.model.task == "embed" and pooler is not None
        assert (pooler.task, pooler.pooling_type, pooler.normalize, pooler.output_size) == ("embed", "mean", True, 64)
