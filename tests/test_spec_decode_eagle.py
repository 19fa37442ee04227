"""EAGLE and EAGLE-3 speculative decoding (`speculative_config={"method": "eagle3", "model": HEAD}`).

Heads are written in the published layouts (`portside.testing.eagle`): EAGLE-3 as yuhuili's
(``midlayer.*``, safetensors, a ``d2t`` draft vocabulary of the tokens the target emits) and as the
speculators' (``layers.0.*``, its own embedding), EAGLE-1 as ``pytorch_model.bin``; random weights
(their proposals are rejected), and an EAGLE-1 head distilled to the target's successor table
(`make_eagle_head(successors=...)`), whose proposals are accepted at every depth about half the time.

- greedy tokens equal transformers' (and so the run without speculation), batched, with
  chunked prefill, a preemption and prefix-cache hits; every block freed;
- every proposal equals an independent pure-torch reference of the head run over the whole
  sequence from transformers' hidden states (the head's paged KV and the bookkeeping of kept
  rows, catch-up and chaining exact);
- seeded sampling gives the plain run's tokens; unseeded sampling keeps the target's
  distribution (chi-square);
- a head whose hidden size, vocabulary or layer ids do not fit exits 2 naming the mismatch;
- a request under a regex is speculated (proposals cut by the grammar, each verify row masked);
- a LoRA adapter on the target; DeepSeek-V3's MTP layer (method "mtp") read from the target's
  checkpoint (`portside.testing.eagle.add_mtp_layer`).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from test_spec_decode import TEXT, assert_all_blocks_free, assert_chi_square_fits, structured_run

from portside import LLM, SamplingParams
from portside.backends.cpu.eager_linears import EagerLinears
from portside.spec_decode.config import SpeculativeConfig
from portside.spec_decode.eagle import EagleProposer
from portside.testing.eagle import make_eagle_head
from portside.testing.tiny import hf_greedy, hf_logits, make_tiny_model

AUX = [0, 2, 3]
N = 32  # tokens generated per prompt


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("eagle_target"), "llama", num_hidden_layers=4)


@pytest.fixture(scope="module")
def ps(target) -> list[list[int]]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(target)).encode(TEXT)
    return [ids[i : i + n] for i, n in enumerate((5, 13, 3, 21))]


@pytest.fixture(scope="module")
def want(target, ps) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): hf_greedy(target, p, N) for p in ps}


@pytest.fixture(scope="module")
def heads(target, ps, want, tmp_path_factory) -> dict[str, Path]:
    vocab = sorted({t for out in want.values() for t in out})
    pairs: dict[int, Counter] = {}
    for p in ps:
        seq = p + want[tuple(p)]
        for a, b in zip(seq, seq[1:]):
            pairs.setdefault(a, Counter())[b] += 1
    root = tmp_path_factory.mktemp("eagle_heads")
    return {"eagle-distilled": make_eagle_head(target, root / "e1d", "eagle",
                                               successors={a: c.most_common(1)[0][0] for a, c in pairs.items()}),
            "eagle3": make_eagle_head(target, root / "e3", "eagle3", draft_vocab=vocab, aux_layer_ids=AUX),
            "eagle3-speculators": make_eagle_head(target, root / "e3s", "eagle3", draft_vocab=vocab, aux_layer_ids=AUX,
                                                  layout="speculators", with_embed=True, seed=1),
            "eagle": make_eagle_head(target, root / "e1", "eagle", seed=2)}


def make_llm(target: Path, head: Path, k: int = 3, **kwargs) -> LLM:
    method = json.loads((head / "config.json").read_text()).get("draft_vocab_size") and "eagle3" or "eagle"
    kwargs = {"device": "cpu", "max_model_len": 128, "block_size": 4} | kwargs
    return LLM(model=str(target), speculative_config={"method": method, "model": str(head), "num_speculative_tokens": k},
               **kwargs)


def greedy(llm: LLM, ps: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)]


def test_config_parsing():
    c = SpeculativeConfig.parse({"method": "eagle3", "model": "/m/h", "num_speculative_tokens": 3})
    assert (c.method, c.model, c.num_lookahead_tokens) == ("eagle3", "/m/h", 3)
    with pytest.raises(ValueError, match="'eagle' needs 'model', the eagle head's folder"):
        SpeculativeConfig.parse({"method": "eagle", "num_speculative_tokens": 2})
    assert SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 2}).num_lookahead_tokens == 2
    with pytest.raises(ValueError, match="'mtp' takes no 'model'"):
        SpeculativeConfig.parse({"method": "mtp", "model": "/m/h", "num_speculative_tokens": 2})


# ---- an independent reference: the head over the whole sequence, no cache -----------------------

def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:  # [T, H, D]
    d = x.shape[-1]
    freqs = pos[:, None].double() / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = torch.cat([freqs.cos()] * 2, -1)[:, None].float(), torch.cat([freqs.sin()] * 2, -1)[:, None].float()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class RefHead:
    def __init__(self, head: Path, target: Path):
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        f = head / "model.safetensors"
        raw = load_file(str(f)) if f.exists() else torch.load(head / "pytorch_model.bin", weights_only=True)
        self.w = {k.replace("midlayer.", "").replace("layers.0.", ""): v for k, v in raw.items()}
        self.cfg = json.loads((head / "config.json").read_text())
        self.eagle3 = "d2t" in self.w
        self.hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
        self.embed = self.w.get("embed_tokens.weight", self.hf.model.embed_tokens.weight.detach())

    @torch.no_grad()
    def proposals(self, seq: list[int], k: int) -> list[int]:
        out = self.hf(torch.tensor([seq[:-1]]), output_hidden_states=True).hidden_states
        hid = torch.cat([out[i][0] for i in AUX], -1) @ self.w["fc.weight"].T if self.eagle3 else out[-1][0]
        tokens, pos = list(seq[1:]), list(range(len(seq) - 1))
        drafted: list[int] = []
        for _ in range(k):
            o, nxt = self.layer(torch.tensor(tokens), torch.tensor(pos), hid)
            if self.eagle3:
                best = int((o[-1] @ self.w["lm_head.weight"].T).argmax())
                t = best + int(self.w["d2t"][best])
            else:
                t = int(self.hf.lm_head(o[-1]).argmax())
            drafted.append(t)
            tokens, pos, hid = tokens + [t], pos + [pos[-1] + 1], torch.cat([hid, nxt[-1:]])
        return drafted

    def layer(self, ids: torch.Tensor, pos: torch.Tensor, hid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w, c = self.w, self.cfg
        emb = self.embed[ids]
        if self.eagle3:
            x, res = torch.cat([_rms(emb, w["input_layernorm.weight"]), _rms(hid, w["hidden_norm.weight"])], -1), hid
        else:
            x = res = torch.cat([emb, hid], -1) @ w["fc.weight"].T + w["fc.bias"]
        H, KVH = c["num_attention_heads"], c["num_key_value_heads"]
        D = c["hidden_size"] // H
        T = len(ids)
        q = _rope((x @ w["self_attn.q_proj.weight"].T).view(T, H, D), pos, c.get("rope_theta", 10000.0))
        kk = _rope((x @ w["self_attn.k_proj.weight"].T).view(T, KVH, D), pos, c.get("rope_theta", 10000.0))
        v = (x @ w["self_attn.v_proj.weight"].T).view(T, KVH, D)
        kk, v = kk.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1)
        att = torch.einsum("thd,shd->hts", q, kk) / D**0.5
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        h = res + torch.einsum("hts,shd->thd", att, v).reshape(T, H * D) @ w["self_attn.o_proj.weight"].T
        m = _rms(h, w["post_attention_layernorm.weight"])
        h = h + (torch.nn.functional.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)) \
            @ w["mlp.down_proj.weight"].T
        return (_rms(h, w["norm.weight"]) if self.eagle3 else h), h


@pytest.mark.parametrize("name", ["eagle3", "eagle3-speculators", "eagle", "eagle-distilled"])
def test_greedy_equals_transformers_and_proposals_equal_the_reference(target, heads, ps, want, name, monkeypatch):
    """Batched greedy runs with a 16-token budget (prompts prefilled in chunks, the head catching
    up in the same steps); each proposal is checked against the reference head."""
    seen: list[tuple[list[int], list[int]]] = []
    head_weights: set[int] = set()
    propose = EagleProposer.propose

    def spy(self, states):
        head_weights.update(id(p) for p in self.head.parameters())
        out = propose(self, states)
        seen.extend((s.prompt_token_ids + s.output_token_ids, out[s.req_id]) for s in states if s.req_id in out)
        return out

    # the head's linears run in the cpu runner's eager kernels (`GraphRunner.eager_mode`), not torch's
    in_mode: set[int] = set()
    mode_call = EagerLinears.__torch_function__

    def counting(mode, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.linear:
            in_mode.add(id(args[1] if len(args) > 1 else (kwargs or {})["weight"]))
        return mode_call(mode, func, types, args, kwargs)

    monkeypatch.setattr(EagleProposer, "propose", spy)
    monkeypatch.setattr(EagerLinears, "__torch_function__", counting)
    llm = make_llm(target, heads[name], max_num_batched_tokens=16)
    for p, got in zip(ps, greedy(llm, ps, N)):
        assert got == want[tuple(p)], f"prompt of {len(p)} tokens"
    assert head_weights & in_mode, "no linear of the head ran in the runner's eager mode"
    s = llm.engine.stats().spec_decode
    assert s.num_drafts > 0, s
    if name == "eagle-distilled":  # accepted and rejected at every depth
        assert all(s.num_drafts > c > 0 for c in s.num_accepted_tokens_per_pos), s
    assert_all_blocks_free(llm)
    ref = RefHead(heads[name], target)
    for seq, drafted in seen[:: max(1, len(seen) // 10)]:
        assert drafted == ref.proposals(seq, len(drafted))[: len(drafted)], f"sequence of {len(seq)} tokens"
    llm.shutdown()


@pytest.mark.slow  # end-to-end, two rounds through a small pool (29 s at load 14 on 2 cores): CI's legs run it
def test_preemption_and_prefix_hits_keep_greedy_exact(target, heads, ps, want):
    """A pool that forces preemption and the same prompts again (prefix-cache hits, whose head
    K/V is the earlier run's): tokens stay the target's, every block is freed."""
    llm = make_llm(target, heads["eagle-distilled"], k=4, max_num_batched_tokens=16, num_kv_blocks=24, max_num_seqs=8,
                   max_model_len=64)
    for round_ in range(2):
        for p, got in zip(ps, greedy(llm, ps, N)):
            assert got == want[tuple(p)], f"round {round_}, prompt of {len(p)} tokens"
        assert_all_blocks_free(llm)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_decode.num_accepted_tokens > 0


def test_seeded_sampling_gives_the_tokens_of_the_run_without_speculation(target, heads, ps):
    plain = LLM(model=str(target), device="cpu", max_model_len=128, block_size=4)
    spec = make_llm(target, heads["eagle-distilled"])
    params = [SamplingParams(temperature=0.7, max_tokens=20, seed=50 + i, ignore_eos=True) for i in range(len(ps))]
    want = plain.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    got = spec.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert spec.engine.stats().spec_decode.num_drafts > 0
    assert_all_blocks_free(spec)


@pytest.mark.slow  # end-to-end, over 10 s on 2 cores: CI's legs run it
def test_unseeded_sampling_keeps_the_target_distribution(target, ps, tmp_path):
    """(t1, t2, t3) under temperature 1 and top-k 3; the head's one-token vocabulary is the most
    likely t2 after the most likely t1, proposed for t2 and t3 (accepted or rejected for a draw
    from the rest): joint frequencies against transformers' probabilities, chi-square at p > 0.001."""
    prompt = ps[1][:7]
    a = int(hf_logits(target, prompt)[-1].argmax())
    b = int(hf_logits(target, prompt + [a])[-1].argmax())
    head = make_eagle_head(target, tmp_path / "one", "eagle3", draft_vocab=[b], aux_layer_ids=AUX)
    llm = make_llm(target, head, k=2, max_num_seqs=256, num_kv_blocks=1500, seed=11)
    k = 3

    def top(ids):
        vals, toks = hf_logits(target, ids)[-1].topk(k)
        return toks.tolist(), torch.softmax(vals, -1).tolist()

    exact = {}
    for x, px in zip(*top(prompt)):
        for y, py in zip(*top(prompt + [x])):
            for z, pz in zip(*top(prompt + [x, y])):
                exact[(x, y, z)] = px * py * pz
    params = SamplingParams(n=250, temperature=1.0, top_k=k, max_tokens=3, ignore_eos=True)
    counts: Counter = Counter()
    for _ in range(6):
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        counts.update(tuple(c.token_ids) for c in out.outputs)
    s = llm.engine.stats().spec_decode
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens, s
    assert_chi_square_fits(counts, exact)


def _shift_last_draft_token(head: Path, by: int) -> Path:
    """The head with its last draft token mapped `by` ids further (``d2t``), past the target's vocabulary."""
    from safetensors.torch import load_file, save_file

    f = head / "model.safetensors"
    tensors = load_file(str(f))
    tensors["d2t"][-1] += by
    save_file(tensors, str(f), metadata={"format": "pt"})
    return head


def test_a_head_that_does_not_fit_exits_2_naming_the_mismatch(target, tmp_path, capsys):
    from portside.cli import main

    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    cases = {
        "hidden": (make_eagle_head(target, tmp_path / "h", "eagle3", target_hidden_size=32, aux_layer_ids=AUX),
                   "head's hidden size (32) does not fit the target's (64)"),
        "vocab": (make_eagle_head(target, tmp_path / "v", "eagle", vocab_size=300), "vocabulary (300 tokens) is not the"),
        "eagle hidden": (make_eagle_head(target, tmp_path / "eh", "eagle", hidden_size=32, intermediate_size=64),
                         "eagle head's hidden size (32) does not fit the target's (64)"),
        "eagle3 vocab": (make_eagle_head(target, tmp_path / "ev", "eagle3", vocab_size=300, draft_vocab=[3, 4],
                                         aux_layer_ids=AUX), "eagle3 head's vocabulary (300 tokens) is not the target's"),
        "eagle3 d2t": (_shift_last_draft_token(make_eagle_head(target, tmp_path / "ed", "eagle3", draft_vocab=[3, 4, 5],
                                                               aux_layer_ids=AUX), vocab),
                       f"d2t maps its draft vocabulary to token ids 3..{vocab + 5}, outside the target's vocabulary"),
        "eagle3 layers": (make_eagle_head(target, tmp_path / "el", "eagle3", num_hidden_layers=2, aux_layer_ids=AUX),
                          "has 2 layers; portside runs heads of one decoder layer"),
        "layers": (make_eagle_head(target, tmp_path / "l", "eagle3", aux_layer_ids=[1, 2, 7]),
                   "auxiliary layer ids [1, 2, 7] do not fit the target's 4 layers"),
        "default layers": (make_eagle_head(target, tmp_path / "d", "eagle3", draft_vocab=[3, 4]),
                           "auxiliary layer ids [2, 2, 1]"),  # vLLM's defaults fit 4 layers: this one loads
    }
    for name, (head, message) in cases.items():
        method = "eagle" if name in ("vocab", "eagle hidden") else "eagle3"
        spec = json.dumps({"method": method, "model": str(head), "num_speculative_tokens": 2})
        rc = main(["generate", "hi", "--model", str(target), "--device", "cpu", "--max-tokens", "2",
                   "--speculative-config", spec])
        err = capsys.readouterr().err
        if name == "default layers":
            assert rc == 0, err
            continue
        assert rc == 2 and message in err, (name, err)


@pytest.mark.parametrize("name", ["eagle3", "eagle-distilled"])
def test_structured_requests_are_speculated_under_the_grammar(target, heads, ps, name):
    """EAGLE proposals under a regex (batched with an unconstrained request): cut where the grammar
    refuses them, verified under each position's mask; tokens equal the run without speculation.
    The random EAGLE-3 head's proposals are mostly rejected (1 of 48 accepted here); the distilled
    head's about half."""
    llm = make_llm(target, heads[name])
    plain = LLM(model=str(target), device="cpu", max_model_len=128, block_size=4)
    proposed, accepted, cut = structured_run(llm, plain, ps[:2], "[ab ]{20,40}")
    assert proposed > 0 and cut > 0 and (accepted > 0 or name == "eagle3"), (proposed, accepted, cut)


def test_lora_on_the_target(target, heads, ps, tmp_path):
    """An adapter on the target: the EAGLE-3 head reads the adapted target's aux hidden states;
    greedy tokens equal the adapted target's without speculation."""
    from portside.lora.request import LoRARequest
    from portside.testing.tiny import make_tiny_lora

    lora = LoRARequest("a", 1, str(make_tiny_lora(target, tmp_path / "lora")))
    kw = {"enable_lora": True, "max_lora_rank": 8}
    plain = LLM(model=str(target), device="cpu", max_model_len=128, block_size=4, **kw)
    spec = make_llm(target, heads["eagle3"], **kw)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ps[:2]]
    want = plain.generate(prompts, params, use_tqdm=False, lora_request=lora)
    got = spec.generate(prompts, params, use_tqdm=False, lora_request=lora)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert want[0].outputs[0].token_ids != greedy(plain, ps[:1], 16)[0]  # the adapter changes the tokens
    assert spec.engine.stats().spec_decode.num_drafts > 0
    assert_all_blocks_free(spec)


def test_mtp_layer_of_a_deepseek_v3_checkpoint(tmp_path):
    """DeepSeek-V3 (latent attention, experts) with its MTP layer (``model.layers.{L}.*``) proposing:
    greedy tokens equal transformers', batched, chunked; a checkpoint without MTP layers exits 2."""
    from portside.cli import main
    from portside.testing.eagle import add_mtp_layer
    from portside.testing.tiny_deepseek import make_tiny_deepseek

    overrides = dict(seed=6, num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                     n_group=2, topk_group=1, norm_topk_prob=True)
    path = add_mtp_layer(make_tiny_deepseek(tmp_path / "v3", "v3", num_nextn_predict_layers=1, **overrides))
    llm = LLM(model=str(path), device="cpu", max_model_len=64, block_size=4, max_num_batched_tokens=16,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    prompts = [[5, 17, 250, 31, 99, 8, 120], [64, 300, 2], [45, 77, 1, 390, 12, 13, 14, 200, 201, 6, 7, 333, 42]]
    for p, got in zip(prompts, greedy(llm, prompts, 12)):
        assert got == hf_greedy(path, p, 12), f"prompt of {len(p)} tokens"
    assert llm.engine.stats().spec_decode.num_drafts > 0
    assert_all_blocks_free(llm)
    plain = make_tiny_deepseek(tmp_path / "plain", "v3", **overrides)
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
    assert main(["generate", "hi", "--model", str(plain), "--device", "cpu", "--speculative-config", spec]) == 2


def test_eagle3_on_a_qwen3_target(ps, tmp_path):
    """A Qwen3 target (q/k norms, head_dim 32 over hidden 64): the head's aux hidden states come
    from its own layer loop; greedy tokens equal transformers'."""
    target = make_tiny_model(tmp_path / "qwen3", "qwen3", num_hidden_layers=4)
    head = make_eagle_head(target, tmp_path / "head", "eagle3", aux_layer_ids=AUX, layout="speculators")
    llm = make_llm(target, head, max_num_batched_tokens=16)
    for p, got in zip(ps[:2], greedy(llm, ps[:2], 12)):
        assert got == hf_greedy(target, p, 12)
    assert llm.engine.stats().spec_decode.num_drafts > 0
    assert_all_blocks_free(llm)
