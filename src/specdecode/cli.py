"""Command line: ``specdecode generate | demo | conformance | bench | bench-decode | train | ...``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from specdecode.core.dtypes import DRAFT_DTYPE_HELP, DTYPE_CHOICES, DTYPE_HELP, QUANT_DTYPES
from specdecode.errors import SpecDecodeError
from specdecode.methods import TRAINED, method_names, method_spec


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _k_value(text: str) -> int | str:
    return "auto" if text == "auto" else _positive_int(text)


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {text}")
    return value


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="transformers folder or .gguf file (default: embedded SmolLM2-135M)")
    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help=DTYPE_HELP,
    )
    p.add_argument("--draft-dtype", choices=DTYPE_CHOICES, default=None, help=DRAFT_DTYPE_HELP)
    p.add_argument("--backend", choices=["auto", "native", "transformers"], default="auto")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads (default: free cores)")


def _draft(args: argparse.Namespace) -> Any:
    """``--draft`` as given (a path), or loaded here and cut to ``--draft-vocab`` tokens."""
    if args.draft_vocab is None:
        return args.draft
    from specdecode.errors import ConfigError
    from specdecode.models.loading import load_draft
    from specdecode.models.native import with_draft_vocab

    if not args.draft or args.method not in ("draft", "hybrid"):
        raise ConfigError("--draft-vocab needs --draft and --method draft or hybrid")

    return with_draft_vocab(load_draft(args.draft, args.dtype, args.draft_dtype), args.draft_vocab)


def _generate_parser(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt")
    p.add_argument("prompt")
    _add_model_args(p)
    p.add_argument(
        "--method",
        choices=list(method_names()),
        default="auto",
        help="default auto: the best drafter shipped for the target, else n-gram lookup",
    )
    p.add_argument(
        "--draft",
        default=None,
        help="draft model folder or .gguf (methods 'draft', 'xtok'); trained head folder (eagle, medusa)",
    )
    p.add_argument(
        "--draft-vocab",
        type=_positive_int,
        default=None,
        help="the --draft model's head cut to its N most common tokens plus each request's context's (methods draft, "
        "hybrid; default 32768 for a draft over 65536 ids)",
    )
    p.add_argument(
        "--k",
        type=_k_value,
        default=None,
        help="draft tokens per round, or 'auto' (default 4; with --method auto, what the drafter was measured with)",
    )
    p.add_argument("--k-max", type=_positive_int, default=8, help="upper bound for --k auto")
    p.add_argument(
        "--policy",
        choices=["fixed", "heuristic", "confidence", "auto"],
        default=None,
        help="how k changes between rounds (default: fixed; auto with --k auto)",
    )
    p.add_argument(
        "--confidence",
        type=float,
        default=None,
        help="--policy confidence: a draft/eagle/medusa/hybrid chain stops before a token it gives less than this",
    )
    p.add_argument(
        "--tree",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="verify a tree of candidates per round (default: only for lookahead)",
    )
    p.add_argument("--max-nodes", type=_positive_int, default=16, help="tree node budget per round")
    p.add_argument(
        "--drafter",
        choices=list(TRAINED),
        default=None,
        help="hybrid: the trained drafter for rounds prompt lookup cannot serve (default: best shipped)",
    )
    p.add_argument(
        "--exit-layers",
        type=_positive_int,
        default=None,
        help="early-exit: target layers the draft runs (default: measured best)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a proposer option of --method (repeatable), e.g. --set prompt_window=256 (draft, hybrid) "
        "or --set lookup=ngram (hybrid); a misspelt one is an error naming the options the method takes",
    )
    p.add_argument(
        "--shadow", action="store_true", help="decode plainly; record the acceptance the method would have had"
    )
    p.add_argument("--temperature", type=_nonneg_float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", type=_positive_int, default=128)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--stream", action="store_true", help="print text as tokens commit")
    p.add_argument("--json", action="store_true", help='print {"text", "token_ids", "stats"}')


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdecode", description="Exact speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    demo = sub.add_parser("demo", help="plain vs speculative decoding on the embedded model")
    demo.add_argument("--max-new-tokens", type=_positive_int, default=160)
    demo.add_argument("--prompt", default=None, help="your own prompt instead of the built-in one")
    demo.add_argument(
        "--k", type=_positive_int, default=None, help="default: 4, or what the auto-chosen drafter was measured with"
    )
    demo.add_argument(
        "--method",
        choices=[m for m in method_names() if m != "none"],
        default="auto",
        help="default auto: the best drafter shipped for the model, else n-gram lookup",
    )
    demo.add_argument(
        "--target", default=None, help="a model name (specdecode models list) or path (default: the embedded one)"
    )
    demo.add_argument("--draft", default=None, help="the draft model of --method draft (a name or a path)")
    demo.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help=DTYPE_HELP,
    )
    demo.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads (default: free cores)")
    _conformance_parser(sub)
    sub.add_parser("bench-decode", help="plain decode speed vs transformers (see --help)", add_help=False)
    sub.add_parser(
        "bench-serve",
        help="serving throughput and latency of the batched engine under load (see --help)",
        add_help=False,
    )
    sub.add_parser(
        "models", help="models pull NAME | models list: named models from the package registry", add_help=False
    )
    sub.add_parser("serve", help="an OpenAI-compatible server on the batched engine (see --help)", add_help=False)
    sub.add_parser(
        "record-drafters",
        help="write bench runs' drafter speedups into the shipped cards (see --help)",
        add_help=False,
    )
    return parser


def _conformance_parser(sub: Any) -> None:
    p = sub.add_parser(
        "conformance",
        help="certify a proposer's exactness on a tiny enumerable target (chi-square)",
        description="Sample speculative output on a tiny Markov-chain target and test it against the "
        "target's exact law (Pearson chi-square per case), plus greedy identity.",
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--method",
        default=None,
        help="a registered method that builds without a real model (ngram, suffix, lookahead, plugins)",
    )
    which.add_argument(
        "--plugin",
        metavar="MODULE:ATTR",
        default=None,
        help="your proposer: ATTR is a MethodSpec, a registered method's name, a Proposer class "
        "(built with no arguments) or a function given the tiny target model",
    )
    p.add_argument("--samples", type=_positive_int, default=3000, help="generations per case (default 3000)")
    p.add_argument("--alpha", type=_probability, default=1e-3, help="significance level per case (default 0.001)")
    p.add_argument("--k", type=_positive_int, default=2, help="draft tokens per round (default 2)")
    p.add_argument("--n-new", type=_positive_int, default=3, help="new tokens per generation (default 3)")
    p.add_argument(
        "--trees",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also certify tree drafting (default: when the proposer declares caps.trees)",
    )
    p.add_argument("--seed", type=int, default=0)


def conformance_proposer(args: argparse.Namespace, target: Any) -> Any:
    """The proposer ``specdecode conformance`` certifies, built over the tiny ``target`` model."""
    import importlib

    from specdecode.errors import ConfigError
    from specdecode.methods import REGISTRY, MethodSpec, register_method

    if args.method is not None:
        return _build_registered(args.method, target)
    module_name, _, attr = args.plugin.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"--plugin takes MODULE:ATTR, got {args.plugin!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # a plugin next to the user, as with python -m
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"--plugin: cannot import module {module_name!r} ({exc})") from None
    if attr not in vars(module):
        if attr in REGISTRY:  # importing the module registered it
            return _build_registered(attr, target)
        raise ConfigError(
            f"--plugin: module {module_name!r} has no attribute {attr!r}, and no method {attr!r} is registered"
        )
    obj = vars(module)[attr]
    if isinstance(obj, MethodSpec):
        if REGISTRY.get(obj.name) is not obj:
            register_method(obj)
        return _build_registered(obj.name, target)
    if not callable(obj):
        raise ConfigError(
            f"--plugin: {args.plugin} is a {type(obj).__name__}, not a MethodSpec, a proposer class "
            "or a function returning a proposer"
        )
    try:
        return obj() if isinstance(obj, type) else obj(target)
    except SpecDecodeError:
        raise
    except Exception as exc:
        how = "with no arguments" if isinstance(obj, type) else "with the tiny target"
        raise ConfigError(f"--plugin: building {args.plugin} {how} failed: {type(exc).__name__}: {exc}") from None


def _build_registered(name: str, target: Any) -> Any:
    """A registered method's proposer over the tiny target; ConfigError for methods that cannot build there."""
    from specdecode.api import make_proposer
    from specdecode.errors import ConfigError
    from specdecode.methods import method_spec
    from specdecode.models.loading import LoadedModel

    spec = method_spec(name)
    if name == "none":
        raise ConfigError("method 'none' is plain decoding: there is no proposer to certify")
    needs = (
        "trained weights for a real target"
        if spec.trained
        else "a trained drafter"
        if spec.composed
        else "a draft model"
        if spec.needs_draft
        else "a real target model"
        if spec.needs_model
        else None
    )
    if needs:
        raise ConfigError(
            f"method {name!r} needs {needs}, so it cannot be built on the tiny conformance target; "
            "certify it in Python with specdecode.testing.certify(proposer, target=...)"
        )
    try:
        return make_proposer(name, LoadedModel(model=target, tokenizer=None, source="tiny-markov"))
    except SpecDecodeError:
        raise
    except Exception as exc:
        raise ConfigError(f"building method {name!r} on the tiny target failed: {type(exc).__name__}: {exc}") from None


def cmd_conformance(args: argparse.Namespace) -> int:
    """Certify a proposer; print one row per case and ``N passed, M failed``; 0 when all pass, else 1."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from specdecode.runtime import set_threads
    from specdecode.testing import certify, default_target, format_pvalue

    set_threads(1)  # tiny tensors: a second thread only adds synchronisation
    target = default_target()
    proposer = conformance_proposer(args, target)
    report = certify(
        proposer,
        target=target,
        samples=args.samples,
        alpha=args.alpha,
        k=args.k,
        n_new=args.n_new,
        trees=args.trees,
        seed=args.seed,
    )
    console = Console(highlight=False)
    table = Table(
        title=f"conformance of {report.proposer!r}: Markov chain over {target.vocab_size} tokens, "
        f"{args.samples} samples per case, k={args.k}, {args.n_new} new tokens, alpha={args.alpha:g}"
    )
    for column in ("case", "p-value", "result", "detail"):
        table.add_column(column, justify="right" if column == "p-value" else "left")
    for case in report.cases:
        result = "[green]PASS[/green]" if case.passed else "[red]FAIL[/red]"
        table.add_row(escape(case.name), format_pvalue(case.pvalue), result, escape(case.detail))
    console.print(table)
    for note in report.notes:
        console.print(f"note: {note}", markup=False)
    print(f"{report.n_passed} passed, {report.n_failed} failed", flush=True)
    return 0 if report.passed else 1


def _proposer_options(args: argparse.Namespace) -> dict[str, Any]:
    """The proposer options of ``generate``: its own flags, then ``--set NAME=VALUE`` ones,
    checked against ``--method``'s options before any model loads."""
    from specdecode.errors import ConfigError
    from specdecode.methods import parse_option

    options: dict[str, Any] = {}
    if args.exit_layers and args.method == "early-exit":
        options["layers"] = args.exit_layers
    if args.drafter:
        options["drafter"] = args.drafter
    if args.draft_dtype and method_spec(args.method).uses_draft:
        options["dtype"] = args.draft_dtype
    for text in args.set:
        key, value = parse_option(text, "--set")
        if key in options:
            raise ConfigError(f"--set {key}: already given by its own flag")
        options[key] = value
    method_spec(args.method).check_options(list(options))  # auto forwards any to the method it picks
    return options


def cmd_generate(args: argparse.Namespace) -> int:
    from specdecode.api import SpeculativeGenerator
    from specdecode.core.sampling import SamplingConfig
    from specdecode.errors import ConfigError, InputError
    from specdecode.models.loading import load_model

    if not args.prompt.strip():
        raise InputError("empty prompt")
    if args.drafter and args.method != "hybrid":
        raise ConfigError(
            f"--drafter chooses the hybrid's trained drafter; use it with --method hybrid, not {args.method!r}"
        )
    options = _proposer_options(args)
    from specdecode.runtime import set_threads

    set_threads(args.threads)
    # Validate sampling flags before spending seconds on loading the model.
    SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    target = load_model(args.target, dtype=args.dtype, backend=args.backend)
    gen = SpeculativeGenerator(
        target,
        method=args.method,
        k=args.k,
        k_max=args.k_max,
        draft=_draft(args),
        policy=args.policy,
        confidence=args.confidence,
        shadow=args.shadow,
        tree=args.tree,
        max_nodes=args.max_nodes,
        **options,
    )
    kwargs = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        stop_strings=tuple(args.stop),
        chat=False if args.no_chat else None,
    )
    if args.stream and not args.json:
        for piece in gen.stream(args.prompt, **kwargs):
            print(piece, end="", flush=True)
        print()
        return 0
    out = gen.generate(args.prompt, **kwargs)
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "stats": out.stats}))
    else:
        print(out.text)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if argv[:1] == ["bench-decode"]:
        from specdecode.bench import decode

        return _guard(lambda: decode.main(argv[1:]))
    if argv[:1] == ["bench-serve"]:
        from specdecode.bench import serve

        return _guard(lambda: serve.main(argv[1:]))
    if argv[:1] == ["models"]:
        return _guard(lambda: cmd_models(argv[1:]))
    if argv[:1] == ["serve"]:
        from specdecode.serve import main as serve_main

        return _guard(lambda: serve_main.main(argv[1:]))
    if argv[:1] == ["bench"]:
        from specdecode.bench import runner

        return _guard(lambda: runner.main(argv[1:]))
    if argv[:1] == ["train"]:
        from specdecode.train import trainer

        return _guard(lambda: trainer.main(argv[1:]))
    if argv[:1] == ["record-drafters"]:
        from specdecode.bench import cards

        return _guard(lambda: cards.main(argv[1:]))
    if argv[:1] == ["advise"]:
        from specdecode.bench import advise

        return _guard(lambda: advise.main(argv[1:]))
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from specdecode.demo import run_demo

        return _guard(lambda: run_demo(args))
    if args.command == "conformance":
        return _guard(lambda: cmd_conformance(args))
    return _guard(lambda: cmd_generate(args))


def cmd_models(argv: list[str]) -> int:
    """``models pull NAME [pip options]`` and ``models list``."""
    from specdecode.models import catalog

    parser = argparse.ArgumentParser(prog="specdecode models")
    sub = parser.add_subparsers(dest="action", required=True)
    pull = sub.add_parser("pull", help="install a model (or a family: qwen2.5-coder) into the model cache")
    pull.add_argument("name")
    pull.add_argument("--index-url", default=None, help="the package registry (default: pip's)")
    pull.add_argument("--find-links", default=None, help="a local folder of wheels")
    pull.add_argument("--no-index", action="store_true", help="only --find-links, no registry")
    pull.add_argument(
        "--prepare",
        action="append",
        default=[],
        choices=("auto", *QUANT_DTYPES),
        help="also quantize to this dtype and store it, so the first load is quick (repeatable; "
        "auto: the dtype --dtype auto loads each in, a draft in its draft dtype)",
    )
    sub.add_parser("list", help="the named models and where they are installed")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    if args.action == "list":
        for model, path in catalog.installed():
            where = f"{path}  {path.stat().st_size / 2**20:.0f} MiB" if path else "not installed"
            print(f"{model.name:<22} {model.family:<16} {where}   {model.about}")
        return 0
    pip_args = []
    if args.index_url:
        pip_args += ["--index-url", args.index_url]
    if args.find_links:
        pip_args += ["--find-links", args.find_links]
    if args.no_index:
        pip_args.append("--no-index")
    for model in catalog.select(args.name):
        path = catalog.pull(model, pip_args, lambda line: print(line, flush=True))
        for dtype in args.prepare:
            _prepare(model, path, dtype)
    return 0


def _prepare(model: Any, path: os.PathLike, dtype: str) -> None:
    """Load ``path`` at a quantized ``dtype`` once: the load stores the packed weights."""
    import time

    from specdecode.models.loading import load_model

    start = time.perf_counter()
    loaded = load_model(path, dtype=dtype, draft=model.draft)
    print(f"{model.name}: {loaded.dtype} weights ready ({time.perf_counter() - start:.0f} s)", flush=True)


def _guard(fn: Any) -> int:
    """Run a command; user errors become one line on stderr and exit status 2."""
    try:
        return int(fn() or 0)
    except SpecDecodeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
