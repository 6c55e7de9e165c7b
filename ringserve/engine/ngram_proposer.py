"""Prompt lookup (n-gram) drafts for speculative decoding (issue 30; vLLM's method "ngram",
`prompt_lookup_min` / `prompt_lookup_max`): the tokens that followed the latest earlier
occurrence of the sequence's last n tokens, for the longest n that has one.

Long-context work copies from long prompts, so the lookup may not scan the sequence each
step. Each n-gram (n from min to max) is indexed once, as its tokens arrive, by where the
token after it is; the index keeps the latest place (the most recent context is the likeliest
to repeat). A step's lookup is then one dictionary probe per n and the draft a slice: work
O(max_n^2 + k) per step and per new token, whatever the sequence's length. Indexing a
prompt of P tokens costs O(P x max_n^2) once.
"""

from __future__ import annotations


class NgramIndex:
    """The n-gram index of one sequence's tokens (prompt, then output as it is accepted)."""

    def __init__(self, min_n: int, max_n: int, tokens: list[int] = ()):
        if not 1 <= min_n <= max_n:
            raise ValueError(
                f"prompt_lookup_min ({min_n}) must be at least 1 and at most prompt_lookup_max ({max_n})"
            )
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        # n-gram (a tuple of n tokens) -> the position of the token after its latest occurrence
        self._after: dict[tuple[int, ...], int] = {}
        self.probes = 0  # dictionary reads and writes (tests check the work per step)
        self.extend(tokens)

    def extend(self, tokens) -> None:
        """Append tokens (a prompt, or a step's accepted ones), indexing each n-gram that now has
        a token after it."""
        seq = self.tokens
        for token in tokens:
            end = len(seq)  # the new token's position: it follows the n-grams ending before it
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._after[tuple(seq[end - n : end])] = end
                self.probes += 1
            seq.append(token)

    def truncate(self, length: int) -> None:
        """Forget tokens from `length` on (rejected drafts are never appended, but a preempted or
        rolled-back sequence may shrink): rebuilds the index of what remains."""
        if length < len(self.tokens):
            kept = self.tokens[:length]
            self.tokens, self._after = [], {}
            self.extend(kept)

    def propose(self, k: int) -> list[int]:
        """k draft tokens: what followed the latest earlier occurrence of the last n tokens, for
        the longest n in [min_n, max_n] that occurred before; [] when none did."""
        seq = self.tokens
        length = len(seq)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            self.probes += 1
            start = self._after.get(tuple(seq[length - n :]))
            if start is not None:
                # start < length: the suffix itself has no token after it yet, so it is not indexed.
                # A copy that reaches the end goes on into its own draft (a repeating stretch,
                # "a b a b" -> "a b a b", as an overlapping copy does).
                draft = seq[start : start + k]
                while len(draft) < k:
                    draft.append(draft[len(draft) - (length - start)])
                return draft
        return []
