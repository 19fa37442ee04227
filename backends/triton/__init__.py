"""Portable Triton kernels shared by the cuda and rocm backends (and any plugin that wants them).

A kernel library, not a platform. Modules:

- `launch`: per-architecture launch heuristics (pure functions);
- `kv_cache`: the KV-cache write at `slot_mapping`;
- `paged_attention`: mixed prefill/decode paged attention with a split-KV (flash-decoding) path,
  sliding windows and logit softcaps;
- `moe`: fused mixture-of-experts (grouped GEMMs over expert-sorted tokens), `TritonModelOps`;
- `lora`: batched multi-LoRA shrink and expand (grouped GEMMs over slot-sorted tokens);
- `recurrent`: the recurrent-layer kernels (causal conv1d, Mamba-2 / Mamba-1 scans, gated delta
  rule) over a step's ragged requests and their state slots, `TritonRecurrentOps`; the scans'
  kernels (a token at a time, and chunked as matmuls) in `recurrent_scans`;
- `quant`: quantized linear layers (`TritonQuantOps`, the kernel chosen per weight) on
  `dequant_gemm` (weight-only) and `scaled_mm` (W8A8), which share `quant_gemm`;
- `attention`: `TritonAttentionBackend`, the kernels behind the `AttentionBackend` contract;
- `graphs`: the device-graph runner (CUDA and HIP graphs) shared by cuda and rocm; no triton;
- `gpu_platform`: `TorchGpuPlatform`, the base of the cuda and rocm platforms; no triton.

Importing this package imports nothing heavy; import the submodule you need.
"""
