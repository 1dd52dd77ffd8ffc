"""``specdecode record-drafters OUT [OUT ...]``: write bench runs' measurements into the shipped cards.

Each measured method's card gets a ``benchmark`` block (and, from cells at a temperature above 0,
a ``sampled_benchmark`` block: what ``auto`` picks for sampled requests) from one side-by-side ``specdecode bench``
run, or from several on the same target (different workloads: the cell with the best geometric
mean over them, each run's own figure kept under ``runs``): its best greedy chain cell overall (the settings it ran with: k, the confidence stop for
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
import math
import shlex
from pathlib import Path
from typing import Any

from specdecode.bench.runner import CONF_SUFFIX, TREE_SUFFIX, base_method, parse_method
from specdecode.core.sampling import is_greedy
from specdecode.errors import InputError
from specdecode.methods import COMPOSED, MEASURED, TRAINED, method_spec
from specdecode.models.catalog import CATALOG
from specdecode.proposers.hybrid import DEFAULT_LOOKUP

COMPOSED_HOW = {
    "hybrid": "a lookup where the context repeats (settings.lookup: suffix decoding drafting 2+ tokens, or n-gram "
    "prompt lookup of the context's last 2+ tokens); else the trained drafter (settings.drafter) with its "
    "confidence stop; a 1-token match when that drafter is unsure",
}


def benchmark_blocks(*runs: dict[str, Any], k: str | None = None, sampled: bool = False) -> dict[str, dict[str, Any]]:
    """The ``benchmark`` block of every method measured greedily (``sampled``: at a temperature
    above 0, the ``sampled_benchmark`` block) in each of ``runs`` (bench
    results on one target, typically different workloads): its chain cell with the best
    geometric-mean speedup over the runs, so that what ``auto`` picks wins across them and a
    near tie on one workload does not decide it. A method that ran with a draft model given by
    path gets none (``auto`` could not load it elsewhere). ``k`` ("auto", or a number): only the
    cells measured at that k (a planned k adapts to a server's load; a fixed k measured on one
    request at a time does not)."""
    if not runs:
        raise InputError("no bench results to record")
    targets = {run["config"]["target"] for run in runs}
    if len(targets) > 1:
        raise InputError(f"the runs measured different targets ({', '.join(sorted(targets))}): record one at a time")
    cells = [_cell_blocks(run, k, sampled) for run in runs]  # per run: method -> cell -> block
    blocks = {}
    for method in MEASURED:
        names = set.intersection(*(set(c.get(method, {})) for c in cells))
        if names:
            best = max(sorted(names), key=lambda n: _geomean([c[method][n]["speedup"] for c in cells]))
            blocks[method] = _merged([c[method][best] for c in cells])
    return blocks


def _cell_blocks(results: dict[str, Any], k: str | None, sampled: bool) -> dict[str, dict[str, dict[str, Any]]]:
    """For each method measured greedily (``sampled``: at a temperature above 0) in one run, a
    block for each of its default chain cells (at ``k`` only, when given)."""
    rows = [a for a in results["aggregates"] if is_greedy(a["temperature"]) != sampled]
    overall = {a["cell"]: a for a in rows if a["category"] == "overall"}
    ngram = max((a["speedup"] for a in overall.values() if a["method"] == "ngram"), default=None)
    config = results["config"]
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for method in MEASURED:
        drafted = _ran_a_draft_model(method, config)
        if drafted and config.get("draft_name") not in CATALOG:
            continue
        for cell in (a for a in overall.values() if _default_chain(a["method"]) == method):
            if k is not None and str(cell["k"]) != k:
                continue
            settings: dict[str, Any] = {"k": cell["k"]}
            if cell["method"].endswith(CONF_SUFFIX):
                settings |= {"policy": "confidence", "confidence": config["confidence"]}
            if method in COMPOSED:  # its drafter, and the lookup a default cell runs
                settings |= {"drafter": config.get("hybrid_drafter"), "lookup": DEFAULT_LOOKUP}
            if drafted:
                settings |= {"draft": config["draft_name"], "draft_dtype": config["draft_dtype"]}
            found.setdefault(method, {})[cell["cell"]] = _block(results, cell, rows, overall, settings, ngram)
    return found


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(max(v, 1e-9)) for v in values) / len(values))


def _merged(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """One block for a cell measured in several runs: geometric means, every run's categories,
    and each run's own speedup, workload and command under ``runs``."""
    if len(blocks) == 1:
        return blocks[0]
    merged = dict(blocks[0])
    for key in ("speedup", "mean_accepted_length"):
        merged[key] = round(_geomean([b[key] for b in blocks]), 3)
    ngrams = [b["ngram_speedup"] for b in blocks]
    merged["ngram_speedup"] = None if None in ngrams else round(_geomean(ngrams), 3)
    for key in ("per_category_speedup", "per_category_mean_accepted_length"):
        merged[key] = {cat: v for b in blocks for cat, v in b[key].items()}
    merged["decoding"] = blocks[0]["decoding"] + "; the geometric mean over the runs below"
    merged["workload"] = " + ".join(b["workload"] for b in blocks)
    merged["command"] = " ; ".join(b["command"] for b in blocks)
    merged["runs"] = [{key: b[key] for key in ("workload", "speedup", "command")} for b in blocks]
    trees = [b.get("tree") for b in blocks]
    merged.pop("tree", None)
    if all(trees):
        merged["tree"] = {
            "speedup": round(_geomean([t["speedup"] for t in trees]), 3),
            "mean_accepted_length": round(_geomean([t["mean_accepted_length"] for t in trees]), 3),
            "k": trees[0]["k"],
        }
    return merged


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
    greedy = is_greedy(best["temperature"])
    top_p = config.get("top_p", 1.0)
    nucleus = f", top-p {top_p:g}" if top_p < 1.0 else ""
    regime = "greedy" if greedy else f"sampled (T={best['temperature']:g}{nucleus})"
    at = "" if greedy else " (each prompt at plain's output length)"
    block = {
        "speedup": round(best["speedup"], 3),
        "mean_accepted_length": round(best["mean_accepted_length"], 3),
        "ngram_speedup": None if ngram is None else round(ngram, 3),
        "settings": settings,
        "cell": best["method"],
        "decoding": f"{regime} chain, native {config['dtype']}; speedup vs plain decoding{at} measured side by "
        "side in the same run",
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
    results: str | Path | list[str | Path],
    drafters_dir: str | Path | None = None,
    methods: tuple[str, ...] | None = None,
    k: str | None = None,
) -> list[Path]:
    """Update the cards of the drafters shipped for the target of ``results`` (one bench run's
    folder or results.json, or several runs on that target: :func:`benchmark_blocks`), only
    ``methods`` when given, so a run that measured some drafters leaves the others' blocks
    alone, and only cells at ``k`` when given; the cards written."""
    from specdecode.networks import storage

    runs = [_load(p) for p in (results if isinstance(results, list) else [results])]
    root = Path(drafters_dir) if drafters_dir else storage.DRAFTERS_DIR
    folder = root / storage.drafter_name(runs[0]["config"]["target"])
    written = []
    for key, sampled in (("benchmark", False), ("sampled_benchmark", True)):
        for method, block in benchmark_blocks(*runs, k=k, sampled=sampled).items():
            if methods is None or method in methods:
                written += _write(folder / method / "card.json", method, key, block)
    return sorted(set(written))


def _write(card_path: Path, method: str, key: str, block: dict[str, Any]) -> list[Path]:
    """Put ``block`` under ``key`` in ``method``'s card; the card written, or none for a trained
    drafter whose card (from training) is not there."""
    if card_path.exists():
        card = json.loads(card_path.read_text())
    elif method in TRAINED and "draft" not in block["settings"]:
        return []  # a trained drafter's card comes with its weights, from training
    else:  # no weights shipped: the card is just the measurement
        card = {"method": method}
        card_path.parent.mkdir(parents=True, exist_ok=True)
    # a composed method's card says how what it measured works now; a trained one keeps its own
    card["how"] = COMPOSED_HOW.get(method) or card.get("how") or method_spec(method).description
    card[key] = block
    card_path.write_text(json.dumps(card, indent=2) + "\n")
    return [card_path]


def _load(results_path: str | Path) -> dict[str, Any]:
    path = Path(results_path)
    path = path / "results.json" if path.is_dir() else path
    if not path.exists():
        raise InputError(f"no results.json at {results_path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: malformed JSON ({exc.msg}, line {exc.lineno})") from None


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="specdecode record-drafters",
        description="Record a bench run's drafter speedups in the shipped drafters' cards.",
    )
    p.add_argument(
        "results",
        nargs="+",
        help="a bench output folder or its results.json; several runs on one target (e.g. HumanEval and "
        "Spec-Bench) record each method's cell with the best geometric-mean speedup over them",
    )
    p.add_argument("--drafters", default=None, help="drafters folder (default: the package's)")
    p.add_argument(
        "--methods",
        default=None,
        help=f"comma list of the cards to update (default: every one the run measured; of {', '.join(MEASURED)})",
    )
    p.add_argument("--k", default=None, help="record only cells measured at this k ('auto', or a number)")
    args = p.parse_args(argv)
    methods = tuple(m.strip() for m in args.methods.split(",")) if args.methods else None
    unknown = set(methods or ()) - set(MEASURED)
    if unknown:
        raise InputError(f"--methods: unknown {', '.join(sorted(unknown))}; choose from {', '.join(MEASURED)}")
    for card in record(args.results, args.drafters, methods, args.k):
        print(f"updated {card}")
    return 0
