"""``method="auto"``: the best shipped drafter by its card's measured speedup, else n-gram lookup."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from helpers import save_tiny_llama
from specdecode.api import SpeculativeGenerator, best_method, shipped_drafters
from specdecode.networks import storage

TARGET = SimpleNamespace(source="/models/Tiny-Chat.Q4_1-abc123")  # drafter folder name: tiny-chat


def ship(root, method: str, speedup: float, ngram: float = 1.2) -> None:
    folder = root / "tiny-chat" / method
    folder.mkdir(parents=True)
    card = {"method": method, "benchmark": {"speedup": speedup, "ngram_speedup": ngram}}
    (folder / "card.json").write_text(json.dumps(card))


@pytest.fixture
def drafters(tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "DRAFTERS_DIR", tmp_path)
    return tmp_path


def test_no_shipped_drafter_falls_back_to_ngram(drafters):
    assert shipped_drafters(TARGET) == {} and best_method(TARGET) == "ngram"


def test_a_drafter_slower_than_plain_or_ngram_is_not_chosen(drafters):
    ship(drafters, "eagle", 0.9)
    ship(drafters, "draft", 1.1, ngram=1.3)
    assert set(shipped_drafters(TARGET)) == {"eagle", "draft"}
    assert best_method(TARGET) == "ngram"


def test_the_fastest_paying_drafter_wins(drafters):
    ship(drafters, "eagle", 1.4)
    ship(drafters, "medusa", 1.6)
    ship(drafters, "draft", 1.5)
    assert best_method(TARGET) == "medusa"


def test_generator_reports_the_method_auto_chose(tmp_path):
    save_tiny_llama(tmp_path / "tiny")
    gen = SpeculativeGenerator(str(tmp_path / "tiny"), k=2)
    assert gen.method == "ngram"
    assert gen.generate([5, 6, 5, 6, 5], max_new_tokens=4).token_ids


def test_confidence_policy_needs_a_drafter_with_probabilities(tmp_path):
    from specdecode.errors import ConfigError

    save_tiny_llama(tmp_path / "tiny")
    with pytest.raises(ConfigError, match="draft, eagle, medusa"):
        SpeculativeGenerator(str(tmp_path / "tiny"), method="ngram", policy="confidence")


def test_auto_runs_the_settings_the_card_was_measured_with(drafters, monkeypatch):
    from specdecode import api

    ship(drafters, "eagle", 1.4)
    card = drafters / "tiny-chat" / "eagle" / "card.json"
    data = json.loads(card.read_text())
    data["benchmark"]["settings"] = {"k": 6, "policy": "confidence", "confidence": 0.3}
    card.write_text(json.dumps(data))
    assert api.benchmarked_settings(TARGET, "eagle") == {"k": 6, "policy": "confidence", "confidence": 0.3}
    assert api.benchmarked_settings(TARGET, "medusa") == {}
    seen = {}
    monkeypatch.setattr(
        api,
        "make_proposer",
        lambda method, target, draft, **o: seen.update(o, method=method) or SimpleNamespace(name=method),
    )
    monkeypatch.setattr(api, "Decoder", lambda model, proposer, k, **o: seen.update(k=k, policy=o["policy"].name))
    loaded = api.LoadedModel(model=None, tokenizer=None, source=TARGET.source)
    auto = api.SpeculativeGenerator(loaded)
    assert (auto.method, auto.k) == ("eagle", 6)
    assert seen == {"method": "eagle", "confidence_threshold": 0.3, "k": 6, "policy": "confidence"}
    seen.clear()
    api.SpeculativeGenerator(loaded, method="eagle")  # asked for by name: the plain defaults
    assert seen == {"method": "eagle", "k": 4, "policy": "fixed"}


def test_a_cards_settings_are_read_one_way_for_auto_and_for_bench_serve():
    """``measured_run``: k, the policy and the proposer options a card's settings run with
    (bench-serve's ``best`` arm and ``method="auto"`` both read cards through it)."""
    from specdecode.api import MeasuredRun, measured_run

    conf = {"k": 6, "policy": "confidence", "confidence": 0.3}
    assert measured_run(conf) == MeasuredRun(6, "confidence", {"confidence_threshold": 0.3})
    hybrid = measured_run({"k": "auto", "drafter": "draft", "lookup": "suffix", "draft": "qwen2.5-coder-0.5b"})
    assert hybrid == MeasuredRun("auto", None, {"drafter": "draft", "lookup": "suffix"}) and hybrid.planned
    assert measured_run({}, default_k=3) == MeasuredRun(3, None, {}) and not measured_run({}).planned
    assert measured_run({"k": 8, "policy": "auto"}).planned


def test_auto_runs_the_hybrid_with_the_drafter_and_lookup_it_was_measured_with(drafters, monkeypatch):
    from specdecode import api

    ship(drafters, "medusa", 1.1)
    ship(drafters, "eagle", 1.05)
    ship(drafters, "hybrid", 1.3, ngram=1.25)
    card = drafters / "tiny-chat" / "hybrid" / "card.json"
    data = json.loads(card.read_text())
    data["benchmark"]["settings"] = {
        "k": 4,
        "policy": "confidence",
        "confidence": 0.3,
        "drafter": "eagle",
        "lookup": "ngram",  # not the hybrid's default (suffix): the card's own
    }
    card.write_text(json.dumps(data))
    assert best_method(TARGET) == "hybrid" and set(shipped_drafters(TARGET)) == {"medusa", "eagle"}
    assert api.best_drafter(TARGET) == "eagle"  # what the hybrid was measured with, not the best alone
    seen = {}
    monkeypatch.setattr(
        api,
        "make_proposer",
        lambda method, target, draft, **o: seen.update(o, method=method) or SimpleNamespace(name=method),
    )
    monkeypatch.setattr(api, "Decoder", lambda model, proposer, k, **o: seen.update(k=k, policy=o["policy"].name))
    api.SpeculativeGenerator(api.LoadedModel(model=None, tokenizer=None, source=TARGET.source))
    assert seen == {
        "method": "hybrid",
        "drafter": "eagle",
        "lookup": "ngram",
        "confidence_threshold": 0.3,
        "k": 4,
        "policy": "confidence",
    }


def test_hybrid_without_a_trained_drafter_is_refused(drafters):
    from specdecode import api
    from specdecode.errors import ConfigError

    with pytest.raises(ConfigError, match="needs a trained drafter"):
        api.best_drafter(TARGET)


@pytest.fixture
def installed_draft(tmp_path, monkeypatch):
    """A catalog draft model, installed (its file in a scratch model cache)."""
    from specdecode.models import catalog

    model = catalog.CatalogModel("tiny-draft", "tiny", "tiny-draft.gguf", (), 4, "0" * 64, "a test draft")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setitem(catalog.CATALOG, model.name, model)
    return model


def ship_with_draft(root, method: str, speedup: float, draft: str) -> None:
    ship(root, method, speedup)
    card = root / "tiny-chat" / method / "card.json"
    data = json.loads(card.read_text())
    data["benchmark"]["settings"] = {"k": 5, "draft": draft, "draft_dtype": "int4"}
    card.write_text(json.dumps(data))


def test_a_card_measured_with_a_named_draft_counts_only_once_that_draft_is_installed(
    drafters, installed_draft, monkeypatch
):
    from specdecode import api
    from specdecode.models import catalog

    ship(drafters, "suffix", 1.3)
    ship_with_draft(drafters, "draft", 1.8, installed_draft.name)
    assert best_method(TARGET) == "suffix"  # the 1.8x needs a draft that is not installed
    assert best_method(TARGET, draft_given=True) == "draft"  # unless the caller brings one
    path = catalog.cached_path(installed_draft)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"GGUF")
    assert best_method(TARGET) == "draft"
    assert api.measured_draft(TARGET) == ("tiny-draft", "int4")
    seen = {}
    monkeypatch.setattr(
        api,
        "make_proposer",
        lambda method, target, draft, **o: seen.update(o, method=method, draft=draft) or SimpleNamespace(name=method),
    )
    monkeypatch.setattr(api, "Decoder", lambda model, proposer, k, **o: seen.update(k=k))
    api.SpeculativeGenerator(api.LoadedModel(model=None, tokenizer=None, source=TARGET.source))
    assert seen == {"method": "draft", "draft": "tiny-draft", "dtype": "int4", "k": 5}


def test_a_measured_suffix_card_is_picked_over_ngram(drafters):
    ship(drafters, "suffix", 1.5, ngram=1.2)
    assert best_method(TARGET) == "suffix"
    assert best_method(SimpleNamespace(source="/models/Other-Model-abc")) == "ngram"  # another target's card


def sample_block(root, method: str, speedup: float, folder: str = "tiny-chat") -> None:
    """Add a ``sampled_benchmark`` block (k planned) to ``method``'s card."""
    card = root / folder / method / "card.json"
    data = json.loads(card.read_text())
    data["sampled_benchmark"] = {"speedup": speedup, "ngram_speedup": 1.0, "settings": {"k": "auto"}}
    card.write_text(json.dumps(data))


def test_auto_picks_for_sampled_requests_what_the_cards_measured_best_on_them(drafters):
    """A draft kept with probability min(1, p/q) fares unlike one that must equal the argmax: on
    the Qwen pair at T=0.7 the hybrid lost about a tenth to suffix decoding at every load, though
    it led greedy. Cards keep a sampled measurement beside the greedy one, and ``auto`` picks
    from the regime's own figures, never a mix of the two."""
    from specdecode import api

    ship(drafters, "hybrid", 1.3, ngram=1.1)
    ship(drafters, "suffix", 1.25, ngram=1.1)
    assert best_method(TARGET) == best_method(TARGET, sampled=True) == "hybrid"  # no sampled figures yet
    sample_block(drafters, "hybrid", 1.05)
    sample_block(drafters, "suffix", 1.2)
    assert best_method(TARGET) == "hybrid" and best_method(TARGET, sampled=True) == "suffix"
    assert api.benchmarked_settings(TARGET, "suffix", sampled=True) == {"k": "auto"}
    ship(drafters, "eagle", 1.5)  # greedy figures only: no say in the sampled choice
    assert best_method(TARGET) == "eagle" and best_method(TARGET, sampled=True) == "suffix"
    card = drafters / "tiny-chat" / "suffix" / "card.json"
    data = json.loads(card.read_text())
    data["sampled_benchmark"]["ngram_speedup"] = None  # recorded from runs without an n-gram cell
    card.write_text(json.dumps(data))
    assert best_method(TARGET, sampled=True) == "suffix"


def test_a_generator_under_auto_runs_sampled_requests_on_the_sampled_choice(tmp_path, monkeypatch):
    from specdecode.core.sampling import SamplingConfig
    from specdecode.engine import GenerationConfig

    monkeypatch.setattr(storage, "DRAFTERS_DIR", tmp_path / "drafters")
    save_tiny_llama(tmp_path / "tiny")
    ship(tmp_path / "drafters", "suffix", 1.3, ngram=1.1)
    (tmp_path / "drafters" / "tiny-chat").rename(tmp_path / "drafters" / storage.drafter_name(tmp_path / "tiny"))
    sample_block(tmp_path / "drafters", "suffix", 0.9, folder=storage.drafter_name(tmp_path / "tiny"))
    gen = SpeculativeGenerator(str(tmp_path / "tiny"), k=2)
    assert gen.method == "suffix"
    sampled = gen.decoder_for(GenerationConfig(sampling=SamplingConfig(temperature=0.7)))
    assert sampled is not gen.decoder and sampled.spec.method == "ngram"  # suffix lost when sampling
    assert gen.decoder_for(GenerationConfig()) is gen.decoder
    assert gen.generate([5, 6, 5, 6, 5], max_new_tokens=4, temperature=0.7, seed=1).token_ids
    named = SpeculativeGenerator(str(tmp_path / "tiny"), method="suffix", k=2)  # asked for by name: one decoder
    assert named.decoder_for(GenerationConfig(sampling=SamplingConfig(temperature=0.7))) is named.decoder
