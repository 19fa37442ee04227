"""portside: a hardware-portable LLM inference and serving engine."""

from portside.lora.request import LoRARequest
from portside.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob, RequestOutput
from portside.pooling.params import PoolingParams
from portside.sampling_params import BeamSearchParams, GuidedDecodingParams, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "LLMEngine",
    "SamplingParams",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "StructuredOutputsParams",
    "GuidedDecodingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "LoRARequest",
    "PoolingParams",
    "__version__",
]


def __getattr__(name: str):
    # The engine pulls in torch and transformers: import it on first use, so that
    # `import portside` (and `portside devices`) stays cheap.
    if name == "LLM":
        from portside.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from portside.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'portside' has no attribute {name!r}")
