"""The batched engine: many requests, one forward per step, speculation chosen per request.

Greedy: every request's tokens in a batch equal what it gives alone, whatever shares its batch
(tiny native models here; the real default model below). Sampling: requests in a batch follow the
target's exact sequence law while other requests with other settings share their steps (Pearson
chi-square at ALPHA = 0.001, 3,000 sequences: the broken variant gets p ~ 0). Scheduling: ragged
acceptance, joins and leaves mid-flight, chunked prefill, cancellation, KV budget and queueing.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from helpers import ALPHA, MarkovLM, chi_square_pvalue, sequence_law, tiny_llama, tiny_native
from specdecode.core.sampling import SamplingConfig, logits_to_probs
from specdecode.core.verify import Draft
from specdecode.engine import Decoder, Engine, EngineConfig, GenerationConfig, Speculation, TreeConfig
from specdecode.engine.planner import AcceptanceHistory, Candidate, ForwardCosts, ScoreCalibration, plan
from specdecode.engine.policy import AcceptanceEstimates, AutoK, make_policy
from specdecode.engine.request import DONE, PREFILL, RUNNING, WAITING, Request
from specdecode.engine.scheduler import MIN_SHARE, _Crowd
from specdecode.errors import ConfigError, InputError, QueueFullError
from specdecode.models import int8dot, native
from specdecode.proposers import DraftModelProposer, NgramProposer
from specdecode.proposers.base import PerRequest, ProposerCaps
from specdecode.proposers.early_exit import EarlyExitProposer
from specdecode.proposers.hybrid import DRAFTER, HybridProposer
from specdecode.proposers.suffix import SuffixProposer

N_SAMPLES = 3_000
PROMPT = [1, 2, 3, 1, 2, 0, 1]

pytestmark = pytest.mark.usefixtures("one_thread")


def prompts(vocab: int, lengths=(3, 9, 1, 14, 6, 11)) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def alone(target, prompt, n, spec=None, eos=()):
    engine = Engine(target, eos_token_ids=eos)
    return engine.generate([prompt], GenerationConfig(max_new_tokens=n), spec)[0].token_ids


def test_plain_batch_equals_decoding_alone_with_joins_and_leaves():
    target = tiny_native(vocab=16, seed=3)
    ps = prompts(16)
    # max_batch 2: requests join while others are mid-flight (prefill rows beside decode rows).
    engine = Engine(target, eos_token_ids=(5,), config=EngineConfig(max_batch=2))
    got = [r.token_ids for r in engine.generate(ps, GenerationConfig(max_new_tokens=12))]
    assert got == [alone(target, p, 12, eos=(5,)) for p in ps]
    assert any(len(g) < 12 for g in got) and all(g[-1] == 5 for g in got if len(g) < 12)
    assert max(s.batch for s in engine.steps) == 2


def mixed_specs(target, draft) -> list[Speculation]:
    """One batch, every kind of request: plain, n-gram at two k, a draft model (batched drafting),
    suffix, batch-planned auto k, and a tree."""
    return [
        Speculation(),
        Speculation(NgramProposer(), k=2),
        Speculation(NgramProposer(), k=5),
        Speculation(DraftModelProposer(draft), k=3),
        Speculation(SuffixProposer(use_corpus=False), k=4),
        Speculation(NgramProposer(), policy=make_policy("auto", 6)),
        Speculation(NgramProposer(), k=3, tree=TreeConfig(max_nodes=8)),
        Speculation(EarlyExitProposer(target, layers=1), k=3),  # drafts on the target cache's first layer
        Speculation(DraftModelProposer(draft), k=2, shadow=True),
    ]


def test_mixed_speculation_in_one_batch_is_greedy_identical():
    target, draft = tiny_native(vocab=8, seed=5, layers=3), tiny_native(vocab=8, seed=6, layers=1)
    ps = [
        [1, 2, 3, 4, 1, 2, 3, 0, 1, 2],
        [5, 6, 5, 6, 5],
        [7],
        [3, 3, 1, 2, 3, 3, 1],
        [0, 1, 2, 3],
        [2, 4, 2, 4, 2, 4],
        [6, 1, 6, 1],
        [1, 1, 2, 2],
        [3, 4, 5],
    ]
    specs = mixed_specs(target, draft)
    expected = [alone(target, p, 24) for p in ps]
    engine = Engine(target)
    requests = [engine.submit(p, GenerationConfig(max_new_tokens=24), s) for p, s in zip(ps, specs)]
    while engine.busy:
        engine.step()
        for r in engine.running:  # ragged acceptance: each cache holds exactly its own context
            if r.status == RUNNING:
                assert r.cache.length == len(r.context) - 1
    assert [r.result.token_ids for r in requests] == expected
    assert any(len(set(s.ks)) > 1 for s in engine.steps)  # different k in one forward
    draft_rounds = requests[3].result.stats["target_calls"]
    assert requests[3].result.stats["mean_accepted_length"] > 0 and draft_rounds < 24
    assert requests[8].result.stats["shadow_rounds"] > 0 and requests[8].result.stats["target_calls"] == 24


@pytest.mark.skipif(
    not int8dot.available() or not native._packing_works(torch.randn(8, 8).bfloat16()),
    reason="needs the int8dot kernels and oneDNN's bf16 packing",
)
def test_long_prompts_on_prompt_copies_are_greedy_identical_alone_and_in_a_batch(tmp_path):
    """Prompt chunks of 32+ rows on a w4a8 target's bf16 copies (chunked, several per step)
    decode exactly as each request alone, with and without speculation."""
    from helpers import wide_checkpoint
    from specdecode.models.native import NativeCausalLM

    wide_checkpoint(tmp_path)
    target = NativeCausalLM.from_pretrained(tmp_path, quant="w4a8", prompt_copies=True)
    assert "bf16" in target.kernels()["prompt chunks"]
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(0, 16, (n,), generator=g).tolist() for n in (70, 45, 3, 100, 33)]
    ps = [p[:20] + p[:20] + p[20:] for p in ps]  # repeats for the n-gram drafts
    specs = [None, Speculation(NgramProposer(), k=4), None, Speculation(SuffixProposer(), k=3), None]
    settings = EngineConfig(prefill_chunk=48)  # a chunk's bits depend on its length: the same chunks alone

    def run(batch, spec_of):
        engine = Engine(target, config=settings)
        out = [engine.submit(p, GenerationConfig(max_new_tokens=12), spec_of(i)) for i, p in enumerate(batch)]
        engine.run()
        return [r.result.token_ids for r in out]

    expected = [run([p], lambda _: None)[0] for p in ps]
    assert run(ps, lambda i: specs[i]) == expected
    assert [run([p], lambda _, s=s: s)[0] for p, s in zip(ps, specs)] == expected


def test_batched_drafting_matches_drafting_alone():
    draft = tiny_native(vocab=8, seed=6, layers=1)
    proto = DraftModelProposer(draft, confidence_threshold=0.2)
    contexts = [[1, 2, 3], [4, 5, 6, 7, 1], [2]]
    sampling = [SamplingConfig(), SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=3)]
    gens = lambda: [torch.Generator().manual_seed(i) for i in range(3)]  # noqa: E731
    ks = [4, 2, 5]
    states = [proto.start(c) for c in contexts]
    batched = proto.propose_batch(states, contexts, ks, sampling, gens())
    single = [proto.start(c).propose(c, k, s, g) for c, k, s, g in zip(contexts, ks, sampling, gens())]
    for a, b in zip(batched, single):
        assert torch.equal(a.tokens, b.tokens)
        assert (a.probs is None) == (b.probs is None)
        if a.probs is not None:
            torch.testing.assert_close(a.probs, b.probs)


def test_chunked_prefill_keeps_running_requests_decoding():
    target = tiny_native(vocab=16, seed=3)
    engine = Engine(target, config=EngineConfig(prefill_chunk=4))
    short = engine.submit([1, 2], GenerationConfig(max_new_tokens=20), Speculation(NgramProposer(), k=2))
    engine.step()
    engine.step()  # the short request is decoding
    long_prompt = prompts(16, (23,))[0]
    long = engine.submit(long_prompt, GenerationConfig(max_new_tokens=6))
    emitted_while_prefilling = 0
    while long.status in (WAITING, PREFILL):
        before = len(short.context)
        engine.step()
        emitted_while_prefilling += len(short.context) > before
    assert emitted_while_prefilling >= 5  # 22 prompt tokens in chunks of 4: six steps, all decoding
    engine.run()
    assert long.result.token_ids == alone(target, long_prompt, 6)
    assert short.result.token_ids == alone(target, [1, 2], 20)


def test_cancelled_request_leaves_before_the_next_forward():
    target = tiny_native(vocab=16, seed=3)
    engine = Engine(target, config=EngineConfig(kv_budget=200))
    a = engine.submit([1, 2, 3], GenerationConfig(max_new_tokens=30))
    b = engine.submit([4, 5], GenerationConfig(max_new_tokens=30))
    engine.step()
    engine.step()
    reserved = engine.reserved
    engine.cancel(a)
    engine.step()
    assert a.status == DONE and a.cache is None and a.result.finish_reason == "cancelled"
    assert engine.reserved == reserved - a.capacity and engine.running == [b]
    assert engine.steps[-1].batch == 1
    engine.run()
    assert b.result.token_ids == alone(target, [4, 5], 30)


def test_kv_budget_queues_requests_and_refuses_what_never_fits():
    target = tiny_native(vocab=16, seed=3)
    cfg = GenerationConfig(max_new_tokens=10)
    engine = Engine(target, config=EngineConfig(kv_budget=40, max_queue=1))
    first = engine.submit([1, 2, 3], cfg, Speculation(NgramProposer(), k=4))  # reserves 3 + 10 + 5 = 18
    engine.step()
    second = engine.submit([4, 5, 6], cfg, Speculation(NgramProposer(), k=4))
    engine.step()
    assert first.status != WAITING and second.status != WAITING and engine.kv_usage()["reserved"] == 36
    third = engine.submit([7, 8, 9], cfg)  # 3 + 10 + 1 = 14 more would exceed 40: waits
    with pytest.raises(QueueFullError, match="queue is full"):
        engine.submit([1], cfg)
    engine.step()
    assert third.status == WAITING
    engine.run()
    assert third.result.token_ids == alone(target, [7, 8, 9], 10)
    assert engine.reserved == 0
    with pytest.raises(InputError, match="KV budget"):
        engine.submit(list(range(16)) * 3, cfg)


def test_bad_engine_settings_are_refused():
    with pytest.raises(ConfigError, match="max_batch"):
        EngineConfig(max_batch=0)
    with pytest.raises(ConfigError, match="kv_budget"):
        EngineConfig(kv_budget=-5)
    engine = Engine(tiny_native())
    with pytest.raises(InputError, match="at least one token"):
        engine.submit([], GenerationConfig(max_new_tokens=4))
    with pytest.raises(ConfigError, match="k must be"):
        Speculation(NgramProposer(), k=0)
    with pytest.raises(ConfigError, match="cannot verify trees"):
        Engine(tiny_llama()).submit([1], None, Speculation(NgramProposer(), k=2, tree=TreeConfig()))


def test_a_model_without_multi_row_forwards_still_batches():
    target = tiny_llama(vocab=6, seed=2)  # the transformers adapter: one forward per row
    ps = [[1, 2, 1, 2], [3], [4, 5, 4]]
    specs = [Speculation(), Speculation(NgramProposer(), k=3), Speculation(NgramProposer(), k=1)]
    engine = Engine(target)
    got = [engine.submit(p, GenerationConfig(max_new_tokens=10), s) for p, s in zip(ps, specs)]
    engine.run()
    assert [r.result.token_ids for r in got] == [alone(target, p, 10) for p in ps]


# -- sampling in a batch ---------------------------------------------------------------------------


class WrongTemperatureDraft(DraftModelProposer):
    """Broken: drafts at the request's temperature but reports q at a sharper one."""

    def _reported(self, q):
        return torch.softmax(torch.log(q.clamp_min(1e-30)) / 0.3, dim=-1)


def _batched_pvalue(proposer_cls) -> float:
    """3,000 sampled requests of one kind in one engine, interleaved with others that greedy-decode,
    sample at another temperature, speculate differently or not at all."""
    target, draft = tiny_native(vocab=5, seed=0), tiny_native(vocab=5, seed=1, layers=1)
    sampling = SamplingConfig(temperature=1.0, top_k=4)
    spec = Speculation(proposer_cls(draft), k=2)
    others = [
        (GenerationConfig(max_new_tokens=5), Speculation(NgramProposer(), k=3)),
        (GenerationConfig(max_new_tokens=4, sampling=SamplingConfig(temperature=0.6)), Speculation()),
        (
            GenerationConfig(max_new_tokens=3, sampling=SamplingConfig(temperature=1.4)),
            Speculation(NgramProposer(), policy=make_policy("auto", 4)),
        ),
    ]
    engine = Engine(target, config=EngineConfig(max_batch=96))
    mine = []
    for i in range(N_SAMPLES):
        mine.append(engine.submit(PROMPT, GenerationConfig(max_new_tokens=3, sampling=sampling, seed=i), spec))
        cfg, other = others[i % len(others)]
        engine.submit(PROMPT[: 2 + i % 5], cfg, other)
    engine.run()
    counts = Counter(tuple(r.result.token_ids) for r in mine)
    return chi_square_pvalue(counts, sequence_law(target, PROMPT, 3, sampling))


def test_sampled_requests_in_a_mixed_batch_follow_the_target_law():
    assert _batched_pvalue(DraftModelProposer) > ALPHA


def test_a_wrong_q_in_a_mixed_batch_is_caught():
    assert _batched_pvalue(WrongTemperatureDraft) < ALPHA


# -- batch-aware k ---------------------------------------------------------------------------------


def test_forward_costs_interpolate_and_extrapolate():
    costs = ForwardCosts(ema=1.0)
    assert costs(10) > costs(1)  # the prior is a gently rising line
    costs.observe(1, 1.0)
    costs.observe(11, 2.0)
    assert costs(6) == pytest.approx(1.5) and costs(21) == pytest.approx(3.0) and costs.slope() == pytest.approx(0.1)


def test_a_noisy_dip_in_the_curve_does_not_read_as_free_rows():
    """The planner prices drafts from a line through the measured counts nearby, not from the
    neighbouring point: one fast forward a row further on must not make drafts look free."""
    costs = ForwardCosts(ema=1.0)
    for n, s in ((250, 0.5), (500, 1.0), (501, 0.95), (750, 1.5), (1000, 2.0)):
        costs.observe(n, s)
    assert costs(501) < costs(500)  # the dip
    level, slope = costs.line(500)
    assert level == pytest.approx(1.0, rel=0.05) and slope == pytest.approx(0.002, rel=0.05)
    weak = Candidate([0.05, 0.01], draft_s_per_token=0.0, k_max=2)
    assert plan([weak], 499, 31.0, costs) == [0]  # 32 tokens a step: a 5% draft does not pay a row
    assert costs.line(2) == (costs(2), costs.slope())  # nothing measured nearby: the curve itself


def test_planner_speculates_on_a_flat_curve_and_stops_when_rows_get_expensive():
    good = Candidate([0.9, 0.81, 0.73, 0.66], draft_s_per_token=0.001, k_max=4)
    flat, steep = ForwardCosts(ema=1.0), ForwardCosts(ema=1.0)
    for n in (1, 200):
        flat.observe(n, 0.010 + 0.00001 * n)
        steep.observe(n, 0.010 * n)  # every row costs a full forward: a saturated batch
    assert plan([good], 0, 0.0, flat) == [4]
    assert plan([good] * 32, 0, 0.0, steep) == [0] * 32
    poor = Candidate([0.1, 0.01, 0.0, 0.0], draft_s_per_token=0.001, k_max=4)
    assert plan([good, poor], 0, 0.0, flat)[1] <= 1


def test_a_one_time_read_is_paid_for_by_every_token_drafting_commits():
    """A draft model's unread prompt is priced per token the request is expected still to make
    and charged on every token a drafting step commits: the planner drafts exactly where, over
    the request's life, drafting saves more than the read costs. Here plain decoding costs
    11 ms a token and k = 4 (4.1 tokens for 19 ms) 4.63 ms: a read that adds 6 ms to each
    token pays, one that adds 7 ms does not (charged once a step, it looked like 1.7 ms)."""
    costs = ForwardCosts()
    for n in (1, 2, 4, 8):
        costs.observe(n, 0.01 + 0.001 * n)
    accept = [0.9, 0.81, 0.73, 0.66]
    assert plan([Candidate(accept, 0.001, 4, read_s_per_token=0.007)], 0, 0.0, costs) == [0]
    assert plan([Candidate(accept, 0.001, 4, read_s_per_token=0.006)], 0, 0.0, costs) == [4]
    assert plan([Candidate(accept, 0.001, 4)], 0, 0.0, costs) == [4]
    # before any read was timed, one request a step reads (price 0), the others wait (inf)
    pair = [Candidate(accept, 0.001, 4), Candidate(accept, 0.001, 4, read_s_per_token=float("inf"))]
    assert plan(pair, 0, 0.0, costs) == [4, 0]
    never = Candidate([0.9, 0.0, 0.0, 0.0], 0.001, 4, read_s_per_token=float("inf"))
    assert plan([never], 0, 0.0, costs) == [0]  # a draft adding no tokens is charged nothing, not NaN


def test_the_engine_learns_what_a_draft_models_prompt_read_costs():
    target, draft = tiny_native(vocab=8, seed=5, layers=2), tiny_native(vocab=8, seed=6, layers=1)
    spec = Speculation(DraftModelProposer(draft), policy=make_policy("auto", 4))
    engine = Engine(target)
    first = engine.submit(list(range(8)) * 3, GenerationConfig(max_new_tokens=6), spec)
    second = engine.submit([1, 2, 3], GenerationConfig(max_new_tokens=6), spec)
    engine.run()
    assert first.result is not None and second.result is not None
    assert engine.memory.read_rates[id(spec.proposer)] > 0  # the 23-token prompt read, per token


def test_a_stale_request_is_probed_only_where_optimism_pays():
    """Off for a while, a request is judged with its acceptance raised to the prior: on a flat
    curve that brings drafting back (to re-measure); in a saturated batch nothing is forced on it."""
    policy = AutoK(4)
    for _ in range(20):
        policy.update(2, 0, 0.002, 0.01)  # measured useless
    assert policy.accept_by_position()[0] < 0.01
    assert policy.accept_when_drafted(optimistic=True) == pytest.approx([0.6, 0.36, 0.216, 0.1296])
    flat, steep = ForwardCosts(ema=1.0), ForwardCosts(ema=1.0)
    for n in (1, 200):
        flat.observe(n, 0.010 + 0.00001 * n)
        steep.observe(n, 0.010 * n)
    assert plan([Candidate(policy.accept_when_drafted(), 0.001, 4)], 0, 0.0, flat) == [0]
    stale = Candidate(policy.accept_when_drafted(optimistic=True), 0.001, 4)
    assert plan([stale], 0, 0.0, flat)[0] > 0
    assert plan([stale] * 32, 0, 0.0, steep) == [0] * 32


def test_a_proposer_sure_of_its_deep_drafts_is_asked_for_them():
    """A lookup that drafts one token when its match is short (right half the time) and six when
    it is long (all accepted): one more draft never pays on this steep curve, the run of six does.
    A deep estimate still at its prior is never worth more than the measured draft above it."""
    costs = ForwardCosts(ema=1.0)
    for n in (1, 200):
        costs.observe(n, 0.010 + 0.006 * (n - 1))
    sure = Candidate([0.5] + [1.0] * 5 + [0.0] * 2, 0.0, 8, reach_by_position=[1.0] + [0.5] * 5 + [0.0] * 2)
    assert plan([sure], 0, 0.0, costs) == [6]
    useless_then_prior = Candidate([0.0, 0.0, 0.216, 0.1296], 0.0, 4)
    assert [useless_then_prior.gain(i) for i in range(4)] == [0.0] * 4
    assert plan([useless_then_prior], 0, 0.0, costs) == [0]


def test_auto_k_switches_off_as_the_batch_grows():
    """Where verify rows are not nearly free, the batch-planned k falls with the batch size."""
    target = tiny_native(vocab=8, seed=5, layers=2)
    engine = Engine(target, config=EngineConfig(max_batch=64))
    for n in (1, 2, 4, 8):  # a synthetic cost curve that steepens with the rows (a saturated machine)
        engine.memory.costs.observe(n, 0.01 * n)
    engine.memory.costs.observe(600, 6.0)
    engine.memory.costs.ema = 0.0  # keep it: this test is about the planner's use of the curve
    engine.memory.costs.forget_after = 1 << 30  # nor forget it
    spec = Speculation(NgramProposer(), policy=make_policy("auto", 4))
    for i in range(48):
        engine.submit([1, 2, 3, 1, 2, 3, 1, 2], GenerationConfig(max_new_tokens=12, seed=i), spec)
    engine.run()
    k = engine.k_by_batch_size()
    assert k[48] == 0.0  # off, and no probe forced on a batch where even the prior would not pay


def test_a_step_carrying_a_prompt_chunk_never_charges_the_prompt_to_decoding():
    """A fresh engine has timed little but prompt steps, and a line through two of them can come
    out flat (here: 220 and 435 rows in the same 1.1 s). Read as it stands, decoding's share of
    a step carrying 214 prompt rows is the whole 1.1 s, and a weak draft, its row free, looks
    worth 12 ms of drafting and a prompt read. Decoding is charged its rows' share at most."""
    costs = ForwardCosts(ema=1.0)
    costs.observe(220, 1.1)
    costs.observe(435, 1.1)
    weak = Candidate([0.6, 0.36, 0.22, 0.13], draft_s_per_token=0.012, k_max=4, read_s_per_token=0.05)
    assert plan([weak] * 6, 214, 0.0, costs, prefill_rows=214) == [0] * 6
    good = Candidate([0.9, 0.81, 0.73, 0.66], draft_s_per_token=0.001, k_max=4)  # cheap, sure drafts still pay
    assert plan([good] * 6, 214, 0.0, costs, prefill_rows=214) == [4] * 6


def test_a_drafters_read_is_priced_by_the_batch_the_requests_now_prefilling_will_make():
    """When a burst of requests arrives, the first to finish their prompts decode a few steps in
    a small batch, where drafting pays, then for the rest of their lives in a full one, where it
    does not; the read is paid for only by those later rounds. So a read is spread over the share
    of rounds the planner would draft in once everyone admitted or waiting decodes (16 at once:
    each drafter read its prompt, then drafted once)."""
    target = tiny_native(vocab=8, seed=5, layers=2)
    spec = Speculation(DraftModelProposer(tiny_native(vocab=8, seed=6, layers=1)), policy=make_policy("auto", 4))
    engine = Engine(target, config=EngineConfig(max_batch=8, prefill_chunk=4))
    for n in (1, 2, 4, 8, 16, 32):  # a row costs a full forward from two rows on: 8 requests never draft
        engine.memory.costs.observe(n, 0.01 * max(n, 1.5) if n > 1 else 0.01)
    engine.memory.costs.ema, engine.memory.costs.forget_after = 0.0, 1 << 30
    engine.memory.read_rates[id(spec.proposer)] = 0.001
    first = engine.submit([3, 1, 2, 0, 1, 2, 3, 1], GenerationConfig(max_new_tokens=40), spec)
    engine.step()
    engine.step()  # its prompt is in: it decodes alone, its draft model has read nothing
    assert first.status == RUNNING and first.read_at is None
    candidate = Candidate(first.policy.accept_when_drafted(), 0.001, 4)
    alone_cost = engine._read_cost(first, set(), _Crowd(candidate, 1, {}))
    assert alone_cost == pytest.approx(engine._read_cost(first, set()))  # nobody coming: as before
    for _ in range(7):  # seven more arrive, their prompts long
        engine.submit([1, 2, 3, 0] * 8, GenerationConfig(max_new_tokens=40), spec)
    crowded = engine._read_cost(first, set(), _Crowd(candidate, 1, {}))
    assert crowded == pytest.approx(alone_cost / MIN_SHARE)  # in a batch of 8 it would never draft
    del engine.memory.read_rates[id(spec.proposer)]  # unpriced: the first read would be free, but not here
    assert engine._read_cost(first, set(), _Crowd(candidate, 1, {})) == float("inf")
    assert engine._read_cost(first, set()) == 0.0


def test_a_draft_model_kept_off_by_the_planner_never_reads_a_prompt():
    """Under a load where the planner drafts nothing, a draft model is never run: its prompt is
    read only before a request's first drafting round (``catch_up``), not when it starts."""
    target, draft = tiny_native(vocab=8, seed=5, layers=2), tiny_native(vocab=8, seed=6, layers=1)
    calls: list[int] = []
    forward_rows, forward = draft.forward_rows, draft.forward
    draft.forward_rows = lambda ids, *a, **kw: (calls.append(len(ids)), forward_rows(ids, *a, **kw))[1]
    draft.forward = lambda ids, *a, **kw: (calls.append(1), forward(ids, *a, **kw))[1]
    engine = Engine(target, config=EngineConfig(max_batch=64))
    for n in (1, 2, 4, 8):
        engine.memory.costs.observe(n, 0.01 * n)
    engine.memory.costs.observe(600, 6.0)
    engine.memory.costs.ema = 0.0
    engine.memory.costs.forget_after = 1 << 30  # nor forget it
    spec = Speculation(DraftModelProposer(draft), policy=make_policy("auto", 4))
    ps = [[1, 2, 3, 1, 2, 3, 1, 2]] * 48
    out = engine.generate(ps, GenerationConfig(max_new_tokens=6), spec)
    assert engine.k_by_batch_size()[48] == 0.0 and calls == []
    assert all(r.token_ids == alone(target, ps[0], 6) for r in out)


# -- the real model ------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_model_mixed_batch_is_greedy_identical():
    from real_model import PROMPTS, chat_ids, default_target
    from specdecode.api import make_proposer

    loaded = default_target(backend="native")
    eos = loaded.eos_token_ids
    ids = [chat_ids(loaded, p) for p in (PROMPTS[1], PROMPTS[4], PROMPTS[6], PROMPTS[9])]
    specs = [
        Speculation(),
        Speculation(make_proposer("ngram", loaded), k=4),
        Speculation(make_proposer("eagle", loaded), k=4),
        Speculation(make_proposer("suffix", loaded), policy=make_policy("auto", 6)),
    ]
    cfg = GenerationConfig(max_new_tokens=32)
    expected = [Decoder(loaded.model, None, eos_token_ids=eos).generate(p, cfg).token_ids for p in ids]
    engine = Engine(loaded.model, eos_token_ids=eos, config=EngineConfig(max_batch=3))
    got = [engine.submit(p, cfg, s) for p, s in zip(ids, specs)]
    engine.run()
    assert [r.result.token_ids for r in got] == expected


def test_positions_a_request_rarely_drafts_cost_in_proportion():
    """A confidence stop drafts deep positions only sometimes: asking for them costs rows and
    draft time in proportion to how often they come, so the planner asks as deep as pays."""
    costs = ForwardCosts(ema=1.0)
    for n in (1, 200):
        costs.observe(n, 0.010 + 0.002 * (n - 1))  # each row costs a fifth of a one-row forward
    accept = [0.8, 0.6, 0.45, 0.35]
    always = Candidate(accept, draft_s_per_token=0.001, k_max=4)
    sometimes = Candidate(accept, draft_s_per_token=0.001, k_max=4, reach_by_position=[0.9, 0.5, 0.2, 0.1])
    assert plan([sometimes], 0, 0.0, costs) >= plan([always], 0, 0.0, costs)
    never = Candidate(accept, draft_s_per_token=0.001, k_max=4, reach_by_position=[0.0] * 4)
    assert plan([never], 0, 0.0, costs) == [0]  # nothing ever drafted: nothing to gain


# -- free scored drafts: drafted first, cut to what pays --------------------------------------------


class ScoredMarkovDraft(PerRequest):
    """Drafts along a second-order Markov table: deterministic (the table's argmax, scored by its
    probability), or, given a ``judge`` table, sampled and scored 1 when it drew the judge's
    favourite, else 0 (a score that depends on the token drawn)."""

    name = "scored-markov"
    caps = ProposerCaps(scored_drafts=True)

    def __init__(self, table: torch.Tensor, judge: torch.Tensor | None = None) -> None:
        self.table, self.judge = table, judge

    def propose(self, context, k, sampling, generator):
        ctx, tokens, scores, probs = list(context), [], [], []
        for _ in range(k):
            logits = self.table[ctx[-2] if len(ctx) > 1 else 0, ctx[-1]]
            if self.judge is not None:
                q = logits_to_probs(logits[None], sampling)[0]
                x = int(torch.multinomial(q, 1, generator=generator))
                probs.append(q)
                scores.append(float(x == int(self.judge[ctx[-2] if len(ctx) > 1 else 0, ctx[-1]].argmax())))
            else:
                q = torch.softmax(logits, -1)
                x = int(q.argmax())
                scores.append(float(q[x]))
            tokens.append(x)
            ctx.append(x)
        return Draft(torch.tensor([tokens]), torch.stack(probs)[None] if probs else None, torch.tensor([scores]))

    def observe(self, num_accepted: int) -> None:
        pass


def _steep_engine(target, max_batch: int = 1) -> Engine:
    """An engine whose cost curve is fixed at every row count it will see: each row costs a fifth
    of a one-row forward."""
    engine = Engine(target, config=EngineConfig(max_batch=max_batch))
    for n in range(1, 129):
        engine.memory.costs.observe(n, 0.01 + 0.002 * (n - 1))
    engine.memory.costs.ema = 0.0
    engine.memory.costs.forget_after = 1 << 30  # nor forget it
    return engine


def test_score_calibration_starts_at_the_proposers_word_and_learns_what_scores_are_worth():
    cal = ScoreCalibration(bins=10, weight=4.0, horizon=100.0)
    assert cal.rate(0.93) == pytest.approx(0.95) and cal.rate(0.02) == pytest.approx(0.05)
    for _ in range(50):  # drafts scored 0.95 turn out right a third of the time (the first of each)
        cal.observe([0.95, 0.95, 0.95], accepted=1)  # judged: the first two (the second rejected)
    assert cal.rate(0.95) == pytest.approx((50 + 4 * 0.95) / (100 + 4), rel=1e-6)
    assert cal.accept_by_position([0.95, 0.95]) == pytest.approx([cal.rate(0.95), cal.rate(0.95) ** 2])
    for _ in range(1000):
        cal.observe([0.55], accepted=1)
    assert cal.judged[5] == pytest.approx(100.0) and cal.rate(0.55) > 0.95  # bounded memory, still right


def test_free_scored_drafts_are_made_first_and_only_the_sure_prefix_is_verified():
    """A proposer declaring ``scored_drafts`` drafts k_max before the planner chooses k; on a curve
    where a row costs a fifth of a forward, its unsure drafts are cut, and the output is unchanged."""
    target = tiny_native(vocab=8, seed=5, layers=2)
    g = torch.Generator().manual_seed(3)
    table = torch.randn(8, 8, 8, generator=g) * 3.0
    spec = Speculation(ScoredMarkovDraft(table), policy=make_policy("auto", 6))
    engine = _steep_engine(target)
    request = engine.submit([1, 2, 3, 4], GenerationConfig(max_new_tokens=24), spec)
    seen: list[tuple[list[float], int]] = []
    while engine.busy:
        engine.step()
        if request.draft.k or request.status == RUNNING:
            seen.append((request.draft_scores() or [], request.k))
    assert request.result.token_ids == alone(target, [1, 2, 3, 4], 24)
    cut = [(scores, k) for scores, k in seen if k < 6]
    assert cut and all(len(scores) == k for scores, k in seen)  # verified exactly what was planned
    assert engine.memory.calibrations[(id(spec.proposer), "", "greedy")].judged != [0.0] * 10  # and learnt from it


def test_one_slow_forward_does_not_price_drafts_out_for_good():
    """A hiccup measured at 2 rows makes every draft look dear, and rows the planner never uses
    are never measured again; the count is forgotten after ``forget_after`` forwards, so the
    request drafts again (and its tokens stay exactly plain greedy decoding's)."""
    target = tiny_native(vocab=8, seed=5, layers=2)
    table = torch.randn(8, 8, 8, generator=torch.Generator().manual_seed(3)) * 3.0
    spec = Speculation(ScoredMarkovDraft(table), policy=make_policy("auto", 6))
    engine = Engine(target)
    engine.memory.costs.forget_after = 32
    engine.memory.costs.observe(1, 0.001)
    engine.memory.costs.observe(2, 10.0)  # one slow 2-row forward
    request = engine.submit([1, 2, 3, 4], GenerationConfig(max_new_tokens=80), spec)
    ks = []
    while engine.busy:
        engine.step()
        if request.status == RUNNING:
            ks.append(request.k)
    assert request.result.token_ids == alone(target, [1, 2, 3, 4], 80)
    assert ks[:30] == [0] * 30 and any(ks[48:])  # priced out, then forgotten and drafting again
    assert engine.memory.costs(2) < 1.0  # measured again


def test_a_decoders_runs_share_what_the_planner_learnt():
    """One Decoder, one request after another: every run's engine has the decoder's memory, so
    the second request plans on the first one's measured costs and calibration (not priors);
    its tokens are still exactly plain greedy decoding's."""
    target = tiny_native(vocab=8, seed=5, layers=2)
    table = torch.randn(8, 8, 8, generator=torch.Generator().manual_seed(3)) * 3.0
    decoder = Decoder(target, ScoredMarkovDraft(table), policy=make_policy("auto", 6))
    first = decoder.run([1, 2, 3, 4], GenerationConfig(max_new_tokens=16))
    first.result()
    assert first.engine.memory is decoder.memory and decoder.memory.costs.points
    judged = sum(decoder.memory.calibrations[(id(decoder.spec.proposer), "", "greedy")].judged)
    second = decoder.run([4, 3, 2, 1], GenerationConfig(max_new_tokens=16))
    assert second.engine is not first.engine and second.engine.memory is decoder.memory
    assert second.result().token_ids == alone(target, [4, 3, 2, 1], 16)
    assert sum(decoder.memory.calibrations[(id(decoder.spec.proposer), "", "greedy")].judged) > judged > 0
    assert Engine(target).memory is not decoder.memory  # an engine of its own learns alone


def test_a_proposers_next_request_starts_from_what_its_last_ones_measured():
    """A short request is over before its own estimates leave the flat prior, so the engine keeps
    each proposer's acceptance by position and draft speed from the requests that finished and
    starts the next request of that proposer there. Tokens are unchanged."""
    target, twin = tiny_native(vocab=8, seed=5, layers=2), tiny_native(vocab=8, seed=5, layers=2)
    spec = Speculation(DraftModelProposer(twin), policy=make_policy("auto", 4))  # drafts what the target says
    engine = Engine(target)
    for n in (1, 200):  # a fixed flat curve of slow forwards: drafting always pays, whatever the load
        engine.memory.costs.observe(n, 1.0 + 0.0001 * n)
    engine.memory.costs.ema = 0.0
    engine.memory.costs.forget_after = 1 << 30  # nor forget it
    first = engine.generate([[1, 2, 3]], GenerationConfig(max_new_tokens=24), spec)[0]
    assert first.token_ids == alone(target, [1, 2, 3], 24)
    key = (id(spec.proposer), "")  # a draft model drafts from one source
    history = engine.memory.acceptance[(*key, "greedy")]
    assert history.rounds > 0 and history.estimates.cond[0] > 0.8 > 0.6  # above the flat prior
    assert engine.memory.draft_rates[key] > 0
    second = engine.submit([4, 3, 2, 1], GenerationConfig(max_new_tokens=24), spec)
    engine.step()  # admitted; its prompt is fed, no round judged yet
    assert second.policy.estimates() == history.estimates
    engine.run()
    assert second.result.token_ids == alone(target, [4, 3, 2, 1], 24)


def hybrid_with_twin(target) -> tuple[HybridProposer, DraftModelProposer, list[tuple[str, int, int]]]:
    """A hybrid whose drafter is the target's twin (drafts what the target says), and a log of
    what happened to it: ("source:NAME", context length, k asked) for each round's named source,
    ("catch_up", length, 0) and ("propose", length, k) for the draft model (its states log here)."""
    twin = tiny_native(vocab=8, seed=5, layers=2)
    log: list[tuple[str, int, int]] = []

    class Logged(DraftModelProposer):
        def catch_up(self, context):
            log.append(("catch_up", len(context), 0))
            super().catch_up(context)

        def propose(self, context, k, sampling, generator):
            log.append(("propose", len(context), k))
            return super().propose(context, k, sampling, generator)

    class LoggedHybrid(HybridProposer):
        def source(self, context, k):
            named = super().source(context, k)
            log.append((f"source:{named.name}", len(context), k))
            return named

    drafter = Logged(twin)
    return LoggedHybrid(drafter), drafter, log


def test_a_composite_proposer_is_planned_source_by_source():
    """The hybrid names each round's source before k is chosen: the engine keeps acceptance and
    draft speed per source, and the draft model reads the context only before a round it drafts
    (lookup rounds leave it behind, to read in one catch-up). Tokens are unchanged."""
    target = tiny_native(vocab=8, seed=5, layers=2)
    proposer, drafter, log = hybrid_with_twin(target)
    spec = Speculation(proposer, policy=make_policy("auto", 4))
    engine = Engine(target)
    for n in (1, 200):  # a flat curve of slow forwards: drafting pays wherever it is accepted
        engine.memory.costs.observe(n, 1.0 + 0.0001 * n)
    engine.memory.costs.ema = 0.0
    engine.memory.costs.forget_after = 1 << 30  # nor forget it
    prompt = [1, 2, 3, 4, 1, 2, 3, 0, 1, 2] * 2
    result = engine.generate([prompt], GenerationConfig(max_new_tokens=40), spec)[0]
    assert result.token_ids == alone(target, prompt, 40)
    rounds = result.stats["hybrid_rounds"]
    assert rounds["lookup"] and rounds["drafter"], rounds
    assert result.stats["sources"]["lookup"]["rounds"] == rounds["lookup"]  # the engine's own tally
    lookup_at = {n for kind, n, _ in log if kind == "source:lookup"}
    read_at = {n for kind, n, _ in log if kind == "catch_up"}
    drafted_at = {n for kind, n, k in log if kind == "propose" and k > 0}
    assert read_at and read_at <= drafted_at and not read_at & lookup_at  # reads only for its own rounds
    key = id(proposer)
    assert set(engine.memory.acceptance) == {(key, "lookup", "greedy"), (key, "drafter", "greedy")}
    rates = engine.memory.draft_rates
    assert rates[(key, "lookup")] < rates[(key, "drafter")] / 5  # a lookup costs next to nothing


def test_a_hybrids_suffix_lookup_rounds_are_drafted_first_and_priced_by_their_scores():
    """A hybrid's suffix-lookup round is what a suffix proposer's every round is (deterministic,
    nearly free, scored): drafted to k_max before the planner chooses k and priced by what its
    scores proved worth, learnt apart from the drafter's rounds. Unscored, lookup rounds were
    priced by their measured acceptance alone, and at 16 requests the hybrid verified drafts that
    plain suffix decoding cut. Tokens are unchanged."""
    target = tiny_native(vocab=8, seed=5, layers=2)
    proposer, drafter, log = hybrid_with_twin(target)
    spec = Speculation(proposer, policy=make_policy("auto", 6))
    engine = _steep_engine(target)
    prompt = [1, 2, 3, 4, 1, 2, 3, 0, 1, 2] * 2
    request = engine.submit(prompt, GenerationConfig(max_new_tokens=40), spec)
    lookups, drafter_rounds = [], []
    while engine.busy:
        engine.step()
        if request.status == RUNNING and request.source.name == "lookup":
            lookups.append((request.drafts_first, request.draft_scores(), request.k))
        elif request.status == RUNNING and request.k:
            drafter_rounds.append(request.drafts_first)
    assert request.result.token_ids == alone(target, prompt, 40)
    assert lookups and all(first and len(scores or []) == k for first, scores, k in lookups)
    assert not any(drafter_rounds)  # the draft model's rounds cost drafting: planned as before
    key = id(proposer)
    assert engine.memory.calibrations[(key, "lookup", "greedy")].judged != [0.0] * 10
    assert (key, "drafter", "greedy") not in engine.memory.calibrations  # its drafts carry no scores


def test_a_drafters_read_is_spread_over_the_rounds_it_drafts_in():
    """A hybrid's draft model reads the prompt to speed up the rounds it drafts, not the lookup's
    nor those the planner keeps at k = 0 (most of them in a busy batch): the read is spread over
    the tokens still to come in such rounds, as a share of rounds the engine learns per proposer
    from requests that read. Where the drafter drafts one round in four, the read costs four
    times as much a token as where it drafts every round. (On HumanEval the 0.5B's prompt read
    cost a hybrid 0.23 s a request and saved it 0.08 s; at 16 requests, 17 reads and 17 drafting
    rounds cost the hybrid 3 s of 34.)"""
    target = tiny_native(vocab=8, seed=5, layers=2)
    proposer, drafter, log = hybrid_with_twin(target)
    spec = Speculation(proposer, policy=make_policy("auto", 4))
    engine = Engine(target)
    prompt = [1, 2, 3, 4, 1, 2, 3, 0, 1, 2] * 2
    first = engine.submit(prompt, GenerationConfig(max_new_tokens=30), spec)
    engine.run()
    assert first.read_at is not None and first.drafting_rounds < first.rounds - first.read_at  # lookup drafted some
    share = first.drafting_rounds / (first.rounds - first.read_at)
    assert engine.memory.drafting_shares[id(proposer)] == pytest.approx(share)
    engine.memory.drafting_shares[id(proposer)] = 0.25
    engine.memory.read_rates[id(proposer)] = 0.001  # seconds per token read
    fresh = engine.submit([3, 1, 2, 0, 1, 2, 3, 1], GenerationConfig(max_new_tokens=40), spec)
    engine.step()  # admitted and prefilled: its drafter has read nothing yet
    fresh.enter(DRAFTER)  # a round the drafter would draft
    unread, remaining = fresh.unread(), engine._remaining(fresh)
    assert fresh.read_at is None and unread > 0
    assert engine._read_cost(fresh, set()) == pytest.approx(0.001 * unread / (remaining * 0.25))
    fresh.metrics.target_calls = 8  # rounds before any read tell nothing: the drafter could not draft in them
    assert engine._read_cost(fresh, set()) == pytest.approx(0.001 * unread / (remaining * 0.25))
    fresh.read_at, fresh.metrics.target_calls, fresh.drafting_rounds = (
        8,
        16,
        8,
    )  # since its read, it drafted every round
    assert engine._read_cost(fresh, set()) == pytest.approx(0.001 * unread / (remaining * (8 + 2) / 16))
    # a request that never read drifts the figure back toward drafting (a busy spell is not forever)
    quiet = Engine(target)
    quiet.memory.drafting_shares[id(proposer)] = 0.25
    quiet.generate([[3, 2, 1]], GenerationConfig(max_new_tokens=1), spec)
    assert quiet.memory.drafting_shares[id(proposer)] == pytest.approx(0.25 + 0.1 * 0.75)
    alone_spec = Speculation(DraftModelProposer(tiny_native(vocab=8, seed=6)), policy=make_policy("auto", 4))
    alone = quiet.submit(prompt, GenerationConfig(max_new_tokens=12), alone_spec)
    quiet.run()  # a draft model alone: the rounds it was planned at k = 0 count against it too
    assert alone.read_at is not None and 0 < alone.drafting_rounds <= alone.rounds - alone.read_at
    got = quiet.memory.drafting_shares[id(alone_spec.proposer)]
    assert got == pytest.approx(alone.drafting_rounds / (alone.rounds - alone.read_at))


def test_a_source_that_does_not_pay_stays_off_while_another_drafts():
    """A draft model measured far too slow to pay is never asked for a draft, while the same
    request's lookup rounds still draft (one estimate for both would have mixed them)."""
    target = tiny_native(vocab=8, seed=5, layers=2)
    proposer, drafter, log = hybrid_with_twin(target)
    engine = Engine(target)
    for n in (1, 200):
        engine.memory.costs.observe(n, 1.0 + 0.0001 * n)
    engine.memory.costs.ema = 0.0
    engine.memory.costs.forget_after = 1 << 30  # nor forget it
    engine.memory.draft_rates[(id(proposer), "drafter")] = 10.0  # seconds a token: ten forwards
    spec = Speculation(proposer, policy=make_policy("auto", 4))
    prompt = [1, 2, 3, 4, 1, 2, 3, 0, 1, 2] * 2
    result = engine.generate([prompt], GenerationConfig(max_new_tokens=40), spec)[0]
    assert result.token_ids == alone(target, prompt, 40)
    assert result.stats["hybrid_rounds"]["lookup"] >= 3
    assert not [entry for entry in log if entry[0] in ("propose", "catch_up")]  # nor read the prompt


def test_a_round_kept_off_its_draft_model_drafts_the_short_lookup_instead():
    """Where the planner drafts nothing from a hybrid's draft model, the round falls back to
    suffix decoding's short draft (fewer than min_match tokens), scored and planned around the
    rest of the step: it drafts what plain suffix decoding would instead of nothing. The draft
    model is never run, and the tokens are the target's."""
    target = tiny_native(vocab=8, seed=5, layers=2)
    proposer, drafter, log = hybrid_with_twin(target)
    engine = _steep_engine(target)
    engine.memory.draft_rates[(id(proposer), "drafter")] = 10.0  # seconds a token: never pays
    spec = Speculation(proposer, policy=make_policy("auto", 4))
    prompt = [1, 2, 3, 4, 1, 2, 3, 0, 1, 2] * 2
    request = engine.submit(prompt, GenerationConfig(max_new_tokens=40), spec)
    engine.run()
    result = request.result
    assert result.token_ids == alone(target, prompt, 40)
    short = result.stats["hybrid_rounds"]["short"]
    assert short >= 1  # rounds the drafter's name would have left empty
    assert not [entry for entry in log if entry[0] in ("propose", "catch_up")]


def test_greedy_and_sampled_requests_learn_acceptance_apart():
    """Acceptance history is kept per sampling regime: sampled requests of a proposer do not
    move where its next greedy request starts (a greedy draft must equal the argmax; a sampled
    one is kept with probability min(1, p/q)), nor its score calibration."""
    target = tiny_native(vocab=8, seed=5, layers=2)
    spec = Speculation(NgramProposer(), policy=make_policy("auto", 3))
    engine = Engine(target)
    prompt = [1, 2, 3, 4, 1, 2, 3, 0, 1, 2]
    engine.generate([prompt], GenerationConfig(max_new_tokens=16), spec)
    greedy = engine.memory.acceptance[(id(spec.proposer), "", "greedy")]
    before = (greedy.estimates, greedy.rounds)
    hot = GenerationConfig(max_new_tokens=16, sampling=SamplingConfig(temperature=1.0), seed=3)
    engine.generate([prompt], hot, spec)
    assert (id(spec.proposer), "", "T=1") in engine.memory.acceptance
    assert (greedy.estimates, greedy.rounds) == before
    request = engine.submit(prompt, GenerationConfig(max_new_tokens=4), spec)
    engine.step()
    assert request.policy.estimates() == greedy.estimates  # a greedy request starts from greedy ones


def test_a_draft_models_read_is_spread_over_the_tokens_requests_typically_make():
    """A prompt read is priced as its share over the tokens still to come: the budget left
    until a request has finished, then what finished requests made (answers that stop at EOS
    long before max_new_tokens made the read look cheaper than it was). A request its budget
    cut short tells only that answers run at least that long: it may raise the typical length,
    never start or lower it (a 4-token warm-up once priced every later read over 4 tokens)."""
    target = tiny_native(vocab=8, seed=5, layers=2)
    engine = Engine(target, eos_token_ids=frozenset({0}))  # [1, 2, 3] ends at EOS after 22 tokens
    waiting = engine.submit([1, 2, 3], GenerationConfig(max_new_tokens=100))
    assert engine._remaining(waiting) == 100  # nothing finished yet: the whole budget
    engine.generate([[1, 2, 3]], GenerationConfig(max_new_tokens=8))  # cut at 8; the first runs to EOS
    assert waiting.output.finish_reason == "eos" and engine.memory.output_tokens == 22
    engine.generate([[3, 2, 1]], GenerationConfig(max_new_tokens=4))  # cut short: no news
    assert engine.memory.output_tokens == 22
    engine.generate([[3, 2, 1]], GenerationConfig(max_new_tokens=60))  # cut at 60: longer than typical
    typical = engine.memory.output_tokens
    assert typical == pytest.approx(0.7 * 22 + 0.3 * 60)
    fresh = engine.submit([3, 2, 1], GenerationConfig(max_new_tokens=100))
    assert engine._remaining(fresh) == pytest.approx(typical)
    short = engine.submit([3, 2, 1], GenerationConfig(max_new_tokens=4))
    assert engine._remaining(short) == 4  # never more than its own budget leaves


def test_a_draft_read_is_priced_by_the_tokens_the_draft_read():
    """Between two drafting rounds a draft model has fed its own accepted drafts: the engine's
    price of reading (seconds per token) counts what it read, not everything committed since,
    which a round accepting 8 drafts would otherwise price at next to nothing a token."""
    target = tiny_native(vocab=8, seed=5, layers=2)
    twin = tiny_native(vocab=8, seed=5, layers=2)  # drafts what the target says: all accepted
    fed: list[int] = []
    rows = twin.forward_rows

    def spy(ids, *args, **kw):
        if kw.get("keep") == [0]:  # a read, not a drafting step
            fed.append(int(ids[0].numel()))
        return rows(ids, *args, **kw)

    twin.forward_rows = spy
    engine = Engine(target, config=EngineConfig(prefix_cache_mb=0))
    priced: list[int] = []
    price = engine._priced_read
    engine._priced_read = lambda r, tokens, seconds: (priced.append(tokens), price(r, tokens, seconds))
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5]
    out = engine.generate([prompt], GenerationConfig(max_new_tokens=30), Speculation(DraftModelProposer(twin), k=8))
    assert out[0].stats["accepted_tokens"] >= 16  # rounds that accepted all 8
    assert [t for t in priced if t] == fed == [len(prompt) - 1]


def test_acceptance_history_weighs_requests_by_their_rounds_and_forgets_slowly():
    def est(a: float) -> AcceptanceEstimates:
        return AcceptanceEstimates((a, a), (a, a * a), (1.0, 1.0))

    history = AcceptanceHistory(horizon=10.0)
    history.observe(est(0.2), 0)  # drafted nothing: measured nothing
    assert history.estimates is None
    history.observe(est(0.2), 4)
    history.observe(est(0.8), 12)  # three times the rounds: three quarters of the weight
    assert history.estimates.cond == pytest.approx((0.65, 0.65)) and history.rounds == 10.0
    history.observe(est(0.0), 10)  # past the horizon, the old rounds count as ``horizon`` only
    assert history.estimates.cond == pytest.approx((0.325, 0.325))
    history.observe(AcceptanceEstimates((0.5,), (0.5,), (1.0,)), 2)  # another k_max: starts over
    assert history.estimates.cond == (0.5,) and history.rounds == 2.0
    policy = AutoK(2)
    policy.start_from(est(0.9))
    assert policy.estimates() == est(0.9) and policy.accept_when_drafted() == [0.9, 0.81]
    policy.start_from(AcceptanceEstimates((0.1,) * 3, (0.1,) * 3, (1.0,) * 3))  # made for k_max 3: ignored
    assert policy.estimates() == est(0.9)


def _scored_pvalue(sampled: bool) -> float:
    """3,000 sampled requests drafting first (auto), 8 to a batch on a fixed steep curve."""
    target = MarkovLM(5, seed=11)
    sampling = SamplingConfig(temperature=1.0)
    proposer = ScoredMarkovDraft(target.table * 0.5, judge=target.table if sampled else None)  # a flatter sibling
    spec = Speculation(proposer, policy=make_policy("auto", 3))
    engine = _steep_engine(target, max_batch=8)
    mine = [
        engine.submit(PROMPT, GenerationConfig(max_new_tokens=3, sampling=sampling, seed=i), spec)
        for i in range(N_SAMPLES)
    ]
    engine.run()
    counts = Counter(tuple(r.result.token_ids) for r in mine)
    return chi_square_pvalue(counts, sequence_law(target, PROMPT, 3, sampling))


def test_a_k_chosen_from_deterministic_draft_scores_keeps_sampling_exact():
    assert _scored_pvalue(sampled=False) > ALPHA


def test_a_k_chosen_from_the_scores_of_sampled_drafts_is_caught(monkeypatch):
    """Scores on sampled drafts depend on the token drawn; cutting by them biases what is verified.
    The engine ignores them (the proposer then drafts first but is priced by its measured
    acceptance): broken on purpose to use them, the same test must fail."""
    assert _scored_pvalue(sampled=True) > ALPHA  # the guard on: exact
    monkeypatch.setattr(
        Request, "draft_scores", lambda r: None if r.draft.scores is None else r.draft.scores[0].tolist()
    )
    assert _scored_pvalue(sampled=True) < ALPHA


def test_a_prompt_chunk_is_counted_in_scoring_rows_worth():
    """A prompt row skips the output head; a decode or verify row does not. The cost curve counts
    each prompt row as (1 - head_share) of a scoring row, so a draft added beside a prompt chunk
    is priced at a scoring row's cost, not at the chunk's cheaper average (on the Qwen 1.5B a
    verify row costs 7.2 ms where a step of 112 mostly prompt rows averages 5.9)."""
    import dataclasses

    target = tiny_native(vocab=8, seed=5, layers=2)
    c = target.config
    head = c.vocab_size * c.hidden_size
    layer = (
        c.hidden_size * (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim + 3 * c.hidden_size * c.intermediate_size
    )
    assert target.caps.head_share == pytest.approx(head / (head + c.num_layers * layer))
    target.caps = dataclasses.replace(target.caps, head_share=0.5)  # a head as big as the layers
    engine = Engine(target, config=EngineConfig(prefill_chunk=32))
    first = engine.submit([1, 2, 3], GenerationConfig(max_new_tokens=40))
    while first.status != RUNNING:
        engine.step()
    engine.submit(list(range(1, 8)) * 10, GenerationConfig(max_new_tokens=4))  # 70 tokens: chunks of 32
    engine.memory.costs = ForwardCosts()
    engine.step()  # one decode row beside a 32-row prompt chunk
    assert list(engine.memory.costs.points) == [17]  # 32 * 0.5 + 1, not 33
    assert engine.steps[-1].rows == 33  # reports still count every row
