"""Per-cell metrics, ratios against plain, the targets, and the outputs of ``specdecode bench-serve``:
a console table, ``results.json``, ``summary.md``, PNG plots and a self-contained ``report.html``."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from specdecode.bench.report import (
    CSS,
    _html_table,
    _md_table,
    _pct,
    _round,
    sources_text,
    sum_sources,
    top_p_note,
    write_files,
)

if TYPE_CHECKING:
    from specdecode.bench.serve import Arm, LoadPoint, LoadRun

PERCENTILES = (50, 90, 99)
PLOTS = {
    "tok_s_vs_concurrency": "tok_s_vs_concurrency.png",
    "tpot_vs_concurrency": "tpot_vs_concurrency.png",
    "k_vs_batch": "k_vs_batch.png",
    "tok_s_vs_rate": "tok_s_vs_rate.png",
    "tpot_vs_rate": "tpot_vs_rate.png",
}
AUTO = "auto"  # the arm the targets are about: batch-planned k over the best method
TARGETS = {
    "auto_tpot_c1_le_0.7x_plain": "at concurrency 1, auto's TPOT (p50) <= 0.7x plain's",
    "auto_tok_s_ge_0.97x_best_of_plain_and_fixed_k": "at every concurrency, auto's output tok/s >= 0.97x the better "
    "of plain and the best fixed-k cell of the same method",
    "auto_ge_plain_at_c_ge_16": "at concurrency >= 16, auto's output tok/s >= plain's",
}


# -- statistics ---------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100, numpy's linear rule); None if empty, ValueError outside 0..100."""
    return float(np.percentile(values, q)) if values else None


def distribution(seconds: list[float]) -> dict[str, Any]:
    """Mean and p50/p90/p99 in milliseconds (None when nothing was measured)."""
    out: dict[str, Any] = {"n": len(seconds), "mean": sum(seconds) / len(seconds) * 1e3 if seconds else None}
    for q in PERCENTILES:
        v = percentile(seconds, q)
        out[f"p{q}"] = None if v is None else v * 1e3
    return out


def _div(a: float, b: float) -> float | None:
    return a / b if b else None


# -- one cell -----------------------------------------------------------------------------------
def cell_metrics(
    arm: Arm, temperature: float, point: LoadPoint, run: LoadRun, info: dict[str, Any], slo_ms: tuple[float, float]
) -> dict[str, Any]:
    traces = run.traces
    duration = run.t_end - run.t0
    tokens = sum(t.tokens for t in traces)
    completed = sum(t.finished is not None for t in traces)
    stats = [t.stats for t in traces if t.stats]
    drafted = sum(int(s.get("drafted_tokens") or 0) for s in stats)
    accepted = sum(int(s.get("accepted_tokens") or 0) for s in stats)
    calls = sum(int(s.get("target_calls") or 0) for s in stats)
    committed = sum(float(s.get("mean_accepted_length") or 0.0) * int(s.get("target_calls") or 0) for s in stats)
    history = [int(k) for s in stats for k in (s.get("k_history") or [])]
    calls_k = [(float(s["k"]), int(s.get("target_calls") or 0)) for s in stats if "k_history" not in s and "k" in s]
    speculative = arm.method != "none"
    return {
        "key": f"{arm.name}|{point.label}|T={temperature:g}",
        "arm": arm.name,
        "label": arm.label,
        "method": arm.method,
        "kind": arm.kind,
        "policy": arm.policy,
        "fixed_k": arm.fixed_k,
        "k": arm.k,
        "temperature": temperature,
        "load": point.to_dict(),
        "mode": point.mode,
        "concurrency": point.concurrency,
        "rate": point.value if point.mode == "poisson" else None,
        "requests": len(traces),
        "completed": completed,
        "new_tokens": tokens,
        "duration_s": duration,
        "req_per_s": _div(completed, duration),
        "goodput_req_s": _div(sum(meets_slo(t, slo_ms) for t in traces), duration),
        "output_tok_s": _div(tokens, duration),
        "ttft_ms": distribution([t.ttft for t in traces if t.ttft is not None]),
        "tpot_ms": distribution([t.tpot for t in traces if t.tpot is not None]),
        "itl_ms": distribution([g for t in traces for g in t.itl]),
        "e2e_ms": distribution([t.e2e for t in traces if t.e2e is not None]),
        "queue_ms_mean": _div(sum(float(s.get("queue_s") or 0.0) for s in stats) * 1e3, len(stats)),
        "acceptance_rate": _div(accepted, drafted) if speculative else None,
        "mean_accepted_length": (_div(committed, calls) if speculative else 1.0),
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "target_calls": calls,
        "mean_k": _mean_k(history, calls_k) if speculative else None,
        "sources": sum_sources(stats),
        "engine": info,
        "in_flight": {
            "max": max(run.in_flight, default=0),
            "mean": sum(run.in_flight) / len(run.in_flight) if run.in_flight else 0.0,
        },
        "request_records": [t.to_dict(run.t0) for t in traces],
    }


def merge_repeats(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One cell per key (arm, load, temperature), in first-run order.

    Throughput (requests/s, goodput, output tok/s) is pooled over a key's repeated runs: all
    their requests over all their time, the estimate the ratios and targets should use. The
    latencies and engine figures are the median-throughput run's (the lower middle of an even
    count), so each of those comes from one real run. ``repeats`` keeps every run's throughput
    and TPOT p50 for the spread.
    """
    by_key: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_key.setdefault(run["key"], []).append(run)
    cells = []
    for group in by_key.values():
        ranked = sorted(group, key=lambda c: c["output_tok_s"] or 0.0)
        cell = dict(ranked[(len(ranked) - 1) // 2])
        cell["repeats"] = {
            "n": len(group),
            "output_tok_s": [c["output_tok_s"] for c in group],
            "tpot_p50_ms": [c["tpot_ms"]["p50"] for c in group],
        }
        if len(group) > 1:
            time_s = sum(c["duration_s"] for c in group)
            cell["output_tok_s"] = _div(sum(c["new_tokens"] for c in group), time_s)
            cell["req_per_s"] = _div(sum(c["completed"] for c in group), time_s)
            goodput = [c.get("goodput_req_s") for c in group]
            if None not in goodput:
                cell["goodput_req_s"] = _div(sum(g * c["duration_s"] for g, c in zip(goodput, group)), time_s)
        cells.append(cell)
    return cells


def _mean_k(history: list[int], calls_k: list[tuple[float, int]]) -> float:
    """Mean drafts per round: from each round's k, or (over HTTP, where usage reports each
    request's mean k) weighted by the request's rounds."""
    if history:
        return sum(history) / len(history)
    rounds = sum(n for _, n in calls_k)
    return sum(k * n for k, n in calls_k) / rounds if rounds else 0.0


def meets_slo(trace: Any, slo_ms: tuple[float, float]) -> bool:
    """Finished, first token within the TTFT bound and (when it has more than one) TPOT within its bound."""
    ttft, tpot = trace.ttft, trace.tpot
    if trace.finished is None or ttft is None or ttft * 1e3 > slo_ms[0]:
        return False
    return tpot is None or tpot * 1e3 <= slo_ms[1]


# -- across cells -------------------------------------------------------------------------------
def _plain(cells: list[dict[str, Any]], cell: dict[str, Any]) -> dict[str, Any] | None:
    return next(
        (
            c
            for c in cells
            if c["method"] == "none"
            and c["load"]["label"] == cell["load"]["label"]
            and c["temperature"] == cell["temperature"]
        ),
        None,
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(cell: dict[str, Any], plain: dict[str, Any] | None) -> dict[str, float | None]:
    """The cell over plain decoding at the same load point and temperature (throughput: > 1 is
    better; latency: < 1 is better)."""
    if plain is None:
        return {}
    return {
        "output_tok_s": _ratio(cell["output_tok_s"], plain["output_tok_s"]),
        "req_per_s": _ratio(cell["req_per_s"], plain["req_per_s"]),
        "goodput": _ratio(cell.get("goodput_req_s"), plain.get("goodput_req_s")),
        "tpot_p50": _ratio(cell["tpot_ms"]["p50"], plain["tpot_ms"]["p50"]),
        "ttft_p50": _ratio(cell["ttft_ms"]["p50"], plain["ttft_ms"]["p50"]),
        "itl_p50": _ratio(cell["itl_ms"]["p50"], plain["itl_ms"]["p50"]),
        "e2e_p50": _ratio(cell["e2e_ms"]["p50"], plain["e2e_ms"]["p50"]),
    }


def evaluate_targets(cells: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each target's checks (one per temperature, and per concurrency where it says "every"), and
    ``met``: all checks pass (None: nothing to check, e.g. no auto cell or no such concurrency)."""
    closed = [c for c in cells if c["mode"] == "closed"]
    autos = [c for c in closed if c["arm"] == AUTO]
    checks: dict[str, list[dict[str, Any]]] = {name: [] for name in TARGETS}
    for auto in autos:
        plain = _plain(closed, auto)
        if plain is None:
            continue
        c, temp = auto["concurrency"], auto["temperature"]
        where = {"concurrency": c, "temperature": temp}
        if c == 1 and auto["tpot_ms"]["p50"] is not None and plain["tpot_ms"]["p50"]:
            ratio = auto["tpot_ms"]["p50"] / plain["tpot_ms"]["p50"]
            checks["auto_tpot_c1_le_0.7x_plain"].append(
                {
                    **where,
                    "auto_tpot_ms": auto["tpot_ms"]["p50"],
                    "plain_tpot_ms": plain["tpot_ms"]["p50"],
                    "ratio": ratio,
                    "met": ratio <= 0.7,
                }
            )
        fixed = [
            x
            for x in closed
            if x["fixed_k"]
            and x["method"] == auto["method"]
            and x["concurrency"] == c
            and x["temperature"] == temp
            and x["output_tok_s"] is not None
        ]
        best_fixed = max(fixed, key=lambda x: x["output_tok_s"], default=None)
        rival = plain if best_fixed is None or best_fixed["output_tok_s"] <= plain["output_tok_s"] else best_fixed
        checks["auto_tok_s_ge_0.97x_best_of_plain_and_fixed_k"].append(
            {
                **where,
                "auto_tok_s": auto["output_tok_s"],
                "plain_tok_s": plain["output_tok_s"],
                "best_fixed": None if best_fixed is None else best_fixed["arm"],
                "best_fixed_tok_s": None if best_fixed is None else best_fixed["output_tok_s"],
                "rival": rival["arm"],
                "ratio": _ratio(auto["output_tok_s"], rival["output_tok_s"]),
                "met": auto["output_tok_s"] >= 0.97 * rival["output_tok_s"],
            }
        )
        if c >= 16:
            checks["auto_ge_plain_at_c_ge_16"].append(
                {
                    **where,
                    "auto_tok_s": auto["output_tok_s"],
                    "plain_tok_s": plain["output_tok_s"],
                    "ratio": _ratio(auto["output_tok_s"], plain["output_tok_s"]),
                    "met": auto["output_tok_s"] >= plain["output_tok_s"],
                }
            )
    return {
        name: {"target": TARGETS[name], "met": all(x["met"] for x in found) if found else None, "checks": found}
        for name, found in checks.items()
    }


def merged_k_by_batch(cells: list[dict[str, Any]]) -> dict[str, float]:
    """Mean k per batch size over several cells, weighted by requests-steps at each size."""
    sums: dict[int, list[float]] = {}
    for c in cells:
        eng = c.get("engine") or {}
        for b, k in (eng.get("k_by_batch_size") or {}).items():
            weight = int(b) * int((eng.get("batch_steps") or {}).get(b, 0))
            acc = sums.setdefault(int(b), [0.0, 0.0])
            acc[0] += k * weight
            acc[1] += weight
    return {str(b): s / w for b, (s, w) in sorted(sums.items()) if w}


def finish(results: dict[str, Any]) -> None:
    """Ratios against plain, the targets, and k by batch size per method, into ``results``."""
    cells = results["cells"]
    for cell in cells:
        cell["vs_plain"] = ratios(cell, _plain(cells, cell))
    results["targets"] = evaluate_targets(cells)
    results["k_by_batch_size"] = {}
    for arm in results["arms"]:
        if arm["method"] == "none":
            continue
        for temp in results["config"]["temperatures"]:
            chosen = [c for c in cells if c["arm"] == arm["name"] and c["temperature"] == temp]
            results["k_by_batch_size"][f"{arm['name']} T={temp:g}"] = merged_k_by_batch(chosen)


# -- presentation -------------------------------------------------------------------------------
def _ms(d: dict[str, Any]) -> str:
    vals = [d.get(f"p{q}") for q in PERCENTILES]
    return "—" if vals[0] is None else "/".join(f"{v:.0f}" if v >= 100 else f"{v:.1f}" for v in vals)


def _f(v: float | None, digits: int = 2, suffix: str = "") -> str:
    return "—" if v is None else f"{v:.{digits}f}{suffix}"


def _k_by_batch(cell: dict[str, Any], top: int = 4) -> str:
    eng = cell.get("engine") or {}
    k = eng.get("k_by_batch_size") or {}
    if cell["method"] == "none" or not k:
        return "—"
    steps = eng.get("batch_steps") or {}
    busiest = sorted(sorted(k, key=lambda b: -int(steps.get(b, 0)))[:top], key=int)
    return " ".join(f"{b}:{k[b]:.1f}" for b in busiest) + (" …" if len(k) > top else "")


HEADER = [
    "load",
    "method",
    "req/s",
    "goodput/s",
    "tok/s",
    "tok/s vs plain",
    "TTFT ms p50/90/99",
    "TPOT ms p50/90/99",
    "ITL ms p50/90/99",
    "TPOT vs plain",
    "accept",
    "MAL",
    "mean k",
    "k by batch (busiest)",
    "peak MB",
]


def row_cells(c: dict[str, Any]) -> list[str]:
    r = c.get("vs_plain") or {}
    return [
        c["load"]["label"],
        c["arm"],
        _f(c["req_per_s"], 2),
        _f(c.get("goodput_req_s"), 2),
        _f(c["output_tok_s"], 1) + _spread(c),
        _f(r.get("output_tok_s"), 2, "x") if c["method"] != "none" else "1.00x",
        _ms(c["ttft_ms"]),
        _ms(c["tpot_ms"]),
        _ms(c["itl_ms"]),
        _f(r.get("tpot_p50"), 2, "x") if c["method"] != "none" else "1.00x",
        _pct(c["acceptance_rate"]),
        _f(c["mean_accepted_length"], 2),
        _f(c["mean_k"], 1),
        _k_by_batch(c),
        _f(c.get("peak_rss_mb"), 0),
    ]


def _spread(c: dict[str, Any]) -> str:
    """`` (lo-hi)`` over a repeated cell's runs; nothing for a single run."""
    values = [v for v in (c.get("repeats") or {}).get("output_tok_s", []) if v is not None]
    return f" ({min(values):.1f}-{max(values):.1f})" if len(values) > 1 else ""


def _sorted_cells(results: dict[str, Any], temp: float) -> list[dict[str, Any]]:
    order = {a["name"]: i for i, a in enumerate(results["arms"])}
    cells = [c for c in results["cells"] if c["temperature"] == temp]
    return sorted(
        cells,
        key=lambda c: (
            c["mode"] != "closed",
            c["load"].get("concurrency") or c["load"].get("rate"),
            order.get(c["arm"], 99),
        ),
    )


def _verdict(met: bool | None) -> str:
    return "not measured" if met is None else ("met" if met else "MISSED")


def _target_lines(results: dict[str, Any]) -> list[list[str]]:
    rows = []
    for t in results["targets"].values():
        detail = "; ".join(  # every check, the failing ones marked: a verdict alone hides which
            f"c={x['concurrency']} T={x['temperature']:g}: {x['ratio']:.2f}x"
            + (f" vs {x['rival']}" if "rival" in x else "")
            + ("" if x["met"] else " (missed)")
            for x in t["checks"]
            if x.get("ratio") is not None
        )
        rows.append([t["target"], _verdict(t["met"]), detail or "—"])
    return rows


def _host_line(results: dict[str, Any]) -> str:
    h = results["host"]
    return (
        f"{h.get('cpu')} · {h.get('cores')} cores ({h.get('cores_available')} available) · torch {h.get('torch')} with "
        f"{results['config']['torch_threads']} threads · load average {h.get('load_average')} at start, "
        f"{h.get('load_average_end')} at end · Python {h.get('python')} · commit {h.get('git_commit')}"
    )


def _config_line(results: dict[str, Any]) -> str:
    cfg = results["config"]
    return (
        f"target {cfg['target']} ({cfg['backend']}, {cfg['dtype']}) · workload {cfg['workload']} · "
        f"load {', '.join(p['label'] for p in cfg['load_points'])} · requests per cell "
        f"{', '.join(f'{k}: {v}' for k, v in cfg['requests'].items())} · {cfg['max_new_tokens']} new tokens · "
        f"prompts up to {cfg['max_prompt_tokens']} tokens · temperatures "
        f"{', '.join(f'{t:g}' for t in cfg['temperatures'])}{top_p_note(cfg)} · max batch {cfg['max_batch']} · "
        f"seed {cfg['seed']}"
    )


NOTES = (
    "Closed loop c=N: N requests in flight, each replaced as soon as it finishes. Poisson: requests arrive at "
    "seeded exponential gaps; idle gaps are skipped, latencies count from the scheduled arrival. Throughput "
    "is over the cell's wall time (first submission to last finish). TTFT: arrival to the first token's event; "
    "TPOT: per request, (last event - first event) / (tokens - 1); ITL: gaps between a request's consecutive "
    "events, timed with time.perf_counter() as each step's events arrive (a speculative event carries several "
    "tokens). Ratios are against plain decoding at the same load point and temperature in the same run. "
    "k by batch: mean drafts per decoding request by how many requests decoded in the step "
    "(Engine.k_by_batch_size()). Peak MB: the process's peak RSS so far."
)


def summary_markdown(results: dict[str, Any]) -> str:
    parts = [
        "# specdecode bench-serve",
        "",
        f"- command: `{' '.join(results['command'])}`",
        f"- created: {results['created']}; elapsed {results.get('elapsed_s')} s",
        f"- host: {_host_line(results)}",
        f"- config: {_config_line(results)}",
        "",
        "## Methods",
        "",
        _md_table(["name", "what runs"], [[a["name"], a["label"]] for a in results["arms"]]),
        "",
    ]
    if results["skipped"]:
        parts += [f"- skipped `{s['name']}`: {s['reason']}" for s in results["skipped"]] + [""]
    parts += ["## Targets", "", _md_table(["target", "verdict", "measured"], _target_lines(results)), "", NOTES]
    for temp in results["config"]["temperatures"]:
        parts += [
            "",
            f"## Temperature {temp:g}",
            "",
            _md_table(HEADER, [row_cells(c) for c in _sorted_cells(results, temp)]),
        ]
    sources = _sources_lines(results)
    if sources:
        parts += ["", "## Drafting rounds by source", "", *[f"- {line.strip()}" for line in sources[1:]]]
    parts += ["", "## k chosen by batch size (all load points)", ""]
    kb = results["k_by_batch_size"]
    sizes = sorted({int(b) for v in kb.values() for b in v})
    if sizes:
        parts.append(
            _md_table(
                ["method"] + [str(b) for b in sizes],
                [[name] + [_f(v.get(str(b)), 2) for b in sizes] for name, v in kb.items()],
            )
        )
    else:
        parts.append("(no speculative cells)")
    return "\n".join(parts) + "\n"


def make_plots(results: dict[str, Any]) -> dict[str, bytes]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    temps = results["config"]["temperatures"]
    arms = results["arms"]
    cells = results["cells"]
    pngs: dict[str, bytes] = {}
    colors = plt.get_cmap("tab10").colors

    def save(fig: Any, name: str) -> None:
        buf = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buf, format="png", dpi=100)
        plt.close(fig)
        pngs[name] = buf.getvalue()

    def by_load(mode: str, metric: Any, ylabel: str, title: str, name: str, logx: bool) -> None:
        chosen = [c for c in cells if c["mode"] == mode]
        if not chosen:
            return
        fig, axes = plt.subplots(1, len(temps), figsize=(6.0 * len(temps) + 2.0, 4.2), squeeze=False)
        for ax, temp in zip(axes[0], temps):
            for i, arm in enumerate(arms):
                pts = sorted(
                    (
                        (c["load"].get("concurrency") or c["load"].get("rate"), metric(c))
                        for c in chosen
                        if c["arm"] == arm["name"] and c["temperature"] == temp
                    ),
                    key=lambda p: p[0],
                )
                pts = [(x, y) for x, y in pts if y is not None]
                if pts:
                    ax.plot(
                        [x for x, _ in pts],
                        [y for _, y in pts],
                        marker="o",
                        color=colors[i % len(colors)],
                        linestyle="--" if arm["method"] == "none" else "-",
                        label=arm["name"],
                    )
            if logx:
                ax.set_xscale("log", base=2)
                xs = sorted({c["concurrency"] for c in chosen})
                ax.set_xticks(xs, [str(x) for x in xs])
            ax.set_xlabel("concurrency (requests in flight)" if mode == "closed" else "arrival rate (requests/s)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{title}, T={temp:g}")
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        save(fig, name)

    tok_s = lambda c: c["output_tok_s"]
    tpot = lambda c: c["tpot_ms"]["p50"]
    by_load("closed", tok_s, "output tokens/s", "Output tok/s vs concurrency", "tok_s_vs_concurrency", True)
    by_load("closed", tpot, "TPOT p50 (ms)", "TPOT vs concurrency", "tpot_vs_concurrency", True)
    by_load("poisson", tok_s, "output tokens/s", "Output tok/s vs arrival rate", "tok_s_vs_rate", False)
    by_load("poisson", tpot, "TPOT p50 (ms)", "TPOT vs arrival rate", "tpot_vs_rate", False)

    fig, axes = plt.subplots(1, len(temps), figsize=(6.0 * len(temps) + 2.0, 4.2), squeeze=False)
    drawn = False
    for ax, temp in zip(axes[0], temps):
        for i, arm in enumerate(arms):
            k = results["k_by_batch_size"].get(f"{arm['name']} T={temp:g}") or {}
            if arm["method"] == "none" or not k:
                continue
            xs = sorted(int(b) for b in k)
            ax.plot(
                xs, [k[str(b)] for b in xs], marker="o", markersize=3, color=colors[i % len(colors)], label=arm["name"]
            )
            drawn = True
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("batch size (requests decoding in the step)")
        ax.set_ylabel("mean k chosen")
        ax.set_title(f"k chosen vs batch size, T={temp:g}")
        ax.grid(alpha=0.3)
    if drawn:
        axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    else:
        axes[0][0].text(0.5, 0.5, "no speculative cells", ha="center", transform=axes[0][0].transAxes)
    save(fig, "k_vs_batch")
    return pngs


def report_html(results: dict[str, Any], pngs: dict[str, bytes]) -> str:
    esc = html.escape
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        "<title>specdecode bench-serve report</title>",
        f"<style>{CSS}</style></head><body>",
        "<h1>specdecode bench-serve report</h1>",
        (
            f"<p class='meta'>{esc(results['created'])} · <code>{esc(' '.join(results['command']))}</code> · "
            f"elapsed {results.get('elapsed_s')} s</p>"
        ),
        f"<p class='meta'>{esc(_host_line(results))}<br>{esc(_config_line(results))}</p>",
        "<h2>Methods</h2>",
        _html_table(["name", "what runs"], [[a["name"], a["label"]] for a in results["arms"]]),
    ]
    if results["skipped"]:
        parts.append(
            "<ul>"
            + "".join(f"<li>skipped <code>{esc(s['name'])}</code>: {esc(s['reason'])}</li>" for s in results["skipped"])
            + "</ul>"
        )
    parts += [
        "<h2>Targets</h2>",
        _html_table(["target", "verdict", "measured"], _target_lines(results)),
        f"<p>{esc(NOTES)}</p>",
        "<div class='plots'>",
    ]
    titles = {
        "tok_s_vs_concurrency": "Output tok/s vs concurrency",
        "tpot_vs_concurrency": "TPOT vs concurrency",
        "tok_s_vs_rate": "Output tok/s vs arrival rate",
        "tpot_vs_rate": "TPOT vs arrival rate",
        "k_vs_batch": "k chosen vs batch size",
    }
    for name, title in titles.items():
        if name in pngs:
            data = base64.b64encode(pngs[name]).decode("ascii")
            parts.append(f"<h2>{esc(title)}</h2><img alt='{esc(title)}' src='data:image/png;base64,{data}'>")
    parts.append("</div>")
    for temp in results["config"]["temperatures"]:
        parts.append(f"<h2>Temperature {temp:g}</h2>")
        parts.append(_html_table(HEADER, [row_cells(c) for c in _sorted_cells(results, temp)]))
    kb = results["k_by_batch_size"]
    sizes = sorted({int(b) for v in kb.values() for b in v})
    if sizes:
        parts.append("<h2>k chosen by batch size (all load points)</h2>")
        parts.append(
            _html_table(
                ["method"] + [str(b) for b in sizes],
                [[name] + [_f(v.get(str(b)), 2) for b in sizes] for name, v in kb.items()],
            )
        )
    parts.append("<p class='meta'>Per-request records: <code>results.json</code> next to this file.</p></body></html>")
    return "\n".join(parts)


def write_all(results: dict[str, Any], out: Path) -> None:
    write_files(out, results, summary_markdown, make_plots, PLOTS, report_html)


def print_console(results: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    for temp in results["config"]["temperatures"]:
        table = Table(title=f"bench-serve, T={temp:g} (latencies in ms)")
        for name in HEADER:
            table.add_column(
                name, justify="left" if name in ("load", "method", "k by batch (busiest)") else "right", no_wrap=True
            )
        for c in _sorted_cells(results, temp):
            table.add_row(*row_cells(c))
        console.print(table)
    for a in results["arms"]:
        console.print(f"  {a['name']}: {a['label']}")
    for line in _sources_lines(results):
        console.print(line)
    for target, verdict, detail in _target_lines(results):
        console.print(f"target: {target}: {verdict} ({detail})")


def _sources_lines(results: dict[str, Any]) -> list[str]:
    """Which source drafted, for each cell of a composite proposer (the hybrid), under a heading."""
    lines = [
        f"  {c['arm']} {c['load']['label']} T={c['temperature']:g}: " + sources_text(c["sources"])
        for c in results["cells"]
        if c.get("sources")
    ]
    return ["drafting rounds by source (a composite proposer's):", *lines] if lines else []


def summary_json(results: dict[str, Any], out: Path) -> str:
    """The one JSON line that ends stdout."""
    h = results["host"]
    cells, ratio = [], {}
    for c in results["cells"]:
        cells.append(
            {
                "method": c["arm"],
                "load": c["load"]["label"],
                "T": c["temperature"],
                "req_s": _round(c["req_per_s"]),
                "goodput_req_s": _round(c.get("goodput_req_s")),
                "tok_s": _round(c["output_tok_s"], 2),
                "ttft_p50_ms": _round(c["ttft_ms"]["p50"], 1),
                "tpot_p50_ms": _round(c["tpot_ms"]["p50"], 2),
                "tpot_p99_ms": _round(c["tpot_ms"]["p99"], 2),
                "itl_p50_ms": _round(c["itl_ms"]["p50"], 2),
                "accept": _round(c["acceptance_rate"]),
                "mal": _round(c["mean_accepted_length"]),
                "mean_k": _round(c["mean_k"], 2),
            }
        )
        runs = (c.get("repeats") or {}).get("output_tok_s") or []
        if len(runs) > 1:
            cells[-1]["tok_s_runs"] = [_round(v, 2) for v in runs]
        if c["method"] != "none" and c.get("vs_plain"):
            ratio[f"{c['arm']} {c['load']['label']} T={c['temperature']:g}"] = {
                "tok_s": _round(c["vs_plain"]["output_tok_s"]),
                "tpot_p50": _round(c["vs_plain"]["tpot_p50"]),
                "ttft_p50": _round(c["vs_plain"]["ttft_p50"]),
            }
    line = {
        "command": "bench-serve",
        "out": str(out),
        "results": str(out / "results.json"),
        "report": str(out / "report.html"),
        "elapsed_s": results.get("elapsed_s"),
        "host": {
            "cpu": h.get("cpu"),
            "cores": h.get("cores"),
            "cores_available": h.get("cores_available"),
            "torch_threads": results["config"]["torch_threads"],
            "load_average": h.get("load_average"),
        },
        "cells": cells,
        "ratios": ratio,
        "targets": {name: t["met"] for name, t in results["targets"].items()},
        "skipped": [s["name"] for s in results["skipped"]],
    }
    return json.dumps(line)
