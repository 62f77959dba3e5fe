"""The inference engine: request flow, sampling and results."""

from pagedkv.engine.engine import Engine
from pagedkv.engine.request import GenerationResult, StreamEvent
from pagedkv.engine.sampling import SamplingParams
from pagedkv.engine.scheduler import SchedulerConfig

__all__ = ["Engine", "GenerationResult", "SamplingParams", "SchedulerConfig", "StreamEvent"]
