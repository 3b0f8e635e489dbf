"""Stop strings over streamed text: hold back what might be the start of a stop string."""

from __future__ import annotations

from typing import Sequence


class StopMatcher:
    """Feed text pieces; get back the text that is safe to emit and whether a stop string was hit."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self.held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Emit-able text and True once a stop string appears (the stop text and anything after it are dropped)."""
        if not self.stops:
            return text, False
        self.held += text
        hits = [i for i in (self.held.find(stop) for stop in self.stops) if i >= 0]
        if hits:
            emit, self.held = self.held[: min(hits)], ""
            return emit, True
        keep = self._partial_suffix()
        emit = self.held[: len(self.held) - keep]
        self.held = self.held[len(self.held) - keep :]
        return emit, False

    def flush(self) -> str:
        """Text still held back when generation ends for another reason."""
        text, self.held = self.held, ""
        return text

    def _partial_suffix(self) -> int:
        # The longest end of the held text that begins some stop string.
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(self.held)), longest, -1):
                if self.held.endswith(stop[:size]):
                    longest = size
                    break
        return longest
