"""vLLM flags that scripts commonly pass and portside does not (yet) support.

Each is accepted where its value asks for nothing portside lacks (`--pipeline-parallel-size 1`,
`--load-format safetensors`); any other value exits 2 with "portside does not support ...",
naming what to do instead, rather than argparse's generic "unrecognized arguments". A few tuning
flags whose subject does not exist here (`--swap-space`) are accepted with a warning, so vLLM
command lines keep working.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

# flag (aliases) -> (values that are fine as they are, why not / what instead); () : any use fails
UNSUPPORTED: dict[tuple[str, ...], tuple[tuple[str, ...], str]] = {
    ("--pipeline-parallel-size", "-pp"): (("1",), "pipeline parallelism is not implemented; shard the model with --tensor-parallel-size"),
    ("--data-parallel-size", "-dp"): (("1",), "data parallelism is not implemented; run one `portside serve` per device group behind a load balancer"),
    ("--kv-transfer-config",): ((), "disaggregated prefill (KV-cache transfer between instances) is not implemented"),
    ("--cpu-offload-gb",): (("0",), "weights are not offloaded to host memory; use a quantized checkpoint or --quantization int8/fp8 to fit a model"),
    ("--load-format",): (("auto", "safetensors", "gguf"), "portside loads Hugging Face safetensors folders and .gguf files (auto, safetensors, gguf)"),
    ("--distributed-executor-backend",): (("mp", "uni"), "tensor-parallel workers run as local processes (mp); ray is not supported"),
    ("--enable-sleep-mode",): ((), "sleep mode (releasing device memory on request) is not implemented"),
}
ZERO_ARG = {"--enable-sleep-mode"}
# flags accepted with any value and a warning: what they tune does not exist here, and results are the same
NO_EFFECT: dict[tuple[str, ...], str] = {
    ("--swap-space",): "preempted requests are recomputed, never swapped to host memory",
}
# flag prefixes handled when argparse finds them unknown (any value)
UNSUPPORTED_PREFIXES = {
    "--mm-": "multimodal inputs are not supported: portside serves text-only models",
    "--limit-mm-per-prompt": "multimodal inputs are not supported: portside serves text-only models",
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
        kwargs["nargs"] = 0 if option_strings[0] in ZERO_ARG else None
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
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
        print(f"portside: warning: {option_string} has no effect: {self.reason}", file=sys.stderr)


def add_unsupported_args(parser: argparse.ArgumentParser) -> None:
    """Register every flag of `UNSUPPORTED` and `NO_EFFECT` on `parser` (hidden from --help)."""
    for flags, (ok, reason) in UNSUPPORTED.items():
        parser.add_argument(*flags, action=UnsupportedFlag, ok=ok, reason=reason)
    for flags, reason in NO_EFFECT.items():
        parser.add_argument(*flags, action=NoEffectFlag, reason=reason)
