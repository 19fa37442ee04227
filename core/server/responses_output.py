"""The output of an OpenAI Response: its items (`reasoning`, `message`, `function_call`) from a
finished turn, and the typed stream events that deliver them piece by piece.

A stream is `response.created` and `response.in_progress` (the response without output), then
per item `response.output_item.added`, its content (`response.content_part.added`, the text's or
the reasoning's `.delta` events, their `.done`, `response.content_part.done`; a function call's
`response.function_call_arguments.delta` / `.done`) and `response.output_item.done`, and last
`response.completed` (or `response.incomplete`, or `response.failed`) with the whole response.
Every event has its `sequence_number`, from 0. Items are streamed one at a time, in the order the
turn's reader (`portside.server.chat_turn.TurnStream`) hands out reasoning, content and calls.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from portside.server.chat_turn import ParsedTurn


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, status: str = "completed", rid: str | None = None) -> dict[str, Any]:
    """A reasoning item: the whole reasoning as its content (no summary is written)."""
    return {"id": rid or item_id("rs"), "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}


def output_text(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(text: str, status: str = "completed", logprobs: list[dict[str, Any]] | None = None,
                 mid: str | None = None) -> dict[str, Any]:
    return {"id": mid or item_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [output_text(text, logprobs)]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed", fid: str | None = None) -> dict[str, Any]:
    return {"id": fid or item_id("fc"), "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


def output_items(parsed: ParsedTurn, incomplete: bool, logprobs: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """A finished turn's items: its reasoning, its text (also when empty, unless it only called),
    its calls. `incomplete`: cut at the output limit (the last item is then incomplete)."""
    items = []
    if parsed.reasoning:
        items.append(reasoning_item(parsed.reasoning))
    if parsed.content or not (parsed.tool_calls or parsed.reasoning):
        items.append(message_item(parsed.content or "", logprobs=logprobs))
    for call in parsed.tool_calls:
        items.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    if incomplete and items:
        items[-1]["status"] = "incomplete"
    return items


def usage(input_tokens: int, output_tokens: int, cached: int, reasoning: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        # portside's prefix cache has no separate write step a client pays for: cache_write_tokens is 0
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": min(reasoning, output_tokens)},
        "total_tokens": input_tokens + output_tokens,
    }


class EventStream:
    """The events of one streamed response. `snapshot(status, output, usage)` is the response
    body at that point (the endpoint's); `feed` takes the turn's OpenAI-style deltas."""

    def __init__(self, snapshot: Callable[..., dict[str, Any]]) -> None:
        self.snapshot = snapshot
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # every item so far; the last may be open
        self.open: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}  # a streamed call's index -> its item
        self.logprobs: list[dict[str, Any]] = []  # the open message's, so far

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        out = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return out

    def start(self) -> list[dict[str, Any]]:
        return [self.event("response.created", response=self.snapshot("in_progress", [])),
                self.event("response.in_progress", response=self.snapshot("in_progress", []))]

    def _index(self) -> int:
        return len(self.items) - 1

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        out = self.close()
        self.items.append(item)
        self.open = item
        added = {k: v for k, v in item.items()} | {"status": "in_progress"}
        if item["type"] == "function_call":
            added["arguments"] = ""
        out.append(self.event("response.output_item.added", output_index=self._index(), item=added))
        part = None
        if item["type"] == "message":
            part = output_text("")
            added["content"] = []
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
            added["content"] = []
        if part is not None:
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=self._index(), content_index=0,
                                  part=part))
        return out

    def feed(self, delta: dict[str, Any], logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The events of one delta (`logprobs`: those of the tokens behind a text delta)."""
        out: list[dict[str, Any]] = []
        if delta.get("reasoning_content"):
            if self.open is None or self.open["type"] != "reasoning":
                out += self._open(reasoning_item("", "in_progress"))
            assert self.open is not None
            self.open["content"][0]["text"] += delta["reasoning_content"]
            out.append(self.event("response.reasoning_text.delta", item_id=self.open["id"], output_index=self._index(),
                                  content_index=0, delta=delta["reasoning_content"]))
        if delta.get("content") or (logprobs and "content" in delta):
            if self.open is None or self.open["type"] != "message":
                out += self._open(message_item("", "in_progress"))
            assert self.open is not None
            self.open["content"][0]["text"] += delta["content"]
            self.logprobs += logprobs
            out.append(self.event("response.output_text.delta", item_id=self.open["id"], output_index=self._index(),
                                  content_index=0, delta=delta["content"], logprobs=logprobs))
        for call in delta.get("tool_calls") or ():
            fn = call.get("function") or {}
            if "id" in call:  # a new call: its id and name come first
                out += self._open(call_item(call["id"], fn.get("name", ""), "", "in_progress"))
                assert self.open is not None
                self.calls[call["index"]] = self.open
            item = self.calls.get(call["index"])
            if item is not None and fn.get("arguments"):
                item["arguments"] += fn["arguments"]
                if item is self.open:  # (a closed call's late arguments still reach its final item)
                    out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                          output_index=self.items.index(item), delta=fn["arguments"]))
        return out

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        """The events that end the open item (none when no item is open)."""
        item, self.open = self.open, None
        if item is None:
            return []
        index, out = self._index(), []
        item["status"] = status
        if item["type"] == "message":
            item["content"][0]["logprobs"] = self.logprobs
            self.logprobs = []
            part = item["content"][0]
            out.append(self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                                  text=part["text"], logprobs=part["logprobs"]))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                                  text=part["text"]))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part))
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=item["arguments"]))
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out

    def finish(self, incomplete: bool, final_usage: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The closing events and the final response body (every item complete, or, when cut at
        the output limit, the last one incomplete)."""
        out = self.close("incomplete" if incomplete else "completed")
        if not self.items:  # nothing at all came out: an empty message, as a whole response has
            out += self._open(message_item("", "in_progress"))
            out += self.close("incomplete" if incomplete else "completed")
        body = self.snapshot("incomplete" if incomplete else "completed", self.items, final_usage)
        out.append(self.event("response.incomplete" if incomplete else "response.completed", response=body))
        return out, body

    def failed(self, code: str, message: str) -> dict[str, Any]:
        """`response.failed`: the response so far, its status failed and its error set."""
        body = self.snapshot("failed", self.items, None)
        body["error"] = {"code": code, "message": message}
        return self.event("response.failed", response=body)
