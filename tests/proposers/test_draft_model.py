"""A draft model that reads a window of the prompt (``prompt_window``): what it reads, that its
drafts are exactly a full-reading draft's on that view, and that decoding stays exact."""

from __future__ import annotations

import pytest

from helpers import tiny_llama, tiny_native
from specdecode.core.sampling import SamplingConfig
from specdecode.engine import Decoder, GenerationConfig
from specdecode.errors import ConfigError
from specdecode.methods import method_spec
from specdecode.proposers import DraftModelProposer
from specdecode.proposers.draft_model import SINK
from specdecode.proposers.early_exit import EarlyExitProposer

PROMPT = [1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 2, 4, 1, 3, 5, 0, 1, 1]  # 20 tokens
GREEDY = SamplingConfig()

pytestmark = pytest.mark.usefixtures("one_thread")


def _fed(model) -> list[int]:
    """Record the number of tokens each forward of ``model`` reads."""
    fed: list[int] = []
    forward = model.forward
    model.forward = lambda ids, cache, **kw: (fed.append(int(ids.shape[1])), forward(ids, cache, **kw))[1]
    return fed


def test_a_windowed_draft_reads_the_sinks_and_the_prompts_tail_then_everything_generated():
    draft = tiny_llama(vocab=6, seed=5)
    fed = _fed(draft)
    state = DraftModelProposer(draft, prompt_window=6).start(PROMPT)
    assert state.skipped == (SINK, len(PROMPT) - 6) and state.dropped == len(PROMPT) - SINK - 6
    context = PROMPT + [3]
    assert state.reads(context, 0) == SINK + 6 + 1  # what the engine prices the read by
    state.catch_up(context)
    assert fed == [SINK + 6]  # all of the view but its last token: the first round feeds that
    assert state.reads(context, len(context)) == 0
    out = state.propose(context, 3, GREEDY, None)
    context += out.tokens[0].tolist() + [2]
    state.propose(context, 2, GREEDY, None)
    assert state._view(context) == PROMPT[:SINK] + context[len(PROMPT) - 6 :]
    assert state.cache.length == len(state._view(context)) + 1  # and this round's first draft


def test_a_draft_prices_no_read_for_the_drafts_it_fed_itself():
    """After a round whose k drafts the target all kept, 0 to read: the draft fed itself drafts
    1..k-1, and the last draft and the bonus token go with the next round (counted from the
    engine's last read, k + 1 tokens were priced as a read to come). Tokens committed while the
    request did not draft are read, all but the last."""
    draft = tiny_llama(vocab=6, seed=5)
    fed = _fed(draft)
    state = DraftModelProposer(draft).start(PROMPT)
    context = PROMPT + [3]
    state.catch_up(context)
    last_read = len(context)
    context += state.propose(context, 4, GREEDY, None).tokens[0].tolist() + [2]  # all 4 kept, bonus 2
    assert state.reads(context, last_read) == 0 and state.catch_up(context) == 0
    context += [1, 4, 0, 5]  # committed at k = 0
    assert state.reads(context, last_read) == 2 + 4  # the last draft, the bonus, the four
    del fed[:]
    assert state.catch_up(context) == 5 and fed == [5]


@pytest.mark.parametrize("window", [1, 6, 15, 16, 100])
def test_a_windowed_draft_drafts_what_a_full_draft_drafts_from_the_same_view(window):
    """The window is only a view: drafting from it equals a full-reading draft started on the
    view, round after round; a prompt no longer than the sinks and the window is read whole."""
    draft = tiny_llama(vocab=6, seed=5)
    windowed = DraftModelProposer(draft, prompt_window=window).start(PROMPT)
    cut = max(len(PROMPT) - SINK - window, 0)
    view = PROMPT[:SINK] + PROMPT[SINK + cut :] if cut else PROMPT
    full = DraftModelProposer(draft).start(view)
    context, seen = list(PROMPT), list(view)
    for k, bonus in [(3, 1), (4, 5), (2, 0)]:
        a = windowed.propose(context, k, GREEDY, None).tokens[0].tolist()
        b = full.propose(seen, k, GREEDY, None).tokens[0].tolist()
        assert a == b
        context += a[:1] + [bonus]  # the first accepted, then the target's correction
        seen += a[:1] + [bonus]


def test_windowed_drafts_batched_equal_their_lone_drafts():
    draft = tiny_native(vocab=6, seed=6, layers=1)
    proposer = DraftModelProposer(draft, prompt_window=5)
    prompts = [PROMPT, PROMPT[:7], PROMPT[3:] + [2, 2, 2]]
    lone = [proposer.start(p).propose(p + [1], 3, GREEDY, None).tokens[0].tolist() for p in prompts]
    states = [proposer.start(p) for p in prompts]
    drafts = proposer.propose_batch(states, [p + [1] for p in prompts], [3, 3, 3], [GREEDY] * 3, [None] * 3)
    assert [d.tokens[0].tolist() for d in drafts] == lone


@pytest.mark.parametrize("kind", ["llama", "native"])
def test_greedy_with_a_windowed_draft_is_plain_greedy(kind):
    make = tiny_llama if kind == "llama" else tiny_native
    target, draft = make(vocab=6, seed=5, layers=2), make(vocab=6, seed=6, layers=1)
    cfg = GenerationConfig(max_new_tokens=30)
    expected = Decoder(target, None).generate(PROMPT, cfg).token_ids
    for window in (1, 4, 50):
        out = Decoder(target, DraftModelProposer(draft, prompt_window=window), k=3).generate(PROMPT, cfg)
        assert out.token_ids == expected, window


def test_prompt_window_is_checked_and_registered():
    for bad in (-1, 2.5, "8"):
        with pytest.raises(ConfigError, match="prompt_window"):
            DraftModelProposer(tiny_llama(vocab=6), prompt_window=bad)
    for method in ("draft", "hybrid"):
        method_spec(method).check_options(["prompt_window"])
    with pytest.raises(ConfigError, match="prompt_windw"):
        method_spec("draft").check_options(["prompt_windw"])
    with pytest.raises(ConfigError, match="prompt_window"):
        method_spec("early-exit").check_options(["prompt_window"])  # it reads the target's cache
    with pytest.raises(ConfigError, match="prompt_window"):
        EarlyExitProposer(tiny_native(vocab=6, layers=2), prompt_window=8)
