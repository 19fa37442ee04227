"""The weight-update group (issue 50): a trainer in another process broadcasts a second
checkpoint's tensors over gloo to the engine, whose greedy tokens then equal transformers' on
that checkpoint; an update the engine refuses (a wrong shape) raises on both sides, with nothing
sent and the model unchanged. Also under TP 2 (slow): each worker is a member and keeps its shard."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from safetensors.torch import load_file

from portside import LLM, SamplingParams
from portside.distributed.env import free_port
from portside.testing.tiny import hf_greedy, make_tiny_model

PROMPT = [5, 9, 23, 41, 7, 8, 99, 3, 17]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE = dict(device="cpu", max_model_len=128, block_size=4, num_kv_blocks=64)

TRAINER = textwrap.dedent("""
    import sys
    import torch
    from safetensors.torch import load_file
    from portside.distributed.weight_transfer import WeightTransferGroup

    port, world, ckpt = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    group = WeightTransferGroup("127.0.0.1", port, 0, world)
    weights = load_file(ckpt)
    try:
        group.send([("model.norm.weight", torch.ones(3))])
    except ValueError as e:
        print("refused:", e, flush=True)
    print("sent", group.send(weights.items()), flush=True)
    group.close()
""")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("wt")
    return make_tiny_model(root / "a", seed=0), make_tiny_model(root / "b", seed=1)


def tokens(llm: LLM) -> list[int]:
    return list(llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def run(ckpts, **parallel) -> None:
    a, b = ckpts
    with LLM(str(a), **ENGINE, **parallel) as llm:
        before = tokens(llm)
        world = 1 + parallel.get("tensor_parallel_size", 1)
        port = free_port()
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(port), str(world), str(b / "model.safetensors")],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            llm.init_weight_transfer("127.0.0.1", port, world)
            with pytest.raises(ValueError, match="model.norm.weight"):
                llm.receive_weights()
            assert tokens(llm) == before  # refused: unchanged
            assert llm.receive_weights() == len(load_file(str(b / "model.safetensors")))
            llm.close_weight_transfer()  # with the trainer's close
            out, _ = trainer.communicate(timeout=120)
        finally:
            trainer.kill()
        assert trainer.returncode == 0, repr(out)
        assert "refused: the engine refused the weight update: rank 1: checkpoint tensor 'model.norm.weight'" in out, out
        assert "sent" in out, out
        assert tokens(llm) == hf_greedy(b, PROMPT, 8)


def test_trainer_broadcasts_weights(ckpts):
    run(ckpts)


@pytest.mark.slow
def test_trainer_broadcasts_weights_tp2(ckpts):
    run(ckpts, tensor_parallel_size=2)


def test_group_arguments_checked():
    from portside.distributed.weight_transfer import WeightTransferGroup

    with pytest.raises(ValueError, match="world_size"):
        WeightTransferGroup("127.0.0.1", free_port(), 0, 1)
