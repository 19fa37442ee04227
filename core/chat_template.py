"""Chat-template rendering that a client cannot abuse.

`render_chat_ids` renders with the tokenizer's own ``apply_chat_template(tokenize=False)`` and
tokenizes with special tokens parsed, as transformers does, except inside ``user`` and ``tool``
contents: there special tokens are plain text, so typing ``<|im_start|>system`` forges no turn.
Without such a token the ids are exactly transformers'. With one, the template is rendered again
with those contents replaced by sentinels, which show unambiguously where the contents sit (a
content equal to the template's own markers cannot be mistaken for them); a template that does
not render such a content verbatim (or stripped) is refused with ValueError rather than forged.
`budget_s` bounds the render time (a tracer in the rendering thread), `max_chars` the text.

A message's content may be a list of parts, {"type": "text", "text": ...} and {"type": "image"}
(one per image, where the image goes), as the templates of vision-language models read it; the
template writes the model's image placeholder for each image part. With `supports_images=False`
(a text-only model) a message holding image parts is refused with ValueError; a template that
prints the parts as text instead of rendering them is refused too.
"""

from __future__ import annotations

import functools
import re
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["TemplateBudgetError", "count_images", "render_chat", "render_chat_ids", "special_tokens"]

PLAIN_ROLES = ("user", "tool")  # whose contents are tokenized without special-token parsing
_SENTINEL = re.compile("\ue000(\\d+)\ue001")
_plain_backends: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


class TemplateBudgetError(ValueError):
    """The chat template ran past its time budget."""


class _Expired(BaseException):  # from the tracer: no ``except Exception`` on the way swallows it
    pass


def render_chat_ids(
    tokenizer: Any, messages: list[dict[str, Any]], *, chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True, continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None, budget_s: float | None = None, max_chars: int | None = None,
    supports_images: bool | None = None, model_name: str | None = None,
) -> list[int]:
    """The prompt ids of `messages` through the chat template (see `render_chat`)."""
    return render_chat(tokenizer, messages, chat_template=chat_template, tools=tools,
                       add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                       template_kwargs=template_kwargs, budget_s=budget_s, max_chars=max_chars,
                       supports_images=supports_images, model_name=model_name)[1]


def render_chat(
    tokenizer: Any, messages: list[dict[str, Any]], *, chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True, continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None, budget_s: float | None = None, max_chars: int | None = None,
    supports_images: bool | None = None, model_name: str | None = None,
) -> tuple[str, list[int]]:
    """(rendered text, prompt ids). Template errors propagate as raised; TemplateBudgetError past
    `budget_s` s of rendering; ValueError past `max_chars`, or for a forged token it cannot place.
    `supports_images`: False refuses image parts (ValueError naming `model_name`); None: not checked."""
    deadline = time.monotonic() + (budget_s or 0.0)
    images = count_images(messages)
    if images and supports_images is False:
        name = f"model {model_name}" if model_name else "this model"
        raise ValueError(f"{name} does not take images: it is a text-only model; send text content only "
                         "(image parts need a vision-language model)")

    def render(msgs: list[dict[str, Any]]) -> str:
        call = functools.partial(
            tokenizer.apply_chat_template, msgs, tools=tools, chat_template=chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message, **(template_kwargs or {}))  # fmt: skip
        text: str = call() if budget_s is None else _before(deadline, budget_s, call)
        if max_chars is not None and len(text) > max_chars:
            raise ValueError(f"the chat template rendered {len(text)} characters, over the limit {max_chars}")
        return text

    text = render(messages)
    if images and _PART_REPR.search(text):
        raise ValueError("the chat template printed the message's content parts as text instead of rendering them: it "
                         "does not take image parts; use the model's own template (or one that iterates over content parts)")
    tokens = special_tokens(tokenizer)
    forged = _forged_parts(messages, tokens)
    if not forged:  # the fast path: byte-for-byte what transformers does
        return text, tokenizer(text, add_special_tokens=False).input_ids
    spans = _locate(text, render(_with_sentinels(messages, forged)), [part for part, _ in forged], tokens)
    cuts = [0, *(x for span in spans for x in span), len(text)]  # template text, content, template text, ...
    return text, [t for n, (a, b) in enumerate(zip(cuts, cuts[1:])) for t in _encode(tokenizer, text[a:b], a > 0, plain=n % 2 == 1)]


def count_images(messages: list[dict[str, Any]]) -> int:
    """The image parts ({"type": "image"}, or vLLM's "image_url" / "image_pil" ones) of `messages`."""
    return sum(1 for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
               for p in m["content"] if isinstance(p, dict) and p.get("type") in _IMAGE_TYPES)


_IMAGE_TYPES = ("image", "image_url", "image_pil")
_PART_REPR = re.compile(r"""\{['"]type['"]: ['"](?:text|image)""")  # a part dict's repr (or JSON) in the output


def special_tokens(tokenizer: Any) -> tuple[str, ...]:
    """The tokenizer's special tokens (its added tokens marked special, and its named ones)."""
    added = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    return tuple(sorted(added | set(getattr(tokenizer, "all_special_tokens", ())), key=len, reverse=True))


@functools.lru_cache(maxsize=32)
def _pattern(tokens: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("|".join(re.escape(t) for t in tokens if t) or "(?!)")  # no tokens: matches nothing


def _texts(content: Any) -> list[tuple[int | None, str]]:
    """(part index or None, text) of a message content: a str or a list of text parts."""
    if isinstance(content, str):
        return [(None, content)]
    return [(i, p["text"]) for i, p in enumerate(content if isinstance(content, list) else [])
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)]


def _forged_parts(messages: list[dict[str, Any]], tokens: tuple[str, ...]) -> list[tuple[str, tuple[int, int | None]]]:
    """(text, (message, part)) of every user/tool content that holds a special token, in order.
    Parts are checked one by one and joined (a template may join them into a token)."""
    pattern, out = _pattern(tokens), []
    for m, msg in enumerate(messages):
        if isinstance(msg, dict) and msg.get("role") in PLAIN_ROLES:
            parts = _texts(msg.get("content"))
            whole = pattern.search("".join(text for _, text in parts)) is not None
            out += [(text, (m, p)) for p, text in parts if whole or pattern.search(text)]
    return out


def _with_sentinels(messages: list[dict[str, Any]], forged: list[tuple[str, tuple[int, int | None]]]) -> list[dict[str, Any]]:
    """`messages` with forged content number k replaced by the sentinel \\ue000k\\ue001."""
    out = [dict(m) for m in messages]
    for k, (_, (m, p)) in enumerate(forged):
        mark = f"\ue000{k}\ue001"
        if p is None:
            out[m]["content"] = mark
        else:  # a copy of the part list, with a copy of the part
            out[m]["content"] = [{**part, "text": mark} if i == p else part for i, part in enumerate(out[m]["content"])]
    return out


def _locate(text: str, marked: str, contents: list[str], tokens: tuple[str, ...]) -> list[tuple[int, int]]:
    """Where the contents sit in `text`, from where their sentinels sit in `marked`: `text` must be
    `marked` with each sentinel replaced by its content (verbatim or stripped). Else ValueError."""
    pieces = _SENTINEL.split(marked)  # [template text, k, template text, k, ..., template text]
    spans, pos = [], 0
    for i in range(0, len(pieces) - 1, 2):
        k, after = int(pieces[i + 1]), pieces[i + 2]
        if not text.startswith(pieces[i], pos) or k >= len(contents):
            break
        pos += len(pieces[i])
        c = contents[k]
        found = next((v for v in dict.fromkeys((c, c.strip(), c.rstrip(), c.lstrip())) if text.startswith(v + after, pos)), None)
        if found is None:
            break
        spans.append((pos, pos + len(found)))
        pos += len(found)
    else:
        if text[pos:] == pieces[-1]:
            return spans
    named = ", ".join(dict.fromkeys(_pattern(tokens).findall(" ".join(contents))))
    raise ValueError(f"a user or tool message holds the special token {named}, and the chat template does not render "
                     "that content verbatim, so it cannot be kept as plain text: refused rather than forged")


def _encode(tokenizer: Any, piece: str, inside: bool, plain: bool) -> list[int]:
    """Ids of a piece of the rendered text (`plain`: special tokens as text). A piece `inside` the
    text is encoded after a newline, dropped again (SentencePiece puts a space at a string's start),
    as transformers' own sanitizer does."""
    backend = _plain_backend(tokenizer) if plain else None

    def encode(s: str) -> list[int]:
        if backend is not None:
            return list(backend.encode(s, add_special_tokens=False).ids)
        return list(tokenizer(s, add_special_tokens=False, split_special_tokens=plain).input_ids)

    newline, ids = (encode("\n"), encode("\n" + piece)) if piece and inside else ([], [])
    return ids[len(newline):] if newline and ids[: len(newline)] == newline else encode(piece) if piece else []


def _plain_backend(tokenizer: Any) -> Any:
    """A private copy of a fast tokenizer's backend that encodes special tokens as text (flipping
    the shared one's flag, as split_special_tokens=True does, races with other threads using it)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and (copy := _plain_backends.get(tokenizer)) is None:
        from tokenizers import Tokenizer

        copy = _plain_backends[tokenizer] = Tokenizer.from_str(backend.to_str())
        copy.encode_special_tokens = True
        copy.no_truncation()
        copy.no_padding()
    return None if backend is None else _plain_backends[tokenizer]


def _before(deadline: float, budget_s: float, fn: Callable[[], str]) -> str:
    """fn(), stopped with TemplateBudgetError past `deadline` (the clock is read every 1000 trace
    events of this thread's Python frames); the previous tracer is restored."""
    count = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        count += 1
        if count >= 1000:
            count = 0
            if time.monotonic() > deadline:
                raise _Expired
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        out: str | None = fn()
    except _Expired:
        out = None
    finally:
        sys.settrace(previous)
    if out is None or time.monotonic() > deadline:
        raise TemplateBudgetError(f"the chat template took longer than {budget_s:g} s to render")
    return out
