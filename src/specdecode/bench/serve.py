"""``specdecode bench-serve``: serving throughput and latency of the batched engine under load.

A sweep of load points x methods x temperatures over a fixed, seeded sample of Spec-Bench prompts.
A load point is either **closed loop** (``--concurrency``: that many requests in flight, a new one
submitted as soon as one finishes) or **Poisson arrivals** (``--arrival-rate``: exponential
inter-arrival times from a seeded RNG; before each step every request whose arrival time has
passed is submitted). Each cell reports request and output-token throughput, TTFT / TPOT /
inter-token latency percentiles, acceptance, the k the policy chose by batch size and peak RSS,
with ratios against plain decoding at the same load point, measured in the same run.

The load generator (:func:`closed_loop`, :func:`open_loop`) only talks to a :class:`ServeTarget`:
here :class:`EngineTarget`, an in-process :class:`~specdecode.engine.Engine`; an HTTP client
target (``--url``) can implement the same five calls without touching the load generator or
the report.

Methods (``--methods``, comma list):

- ``none``: plain decoding (always measured: every ratio is against it);
- a method name (``ngram``, ``suffix``, ``eagle``, ``medusa``, ``draft``, ``hybrid``,
  ``lookahead``, ``early-exit``) at fixed ``--k``; ``NAME-kN`` at fixed k = N;
- ``best``: the best shipped method (:func:`specdecode.api.best_method`) with the settings its
  card was measured with (what ``method="auto"`` runs); ``best-kN``: the same drafter at fixed N;
- ``auto``: the best method with policy auto, k in 0..``--k-max`` planned by the engine for the
  whole batch; ``auto-NAME`` over another method;
- ``table``: the best method with k looked up by batch size (``--k-table``, like vLLM's
  ``num_speculative_tokens_per_batch_size``); ``table-NAME`` over another method.

Any entry but ``none`` may end in the proposer's own options, ``:name=value`` each (checked
against the method's options), e.g. ``auto-suffix:scored=false`` beside ``auto-suffix``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import random
import re
import sys
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from specdecode.bench.workload import WorkItem, default_workload_path, load_workload
from specdecode.core.dtypes import DTYPE_CHOICES, DTYPE_HELP
from specdecode.core.sampling import check_top_p, is_greedy
from specdecode.engine.policy import BatchTableK
from specdecode.engine.scheduler import EngineConfig
from specdecode.errors import ConfigError, InputError
from specdecode.methods import METHODS, method_spec, parse_option

SPEC_METHODS = tuple(m for m in METHODS if m not in ("auto", "none", "xtok"))  # xtok needs a second tokenizer
ARM_KINDS = ("auto", "table")
DEFAULT_K_TABLE = "2:4,8:2,0"  # k 4 for batch <= 2, 2 for batch <= 8, 0 above
WARM_TEXT = "Hello! Please write one short sentence about the weather today."
QUICK = {
    "concurrency": "1,4",
    "requests": 4,
    "max_new_tokens": 32,
    "methods": "none,ngram,auto",
    "temperatures": "0",
    "threads": 1,
}
DEFAULTS = {
    "concurrency": "1,2,4,8,16,32",
    "requests": None,
    "max_new_tokens": 64,
    "methods": "none,ngram,suffix,best,best-k2,auto,table",
    "temperatures": "0,0.7",
    "threads": None,
}
MIN_REQUESTS = 8  # per cell, unless --requests says otherwise
POISSON_REQUESTS = 16  # per Poisson cell by default


METHODS_HELP = f"""methods (--methods, comma list):
  none            plain decoding (always measured: every ratio is against it)
  METHOD[-kN]     {", ".join(SPEC_METHODS)} at fixed --k (or N)
  best[-kN]       the best shipped method with the settings its card was measured with (or fixed N)
  auto[-METHOD]   the best method (or METHOD) with policy auto: k in 0..--k-max planned by the engine per batch
  table[-METHOD]  the best method (or METHOD) with k by batch size from --k-table
  ...:NAME=VALUE  any of these but none with a proposer option, e.g. auto-suffix:scored=false
"""


class _Parser(argparse.ArgumentParser):
    """Option errors are one ``error:`` line (exit 2) like every other user error, not a usage dump."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="specdecode bench-serve",
        description="Serving benchmark of the batched engine: load points x methods x temperatures.",
        epilog=METHODS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="bench-out/serve", help="output folder (default bench-out/serve)")
    p.add_argument(
        "--quick", action="store_true", help="concurrency 1,4; 4 requests; 32 tokens; none,ngram,auto; T=0; 1 thread"
    )
    p.add_argument("--workload", default=None, help=f"JSONL file (default: {default_workload_path()})")
    p.add_argument("--target", default=None, help="target model (default: embedded SmolLM2-135M)")
    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help=DTYPE_HELP,
    )
    p.add_argument("--backend", choices=["auto", "native", "transformers"], default="auto")
    p.add_argument(
        "--draft",
        default=None,
        help="a draft model (catalog name or path) for the draft method and the hybrid's second source",
    )
    p.add_argument("--threads", default=None, help="torch CPU threads (default: free cores; 1 with --quick)")
    p.add_argument(
        "--concurrency",
        default=None,
        help=f"closed-loop levels, comma list (default {DEFAULTS['concurrency']}; none with only --arrival-rate)",
    )
    p.add_argument("--arrival-rate", default=None, help="Poisson mode: requests/s, comma list")
    p.add_argument(
        "--requests",
        default=None,
        help=f"requests per cell (default max({MIN_REQUESTS}, 2 x concurrency); {POISSON_REQUESTS} per Poisson cell)",
    )
    p.add_argument("--max-new-tokens", default=None, help=f"default {DEFAULTS['max_new_tokens']}")
    p.add_argument(
        "--max-prompt-tokens", default=None, help="left-truncate prompts to this (default: what the model fits)"
    )
    p.add_argument("--methods", default=None, help=f"comma list (default {DEFAULTS['methods']}); see below")
    p.add_argument("--k", default="4", help="fixed k of named methods (default 4)")
    p.add_argument("--k-max", default="8", help="k_max of the auto policy (default 8)")
    p.add_argument(
        "--k-table",
        default=DEFAULT_K_TABLE,
        help=f"table policy: B:K pairs (k K for batch <= B), then k above the last B (default {DEFAULT_K_TABLE})",
    )
    p.add_argument("--temperatures", default=None, help=f"comma list; 0 = greedy (default {DEFAULTS['temperatures']})")
    p.add_argument(
        "--top-p",
        default="1",
        help="nucleus filtering of sampled cells, as clients send it (default 1: off; greedy cells ignore it)",
    )
    p.add_argument("--max-batch", default=None, help="engine max batch (default max(32, top concurrency))")
    p.add_argument("--seed", default="0", help="prompt sample, arrivals and sampling seed (default 0)")
    p.add_argument(
        "--prefix-cache-mb",
        default=str(EngineConfig.prefix_cache_mb),
        help="in-process engine: memory for prompt prefixes reused across a cell's requests (a shared system "
        f"prompt); 0: every prompt prefilled in full (default {EngineConfig.prefix_cache_mb})",
    )
    p.add_argument(
        "--url",
        default=None,
        help="drive a running server (specdecode serve, or any OpenAI-compatible one) over HTTP instead of "
        "the in-process engine; --target must name the same model (prompts are tokenized here)",
    )
    p.add_argument("--api-key", default=None, help="with --url: the server's API key")
    p.add_argument(
        "--repeats",
        default="1",
        help="run every cell this many times, interleaved (the order rotates each time): throughput pooled "
        "over the runs, latencies from the median run, the spread kept (default 1)",
    )
    p.add_argument("--slo-ttft-ms", default="2000", help="goodput: a request meets the SLO within this TTFT")
    p.add_argument("--slo-tpot-ms", default="200", help="goodput: ... and this TPOT (default 200 ms)")
    return p


@dataclass(frozen=True)
class LoadPoint:
    """Closed loop at ``concurrency`` in flight, or Poisson arrivals at ``rate`` requests/s."""

    mode: str  # "closed" | "poisson"
    value: float  # concurrency (an int) or rate

    @property
    def concurrency(self) -> int | None:
        return int(self.value) if self.mode == "closed" else None

    @property
    def label(self) -> str:
        return f"c={int(self.value)}" if self.mode == "closed" else f"rate={self.value:g}/s"

    def to_dict(self) -> dict[str, Any]:
        key = "concurrency" if self.mode == "closed" else "rate"
        return {"mode": self.mode, key: int(self.value) if self.mode == "closed" else self.value, "label": self.label}


@dataclass(frozen=True)
class ArmSpec:
    """A ``--methods`` entry as written, checked before the model loads."""

    name: str
    base: str  # "none", "best" or a method name
    kind: str  # "fixed" | "auto" | "table"
    k: int | None = None  # an explicit fixed k (NAME-kN)
    options: tuple[tuple[str, Any], ...] = ()  # proposer options written after the name (:name=value)


@dataclass
class Options:
    out: Path
    quick: bool
    workload: str | None
    target: str | None
    dtype: str
    backend: str
    threads: int | None
    points: list[LoadPoint]
    requests: int | None
    max_new_tokens: int
    max_prompt_tokens: int | None
    arms: list[ArmSpec]
    k: int
    k_max: int
    k_table: tuple[tuple[tuple[int, int], ...], int]
    temperatures: list[float]
    max_batch: int
    seed: int
    url: str | None = None
    api_key: str | None = None
    draft: str | None = None  # a draft model for draft / hybrid arms, loaded once beside the target
    slo_ms: tuple[float, float] = (2000.0, 200.0)  # (TTFT, TPOT) a request must meet to count as goodput
    repeats: int = 1  # runs of every cell, interleaved; throughput pooled, latencies of the median run
    prefix_cache_mb: int = EngineConfig.prefix_cache_mb  # the engine's prefix store (0: off)
    top_p: float = 1.0  # nucleus filtering of sampled cells (1: off)

    def requests_for(self, point: LoadPoint) -> int:
        if self.requests is not None:
            return self.requests
        if point.mode == "poisson":
            return POISSON_REQUESTS
        return max(MIN_REQUESTS, 2 * int(point.value))


def _top_p(text: str) -> float:
    return check_top_p(_float(text, "--top-p", positive=True), "--top-p")


def _split(text: str, what: str) -> list[str]:
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        raise ConfigError(f"{what}: empty list")
    return list(dict.fromkeys(parts))


def _int(text: Any, what: str, low: int = 1) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise ConfigError(f"{what}: expected an integer, got {text!r}") from None
    if value < low:
        raise ConfigError(f"{what}: must be >= {low}, got {value}")
    return value


def _float(text: str, what: str, positive: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{what}: expected a number, got {text!r}") from None
    if not math.isfinite(value) or (value <= 0 if positive else value < 0):
        raise ConfigError(f"{what}: must be {'> 0' if positive else '>= 0'}, got {text}")
    return value


def parse_arm(name: str) -> ArmSpec:
    """``none``, ``METHOD[-kN]``, ``best[-kN]``, ``auto[-METHOD]``, ``table[-METHOD]``, each but
    ``none`` optionally followed by proposer options ``:name=value``."""
    name = name.strip().lower()
    head, *written = name.split(":")
    spec = _parse_arm_head(head, name)
    if not written:
        return spec
    if spec.base == "none":
        raise ConfigError(f"--methods: {name!r}: plain decoding takes no proposer options")
    options = tuple(parse_option(text, f"--methods: {name!r}") for text in written)
    if spec.base != "best":
        method_spec(spec.base).check_options([key for key, _ in options])
    return ArmSpec(name, spec.base, spec.kind, spec.k, options)


def _parse_arm_head(name: str, written: str) -> ArmSpec:
    known = ("none", *SPEC_METHODS, "best", "best-kN", "METHOD-kN", "auto", "auto-METHOD", "table", "table-METHOD")
    if name == "none":
        return ArmSpec(name, "none", "fixed")
    for kind in ARM_KINDS:
        if name == kind or name.startswith(kind + "-"):
            base = name[len(kind) + 1 :] or "best"
            if base not in SPEC_METHODS and base != "best":
                raise ConfigError(
                    f"--methods: {written!r}: {kind} runs over a speculative method or best, not {base!r}"
                )
            return ArmSpec(name, base, kind)
    m = re.fullmatch(r"(.+?)(?:-k(\d+))?", name)
    base, k = (m.group(1), m.group(2)) if m else (name, None)
    if base == "xtok":
        raise ConfigError("--methods: xtok needs a draft model with its own tokenizer; bench-serve does not load one")
    if base not in SPEC_METHODS and base != "best":
        raise ConfigError(f"--methods: unknown method {written!r}; choose from {', '.join(known)}")
    return ArmSpec(name, base, "fixed", _int(k, f"--methods {written}: k") if k is not None else None)


def parse_k_table(text: str) -> tuple[tuple[tuple[int, int], ...], int]:
    """``"2:4,8:2,0"`` -> (((2, 4), (8, 2)), 0): k 4 for batch <= 2, 2 for batch <= 8, 0 above."""
    pairs: list[tuple[int, int]] = []
    above = 0
    parts = _split(text, "--k-table")
    for i, part in enumerate(parts):
        if ":" not in part:
            if i != len(parts) - 1:
                raise ConfigError(f"--k-table: a bare k ({part!r}) is only allowed last (k above the last batch size)")
            above = _int(part, "--k-table: k", low=0)
            continue
        b, k = part.split(":", 1)
        pairs.append((_int(b, "--k-table: batch size"), _int(k, "--k-table: k", low=0)))
    bounds = [b for b, _ in pairs]
    if bounds != sorted(set(bounds)):
        raise ConfigError(f"--k-table: batch sizes must increase, got {', '.join(map(str, bounds))}")
    if max([k for _, k in pairs] + [above]) < 1:
        raise ConfigError("--k-table: every k is 0; use method none for plain decoding")
    return tuple(pairs), above


def parse_options(argv: list[str]) -> Options:
    args = build_parser().parse_args(argv)
    preset = QUICK if args.quick else DEFAULTS
    points: list[LoadPoint] = []
    if args.concurrency is not None or args.arrival_rate is None:
        levels = [_int(c, "--concurrency") for c in _split(args.concurrency or preset["concurrency"], "--concurrency")]
        points += [LoadPoint("closed", c) for c in sorted(set(levels))]
    if args.arrival_rate is not None:
        rates = [_float(r, "--arrival-rate", positive=True) for r in _split(args.arrival_rate, "--arrival-rate")]
        points += [LoadPoint("poisson", r) for r in sorted(set(rates))]
    requests = args.requests if args.requests is not None else preset["requests"]
    arms = [parse_arm(a) for a in _split(args.methods or preset["methods"], "--methods")]
    if not any(a.base == "none" for a in arms):
        arms.insert(0, parse_arm("none"))  # every ratio is against plain decoding in the same run
    seen: dict[str, ArmSpec] = {}
    for a in arms:
        seen.setdefault(a.name, a)
    top = max([int(p.value) for p in points if p.mode == "closed"] + [32])
    threads = args.threads if args.threads is not None else preset["threads"]
    max_prompt = args.max_prompt_tokens
    return Options(
        out=Path(args.out),
        quick=args.quick,
        workload=args.workload,
        target=args.target,
        dtype=args.dtype,
        backend=args.backend,
        threads=None if threads is None else _int(threads, "--threads"),
        points=points,
        requests=None if requests is None else _int(requests, "--requests"),
        max_new_tokens=_int(
            args.max_new_tokens if args.max_new_tokens is not None else preset["max_new_tokens"], "--max-new-tokens"
        ),
        max_prompt_tokens=None if max_prompt is None else _int(max_prompt, "--max-prompt-tokens"),
        arms=list(seen.values()),
        k=_int(args.k, "--k"),
        k_max=_int(args.k_max, "--k-max"),
        k_table=parse_k_table(args.k_table),
        temperatures=list(
            dict.fromkeys(
                _float(t, "--temperatures", positive=False)
                for t in _split(args.temperatures or preset["temperatures"], "--temperatures")
            )
        ),
        max_batch=_int(args.max_batch, "--max-batch") if args.max_batch is not None else top,
        seed=_int(args.seed, "--seed", low=0),
        repeats=_int(args.repeats, "--repeats"),
        top_p=_top_p(args.top_p),
        prefix_cache_mb=_int(args.prefix_cache_mb, "--prefix-cache-mb", low=0),
        url=args.url,
        api_key=args.api_key,
        draft=args.draft,
        slo_ms=(
            _float(args.slo_ttft_ms, "--slo-ttft-ms", positive=True),
            _float(args.slo_tpot_ms, "--slo-tpot-ms", positive=True),
        ),
    )


# -- arms: what one cell runs -------------------------------------------------------------------
@dataclass
class Arm:
    """A ``--methods`` entry resolved against the target: proposer method, its options and policy."""

    name: str
    method: str  # the proposer's method ("none" for plain)
    kind: str  # "fixed" | "auto" | "table"
    policy: str  # "none", "fixed", "confidence", "heuristic", "auto", "table"
    k: int  # fixed k, or the policy's k_max
    options: dict[str, Any] = field(default_factory=dict)
    table: tuple[tuple[tuple[int, int], ...], int] | None = None
    tree: bool = False
    from_best: bool = False
    sampled: Arm | None = None  # a ``best`` arm's choice for T > 0 cells, where the cards pick another

    def at(self, temperature: float) -> Arm:
        """The arm a cell at ``temperature`` runs (a sampled cell of ``best``/``auto`` runs what the
        cards measured best on sampled requests, as a server's ``auto`` does)."""
        return self if self.sampled is None or is_greedy(temperature) else self.sampled

    @property
    def variants(self) -> tuple[Arm, ...]:
        """This arm and, where it has one, the one its sampled cells run."""
        return (self,) if self.sampled is None else (self, self.sampled)

    @property
    def fixed_k(self) -> bool:
        """Always the same k (a "fixed k" cell, what batch-planned auto is compared against)."""
        return self.method != "none" and self.policy in ("fixed", "confidence")

    @property
    def label(self) -> str:
        own = self._label()
        return own if self.sampled is None else f"{own}; at T > 0: {self.sampled.label}"

    def _label(self) -> str:
        if self.method == "none":
            return "plain"
        if self.kind == "auto":
            return f"{self.name} ({self.method}, k<={self.k} planned by the engine{self._extras()})"
        if self.kind == "table":
            assert self.table is not None
            return f"{self.name} ({self.method}, k by batch size {BatchTableK(*self.table).describe()}{self._extras()})"
        text = f"{self.method} k={self.k}" + ("" if self.policy in ("fixed", "confidence") else f" {self.policy}")
        return text + self._extras() if self.name == self.method else f"{self.name} ({text}{self._extras()})"

    def _extras(self) -> str:
        opts = self.options
        return "".join(
            [
                f", confidence {opts['confidence_threshold']:g}" if "confidence_threshold" in opts else "",
                f", drafter {opts['drafter']}" if "drafter" in opts else "",
                ", tree" if self.tree else "",
            ]
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "label": self.label,
            "method": self.method,
            "kind": self.kind,
            "policy": self.policy,
            "k": self.k,
            "options": dict(self.options),
            "fixed_k": self.fixed_k,
            "from_best": self.from_best,
            "k_table": None if self.table is None else BatchTableK(*self.table).describe(),
            "sampled": None if self.sampled is None else self.sampled.to_dict(),
        }

    def speculation(self, target: Any, draft: Any = None) -> Any:
        """A fresh proposer prototype and policy for one cell (a proposer's corpus never leaks across
        cells); ``draft``: the loaded draft model of ``--draft``, shared by every cell."""
        from specdecode.api import make_proposer
        from specdecode.engine import Speculation, TreeConfig
        from specdecode.engine.policy import FixedK, make_policy

        if self.method == "none":
            return Speculation()
        proposer = make_proposer(self.method, target, draft, **self.options)
        if self.kind == "table":
            assert self.table is not None
            policy: Any = BatchTableK(*self.table)
        elif self.policy in ("fixed", "confidence"):
            policy = FixedK(self.k, self.policy)
        else:
            policy = make_policy(self.policy, self.k)
        return Speculation(proposer, k=policy.k_max, policy=policy, tree=TreeConfig() if self.tree else None)


def resolve_arm(spec: ArmSpec, target: Any, opts: Options, sampled: bool = False) -> Arm:
    """The arm for ``spec`` on ``target``: ``best`` is :func:`best_method` with its card's settings
    (``sampled``: the cards' choice for sampled requests, an arm's :attr:`Arm.sampled`)."""
    from specdecode.api import MeasuredRun, benchmarked_settings, best_method, measured_run
    from specdecode.methods import TREE_ONLY

    if spec.base == "none":
        return Arm(spec.name, "none", "fixed", "none", 0)
    from_best = spec.base == "best"
    method = best_method(target, sampled=sampled) if from_best else spec.base
    run = (
        measured_run(benchmarked_settings(target, method, sampled), opts.k)
        if from_best
        else MeasuredRun(opts.k, None, {})
    )
    options = dict(run.options)
    if spec.options:  # written after the name; checked here too for best, now that it has a method
        method_spec(method).check_options([key for key, _ in spec.options])
        options.update(spec.options)
    tree = method in TREE_ONLY
    if spec.kind == "auto" or (from_best and spec.k is None and run.planned):
        # a card measured with k planned by the engine: ``best`` runs what was measured
        return Arm(spec.name, method, "auto", "auto", opts.k_max, options, tree=tree, from_best=from_best)
    if spec.kind == "table":
        return Arm(
            spec.name,
            method,
            "table",
            "table",
            max([k for _, k in opts.k_table[0]] + [opts.k_table[1]]),
            options,
            table=opts.k_table,
            tree=tree,
            from_best=from_best,
        )
    if spec.k is not None:
        k, policy = spec.k, "confidence" if "confidence_threshold" in options else "fixed"
    else:
        k, policy = int(run.k), run.policy or "fixed"
    return Arm(spec.name, method, "fixed", policy, k, options, tree=tree, from_best=from_best)


# -- the load generator and the target it drives --------------------------------------------------
@dataclass(frozen=True)
class LoadRequest:
    index: int
    prompt_ids: list[int]
    max_new_tokens: int
    seed: int


@dataclass(frozen=True)
class Progress:
    """What one request did in one ``advance``: new tokens, and its end (stats from the target)."""

    index: int
    tokens: int
    finished: bool = False
    stats: dict[str, Any] | None = None
    finish_reason: str | None = None


@dataclass
class Trace:
    """One request's timeline on the target's clock: arrival, each chunk of tokens, the end."""

    index: int
    prompt_tokens: int
    arrival: float  # when the request arrived (Poisson: its scheduled time, even if submitted later)
    submitted: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) per arriving event
    finished: float | None = None
    stats: dict[str, Any] | None = None
    finish_reason: str | None = None

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def ttft(self) -> float | None:
        return self.chunks[0][0] - self.arrival if self.chunks else None

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first (vLLM's TPOT)."""
        n = self.tokens
        return (self.chunks[-1][0] - self.chunks[0][0]) / (n - 1) if n > 1 else None

    @property
    def itl(self) -> list[float]:
        """Gaps between consecutive arriving chunks (a speculative chunk holds several tokens)."""
        return [b[0] - a[0] for a, b in zip(self.chunks, self.chunks[1:])]

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    def to_dict(self, t0: float) -> dict[str, Any]:
        s = self.stats or {}
        return {
            "index": self.index,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.tokens,
            "arrival_s": round(self.arrival - t0, 6),
            "submitted_s": round(self.submitted - t0, 6),
            "finished_s": None if self.finished is None else round(self.finished - t0, 6),
            "ttft_s": self.ttft,
            "tpot_s": self.tpot,
            "e2e_s": self.e2e,
            "chunks": len(self.chunks),
            "finish_reason": self.finish_reason,
            **{
                k: s.get(k)
                for k in (
                    "acceptance_rate",
                    "mean_accepted_length",
                    "target_calls",
                    "drafted_tokens",
                    "accepted_tokens",
                    "queue_s",
                    "k_history",
                    "sources",
                )
            },
        }


@dataclass
class LoadRun:
    traces: list[Trace]
    t0: float
    t_end: float
    in_flight: list[int]  # requests in flight before each advance


class ServeTarget(Protocol):
    """What the load generator drives: the in-process engine here, an HTTP server (``--url``) later.

    ``advance`` blocks until at least one step's worth of events arrived (the engine: one step)
    and returns them; ``now`` is the clock every timestamp is taken on; ``skip_to`` lets the
    clock reach ``t`` while nothing is in flight (the engine skips the idle gap, a client sleeps).
    """

    def start_cell(self, arm: Arm, temperature: float, warmup: int) -> None: ...

    def submit(self, request: LoadRequest) -> None: ...

    def advance(self) -> list[Progress]: ...

    def now(self) -> float: ...

    def skip_to(self, t: float) -> None: ...

    def end_cell(self) -> dict[str, Any]: ...


def _absorb(progress: list[Progress], traces: dict[int, Trace], in_flight: set[int], now: float) -> None:
    for p in progress:
        trace = traces[p.index]
        if p.tokens:
            trace.chunks.append((now, p.tokens))
        if p.finished:
            trace.finished, trace.stats, trace.finish_reason = now, p.stats, p.finish_reason
            in_flight.discard(p.index)


def closed_loop(target: ServeTarget, requests: Sequence[LoadRequest], concurrency: int) -> LoadRun:
    """Exactly ``concurrency`` requests in flight (fewer only once the rest are all submitted):
    each one that finishes is replaced before the next step."""
    pending = deque(requests)
    traces: dict[int, Trace] = {}
    in_flight: set[int] = set()
    log: list[int] = []

    def fill(now: float) -> None:
        while pending and len(in_flight) < concurrency:
            req = pending.popleft()
            target.submit(req)
            traces[req.index] = Trace(req.index, len(req.prompt_ids), now, now)
            in_flight.add(req.index)

    t0 = target.now()
    fill(t0)
    while in_flight:
        log.append(len(in_flight))
        progress = target.advance()
        now = target.now()  # one timestamp for everything this step delivered
        _absorb(progress, traces, in_flight, now)
        fill(now)
    return LoadRun([traces[r.index] for r in requests], t0, target.now(), log)


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """``n`` arrival times (seconds from the start, the first at 0), exponential gaps of mean 1/rate."""
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def open_loop(target: ServeTarget, requests: Sequence[LoadRequest], arrivals: Sequence[float]) -> LoadRun:
    """Requests arrive at ``arrivals`` (seconds from the start) whatever is in flight; before each
    step every request whose arrival has passed is submitted. Latencies count from the scheduled
    arrival, so time spent waiting for the step in progress counts too."""
    traces: dict[int, Trace] = {}
    in_flight: set[int] = set()
    log: list[int] = []
    t0 = target.now()
    i = 0
    while i < len(requests) or in_flight:
        now = target.now()
        if not in_flight and t0 + arrivals[i] > now:
            target.skip_to(t0 + arrivals[i])  # idle until the next arrival
            now = target.now()
        while i < len(requests) and t0 + arrivals[i] <= now:
            req = requests[i]
            target.submit(req)
            traces[req.index] = Trace(req.index, len(req.prompt_ids), t0 + arrivals[i], now)
            in_flight.add(req.index)
            i += 1
        log.append(len(in_flight))
        _absorb(target.advance(), traces, in_flight, target.now())
    return LoadRun([traces[r.index] for r in requests], t0, target.now(), log)


class EngineTarget:
    """The in-process engine as a serving target: a fresh engine (and proposer) per cell."""

    def __init__(
        self, loaded: Any, max_batch: int, draft: Any = None, prefix_cache_mb: int = 0, top_p: float = 1.0
    ) -> None:
        self.loaded, self.max_batch, self.draft = loaded, max_batch, draft
        self.prefix_cache_mb, self.top_p = prefix_cache_mb, top_p
        self.engine: Any = None
        self.skew = 0.0  # idle time skipped (Poisson mode) instead of slept

    def now(self) -> float:
        return time.perf_counter() + self.skew

    def skip_to(self, t: float) -> None:
        self.skew += max(0.0, t - self.now())

    def start_cell(self, arm: Arm, temperature: float, warmup: int) -> None:
        """A new engine for the cell, warmed by ``warmup`` short requests at once (untimed): first-call
        costs stay out of the timings and the planner has measured forwards at that batch size."""
        from specdecode.core.sampling import SamplingConfig
        from specdecode.engine import Engine, EngineConfig, GenerationConfig

        loaded = self.loaded
        self.engine = Engine(
            loaded.model,
            eos_token_ids=loaded.eos_token_ids,
            tokenizer=loaded.tokenizer,
            config=EngineConfig(max_batch=self.max_batch, prefix_cache_mb=self.prefix_cache_mb),
        )
        self.spec = arm.speculation(loaded, self.draft)
        self.sampling = SamplingConfig(temperature=temperature, top_p=self.top_p)
        self.by_id: dict[int, int] = {}
        warm = encode_prompt(loaded.tokenizer, WARM_TEXT)[:16] or [0, 0]
        for i in range(warmup):
            self.engine.submit(warm, GenerationConfig(max_new_tokens=4, sampling=self.sampling, seed=i), self.spec)
        self.engine.run()
        self.engine.steps.clear()  # k by batch size: the timed requests' steps only
        self.peak_reserved = 0

    def submit(self, request: LoadRequest) -> None:
        from specdecode.engine import GenerationConfig

        config = GenerationConfig(max_new_tokens=request.max_new_tokens, sampling=self.sampling, seed=request.seed)
        r = self.engine.submit(request.prompt_ids, config, self.spec)
        self.by_id[r.id] = request.index

    def advance(self) -> list[Progress]:
        engine = self.engine
        if not engine.busy:
            raise RuntimeError("advance() with nothing in flight")
        touched = engine.step()
        self.peak_reserved = max(self.peak_reserved, engine.reserved)
        out = []
        for r in touched:
            events, r.events = r.events, []
            tokens = sum(len(e.token_ids) for e in events)
            done = r.result is not None
            out.append(
                Progress(
                    self.by_id[r.id],
                    tokens,
                    done,
                    dict(r.result.stats) if done else None,
                    r.result.finish_reason if done else None,
                )
            )
        return out

    def end_cell(self) -> dict[str, Any]:
        engine = self.engine
        steps = engine.steps
        batches = Counter(s.batch for s in steps)
        info = {
            "k_by_batch_size": {str(b): k for b, k in engine.k_by_batch_size().items()},
            "batch_steps": {str(b): n for b, n in sorted(batches.items())},
            "steps": len(steps),
            "mean_batch": sum(s.batch for s in steps) / len(steps) if steps else 0.0,
            "mean_rows": sum(s.rows for s in steps) / len(steps) if steps else 0.0,
            "forward_s": sum(s.forward_s for s in steps),
            "peak_batch": max((s.batch for s in steps), default=0),
            "peak_kv_reserved": self.peak_reserved,
        }
        self.engine = None
        return info


# -- prompts ------------------------------------------------------------------------------------
def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text``, with the chat template when the tokenizer has one."""
    from specdecode.api import encode_prompt as encode

    return encode(tokenizer, text)


def sample_items(items: list[WorkItem], n: int, seed: int) -> list[WorkItem]:
    """``n`` prompts: each reporting category shuffled (seeded), then dealt round-robin, so every
    cell's first requests mix the categories; the sample repeats once the workload runs out."""
    rng = random.Random(seed)
    groups: dict[str, list[WorkItem]] = {}
    for item in items:
        groups.setdefault(item.group, []).append(item)
    for members in groups.values():
        rng.shuffle(members)
    dealt: list[WorkItem] = []
    for i in range(max(len(m) for m in groups.values())):
        dealt.extend(m[i] for m in groups.values() if i < len(m))
    return [dealt[i % len(dealt)] for i in range(n)]


def request_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index * 7_919 + 17) % (1 << 62)


# -- the run ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = parse_options(argv)
    items = load_workload(opts.workload)
    return run_serve(opts, items, argv)


def host_info() -> dict[str, Any]:
    """The machine: CPU model (from /proc/cpuinfo), cores, torch threads, load, versions."""
    from specdecode.bench.runner import machine_info

    info = machine_info()
    info["cores"] = info.get("cpu_count")
    info["cores_available"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else info["cores"]
    info["load_average"] = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    return info


def run_serve(opts: Options, items: list[WorkItem], argv: list[str]) -> int:
    import torch
    from rich.console import Console
    from tqdm import tqdm

    from specdecode.bench import serve_report
    from specdecode.metrics import peak_rss_mb
    from specdecode.models.loading import load_model
    from specdecode.runtime import set_threads

    started = time.perf_counter()
    console = Console(stderr=True)
    if opts.out.exists() and not opts.out.is_dir():
        raise InputError(f"--out is not a folder: {opts.out}")
    threads_before = torch.get_num_threads()
    try:
        set_threads(opts.threads)
        host = host_info()
        target = load_model(opts.target, dtype=opts.dtype, backend=opts.backend)
        draft = None
        if opts.draft is not None:
            if opts.url is not None:
                raise ConfigError("--draft loads a draft model in process; with --url the server brings its own")
            from specdecode.models.loading import load_draft

            draft = load_draft(opts.draft, target.dtype)
        arms, skipped = [], []
        for spec in opts.arms:
            try:
                arm = resolve_arm(spec, target, opts)
                if arm.from_best and not all(is_greedy(t) for t in opts.temperatures):
                    other = resolve_arm(spec, target, opts, sampled=True)
                    arm.sampled = None if other == arm else other
                for each in arm.variants:
                    each.speculation(target, draft).check(target.model)  # fails now, not mid-sweep
                if opts.url is not None:
                    from specdecode.bench.http_target import speculative_field

                    speculative_field(arm)  # what a request can ask for over HTTP
                arms.append(arm)
            except (ConfigError, TypeError, ValueError) as exc:
                skipped.append({"name": spec.name, "reason": str(exc)})
                console.print(f"[yellow]skipping {spec.name}: {exc}[/yellow]")
        max_k = max([a.k for arm in arms for a in arm.variants] + [1])
        limit = int(target.model.max_length) - opts.max_new_tokens - max_k - 2
        if opts.max_prompt_tokens is not None:
            limit = min(limit, opts.max_prompt_tokens)
        if limit < 2:
            raise ConfigError(
                f"--max-new-tokens {opts.max_new_tokens} leaves no room for a prompt in the model's "
                f"{target.model.max_length} positions"
            )
        n_max = max(opts.requests_for(p) for p in opts.points)
        sample = sample_items(items, n_max, opts.seed)
        prompts = []
        for i, item in enumerate(sample):
            ids = encode_prompt(target.tokenizer, item.prompt)
            prompts.append(
                {
                    "index": i,
                    "id": item.id,
                    "group": item.group,
                    "tokens": len(ids),
                    "truncated": len(ids) > limit,
                    "ids": ids[-limit:],
                }
            )
        requests = [
            LoadRequest(i, p["ids"], opts.max_new_tokens, request_seed(opts.seed, i)) for i, p in enumerate(prompts)
        ]
        engine_target = build_target(opts, target, draft)
        plan = [(t, point) for t in opts.temperatures for point in opts.points]
        console.print(
            f"bench-serve: {len(arms)} methods x {len(opts.points)} load points x {len(opts.temperatures)} "
            f"temperatures, up to {n_max} requests x {opts.max_new_tokens} tokens per cell -> {opts.out}"
        )
        runs: list[dict[str, Any]] = []
        with tqdm(
            total=len(plan) * len(arms) * opts.repeats,
            desc="bench-serve",
            unit="cell",
            file=sys.stderr,
            dynamic_ncols=True,
        ) as bar:
            turn = 0
            for temp, point in plan:
                n = opts.requests_for(point)
                for _ in range(opts.repeats):  # repeats interleave, so a slow spell hits every method
                    rotated = arms[turn % len(arms) :] + arms[: turn % len(arms)]  # no method always runs first
                    turn += 1
                    for arm in rotated:
                        bar.set_postfix_str(f"{arm.name} {point.label} T={temp:g}", refresh=False)
                        runs.append(run_cell(engine_target, arm, temp, point, requests[:n], opts))
                        runs[-1]["peak_rss_mb"] = round(peak_rss_mb(), 1)
                        bar.update(1)
        cells = serve_report.merge_repeats(runs)
        results = {
            "schema": 1,
            "bench": "serve",
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": ["specdecode", "bench-serve", *argv],
            "host": host,
            "config": {
                "workload": str(Path(opts.workload).resolve()) if opts.workload else str(default_workload_path()),
                "target": target.source,
                "dtype": target.dtype,  # as loaded (auto resolved)
                "draft": None if draft is None else {"source": draft.source, "dtype": draft.dtype},
                "backend": getattr(target.model, "backend", opts.backend),
                "load_points": [p.to_dict() for p in opts.points],
                "temperatures": opts.temperatures,
                "top_p": opts.top_p,
                "requests": {p.label: opts.requests_for(p) for p in opts.points},
                "max_new_tokens": opts.max_new_tokens,
                "max_prompt_tokens": limit,
                "k": opts.k,
                "k_max": opts.k_max,
                "k_table": BatchTableK(*opts.k_table).describe(),
                "max_batch": opts.max_batch,
                "prefix_cache_mb": opts.prefix_cache_mb,
                "seed": opts.seed,
                "repeats": opts.repeats,
                "over": "http" if opts.url else "engine",
                "url": opts.url,
                "slo_ms": {"ttft": opts.slo_ms[0], "tpot": opts.slo_ms[1]},
                "quick": opts.quick,
                "torch_threads": torch.get_num_threads(),
            },
            "arms": [a.to_dict() for a in arms],
            "skipped": skipped,
            "prompts": [{k: v for k, v in p.items() if k != "ids"} for p in prompts],
            "cells": cells,
        }
        results["host"]["load_average_end"] = (
            [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
        )
        serve_report.finish(results)
        results["elapsed_s"] = round(time.perf_counter() - started, 2)
        opts.out.mkdir(parents=True, exist_ok=True)
        serve_report.write_all(results, opts.out)
        serve_report.print_console(results, Console(file=sys.stdout, width=max(Console().width, 200)))
        print(serve_report.summary_json(results, opts.out), flush=True)
        return 0
    finally:
        torch.set_num_threads(threads_before)


def build_target(opts: Options, loaded: Any, draft: Any = None) -> ServeTarget:
    """What the load is driven against: the in-process engine, or a server over HTTP (``--url``;
    prompts are still tokenized here, with the target's tokenizer)."""
    if opts.url is not None:
        from specdecode.bench.http_target import HttpTarget

        return HttpTarget(opts.url, opts.api_key, top_p=opts.top_p)
    return EngineTarget(loaded, opts.max_batch, draft, opts.prefix_cache_mb, opts.top_p)


def run_cell(
    target: ServeTarget, arm: Arm, temperature: float, point: LoadPoint, requests: list[LoadRequest], opts: Options
) -> dict[str, Any]:
    """One cell: warm the target, drive the load, and summarise what every request saw."""
    from specdecode.bench.serve_report import cell_metrics

    warm = min(int(point.value), opts.max_batch) if point.mode == "closed" else min(4, opts.max_batch)
    arm = arm.at(temperature)
    target.start_cell(arm, temperature, warm)
    if point.mode == "closed":
        run = closed_loop(target, requests, int(point.value))
    else:
        arrivals = poisson_arrivals(len(requests), point.value, opts.seed * 7_919 + int(point.value * 1000))
        run = open_loop(target, requests, arrivals)
    info = target.end_cell()
    return cell_metrics(arm, temperature, point, run, info, opts.slo_ms)
