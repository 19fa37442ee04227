"""vLLM flags that scripts commonly pass and portside does not (yet) support.

Each is accepted where its value asks for nothing portside lacks (`--load-format safetensors`,
`--cpu-offload-gb 0`); any other value exits 2 with "portside does not support ...",
naming what to do instead, rather than argparse's generic "unrecognized arguments". Tuning flags
whose subject does not exist here, and whose results are the same either way
(`--num-scheduler-steps`, `--compilation-config`, `--download-dir`), are accepted with a warning
saying why they have no effect, so vLLM command lines keep working.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

_HUB = "portside never contacts a model hub: pass a local folder (or .gguf file) checked out at the revision you want"
_SCHEDULER = ("each step's token budget (--max-num-batched-tokens) goes to running requests, then to waiting ones in "
              "order; there is no separate limit on partial prefills")
_GRAPHS = "graph capture and compilation are the platform's: --enforce-eager turns them off, --backend-option cpu_graph=MODE picks the cpu mode"

# flag (aliases) -> (values that are fine as they are, why not / what instead); () : any use fails
UNSUPPORTED: dict[tuple[str, ...], tuple[tuple[str, ...], str]] = {
    ("--cpu-offload-gb",): (("0",), "weights are not offloaded to host memory; use a quantized checkpoint or --quantization int8/fp8 to fit a model"),
    ("--load-format",): (("auto", "safetensors", "gguf"), "portside loads Hugging Face safetensors folders and .gguf files (auto, safetensors, gguf)"),
    ("--enable-sleep-mode",): ((), "sleep mode (releasing device memory on request) is not implemented"),
    ("--tokenizer-mode",): (("auto", "hf"), "the tokenizer is the model's Hugging Face (fast) tokenizer, loaded with transformers (auto)"),
    ("--revision",): ((), _HUB),
    ("--code-revision",): ((), _HUB + "; no model code is ever run from a checkpoint"),
    ("--tokenizer-revision",): ((), _HUB + " (--tokenizer FOLDER for another tokenizer)"),
    ("--hf-config-path",): ((), "the model's own config.json is read; edit it in a copy of the model folder"),
    ("--config-format",): (("auto", "hf"), "checkpoints are read in Hugging Face format (config.json)"),
    ("--model-impl",): (("auto", "vllm"), "models run portside's own implementations (`portside models`); transformers' are not used"),
    ("--skip-tokenizer-init",): ((), "the tokenizer is always loaded (prompts are text or token ids either way)"),
    ("--override-generation-config",): ((), "write the values into a generation_config.json and pass its folder with "
                                            "--generation-config DIR, or set them per request"),
    ("--rope-scaling", "--rope-theta"): ((), "config.json is used as it is; change the value in a copy of the model "
                                             "folder"),
    ("--disable-sliding-window",): ((), "sliding-window layers always attend over their window, as the model was trained"),
    ("--enable-expert-parallel",): ((), "expert parallelism is not implemented; mixture-of-experts layers are sharded "
                                        "with --tensor-parallel-size"),
    ("--num-gpu-blocks-override",): ((), "size the KV cache with --num-kv-blocks N (portside's name for it)"),
    ("--kv-cache-memory-bytes",): ((), "size the KV cache with --kv-cache-memory BYTES (portside's name for it)"),
    ("--logits-processors", "--logits-processor-pattern"): ((), "custom logits processors are not supported"),
    ("--quantization-param-path",): ((), "KV-cache scales come from the checkpoint (--kv-cache-dtype fp8)"),
}
# flags that take no value (the rest take one; "?" an optional one)
NARGS: dict[str, int | str] = {
    "--enable-sleep-mode": 0, "--skip-tokenizer-init": 0, "--disable-sliding-window": 0, "--enable-expert-parallel": 0,
    "--disable-frontend-multiprocessing": 0, "--disable-custom-all-reduce": 0, "--use-v2-block-manager": 0,
    "--disable-async-output-proc": 0, "--async-scheduling": 0, "--enable-reasoning": 0, "--enable-log-requests": 0,
    "--disable-fastapi-docs": 0, "--hf-token": "?",
}  # fmt: skip
# flags accepted with any value and a warning: what they tune does not exist here, and results are the same
NO_EFFECT: dict[tuple[str, ...], str] = {
    ("--download-dir",): "portside downloads no checkpoints (models are local folders or .gguf files; the default model is "
                         "cached under ~/.cache/portside or $PORTSIDE_CACHE)",
    ("--hf-token",): "portside never contacts the Hugging Face Hub",
    ("--ignore-patterns",): "portside downloads no checkpoints",
    ("--max-parallel-loading-workers",): "weights load in one pass per process",
    ("--disable-frontend-multiprocessing",): "the API server and the engine share one process (the engine runs in its "
                                             "own thread)",
    ("--disable-async-output-proc",): "outputs are processed after each step, in order",
    ("--async-scheduling",): "each step is scheduled after the previous one finishes",
    ("--compilation-config", "-O"): _GRAPHS,
    ("--max-seq-len-to-capture",): _GRAPHS,
    ("--cuda-graph-sizes",): _GRAPHS,
    ("--disable-custom-all-reduce",): "tensor-parallel all-reduce is the platform's collective op",
    ("--use-v2-block-manager",): "the paged KV-cache manager is the only one (vLLM's v2 block manager is its default too)",
    ("--num-scheduler-steps",): "every engine step is scheduled (multi-step scheduling does not exist here, nor in vLLM V1)",
    ("--num-lookahead-slots",): "speculative tokens get their slots from --speculative-config",
    ("--scheduler-delay-factor",): _SCHEDULER,
    ("--max-num-partial-prefills",): _SCHEDULER,
    ("--max-long-partial-prefills",): _SCHEDULER,
    ("--long-prefill-token-threshold",): _SCHEDULER,
    ("--tokenizer-pool-size",): "prompts are tokenized by the server's offload threads",
    ("--enable-reasoning",): "--reasoning-parser NAME alone turns reasoning parsing on",
    ("--enable-log-requests",): "a line per finished request is logged by default (--disable-log-requests turns it off)",
    ("--disable-fastapi-docs",): "portside serves no /docs, /redoc or /openapi.json pages",
}
# flag prefixes handled when argparse finds them unknown (any value)
UNSUPPORTED_PREFIXES = {
    "--mm-": "portside takes images with the model's own processor settings and has no --mm-* options "
             "(--limit-mm-per-prompt and --max-num-encoder-input-tokens are the multimodal flags; see docs/multimodal.md)",
}


def unsupported_message(flag: str, reason: str | None = None) -> str | None:
    """The exit message for `flag`, or None when it is not one of vLLM's unsupported flags."""
    if reason is None:
        reason = next((r for p, r in UNSUPPORTED_PREFIXES.items() if flag.startswith(p)), None)
        if reason is None:
            return None
    return f"portside does not support {flag} (yet): {reason}"


class UnsupportedFlag(argparse.Action):
    """Accepts the harmless values of an unsupported vLLM flag; exits 2 with its reason otherwise."""

    def __init__(self, option_strings: list[str], dest: str, ok: tuple[str, ...] = (), reason: str = "", **kwargs: Any) -> None:
        self.ok, self.reason = ok, reason
        kwargs["nargs"] = NARGS.get(option_strings[0])
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
        if isinstance(values, str) and values.lower() in self.ok:
            return
        shown = f"{option_string} {values}" if isinstance(values, str) and self.ok else str(option_string)
        parser.error(unsupported_message(shown, self.reason) or self.reason)


class NoEffectFlag(argparse.Action):
    """Accepts a vLLM tuning flag that has nothing to tune here, with a warning saying why."""

    def __init__(self, option_strings: list[str], dest: str, reason: str = "", **kwargs: Any) -> None:
        self.reason = reason
        kwargs["nargs"] = NARGS.get(option_strings[0])
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
        print(f"portside: warning: {option_string} has no effect: {self.reason}", file=sys.stderr)


def add_unsupported_args(parser: argparse.ArgumentParser) -> None:
    """Register every flag of `UNSUPPORTED` and `NO_EFFECT` on `parser` (hidden from --help)."""
    for flags, (ok, reason) in UNSUPPORTED.items():
        parser.add_argument(*flags, action=UnsupportedFlag, ok=ok, reason=reason)
    for flags, reason in NO_EFFECT.items():
        parser.add_argument(*flags, action=NoEffectFlag, reason=reason)
