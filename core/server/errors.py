"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

Every failure the server reports goes through `APIError`; validation errors from pydantic and
`ValueError`s from the engine are turned into one naming the offending parameter. No traceback
ever reaches a client: unexpected exceptions become a bare 500 and are logged here.

The Anthropic Messages routes (/v1/messages and below) answer in Anthropic's shape instead,
`{"type": "error", "error": {"type", "message"}}` with the same status: `error_response` picks
the shape by the request's path, for the handlers below and the guards in `middleware`.
"""

from __future__ import annotations

import json
import logging
import re
from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error with an HTTP status that is reported to the client as an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def anthropic_body(self) -> dict[str, Any]:
        return anthropic_error_body(self.status, self.message)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error"),
            "param": param,
            "code": code if code is not None else _default_code(status),
        }
    }


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors); a 503 (queue
# full, engine unavailable) is its overloaded_error, with the status kept
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
ANTHROPIC_PATH = "/v1/messages"  # it and the paths below it speak Anthropic's error shape


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def route_path(scope: Any) -> str:
    """The request path without the --root-path prefix a proxy may have left on it."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root + "/") else path


def speaks_anthropic(scope: Any) -> bool:
    """Whether the request's route is one of Anthropic's (its errors take Anthropic's shape)."""
    path = route_path(scope)
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def error_response(scope: Any, err: APIError) -> JSONResponse:
    """`err` in the shape the request's API speaks."""
    if speaks_anthropic(scope):
        return JSONResponse(err.anthropic_body(), status_code=err.status, headers=err.headers)
    return err.response()


def _default_code(status: int) -> str | None:
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_")
    except ValueError:
        return None


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value" if param else None)


def from_validation_error(err: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the parameter (`messages[0].role`, `max_tokens`)."""
    first = err.errors(include_url=False)[0]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {first.get('msg', '')}", code="invalid_json")
    loc = first.get("loc", ())
    param = _loc_to_param(loc)
    msg = str(first.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    if not loc and kind == "model_type":
        return APIError(400, "request body must be a JSON object", code="invalid_json")
    # a model-level check names its parameter as "name: why" (relative to the model it checks)
    m = re.match(r"([A-Za-z_][\w.\[\]]*): (.*)", msg, re.S)
    if m and (param is None or kind == "value_error"):
        param, msg = (m.group(1) if param is None else f"{param}.{m.group(1)}"), m.group(2)
    if kind == "missing":
        return APIError(400, f"'{param}' is a required property", param=param, code="missing_required_parameter")
    if kind == "extra_forbidden":
        return APIError(400, f"{param}: unrecognized request field; portside does not support it", param=param, code="unknown_parameter")
    text = f"{param}: {msg}" if param else msg
    return APIError(400, text, param=param, code="invalid_type" if kind.endswith("_type") else "invalid_value")


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif isinstance(item, str) and item.isidentifier():
            parts.append(("." if parts else "") + item)
        else:  # a union-member tag such as 'list[int]' or 'function-after[...]': stop here
            break
    return "".join(parts) or None


_PARAM_NAMES = {
    "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "stop", "stop_token_ids", "max_tokens", "min_tokens", "logprobs",
    "logit_bias", "prompt", "messages", "structured_outputs", "prompt_logprobs", "best_of",
}  # fmt: skip


def from_value_error(err: ValueError, *, default_param: str | None = None, renames: dict[str, str] | None = None) -> APIError:
    """A ValueError from `SamplingParams` or the engine ("top_p must be in (0, 1], got 2.0")."""
    msg = str(err) or "invalid request"
    first = re.split(r"[\s:]", msg, maxsplit=1)[0]
    param = first if first in _PARAM_NAMES else default_param
    if param and renames and param in renames:
        msg = msg.replace(param, renames[param], 1)
        param = renames[param]
    return bad_request(msg, param)


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(request.scope, exc)


async def http_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    return error_response(request.scope, APIError(exc.status_code, detail, headers=dict(exc.headers or {})))


async def unhandled_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error serving %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(request.scope, APIError(500, "internal server error; see the server log"))
