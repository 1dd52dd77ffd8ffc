"""OpenAI-shaped response bodies and stream chunks, built from the engine's events and results."""

from __future__ import annotations

import json
import math
from typing import Any

from specdecode.engine import GenerationResult, StreamEvent

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}
LOGPROB_FLOOR = -9999.0  # JSON has no -inf


def finish_reason(result: GenerationResult) -> str:
    return FINISH.get(result.finish_reason, "stop")


def sse(payload: dict[str, Any] | str) -> bytes:
    """One Server-Sent Events frame."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def usage(prompt_tokens: int, results: list[GenerationResult]) -> dict[str, Any]:
    """``usage`` over one request's choices, with the speculative block when it speculated."""
    completion = sum(len(r.token_ids) for r in results)
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }
    stats = [r.stats for r in results]
    cached = max((s.get("cached_tokens", 0) for s in stats), default=0)
    if cached:  # OpenAI's field: prompt tokens served from the cache
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    method = stats[0].get("method", "none") if stats else "none"
    if method == "none":
        return out
    calls = sum(s.get("target_calls", 0) for s in stats)
    drafted = sum(s.get("drafted_tokens", 0) for s in stats)
    accepted = sum(s.get("accepted_tokens", 0) for s in stats)
    committed = sum(s.get("mean_accepted_length", 0.0) * s.get("target_calls", 0) for s in stats)
    rounds = [k for s in stats for k in s.get("k_history", [])]
    out["speculative"] = {
        "method": method,
        "k": round(sum(rounds) / len(rounds), 3) if rounds else float(stats[0].get("k", 0)),
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "mean_accepted_length": round(committed / calls, 4) if calls else 0.0,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        "target_calls": calls,
    }
    return out


class LogprobFormatter:
    """Token log-probabilities in OpenAI's two shapes (chat ``content`` list, legacy completions)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def text(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else str(token)

    def chat(self, event: StreamEvent, top: int) -> list[dict[str, Any]]:
        out = []
        for token, (lp, alternatives) in zip(event.token_ids, event.logprobs or []):
            entry = self._entry(token, lp)
            entry["top_logprobs"] = [self._entry(t, v) for t, v in alternatives[:top]]
            out.append(entry)
        return out

    def completion(self, events: list[StreamEvent], offset: int, top: int) -> dict[str, Any]:
        tokens, logprobs, tops, offsets = [], [], [], []
        for event in events:
            for token, (lp, alternatives) in zip(event.token_ids, event.logprobs or []):
                piece = self.text(token)
                tokens.append(piece)
                logprobs.append(_finite(lp))
                tops.append({self.text(t): _finite(v) for t, v in alternatives[:top]})
                offsets.append(offset)
                offset += len(piece)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _entry(self, token: int, lp: float) -> dict[str, Any]:
        piece = self.text(token)
        return {"token": piece, "logprob": _finite(lp), "bytes": list(piece.encode("utf-8"))}


def _finite(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR
