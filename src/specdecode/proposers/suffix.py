"""Suffix decoding (Oliaro et al. 2024, arXiv 2411.04975) over an online suffix automaton.

Two automata are searched: one over this request (prompt + output so far, extended as tokens
commit) and, optionally, one over a bounded corpus of earlier requests' outputs (owned by the proposer, so per engine). The
longest suffix of the context found in either is continued along its most frequent next tokens;
drafts are deterministic (one-hot q), so the shared verifier keeps sampling exact.
"""

from __future__ import annotations

import heapq
import math
import threading
from collections import OrderedDict, deque

import torch

from specdecode.core.sampling import SamplingConfig
from specdecode.core.verify import Draft
from specdecode.errors import ConfigError
from specdecode.proposers.base import PerRequest, ProposerCaps


class SuffixAutomaton:
    """Online suffix automaton over token ids, with occurrence counts per state.

    ``extend`` is O(1) amortized (Blumer et al. 1985). ``count[v]`` is the number of end positions
    of v's strings, so ``count[next[v][t]]`` is how often token t followed v's strings. Counts are
    propagated up at most ``count_depth`` suffix links per token (amortized O(1) too); only long
    single-token runs ("a a a a ...") exceed that, leaving the counts of their shortest suffixes
    lower bounds. Several documents share one automaton: ``end_document`` appends a unique negative
    separator, so no match crosses documents and separators are never proposed.
    """

    def __init__(self, count_depth: int = 64) -> None:
        self.next: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.count: list[int] = [0]
        self.last = 0
        self.tokens = 0  # tokens appended, separators included
        self.count_depth = count_depth
        self._separator = -1

    def extend(self, token: int) -> None:
        nxt, link, length, count = self.next, self.link, self.length, self.count
        cur = len(length)
        nxt.append({})
        link.append(0)
        length.append(length[self.last] + 1)
        count.append(0)
        p = self.last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = len(length)
                nxt.append(dict(nxt[q]))
                link.append(link[q])
                length.append(length[p] + 1)
                count.append(count[q])  # endpos(clone) = endpos(q) until this position is added
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur
        self.tokens += 1
        v, steps = cur, 0
        while v > 0 and steps < self.count_depth:  # the new end position lies in every suffix state
            count[v] += 1
            v = link[v]
            steps += 1

    def extend_all(self, tokens) -> None:
        for t in tokens:
            self.extend(int(t))

    def end_document(self) -> None:
        self.extend(self._separator)
        self._separator -= 1

    def step(self, state: int, matched: int, token: int) -> tuple[int, int]:
        """Streaming match: the state and length of the longest suffix of (match + token) present."""
        nxt, link = self.next, self.link
        while state and token not in nxt[state]:
            state = link[state]
            matched = self.length[state]
        if token in nxt[state]:
            return nxt[state][token], matched + 1
        return 0, 0

    def match(self, tokens) -> tuple[int, int]:
        state, matched = 0, 0
        for t in tokens:
            state, matched = self.step(state, matched, int(t))
        return state, matched

    def longest_repeat(self) -> tuple[int, int]:
        """State and length of the longest suffix of the whole text that also occurs earlier."""
        v = self.link[self.last] if self.last else 0
        return max(v, 0), self.length[max(v, 0)]

    def children(self, state: int) -> list[tuple[int, int, int]]:
        """(count, token, state) for each continuation of ``state``, most frequent first."""
        kids = [(self.count[u], t, u) for t, u in list(self.next[state].items()) if t >= 0]
        kids.sort(key=lambda c: (c[0], c[2]), reverse=True)  # ties: the more recently created state
        return kids


MAX_SCOPES = 64  # salted corpora a corpus keeps (each bounded as it is)


class SuffixCorpus:
    """A bounded store of earlier outputs and one automaton over them, shared by proposers.

    Holds at most ``max_tokens`` tokens in at most ``max_docs`` documents (oldest evicted first).
    The automaton is rebuilt from the kept documents once it holds twice ``max_tokens`` tokens
    (amortized O(1) per added token), so evicted outputs may stay matchable until then.
    """

    def __init__(self, max_tokens: int = 65_536, max_docs: int = 256, count_depth: int = 64) -> None:
        if max_tokens < 1 or max_docs < 1:
            raise ConfigError(f"corpus bounds must be >= 1, got {max_tokens} tokens, {max_docs} documents")
        self.max_tokens, self.max_docs, self.count_depth = max_tokens, max_docs, count_depth
        self.docs: deque[list[int]] = deque()
        self.tokens = 0
        self.automaton = SuffixAutomaton(count_depth)
        self._lock = threading.Lock()
        self._scopes: OrderedDict[str, SuffixCorpus] = OrderedDict()  # salt -> its corpus, least recent first

    def scoped(self, salt: str | None) -> "SuffixCorpus":
        """The corpus of requests with ``cache_salt`` ``salt``: this one for None, else one of
        the salt's own with the same bounds (the :data:`MAX_SCOPES` most recently used kept).
        Outputs then draft only for requests of the same scope, as the prefix store's entries
        serve only theirs: acceptance, so timing, would otherwise reveal another tenant's text."""
        if salt is None:
            return self
        with self._lock:
            child = self._scopes.pop(salt, None) or SuffixCorpus(self.max_tokens, self.max_docs, self.count_depth)
            self._scopes[salt] = child
            while len(self._scopes) > MAX_SCOPES:
                self._scopes.popitem(last=False)
            return child

    def add(self, ids: list[int]) -> None:
        ids = [int(t) for t in ids][-self.max_tokens :]
        if not ids:
            return
        with self._lock:
            self.docs.append(ids)
            self.tokens += len(ids)
            while self.tokens > self.max_tokens or len(self.docs) > self.max_docs:
                self.tokens -= len(self.docs.popleft())
            if self.automaton.tokens + len(ids) + 1 > 2 * self.max_tokens:
                fresh = SuffixAutomaton(self.count_depth)  # readers keep the old one until reset
                for doc in self.docs:
                    fresh.extend_all(doc)
                    fresh.end_document()
                self.automaton = fresh
            else:
                self.automaton.extend_all(ids)
                self.automaton.end_document()

    def clear(self) -> None:
        with self._lock:
            self.docs.clear()
            self.tokens = 0
            self.automaton = SuffixAutomaton(self.count_depth)


def token_score(context: int, count: int, total: int) -> float:
    """A draft token's chance of being right, given the drafts before it were: ``count`` of the
    ``total`` times the matched context (``context`` tokens long, the drafts before it included)
    went on, it went on with this token.

    The length of the match is the stronger signal: a context matched over a few tokens is a
    common phrase that goes on many ways, one matched over dozens is a passage being copied.
    On HumanEval with the Qwen2.5-Coder 1.5B (20 prompts, 128 tokens, k=8; 3,860 judged drafts)
    a first draft was accepted 20% of the time after a 1-token match, 55% after 3-4, 93% after
    9-16 and 99% beyond; the frequency alone, by the rule of succession, ranked them backwards
    (one sighting 68%, several unanimous ones 25%: those are the short matches). Scored
    ``m / (m + 2)`` times the frequency, binned and calibrated the way the engine does, the
    drafts' log loss fell from 0.39 to 0.24 nats.
    """
    return context / (context + 2) * count / total


class SuffixProposer(PerRequest):
    """Suffix decoding: continue the longest matched suffix along its most frequent tokens.

    At most ``min(k, ceil(max_spec_factor * match_length))`` tokens are drafted (match length
    capped at ``max_depth``), stopping when the path's empirical probability (product of
    next-token frequencies) falls below ``min_token_prob``. Each draft carries a score (from how
    long the matched context is and how often the token followed it: :func:`token_score`) so a
    planned k can cut the unsure ones after drafting
    (``scored=False``: k is planned from measured acceptance before drafting, as for any
    proposer). With ``use_corpus`` a request's output
    joins ``corpus`` when it finishes. The corpus belongs to this proposer (so to the engine that
    built it, shared by that engine's requests); pass one ``corpus`` to several proposers to
    share it between engines. Nothing is shared per process.
    """

    name = "suffix"
    caps = ProposerCaps(trees=True, scored_drafts=True)

    def __init__(
        self,
        use_corpus: bool = True,
        corpus: SuffixCorpus | None = None,
        max_depth: int = 24,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        count_depth: int = 64,
        scored: bool = True,
    ) -> None:
        if max_depth < 1 or max_spec_factor <= 0 or not 0.0 <= min_token_prob <= 1.0 or count_depth < 1:
            raise ConfigError(
                "need max_depth >= 1, max_spec_factor > 0, 0 <= min_token_prob <= 1, count_depth >= 1; "
                f"got {max_depth}, {max_spec_factor}, {min_token_prob}, {count_depth}"
            )
        if not scored:  # drafts still scored, but not declared: the engine plans k before drafting
            self.caps = ProposerCaps(trees=True)
        self.use_corpus = use_corpus
        self.corpus = (corpus if corpus is not None else SuffixCorpus()) if use_corpus else None
        self.max_depth, self.max_spec_factor = max_depth, max_spec_factor
        self.min_token_prob, self.count_depth = min_token_prob, count_depth
        self.local: SuffixAutomaton | None = None
        self.ids: list[int] = []
        self.prompt_len = 0
        self.global_: SuffixAutomaton | None = None
        self.g_state, self.g_len = 0, 0

    # -- request lifecycle -----------------------------------------------------------------------
    def reset(self, prompt_ids: list[int]) -> None:
        if self.corpus is not None and self.prefix_scope is not None:  # the request's salt's corpus
            self.corpus = self.corpus.scoped(self.prefix_scope.salt)
        self._restart(prompt_ids)

    def finish(self, context: list[int]) -> None:
        if self.corpus is not None:
            self.corpus.add(list(context[self.prompt_len :]))  # this request's output

    def _restart(self, prompt_ids: list[int]) -> None:
        self.local = SuffixAutomaton(self.count_depth)
        self.ids, self.prompt_len = [], len(prompt_ids)
        self.global_ = self.corpus.automaton if self.corpus is not None else None
        self.g_state, self.g_len = 0, 0
        self._append(prompt_ids)

    def _append(self, tokens: list[int]) -> None:
        for t in tokens:
            t = int(t)
            self.ids.append(t)
            self.local.extend(t)
            if self.global_ is not None:
                self.g_state, self.g_len = self.global_.step(self.g_state, self.g_len, t)

    def _sync(self, context: list[int]) -> None:
        """Extend the automata with the tokens committed since the last call (O(1) amortized each)."""
        n = len(self.ids)
        if self.local is None or len(context) < n or (n and context[n - 1] != self.ids[-1]):
            self._restart(context)  # not a continuation of this request (no reset was called)
        else:
            self._append(context[n:])

    # -- proposals -------------------------------------------------------------------------------
    def _sources(self) -> list[tuple[SuffixAutomaton, int, int]]:
        """(automaton, state, match length) for each non-empty match; the request's own first."""
        out = []
        state, matched = self.local.longest_repeat()
        if matched:
            out.append((self.local, state, matched))
        if self.global_ is not None and self.g_len:
            out.append((self.global_, self.g_state, self.g_len))
        return out

    def _max_len(self, k: int, matched: int) -> int:
        return min(k, math.ceil(self.max_spec_factor * min(matched, self.max_depth)))

    def _chain(
        self, sam: SuffixAutomaton, state: int, limit: int, matched: int
    ) -> tuple[list[int], float, list[float]]:
        """Greedy most-frequent walk: the path, its score (sum of path probabilities) and each
        token's chance of being right after the ones before it (:func:`token_score`)."""
        path, prob, score, sure = [], 1.0, 0.0, []
        while len(path) < limit:
            kids = sam.children(state)
            total = sum(c for c, _, _ in kids)
            if total == 0:
                break
            c, token, child = kids[0]
            prob *= c / total
            if prob < self.min_token_prob:
                break
            sure.append(token_score(matched + len(path), c, total))
            path.append(token)
            score += prob
            state = child
        return path, score, sure

    def _best(self, k: int) -> tuple[SuffixAutomaton, int, int, list[int], list[float]] | None:
        best, best_key = None, None
        for sam, state, matched in self._sources():
            limit = self._max_len(k, matched)
            path, score, sure = self._chain(sam, state, limit, matched)
            key = (score, matched)
            if path and (best_key is None or key > best_key):
                best, best_key = (sam, state, limit, path, sure), key
        return best

    def propose(self, context: list[int], k: int, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        self._sync(context)
        best = self._best(k) if k > 0 else None
        if best is None:
            return Draft.empty()
        return Draft(tokens=torch.tensor([best[3]], dtype=torch.long), scores=torch.tensor([best[4]]))

    def propose_tree(self, context: list[int], k: int, max_nodes: int) -> list[list[int]]:
        """Candidate token paths (a draft tree's root-to-leaf paths), best first.

        Best-first expansion from the best-scoring match: nodes are taken in order of their path
        probability (at least ``min_token_prob``), at most ``max_nodes`` nodes, depth at most the
        chain's draft limit. Paths are ordered by expected accepted length (sum of the path's
        probabilities), so the first is the chain ``propose`` would return when it fits.
        """
        self._sync(context)
        best = self._best(k) if k > 0 and max_nodes > 0 else None
        if best is None:
            return []
        sam, state, limit = best[:3]
        # heap entries: (-path probability, insertion order, path, state, score)
        heap: list = [(-1.0, 0, [], state, 0.0)]
        order = 0
        taken: list[tuple[list[int], float]] = []
        while heap and len(taken) < max_nodes:
            neg, _, path, st, score = heapq.heappop(heap)
            if path:
                taken.append((path, score))
            if len(path) >= limit:
                continue
            kids = sam.children(st)
            total = sum(c for c, _, _ in kids)
            for c, token, child in kids:
                p = -neg * c / total
                if p < self.min_token_prob:
                    break  # kids come most frequent first
                order += 1
                heapq.heappush(heap, (-p, order, path + [token], child, score + p))
        parents = {tuple(p[:-1]) for p, _ in taken}
        leaves = [(p, s) for p, s in taken if tuple(p) not in parents]
        leaves.sort(key=lambda ps: ps[1], reverse=True)
        return [p for p, _ in leaves]

    def observe(self, num_accepted: int) -> None:
        pass  # committed tokens reach the automaton through the next context
