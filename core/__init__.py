"""portside: a hardware-portable LLM inference and serving engine."""

from portside.sampling_params import SamplingParams
from portside.outputs import CompletionOutput, Logprob, RequestOutput

__version__ = "0.1.0"

__all__ = ["SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
