"""Speculation-length policies and the cost model, with synthetic timings (no clocks)."""

from __future__ import annotations

import pytest
import torch

from helpers import tiny_llama
from specdecode.core.cost_model import (
    best_k,
    expected_tokens_per_round,
    iid_expected_tokens,
    predict_tokens_per_s,
    predicted_speedup,
)
from specdecode.engine import Decoder, GenerationConfig
from specdecode.engine.policy import AutoK, HeuristicK, constant_costs, make_policy
from specdecode.errors import ConfigError
from specdecode.proposers import DraftModelProposer

FLAT = lambda n: 0.010 * (1 + 0.05 * (n - 1))  # target forward: 10 ms, +5% per extra token


def test_iid_case_matches_leviathan():
    a = 0.7
    cum = [a ** (i + 1) for i in range(6)]
    for k in range(7):
        assert expected_tokens_per_round(k, cum) == pytest.approx(iid_expected_tokens(k, a))


def test_prediction_from_synthetic_timings():
    cum = [0.8, 0.6, 0.4]
    # k = 2: (1 + 0.8 + 0.6) tokens per (2 * 1 ms draft + 11 ms verify over 3 tokens)
    assert predict_tokens_per_s(2, cum, 0.001, FLAT) == pytest.approx(2.4 / 0.013)
    assert predict_tokens_per_s(0, cum, 0.001, FLAT) == pytest.approx(100.0)
    assert predicted_speedup(2, cum, 0.001, FLAT) == pytest.approx(2.4 / 0.013 / 100)


def test_cost_table_interpolates():
    table = {1: 0.010, 5: 0.014}
    assert predict_tokens_per_s(2, [1.0, 1.0], 0.0, table) == pytest.approx(
        3 / 0.012
    )  # c(3) halfway between c(1) and c(5)


def test_best_k_is_zero_when_drafts_are_useless_and_large_when_good():
    assert best_k(8, [0.02, 0.0], 0.002, FLAT) == 0
    assert best_k(8, [0.98 ** (i + 1) for i in range(8)], 0.0005, FLAT) >= 6
    assert best_k(8, [0.98 ** (i + 1) for i in range(8)], 0.5, FLAT) == 0  # draft too slow


def test_heuristic_grows_after_full_acceptance_and_shrinks_otherwise():
    policy = HeuristicK(k_max=8)
    policy.reset()
    assert policy.next_k() == 4
    policy.update(4, 4, 0, 0)
    assert policy.next_k() == 6
    policy.update(6, 2, 0, 0)
    assert policy.next_k() == 5
    for _ in range(10):
        policy.update(policy.next_k(), 0, 0, 0)
    assert policy.next_k() == 1


def test_auto_turns_off_with_useless_draft_and_back_on_when_it_improves():
    policy = AutoK(8, costs=constant_costs(0.001, FLAT), probe_every=4)
    policy.reset()
    for _ in range(20):
        k = policy.next_k()
        policy.update(k, 0, 0, 0)  # a useless draft: nothing accepted
    assert policy.k == 0
    ks = []
    for _ in range(40):
        k = policy.next_k()
        ks.append(k)
        policy.update(k, k, 0, 0)  # the draft became perfect: probes see full acceptance
    assert policy.k >= 4 and ks[-1] >= 4
    assert 0 in ks  # it stayed off until a probe saw the change


class SwitchingDraft(DraftModelProposer):
    """A random draft for the first ``switch_after`` proposals, then the target itself."""

    def __init__(self, bad, good, switch_after: int) -> None:
        super().__init__(bad)
        self.good, self.calls, self.switch_after = good, 0, switch_after

    def propose(self, context, k, sampling, generator):
        self.calls += 1
        if self.calls == self.switch_after:
            self.model = self.good
            self.cache, self.cached, self.agreed = self.good.new_cache(256), [], 0
        return super().propose(context, k, sampling, generator)


def test_auto_in_the_decode_loop_goes_to_zero_then_recovers():
    torch.set_num_threads(1)
    target, random_draft = tiny_llama(vocab=6, seed=5), tiny_llama(vocab=6, seed=9)
    policy = AutoK(6, costs=constant_costs(0.001, FLAT), probe_every=4)
    proposer = SwitchingDraft(random_draft, target, switch_after=12)
    out = Decoder(target, proposer, policy=policy).generate([1, 2, 3], GenerationConfig(max_new_tokens=150))
    ks = out.stats["k_history"]
    assert out.stats["policy"] == "auto"
    assert 0 in ks, ks  # switched itself off with the random draft
    first_off = ks.index(0)
    assert max(ks[first_off:]) >= 4, ks  # and came back on once the draft was good
    plain = Decoder(target, None).generate([1, 2, 3], GenerationConfig(max_new_tokens=150))
    assert out.token_ids == plain.token_ids


def test_shadow_mode_records_acceptance_without_speculating():
    torch.set_num_threads(1)
    target = tiny_llama(vocab=6, seed=5)
    cfg = GenerationConfig(max_new_tokens=30)
    shadow = Decoder(target, DraftModelProposer(target), k=3, shadow=True).generate([1, 2, 3], cfg)
    plain = Decoder(target, None).generate([1, 2, 3], cfg)
    assert shadow.token_ids == plain.token_ids
    assert shadow.stats["target_calls"] == 30 and shadow.stats["drafted_tokens"] == 0
    assert shadow.stats["shadow_acceptance_rate"] == 1.0  # a self-draft would be fully accepted
    assert shadow.stats["shadow_mean_accepted_length"] == pytest.approx(4.0, abs=0.5)
    spec = Decoder(target, DraftModelProposer(tiny_llama(vocab=6, seed=9)), k=3).generate([1, 2, 3], cfg)
    shadow_bad = Decoder(target, DraftModelProposer(tiny_llama(vocab=6, seed=9)), k=3, shadow=True).generate(
        [1, 2, 3], cfg
    )
    # greedy shadow rounds are exactly the speculative rounds
    assert shadow_bad.stats["shadow_acceptance_rate"] == pytest.approx(spec.stats["acceptance_rate"], abs=0.1)


def test_shadow_under_sampling_reports_expected_acceptance():
    torch.set_num_threads(1)
    from specdecode.core.sampling import SamplingConfig

    target = tiny_llama(vocab=6, seed=5)
    cfg = GenerationConfig(max_new_tokens=30, sampling=SamplingConfig(temperature=1.0), seed=3)
    out = Decoder(target, DraftModelProposer(target), k=3, shadow=True).generate([1, 2, 3], cfg)
    assert out.stats["shadow_acceptance_rate"] == pytest.approx(1.0)  # p == q: min(1, p/q) = 1


def test_bad_policy_names_and_k():
    with pytest.raises(ConfigError):
        make_policy("sometimes", 4)
    with pytest.raises(ConfigError):
        make_policy("fixed", 0)


def test_auto_reach_and_unjudged_positions():
    """Reach counts how often each asked-for position was drafted; a rejection early in the
    chain leaves deeper estimates where they were (they were not judged)."""
    policy = AutoK(4, costs=constant_costs(0.001, FLAT))
    policy.reset()
    policy.update(2, 2, 0, 0, planned=4)  # asked for 4, a confidence stop drafted 2, both accepted
    assert policy.reach_by_position()[:2] == [1.0, 1.0] and policy.reach_by_position()[2] < 1.0
    deep = policy.cond[3]
    policy.update(4, 0, 0, 0, planned=4)  # the first draft rejected: positions 2-4 were not judged
    assert policy.cond[3] == deep and policy.cond[0] < 0.6


def test_a_draft_model_reads_the_prompt_in_catch_up_so_a_round_times_drafting_alone():
    """Starting a request reads nothing; ``catch_up`` (timed by the engine as prefill) reads the
    prompt, so the first round feeds one token per draft step like every later one. Left to the
    first round, the prompt's cost was read as draft cost per token (the Qwen 0.5B: 80 ms a token
    against 24) and the auto policy switched speculation off for good on that one measurement.
    After rounds that did not draft, catch_up reads what they committed; after a drafting round
    it reads nothing."""
    from specdecode.core.sampling import SamplingConfig

    draft = tiny_llama(vocab=6, seed=5)
    fed: list[int] = []
    forward = draft.forward
    draft.forward = lambda ids, cache, **kw: (fed.append(int(ids.shape[1])), forward(ids, cache, **kw))[1]
    prompt = [1, 2, 3, 4, 5, 0, 1, 2]
    state = DraftModelProposer(draft).start(prompt)
    assert fed == []  # a request kept at k = 0 never pays for the draft's prompt read
    context = prompt + [3]
    state.catch_up(context)
    assert fed == [len(context) - 1]
    fed.clear()
    out = state.propose(context, 3, SamplingConfig(), None)
    assert out.k == 3 and fed and all(n == 1 for n in fed), fed
    context += out.tokens[0].tolist() + [0]  # all accepted, then the bonus token
    fed.clear()
    state.catch_up(context)
    assert fed == []  # a drafting round's leftovers (the last draft, the bonus) go with the next round
    context += [1, 2, 3, 4]  # four rounds at k = 0
    state.catch_up(context)
    assert fed == [len(context) - 1 - (len(prompt) + 1 + 2)]  # everything since the cached drafts


def test_auto_prices_deep_drafts_by_the_rounds_that_drafted_them():
    """A proposer that drafts one unsure token or six sure ones: the product of per-position
    acceptance mixes the unsure rounds into every depth; the acceptance measured when position i
    was drafted does not."""
    policy = AutoK(8, costs=constant_costs(0.0, FLAT))
    for _ in range(30):
        policy.update(1, 0, 0, 0, planned=8)  # a short match, rejected
        policy.update(6, 6, 0, 0, planned=8)  # a long match, all accepted
    direct = policy.accept_when_drafted()
    assert 0.3 < direct[0] < 0.7
    assert min(direct[1:6]) > 0.95
    assert policy.accept_by_position()[5] < 0.75 * direct[5]
    assert policy.reach_by_position()[5] < 0.7


def test_a_fully_accepted_short_round_does_not_price_deep_drafts_like_short_ones():
    """A drafter whose first two tokens pass and whose third fails (the 0.5B translating): deep
    rounds keep two tokens. A fully accepted two-token round hints the run may go on, but only as
    far as the deeper positions' own acceptance carries it. Drifting every deeper estimate toward
    the second position's figure priced eight drafts like two, and the planner swung back to k = 8
    after each short round (Spec-Bench 166: k 2, 2, 8, 2, 2, 8, ...)."""
    from specdecode.engine.planner import Candidate, ForwardCosts, plan

    policy = AutoK(8, costs=constant_costs(0.0, FLAT))
    for _ in range(4):
        policy.update(8, 2, 0, 0, planned=8)  # a deep round: two kept, the third rejected
        for _ in range(3):
            policy.update(2, 2, 0, 0, planned=2)  # short rounds, fully accepted
    drafted = policy.accept_when_drafted()
    assert drafted[1] > 0.8
    assert drafted[7] < 0.4
    costs = ForwardCosts(ema=1.0)  # the 1.5B on two cores: c(9) ~ 2.3 c(1)
    for n in range(1, 10):
        costs.observe(n, 0.030 + 0.005 * (n - 1))
    assert plan([Candidate(drafted, 0.011, 8)], 0, 0.0, costs) == [2]
