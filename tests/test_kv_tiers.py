"""KV tiers behind the device cache (docs/kv_tiers.md): host memory and disk, swap preemption.

A tiny random-weight Llama with 4-token blocks and a 24-block device cache that holds about two
of six 44-token conversations: replayed round-robin, every later replay misses the device cache.
With the host tier its blocks come back from host memory (greedy tokens equal to the tier-off
run and to transformers'); with a disk tier a new engine on the same folder starts warm; a block
file corrupted on purpose is detected, counted and recomputed; swap preemption resumes with the
same tokens and fewer recomputed tokens than recompute mode. No block leaks (check_integrity).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from portside import LLM, SamplingParams
from portside.kv_transfer import disk_format
from portside.kv_transfer.config import resolve_kv_transfer_config
from portside.testing.engine_parity import random_prompts
from portside.testing.hf_oracle import hf_greedy
from portside.testing.kv_replay import check_books, replay

MAX_TOKENS = 6
PROMPTS = random_prompts(5, [44] * 6)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _llm(path: Path, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 24)
    return LLM(model=str(path), device="cpu", max_model_len=64, block_size=4, **kwargs)


def _replay(llm: LLM, rounds: int = 2) -> tuple[list[list[int]], list[int]]:
    return replay(llm, PROMPTS, GREEDY, rounds)


_check_books = check_books


@pytest.fixture(scope="module")
def baseline(tiny_llama: Path) -> list[list[int]]:
    tokens, cached = _replay(_llm(tiny_llama))
    assert cached[len(PROMPTS):] == [0] * len(PROMPTS)  # the device cache alone keeps none of them
    return tokens


def test_host_tier_loads_evicted_prefixes_with_identical_greedy_tokens(tiny_llama, baseline):
    llm = _llm(tiny_llama, kv_offload_cpu_bytes=1 << 20)
    tokens, cached = _replay(llm)
    assert tokens == baseline
    assert cached[len(PROMPTS):] == [40] * len(PROMPTS)  # 10 of 11 blocks loaded (the last token is computed)
    for prompt, toks in zip(PROMPTS, tokens[: len(PROMPTS)], strict=True):
        assert toks == hf_greedy(tiny_llama, prompt, MAX_TOKENS)
    stats = _check_books(llm)
    assert stats["host_hit_blocks"] == 10 * len(PROMPTS) and stats["loaded_tokens"] == 40 * len(PROMPTS)
    assert stats["load_bytes"] > 0 and stats["loads"] == len(PROMPTS)


def test_a_small_host_tier_keeps_the_most_recent_blocks(tiny_llama, baseline):
    """Room for 15 blocks of 66 evicted: LRU keeps the latest prompt's, hits stay correct."""
    llm = _llm(tiny_llama, kv_offload_cpu_bytes=15 * 2048)
    tokens, _ = _replay(llm)
    assert tokens == baseline
    stats = _check_books(llm)
    assert stats["host_blocks"] == 15 and stats["host_bytes"] == 15 * 2048


def test_disk_tier_starts_a_new_engine_warm_and_drops_a_corrupt_block(tiny_llama, baseline, tmp_path):
    disk = dict(kv_offload_cpu_bytes=8 * 2048, kv_offload_disk_path=str(tmp_path), kv_offload_disk_bytes=1 << 20)
    first = _llm(tiny_llama, **disk)
    tokens, _ = _replay(first, rounds=1)
    assert tokens == baseline[: len(PROMPTS)]
    assert _check_books(first)["disk_saved_blocks"] > 0
    first.engine.shutdown()
    del first

    # a restart: the index is rebuilt from the files; the first prompt's blocks are on disk
    (folder,) = [p for p in tmp_path.iterdir() if p.name.startswith("portside-kv-")]
    assert len(list(folder.glob("*.kvb"))) > 0
    second = _llm(tiny_llama, **disk)
    out = second.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == baseline[0] and out.num_cached_tokens > 0
    stats = _check_books(second)
    assert stats["disk_hit_blocks"] > 0 and stats["corrupt_blocks"] == 0

    # flip payload bytes of every file of the second prompt: detected at load, counted, recomputed
    third = _llm(tiny_llama, **disk)
    hashes = third.engine.scheduler.kv.block_hashes(_request_like(PROMPTS[1]), 10)
    damaged = 0
    for h in hashes:
        path = disk_format.path_of(str(folder), h)
        if os.path.exists(path):
            data = bytearray(Path(path).read_bytes())
            data[-5] ^= 0xFF
            Path(path).write_bytes(bytes(data))
            damaged += 1
    assert damaged > 0
    out = third.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == baseline[1]
    stats = _check_books(third)
    assert stats["corrupt_blocks"] >= 1 and stats["failed_load_blocks"] >= 1


def _request_like(prompt: list[int]):
    from portside.request import Request

    return Request(request_id="probe", prompt_token_ids=prompt, sampling_params=GREEDY, eos_token_id=None)


def test_another_model_never_reads_the_files(tiny_llama, tmp_path, tmp_path_factory):
    from portside.testing.tiny import make_tiny_model

    other = make_tiny_model(tmp_path_factory.mktemp("other_llama"), "llama", seed=1)
    disk = dict(kv_offload_cpu_bytes=4 * 2048, kv_offload_disk_path=str(tmp_path), kv_offload_disk_bytes=1 << 20)
    llm = _llm(tiny_llama, **disk)
    _replay(llm, rounds=1)
    del llm
    llm = _llm(other, **disk)
    assert llm.engine.scheduler.kv_loads.connector.entries == {}
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("portside-kv-")]) == 2


def test_swap_preemption_resumes_with_identical_tokens_and_recomputes_less(tiny_llama):
    """Five 40-token prompts over 20 blocks: some are preempted. Swap loads their blocks back."""
    prompts = random_prompts(7, [38, 35, 40, 33, 37])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = {}
    for mode in ("recompute", "swap"):
        llm = _llm(tiny_llama, num_kv_blocks=20, max_num_batched_tokens=16, preemption_mode=mode, swap_space=0.001)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = _check_books(llm)
        assert llm.engine.stats().num_preemptions > 0
        runs[mode] = ([list(o.outputs[0].token_ids) for o in outs], stats)
    assert runs["swap"][0] == runs["recompute"][0]
    for prompt, toks in zip(prompts, runs["swap"][0], strict=True):
        assert toks == hf_greedy(tiny_llama, prompt, 12)
    assert runs["swap"][1]["swapped_out_blocks"] > 0
    assert runs["swap"][1]["preemption_recomputed_tokens"] < runs["recompute"][1]["preemption_recomputed_tokens"]


def test_flags_resolve_and_bad_combinations_are_refused():
    assert resolve_kv_transfer_config() is None
    swap = resolve_kv_transfer_config(preemption_mode="swap")
    assert swap is not None and swap.cpu_bytes == 4 * 2**30 and swap.option("swap") == "1"
    assert resolve_kv_transfer_config(preemption_mode="swap", swap_space=1).cpu_bytes == 2**30
    with pytest.raises(ValueError, match="needs --kv-offload-cpu-bytes"):
        resolve_kv_transfer_config(disk_path="/tmp/x", disk_bytes=100)
    with pytest.raises(ValueError, match="needs --kv-offload-disk-bytes"):
        resolve_kv_transfer_config(cpu_bytes=100, disk_path="/tmp/x")
    with pytest.raises(ValueError, match="one KV connector"):
        resolve_kv_transfer_config(cpu_bytes=1 << 20, connector="shared_storage")
    with pytest.raises(ValueError, match="unknown preemption mode"):
        resolve_kv_transfer_config(preemption_mode="swapp")


def test_prefix_caching_off_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="enable prefix caching"):
        _llm(tiny_llama, kv_offload_cpu_bytes=1 << 20, enable_prefix_caching=False)


def test_blocks_saved_by_one_backend_load_into_another_layout():
    """The neutral layout: blocks read from core's reference cache ([2, blocks, tokens, heads, dim])
    load into the example NPU plugin's block-major cache ([blocks, 2, heads, tokens, dim]) and read
    back there, slot for slot, as the same K and V."""
    import sys
    import warnings

    import torch

    from portside.attention.reference import ReferenceAttentionBackend
    from portside.contract import KVBlockIO, KVBlockLayout, KVCacheSpec

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "npu_example"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from portside_npu_example.attention import NpuExampleAttentionBackend
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    layout = KVBlockLayout.from_spec(spec, block_size=4)
    ref, npu = ReferenceAttentionBackend(), NpuExampleAttentionBackend()
    ref_caches = [torch.zeros(ref.cache_shape(6, 4, 2, 8, torch.bfloat16), dtype=torch.bfloat16) for _ in range(2)]
    npu_caches = [torch.zeros(npu.cache_shape(6, 4, 2, 8, torch.bfloat16), dtype=torch.bfloat16) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    for cache in ref_caches:
        slots = torch.arange(24)
        ref.write_kv(cache, torch.randn(24, 2, 8, generator=gen), torch.randn(24, 2, 8, generator=gen), slots)
    saved = KVBlockIO(ref, layout).read(ref_caches, [1, 4])
    assert saved[0].numel() * saved.element_size() == layout.block_bytes == 2 * 2 * 4 * 2 * 8 * 2
    payload = saved.reshape(2, -1).view(torch.uint8).clone()  # what a tier stores
    KVBlockIO(npu, layout).write(npu_caches, [5, 0], payload)
    for layer in range(2):
        for src, dst in ((1, 5), (4, 0)):
            k_ref, v_ref = ref.read_kv(ref_caches[layer], torch.arange(src * 4, src * 4 + 4))
            k_npu, v_npu = npu.read_kv(npu_caches[layer], torch.arange(dst * 4, dst * 4 + 4))
            assert torch.equal(k_ref, k_npu) and torch.equal(v_ref, v_npu)


def test_abort_while_loading_releases_the_blocks_once_the_load_lands(tiny_llama):
    llm = _llm(tiny_llama, kv_offload_cpu_bytes=1 << 20)
    _replay(llm, rounds=1)  # the first prompts' blocks are in the host tier now
    engine, sched = llm.engine, llm.engine.scheduler
    engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
    so = sched.schedule()  # admits nothing: the request waits for its blocks, which it holds for the load
    assert so.is_empty and list(sched.kv_loads.loads) and sched.kv.external_holds
    engine.abort_request("a")  # while the load is in flight: the blocks stay held until it lands
    assert sched.kv.external_holds
    for _ in range(50):
        sched.update_from_output(so, engine.executor.execute_model(so))
        if not sched.kv_loads.loads:
            break
        so = sched.schedule()
    assert not engine.has_unfinished_requests()
    _check_books(llm)


def test_cli_flags_reach_the_engine_config(tiny_llama):
    from portside.cli import build_parser, parse_args
    from portside.engine.args import EngineArgs
    from portside.engine.args_cli import engine_kwargs
    from portside.platform import resolve_platform

    args = parse_args(build_parser(), ["serve", str(tiny_llama), "--preemption-mode", "swap", "--swap-space", "0.5",
                                       "--kv-offload-disk-path", "/tmp/kv", "--kv-offload-disk-bytes", "1e6"])
    kwargs = engine_kwargs(args)
    config = EngineArgs(model=str(tiny_llama), **kwargs).create_engine_config(resolve_platform("cpu"))
    kvt = config.kv_transfer
    assert kvt is not None and kvt.cpu_bytes == 2**29 and kvt.disk_path == "/tmp/kv" and kvt.disk_bytes == 10**6
    assert kvt.option("swap") == "1"


def test_prometheus_series_of_the_tiers():
    from portside.engine.stats import EngineStats
    from portside.server.metrics import ServerMetrics

    stats = EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_used_blocks=0, num_total_blocks=1,
                        prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0, prompt_tokens_total=0,
                        generation_tokens_total=0,
                        kv_transfer={"host_hit_blocks": 3, "disk_hit_blocks": 2, "corrupt_blocks": 1, "load_bytes": 4096,
                                     "load_seconds": 0.5, "loads": 2, "preemption_recomputed_tokens": 7})
    text = ServerMetrics(lambda: stats, lambda: 0).render().decode()
    for line in ('portside_kv_tier_hit_blocks_total{tier="host"} 3.0', 'portside_kv_tier_hit_blocks_total{tier="disk"} 2.0',
                 "portside_kv_tier_corrupt_blocks_total 1.0", "portside_kv_transfer_load_bytes_total 4096.0",
                 "portside_kv_transfer_throughput_bytes_per_second 8192.0",
                 "portside_preemption_recomputed_tokens_total 7.0"):
        assert line in text, line


def test_a_load_overlaps_the_steps_of_running_requests(tiny_llama):
    """The step that starts a request's load also runs the others, and the runner returns
    before the load lands (it runs on the loader thread): the waiting request is admitted a
    later step, with the loaded tokens cached."""
    llm = _llm(tiny_llama, kv_offload_cpu_bytes=1 << 20)
    _replay(llm, rounds=1)
    engine, sched = llm.engine, llm.engine.scheduler
    engine.add_request("b", {"prompt_token_ids": PROMPTS[5][:20]}, SamplingParams(temperature=0.0, max_tokens=30,
                                                                                  ignore_eos=True))
    engine.step()
    engine.step()  # b decodes
    engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
    so = sched.schedule()
    assert "b" in so.num_scheduled_tokens and "a" not in so.num_scheduled_tokens
    assert list(so.kv_connector_metadata.loads) == ["a"]
    sched.update_from_output(so, engine.executor.execute_model(so))
    while "a" not in {r.request_id for r in sched.running}:
        engine.step()
    assert sched.requests["a"].num_cached_tokens == 40
    while engine.has_unfinished_requests():
        engine.step()
    _check_books(llm)


def test_the_host_index_never_reuses_a_slot_being_loaded_from():
    """Pure Python: two host slots; while a request's load reads both, a third evicted block finds
    no slot (not saved); once the load is reported, LRU eviction resumes."""
    from portside.kv_cache.manager import KVCacheManager
    from portside.kv_transfer.base import KVConnectorOutput, KVTransferInfo
    from portside.kv_transfer.config import KVTransferConfig
    from portside.kv_transfer.tiers import TiersScheduler

    kv = KVCacheManager(num_blocks=8, block_size=4)
    tiers = TiersScheduler(KVTransferConfig(cpu_bytes=2 * 100), 4, KVTransferInfo(100, "fp"))
    tiers.bind(kv)
    req = _request_like(list(range(10, 23)))  # 13 tokens: 3 full blocks, 2 loadable (never the last token)
    hashes = kv.block_hashes(req, 3)
    blocks = [tuple(range(10 + 4 * i, 14 + 4 * i)) for i in range(3)]
    for i in (1, 0):  # tail first, as the pool evicts
        tiers.on_evict(i, hashes[i], hashes[i - 1] if i else None, blocks[i])
    assert tiers.get_num_new_matched_tokens(req, 0) == 8
    tiers.update_state_after_alloc(req, [5, 6], 8)
    meta = tiers.build_connector_meta(None)
    assert [op[0] for op in meta.ops] == ["save", "save"] and meta.loads["probe"] == [(5, "host", 1), (6, "host", 0)]
    tiers.on_evict(2, hashes[2], hashes[1], blocks[2])  # both slots pinned: not kept
    assert tiers.build_connector_meta(None) is None and hashes[2] not in tiers.entries
    tiers.update_connector_output(KVConnectorOutput(finished_loading={"probe"}))
    tiers.on_evict(2, hashes[2], hashes[1], blocks[2])  # now the least recently used slot is reused
    assert [op[:2] for op in tiers.build_connector_meta(None).ops] == [("save", 2)]
    assert hashes[2] in tiers.entries and len(tiers.entries) == 2
    tiers.check_integrity()


def test_sleep_lets_go_of_the_tier_and_wake_up_serves_identical_tokens(tiny_llama, baseline):
    """Sleep drops the KV cache: the connector's worker (which holds the caches and the host
    buffer) is stopped and let go of, the index is reset, and the worker built on wake-up serves the
    same greedy tokens (the first replay recomputes: nothing stored before sleep is loaded)."""
    llm = _llm(tiny_llama, kv_offload_cpu_bytes=1 << 20)
    _replay(llm, rounds=1)
    runner = llm.engine.executor.runner
    old = runner.kv_transfer.worker
    assert old is not None and old._thread.is_alive()
    llm.sleep(1)
    assert runner.kv_transfer.worker is None and not old._thread.is_alive()
    llm.wake_up()
    assert runner.kv_transfer.worker is not None and runner.kv_transfer.worker is not old
    tokens, cached = _replay(llm)
    assert tokens == baseline
    assert cached[: len(PROMPTS)] == [0] * len(PROMPTS)  # nothing from before sleep came back
    assert any(cached[len(PROMPTS):])  # the new worker's host tier serves the second replay
    _check_books(llm)


def test_after_a_weight_update_no_block_reaches_the_disk(tiny_llama, baseline, tmp_path):
    """RL: KV computed with updated weights must never be stored where a server restarted on the
    checkpoint would load it. The update drops what the tiers hold (files removed) and closes the
    disk tier; a new engine on the checkpoint and the same folder starts cold, with its tokens."""
    from safetensors.torch import load_file

    disk = dict(kv_offload_cpu_bytes=8 * 2048, kv_offload_disk_path=str(tmp_path), kv_offload_disk_bytes=1 << 20)
    first = _llm(tiny_llama, **disk)
    _replay(first, rounds=1)
    weights = load_file(str(tiny_llama / "model.safetensors"))
    first.update_weights([(name, t * 1.25) for name, t in weights.items() if name.endswith("mlp.up_proj.weight")])
    updated, _ = _replay(first, rounds=2)
    assert updated[: len(PROMPTS)] != baseline[: len(PROMPTS)]  # the update changed the model
    _check_books(first)
    first.engine.shutdown()
    del first
    (folder,) = [p for p in tmp_path.iterdir() if p.name.startswith("portside-kv-")]
    assert not list(folder.glob("*.kvb"))
    second = _llm(tiny_llama, **disk)
    tokens, cached = _replay(second, rounds=1)
    assert tokens == baseline[: len(PROMPTS)] and cached == [0] * len(PROMPTS)
