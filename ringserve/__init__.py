"""ringserve: an LLM inference engine for long contexts and low latency."""

from ringserve.errors import ModelLoadError, RequestError, RingserveError
from ringserve.llm import LLM
from ringserve.outputs import RequestOutput
from ringserve.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "ModelLoadError",
    "RequestError",
    "RequestOutput",
    "RingserveError",
    "SamplingParams",
    "StructuredOutputsParams",
]
__version__ = "0.1.0"
