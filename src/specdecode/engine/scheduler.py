"""The engine: many requests, one target forward per step, speculation chosen per request.

Every step is one forward over every running request's rows: prefill chunks of new requests,
the last token alone for requests not speculating this step, and k+1-token chains (or trees) of
different k, each over that request's own cache. Acceptance is ragged: each request commits its
own accepted prefix plus one token and trims only its own cache. Requests join and leave between
steps (continuous batching). A step reads as its stages:

    schedule -> plan k -> propose -> verify (one forward) -> accept + trim -> emit

A single request is a batch of one on the same engine (:class:`specdecode.engine.Decoder`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from specdecode.engine.planner import AcceptanceHistory, Candidate, PlannerMemory, ScoreCalibration, plan
from specdecode.engine.policy import PlannedPolicy
from specdecode.engine.request import (
    DONE,
    PREFILL,
    RUNNING,
    WAITING,
    GenerationConfig,
    GenerationResult,
    Request,
    Row,
    Speculation,
)
from specdecode.errors import ConfigError, InputError, QueueFullError
from specdecode.models.base import CausalLM
from specdecode.models.prefix_cache import PrefixCache, PrefixScope, cold_paths

# The least share of its rounds a drafter is taken to draft in, once it has read: a read spread
# over no rounds at all would cost infinitely much, and one request's few rounds are no proof.
MIN_SHARE = 0.05


@dataclass(frozen=True)
class EngineConfig:
    """Engine-wide limits (per-request settings live in GenerationConfig and Speculation).

    ``kv_budget``: cache positions reserved across running requests (None: unbounded); a
    request reserves prompt + max new tokens + one round of drafts when admitted, so caches
    never grow or move mid-flight, and waits in the queue while the budget is short.
    ``prefill_chunk``: prompt tokens fed per step across prefilling requests; a prompt is cut
    into chunks of this size at fixed offsets (so its cache is the same whatever else runs)
    and at least one chunk moves every step.
    ``prefix_cache_mb``: memory for stored prompt prefixes (:mod:`specdecode.models.prefix_cache`)
    where the engine is not handed a store; 0 turns prefix caching off, a handed store too.
    """

    max_batch: int = 32
    kv_budget: int | None = None
    prefill_chunk: int = 512
    max_queue: int | None = None
    # planned steps at k = 0 before the planner looks at a request again as if unmeasured (its
    # acceptance raised to the prior): it drafts again only where that optimism would pay
    probe_every: int = 8
    step_log: int = 10_000  # recent steps kept for reports (a long-running engine must not grow)
    prefix_cache_mb: int = 256

    def __post_init__(self) -> None:
        for name in ("max_batch", "prefill_chunk", "probe_every", "step_log"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.prefix_cache_mb, int) or self.prefix_cache_mb < 0:
            raise ConfigError(f"prefix_cache_mb must be an integer >= 0, got {self.prefix_cache_mb!r}")
        for name in ("kv_budget", "max_queue"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be an integer >= 1 or None, got {value!r}")


@dataclass(frozen=True)
class _Crowd:
    """What :meth:`Engine._crowded_share` needs of a step: the request's candidate without its
    read, the requests decoding, and the shares worked out so far this step, by proposer."""

    candidate: Candidate
    decoding: int
    memo: dict[int, float]


@dataclass(frozen=True)
class StepRecord:
    """What one step ran: for reports of k by batch size and of the forward-cost curve."""

    batch: int  # requests decoding (not prefilling) in the step
    rows: int  # rows of the forward
    ks: tuple[int, ...]  # drafts per decoding request
    forward_s: float


class Engine:
    """Runs requests over one shared target. Not thread-safe: one caller drives ``step``.

    ``memory`` holds what the planner learns beyond any request (forward costs, read rates,
    score calibrations); give engines over the same target and proposers one to share.
    ``prefixes``: stored prompt prefixes to share with other engines over the same target (by
    default the engine keeps its own, ``config.prefix_cache_mb`` large).
    """

    def __init__(
        self,
        target: CausalLM,
        *,
        eos_token_ids: Iterable[int] = (),
        tokenizer: Any = None,
        config: EngineConfig | None = None,
        memory: PlannerMemory | None = None,
        prefixes: PrefixCache | None = None,
    ) -> None:
        self.target, self.tokenizer = target, tokenizer
        self.eos = frozenset(eos_token_ids)
        self.config = config or EngineConfig()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.reserved = 0  # cache positions held by running requests
        self.memory = memory or PlannerMemory()  # forward costs, read rates, score calibrations
        self.steps: deque[StepRecord] = deque(maxlen=self.config.step_log)
        self.prefixes = self._prefix_store(prefixes)
        self._next_id = 0

    def _prefix_store(self, given: PrefixCache | None) -> PrefixCache | None:
        own = PrefixCache.for_target(self.target, self.config.prefix_cache_mb)
        if own is None or given is None:
            return own
        align = self.target.caps.prefix_align
        if given.align % align:
            raise ConfigError(f"a prefix store aligned to {given.align} cannot serve a target aligned to {align}")
        return given

    # -- requests --------------------------------------------------------------------------------
    def submit(
        self, prompt_ids: Sequence[int], config: GenerationConfig | None = None, spec: Speculation | None = None
    ) -> Request:
        """Queue a request; InputError if it can never run, QueueFullError if the queue is full."""
        spec = spec or Speculation()
        spec.check(self.target)
        request = Request(
            self._next_id,
            [int(t) for t in prompt_ids],
            config or GenerationConfig(),
            spec,
            self.target,
            self.eos,
            self.tokenizer,
        )
        budget = self.config.kv_budget
        if budget is not None and request.capacity > budget:
            raise InputError(f"request needs {request.capacity} cache positions; the engine's KV budget is {budget}")
        if self.config.max_queue is not None and len(self.waiting) >= self.config.max_queue:
            raise QueueFullError(f"the queue is full ({self.config.max_queue} requests waiting)")
        self._next_id += 1
        self.waiting.append(request)
        return request

    def cancel(self, request: Request) -> None:
        """Stop a request; its cache is freed before the next step's forward."""
        request.cancelled = True

    def abort_all(self) -> None:
        """Cancel every request and free every cache now (after a failed step, or at shutdown)."""
        for r in [*self.waiting, *self.running]:
            r.cancelled = True
        try:
            self._schedule()
        except Exception:  # a request left half-updated by the failure: drop the lot
            self.waiting.clear()
            self.running, self.reserved = [], 0

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def run(self) -> None:
        """Step until every submitted request has finished."""
        while self.busy:
            self.step()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        config: GenerationConfig | Sequence[GenerationConfig] | None = None,
        spec: Speculation | None = None,
        on_step: Callable[[int], None] | None = None,
    ) -> list[GenerationResult]:
        """Every prompt's result (in order), all run together; ``config`` is one for all or one
        per prompt; ``on_step(n_finished)`` after each step (progress bars)."""
        configs = config if isinstance(config, Sequence) else [config] * len(prompts)
        if len(configs) != len(prompts):
            raise ConfigError(f"got {len(configs)} configs for {len(prompts)} prompts")
        requests = [self.submit(p, c, spec) for p, c in zip(prompts, configs)]
        done = 0
        while self.busy:
            done += sum(r.result is not None for r in self.step())  # a finishing request is among the touched
            if on_step is not None:
                on_step(done)
        return [r.result for r in requests]

    def kv_usage(self) -> dict[str, float]:
        """Cache positions reserved and filled by running requests, against the budget, and the
        prefix store's bytes and reuse."""
        used = sum(r.cache.length for r in self.running if r.cache is not None)
        budget = self.config.kv_budget
        out = {
            "reserved": self.reserved,
            "used": used,
            "budget": budget or 0,
            "usage": self.reserved / budget if budget else 0.0,
        }
        if self.prefixes is not None:
            stats = self.prefixes.stats()
            out.update(prefix_bytes=stats["bytes"], prefix_hits=stats["hits"], prefix_tokens=stats["hit_tokens"])
            drafts = self.prefixes.companion_stats()  # draft models' own stores
            out.update(draft_prefix_bytes=drafts["bytes"], draft_prefix_tokens=drafts["hit_tokens"])
        return out

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One forward over every running request; the requests that emitted or finished."""
        self._schedule()
        if not self.running:
            return []
        rows = self._prefill_rows()
        decoding = [r for r in self.running if r.status == RUNNING and not r.finished]
        prompt_rows = sum(row.ids.numel() for row in rows)
        prompt = self._scoreless(prompt_rows)  # in scoring rows' worth
        drafted = self._plan(decoding, prompt)
        self._propose([r for r in decoding if r not in drafted])
        scoring = [r.row() for r in decoding]
        scoring_rows = sum(row.ids.numel() for row in scoring)
        rows += scoring
        t = time.perf_counter()
        logits, hidden = self._verify(rows)
        forward_s = time.perf_counter() - t
        n_rows = prompt_rows + scoring_rows
        if decoding:  # the cost curve counts rows in scoring rows' worth (see _scoreless)
            self.memory.costs.observe(round(prompt + scoring_rows), forward_s)
            self.steps.append(StepRecord(len(decoding), n_rows, tuple(r.k for r in decoding), forward_s))
        touched = self._accept(rows, logits, hidden, forward_s)
        self._retire()
        return touched

    def _scoreless(self, rows: int) -> float:
        """``rows`` prompt-chunk rows in scoring rows' worth. A prompt row skips the output head,
        a decode or verify row does not: on a step of many rows (bound by arithmetic) a draft's
        row costs a prompt row's and its head's share more (the Qwen 1.5B: 7.2 ms against 5.9).
        Counted alike, drafts added to a step carrying a prompt chunk were priced too cheap."""
        return rows * (1.0 - self.target.caps.head_share)

    def _schedule(self) -> None:
        """Free cancelled requests, then admit waiting ones while the batch and budget allow."""
        for r in [r for r in self.running if r.cancelled]:
            self._close(r)
        self.running = [r for r in self.running if r.status != DONE]
        for r in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(r)
            r.finish()
        budget = self.config.kv_budget
        while self.waiting and len(self.running) < self.config.max_batch:
            r = self.waiting[0]
            if budget is not None and self.reserved + r.capacity > budget:
                break  # first come, first served: later requests wait too
            self.waiting.popleft()
            r.admit(PrefixScope(self.prefixes, r.config.cache_salt))
            self._reuse_prefix(r)
            self._start_from_history(r)
            self.reserved += r.capacity
            self.running.append(r)

    def _reuse_prefix(self, r: Request) -> None:
        """Take the longest stored prefix of the prompt instead of prefilling it, where the rest
        of the prompt is then computed as without it. A proposer that reads the target's
        features needs every prompt forward, so its requests prefill in full."""
        if self.prefixes is None or r.reads_features or len(r.prompt_ids) <= self.prefixes.align:
            return
        n = self.prefixes.reuse(r.cache, r.prompt_ids, len(r.prompt_ids) - 1, *self._chunking, r.config.cache_salt)
        if n:
            r.reuse(n)

    @property
    def _chunking(self) -> tuple[int, int]:
        """(chunk, rest): how the target's prompts are read, for the prefix store's path rules."""
        return self.config.prefill_chunk, self.target.caps.prefix_rest

    def _keep_prefix(self, r: Request, tokens: list[int]) -> None:
        if self.prefixes is not None and r.cache is not None:
            paths = cold_paths(len(r.prompt_ids) - 1, len(tokens), *self._chunking)  # the last goes with a round
            self.prefixes.store(tokens, r.cache, r.config.cache_salt, paths)

    def _prefill_rows(self) -> list[Row]:
        """Prompt chunks for this step, first come first served, within the token budget."""
        rows, left = [], self.config.prefill_chunk
        for r in self.running:
            if r.status != PREFILL or r.cancelled:
                continue
            if rows and left < min(self.config.prefill_chunk, len(r.prompt_ids) - 1 - r.fed):
                break  # whole chunks only (fixed offsets); at least one per step
            row = r.prefill_row(self.config.prefill_chunk)
            if row is not None:
                rows.append(row)
                left -= row.ids.numel()
        return rows

    def _plan(self, decoding: list[Request], prefill_rows: float) -> set[Request]:
        """Each decoding request's k: its own policy's, or the batch planner's (policy auto), the
        step's prompt chunks counted as ``prefill_rows`` scoring rows' worth (:meth:`_scoreless`).
        Returns the requests already drafted (free scored drafts, made before k was chosen)."""
        planned, other_rows, other_tokens = [], prefill_rows, 0.0
        for r in decoding:
            if r.enter(r.next_source()):  # a source new to the request starts from its history
                self._start_from_history(r)
            if r.spec.batch_planned:
                planned.append(r)
                continue
            r.k = r.policy_k(len(decoding))
            other_rows += r.k + 1
            other_tokens += max(r.metrics.committed_tokens / max(r.metrics.target_calls, 1), 1.0)
        if not planned:
            return set()
        candidates, unpriced, drafted, crowd = [], set(), set(), {}
        for r in planned:
            if r.drafts_first:
                candidates.append(self._draft_first(r))
                drafted.add(r)
                continue
            # Off for a while: judge the request as if unmeasured. Where even that optimism would
            # not pay (a saturated batch), no probe is forced on it: held off is plain decoding.
            stale = r.current.off_steps + 1 >= self.config.probe_every
            accept = r.policy.accept_when_drafted(optimistic=stale)
            k_max, reach = r.clip(r.policy.k_max), r.policy.reach_by_position()
            candidate = Candidate(accept, self._draft_cost(r), k_max, reach)
            read = self._read_cost(r, unpriced, _Crowd(candidate, len(decoding), crowd))
            candidates.append(replace(candidate, read_s_per_token=read) if read else candidate)
        ks = plan(candidates, other_rows, other_tokens, self.memory.costs, prefill_rows)
        self._settle(planned, ks, drafted)
        # A request kept off its named drafter may draft from a second one (a hybrid's short
        # lookup), planned around the rows and tokens the others now bring.
        second = []
        for r, k in zip(planned, ks):
            if k == 0 and r not in drafted and self._fall_back(r):
                second.append(r)
        if second:
            rest = [(c, k) for r, c, k in zip(planned, candidates, ks) if r not in second]
            other_rows += sum(k + 1 for _, k in rest)
            other_tokens += sum(c.expected_tokens(k) for c, k in rest)
            candidates = [self._draft_first(r) for r in second]
            self._settle(second, plan(candidates, other_rows, other_tokens, self.memory.costs, prefill_rows), second)
            drafted.update(second)
        return drafted

    def _settle(self, planned: list[Request], ks: list[int], drafted: set[Request]) -> None:
        """Give each request its planned k; those ``drafted`` already keep that prefix of it."""
        for r, k in zip(planned, ks):
            r.k = k
            r.current.off_steps = r.current.off_steps + 1 if k == 0 else 0
            if r in drafted:
                r.set_draft(r.draft)  # verify only the prefix the planner chose

    def _fall_back(self, r: Request) -> bool:
        """Enter the request's second drafter for this round, if its proposer names one."""
        source = r.fallback()
        if source is None:
            return False
        if r.enter(source):
            self._start_from_history(r)
        return True

    def _draft_first(self, r: Request) -> Candidate:
        """Draft as deep as the request may go, then price each draft by its score as calibrated
        on this target (or, on unscored drafts, by the request's measured acceptance). The drafts
        are made already, so they cost nothing more: only their rows are priced."""
        r.k = r.clip(r.policy.k_max)
        self._priced_read(r, *r.catch_up())
        r.propose()
        scores = r.draft_scores()
        if scores is None:
            return Candidate(r.policy.accept_when_drafted(), 0.0, r.draft.k)
        return Candidate(self._calibration(r).accept_by_position(scores), 0.0, len(scores))

    def _calibration(self, r: Request) -> ScoreCalibration:
        key = r.history_key()  # asked twice a step: no new calibration unless missing
        cal = self.memory.calibrations.get(key)
        return cal if cal is not None else self.memory.calibrations.setdefault(key, ScoreCalibration())

    def _read_cost(self, r: Request, unpriced: set[int], crowd: _Crowd | None = None) -> float:
        """Seconds per committed token of the context read a request pays before it drafts again
        (its draft model's prompt): seconds per token read, measured on earlier reads by the same
        proposer, times the tokens unread, spread over the tokens the request is expected still
        to make in rounds where a source that reads drafts (a hybrid's drafter rounds at k > 0,
        not its lookup's, which the read does not speed up, nor rounds the planner keeps at
        k = 0, as it does most of them in a busy batch), nor rounds in a batch crowded by the
        requests now prefilling or waiting (``crowd``: the share of rounds drafting there, see
        :meth:`_crowded_share`). Before any read was measured, one request a step may read for
        free (so the price gets measured) and the others may not, nor any where that batch would
        never draft."""
        unread = r.unread()
        if not unread:
            return 0.0
        key = id(r.spec.proposer)
        rate = self.memory.read_rates.get(key)
        crowded = 1.0 if crowd is None else self._crowded_share(r, crowd)
        if rate is None:
            if key in unpriced or not crowded:
                return float("inf")
            unpriced.add(key)
            return 0.0
        share = min(r.drafting_share(self.memory.drafting_shares.get(key, 1.0)), crowded)
        return rate * unread / (self._remaining(r) * max(share, MIN_SHARE))

    def _crowded_share(self, r: Request, crowd: _Crowd) -> float:
        """The share of rounds ``r``'s drafter would draft in once the requests now prefilling or
        waiting decode too (up to ``max_batch``): the share of that many requests like it the
        planner would give drafts to in one step. 1 while none is coming. Why: a read is paid for
        by later rounds only, and when a burst of requests arrives the first to finish their
        prompts decode a few steps in a small batch, where drafting pays, then for the rest of
        their lives in a full one, where it does not (16 requests at once: each drafter read its
        prompt, then drafted once). Worked out once a step per proposer."""
        coming = min(len(self.running) + len(self.waiting), self.config.max_batch)
        if coming <= crowd.decoding:
            return 1.0
        key = id(r.spec.proposer)
        if key not in crowd.memo:
            ks = plan([crowd.candidate] * coming, 0.0, 0.0, self.memory.costs)
            crowd.memo[key] = sum(k > 0 for k in ks) / coming
        return crowd.memo[key]

    def _remaining(self, r: Request) -> float:
        """Tokens the request is still expected to make: what its budget leaves, or fewer where
        the engine's finished requests ended sooner (an EOS well before ``max_new_tokens``: a
        read spread over the whole budget looked cheaper than it was). Never below a quarter of
        that typical length, since a request past it may run on."""
        left = max(r.config.max_new_tokens - r.output.count, 1)
        typical = self.memory.output_tokens
        if typical is None:
            return left
        return max(min(left, max(typical - r.output.count, typical / 4)), 1.0)

    def _priced_read(self, r: Request, tokens: int, seconds: float) -> None:
        if tokens >= 8:  # long enough to time (a prompt, a stretch at k = 0)
            _fold(self.memory.read_rates, id(r.spec.proposer), seconds / tokens)

    def _draft_cost(self, r: Request) -> float:
        """Seconds per token drafted by this round's source: this request's own measurements,
        else the source's on earlier requests, else a small share of c(1)."""
        state = r.current
        if state.drafted:
            return state.draft_s / state.drafted
        rate = self.memory.draft_rates.get(r.speed_key())
        return rate if rate is not None else 0.05 * self.memory.costs(1)

    def _start_from_history(self, r: Request) -> None:
        """A planned request's current source starts from what earlier requests measured of it."""
        history = self.memory.acceptance.get(r.history_key()) if r.spec.batch_planned else None
        if history is not None and history.estimates is not None:
            policy: PlannedPolicy = r.policy  # batch_planned: the policy is a PlannedPolicy
            policy.start_from(history.estimates)

    def _learn_drafting_share(self, r: Request) -> None:
        """Fold the share of rounds a leaving request drafted in after it read into its proposer's.
        One that never read tells nothing of it: the figure drifts back toward drafting every
        round, so a busy spell, when requests draft little and reads look dear, does not keep a
        quiet engine from reading for good."""
        shares, key, since = self.memory.drafting_shares, id(r.spec.proposer), r.rounds_since_read
        if since:
            _fold(shares, key, r.drafting_rounds / since)
        elif key in shares:
            shares[key] += 0.1 * (1.0 - shares[key])

    def _remember(self, r: Request) -> None:
        """Fold a leaving request's acceptance estimates and draft speed, source by source, and
        its share of rounds that read first, into its proposer's."""
        if not r.spec.batch_planned:
            return
        if r.spec.proposer.caps.catches_up:
            self._learn_drafting_share(r)
        for name, state in r.sources.items():
            policy: PlannedPolicy = state.policy
            history = self.memory.acceptance.setdefault(r.history_key(name), AcceptanceHistory())
            history.observe(policy.estimates(), state.rounds)
            if state.drafted:
                _fold(self.memory.draft_rates, r.speed_key(name), state.draft_s / state.drafted)

    def _propose(self, decoding: list[Request]) -> None:
        """Draft every request's candidates; a proposer that declares batched drafting gets all of
        its requests' chains in one call (one multi-row draft forward per draft step)."""
        groups: dict[int, list[Request]] = {}
        for r in decoding:
            self._priced_read(r, *r.catch_up())
            if r.k > 0 and r.spec.tree is None and r.shadow is None and r.proposer.caps.batched_drafting:
                groups.setdefault(id(r.spec.proposer), []).append(r)
            else:
                r.propose()
        for group in groups.values():
            if len(group) == 1:  # nothing to batch: the proposer's own chain drafting
                group[0].propose()
                continue
            t = time.perf_counter()
            drafts = group[0].spec.proposer.propose_batch(
                [r.proposer for r in group],
                [r.context for r in group],
                [r.k for r in group],
                [r.config.sampling for r in group],
                [r.generator for r in group],
            )
            share = (time.perf_counter() - t) / len(group)
            for r, draft in zip(group, drafts):
                r.set_draft(draft)
                r.drafted(share)

    def _verify(self, rows: list[Row]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """One target forward over every row; logits [keep, vocab] and (when read) features per row."""
        target = self.target
        want_hidden = any(row.request.reads_features for row in rows)
        if target.caps.rows:
            out = target.forward_rows(
                [row.ids for row in rows],
                [row.request.cache for row in rows],
                [row.positions for row in rows],
                [row.mask for row in rows],
                keep=[row.keep for row in rows],
                return_hidden=want_hidden,
            )
            logits, hidden = out if want_hidden else (out, [None] * len(rows))
            return [lg[0] for lg in logits], hidden
        logits, hidden = [], []
        for row in rows:  # a model without multi-row forwards: one forward per row, same results
            tree = {} if row.positions is None else {"positions": row.positions[None], "attn_mask": row.mask}
            out = target.forward(row.ids[None], row.request.cache, last_only=row.keep <= 1, **tree)
            logits.append(out[0, out.shape[1] - row.keep :])
            hidden.append(None)
        return logits, hidden

    def _accept(self, rows: list[Row], logits: list[torch.Tensor], hidden: list, forward_s: float) -> list[Request]:
        touched = []
        for row, lg, h in zip(rows, logits, hidden):
            r = row.request
            if r.reads_features:
                r.observe_forward(row, h)
            if row.keep == 0:  # a prefill chunk
                r.prefilled(forward_s)
                if r.status == RUNNING:  # its prompt is read: later prompts may start from it
                    self._keep_prefix(r, r.prompt_ids)
                continue
            scores = r.draft_scores()
            event = r.absorb(lg, forward_s)
            if scores:  # every verified scored chain teaches what its proposer's scores are worth
                self._calibration(r).observe(scores, r.accepted)
            if event.token_ids or event.text:
                r.events.append(event)
            touched.append(r)
        return touched

    def _retire(self) -> None:
        for r in self.running:
            if r.finished:
                self._close(r)
        self.running = [r for r in self.running if r.status != DONE]

    def _close(self, r: Request) -> None:
        if not r.cancelled:
            self._learn_length(r)
            if self.target.caps.row_exact:  # a conversation's next turn starts with all of it
                self._keep_prefix(r, r.context)
        self._remember(r)
        r.finish()
        r.free()
        self.reserved -= r.capacity

    def _learn_length(self, r: Request) -> None:
        """Fold a finished request's length into the typical one (what reads are spread over).
        A request its budget cut short says only that requests run at least that long (a
        4-token warm-up must not teach that answers are 4 tokens): it may raise the figure,
        never lower or start it."""
        typical, made = self.memory.output_tokens, float(r.output.count)
        if r.output.finish_reason != "length" or (typical is not None and made > typical):
            self.memory.output_tokens = _blend(typical, made)

    # -- reports ---------------------------------------------------------------------------------
    def k_by_batch_size(self) -> dict[int, float]:
        """Mean drafts per decoding request, by how many requests were decoding in the step
        (over the last ``step_log`` steps)."""
        sums: dict[int, list[float]] = {}
        for s in self.steps:
            acc = sums.setdefault(s.batch, [0.0, 0])
            acc[0] += sum(s.ks)
            acc[1] += len(s.ks)
        return {b: total / n for b, (total, n) in sorted(sums.items())}


def _blend(old: float | None, new: float) -> float:
    """A running figure of the engine's memory: 30% the newest measurement."""
    return new if old is None else 0.7 * old + 0.3 * new


def _fold(rates: dict[Any, float], key: Any, rate: float) -> None:
    """A proposer's running figure (seconds per token, a share of rounds), by :func:`_blend`."""
    rates[key] = _blend(rates.get(key), rate)


__all__ = ["Engine", "EngineConfig", "StepRecord", "WAITING", "PREFILL", "RUNNING", "DONE"]
