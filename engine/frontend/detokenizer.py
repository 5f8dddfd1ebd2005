"""Incremental detokenization with stop strings.

Never emits a broken UTF-8 character (tokenizers' DecodeStream buffers incomplete byte sequences) and
holds back the last max(len(stop)) - 1 characters so a stop string that spans tokens is never streamed.
"""

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from tokenmill.engine.sampling_params import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.text = ""

    def update(self, new_token_ids: list[int]) -> str | None:
        """Decode new tokens; return the stop string if one now appears (the text is then cut at it)."""
        before = len(self.text)
        for token in new_token_ids:
            chunk = self.stream.step(self.tokenizer, token)
            if chunk:
                self.text += chunk
        if not self.stop or len(self.text) == before:
            return None
        # Only the new text, plus enough of the old to catch a stop string spanning the boundary.
        search_from = max(0, before - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            pos = self.text.find(s, search_from)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is None:
            return None
        pos, s = best
        self.text = self.text[: pos + len(s)] if self.include_stop else self.text[:pos]
        return s

    def visible_len(self, finished: bool) -> int:
        """How much of the text is safe to show: all once finished, else all but a possible stop-string
        prefix."""
        if finished or self.max_stop_len <= 1:
            return len(self.text)
        return max(0, len(self.text) - (self.max_stop_len - 1))

    def output_text(self, finished: bool) -> str:
        """Text safe to show (see visible_len)."""
        end = self.visible_len(finished)
        return self.text if end == len(self.text) else self.text[:end]
