"""Emit stage: append committed tokens, stop on EOS / stop strings / length, stream text.

Text is decoded incrementally, the way serving engines do it (vLLM's and TGI's prefix / read
offsets): each round decodes only a short window of recent tokens, so the work per round does not
grow with the length of the output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specdecode.engine.request import GenerationConfig, StreamEvent

REPLACEMENT = "\ufffd"  # what a tokenizer decodes an incomplete (or invalid) UTF-8 sequence to
# An incomplete UTF-8 character is at most 3 bytes, so at most 3 tokens: a clean boundary before
# it is among the last few.
TAIL_TRIES = 4
# Undecided tokens kept at most. Only a run with no clean boundary between any two tokens (tokens
# that each end inside a character the next one completes) gets this far; past it, everything but
# the trailing U+FFFD is settled anyway, which bounds the work per round.
MAX_PENDING = 16


class Detokenizer:
    """Text of a growing list of token ids, decoded a window at a time.

    ``ids[:read_offset]`` are *settled*: their text is final. ``ids[prefix_offset:read_offset]``
    are decoded again as context for the new tokens, and the new text is what the window decodes
    to past the settled part of ``prefix_text`` (those tokens decoded alone). Offsets move to
    *clean* boundaries, not inside a character, so there the window decodes like the whole text.

    Exact for tokenizers whose decode is local at character boundaries (byte-level BPE,
    SentencePiece, WordPiece): the settled pieces and the last tail concatenate to
    ``tokenizer.decode(ids, skip_special_tokens=True)``. (Not when ``clean_up_tokenization_spaces``
    rewrites text across a window boundary, nor for byte-fallback runs of invalid UTF-8.)
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.prefix_offset = 0
        self.read_offset = 0
        self.prefix_text = ""  # decode(ids[prefix_offset:read_offset])
        self.prefix_settled = 0  # characters of prefix_text already settled

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, ids: list[int], final: bool = False) -> tuple[str, str]:
        """(newly settled text, undecided tail) after ``ids`` grew; ``final`` settles everything.

        The tail is what the unsettled tokens decode to now; it ends in U+FFFD (an incomplete
        character) and may change when more tokens come. ``ids`` must extend the previous call's.
        """
        n = len(ids)
        window = self.decode(ids[self.prefix_offset : n])
        if final or not window.endswith(REPLACEMENT):
            return self._settle(ids, n, window), ""
        split = self._clean_split(ids, n, window)
        if split is not None:
            end, head = split
            return self._settle(ids, end, head), window[len(head) :]
        if n - self.read_offset > MAX_PENDING:
            return self._settle_all_but_replacements(ids, n, window)
        return "", window[self.prefix_settled :]

    def _settle(self, ids: list[int], end: int, head: str) -> str:
        """Settle ``ids[:end]`` (``head`` is the window decoded up to ``end``); its new text."""
        piece = head[self.prefix_settled :]
        context = self.decode(ids[self.read_offset : end])
        if context or end - self.prefix_offset > MAX_PENDING:
            self.prefix_offset, self.prefix_text = self.read_offset, context
        else:
            # The new tokens decode to nothing (skipped special tokens): a window starting there
            # would lose what decoders do at the start of a text (SentencePiece drops a space).
            self.prefix_text = head
        self.read_offset, self.prefix_settled = end, len(self.prefix_text)
        return piece

    def _clean_split(self, ids: list[int], n: int, window: str) -> tuple[int, str] | None:
        """The last clean boundary among the last few unsettled tokens, with the window's text to it."""
        for end in range(n - 1, max(self.read_offset, n - 1 - TAIL_TRIES), -1):
            head = self.decode(ids[self.prefix_offset : end])
            if not window.startswith(head):
                continue
            if not head.endswith(REPLACEMENT):
                return end, head
            # A U+FFFD just before ``end`` is final (invalid bytes, not a character still being
            # completed) when what follows decodes alone the same as in the window.
            rest = window[len(head) :]
            if rest and self.decode(ids[end:n]) == rest:
                return end, head
        return None

    def _settle_all_but_replacements(self, ids: list[int], n: int, window: str) -> tuple[str, str]:
        """Settle all tokens, keeping the window's trailing U+FFFD run open (no clean boundary).

        A decoder emits every character but the incomplete last one as it reads the bytes, so
        only the U+FFFD run at the end can still change. The next window starts inside a
        character; its first characters are junk, but that junk is in the settled part of the new
        ``prefix_text`` and cancels out.
        """
        run = min(len(window) - len(window.rstrip(REPLACEMENT)), len(window) - self.prefix_settled)
        for start in dict.fromkeys((max(self.read_offset, n - TAIL_TRIES), self.read_offset)):
            context = self.decode(ids[start:n])
            # The run must be the same bytes in both decodes: a real character before it in the
            # context shows the decoder is back in step there.
            if context.endswith(REPLACEMENT * run) and context[: len(context) - run].strip(REPLACEMENT):
                piece = window[self.prefix_settled : len(window) - run]
                self.prefix_offset, self.prefix_text, self.read_offset = start, context, n
                self.prefix_settled = len(context) - run
                return piece, window[len(window) - run :]
        return self._settle(ids, n, window), ""  # cannot tell: release it as decoded


class OutputTracker:
    """Generated tokens and text so far; text is released only once it cannot change.

    Released text is never past a stop string: text that may be the start of one is held back
    until the next tokens tell, and so is an incomplete UTF-8 character.
    """

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int], config: "GenerationConfig") -> None:
        self.tokenizer, self.eos, self.config = tokenizer, eos_token_ids, config
        self.token_ids: list[int] = []
        self.finish_reason = ""
        self._detok = Detokenizer(tokenizer) if tokenizer is not None else None
        self._released: list[str] = []  # pieces already streamed
        self._held = ""  # settled text not yet streamed: it may start a stop string
        self._pending = ""  # text of the unsettled tokens (ends in an incomplete character)

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason)

    @property
    def count(self) -> int:
        return len(self.token_ids)

    @property
    def text(self) -> str:
        """All text so far (final once finished), cut before a stop string."""
        return "".join(self._released) + self._held + self._pending

    def add(self, committed: list[int]) -> "StreamEvent":
        """Append a round's tokens, up to an EOS or the token budget; the event has the tokens
        kept and the text released by them (empty while it may still change or stop)."""
        from specdecode.engine.request import StreamEvent

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
        if self._detok is None:
            return
        settled, pending = self._detok.update(self.token_ids, final=self.finished)
        # No stop string can begin in released text (_release keeps back any end of the text that
        # may start one), so the text not released yet is all there is to search.
        unreleased = self._held + settled + pending
        at = first_stop(unreleased, self.config.stop_strings)
        if at is None:
            self._held, self._pending = self._held + settled, pending
        else:
            self._held, self._pending, self.finish_reason = unreleased[:at], "", "stop"

    def _release(self) -> str:
        keep = 0 if self.finished else stop_prefix_length(self._held, self.config.stop_strings)
        piece = self._held[: len(self._held) - keep]
        self._held = self._held[len(piece) :]
        if piece:
            self._released.append(piece)
        return piece


def first_stop(text: str, stop_strings: tuple[str, ...]) -> int | None:
    """Where the earliest stop string in ``text`` begins, or None."""
    found = [at for at in (text.find(stop) for stop in stop_strings) if at >= 0]
    return min(found, default=None)


def stop_prefix_length(text: str, stop_strings: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that is the start (not all) of some stop string."""
    best = 0
    for stop in stop_strings:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
