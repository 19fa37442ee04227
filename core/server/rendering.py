"""Messages to a prompt, for every endpoint that takes a conversation (chat completions, and
/tokenize and /v1/embeddings with `messages`): the request's template fields checked, the
conversation rendered through the chat template on an offload worker, and its images loaded and
processed before anything reaches the engine.

Special tokens written in user and tool messages are plain text (`portside.chat_template`): a
user cannot forge a turn. A template sent with a request runs under a time and size budget.

Images (`image_url` content parts, vision-language models): the template renders an image
placeholder per image part; the images are loaded by the server's `MediaConnector` (downloads
awaited, decoding in worker threads) and processed by the engine's `process_multimodal` (in a
worker thread too) before the request is added, so a bad image is a 400 and the engine never sees
the request."""

from __future__ import annotations

from typing import Any

from portside.chat_template import render_chat
from portside.multimodal.media import ImageLoadError
from portside.server.context import ServingContext
from portside.server.errors import APIError, bad_request
from portside.server.harmony import encoding_or_503, render_harmony
from portside.server.tools import template_messages

# apply_chat_template's own parameters: a request's chat_template_kwargs may not set them
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs",
})  # fmt: skip
REQUEST_TEMPLATE_BUDGET_S = 2.0  # render time a template sent with a request may take
REQUEST_TEMPLATE_MAX_CHARS = 8 << 20  # and the most text it may render


def check_template_fields(ctx: ServingContext, req: Any) -> None:
    """The 400s for a request's own template (`chat_template`) and its variables
    (`chat_template_kwargs`): chat completions and every endpoint that renders messages."""
    if req.chat_template is not None and not ctx.trust_request_chat_template:
        raise bad_request("chat_template: this server does not render templates sent with a request; its operator "
                          "can allow them with --trust-request-chat-template", "chat_template")
    bad = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(req.chat_template_kwargs or {}))
    if bad:
        raise bad_request(f"chat_template_kwargs: {bad[0]!r} is a parameter of the template call itself, not a "
                          "template variable", "chat_template_kwargs")


def render(ctx: ServingContext, req: Any, tools: list[dict[str, Any]] | None, images: bool = False) -> tuple[str, list[int]]:
    """The text and token ids of `req.messages` through the chat template (on an offload worker,
    with its tokenizer). `images`: the conversation holds image parts (refused for a text-only model)."""
    template = req.chat_template or ctx.chat_template
    tok = ctx.offload.tokenizer()
    if template is None and not getattr(tok, "chat_template", None):
        raise bad_request("this model has no chat template; start the server with --chat-template", "messages")
    untrusted = req.chat_template is not None
    try:
        return render_chat(
            tok, template_messages(req), chat_template=template, tools=tools, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, template_kwargs=_template_kwargs(req),
            budget_s=REQUEST_TEMPLATE_BUDGET_S if untrusted else None, max_chars=REQUEST_TEMPLATE_MAX_CHARS if untrusted else None,
            supports_images=supports_images(ctx) if images else None, model_name=req.model,
        )  # fmt: skip
    except Exception as e:  # template errors (e.g. a template that enforces role order) are the request's fault
        raise bad_request(f"the chat template could not render these messages: {e}", "messages") from None


def _template_kwargs(req: Any) -> dict[str, Any] | None:
    """The template's variables: the request's, and its `reasoning_effort` (which templates such
    as gpt-oss's read) unless it sets one itself."""
    effort = getattr(req, "reasoning_effort", None)
    if effort is None:
        return req.chat_template_kwargs
    return {"reasoning_effort": effort, **(req.chat_template_kwargs or {})}


def render_ids(ctx: ServingContext, req: Any) -> list[int]:
    """The token ids of `req.messages` as chat completions render them, for /tokenize and
    /v1/embeddings (on an offload worker); with add_special_tokens, wrapped in the tokenizer's
    own special tokens."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if getattr(req, "tools", None) else None
    if ctx.harmony:  # a gpt-oss model: its prompt is harmony's, as chat completions render it
        ids = render_harmony(encoding_or_503(), req.messages, tools, getattr(req, "reasoning_effort", None))
        return with_special_tokens(ctx.offload.tokenizer(), ids) if req.add_special_tokens else ids
    _, ids = render(ctx, req, tools)
    return with_special_tokens(ctx.offload.tokenizer(), ids) if req.add_special_tokens else ids


def with_special_tokens(tok: Any, ids: list[int]) -> list[int]:
    """`ids` wrapped in the special tokens the tokenizer adds around a text (a BOS, say)."""
    plain = tok("a", add_special_tokens=False).input_ids
    full = tok("a", add_special_tokens=True).input_ids
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return full[:i] + ids + full[i + len(plain) :]
    return ids


def supports_images(ctx: ServingContext) -> bool:
    """Whether the served model takes images (a vision-language model)."""
    value = getattr(ctx.engine, "supports_images", None)
    if value is None:
        value = getattr(getattr(ctx.engine, "engine", None), "supports_images", False)
    return bool(value)


def image_parts(messages: list[Any]) -> list[tuple[str, str]]:
    """(parameter, URL) of every image of the conversation, in order: messages[i].content[j]."""
    out = []
    for i, m in enumerate(messages):
        urls = iter(m.image_urls)
        if isinstance(m.content, list):
            out += [(f"messages[{i}].content[{j}]", next(urls)) for j, p in enumerate(m.content) if p.get("type") == "image"]
    return out


def _image_limit(ctx: ServingContext) -> int | None:
    """--limit-mm-per-prompt's image count (None: unknown here; the engine checks it)."""
    config = getattr(getattr(ctx.engine, "engine", None), "config", None)
    multimodal = getattr(config, "multimodal", None)
    return multimodal.limit("image") if multimodal is not None else None


def check_images(ctx: ServingContext, model: str, images: list[tuple[str, str]]) -> None:
    """The 400s an image request gets before any image is read."""
    if not supports_images(ctx):  # about the message, not one image: the param names its content
        where = images[0][0].rsplit("[", 1)[0]
        raise bad_request(f"{where}: model {model!r} does not take images: it is a text-only model; send text content "
                          "only (image parts need a vision-language model)", where)
    limit = _image_limit(ctx)
    if limit is not None and len(images) > limit:
        raise bad_request(f"{images[limit][0]}: {len(images)} images in one request, more than the {limit} this server allows per prompt "
                          "(its operator can raise it with --limit-mm-per-prompt '{\"image\": N}')", images[limit][0])


async def image_prompt(ctx: ServingContext, text: str, ids: list[int], images: list[tuple[str, str]]) -> dict[str, Any]:
    """The engine's processed prompt for the rendered conversation and its images. Reading and
    decoding happen in worker threads (`MediaConnector.load_images`), processing too
    (`process_multimodal`); every failure is a 400 naming the image."""
    try:
        loaded = await ctx.media.load_images([url for _, url in images])
    except ImageLoadError as e:
        raise bad_request(f"{images[e.index][0]}: the image could not be loaded: {e.reason}", images[e.index][0]) from None
    process = getattr(ctx.engine, "process_multimodal", None)
    if process is None:
        raise APIError(501, "this server's engine cannot process images", param=images[0][0], code="not_implemented")
    try:
        return await process({"prompt": text, "prompt_token_ids": ids, "multi_modal_data": {"image": loaded}},
                             add_special_tokens=False)
    except ValueError as e:  # too many images, a model without images, a processor's refusal
        raise bad_request(f"messages: {e}", "messages") from None
    finally:
        del loaded
