"""Text from tokens as they are generated: the deltas a stream sends, with stop strings
found across token boundaries."""

from __future__ import annotations

from collections.abc import Sequence

from kvpush.serving.checkpoint import Tokenizer


class _StopMatcher:
    """Finds the first stop string in the growing text; says how much text is safe to
    send while a stop string might still be forming at its end."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.hold = max((len(x) for x in stops), default=1) - 1

    def find(self, text: str, since: int) -> int | None:
        start = max(0, since - self.hold)
        hits = [i for x in self.stops if (i := text.find(x, start)) >= 0]
        return min(hits) if hits else None


class Detokenizer:
    """Text deltas from growing token lists; holds back an incomplete UTF-8 sequence and,
    with stop strings, the tail in which one of them may still be forming."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...] = ()) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._sent = ""
        self._stop = _StopMatcher(stops) if stops else None
        self.stopped = False  # a stop string was found: the text ends before it

    def add(self, ids: Sequence[int]) -> str:
        self._ids.extend(ids)
        text = self._tok.decode(self._ids)
        if self._stop is not None:
            at = self._stop.find(text, len(self._sent))
            if at is not None:
                self.stopped = True
                delta = text[len(self._sent) : at] if at > len(self._sent) else ""
                self._sent += delta
                return delta
        if text.endswith("\ufffd") or not text.startswith(self._sent):
            return ""
        end = len(text) - (self._stop.hold if self._stop is not None else 0)
        if end <= len(self._sent):
            return ""
        delta = text[len(self._sent) : end]
        self._sent += delta
        return delta

    def flush(self) -> str:
        if self.stopped:
            return ""
        text = self._tok.decode(self._ids)
        delta = text[len(self._sent) :] if text.startswith(self._sent) else ""
        self._sent += delta
        return delta
