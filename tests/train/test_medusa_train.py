"""``specdecode train medusa`` end to end on a tiny native target (seconds), resume, loss alignment."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import save_tiny_llama
from specdecode.networks.medusa_heads import MedusaConfig, MedusaHeads
from specdecode.networks.storage import load_head
from specdecode.train.medusa import LOSS_DECAY, medusa_loss
from specdecode.train.medusa_trainer import train_medusa


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("tiny-target")
    save_tiny_llama(path, seed=0, layers=2)
    return path


def test_quick_training_end_to_end(tiny_dir, tmp_path):
    out = tmp_path / "run"
    card = train_medusa(out, str(tiny_dir), quick=True, steps=12, num_heads=3, progress=False)
    for name in ("data.safetensors", "checkpoint.pt", "model.safetensors", "card.json"):
        assert (out / name).exists(), name
    assert json.loads((out / "card.json").read_text()) == card
    assert card["method"] == "medusa" and card["steps"] == 12 and card["num_heads"] == 3
    per_head = card["heldout"]["top1_agreement_per_head"]
    assert len(per_head) == 3 and all(0.0 <= a <= 1.0 for a in per_head)
    assert card["heldout"]["mean_accepted_length"] >= 1.0
    assert card["reproduce"].startswith("specdecode train medusa") and "--heads 3" in card["reproduce"]
    heads, _ = load_head(out, MedusaHeads)
    assert heads.cfg.num_heads == 3 and heads.cfg.vocab_size == 258 and heads.cfg.hidden == 32


def test_resume_continues_to_the_same_weights(tiny_dir, tmp_path):
    kwargs = dict(quick=True, steps=8, progress=False, checkpoint_every=4)
    train_medusa(tmp_path / "straight", str(tiny_dir), **kwargs)
    part = tmp_path / "resumed"
    assert train_medusa(part, str(tiny_dir), stop_at=4, **kwargs) is None
    train_medusa(part, str(tiny_dir), resume=True, **kwargs)
    a = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=False)
    b = torch.load(part / "checkpoint.pt", weights_only=False)
    assert a["step"] == b["step"] == 8
    for key in a["head"]:
        torch.testing.assert_close(a["head"][key], b["head"][key], rtol=1e-5, atol=1e-6)


def test_head_i_is_scored_against_the_target_at_t_plus_1_plus_i(tiny_dir):
    """Zero blocks make every head the target's own head at t; its agreement with position t+1+i
    must equal a direct count, and pairs across a sequence start must be dropped."""
    from specdecode.models.native import NativeCausalLM

    target = NativeCausalLM.from_pretrained(tiny_dir, pack=False)
    heads = MedusaHeads(MedusaConfig.for_target(target, num_heads=3, draft_vocab=target.vocab_size))
    heads.attach(target)
    feats = torch.randn(1, 13, 32)
    valid = torch.ones(1, 12, dtype=torch.bool)
    valid[0, 7] = False  # position 8 starts a new sequence
    loss, ce, agree, counts = medusa_loss(heads, feats, valid)
    best = heads.target_logits(feats[0]).argmax(-1)
    for i in range(3):
        pairs = [t for t in range(12 - i) if not (t <= 7 <= t + i)]
        assert counts[i] == len(pairs)
        expected = sum(int(best[t] == best[t + 1 + i]) for t in pairs) / len(pairs)
        assert float(agree[i]) == pytest.approx(expected)
    assert float(loss.detach()) == pytest.approx(sum(LOSS_DECAY**i * float(ce[i]) for i in range(3)), rel=1e-5)


def test_cli_train_medusa(tiny_dir, tmp_path, capsys):
    from specdecode.cli import main

    out = tmp_path / "cli"
    assert (
        main(
            ["train", "medusa", "--out", str(out), "--target", str(tiny_dir), "--quick", "--steps", "3", "--heads", "2"]
        )
        == 0
    )
    printed = json.loads(capsys.readouterr().out)
    assert printed["steps"] == 3 and len(printed["heldout"]["top1_agreement_per_head"]) == 2
