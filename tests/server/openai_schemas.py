"""OpenAI's published response schemas as jsonschema validators: completions, chat, models,
errors, embeddings, and the Responses API's `Response` object and stream events.

`data/openai_schemas.json` holds the schemas the tests need (and everything they `$ref`),
extracted from `shared/openai-openapi/openapi.yaml` by `extract()` with the annotation keywords
(description, example(s), title), which take no part in validation, dropped; loading the 3 MB
YAML takes seconds, the extract milliseconds. At load time every `nullable: true` (an OpenAPI 3.0
keyword the 3.1 file still uses) becomes `anyOf: [schema, {type: null}]`. Regenerate with
`python tests/server/openai_schemas.py PATH/openapi.yaml`.
"""

from __future__ import annotations

import copy
import functools
import json
import sys
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

DATA = Path(__file__).parent / "data" / "openai_schemas.json"
ROOTS = (
    "CreateCompletionResponse",
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "ListModelsResponse",
    "ErrorResponse",
    "CreateEmbeddingResponse",
    "Response",
    "ResponseStreamEvent",
)
_ANNOTATIONS = frozenset({"description", "example", "examples", "title", "x-oaiMeta"})


def extract(openapi_yaml: Path) -> dict[str, Any]:
    """The ROOTS schemas and their transitive `$ref`s from the OpenAPI file, unchanged."""
    import yaml

    with open(openapi_yaml) as f:
        spec = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    schemas = spec["components"]["schemas"]
    keep: dict[str, Any] = {}
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep[name] = schemas[name]
        todo.extend(_refs(schemas[name]))
    return _strip(json.loads(json.dumps(dict(sorted(keep.items())), default=str)))  # type: ignore[no-any-return]


def _strip(node: Any) -> Any:
    """`node` without annotation keywords (property *names* such as `description` stay)."""
    if isinstance(node, list):
        return [_strip(x) for x in node]
    if not isinstance(node, dict):
        return node
    return {k: ({name: _strip(s) for name, s in v.items()} if k in ("properties", "$defs") and isinstance(v, dict) else _strip(v))
            for k, v in node.items() if k not in _ANNOTATIONS}


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        out = []
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str) and v.startswith("#/components/schemas/"):
                out.append(v.rsplit("/", 1)[1])
            else:
                out.extend(_refs(v))
        return out
    if isinstance(node, list):
        return [r for item in node for r in _refs(item)]
    return []


def denullable(node: Any) -> Any:
    """Rewrite OpenAPI 3.0 `nullable: true` into JSON Schema `anyOf [..., null]`, recursively."""
    if isinstance(node, list):
        return [denullable(x) for x in node]
    if not isinstance(node, dict):
        return node
    node = {k: denullable(v) for k, v in node.items()}
    if node.pop("nullable", False) is True:
        return {"anyOf": [node, {"type": "null"}]}
    return node


@functools.cache
def _components() -> dict[str, Any]:
    with open(DATA) as f:
        return {"schemas": denullable(json.load(f))}


@functools.cache
def validator(name: str) -> Draft202012Validator:
    return Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": _components()})


def validate(name: str, body: Any) -> None:
    """Raise jsonschema.ValidationError unless `body` matches OpenAI's schema `name`."""
    validator(name).validate(body)


def validate_completion_chunk(body: dict[str, Any]) -> None:
    """A /v1/completions stream chunk. OpenAI's schema says chunks share the response's shape, but
    its `finish_reason` is not nullable while every real (OpenAI's too) intermediate chunk has
    `finish_reason: null`: validate with only that one field relaxed."""
    relaxed = copy.deepcopy(body)
    for choice in relaxed.get("choices", []):
        if choice.get("finish_reason") is None:
            choice["finish_reason"] = "stop"
    validate("CreateCompletionResponse", relaxed)


@functools.cache
def _event_schemas() -> dict[str, str]:
    """Each stream event's `type` -> the name of its schema."""
    schemas = _components()["schemas"]
    out = {}
    for ref in schemas["ResponseStreamEvent"]["anyOf"]:
        name = ref["$ref"].rsplit("/", 1)[1]
        for kind in schemas[name]["properties"]["type"].get("enum", []):
            out[kind] = name
    return out


def validate_event(event: dict[str, Any]) -> None:
    """A stream event against the schema of its own type (a clearer error than the union's)."""
    name = _event_schemas().get(event.get("type", ""))
    assert name is not None, f"not a Responses stream event type: {event.get('type')!r}"
    validate(name, event)


if __name__ == "__main__":
    DATA.write_text(json.dumps(extract(Path(sys.argv[1])), separators=(",", ":"), sort_keys=True) + "\n")
