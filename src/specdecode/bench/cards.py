"""``specdecode record-drafters OUT``: write a bench run's measurements into the shipped cards.

Each measured method's card gets a ``benchmark`` block from one side-by-side ``specdecode bench``
run: its best greedy chain cell overall (the settings it ran with: k, the confidence stop for
``+conf`` cells, the draft model by catalog name), that cell's per-category figures, the best
n-gram speedup of the same run, and the best tree cell. ``method="auto"`` reads these blocks
(:func:`specdecode.api.best_method`) and runs the recorded settings, so what it picks is what was
measured on that target. A trained drafter's card sits beside its weights; a method without
weights shipped for the target (the hybrid, suffix decoding, a named draft model such as the
Qwen 0.5B) gets a card of measurements only. Plain decoding and n-gram lookup (the fallback,
recorded in every block as ``ngram_speedup``) get none.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

from specdecode.bench.runner import CONF_SUFFIX, TREE_SUFFIX, base_method, parse_method
from specdecode.errors import InputError
from specdecode.methods import COMPOSED, MEASURED, TRAINED, method_spec
from specdecode.models.catalog import CATALOG
from specdecode.proposers.hybrid import DEFAULT_LOOKUP

COMPOSED_HOW = {
    "hybrid": "a lookup where the context repeats (settings.lookup: suffix decoding drafting 2+ tokens, or n-gram "
    "prompt lookup of the context's last 2+ tokens); else the trained drafter (settings.drafter) with its "
    "confidence stop; a 1-token match when that drafter is unsure",
}


def benchmark_blocks(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The ``benchmark`` block of every method measured greedily in ``results``; a method that ran
    with a draft model given by path gets none (``auto`` could not load it elsewhere)."""
    rows = [a for a in results["aggregates"] if a["temperature"] == 0]
    overall = {a["cell"]: a for a in rows if a["category"] == "overall"}
    ngram = max((a["speedup"] for a in overall.values() if a["method"] == "ngram"), default=None)
    config = results["config"]
    blocks = {}
    for method in MEASURED:
        chains = [a for a in overall.values() if _default_chain(a["method"]) == method]
        drafted = _ran_a_draft_model(method, config)
        if not chains or (drafted and config.get("draft_name") not in CATALOG):
            continue
        best = max(chains, key=lambda a: a["speedup"])
        settings: dict[str, Any] = {"k": best["k"]}
        if best["method"].endswith(CONF_SUFFIX):
            settings |= {"policy": "confidence", "confidence": config["confidence"]}
        if method in COMPOSED:  # its drafter, and the lookup a default cell runs
            settings |= {"drafter": config.get("hybrid_drafter"), "lookup": DEFAULT_LOOKUP}
        if drafted:
            settings |= {"draft": config["draft_name"], "draft_dtype": config["draft_dtype"]}
        blocks[method] = _block(results, best, rows, overall, settings, ngram)
    return blocks


def _default_chain(name: str) -> str | None:
    """The method of a chain cell with default proposer options (what a card's settings can
    rebuild), else None."""
    m = parse_method(name)
    return None if m.tree or m.options else m.base


def _ran_a_draft_model(method: str, config: dict[str, Any]) -> bool:
    """Whether ``method``'s cells in this run drafted with the run's ``--draft`` model (a composed
    method only when that model was its drafter)."""
    if config.get("draft") is None or not method_spec(method).uses_draft:
        return False
    return method not in COMPOSED or config.get("hybrid_drafter") == "draft"


def _block(
    results: dict[str, Any],
    best: dict[str, Any],
    rows: list[dict[str, Any]],
    overall: dict[str, dict[str, Any]],
    settings: dict[str, Any],
    ngram: float | None,
) -> dict[str, Any]:
    """One method's block: its best cell ``best``, its per-category rows, its best tree cell."""
    config = results["config"]
    per_cat = [a for a in rows if a["cell"] == best["cell"] and a["category"] != "overall"]
    block = {
        "speedup": round(best["speedup"], 3),
        "mean_accepted_length": round(best["mean_accepted_length"], 3),
        "ngram_speedup": None if ngram is None else round(ngram, 3),
        "settings": settings,
        "cell": best["method"],
        "decoding": f"greedy chain, native {config['dtype']}; speedup vs plain decoding measured "
        "side by side in the same run",
        "per_category_speedup": {a["category"]: round(a["speedup"], 3) for a in per_cat},
        "per_category_mean_accepted_length": {a["category"]: round(a["mean_accepted_length"], 3) for a in per_cat},
        "workload": f"{Path(config['workload']).name}, {config['prompts_per_category']} "
        f"prompts per category, {config['max_new_tokens']} new tokens",
        "command": shlex.join(results["command"]),
    }
    machine = results.get("machine") or {}
    if machine:  # a kernel's speed differs between hosts: say which one measured it
        block["host"] = f"{machine.get('cpu')}, {machine.get('torch_threads')} threads, torch {machine.get('torch')}"
    method = base_method(best["method"])
    trees = [a for a in overall.values() if a["method"] == method + TREE_SUFFIX]
    if trees:
        tree = max(trees, key=lambda a: a["speedup"])
        block["tree"] = {
            "speedup": round(tree["speedup"], 3),
            "mean_accepted_length": round(tree["mean_accepted_length"], 3),
            "k": tree["k"],
        }
    return block


def record(
    results_path: str | Path, drafters_dir: str | Path | None = None, methods: tuple[str, ...] | None = None
) -> list[Path]:
    """Update the cards of the drafters shipped for the run's target (only ``methods`` when given,
    so a run that measured some drafters leaves the others' blocks alone); the cards written."""
    from specdecode.networks import storage

    path = Path(results_path)
    path = path / "results.json" if path.is_dir() else path
    if not path.exists():
        raise InputError(f"no results.json at {results_path}")
    try:
        results = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: malformed JSON ({exc.msg}, line {exc.lineno})") from None
    root = Path(drafters_dir) if drafters_dir else storage.DRAFTERS_DIR
    folder = root / storage.drafter_name(results["config"]["target"])
    written = []
    for method, block in benchmark_blocks(results).items():
        if methods is not None and method not in methods:
            continue
        card_path = folder / method / "card.json"
        if card_path.exists():
            card = json.loads(card_path.read_text())
        elif method in TRAINED and "draft" not in block["settings"]:
            continue  # a trained drafter's card comes with its weights, from training
        else:  # no weights shipped: the card is just the measurement
            card = {"method": method}
            card_path.parent.mkdir(parents=True, exist_ok=True)
        # a composed method's card says how what it measured works now; a trained one keeps its own
        card["how"] = COMPOSED_HOW.get(method) or card.get("how") or method_spec(method).description
        card["benchmark"] = block
        card_path.write_text(json.dumps(card, indent=2) + "\n")
        written.append(card_path)
    return written


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="specdecode record-drafters",
        description="Record a bench run's drafter speedups in the shipped drafters' cards.",
    )
    p.add_argument("results", help="a bench output folder or its results.json")
    p.add_argument("--drafters", default=None, help="drafters folder (default: the package's)")
    p.add_argument(
        "--methods",
        default=None,
        help=f"comma list of the cards to update (default: every one the run measured; of {', '.join(MEASURED)})",
    )
    args = p.parse_args(argv)
    methods = tuple(m.strip() for m in args.methods.split(",")) if args.methods else None
    unknown = set(methods or ()) - set(MEASURED)
    if unknown:
        raise InputError(f"--methods: unknown {', '.join(sorted(unknown))}; choose from {', '.join(MEASURED)}")
    for card in record(args.results, args.drafters, methods):
        print(f"updated {card}")
    return 0
