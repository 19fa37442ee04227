"""Speculative decoding on hybrid models, whose recurrent layers (Gated DeltaNet, Mamba-2, Mamba-1)
keep a state that a verify step's rejected proposals must not reach (`portside.runner.recurrent`:
the state after each verified token is kept, the accepted length's committed).

- the reference kernels keep each verified token's state, equal to running the prefix alone, and
  `kernels_for` sends an override that does not declare it to the reference;
- greedy tokens equal transformers' with ngram (k = 2, 3) and Qwen3-Next's own MTP layer (read
  from ``mtp.*`` in the checkpoint: random weights, and a layer distilled to the target's
  successor table), batched and alone, with chunked prefill, preemption and a prefix-cache hit;
  the MTP layer's proposals equal an independent reference (transformers' own decoder layer);
  proposals are accepted, some only in part (the roll back exercised); a scripted proposer
  rejects at every depth; Bamba (Mamba-2), Jamba (Mamba-1) and LFM2 (short convolutions) with
  ngram; a draft model; two tensor-parallel ranks;
- refusals: a Qwen3-Next checkpoint without ``mtp.*`` (exit 2), an MTP tensor missing, a draft
  model with recurrent layers, pipeline parallelism (exit 2).

The tiny models are drawn narrower than the hybrid parity tests' (init std 0.05): their greedy
tokens then follow the last token often enough that earlier text predicts later text.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from test_spec_decode import ScriptedProposer, assert_all_blocks_free, use_proposer

from portside import LLM, SamplingParams
from portside.contract import RecurrentKernels, RecurrentMetadata, kernels_for
from portside.ops import recurrent as ref
from portside.testing.qwen3_next_mtp import add_qwen3_next_mtp
from portside.testing.tiny import hf_greedy, make_tiny_model
from portside.testing.tiny_hybrid import make_tiny_hybrid

N = 20  # tokens generated per prompt
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
QWEN3_NEXT = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  intermediate_size=96, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48, num_hidden_layers=4, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
                  mlp_only_layers=[1])
NGRAM = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _base(seed: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 400, (n,), generator=gen).tolist() for n in lengths]


def _echo_prompts(path: Path, seed: int) -> list[list[int]]:
    """Prompts that hold the target's own continuation of their start, then that start again,
    so that prompt lookup finds what the target writes next (in part), and one without."""
    base = _base(seed, [4, 9, 17])
    outs = [hf_greedy(path, p, 12) for p in base]
    return [base[0] + outs[0][:10] + base[0], base[1] + outs[1] + base[1], base[2] + outs[2] + base[2][-3:], base[1][:5]]


@pytest.fixture(scope="module")
def qnext(tmp_path_factory) -> Path:
    return make_tiny_hybrid(tmp_path_factory.mktemp("qnext"), "Qwen3NextConfig", "Qwen3NextForCausalLM", init_std=0.05,
                            **QWEN3_NEXT)


@pytest.fixture(scope="module")
def qprompts(qnext) -> list[list[int]]:
    return _echo_prompts(qnext, 0)


@pytest.fixture(scope="module")
def qwant(qnext, qprompts) -> list[list[int]]:
    return [hf_greedy(qnext, p, N) for p in qprompts]


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                               use_tqdm=False)]


def _assert_partial_acceptance(llm: LLM) -> None:
    """Proposals accepted and proposals rejected (each rejection rolls a state back to a kept
    token's), some drafts only in part: fewer accepted at the last depth than at the first, or
    drafts wholly rejected."""
    s = llm.engine.stats().spec_decode
    per_pos = s.num_accepted_tokens_per_pos
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens, s
    assert per_pos[-1] < per_pos[0] or s.num_drafts > per_pos[0], s


# ---- the reference kernels ---------------------------------------------------------------------


def _op_cases(gen: torch.Generator) -> dict[str, tuple[Any, list[tuple[int, ...]]]]:
    """op name -> (fn(x, state tensors, md) -> output, the per-sequence state shapes)."""
    T, C, K, H, P, N_, Dm = 9, 6, 4, 4, 3, 5, 6

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    w, b = r(C, K), r(C)
    ssd = (r(T, H, P), r(T, H), -torch.rand(H, generator=gen) - 0.5, r(T, 2, N_), r(T, 2, N_))
    sel = (r(T, Dm), r(T, Dm), -torch.rand(Dm, N_, generator=gen) - 0.5, r(T, N_), r(T, N_), r(T, Dm))
    gdr = (r(T, 2, 4), r(T, 2, 4), r(T, 4, 3), -torch.rand(T, 4, generator=gen), torch.rand(T, 4, generator=gen))
    x = r(T, C)
    return {
        "causal_conv1d": (lambda s, md: ref.causal_conv1d(x, w, b, s[0], md), [(C, K - 1)]),
        "ssd_scan": (lambda s, md: ref.ssd_scan(*ssd, s[0], md), [(H, P, N_)]),
        "selective_scan": (lambda s, md: ref.selective_scan(*sel[:5], s[0], md, z=sel[5]), [(Dm, N_)]),
        "gated_delta_rule": (lambda s, md: ref.gated_delta_rule(*gdr, s[0], md, 0.5), [(4, 4, 3)]),
    }


def _md(lengths: list[int], slots: list[int], kept: list[list[int]] | None = None) -> RecurrentMetadata:
    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    nd = sum(1 for n in lengths if n == 1)
    return RecurrentMetadata(state_slots=torch.tensor(slots), has_initial_state=torch.ones(len(slots), dtype=torch.bool),
                             query_start_loc=torch.tensor(qsl, dtype=torch.int32), query_start_loc_cpu=qsl,
                             state_slots_cpu=slots, has_initial_state_cpu=[True] * len(slots), num_decodes=nd,
                             token_state_slots_cpu=kept or [])


@pytest.mark.parametrize("op", ["causal_conv1d", "ssd_scan", "selective_scan", "gated_delta_rule"])
def test_reference_keeps_each_verified_tokens_state(op: str) -> None:
    """A step of a decode (slot 0), a verify row of 5 tokens (slot 1, its first 4 tokens' states
    to slots 4-7) and a prefill (slot 2): outputs as without keeping; slot 4 + j holds the state
    the row's first j + 1 tokens leave, run alone from the same start."""
    gen = torch.Generator().manual_seed(0)
    fn, shapes = _op_cases(gen)[op]
    start = [torch.randn(8, *s, generator=gen) for s in shapes]
    plain = [t.clone() for t in start]
    expect = fn(plain, _md([1, 5, 3], [0, 1, 2]))
    kept = [t.clone() for t in start]
    got = fn(kept, _md([1, 5, 3], [0, 1, 2], [[], [4, 5, 6, 7], []]))
    torch.testing.assert_close(got, expect)
    torch.testing.assert_close(kept[0][:3], plain[0][:3])
    for j in range(4):  # the verify row's tokens 1..j+1 (rows 1..j+1 of the flat batch) alone
        alone = [t.clone() for t in start]
        # rows before the verify row's: a one-token decode of slot 0 first, as in the step
        fn(alone, _md([1, j + 1, 8 - j - 1], [0, 1, 3]))
        torch.testing.assert_close(kept[0][4 + j], alone[0][1], msg=f"{op}: state after token {j}")


def test_kernels_for_sends_undeclared_overrides_to_the_reference() -> None:
    class Old(RecurrentKernels):  # a backend written before per-token states
        def gated_delta_rule(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            raise AssertionError("not for steps that keep per-token states")

    class New(Old):
        token_state_kernels = frozenset({"gated_delta_rule"})

    verify, plain = _md([1, 3], [0, 1], [[], [2, 3]]), _md([1, 3], [0, 1])
    old, new = Old(), New()
    assert kernels_for(old, plain) is old and kernels_for(new, verify) is new
    chosen = kernels_for(old, verify)
    assert chosen is not old and type(chosen) is RecurrentKernels
    assert kernels_for(RecurrentKernels(), verify) is not None


# ---- Qwen3-Next ----------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 3])
def test_ngram_qwen3_next_batched_and_alone(qnext, qprompts, qwant, k: int) -> None:
    llm = LLM(model=str(qnext), device="cpu", max_model_len=128, block_size=4,
              speculative_config=dict(NGRAM, num_speculative_tokens=k))
    assert _generate(llm, qprompts) == qwant
    _assert_partial_acceptance(llm)
    assert _generate(llm, qprompts[1:2]) == qwant[1:2]
    assert_all_blocks_free(llm)


def test_ngram_qwen3_next_chunked_preempted_and_prefix_hit(qnext, qprompts, qwant) -> None:
    """A 10-token budget chunks the prompts beside verify rows; 24 blocks of 4 tokens cannot hold
    four sequences of ~60 tokens, so some are preempted; then a prompt sharing the previous one's
    first 20 tokens restores the state saved there (saved where a prompt chunk ends, never in a
    verify step, whose state ends at the accepted length)."""
    llm = LLM(model=str(qnext), device="cpu", max_model_len=96, block_size=4, max_num_batched_tokens=10,
              num_kv_blocks=24, speculative_config=dict(NGRAM, num_speculative_tokens=3))
    assert _generate(llm, qprompts) == qwant
    assert llm.engine.stats().num_preemptions > 0
    _assert_partial_acceptance(llm)
    shared = [qprompts[1][:20] + [7, 8, 9], qprompts[1][:20] + [300, 301]]
    first = llm.generate([{"prompt_token_ids": shared[0]}], GREEDY, use_tqdm=False)
    hit = llm.generate([{"prompt_token_ids": shared[1]}], GREEDY, use_tqdm=False)
    assert hit[0].num_cached_tokens == 20, hit[0].num_cached_tokens  # the state saved at token 20 restored
    assert [list(o.outputs[0].token_ids) for o in first + hit] == [hf_greedy(qnext, p, N) for p in shared]
    assert_all_blocks_free(llm)


def test_scripted_rejections_at_every_depth(qnext, qprompts, qwant) -> None:
    """Proposals of the true continuation with one wrong token at a cycling depth: every accepted
    length from 0 to k occurs, and the tokens stay the target's."""
    llm = LLM(model=str(qnext), device="cpu", max_model_len=128, block_size=4,
              speculative_config=dict(NGRAM, num_speculative_tokens=4))
    truth = {tuple(p): w for p, w in zip(qprompts, qwant)}

    def continuation(tokens: list[int]) -> list[int]:
        for p, w in truth.items():
            if tuple(tokens[: len(p)]) == p:
                return w[len(tokens) - len(p):]
        raise AssertionError("unknown prompt")

    use_proposer(llm, ScriptedProposer(continuation, k=4))
    assert _generate(llm, qprompts) == qwant
    s = llm.engine.stats().spec_decode
    assert s.num_accepted_tokens_per_pos[-1] > 0 and s.num_accepted_tokens < s.num_draft_tokens, s
    assert_all_blocks_free(llm)


@pytest.fixture(scope="module")
def successors(qnext, qprompts, qwant) -> dict[int, int]:
    """The target's successor table from its greedy tokens, first seen first, 40 tokens at most
    (the MTP layer's fc solves one row per token of the table: fewer than hidden_size)."""
    pairs: dict[int, Counter] = {}
    for p, w in zip(qprompts, qwant):
        seq = p + w
        for a, b in zip(seq, seq[1:]):
            pairs.setdefault(a, Counter())[b] += 1
    table = {a: c.most_common(1)[0][0] for a, c in pairs.items()}
    return dict(list(table.items())[:40])


@pytest.mark.parametrize("k", [2, 3])
def test_mtp_layer_of_qwen3_next(qnext, qprompts, qwant, successors, tmp_path, k: int) -> None:
    """The checkpoint's ``mtp.*`` layer distilled to the successor table: accepted in part."""
    path = add_qwen3_next_mtp(shutil.copytree(qnext, tmp_path / "m"), successors=successors)
    llm = LLM(model=str(path), device="cpu", max_model_len=128, block_size=4, max_num_batched_tokens=16,
              speculative_config={"method": "mtp", "num_speculative_tokens": k})
    assert _generate(llm, qprompts) == qwant
    _assert_partial_acceptance(llm)
    assert llm.engine.stats().spec_decode.num_accepted_tokens_per_pos[k - 1] > 0
    assert_all_blocks_free(llm)


def test_mtp_chunked_and_preempted(qnext, qprompts, qwant, successors, tmp_path) -> None:
    """The distilled MTP layer with a 10-token budget and a pool that forces preemption: a
    resumed request's MTP rows restart from its recomputed hidden states; tokens stay the target's."""
    path = add_qwen3_next_mtp(shutil.copytree(qnext, tmp_path / "m"), successors=successors)
    llm = LLM(model=str(path), device="cpu", max_model_len=96, block_size=4, max_num_batched_tokens=10,
              num_kv_blocks=24, speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    assert _generate(llm, qprompts) == qwant
    assert llm.engine.stats().num_preemptions > 0
    _assert_partial_acceptance(llm)
    assert_all_blocks_free(llm)


class RefMTP:
    """An independent reference of the MTP layer's proposals over a whole sequence, no cache:
    transformers' target for the hidden states, the layer as transformers' own decoder layer
    (`mtp_twin`), fc and the two pre-fc norms in plain torch."""

    def __init__(self, path: Path, twin: Path) -> None:
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        self.target = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        self.twin = AutoModelForCausalLM.from_pretrained(str(twin), dtype=torch.float32).eval()
        w = load_file(str(path / "model.safetensors"))
        self.fc, self.ne, self.nh = (w[f"mtp.{n}.weight"] for n in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden"))
        self.eps = self.target.config.rms_norm_eps

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # zero-centred RMSNorm
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + w)

    @torch.no_grad()
    def proposals(self, seq: list[int], k: int) -> list[int]:
        """Row i: the target's hidden state at position i and token i + 1, at position i."""
        hid = self.target.model(torch.tensor([seq[:-1]])).last_hidden_state[0]
        tokens, drafted = list(seq[1:]), []
        for _ in range(k):
            x = torch.cat([self._norm(self.target.model.embed_tokens(torch.tensor(tokens)), self.ne),
                           self._norm(hid, self.nh)], -1) @ self.fc.T
            o = self.twin.model(inputs_embeds=x[None], position_ids=torch.arange(len(tokens))[None],
                                use_cache=False).last_hidden_state[0]
            drafted.append(int(self.twin.lm_head(o[-1]).argmax()))
            tokens, hid = tokens + [drafted[-1]], torch.cat([hid, o[-1:]])
        return drafted


def test_mtp_proposals_equal_an_independent_reference(qnext, qprompts, qwant, tmp_path, monkeypatch) -> None:
    """A random-weight MTP layer (attention and experts at work), chunked prompts: every checked
    proposal equals `RefMTP`'s (the layer's paged KV, kept rows, catch-up and chaining exact)."""
    from portside.spec_decode.eagle import EagleProposer
    from portside.testing.qwen3_next_mtp import mtp_twin

    path = add_qwen3_next_mtp(shutil.copytree(qnext, tmp_path / "m"), seed=2)
    seen: list[tuple[list[int], list[int]]] = []
    propose = EagleProposer.propose

    def spy(self: EagleProposer, states: list[Any]) -> dict[str, list[int]]:
        out = propose(self, states)
        seen.extend((s.prompt_token_ids + s.output_token_ids, out[s.req_id]) for s in states if s.req_id in out)
        return out

    monkeypatch.setattr(EagleProposer, "propose", spy)
    llm = LLM(model=str(path), device="cpu", max_model_len=128, block_size=4, max_num_batched_tokens=16,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    assert _generate(llm, qprompts[:3]) == qwant[:3]
    ref = RefMTP(path, mtp_twin(path, tmp_path / "twin"))
    assert len(seen) > 10
    for seq, drafted in seen[:: max(1, len(seen) // 8)]:
        assert drafted == ref.proposals(seq, len(drafted)), f"sequence of {len(seq)} tokens"


def test_mtp_random_layer_and_refusals(qnext, qprompts, qwant, tmp_path) -> None:
    """A random-weight MTP layer (its proposals rejected) keeps the target's tokens; a checkpoint
    without ``mtp.*`` exits 2 naming it; one missing an MTP tensor is refused naming it."""
    from safetensors.torch import load_file, save_file

    from portside.cli import main

    path = add_qwen3_next_mtp(shutil.copytree(qnext, tmp_path / "m"), seed=1)
    llm = LLM(model=str(path), device="cpu", max_model_len=128, block_size=4,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert _generate(llm, qprompts[:2]) == qwant[:2]
    assert llm.engine.stats().spec_decode.num_drafts > 0
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
    assert main(["generate", "hi", "--model", str(qnext), "--device", "cpu", "--max-model-len", "64",
                 "--speculative-config", spec]) == 2
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    del tensors["mtp.pre_fc_norm_hidden.weight"]
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"MTP layer mtp\.\* is missing 1 tensors.*pre_fc_norm_hidden"):
        LLM(model=str(path), device="cpu", max_model_len=64, speculative_config={"method": "mtp",
                                                                                 "num_speculative_tokens": 2})


def test_pipeline_parallelism_refused_at_engine_build(qnext) -> None:
    """Refused before any worker starts, naming the fix (the CLI exits 2)."""
    from portside.cli import main

    with pytest.raises(ValueError, match="speculative decoding with pipeline parallelism is not supported for "
                                         "Qwen3NextForCausalLM.*--tensor-parallel-size"):
        LLM(model=str(qnext), device="cpu", max_model_len=64, pipeline_parallel_size=2,
            speculative_config=dict(NGRAM, num_speculative_tokens=2))
    spec = json.dumps(dict(NGRAM, num_speculative_tokens=2))
    assert main(["generate", "hi", "--model", str(qnext), "--device", "cpu", "--pipeline-parallel-size", "2",
                 "--speculative-config", spec]) == 2


def test_draft_model_on_a_hybrid_target_and_a_hybrid_draft_refused(qnext, qprompts, qwant, tmp_path) -> None:
    draft = make_tiny_model(tmp_path / "draft", "llama", init_std=0.05)
    llm = LLM(model=str(qnext), device="cpu", max_model_len=128, block_size=4,
              speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2})
    assert _generate(llm, qprompts[:2]) == qwant[:2]
    assert llm.engine.stats().spec_decode.num_drafts > 0
    assert_all_blocks_free(llm)
    with pytest.raises(ValueError, match="draft model Qwen3NextForCausalLM has recurrent layers"):
        LLM(model=str(draft), device="cpu", max_model_len=64,
            speculative_config={"method": "draft_model", "model": str(qnext), "num_speculative_tokens": 2})


# ---- Mamba-style hybrids -----------------------------------------------------------------------


def _ssm_ranges(model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.log(torch.linspace(1, 8, p.numel())).reshape(p.shape))
        elif name.endswith("dt_bias") or name.endswith("dt_proj.bias"):
            p.copy_(torch.linspace(-3, 0.5, p.numel()))
        elif name.endswith(".D"):
            p.copy_(torch.linspace(0.5, 1.5, p.numel()))


MAMBA = {
    # Mamba-2 layers around attention (ssd_scan)
    "bamba": ("BambaConfig", "BambaForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        mamba_d_conv=4, mamba_expand=2, num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=8,
        mamba_d_state=16, mamba_n_groups=1)),
    # Mamba-1 layers (selective_scan) and attention, experts
    "jamba": ("JambaConfig", "JambaForCausalLM", dict(
        hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=0,
        num_experts=4, num_experts_per_tok=2, mamba_d_state=8)),
    # short convolutions (causal_conv1d alone) and attention
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(
        hidden_size=64, intermediate_size=96, block_multiple_of=16, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "full_attention"],
        conv_L_cache=3)),
}


@pytest.mark.parametrize("name", ["bamba", pytest.param("jamba", marks=pytest.mark.slow),
                                  pytest.param("lfm2", marks=pytest.mark.slow)])
def test_ngram_mamba_hybrid(name: str, tmp_path: Path) -> None:
    config_class, arch, kwargs = MAMBA[name]
    path = make_tiny_hybrid(tmp_path / name, config_class, arch, init_std=0.05,
                            post_init=_ssm_ranges if name == "bamba" else None, **kwargs)
    prompts = _echo_prompts(path, 1)
    llm = LLM(model=str(path), device="cpu", max_model_len=128, block_size=4, max_num_batched_tokens=12,
              speculative_config=dict(NGRAM, num_speculative_tokens=3))
    assert _generate(llm, prompts) == [hf_greedy(path, p, N) for p in prompts]
    _assert_partial_acceptance(llm)
    assert_all_blocks_free(llm)


@pytest.mark.slow  # two worker processes
def test_ngram_qwen3_next_tensor_parallel(qnext, qprompts, qwant) -> None:
    """Two ranks: each commits its heads' states to the accepted length (the sampled tokens are every rank's)."""
    llm = LLM(model=str(qnext), device="cpu", max_model_len=128, block_size=4, tensor_parallel_size=2,
              speculative_config=dict(NGRAM, num_speculative_tokens=3))
    try:
        assert _generate(llm, qprompts) == qwant
        _assert_partial_acceptance(llm)
    finally:
        llm.engine.shutdown()
