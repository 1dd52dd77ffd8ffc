"""Plain-decode throughput, side by side: transformers ``generate`` vs the native path vs llama.cpp.

Runs every variant on the same prompts, interleaved per prompt (so a noisy neighbour hits all of
them alike), then measures the native forward-cost curve over k new tokens, the memory-bandwidth
floor and peak RSS. Prints a table, then one JSON line.

    python -m specdecode.bench.decode [--quick] [--prompts-per-category N] [--workload FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdecode.metrics import peak_rss_mb

Runner = Callable[[list[int], int], list[int]]  # (prompt ids, new tokens) -> generated ids
K_VALUES = (1, 2, 4, 8, 16, 32)
CURVE_CONTEXT = 200  # cached tokens under the forward-cost curve
BATCH_SIZES = (4, 16)  # sequences per forward for the batched-throughput rows


@dataclass
class Prompt:
    category: str
    ids: list[int]


@dataclass
class Timing:
    """Wall time (prefill included) and tokens of one variant over all prompts."""

    seconds: list[float] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return sum(len(t) for t in self.tokens) / sum(self.seconds) if self.seconds else 0.0


def default_workload() -> Path:
    """``../shared/workloads/spec_bench_question.jsonl`` relative to the repository root."""
    return Path(__file__).resolve().parents[3].parent / "shared" / "workloads" / "spec_bench_question.jsonl"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specdecode bench-decode", description=__doc__.splitlines()[0])
    p.add_argument("--workload", type=Path, default=default_workload(), help="JSONL with category and turns")
    p.add_argument("--prompts-per-category", type=int, default=None, help="default 2 (1 with --quick)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 128 (32 with --quick)")
    p.add_argument("--quick", action="store_true", help="1 prompt per category, 32 tokens, no compile")
    p.add_argument("--compile", action="store_true", help="also time torch.compile variants (slow to build)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--model", default=None, help="transformers folder or GGUF (default: embedded SmolLM2)")
    args = p.parse_args(argv)
    args.prompts_per_category = args.prompts_per_category or (1 if args.quick else 2)
    args.max_new_tokens = args.max_new_tokens or (32 if args.quick else 128)
    return args


def load_prompts(path: Path, per_category: int, tokenizer: Any) -> list[Prompt]:
    """The first ``per_category`` rows of each category: first turn, chat template applied."""
    taken: dict[str, int] = {}
    prompts: list[Prompt] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        cat = row["category"]
        if taken.get(cat, 0) >= per_category:
            continue
        taken[cat] = taken.get(cat, 0) + 1
        messages = [{"role": "user", "content": row["turns"][0]}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # some versions return a BatchEncoding
            ids = ids["input_ids"]
        prompts.append(Prompt(cat, list(ids)))
    return prompts


# -- variants ---------------------------------------------------------------------------------


def hf_runner(model_dir: Path) -> Runner:
    """transformers ``generate``, greedy, fp32, exactly ``n`` tokens (EOS suppressed by min_new_tokens)."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def run(ids: list[int], n: int) -> list[int]:
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=model.config.eos_token_id,
            )
        return out[0, len(ids) :].tolist()

    return run


def native_runner(model: Any) -> Runner:
    """Plain greedy decoding through the engine; no EOS ids, so exactly ``n`` tokens."""
    from specdecode.engine import Decoder, GenerationConfig

    decoder = Decoder(model, None, eos_token_ids=())

    def run(ids: list[int], n: int) -> list[int]:
        return decoder.generate(ids, GenerationConfig(max_new_tokens=n)).token_ids

    return run


def llama_cpp_runner(threads: int) -> Runner | None:
    """llama.cpp on the shipped GGUF (quantised, so a speed reference only), or None if not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    from specdecode.models.loading import default_gguf_path

    llm = Llama(model_path=str(default_gguf_path()), n_ctx=4096, n_threads=threads, verbose=False)

    def run(ids: list[int], n: int) -> list[int]:
        out: list[int] = []
        for tok in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, reset=True):
            out.append(int(tok))
            if len(out) == n:
                break
        return out

    return run


def build_variants(args: argparse.Namespace, model_dir: Path, threads: int) -> tuple[dict[str, Runner], dict]:
    """Runners by name, plus the loaded native models (for the forward curve and the floor)."""
    from specdecode.models.native import NativeCausalLM

    runners: dict[str, Runner] = {"transformers fp32": hf_runner(model_dir)}
    natives: dict[str, Any] = {}
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        natives[label] = NativeCausalLM.from_pretrained(model_dir, dtype=dtype)
        runners[f"native {label}"] = native_runner(natives[label])
        if args.compile and not args.quick:
            compiled = NativeCausalLM.from_pretrained(model_dir, dtype=dtype, compile=True)
            runners[f"native {label} compiled"] = native_runner(compiled)
    llama = llama_cpp_runner(threads)
    if llama is not None:
        runners["llama.cpp (GGUF)"] = llama
    return runners, natives


def run_interleaved(runners: dict[str, Runner], prompts: list[Prompt], n: int) -> dict[str, Timing]:
    """Each prompt through every variant, order rotated per prompt; one warm-up call each first."""
    for run in runners.values():
        run(prompts[0].ids, 4)
    names = list(runners)
    timings = {name: Timing() for name in names}
    for i, prompt in enumerate(prompts):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            t = time.perf_counter()
            tokens = runners[name](prompt.ids, n)
            timings[name].seconds.append(time.perf_counter() - t)
            timings[name].tokens.append(tokens)
        print(f"  prompt {i + 1}/{len(prompts)} ({prompt.category}, {len(prompt.ids)} tokens) done", file=sys.stderr)
    return timings


# -- forward cost, floor, agreement -------------------------------------------------------------


def forward_curve(model: Any, reps: int, context: int = CURVE_CONTEXT) -> dict[str, Any]:
    """Median forward time over k new tokens on a ``context``-token cache, and ratios to k = 1."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.vocab_size, (1, context + max(K_VALUES)), generator=g)
    cache = model.new_cache(context + max(K_VALUES))
    model.forward(ids[:, :context], cache)
    samples: dict[int, list[float]] = {k: [] for k in K_VALUES}
    for _ in range(reps + 1):  # the first pass warms up and is dropped
        for k in K_VALUES:  # interleaved: drift hits every k alike
            t = time.perf_counter()
            model.forward(ids[:, context : context + k], cache)
            samples[k].append(time.perf_counter() - t)
            cache.trim(context)
    median = {k: statistics.median(v[1:]) for k, v in samples.items()}
    return {"k1_ms": median[1] * 1e3, "ratio": {k: median[k] / median[1] for k in K_VALUES}}


def batch_throughput(
    model: Any, prompts: list[Prompt], n: int, sizes: tuple[int, ...] = BATCH_SIZES
) -> dict[int, float]:
    """Aggregate tok/s of all prompts decoded together (continuous batching, at most ``size`` at once)."""
    from specdecode.engine import Engine, EngineConfig, GenerationConfig

    ids = [p.ids for p in prompts]
    out = {}
    for size in sizes:
        t = time.perf_counter()
        results = Engine(model, config=EngineConfig(max_batch=size)).generate(ids, GenerationConfig(max_new_tokens=n))
        out[size] = sum(len(r.token_ids) for r in results) / (time.perf_counter() - t)
    return out


def copy_bandwidth_gbs(mib: int = 512, reps: int = 5) -> float:
    """Best memory copy bandwidth, counting bytes read plus bytes written."""
    src = torch.ones(mib * 1024 * 1024 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(reps))
    return 2 * src.numel() * 4 / best / 1e9


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def weight_bytes(model_dir: Path, dtype: torch.dtype) -> int:
    """Bytes of weights read per decode step: every parameter once (a tied matrix once)."""
    from specdecode.models.native import NativeConfig, read_config

    c = NativeConfig.from_dict(read_config(model_dir))
    attn = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * c.hidden_size
    per_layer = attn + 3 * c.hidden_size * c.intermediate_size
    head = c.vocab_size * c.hidden_size
    params = c.num_layers * per_layer + head * (1 if c.tie_word_embeddings else 2)
    # The input embedding is a row gather, not a full read, so only the output head counts.
    read = params - (0 if c.tie_word_embeddings else head)
    return read * torch.finfo(dtype).bits // 8


def agreement(a: list[list[int]], b: list[list[int]], stop: tuple[int, ...] = ()) -> dict[str, Any]:
    """How many prompts decode to identical tokens, and where the others first diverge.

    Each pair is compared up to the first ``stop`` token in ``a``: transformers suppresses EOS to
    force the length while the engine just ignores it, so what follows an EOS may differ.
    """
    first = [_divergence(_until(s, stop), t) for s, t in zip(a, b)]
    return {
        "identical": sum(f is None for f in first),
        "of": len(first),
        "first_divergence": [f for f in first if f is not None],
    }


def _until(tokens: list[int], stop: tuple[int, ...]) -> list[int]:
    return next((tokens[: i + 1] for i, tok in enumerate(tokens) if tok in stop), tokens)


def _divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


# -- report -------------------------------------------------------------------------------------


def render(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    table = Table(title=f"Plain greedy decode, {result['prompts']} prompts x {result['max_new_tokens']} tokens")
    for col in ("variant", "tok/s", "vs transformers"):
        table.add_column(col, justify="right" if col != "variant" else "left")
    for name, tps in result["tok_s"].items():
        table.add_row(name, f"{tps:.1f}", f"{result['speedup_vs_transformers'][name]:.2f}x")
    console.print(table)
    curve = Table(title=f"Native forward cost over k new tokens ({CURVE_CONTEXT}-token cache), ratio to k=1")
    curve.add_column("dtype")
    curve.add_column("k=1 ms", justify="right")
    for k in K_VALUES[1:]:
        curve.add_column(f"k={k}", justify="right")
    for label, c in result["forward_curve"].items():
        curve.add_row(label, f"{c['k1_ms']:.2f}", *(f"{c['ratio'][k]:.2f}" for k in K_VALUES[1:]))
    console.print(curve)
    batch = Table(title="Continuous batching (all prompts, plain greedy), aggregate tok/s")
    batch.add_column("dtype")
    for size in BATCH_SIZES:
        batch.add_column(f"batch {size}", justify="right")
    for label, row in result["batched_tok_s"].items():
        batch.add_row(label, *(f"{row[size]:.1f}" for size in BATCH_SIZES))
    console.print(batch)
    floor = result["floor"]
    console.print(
        f"bandwidth {floor['copy_gbs']:.1f} GB/s (copy, read+write): floor "
        f"{floor['fp32_ms']:.1f} ms/token fp32, {floor['bf16_ms']:.1f} ms/token bf16; "
        f"peak RSS {result['peak_rss_mb']:.0f} MiB"
    )
    for pair, agree in result["agreement"].items():
        console.print(
            f"{pair}: {agree['identical']}/{agree['of']} identical, first divergence {agree['first_divergence']}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    from specdecode.models.loading import load_tokenizer, resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    prompts = load_prompts(args.workload, args.prompts_per_category, load_tokenizer(model_dir))
    runners, natives = build_variants(args, model_dir, threads)
    timings = run_interleaved(runners, prompts, args.max_new_tokens)
    base = timings["transformers fp32"].tok_s
    reps = 5 if args.quick else 15
    result = {
        "bench": "decode",
        "model": str(model_dir),
        "threads": threads,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "tok_s": {name: t.tok_s for name, t in timings.items()},
        "speedup_vs_transformers": {name: t.tok_s / base for name, t in timings.items()},
        "forward_curve": {label: forward_curve(m, reps) for label, m in _curve_models(natives).items()},
        "batched_tok_s": {label: batch_throughput(m, prompts, args.max_new_tokens) for label, m in natives.items()},
        "floor": _floor(model_dir),
        "agreement": {
            "native bf16 vs fp32": agreement(timings["native fp32"].tokens, timings["native bf16"].tokens),
            "native fp32 vs transformers": agreement(
                timings["native fp32"].tokens, timings["transformers fp32"].tokens, _eos_ids(model_dir)
            ),
        },
        "peak_rss_mb": peak_rss_mb(),
    }
    render(result)
    print(json.dumps(result))
    return 0


def _curve_models(natives: dict[str, Any]) -> dict[str, Any]:
    """The loaded models, plus bf16 with one batched attention call per verify (not bitwise equal
    to 1-token decoding; the exact default runs verify attention row by row)."""
    from specdecode.models.native import NativeCausalLM

    bf16 = natives["bf16"]
    batched = NativeCausalLM(bf16.config, bf16.weights, bf16.dtype, row_exact=False)
    return {**natives, "bf16 batched attention": batched}


def _eos_ids(model_dir: Path) -> tuple[int, ...]:
    from specdecode.models.native import read_config

    eos = read_config(model_dir).get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))


def _floor(model_dir: Path) -> dict[str, float]:
    gbs = copy_bandwidth_gbs()
    fp32, bf16 = weight_bytes(model_dir, torch.float32), weight_bytes(model_dir, torch.bfloat16)
    return {"copy_gbs": gbs, "weight_mb_fp32": fp32 / 1e6, "fp32_ms": fp32 / gbs / 1e6, "bf16_ms": bf16 / gbs / 1e6}


if __name__ == "__main__":
    raise SystemExit(main())
