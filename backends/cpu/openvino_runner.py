"""OpenVINO graph runner: the dense parts of the model as OpenVINO models, attention in torch.

The predictable path (`openvino.convert_model` + `compile_model("CPU")`), not
`torch.compile(backend="openvino")`, whose dynamo backend silently falls back to Inductor on any
conversion error. The model is cut at its attention calls into ``num_layers + 1`` segments:

    head:  h, cos, sin            -> h, q, k, v       (layer 0: input norm, qkv, rotary)
    mid i: h, o, cos, sin         -> h, q, k, v       (layer i-1: o_proj, residual, MLP;
                                                       layer i: input norm, qkv, rotary)
    tail:  h, o                   -> hidden           (last layer's o_proj + MLP, final norm)

Each segment is converted once with a dynamic token axis, so any batch shape runs without
recompiling. Paged attention (which writes the KV cache in place) stays in the platform's
attention backend between segments. Works for the Llama family (`LlamaForCausalLM`) at tensor
parallel size 1.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from portside.backend_api import ForwardContext, GraphRunner, ModelFn

logger = logging.getLogger(__name__)


def openvino_available() -> str | None:
    """None if `openvino` imports, else the reason."""
    try:
        import openvino  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the environment
        return f"openvino is not importable ({e}); pip install 'portside[openvino]'"
    return None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The Llama family's rotary (first half paired with second half), as the model applies it:
    x [T, H, D], cos/sin [T, D/2]. Restated here because a backend imports only the contract;
    the segment-vs-eager test catches a divergence."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def _qkv(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    attn = layer.self_attn
    T, D = x.shape[0], attn.head_dim
    q_size, kv_size = attn.num_heads * D, attn.num_kv_heads * D
    q, k, v = attn.qkv_proj(layer.input_layernorm(x)).split([q_size, kv_size, kv_size], dim=-1)
    q = _rotate(q.view(T, attn.num_heads, D), cos, sin)  # [T, H, D]
    k = _rotate(k.view(T, attn.num_kv_heads, D), cos, sin)  # [T, KVH, D]
    return q, k, v.reshape(T, attn.num_kv_heads, D)


def _finish(layer: nn.Module, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    h = h + layer.self_attn.o_proj(o)  # o [T, H*D]
    return h + layer.mlp(layer.post_attention_layernorm(h))


class _Head(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, h, cos, sin):  # h [T, hidden], cos/sin [T, D/2]
        return (h, *_qkv(self.layer, h, cos, sin))


class _Mid(nn.Module):
    def __init__(self, prev: nn.Module, nxt: nn.Module) -> None:
        super().__init__()
        self.prev, self.nxt = prev, nxt

    def forward(self, h, o, cos, sin):
        h = _finish(self.prev, h, o)
        return (h, *_qkv(self.nxt, h, cos, sin))


class _Tail(nn.Module):
    def __init__(self, last: nn.Module, norm: nn.Module) -> None:
        super().__init__()
        self.last, self.norm = last, norm

    def forward(self, h, o):
        return self.norm(_finish(self.last, h, o))


class OpenVinoGraphRunner(GraphRunner):
    """Runs each step through `num_layers + 1` compiled OpenVINO models (see the module doc).

    `num_ov_calls` counts OpenVINO inferences: tests use it to prove OpenVINO actually ran.
    """

    name = "openvino"

    def __init__(self, model_fn: ModelFn, config: Any) -> None:
        super().__init__(model_fn, config)
        reason = openvino_available()
        if reason:
            raise RuntimeError(reason)
        model = getattr(model_fn, "__self__", None)
        inner = getattr(model, "model", None)
        if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "rotary", "layers", "norm")):
            raise ValueError("cpu graph mode 'openvino' supports Llama-family models (LlamaForCausalLM.forward)")
        self.inner = inner
        self.num_ov_calls = 0
        self._requests: list[Any] = []
        self._compiled: list[Any] = []
        self._build()

    def _build(self) -> None:
        import openvino as ov

        inner = self.inner
        layers = list(inner.layers)
        attn = layers[0].self_attn
        hidden = inner.norm.weight.shape[0]
        half = attn.head_dim // 2
        q_out = attn.num_heads * attn.head_dim
        dt = inner.norm.weight.dtype
        t0 = time.perf_counter()
        ex_h, ex_cs, ex_o = torch.zeros(3, hidden, dtype=dt), torch.zeros(3, half, dtype=dt), torch.zeros(3, q_out, dtype=dt)
        shp_h, shp_cs, shp_o = ov.PartialShape([-1, hidden]), ov.PartialShape([-1, half]), ov.PartialShape([-1, q_out])
        segments: list[tuple[nn.Module, tuple, list]] = [(_Head(layers[0]), (ex_h, ex_cs, ex_cs), [shp_h, shp_cs, shp_cs])]
        for prev, nxt in zip(layers[:-1], layers[1:]):
            segments.append((_Mid(prev, nxt), (ex_h, ex_o, ex_cs, ex_cs), [shp_h, shp_o, shp_cs, shp_cs]))
        segments.append((_Tail(layers[-1], inner.norm), (ex_h, ex_o), [shp_h, shp_o]))
        core = ov.Core()
        props = {
            "INFERENCE_NUM_THREADS": torch.get_num_threads(),
            "NUM_STREAMS": 1,
            "PERFORMANCE_HINT": "LATENCY",
        }
        if dt == torch.float32:
            props["INFERENCE_PRECISION_HINT"] = "f32"  # no silent bf16 on AMX/AVX-512-BF16 CPUs
        with torch.no_grad():
            for module, example, shapes in segments:
                ov_model = ov.convert_model(module.eval(), example_input=example, input=shapes)
                compiled = core.compile_model(ov_model, "CPU", props)
                self._compiled.append(compiled)
                self._requests.append(compiled.create_infer_request())
        logger.info("openvino: compiled %d segments in %.1f s", len(segments), time.perf_counter() - t0)

    def _infer(self, i: int, *args: torch.Tensor) -> list[torch.Tensor]:
        """Run segment i. Inputs are shared with OpenVINO (no copy); outputs are fresh arrays,
        because the request's own output buffers are reallocated when the token count changes."""
        inputs = [a.contiguous().numpy() for a in args]  # kept alive for the duration of infer
        res = self._requests[i].infer(inputs, share_inputs=False, share_outputs=False)
        self.num_ov_calls += 1
        return [torch.from_numpy(res[out]) for out in self._compiled[i].outputs]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        inner = self.inner
        h = inner.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = inner.rotary(positions, h.dtype)  # [T, D/2] each
        T = h.shape[0]
        h, q, k, v = self._infer(0, h, cos, sin)
        num_layers = len(self._requests) - 1
        for i in range(num_layers):
            scale = inner.layers[i].self_attn.scale
            o = ctx.attention(i, q, k, v, scale).reshape(T, -1)  # [T, H*D]
            if i + 1 < num_layers:
                h, q, k, v = self._infer(i + 1, h, o, cos, sin)
            else:
                (h,) = self._infer(i + 1, h, o)
        return h
