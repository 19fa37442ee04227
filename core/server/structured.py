"""A request's output constraint, from whichever field set it: OpenAI's `response_format`,
vLLM's `structured_outputs`, or vLLM's older `guided_*` fields (at most one of them), compiled
off the event loop so that a large schema never stalls other clients."""

from __future__ import annotations

import asyncio
from typing import Any

from portside.server.errors import APIError, bad_request
from portside.server.protocol.common import SamplingFields
from portside.structured.params import StructuredOutputsParams

COMPILE_TIMEOUT_S = 10.0


def request_constraint(req: SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The constraint and the field it came from (None, None: unconstrained); 400 when several
    fields set one or a value is invalid."""
    found: list[tuple[str, dict[str, Any]]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        assert rf.json_schema is not None
        schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {}
        found.append(("response_format", {"json": schema, "disable_additional_properties": bool(rf.json_schema.strict)}))
    if req.structured_outputs is not None:
        body = req.structured_outputs.model_dump(by_alias=True)
        found.append(("structured_outputs", {k: v for k, v in body.items() if v is not None}))
    guided = {"json": req.guided_json, "regex": req.guided_regex, "choice": req.guided_choice, "grammar": req.guided_grammar}
    for name, value in guided.items():
        if value is not None:
            extra = {"whitespace_pattern": req.guided_whitespace_pattern} if req.guided_whitespace_pattern else {}
            found.append((f"guided_{name}", {name: value} | extra))
    if req.guided_whitespace_pattern is not None and not any(f.startswith("guided_") for f, _ in found):
        raise bad_request("guided_whitespace_pattern: only used with guided_json", "guided_whitespace_pattern")
    if not found:
        return None, None
    if len(found) > 1:
        names = ", ".join(f for f, _ in found)
        raise bad_request(f"{found[1][0]}: only one output constraint per request, got {names}", found[1][0])
    field, kwargs = found[0]
    try:
        return StructuredOutputsParams(**kwargs), field
    except (TypeError, ValueError) as e:
        raise bad_request(f"{field}: {str(e).removeprefix('structured_outputs: ')}", field) from None


async def compile_constraint(manager: Any, params: StructuredOutputsParams, field: str) -> None:
    """Compile on a worker thread (the engine then finds it in its cache); a 400 naming `field`
    when the constraint is invalid, can never match, or takes too long to compile."""
    # the grammar engine itself is built on first use, outside the request's budget: for a large
    # vocabulary (gpt-oss's 201k tokens) that takes seconds, the grammar then milliseconds
    try:
        await asyncio.to_thread(getattr, manager, "backend")
        await asyncio.wait_for(asyncio.to_thread(manager.compile, params), COMPILE_TIMEOUT_S)
    except TimeoutError:
        raise bad_request(f"{field}: the {params.kind} did not compile within {COMPILE_TIMEOUT_S:.0f} s; simplify it", field) from None
    except ValueError as e:
        raise bad_request(f"{field}: {str(e).removeprefix('structured_outputs: ')}", field) from None
    except Exception as e:  # a grammar engine's own failure on a hostile input is still the input's fault
        raise APIError(400, f"{field}: the grammar engine could not compile it: {e}", param=field) from None
