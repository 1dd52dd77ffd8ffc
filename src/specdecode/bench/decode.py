"""Plain-decode throughput, side by side: transformers ``generate`` vs the native path vs llama.cpp.

Runs every variant on the same prompts, interleaved per prompt (so a noisy neighbour hits all of
them alike), then measures the native forward-cost curve over k new tokens, the memory-bandwidth
floor and peak RSS. Prints a table, then one JSON line.

    python -m specdecode.bench.decode [--quick] [--prompts-per-category N] [--workload FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdecode.core.dtypes import QUANT_DTYPES
from specdecode.metrics import peak_rss_mb
from specdecode.models import hugepages
from specdecode.models.quant import act_dtype

Runner = Callable[[list[int], int], list[int]]  # (prompt ids, new tokens) -> generated ids
K_VALUES = (1, 2, 4, 8, 16, 32)
CURVE_CONTEXT = 200  # cached tokens under the forward-cost curve
BATCH_SIZES = (4, 16)  # sequences per forward for the batched-throughput rows
PAGES_4K = "@4k"  # a variant suffix: the same weights left on 4 KiB pages, to price huge pages side by side
NATIVE_DTYPES = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None)} | {
    q: (act_dtype(q), q) for q in QUANT_DTYPES
}


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
    p.add_argument("--model", default=None, help="GGUF, catalog name or transformers folder (default: SmolLM2)")
    p.add_argument(
        "--dtypes",
        default="fp32,bf16,int8,int4",
        help=f"native variants, comma-separated; DTYPE{PAGES_4K} keeps that variant's weights off huge pages",
    )
    p.add_argument("--no-transformers", action="store_true", help="skip transformers generate (large models)")
    p.add_argument("--llama-bench", default=None, help="path of a llama-bench binary: llama.cpp on the same GGUF")
    p.add_argument("--skip-batched", action="store_true", help="skip the continuous-batching rows")
    args = p.parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = [d for d in args.dtypes if d.removesuffix(PAGES_4K) not in NATIVE_DTYPES]
    if unknown:
        p.error(
            f"unknown dtype {unknown[0]!r} in --dtypes; choose from {', '.join(NATIVE_DTYPES)} (each may end {PAGES_4K})"
        )
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

    decoder = Decoder(model, None, eos_token_ids=(), prefix_cache_mb=0)  # every run prefills its prompt

    def run(ids: list[int], n: int) -> list[int]:
        return decoder.generate(ids, GenerationConfig(max_new_tokens=n)).token_ids

    return run


def llama_cpp_runner(threads: int, model_dir: Path) -> Runner | None:
    """llama.cpp (the ``llama-cpp-python`` extra) on the same GGUF, or None if either is missing."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    from specdecode.models.loading import gguf_source

    gguf = gguf_source(model_dir)
    if gguf is None:
        return None
    llm = Llama(model_path=str(gguf), n_ctx=4096, n_threads=threads, verbose=False)

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
    from specdecode.models.loading import transformers_dir
    from specdecode.models.native import NativeCausalLM

    runners: dict[str, Runner] = {}
    if not args.no_transformers:
        runners["transformers fp32"] = hf_runner(transformers_dir(model_dir))
    natives: dict[str, Any] = {}
    for label in args.dtypes:
        dtype, quant = NATIVE_DTYPES[label.removesuffix(PAGES_4K)]
        with hugepages.off() if label.endswith(PAGES_4K) else contextlib.nullcontext():
            natives[label] = NativeCausalLM.from_pretrained(model_dir, dtype=dtype, quant=quant)
        runners[f"native {label}"] = native_runner(natives[label])
        if args.compile and not args.quick and quant is None:
            compiled = NativeCausalLM.from_pretrained(model_dir, dtype=dtype, compile=True)
            runners[f"native {label} compiled"] = native_runner(compiled)
    llama = llama_cpp_runner(threads, model_dir)
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
        results = Engine(model, config=EngineConfig(max_batch=size, prefix_cache_mb=0)).generate(
            ids, GenerationConfig(max_new_tokens=n)
        )
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


def llama_bench(binary: str, model_dir: Path, threads: int, n: int, prompt: int = 256) -> dict[str, Any]:
    """llama.cpp's own benchmark on the same GGUF and thread count: decode (tg) and prefill (pp) tok/s."""
    import subprocess

    from specdecode.models.loading import gguf_source

    gguf = gguf_source(model_dir)
    if gguf is None:
        return {"error": "the model is not a GGUF file"}
    env = dict(os.environ, LD_LIBRARY_PATH=str(Path(binary).resolve().parent))
    cmd = [binary, "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(n), "-r", "3", "-o", "json"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, check=True)
        rows = json.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    out: dict[str, Any] = {"command": " ".join(cmd)}
    for row in rows:
        key = "tg_tok_s" if row.get("n_gen") else "pp_tok_s"
        out[key] = float(row["avg_ts"])
    return out


def ops_per_token(model: Any, context: int = 32) -> int:
    """ATen ops dispatched by one 1-token decode forward (after a ``context``-token prefill)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    cache = model.new_cache(context + 1)
    model.forward(torch.zeros(1, context, dtype=torch.long), cache)
    with Count():
        model.forward(torch.zeros(1, 1, dtype=torch.long), cache)
    return Count.n


def matrix_bytes(model: Any) -> int:
    """Bytes of matrices one decode step reads (every layer matrix and the output head)."""
    from specdecode.models.native import matrices
    from specdecode.models.quant import QuantMatrix

    return sum(
        m.nbytes if isinstance(m, QuantMatrix) else m.numel() * m.element_size() for m in matrices(model.weights)
    )


def render(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    console.print(f"host: {result['host']}, {result['threads']} threads")
    table = Table(title=f"Plain greedy decode, {result['prompts']} prompts x {result['max_new_tokens']} tokens")
    for col in ("variant", "tok/s (prefill incl.)", f"vs {result['baseline']}", "decode only tok/s", "vs llama.cpp"):
        table.add_column(col, justify="right" if col != "variant" else "left")
    llama = result.get("llama_cpp") or {}
    for name, tps in result["tok_s"].items():
        label = name.removeprefix("native ")
        dec = result["decode_only_tok_s"].get(label) if name.startswith("native ") else None
        vs = result.get("vs_llama_cpp_decode", {}).get(label)
        table.add_row(
            name,
            f"{tps:.1f}",
            f"{result['speedup_vs_baseline'][name]:.2f}x",
            "" if dec is None else f"{dec:.1f}",
            "" if vs is None else f"{vs:.2f}x",
        )
    if "tg_tok_s" in llama:
        table.add_row("llama.cpp (llama-bench)", "", "", f"{llama['tg_tok_s']:.1f}", "1.00x")
    console.print(table)
    if llama.get("error"):
        console.print(f"llama-bench: {llama['error']}")
    elif "pp_tok_s" in llama:
        console.print(f"llama.cpp prefill {llama['pp_tok_s']:.0f} tok/s ({llama['command']})")
    curve = Table(title=f"Native forward cost over k new tokens ({CURVE_CONTEXT}-token cache), ratio to k=1")
    curve.add_column("dtype")
    curve.add_column("k=1 ms", justify="right")
    for k in K_VALUES[1:]:
        curve.add_column(f"k={k}", justify="right")
    for label, c in result["forward_curve"].items():
        curve.add_row(label, f"{c['k1_ms']:.2f}", *(f"{c['ratio'][k]:.2f}" for k in K_VALUES[1:]))
    console.print(curve)
    if result["batched_tok_s"]:
        batch = Table(title="Continuous batching (all prompts, plain greedy), aggregate tok/s")
        batch.add_column("dtype")
        for size in BATCH_SIZES:
            batch.add_column(f"batch {size}", justify="right")
        for label, row in result["batched_tok_s"].items():
            batch.add_row(label, *(f"{row[size]:.1f}" for size in BATCH_SIZES))
        console.print(batch)
    floor = result["floor"]
    per = ", ".join(
        f"{label} {mb:.0f} MB -> {floor['floor_ms'][label]:.1f} ms ({result['ops_per_token'][label]} ops/token)"
        for label, mb in floor["matrix_mb"].items()
    )
    console.print(f"bandwidth {floor['copy_gbs']:.1f} GB/s (copy, read+write); matrices per token: {per}")
    console.print(f"peak RSS {result['peak_rss_mb']:.0f} MiB")
    for label, kernels in result["kernels"].items():
        console.print(f"kernels {label}: " + "; ".join(f"{k}: {v}" for k, v in kernels.items()))
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

    model_dir = resolve_model_dir(args.model, weights=False)
    prompts = load_prompts(args.workload, args.prompts_per_category, load_tokenizer(model_dir))
    runners, natives = build_variants(args, model_dir, threads)
    timings = run_interleaved(runners, prompts, args.max_new_tokens)
    base_name = "transformers fp32" if "transformers fp32" in timings else next(iter(timings))
    base = timings[base_name].tok_s
    reps = 5 if args.quick else 15
    llama = llama_bench(args.llama_bench, model_dir, threads, args.max_new_tokens) if args.llama_bench else None
    result = {
        "bench": "decode",
        "model": str(model_dir),
        "host": host_description(),
        "threads": threads,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "tok_s": {name: t.tok_s for name, t in timings.items()},
        "baseline": base_name,
        "speedup_vs_baseline": {name: t.tok_s / base for name, t in timings.items()},
        "decode_only_tok_s": {
            label: decode_only_tok_s(m, prompts[0].ids, args.max_new_tokens) for label, m in natives.items()
        },
        "llama_cpp": llama,
        "forward_curve": {label: forward_curve(m, reps) for label, m in _curve_models(natives).items()},
        "batched_tok_s": {}
        if args.skip_batched
        else {label: batch_throughput(m, prompts, args.max_new_tokens) for label, m in natives.items()},
        "ops_per_token": {label: ops_per_token(m) for label, m in natives.items()},
        "kernels": {label: m.kernels() for label, m in natives.items()},
        "floor": _floor(natives),
        "agreement": _agreements(timings, model_dir),
        "peak_rss_mb": peak_rss_mb(),
    }
    if llama and "tg_tok_s" in llama:
        result["vs_llama_cpp_decode"] = {k: v / llama["tg_tok_s"] for k, v in result["decode_only_tok_s"].items()}
    render(result)
    print(json.dumps(result))
    return 0


def decode_only_tok_s(model: Any, ids: list[int], n: int) -> float:
    """Tokens per second of 1-token decode steps alone (prefill excluded), as llama-bench's tg."""
    cache = model.new_cache(len(ids) + n + 1)
    logits = model.forward(torch.tensor([ids]), cache)
    tok = int(logits[0, -1].argmax())
    t = time.perf_counter()
    for _ in range(n):
        tok = int(model.forward(torch.tensor([[tok]]), cache)[0, -1].argmax())
    return n / (time.perf_counter() - t)


def host_description() -> str:
    """CPU model and the vector/matrix extensions torch may use, for every recorded figure."""
    from specdecode.models.kernels import cpu_info

    model, flags = cpu_info()
    ext = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8") if f in flags.split()]
    return f"{model}; {len(os.sched_getaffinity(0))} cores; {' '.join(ext)}; torch {torch.__version__}"


def _agreements(timings: dict[str, Timing], model_dir: Path) -> dict[str, Any]:
    out = {}
    if "native fp32" in timings:
        for other in (n for n in timings if n.startswith("native ") and n != "native fp32"):
            out[f"{other} vs fp32"] = agreement(timings["native fp32"].tokens, timings[other].tokens)
        if "transformers fp32" in timings:
            out["native fp32 vs transformers"] = agreement(
                timings["native fp32"].tokens, timings["transformers fp32"].tokens, _eos_ids(model_dir)
            )
    return out


def _curve_models(natives: dict[str, Any]) -> dict[str, Any]:
    """The loaded models, plus bf16 with one batched attention call per verify (not bitwise equal
    to 1-token decoding; the exact default runs verify attention row by row)."""
    from specdecode.models.native import NativeCausalLM

    if "bf16" not in natives:
        return dict(natives)
    bf16 = natives["bf16"]
    batched = NativeCausalLM(bf16.config, bf16.weights, bf16.dtype, row_exact=False)
    return {**natives, "bf16 batched attention": batched}


def _eos_ids(model_dir: Path) -> tuple[int, ...]:
    from specdecode.models.native import read_config

    eos = read_config(model_dir).get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))


def _floor(natives: dict[str, Any]) -> dict[str, Any]:
    """Copy bandwidth and, per variant, the matrix bytes a decode step reads and the time floor."""
    gbs = copy_bandwidth_gbs()
    mb = {label: matrix_bytes(m) / 1e6 for label, m in natives.items()}
    return {"copy_gbs": gbs, "matrix_mb": mb, "floor_ms": {label: v / gbs for label, v in mb.items()}}


if __name__ == "__main__":
    raise SystemExit(main())
