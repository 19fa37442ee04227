"""KV events for routers: the block pool's stored / removed / cleared reports, and the engine's ZeroMQ
publisher read by a subscriber written from docs/kv_events.md with pyzmq and msgpack alone (no
portside decoder): what it receives matches the blocks the engine's prefix cache holds, and the
replay socket resends the batches it asks for."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from portside.kv_cache.block_pool import BlockPool
from portside.kv_cache.hashing import hash_full_blocks
from portside.kv_cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventRecorder

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

U64 = (1 << 64) - 1


def test_pool_reports_stores_evictions_and_resets_merging_runs() -> None:
    pool = BlockPool(3)
    pool.events = rec = KVEventRecorder(block_size=2)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(a, 11, None, (1, 2), lora_id=7)
    pool.cache_block(b, 12, 11, (3, 4), lora_id=7)  # continues the chain: same event
    pool.cache_block(c, 13, None, (5, 6))  # a new chain
    assert rec.drain() == [BlockStored([11, 12], None, [1, 2, 3, 4], 2, 7), BlockStored([13], None, [5, 6], 2, None)]
    pool.free_blocks([c, b, a])
    pool.get_new_blocks(2)  # evicts the least recently freed cached blocks: c, then b
    assert rec.drain() == [BlockRemoved([13, 12])]
    pool.reset_prefix_cache()  # a is still cached: one clear, no removal
    assert rec.drain() == [AllBlocksCleared()]
    assert rec.drain() == []
    pool.check_integrity()


def test_config_json_shorthands_and_errors() -> None:
    from portside.engine.kv_events import KVEventsConfig, offset_endpoint, resolve_kv_events_config

    assert resolve_kv_events_config(None) is None
    assert resolve_kv_events_config('{"enable_kv_cache_events": false}') is None
    cfg = resolve_kv_events_config('{"enable_kv_cache_events": true, "topic": "kv"}')
    assert cfg == KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", topic="kv")
    cfg = resolve_kv_events_config(None, publisher="zmq", endpoint="tcp://*:6000")
    assert cfg is not None and cfg.endpoint == "tcp://*:6000" and cfg.enable_kv_cache_events
    assert resolve_kv_events_config(None, publisher="null") is None
    with pytest.raises(ValueError, match="unknown key.*endpont.*known: .*endpoint"):
        resolve_kv_events_config('{"endpont": "tcp://*:1"}')
    with pytest.raises(ValueError, match="not valid JSON"):
        resolve_kv_events_config("{enable")
    with pytest.raises(ValueError, match="publisher 'kafka' is unknown"):
        resolve_kv_events_config({"enable_kv_cache_events": True, "publisher": "kafka"})
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("ipc:///tmp/ev", 1) == "ipc:///tmp/ev_dp1"
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"


def test_cli_flags_reach_engine_args() -> None:
    import argparse

    from portside.engine.args_cli import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--kv-events-config", '{"enable_kv_cache_events": true}', "--kv-events-publisher", "zmq",
                              "--kv-events-endpoint", "tcp://*:7000"])
    kwargs = engine_kwargs(args)
    assert kwargs["kv_events_config"] == '{"enable_kv_cache_events": true}'
    assert (kwargs["kv_events_publisher"], kwargs["kv_events_endpoint"]) == ("zmq", "tcp://*:7000")


# ---- the subscriber: written from docs/kv_events.md ---------------------------------------------


class Subscriber:
    """SUB socket on the event stream, DEALER on the replay socket."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.replay = self.ctx.socket(zmq.DEALER)
        self.replay.connect(replay_endpoint)
        self.topic = topic

    def receive(self, timeout_ms: int = 2000) -> list[tuple[int, bytes]]:
        """Every (sequence number, payload) until none arrives for `timeout_ms`."""
        got = []
        while self.sub.poll(timeout_ms):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == self.topic.encode() and len(seq) == 8
            got.append((int.from_bytes(seq, "big"), payload))
        return got

    def replay_from(self, start: int) -> list[tuple[int, bytes]]:
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            assert self.replay.poll(5000), "no replay answer"
            empty, seq, payload = self.replay.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                return got
            got.append((int.from_bytes(seq, "big"), payload))

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def decode(payload: bytes, encoding: str) -> tuple[float, list[dict[str, Any]], int]:
    """One batch as [ts, events, data_parallel_rank]; events as {"type": ..., fields}."""
    ts, events, rank = msgpack.unpackb(payload)
    if encoding == "array":  # [name, field, ...] in the documented order
        order = {"BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"],
                 "BlockRemoved": ["block_hashes", "medium"], "AllBlocksCleared": []}
        events = [{"type": e[0], **dict(zip(order[e[0]], e[1:], strict=True))} for e in events]
    return ts, events, rank


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_subscriber_sees_what_the_prefix_cache_holds(tiny_llama: Path, tmp_path: Path, encoding: str) -> None:
    from portside.engine.llm_engine import LLMEngine
    from portside.sampling_params import SamplingParams

    endpoint, replay = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay"
    config = {"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay, "topic": "kv",
              "encoding": encoding}
    # 16 blocks of 4 tokens: each 30-token prompt fills 7 full blocks and more, so the next evicts
    engine = LLMEngine.from_args(model=str(tiny_llama), device="cpu", max_model_len=64, block_size=4, num_kv_blocks=16,
                                 kv_events_config=config)
    sub = Subscriber(endpoint, replay, "kv")
    try:
        time.sleep(0.3)  # the subscription reaches the PUB socket (ZeroMQ's slow joiner)
        prompts = [[(7 * r + i) % 300 + 3 for i in range(30)] for r in range(3)]
        params = SamplingParams(max_tokens=3, temperature=0.0)
        for r, prompt in enumerate(prompts):
            engine.add_request(f"r{r}", {"prompt_token_ids": prompt}, params)
            while engine.has_unfinished_requests():
                engine.step()
        batches = sub.receive()
        assert [seq for seq, _ in batches] == list(range(len(batches))) and batches

        held: dict[int, list[int]] = {}
        removed = 0
        for _, payload in batches:
            _, events, rank = decode(payload, encoding)
            assert rank == 0
            for ev in events:
                if ev["type"] == "BlockStored":
                    assert ev["block_size"] == 4 and ev["medium"] == "GPU" and ev["lora_id"] is None
                    toks = ev["token_ids"]
                    assert len(toks) == 4 * len(ev["block_hashes"])
                    for i, h in enumerate(ev["block_hashes"]):
                        assert 0 <= h <= U64 and h not in held
                        held[h] = toks[4 * i : 4 * i + 4]
                elif ev["type"] == "BlockRemoved":
                    for h in ev["block_hashes"]:
                        held.pop(h)
                        removed += 1
                else:
                    held.clear()
        pool = engine.scheduler.kv.pool
        assert removed > 0, "the tiny cache evicted nothing: the test lost its point"
        assert held == {h & U64: list(b.token_ids) for h, b in pool.cached.items()}
        # the last prompt's full blocks are cached under the engine's own chained hashes
        last_hashes = hash_full_blocks(prompts[-1], 4, [])
        assert all(h & U64 in held for h in last_hashes)

        assert sub.replay_from(0) == batches  # everything kept
        assert sub.replay_from(len(batches) - 1) == batches[-1:]
        engine.reset_prefix_cache()  # published at once, without a step
        (seq, payload), = sub.receive()
        assert seq == len(batches) and decode(payload, encoding)[1] == [{"type": "AllBlocksCleared"}]
    finally:
        sub.close()
        engine.shutdown()


def test_endpoint_in_use_is_a_clear_error(tiny_llama: Path, tmp_path: Path) -> None:
    from portside.engine.llm_engine import LLMEngine

    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(ValueError, match="kv events: cannot open"):
            LLMEngine.from_args(model=str(tiny_llama), device="cpu", max_model_len=64, kv_events_publisher="zmq",
                                kv_events_endpoint=f"tcp://*:{port}")
    finally:
        ctx.destroy(linger=0)


def test_a_data_parallel_replica_publishes_on_its_own_endpoint(tiny_llama: Path, tmp_path: Path) -> None:
    from portside.engine.llm_engine import LLMEngine
    from portside.sampling_params import SamplingParams

    base = f"ipc://{tmp_path}/ev"
    engine = LLMEngine.from_args(model=str(tiny_llama), device="cpu", max_model_len=64, block_size=4,
                                 kv_events_publisher="zmq", kv_events_endpoint=base, data_parallel_rank=1)
    sub = Subscriber(f"{base}_dp1", f"ipc://{tmp_path}/unused", "")
    try:
        time.sleep(0.3)
        engine.add_request("r", {"prompt_token_ids": list(range(3, 20))}, SamplingParams(max_tokens=2, temperature=0.0))
        while engine.has_unfinished_requests():
            engine.step()
        batches = sub.receive(1000)
        assert batches and all(decode(p, "map")[2] == 1 for _, p in batches)
    finally:
        sub.close()
        engine.shutdown()


def test_host_and_disk_tiers_report_their_blocks(tiny_llama: Path, tmp_path: Path) -> None:
    """With the KV tiers on, blocks evicted to host memory are stored with medium CPU, spilled to
    disk with DISK, and removed as the tiers let them go: per medium, the subscriber's view equals
    each tier's index; a restarted engine announces the disk tier's blocks at its first step."""
    from portside.engine.llm_engine import LLMEngine
    from portside.kv_transfer.disk_format import file_bytes
    from portside.sampling_params import SamplingParams

    endpoint = f"ipc://{tmp_path}/ev"
    args = dict(model=str(tiny_llama), device="cpu", max_model_len=64, block_size=4, num_kv_blocks=16,
                kv_offload_cpu_bytes=6 * 2048, kv_offload_disk_path=str(tmp_path / "disk"),
                kv_offload_disk_bytes=10 * file_bytes(2048, 4), kv_events_publisher="zmq", kv_events_endpoint=endpoint)
    params = SamplingParams(max_tokens=2, temperature=0.0)

    def views(sub: Subscriber) -> dict[str, set[int]]:
        held: dict[str, set[int]] = {"GPU": set(), "CPU": set(), "DISK": set()}
        for _, payload in sub.receive(1000):
            for ev in decode(payload, "map")[1]:
                if ev["type"] == "BlockStored":
                    held[ev["medium"]].update(ev["block_hashes"])
                elif ev["type"] == "BlockRemoved":
                    assert set(ev["block_hashes"]) <= held[ev["medium"]], ev
                    held[ev["medium"]].difference_update(ev["block_hashes"])
        return held

    engine = LLMEngine.from_args(**args)
    sub = Subscriber(endpoint, f"ipc://{tmp_path}/unused", "")
    try:
        time.sleep(0.3)
        for r in range(5):
            engine.add_request(f"r{r}", {"prompt_token_ids": [(11 * r + i) % 300 + 3 for i in range(30)]}, params)
            while engine.has_unfinished_requests():
                engine.step()
        tiers = engine.scheduler.kv_loads.connector
        held = views(sub)
        assert held["GPU"] == {h & U64 for h in engine.scheduler.kv.pool.cached}
        assert held["CPU"] == {h & U64 for h in tiers.host_lru} and held["CPU"]
        assert held["DISK"] == {h & U64 for h in tiers.disk_lru} and held["DISK"]
        assert tiers.counters["disk_evicted_blocks"] > 0  # the disk tier let some go too
    finally:
        sub.close()
        engine.shutdown()
    engine = LLMEngine.from_args(**args)  # a restart: the disk tier's files are found again
    sub = Subscriber(endpoint, f"ipc://{tmp_path}/unused", "")
    try:
        time.sleep(0.3)
        on_disk = {h & U64 for h in engine.scheduler.kv_loads.connector.disk_lru}
        engine.add_request("again", {"prompt_token_ids": list(range(3, 10))}, params)
        while engine.has_unfinished_requests():
            engine.step()
        assert on_disk and views(sub)["DISK"] == on_disk
    finally:
        sub.close()
        engine.shutdown()
