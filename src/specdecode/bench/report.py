"""Aggregates, Markdown summary, PNG plots and a self-contained HTML report for ``specdecode bench``."""

from __future__ import annotations

import base64
import html
import io
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specdecode.core.cost_model import (
    expected_tokens_per_round,
    predict_tokens_per_s,
    speedup_bound,
    tokens_per_call_needed,
)
from specdecode.core.sampling import is_greedy

OVERALL = "overall"
# Cells measured beside ours on the same prompts, for reference: never ranked as our best,
# recommended by ``advise`` or recorded in a card. llama.cpp's come from ``--llama-server``.
REFERENCE_LABELS = {"hf": "hf generate", "llama.cpp": "llama.cpp plain", "llama.cpp-draft": "llama.cpp draft"}


def ours_speculative(method: str) -> bool:
    """Whether cells of ``method`` are our own speculative decoding (not plain, not a reference)."""
    return method != "none" and method not in REFERENCE_LABELS


def reference_stats(
    method: str,
    policy: str,
    prompt_tokens: int,
    new_tokens: int,
    total_s: float,
    ttft_s: float,
    peak_rss_mb: float,
    drafted: int = 0,
    accepted: int = 0,
    prefill_s: float | None = None,
) -> dict[str, Any]:
    """A reference cell's stats record, shaped like the engine's: no stage timings of ours, and
    target calls derived from its counts (each call commits its accepted drafts plus one token)."""
    n = new_tokens
    calls = max(n - accepted, 0)
    return {
        "method": method,
        "k": 0,
        "policy": policy,
        "prompt_tokens": prompt_tokens,
        "new_tokens": n,
        "target_calls": calls,
        "target_calls_per_token": calls / n if n else 0.0,
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": n / calls if calls else 0.0,
        "per_position_acceptance": [],
        "accepted_length_histogram": {},
        "prefill_s": prefill_s,
        "draft_s": None,
        "verify_s": None,
        "overhead_s": None,
        "total_s": total_s,
        "ttft_s": ttft_s,
        "tpot_s": (total_s - ttft_s) / (n - 1) if n > 1 else 0.0,
        "tokens_per_s": n / total_s if total_s else 0.0,
        "peak_rss_mb": round(peak_rss_mb, 1),
    }


PLOTS = {
    "speedup_by_category": "speedup_by_category.png",
    "acceptance_by_position": "acceptance_by_position.png",
    "speedup_vs_k": "speedup_vs_k.png",
}


# -- per-record raw counts ---------------------------------------------------------------------
def position_counts(stats: dict[str, Any]) -> tuple[list[int], list[int]]:
    """(drafted, accepted) counts per draft position, rebuilt exactly from one stats record.

    Accepted at position i <=> the round accepted more than i drafts (the histogram); drafted at
    position i <=> the round drafted more than i (``k_history`` when it holds drafted counts).
    """
    hist = {int(n): int(c) for n, c in (stats.get("accepted_length_histogram") or {}).items()}
    ratios = list(stats.get("per_position_acceptance") or [])
    width = len(ratios)
    accepted = [sum(c for n, c in hist.items() if n > i) for i in range(width)]
    history = [int(k) for k in stats.get("k_history") or []]
    if history and sum(history) == int(stats.get("drafted_tokens", -1)):
        drafted = [sum(1 for k in history if k > i) for i in range(width)]
        return drafted, accepted
    # Older records: denominators from the ratios; a zero-ratio tail shares what is left.
    drafted = [round(a / r) if r > 0 else 0 for a, r in zip(accepted, ratios)]
    zeros = [i for i, r in enumerate(ratios) if r <= 0]
    rest = max(int(stats.get("drafted_tokens", 0)) - sum(drafted), 0)
    for j, i in enumerate(zeros):
        drafted[i] = rest // len(zeros) + (1 if j < rest % len(zeros) else 0)
    return drafted, accepted


def _committed(stats: dict[str, Any]) -> float:
    return float(stats.get("mean_accepted_length") or 0.0) * int(stats.get("target_calls") or 0)


# -- aggregation -------------------------------------------------------------------------------
def aggregate(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per cell x (each category, then overall); speedups against plain on the same prompts."""
    curve = {int(n): float(s) for n, s in results["cost_curve"]["forward_s"].items()}
    records = results["records"]
    by_cell: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        by_cell.setdefault(rec["cell"], []).append(rec)
    rows = []
    scopes = list(results["categories"]) + [OVERALL]
    for cell in results["cells"]:
        plain_key = f"none|k=0|T={cell['temperature']:g}"
        for scope in scopes:
            recs = [r for r in by_cell.get(cell["key"], []) if scope == OVERALL or r["group"] == scope]
            if not recs:
                continue
            plain = {r["prompt_id"]: r for r in by_cell.get(plain_key, []) if scope == OVERALL or r["group"] == scope}
            rows.append(_row(cell, scope, recs, plain, curve))
    return rows


def top_p_note(cfg: dict[str, Any]) -> str:
    """The sampled cells' nucleus filtering, where on (runs before ``--top-p``: off)."""
    top_p = cfg.get("top_p", 1.0)
    return "" if top_p >= 1.0 else f" (sampled with top-p {top_p:g})"


SAMPLED_SPEEDUP = (
    "at T > 0, where samples end at different lengths, plain's time over the cell's time to make plain's "
    "number of tokens on each prompt (its own first-token time plus its own time per later token)."
)


def _at_length(rec: dict[str, Any], n: int) -> float:
    """Seconds ``rec``'s run would have taken to make ``n`` tokens: its own time to the first token
    plus ``n - 1`` of its own later tokens. Sampled runs of the same prompt end at different
    lengths (an EOS drawn early or late), and tokens per second over a run's own length counted a
    long sample's time to the first token over more tokens: a method whose sample happened to run
    long (one RAG answer of 112 tokens against plain's 20) looked several times faster. Its own
    length is kept where it made at most one token (no time per token to scale)."""
    st = rec["stats"]
    own, ttft, total = int(st["new_tokens"]), float(st["ttft_s"]), float(st["total_s"])
    if own <= 1 or n == own:
        return total
    return ttft + (n - 1) * (total - ttft) / (own - 1)


def _sum(recs: list[dict[str, Any]], field: str) -> float:
    return float(sum((r["stats"].get(field) or 0.0) for r in recs))


def sum_sources(stats: list[dict[str, Any]]) -> dict[str, dict[str, float]] | None:
    """A composite proposer's rounds that drafted, tokens drafted and draft seconds, per source
    (the engine's ``stats["sources"]``), summed over requests' ``stats``; None for a proposer
    with one source."""
    total: dict[str, dict[str, float]] = {}
    for st in stats:
        for name, figures in (st.get("sources") or {}).items():
            acc = total.setdefault(name, {"rounds": 0, "drafted": 0, "draft_s": 0.0})
            for field in acc:
                acc[field] += figures.get(field, 0)
    return total or None


def sources_text(sources: dict[str, dict[str, float]]) -> str:
    """Each source's figures in a line, e.g. ``lookup 147 rounds, 641 drafts; drafter 2 rounds, 2 drafts``."""
    return "; ".join(f"{name} {int(f['rounds'])} rounds, {int(f['drafted'])} drafts" for name, f in sources.items())


def sources_line(row: dict[str, Any], with_temp: bool = False) -> str | None:
    """The cell's label and :func:`sources_text`, or None for a proposer with one source."""
    if not row.get("sources"):
        return None
    return f"{cell_label(row, with_temp)}: " + sources_text(row["sources"])


def _row(
    cell: dict[str, Any],
    scope: str,
    recs: list[dict[str, Any]],
    plain: dict[str, dict[str, Any]],
    curve: dict[int, float],
) -> dict[str, Any]:
    tokens = _sum(recs, "new_tokens")
    calls = _sum(recs, "target_calls")
    drafted = _sum(recs, "drafted_tokens")
    accepted = _sum(recs, "accepted_tokens")
    total = _sum(recs, "total_s")
    timed = cell["method"] not in REFERENCE_LABELS  # our own stage timings
    width = max((len(r["stats"].get("per_position_acceptance") or []) for r in recs), default=0)
    pos_d, pos_a = [0] * width, [0] * width
    for r in recs:
        d, a = position_counts(r["stats"])
        for i in range(len(d)):
            pos_d[i] += d[i]
            pos_a[i] += a[i]
    history = [k for r in recs for k in (r["stats"].get("k_history") or [])]
    row: dict[str, Any] = {
        "cell": cell["key"],
        "method": cell["method"],
        "k": cell["k"],
        "temperature": cell["temperature"],
        "category": scope,
        "prompts": len(recs),
        "new_tokens": int(tokens),
        "target_calls": int(calls),
        "target_calls_per_token": _div(calls, tokens),
        "drafted_tokens": int(drafted),
        "accepted_tokens": int(accepted),
        "acceptance_rate": _div(accepted, drafted) if ours_speculative(cell["method"]) or drafted else None,
        "mean_accepted_length": _div(sum(_committed(r["stats"]) for r in recs), calls)
        if cell["method"] != "hf"
        else 1.0,
        "per_position_acceptance": [_div(a, d) for a, d in zip(pos_a, pos_d)],
        "per_position_drafted": pos_d,
        # P(a round accepts more than i drafts), over every target call: what the cost model takes
        "round_acceptance": [_div(a, calls) for a in pos_a],
        "mean_k": _div(sum(history), len(history)) if history else None,
        "sources": sum_sources([r["stats"] for r in recs]),
        "prompt_tokens": sum(int(r.get("prompt_tokens") or 0) for r in recs),
        # prompt positions taken from the prefix cache (ours; llama.cpp's cache_prompt reports none)
        "cached_tokens": sum(int(r["stats"].get("cached_tokens") or 0) for r in recs) if timed else None,
        # positions of its draft model's own reads taken from the draft's store
        "draft_cached_tokens": sum(int(r["stats"].get("draft_cached_tokens") or 0) for r in recs) if timed else None,
        "total_s": total,
        "tokens_per_s": _div(tokens, total),
        "ttft_s": _div(_sum(recs, "ttft_s"), len(recs)),
        "tpot_s": _div(
            sum(r["stats"]["total_s"] - r["stats"]["ttft_s"] for r in recs),
            sum(max(r["stats"]["new_tokens"] - 1, 0) for r in recs),
        ),
        "peak_rss_mb": max(float(r["stats"].get("peak_rss_mb") or 0.0) for r in recs),
    }
    for part in ("prefill_s", "draft_s", "verify_s", "overhead_s"):
        row[part] = _sum(recs, part) if timed else None
        row[part.replace("_s", "_share")] = _div(row[part], total) if timed else None
    # speedup against plain decoding on the prompts both ran
    common = [r for r in recs if r["prompt_id"] in plain]
    base = [plain[r["prompt_id"]] for r in common]
    row["speedup"] = row["time_speedup"] = None
    if common:
        c_tok, c_time = _sum(common, "new_tokens"), _sum(common, "total_s")
        p_tok, p_time = _sum(base, "new_tokens"), _sum(base, "total_s")
        if c_time > 0 and p_time > 0 and p_tok > 0:
            row["speedup"] = (c_tok / c_time) / (p_tok / p_time)
            row["time_speedup"] = p_time / c_time
            if not is_greedy(cell["temperature"]):  # samples end at different lengths: compare at plain's
                row["speedup"] = p_time / sum(_at_length(r, b["stats"]["new_tokens"]) for r, b in zip(common, base))
    row["predicted_speedup"] = row["predicted_tokens_per_s"] = None
    if timed and common and curve:
        pred = _predicted_rate(common, curve, cell["k"])
        pred_plain = _predicted_rate(base, curve, 0)
        if pred and pred_plain:
            row["predicted_tokens_per_s"] = pred
            # at plain's number of tokens, as the measured figure (greedy lengths are equal anyway)
            p_tok = _sum(base, "new_tokens")
            c_time = _sum(common, "prefill_s") + p_tok / pred
            p_time = _sum(base, "prefill_s") + p_tok / pred_plain
            row["predicted_speedup"] = p_time / c_time
    if is_greedy(cell["temperature"]) and cell["method"] != "none" and common:
        row["greedy_match"] = _div(
            sum(r["token_ids"] == plain[r["prompt_id"]]["token_ids"] for r in common), len(common)
        )
    else:
        row["greedy_match"] = None
    return row


def _predicted_rate(recs: list[dict[str, Any]], curve: dict[int, float], k: Any) -> float | None:
    """Decode tokens/s from the cost model: measured acceptance, draft cost, overhead and c(n).

    A fixed-k round that drafted every time is exactly ``predict_tokens_per_s``; rounds that drafted
    fewer (an n-gram miss, the auto policy) are costed at the size of forward they really ran.
    """
    calls = _sum(recs, "target_calls")
    if calls <= 0:
        return None
    overhead = _sum(recs, "overhead_s") / calls
    if k == 0:
        return predict_tokens_per_s(0, [], 0.0, curve, overhead)
    drafted = _sum(recs, "drafted_tokens")
    draft_per_token = _div(_sum(recs, "draft_s"), drafted)
    width = max(len(r["stats"].get("per_position_acceptance") or []) for r in recs)
    pos_a = [0] * width
    history: list[int] = []
    for r in recs:
        _, a = position_counts(r["stats"])
        for i, v in enumerate(a):
            pos_a[i] += v
        history.extend(int(x) for x in r["stats"].get("k_history") or [])
    accept = [a / calls for a in pos_a]
    if isinstance(k, int) and (not history or all(h == k for h in history)):
        return predict_tokens_per_s(k, accept, draft_per_token, curve, overhead)
    if not history or len(history) != calls:
        return None
    k_top = max(history)
    tokens_per_round = expected_tokens_per_round(k_top, accept + [0.0] * (k_top - len(accept))) if k_top else 1.0
    round_s = sum(h * draft_per_token + _forward(curve, h + 1) for h in history) / len(history) + overhead
    return tokens_per_round / round_s


def _forward(curve: dict[int, float], n: int) -> float:
    if n in curve:
        return curve[n]
    top = max(curve)
    return curve[top] * n / top


def _div(a: float | None, b: float | None) -> float:
    return float(a) / float(b) if a is not None and b else 0.0


# -- helpers for presentation ------------------------------------------------------------------
def _multi_temp(results: dict[str, Any]) -> bool:
    return len({c["temperature"] for c in results["cells"]}) > 1


def cell_label(row_or_cell: dict[str, Any], with_temp: bool = False) -> str:
    m, k = row_or_cell["method"], row_or_cell["k"]
    base = {"none": "plain", **REFERENCE_LABELS}.get(m, f"{m}") + (f" k={k}" if k else "")
    return f"{base} T={row_or_cell['temperature']:g}" if with_temp else base


def _x(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}x"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v:.0%}"


def _f(v: float | None, digits: int = 2, scale: float = 1.0) -> str:
    return "—" if v is None else f"{v * scale:.{digits}f}"


def _rows(results: dict[str, Any], scope: str) -> list[dict[str, Any]]:
    return [r for r in results["aggregates"] if r["category"] == scope]


TABLE_COLUMNS = [
    ("cell", "cell"),
    ("prompts", "prompts"),
    ("tokens", "tokens"),
    ("accept", "acceptance"),
    ("MAL", "mean accepted length (bonus included)"),
    ("calls/tok", "target calls per token"),
    ("draft/verify/other/prefill", "time split"),
    ("TTFT ms", "time to first token"),
    ("TPOT ms", "time per output token"),
    ("tok/s", "tokens per second"),
    ("speedup", "vs plain"),
    ("predicted", "cost model"),
    ("same tokens", "greedy output equals plain"),
    ("peak MB", "peak RSS"),
]


def table_cells(row: dict[str, Any], with_temp: bool) -> list[str]:
    if row["draft_share"] is None:
        split = "—"
    else:
        split = "/".join(f"{row[p]:.0%}" for p in ("draft_share", "verify_share", "overhead_share", "prefill_share"))
    label = cell_label(row, with_temp)
    if row.get("mean_k") is not None and row["k"] == "auto":
        label += f" (mean k {row['mean_k']:.1f})"
    return [
        label,
        str(row["prompts"]),
        str(row["new_tokens"]),
        _pct(row["acceptance_rate"]),
        _f(row["mean_accepted_length"]),
        _f(row["target_calls_per_token"], 3),
        split,
        _f(row["ttft_s"], 1, 1000),
        _f(row["tpot_s"], 1, 1000),
        _f(row["tokens_per_s"], 1),
        _x(row["speedup"]),
        _x(row["predicted_speedup"]),
        _pct(row["greedy_match"]),
        _f(row["peak_rss_mb"], 0),
    ]


def _speedup_matrix(results: dict[str, Any]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    scopes = list(results["categories"]) + [OVERALL]
    multi = _multi_temp(results)
    lines = []
    for cell in results["cells"]:
        if cell["method"] == "none":
            continue
        vals = []
        for scope in scopes:
            row = next((r for r in results["aggregates"] if r["cell"] == cell["key"] and r["category"] == scope), None)
            if row is None or row["speedup"] is None:
                vals.append("—")
            elif row["predicted_speedup"] is None:
                vals.append(_x(row["speedup"]))
            else:
                vals.append(f"{_x(row['speedup'])} ({_x(row['predicted_speedup'])})")
        lines.append((cell_label(cell, multi), vals))
    return scopes, lines


# -- Markdown ----------------------------------------------------------------------------------
def _md_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(out)


def summary_markdown(results: dict[str, Any]) -> str:
    cfg, machine = results["config"], results["machine"]
    multi = _multi_temp(results)
    parts = [
        "# specdecode bench",
        "",
        f"- command: `{' '.join(results['command'])}`",
        f"- created: {results['created']}; elapsed {results['run']['elapsed_s']} s "
        f"({results['run']['ran']} runs now, {results['run']['resumed']} resumed)",
        f"- target: `{cfg['target']}` ({cfg['backend']}, {cfg['dtype']})"
        + (f"; draft: `{cfg['draft']}`" if cfg["draft"] else ""),
        f"- workload: `{cfg['workload']}`; {len(results['prompts'])} prompts; max new tokens {cfg['max_new_tokens']}; "
        f"temperatures {', '.join(f'{t:g}' for t in cfg['temperatures'])}{top_p_note(cfg)}; seed {cfg['seed']}",
        f"- machine: {machine['cpu']} ({machine['cpu_count']} CPUs, torch {machine['torch']} with "
        f"{machine['torch_threads']} threads), Python {machine['python']}, {machine['platform']}",
        "",
        "Speedup: tokens/s of the cell over plain decoding's on the same prompts (totals, prefill included); "
        f"{SAMPLED_SPEEDUP} Predicted: the cost model with the measured per-position acceptance, draft cost per token, "
        "per-round overhead and the target's forward-cost curve c(n).",
        "",
        "## Speedup by category — measured (predicted)",
        "",
    ]
    scopes, lines = _speedup_matrix(results)
    parts.append(_md_table(["cell"] + scopes, [[label] + vals for label, vals in lines]))
    header = [c[0] for c in TABLE_COLUMNS]
    for scope in [OVERALL] + list(results["categories"]):
        parts += ["", f"## {scope}", "", _md_table(header, [table_cells(r, multi) for r in _rows(results, scope)])]
    parts += ["", "## Acceptance by draft position (overall)", ""]
    spec_rows = [r for r in _rows(results, OVERALL) if ours_speculative(r["method"])]
    width = max((len(r["per_position_acceptance"]) for r in spec_rows), default=0)
    if width:
        parts.append(
            _md_table(
                ["cell"] + [str(i + 1) for i in range(width)],
                [
                    [cell_label(r, multi)]
                    + [_pct(v) for v in r["per_position_acceptance"]]
                    + ["—"] * (width - len(r["per_position_acceptance"]))
                    for r in spec_rows
                ],
            )
        )
    else:
        parts.append("(no speculative cells)")
    sources = _sources_lines(results, multi)
    if sources:
        parts += ["", "## Sources", "", *[f"- {line}" for line in sources[1:]]]
    bound = ceiling(results)
    if bound is not None:
        parts += ["", "## Ceiling", "", ceiling_sentence(bound)]
    curve = results["cost_curve"]["forward_s"]
    parts += [
        "",
        f"## Target forward cost c(n) after {results['cost_curve']['context_tokens']} cached tokens",
        "",
        _md_table(["n tokens"] + list(curve), [["ms"] + [f"{float(v) * 1000:.2f}" for v in curve.values()]]),
    ]
    if results["skipped_cells"]:
        parts += ["", "## Skipped cells", ""] + [f"- `{s['key']}`: {s['reason']}" for s in results["skipped_cells"]]
    truncated = [p["id"] for p in results["prompts"] if p["truncated"]]
    if truncated:
        parts += ["", f"Prompts left-truncated to fit the model: {', '.join(truncated)}"]
    return "\n".join(parts) + "\n"


CEILING_TARGETS = (1.5, 2.0, 2.5)


def ceiling(results: dict[str, Any]) -> dict[str, Any] | None:
    """What this run's machine and workload allow any drafter at the largest k measured: the speedup
    of perfect, free drafts, and the tokens per call free drafts need for 1.5x / 2x / 2.5x (None:
    out of reach at this k). Prefill (plain decoding's measured share) is never sped up."""
    plain = next((r for r in _rows(results, OVERALL) if r["method"] == "none"), None)
    ks = [c["k"] for c in results["cells"] if isinstance(c.get("k"), int) and ours_speculative(c["method"])]
    if plain is None or plain.get("prefill_share") is None or not ks:
        return None
    k, share = max(ks), plain["prefill_share"]
    curve = {int(n): float(v) for n, v in results["cost_curve"]["forward_s"].items()}

    def bound(prefill: float) -> dict[str, Any]:
        need = {f"{x:g}x": tokens_per_call_needed(x, k, curve, prefill) for x in CEILING_TARGETS}
        return {
            "perfect_drafts_speedup": _round(speedup_bound(k + 1, k, curve, prefill)),
            "mal_needed": {x: None if math.isinf(v) else _round(v, 2) for x, v in need.items()},
        }

    # Decode only: the limit for long outputs, where prefill's share goes to 0.
    return {"k": k, "prefill_share": _round(share), **bound(share), "decode_only": bound(0.0)}


def ceiling_sentence(c: dict[str, Any]) -> str:
    def needs(b: dict[str, Any]) -> str:
        return ", ".join(f"{x} {'out of reach' if v is None else f'MAL {v:.2f}'}" for x, v in b["mal_needed"].items())

    return (
        f"Ceiling at k={c['k']}, drafting for free: with this run's prefill ({c['prefill_share']:.0%} of plain time, "
        f"never sped up) perfect drafts give {c['perfect_drafts_speedup']:.2f}x, and {needs(c)}; decode only "
        f"(long outputs) perfect drafts give {c['decode_only']['perfect_drafts_speedup']:.2f}x, and {needs(c['decode_only'])}."
    )


# -- plots -------------------------------------------------------------------------------------
def make_plots(results: dict[str, Any]) -> dict[str, bytes]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    multi = _multi_temp(results)
    pngs: dict[str, bytes] = {}
    colors = plt.get_cmap("tab20").colors

    def legend(ax: Any) -> None:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)

    def save(fig: Any, name: str) -> None:
        buf = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buf, format="png", dpi=110)
        plt.close(fig)
        pngs[name] = buf.getvalue()

    # 1. speedup by category and method
    scopes = list(results["categories"]) + [OVERALL]
    cells = [c for c in results["cells"] if c["method"] != "none"]
    fig, ax = plt.subplots(figsize=(max(9.0, 1.3 * len(scopes) + 4), 4.4))
    width = 0.8 / max(len(cells), 1)
    for j, cell in enumerate(cells):
        vals = []
        for scope in scopes:
            row = next((r for r in results["aggregates"] if r["cell"] == cell["key"] and r["category"] == scope), None)
            vals.append(row["speedup"] if row and row["speedup"] is not None else math.nan)
        ax.bar(
            [i + (j - (len(cells) - 1) / 2) * width for i in range(len(scopes))],
            vals,
            width,
            label=cell_label(cell, multi),
            color=colors[j % len(colors)],
        )
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
    ax.set_xticks(range(len(scopes)), scopes, rotation=20)
    ax.set_ylabel("speedup vs plain (x)")
    ax.set_title("Measured speedup vs plain decoding, by category")
    legend(ax)
    save(fig, "speedup_by_category")

    # 2. acceptance by position (overall)
    fig, ax = plt.subplots(figsize=(9.0, 4.4))
    drawn = False
    for row in _rows(results, OVERALL):
        ppa = row["per_position_acceptance"]
        if not ours_speculative(row["method"]) or not ppa:
            continue
        ax.plot(range(1, len(ppa) + 1), ppa, marker="o", label=cell_label(row, multi))
        drawn = True
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance (given drafted)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by draft position (overall)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if drawn:
        legend(ax)
    else:
        ax.text(0.5, 0.5, "no speculative cells", ha="center", transform=ax.transAxes)
    save(fig, "acceptance_by_position")

    # 3. speedup vs k (overall), measured solid and predicted dashed; auto as a horizontal line
    fig, ax = plt.subplots(figsize=(9.0, 4.4))
    series: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for row in _rows(results, OVERALL):
        if ours_speculative(row["method"]):
            series.setdefault((row["method"], row["temperature"]), []).append(row)
    for (method, temp), rows in series.items():
        name = f"{method} T={temp:g}" if multi else method
        fixed = sorted((r for r in rows if isinstance(r["k"], int)), key=lambda r: r["k"])
        line = None
        if fixed:
            (line,) = ax.plot(
                [r["k"] for r in fixed], [r["speedup"] or math.nan for r in fixed], marker="o", label=f"{name} measured"
            )
            ax.plot(
                [r["k"] for r in fixed],
                [r["predicted_speedup"] or math.nan for r in fixed],
                marker="x",
                linestyle="--",
                color=line.get_color(),
                label=f"{name} predicted",
            )
        for r in rows:
            if r["k"] == "auto" and r["speedup"] is not None:
                ax.axhline(
                    r["speedup"], linestyle=":", color=line.get_color() if line else None, label=f"{name} k=auto"
                )
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
    fixed_ks = [r["k"] for rows in series.values() for r in rows if isinstance(r["k"], int)]
    if fixed_ks:
        ax.set_xlim(min(fixed_ks) - 0.5, max(fixed_ks) + 0.5)
    ax.set_xlabel("k (draft tokens per round)")
    ax.set_ylabel("speedup vs plain (x)")
    ax.set_title("Speedup vs k (overall): measured solid, predicted dashed, k=auto dotted")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if series:
        legend(ax)
    save(fig, "speedup_vs_k")
    return pngs


# -- HTML --------------------------------------------------------------------------------------
CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px auto;max-width:1280px;color:#1d2330;padding:0 16px}
h1{font-size:1.6em;margin-bottom:4px}h2{font-size:1.2em;margin-top:28px;border-bottom:1px solid #d8dde6;padding-bottom:4px}
table{border-collapse:collapse;font-size:13px;margin:8px 0}th,td{border:1px solid #d8dde6;padding:4px 8px;text-align:right}
th{background:#f1f4f8}td:first-child,th:first-child{text-align:left}tr:nth-child(even) td{background:#fafbfc}
.meta{color:#4a5468;font-size:13px}.plots img{max-width:100%;border:1px solid #e3e7ee;margin:6px 0}
code{background:#f1f4f8;padding:1px 4px;border-radius:3px}.good{color:#0a7d2c;font-weight:600}.bad{color:#b3261e}
"""


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def report_html(results: dict[str, Any], pngs: dict[str, bytes]) -> str:
    cfg, machine = results["config"], results["machine"]
    multi = _multi_temp(results)
    esc = html.escape
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        "<title>specdecode bench report</title>",
        f"<style>{CSS}</style></head><body>",
        "<h1>specdecode bench report</h1>",
        f"<p class='meta'>{esc(results['created'])} · <code>{esc(' '.join(results['command']))}</code></p>",
        "<p class='meta'>",
        f"target <code>{esc(cfg['target'])}</code> ({esc(str(cfg['backend']))}, {esc(cfg['dtype'])})",
        f"{' · draft <code>' + esc(cfg['draft']) + '</code>' if cfg['draft'] else ''}<br>",
        f"workload <code>{esc(cfg['workload'])}</code>: {len(results['prompts'])} prompts in "
        f"{len(results['categories'])} categories · max new tokens {cfg['max_new_tokens']} · seed {cfg['seed']}<br>",
        f"{esc(str(machine['cpu']))} · {machine['cpu_count']} CPUs · torch {esc(machine['torch'])} "
        f"({machine['torch_threads']} threads) · transformers {esc(machine['transformers'])} · Python {esc(machine['python'])}"
        f" · elapsed {results['run']['elapsed_s']} s ({results['run']['ran']} runs, {results['run']['resumed']} resumed)",
        "</p>",
        "<p>Speedup is the cell's tokens/s over plain decoding's on the same prompts, all cells run back to back "
        f"per prompt; {esc(SAMPLED_SPEEDUP)} <em>Predicted</em> comes from the cost model with the measured per-position acceptance, "
        "draft cost per token, per-round overhead and the target's forward-cost curve c(n).</p>",
        "<h2>Speedup by category — measured (predicted)</h2>",
    ]
    scopes, lines = _speedup_matrix(results)
    parts.append(_html_table(["cell"] + scopes, [[label] + vals for label, vals in lines]))
    parts.append("<div class='plots'>")
    for name, title in (
        ("speedup_by_category", "Speedup by category and method"),
        ("speedup_vs_k", "Speedup vs k"),
        ("acceptance_by_position", "Acceptance by position"),
    ):
        if name in pngs:
            data = base64.b64encode(pngs[name]).decode("ascii")
            parts.append(f"<h2>{esc(title)}</h2><img alt='{esc(title)}' src='data:image/png;base64,{data}'>")
    parts.append("</div>")
    header = [c[0] for c in TABLE_COLUMNS]
    for scope in [OVERALL] + list(results["categories"]):
        parts.append(f"<h2>{esc(scope)}</h2>")
        parts.append(_html_table(header, [table_cells(r, multi) for r in _rows(results, scope)]))
    curve = results["cost_curve"]["forward_s"]
    parts.append(f"<h2>Target forward cost c(n) after {results['cost_curve']['context_tokens']} cached tokens</h2>")
    parts.append(_html_table(["n tokens"] + list(curve), [["ms"] + [f"{float(v) * 1000:.2f}" for v in curve.values()]]))
    if results["skipped_cells"]:
        parts.append(
            "<h2>Skipped cells</h2><ul>"
            + "".join(f"<li><code>{esc(s['key'])}</code>: {esc(s['reason'])}</li>" for s in results["skipped_cells"])
            + "</ul>"
        )
    parts.append(
        "<p class='meta'>Raw per-prompt records: <code>results.json</code> and <code>cells.jsonl</code> "
        "next to this file.</p></body></html>"
    )
    return "\n".join(parts)


# -- writing -----------------------------------------------------------------------------------
def write_all(results: dict[str, Any], out: Path) -> None:
    write_files(out, results, summary_markdown, make_plots, PLOTS, report_html)


def write_files(
    out: Path,
    results: dict[str, Any],
    summary: Callable[[dict[str, Any]], str],
    plots: Callable[[dict[str, Any]], dict[str, bytes]],
    plot_files: dict[str, str],
    html_page: Callable[[dict[str, Any], dict[str, bytes]], str],
) -> None:
    """A bench's outputs in ``out``: results.json, summary.md, its PNG plots and report.html."""
    (out / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    (out / "summary.md").write_text(summary(results), encoding="utf-8")
    pngs = plots(results)
    for name, data in pngs.items():
        (out / plot_files[name]).write_bytes(data)
    (out / "report.html").write_text(html_page(results, pngs), encoding="utf-8")


def print_console(results: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    multi = _multi_temp(results)
    table = Table(title="overall (all prompts); time split = draft/verify/other/prefill")
    keep = [i for i, (short, _) in enumerate(TABLE_COLUMNS) if short not in ("tokens", "peak MB")]
    for i in keep:
        short = TABLE_COLUMNS[i][0]
        short = "time split" if short.startswith("draft/") else short
        table.add_column(short, justify="left" if short == "cell" else "right", no_wrap=True)
    for row in _rows(results, OVERALL):
        cells = table_cells(row, multi)
        table.add_row(*[cells[i] for i in keep])
    console.print(table)
    scopes, lines = _speedup_matrix(results)
    matrix = Table(title="speedup vs plain by category: measured (predicted)")
    for name in ["cell"] + scopes:
        matrix.add_column(name, justify="left" if name == "cell" else "right")
    for label, vals in lines:
        matrix.add_row(label, *vals)
    console.print(matrix)
    for line in _sources_lines(results, multi) + _cached_lines(results, multi):
        console.print(line)
    bound = ceiling(results)
    if bound is not None:
        console.print(ceiling_sentence(bound))


def _sources_lines(results: dict[str, Any], multi: bool) -> list[str]:
    """Which source drafted, for each composite proposer's cell (overall), under a heading."""
    lines = [line for row in _rows(results, OVERALL) if (line := sources_line(row, multi))]
    return ["Drafting rounds by source (a composite proposer's):", *lines] if lines else []


def _cached_lines(results: dict[str, Any], multi: bool) -> list[str]:
    """How much of each cell's prompts the prefix cache served (overall), where it served any."""
    rows = [r for r in _rows(results, OVERALL) if r.get("cached_tokens") or r.get("draft_cached_tokens")]
    parts = [
        f"{cell_label(r, multi)} {r['cached_tokens']} of {r['prompt_tokens']}"
        + (f" (its draft model {r['draft_cached_tokens']})" if r.get("draft_cached_tokens") else "")
        for r in rows
    ]
    return ["Prompt tokens from the prefix cache: " + ", ".join(parts)] if parts else []


def summary_line(results: dict[str, Any], out: Path) -> dict[str, Any]:
    multi = _multi_temp(results)
    overall = {}
    for row in _rows(results, OVERALL):
        overall[cell_label(row, multi)] = {
            "speedup": _round(row["speedup"]),
            "predicted_speedup": _round(row["predicted_speedup"]),
            "tokens_per_s": _round(row["tokens_per_s"]),
            "acceptance_rate": _round(row["acceptance_rate"]),
            "mean_accepted_length": _round(row["mean_accepted_length"]),
        }
    spec = [r for r in _rows(results, OVERALL) if ours_speculative(r["method"]) and r["speedup"] is not None]
    best = max(spec, key=lambda r: r["speedup"], default=None)
    return {
        "command": "bench",
        "out": str(out),
        "results": str(out / "results.json"),
        "report": str(out / "report.html"),
        "prompts": len(results["prompts"]),
        "categories": results["categories"],
        "ran": results["run"]["ran"],
        "resumed": results["run"]["resumed"],
        "elapsed_s": results["run"]["elapsed_s"],
        "best": None if best is None else {"cell": cell_label(best, multi), "speedup": _round(best["speedup"])},
        "overall": overall,
        "ceiling": ceiling(results),
    }


def _round(v: float | None, digits: int = 3) -> float | None:
    return None if v is None else round(float(v), digits)
