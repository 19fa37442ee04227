"""`use_beam_search` on /v1/completions and chat (vLLM's extra field, `n` the beam width): the
same `BeamSearchState` as `LLM.beam_search`, stepped over the async engine. Each step every live
beam of every prompt is one request returning its top 2n logprobs; the finished beams come back
as one `RequestOutput` per prompt (beam i as choice i, best first), so the endpoints build their
usual responses from them."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from portside.engine.beam_search import BeamSearchBatch, BeamSearchState, step_params
from portside.outputs import CompletionOutput, RequestOutput
from portside.sampling_params import BeamSearchParams
from portside.server.context import ServingContext
from portside.server.errors import bad_request
from portside.server.streams import collect, merged, submit_all, until_disconnected


async def beam_search(ctx: ServingContext, request: Request, request_id: str, prompts: list[list[int]],
                      max_tokens: list[int], req: Any, lora: Any, prompt_param: str,
                      mm_features: list[list[Any]] | None = None) -> list[RequestOutput]:
    """The best `req.n` beams of each prompt, as transformers' `generate(num_beams=n)` ranks them.
    `mm_features`: each prompt's processed images (`process_multimodal`), carried by its beams."""
    engine: Any = ctx.engine.engine  # the LLMEngine behind the async front
    try:
        step = step_params(req.n, ctx.max_logprobs, engine.config.model.logprobs_mode)
    except ValueError as e:
        raise bad_request(f"n: {e}", "n") from None
    batch = BeamSearchBatch([
        BeamSearchState(ids, BeamSearchParams(beam_width=req.n, max_tokens=m, length_penalty=req.length_penalty,
                                              ignore_eos=req.ignore_eos), engine.eos_token_ids, ctx.max_model_len)
        for ids, m in zip(prompts, max_tokens)
    ])  # fmt: skip
    images = {id(s): f for s, f in zip(batch.states, mm_features or []) if f}
    n_step = 0
    while not batch.done:
        beams: list[Any] = [{"prompt_token_ids": b, "mm_features": images[id(s)]} if id(s) in images else b
                            for b, s in zip(batch.prompts(), batch.owners, strict=True)]
        streams = await submit_all(ctx, f"{request_id}-beam{n_step}", beams, [step] * len(beams), req.priority,
                                   prompt_param, lora)
        batch.advance(await until_disconnected(request, collect(merged(streams), len(streams))))
        n_step += 1
    return await ctx.offload.run(_outputs, ctx, request_id, batch.states, req.skip_special_tokens, large=False,
                                 refusable=False)


def _outputs(ctx: ServingContext, request_id: str, states: list[BeamSearchState], skip_special: bool) -> list[RequestOutput]:
    tok = ctx.offload.tokenizer()
    outputs = []
    for s in states:
        seqs = s.sequences(lambda ids: tok.decode(ids, skip_special_tokens=skip_special))
        n = len(s.prompt_ids)
        outputs.append(RequestOutput(
            request_id=request_id, prompt=None, prompt_token_ids=s.prompt_ids, finished=True,
            outputs=[CompletionOutput(index=i, text=q.text, token_ids=q.tokens[n:], cumulative_logprob=q.cum_logprob,
                                      logprobs=None, finish_reason=q.finish_reason) for i, q in enumerate(seqs)],
        ))  # fmt: skip
    return outputs
