"""Stop strings (OpenAI ``stop``): where the answer ends, and what a stream must hold back.

Pure string logic, used by the server on the decoded committed prefix of each choice:

- ``find_stop(text, stops)``: the earliest position where any stop string occurs (-1: none);
  the returned answer is ``text[:pos]`` (the stop string itself is not part of it).
- ``partial_stop_len(text, stops)``: the length of the longest suffix of ``text`` that is a
  proper prefix of some stop string; a stream holds that much back, since the next committed
  characters may complete a stop string.
- ``StopBuffer``: the two combined over a growing text: ``push(delta)`` returns the text that is
  safe to send now and never anything at or past a stop string.
- ``tokens_covering(ids, text, decode)``: how many leading token ids the returned text needs
  (the ``completion_tokens`` of an answer cut at a stop string).
"""
from __future__ import annotations

from typing import Callable, Sequence

MAX_STOP_STRINGS = 4      # OpenAI's limit


def stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """The request's ``stop`` as a tuple (``None`` and ``[]``: no stop strings); raises
    ``ValueError`` for more than ``MAX_STOP_STRINGS`` strings or an empty one."""
    stops = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
    if any(s == "" for s in stops):
        raise ValueError("stop strings must not be empty")
    return stops


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int:
    """Earliest index ``>= start`` at which any stop string begins in ``text``, or -1."""
    best = -1
    for s in stops:
        i = text.find(s, start)
        if i != -1 and (best == -1 or i < best):
            best = i
    return best


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string
    (0 if none): text that may still turn out to be the start of a stop string."""
    longest = max((len(s) for s in stops), default=0)
    for k in range(min(len(text), longest - 1), 0, -1):
        tail = text[-k:]
        if any(len(s) > k and s.startswith(tail) for s in stops):
            return k
    return 0


class StopBuffer:
    """A growing text cut at the first stop string, released only as far as it is final.

    ``push(delta)`` appends newly committed text and returns what may be sent now: everything up
    to the first stop string once one occurs (then ``stopped`` is True and later pushes return
    ""), else everything but a trailing partial stop string, or everything when ``final``.
    The returned pieces concatenate to ``output``. With no stop strings it passes text through.
    """

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self.stops = tuple(stops)
        self._longest = max((len(s) for s in self.stops), default=0)
        self.text = ""                   # everything pushed
        self.emitted = 0                 # length of text returned so far
        self.stop_at: int | None = None  # where the first stop string begins

    @property
    def stopped(self) -> bool:
        return self.stop_at is not None

    @property
    def output(self) -> str:
        """The answer: the text up to (not including) the first stop string."""
        return self.text if self.stop_at is None else self.text[:self.stop_at]

    def push(self, delta: str, final: bool = False) -> str:
        if self.stopped:
            return ""
        # NOTE: an occurrence not seen before must end inside the new text, so the search starts
        # at most (longest stop - 1) characters before it
        start = max(0, len(self.text) - self._longest + 1)
        self.text += delta
        pos = find_stop(self.text, self.stops, start) if self.stops else -1
        if pos >= 0:
            self.stop_at = end = pos
        elif final:
            end = len(self.text)
        else:
            end = len(self.text) - partial_stop_len(self.text, self.stops)
        if end <= self.emitted:          # (never below: held-back text covers any partial match)
            return ""
        out = self.text[self.emitted:end]
        self.emitted = end
        return out


def tokens_covering(ids: Sequence[int], text: str, decode: Callable[[list[int]], str]) -> int:
    """The fewest leading ``ids`` whose decoding starts with ``text`` (binary search: decoding a
    longer prefix only appends text). A token that straddles the end of ``text`` counts. Falls
    back to ``len(ids)`` if even the whole list does not decode to a text starting with ``text``
    (a decoder that rewrites earlier text)."""
    if not text:
        return 0
    ids = list(ids)
    if not decode(ids).startswith(text):
        return len(ids)
    lo, hi = 1, len(ids)                 # decode(ids[:hi]) covers text; find the smallest such
    while lo < hi:
        mid = (lo + hi) // 2
        if decode(ids[:mid]).startswith(text):
            hi = mid
        else:
            lo = mid + 1
    return hi
