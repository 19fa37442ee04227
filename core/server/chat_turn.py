"""One assistant turn of a conversation: what every chat-style API shares (chat completions,
Anthropic Messages, OpenAI Responses).

An API that takes a conversation maps its body onto a `ChatCompletionRequest` (its messages,
tools and tool choice, sampling fields) and hands it to a `ChatTurn`, which

- prepares the prompt (`prepare`): harmony for gpt-oss, else the chat template with the request's
  tools and images, the tool plan (`portside.server.tools`) and whether the prompt opens a
  reasoning block (`--reasoning-parser`);
- reads a finished output (`parse`) as reasoning, content and tool calls;
- streams one (`stream()` per choice): OpenAI `delta` dicts (`{"reasoning_content"}`,
  `{"content"}`, `{"tool_calls": [...]}`) in order, which each API turns into its own events.

So templating, structured output, tool and reasoning parsing are written once; an API is an
adapter of its request and response shapes only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from portside.outputs import CompletionOutput
from portside.server.context import ServingContext
from portside.server.errors import bad_request
from portside.server.formatting import openai_finish_reason
from portside.server.harmony import encoding_or_503
from portside.server.harmony_output import HarmonyStream
from portside.server.harmony_plan import prepare_harmony
from portside.server.pipeline import Job
from portside.server.protocol.bodies import ChatCompletionRequest
from portside.server.rendering import check_images, check_template_fields, image_parts, image_prompt, render
from portside.server.streams import Prompt
from portside.server.tools import ToolPlan, ToolStream, parse_output, plan_tools


@dataclass
class ParsedTurn:
    """A finished output, read: each part None (or no calls) when the output has none."""

    reasoning: str | None
    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's shape: id, type, function{name, arguments}


class ChatTurn:
    """The prompt of `req` and the reading of its outputs (see the module's docstring)."""

    plan: ToolPlan
    prefill: list[int]  # harmony: the prompt's tokens after <|start|>assistant, where its output parser starts
    thinking: bool  # the rendered prompt opens a reasoning block (--reasoning-parser)

    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, large: bool) -> None:
        self.ctx = ctx
        self.req = req
        self.large = large

    async def prepare(self, top_logprobs: int | None = None) -> Job:
        """The pipeline's job for this turn (stage 2): rendered on the offload lanes, images
        loaded and processed; every problem a 400 naming the field."""
        ctx, req = self.ctx, self.req
        if ctx.harmony:  # gpt-oss: harmony renders the prompt, and its parser reads the output
            self.plan, self.prefill, job = await prepare_harmony(ctx, req, self.large, top_logprobs)
            self.thinking = False
            return job
        check_template_fields(ctx, req)
        images = image_parts(req.messages)
        if images:
            check_images(ctx, req.model, images)
        self.plan = plan = plan_tools(req, ctx.tool_parser, ctx.tokenizer)
        text, ids = await ctx.offload.run(render, ctx, req, plan.tools, bool(images),
                                          large=self.large or req.chat_template is not None)
        prompt: Prompt = ids
        if images:  # loaded and processed before anything reaches the engine: a bad image adds no request
            prompt = await image_prompt(ctx, text, ids, images)
            ids = prompt["prompt_token_ids"]
        self.thinking = ctx.reasoning_parser is not None and bool(ctx.reasoning_parser.prompt_opens_reasoning(ids))
        requested, field_name = req.requested_max_tokens
        return Job([prompt], "messages", requested, field_name, logprobs=top_logprobs, constraint=plan.constraint,
                   skip_special_tokens=plan.skip_special_tokens)

    @property
    def splits_reasoning(self) -> bool:
        """Whether outputs are read for reasoning (--reasoning-parser, or a harmony model)."""
        return self.ctx.reasoning_parser is not None or self.ctx.harmony

    def _harmony(self) -> HarmonyStream:
        """A parser of one choice's harmony output (it starts inside the prompt's prefill)."""
        return HarmonyStream(encoding_or_503(), self.prefill, calls_allowed=self.plan.choice != "none", parallel=self.plan.parallel)

    def parse(self, c: CompletionOutput) -> ParsedTurn:
        """A finished output as reasoning, content and tool calls."""
        ctx = self.ctx
        if ctx.harmony:
            parsed = self._harmony().parse_all(c.token_ids)
            return ParsedTurn(parsed.reasoning, parsed.content, list(parsed.tool_calls))
        reasoning, text = None, c.text
        if ctx.reasoning_parser is not None:
            reasoning, text = ctx.reasoning_parser.extract(c.text, self.thinking)
        content, calls = parse_output(self.plan, text or "")
        return ParsedTurn(reasoning, content, calls)

    def stream(self) -> TurnStream:
        """A parser of one choice's streamed output."""
        rp = self.ctx.reasoning_parser
        return TurnStream(ToolStream(self.plan), rp.streamer(self.thinking) if rp is not None else None,
                          self._harmony() if self.ctx.harmony else None)

    def finish_reason(self, c: CompletionOutput, called: bool) -> str | None:
        """OpenAI's finish_reason: "tool_calls" when the model chose to call (a named function's
        call ends with "stop", as OpenAI's does)."""
        reason = openai_finish_reason(c.finish_reason)
        if reason == "stop" and called and self.plan.choice in ("auto", "required"):
            return "tool_calls"
        return reason


@dataclass
class TurnStream:
    """One streamed choice's parsers: reasoning, tool calls, or a harmony model's channels."""

    tools: ToolStream
    reasoning: Any = None  # a ReasoningStreamer, with --reasoning-parser
    harmony: HarmonyStream | None = None  # a harmony model's parser (it reads tokens, not text)

    @property
    def called(self) -> bool:
        return self.harmony.called if self.harmony is not None else self.tools.called

    def deltas(self, text: str, final: bool, token_ids: Sequence[int] = ()) -> list[dict[str, Any]]:
        """OpenAI `delta` dicts for new output (and, when `final`, whatever the parsers held back)."""
        if self.harmony is not None:
            return self.harmony.feed(list(token_ids)) + (self.harmony.finish() if final else [])
        out: list[dict[str, Any]] = []
        if self.reasoning is None:
            answer = text
        else:
            r, answer = self.reasoning.feed(text) if text else ("", "")
            if final:
                r2, a2 = self.reasoning.finish()
                r, answer = r + r2, answer + a2
            if r:
                out.append({"reasoning_content": r})
        out += self.tools.feed(answer)
        if final:
            out += self.tools.finish()
        return out


def check_top_logprobs(ctx: ServingContext, top_k: int | None, field_name: str = "top_logprobs") -> int | None:
    """`top_k`, or a 400 when it is over --max-logprobs."""
    if top_k is not None and 0 <= ctx.max_logprobs < top_k:
        raise bad_request(f"{field_name}: {top_k} requested, more than the {ctx.max_logprobs} this server allows "
                          "(--max-logprobs); ask for fewer", field_name)
    return top_k
