"""The server's per-request settings, apart from HTTP."""

from __future__ import annotations

import json
from types import SimpleNamespace

from specdecode.networks import storage
from specdecode.serve import ServerConfig
from specdecode.serve.state import ServerState


def test_auto_picks_per_request_by_whether_it_samples(tiny_loaded, tmp_path, monkeypatch):
    """A server's ``auto`` runs what the cards measured best for the request's regime: greedy
    requests the greedy choice, sampled ones (OpenAI's default temperature 1 included) the
    sampled one (here suffix decoding, which lost when sampling, gives way to n-gram lookup)."""
    monkeypatch.setattr(storage, "DRAFTERS_DIR", tmp_path)
    folder = tmp_path / storage.drafter_name(tiny_loaded.source) / "suffix"
    folder.mkdir(parents=True)
    card = {
        "method": "suffix",
        "benchmark": {"speedup": 1.3, "ngram_speedup": 1.1, "settings": {"k": "auto"}},
        "sampled_benchmark": {"speedup": 0.9, "ngram_speedup": 1.0, "settings": {"k": "auto"}},
    }
    (folder / "card.json").write_text(json.dumps(card))
    state = ServerState(lambda: (tiny_loaded, None), ServerConfig())
    state.target = tiny_loaded
    assert state.default_speculation(None).method == "suffix"
    assert state.default_speculation(None, sampled=True).method == "ngram"
    assert [state.sampled(SimpleNamespace(temperature=t)) for t in (None, 0.0, 0.7)] == [True, False, True]
