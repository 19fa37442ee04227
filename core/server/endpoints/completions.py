"""POST /v1/completions: text or token-id prompts (one or a batch), streamed or not, with echo.
The stages every generate endpoint shares are `portside.server.pipeline`'s; this module is the
adapter: prompts tokenized on an offload worker, responses and stream chunks in the legacy shape."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from portside.outputs import RequestOutput
from portside.server.context import ServingContext
from portside.server.errors import bad_request
from portside.server.formatting import (
    ChoiceCursor,
    completion_logprobs,
    floor,
    openai_finish_reason,
    prompt_logprobs_json,
    top_texts,
    usage,
)
from portside.server.pipeline import GenerateAPI, Job, generate_route, resolve_max_tokens
from portside.server.protocol.bodies import CompletionRequest
from portside.server.streams import Prompt


class Completions(GenerateAPI[CompletionRequest]):
    name = "Completions"
    body = CompletionRequest
    id_prefix = "cmpl"
    echo: list[str] | None  # each prompt's text, when it is echoed

    async def prepare(self) -> Job:
        req = self.req
        ids, self.echo = await self.ctx.offload.run(_tokenize, self.ctx, req.prompt, req.echo, large=self.large)
        prompts: list[Prompt] = list(ids)
        return Job(prompts, "prompt", req.max_tokens, logprobs=req.logprobs,
                   prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None,
                   constrain_reasoning=False)  # raw text comes back, with no reasoning split off: constrain all of it

    def response(self, job: Job, finals: list[RequestOutput]) -> dict[str, Any]:
        ctx, req, echo = self.ctx, self.req, self.echo
        choices: list[dict[str, Any]] = []
        prompt_tokens = completion_tokens = cached = 0
        for i, out in enumerate(finals):
            prompt_tokens += len(out.prompt_token_ids)
            completion_tokens += out.num_dropped_tokens  # best_of > n: the samples not returned count too
            cached += out.num_cached_tokens
            prefix = echo[i] if echo is not None else ""
            prompt_lps = prompt_logprobs_json(ctx, out.prompt_logprobs) if req.prompt_logprobs is not None else None
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                logprobs = completion_logprobs(ctx, c, req.logprobs, len(prefix)) if req.logprobs is not None else None
                if logprobs is not None and echo is not None:
                    logprobs = _echo_logprobs(ctx, out, req.logprobs or 0, logprobs)
                choice = {"index": i * req.n + c.index, "text": prefix + c.text, "logprobs": logprobs,
                          "finish_reason": openai_finish_reason(c.finish_reason)}
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_lps  # vLLM's extra field, on every choice of the prompt
                choices.append(choice)
        choices.sort(key=lambda ch: ch["index"])
        return {"id": job.request_id, "object": "text_completion", "created": job.created, "model": req.model,
                "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached)}

    async def events(self, job: Job, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[dict[str, Any]]:
        req = self.req
        cursors: dict[int, ChoiceCursor] = {}
        completion_tokens = cached = 0
        async for i, out in outputs:
            for c in out.outputs:
                index = i * req.n + c.index
                cur = cursors.setdefault(index, ChoiceCursor())
                if cur.finished:
                    continue
                prefix = ""
                if not cur.started:
                    cur.started = True
                    prefix = self.echo[i] if self.echo is not None else ""
                    cur.echo_len = len(prefix)
                offset = cur.echo_len + cur.text_len
                cur.advance(c)
                finish = openai_finish_reason(c.finish_reason)
                if not (prefix or c.text or c.token_ids or finish):
                    continue
                logprobs = completion_logprobs(self.ctx, c, req.logprobs, offset) if req.logprobs is not None else None
                if finish:
                    cur.finished = True
                    completion_tokens += cur.num_tokens
                choice = {"index": index, "text": prefix + c.text, "logprobs": logprobs, "finish_reason": finish}
                yield {"id": job.request_id, "object": "text_completion", "created": job.created, "model": req.model,
                       "choices": [choice]}
            if out.finished:
                cached += out.num_cached_tokens
        if req.stream_options and req.stream_options.include_usage:
            prompt_tokens = sum(len(p) for p in job.prompt_ids())
            yield {"id": job.request_id, "object": "text_completion", "created": job.created, "model": req.model,
                   "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached)}


def _echo_logprobs(ctx: ServingContext, out: RequestOutput, k: int, completion: dict[str, Any]) -> dict[str, Any]:
    """Echo with logprobs: the prompt tokens' logprobs before the completion's, as OpenAI's legacy
    API and vLLM return them (the first prompt token has none: null, as theirs)."""
    pl = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = 0
    for tid, entry in zip(out.prompt_token_ids, pl):
        lp = entry.get(tid) if entry is not None else None
        token = ctx.decode_token(tid, lp)
        tokens.append(token)
        values.append(floor(lp.logprob) if lp is not None else None)
        tops.append(top_texts(ctx, entry, k) if entry is not None else None)
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens + completion["tokens"], "token_logprobs": values + completion["token_logprobs"],
            "top_logprobs": tops + completion["top_logprobs"], "text_offset": offsets + completion["text_offset"]}


def _tokenize(ctx: ServingContext, prompt: list[Any], echo: bool) -> tuple[list[list[int]], list[str] | None]:
    """Token ids of each prompt (text prompts get the tokenizer's special tokens), and their
    text when it is to be echoed. Runs on an offload worker, with its tokenizer."""
    tok = ctx.offload.tokenizer()
    if isinstance(prompt[0], str):
        return [_encode(tok, p, ctx.max_model_len) for p in prompt], list(prompt) if echo else None
    ids = [list(p) for p in prompt]
    for p in ids:
        bad = [t for t in p if not 0 <= t < ctx.vocab_size]
        if bad:
            raise bad_request(f"prompt token id {bad[0]} is out of range for vocabulary size {ctx.vocab_size}", "prompt")
    return ids, [tok.decode(p) for p in ids] if echo else None


_HEAD_CHARS_PER_TOKEN = 32
_COUNT_FIRST_CHARS = 1 << 16  # a text prompt longer than this is counted before it is tokenized into lists


def _encode(tok: Any, text: str, max_model_len: int) -> list[int]:
    """A text prompt's ids; a prompt whose first `max_model_len * _HEAD_CHARS_PER_TOKEN`
    characters alone overflow the context is refused without tokenizing the rest, and a long
    one that overflows it is refused before its ids become Python lists (see `_count_tokens`)."""
    head = max_model_len * _HEAD_CHARS_PER_TOKEN
    if len(text) > head:
        n = _count_tokens(tok, text[:head])
        if n > max_model_len + 1:  # (+1: the cut may split one token in two)
            raise bad_request(f"This model's maximum context length is {max_model_len} tokens, but the prompt has more "
                              f"than {n - 1} tokens ({len(text)} characters); shorten the prompt", "prompt")
    if len(text) > _COUNT_FIRST_CHARS and _has_backend(tok):
        # no room for output: the same 400 as resolve_max_tokens gives once the ids are there
        resolve_max_tokens(None, "max_tokens", False, _count_tokens(tok, text), max_model_len, "prompt")
    return tok(text).input_ids


def _has_backend(tok: Any) -> bool:
    return hasattr(getattr(tok, "_tokenizer", None), "encode_batch")


def _count_tokens(tok: Any, text: str) -> int:
    """How many tokens `tok(text)` gives. With a fast tokenizer, its Rust backend's count without
    the id lists: converting millions of ids to Python lists holds the GIL (a 5 MB prompt:
    ~0.3 s, a stall of the event loop), while `encode_batch(_fast)` releases it as it tokenizes.
    The `_fast` variant (no character offsets) is also ~2.5x faster and its result is freed at
    once (a full `Encoding` of 2M tokens takes ~0.4 s to free, with the GIL held)."""
    if not _has_backend(tok):
        return len(tok(text).input_ids)
    backend = tok._tokenizer
    split = getattr(tok, "split_special_tokens", None)
    if split is not None and backend.encode_special_tokens != split:  # as tok(text) sets it
        backend.encode_special_tokens = split
    encode = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
    return len(encode([text], add_special_tokens=True)[0])


ROUTES = (generate_route("/v1/completions", Completions),)
