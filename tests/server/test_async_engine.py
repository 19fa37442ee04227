"""AsyncLLMEngine on the real LLMEngine, in-process: streams, abort, the waiting bound, shutdown."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from portside.engine.async_engine import AsyncLLMEngine, EngineStoppedError, QueueFullError
from portside.engine.stats import RequestRecord
from portside.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def sync_engine(tiny_llama: Path):  # type: ignore[no-untyped-def]
    from portside.engine.llm_engine import LLMEngine

    return LLMEngine.from_args(model=str(tiny_llama), device="cpu", dtype="float32", max_model_len=128,
                               block_size=16, num_kv_blocks=64, max_num_seqs=2)  # fmt: skip


def test_stream_abort_queue_bound_and_shutdown(sync_engine) -> None:  # type: ignore[no-untyped-def]
    records: list[RequestRecord] = []

    async def main() -> None:
        engine = AsyncLLMEngine(sync_engine, max_waiting_requests=1, on_request_done=records.append)
        engine.start()
        greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        outs = [o async for o in engine.generate("a", [5, 6, 7], greedy)]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 6
        assert [len(o.outputs[0].token_ids) for o in outs] == sorted(len(o.outputs[0].token_ids) for o in outs)

        # a bad request is refused by the engine, as ValueError, before any stream exists
        with pytest.raises(ValueError, match="out of range"):
            await engine.add_request("bad", [10**9], greedy)

        # abort mid-stream: the stream ends and every block is free again after the next step
        long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
        stream = await engine.add_request("b", [5, 6, 7], long)
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 3:
                stream.close()
        assert stream.finished and engine.num_unfinished == 0
        for _ in range(100):
            if sync_engine.stats().num_used_blocks == 0 and not sync_engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        assert sync_engine.stats().num_used_blocks == 0

        # the waiting bound: two long requests fill both batch slots (max_num_seqs=2), so the
        # next one waits for its first token, and the one after that is shed
        longer = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
        running = []
        for i in range(2):
            running.append(await engine.add_request(f"r{i}", [5, 6], longer))
            await running[-1].__aiter__().__anext__()  # its first token: no longer waiting
        s1 = await engine.add_request("c1", [5, 6], long)
        assert engine.num_waiting == 1
        with pytest.raises(QueueFullError):
            await engine.add_request("c2", [5, 6], long)
        for s in [*running, s1]:
            s.close()

        await engine.shutdown(timeout=5)
        with pytest.raises(EngineStoppedError):
            await engine.add_request("late", [5], greedy)

    asyncio.run(main())
    by_id = {r.request_id: r for r in records}
    assert by_id["a"].outcome == "length" and by_id["a"].num_generation_tokens == 6 and by_id["a"].ttft is not None
    assert by_id["b"].outcome == "abort" and by_id["c1"].outcome == "abort"
    assert "bad" not in by_id and "c2" not in by_id


def test_waiting_limit_counts_sequences(sync_engine) -> None:  # type: ignore[no-untyped-def]
    """--max-waiting-requests counts waiting sequences (n x prompts), not requests: two waiting
    requests of n=3 and n=4 leave room for one more sequence under a limit of 8, so a third
    request of n=2 (or a batch of two prompts: `submit_all` checks their sum) is shed with
    QueueFullError (503), and a batch that could never wait at once is a ValueError (400)."""

    async def main() -> None:
        engine = AsyncLLMEngine(sync_engine, max_waiting_requests=8)
        engine.start()
        longer = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
        running = []
        for i in range(2):  # both batch slots (max_num_seqs=2) busy: every sequence after them waits
            running.append(await engine.add_request(f"r{i}", [5, 6], longer))
            await running[-1].__aiter__().__anext__()  # its first token: no longer waiting
        short = dict(max_tokens=4, ignore_eos=True)
        waiting = [await engine.add_request("n3", [5, 6], SamplingParams(n=3, **short)),  # type: ignore[arg-type]
                   await engine.add_request("n4", [5, 6], SamplingParams(n=4, **short))]  # type: ignore[arg-type]
        assert engine.num_waiting == 7  # two requests, seven sequences
        with pytest.raises(QueueFullError, match="7 sequences of at most 8"):
            await engine.add_request("n2", [5, 6], SamplingParams(n=2, **short))  # type: ignore[arg-type]
        with pytest.raises(QueueFullError):
            engine.check_capacity(2)  # two prompts x n=1, as submit_all checks a batch
        with pytest.raises(ValueError, match="9 sequences"):
            engine.check_capacity(9)  # more than may ever wait: the request's own fault
        waiting.append(await engine.add_request("n1", [5, 6], SamplingParams(**short)))  # type: ignore[arg-type]
        assert engine.num_waiting == 8  # the one sequence that still fitted
        for s in [*running, *waiting]:
            s.close()
        await engine.shutdown(timeout=5)

    asyncio.run(main())


def test_full_collections_wait_for_idle_and_released_outputs(sync_engine) -> None:  # type: ignore[no-untyped-def]
    """Logprob tokens are decoded on the engine thread (the server never decodes them on its event
    loop), and full garbage collections run on the engine thread only once it is idle and the
    finished outputs it handed out are let go: never while a response may be built from them.
    The start-up heap is frozen; shutdown restores the collector as it was."""
    import gc

    from portside.engine.memory_hygiene import IDLE_GC_S
    from portside.sampling_params import RequestOutputKind

    def full_collections() -> int:
        return gc.get_stats()[2]["collections"]

    async def main() -> None:
        before = gc.get_threshold()
        engine = AsyncLLMEngine(sync_engine)
        engine.start()
        assert gc.get_threshold()[2] > 1 << 20 and gc.get_freeze_count() > 0
        params = SamplingParams(n=2, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2,
                                output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
        (out,) = [o async for o in engine.generate("g", [5, 6, 7], params)]
        entries = [e for c in out.outputs for e in c.logprobs or []] + [e for e in out.prompt_logprobs or [] if e]
        assert len(entries) == 2 * 8 + 2
        assert all(lp.decoded_token == sync_engine.tokenizer.decode([t]) for e in entries for t, lp in e.items())
        del entries
        held = full_collections()
        await asyncio.sleep(IDLE_GC_S * 2.5)  # idle, but `out` is still held
        assert full_collections() == held
        del out
        for _ in range(100):
            if full_collections() > held:
                break
            await asyncio.sleep(0.05)
        assert full_collections() > held, "no full collection once idle with the outputs let go"
        await engine.shutdown(timeout=5)
        assert gc.get_threshold() == before and gc.get_freeze_count() == 0

    asyncio.run(main())


def test_delta_outputs_and_a_slow_reader(sync_engine) -> None:  # type: ignore[no-untyped-def]
    """DELTA outputs concatenate to the CUMULATIVE result; what a reader has not taken is folded
    into one pending output (not one copy per step); FINAL_ONLY hands out one output."""
    from portside.sampling_params import RequestOutputKind

    async def main() -> None:
        engine = AsyncLLMEngine(sync_engine)
        engine.start()
        base = dict(n=2, max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2, stop=["never appears"])
        cumulative = [o async for o in engine.generate("c", [5, 6, 7], SamplingParams(**base))][-1]  # type: ignore[arg-type]

        deltas = [o async for o in engine.generate("d", [5, 6, 7], SamplingParams(**base, output_kind=RequestOutputKind.DELTA))]  # type: ignore[arg-type]
        assert len(deltas) > 2 and deltas[-1].finished
        for c in cumulative.outputs:
            mine = [x for o in deltas for x in o.outputs if x.index == c.index]
            assert "".join(x.text for x in mine) == c.text
            assert [t for x in mine for t in x.token_ids] == c.token_ids
            assert [e for x in mine for e in x.logprobs or []] == c.logprobs
            assert mine[-1].finish_reason == "length" and all(x.finish_reason is None for x in mine[:-1])

        slow = await engine.add_request("s", [5, 6, 7], SamplingParams(**base, output_kind=RequestOutputKind.DELTA))  # type: ignore[arg-type]
        while not slow.finished:  # the reader sleeps through the whole request
            await asyncio.sleep(0.01)
        (only,) = [o async for o in slow]
        assert only.finished
        assert [(c.text, c.token_ids, c.logprobs) for c in only.outputs] == [(c.text, c.token_ids, c.logprobs) for c in cumulative.outputs]

        final = [o async for o in engine.generate("f", [5, 6, 7], SamplingParams(**base, output_kind=RequestOutputKind.FINAL_ONLY))]  # type: ignore[arg-type]
        assert len(final) == 1 and [c.token_ids for c in final[0].outputs] == [c.token_ids for c in cumulative.outputs]
        await engine.shutdown(timeout=5)

    asyncio.run(main())


def test_serve_help_documents_every_flag() -> None:
    import argparse

    from portside.engine.args_cli import add_engine_args
    from portside.server.cli import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    add_engine_args(parser)
    flags = [
        "--host", "--port", "--served-model-name", "--chat-template", "--api-key", "--max-waiting-requests",
        "--max-request-body-bytes", "--device", "--dtype", "--max-model-len", "--kv-cache-memory", "--num-kv-blocks",
        "--block-size", "--max-num-seqs", "--max-num-batched-tokens", "--enable-prefix-caching", "--tensor-parallel-size", "--seed",
    ]  # fmt: skip
    for action in parser._actions:
        if set(action.option_strings) & set(flags):
            assert action.help, action.option_strings
    assert {s for a in parser._actions for s in a.option_strings} >= set(flags)
    args = parser.parse_args([])
    assert args.model is None and args.host == "127.0.0.1"
