"""``specdecode train eagle`` end to end on a tiny native target (seconds), resume, data sources."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import save_tiny_llama
from specdecode.networks.storage import load_head
from specdecode.train import data
from specdecode.train.trainer import train_eagle


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("tiny-target")
    save_tiny_llama(path, seed=0, layers=2)
    return path


def test_quick_training_end_to_end(tiny_dir, tmp_path):
    card = train_eagle(tmp_path / "run", str(tiny_dir), quick=True, steps=12, progress=False)
    out = tmp_path / "run"
    for name in ("data.safetensors", "checkpoint.pt", "model.safetensors", "card.json"):
        assert (out / name).exists(), name
    assert json.loads((out / "card.json").read_text()) == card
    assert card["steps"] == 12 and card["method"] == "eagle"
    assert 0.0 <= card["heldout"]["top1_agreement"] <= 1.0
    assert card["heldout"]["mean_accepted_length"] >= 1.0
    head, _ = load_head(out)
    assert head.cfg.vocab_size == 258 and head.cfg.hidden == 32
    assert card["data"]["generated_sequences"] > 0 and card["data"]["stdlib_sequences"] > 0


def test_training_reduces_the_loss(tiny_dir, tmp_path):
    card = train_eagle(tmp_path / "run", str(tiny_dir), quick=True, steps=60, progress=False, lr=3e-3)
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    losses = [h[1] for h in state["history"]]
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10
    assert card["final_train_loss"] == losses[-1]


def test_resume_continues_to_the_same_weights(tiny_dir, tmp_path):
    train_eagle(tmp_path / "straight", str(tiny_dir), quick=True, steps=10, progress=False, checkpoint_every=5)
    part = tmp_path / "resumed"
    assert train_eagle(part, str(tiny_dir), quick=True, steps=10, progress=False, checkpoint_every=5, stop_at=5) is None
    assert torch.load(part / "checkpoint.pt", weights_only=False)["step"] == 5
    card = train_eagle(part, str(tiny_dir), quick=True, steps=10, resume=True, progress=False, checkpoint_every=5)
    assert card["steps"] == 10
    a = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=False)
    b = torch.load(part / "checkpoint.pt", weights_only=False)
    assert a["step"] == b["step"] == 10
    for key in a["head"]:
        torch.testing.assert_close(a["head"][key], b["head"][key], rtol=1e-5, atol=1e-6)


def test_cli_train_eagle(tiny_dir, tmp_path, capsys):
    from specdecode.cli import main

    assert (
        main(["train", "eagle", "--out", str(tmp_path / "cli"), "--target", str(tiny_dir), "--quick", "--steps", "3"])
        == 0
    )
    assert json.loads(capsys.readouterr().out)["steps"] == 3
    assert main(["train", "nonsense"]) == 2


def test_data_sources_are_local_and_not_the_workload():
    prompts = data.instruction_prompts(200, seed=0)
    assert len(set(prompts)) > 100
    assert not any(t in p for p in prompts for t in data.HELDOUT_TOPICS)
    texts = data.stdlib_texts(5, seed=0, max_chars=400)
    assert len(texts) == 5 and all(len(t) > 0 for t in texts)
    from pathlib import Path

    workload = Path(__file__).resolve().parents[2] / ".." / "shared" / "workloads" / "spec_bench_question.jsonl"
    if workload.exists():
        turns = {t for line in workload.read_text().splitlines() if line.strip() for t in json.loads(line)["turns"]}
        assert not turns & set(prompts)


def test_unrolled_predictions_match_drafting_from_a_cache():
    """Depth d at position i must see exactly what the drafting cache holds (training-time test)."""
    from helpers import tiny_native
    from specdecode.models.static_cache import StaticKVCache
    from specdecode.networks.eagle_head import EagleHead, HeadConfig
    from specdecode.train.eagle import unrolled_predictions

    target = tiny_native(vocab=6, seed=5, layers=3)
    torch.manual_seed(0)
    head = EagleHead(HeadConfig.for_target(target, draft_vocab=6)).eval()
    head.attach(target)
    feats, tokens = torch.randn(2, 7, head.cfg.hidden), torch.randint(0, 6, (2, 7))
    embeds = head.embed_tokens(tokens)
    preds = unrolled_predictions(head, feats, embeds, 3)
    for b in range(2):
        for depth in (1, 2, 3):
            for i in range(depth - 1, 7):
                cache = StaticKVCache(1, head.cfg.kv_heads, head.cfg.head_dim, 16, torch.float32)
                n_true = i - depth + 2  # the true entries 0..i-depth+1, then drafted ones up to i
                x = head(
                    feats[b : b + 1, :n_true],
                    embeds[b : b + 1, :n_true],
                    torch.arange(n_true),
                    cache.keys[0],
                    cache.values[0],
                    cache.reserve(n_true),
                )[:, -1:]
                for pos in range(n_true, i + 1):
                    x = head(
                        x,
                        embeds[b : b + 1, pos : pos + 1],
                        torch.tensor([pos]),
                        cache.keys[0],
                        cache.values[0],
                        cache.reserve(1),
                    )
                torch.testing.assert_close(x[0, 0], preds[depth - 1][b, i], atol=1e-4, rtol=1e-4)


def test_quick_training_with_unrolled_depths(tiny_dir, tmp_path):
    card = train_eagle(tmp_path / "run", str(tiny_dir), quick=True, steps=6, progress=False, unroll=3)
    assert card["unroll"] == 3 and "--unroll 3" in card["reproduce"]
