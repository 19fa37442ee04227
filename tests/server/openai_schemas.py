"""OpenAI's published response schemas as jsonschema validators.

`data/openai_schemas.json` holds the schemas the tests need (and everything they `$ref`),
extracted verbatim from `shared/openai-openapi/openapi.yaml` by `extract()`; loading the 3 MB
YAML takes seconds, the extract milliseconds. At load time every `nullable: true` (an OpenAPI 3.0
keyword the 3.1 file still uses) becomes `anyOf: [schema, {type: null}]`.
"""

from __future__ import annotations

import copy
import functools
import json
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
)


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
    return json.loads(json.dumps(dict(sorted(keep.items())), default=str))


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
