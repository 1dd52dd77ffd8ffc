"""Batch-aware k: each step, every planned request's k in 0..k_max for the most committed tokens/s.

A verify forward over N rows costs c(N), learnt from the engine's own steps. Request r drafting
k_r tokens commits 1 + a_r(1) + ... + a_r(k_r) in expectation (a_r(i): its live probability that
the first i drafts are all accepted) and costs d_r per drafted token. The step's rate is

    (sum_r E_r(k_r)) / (c(N_other + sum_r (k_r + 1)) + sum_r d_r k_r)

and k is raised one draft at a time, always where it helps the rate most, until no draft helps.
Small batches on a flat c(N) then speculate fully; as the batch grows c(N) steepens, the extra
rows stop paying, and speculation switches itself off (k = 0), with no table to tune.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass


class ForwardCosts:
    """Seconds of one target forward over n rows: an EMA per row count, linear in between and
    beyond (least-squares slope, never negative); before any measurement, a flat prior curve.

    The planner asks for many row counts every step, so the measured counts are kept sorted and
    the slope is refitted only when a measurement arrives.
    """

    def __init__(self, ema: float = 0.3, prior_slope: float = 0.02) -> None:
        self.ema, self.prior_slope = ema, prior_slope
        self.points: dict[int, float] = {}
        self._xs: list[int] = []  # the keys of ``points``, ascending
        self._slope: float | None = None  # cached fit; None after a new measurement

    def observe(self, rows: int, seconds: float) -> None:
        old = self.points.get(rows)
        if old is None:
            bisect.insort(self._xs, rows)
        self.points[rows] = seconds if old is None else (1 - self.ema) * old + self.ema * seconds
        self._slope = None

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

    def slope(self) -> float:
        """Extra seconds per extra row (least squares over the measured row counts)."""
        if self._slope is None:
            self._slope = self._fit()
        return self._slope

    def _fit(self) -> float:
        xs = self._xs
        if len(xs) < 2:
            return self.prior_slope * next(iter(self.points.values()), 1.0)
        mx = sum(xs) / len(xs)
        my = sum(self.points.values()) / len(xs)
        var = sum((x - mx) ** 2 for x in xs)
        cov = sum((x - mx) * (self.points[x] - my) for x in xs)
        return max(cov / var, 0.0)


@dataclass(frozen=True)
class Candidate:
    """A request the planner chooses k for: cumulative acceptance a(1..k_max) of drafted
    positions, draft s/token, and reach s(1..k_max), the chance it drafts position i when asked
    (below 1 for a confidence stop or a lookup that can miss; None: it always drafts k)."""

    accept_by_position: Sequence[float]
    draft_s_per_token: float
    k_max: int
    k_min: int = 0  # a probe: at least this many drafts (to re-measure acceptance)
    reach_by_position: Sequence[float] | None = None

    def reach(self, i: int) -> float:
        return 1.0 if self.reach_by_position is None else self.reach_by_position[i]

    def gain(self, i: int) -> float:
        """Expected committed tokens that asking for draft i + 1 adds."""
        return self.reach(i) * self.accept_by_position[i]


def plan(candidates: Sequence[Candidate], other_rows: int, other_tokens: float, costs: ForwardCosts) -> list[int]:
    """k for each candidate, maximising the step's predicted committed tokens per second.

    ``other_rows``/``other_tokens``: rows and expected tokens of the step's other requests
    (prefill chunks, requests with their own fixed k). Greedy on marginal gains: acceptance
    never rises with depth, so each request's extra drafts are worth less and less. A position
    a request drafts only sometimes (reach s < 1) costs and yields in proportion: rows and draft
    time are expected values, so a confidence stop keeps its own say on how deep to go.
    """
    ks = [c.k_min for c in candidates]
    drafted = [sum(c.reach(i) for i in range(k)) for c, k in zip(candidates, ks)]  # expected drafts
    tokens = other_tokens + sum(1 + sum(c.gain(i) for i in range(k)) for c, k in zip(candidates, ks))
    rows = other_rows + len(candidates) + sum(drafted)
    draft = sum(c.draft_s_per_token * d for c, d in zip(candidates, drafted))
    rate = tokens / (costs(rows) + draft)
    while True:
        best, best_rate, best_s = -1, rate, 0.0
        for i, c in enumerate(candidates):
            k = ks[i]
            if k >= c.k_max:
                continue
            s = c.reach(k)
            r = (tokens + c.gain(k)) / (costs(rows + s) + draft + c.draft_s_per_token * s)
            if r > best_rate * (1 + 1e-9):
                best, best_rate, best_s = i, r, s
        if best < 0:
            return ks
        c = candidates[best]
        tokens += c.gain(ks[best])
        rows += best_s
        draft += c.draft_s_per_token * best_s
        ks[best] += 1
        rate = best_rate
