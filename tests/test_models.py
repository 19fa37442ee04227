"""Llama-family models against transformers: full-prompt logits and paged greedy decoding."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from portside.attention.reference import ReferenceAttentionBackend
from portside.config import ModelConfig
from portside.contract import Communicator, KVCacheSpec
from portside.model.args import ModelArgs, RopeScaling
from portside.model.registry import load_model
from portside.model.rotary import RotaryEmbedding, rope_inv_freq
from portside.testing.paged import PagedSequence
from portside.testing.tiny import hf_greedy, hf_logits, make_tiny_model

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # small, so all three frequency bands occur at head_dim 16
}

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {"seed": 1}),
    "qwen2": ("qwen2", {"seed": 2, "num_hidden_layers": 3}),
    "llama-tied": ("llama", {"seed": 3, "tie_word_embeddings": True}),
    "llama-head-dim-32": ("llama", {"seed": 4, "head_dim": 32}),
    "llama-bias": ("llama", {"seed": 5, "attention_bias": True, "mlp_bias": True}),
    "qwen2-tied-mha": ("qwen2", {"seed": 6, "tie_word_embeddings": True, "num_key_value_heads": 4}),
    "rope-linear": ("llama", {"seed": 7, "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0}}),
    "rope-dynamic": ("llama", {"seed": 8, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}),
    "rope-llama3": ("llama", {"seed": 9, "rope_parameters": LLAMA3_ROPE}),
}

PROMPT = [5, 17, 250, 31, 99, 8, 120, 64, 300, 2, 45, 77, 1, 390, 12, 13, 14, 200, 201, 6, 7, 333, 42]  # 23 tokens


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, overrides = VARIANTS[request.param]
    return make_tiny_model(tmp_path_factory.mktemp(request.param), arch, **overrides)


def _load(path: Path, **kw: Any) -> torch.nn.Module:
    # max_model_len = the trained context, so dynamic rope scaling stays off (as in transformers)
    return load_model(ModelConfig(path=str(path), **{"max_model_len": 512, **kw}), torch.device("cpu"))


def test_prompt_logits_match_transformers(variant: Path) -> None:
    model = _load(variant)
    logits = PagedSequence(model, ReferenceAttentionBackend(), block_size=4).forward(PROMPT)
    expected = hf_logits(variant, PROMPT)
    assert logits.dtype == torch.float32 and logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_paged_greedy_decode_matches_transformers(variant: Path) -> None:
    model = _load(variant)
    expected = hf_greedy(variant, PROMPT, 24)
    assert len(set(expected)) > 5, "tiny model degenerate: greedy repeats itself"
    got = PagedSequence(model, ReferenceAttentionBackend(), block_size=4).greedy(PROMPT, 24)
    assert got == expected


def test_chunked_prefill_equals_whole_prefill(tiny_qwen2: Path) -> None:
    model = _load(tiny_qwen2)
    whole = PagedSequence(model, ReferenceAttentionBackend(), block_size=4).greedy(PROMPT, 10)
    chunked = PagedSequence(model, ReferenceAttentionBackend(), block_size=4).greedy(PROMPT, 10, prefill_chunk=5)
    assert chunked == whole == hf_greedy(tiny_qwen2, PROMPT, 10)


def test_model_interface(tiny_llama: Path) -> None:
    model = _load(tiny_llama)
    cfg = model.config
    assert (cfg.vocab_size, cfg.num_layers, cfg.max_position_embeddings) == (400, 2, 512)
    assert cfg.eos_token_ids == (2,)  # <|im_end|>
    assert model.kv_cache_spec() == KVCacheSpec(num_layers=2, num_kv_heads=2, head_size=16, dtype=torch.float32)
    # fused projections: one matmul for q/k/v and one for gate/up per layer
    names = {n for n, _ in model.named_parameters()}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names


def test_dtype_cast(tiny_llama: Path) -> None:
    model = _load(tiny_llama, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.kv_cache_spec().dtype == torch.bfloat16
    logits = PagedSequence(model, ReferenceAttentionBackend(), block_size=4).forward(PROMPT[:6])
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hf_logits(tiny_llama, PROMPT[:6]), atol=0.3, rtol=0.05)


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    import json

    path = make_tiny_model(tmp_path / "m", "llama")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    cfg["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM.*LlamaForCausalLM.*Qwen2ForCausalLM"):
        _load(path)


# ---- rope scaling details -------------------------------------------------------------------


def test_transformers4_rope_scaling_form_is_read() -> None:
    hf = SimpleNamespace(
        architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0}, eos_token_id=[3, 4],
    )  # fmt: skip
    args = ModelArgs.from_hf(hf)
    assert args.rope_theta == 500000.0 and args.rope_scaling == RopeScaling("linear", factor=2.0)
    assert args.head_dim == 4 and args.eos_token_ids == (3, 4) and not args.qkv_bias


def test_dynamic_rope_beyond_trained_context_matches_transformers_formula(tmp_path: Path) -> None:
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    path = make_tiny_model(tmp_path, "llama", **{"rope_parameters": VARIANTS["rope-dynamic"][1]["rope_parameters"]})
    hf = AutoConfig.from_pretrained(path)
    expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf, torch.device("cpu"), seq_len=2048)
    scaling = RopeScaling("dynamic", factor=2.0)
    torch.testing.assert_close(rope_inv_freq(16, 10000.0, scaling, 512, max_model_len=2048), expected)
    # within the trained context, dynamic scaling changes nothing
    torch.testing.assert_close(rope_inv_freq(16, 10000.0, scaling, 512, 512), rope_inv_freq(16, 10000.0, None, 512))


def test_rotary_table_matches_computing_the_angles():
    """The cos/sin table looked up per step holds exactly what computing a step's angles gives,
    for every position up to the context length, in the model's dtype; past it, an error."""
    rotary = RotaryEmbedding(16, 10000.0, None, 512, max_model_len=300)
    positions = torch.tensor([0, 1, 17, 255, 299])
    freqs = positions.float().unsqueeze(1) * rope_inv_freq(16, 10000.0, None, 512).unsqueeze(0)
    for dtype in (torch.float32, torch.bfloat16):
        cos, sin = rotary(positions, dtype)
        assert cos.shape == sin.shape == (5, 8) and cos.dtype == dtype
        torch.testing.assert_close(cos, freqs.cos().to(dtype), rtol=0, atol=0)
        torch.testing.assert_close(sin, freqs.sin().to(dtype), rtol=0, atol=0)
    with pytest.raises(IndexError):
        rotary(torch.tensor([300]), torch.float32)


# ---- tensor parallelism (threads standing in for ranks) ---------------------------------------


class ThreadCommunicator(Communicator):
    """Real collectives between threads of one process (each thread is a rank)."""

    name = "threads"

    def __init__(self, rank: int, world_size: int, shared: dict[str, Any]) -> None:
        super().__init__(rank, world_size)
        self.shared = shared

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        slots, barrier = self.shared["slots"], self.shared["barrier"]
        slots[self.rank] = x.clone()
        barrier.wait()
        parts = list(slots)
        barrier.wait()
        return parts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._exchange(x)).sum(0)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self._exchange(x), dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        return self._exchange(x)[src]

    def barrier(self) -> None:
        self.shared["barrier"].wait()


def run_ranks(world_size: int, fn: Callable[[Communicator, int], Any], timeout: float = 120) -> list[Any]:
    """`fn(comm, rank)` on one thread per rank, over `ThreadCommunicator` collectives; the results in
    rank order. A rank that raises aborts the others' barrier, and the test fails with its error."""
    shared: dict[str, Any] = {"slots": [None] * world_size, "barrier": threading.Barrier(world_size)}
    results: list[Any] = [None] * world_size

    def rank(r: int) -> None:
        try:
            results[r] = fn(ThreadCommunicator(r, world_size, shared), r)
        except BaseException as e:  # noqa: BLE001 - surfaced below
            shared["barrier"].abort()
            results[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    for result in results:
        assert not isinstance(result, BaseException), result
    return results


@pytest.mark.parametrize("tp_size", [2, 4])  # 4 > 2 KV heads: KV heads are replicated
def test_tensor_parallel_logits_equal_single_rank(tiny_qwen2: Path, tp_size: int) -> None:
    expected = hf_logits(tiny_qwen2, PROMPT)

    def rank(comm: Communicator, r: int) -> Any:
        model = load_model(ModelConfig(path=str(tiny_qwen2)), torch.device("cpu"), comm, r, tp_size)
        return (model, PagedSequence(model, ReferenceAttentionBackend(), block_size=4).forward(PROMPT))

    results = run_ranks(tp_size, rank)
    for r in range(tp_size):
        model, logits = results[r]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
        # each rank holds a shard, never the whole model
        qkv = model.model.layers[0].self_attn.qkv_proj.weight
        assert qkv.shape[0] == (4 // tp_size + 2 * max(1, 2 // tp_size)) * 16
        assert model.kv_cache_spec().num_kv_heads == max(1, 2 // tp_size)
        assert model.model.embed_tokens.weight.shape[0] == -(-400 // tp_size)
