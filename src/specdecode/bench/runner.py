"""``specdecode bench``: a workload across methods x k x temperature, plain decoding and
transformers ``generate`` measured in the same run, interleaved per prompt, resumable.

Every finished (cell, prompt) pair is appended to ``DIR/cells.jsonl`` at once; a re-run with the
same DIR and settings skips those pairs. At the end ``DIR/results.json``, ``DIR/summary.md``, the
PNG plots and ``DIR/report.html`` are (re)written from every stored pair of this configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdecode.bench.llama_cpp import DEFAULT_K, find_binary
from specdecode.bench.report import cell_label, ours_speculative, reference_stats
from specdecode.bench.workload import HUMANEVAL, WorkItem, default_workload_path, groups_in_order, load_workload, select
from specdecode.core.dtypes import DRAFT_DTYPE_HELP, DTYPE_CHOICES, DTYPE_HELP, draft_default
from specdecode.core.sampling import check_top_p
from specdecode.engine.scheduler import EngineConfig
from specdecode.errors import ConfigError, InputError
from specdecode.methods import CONFIDENCE_METHODS, METHODS, method_spec, parse_option

TREE_SUFFIX = "+tree"  # e.g. "ngram+tree": the same method verifying candidate trees
CONF_SUFFIX = "+conf"  # e.g. "eagle+conf": chains stop before a token the drafter gives < --confidence
OPTION_SEP = ":"  # e.g. "draft:prompt_window=256": that cell's proposer built with this option
COST_CONTEXT = 200  # cache length for the forward-cost curve
AUTO_K_MAX = 8  # k_max the engine's auto policy uses by default
LLAMA_CELLS = ("llama.cpp", "llama.cpp-draft")  # its plain decoding, its own draft-model speculation

# --quick uses one torch thread: on a small shared machine, OpenMP threads that outnumber free
# cores make every forward many times slower and the timings meaningless.
QUICK = {
    "prompts_per_category": 1,
    "max_new_tokens": 32,
    "methods": "none,ngram",
    "k": "2,4,auto",
    "temperatures": "0",
    "threads": 1,
}
DEFAULTS = {
    "prompts_per_category": 10,
    "max_new_tokens": 128,
    "methods": "none,ngram",
    "k": "2,4,8,auto",
    "temperatures": "0",
    "threads": None,
}


@dataclass(frozen=True)
class Cell:
    """One configuration measured on every prompt: method "none" (plain), "hf" or a speculative one."""

    method: str
    k: int | str  # 0 for none / hf; an int >= 1 or "auto" otherwise
    temperature: float

    @property
    def key(self) -> str:
        return f"{self.method}|k={self.k}|T={self.temperature:g}"

    @property
    def speculative(self) -> bool:
        return ours_speculative(self.method)

    @property
    def llama(self) -> bool:
        """A llama.cpp reference cell (``--llama-server``)."""
        return self.method in LLAMA_CELLS

    def label(self, with_temperature: bool = False) -> str:
        return cell_label(self.to_dict(), with_temperature)

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "method": self.method, "k": self.k, "temperature": self.temperature}


# -- options -----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specdecode bench",
        description="Benchmark speculative decoding on a workload (Spec-Bench by default).",
    )
    p.add_argument("--workload", default=None, help=f"JSONL file or 'humaneval' (default: {default_workload_path()})")
    p.add_argument("--out", required=True, help="output folder (re-use it to resume)")
    p.add_argument(
        "--quick", action="store_true", help="1 prompt per category, 32 tokens, none+ngram, k 2,4,auto, 1 thread"
    )
    p.add_argument("--target", default=None, help="target model (default: embedded SmolLM2-135M)")
    p.add_argument("--draft", default=None, help="draft model for method 'draft'")
    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help=DTYPE_HELP,
    )
    p.add_argument("--draft-dtype", choices=DTYPE_CHOICES, default=None, help=DRAFT_DTYPE_HELP)
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="the --draft model's head cut to its N most common tokens plus each request's context's, for "
        "every draft cell (default 32768 for a draft over 65536 ids; or a cell's own vocab=N option instead)",
    )
    p.add_argument("--backend", choices=["auto", "native", "transformers"], default="auto")
    p.add_argument(
        "--methods",
        default=None,
        help=f"comma list of {', '.join(METHODS)}, each optionally +tree (or +conf) and :name=value proposer "
        f"options, e.g. draft:prompt_window=256 (default {DEFAULTS['methods']}, plus draft with --draft)",
    )
    p.add_argument("--k", default=None, help=f"comma list of draft lengths and/or auto (default {DEFAULTS['k']})")
    p.add_argument(
        "--confidence",
        type=float,
        default=0.5,
        help=f"threshold of the {CONF_SUFFIX} methods ({', '.join(CONFIDENCE_METHODS)}{CONF_SUFFIX})",
    )
    p.add_argument("--temperatures", default=None, help="comma list; 0 = greedy (default 0)")
    p.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus filtering of the sampled cells, every engine (default 1: off)"
    )
    p.add_argument("--max-new-tokens", type=int, default=None, help=f"default {DEFAULTS['max_new_tokens']}")
    p.add_argument(
        "--prompts-per-category", type=int, default=None, help=f"0 = all (default {DEFAULTS['prompts_per_category']})"
    )
    p.add_argument("--seed", type=int, default=0, help="prompt sample and sampling seed")
    p.add_argument("--no-hf", action="store_true", help="skip transformers generate")
    p.add_argument(
        "--turns",
        type=int,
        default=1,
        help="user turns of a conversation's prompts to run (Spec-Bench's MT-Bench questions have 2): turn n "
        "is the conversation so far, with plain greedy decoding's answers, so every cell sees the same ids "
        "(default 1)",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=EngineConfig.prefix_cache_mb,
        help="memory for prompt prefixes a cell reuses across its prompts (a shared system prompt), also "
        "llama.cpp's cache_prompt when on; 0: every prompt prefilled in full (default %(default)s)",
    )
    p.add_argument(
        "--llama-server",
        default=None,
        metavar="PATH",
        help="a llama-server binary (or its folder): adds llama.cpp's plain decoding and, with a GGUF --draft, its "
        "own draft-model speculation at the largest fixed --k, on the same GGUF files and prompt ids",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice; 1 with --quick)"
    )
    return p


@dataclass
class Options:
    workload: str | None
    out: Path
    quick: bool
    target: str | None
    draft: str | None
    dtype: str
    draft_dtype: str  # --draft-dtype, else --dtype
    draft_vocab: int | None  # --draft-vocab: the draft's head cut to its N most common tokens
    backend: str
    methods: list[str]
    ks: list[int | str]
    temperatures: list[float]
    max_new_tokens: int
    prompts_per_category: int
    seed: int
    hf: bool
    threads: int | None = None
    confidence: float = 0.5
    llama_server: str | None = None  # --llama-server: the binary, found and checked
    prefix_cache_mb: int = 0  # --prefix-cache-mb (0: off)
    turns: int = 1  # --turns: user turns of multi-turn prompts run
    top_p: float = 1.0  # --top-p: nucleus filtering of the sampled cells (1: off)


def parse_options(argv: list[str]) -> Options:
    args = build_parser().parse_args(argv)
    preset = QUICK if args.quick else DEFAULTS
    methods_text = args.methods or (preset["methods"] + (",draft" if args.draft and not args.quick else ""))
    if args.quick and args.draft and args.methods is None:
        methods_text += ",draft"
    methods = _methods(methods_text)
    for m in methods:
        if method_spec(base_method(m)).needs_draft and not args.draft:
            raise ConfigError(f"method '{m}' needs a draft model (--draft PATH)")
    max_new = args.max_new_tokens if args.max_new_tokens is not None else preset["max_new_tokens"]
    if max_new < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {max_new}")
    per_cat = args.prompts_per_category if args.prompts_per_category is not None else preset["prompts_per_category"]
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {args.threads}")
    if per_cat < 0:
        raise ConfigError(f"--prompts-per-category must be >= 0, got {per_cat}")
    check_top_p(args.top_p, "--top-p")
    if args.turns < 1:
        raise ConfigError(f"--turns must be >= 1, got {args.turns}")
    if args.prefix_cache_mb < 0:
        raise ConfigError(f"--prefix-cache-mb must be >= 0, got {args.prefix_cache_mb}")
    if args.draft_vocab is not None and (not args.draft or args.draft_vocab < 1):
        raise ConfigError("--draft-vocab needs --draft and a count >= 1")
    return Options(
        workload=args.workload,
        out=Path(args.out),
        quick=args.quick,
        target=args.target,
        draft=args.draft,
        dtype=args.dtype,
        draft_dtype=args.draft_dtype or draft_default(args.dtype),
        draft_vocab=args.draft_vocab,
        backend=args.backend,
        methods=methods,
        ks=_ks(args.k or preset["k"]),
        temperatures=_temperatures(args.temperatures or preset["temperatures"]),
        max_new_tokens=max_new,
        prompts_per_category=per_cat,
        seed=args.seed,
        hf=not args.no_hf,
        threads=args.threads if args.threads is not None else preset["threads"],
        confidence=args.confidence,
        llama_server=str(find_binary(args.llama_server)) if args.llama_server else None,
        prefix_cache_mb=args.prefix_cache_mb,
        turns=args.turns,
        top_p=args.top_p,
    )


def _split(text: str, what: str) -> list[str]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ConfigError(f"{what}: empty list")
    return list(dict.fromkeys(parts))


@dataclass(frozen=True)
class BenchMethod:
    """A bench method name read: ``METHOD[+tree|+conf][:name=value ...]``."""

    base: str
    tree: bool
    conf: bool
    options: tuple[tuple[str, Any], ...]


def parse_method(name: str) -> BenchMethod:
    """'ngram+tree' -> ngram over trees; 'eagle+conf' -> eagle chains that stop on confidence;
    'draft:prompt_window=256' -> draft with that proposer option (see :func:`parse_option`)."""
    head, *written = name.split(OPTION_SEP)
    options = tuple(parse_option(text, f"--methods: {name!r}") for text in written)
    base = head.removesuffix(TREE_SUFFIX).removesuffix(CONF_SUFFIX)
    return BenchMethod(base, head.endswith(TREE_SUFFIX), head.endswith(CONF_SUFFIX), options)


def base_method(name: str) -> str:
    """The method of a bench method name: 'eagle+tree' -> 'eagle', 'draft:prompt_window=64' -> 'draft'."""
    return parse_method(name).base


def _methods(text: str) -> list[str]:
    """Registered method names (:mod:`specdecode.methods`), each optionally with ``+tree`` or
    ``+conf`` and proposer options ``:name=value``."""
    methods = _split(text.lower(), "--methods")
    for m in methods:
        p = parse_method(m)
        if p.base not in METHODS or (p.base == "none" and m != "none"):
            raise ConfigError(
                f"unknown method {m!r}; choose from {', '.join(METHODS)} (+tree, or +conf for "
                f"{', '.join(CONFIDENCE_METHODS)}; then any :name=value proposer options)"
            )
        if p.conf and not method_spec(p.base).confidence:
            raise ConfigError(f"{m!r}: only {', '.join(CONFIDENCE_METHODS)} chains stop on confidence")
        method_spec(p.base).check_options([key for key, _ in p.options])
    return methods


def _ks(text: str) -> list[int | str]:
    ks: list[int | str] = []
    for part in _split(text.lower(), "--k"):
        if part == "auto":
            ks.append("auto")
            continue
        try:
            value = int(part)
        except ValueError:
            raise ConfigError(f"--k: expected integers >= 1 or 'auto', got {part!r}") from None
        if value < 1:
            raise ConfigError(f"--k: draft lengths must be >= 1, got {value}")
        ks.append(value)
    return ks


def _temperatures(text: str) -> list[float]:
    temps = []
    for part in _split(text, "--temperatures"):
        try:
            value = float(part)
        except ValueError:
            raise ConfigError(f"--temperatures: expected numbers >= 0, got {part!r}") from None
        if not value >= 0:
            raise ConfigError(f"--temperatures: must be >= 0, got {part}")
        temps.append(value)
    return list(dict.fromkeys(temps))


# -- machine info ------------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    import torch
    import transformers

    import specdecode

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = None
    try:
        root = Path(__file__).resolve().parents[3]
        commit = (
            subprocess.run(
                ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "specdecode": getattr(specdecode, "__version__", "?"),
        "git_commit": commit,
        "cuda": torch.cuda.is_available(),
    }


# -- measurements ------------------------------------------------------------------------------
def measure_cost_curve(model: Any, max_tokens: int, context: int = COST_CONTEXT, reps: int = 5) -> dict[int, float]:
    """Median seconds of one target forward over n = 1..max_tokens new tokens after ``context``."""
    import torch

    context = max(1, min(context, int(model.max_length) - max_tokens - 1))
    gen = torch.Generator().manual_seed(0)
    vocab = int(model.vocab_size)
    cache = model.new_cache(context + max_tokens + 1)
    model.forward(torch.randint(0, vocab, (1, context), generator=gen), cache)
    base = cache.length
    samples: dict[int, list[float]] = {n: [] for n in range(1, max_tokens + 1)}
    for rep in range(reps + 1):  # the first pass warms up and is dropped
        for n in range(1, max_tokens + 1):
            ids = torch.randint(0, vocab, (1, n), generator=gen)
            t = time.perf_counter()
            model.forward(ids, cache)
            elapsed = time.perf_counter() - t
            cache.trim(base)
            if rep:
                samples[n].append(elapsed)
    return {n: statistics.median(v) for n, v in samples.items()}


class _FirstTokenTimer:
    """A transformers streamer that notes when the first generated token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # call 1 carries the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def hf_generate(
    model: Any,
    ids: list[int],
    max_new_tokens: int,
    temperature: float,
    seed: int,
    eos_ids: tuple[int, ...],
    top_p: float = 1.0,
) -> tuple[list[int], dict[str, Any]]:
    """transformers ``generate`` on the same prompt ids; a stats record like the engine's."""
    import torch
    from transformers import GenerationConfig as HFGenerationConfig

    from specdecode.metrics import peak_rss_mb

    eos = list(eos_ids) or None
    options: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "eos_token_id": eos,
        "pad_token_id": eos[0] if eos else 0,
        "do_sample": temperature > 0,
    }
    if temperature > 0:
        options.update(temperature=temperature, top_k=0, top_p=top_p)
    config = HFGenerationConfig(**options)
    torch.manual_seed(seed)
    timer = _FirstTokenTimer()
    input_ids = torch.tensor([ids], dtype=torch.long)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config, streamer=timer
        )
    total = time.perf_counter() - start
    new = [int(t) for t in out[0, len(ids) :].tolist()]
    while new and eos and len(new) > 1 and new[-1] in eos and new[-2] in eos:  # padding after EOS
        new.pop()
    ttft = (timer.first - start) if timer.first is not None else total
    stats = reference_stats("hf", "none", len(ids), len(new), total, ttft, peak_rss_mb())
    return new, stats


# -- the store ---------------------------------------------------------------------------------
def fingerprint(
    opts: Options,
    target_source: str,
    draft_source: str | None,
    hybrid_drafter: str | None = None,
    dtypes: tuple[str, str | None] | None = None,
) -> str:
    """Settings a stored result depends on besides its cell and prompt. ``dtypes``: what the
    target and draft loaded as (``auto`` resolved), else the options as given."""
    dtype, draft_dtype = dtypes or (opts.dtype, opts.draft_dtype)
    spec = {
        "target": target_source,
        "draft": draft_source,
        "dtype": dtype,
        "draft_dtype": draft_dtype,
        "backend": opts.backend,
        "max_new_tokens": opts.max_new_tokens,
        "seed": opts.seed,
    }
    if hybrid_drafter:
        spec["hybrid_drafter"] = hybrid_drafter
    if opts.draft_vocab is not None:
        spec["draft_vocab"] = opts.draft_vocab
    if opts.top_p < 1.0:  # results stored before --top-p ran without it
        spec["top_p"] = opts.top_p
    if opts.prefix_cache_mb:  # results stored before prefix caching ran without it
        spec["prefix_cache_mb"] = opts.prefix_cache_mb
    if any(parse_method(m).conf for m in opts.methods):
        spec["confidence"] = opts.confidence
    return hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def record_key(cell: Cell, item: WorkItem) -> str:
    digest = hashlib.sha1(item.prompt.encode()).hexdigest()[:10]
    return f"{cell.key}|{item.id}|{digest}"


def read_store(path: Path, fp: str) -> dict[str, dict[str, Any]]:
    """Stored records of this configuration; a torn last line (from an interrupted run) is ignored."""
    done: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return done
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and rec.get("fingerprint") == fp and "key" in rec:
            done[rec["key"]] = rec
    return done


# -- the run -----------------------------------------------------------------------------------
def plan_cells(opts: Options) -> list[Cell]:
    cells: list[Cell] = []
    for temp in opts.temperatures:
        cells.append(Cell("none", 0, temp))
        if opts.hf:
            cells.append(Cell("hf", 0, temp))
        if opts.llama_server:
            cells.append(Cell("llama.cpp", 0, temp))
            if opts.draft:
                cells.append(Cell("llama.cpp-draft", llama_k(opts), temp))
        for method in opts.methods:
            if method == "none":
                continue
            cells.extend(Cell(method, k, temp) for k in opts.ks)
    return cells


def llama_k(opts: Options) -> int:
    """llama.cpp's draft length: the largest fixed k measured, else llama_cpp's ``DEFAULT_K``."""
    return max((k for k in opts.ks if isinstance(k, int)), default=DEFAULT_K)


def prompt_seed(seed: int, item: WorkItem) -> int:
    return (seed * 1_000_003 + zlib.crc32(item.id.encode())) % (1 << 62)


def main(argv: list[str] | None = None) -> int:
    opts = parse_options(list(sys.argv[1:] if argv is None else argv))
    items = select(load_workload(opts.workload), opts.prompts_per_category, opts.seed)
    return run_bench(opts, items, list(sys.argv[1:] if argv is None else argv))


def run_bench(opts: Options, items: list[WorkItem], argv: list[str]) -> int:
    """Run every cell on every prompt (resuming from ``opts.out``), then write and print the report."""
    with contextlib.ExitStack() as servers:  # llama-server processes stop however the run ends
        return _run_bench(opts, items, argv, servers)


def _run_bench(opts: Options, items: list[WorkItem], argv: list[str], servers: contextlib.ExitStack) -> int:
    import torch
    from rich.console import Console
    from tqdm import tqdm

    from specdecode.api import SpeculativeGenerator
    from specdecode.bench import report
    from specdecode.models.loading import load_draft, load_model

    console = Console(stderr=True)
    started = time.perf_counter()
    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    if opts.out.exists() and not opts.out.is_dir():
        raise InputError(f"--out is not a folder: {opts.out}")
    opts.out.mkdir(parents=True, exist_ok=True)
    console.print(f"bench: {len(items)} prompts in {len(groups_in_order(items))} categories -> {opts.out}")

    target = load_model(opts.target, dtype=opts.dtype, backend=opts.backend)
    if opts.turns > 1 and not getattr(target.tokenizer, "chat_template", None):
        raise ConfigError("--turns needs a target with a chat template (later turns are conversations)")
    needs_draft = any(method_spec(base_method(m)).uses_draft for m in opts.methods)
    draft = load_draft(opts.draft, opts.dtype, opts.draft_dtype) if needs_draft and opts.draft else None
    if draft is not None and opts.draft_vocab is not None:
        from specdecode.models.native import with_draft_vocab

        draft = with_draft_vocab(draft, opts.draft_vocab)
    cells, skipped_cells, gens = [], [], {}
    for cell in plan_cells(opts):
        if cell.method == "hf" or cell.llama:
            cells.append(cell)
            continue
        # One generator per cell (the frozen Cell is its key): a proposer's corpus and the planner's
        # memory are the cell's own (shared across temperatures, a suffix cell at T=0.7 copied the
        # greedy cell's answer to the same prompt, and each cell's k was planned on the other's
        # measurements).
        try:
            m = parse_method(cell.method)
            gens[cell] = SpeculativeGenerator(
                target,
                method=m.base,
                k=cell.k if m.base != "none" else 1,
                draft=draft,
                tree=m.tree or None,
                prefix_cache_mb=opts.prefix_cache_mb,
                **({"policy": "confidence", "confidence": opts.confidence} if m.conf else {}),
                **dict(m.options),
            )
        except (ConfigError, TypeError, ValueError) as exc:
            skipped_cells.append({**cell.to_dict(), "reason": str(exc)})
            continue
        cells.append(cell)
    for s in skipped_cells:
        console.print(f"[yellow]skipping {s['key']}: {s['reason']}[/yellow]")
    hybrid = next(
        (g.decoder.proposer.drafter.name for c, g in gens.items() if base_method(c.method) == "hybrid"),
        None,
    )
    loaded = (target.dtype, draft.dtype if draft else opts.draft_dtype)
    fp = fingerprint(opts, target.source, draft.source if draft else None, hybrid, loaded)
    hf_model = _hf_model(target, target.dtype) if any(c.method == "hf" for c in cells) else None

    plain = next(g for c, g in gens.items() if c.method == "none")
    k_fixed = [k for k in opts.ks if isinstance(k, int)]
    kmax = max(k_fixed + ([AUTO_K_MAX] if "auto" in opts.ks else []) + [1])
    budget = int(target.model.max_length) - opts.max_new_tokens - kmax - 2
    if budget < 1:
        raise ConfigError(
            f"--max-new-tokens {opts.max_new_tokens} leaves no room for a prompt in the "
            f"model's {target.model.max_length} positions"
        )
    prompts: dict[str, dict[str, Any]] = {}
    for item in items:
        prompts[item.id] = _prompt_entry(plain.encode(item.prompt), budget, [{"role": "user", "content": item.prompt}])

    longest = max(p["tokens"] if not p["truncated"] else budget for p in prompts.values())
    context = longest + opts.max_new_tokens + 16 if opts.turns == 1 else int(target.model.max_length)
    engines = _Engines(gens, hf_model, _llama_servers(opts, cells, target, context, servers), target)
    console.print(f"measuring the target's forward cost c(n), n = 1..{kmax + 1}, after {COST_CONTEXT} cached tokens")
    cost_curve = measure_cost_curve(target.model, kmax + 1)

    store_path = opts.out / "cells.jsonl"
    done = read_store(store_path, fp)
    # Every prompt's cells in turn; a conversation's next turn right after its previous one (as a
    # user's follow-up comes), so its history is still in each cell's prefix cache.
    conversations = [[it, *_later_turns(it, opts.turns)] for it in items]
    items = [it for conv in conversations for it in conv]
    todo = [(it, c) for it in items for c in cells if record_key(c, it) not in done]
    resumed = len(items) * len(cells) - len(todo)
    if todo:  # one short untimed run per cell: first-call costs stay out of the timings
        _warm_up(cells, prompts[items[0].id]["ids"][:16], engines, opts.top_p)
    with (
        open(store_path, "a", encoding="utf-8") as store,
        tqdm(total=len(todo), desc="bench", unit="run", file=sys.stderr, dynamic_ncols=True) as bar,
    ):
        for index, conv in enumerate(conversations):
            rotated = cells[index % len(cells) :] + cells[: index % len(cells)]  # no cell always runs first
            for before, item in zip([None, *conv], conv):
                if before is not None:
                    prompts[item.id] = _turn_prompt(before, item, prompts, done, opts, target, budget)
                for cell in rotated:
                    if record_key(cell, item) in done:
                        continue
                    bar.set_postfix_str(
                        f"{item.group}/{item.id} {cell.label(len(opts.temperatures) > 1)}", refresh=False
                    )
                    rec = _run_one(cell, item, prompts[item.id], opts, engines)
                    rec.update(key=record_key(cell, item), fingerprint=fp)
                    store.write(json.dumps(rec) + "\n")
                    store.flush()
                    done[rec["key"]] = rec
                    bar.update(1)
    ran = len(todo)
    if resumed:
        console.print(f"resumed: {resumed} finished cell x prompt results found in {store_path}, not run again")

    records = [done[record_key(c, item)] for item in items for c in cells if record_key(c, item) in done]
    results = {
        "schema": 1,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": ["specdecode", "bench", *argv],
        "machine": machine_info(),
        "config": {
            "workload": _workload_name(opts.workload),
            "target": target.source,
            "draft": draft.source if draft else None,
            "draft_name": opts.draft if draft else None,  # as given: a catalog name travels, a path does not
            "dtype": loaded[0],  # as loaded (auto resolved)
            "draft_dtype": loaded[1],
            "draft_vocab": opts.draft_vocab,
            "backend": getattr(target.model, "backend", opts.backend),
            "methods": opts.methods,
            "k": opts.ks,
            "temperatures": opts.temperatures,
            "top_p": opts.top_p,
            "max_new_tokens": opts.max_new_tokens,
            "prompts_per_category": opts.prompts_per_category,
            "seed": opts.seed,
            "hf_generate": opts.hf,
            "quick": opts.quick,
            "confidence": opts.confidence,
            "hybrid_drafter": hybrid,
            "llama_server": {kind: " ".join(server.command) for kind, server in engines.llamas.items()} or None,
            "fingerprint": fp,
        },
        "cost_curve": {"context_tokens": COST_CONTEXT, "forward_s": {str(n): s for n, s in cost_curve.items()}},
        "prompts": [
            {
                "id": it.id,
                "category": it.category,
                "group": it.group,
                "line": it.line,
                "prompt_tokens": prompts[it.id]["tokens"],
                "truncated": prompts[it.id]["truncated"],
            }
            for it in items
        ],
        "categories": groups_in_order(items),
        "cells": [c.to_dict() for c in cells],
        "skipped_cells": skipped_cells,
        "run": {"ran": ran, "resumed": resumed, "elapsed_s": 0.0},
        "records": records,
    }
    results["aggregates"] = report.aggregate(results)
    results["run"]["elapsed_s"] = round(time.perf_counter() - started, 2)
    report.write_all(results, opts.out)
    report.print_console(results, Console(file=sys.stdout, width=max(Console().width, 180)))
    print(json.dumps(report.summary_line(results, opts.out)), flush=True)
    return 0


def _prompt_entry(ids: list[int], budget: int, messages: list[dict[str, str]]) -> dict[str, Any]:
    truncated = len(ids) > budget
    return {
        "ids": ids[-budget:] if truncated else ids,
        "truncated": truncated,
        "tokens": len(ids),
        "messages": messages,
    }


@dataclass(frozen=True)
class _Engines:
    """What runs a cell: our generators (one per cell), the transformers model, the started
    llama-servers, and the target (its end-of-sequence ids for transformers)."""

    gens: dict
    hf_model: Any
    llamas: dict
    target: Any

    def generate(
        self, cell: Cell, ids: list[int], max_new_tokens: int, seed: int, top_p: float
    ) -> tuple[list[int], dict[str, Any], str | None]:
        """``cell``'s continuation of ``ids``: token ids, stats, finish reason (None where unknown)."""
        if cell.method == "hf":
            eos = self.target.eos_token_ids
            token_ids, stats = hf_generate(self.hf_model, ids, max_new_tokens, cell.temperature, seed, eos, top_p)
            return token_ids, stats, None
        if cell.llama:
            token_ids, stats = self.llamas[cell.method].generate(ids, max_new_tokens, cell.temperature, seed, top_p)
            return token_ids, {**stats, "method": cell.method, "k": cell.k}, None
        out = self.gens[cell].generate(
            ids, max_new_tokens=max_new_tokens, temperature=cell.temperature, top_p=top_p, seed=seed
        )
        return list(out.token_ids), dict(out.stats), out.finish_reason


def _warm_up(cells: list[Cell], ids: list[int], engines: _Engines, top_p: float) -> None:
    for cell in cells:
        engines.generate(cell, ids, 4, 0, top_p)


def _later_turns(item: WorkItem, turns: int) -> list[WorkItem]:
    """The conversation's user turns after ``item``'s, up to ``turns`` in all (``<id>#t<n>``)."""
    return [
        WorkItem(f"{item.id}#t{n}", item.category, item.group, text, item.line, item.later[i + 1 :], n)
        for i, (n, text) in enumerate(zip(range(item.turn + 1, turns + 1), item.later))
    ]


def _turn_prompt(
    before: WorkItem, item: WorkItem, prompts: dict, done: dict, opts: Options, target: Any, budget: int
) -> dict[str, Any]:
    """``item``'s prompt: the conversation up to ``before``, whose answer is plain greedy
    decoding's (the plain T=0 cell's, else made here, untimed), then ``item``'s question. Every
    cell sees the same ids."""
    from specdecode.api import SpeculativeGenerator, encode_chat

    plain = done.get(record_key(Cell("none", 0, 0.0), before))
    if plain is not None:
        answer = plain["token_ids"]
    else:
        reference = SpeculativeGenerator(target, method="none", prefix_cache_mb=0)
        answer = reference.generate(prompts[before.id]["ids"], max_new_tokens=opts.max_new_tokens).token_ids
    messages = prompts[before.id]["messages"] + [
        {"role": "assistant", "content": target.tokenizer.decode(answer, skip_special_tokens=True)},
        {"role": "user", "content": item.prompt},
    ]
    return _prompt_entry(encode_chat(target.tokenizer, messages), budget, messages)


def _hf_model(target: Any, dtype: str) -> Any:
    """transformers' model for the target's folder (the loaded one when the target runs on it)."""
    inner = getattr(target.model, "model", None)
    if getattr(target.model, "backend", None) == "transformers" and hasattr(inner, "generate"):
        return inner
    import torch
    from transformers import AutoModelForCausalLM

    from specdecode.models.loading import DTYPES, transformers_dir

    folder = transformers_dir(target.source)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES.get(dtype, torch.float32)).eval()


def _run_one(cell: Cell, item: WorkItem, prompt: dict[str, Any], opts: Options, engines: _Engines) -> dict[str, Any]:
    seed = prompt_seed(opts.seed, item)
    token_ids, stats, finish = engines.generate(cell, prompt["ids"], opts.max_new_tokens, seed, opts.top_p)
    return {
        **cell.to_dict(),
        "cell": cell.key,
        "prompt_id": item.id,
        "category": item.category,
        "group": item.group,
        "prompt_tokens": len(prompt["ids"]),
        "truncated": prompt["truncated"],
        "seed": seed,
        "finish_reason": finish,
        "token_ids": token_ids,
        "stats": stats,
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def _llama_servers(
    opts: Options, cells: list[Cell], target: Any, context: int, servers: contextlib.ExitStack
) -> dict[str, Any]:
    """A started llama-server per llama.cpp cell kind, on the GGUF files the target and draft came
    from, each closed by ``servers``; InputError where a model is not a GGUF file."""
    from specdecode.bench.llama_cpp import LlamaServer
    from specdecode.models.loading import gguf_source, resolve_model_dir

    kinds = {c.method: c.k for c in cells if c.llama}
    if not kinds:
        return {}
    model = gguf_source(Path(target.source))
    draft = gguf_source(resolve_model_dir(opts.draft, weights=False)) if "llama.cpp-draft" in kinds else None
    if model is None or ("llama.cpp-draft" in kinds and draft is None):
        raise InputError("--llama-server needs the target and the draft to come from GGUF files")
    threads = opts.threads or os.cpu_count() or 1
    logs = opts.out / "llama-server"
    logs.mkdir(exist_ok=True)
    started: dict[str, Any] = {}
    for kind, k in kinds.items():
        drafted = draft if kind == "llama.cpp-draft" else None
        log = logs / f"{kind}.log"
        server = LlamaServer(
            Path(opts.llama_server), model, threads, context, log, drafted, k, opts.prefix_cache_mb > 0
        )
        started[kind] = servers.enter_context(contextlib.closing(server))
    return started


def _workload_name(workload: str | None) -> str:
    if workload is None:
        return str(default_workload_path())
    return workload if workload == HUMANEVAL else str(Path(workload).resolve())
