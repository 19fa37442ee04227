"""The `portside` command: generate, serve, devices, models, bench.

Usage errors (a bad flag, an unknown or unavailable device, a missing model) print one message
naming the fix and exit with code 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
import textwrap
from collections.abc import Callable

from portside.cli_parser import EXIT_USAGE, Parser


def _cmd_devices(args: argparse.Namespace) -> int:
    from portside.platform import discover_platforms, format_backend_options, format_devices

    report = _cache_report(args) if args.model is not None else None  # a bad flag fails before the listing
    entries = discover_platforms()
    print(format_devices(entries))
    print()
    print(format_backend_options(entries))
    if report is not None:
        print()
        print(report)
    return 0


def _cache_report(args: argparse.Namespace) -> str:
    """`portside devices --model`: the model's cache groups and the sequences a budget holds."""
    import torch

    from portside.engine.kv_report import cache_report

    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"--dtype {args.dtype!r}: expected a torch dtype name such as bfloat16, float16 or float32")
    report = cache_report(args.model, dtype, args.kv_cache_dtype, args.mamba_ssm_cache_dtype)
    return report.format(args.kv_cache_memory, args.max_model_len)


def _cmd_models(args: argparse.Namespace) -> int:
    import shutil

    from portside.model.registry import format_architectures

    print(format_architectures())
    print()
    print(textwrap.fill("needs: attention features each platform's attention backend runs natively or through core's "
                        "reference (see `portside devices`), in brackets where only some checkpoints' configs ask for "
                        "them; moe: the platform's ModelOps.fused_moe; recurrent: its recurrent-layer kernels; latent: its "
                        "AttentionBackend.latent_attention (MLA; core's reference by default). llava and qwen2_5_vl take images "
                        "(docs/multimodal.md)",
                        shutil.get_terminal_size((80, 24)).columns))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from portside.engine.args_cli import engine_kwargs
    from portside.engine.llm import LLM
    from portside.sampling_params import SamplingParams

    # a flag left unset takes the model's generation_config.json (--generation-config), else these
    fallback = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "max_tokens": 64}
    given = {k: getattr(args, k) for k in fallback if getattr(args, k) is not None}
    fixed = dict(n=args.n, presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                 seed=args.sampling_seed, stop=args.stop or None, ignore_eos=args.ignore_eos)
    SamplingParams(**fixed, **{**fallback, **given})  # a bad flag fails before the model loads
    if args.max_num_seqs is None:
        # One prompt: its n samples run together, and the KV cache is sized for them (the runner
        # caps it at twice what max_num_seqs sequences of full length take) rather than a server's
        # budget: the default model's 4 GiB cost a first answer ~10 s of CPU to allocate and touch.
        args.max_num_seqs = max(1, args.n)
    llm = LLM(**{**engine_kwargs(args), "model": args.model})
    params = SamplingParams(**fixed, **{**fallback, **llm.engine.default_sampling, **given})
    if args.raw:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    else:
        if not getattr(llm.get_tokenizer(), "chat_template", None):
            print("note: the model has no chat template; sending the prompt as plain text (--raw)", file=sys.stderr)
            outputs = llm.generate(args.prompt, params, use_tqdm=False)
        else:
            outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    for completion in outputs[0].outputs:
        prefix = f"[{completion.index}] " if args.n > 1 else ""
        print(prefix + completion.text.strip())
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from portside.server.main import run_server

    return run_server(args) or 0


def _cmd_disagg_proxy(args: argparse.Namespace) -> int:
    from portside.server.disagg_proxy import run_proxy

    return run_proxy(args)


def build_parser() -> Parser:
    from portside.cli_bench import add_bench_parser
    from portside.engine.args_cli import add_engine_args

    parser = Parser(prog="portside", description="Hardware-portable LLM inference and serving.")
    parser.add_argument("--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING, ...)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("devices", help="list every discovered platform and why unavailable ones are")
    p.add_argument("--model", default=None, help="also report this HF model folder's KV cache: bytes per token of its "
                   "attention layers, state per sequence of its recurrent layers, and how many sequences fit")
    p.add_argument("--max-model-len", type=int, default=4096, help="sequence length of the report (default 4096)")
    p.add_argument("--kv-cache-memory", type=float, default=8 * 2**30, help="KV-cache bytes of the report (default 8 GiB)")
    p.add_argument("--dtype", default="bfloat16", help="the model's dtype in the report (default bfloat16)")
    p.add_argument("--kv-cache-dtype", default="auto", help="the KV cache's dtype in the report (default auto)")
    p.add_argument("--mamba-ssm-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="a hybrid model's recurrent state dtype in the report (default auto: as the engine)")
    p.set_defaults(func=_cmd_devices)

    p = sub.add_parser("models", help="list the supported model architectures and what each needs")
    p.set_defaults(func=_cmd_models)

    p = sub.add_parser("generate", help="generate a reply to one prompt")
    p.add_argument("prompt", help="the prompt (sent through the model's chat template unless --raw)")
    p.add_argument("--model", default=None, help="HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    gen = "the model's generation_config.json (see --generation-config), else "
    p.add_argument("--max-tokens", type=int, default=None, help=f"most tokens to generate (default: {gen}64)")
    p.add_argument("--temperature", type=float, default=None, help=f"0 = greedy (default: {gen}0)")
    p.add_argument("--top-p", type=float, default=None, help=f"default: {gen}1.0")
    p.add_argument("--top-k", type=int, default=None, help=f"default: {gen}-1 (off)")
    p.add_argument("--min-p", type=float, default=None, help=f"default: {gen}0.0")
    p.add_argument("--repetition-penalty", type=float, default=None, help=f"default: {gen}1.0")
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("-n", type=int, default=1, help="number of samples")
    add_engine_args(p)
    p.set_defaults(max_num_seqs=None)  # default: -n (`_cmd_generate`)
    next(a for a in p._actions if a.dest == "max_num_seqs").help = "most requests running at once (default: -n)"
    _add_config_arg(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_serve_args: Callable[[argparse.ArgumentParser], None] | None
    try:
        from portside.server.cli import add_serve_args
    except ImportError:  # the server extra is missing
        add_serve_args = None
    if add_serve_args is not None:
        add_serve_args(p)
    add_engine_args(p)
    _add_config_arg(p)
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("disagg-proxy", help="serve one OpenAI endpoint over a prefill and a decode instance "
                       "(disaggregated prefill; docs/disagg.md)")
    try:
        from portside.server.disagg_proxy import add_proxy_args
    except ImportError:  # the server extra is missing
        pass
    else:
        add_proxy_args(p)
    p.set_defaults(func=_cmd_disagg_proxy)

    add_bench_parser(sub)
    return parser


def _add_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, metavar="YAML",
                   help="read flags from a YAML mapping (keys: flag names with - or _); flags on the command line win")


def parse_args(parser: Parser, argv: list[str]) -> argparse.Namespace:
    """Parse `argv`, with a --config file's flags before the command line's; usage errors exit 2."""
    from portside.cli_config import ConfigFileError, config_argv

    args, extra = parser.parse_known_args(argv)
    if getattr(args, "config", None):
        sub = parser.subparser(args.command)
        try:
            tokens, positional, top_tokens = config_argv(args.config, sub, top=parser)
        except ConfigFileError as e:
            sub.error(str(e))
        at = argv.index(args.command) + 1
        # the file's flags go before the command line's (which win), the program's own before the subcommand
        args, extra = parser.parse_known_args(top_tokens + argv[:at] + tokens + argv[at:])
        for dest, value in positional.items():
            if getattr(args, dest, None) is None:
                setattr(args, dest, str(value))
    if extra:
        parser.unknown_args_error(args.command, extra, getattr(args, "bench_command", None))
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from portside.platform import DeviceSelectionError

    try:
        return args.func(args)
    except DeviceSelectionError as e:
        print(f"portside: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, FileNotFoundError) as e:
        print(f"portside: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
