"""Proposers: where candidate tokens come from. One file per method, one shared interface."""

from specdecode.proposers.base import Proposer
from specdecode.proposers.draft_model import DraftModelProposer
from specdecode.proposers.ngram import NgramProposer

__all__ = ["Proposer", "DraftModelProposer", "NgramProposer"]
