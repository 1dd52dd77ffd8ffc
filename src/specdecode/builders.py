"""The built-in methods' builders, named by the registry (:mod:`specdecode.methods`).

An entry point: builders may import proposers, networks and models. Each is called as
``build_x(target, draft, **options)`` by :func:`specdecode.api.make_proposer` once the options
were checked against the method's spec; ``target`` is a
:class:`~specdecode.models.loading.LoadedModel` (None is fine for methods that never read it).
"""

from __future__ import annotations

import os
from typing import Any

from specdecode.errors import ConfigError
from specdecode.methods import TRAINED
from specdecode.models.loading import LoadedModel, check_compatible, load_draft, load_model
from specdecode.proposers.base import Proposer

DraftArg = LoadedModel | str | os.PathLike | None


def build_auto(target: LoadedModel, draft: DraftArg = None, **options: Any) -> Proposer | None:
    """The method :func:`~specdecode.api.best_method` picks for ``target``, with ``options``."""
    from specdecode.api import best_method, make_proposer

    return make_proposer(best_method(target), target, draft, **options)


def build_none(target: LoadedModel | None, draft: DraftArg = None) -> None:
    """Plain decoding: no proposer."""
    return None


def build_ngram(target: LoadedModel | None, draft: DraftArg = None, **options: Any) -> Proposer:
    from specdecode.proposers.ngram import NgramProposer

    return NgramProposer(**options)


def build_suffix(target: LoadedModel | None, draft: DraftArg = None, **options: Any) -> Proposer:
    from specdecode.proposers.suffix import SuffixProposer

    return SuffixProposer(**options)


def build_lookahead(target: LoadedModel | None, draft: DraftArg = None, **options: Any) -> Proposer:
    from specdecode.proposers.lookahead import LookaheadProposer

    return LookaheadProposer(**options)


def build_draft(target: LoadedModel, draft: DraftArg = None, **options: Any) -> Proposer:
    """A draft model sharing the target's tokenizer: ``draft`` (loaded, a path, or a folder from
    ``specdecode train draft-model``), else the distilled draft shipped for the target."""
    from specdecode.models.native import default_draft_vocab, with_draft_vocab
    from specdecode.networks.draft_model import is_distilled, load_distilled, shipped_draft
    from specdecode.proposers.draft_model import DraftModelProposer

    vocab = options.pop("vocab", None)  # None: default_draft_vocab's cut for a loaded draft; 0: none
    if draft is None or (not isinstance(draft, LoadedModel) and is_distilled(draft)):
        # The distilled draft shipped for this target, or one from `specdecode train draft-model`.
        if vocab:
            raise ConfigError("vocab cuts a draft model's own head; a distilled draft has its trained one")
        options.pop("dtype", None)  # it runs in the target's dtype, on the target's own layers
        model = shipped_draft(target.model, target.source) if draft is None else load_distilled(target.model, draft)[0]
        return DraftModelProposer(model, **options)
    dtype = options.pop("dtype", None)  # of a draft loaded here; a loaded one keeps its own
    if not isinstance(draft, LoadedModel):
        draft = load_draft(draft, target.dtype, dtype)
    check_compatible(target, draft)
    if vocab is None:  # a static cut alone costs acceptance: only with the context's tokens
        vocab = default_draft_vocab(draft.model) if options.get("context_vocab", True) is True else 0
    if vocab:  # built once here, shared by every request (each adds its context's tokens)
        draft = with_draft_vocab(draft, vocab, "vocab")
    return DraftModelProposer(draft.model, **options)


def build_xtok(target: LoadedModel, draft: DraftArg = None, **options: Any) -> Proposer:
    """A draft with another tokenizer: drafts cross over as text."""
    from specdecode.proposers.xtok import CrossTokenizerProposer

    if draft is None:
        raise ConfigError("method 'xtok' needs a draft model (--draft PATH)")
    dtype = options.pop("dtype", target.dtype)
    if not isinstance(draft, LoadedModel):
        draft = load_model(draft, dtype=dtype)
    return CrossTokenizerProposer(draft, target.tokenizer, **options)


def build_early_exit(target: LoadedModel, draft: DraftArg = None, **options: Any) -> Proposer:
    from specdecode.proposers.early_exit import EarlyExitProposer

    return EarlyExitProposer(target.model, **options)


def build_eagle(target: LoadedModel, draft: DraftArg = None, **options: Any) -> Proposer:
    """A trained head: ``path`` / ``draft`` when given, else the one shipped for the target."""
    from specdecode.proposers.eagle import EagleProposer

    return EagleProposer(target.model, path=trained_dir("eagle", target, draft, options), **options)


def build_medusa(target: LoadedModel, draft: DraftArg = None, **options: Any) -> Proposer:
    """Trained heads: ``path`` / ``draft`` when given, else the ones shipped for the target."""
    from specdecode.proposers.medusa import MedusaProposer

    return MedusaProposer(target.model, path=trained_dir("medusa", target, draft, options), **options)


def build_hybrid(target: LoadedModel, draft: DraftArg = None, **options: Any) -> Proposer:
    """A lookup where the context repeats, else ``drafter``, which gets the other options.
    Its default: a loaded draft model when one is given (``draft``: the 0.5B beside a Qwen 1.5B
    target, which has no trained drafter), else the trained drafter the shipped card was
    measured with (:func:`~specdecode.api.best_drafter`)."""
    from specdecode.api import best_drafter, make_proposer
    from specdecode.proposers.hybrid import HybridProposer

    lookup = {key: options.pop(key) for key in ("min_match", "max_ngram", "lookup") if key in options}
    inner = options.pop("drafter", None) or ("draft" if isinstance(draft, LoadedModel) else best_drafter(target))
    if inner not in TRAINED:
        raise ConfigError(f"hybrid drafter must be one of {', '.join(TRAINED)}, got {inner!r}")
    return HybridProposer(make_proposer(inner, target, draft, **options), **lookup)


def trained_dir(method: str, target: LoadedModel, draft: Any, options: dict) -> str:
    """The folder of ``method``'s trained drafter: ``path`` / ``draft`` when given, else the one
    shipped for ``target``; ConfigError when it holds no weights. Pops ``path`` from ``options``."""
    from specdecode.networks.storage import shipped_head_dir

    path = options.pop("path", None) or (draft if isinstance(draft, (str, os.PathLike)) else None)
    path = str(path or shipped_head_dir(target.source, method))
    if not (os.path.isdir(path) and os.path.exists(os.path.join(path, "model.safetensors"))):
        raise ConfigError(
            f"no trained {method} drafter for this target at {path}; train one with: specdecode train {method} "
            "--out DIR (then --draft DIR)"
        )
    return path
