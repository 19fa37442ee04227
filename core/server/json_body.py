"""The JSON body of a non-streamed response: built and encoded on the event loop when small, on
the large offload lane when it holds many values (encoded in pieces, so no single C call holds
the GIL for long), and the outputs it was built from freed a slice at a time off the loop."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse, Response

from portside.outputs import RequestOutput
from portside.server.context import ServingContext

# a non-streamed response holding more values than this (tokens, logprob alternatives, prompt
# logprobs, text in 64-character units) is built and encoded off the event loop: at a few
# microseconds a value, one under it stalls the loop for at most some tens of milliseconds
LARGE_RESPONSE_VALUES = 8192
_JSON_PIECE_VALUES = 2048  # values per json.dumps call when encoding a large body


def response_values(finals: list[RequestOutput]) -> int:
    """About how many values the non-streamed response of `finals` holds (see LARGE_RESPONSE_VALUES)."""
    total = 0
    for out in finals:
        pl = out.prompt_logprobs
        prompt = len(pl) * len(pl[-1] or ()) if pl else 0  # completions repeat it on every choice
        for c in out.outputs:
            lp = c.logprobs
            total += len(c.text) // 64 + len(c.token_ids) + (len(lp) * len(lp[-1]) if lp else 0) + prompt
    return total


class ResponseBuilder:
    """`fn(*args)` for the response body of `outputs`, called once. Freeing the million objects
    of a large output holds the GIL as long as it takes (n=128 x 480 tokens x 21 logprobs, its
    body included: ~0.9 s in one go), so the call takes the outputs apart a slice at a time once
    the body is built, on the thread that built it, and lets go of them; the caller hands over
    its only references (`del`), so nothing large is freed on the event loop."""

    def __init__(self, fn: Callable[..., dict[str, Any]], *args: Any, outputs: list[RequestOutput]) -> None:
        self._call: Callable[[], dict[str, Any]] | None = functools.partial(fn, *args)
        self._outputs: list[RequestOutput] | None = outputs

    def __call__(self) -> dict[str, Any]:
        call, self._call = self._call, None
        outputs, self._outputs = self._outputs, None
        assert call is not None and outputs is not None, "a response is built once"
        body = call()
        del call
        for out in outputs:
            release(out.prompt_logprobs)
            for c in out.outputs:
                release(c.logprobs)
        return body


async def json_response(ctx: ServingContext, build: ResponseBuilder, values: int) -> Response:
    """The JSON response of a non-streamed request: `build()` and its encoding on the event loop
    when it holds up to LARGE_RESPONSE_VALUES values, else on the large offload lane (not
    refused when the lane is busy: the generation is done), encoded in pieces."""
    if values <= LARGE_RESPONSE_VALUES:
        return JSONResponse(build())
    body = await ctx.offload.run(_build_and_encode, build, large=True, refusable=False)
    return Response(body, media_type="application/json")


def _build_and_encode(build: ResponseBuilder) -> bytes:
    body = build()
    try:
        return encode_json(body)
    finally:
        release(body)


def release(obj: Any) -> None:
    """Empty a large list or dict (and the large ones inside it) a slice of about
    _JSON_PIECE_VALUES values at a time: freeing them all in one go holds the GIL throughout."""
    if not isinstance(obj, (dict, list)) or _weight(obj) <= _JSON_PIECE_VALUES:
        return
    if isinstance(obj, dict):
        for value in obj.values():
            release(value)
        obj.clear()
        return
    step = _piece_step(obj)
    while obj:
        if step == 1:
            release(obj[-1])
        del obj[-step:]


def encode_json(obj: Any) -> bytes:
    """`obj` as JSONResponse encodes it (the same bytes), but in pieces of about
    _JSON_PIECE_VALUES values, each one json.dumps call: a C call holds the GIL throughout, and
    one over a whole 24 MB body would stall the event loop for seconds."""
    pieces: list[bytes] = []
    _encode_pieces(obj, pieces)
    return b"".join(pieces)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


def _weight(obj: Any) -> int:
    """About how many scalar values `obj` holds (a list counted by its first and last elements)."""
    if isinstance(obj, dict):
        return max(1, sum(_weight(v) for v in obj.values()))
    if isinstance(obj, (list, tuple)) and obj:
        return len(obj) * max(_weight(obj[0]), _weight(obj[-1]))
    return 1


def _piece_step(items: list[Any]) -> int:
    """How many elements of a non-empty list make a piece of about _JSON_PIECE_VALUES values."""
    return max(1, _JSON_PIECE_VALUES // max(_weight(items[0]), _weight(items[-1])))


def _encode_pieces(obj: Any, out: list[bytes]) -> None:
    if not isinstance(obj, (dict, list)) or _weight(obj) <= _JSON_PIECE_VALUES or \
            (isinstance(obj, dict) and not all(isinstance(k, str) for k in obj)):
        out.append(_dumps(obj).encode())
        return
    if isinstance(obj, dict):
        out.append(b"{")
        for j, (key, value) in enumerate(obj.items()):
            out.append(f"{',' if j else ''}{_dumps(key)}:".encode())
            _encode_pieces(value, out)
        out.append(b"}")
        return
    step = _piece_step(obj)
    out.append(b"[")
    for i in range(0, len(obj), step):
        if i:
            out.append(b",")
        if step == 1:
            _encode_pieces(obj[i], out)
        else:
            out.append(_dumps(obj[i : i + step])[1:-1].encode())
    out.append(b"]")

