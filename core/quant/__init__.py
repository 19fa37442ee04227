"""Quantized weights: checkpoint formats (`config`, `formats`, `gguf`), the canonical
`QuantWeight` and its pure-torch reference (`weight`), applied to a built model (`apply`)."""

from portside.quant.config import QUANT_METHODS, QuantConfig
from portside.quant.weight import QuantWeight, dequantize, quantized_linear

__all__ = ["QUANT_METHODS", "QuantConfig", "QuantWeight", "dequantize", "quantized_linear"]
