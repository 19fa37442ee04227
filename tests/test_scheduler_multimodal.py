"""The scheduler with images in prompts: a prefill chunk stops before an image the step's encoder
budget cannot pay for (the step's first image is always paid for, so an image larger than the
budget still runs, also when pipeline micro-batches split the token budget), and block hashes
tell two images behind the same placeholder tokens apart."""

from __future__ import annotations

import torch

from portside.config import SchedulerConfig
from portside.multimodal.inputs import MultiModalFeature, PlaceholderRange
from portside.request import Request
from portside.sampling_params import SamplingParams
from portside.sched.output import ModelRunnerOutput, SchedulerOutput
from portside.sched.scheduler import Scheduler

IMG = 9  # the placeholder token


def image(offset: int, length: int, ident: str) -> MultiModalFeature:
    return MultiModalFeature("image", ident, PlaceholderRange(offset, length), {"pixel_values": torch.zeros(1)})


def prompt_with(images: list[MultiModalFeature], length: int) -> list[int]:
    ids = [1 + i % 5 for i in range(length)]
    for f in images:
        ids[f.placeholder.offset : f.placeholder.end] = [IMG] * f.placeholder.length
    return ids


def request(rid: str, images: list[MultiModalFeature], length: int) -> Request:
    return Request(rid, prompt_with(images, length), SamplingParams(max_tokens=2, ignore_eos=True), max_tokens=2,
                   mm_features=images)


def scheduler(budget: int, encoder: int | None, micro: int = 1) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4), block_size=4, num_blocks=64,
                     enable_prefix_caching=True, max_model_len=128, max_encoder_tokens=encoder, num_micro_batches=micro)


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    sampled = {}
    for rid, n in out.num_scheduled_tokens.items():
        r = s.requests[rid]
        sampled[rid] = [3] if r.num_computed_tokens + n >= r.num_tokens else []
    s.update_from_output(out, ModelRunnerOutput(req_ids=list(out.num_scheduled_tokens), sampled_token_ids=sampled))
    return out


def test_chunks_stop_before_an_image_the_encoder_budget_cannot_pay():
    s = scheduler(budget=32, encoder=10)
    s.add_request(request("a", [image(4, 8, "x"), image(20, 10, "y")], 40))
    assert step(s).num_scheduled_tokens == {"a": 20}  # x (8) fits; y (10) does not fit the 2 left
    assert step(s).num_scheduled_tokens == {"a": 20}  # y alone, then the rest of the prompt


def test_an_image_larger_than_the_budget_runs_alone():
    s = scheduler(budget=64, encoder=10)
    s.add_request(request("a", [image(2, 16, "x"), image(20, 4, "y")], 30))
    assert step(s).num_scheduled_tokens == {"a": 20}  # x (16 > 10) as the step's first image; y waits
    assert step(s).num_scheduled_tokens == {"a": 10}


def test_micro_batches_split_the_token_budget_but_images_still_run():
    s = scheduler(budget=24, encoder=None, micro=2)  # a batch's budget: 12 tokens, and 12 encoder rows
    s.add_request(request("a", [image(2, 20, "x")], 30))
    counts = []
    while s.has_unfinished_requests() and len(counts) < 20:
        counts.append(sum(step(s).num_scheduled_tokens.values()))
    assert not s.has_unfinished_requests() and counts[0] == 12  # the image (20 rows) starts at once


def test_block_hashes_include_the_images():
    a, b = request("a", [image(4, 8, "x")], 20), request("b", [image(4, 8, "y")], 20)
    c = request("c", [image(4, 8, "x")], 20)
    assert a.prompt_token_ids == b.prompt_token_ids == c.prompt_token_ids
    s = scheduler(budget=64, encoder=None)
    s.add_request(a)
    step(s)
    step(s)  # a finishes; its full blocks stay in the prefix cache
    s.add_request(b)
    s.add_request(c)
    step(s)
    assert (b.num_cached_tokens, c.num_cached_tokens) == (4, 16)  # b: only the block before its image
