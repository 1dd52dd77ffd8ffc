"""Speculation-length policies: how many tokens to draft next round (0 turns speculation off)."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from specdecode.core.cost_model import best_k, predict_tokens_per_s
from specdecode.errors import ConfigError

POLICIES = ("fixed", "heuristic", "confidence", "auto")


class KPolicy(Protocol):
    name: str
    k_max: int
    batch_planned: bool  # True only for a PlannedPolicy: the engine picks k for the whole batch

    def reset(self) -> None:
        """Start a new request."""
        ...

    def next_k(self, batch: int = 1) -> int:
        """Drafts to request this round, in 0..k_max; ``batch``: requests decoding in the step."""
        ...

    def update(self, drafted: int, accepted: int, draft_s: float, verify_s: float, planned: int | None = None) -> None:
        """Outcome and timing of the round just finished (verify_s: one forward over drafted + 1;
        ``planned``: the k asked for, when the proposer drafted fewer; None: as many as drafted)."""
        ...


@dataclass(frozen=True)
class AcceptanceEstimates:
    """A planned policy's acceptance estimates by position 1..k_max (see :class:`AutoK`): what a
    request learnt, and what the next request of the same proposer can start from."""

    cond: tuple[float, ...]  # P(accept position i | all before it accepted)
    drafted_accept: tuple[float, ...]  # P(positions 1..i all accepted | position i drafted)
    reach: tuple[float, ...]  # P(the proposer drafts position i | asked for it)

    def blend(self, other: AcceptanceEstimates, weight: float) -> AcceptanceEstimates:
        """``weight`` of ``other`` mixed into these, position by position."""

        def mix(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, ...]:
            return tuple((1 - weight) * x + weight * y for x, y in zip(a, b))

        return AcceptanceEstimates(
            mix(self.cond, other.cond), mix(self.drafted_accept, other.drafted_accept), mix(self.reach, other.reach)
        )


class PlannedPolicy(KPolicy, Protocol):
    """A policy with ``batch_planned`` True: the engine's batch planner reads its live estimates."""

    def accept_by_position(self) -> list[float]:
        """P(drafts 1..i all accepted), i = 1..k_max."""
        ...

    def accept_when_drafted(self, optimistic: bool = False) -> list[float]:
        """P(drafts 1..i all accepted | the proposer drafted position i), i = 1..k_max: what asking
        for position i yields, divided by its reach (what the batch planner prices drafts with).
        ``optimistic``: each position at least the prior's (a request whose estimates are old)."""
        ...

    def reach_by_position(self) -> list[float]:
        """P(the proposer drafts position i | asked for it), i = 1..k_max."""
        ...

    def estimates(self) -> AcceptanceEstimates:
        """The live estimates (for the requests that come after this one)."""
        ...

    def start_from(self, estimates: AcceptanceEstimates) -> None:
        """Begin this request from earlier requests' estimates instead of the flat prior
        (ignored when they were made for another k_max)."""
        ...


class FixedK:
    """Always k (the draft model may still stop early when its confidence policy says so)."""

    batch_planned = False

    def __init__(self, k: int, name: str = "fixed") -> None:
        self.k_max, self.name = k, name

    def reset(self) -> None:
        pass

    def next_k(self, batch: int = 1) -> int:
        return self.k_max

    def update(self, drafted: int, accepted: int, draft_s: float, verify_s: float, planned: int | None = None) -> None:
        pass


class HeuristicK:
    """transformers' rule: +2 after a fully accepted round, -1 otherwise (never below 1)."""

    name = "heuristic"
    batch_planned = False

    def __init__(self, k_max: int, k_start: int | None = None) -> None:
        self.k_max = k_max
        self.k_start = min(k_start or 4, k_max)
        self.k = self.k_start

    def reset(self) -> None:
        self.k = self.k_start

    def next_k(self, batch: int = 1) -> int:
        return self.k

    def update(self, drafted: int, accepted: int, draft_s: float, verify_s: float, planned: int | None = None) -> None:
        if drafted == 0:
            return
        self.k = min(self.k + 2, self.k_max) if accepted == drafted else max(self.k - 1, 1)


class BatchTableK:
    """k by how many requests decode in the step, from a table (vLLM's
    ``num_speculative_tokens_per_batch_size``): ``table`` holds (batch bound, k) pairs, a batch
    above the last bound drafts ``above``."""

    name = "table"
    batch_planned = False

    def __init__(self, table: Sequence[tuple[int, int]], above: int = 0) -> None:
        self.table, self.above = tuple(table), above
        self.k_max = max([k for _, k in self.table] + [above])

    def k_for(self, batch: int) -> int:
        return next((k for bound, k in self.table if batch <= bound), self.above)

    def reset(self) -> None:
        pass

    def next_k(self, batch: int = 1) -> int:
        return self.k_for(batch)

    def update(self, drafted: int, accepted: int, draft_s: float, verify_s: float, planned: int | None = None) -> None:
        pass

    def describe(self) -> str:
        return ",".join([f"{b}:{k}" for b, k in self.table] + [str(self.above)])


class Costs(Protocol):
    """Draft seconds per token and target seconds per forward over n tokens."""

    def draft_s_per_token(self) -> float: ...

    def verify_s(self, n_tokens: int) -> float: ...


class MeasuredCosts:
    """Running averages of this request's own timings; unmeasured sizes from a flat-ish curve."""

    def __init__(self, ema: float = 0.3, slope: float = 0.05) -> None:
        self.ema, self.slope = ema, slope  # slope: assumed extra cost per extra verified token
        self.draft: float | None = None
        self.forward: dict[int, float] = {}

    def observe(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        if drafted:
            self.draft = _ema(self.draft, draft_s / drafted, self.ema)
        n = drafted + 1
        self.forward[n] = _ema(self.forward.get(n), verify_s, self.ema)

    def draft_s_per_token(self) -> float:
        return self.draft if self.draft is not None else 0.1 * self.verify_s(1)

    def verify_s(self, n_tokens: int) -> float:
        if n_tokens in self.forward:
            return self.forward[n_tokens]
        if not self.forward:
            return 1.0
        n0 = min(self.forward, key=lambda n: abs(n - n_tokens))  # scale the nearest measurement
        return self.forward[n0] * (1 + self.slope * (n_tokens - 1)) / (1 + self.slope * (n0 - 1))


class AutoK:
    """Each round, the k in 0..k_max that maximises predicted tokens/s from online estimates.

    Acceptance per position is an EMA of conditional acceptance; k changes only when the
    predicted gain beats ``margin`` (hysteresis). At k = 0 speculation is off; every
    ``probe_every`` rounds a short probe re-measures acceptance so it can come back on.
    ``drift``: the pace, as a share of ``ema``, at which positions a round did not judge move
    up toward the last one it judged (see ``update``).
    """

    name = "auto"

    def __init__(
        self,
        k_max: int,
        *,
        costs: Costs | None = None,
        ema: float = 0.3,
        prior: float = 0.6,
        margin: float = 0.05,
        probe_every: int = 8,
        probe_k: int = 2,
        drift: float = 0.5,
    ) -> None:
        self.k_max, self.ema, self.prior, self.margin, self.drift = k_max, ema, prior, margin, drift
        self.probe_every, self.probe_k = probe_every, min(probe_k, k_max)
        self.fixed_costs = costs
        # In the engine, k comes from the batch planner (the measured cost of the whole step's
        # forward); with costs given up front this policy chooses alone, as a single request would.
        self.batch_planned = costs is None
        self.reset()

    def reset(self) -> None:
        self.costs: Costs = self.fixed_costs or MeasuredCosts()
        self.cond = [self.prior] * self.k_max  # P(accept position i | all before accepted)
        # P(positions 1..i all accepted | position i drafted), measured on the rounds that drafted
        # that deep. The product of ``cond`` mixes every round into its shallow factors, so for a
        # proposer that drafts deep only when sure (a long suffix match, a confidence stop) it
        # prices deep drafts by the unsure rounds too; this is measured on the sure ones.
        self.drafted_accept = _cumulative(self.cond)
        # P(the proposer drafts position i | asked for it): a confidence stop or a lookup that
        # finds nothing drafts fewer than asked, and undrafted positions cost nothing
        self.reach = [1.0] * self.k_max
        self.k = min(4, self.k_max)
        self.off_rounds = 0

    def reach_by_position(self) -> list[float]:
        return list(self.reach)

    def estimates(self) -> AcceptanceEstimates:
        return AcceptanceEstimates(tuple(self.cond), tuple(self.drafted_accept), tuple(self.reach))

    def start_from(self, estimates: AcceptanceEstimates) -> None:
        if len(estimates.cond) != self.k_max:
            return
        self.cond, self.drafted_accept = list(estimates.cond), list(estimates.drafted_accept)
        self.reach = list(estimates.reach)

    def accept_by_position(self) -> list[float]:
        return _cumulative(self.cond)

    def accept_when_drafted(self, optimistic: bool = False) -> list[float]:
        if not optimistic:
            return list(self.drafted_accept)
        return [max(a, p) for a, p in zip(self.drafted_accept, _cumulative([self.prior] * self.k_max))]

    def rate(self, k: int) -> float:
        return predict_tokens_per_s(k, self.accept_by_position(), self.costs.draft_s_per_token(), self.costs.verify_s)

    def next_k(self, batch: int = 1) -> int:
        if self.k == 0:
            self.off_rounds += 1
            if self.off_rounds % self.probe_every == 0:
                return self.probe_k
        return self.k

    def update(self, drafted: int, accepted: int, draft_s: float, verify_s: float, planned: int | None = None) -> None:
        for i in range(min(drafted if planned is None else planned, self.k_max)):
            self.reach[i] = _ema(self.reach[i], float(i < drafted), self.ema)
        if isinstance(self.costs, MeasuredCosts):
            self.costs.observe(drafted, accepted, draft_s, verify_s)
        for i in range(min(drafted, self.k_max)):  # a drafted position's outcome is always known
            self.drafted_accept[i] = _ema(self.drafted_accept[i], float(i < accepted), self.ema)
        judged = min(accepted + 1, drafted)  # positions the target actually judged
        for i in range(judged):
            self.cond[i] = _ema(self.cond[i], float(i < accepted), self.ema)
        self._drift_unjudged(judged)
        if 0 < drafted == accepted < self.k_max:
            self._extend_run(drafted)
        best = best_k(self.k_max, self.accept_by_position(), self.costs.draft_s_per_token(), self.costs.verify_s)
        if best != self.k and self.rate(best) > (1 + self.margin) * self.rate(self.k):
            self.k = best
            self.off_rounds = 0

    def _drift_unjudged(self, judged: int) -> None:
        """Positions the target did not judge only drift up, toward the last judged one (a fully
        accepted round hints the run goes on). Pulling them down too made a low k keep itself
        low: deep positions, often accepted once the first is, were never seen again. cond[0]
        alone still turns a useless draft off. They drift at ``drift`` of the EMA's pace: a hint
        is not a measurement, and at full pace three short rounds wiped out a deep position's
        measured rejection, so the planner kept going back to drafts that failed."""
        if not judged:
            return
        last = self.cond[judged - 1]
        for i in range(judged, self.k_max):
            if last > self.cond[i]:
                self.cond[i] = _ema(self.cond[i], last, self.ema * self.drift)

    def _extend_run(self, drafted: int) -> None:
        """All ``drafted`` drafts accepted: deeper positions' P(1..i all accepted) drifts up toward
        the run going on at each deeper position's conditional acceptance. Drifting toward the
        last drafted position's own figure priced eight drafts like two: on a request that keeps
        two (translation with the 0.5B) every fully accepted short round sent the planner back to
        k = 8, for one or two tokens a time."""
        run = self.drafted_accept[drafted - 1]
        for i in range(drafted, self.k_max):
            run *= self.cond[i]
            if run > self.drafted_accept[i]:
                self.drafted_accept[i] = _ema(self.drafted_accept[i], run, self.ema)


def make_policy(name: str, k_max: int) -> KPolicy:
    if not isinstance(k_max, int) or k_max < 1:
        raise ConfigError(f"k must be an integer >= 1, got {k_max!r}")
    if name in ("fixed", "confidence"):
        return FixedK(k_max, name)
    if name == "heuristic":
        return HeuristicK(k_max)
    if name == "auto":
        return AutoK(k_max)
    raise ConfigError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")


def _cumulative(cond: Sequence[float]) -> list[float]:
    """P(positions 1..i all accepted) from each position's acceptance given all before it."""
    return list(itertools.accumulate(cond, operator.mul))


def _ema(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1 - weight) * old + weight * new


def constant_costs(draft_s_per_token: float, verify_s: Callable[[int], float]) -> Costs:
    """Fixed costs (synthetic timings in tests, or costs measured beforehand by a benchmark)."""

    class _Fixed:
        def draft_s_per_token(self) -> float:
            return draft_s_per_token

        def verify_s(self, n_tokens: int) -> float:
            return verify_s(n_tokens)

    return _Fixed()
