"""Graph contract: after `capture`, the platform's graph runner gives what `EagerGraphRunner`
gives, step after step, on a tiny model: mixed prefills, decode batches of every size up to past
the largest captured one, and a decode + prefill-chunk step. The KV caches must agree too."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from portside.contract import EagerGraphRunner, ForwardContext, Platform
from portside.testing.conformance.cases import build_metadata, contract_failure, engine_config

NUM_REQS = 11
PROMPT_LENS = (3, 17, 1, 9, 20, 5, 2, 13, 8, 4, 6)  # one per request
# Each step: {request index: tokens computed now}. Requests not listed wait.
STEPS: tuple[dict[int, int], ...] = (
    {i: n for i, n in enumerate(PROMPT_LENS)},  # every prefill at once (mixed lengths)
    {i: 1 for i in range(NUM_REQS)},  # 11 decodes: larger than typical capture sizes
    {i: 1 for i in range(5)},  # 5: padded up to a captured size
    {i: 1 for i in range(3, 6)},  # 3
    {7: 1},  # 1
    {0: 1, 2: 1},  # 2
    {i: 1 for i in range(8)},  # 8
    {1: 1, 4: 7},  # a decode and a prefill chunk
    {i: 1 for i in range(NUM_REQS)},
)


def _dummy_context_factory(backend, caches: list[torch.Tensor], scratch_block: int, block_size: int, device):
    """What the model runner hands `capture`: decode-only batches writing into a scratch block."""
    from portside.runner.kv_cache import dummy_decode_context

    return functools.partial(dummy_decode_context, backend, caches, scratch_block, block_size, device)


def test_graph_replay_equals_eager(conformance_platform: type[Platform], conformance_tiny_model: Path,
                                   conformance_dtype: torch.dtype) -> None:  # fmt: skip
    from portside.model.registry import load_model

    platform, dtype = conformance_platform, conformance_dtype
    bs = platform.default_block_size
    max_len = max(PROMPT_LENS) + len(STEPS) + 8
    blocks_per_req = -(-max_len // bs)
    # Limits sized to this workload (every prefill in one step; block tables one column wider
    # than needed, as build_metadata makes them): a runner that prepares every shape the config
    # allows (XLA precompiles its buckets) prepares only what this check can use.
    config = engine_config(platform, dtype, bs, str(conformance_tiny_model), max_model_len=(blocks_per_req + 1) * bs,
                           max_num_batched_tokens=sum(PROMPT_LENS), max_num_seqs=16)  # fmt: skip
    device = platform.device(0)
    platform.set_device(0)
    model = load_model(config.model, device)
    spec = model.kv_cache_spec()
    backend = platform.attention_backend(config)
    graph = platform.graph_runner(model, config)  # the model runner passes the model itself
    eager = EagerGraphRunner(model, config)

    gen = torch.Generator().manual_seed(7)
    num_blocks = NUM_REQS * blocks_per_req * 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [order[i * blocks_per_req : (i + 1) * blocks_per_req] for i in range(NUM_REQS)]
    shape = backend.kv_cache_shape(num_blocks + 1, bs, spec.num_kv_heads, spec.head_size)  # + scratch block
    caches = {name: [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
              for name in ("graph", "eager")}  # fmt: skip
    tokens = [torch.randint(3, model.config.vocab_size, (max_len,), generator=gen).tolist() for _ in range(NUM_REQS)]
    done = [0] * NUM_REQS

    with platform.inference_mode():
        graph.capture(_dummy_context_factory(backend, caches["graph"], num_blocks, bs, device))
        for step, work in enumerate(STEPS):
            reqs = sorted(work, key=lambda r: work[r] != 1)  # decodes first
            requests = tuple((done[r], work[r]) for r in reqs)
            md = build_metadata(requests, [tables[r] for r in reqs], bs, device)
            ids = torch.tensor([t for r in reqs for t in tokens[r][done[r] : done[r] + work[r]]], device=device)
            pos = torch.cat([torch.arange(done[r], done[r] + work[r]) for r in reqs]).to(device)
            outs = {}
            for name, runner in (("graph", graph), ("eager", eager)):
                ctx = ForwardContext(backend, caches[name], backend.prepare(md))
                outs[name] = runner(ids, pos, ctx).float().cpu()
            platform.synchronize()
            for r in reqs:
                done[r] += work[r]
            where = f"step {step} ({len(reqs)} requests, tokens per request {[work[r] for r in reqs]})"
            if outs["graph"].shape != outs["eager"].shape:
                contract_failure("graph", f"{graph.name} returned {tuple(outs['graph'].shape)}, eager "
                                 f"{tuple(outs['eager'].shape)} at {where}")  # fmt: skip
            tol = 1e-4 if dtype == torch.float32 else 5e-2
            err = (outs["graph"] - outs["eager"]).abs().max().item()
            if not err <= tol * max(1.0, outs["eager"].abs().max().item()):
                contract_failure("graph", f"{graph.name} replay differs from eager at {where}: max abs err {err:.3e}")

    slots = torch.tensor([tables[r][p // bs] * bs + p % bs for r in range(NUM_REQS) for p in range(done[r])], device=device)
    for layer in range(spec.num_layers):
        kg, vg = backend.read_kv(caches["graph"][layer], slots)
        ke, ve = backend.read_kv(caches["eager"][layer], slots)
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        if not (torch.allclose(kg.float(), ke.float(), atol=tol, rtol=tol) and torch.allclose(vg.float(), ve.float(), atol=tol, rtol=tol)):
            contract_failure("graph", f"after the steps, layer {layer}'s KV cache differs between {graph.name} and "
                             "eager: replay wrote K/V to the wrong slots (or padding wrote somewhere real)")  # fmt: skip
