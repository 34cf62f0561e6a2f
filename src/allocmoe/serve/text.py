"""Token ids in, text out, a piece at a time: incremental detokenisation with stop strings.

The whole generated sequence is decoded again after each token (byte-level BPE splits characters
across tokens, so a token alone may decode to half a character, shown as U+FFFD). Text is handed
out only once it can no longer change: a trailing U+FFFD waits for the rest of its character, and
the last len(longest stop) - 1 characters wait until no stop string can begin in them.
"""

from __future__ import annotations


class IncrementalText:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.text = ""                  # all text so far, cut before a stop string once one is seen
        self.stopped = False            # a stop string was found: no more text will come
        self._sent = 0                  # characters already handed out
        self._holdback = max((len(s) for s in stop), default=1) - 1

    def add(self, token_id: int) -> None:
        if self.stopped:
            return
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if cut:
            self.text, self.stopped = text[:min(cut)], True
        elif not text.endswith("\ufffd"):
            self.text = text

    def take(self, final: bool = False) -> str:
        """The text not handed out yet that is settled (all of it when `final` or stopped)."""
        end = len(self.text) if final or self.stopped else len(self.text) - self._holdback
        if end <= self._sent:
            return ""
        piece, self._sent = self.text[self._sent:end], end
        return piece
