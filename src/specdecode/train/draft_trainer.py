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

from specdecode.train.draft_model import DistilledDraft, DraftConfig, distill_loss, same_sequence
from specdecode.train.eagle import save_head
from specdecode.train.trainer import (
    FULL, QUICK, Stream, common_arguments, common_options, draft_vocabulary, fit, heldout_acceptance,
    heldout_agreement, mixed_source, prepare_data, report, seed_everything, weighted_tokens,
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
    train, held = Stream(tensors, heldout=False), Stream(tensors, heldout=True)
    chat = Stream(tensors, heldout=False, only=set(range(summary.get("generated_sequences", 0))))

    target_model = NativeCausalLM.from_pretrained(model_dir, pack=False)
    eos = eos_token_ids(load_tokenizer(model_dir), target_model.config)
    cfg = DraftConfig.for_target(target_model, tuple(layers), rank, draft_vocab)
    draft = DistilledDraft(cfg)
    with torch.no_grad():
        counts_from = weighted_tokens(train, chat, chat_weight)
        draft.vocab_ids.copy_(draft_vocabulary(counts_from, cfg.draft_vocab, cfg.vocab_size, eos))
    draft.attach(target_model)
    draft.init_from_target(target_model)
    total = opts["steps"]

    def step_loss(rng: random.Random) -> tuple[torch.Tensor, dict[str, float]]:
        source = mixed_source(rng, train, chat, chat_weight, opts["seq_len"])
        feats, tokens, valid = source.batch(rng, opts["batch"], opts["seq_len"])
        loss, agree = distill_loss(draft, feats, tokens, valid)
        return loss, {"top1": float(agree)}

    done = fit(draft, step_loss, out / "checkpoint.pt", steps=total, lr=lr, seed=seed, resume=resume,
               checkpoint_every=checkpoint_every, stop_at=stop_at, max_minutes=max_minutes, progress=progress,
               desc="train draft-model")
    if done is None:
        return None
    history, train_seconds = done
    _round_to_stored(draft)

    def agreement(feats, tokens, valid):
        with torch.no_grad():
            return float(distill_loss(draft, feats, tokens, valid)[1]), int(same_sequence(valid).sum())

    heldout = {"top1_agreement": heldout_agreement(held, opts["seq_len"], agreement)}
    heldout.update(heldout_acceptance(model_dir, lambda loaded: _proposer(draft, loaded.model),
                                      opts["eval_prompts"], opts["eval_tokens"]))
    card = _card(cfg, model_dir, summary, opts, history, heldout, seed=seed, lr=lr, chat_weight=chat_weight,
                 data_seconds=data_seconds, train_seconds=train_seconds, quick=quick, out=out)
    card["cost"] = measure_cost(model_dir, draft, repeats=8 if quick else 64)
    save_head(draft, out, card)
    return json.loads((out / "card.json").read_text())


def _round_to_stored(draft: DistilledDraft) -> None:
    """Round the trained tensors to fp16 (as stored), so that the card measures what ships."""
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(p.half().float())


def _proposer(draft: DistilledDraft, target):
    from specdecode.proposers import DraftModelProposer

    draft.attach(target)
    return DraftModelProposer(draft.to_native(target))


def _card(cfg: DraftConfig, model_dir: Path, summary: dict, opts: dict, history: list, heldout: dict, *, seed: int,
          lr: float, chat_weight: float, data_seconds: float, train_seconds: float, quick: bool, out: Path) -> dict:
    from specdecode.proposers.eagle import drafter_name

    layers = " ".join(str(i) for i in cfg.layers)
    return {
        "method": "draft-model",
        "target": Path(str(model_dir)).name,
        "target_drafter_name": drafter_name(model_dir),
        "how": f"layer pruning + distillation: the target's layers {list(cfg.layers)} (of {cfg.target_layers}) with its "
               f"final norm, each matrix plus a trained rank-{cfg.rank} delta, norms trained; loss KL(target || draft) "
               "against the target's next-token distribution over the draft vocabulary (its final norm and LM-head "
               "rows applied to the stored features); input embedding and LM-head rows shared with the target",
        "data": dict(summary, sources="templated instructions answered greedily by the target; Python stdlib "
                                      "source chunks (plain and as chat replies), teacher-forced"),
        "steps": opts["steps"],
        "batch": opts["batch"],
        "seq_len": opts["seq_len"],
        "lr": lr,
        "seed": seed,
        "chat_weight": chat_weight,
        "layers": list(cfg.layers),
        "rank": cfg.rank,
        "draft_vocab": cfg.draft_vocab,
        "data_seconds": round(data_seconds, 1),
        "train_seconds": round(train_seconds, 1),
        "final_train_loss": history[-1][1] if history else None,
        "heldout": heldout,
        "reproduce": f"specdecode train draft-model --out {out.name} --steps {opts['steps']} --seed {seed} "
                     f"--batch {opts['batch']} --seq-len {opts['seq_len']} --lr {lr} --draft-vocab {cfg.draft_vocab} "
                     f"--chat-weight {chat_weight} --layers {layers} --rank {cfg.rank}" + (" --quick" if quick else ""),
    }


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
    p = argparse.ArgumentParser(prog="specdecode train draft-model",
                                description="Distill a small draft model (a few of the target's layers) for a target.")
    common_arguments(p, lr=1e-3)
    p.add_argument("--layers", type=int, nargs="+", default=list(DEFAULT_LAYERS),
                   help="the target's layers the draft starts from (negative: from the end)")
    p.add_argument("--rank", type=int, default=128, help="rank of the trained delta on every matrix")
    args = p.parse_args(argv)
    card = train_draft_model(args.out, args.target, layers=tuple(args.layers), rank=args.rank, **common_options(args))
    return report(card, args.out)
