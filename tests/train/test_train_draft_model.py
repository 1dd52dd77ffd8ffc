"""``specdecode train draft-model`` end to end on a tiny native target (seconds), and its use by --method draft."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import save_tiny_llama
from specdecode.engine import Decoder, GenerationConfig
from specdecode.networks.draft_model import DistilledDraft
from specdecode.networks.storage import load_head
from specdecode.train.draft_model import same_sequence
from specdecode.train.draft_trainer import train_draft_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("tiny-target")
    save_tiny_llama(path, seed=0, layers=3)
    return path


def test_quick_training_end_to_end_and_use(tiny_dir, tmp_path):
    from specdecode.api import make_proposer
    from specdecode.models.loading import load_model

    out = tmp_path / "run"
    card = train_draft_model(out, str(tiny_dir), quick=True, steps=30, layers=(0, -1), rank=8, lr=3e-3, progress=False)
    for name in ("data.safetensors", "checkpoint.pt", "model.safetensors", "card.json"):
        assert (out / name).exists(), name
    assert json.loads((out / "card.json").read_text()) == card
    assert card["method"] == "draft-model" and card["steps"] == 30 and card["layers"] == [0, 2]
    assert 0.0 <= card["heldout"]["top1_agreement"] <= 1.0 and card["heldout"]["mean_accepted_length"] >= 1.0
    assert card["cost"]["macs_ratio"] > 1.0 and card["cost"]["time_ratio"] > 0
    losses = [h[1] for h in torch.load(out / "checkpoint.pt", weights_only=False)["history"]]
    assert sum(losses[-5:]) < sum(losses[:5])
    draft, _ = load_head(out, DistilledDraft)
    assert draft.cfg.layers == (0, 2) and draft.cfg.vocab_size == 258

    target = load_model(tiny_dir, backend="native")
    prompt, cfg = [5, 6, 7, 8, 9, 10], GenerationConfig(max_new_tokens=20)
    expected = Decoder(target.model, None).generate(prompt, cfg).token_ids
    proposer = make_proposer("draft", target, str(out))  # --draft PATH of a trained draft
    assert Decoder(target.model, proposer, k=3).generate(prompt, cfg).token_ids == expected


def test_cli_train_draft_model(tiny_dir, tmp_path, capsys):
    from specdecode.cli import main

    argv = [
        "train",
        "draft-model",
        "--out",
        str(tmp_path / "cli"),
        "--target",
        str(tiny_dir),
        "--quick",
        "--steps",
        "3",
        "--layers",
        "1",
        "--rank",
        "4",
    ]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 3
    assert json.loads((tmp_path / "cli" / "card.json").read_text())["layers"] == [1]


def test_positions_after_a_sequence_boundary_are_not_scored():
    valid = torch.tensor([[True, True, False, True], [True, True, True, True]])  # x_3 starts a sequence in row 0
    assert same_sequence(valid).tolist() == [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
