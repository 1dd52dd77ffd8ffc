"""The public Python API: load a target, build a generator, generate or stream."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from specdecode.core.sampling import SamplingConfig
from specdecode.engine import Decoder, EngineConfig, GenerationConfig, GenerationResult, Speculation, TreeConfig
from specdecode.engine.policy import make_policy
from specdecode.errors import ConfigError, InputError, ModelLoadError
from specdecode.methods import (  # noqa: F401
    COMPOSED,
    CONFIDENCE_METHODS,
    FALLBACK,
    MEASURED,
    METHODS,
    TRAINED,
    TREE_ONLY,
    method_spec,
)
from specdecode.models.loading import LoadedModel, load_model
from specdecode.proposers.base import Proposer


def shipped_drafters(target: LoadedModel, methods: tuple[str, ...] = TRAINED) -> dict[str, dict]:
    """Cards shipped for ``target``, by method (trained drafters by default; ``COMPOSED`` methods
    such as the hybrid ship a card of measurements only); empty for targets without any."""
    import json

    from specdecode.networks.storage import shipped_head_dir

    cards = {}
    for method in methods:
        card = shipped_head_dir(target.source, method) / "card.json"
        if card.exists():
            cards[method] = json.loads(card.read_text())
    return cards


def best_method(target: LoadedModel, draft_given: bool = False, sampled: bool = False) -> str:
    """What ``method="auto"`` runs: the method whose shipped card (a trained drafter's, or a card
    of measurements only, e.g. the hybrid's, or the draft model measured beside a Qwen target)
    records the best measured speedup, if it beat both plain decoding and n-gram lookup in that
    same run; else n-gram. A card measured with a named draft model counts only when that draft
    is installed (or ``draft_given``: the caller brings one). ``sampled``: for requests sampled at
    a temperature above 0, from the cards' ``sampled_benchmark`` blocks where any card has one
    (a draft kept with probability min(1, p/q) fares unlike one that must equal the argmax)."""
    return _auto_choice(target, draft_given, sampled)[0]


def _regime_blocks(target: LoadedModel, sampled: bool) -> dict[str, dict[str, Any]]:
    """Each shipped card's measurement for the regime: sampled requests read the cards'
    ``sampled_benchmark`` blocks where any card has one, else (and greedy ones always) their
    ``benchmark`` blocks; never a mix, whose speedups would not compare."""
    cards = shipped_drafters(target, MEASURED)
    key = "sampled_benchmark" if sampled and any("sampled_benchmark" in c for c in cards.values()) else "benchmark"
    return {method: card.get(key) or {} for method, card in cards.items()}


def _auto_choice(target: LoadedModel, draft_given: bool, sampled: bool = False) -> tuple[str, dict[str, Any]]:
    """:func:`best_method` and its card's settings (:func:`benchmarked_settings`), the cards read once."""
    best, best_speedup, settings = FALLBACK, 1.0, {}
    for method, bench in _regime_blocks(target, sampled).items():
        measured = bench.get("settings") or {}
        if not (draft_given or _draft_installed(measured.get("draft"))):
            continue
        speedup = float(bench.get("speedup", 0.0))
        if speedup > max(best_speedup, float(bench.get("ngram_speedup") or 1.0)):  # None: no n-gram cell ran
            best, best_speedup, settings = method, speedup, measured
    return best, _kept(settings)


def measured_draft(target: LoadedModel) -> tuple[str, str] | None:
    """The draft model (name, dtype) that what ``method="auto"`` picks was measured with, for
    greedy requests or else for sampled ones; None when neither needs one. Servers load it once
    beside the target."""
    for sampled in (False, True):
        if draft := _card_draft(_auto_choice(target, False, sampled)[1], target):
            return draft
    return None


def _card_draft(settings: dict[str, Any], target: LoadedModel) -> tuple[str, str] | None:
    """The (name, dtype) of the draft model a card's ``settings`` were measured with, if any."""
    if "draft" not in settings:
        return None
    return settings["draft"], settings["draft_dtype"] if "draft_dtype" in settings else target.dtype


def _draft_installed(name: str | None) -> bool:
    from specdecode.models import catalog

    if name is None:
        return True
    try:
        return catalog.resolve(name) is not None or os.path.exists(name)
    except ModelLoadError:  # a catalog model that has not been pulled
        return False


def best_drafter(target: LoadedModel) -> str:
    """The hybrid's default second source: the trained drafter its shipped card was measured with,
    else the shipped one whose card records the best speedup; ConfigError when there is none."""
    measured = benchmarked_settings(target, "hybrid").get("drafter")
    cards = shipped_drafters(target)
    if measured in cards:
        return measured
    if not cards:
        raise ConfigError(
            "method 'hybrid' needs a trained drafter; none is shipped for this target "
            "(train one with: specdecode train eagle --out DIR, then --drafter eagle --draft DIR)"
        )
    return max(cards, key=lambda m: float((cards[m].get("benchmark") or {}).get("speedup", 0.0)))


def benchmarked_settings(target: LoadedModel, method: str, sampled: bool = False) -> dict[str, Any]:
    """The settings (k, policy, confidence; the hybrid's drafter and lookup) a shipped card says
    its speedup was measured with (for ``sampled`` requests, as :func:`best_method` reads the
    cards), so that ``method="auto"`` runs what was measured; empty for anything else."""
    return _kept((_regime_blocks(target, sampled).get(method) or {}).get("settings") or {})


@dataclass(frozen=True)
class MeasuredRun:
    """How a card's settings run: ``k`` (an int, or "auto": planned by the engine), the k policy
    the card names (None: fixed k), and the proposer options it was measured with (the hybrid's
    drafter and lookup; the confidence stop's threshold)."""

    k: int | str
    policy: str | None
    options: dict[str, Any]

    @property
    def planned(self) -> bool:
        return self.k == "auto" or self.policy == "auto"


def measured_run(settings: dict[str, Any], default_k: int = 4) -> MeasuredRun:
    """What a card's ``settings`` (:func:`benchmarked_settings`) run with; ``default_k`` where it
    records no k. The one reading of a card's settings, for ``auto`` and for bench-serve's
    ``best`` arm alike."""
    options = {key: settings[key] for key in ("drafter", "lookup") if key in settings}
    policy = settings.get("policy")
    if policy == "confidence":
        options["confidence_threshold"] = settings.get("confidence", 0.5)
    return MeasuredRun(settings.get("k", default_k), policy, options)


def _kept(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings ``auto`` runs with, out of a card's."""
    keys = ("k", "policy", "confidence", "drafter", "lookup", "draft", "draft_dtype")
    return {key: settings[key] for key in keys if key in settings}


def make_proposer(
    method: str, target: LoadedModel, draft: LoadedModel | str | None = None, **options: Any
) -> Proposer | None:
    """The proposer for ``method``, built by its registered builder (:mod:`specdecode.methods`);
    ``draft`` is a loaded model or a path (methods draft, xtok; a trained folder for eagle,
    medusa). An option the method does not accept is a ConfigError naming the ones it does."""
    spec = method_spec(method)
    spec.check_options(options)
    return spec.load_builder()(target, draft, **options)


def encode_prompt(tokenizer: Any, prompt: str | list[int], chat: bool | None = None) -> list[int]:
    """Token ids for ``prompt``: ids pass through; text gets the chat template (one user turn)
    when ``chat`` is true, or is None and the tokenizer has a template."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise InputError("empty prompt")
        if chat is None:
            chat = bool(getattr(tokenizer, "chat_template", None))
        if chat:
            return encode_chat(tokenizer, [{"role": "user", "content": prompt}])
        return list(tokenizer.encode(prompt))
    ids = [int(t) for t in prompt]
    if not ids:
        raise InputError("empty prompt")
    return ids


def encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation under the model's chat template, ready for the assistant's turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise InputError("this model has no chat template; send a plain prompt (completions) instead")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(out["input_ids"])


def resolve_speculation(
    target: LoadedModel,
    method: str = "auto",
    k: int | str | None = None,
    draft: LoadedModel | str | os.PathLike | None = None,
    *,
    policy: str | None = None,
    k_max: int = 8,
    confidence: float | None = None,
    shadow: bool = False,
    tree: bool | None = None,
    max_nodes: int = 16,
    factory: Callable[[str, dict[str, Any]], Proposer | None] | None = None,
    sampled: bool = False,
    **proposer_options: Any,
) -> Speculation:
    """How a request speculates, from the user's words (see :class:`SpeculativeGenerator`);
    ``sampled``: the request samples at a temperature above 0 (what ``auto`` picks, see
    :func:`best_method`).

    ``factory(method, options)`` builds (or hands out an already built, shared) proposer
    prototype; by default a new one is built with :func:`make_proposer`.
    """
    chosen = method == "auto"
    method, measured = _auto_choice(target, draft is not None, sampled) if chosen else (method, {})
    if draft is None and (card_draft := _card_draft(measured, target)):  # what the card measured with
        draft, dtype = card_draft
        proposer_options.setdefault("dtype", dtype)
    run = measured_run(measured)
    k = run.k if k is None else k  # int, or "auto"
    policy = policy or run.policy
    if k == "auto":
        policy, k = "auto", k_max
    policy = policy or "fixed"
    for key, value in run.options.items():
        if key != "confidence_threshold" or policy == "confidence":
            proposer_options.setdefault(key, value)
    if policy == "confidence":
        if method not in CONFIDENCE_METHODS:
            raise ConfigError(
                f"policy 'confidence' needs a drafter with its own probabilities "
                f"(method {', '.join(CONFIDENCE_METHODS)}), not {method!r}"
            )
        if confidence is not None or "confidence_threshold" not in proposer_options:
            proposer_options["confidence_threshold"] = 0.5 if confidence is None else confidence
    if factory is not None:
        proposer = factory(method, proposer_options)
    else:
        proposer = make_proposer(method, target, draft, **proposer_options)
    if proposer is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
        raise ConfigError(f"k must be an integer >= 1 or 'auto', got {k!r}")
    use_tree = tree or (tree is None and method in TREE_ONLY)
    return Speculation(  # the engine checks it against the target on submission
        proposer,
        k,
        make_policy(policy, k) if proposer is not None else None,
        shadow,
        TreeConfig(max_nodes=max_nodes) if use_tree else None,
    )


def _same_run(a: Speculation, b: Speculation) -> bool:
    """Whether two resolved speculations run the same method the same way (one decoder serves both)."""

    def key(spec: Speculation) -> tuple[Any, ...]:
        return spec.method, spec.k_max, None if spec.policy is None else spec.policy.name, spec.tree

    return key(a) == key(b)


class SpeculativeGenerator:
    """Generate text from a target with a speculative method; outputs match the target's.

    >>> target = load_model()                                   # the embedded SmolLM2-135M
    >>> gen = SpeculativeGenerator(target, method="ngram", k=4)
    >>> out = gen.generate("Name three colours.", max_new_tokens=32)
    >>> out.text, out.token_ids, out.stats["mean_accepted_length"]
    """

    def __init__(
        self,
        target: LoadedModel | str | os.PathLike | None = None,
        *,
        method: str = "auto",
        k: int | str | None = None,
        draft: LoadedModel | str | os.PathLike | None = None,
        policy: str | None = None,
        k_max: int = 8,
        confidence: float | None = None,
        shadow: bool = False,
        tree: bool | None = None,
        max_nodes: int = 16,
        prefix_cache_mb: int = EngineConfig.prefix_cache_mb,
        **proposer_options: Any,
    ) -> None:
        """``method="auto"`` runs the best drafter shipped for the target (:func:`best_method`) with
        the settings its card's speedup was measured with, unless ``k``/``policy``/``confidence``
        are given. ``k`` (default 4) drafts per round; ``k="auto"`` (or ``policy="auto"``) lets the
        cost model pick k in 0..k_max each round; ``policy`` is one of fixed, heuristic (k is the
        upper bound), confidence (a draft model, EAGLE or Medusa chain stops before a token it
        gives less than ``confidence``, default 0.5) or auto. ``shadow=True`` decodes plainly and
        records the acceptance the method would have had. ``tree=True`` verifies several candidate
        branches per round in one masked forward (native backend); ``None`` uses trees only for
        methods that need them (lookahead). ``prefix_cache_mb`` bounds the stored prompt prefixes
        that later prompts starting the same way reuse instead of prefilling (0: off).
        """
        self.target = target if isinstance(target, LoadedModel) else load_model(target)
        self.prefix_cache_mb = prefix_cache_mb
        # ``auto`` may pick another method for sampled requests (:func:`best_method`): that one
        # is resolved, and its decoder built, when a sampled request first asks for it
        self._resolve = functools.partial(
            resolve_speculation,
            self.target,
            method,
            k,
            draft,
            policy=policy,
            k_max=k_max,
            confidence=confidence,
            shadow=shadow,
            tree=tree,
            max_nodes=max_nodes,
            **proposer_options,
        )
        self._auto = method == "auto"
        self.spec = self._resolve()
        self.decoder = self._decoder_for(self.spec)
        self.method, self.k = self.spec.method, self.spec.k_max
        self._decoders = {False: self.decoder}

    def _decoder_for(self, spec: Speculation) -> Decoder:
        return Decoder(
            self.target.model,
            spec.proposer,
            spec.k,
            policy=spec.policy,
            shadow=spec.shadow,
            tree=spec.tree,
            eos_token_ids=self.target.eos_token_ids,
            tokenizer=self.target.tokenizer,
            prefix_cache_mb=self.prefix_cache_mb,
        )

    def decoder_for(self, config: GenerationConfig) -> Decoder:
        """The decoder a request with ``config`` runs on: this generator's, or for a sampled
        request under ``auto``, the one of the method measured best on sampled requests."""
        sampled = self._auto and not config.sampling.greedy
        if sampled not in self._decoders:
            spec = self._resolve(sampled=True)
            self._decoders[sampled] = self.decoder if _same_run(spec, self.spec) else self._decoder_for(spec)
        return self._decoders[sampled]

    def encode(self, prompt: str | list[int], chat: bool | None = None) -> list[int]:
        """Token ids for ``prompt``; text gets the chat template when the model has one."""
        return encode_prompt(self.target.tokenizer, prompt, chat)

    def generate(self, prompt: str | list[int], **kwargs: Any) -> GenerationResult:
        """Generate a completion; keyword names follow transformers' ``generate``.

        Accepts ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
        ``min_p``, ``stop_strings``, ``seed`` and ``chat``. Greedy unless sampling is asked for.
        """
        ids, config = self._prepare(prompt, **kwargs)
        return self.decoder_for(config).generate(ids, config)

    def generate_many(
        self, prompts: list[str | list[int]], *, max_batch: int = 32, **kwargs: Any
    ) -> list[GenerationResult]:
        """Many prompts in one batched engine with this generator's settings (same arguments as
        :meth:`generate`); each result is exactly what :meth:`generate` gives that prompt alone."""
        prepared = [self._prepare(p, **kwargs) for p in prompts]
        decoder = self.decoder_for(prepared[0][1]) if prepared else self.decoder  # one sampling for all
        engine = decoder.engine(EngineConfig(max_batch=max_batch, prefix_cache_mb=self.prefix_cache_mb))
        return engine.generate([ids for ids, _ in prepared], [cfg for _, cfg in prepared], decoder.spec)

    def stream(self, prompt: str | list[int], **kwargs: Any) -> Iterator[str]:
        """Yield text pieces as tokens commit (same arguments as :meth:`generate`)."""
        ids, config = self._prepare(prompt, **kwargs)
        for event in self.decoder_for(config).run(ids, config):
            if event.text:
                yield event.text

    def _prepare(
        self,
        prompt: str | list[int],
        *,
        max_new_tokens: int = 128,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        stop_strings: tuple[str, ...] | list[str] | str = (),
        seed: int | None = None,
        chat: bool | None = None,
    ) -> tuple[list[int], GenerationConfig]:
        if do_sample is None:
            do_sample = bool(temperature)
        temp = 0.0 if not do_sample else (1.0 if temperature is None else float(temperature))
        if isinstance(stop_strings, str):
            stop_strings = (stop_strings,)
        sampling = SamplingConfig(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p)
        config = GenerationConfig(
            max_new_tokens=max_new_tokens, sampling=sampling, stop_strings=tuple(stop_strings), seed=seed
        )
        return self.encode(prompt, chat), config
