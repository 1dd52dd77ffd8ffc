"""Emit stage: append committed tokens, stop on EOS / stop strings / length, stream text."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specdecode.engine.loop import GenerationConfig, StreamEvent


class OutputTracker:
    """Generated tokens and text so far; text is released only once it cannot change."""

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int], config: "GenerationConfig") -> None:
        self.tokenizer, self.eos, self.config = tokenizer, eos_token_ids, config
        self.token_ids: list[int] = []
        self.text = ""
        self.released = 0  # characters of ``text`` already streamed
        self.finish_reason = ""
        # A stop string may be split across rounds: hold back enough characters to catch it.
        self.holdback = max((len(s) for s in config.stop_strings), default=1) - 1

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason)

    @property
    def count(self) -> int:
        return len(self.token_ids)

    def add(self, committed: list[int]) -> "StreamEvent":
        from specdecode.engine.loop import StreamEvent

        new: list[int] = []
        for tok in committed:
            new.append(tok)
            if tok in self.eos:
                self.finish_reason = "eos"
                break
            if len(self.token_ids) + len(new) >= self.config.max_new_tokens:
                self.finish_reason = "length"
                break
        self.token_ids.extend(new)
        self._decode()
        return StreamEvent(token_ids=new, text=self._release())

    def _decode(self) -> None:
        if self.tokenizer is None:
            return
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        for stop in self.config.stop_strings:
            at = text.find(stop, max(self.released - len(stop), 0))
            if at >= 0:
                text, self.finish_reason = text[:at], "stop"
        self.text = text

    def _release(self) -> str:
        end = len(self.text)
        if not self.finished:
            end -= self.holdback
            while end > self.released and self.text[end - 1] == "\ufffd":  # incomplete UTF-8
                end -= 1
        if end <= self.released:
            return ""
        piece, self.released = self.text[self.released : end], end
        return piece
