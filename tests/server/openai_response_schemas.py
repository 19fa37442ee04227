"""OpenAI's Responses API schemas (the `Response` object and every stream event) as jsonschema
validators, beside `openai_schemas` (which holds the chat and completions ones).

`data/openai_response_schemas.json` holds `Response`, `ResponseStreamEvent` and everything they
`$ref`, extracted from `shared/openai-openapi/openapi.yaml` by `extract()` with the annotation
keywords (description, example(s), title) dropped: they do not take part in validation and were
half the size. Regenerate with `python tests/server/openai_response_schemas.py PATH/openapi.yaml`.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from openai_schemas import _refs, denullable

DATA = Path(__file__).parent / "data" / "openai_response_schemas.json"
ROOTS = ("Response", "ResponseStreamEvent")
_ANNOTATIONS = frozenset({"description", "example", "examples", "title", "x-oaiMeta"})


def _strip(node: Any) -> Any:
    """`node` without annotation keywords (property *names* such as `description` stay)."""
    if isinstance(node, list):
        return [_strip(x) for x in node]
    if not isinstance(node, dict):
        return node
    return {k: ({name: _strip(s) for name, s in v.items()} if k in ("properties", "$defs") and isinstance(v, dict) else _strip(v))
            for k, v in node.items() if k not in _ANNOTATIONS}


def extract(openapi_yaml: Path) -> dict[str, Any]:
    import yaml

    with open(openapi_yaml) as f:
        spec = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    schemas = spec["components"]["schemas"]
    keep: dict[str, Any] = {}
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        if name not in keep:
            keep[name] = schemas[name]
            todo.extend(_refs(schemas[name]))
    return _strip(json.loads(json.dumps(dict(sorted(keep.items())), default=str)))  # type: ignore[no-any-return]


@functools.cache
def _components() -> dict[str, Any]:
    with open(DATA) as f:
        return {"schemas": denullable(json.load(f))}


@functools.cache
def validator(name: str) -> Draft202012Validator:
    return Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": _components()})


def validate(name: str, body: Any) -> None:
    """Raise jsonschema.ValidationError unless `body` matches the schema `name` (e.g. "Response")."""
    validator(name).validate(body)


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
