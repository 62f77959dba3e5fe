"""The inference engine: request flow, sampling and results."""

from .engine import Engine
from .request import GenerationResult, StreamEvent
from .sampling import SamplingParams

__all__ = ["Engine", "GenerationResult", "SamplingParams", "StreamEvent"]
