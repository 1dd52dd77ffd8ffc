"""The registry of speculative methods: one :class:`MethodSpec` per name, built-in or a plugin's.

A light module (the CLI reads it before importing torch): a spec names its builder as a
``"module:function"`` string, imported only when a proposer is built. The API
(:func:`specdecode.api.make_proposer`), the CLI's ``--method`` choices and the bench's method
grammar (``name``, ``name+tree``, ``name+conf``) all read this registry, so a method registered
with :func:`register_method` before they run is accepted everywhere.

>>> from specdecode.methods import MethodSpec, register_method
>>> register_method(MethodSpec("mine", "my_package.drafting:build", options={"depth"},
...                            description="my own proposer"))
"""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from specdecode.errors import ConfigError

_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")  # lower case, no '+' or ',' (the bench's grammar)


@dataclass(frozen=True)
class MethodSpec:
    """One speculative method.

    ``builder`` is ``"module:function"``; the function is called as
    ``builder(target, draft, **options)`` with ``target`` a
    :class:`~specdecode.models.loading.LoadedModel` (``target.model`` is the
    :class:`~specdecode.models.base.CausalLM`; may be None for methods that never read it),
    ``draft`` a loaded model, a path or None, and returns a
    :class:`~specdecode.proposers.base.Proposer` (None only for plain decoding). ``options`` are
    the keyword options the builder accepts: any other is a ConfigError before the builder runs;
    ``None`` means the builder takes and checks any option itself (``auto`` forwards them).

    Flags: ``trained`` (can ship a trained drafter per target: ``drafters/<target>/<name>/``),
    ``composed`` (built from a trained drafter; its shipped card holds only measurements),
    ``tree_only`` (drafts only through the tree forward: trees are switched on by default),
    ``confidence`` (takes ``confidence_threshold``: the ``confidence`` policy and the bench's
    ``+conf``), ``needs_draft`` (refused without a draft model), ``uses_draft`` (takes a draft
    model, ``--draft PATH`` loaded as a model, when given; implied by ``needs_draft``; a trained
    drafter's folder passed as ``draft`` to eagle / medusa is not a model), ``needs_model`` (builds from a real target's
    weights or chooses per target, so it cannot be built on a tiny table model).
    """

    name: str
    builder: str
    options: frozenset[str] | None = frozenset()
    description: str = ""
    trained: bool = False
    composed: bool = False
    tree_only: bool = False
    confidence: bool = False
    needs_draft: bool = False
    uses_draft: bool = False
    needs_model: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ConfigError(f"method name must be lower-case letters, digits, '-' or '_', got {self.name!r}")
        module, _, function = self.builder.partition(":") if isinstance(self.builder, str) else ("", "", "")
        if not module or not function:
            raise ConfigError(f"method {self.name!r}: builder must be a 'module:function' string, got {self.builder!r}")
        if self.options is not None:
            if isinstance(self.options, str):
                raise ConfigError(
                    f"method {self.name!r}: options must be a set of names, got the string {self.options!r}"
                )
            object.__setattr__(self, "options", frozenset(self.options))
        if self.needs_draft:
            object.__setattr__(self, "uses_draft", True)

    def check_options(self, options: Iterable[str]) -> None:
        """ConfigError naming any option the builder does not accept, and the ones it does."""
        if self.options is None:
            return
        unknown = sorted(set(options) - self.options)
        if not unknown:
            return
        accepted = ", ".join(sorted(self.options)) or "none"
        hints = [m for u in unknown for m in difflib.get_close_matches(u, sorted(self.options), n=1)]
        hint = f" (did you mean {', '.join(repr(h) for h in hints)}?)" if hints else ""
        plural = "s" if len(unknown) > 1 else ""
        raise ConfigError(
            f"method {self.name!r} does not take option{plural} {', '.join(map(repr, unknown))}{hint}; "
            f"it accepts: {accepted}"
        )

    def load_builder(self) -> Callable[..., Any]:
        """The builder function (imported now); ConfigError when it cannot be found."""
        module, _, function = self.builder.partition(":")
        try:
            fn = getattr(importlib.import_module(module), function)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"method {self.name!r}: cannot import its builder {self.builder!r} ({exc})") from None
        if not callable(fn):
            raise ConfigError(f"method {self.name!r}: builder {self.builder!r} is not callable")
        return fn


_SPECS: dict[str, MethodSpec] = {}
REGISTRY: MappingProxyType[str, MethodSpec] = MappingProxyType(_SPECS)  # name -> spec, read-only view


def register_method(spec: MethodSpec, replace: bool = False) -> MethodSpec:
    """Register ``spec`` under its name (the plugin API); a name already taken is a ConfigError
    unless ``replace=True``. Returns ``spec``."""
    if not isinstance(spec, MethodSpec):
        raise ConfigError(f"register_method takes a MethodSpec, got {type(spec).__name__}")
    if spec.name in _SPECS and not replace:
        raise ConfigError(f"method {spec.name!r} is already registered (pass replace=True to replace it)")
    _SPECS[spec.name] = spec
    return spec


def unregister_method(name: str) -> MethodSpec:
    """Remove a registered method (a plugin's clean-up); ConfigError when it is not registered."""
    return _SPECS.pop(method_spec(name).name)


def parse_option(text: str, where: str) -> tuple[str, Any]:
    """A proposer option written ``name=value`` (the benches' ``METHOD:name=value``): the value
    as a bool, int or float where it reads as one, else a string; ConfigError naming ``where``."""
    key, eq, value = (part.strip() for part in text.partition("="))
    if not eq or not key or not value:
        raise ConfigError(f"{where}: expected a proposer option as name=value, got {text!r}")
    if value in ("true", "false"):
        return key, value == "true"
    for kind in (int, float):
        try:
            return key, kind(value)
        except ValueError:
            pass
    return key, value


def method_names() -> tuple[str, ...]:
    """Every registered method's name, built-ins first, in registration order."""
    return tuple(_SPECS)


def method_spec(name: str) -> MethodSpec:
    """The spec registered as ``name``; ConfigError naming the choices when there is none."""
    try:
        return _SPECS[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown method {name!r}; choose one of {', '.join(_SPECS)}") from None


class _Names(Sequence):
    """A live, read-only tuple of the registered names whose spec satisfies a predicate: the
    older constants (``METHODS``, ``TRAINED``...) stay importable and see later plugins too.
    Names in ``first`` (if registered and kept) lead, in that order; then registration order."""

    def __init__(self, keep: Callable[[MethodSpec], bool], first: tuple[str, ...] = ()) -> None:
        self._keep, self._first = keep, first

    def _names(self) -> tuple[str, ...]:
        kept = [name for name, spec in _SPECS.items() if self._keep(spec)]
        return tuple([n for n in self._first if n in kept] + [n for n in kept if n not in self._first])

    def __getitem__(self, index):
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __add__(self, other: Sequence[str]) -> tuple[str, ...]:
        return self._names() + tuple(other)

    def __radd__(self, other: Sequence[str]) -> tuple[str, ...]:
        return tuple(other) + self._names()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and not isinstance(other, str) and self._names() == tuple(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._names())


# -- the built-in methods --------------------------------------------------------------------------

_B = "specdecode.builders:"
_DRAFT_MODEL = {"max_length", "confidence_threshold", "branch", "static_tree"}  # DraftModelProposer's
_HEAD = {"path", "branch", "confidence_threshold"}  # EAGLE / Medusa: path = a trained folder
_OWN_READ = {"prompt_window"}  # a draft with its own cache (not early-exit's, which shares the target's)
_OWN_HEAD = {"vocab", "context_vocab"}  # a draft model's head cut to N ids (+ each request's context's)
_TRAINED_OPTIONS = _DRAFT_MODEL | _OWN_READ | _OWN_HEAD | {"dtype"} | _HEAD  # the hybrid's drafter's

for _spec in (
    MethodSpec(
        "auto",
        _B + "build_auto",
        None,
        needs_model=True,
        description="the method with the best speedup measured on this target (its shipped cards), else ngram",
    ),
    MethodSpec("none", _B + "build_none", description="plain autoregressive decoding (no proposer)"),
    MethodSpec(
        "draft",
        _B + "build_draft",
        _DRAFT_MODEL | _OWN_READ | _OWN_HEAD | {"dtype"},
        trained=True,
        confidence=True,
        uses_draft=True,
        description="a small draft model sharing the target's tokenizer (default: the shipped distilled one)",
    ),
    MethodSpec(
        "ngram",
        _B + "build_ngram",
        {"max_ngram", "min_ngram"},
        description="prompt lookup: what followed the latest earlier match of the last n-gram",
    ),
    MethodSpec(
        "suffix",
        _B + "build_suffix",
        {"use_corpus", "corpus", "max_depth", "max_spec_factor", "min_token_prob", "count_depth", "scored"},
        description="suffix decoding over prompt + output and a corpus of earlier outputs",
    ),
    MethodSpec(
        "xtok",
        _B + "build_xtok",
        {"max_length", "draft_tokens", "max_draft_tokens", "dtype"},
        needs_draft=True,
        description="a draft model with another tokenizer; drafts cross over as text",
    ),
    MethodSpec(
        "lookahead",
        _B + "build_lookahead",
        {"window", "ngram", "max_per_key"},
        tree_only=True,
        description="Jacobi iterations on a side branch feed an n-gram pool (trees)",
    ),
    MethodSpec(
        "early-exit",
        _B + "build_early_exit",
        _DRAFT_MODEL | {"layers"},
        needs_model=True,
        description="self-speculation: the target's first layers draft",
    ),
    MethodSpec(
        "eagle",
        _B + "build_eagle",
        _HEAD,
        trained=True,
        confidence=True,
        description="a trained EAGLE head on the target's last-layer features",
    ),
    MethodSpec(
        "medusa",
        _B + "build_medusa",
        _HEAD,
        trained=True,
        confidence=True,
        description="trained Medusa heads on the target's last hidden state",
    ),
    MethodSpec(
        "hybrid",
        _B + "build_hybrid",
        {"min_match", "max_ngram", "lookup", "drafter"} | _TRAINED_OPTIONS,
        composed=True,
        confidence=True,
        uses_draft=True,
        description="a lookup (suffix decoding) where the context repeats, else a trained drafter or the given draft model",
    ),
):
    register_method(_spec)
del _spec

METHODS = _Names(lambda spec: True)
TRAINED = _Names(
    lambda spec: spec.trained, first=("eagle", "medusa", "draft")
)  # methods that can ship a trained drafter per target
COMPOSED = _Names(lambda spec: spec.composed)  # built from a trained drafter; their cards hold only measurements
TREE_ONLY = _Names(lambda spec: spec.tree_only)  # drafts come from a side branch of the tree forward
CONFIDENCE_METHODS = _Names(lambda spec: spec.confidence)  # chains that can stop at a token they are unsure of
FALLBACK = "ngram"  # what "auto" runs without a shipped drafter that pays: best untrained on Spec-Bench
# what a shipped card can record and ``auto`` can pick from (plain decoding, auto itself and the
# fallback, whose speedup every card carries as ``ngram_speedup``, get no card)
MEASURED = _Names(lambda spec: spec.name not in ("none", "auto", FALLBACK))
