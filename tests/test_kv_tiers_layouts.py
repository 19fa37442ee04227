"""KV tiers (docs/kv_tiers.md) for the block layouts beyond a plain K/V cache in the model's dtype:
an 8-bit KV cache (int8 with its per-row scales, fp8), latent attention (MLA, a tiny
DeepSeek-V2), and speculative decoding whose draft (an EAGLE head) keeps its KV in the target's
block ids. Each engine with tiers gives the greedy tokens of the same engine without them; the
blocks cross in the neutral layout (`portside.contract.kv_transfer`), stored rows and scales
bit for bit (the conformance kit's `test_kv_block_layout_round_trips_8bit_blocks` checks the
bytes), a draft's layers riding in the same blocks: an EAGLE head or an MTP layer proposes after a
tier restore exactly what it proposes from a resident prefix (without its layers in the blocks it
does not). The shared-storage connector (disaggregated prefill) moves the same blocks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from portside import LLM, SamplingParams
from portside.testing.engine_parity import random_prompts
from portside.testing.hf_oracle import hf_greedy
from portside.testing.kv_replay import check_books, replay

MAX_TOKENS = 6
PROMPTS = random_prompts(5, [44] * 6)  # 11 blocks of 4 each; the 24-block device cache keeps about two
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ROW_BYTES = {"int8": 16 + 4, "fp8_e4m3": 16}  # tiny llama: head_size 16; int8 rows carry an fp32 scale


def _llm(path: Path, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 24)
    return LLM(model=str(path), device="cpu", max_model_len=64, block_size=4, **kwargs)


def _replay(llm: LLM, rounds: int = 2, prompts: list[list[int]] = PROMPTS) -> tuple[list[list[int]], list[int]]:
    return replay(llm, prompts, GREEDY, rounds)


_books = check_books


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_8bit_cache_blocks_come_back_from_host_and_disk(tiny_llama, tmp_path, kv_cache_dtype):
    """An 8-bit cache with a host tier of 30 blocks and a disk tier behind it, the prompts replayed
    forward then backward: the backward round hits the device, then the host tier (the latest
    evicted blocks), then the disk, and generates the tier-off engine's tokens; a new engine on
    the same folder starts warm; a cache of another dtype never reads the files."""
    block_bytes = 2 * 2 * 4 * 2 * ROW_BYTES[kv_cache_dtype]  # layers, K/V, tokens, KV heads, row
    order = PROMPTS + PROMPTS[::-1]
    baseline, cached = _replay(_llm(tiny_llama, kv_cache_dtype=kv_cache_dtype), rounds=1, prompts=order)
    assert cached[len(PROMPTS) + 2:] == [0] * (len(PROMPTS) - 2)  # the device keeps the last two prompts only
    tiers = dict(kv_cache_dtype=kv_cache_dtype, kv_offload_cpu_bytes=30 * block_bytes,
                 kv_offload_disk_path=str(tmp_path), kv_offload_disk_bytes=1 << 22)
    llm = _llm(tiny_llama, **tiers)
    assert llm.engine.scheduler.kv_loads.connector.num_host_slots == 30  # the block is what the layout says
    tokens, cached = _replay(llm, rounds=1, prompts=order)
    assert tokens == baseline
    assert cached[len(PROMPTS):] == [40] * len(PROMPTS)
    stats = _books(llm)
    assert stats["host_hit_blocks"] > 0 and stats["disk_hit_blocks"] > 0 and stats["corrupt_blocks"] == 0
    del llm

    warm = _llm(tiny_llama, **tiers)
    out = warm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == baseline[0] and out.num_cached_tokens == 40  # (from disk)
    del warm
    other = _llm(tiny_llama, **{**tiers, "kv_cache_dtype": "auto", "kv_offload_cpu_bytes": 1 << 20})
    assert other.engine.scheduler.kv_loads.connector.entries == {}  # another fingerprint: another folder


def test_swap_preemption_with_an_int8_cache(tiny_llama):
    """Five 40-token prompts over 20 blocks of an int8 cache: preempted requests' blocks (values
    and scales) swap to the host tier and back; the tokens are recompute mode's."""
    prompts = random_prompts(7, [38, 35, 40, 33, 37])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = {}
    for mode in ("recompute", "swap"):
        llm = _llm(tiny_llama, num_kv_blocks=20, max_num_batched_tokens=16, preemption_mode=mode, swap_space=0.001,
                   kv_cache_dtype="int8")
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.engine.stats().num_preemptions > 0
        runs[mode] = ([list(o.outputs[0].token_ids) for o in outs], _books(llm))
    assert runs["swap"][0] == runs["recompute"][0]
    assert runs["swap"][1]["swapped_out_blocks"] > 0
    assert runs["swap"][1]["preemption_recomputed_tokens"] < runs["recompute"][1]["preemption_recomputed_tokens"]


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory) -> Path:
    from portside.testing.tiny_deepseek import make_tiny_deepseek

    return make_tiny_deepseek(tmp_path_factory.mktemp("kv_tiers_deepseek"), "v2")


def test_latent_attention_blocks_come_back_from_the_host_tier(tiny_deepseek):
    """A tiny DeepSeek-V2 (MLA: one latent row per token and layer): with the host tier, round two
    loads each prompt's latent rows and generates the tier-off tokens, which are transformers'."""
    prompts = PROMPTS[:4]
    baseline, cached = _replay(_llm(tiny_deepseek, num_kv_blocks=20), prompts=prompts)
    assert cached[len(prompts):] == [0] * len(prompts)
    llm = _llm(tiny_deepseek, num_kv_blocks=20, kv_offload_cpu_bytes=1 << 20)
    tokens, cached = _replay(llm, prompts=prompts)
    assert tokens == baseline
    assert cached[len(prompts):] == [40] * len(prompts)
    stats = _books(llm)
    assert stats["host_hit_blocks"] == 10 * len(prompts)
    width = 32 + 8  # kv_lora_rank + qk_rope_head_dim, fp32, 2 layers, 4 tokens
    assert stats["load_bytes"] == 10 * len(prompts) * 2 * 4 * width * 4
    for prompt, toks in zip(prompts[:2], tokens[:2], strict=True):
        assert toks == hf_greedy(tiny_deepseek, prompt, MAX_TOKENS)


@pytest.fixture(scope="module")
def eagle(tiny_llama, tmp_path_factory) -> Path:
    """A random-weight EAGLE-1 head: its proposals (mostly rejected) depend on the K/V its layer
    reads at every earlier position, the restored blocks' included."""
    from portside.testing.eagle import make_eagle_head

    return make_eagle_head(tiny_llama, tmp_path_factory.mktemp("kv_tiers_eagle") / "head", "eagle", seed=2)


def _record_proposals(llm: LLM) -> list[dict[str, list[int]]]:
    """Every step's proposals, as the engine's EAGLE proposer makes them (its `propose`, wrapped)."""
    draft, log = llm.engine.executor.runner.draft, []
    propose = draft.propose

    def recorded(states):
        out = propose(states)
        log.append({rid: list(p) for rid, p in out.items()})
        return out

    draft.propose = recorded
    return log


def _proposals_after_a_tier_restore_equal_a_resident_prefix(target: Path, spec: dict, block_bytes: int) -> None:
    """Round two of four prompts with a draft that proposes from its own K/V: a large device cache
    keeps the prefixes (the reference), a 24-block one with the host tier loads them back, the
    draft's layer's blocks (`block_bytes` each with the target's) with them. The tokens are the
    target's greedy ones and the draft proposes exactly the same tokens in both."""
    prompts = PROMPTS[:4]
    resident = _llm(target, num_kv_blocks=200, speculative_config=spec)
    first, _ = _replay(resident, rounds=1, prompts=prompts)
    want = _record_proposals(resident)
    again, cached = _replay(resident, rounds=1, prompts=prompts)
    assert cached == [40] * len(prompts) and again == first
    assert sum(len(p) for step in want for p in step.values()) >= 4 * len(prompts)

    llm = _llm(target, speculative_config=spec, kv_offload_cpu_bytes=1 << 20)
    assert llm.engine.scheduler.kv_loads.connector.num_host_slots == (1 << 20) // block_bytes
    tokens, _ = _replay(llm, rounds=1, prompts=prompts)
    got = _record_proposals(llm)
    tokens2, cached = _replay(llm, rounds=1, prompts=prompts)
    assert cached == [40] * len(prompts)
    assert tokens == tokens2 == first
    for prompt, toks in zip(prompts, tokens2, strict=True):
        assert toks == hf_greedy(target, prompt, MAX_TOKENS)
    assert got == want
    assert _books(llm)["host_hit_blocks"] == 10 * len(prompts)


def test_an_eagle_heads_kv_rides_in_the_blocks(tiny_llama, eagle):
    """EAGLE: the head's one K/V layer (1 KiB a block) rides after the target's two (2 KiB)."""
    spec = {"method": "eagle", "model": str(eagle), "num_speculative_tokens": 3}
    _proposals_after_a_tier_restore_equal_a_resident_prefix(tiny_llama, spec, 2048 + 1024)


@pytest.mark.slow  # a DeepSeek-V3 with experts, transformers' greedy of four prompts: 18 s on 2 cores
def test_an_mtp_layers_latent_kv_rides_in_the_blocks(tmp_path):
    """DeepSeek-V3 with its MTP layer (method "mtp"): latent blocks, the MTP layer's latent rows
    riding after the target's two layers'."""
    from portside.testing.eagle import add_mtp_layer
    from portside.testing.tiny_deepseek import make_tiny_deepseek

    overrides = dict(seed=6, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                     topk_group=1, norm_topk_prob=True)  # (the MTP layer has experts, as V3's)
    path = add_mtp_layer(make_tiny_deepseek(tmp_path / "v3", "v3", num_nextn_predict_layers=1, **overrides))
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    _proposals_after_a_tier_restore_equal_a_resident_prefix(path, spec, 3 * 4 * (32 + 8) * 4)


@pytest.mark.parametrize("model, kwargs", [("llama", {"kv_cache_dtype": "int8"}), ("deepseek", {}), ("llama", None)],
                         ids=["int8", "mla", "eagle"])
def test_shared_storage_producer_to_consumer(request, tiny_llama, tmp_path, model, kwargs):
    """Disaggregated prefill and decode (the shared-storage connector) with an int8 cache, with
    latent attention and with an EAGLE head: the consumer loads the producer's blocks and generates
    one engine's tokens; a consumer whose cache is another dtype finds no files of its layout and
    computes them."""
    path = tiny_llama if model == "llama" else request.getfixturevalue("tiny_deepseek")
    if kwargs is None:
        eagle = request.getfixturevalue("eagle")
        kwargs = {"speculative_config": {"method": "eagle", "model": str(eagle), "num_speculative_tokens": 3}}
    store = str(tmp_path / "kv")
    prompts = PROMPTS[:2]
    alone = _replay(_llm(path, **kwargs), rounds=1, prompts=prompts)[0]
    producer = _llm(path, kv_connector="shared_storage", kv_role="producer", kv_connector_path=store, **kwargs)
    assert _replay(producer, rounds=1, prompts=prompts)[0] == alone
    del producer
    consumer = _llm(path, kv_connector="shared_storage", kv_role="consumer", kv_connector_path=store, **kwargs)
    tokens, cached = _replay(consumer, rounds=1, prompts=prompts)
    assert tokens == alone and cached == [40] * len(prompts)
    assert consumer.engine.scheduler.kv_loads.num_loaded_tokens == 40 * len(prompts)
    del consumer
    if "kv_cache_dtype" in kwargs:
        other = _llm(path, kv_connector="shared_storage", kv_role="consumer", kv_connector_path=store)
        assert _replay(other, rounds=1, prompts=prompts[:1])[1] == [0]
        assert other.engine.scheduler.kv_loads.num_loaded_tokens == 0


def _drafts(llm: LLM) -> tuple[int, int]:
    """(proposed, accepted) tokens since start."""
    s = llm.engine.stats().spec_decode
    return s.num_draft_tokens, s.num_accepted_tokens


def test_a_draft_models_layers_ride_in_the_blocks(tiny_llama):
    """A draft model (the tiny llama drafting for itself) with the host tier: each block carries
    the draft's two layers after the target's, and round two loads them and generates the
    target's greedy tokens (the draft proposes and is accepted)."""
    spec = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 2}
    prompts = PROMPTS[:4]
    llm = _llm(tiny_llama, speculative_config=spec, kv_offload_cpu_bytes=1 << 20)
    assert llm.engine.scheduler.kv_loads.connector.num_host_slots == (1 << 20) // (2 * 2048)
    tokens, cached = _replay(llm, prompts=prompts)
    assert cached[len(prompts):] == [40] * len(prompts)
    assert tokens[: len(prompts)] == tokens[len(prompts):]
    for prompt, toks in zip(prompts, tokens[: len(prompts)], strict=True):
        assert toks == hf_greedy(tiny_llama, prompt, MAX_TOKENS)
    assert _drafts(llm)[1] > 0
    assert _books(llm)["host_hit_blocks"] == 10 * len(prompts)


def test_the_fingerprint_follows_what_changes_the_bytes():
    """Pure Python: the default K/V layout digests as it did before 8-bit, latent and draft
    layouts existed (its stored blocks stay readable); the cache dtype, a draft's layers, and the
    draft's identity (`extra_identity`: which head, which draft model and dtype) each change it."""
    import dataclasses

    import torch

    from portside.contract import KVBlockLayout, KVCacheSpec, LatentKVCacheSpec
    from portside.runner.kv_transfer import extra_identity

    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_size=16, dtype=torch.float32)
    ident = ("model", "torch.float32", "auto", "tp1", "pp1")
    plain = KVBlockLayout.from_spec(spec, 4)
    assert plain.fingerprint(*ident) == "ebdb1e842f89ea261a847c339c02828c"  # as before: old files stay valid
    int8 = KVBlockLayout.from_spec(dataclasses.replace(spec, cache_dtype=torch.int8), 4)
    fp8 = KVBlockLayout.from_spec(dataclasses.replace(spec, cache_dtype=torch.float8_e4m3fn), 4)
    assert int8.row_scale == "float32" and int8.layer_shapes[0] == (2, 4, 2, 20) and int8.block_bytes == 640
    assert fp8.row_scale is None and fp8.block_bytes == 512
    latent = KVBlockLayout.from_spec(LatentKVCacheSpec(2, 1, 40, torch.float32, latent_dim=32), 4)
    assert latent.latent and latent.layer_shapes == ((4, 40),) * 2 and latent.block_bytes == 2 * 4 * 40 * 4
    head = KVBlockLayout.from_spec(dataclasses.replace(spec, num_layers=1), 4)
    drafted = plain.with_draft(head)
    assert drafted.block_bytes == 2048 + 1024 and [len(p.layer_shapes) for p in drafted.parts()] == [2, 1]
    prints = {x.fingerprint(*ident) for x in (plain, int8, fp8, latent, drafted)}
    assert len(prints) == 5

    from portside.spec_decode.config import SpeculativeConfig

    class Config:  # the fields extra_identity reads
        model = type("M", (), {"quantization": None})()
        speculative = None

    assert extra_identity(Config()) == ()
    ids = set()
    for method, model in (("eagle", "/heads/a"), ("eagle", "/heads/b"), ("mtp", None)):
        Config.speculative = SpeculativeConfig(method=method, num_speculative_tokens=2, model=model)
        ids.add(drafted.fingerprint(*ident, *extra_identity(Config())))
    Config.speculative = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    assert extra_identity(Config()) == ()  # prompt lookup keeps no KV of its own
    assert len(ids) == 3
