"""``specdecode train draft-model``: distill a few of the target's layers into a cheap draft model.

    specdecode train draft-model --out runs/draft [--target DIR] [--steps N] [--resume] [--seed S]
                                 [--quick] [--max-minutes M] [--layers 0 1 -1] [--rank R]

Same data (``data.safetensors``, built once; the shard of ``train eagle`` works as is),
checkpoints and resume as ``train eagle``. Ends with held-out acceptance (top-1 agreement on
held-out sequences; mean accepted length of real greedy decoding with the draft-model proposer on
held-out-topic prompts) and the draft's cost next to the target's (multiply-adds and measured
per-token forward time). The folder then holds ``model.safetensors`` (trained deltas, norms and
the draft vocabulary, fp16) and ``card.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from specdecode.networks.draft_model import DistilledDraft, DraftConfig
from specdecode.networks.storage import save_head
from specdecode.train.draft_model import distill_loss, same_sequence
from specdecode.train.trainer import (
    common_arguments,
    common_card,
    common_options,
    draft_vocabulary,
    fit,
    heldout_acceptance,
    heldout_agreement,
    mixed_source,
    report,
    setup_run,
    weighted_tokens,
)

DEFAULT_LAYERS = (0, 1, -1)  # the first two layers and the last: input features and output mapping


def train_draft_model(
    out: str | Path,
    target: str | None = None,
    *,
    steps: int | None = None,
    resume: bool = False,
    seed: int = 0,
    quick: bool = False,
    layers: tuple[int, ...] = DEFAULT_LAYERS,
    rank: int = 128,
    draft_vocab: int = 8192,
    lr: float = 1e-3,
    checkpoint_every: int = 100,
    progress: bool = True,
    stop_at: int | None = None,
    max_minutes: float | None = None,
    chat_weight: float = 0.7,
    **overrides,
) -> dict | None:
    """Distill a draft model for ``target`` (None: the default model) into ``out``; return its card.

    ``stop_at`` (a step) or ``max_minutes`` (of training) interrupt the run cleanly: a checkpoint
    is written and None returned; ``resume=True`` continues it later on the same schedule.
    """
    run = setup_run(out, target, steps, seed, quick, progress, overrides)
    opts, train, held, chat, target_model = run.opts, run.train, run.held, run.chat, run.target
    cfg = DraftConfig.for_target(target_model, tuple(layers), rank, draft_vocab)
    draft = DistilledDraft(cfg)
    with torch.no_grad():
        counts_from = weighted_tokens(train, chat, chat_weight)
        draft.vocab_ids.copy_(draft_vocabulary(counts_from, cfg.draft_vocab, cfg.vocab_size, run.eos))
    draft.attach(target_model)
    draft.init_from_target(target_model)
    total = opts["steps"]

    def step_loss(rng: random.Random) -> tuple[torch.Tensor, dict[str, float]]:
        source = mixed_source(rng, train, chat, chat_weight, opts["seq_len"])
        feats, tokens, valid = source.batch(rng, opts["batch"], opts["seq_len"])
        loss, agree = distill_loss(draft, feats, tokens, valid)
        return loss, {"top1": float(agree)}

    done = fit(
        draft,
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
        desc="train draft-model",
    )
    if done is None:
        return None
    history, train_seconds = done
    _round_to_stored(draft)

    def agreement(feats, tokens, valid):
        with torch.no_grad():
            return float(distill_loss(draft, feats, tokens, valid)[1]), int(same_sequence(valid).sum())

    heldout = {"top1_agreement": heldout_agreement(held, opts["seq_len"], agreement)}
    heldout.update(
        heldout_acceptance(
            run.model_dir, lambda loaded: _proposer(draft, loaded.model), opts["eval_prompts"], opts["eval_tokens"]
        )
    )
    layers = " ".join(str(i) for i in cfg.layers)
    card = common_card(
        run,
        "draft-model",
        lr=lr,
        seed=seed,
        chat_weight=chat_weight,
        draft_vocab=cfg.draft_vocab,
        history=history,
        train_seconds=train_seconds,
        heldout=heldout,
        quick=quick,
        extra_args=f" --layers {layers} --rank {cfg.rank}",
        how=f"layer pruning + distillation: the target's layers {list(cfg.layers)} (of {cfg.target_layers}) with its "
        f"final norm, each matrix plus a trained rank-{cfg.rank} delta, norms trained; loss KL(target || draft) "
        "against the target's next-token distribution over the draft vocabulary (its final norm and LM-head "
        "rows applied to the stored features); input embedding and LM-head rows shared with the target",
    )
    card.update(
        layers=list(cfg.layers), rank=cfg.rank, cost=measure_cost(run.model_dir, draft, repeats=8 if quick else 64)
    )
    save_head(draft, run.out, card)
    return json.loads((run.out / "card.json").read_text())


def _round_to_stored(draft: DistilledDraft) -> None:
    """Round the trained tensors to fp16 (as stored), so that the card measures what ships."""
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(p.half().float())


def _proposer(draft: DistilledDraft, target):
    from specdecode.proposers import DraftModelProposer

    draft.attach(target)
    return DraftModelProposer(draft.to_native(target))


def measure_cost(model_dir: Path, draft: DistilledDraft, repeats: int = 64, context: int = 256) -> dict:
    """The draft's per-token cost next to the target's: multiply-adds, and measured 1-token forward time.

    Both run the native path (prepacked when available) on this process's threads, interleaved so
    that a busy machine slows both alike; times are medians over ``repeats`` rounds.
    """
    from specdecode.models.loading import load_model

    target = load_model(model_dir, backend="native").model
    draft.attach(target)
    small = draft.to_native(target)
    prompt = torch.arange(context).remainder(target.vocab_size).view(1, -1)
    times: dict[str, list[float]] = {"target": [], "draft": []}
    caches = {}
    for name, model in (("target", target), ("draft", small)):
        caches[name] = model.new_cache(context + repeats + 1)
        model.forward(prompt, caches[name], last_only=True)
    token = torch.tensor([[prompt[0, -1].item()]])
    for _ in range(repeats):
        for name, model in (("target", target), ("draft", small)):
            t0 = time.perf_counter()
            model.forward(token, caches[name])
            times[name].append(time.perf_counter() - t0)
    median = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    draft_macs, target_macs = draft.cfg.macs_per_token()
    return {
        "draft_macs_per_token": draft_macs,
        "target_macs_per_token": target_macs,
        "macs_ratio": round(target_macs / draft_macs, 2),
        "draft_ms_per_token": round(1e3 * median["draft"], 3),
        "target_ms_per_token": round(1e3 * median["target"], 3),
        "time_ratio": round(median["target"] / median["draft"], 2),
        "measured": f"median of {repeats} interleaved 1-token forwards after a {context}-token context, "
        f"{torch.get_num_threads()} thread(s)",
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="specdecode train draft-model",
        description="Distill a small draft model (a few of the target's layers) for a target.",
    )
    common_arguments(p, lr=1e-3)
    p.add_argument(
        "--layers",
        type=int,
        nargs="+",
        default=list(DEFAULT_LAYERS),
        help="the target's layers the draft starts from (negative: from the end)",
    )
    p.add_argument("--rank", type=int, default=128, help="rank of the trained delta on every matrix")
    args = p.parse_args(argv)
    card = train_draft_model(args.out, args.target, layers=tuple(args.layers), rank=args.rank, **common_options(args))
    return report(card, args.out)
