"""The target's own last-layer features of the committed context, for proposers that read them.

A feature-reading proposer (EAGLE, Medusa) needs the target's pre-norm last-layer feature f_i of
committed positions. It gets them for free from the target's own forwards: the engine hands it
each forward of its request's target cache (``observe_forward``, the features the forward returns)
and, when it next drafts, it keeps the rows of the forwards since (prefill, chain or tree verify, however many rounds it sat out: another proposer
drafted, or speculation was off) whose tokens the committed context confirms. If a feature is
missing anyway (a forward it did not see), it recomputes it with its own target forward on a
private cache, so the drafts never depend on how the decoder is driven.
"""

from __future__ import annotations

from collections import deque

import torch

MAX_PENDING_ROWS = 4096  # forwards' rows kept until the next draft (a few MB); older ones are recomputed


class TargetFeatures:
    """Mixin: ``feats[:nfeat]`` are the target's features of the context's first positions.

    The host class sets ``target`` (a native model) and ``hidden`` (its feature width) and calls
    :meth:`_watch` from ``reset``.
    """

    target: object
    hidden: int

    def _watch(self, prompt_ids: list[int]) -> None:
        """Start recording the target's forwards for a new request."""
        self._records: deque[tuple] = deque()
        self._pending = 0  # rows in _records
        self.feats = torch.empty(len(prompt_ids) + 256, self.hidden)
        self.known = torch.zeros(self.feats.shape[0], dtype=torch.bool)
        self.nfeat = 0  # feats[:nfeat] are the target's features of the context's positions
        self._own = None  # private target cache for features the sink missed
        self._own_len = 0

    def observe_forward(
        self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, hidden: torch.Tensor
    ) -> None:
        """A target forward over this request's cache: ids [n], positions [n], its mask
        ([n, length + n] bool, or None for causal) and its features hidden [n, hidden]."""
        self._records.append((ids, positions, mask, hidden))
        self._pending += len(ids)
        while self._pending > MAX_PENDING_ROWS and len(self._records) > 1:
            self._pending -= len(self._records.popleft()[0])

    def _features_upto(self, context: list[int], needed: int) -> None:
        """Make ``feats[:needed]`` the target's features of ``context[:needed]``."""
        self._absorb(context)
        if self.nfeat < needed:
            self._fill(context, needed)

    def _ensure(self, n: int) -> None:
        if n > self.feats.shape[0]:
            size = max(n, 2 * self.feats.shape[0])
            feats, known = torch.empty(size, self.hidden), torch.zeros(size, dtype=torch.bool)
            feats[: self.feats.shape[0]] = self.feats
            known[: self.known.shape[0]] = self.known
            self.feats, self.known = feats, known

    def _absorb(self, context: list[int]) -> None:
        """Keep the recorded rows whose tokens (and attended new tokens) the context confirms."""
        n_ctx = len(context)
        for ids, positions, mask, hidden in self._records:
            ids, pos = ids.tolist(), positions.tolist()
            match = [p < n_ctx and t == context[p] for t, p in zip(ids, pos)]
            n = len(ids)
            if mask is None:  # causal: a row is valid when it and every row before it match
                ok, valid = True, []
                for m in match:
                    ok = ok and m
                    valid.append(ok)
            else:
                block = mask.reshape(n, -1)[:, -n:]
                valid = [match[i] and all(match[j] for j in block[i].nonzero().flatten().tolist()) for i in range(n)]
            rows = [i for i in range(n) if valid[i]]
            if rows:
                self._ensure(max(pos[i] for i in rows) + 1)
                index = torch.tensor([pos[i] for i in rows])
                self.feats[index] = hidden[rows].float()
                self.known[index] = True
        self._records.clear()
        self._pending = 0
        while self.nfeat < self.known.shape[0] and self.known[self.nfeat]:
            self.nfeat += 1

    def _fill(self, context: list[int], needed: int) -> None:
        """Compute features for positions nfeat..needed-1 with a private target forward."""
        if self._own is None:
            self._own = self.target.new_cache(len(context) + 256)
            self._own_len = 0
        self._own.trim(min(self._own_len, self.nfeat, self._own.length))
        start = self._own.length
        _, hidden = self.target.forward(
            torch.tensor([context[start:needed]]), self._own, last_only=True, return_hidden=True
        )
        self._own_len = needed
        self._ensure(needed)
        self.feats[start:needed] = hidden
        self.known[start:needed] = True
        self.nfeat = max(self.nfeat, needed)
        while self.nfeat < self.known.shape[0] and self.known[self.nfeat]:
            self.nfeat += 1
