"""LoRA adapters over HTTP: `--lora-modules` served under their own model names (a request's
`model` picks one), listed in /v1/models with their parent, and, with
`--allow-runtime-lora-updating`, loaded and unloaded while serving (vLLM's
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter`). An adapter that requests are still
using is never unloaded under them: the unload is refused (409) until they finish."""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

from portside.lora.request import LoRARequest
from portside.server.errors import APIError, bad_request


@dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: list[str]) -> list[LoRAModule]:
    """`--lora-modules` entries: ``name=path`` or vLLM's JSON ``{"name", "path", "base_model_name"}``."""
    modules = []
    for v in values:
        if v.lstrip().startswith("{"):
            try:
                d = json.loads(v)
                name, path, parent = d["name"], d["path"], d.get("base_model_name")
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"--lora-modules {v!r}: JSON entries need \"name\" and \"path\" ({e})") from None
            if not (isinstance(name, str) and name and isinstance(path, str) and path):
                raise ValueError(f"--lora-modules {v!r}: \"name\" and \"path\" must be non-empty strings")
            if parent is not None and not isinstance(parent, str):
                raise ValueError(f"--lora-modules {v!r}: base_model_name must be a string")
            modules.append(LoRAModule(name, path, parent))
        else:
            name, sep, path = v.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {v!r}: expected NAME=PATH or a JSON object")
            modules.append(LoRAModule(name, path))
    names = [m.name for m in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules: adapter names must be unique, got {names}")
    return modules


@dataclass
class ServedAdapters:
    """The adapters a server offers, by served name."""

    base_name: str
    adapters: dict[str, LoRARequest] = field(default_factory=dict)
    parents: dict[str, str] = field(default_factory=dict)
    _ids: Any = field(default_factory=lambda: itertools.count(1))
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def add(self, module: LoRAModule) -> LoRARequest:
        lora = LoRARequest(module.name, next(self._ids), module.path, module.base_model_name)
        self.adapters[module.name] = lora
        self.parents[module.name] = module.base_model_name or self.base_name
        return lora

    def model_cards(self, created: int, max_model_len: int) -> list[dict[str, Any]]:
        return [
            {"id": name, "object": "model", "created": created, "owned_by": "portside", "root": lora.lora_path,
             "parent": self.parents[name], "max_model_len": max_model_len}
            for name, lora in self.adapters.items()
        ]


async def load_adapter(served: ServedAdapters, engine: Any, offload: Any, body: dict[str, Any], reserved: list[str]) -> str:
    """POST /v1/load_lora_adapter: check the adapter (off the event loop), then serve it."""
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise bad_request("lora_name and lora_path (strings) are required", "lora_name" if not name else "lora_path")
    async with served._lock:
        if name in served.adapters or name in reserved:
            raise bad_request(f"lora_name: the adapter {name!r} is already loaded", "lora_name")
        lora = LoRARequest(name, next(served._ids), path)
        try:
            await offload.run(engine.engine.loras.check, lora, large=True)
        except ValueError as e:
            raise bad_request(f"lora_path: {e}", "lora_path") from None
        served.adapters[name] = lora
        served.parents[name] = served.base_name
    return f"Success: LoRA adapter '{name}' added successfully."


async def unload_adapter(served: ServedAdapters, engine: Any, body: dict[str, Any]) -> str:
    """POST /v1/unload_lora_adapter: stop serving it; refused while requests use it."""
    name = body.get("lora_name")
    async with served._lock:
        lora = served.adapters.get(name) if isinstance(name, str) else None
        if lora is None or not isinstance(name, str):
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name", code="not_found")
        busy = engine.num_using(lora.lora_int_id)
        if busy:
            raise APIError(409, f"the adapter {name!r} is in use by {busy} request(s); unload it once they finish",
                           param="lora_name", code="adapter_in_use")
        del served.adapters[name]
        served.parents.pop(name, None)
        engine.engine.loras.forget(lora.lora_int_id)
    return f"Success: LoRA adapter '{name}' removed successfully."
