"""``make demo``: the embedded model on one prompt, plainly and speculatively, side by side."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

# Editing tasks copy much of the prompt into the answer: where prompt lookup shines.
DEMO_PROMPT = (
    "Fix the spelling mistakes in this text and return the corrected text in full:\n\n"
    "Speculative decoding is a tecnique that makes large langauge models generate text faster. "
    "A small draft model proposes several tokens, and the large model checks them all in one "
    "pass. Tokens that match are kept, so the output is exactly the same as before, only "
    "quicker. The speedup depends on how often the draft is right: on editing, summarising and "
    "code tasks the answer repeats much of the prompt, so even a simple lookup in the prompt "
    "makes a good draft. On open-ended writing the draft is rarely right, and a good system "
    "notices this and switches speculation off."
)


def run_demo(args: argparse.Namespace) -> int:
    from specdecode.api import SpeculativeGenerator
    from specdecode.models.loading import load_model
    from specdecode.runtime import set_threads

    console = Console()
    name = args.target or "SmolLM2-135M-Instruct (embedded)"
    console.print(f"[bold]specdecode demo[/bold]: {name}, greedy decoding")
    threads = set_threads(args.threads)
    target = load_model(args.target, dtype=args.dtype)
    backend = getattr(target.model, "backend", "?")
    console.print(f"backend: {backend}, dtype: {args.dtype}, threads: {threads}")
    console.print("prompt:", style="dim")
    console.print(args.prompt or DEMO_PROMPT, markup=False, highlight=False)
    plain = SpeculativeGenerator(target, method="none")
    # --draft: a name (qwen2.5-coder-0.5b) or a path, loaded in the target's dtype
    spec = SpeculativeGenerator(target, method=args.method, k=args.k, draft=args.draft)
    plain.generate("warm up", max_new_tokens=4)  # first-call allocations stay out of the timing
    prompt = args.prompt or DEMO_PROMPT
    runs = {"plain": plain.generate(prompt, max_new_tokens=args.max_new_tokens)}
    runs[f"{spec.method} k={spec.k}"] = spec.generate(prompt, max_new_tokens=args.max_new_tokens)
    for name, out in runs.items():
        console.rule(f"{name} output")
        console.print(out.text, markup=False, highlight=False)
    _summary(console, runs)
    return 0


def _summary(console: Console, runs: dict) -> None:
    table = Table(title="plain vs speculative (same prompt, same model)")
    for col in ("run", "tokens", "tok/s", "target calls", "acceptance", "mean accepted len", "TTFT s"):
        table.add_column(col, justify="right")
    for name, out in runs.items():
        s = out.stats
        table.add_row(
            name,
            str(s["new_tokens"]),
            f"{s['tokens_per_s']:.1f}",
            str(s["target_calls"]),
            f"{s['acceptance_rate']:.0%}",
            f"{s['mean_accepted_length']:.2f}",
            f"{s['ttft_s']:.3f}",
        )
    console.print(table)
    (plain, spec) = runs.values()
    same = plain.token_ids == spec.token_ids
    speedup = spec.stats["tokens_per_s"] / max(plain.stats["tokens_per_s"], 1e-9)
    console.print(f"identical tokens: [bold]{same}[/bold]   speedup: [bold]{speedup:.2f}x[/bold]")
