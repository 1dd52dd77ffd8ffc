"""Batch-aware k: each step, every planned request's k in 0..k_max for the most committed tokens/s.

A verify forward over N rows costs c(N), learnt from the engine's own steps. Request r drafting
k_r tokens commits 1 + a_r(1) + ... + a_r(k_r) in expectation (a_r(i): its live probability that
the first i drafts are all accepted) and costs d_r per drafted token. The step's rate is

    (sum_r E_r(k_r)) / (c(N_other + sum_r (k_r + 1)) + sum_r d_r k_r)

and k is raised one draft at a time, always where it helps the rate most, until no draft helps.
A request whose drafter must first read context it has not seen (a draft model's prompt) pays
for that read on every token it would commit while drafting: the read spread over the tokens the
request is expected still to make. So it reads only where, over its remaining life, drafting saves
more than the read costs, and a busy batch does not start it for little.
Small batches on a flat c(N) then speculate fully; as the batch grows c(N) steepens, the extra
rows stop paying, and speculation switches itself off (k = 0), with no table to tune.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specdecode.engine.policy import AcceptanceEstimates


class ForwardCosts:
    """Seconds of one target forward over n rows: an EMA per row count, linear in between and
    beyond (least-squares slope, never negative); before any measurement, a flat prior curve.

    A row count not measured in the last ``forget_after`` forwards is forgotten. Measurements
    are taken only at the row counts the planner chooses, so without this one slow forward (a
    hiccup, a first call's set-up) at 2 rows could price every draft out for good: the planner
    would never use 2 rows again, and so never measure them again. Forgotten, the count is
    priced from its neighbours or the prior, and measured again when next used.

    The planner asks for many row counts every step, so the measured counts are kept sorted and
    the slope is refitted only when a measurement arrives.
    """

    def __init__(self, ema: float = 0.3, prior_slope: float = 0.02, forget_after: int = 256) -> None:
        self.ema, self.prior_slope, self.forget_after = ema, prior_slope, forget_after
        self.points: dict[int, float] = {}
        self._xs: list[int] = []  # the keys of ``points``, ascending
        self._slope: float | None = None  # cached fit; None after a new measurement
        self._forwards = 0  # forwards observed
        self._last: dict[int, int] = {}  # row count -> the forward that last measured it

    def observe(self, rows: int, seconds: float) -> None:
        old = self.points.get(rows)
        if old is None:
            bisect.insort(self._xs, rows)
        self.points[rows] = seconds if old is None else (1 - self.ema) * old + self.ema * seconds
        self._forwards += 1
        self._last[rows] = self._forwards
        self._slope = None
        if self._forwards % 16 == 0:  # a scan of every count: often enough every 16th forward
            self._forget()

    def _forget(self) -> None:
        """Drop stale counts by swapping in new containers, the index first: a reader on another
        thread reads ``points`` before ``_xs`` and so never meets a count its ``points`` lacks."""
        keep = [x for x in self._xs if self._forwards - self._last.get(x, self._forwards) <= self.forget_after]
        if len(keep) < len(self._xs):
            self._xs = keep
            self.points = {x: self.points[x] for x in keep if x in self.points}
            self._last = {x: self._last.get(x, self._forwards) for x in keep}

    def __call__(self, rows: float) -> float:
        """Seconds of a forward over ``rows`` (the planner asks for expected, fractional counts)."""
        pts, xs = self.points, self._xs
        if rows in pts:
            return pts[rows]
        if not xs:
            return 1.0 + self.prior_slope * (rows - 1)
        i = bisect.bisect_left(xs, rows)  # xs[i - 1] < rows < xs[i]
        if 0 < i < len(xs):
            x0, x1 = xs[i - 1], xs[i]
            return pts[x0] + (pts[x1] - pts[x0]) * (rows - x0) / (x1 - x0)
        x0 = xs[-1] if i else xs[0]
        return max(pts[x0] + self.slope() * (rows - x0), 1e-9)

    def line(self, rows: int) -> tuple[float, float]:
        """(seconds at ``rows``, extra seconds per extra row) from a least-squares line through the
        measured row counts within a factor of two of ``rows`` (and at least 8 rows either side).

        The planner prices the drafts it adds from this line, not from neighbouring points: one
        noisy neighbour a few rows away can look cheaper, and a curve that dips reads as free rows.
        Fewer than two counts in the window: the curve's value and its overall slope.
        """
        lo, hi = min(rows / 2, rows - 8), max(2 * rows, rows + 8)
        pts, xs = self.points, self._xs  # in this order (see _forget)
        xs = xs[bisect.bisect_left(xs, lo) : bisect.bisect_right(xs, hi)]
        if len(xs) < 2:
            return self(rows), self.slope()
        mx, my, slope = _line(xs, [pts[x] for x in xs])
        return max(my + slope * (rows - mx), 1e-9), slope

    def slope(self) -> float:
        """Extra seconds per extra row (least squares over the measured row counts)."""
        if self._slope is None:
            self._slope = self._fit()
        return self._slope

    def _fit(self) -> float:
        pts, xs = self.points, self._xs  # in this order (see _forget)
        ys = [pts[x] for x in xs]
        if len(xs) < 2:
            return self.prior_slope * (ys[0] if ys else 1.0)
        return _line(xs, ys)[2]


def _line(xs: Sequence[int], ys: Sequence[float]) -> tuple[float, float, float]:
    """(mean x, mean y, least-squares slope never below 0) of two or more distinct counts."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return mx, my, max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var, 0.0)


class ScoreCalibration:
    """What a proposer's own scores are worth on this target: P(a draft is accepted | the drafts
    before it were, its score), by score bin, learnt from the rounds that verified scored drafts.

    A bin starts at its own score (the proposer taken at its word) with ``weight`` rounds' worth
    of belief, so a few rounds move it and many settle it; counts past ``horizon`` are scaled
    down, so a long-running engine follows a workload that changes.
    """

    def __init__(self, bins: int = 10, weight: float = 4.0, horizon: float = 400.0) -> None:
        self.bins, self.weight, self.horizon = bins, weight, horizon
        self.accepted = [0.0] * bins
        self.judged = [0.0] * bins

    def _bin(self, score: float) -> int:
        return min(max(int(score * self.bins), 0), self.bins - 1)

    def rate(self, score: float) -> float:
        """P(accepted | all drafts before it accepted) for a draft scored ``score``."""
        b = self._bin(score)
        prior = (b + 0.5) / self.bins
        return (self.accepted[b] + self.weight * prior) / (self.judged[b] + self.weight)

    def accept_by_position(self, scores: Sequence[float]) -> list[float]:
        """P(drafts 1..i all accepted) for a chain scored ``scores``."""
        return list(itertools.accumulate((self.rate(s) for s in scores), operator.mul))

    def observe(self, scores: Sequence[float], accepted: int) -> None:
        """A verified chain scored ``scores`` had its first ``accepted`` drafts accepted (the
        target judged those and the one after them)."""
        for i, score in enumerate(scores[: accepted + 1]):
            b = self._bin(score)
            self.judged[b] += 1.0
            self.accepted[b] += float(i < accepted)
            if self.judged[b] > self.horizon:
                shrink = self.horizon / self.judged[b]
                self.judged[b] *= shrink
                self.accepted[b] *= shrink


class AcceptanceHistory:
    """A proposer's acceptance by position as its finished requests measured it, so that the next
    request starts from it instead of from the flat prior. A short request (a chat turn of a few
    dozen tokens) is over before its own estimates leave that prior, and the planner, pricing a
    good drafter by the prior, drafts too little to learn better: a drafter that pays at fixed k
    stayed off. Requests weigh by the rounds they drafted; past ``horizon`` rounds the old ones
    are scaled down, so the history follows a workload that changes.
    """

    def __init__(self, horizon: float = 64.0) -> None:
        self.horizon = horizon
        self.estimates: AcceptanceEstimates | None = None
        self.rounds = 0.0

    def observe(self, estimates: AcceptanceEstimates, rounds: int) -> None:
        """A finished request's final estimates, made over ``rounds`` drafting rounds."""
        if rounds <= 0:
            return
        if self.estimates is None or len(self.estimates.cond) != len(estimates.cond):
            self.estimates, self.rounds = estimates, min(float(rounds), self.horizon)
            return
        self.estimates = self.estimates.blend(estimates, rounds / (self.rounds + rounds))
        self.rounds = min(self.rounds + rounds, self.horizon)


class PlannerMemory:
    """What an engine learns about its target and proposers, apart from any request: forward
    costs by row count; how many tokens a request typically makes; for each proposer (keyed by
    the proposer object's id, which the owner of this memory keeps alive) its seconds per
    context token read and the share of its requests' rounds in which a source that reads drafts
    once it has read (a draft model at k > 0; not a hybrid's lookup); for each of its sources (:class:`~specdecode.proposers.base.Source`)
    its seconds per token drafted (keyed by (id, source name)); and, apart for greedy requests
    and for each sampling temperature, each source's score calibration and acceptance history
    (both keyed by (id, source name, regime)): a draft that must equal
    the argmax is accepted far less often than one kept with probability min(1, p/q), so what
    sampled requests measured must not price a greedy one's drafts.

    An engine makes its own unless given one; a :class:`~specdecode.engine.loop.Decoder` gives
    every run the same, so one request after another starts from what the last ones measured
    instead of from priors. It takes no lock: engines sharing it from several threads may
    interleave updates (a measurement lost, a row count listed twice in the cost curve's index),
    which leaves the estimates usable.
    """

    def __init__(self) -> None:
        self.costs = ForwardCosts()
        self.read_rates: dict[int, float] = {}  # a proposer's measured seconds per context token it reads
        self.calibrations: dict[tuple[int, str, str], ScoreCalibration] = {}  # what a source's scores are worth
        self.draft_rates: dict[tuple[int, str], float] = {}  # a source's seconds per drafted token
        self.acceptance: dict[tuple[int, str, str], AcceptanceHistory] = {}  # where a source's next request starts
        self.output_tokens: float | None = None  # tokens a finished request made (EMA), to spread reads over
        self.drafting_shares: dict[int, float] = {}  # a proposer's share of rounds it drafts in after reading (EMA)


@dataclass(frozen=True)
class Candidate:
    """A request the planner chooses k for: a(1..k_max), the chance that drafts 1..i are all
    accepted when the proposer drafts position i, draft s/token, and reach s(1..k_max), the chance
    it drafts position i when asked (below 1 for a confidence stop or a lookup that can miss;
    None: it always drafts k). Asking for position i then yields s(i) a(i) tokens."""

    accept_by_position: Sequence[float]
    draft_s_per_token: float
    k_max: int
    reach_by_position: Sequence[float] | None = None
    # Seconds per committed token of a one-time read before the request can draft (a draft model
    # reading the context it has not seen), spread over the tokens it is expected still to make.
    # Charged on every token a drafting step commits for it, the one it would commit anyway
    # included: drafting then beats plain decoding exactly where, over the request's remaining
    # tokens, it saves more than the read costs. (Charged once a step instead, a draft committing
    # 5 tokens a step paid a fifth of its read and read long prompts it could never pay back.)
    read_s_per_token: float = 0.0

    def read_cost(self, i: int) -> float:
        """Seconds of the read that asking for draft i + 1 adds: its share for the tokens that
        draft adds, and for the first draft also the token the step commits without drafts."""
        if not self.read_s_per_token:
            return 0.0
        tokens = self.gain(i) + (1.0 if i == 0 else 0.0)
        return self.read_s_per_token * tokens if tokens else 0.0

    def expected_tokens(self, k: int) -> float:
        """Tokens a step drafting ``k`` commits for this candidate, in expectation."""
        return 1.0 + sum(self._gains[:k])

    def reach(self, i: int) -> float:
        return 1.0 if self.reach_by_position is None else self.reach_by_position[i]

    def gain(self, i: int) -> float:
        """Expected committed tokens that asking for draft i + 1 adds: s(i) a(i), never more than
        any draft before it adds (draft i + 1 counts only when drafted with all before it accepted;
        a deep estimate still at its prior cannot outbid the measured ones above it)."""
        return self._gains[i]

    @functools.cached_property
    def _gains(self) -> list[float]:  # the planner asks for each many times a step
        raw = (self.reach(i) * a for i, a in enumerate(self.accept_by_position[: self.k_max]))
        return list(itertools.accumulate(raw, min))


def plan(
    candidates: Sequence[Candidate],
    other_rows: float,
    other_tokens: float,
    costs: ForwardCosts,
    prefill_rows: float = 0,
) -> list[int]:
    """k for each candidate, maximising the step's predicted committed tokens per second.

    ``other_rows``/``other_tokens``: rows and expected tokens of the step's other requests
    (prefill chunks, requests with their own fixed k). Greedy on marginal gains, one draft at a
    time where it helps most, or a run of drafts where no single one helps but the run does. A position
    a request drafts only sometimes (reach s < 1) costs and yields in proportion: rows and draft
    time are expected values, so a confidence stop keeps its own say on how deep to go.

    ``prefill_rows`` (part of ``other_rows``) is prompt work the step does whatever k is: its
    share of the forward is not charged to decoding. Charged, a step carrying a long prefill
    chunk looks so slow per token that any draft seems worth a row, and on a saturated machine
    those rows cost the whole run time. Rows are counted as ``costs`` counts them: the engine
    counts a prompt row, which skips the output head, as a fraction of a row that scores.
    With prompt rows in the step, decoding's share is never more than its rows' share of the
    forward: such a forward is bound by arithmetic, where a row costs about the average row. A
    fresh engine has timed little but prompt steps, and a line through two or three of them can
    come out flat; it then charged the whole prompt to decoding, and every draft looked worth
    its row (16 requests at once: at the fourth step six requests each planned 6-8 drafts and
    read their prompts into the draft model, in a step carrying 220 prompt rows).
    """
    ks = [0] * len(candidates)
    start = rows = other_rows + len(candidates)  # rows before any draft
    level, slope = costs.line(start)
    base = max(level - slope * prefill_rows, 0.05 * level)  # the decoding share of the step
    if 0 < prefill_rows < start:
        base = min(base, level * (start - prefill_rows) / start)

    def forward(n: float) -> float:  # decoding's share of a forward over n rows
        return base + slope * (n - start)

    tokens = other_tokens + len(candidates)
    draft = 0.0
    rate = tokens / forward(rows)
    while True:
        # One more draft where it helps most; where none does, a run of several drafts that pays
        # as a whole (deeper positions can be worth more than the one before them when a proposer
        # drafts deep only when sure: a dip in the yields must not hide what lies past it).
        step = _best_run(candidates, ks, 1, tokens, rows, draft, rate, forward)
        step = step or _best_run(
            candidates, ks, max((c.k_max for c in candidates), default=0), tokens, rows, draft, rate, forward
        )
        if step is None:
            return ks
        i, k, gain, extra_rows, extra_draft, rate = step
        ks[i], tokens, rows, draft = k, tokens + gain, rows + extra_rows, draft + extra_draft


def _best_run(
    candidates: Sequence[Candidate],
    ks: list[int],
    longest: int,
    tokens: float,
    rows: float,
    draft: float,
    rate: float,
    forward: Callable[[float], float],
) -> tuple[int, int, float, float, float, float] | None:
    """The run of up to ``longest`` more drafts for one candidate that raises the step's rate most:
    (candidate, its new k, tokens, rows and draft seconds the run adds, the new rate), or None."""
    best = None
    for i, c in enumerate(candidates):
        gain = extra_rows = extra_draft = 0.0
        for k in range(ks[i], min(c.k_max, ks[i] + longest)):
            s = c.reach(k)
            gain += c.gain(k)
            extra_rows += s
            extra_draft += c.draft_s_per_token * s + c.read_cost(k)
            r = (tokens + gain) / (forward(rows + extra_rows) + draft + extra_draft)
            if r > rate * (1 + 1e-9):
                best, rate = (i, k + 1, gain, extra_rows, extra_draft, r), r
    return best
