"""Per-request metrics, in three separate kinds: acceptance quality, target serial steps, timing."""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass, field
from typing import Any


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


@dataclass
class RequestMetrics:
    """Accumulated while one request decodes; ``to_dict`` gives the JSON record."""

    method: str
    k: int
    policy: str = "fixed"
    k_history: list[int] = field(default_factory=list)  # drafts requested per round
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt positions taken from the prefix cache, not prefilled
    new_tokens: int = 0
    target_calls: int = 0  # verification forwards (prefill not counted)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    committed_tokens: int = 0
    tree_nodes: int = 0  # candidate nodes verified in tree rounds  # before truncation at EOS / stop / max_new_tokens
    position_drafted: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    histogram: dict[int, int] = field(default_factory=dict)  # accepted drafts per round -> rounds
    queue_s: float = 0.0  # waiting for a slot (cache budget, batch size) before prefill began
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    ttft_s: float = 0.0

    def record_round(self, drafted: int, accepted: int, committed: int) -> None:
        self.target_calls += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.committed_tokens += committed
        while len(self.position_drafted) < drafted:
            self.position_drafted.append(0)
            self.position_accepted.append(0)
        for i in range(drafted):
            self.position_drafted[i] += 1
            self.position_accepted[i] += int(i < accepted)
        if drafted:
            self.histogram[accepted] = self.histogram.get(accepted, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        overhead = max(self.total_s - self.prefill_s - self.draft_s - self.verify_s, 0.0)
        decode_tokens = max(self.new_tokens - 1, 0)
        return {
            "method": self.method,
            "k": self.k,
            "policy": self.policy,
            "k_history": list(self.k_history),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "new_tokens": self.new_tokens,
            "target_calls": self.target_calls,
            "target_calls_per_token": _ratio(self.target_calls, self.new_tokens),
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "tree_nodes": self.tree_nodes,
            "acceptance_rate": _ratio(self.accepted_tokens, self.drafted_tokens),
            "mean_accepted_length": _ratio(self.committed_tokens, self.target_calls),
            "per_position_acceptance": [_ratio(a, d) for a, d in zip(self.position_accepted, self.position_drafted)],
            "accepted_length_histogram": {str(n): c for n, c in sorted(self.histogram.items())},
            "queue_s": self.queue_s,
            "prefill_s": self.prefill_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "overhead_s": overhead,
            "total_s": self.total_s,
            "ttft_s": self.ttft_s,
            "tpot_s": _ratio(self.total_s - self.ttft_s, decode_tokens),
            "tokens_per_s": _ratio(self.new_tokens, self.total_s),
            "peak_rss_mb": round(peak_rss_mb(), 1),
        }


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0
