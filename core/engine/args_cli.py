"""The engine's command-line flags (shared by `portside generate` and `portside serve`), one argument
group per concern, and their translation into `EngineArgs` keyword arguments."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from portside.engine.args import EngineArgs, parse_limit_mm_per_prompt
from portside.engine.backend_options import add_backend_option_args, backend_options_from_args
from portside.engine.unsupported_args import add_unsupported_args
from portside.kv_transfer.cli import add_kv_offload_args


def _limit_mm_arg(text: str) -> dict[str, int]:
    try:
        return parse_limit_mm_per_prompt(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("limit_mm_per_prompt: ")) from None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine flags shared by `portside generate` and `portside serve`, one argument group each."""
    _add_model_args(parser.add_argument_group("model and device"))
    _add_kv_cache_args(parser.add_argument_group("KV cache"))
    add_kv_offload_args(parser.add_argument_group("KV offloading (host and disk tiers, swap preemption)"))
    _add_scheduler_args(parser.add_argument_group("scheduling"))
    _add_parallel_args(parser.add_argument_group("parallelism"))
    _add_quantization_args(parser.add_argument_group("quantization"))
    _add_output_args(parser.add_argument_group("outputs"))
    _add_speculative_and_image_args(parser.add_argument_group("speculative decoding and images"))
    add_unsupported_args(parser)
    _add_lora_args(parser.add_argument_group("LoRA adapters"))


def _add_model_args(g: argparse._ArgumentGroup) -> None:
    """The model, the platform it runs on, and how its step runs."""
    g.add_argument("--device", default=None, help="platform to run on (cpu, cuda, rocm, tpu, or a plugin's); default: the best available; see `portside devices`")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    g.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16 (auto: the checkpoint's dtype where the device is fast at it, else float32)")
    g.add_argument("--seed", type=int, default=0, help="random seed for unseeded sampling")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (prompt + output); default: the model's")
    g.add_argument("--enforce-eager", action="store_true",
                   help="never capture graphs or compile: cpu runs --backend-option cpu_graph=eager, cuda/rocm run without "
                        "CUDA/HIP graphs")
    g.add_argument("--batch-invariant", action="store_true",
                   help="a request's tokens and logprobs do not depend on its batch, chunking or preemption (with a "
                        "seed, bitwise the same run to run); slower; cpu only (docs/batch_invariant.md)")
    add_backend_option_args(g)
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM compatibility; no effect: portside never runs model code from checkpoints")


def _add_kv_cache_args(g: argparse._ArgumentGroup) -> None:
    """KV-cache blocks: their size, how many, and their storage type."""
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV-cache block; default: the platform's")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="exact number of KV-cache blocks (overrides --kv-cache-memory)")
    g.add_argument("--kv-cache-memory", type=float, default=None, help="KV-cache size: bytes (> 1) or a fraction (<= 1) of free device memory after loading the model")
    g.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help="vLLM's sizing: the fraction of the device's total memory (host memory on cpu) that model weights and "
                        "KV cache may fill, less what other processes use; the KV cache gets what is left after loading "
                        "(conflicts with --kv-cache-memory; default: the platform's --kv-cache-memory default)")
    g.add_argument("--mamba-ssm-cache-dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="hybrid models (Mamba-2, Gated DeltaNet layers): the recurrent state's dtype; auto: the "
                        "checkpoint config's mamba_ssm_cache_dtype, else the model's dtype; float32 is more accurate "
                        "and holds fewer sequences")
    g.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help='publish KV-cache events (blocks stored, removed, cleared) for prefix-aware routers, as vLLM\'s: '
                        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
                        '"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}\' (also buffer_steps, hwm, '
                        'max_queue_size; "encoding": "array" for routers older than vLLM\'s map encoding); docs/kv_events.md')
    g.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help='disaggregated prefill and decode, as vLLM\'s: \'{"kv_connector": "SharedStorageConnector", '
                        '"kv_role": "kv_both", "kv_connector_extra_config": {"shared_storage_path": DIR}}\'; docs/disagg.md')
    g.add_argument("--kv-connector", choices=["shared_storage"], default=None,
                   help="KV connector between instances: shared_storage (block files in --kv-connector-path)")
    g.add_argument("--kv-role", choices=["producer", "consumer", "both"], default=None,
                   help="with --kv-connector: producer (a prefill instance: saves its prompts' KV), consumer (a decode "
                        "instance: loads it) or both (default)")
    g.add_argument("--kv-connector-path", default=None, metavar="DIR",
                   help="with --kv-connector shared_storage: the directory every instance reads and writes")
    g.add_argument("--kv-events-publisher", choices=["zmq", "null"], default=None,
                   help="shorthand for --kv-events-config's publisher (zmq turns events on)")
    g.add_argument("--kv-events-endpoint", default=None, metavar="ENDPOINT",
                   help="shorthand for --kv-events-config's endpoint (turns events on), e.g. tcp://*:5557")
    g.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"], default="auto", help="KV-cache storage: auto (the model's dtype), fp8 (= fp8_e4m3) or fp8_e5m2 (per-layer k/v scales from the checkpoint, else 1), or int8 (cpu; a scale per token and KV head); 8-bit caches hold about 2x (bf16) / 4x (fp32) the tokens and are not bit-exact")


def _add_scheduler_args(g: argparse._ArgumentGroup) -> None:
    """A step's token budget and the order requests are served in."""
    g.add_argument("--max-num-seqs", type=int, default=128, help="most requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per engine step (chunked prefill splits longer prompts)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True, help="reuse KV blocks of shared prompt prefixes")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts over engine steps of --max-num-batched-tokens, batched with decodes; without it a "
                        "prompt runs whole (--max-num-batched-tokens must then hold --max-model-len)")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs", help="order of waiting requests and choice of preemption victims")


def _add_parallel_args(g: argparse._ArgumentGroup) -> None:
    """Tensor, pipeline and data parallelism, and how the ranks run."""
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="shard the model over this many devices")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="split the model's layers into this many stages, each on its own TP group (ranks = TP x PP)")
    g.add_argument("--pipeline-layers", default=None, metavar="N1,N2,...",
                   help="decoder layers per pipeline stage (default: balanced by count)")
    g.add_argument("--pipeline-micro-batches", type=int, default=None, metavar="N",
                   help="with -pp > 1: scheduled steps kept in flight so the stages overlap (default: one per stage; "
                        "1 runs one step at a time)")
    g.add_argument("--pipeline-micro-batch-tokens", type=int, default=None, metavar="N",
                   help="with -pp > 1 and chunked prefill: most tokens one micro-batch computes; smaller batches "
                        "shorten the pipeline's fill and drain (default: max-num-batched-tokens / micro-batches, capped "
                        "by the platform: 256 on cpu)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="serve this many engine replicas (each TP x PP ranks) behind one API server")
    g.add_argument("--distributed-executor-backend", choices=["mp", "ray", "uni"], default=None,
                   help="how the ranks run: mp (local worker processes; default) or ray (one Ray actor per rank, across "
                        "the nodes of a Ray cluster; the default when RAY_ADDRESS is set)")


def _add_quantization_args(g: argparse._ArgumentGroup) -> None:
    """The checkpoint's weight format, or quantization while loading."""
    g.add_argument("--quantization", "-q", default=None, help="gptq, awq, compressed-tensors, fp8, gguf: the checkpoint's format (default: what its config.json says); int8 or fp8 on a full-precision checkpoint quantizes it per output channel while loading")
    g.add_argument("--quantized-activations", choices=["none", "int8", "fp8"], default=None, help="with --quantization int8: also quantize activations per token (W8A8, faster on VNNI/AMX CPUs, not bit-exact); fp8 checkpoints set their own")


def _add_output_args(g: argparse._ArgumentGroup) -> None:
    """What a request may ask for and gets back: logprobs, structured output, reasoning, sampling defaults, the task."""
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="most logprobs (completions) / top_logprobs (chat) a request may ask for; more is a 400 (-1: no limit)")
    g.add_argument("--logprobs-mode", choices=["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"],
                   default="raw_logprobs",
                   help="what returned logprobs hold: the model's log-softmax (raw_logprobs, default) or logits (raw_logits), "
                        "or those a token was sampled from, after penalties, temperature and top-k/top-p/min-p "
                        "(processed_logprobs, processed_logits)")
    g.add_argument("--structured-outputs-backend", "--guided-decoding-backend", dest="structured_outputs_backend",
                   choices=["auto", "llguidance", "guidance", "xgrammar"], default="auto",
                   help="grammar engine for structured output (JSON schema, regex, choice, grammar); auto = llguidance")
    from portside.reasoning import described as described_reasoning_parsers

    g.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help=f"split the model's reasoning from its answer: {described_reasoning_parsers()}, or a plugin's. "
                        "reasoning_content in responses; structured output applies after reasoning whose markers are "
                        "tokens (<think>), to all of the output otherwise")
    g.add_argument("--generation-config", default="auto", help="default sampling parameters: auto (the model's generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), vllm (ignore it: SamplingParams' own defaults) or a folder holding a generation_config.json; values you pass always win")
    g.add_argument("--task", "--runner", dest="task", type=str.lower, default="auto",
                   choices=["auto", "generate", "pooling", "embed", "classify", "score", "reward"],
                   help="vLLM's --runner: auto (pooling for a pooling architecture such as BertModel or "
                        "*ForSequenceClassification, else generate), generate, or pooling (/v1/embeddings, /score, /rerank, "
                        "/classify, /pooling; LLM.embed/score/classify/reward); embed, classify, score and reward: pooling "
                        "with that task")
    g.add_argument("--convert", type=str.lower, choices=["auto", "none", "embed", "classify", "reward"], default=None,
                   help="serve the model as a pooling model of this task (vLLM's --convert): embed (e.g. a causal LM's "
                        "last-token embeddings), classify (its classifier, or --hf-overrides classifier_from_token), reward")
    g.add_argument("--pooling-type", type=str.lower, choices=["last", "mean", "cls", "max"], default=None,
                   help="pooling models: the last token's hidden state, the mean over the prompt, the first token's, or the "
                        "elementwise maximum (default: the folder's sentence-transformers Pooling, else the architecture's)")
    g.add_argument("--pooler-config", default=None, metavar="JSON",
                   help='pooling models, as vLLM\'s: \'{"pooling_type": "mean", "normalize": false, "use_activation": false}\'')
    g.add_argument("--hf-overrides", default=None, metavar="JSON",
                   help='what vLLM\'s Qwen3-Reranker recipe overrides: \'{"architectures": ["Qwen3ForSequenceClassification"], '
                        '"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}\' scores with the LM '
                        "head's yes/no logits")


def _add_speculative_and_image_args(g: argparse._ArgumentGroup) -> None:
    """Speculative decoding, and the images of vision-language models."""
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}\' (proposals from the request\'s own tokens) or '
                        '\'{"model": DRAFT_FOLDER, "num_speculative_tokens": 4}\' (a smaller model with the same '
                        'vocabulary); verified in one forward, greedy output unchanged')
    g.add_argument("--limit-mm-per-prompt", type=_limit_mm_arg, default=None, metavar="JSON",
                   help='vision-language models: most images in one prompt, as vLLM\'s: \'{"image": N}\' (default 4; 0: '
                        "no images); more is a 400")
    g.add_argument("--max-num-encoder-input-tokens", type=int, default=None, metavar="N",
                   help="vision-language models: image embedding rows the vision encoder computes per engine step "
                        "(default: --max-num-batched-tokens); a prefill chunk stops before an image that would exceed it")


def _add_lora_args(g: argparse._ArgumentGroup) -> None:
    """Serving PEFT LoRA adapters, chosen per request."""
    g.add_argument("--enable-lora", action="store_true", help="serve PEFT LoRA adapters on top of the model, chosen per request")
    g.add_argument("--max-loras", type=int, default=1, help="adapters that may run in one batch (device slots; default 1)")
    g.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank accepted (slots are sized for it; default 16)")
    g.add_argument("--max-cpu-loras", type=int, default=None, help="adapters kept loaded in host memory (default: --max-loras)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineArgs keyword arguments from parsed CLI flags."""
    names = {f.name for f in dataclasses.fields(EngineArgs)} - {"model", "platform_options"}
    kwargs = {n: getattr(args, n) for n in names if hasattr(args, n)}
    kwargs["platform_options"] = backend_options_from_args(args)
    return kwargs
