"""``specdecode train eagle``: build self-distilled data, train the head, checkpoint, resume, report.

    specdecode train eagle --out runs/eagle [--target DIR] [--steps N] [--resume] [--seed S] [--quick]

The output folder holds ``data.safetensors`` (built once, reused), ``checkpoint.pt`` (every
``--checkpoint-every`` steps; ``--resume`` continues from it) and the final head
(``model.safetensors`` + ``card.json``). Training ends with held-out acceptance: top-1 agreement
with the target on held-out sequences and the mean accepted length of real greedy decoding on
prompts whose topics never appear in the training data.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdecode.errors import ConfigError
from specdecode.networks.eagle_head import EagleHead, HeadConfig
from specdecode.networks.storage import save_head
from specdecode.train import data as data_mod
from specdecode.train.eagle import head_loss

QUICK = dict(
    n_generated=4,
    gen_tokens=24,
    n_chunks=6,
    chunk_chars=600,
    task_share=0.5,
    n_self_instruct=2,
    steps=20,
    batch=4,
    seq_len=32,
    eval_prompts=2,
    eval_tokens=16,
)
# The shipped drafters' shard: 2,400 answers to templated prompts (half of them tasks), 2,000 answers to
# self-instructed prompts and 200 stdlib chunks.
FULL = dict(
    n_generated=2400,
    gen_tokens=160,
    n_chunks=200,
    chunk_chars=1600,
    task_share=0.5,
    n_self_instruct=2000,
    steps=1500,
    batch=8,
    seq_len=256,
    eval_prompts=4,
    eval_tokens=64,
)


class Stream:
    """Training sequences concatenated; random windows; pairs across a boundary are masked."""

    def __init__(self, tensors: dict[str, torch.Tensor], heldout: bool, only: set[int] | None = None) -> None:
        offsets, held = tensors["offsets"].tolist(), tensors["heldout"].tolist()
        keep = [i for i in range(len(held)) if bool(held[i]) == heldout and (only is None or i in only)]
        idx = (
            torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in keep])
            if keep
            else torch.zeros(0, dtype=torch.long)
        )
        self.tokens = tensors["tokens"][idx].long()
        self.features = tensors["features"][idx]
        starts = torch.zeros(len(idx), dtype=torch.bool)
        pos = 0
        for i in keep:
            starts[pos] = True
            pos += offsets[i + 1] - offsets[i]
        self.starts = starts

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def window(self, start: int, length: int):
        sl = slice(start, start + length + 1)
        return self.features[sl].float(), self.tokens[sl], ~self.starts[start + 1 : start + length + 1]

    def batch(self, rng: random.Random, size: int, length: int):
        length = min(length, len(self) - 1)
        parts = [self.window(rng.randrange(len(self) - length), length) for _ in range(size)]
        return tuple(torch.stack(x) for x in zip(*parts))


def _lr(step: int, steps: int, base: float, warmup: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def draft_vocabulary(tokens: torch.Tensor, size: int, vocab: int, always: tuple[int, ...]) -> torch.Tensor:
    """The ``size`` most frequent ids of ``tokens`` (``always`` first), padded with the lowest unused ids."""
    counts = torch.bincount(tokens, minlength=vocab).float()
    counts[list(always)] = float("inf")
    return torch.argsort(counts, descending=True, stable=True)[:size].sort().values


def weighted_tokens(train: Stream, chat: Stream, chat_weight: float) -> torch.Tensor:
    """Training tokens with the target's chat answers counted 20 more times (for the draft vocabulary)."""
    return torch.cat([train.tokens] + [chat.tokens] * 20) if len(chat) and chat_weight > 0 else train.tokens


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed)


def prepare_data(out: Path, model_dir: Path, opts: dict, seed: int, progress: bool) -> tuple[dict, dict, float]:
    """Build ``out/data.safetensors`` once (reused when present) and load it: (tensors, summary, build seconds)."""
    data_path = out / "data.safetensors"
    t0 = time.perf_counter()
    if not data_path.exists():
        data_mod.build_dataset(
            model_dir,
            data_path,
            n_generated=opts["n_generated"],
            gen_tokens=opts["gen_tokens"],
            n_chunks=opts["n_chunks"],
            chunk_chars=opts["chunk_chars"],
            task_share=opts["task_share"],
            n_self_instruct=opts["n_self_instruct"],
            seed=seed if opts.get("data_seed") is None else opts["data_seed"],
            progress=progress,
        )
    data_seconds = time.perf_counter() - t0
    tensors, summary = data_mod.load_dataset(data_path)
    return tensors, summary, data_seconds


@dataclass
class Setup:
    """What every trainer starts from: options, data streams and the frozen target."""

    opts: dict
    out: Path
    model_dir: Path
    summary: dict
    data_seconds: float
    train: Stream
    held: Stream
    chat: Stream  # the target's own chat answers (the shard's first sequences): what decoding sees
    target: Any  # NativeCausalLM, unpacked (trainers read its matrices)
    eos: tuple[int, ...]


def setup_run(
    out: str | Path, target: str | None, steps: int | None, seed: int, quick: bool, progress: bool, overrides: dict
) -> Setup:
    """Options (QUICK or FULL, then ``overrides``), seeds, the data shard (built once) and the target."""
    from specdecode.models.loading import eos_token_ids, load_tokenizer, resolve_model_dir
    from specdecode.models.native import NativeCausalLM

    opts = dict(QUICK if quick else FULL)
    opts.update({k: v for k, v in overrides.items() if v is not None})
    if steps is not None:
        opts["steps"] = steps
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    seed_everything(seed)
    model_dir = resolve_model_dir(target)
    tensors, summary, data_seconds = prepare_data(out, model_dir, opts, seed, progress)
    chat = Stream(tensors, heldout=False, only=set(range(summary.get("generated_sequences", 0))))
    target_model = NativeCausalLM.from_pretrained(model_dir, pack=False)
    eos = eos_token_ids(load_tokenizer(model_dir), target_model.config)
    return Setup(
        opts,
        out,
        Path(model_dir),
        summary,
        data_seconds,
        Stream(tensors, heldout=False),
        Stream(tensors, heldout=True),
        chat,
        target_model,
        eos,
    )


def fit(
    module: torch.nn.Module,
    step_loss: Callable[[random.Random], tuple[torch.Tensor, dict[str, float]]],
    ckpt: Path,
    *,
    steps: int,
    lr: float,
    seed: int,
    resume: bool = False,
    checkpoint_every: int = 100,
    stop_at: int | None = None,
    max_minutes: float | None = None,
    progress: bool = True,
    desc: str = "train",
) -> tuple[list[list[float]], float] | None:
    """Train ``module``'s parameters (AdamW, warmup + cosine LR, gradient clipping at 1) for ``steps``.

    ``step_loss(rng)`` draws a batch with ``rng`` and returns (loss, metrics); the history holds
    [step, loss, *metrics] per step. Checkpoints go to ``ckpt`` every ``checkpoint_every`` steps
    and at the end; ``resume`` continues from it on the same schedule. Returns (history, training
    seconds over all sessions), or None when ``stop_at`` / ``max_minutes`` interrupted the run.
    """
    from tqdm import tqdm

    params = [p for p in module.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(seed)
    start_step, history, train_seconds = 0, [], 0.0
    if resume and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        module.load_state_dict(state["head"])
        optim.load_state_dict(state["optim"])
        start_step, history, train_seconds = state["step"], state["history"], state["train_seconds"]
        rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
    module.train()
    bar = tqdm(range(start_step, steps), desc=desc, initial=start_step, total=steps, disable=not progress)
    t1 = time.perf_counter()
    for step in bar:
        for g in optim.param_groups:
            g["lr"] = _lr(step, steps, lr, warmup=min(50, max(1, steps // 10)))
        loss, metrics = step_loss(rng)
        optim.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        history.append([step, float(loss.detach()), *metrics.values()])
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", **{k: f"{v:.3f}" for k, v in metrics.items()})
        interrupted = (stop_at is not None and step + 1 >= stop_at) or (
            max_minutes is not None and time.perf_counter() - t1 > 60 * max_minutes
        )
        if (step + 1) % checkpoint_every == 0 or step + 1 == steps or interrupted:
            # "head" names the trained module's state (kept so earlier checkpoints still resume).
            torch.save(
                {
                    "head": module.state_dict(),
                    "optim": optim.state_dict(),
                    "step": step + 1,
                    "history": history,
                    "train_seconds": train_seconds + time.perf_counter() - t1,
                    "rng": rng.getstate(),
                    "torch_rng": torch.get_rng_state(),
                },
                ckpt,
            )
        if interrupted and step + 1 < steps:
            bar.close()
            print(f"stopped at step {step + 1}/{steps}; continue with --resume", flush=True)
            return None
    module.eval()
    return history, train_seconds + time.perf_counter() - t1


def train_eagle(
    out: str | Path,
    target: str | None = None,
    *,
    steps: int | None = None,
    resume: bool = False,
    seed: int = 0,
    quick: bool = False,
    draft_vocab: int = 8192,
    lr: float = 5e-4,
    checkpoint_every: int = 100,
    progress: bool = True,
    stop_at: int | None = None,
    max_minutes: float | None = None,
    chat_weight: float = 0.7,
    init_from: str | Path | None = None,
    unroll: int = 1,
    **overrides,
) -> dict | None:
    """Train an EAGLE head for ``target`` (None: the default model) into ``out``; return its card.

    ``stop_at`` (a step) or ``max_minutes`` (of training) interrupt the run cleanly: a checkpoint
    is written and None returned; ``resume=True`` continues it later on the same schedule.
    ``unroll`` > 1 also trains draft depths 2..unroll on the head's own predictions.
    """
    from specdecode.proposers.eagle import EagleProposer

    if unroll < 1:
        raise ConfigError(f"--unroll must be >= 1, got {unroll}")

    run = setup_run(out, target, steps, seed, quick, progress, overrides)
    opts, train, held, chat, target_model = run.opts, run.train, run.held, run.chat, run.target
    cfg = HeadConfig.for_target(target_model, draft_vocab)
    head = EagleHead(cfg)
    with torch.no_grad():
        counts_from = weighted_tokens(train, chat, chat_weight)
        head.vocab_ids.copy_(draft_vocabulary(counts_from, cfg.draft_vocab, cfg.vocab_size, run.eos))
    head.attach(target_model)
    head.init_from_target(target_model)
    if init_from is not None:  # warm start from an earlier head (its layer; this run's vocabulary)
        from specdecode.networks.storage import load_head

        earlier, _ = load_head(init_from)
        state = {k: v for k, v in earlier.state_dict().items() if k != "vocab_ids"}
        head.load_state_dict(state, strict=False)
    scale = float(train.features[:200_000].float().pow(2).mean().sqrt())
    total = opts["steps"]

    def step_loss(rng: random.Random) -> tuple[torch.Tensor, dict[str, float]]:
        source = mixed_source(rng, train, chat, chat_weight, opts["seq_len"])
        feats, tokens, valid = source.batch(rng, opts["batch"], opts["seq_len"])
        loss, reg, ce, agree = head_loss(head, feats, tokens, scale, noise=0.05, valid=valid, depth=unroll)
        return loss, {"reg": float(reg), "ce": float(ce), "top1": float(agree)}

    done = fit(
        head,
        step_loss,
        run.out / "checkpoint.pt",
        steps=total,
        lr=lr,
        seed=seed,
        resume=resume,
        checkpoint_every=checkpoint_every,
        stop_at=stop_at,
        max_minutes=max_minutes,
        progress=progress,
        desc="train eagle",
    )
    if done is None:
        return None
    history, train_seconds = done

    def agreement(feats, tokens, valid):
        return float(head_loss(head, feats, tokens, scale, valid=valid)[3]), int(valid.sum())

    heldout = {"top1_agreement": heldout_agreement(held, opts["seq_len"], agreement)}
    heldout.update(
        heldout_acceptance(
            run.model_dir,
            lambda loaded: EagleProposer(loaded.model, head=head),
            opts["eval_prompts"],
            opts["eval_tokens"],
        )
    )
    card = common_card(
        run,
        "eagle",
        lr=lr,
        seed=seed,
        chat_weight=chat_weight,
        draft_vocab=cfg.draft_vocab,
        history=history,
        train_seconds=train_seconds,
        heldout=heldout,
        quick=quick,
        how="EAGLE-1 style head (fc over [norm(feature), norm(embedding)] + one Llama layer initialised from the "
        "target's last layer), self-distilled: smooth-L1 on the target's pre-norm features + 0.1 x "
        "cross-entropy vs the target's own next-token distribution over the draft vocabulary",
        extra_args=f" --unroll {unroll}" + (f" --init-from {Path(init_from).name}" if init_from else ""),
    )
    card["init_from"] = None if init_from is None else Path(init_from).name
    card["unroll"] = unroll
    save_head(head, run.out, card)
    return json.loads((run.out / "card.json").read_text())


SOURCES = (
    "templated instructions and task prompts over the Python docs' prose, and user turns the target wrote "
    "itself (self-instruct), answered greedily by the target; Python stdlib source chunks (plain and as chat "
    "replies), teacher-forced"
)


def common_card(
    run: Setup,
    method: str,
    *,
    how: str,
    lr: float,
    seed: int,
    chat_weight: float,
    draft_vocab: int,
    history: list,
    train_seconds: float,
    heldout: dict,
    quick: bool,
    extra_args: str = "",
) -> dict:
    """The card fields every trained drafter has; ``extra_args`` ends the reproduce command."""
    from specdecode.networks.storage import drafter_name

    o = run.opts
    data_args = (
        f" --generated {o['n_generated']} --self-instruct {o['n_self_instruct']} --chunks {o['n_chunks']}"
        f" --task-share {o['task_share']}"
    )
    if o.get("data_seed") is not None:
        data_args += f" --data-seed {o['data_seed']}"
    return {
        "method": method,
        "target": run.model_dir.name,
        "target_drafter_name": drafter_name(run.model_dir),
        "how": how,
        "data": dict(run.summary, sources=SOURCES),
        "steps": o["steps"],
        "batch": o["batch"],
        "seq_len": o["seq_len"],
        "lr": lr,
        "seed": seed,
        "chat_weight": chat_weight,
        "draft_vocab": draft_vocab,
        "data_seconds": round(run.data_seconds, 1),
        "train_seconds": round(train_seconds, 1),
        "final_train_loss": history[-1][1] if history else None,
        "heldout": heldout,
        "reproduce": f"specdecode train {method} --out {run.out.name} "
        f"--steps {o['steps']} --seed {seed} --batch {o['batch']} --seq-len {o['seq_len']} --lr {lr} "
        f"--draft-vocab {draft_vocab} --chat-weight {chat_weight}{data_args}{extra_args}"
        + (" --quick" if quick else ""),
    }


def mixed_source(rng: random.Random, train: Stream, chat: Stream, chat_weight: float, seq_len: int) -> Stream:
    """The chat stream with probability ``chat_weight`` (when it holds a window), else the whole training stream."""
    return chat if len(chat) > seq_len + 1 and chat_weight > 0 and rng.random() < chat_weight else train


@torch.no_grad()
def heldout_agreement(held: Stream, seq_len: int, agreement: Callable[..., tuple[float, int]]) -> float | None:
    """Top-1 agreement with the target's next token over the held-out stream, in windows.

    ``agreement(feats, tokens, valid)`` (one window, batch of 1) returns (agreement, positions scored).
    """
    if len(held) < 3:
        return None
    agree, n = 0.0, 0
    for start in range(0, len(held) - 2, seq_len):
        length = min(seq_len, len(held) - 1 - start)
        feats, tokens, valid = held.window(start, length)
        a, w = agreement(feats[None], tokens[None], valid[None])
        agree += a * w
        n += w
    return round(agree / max(n, 1), 4)


def heldout_acceptance(model_dir, make_proposer: Callable, prompts: int, max_new: int, k: int = 4) -> dict:
    """Mean accepted length of real greedy decoding (chain, k) on prompts with held-out topics.

    ``make_proposer(loaded)`` builds the proposer over the freshly loaded native target.
    """
    from specdecode.engine import Decoder, GenerationConfig
    from specdecode.models.loading import load_model

    loaded = load_model(model_dir, backend="native")
    proposer = make_proposer(loaded)
    decoder = Decoder(loaded.model, proposer, k=k, eos_token_ids=loaded.eos_token_ids)
    rounds = tokens = 0
    for text in data_mod.heldout_prompts(prompts):
        ids = data_mod.chat_ids(loaded.tokenizer, text)
        stats = decoder.generate(ids, GenerationConfig(max_new_tokens=max_new)).stats
        rounds += stats["target_calls"]
        tokens += round(stats["mean_accepted_length"] * stats["target_calls"])
    return {
        "mean_accepted_length": round(tokens / max(rounds, 1), 3),
        "k": k,
        "prompts": prompts,
        "max_new_tokens": max_new,
        "decoding": "greedy, chain",
    }


def common_arguments(p: argparse.ArgumentParser, lr: float) -> None:
    """The options every ``specdecode train`` method takes (data, schedule, checkpoints)."""
    p.add_argument("--out", required=True, help="output folder (data, checkpoints, final drafter + card.json)")
    p.add_argument("--target", default=None, help="native target folder or .gguf (default: embedded SmolLM2-135M)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny data and few steps (smoke test)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--generated", type=int, default=None, help="templated prompts answered by the target")
    p.add_argument(
        "--self-instruct",
        type=int,
        default=None,
        help="prompts the target writes itself (Magpie-style), answered by the target",
    )
    p.add_argument("--chunks", type=int, default=None, help="stdlib source chunks")
    p.add_argument(
        "--task-share",
        type=float,
        default=None,
        help="share of generated prompts that are tasks over the Python docs (summaries, context QA, edits, arithmetic)",
    )
    p.add_argument("--data-seed", type=int, default=None, help="seed of the data build (default: --seed)")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--chat-weight", type=float, default=0.7, help="share of batches from the target's chat answers")
    p.add_argument("--max-minutes", type=float, default=None, help="stop (checkpointed) after this much training")


def common_options(args: argparse.Namespace) -> dict:
    """Keyword arguments of a ``train_*`` function from :func:`common_arguments`' options."""
    torch.set_num_threads(args.threads)
    return dict(
        steps=args.steps,
        resume=args.resume,
        seed=args.seed,
        quick=args.quick,
        draft_vocab=args.draft_vocab,
        lr=args.lr,
        checkpoint_every=args.checkpoint_every,
        batch=args.batch,
        seq_len=args.seq_len,
        n_generated=args.generated,
        n_chunks=args.chunks,
        max_minutes=args.max_minutes,
        chat_weight=args.chat_weight,
        task_share=args.task_share,
        data_seed=args.data_seed,
        n_self_instruct=args.self_instruct,
    )


def report(card: dict | None, out: str) -> int:
    """Print a finished run's held-out numbers (nothing for an interrupted one); exit status 0."""
    if card is not None:
        print(json.dumps({"heldout": card["heldout"], "steps": card["steps"], "out": out}, indent=2))
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["draft-model"]:
        from specdecode.train.draft_trainer import main as draft_model_main

        return draft_model_main(argv[1:])
    if argv[:1] == ["medusa"]:
        from specdecode.train.medusa_trainer import main as medusa_main

        return medusa_main(argv[1:])
    if not argv or argv[0] not in ("eagle",):
        print(
            "usage: specdecode train eagle|draft-model|medusa --out DIR [--target DIR] [--steps N] [--resume] [--seed S] [--quick]"
        )
        return 2
    p = argparse.ArgumentParser(
        prog="specdecode train eagle", description="Train an EAGLE draft head by self-distillation."
    )
    common_arguments(p, lr=5e-4)
    p.add_argument("--init-from", default=None, help="warm start from an earlier head folder")
    p.add_argument("--unroll", type=int, default=1, help="also train draft depths 2..N on the head's own predictions")
    args = p.parse_args(argv[1:])
    return report(
        train_eagle(args.out, args.target, init_from=args.init_from, unroll=args.unroll, **common_options(args)),
        args.out,
    )
