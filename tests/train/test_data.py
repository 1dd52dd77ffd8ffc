"""Training-data building blocks: self-instructed prompts, the held-out split, shard storage."""

from __future__ import annotations

import torch

from real_model import default_target
from specdecode.train import data


def test_self_instructed_prompts_are_the_targets_own_user_turns():
    loaded = default_target("native")
    tok, eos = loaded.tokenizer, tuple(loaded.eos_token_ids)
    prefix = data.user_turn_prefix(tok)
    assert data.chat_ids(tok, "Hello there")[: len(prefix)] == prefix
    prompts = data.self_instruct_prompts(loaded.model, tok, 3, seed=0, eos=eos, max_tokens=48)
    assert len(prompts) == 3 and len(set(prompts)) == 3
    assert all(len(p.split()) >= 3 and "<|im_end|>" not in p for p in prompts)
    assert data.self_instruct_prompts(loaded.model, tok, 3, seed=0, eos=eos, max_tokens=48) == prompts


def test_no_chat_template_means_no_self_instructed_prompts():
    class Plain:
        chat_template = None

    assert data.user_turn_prefix(Plain()) is None
    assert data.self_instruct_prompts(None, Plain(), 5, seed=0, eos=(0,)) == []


def test_heldout_split_depends_only_on_the_sequence():
    seqs = [[i, i + 1, i * 7 % 13] for i in range(2000)]
    held = [data.is_heldout(s, 0.05) for s in seqs]
    assert 0.03 < sum(held) / len(held) < 0.07
    assert [data.is_heldout(s, 0.05) for s in reversed(seqs)] == held[::-1]
    assert not any(data.is_heldout(s, 0.0) for s in seqs)


def test_shard_round_trip_keeps_chat_answers_first(tmp_path):
    seqs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    feats = [torch.randn(len(s), 4).half() for s in seqs]
    summary = data.write_shard(
        tmp_path / "d.safetensors", seqs, ["generated", "self_instruct", "stdlib"], feats, 0.0, 7
    )
    tensors, stored = data.load_dataset(tmp_path / "d.safetensors")
    assert stored == summary
    assert summary["generated_sequences"] == 2 and summary["self_instruct_sequences"] == 1
    assert tensors["offsets"].tolist() == [0, 3, 5, 9] and tensors["tokens"].tolist() == sum(seqs, [])
    assert torch.equal(tensors["features"], torch.cat(feats))
