"""specdecode.testing: the public conformance machinery and certify()."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from plugin_proposers import FixedQProposer
from specdecode.errors import ConfigError
from specdecode.proposers import NgramProposer
from specdecode.proposers.lookahead import LookaheadProposer
from specdecode.testing import MarkovLM, certify, chi2_sf, chi_square_pvalue, no_residual_verify

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one thread is fastest


def test_chi_square_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 5, 30, 124):
        for x in (0.0, 0.7, 4.0, 25.0, 300.0):
            assert chi2_sf(x, df) == pytest.approx(stats.chi2.sf(x, df), rel=1e-9, abs=1e-14)
    rng = np.random.default_rng(0)
    law = dict(enumerate(rng.dirichlet(np.ones(40))))
    counts = Counter(rng.choice(40, size=3000, p=list(law.values())).tolist())
    obs, exp, po, pe = [], [], 0, 0.0
    for key in sorted(law, key=law.get, reverse=True):
        e = law[key] * 3000
        if e >= 5:
            obs.append(counts.get(key, 0))
            exp.append(e)
        else:
            po, pe = po + counts.get(key, 0), pe + e
    obs, exp = obs + [po], exp + [pe]
    assert chi_square_pvalue(counts, law) == pytest.approx(stats.chisquare(obs, np.array(exp) * 3000 / sum(exp)).pvalue)
    assert chi_square_pvalue(Counter({41: 1}), law) == 0.0  # outside the support


def test_ngram_passes_on_chains_and_trees():
    report = certify(NgramProposer(), samples=1000)
    assert report.passed, report.table()
    names = [c.name for c in report.cases]
    assert names == [
        "chain t=1.0",
        "chain t=0.7 top_k=3",
        "chain t=1.3 top_p=0.8",
        "chain greedy identity",
        "tree t=1.0",
        "tree t=0.7 top_k=3",
        "tree t=1.3 top_p=0.8",
        "tree greedy identity",
    ]
    assert all(c.pvalue is not None for c in report.cases if "greedy" not in c.name)
    assert report.table().splitlines()[-1] == "8 passed, 0 failed"


def test_tree_only_proposer_is_certified_on_trees():
    report = certify(LookaheadProposer(window=3, ngram=2), samples=800, trees=None)
    assert report.passed and {c.mode for c in report.cases} == {"tree"}
    assert any("tree_only" in note for note in report.notes)


def test_a_broken_verifier_fails(monkeypatch):
    import specdecode.engine.request as loop

    monkeypatch.setattr(loop, "verify_sampling", no_residual_verify)
    report = certify(FixedQProposer(5), samples=1000)
    assert not report.passed and report.n_failed >= 2
    assert all(c.passed for c in report.cases if "greedy" in c.name)  # greedy never reaches the sampler


def test_a_crashing_proposer_fails_with_its_error():
    class Crashes(NgramProposer):
        name = "crashes"

        def propose(self, context, k, sampling, generator):
            raise RuntimeError("boom")

    report = certify(Crashes(), samples=10, trees=False)
    assert not report.passed and report.n_passed == 0
    assert all("RuntimeError: boom" in c.detail for c in report.cases)


def test_impossible_requests_are_config_errors():
    with pytest.raises(ConfigError, match="not a proposer"):
        certify(object())
    with pytest.raises(ConfigError, match="does not declare caps.trees"):
        certify(FixedQProposer(5), trees=True)
    with pytest.raises(ConfigError, match="not enumerable"):
        certify(NgramProposer(), target=MarkovLM(30, seed=0), n_new=3)
    with pytest.raises(ConfigError, match="alpha"):
        certify(NgramProposer(), alpha=0.0)


def test_chain_only_proposer_notes_the_trees_it_skipped():
    report = certify(FixedQProposer(4, peak=0.5), samples=300, trees=None, target=MarkovLM(4, seed=3), n_new=2)
    assert report.passed, report.table()
    assert {c.mode for c in report.cases} == {"chain"} and any("caps.trees" in n for n in report.notes)
