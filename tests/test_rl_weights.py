"""Weight updates in place, collective_rpc, sleep and wake-up (issue 50), on the cpu backend with
tiny random Llama checkpoints: after an update from a second checkpoint, greedy tokens equal
transformers' on that checkpoint; a bad update changes nothing; the prefix cache is reset; a
sleep at level 1 gives identical outputs after waking and returns the weights' memory to the OS;
level 2 needs an update before generating; and the same through worker processes (TP 2, PP 2)."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from portside import LLM, SamplingParams
from portside.engine.rl_engine import EngineAsleepError
from portside.testing.tiny import hf_greedy, make_tiny_model

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE = dict(device="cpu", max_model_len=128, block_size=4, num_kv_blocks=96)
PROMPTS = [[5, 9, 23, 41, 7], [8, 99, 3, 17, 60, 61, 62, 63, 64, 65, 66, 67, 68], list(range(30, 48))]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    a = make_tiny_model(root / "a", seed=0)
    b = make_tiny_model(root / "b", seed=1)
    return a, b


def greedy(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def oracle(path, prompts=PROMPTS) -> list[list[int]]:
    return [hf_greedy(path, p, MAX_TOKENS) for p in prompts]


def test_update_from_path_then_tensors(ckpts):
    a, b = ckpts
    with LLM(str(a), **ENGINE) as llm:
        assert greedy(llm) == oracle(a)
        assert llm.update_weights_from_path(b) == len(load_file(str(b / "model.safetensors")))
        assert greedy(llm) == oracle(b)
        # back to the first checkpoint as (HF name, tensor) pairs, as a trainer sends them
        llm.update_weights(load_file(str(a / "model.safetensors")).items())
        assert greedy(llm) == oracle(a)


def test_bad_updates_change_nothing(ckpts):
    a, b = ckpts
    sd_b = load_file(str(b / "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj.weight"
    with LLM(str(a), **ENGINE) as llm:
        want = greedy(llm)
        cases = {
            "has no place": [("model.layers.0.self_attn.nope.weight", torch.zeros(3))],
            "rows, expected": [(q, sd_b[q][:3])],
            "dtype torch.float64": [(q, sd_b[q].double())],
            "dtype torch.int64": [("model.norm.weight", torch.ones(64, dtype=torch.int64))],
            "parameter name, tensor. pair, got .str.": [(q,)],
            # every good tensor of the second checkpoint, then one bad one: none is applied
            "up_proj": [*sd_b.items(), ("model.layers.1.mlp.up_proj.weight", torch.zeros(2, 2))],
        }
        for message, weights in cases.items():
            with pytest.raises(ValueError, match=message):
                llm.update_weights(weights)
        with pytest.raises(ValueError, match="not a folder"):
            llm.update_weights_from_path(a / "missing")
        assert greedy(llm) == want


def test_prefix_cache_is_not_reused_after_an_update(ckpts):
    a, b = ckpts
    prompt = [list(range(100, 124))]  # 6 full blocks
    with LLM(str(a), **ENGINE) as llm:
        greedy(llm, prompt)
        again = llm.generate([{"prompt_token_ids": prompt[0]}], GREEDY, use_tqdm=False)[0]
        assert again.num_cached_tokens >= 20  # cached before the update
        llm.update_weights_from_path(b)
        after = llm.generate([{"prompt_token_ids": prompt[0]}], GREEDY, use_tqdm=False)[0]
        assert after.num_cached_tokens == 0
        assert list(after.outputs[0].token_ids) == oracle(b, prompt)[0]
        assert llm.reset_prefix_cache() is True


def test_collective_rpc(ckpts):
    a, b = ckpts
    with LLM(str(a), **ENGINE) as llm:
        [n] = llm.collective_rpc(lambda runner, k: runner.vocab_size + k, args=(1,))
        assert n == llm.engine.vocab_size + 1
        with pytest.raises(ValueError, match="no public method 'nope'"):
            llm.collective_rpc("nope")
        with pytest.raises(ValueError, match="call LLM.sleep"):  # the engine tracks sleeping itself
            llm.collective_rpc("sleep", args=(1,))
        prompt = list(range(100, 124))
        greedy(llm, [prompt])
        llm.collective_rpc("update_weights_from_path", args=(str(b),))  # an update by name resets the prefix cache
        after = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
        assert after.num_cached_tokens == 0
        assert list(after.outputs[0].token_ids) == oracle(b, [prompt])[0]


def test_quantized_model_refused(ckpts, tmp_path):
    from portside.testing.quant_checkpoints import write_quantized

    a, _ = ckpts
    qdir, _ = write_quantized(a, tmp_path / "gptq", "gptq")
    with LLM(str(qdir), **ENGINE) as llm:
        want = greedy(llm)
        with pytest.raises(ValueError, match="is quantized"):
            llm.update_weights([("model.norm.weight", torch.ones(64))])
        assert greedy(llm) == want


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_sleep_level1_wakes_identical_and_frees_memory(tmp_path):
    path = make_tiny_model(tmp_path / "m", hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=4, head_dim=64)
    with LLM(str(path), **ENGINE) as llm:
        want = greedy(llm)
        weight_bytes = llm.engine.weight_bytes
        before = rss()
        llm.sleep(1)
        assert llm.is_sleeping()
        assert before - rss() >= 0.8 * weight_bytes  # the weights' pages went back to the OS
        with pytest.raises(EngineAsleepError, match="asleep"):
            greedy(llm)
        with pytest.raises(ValueError, match="weights are asleep"):
            llm.update_weights_from_path(path)
        llm.wake_up(["kv_cache"])
        assert llm.is_sleeping()
        llm.wake_up(["weights"])
        assert not llm.is_sleeping()
        assert greedy(llm) == want
        with pytest.raises(ValueError, match="tags"):
            llm.wake_up(["gpu"])
        with pytest.raises(ValueError, match="level"):
            llm.sleep(3)


def test_sleep_level2_needs_an_update(ckpts):
    a, b = ckpts
    with LLM(str(a), **ENGINE) as llm:
        llm.sleep(2)
        llm.wake_up()
        with pytest.raises(EngineAsleepError, match="level-2"):
            greedy(llm)
        llm.update_weights_from_path(b)
        assert greedy(llm) == oracle(b)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_update_and_sleep_through_workers(ckpts, parallel):
    a, b = ckpts
    with LLM(str(a), **ENGINE, **parallel) as llm:
        assert greedy(llm) == oracle(a)
        llm.update_weights(load_file(str(b / "model.safetensors")).items())
        assert greedy(llm) == oracle(b)
        with pytest.raises(ValueError, match="has no place"):  # raised on the ranks, which go on
            llm.update_weights([("model.layers.0.self_attn.nope.weight", torch.zeros(3))])
        assert llm.collective_rpc("update_weights_from_path", args=(str(a),)) == [len(load_file(str(a / "model.safetensors")))] * 2
        llm.reset_prefix_cache()
        assert greedy(llm) == oracle(a)
        llm.sleep(1)
        llm.wake_up()
        assert greedy(llm) == oracle(a)
