"""The decode loop: prefill once, then rounds of propose, verify, accept, trim caches, emit."""

from specdecode.engine.loop import Decoder, DecodeRun, GenerationConfig, GenerationResult, StreamEvent, TreeConfig

__all__ = ["Decoder", "DecodeRun", "GenerationConfig", "GenerationResult", "StreamEvent", "TreeConfig"]
