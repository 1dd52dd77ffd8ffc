"""The engine: many requests in one batched forward per step, speculation chosen per request.

``Engine`` runs requests; ``Decoder`` is the single-request view of it (a batch of one).
"""

from specdecode.engine.loop import Decoder, DecodeRun
from specdecode.engine.request import GenerationConfig, GenerationResult, Speculation, StreamEvent, TreeConfig
from specdecode.engine.scheduler import Engine, EngineConfig

__all__ = [
    "Decoder",
    "DecodeRun",
    "Engine",
    "EngineConfig",
    "GenerationConfig",
    "GenerationResult",
    "Speculation",
    "StreamEvent",
    "TreeConfig",
]
