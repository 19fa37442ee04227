"""What a chat request asks of a harmony model's output (gpt-oss), and its prompt.

The model's own turn starts after ``<|start|>assistant``. Where the request leaves it free, the
model picks its channels (analysis, then a final answer or a call). Where the request decides, the
prompt ends with a prefill that opens the message the output must be, and the structured-output
engine holds the rest:

- tool_choice "none": the tools are not shown (the model is not told it could call them); a
  message to a function would come back as content;
- "auto": the tools are shown; the model's calls (``to=functions.NAME``) become `tool_calls`;
- a named function: the prefill is ``<|channel|>commentary to=functions.NAME <|constrain|>json
  <|message|>`` and the output is constrained to the function's parameters schema: one call;
- "required": one tool, as named; several, the prefill is ``<|channel|>`` and a grammar (llguidance)
  allows ``commentary to=functions.`` + one of the names + `` <|constrain|>json<|message|>`` +
  arguments valid for that function's schema: one call, to a tool of the model's choosing;
- the request's own constraint (response_format, structured_outputs, guided_*): a JSON schema,
  JSON object, regex or choice constrains the final answer, the prefill ``<|channel|>final
  <|message|>`` (no analysis first); a grammar constrains the whole turn from its first header
  token, special tokens written ``<|channel|>`` or ``<[200005]>`` (llguidance Lark).

A forced call or answer skips the analysis channel: the grammar engines hold a constraint from
the first output token.
"""

from __future__ import annotations

import json
from typing import Any

from portside.server.context import ServingContext
from portside.server.errors import bad_request
from portside.server.harmony import encoding_or_503, render_harmony
from portside.server.pipeline import Job
from portside.server.protocol.bodies import ChatCompletionRequest
from portside.server.protocol.messages import NamedToolChoice
from portside.server.structured import request_constraint
from portside.server.tools import ToolPlan
from portside.structured.params import StructuredOutputsParams

_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
FINAL = "<|channel|>final<|message|>"
TEMPLATE_KWARGS = frozenset({"reasoning_effort"})  # chat_template_kwargs harmony reads (vLLM's)


def call_prefill(name: str) -> str:
    return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"


def _lark_string(text: str) -> str:
    return json.dumps(text)


def required_grammar(encoding: Any, params: dict[str, dict[str, Any]]) -> str:
    """The llguidance Lark grammar of one call to any of the functions (after ``<|channel|>``)."""
    constrain, message = (encoding.encode(t, allowed_special="all")[0] for t in ("<|constrain|>", "<|message|>"))
    calls = []
    for i, (name, schema) in enumerate(params.items()):
        closed = StructuredOutputsParams(json=schema, disable_additional_properties=True).schema()
        body = json.dumps({**closed, "x-guidance": {"whitespace_flexible": False}}, ensure_ascii=False)  # type: ignore[dict-item]
        calls.append(f"call{i}: {_lark_string(name)} \" \" <[{constrain}]> \"json\" <[{message}]> %json {body}")
    alternatives = " | ".join(f"call{i}" for i in range(len(calls)))
    return "\n".join([f"start: \"commentary to=functions.\" ({alternatives})", *calls])


def plan_harmony(req: ChatCompletionRequest, encoding: Any, backend: str | None) -> tuple[ToolPlan, str]:
    """The tool plan (tools shown, the constraint tool_choice imposes) and the prefill."""
    choice = req.effective_tool_choice
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    own, _ = request_constraint(req)
    answer = "" if own is None or own.kind == "grammar" else FINAL  # where the request's own constraint starts
    if choice == "none" or not req.tools:
        return ToolPlan("none", None), answer
    if choice == "auto":
        return ToolPlan("auto", tools, parallel=req.parallel_tool_calls), answer
    params = {t.function.name: t.function.parameters or _NO_PARAMETERS for t in req.tools}
    if isinstance(choice, NamedToolChoice) or len(params) == 1:
        name = choice.function.name if isinstance(choice, NamedToolChoice) else next(iter(params))
        constraint = StructuredOutputsParams(json=params[name], disable_additional_properties=True)
        return ToolPlan("named" if isinstance(choice, NamedToolChoice) else "required", tools, name=name,
                        constraint=constraint), call_prefill(name)
    if backend not in (None, "llguidance", "auto"):
        raise bad_request('tool_choice: "required" with several tools needs the llguidance grammar engine for a harmony '
                          "model (its grammar names harmony's special tokens); the server runs "
                          f"--structured-outputs-backend {backend}: name one function instead", "tool_choice")
    grammar = required_grammar(encoding, params)
    return ToolPlan("required", tools, constraint=StructuredOutputsParams(grammar=grammar)), "<|channel|>"


def check_harmony_fields(req: ChatCompletionRequest) -> None:
    """The 400s for what a harmony prompt cannot honour."""
    if req.chat_template is not None:
        raise bad_request("chat_template: this model's prompts are rendered in the harmony format (gpt-oss), not by a "
                          "chat template", "chat_template")
    extra = sorted(set(req.chat_template_kwargs or {}) - TEMPLATE_KWARGS)
    if extra:
        raise bad_request(f"chat_template_kwargs: {extra[0]!r} is not read by the harmony format (gpt-oss); it reads "
                          "reasoning_effort only", "chat_template_kwargs")
    if req.continue_final_message or not req.add_generation_prompt:
        name = "continue_final_message" if req.continue_final_message else "add_generation_prompt"
        raise bad_request(f"{name}: the harmony format (gpt-oss) always renders the assistant's next turn", name)


def reasoning_effort(req: ChatCompletionRequest) -> str | None:
    effort = req.reasoning_effort
    kwarg = (req.chat_template_kwargs or {}).get("reasoning_effort")
    if effort is None and kwarg is not None:
        if kwarg not in ("low", "medium", "high"):
            raise bad_request(f"chat_template_kwargs.reasoning_effort: {kwarg!r} is not one of low, medium, high",
                              "chat_template_kwargs")
        effort = kwarg
    return effort


async def prepare_harmony(ctx: ServingContext, req: ChatCompletionRequest, large: bool,
                          top_k: int | None) -> tuple[ToolPlan, list[int], Job]:
    """Stage 2 of chat completions for a harmony model: the tool plan, the prefill's token ids
    (where the output parser starts) and the job."""
    check_harmony_fields(req)
    encoding = encoding_or_503()
    backend = getattr(ctx.structured, "backend_name", None)
    plan, prefill = plan_harmony(req, encoding, backend)
    ids = await ctx.offload.run(render_harmony, encoding, req.messages, plan.tools, reasoning_effort(req), prefill, large=large)
    prefill_ids = encoding.encode(prefill, allowed_special="all") if prefill else []
    requested, field_name = req.requested_max_tokens
    job = Job([ids], "messages", requested, field_name, logprobs=top_k, constraint=plan.constraint, constrain_reasoning=False,
              stop_token_ids=list(encoding.stop_tokens_for_assistant_actions()))
    return plan, prefill_ids, job
