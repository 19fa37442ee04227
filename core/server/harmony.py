"""gpt-oss's harmony chat format, through OpenAI's `openai_harmony` package: which servers use it,
its encoding (the o200k vocabulary, offline through ``TIKTOKEN_ENCODINGS_BASE``), and a chat
request rendered as a harmony conversation.

A harmony model's prompt is not a Jinja template: `render_harmony` builds the conversation as
openai_harmony's messages and renders it for the assistant's next turn:

- a system message (openai_harmony's defaults) whose ``Reasoning:`` line is the request's
  ``reasoning_effort`` (low / medium / high; medium when unset);
- a developer message: the request's system and developer messages as its instructions, and its
  ``tools`` (unless tool_choice is "none") as the ``functions`` namespace;
- user messages; assistant turns as their reasoning (analysis channel), tool calls (commentary
  channel, ``to=functions.NAME``, ``<|constrain|>json``) and content (final channel); tool results
  as messages from ``functions.NAME`` (named by the call their ``tool_call_id`` answers).

What the output must be is said by an assistant prefix rendered into the prompt (the prefill) and,
where needed, a grammar (`portside.server.harmony_plan`). The output is parsed back by
`portside.server.harmony_output`.
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path
from typing import Any

from portside.server.errors import APIError, bad_request

HARMONY_MODEL_TYPES = frozenset({"gpt_oss"})
HARMONY_ARCHITECTURES = frozenset({"GptOssForCausalLM"})
VOCAB_ENV = "TIKTOKEN_ENCODINGS_BASE"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
CHAT_FORMATS = ("auto", "harmony", "template")
HARMONY_TOOL_PARSER = "openai"  # vLLM's --tool-call-parser for gpt-oss: accepted, harmony parses the calls itself

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # what a tool's name may be (as `tools` requires), in a header
_lock = threading.Lock()
_encoding: Any = None


class HarmonyUnavailable(ValueError):
    """openai_harmony could not load its vocabulary (the message says how to provide it)."""


def is_harmony_model(path: str | os.PathLike[str] | None) -> bool:
    """Whether the model folder at `path` is a harmony model (gpt-oss), from its config.json."""
    if path is None or not os.path.isdir(path):
        return False
    try:
        with open(Path(path) / "config.json") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return config.get("model_type") in HARMONY_MODEL_TYPES or bool(HARMONY_ARCHITECTURES & set(config.get("architectures") or ()))


def use_harmony(chat_format: str, model_path: str | os.PathLike[str] | None) -> bool:
    """What `--chat-format` (auto, harmony, template) means for this model."""
    if chat_format not in CHAT_FORMATS:
        raise ValueError(f"--chat-format {chat_format!r}: use one of {', '.join(CHAT_FORMATS)}")
    return chat_format == "harmony" or (chat_format == "auto" and is_harmony_model(model_path))


def load_encoding() -> Any:
    """openai_harmony's gpt-oss encoding (loaded once; a failure is retried on the next call).
    HarmonyUnavailable naming ``TIKTOKEN_ENCODINGS_BASE`` when the vocabulary cannot be read."""
    global _encoding
    with _lock:
        if _encoding is not None:
            return _encoding
        try:
            from openai_harmony import HarmonyEncodingName, load_harmony_encoding

            _encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
        except ImportError as e:
            raise HarmonyUnavailable(f"the harmony chat format (gpt-oss) needs the openai-harmony package: "
                                     f"pip install openai-harmony ({e})") from None
        except Exception as e:  # openai_harmony.HarmonyError: no vocabulary file, no network
            where = os.environ.get(VOCAB_ENV)
            hint = (f"{VOCAB_ENV}={where} must be a folder holding o200k_base.tiktoken" if where else
                    f"without network, put o200k_base.tiktoken in a folder and set {VOCAB_ENV} to that folder")
            raise HarmonyUnavailable(
                f"the harmony chat format (gpt-oss) could not load the o200k_base vocabulary, which openai_harmony "
                f"downloads on first use: {hint} (sha256 {O200K_SHA256}; the bpe-openai package ships it as "
                f"bpe_openai/data/o200k_base.tiktoken.gz, to gunzip) ({e})"
            ) from None
        return _encoding


def encoding_or_503() -> Any:
    """`load_encoding()` for a request: the failure is the server's, a 503 that says how to fix it."""
    try:
        return load_encoding()
    except HarmonyUnavailable as e:
        raise APIError(503, str(e), code="harmony_vocab_unavailable") from None


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    raise bad_request(f"{where}: the harmony chat format takes text content only (gpt-oss reads no images)", where)


def harmony_messages(messages: list[Any], tools: list[dict[str, Any]] | None, reasoning_effort: str | None) -> list[Any]:
    """A chat request's messages (`ChatMessage`s) as openai_harmony messages, system and developer
    first; a 400 for what harmony cannot express."""
    from openai_harmony import (
        Author,
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
        ToolDescription,
    )

    system = SystemContent.new()
    if reasoning_effort is not None:
        system = system.with_reasoning_effort(ReasoningEffort(reasoning_effort.capitalize()))
    out = [Message.from_role_and_content(Role.SYSTEM, system)]
    instructions = [_text(m.content, f"messages[{i}].content") for i, m in enumerate(messages) if m.role in ("system", "developer")]
    developer = DeveloperContent.new()
    if any(instructions):
        developer = developer.with_instructions("\n\n".join(t for t in instructions if t))
    if tools:
        developer = developer.with_function_tools([
            ToolDescription.new(t["function"]["name"], t["function"].get("description") or "", parameters=t["function"].get("parameters"))
            for t in tools
        ])  # fmt: skip
    if any(instructions) or tools:
        out.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    call_names: dict[str, str] = {}
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.role in ("system", "developer"):
            continue
        if m.role == "user":
            out.append(Message.from_role_and_content(Role.USER, _text(m.content, f"{where}.content")))
        elif m.role == "assistant":
            if m.reasoning_content:
                out.append(Message.from_role_and_content(Role.ASSISTANT, m.reasoning_content).with_channel("analysis"))
            text = _text(m.content, f"{where}.content") or (m.refusal or "")
            if m.tool_calls:
                if text:  # what the model said beside its calls: harmony's commentary preamble
                    out.append(Message.from_role_and_content(Role.ASSISTANT, text).with_channel("commentary"))
                for j, c in enumerate(m.tool_calls):
                    if not _NAME.fullmatch(c.function.name):
                        where_name = f"{where}.tool_calls[{j}].function.name"
                        raise bad_request(f"{where_name}: {c.function.name!r} is not a function name (letters, digits, _ and "
                                          "-) that a harmony header can address", where_name)
                    call_names[c.id] = c.function.name
                    out.append(Message.from_role_and_content(Role.ASSISTANT, c.function.arguments).with_channel("commentary")
                               .with_recipient(f"functions.{c.function.name}").with_content_type("<|constrain|>json"))
            elif text:
                out.append(Message.from_role_and_content(Role.ASSISTANT, text).with_channel("final"))
        elif m.role == "tool":
            name = call_names.get(m.tool_call_id or "") or m.name
            if name is None:
                raise bad_request(f"{where}.tool_call_id: {m.tool_call_id!r} answers no tool call of an earlier assistant "
                                  "message (harmony names a tool result by its function)", f"{where}.tool_call_id")
            author = Author.new(Role.TOOL, f"functions.{name}")
            out.append(Message.from_author_and_content(author, _text(m.content, f"{where}.content"))
                       .with_channel("commentary").with_recipient("assistant"))
    return out


def render_harmony(encoding: Any, messages: list[Any], tools: list[dict[str, Any]] | None, reasoning_effort: str | None,
                   prefill: str = "") -> list[int]:
    """The prompt's token ids: the conversation rendered for the assistant's next turn (ending
    ``<|start|>assistant``), then `prefill` (harmony text, special tokens allowed) when given."""
    from openai_harmony import Conversation, Role

    conversation = Conversation.from_messages(harmony_messages(messages, tools, reasoning_effort))
    ids = list(encoding.render_conversation_for_completion(conversation, Role.ASSISTANT))
    return ids + (encoding.encode(prefill, allowed_special="all") if prefill else [])
