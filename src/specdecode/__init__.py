"""specdecode: exact speculative decoding for LLMs, measured honestly."""

from specdecode.api import SpeculativeGenerator, make_proposer
from specdecode.core.sampling import SamplingConfig
from specdecode.engine import Decoder, GenerationConfig, GenerationResult
from specdecode.errors import SpecDecodeError
from specdecode.models.loading import LoadedModel, load_model

__version__ = "0.1.0"

__all__ = [
    "Decoder",
    "GenerationConfig",
    "GenerationResult",
    "LoadedModel",
    "SamplingConfig",
    "SpecDecodeError",
    "SpeculativeGenerator",
    "load_model",
    "make_proposer",
]
