"""The input processor: everything a caller hands `LLMEngine.add_request` in, one validated
`EngineRequest` out (the shape of vLLM v1's `Processor.process_inputs`).

In: a prompt (text, token ids, or a prompt dict: {"prompt": ...} / {"prompt_token_ids": [...]},
{"messages": [...]} rendered through the chat template, any of them with "multi_modal_data"
images or already processed "mm_features"), `SamplingParams` (with their structured-output
constraint), a LoRA adapter, a priority. The processor tokenizes, renders chat templates, runs
images through the model's multimodal processor, checks the adapter, validates the sampling
parameters against the model (vocabulary, max_logprobs, the task), checks the prompt's length,
compiles the grammar, and resolves what the scheduler needs (max_tokens, stop ids, one sequence
per sample drawn). Every error is a ValueError that names the field at fault; nothing reaches the
scheduler or the output processor unless the whole request is valid.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from portside.chat_template import render_chat
from portside.engine.token_types import token_type_ids
from portside.multimodal.processor import check_features, image_list
from portside.request import Request
from portside.sampling_params import SamplingParams

if TYPE_CHECKING:
    from portside.config import EngineConfig
    from portside.lora.registry import LoRARegistry
    from portside.multimodal.processor import MultiModalProcessor
    from portside.structured.manager import StructuredOutputManager

Prompt = str | list[int] | dict[str, Any]


@dataclass
class EngineRequest:
    """One validated request: what the output processor shows and the sequences the scheduler runs."""

    request_id: str
    prompt: str | None  # the text outputs show (None: the caller gave ids only)
    prompt_token_ids: list[int]
    params: SamplingParams
    # one per sample drawn (n, or best_of > n); sample k > 0 forks sample 0's prompt blocks
    sequences: list[Request]
    best_n: int | None = None  # best_of > n: the n samples with the highest cumulative logprob return


@dataclass
class EosIds:
    """The ids that end a sequence: the tokenizer's eos (the primary one, the scheduler's check),
    and the extra ones generation_config.json lists (added to each request's stop ids)."""

    primary: int | None
    extra: list[int]

    @property
    def all(self) -> list[int]:
        return [t for t in [self.primary, *self.extra] if t is not None]

    @classmethod
    def read(cls, model_path: str, tokenizer: Any) -> EosIds:
        """The tokenizer's eos id (else generation_config.json's first) and generation_config.json's others."""
        ids: list[int] = []
        gen = os.path.join(model_path, "generation_config.json")
        if os.path.isfile(gen):
            with open(gen) as f:
                eos = json.load(f).get("eos_token_id")
            ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        primary = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else (ids[0] if ids else None)
        return cls(primary, [t for t in ids if t != primary])


class InputProcessor:
    """Prompt, parameters and adapter in, one validated `EngineRequest` out (see the module
    docstring). Safe to call from any thread except `process` itself, whose grammar and adapter
    checks share the engine's caches: the server processes images in worker threads
    (`process_multimodal`) and hands the engine thread the result."""

    def __init__(self, config: EngineConfig, tokenizer: Any, vocab_size: int, eos: EosIds, *,
                 structured: StructuredOutputManager, loras: LoRARegistry,
                 mm_processor: MultiModalProcessor | None = None) -> None:
        self.tokenizer = tokenizer
        self.model_path = config.model.path
        self.max_model_len = config.model.max_model_len
        self.max_logprobs = config.model.max_logprobs
        self.task = config.model.task  # "generate" or "embed"
        self.vocab_size = vocab_size
        self.eos = eos
        self.structured = structured  # a data-parallel front may swap in replica 0's (shared grammar cache)
        self.loras = loras  # and its adapter registry
        self.mm_processor = mm_processor  # None: a text-only model

    # ---- the one entry point ------------------------------------------------------------------

    def process(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None, *, priority: int = 0,
                add_special_tokens: bool = True, lora_request: Any = None) -> EngineRequest:
        """The request, validated and resolved; ValueError naming the field for bad input."""
        params = params or SamplingParams()
        self._check_logprobs(params)
        self.loras.check(lora_request)
        prompt_text, prompt_ids, mm_features = self.prompt(prompt, add_special_tokens)
        self._validate(prompt_ids, params)
        self._check_task(params, mm_features)
        token_types = token_type_ids(prompt, prompt_ids, self.model_path)
        grammar = self.structured.compile(params.structured_outputs) if params.structured_outputs is not None else None
        best_n = params.n if params.num_samples > params.n else None
        common = {"prompt_token_ids": prompt_ids, "eos_token_id": self.eos.primary, "priority": priority,
                  "max_tokens": self._max_tokens(params, len(prompt_ids)), "lora_request": lora_request,
                  "mm_features": mm_features, "token_type_ids": token_types}
        sequences = self._sequences(request_id, params, grammar, best_n, common)
        return EngineRequest(request_id, prompt_text, prompt_ids, params, sequences, best_n)

    # ---- prompts ------------------------------------------------------------------------------

    def prompt(self, prompt: Prompt, add_special_tokens: bool = True) -> tuple[str | None, list[int], list[Any]]:
        """(text shown in outputs, token ids, image features) of a prompt: text, ids, or a prompt
        dict (with both, the ids are the prompt and the text is what outputs show; "messages":
        rendered through the chat template), which may carry images ("multi_modal_data":
        {"image": ...}, or "mm_features" already processed)."""
        shown: str | None = None
        value: Any = prompt
        if isinstance(prompt, dict):
            if "messages" in prompt:
                prompt = self._render_messages(prompt)
                add_special_tokens = False  # the template wrote them
            value = prompt.get("prompt_token_ids", prompt.get("prompt"))
            if value is None:
                raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
            if not isinstance(value, str) and isinstance(prompt.get("prompt"), str):
                shown = prompt["prompt"]
            if prompt.get("multi_modal_data") or prompt.get("mm_features"):
                return self._multimodal_prompt(prompt, value, shown, add_special_tokens)
        if isinstance(value, str):
            return value, self.tokenizer.encode(value, add_special_tokens=add_special_tokens), []
        return shown, list(value), []

    def prompt_token_ids(self, prompt: Prompt, add_special_tokens: bool = True) -> list[int]:
        """A prompt as `process` takes it, as token ids."""
        return self.prompt(prompt, add_special_tokens)[1]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None) -> dict[str, Any]:
        """The conversation as a prompt: {"prompt": rendered text, "prompt_token_ids": ids}, with
        special tokens in user and tool contents tokenized as plain text (`portside.chat_template`)."""
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; pass one (--chat-template)")
        text, ids = render_chat(self.tokenizer, messages, chat_template=chat_template,
                                add_generation_prompt=add_generation_prompt)
        return {"prompt": text, "prompt_token_ids": ids}

    def _render_messages(self, prompt: dict[str, Any]) -> dict[str, Any]:
        """A {"messages": [...]} prompt dict as {"prompt", "prompt_token_ids"} (its other entries
        kept: images, and "chat_template" / "add_generation_prompt" for the rendering)."""
        if "prompt" in prompt or "prompt_token_ids" in prompt:
            raise ValueError("a prompt dict takes 'messages' or 'prompt' / 'prompt_token_ids', not both")
        messages = prompt["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError(f"messages must be a list of message dicts, got {type(messages).__name__}")
        rendered = self.apply_chat_template(messages, prompt.get("add_generation_prompt", True), prompt.get("chat_template"))
        rest = {k: v for k, v in prompt.items() if k not in ("messages", "add_generation_prompt", "chat_template")}
        return rest | rendered

    @property
    def supports_images(self) -> bool:
        return self.mm_processor is not None

    def process_multimodal(self, prompt: dict[str, Any], add_special_tokens: bool = True) -> dict[str, Any]:
        """A prompt dict with "multi_modal_data" run through the model's processor: the prompt
        dict `process` takes as it is ("prompt_token_ids" with the images' placeholders
        expanded, "prompt", "mm_features"). Safe to call from any thread; ValueError for what
        cannot be served."""
        text, ids, features = self.prompt(prompt, add_special_tokens)
        return {"prompt_token_ids": ids, "prompt": text, "mm_features": features}

    def _multimodal_prompt(self, prompt: dict[str, Any], value: str | list[int], shown: str | None,
                           add_special_tokens: bool) -> tuple[str | None, list[int], list[Any]]:
        if self.mm_processor is None:
            raise ValueError(f"model {self.model_path} does not take images (it is not a vision-language model)")
        if prompt.get("mm_features"):  # processed already (`process_multimodal`)
            ids = list(value) if not isinstance(value, str) else self.tokenizer.encode(value, add_special_tokens=add_special_tokens)
            check_features(prompt["mm_features"], ids, self.mm_processor.image_token_id)
            return (value if isinstance(value, str) else shown), ids, list(prompt["mm_features"])
        data = prompt["multi_modal_data"]
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError("multi_modal_data must be a dict with an 'image' entry (a PIL image or a list of them); "
                             f"got {sorted(data) if isinstance(data, dict) else type(data).__name__}")
        out = self.mm_processor.process(value, image_list(data["image"]), add_special_tokens)
        return (out.prompt if out.prompt is not None else shown), out.prompt_token_ids, out.mm_features

    # ---- validation ---------------------------------------------------------------------------

    def _check_logprobs(self, params: SamplingParams) -> None:
        limit = self.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and limit >= 0 and k > limit:
                raise ValueError(f"{name}: {k} requested, more than the {limit} allowed (max_logprobs, "
                                 "the server's --max-logprobs); ask for fewer")

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        params.validate()
        if not prompt_ids:
            raise ValueError("prompt must not be empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range for vocabulary size {self.vocab_size}")
        if self.task == "embed" and len(prompt_ids) > self.max_model_len:
            raise ValueError(f"prompt is {len(prompt_ids)} tokens, more than max_model_len {self.max_model_len}; shorten it "
                             "(or truncate it: truncate_prompt_tokens)")
        if self.task != "embed" and len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(prompt_ids)} tokens, but max_model_len is {self.max_model_len}: "
                "it leaves no room for output; shorten the prompt or raise max_model_len"
            )
        for tid in (params.logit_bias or {}):
            if not 0 <= int(tid) < self.vocab_size:
                raise ValueError(f"logit_bias token id {tid} is out of range for vocabulary size {self.vocab_size}")
        for tid in params.stop_token_ids or []:
            if not 0 <= tid < self.vocab_size:
                raise ValueError(f"stop_token_ids entry {tid} is out of range for vocabulary size {self.vocab_size}")

    def _check_task(self, params: SamplingParams, mm_features: list[Any]) -> None:
        if mm_features and self.task == "embed":
            raise ValueError("task embed: prompts with images are not supported")
        if self.task == "embed" and (params.num_samples != 1 or params.structured_outputs is not None
                                     or params.prompt_logprobs is not None):
            raise ValueError("task embed: a request returns one embedding; n and structured outputs do not apply, "
                             "nor best_of or prompt_logprobs")

    # ---- resolution ---------------------------------------------------------------------------

    def _max_tokens(self, params: SamplingParams, num_prompt_tokens: int) -> int:
        """Output tokens the request may produce: never past max_model_len; 0 under task embed
        (prefill only: the scheduler finishes it after its prompt)."""
        if self.task == "embed":
            return 0
        room = self.max_model_len - num_prompt_tokens
        return room if params.max_tokens is None else min(room, params.max_tokens)

    def _sequences(self, rid: str, params: SamplingParams, grammar: Any, best_n: int | None,
                   common: dict[str, Any]) -> list[Request]:
        """One `Request` per sample drawn (`common`: the fields they share): its own sampling
        parameters (a seed per sample, logprobs for best_of's ranking, the extra eos ids as stop
        ids) and grammar state."""
        stop_ids = list(params.stop_token_ids or []) + [t for t in self.eos.extra if t not in (params.stop_token_ids or [])]
        num_samples = params.num_samples
        sequences = []
        for k in range(num_samples):
            sp = params if num_samples == 1 else params.clone_for_sample(k)
            if best_n is not None and sp.logprobs is None:  # best_of ranks samples by their cumulative logprob
                sp = dataclasses.replace(sp, logprobs=0)
            if stop_ids != sp.stop_token_ids and not sp.ignore_eos:
                sp = dataclasses.replace(sp, stop_token_ids=stop_ids)
            structured = None if grammar is None else self.structured.new_state(
                grammar, common["prompt_token_ids"], params.structured_outputs.after_reasoning)  # type: ignore[union-attr]
            sequences.append(Request(request_id=rid if num_samples == 1 else f"{rid}#{k}", sampling_params=sp,
                                     parent_id=None if k == 0 else f"{rid}#0", structured=structured, **common))
        return sequences
