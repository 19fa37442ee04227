"""Multi-token prediction (`speculative_config={"method": "mtp"}`) on GLM-4.5 (`Glm4MoeForCausalLM`):
the MTP layer GLM-4.5 ships as ``model.layers.{num_hidden_layers}.*`` (eh_proj, enorm, hnorm,
shared_head.norm / shared_head.head and a decoder layer of the target's kind: q/k norms, q/k/v
biases, partial rotary, experts), written by `portside.testing.tiny_glm4_moe` with transformers'
own `Glm4MoeConfig` / `Glm4MoeForCausalLM` for the target.

- greedy tokens equal transformers', batched and alone, with chunked prefill and a forced
  preemption; every block freed;
- every sampled proposal equals a reference MTP layer built from transformers'
  `Glm4MoeDecoderLayer` with the checkpoint's MTP tensors, run over the whole sequence from
  transformers' hidden states (its logits from the checkpoint's own ``shared_head.head``);
- an MTP layer that does not fit the target (hidden size, vocabulary, layer index, a missing
  tensor) exits 2 naming the mismatch.

(DeepSeek-V3's MTP layer: tests/test_spec_decode_eagle.py.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from portside import LLM, SamplingParams
from portside.spec_decode.eagle import EagleProposer
from portside.spec_decode.mtp import MTPHead
from portside.testing.engine_parity import assert_all_blocks_free, assert_greedy_parity, random_prompts
from portside.testing.tiny import hf_model
from portside.testing.tiny_glm4_moe import make_tiny_glm4_moe

N = 12  # tokens generated per prompt
MTP = {"method": "mtp", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_glm4_moe(tmp_path_factory.mktemp("glm_mtp"))


def _greedy(llm: LLM, prompts: list[list[int]], n: int = N) -> list[Any]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class RefMTP:
    """GLM-4.5's MTP layer as vLLM runs it, over a whole sequence with no cache: transformers'
    decoder layer for the block, the checkpoint's eh_proj / norms / shared_head."""

    def __init__(self, path: Path) -> None:
        from safetensors.torch import load_file
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer

        self.hf = hf_model(path)
        cfg = self.hf.config
        prefix = f"model.layers.{cfg.num_hidden_layers}."
        state = load_file(str(next(path.glob("*.safetensors"))))
        self.w = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
        self.block = Glm4MoeDecoderLayer(cfg, cfg.num_hidden_layers).eval()
        own = ("eh_proj.", "enorm.", "hnorm.", "shared_head.", "embed_tokens.", "mlp.experts.")
        block = {k: v for k, v in self.w.items() if not k.startswith(own)}
        experts = range(cfg.n_routed_experts)  # the published per-expert tensors, fused as transformers keeps them
        block["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([self.w[f"mlp.experts.{e}.gate_proj.weight"], self.w[f"mlp.experts.{e}.up_proj.weight"]]) for e in experts])
        block["mlp.experts.down_proj"] = torch.stack([self.w[f"mlp.experts.{e}.down_proj.weight"] for e in experts])
        self.block.load_state_dict(block, strict=True)
        self.eps = cfg.rms_norm_eps

    @torch.no_grad()
    def proposals(self, seq: list[int], k: int) -> list[int]:
        hid = self.hf(torch.tensor([seq[:-1]]), output_hidden_states=True).hidden_states[-1][0]  # final, normed
        tokens, pos = list(seq[1:]), list(range(len(seq) - 1))
        drafted: list[int] = []
        for _ in range(k):
            out, nxt = self.layer(torch.tensor(tokens), torch.tensor(pos), hid)
            t = int((out[-1] @ self.w["shared_head.head.weight"].T).argmax())
            drafted.append(t)
            tokens, pos, hid = tokens + [t], pos + [pos[-1] + 1], torch.cat([hid, nxt[-1:]])
        return drafted

    def layer(self, ids: torch.Tensor, pos: torch.Tensor, hid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w, eps = self.w, self.eps
        emb = self.hf.model.embed_tokens(ids).masked_fill((pos == 0)[:, None], 0)
        x = torch.cat([_rms(emb, w["enorm.weight"], eps), _rms(hid, w["hnorm.weight"], eps)], -1) @ w["eh_proj.weight"].T
        rope = self.hf.model.rotary_emb(x[None], pos[None])
        h = self.block(x[None], attention_mask=None, position_ids=pos[None], position_embeddings=rope)[0]
        return _rms(h, w["shared_head.norm.weight"], eps), h


def test_greedy_equals_transformers_and_proposals_equal_the_reference(glm: Path, monkeypatch) -> None:
    """Five prompts batched with a 16-token budget (prompts prefilled in chunks, the MTP layer
    catching up in the same steps), then the longest alone; proposals checked against `RefMTP`."""
    seen: list[tuple[list[int], list[int]]] = []
    propose = EagleProposer.propose

    def spy(self, states):
        out = propose(self, states)
        seen.extend((s.prompt_token_ids + s.output_token_ids, out[s.req_id]) for s in states if s.req_id in out)
        return out

    monkeypatch.setattr(EagleProposer, "propose", spy)
    llm = LLM(model=str(glm), device="cpu", max_model_len=128, block_size=4, max_num_batched_tokens=16,
              speculative_config=MTP)
    head = llm.engine.executor.runner.draft.head
    assert isinstance(head, MTPHead) and head.lm_head is not None  # the checkpoint's shared_head.head, its own
    assert head.layer.self_attn.qk_norm == "head"
    prompts = random_prompts(0, [1, 4, 9, 17, 30])
    outs = _greedy(llm, prompts)
    assert_greedy_parity(glm, prompts, outs, N)
    (alone,) = _greedy(llm, prompts[-1:])
    assert alone.outputs[0].token_ids == outs[-1].outputs[0].token_ids
    assert llm.engine.stats().spec_decode.num_drafts > 0
    assert_all_blocks_free(llm)
    ref = RefMTP(glm)
    assert len(seen) > 10
    for seq, drafted in seen[:: max(1, len(seen) // 8)]:
        assert drafted == ref.proposals(seq, len(drafted)), f"sequence of {len(seq)} tokens"
    llm.shutdown()


def test_chunked_prefill_and_preemption(glm: Path) -> None:
    """A 10-token budget and 24 blocks of 4 tokens for five sequences of ~40: prompts split across
    steps and some requests preempted and recomputed; tokens stay transformers'."""
    llm = LLM(model=str(glm), device="cpu", max_model_len=64, block_size=4, num_kv_blocks=24,
              max_num_batched_tokens=10, speculative_config={**MTP, "num_speculative_tokens": 2})
    prompts = random_prompts(1, [23, 11, 19, 25, 14])
    outs = _greedy(llm, prompts, 16)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_decode.num_drafts > 0
    assert_greedy_parity(glm, prompts, outs, 16)
    assert_all_blocks_free(llm)


def _edited(src: Path, dst: Path, edit) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    f = next(dst.glob("*.safetensors"))
    state = load_file(str(f))
    edit(state)
    save_file(state, str(f), metadata={"format": "pt"})
    return dst


def test_an_mtp_layer_that_does_not_fit_exits_2_naming_the_mismatch(glm: Path, tmp_path: Path, capsys) -> None:
    from portside.cli import main

    mtp = "model.layers.3."

    def drop_layer(s: dict) -> None:
        for k in [k for k in s if k.startswith(mtp)]:
            del s[k]

    def move_layer(s: dict) -> None:  # written at index 4 (past num_hidden_layers + num_nextn_predict_layers)
        for k in [k for k in s if k.startswith(mtp)]:
            s[k.replace(mtp, "model.layers.4.")] = s.pop(k)

    cases = {
        "hidden": (lambda s: s.__setitem__(mtp + "eh_proj.weight", torch.zeros(64, 96)),
                   "MTP tensor 'model.layers.3.eh_proj.weight' (64, 96) does not fit"),
        "vocab": (lambda s: s.__setitem__(mtp + "shared_head.head.weight", torch.zeros(300, 64)),
                  "shared_head.head.weight (300, 64) does not fit the target's LM head (vocabulary"),
        "missing": (lambda s: s.pop(mtp + "hnorm.weight"), "model.layers.3.* is missing 1 tensors, e.g. ['hnorm.weight']"),
        "no layer": (drop_layer, "Glm4MoeForCausalLM has none here (num_nextn_predict_layers 1)"),
        "layer index": (move_layer, "has no place in Glm4MoeForCausalLM: layer 4 is past its 3 layers and 1 "
                                    "multi-token-prediction layers"),
    }
    spec = json.dumps(MTP)
    for name, (edit, message) in cases.items():
        bad = _edited(glm, tmp_path / name.replace(" ", "_"), edit)
        rc = main(["generate", "hi", "--model", str(bad), "--device", "cpu", "--max-tokens", "2",
                   "--speculative-config", spec])
        err = capsys.readouterr().err
        assert rc == 2 and message in err, (name, err[-2000:])
