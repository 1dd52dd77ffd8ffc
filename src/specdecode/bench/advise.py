"""``specdecode advise DIR``: per category, the method and k to use (or "off"), from a bench run."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from specdecode.bench.report import ours_speculative
from specdecode.errors import ConfigError, InputError

MIN_SPEEDUP = 1.05  # below this, a measured gain is within run-to-run noise on a shared CPU


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specdecode advise", description="Recommend a method and k per category from DIR/results.json."
    )
    p.add_argument("dir", help="a bench output folder (holding results.json)")
    p.add_argument("--quick-bench", action="store_true", help="run `specdecode bench --quick --out DIR` first")
    p.add_argument(
        "--min-speedup",
        type=float,
        default=MIN_SPEEDUP,
        help=f"turn speculation on only above this measured speedup (default {MIN_SPEEDUP})",
    )
    p.add_argument("--target", default=None, help="with --quick-bench: target model")
    p.add_argument("--draft", default=None, help="with --quick-bench: draft model (adds method draft)")
    p.add_argument("--workload", default=None, help="with --quick-bench: workload JSONL")
    p.add_argument("--no-hf", action="store_true", help="with --quick-bench: skip transformers generate")
    p.add_argument("--threads", default=None, help="with --quick-bench: torch CPU threads")
    return p


def load_results(folder: Path) -> dict[str, Any]:
    path = folder / "results.json"
    if not path.exists():
        raise InputError(
            f"no results.json in {folder}; run `specdecode bench --out {folder}` first (or add --quick-bench)"
        )
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: malformed JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(results, dict) or "aggregates" not in results or "categories" not in results:
        raise InputError(f"{path}: not a specdecode bench results file")
    return results


def _label(row: dict[str, Any]) -> str:
    return f"{row['method']} k={row['k']}"


def recommend(results: dict[str, Any], min_speedup: float = MIN_SPEEDUP) -> list[dict[str, Any]]:
    """One recommendation per category (then overall) and temperature, best measured cell first."""
    temps = sorted({float(r["temperature"]) for r in results["aggregates"]})
    out = []
    for temp in temps:
        for scope in list(results["categories"]) + ["overall"]:
            rows = [r for r in results["aggregates"] if r["category"] == scope and float(r["temperature"]) == temp]
            spec = [r for r in rows if ours_speculative(r["method"]) and r.get("speedup") is not None]
            name = scope if len(temps) == 1 else f"{scope} (T={temp:g})"
            rec: dict[str, Any] = {"category": scope, "temperature": temp}
            if not spec:
                rec.update(
                    method="off",
                    k=None,
                    measured_speedup=None,
                    predicted_speedup=None,
                    acceptance_rate=None,
                    reason="no speculative cell was measured",
                )
                rec["line"] = f"{name}: off — {rec['reason']}"
                out.append(rec)
                continue
            # A cell that never committed more than one token per target call cannot be faster than
            # plain decoding: any measured gain there is timing noise, so it is never recommended.
            useful = [r for r in spec if (r.get("mean_accepted_length") or 0.0) > 1.0 + 1e-9]
            best = max(useful or spec, key=lambda r: r["speedup"])
            measured, predicted = best["speedup"], best.get("predicted_speedup")
            acc = best.get("acceptance_rate") or 0.0
            rec.update(
                measured_speedup=round(measured, 3),
                acceptance_rate=None if acc is None else round(acc, 3),
                predicted_speedup=None if predicted is None else round(predicted, 3),
                prompts=best["prompts"],
            )
            pred = f"predicted {predicted:.2f}x" if predicted is not None else "no prediction"
            if not useful:
                rec.update(method="off", k=None)
                rec["reason"] = (
                    f"no draft was ever accepted (best measured {measured:.2f}x, {_label(best)}, "
                    "is timing noise): speculation cannot pay"
                )
                rec["line"] = f"{name}: off — {rec['reason']}"
            elif measured >= min_speedup:
                rec.update(method=best["method"], k=best["k"])
                extra = (
                    f"; mean k {best['mean_k']:.1f}" if best["k"] == "auto" and best.get("mean_k") is not None else ""
                )
                rec["reason"] = f"measured {measured:.2f}x, {pred}; acceptance {acc:.0%}{extra}"
                rec["line"] = f"{name}: {_label(best)} — {rec['reason']}"
            else:
                rec.update(method="off", k=None)
                why = "speculation does not pay" if measured < 1.0 else f"gain below {min_speedup:.2f}x is within noise"
                rec["reason"] = f"best measured {measured:.2f}x ({_label(best)}, {pred}; acceptance {acc:.0%}): {why}"
                rec["line"] = f"{name}: off — {rec['reason']}"
            if useful and predicted and measured and max(measured / predicted, predicted / measured) > 1.5:
                rec["noisy"] = True
                rec["line"] += "; measured and predicted disagree by over 1.5x: noisy timings, re-run with more prompts"
            if best["prompts"] < 3:
                rec["line"] += f" [only {best['prompts']} prompt{'s' if best['prompts'] != 1 else ''}]"
            out.append(rec)
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if not args.min_speedup > 0:
        raise ConfigError(f"--min-speedup must be > 0, got {args.min_speedup}")
    folder = Path(args.dir)
    if args.quick_bench:
        from specdecode.bench import runner

        bench_argv = ["--quick", "--out", str(folder)]
        for flag, value in (
            ("--target", args.target),
            ("--draft", args.draft),
            ("--workload", args.workload),
            ("--threads", args.threads),
        ):
            if value:
                bench_argv += [flag, value]
        if args.no_hf:
            bench_argv.append("--no-hf")
        with contextlib.redirect_stdout(sys.stderr):  # one JSON line on stdout: advise's
            runner.main(bench_argv)
    results = load_results(folder)
    recs = recommend(results, args.min_speedup)
    print(
        f"advice from {folder / 'results.json'} ({len(results.get('prompts', []))} prompts; "
        f"speculation on only above {args.min_speedup:.2f}x measured):"
    )
    for rec in recs:
        print("  " + rec["line"])
    summary = {
        "command": "advise",
        "results": str(folder / "results.json"),
        "min_speedup": args.min_speedup,
        "recommendations": [{k: v for k, v in rec.items() if k != "line"} for rec in recs],
    }
    print(json.dumps(summary), flush=True)
    return 0
