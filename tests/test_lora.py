"""Multi-LoRA end to end: portside's greedy tokens with PEFT adapters equal transformers + peft
with that adapter active, for one batch mixing the base model and three adapters (more than
the device slots), across block boundaries, chunked prefill, preemption and prefix-cache hits,
and with tensor parallelism 2."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from portside import LLM, LoRARequest, SamplingParams
from portside.testing.tiny import hf_greedy, make_tiny_lora, make_tiny_model

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
WORDS = "the quick brown fox jumps over the lazy dog while a small cat sleeps in the warm sun".split()


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("lora_base"), "llama")


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> list[LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    specs = [  # ranks below the slots' (padded), rslora, and an adapter on attention only
        dict(r=8, alpha=16, seed=1),
        dict(r=4, alpha=8, seed=2, use_rslora=True),
        dict(r=16, alpha=16, seed=3, target_modules=("q_proj", "v_proj", "o_proj")),
    ]
    return [LoRARequest(f"a{i}", i + 1, str(make_tiny_lora(base, root / f"a{i}", **spec))) for i, spec in enumerate(specs)]


@functools.cache
def _peft_model(base: str, adapter: str):  # type: ignore[no-untyped-def]
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    return PeftModel.from_pretrained(model, adapter).eval()


@torch.no_grad()
def expected(base: Path, lora: LoRARequest | None, prompt: list[int]) -> list[int]:
    if lora is None:
        return hf_greedy(base, prompt, MAX_TOKENS)
    model = _peft_model(str(base), lora.lora_path)
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                         eos_token_id=None, pad_token_id=0, temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt):].tolist()


def prompts_for(llm: LLM, lengths: list[int]) -> list[list[int]]:
    ids = llm.get_tokenizer().encode(" ".join(WORDS * 6))
    return [ids[3 * i : 3 * i + n] for i, n in enumerate(lengths)]


def check(llm: LLM, base: Path, prompts: list[list[int]], loras: list[LoRARequest | None]) -> list:  # type: ignore[type-arg]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=loras)
    for p, lora, out in zip(prompts, loras, outs):
        want = expected(base, lora, p)
        assert out.outputs[0].token_ids == want, f"{lora.lora_name if lora else 'base'}, prompt of {len(p)} tokens"
    return outs


@pytest.fixture(scope="module")
def llm(base: Path) -> LLM:
    # two slots for three adapters: the scheduler admits at most two at once and slots are
    # reused; 4-token blocks, a 16-token budget and 24 blocks: block boundaries, chunked
    # prefill and preemption
    return LLM(model=str(base), device="cpu", max_model_len=64, block_size=4, max_num_batched_tokens=16, num_kv_blocks=24,
               enable_lora=True, max_loras=2, max_lora_rank=16)


@pytest.mark.slow
def test_mixed_batch_matches_peft(llm: LLM, base: Path, adapters: list[LoRARequest]) -> None:
    before = llm.engine.stats().num_preemptions
    loras = [None, *adapters, adapters[0], None, adapters[2], adapters[1]]
    outs = check(llm, base, prompts_for(llm, [5, 9, 17, 30, 3, 22, 11, 8]), loras)
    # the base model's tokens really differ from each adapter's (the test can fail)
    assert len({tuple(o.outputs[0].token_ids) for o in outs[:4]}) == 4
    assert llm.engine.stats().num_preemptions > before
    assert llm.engine.stats().num_used_blocks == 0
    llm.engine.scheduler.check_integrity()


def test_prefix_cache_is_per_adapter(llm: LLM, base: Path, adapters: list[LoRARequest]) -> None:
    prompt = prompts_for(llm, [20])[0][::-1]  # a prompt no earlier test computed
    first = check(llm, base, [prompt], [adapters[0]])
    assert first[0].num_cached_tokens == 0
    again = check(llm, base, [prompt, prompt], [adapters[0], adapters[1]])
    assert again[0].num_cached_tokens > 0  # the same adapter's KV is reused
    assert again[1].num_cached_tokens == 0  # another adapter's never is


@pytest.mark.slow
def test_tensor_parallel(base: Path, adapters: list[LoRARequest]) -> None:
    llm = LLM(model=str(base), device="cpu", max_model_len=64, block_size=4, tensor_parallel_size=2,
              enable_lora=True, max_loras=2, max_lora_rank=16)
    try:
        check(llm, base, prompts_for(llm, [7, 13, 5, 10]), [adapters[0], None, adapters[1], adapters[2]])
    finally:
        llm.shutdown()


def test_bad_lora_requests(llm: LLM, base: Path, adapters: list[LoRARequest], tmp_path: Path) -> None:
    from portside.lora.registry import LoRARegistry

    with pytest.raises(ValueError, match="enable_lora"):  # an engine without LoRA
        LoRARegistry(None, str(base)).check(adapters[0])
    big = LoRARequest("big", 7, str(make_tiny_lora(base, tmp_path / "big", r=32)))
    with pytest.raises(ValueError, match="max-lora-rank"):
        llm.generate("the fox", GREEDY, use_tqdm=False, lora_request=big)
    with pytest.raises(ValueError, match="already"):
        llm.generate("the fox", GREEDY, use_tqdm=False, lora_request=LoRARequest("other", 1, adapters[1].lora_path))
    with pytest.raises(ValueError, match="nope"):
        llm.generate("the fox", GREEDY, use_tqdm=False, lora_request=LoRARequest("missing", 9, str(tmp_path / "nope")))
    with pytest.raises(ValueError, match="2 lora requests"):
        llm.generate(["a", "b", "c"], GREEDY, use_tqdm=False, lora_request=adapters[:2])
    assert not llm.engine.has_unfinished_requests()


def test_a_platform_without_lora_refuses_it(base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from portside.backends.cpu.platform import CpuPlatform

    monkeypatch.setattr(CpuPlatform, "supports_lora", False)  # as the tpu platform declares
    with pytest.raises(ValueError, match="LoRA adapters .* not supported on the cpu platform"):
        LLM(model=str(base), device="cpu", max_model_len=64, num_kv_blocks=16, enable_lora=True)


@pytest.mark.slow
def test_host_cache_is_lru_bounded_by_max_cpu_loras(base: Path, adapters: list[LoRARequest],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """One device slot, two adapters kept on the host, three adapters used in turn: the least
    recently used one is evicted from the host (and read from disk again when it comes back),
    the host never holds more than two, and every answer still equals peft's."""
    from portside.lora.manager import LoRAModelManager

    llm = LLM(model=str(base), device="cpu", max_model_len=64, block_size=4, num_kv_blocks=32, enable_lora=True,
              max_loras=1, max_cpu_loras=2, max_lora_rank=16)
    try:
        manager = llm.engine.executor.runner.lora
        assert isinstance(manager, LoRAModelManager)
        reads: list[int] = []
        sizes: list[int] = []
        resolve, host_weights = manager.resolve, manager._host_weights

        def counting_resolve(lora_request):  # type: ignore[no-untyped-def]
            reads.append(lora_request.lora_int_id)
            return resolve(lora_request)

        def watched_host_weights(lora_request):  # type: ignore[no-untyped-def]
            out = host_weights(lora_request)
            sizes.append(len(manager._host))
            return out

        monkeypatch.setattr(manager, "resolve", counting_resolve)
        monkeypatch.setattr(manager, "_host_weights", watched_host_weights)
        a0, a1, a2 = adapters
        prompt = prompts_for(llm, [9])[0]
        for lora in (a0, a1, a2, a0, a2, a1):
            check(llm, base, [prompt], [lora])
        # a0, a1 read; a2 evicts a0; a0 read again (evicts a1); a2 from the host; a1 read again
        assert reads == [1, 2, 3, 1, 2]
        assert list(manager._host) == [3, 2]  # least recently used first
        assert max(sizes) == 2 and len(sizes) == 6  # every slot fill went through the host cache
        # all three in one batch: one slot, so one adapter at a time, the host still at two
        check(llm, base, prompts_for(llm, [6, 11, 4, 8]), [a2, a0, None, a1])
        assert max(sizes) == 2 and len(manager._host) == 2
        assert llm.engine.stats().num_used_blocks == 0
    finally:
        llm.shutdown()


def test_an_adapter_that_fails_to_load_leaves_the_slots_consistent(base: Path, adapters: list[LoRARequest],
                                                                     tmp_path: Path) -> None:
    """An adapter whose folder is gone when it must be read again (it had left the host cache)
    fails its step; the device slots other adapters hold stay theirs, so the engine's later
    batches still equal peft (the slot the failed load would have taken was once handed out
    again while still holding another adapter's weights)."""
    import shutil

    llm = LLM(model=str(base), device="cpu", max_model_len=64, block_size=4, num_kv_blocks=32, enable_lora=True,
              max_loras=2, max_cpu_loras=2, max_lora_rank=16)
    try:
        gone = LoRARequest("gone", 21, shutil.copytree(adapters[0].lora_path, tmp_path / "gone"))
        a0, a1, a2 = adapters
        p, q = prompts_for(llm, [7, 10])
        for lora in (gone, a1, a0, a1):  # slots: gone, a1; a0 takes gone's; a1 used last
            check(llm, base, [p], [lora])
        shutil.rmtree(gone.lora_path)  # out of the host cache (two kept) since a0 came in
        with pytest.raises(ValueError, match="no such folder"):
            llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False, lora_request=gone)
        llm.engine.abort_request(list(llm.engine.outputs.groups))  # the failed step's request is left running
        check(llm, base, [p, q], [a1, a2])  # a1 keeps its slot; a2 takes a0's
        assert llm.engine.stats().num_used_blocks == 0
    finally:
        llm.shutdown()


def test_parse_lora_modules() -> None:
    from portside.server.lora import LoRAModule, parse_lora_modules

    assert parse_lora_modules(["sql=/a/sql", '{"name": "chat", "path": "/a/chat", "base_model_name": "tiny"}',
                               "eq=/a/b=c"]) == [
        LoRAModule("sql", "/a/sql"), LoRAModule("chat", "/a/chat", "tiny"), LoRAModule("eq", "/a/b=c")]
    assert parse_lora_modules([]) == []


@pytest.mark.parametrize(("values", "match"), [
    (["sql"], r"'sql': expected NAME=PATH or a JSON object"),
    (["=/a/sql"], r"'=/a/sql': expected NAME=PATH"),
    (["sql="], r"'sql=': expected NAME=PATH"),
    (['{"name": "sql"}'], r"JSON entries need \"name\" and \"path\""),
    (['{"path": "/a/sql"}'], r"JSON entries need \"name\" and \"path\""),
    (['{"name": "sql", "path": }'], r"JSON entries need"),  # not JSON
    (['{"name": null, "path": "/a/sql"}'], r"\"name\" and \"path\" must be non-empty strings"),
    (['{"name": "sql", "path": ""}'], r"\"name\" and \"path\" must be non-empty strings"),
    (['{"name": "sql", "path": "/a", "base_model_name": 3}'], r"base_model_name must be a string"),
    (["sql=/a/sql", '{"name": "sql", "path": "/b/sql"}'], r"adapter names must be unique, got \['sql', 'sql'\]"),
])  # fmt: skip
def test_parse_lora_modules_errors(values: list[str], match: str) -> None:
    from portside.server.lora import parse_lora_modules

    with pytest.raises(ValueError, match=r"--lora-modules.*" + match):
        parse_lora_modules(values)


def _lora_scheduler(max_loras: int, max_num_seqs: int = 16):  # type: ignore[no-untyped-def]
    from portside.config import SchedulerConfig
    from portside.sched.scheduler import Scheduler

    config = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=max_num_seqs, policy="fcfs",
                             enable_chunked_prefill=True)
    return Scheduler(config, 4, 128, False, 64, max_loras=max_loras)


def _lora_request(req_id: str, lora: LoRARequest | None, max_tokens: int):  # type: ignore[no-untyped-def]
    from portside.request import Request

    return Request(req_id, [3, 4, 5, 6, 7], SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens,
                   lora_request=lora)


def _step(sched) -> tuple[list[str], set[int]]:  # type: ignore[no-untyped-def]
    """One step in which every scheduled request samples a token: (scheduled ids, their adapters)."""
    from portside.sched.output import ModelRunnerOutput

    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    loras = {sched.requests[r].lora_id for r in ids} - {None}
    sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, sampled_token_ids={r: [9] for r in ids}))
    sched.check_integrity()
    return ids, loras


def test_scheduler_admits_no_more_adapters_than_slots() -> None:
    """max_loras=2: a waiting request whose adapter would be a third one in the batch is passed
    over (not waited on: the requests behind it are admitted), and admitted once an adapter's
    requests have all finished; requests on the base model or an adapter already running are
    never held back by the rule."""
    l1, l2, l3 = (LoRARequest(f"l{i}", i, f"/x/l{i}") for i in (1, 2, 3))
    sched = _lora_scheduler(max_loras=2)
    for req_id, lora, n in [("a", l1, 2), ("b", l2, 4), ("c", l3, 2), ("d", None, 2), ("e", l1, 2), ("f", l3, 1)]:
        sched.add_request(_lora_request(req_id, lora, n))
    ids, loras = _step(sched)
    assert ids == ["a", "b", "d", "e"] and loras == {1, 2}  # c and f (l3) wait
    ids, loras = _step(sched)  # a, d and e finish this step; l1 still runs during it
    assert ids == ["a", "b", "d", "e"] and loras == {1, 2}
    ids, loras = _step(sched)  # l1 is gone: l3 takes its slot
    assert ids == ["b", "c", "f"] and loras == {2, 3}
    while sched.requests:
        _, loras = _step(sched)
        assert len(loras) <= 2


def test_scheduler_with_one_slot_runs_one_adapter_at_a_time() -> None:
    l1, l2 = LoRARequest("l1", 1, "/x/l1"), LoRARequest("l2", 2, "/x/l2")
    sched = _lora_scheduler(max_loras=1)
    for i in range(6):
        sched.add_request(_lora_request(f"r{i}", (l1, l2, None)[i % 3], 3))
    seen: list[set[int]] = []
    while sched.requests:
        _, loras = _step(sched)
        assert len(loras) <= 1
        seen.append(loras)
    assert {1} in seen and {2} in seen
