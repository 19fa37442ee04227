"""The tiny tokenizer of the test models: a ~400-token byte-level BPE trained, in a second and
without a network, on a built-in English text, with ChatML special tokens and chat template
(`make_tiny_tokenizer`), and the chat templates and added tokens tests give it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["CHATML_TEMPLATE", "HERMES_TOOLS_TEMPLATE", "QWEN_MARKERS", "SPECIAL_TOKENS", "make_tiny_tokenizer"]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """\
The harbour town woke early. Fishing boats slipped out past the lighthouse while the bakers
lit their ovens, and the smell of fresh bread drifted along the quay. By seven the market was
full: traders called out the price of apples, cheese, rope and lamp oil, and children ran
between the stalls with their dogs.

A ship arrived from the south in the afternoon. Her captain, a tall woman with a grey coat,
asked the harbour master where she could find a carpenter, because the storm had cracked her
mast. He pointed to a small workshop behind the church. "Ask for Thomas," he said. "He is slow,
but his work will outlast the both of us."

What is the capital of France? The capital of France is Paris. What is the largest ocean? The
Pacific Ocean is the largest. How many days are there in a week? There are seven days in a
week. Can you help me write a letter? Of course, I would be glad to help you write a letter.

Engines, servers and schedulers process requests in batches. Each request has a prompt, a
number of tokens to generate, and a set of sampling parameters such as the temperature, top-k
and top-p. The scheduler decides which requests run in each step, and the model computes the
next token for every running sequence at once. Memory for keys and values is split into
blocks, so that sequences of different lengths can share one pool without waste.

In winter the town grew quiet. Snow covered the roofs, the boats stayed in the harbour, and
people gathered in the tavern to tell stories about the sea: of whales and waves, of lost
ships and lucky returns, of the old lighthouse keeper who could read the weather in the clouds.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024. Punctuation: , . ; : ! ? ( ) [ ] { } - " ' / @ #.
"""


# Qwen-style markers a tokenizer may add (`added_tokens=`): reasoning and hermes tool calls
QWEN_MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>")

# ChatML with hermes-style tools, as Qwen2.5 / Qwen3 templates render them (tools listed in the
# system turn, calls as <tool_call> JSON, results as tool turns)
HERMES_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call functions. Signatures:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "Reply with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> to call one.<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{{ '<tool_call>\n' + ({'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson) + '\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}"
)


def make_tiny_tokenizer(path: str | os.PathLike, vocab_size: int = 400, added_tokens: tuple[str, ...] = (),
                        chat_template: str = CHATML_TEMPLATE) -> Any:
    """Train a byte-level BPE on the built-in corpus, save it as a HF tokenizer at `path`.

    Special tokens: ``<|endoftext|>`` (pad, id 0), ``<|im_start|>`` (id 1), ``<|im_end|>``
    (eos, id 2); ChatML chat template; no BOS. `added_tokens` (e.g. `QWEN_MARKERS`) are added
    as single, non-special tokens after the trained ones. Returns the `PreTrainedTokenizerFast`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    if added_tokens:
        hf_tok.add_tokens(list(added_tokens))
    hf_tok.chat_template = chat_template
    Path(path).mkdir(parents=True, exist_ok=True)
    hf_tok.save_pretrained(str(path))
    return hf_tok
