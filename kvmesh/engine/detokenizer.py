"""Incremental detokenization and stop strings, one `SequenceText` per generated sequence.

Text grows only by complete characters: a token that ends inside a multi-byte character (the
decoded text ends in U+FFFD) is held until the character completes; `flush()` at the end of the
sequence releases what is still held, so the streamed pieces always join to the full decode. A
few prompt tokens serve as left context so tokenizers that drop a leading space on the first
token still decode right.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class SequenceText:
    """Text of one sequence's output, stop-string aware.

    `append(new_ids)` returns the newly visible text; `flush()` the held rest once no more ids
    come. After a stop string matched, `stopped_by` holds it and `text` ends right before it
    (or after it with include_stop_str_in_output).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop_str: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0  # first id of the decode window
        self._read = len(self._ids)  # ids before this are already in `text`
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop_str
        self._skip_special = skip_special_tokens
        self.text = ""
        self.stopped_by: str | None = None

    def append(self, new_ids: Sequence[int]) -> str:
        """Add generated ids; return the text they made visible (possibly empty)."""
        if self._tokenizer is None or self.stopped_by is not None:
            return ""
        self._ids.extend(new_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held at the end of the sequence (an incomplete character shows as
        U+FFFD); afterwards `text` is the full decode (up to a stop string)."""
        if self._tokenizer is None or self.stopped_by is not None:
            return ""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or (after.endswith(_REPLACEMENT) and not final):
            return ""
        delta = after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        return self._add_text(delta)

    def _add_text(self, delta: str) -> str:
        start = len(self.text)
        self.text += delta
        if not self._stop:
            return delta
        longest = max(len(s) for s in self._stop)
        search_from = max(0, start - longest + 1)
        hits = [(self.text.find(s, search_from), s) for s in self._stop]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if not hits:
            return delta
        pos, stop = min(hits)
        self.stopped_by = stop
        self.text = self.text[: pos + len(stop)] if self._include_stop else self.text[:pos]
        return self.text[start:]

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=self._skip_special))
