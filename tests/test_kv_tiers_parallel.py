"""KV tiers under tensor and pipeline parallelism (docs/kv_tiers.md): every rank keeps its part of
each block (its KV heads, its stage's layers) at the slots and hashes the one scheduler half
assigns, in its own host buffer and its own disk folder; the executor merges the ranks' reports
(a load is done when every rank's is, good blocks = the fewest any rank has).

Pure-Python parts first (the merge, the info of several ranks, a restart's index over the ranks'
folders), then engines over real worker processes and gloo on cpu (TP = 2, and PP = 2): greedy
tokens with the host tier, swap preemption and a restarted disk tier identical to the same
parallel layout without a tier, and a block damaged on one rank only recomputed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from portside import LLM, SamplingParams
from portside.kv_transfer import disk_format
from portside.kv_transfer.base import KVConnectorOutput, KVTransferInfo
from portside.kv_transfer.config import KVTransferConfig
from portside.kv_transfer.ranks import KVOutputAggregator
from portside.kv_transfer.tiers import TiersScheduler
from portside.testing.engine_parity import random_prompts
from portside.testing.kv_replay import check_books, replay

MAX_TOKENS = 6
PROMPTS = random_prompts(5, [44] * 6)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


# ---- pure Python -------------------------------------------------------------------------------


def test_a_load_finishes_when_every_rank_has_with_the_fewest_good_blocks():
    agg = KVOutputAggregator(2)
    # rank 0 finishes "a" (all good) and "b" (2 good) first; rank 1 reports nothing yet
    assert agg.aggregate([KVConnectorOutput({"a", "b"}, {"b": 2}, {"load_bytes": 10.0, "loads": 2.0}), None]) == \
        KVConnectorOutput(set(), {}, {"load_bytes": 10.0, "loads": 2.0})
    assert agg.num_partial == 2
    # rank 1 finishes "a" with only 1 good block (a damaged file on its side) and "b" whole
    out = agg.aggregate([None, KVConnectorOutput({"a", "b"}, {"a": 1}, {"load_bytes": 6.0, "loads": 2.0,
                                                                           "corrupt_blocks": 1.0})])
    assert out is not None and out.finished_loading == {"a", "b"} and out.failed_loading == {"a": 1, "b": 2}
    assert out.stats == {"load_bytes": 6.0, "corrupt_blocks": 1.0}  # counts are rank 0's; bytes, damaged files summed
    assert agg.num_partial == 0 and agg.aggregate([None, None]) is None
    with pytest.raises(ValueError, match="expected 2 ranks"):
        agg.aggregate([None])


def test_the_info_of_several_ranks_names_each_part():
    one = KVTransferInfo(100, "fp0")
    assert KVTransferInfo.combine([one]) is one and one.parts == (("fp0", 100),)
    both = KVTransferInfo.combine([one, KVTransferInfo(60, "fp1")])
    assert both.block_bytes == 160 and both.parts == (("fp0", 100), ("fp1", 60))
    assert both.fingerprint not in ("fp0", "fp1")
    assert KVTransferInfo.combine([one, KVTransferInfo(60, "fp2")]).fingerprint != both.fingerprint


def test_a_restart_indexes_only_blocks_every_rank_has_and_deletes_the_rest(tmp_path):
    info = KVTransferInfo.combine([KVTransferInfo(8, "rank0"), KVTransferInfo(8, "rank1")])
    config = KVTransferConfig(cpu_bytes=4 * 16, disk_path=str(tmp_path), disk_bytes=1 << 20)
    folders = [disk_format.folder(str(tmp_path), fp) for fp, _ in info.parts]
    blocks = {1: (None, (1, 2)), 2: (1, (3, 4)), 3: (2, (5, 6))}
    for h, (parent, tokens) in blocks.items():
        for rank, folder in enumerate(folders):
            if h == 3 and rank == 1:
                continue  # block 3 has only rank 0's part: unusable
            disk_format.write(disk_format.path_of(folder, h), f"rank{rank}", h, parent, tokens, bytes(8))
    tiers = TiersScheduler(config, 2, info)
    assert tiers.num_host_slots == 4  # 64 bytes: 4 blocks of both ranks' 8 + 8
    assert set(tiers.entries) == {1, 2} and tiers.disk_dirs == folders
    assert not os.path.exists(disk_format.path_of(folders[0], 3))  # the orphan part is deleted
    tiers.check_integrity()


# ---- engines over worker processes ----------------------------------------------------------------


def _llm(path: Path, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 24)
    return LLM(model=str(path), device="cpu", max_model_len=64, block_size=4, **kwargs)


def _replay(llm: LLM, rounds: int = 2) -> tuple[list[list[int]], list[int]]:
    return replay(llm, PROMPTS, GREEDY, rounds)


def _check_books(llm: LLM) -> dict[str, float]:
    stats = check_books(llm)
    assert llm.engine.executor._kv_outputs.num_partial == 0  # every rank reported every load
    return stats


@pytest.fixture(scope="module")
def tp2_baseline(tiny_llama: Path) -> list[list[int]]:
    llm = _llm(tiny_llama, tensor_parallel_size=2)
    tokens, cached = _replay(llm)
    assert cached[len(PROMPTS):] == [0] * len(PROMPTS)  # the device cache alone keeps none of them
    llm.engine.shutdown()
    return tokens


@pytest.mark.slow  # starts worker processes (CI's legs run it)
def test_tp2_host_and_disk_tiers_restart_warm_and_a_block_damaged_on_one_rank_is_recomputed(
        tiny_llama, tp2_baseline, tmp_path):
    tiers = dict(kv_offload_cpu_bytes=1 << 20, kv_offload_disk_path=str(tmp_path), kv_offload_disk_bytes=1 << 20)
    llm = _llm(tiny_llama, tensor_parallel_size=2, **tiers)
    tokens, cached = _replay(llm)
    assert tokens == tp2_baseline
    assert cached[len(PROMPTS):] == [40] * len(PROMPTS)  # 10 of 11 blocks loaded back, on both ranks
    stats = _check_books(llm)
    assert stats["host_hit_blocks"] == 10 * len(PROMPTS) and stats["loads"] == len(PROMPTS)
    assert stats["host_capacity_bytes"] == (1 << 20) // 2048 * 2048  # a block is both ranks' 1024 bytes
    folders = llm.engine.scheduler.kv_loads.connector.disk_dirs
    assert len(folders) == 2 and folders[0] != folders[1]
    # push the host tier's blocks to disk: a small host tier in front of the same folder
    llm.engine.shutdown()
    del llm
    small = dict(tiers, kv_offload_cpu_bytes=8 * 2048)
    writer = _llm(tiny_llama, tensor_parallel_size=2, **small)
    _replay(writer, rounds=1)
    assert _check_books(writer)["disk_saved_blocks"] > 0
    writer.engine.shutdown()
    del writer
    names = [sorted(p.name for p in Path(f).glob("*.kvb")) for f in folders]
    assert names[0] and names[0] == names[1]  # each rank wrote its part of the same blocks

    # a restart with the same layout starts warm; the first prompt's rank-1 parts are damaged
    restarted = _llm(tiny_llama, tensor_parallel_size=2, **small)
    connector = restarted.engine.scheduler.kv_loads.connector
    assert connector.disk_dirs == folders and len(connector.disk_lru) == len(names[0])
    hashes = restarted.engine.scheduler.kv.block_hashes(_request_like(PROMPTS[1]), 10)
    damaged = 0
    for h in hashes:
        path = disk_format.path_of(folders[1], h)
        if os.path.exists(path):
            data = bytearray(Path(path).read_bytes())
            data[-5] ^= 0xFF
            Path(path).write_bytes(bytes(data))
            damaged += 1
    assert damaged > 0
    outs = [restarted.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0] for p in PROMPTS[:2]]
    assert [list(o.outputs[0].token_ids) for o in outs] == tp2_baseline[:2]
    stats = _check_books(restarted)
    assert stats["disk_hit_blocks"] > 0 and outs[0].num_cached_tokens > 0
    assert stats["corrupt_blocks"] >= 1 and stats["failed_load_blocks"] >= 1
    restarted.engine.shutdown()


def _request_like(prompt: list[int]):
    from portside.request import Request

    return Request(request_id="probe", prompt_token_ids=prompt, sampling_params=GREEDY, eos_token_id=None)


@pytest.mark.slow
def test_tp2_swap_preemption_resumes_with_identical_tokens(tiny_llama):
    """Five ~37-token prompts over 20 blocks: some are preempted; swap brings their blocks back."""
    prompts = random_prompts(7, [38, 35, 40, 33, 37])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = {}
    for mode in ("recompute", "swap"):
        llm = _llm(tiny_llama, tensor_parallel_size=2, num_kv_blocks=20, max_num_batched_tokens=16,
                   preemption_mode=mode, swap_space=0.001)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.engine.stats().num_preemptions > 0
        stats = _check_books(llm) if mode == "swap" else llm.engine.stats().kv_transfer
        runs[mode] = ([list(o.outputs[0].token_ids) for o in outs], stats)
        llm.engine.shutdown()
    assert runs["swap"][0] == runs["recompute"][0]
    assert runs["swap"][1]["swapped_out_blocks"] > 0
    assert runs["swap"][1]["preemption_recomputed_tokens"] < runs["recompute"][1]["preemption_recomputed_tokens"]


@pytest.mark.slow
def test_pp2_host_tier_loads_each_stages_layers(tmp_path_factory):
    from portside.testing.tiny import make_tiny_model

    # 3 layers: an uneven split, so the stages' parts of a block differ in size
    path = make_tiny_model(tmp_path_factory.mktemp("pp_tiers"), "llama", num_hidden_layers=3)
    off = _llm(path, pipeline_parallel_size=2)
    baseline, _ = _replay(off)
    off.engine.shutdown()
    llm = _llm(path, pipeline_parallel_size=2, kv_offload_cpu_bytes=1 << 20)
    tokens, cached = _replay(llm)
    assert tokens == baseline
    assert cached[len(PROMPTS):] == [40] * len(PROMPTS)
    stats = _check_books(llm)
    assert stats["host_hit_blocks"] == 10 * len(PROMPTS)
    info = llm.engine.scheduler.kv_loads.connector.info
    assert sorted(b for _, b in info.parts) == [1024, 2048] and info.block_bytes == 3072  # 1 + 2 layers
    llm.engine.shutdown()


@pytest.mark.slow
def test_tp2_shared_storage_each_rank_loads_its_own_files(tiny_llama, tp2_baseline, tmp_path):
    """One TP=2 engine as producer and consumer of a directory: each rank writes its part of each
    prompt block in its own folder; after a prefix-cache reset the blocks load back from there, and
    a block damaged on rank 1 only stops the load at it (recomputed on both ranks)."""
    from portside.kv_cache.hashing import hash_full_blocks

    llm = _llm(tiny_llama, tensor_parallel_size=2, kv_connector="shared_storage", kv_role="both",
               kv_connector_path=str(tmp_path))
    engine = llm.engine
    folders = engine.scheduler.kv_loads.connector.folders
    assert len(folders) == 2 and folders[0] != folders[1]
    for i in range(2):
        out = llm.generate([{"prompt_token_ids": PROMPTS[i]}], GREEDY, use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == tp2_baseline[i]
    names = [sorted(p.name for p in Path(f).glob("*.kvb")) for f in folders]
    assert len(names[0]) == 2 * (44 // 4) and names[0] == names[1]
    engine.reset_prefix_cache()
    third = hash_full_blocks(PROMPTS[1], 4, [])[2]
    victim = Path(disk_format.path_of(folders[1], third))
    victim.write_bytes(victim.read_bytes()[:-10])  # truncated on rank 1 only
    loads = engine.scheduler.kv_loads
    for i, expect_loaded in ((0, 40), (1, 2 * 4)):
        before = loads.num_loaded_tokens
        out = llm.generate([{"prompt_token_ids": PROMPTS[i]}], GREEDY, use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == tp2_baseline[i]
        assert loads.num_loaded_tokens - before == expect_loaded
    stats = loads.connector.stats()
    assert stats["corrupt_blocks"] == 1 and engine.executor._kv_outputs.num_partial == 0
    engine.scheduler.check_integrity()
    engine.shutdown()


LAUNCHED_RANK0 = """
import json, sys
from portside import LLM, SamplingParams
llm = LLM(model=sys.argv[1], device="cpu", tensor_parallel_size=2, max_model_len=64, block_size=4, num_kv_blocks=24,
          kv_offload_cpu_bytes=1 << 20)
greedy = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[3]), ignore_eos=True)
tokens, cached = [], []
for _ in range(2):
    for p in json.loads(sys.argv[2]):
        out = llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)[0]
        tokens.append(list(out.outputs[0].token_ids))
        cached.append(out.num_cached_tokens)
print("RESULT", json.dumps([tokens, cached, llm.engine.stats().kv_transfer["host_hit_blocks"]]))
llm.engine.shutdown()
"""


@pytest.mark.slow
def test_tp2_launched_world_merges_the_ranks_loads(tiny_llama, tp2_baseline):
    """A torchrun-style world (rank 0 the engine, rank 1 `python -m portside.distributed.worker`):
    rank 1's connector reports come back over the gloo control group after each step."""
    import json
    import subprocess
    import sys

    from portside.distributed.env import free_port

    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    worker = subprocess.Popen([sys.executable, "-m", "portside.distributed.worker", "--device", "cpu"],
                              env={**base, "RANK": "1", "LOCAL_RANK": "1"}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        engine = subprocess.run([sys.executable, "-c", LAUNCHED_RANK0, str(tiny_llama), json.dumps(PROMPTS),
                                 str(MAX_TOKENS)], env={**base, "RANK": "0", "LOCAL_RANK": "0"}, capture_output=True,
                                text=True, timeout=300)
        assert engine.returncode == 0, engine.stderr[-3000:]
        assert worker.wait(timeout=30) == 0, worker.stdout.read()[-3000:]
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    (line,) = [x for x in engine.stdout.splitlines() if x.startswith("RESULT ")]
    tokens, cached, hits = json.loads(line.split(" ", 1)[1])
    assert tokens == tp2_baseline
    assert cached[len(PROMPTS):] == [40] * len(PROMPTS) and hits == 10 * len(PROMPTS)
