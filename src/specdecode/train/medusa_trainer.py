"""``specdecode train medusa``: self-distil Medusa heads for a native target.

    specdecode train medusa --out runs/medusa [--target DIR] [--steps N] [--resume] [--seed S]
                            [--quick] [--max-minutes M] [--heads H]

Same data (``data.safetensors``, built once; the shard of ``train eagle`` works as is),
checkpoints and resume as ``train eagle``. Ends with held-out acceptance: per-head top-1
agreement with the target on held-out sequences, and the mean accepted length of real greedy
decoding (chain, k=4) with the Medusa proposer on held-out-topic prompts. The folder then holds
``model.safetensors`` (the heads' residual blocks and the draft vocabulary, fp16) and ``card.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdecode.networks.medusa_heads import MedusaConfig, MedusaHeads
from specdecode.networks.storage import save_head
from specdecode.train.medusa import LOSS_DECAY, medusa_loss
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

HOW = (
    "Medusa-1 style heads: residual blocks h + SiLU(W h + b) on the target's final-normed last hidden state, "
    "sharing the target's frozen LM head over the draft vocabulary; head i predicts x_{t+2+i}. Self-distilled: "
    f"cross-entropy vs the target's own distribution of that token, head i weighted {LOSS_DECAY}^i"
)


def train_medusa(
    out: str | Path,
    target: str | None = None,
    *,
    steps: int | None = None,
    resume: bool = False,
    seed: int = 0,
    quick: bool = False,
    num_heads: int = 4,
    draft_vocab: int = 8192,
    lr: float = 1e-3,
    checkpoint_every: int = 100,
    progress: bool = True,
    stop_at: int | None = None,
    max_minutes: float | None = None,
    chat_weight: float = 0.7,
    **overrides,
) -> dict | None:
    """Train Medusa heads for ``target`` (None: the default model) into ``out``; return their card.

    The data shard, schedule, checkpoints and interruption contract are
    :func:`~specdecode.train.trainer.train_eagle`'s: ``stop_at`` / ``max_minutes`` write a
    checkpoint and return None, ``resume=True`` continues on the same schedule.
    """
    from specdecode.proposers.medusa import MedusaProposer

    run = setup_run(out, target, steps, seed, quick, progress, overrides)
    opts, train, held, chat, target_model = run.opts, run.train, run.held, run.chat, run.target
    cfg = MedusaConfig.for_target(target_model, num_heads, draft_vocab)
    heads = MedusaHeads(cfg)
    with torch.no_grad():
        heads.vocab_ids.copy_(
            draft_vocabulary(weighted_tokens(train, chat, chat_weight), cfg.draft_vocab, cfg.vocab_size, run.eos)
        )
    heads.attach(target_model)

    def step_loss(rng):
        source = mixed_source(rng, train, chat, chat_weight, opts["seq_len"])
        feats, _tokens, valid = source.batch(rng, opts["batch"], opts["seq_len"])
        loss, ce, agree, _ = medusa_loss(heads, feats, valid)
        return loss, {"ce": float(ce.mean()), **{f"top1_{i}": float(a) for i, a in enumerate(agree)}}

    done = fit(
        heads,
        step_loss,
        run.out / "checkpoint.pt",
        steps=opts["steps"],
        lr=lr,
        seed=seed,
        resume=resume,
        checkpoint_every=checkpoint_every,
        stop_at=stop_at,
        max_minutes=max_minutes,
        progress=progress,
        desc="train medusa",
    )
    if done is None:
        return None
    history, train_seconds = done

    def agreement(head: int):
        """Head ``head``'s top-1 agreement with the target's argmax (draft vocabulary) on one window."""

        def one(feats, _tokens, valid):
            _, _, agree, counts = medusa_loss(heads, feats, valid)
            return (float(agree[head]), counts[head]) if head < len(counts) else (0.0, 0)  # a window too short

        return one

    heldout = {
        "top1_agreement_per_head": [heldout_agreement(held, opts["seq_len"], agreement(i)) for i in range(num_heads)]
    }
    heldout.update(
        heldout_acceptance(
            run.model_dir,
            lambda loaded: MedusaProposer(loaded.model, heads=heads),
            opts["eval_prompts"],
            opts["eval_tokens"],
        )
    )
    card = common_card(
        run,
        "medusa",
        how=HOW,
        lr=lr,
        seed=seed,
        chat_weight=chat_weight,
        draft_vocab=cfg.draft_vocab,
        history=history,
        train_seconds=train_seconds,
        heldout=heldout,
        quick=quick,
        extra_args=f" --heads {num_heads}",
    )
    card["num_heads"] = num_heads
    save_head(heads, run.out, card)
    return json.loads((run.out / "card.json").read_text())


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="specdecode train medusa", description="Train Medusa heads by self-distillation.")
    common_arguments(p, lr=1e-3)
    p.add_argument("--heads", type=int, default=4, help="number of heads (head i predicts x_{t+2+i})")
    args = p.parse_args(argv)
    return report(train_medusa(args.out, args.target, num_heads=args.heads, **common_options(args)), args.out)
