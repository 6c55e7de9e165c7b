"""Speculative decoding's engine side (--speculative-config): which sequences get drafts, how
many, and which of a verified run's tokens are kept.

A step with drafts computes, for a sequence, its last token and its d drafts (d + 1 new
tokens, the paged cache read in place as a prefill chunk reads it) and returns d + 1 rows of
logits: row i scores the token after the last token and drafts 0 .. i - 1. Each row is
sampled as the token at its position would be without speculation (same logits adjustments,
same counter-based random numbers: sampler.py keys a draw by the output position), and the
run is kept up to the first row whose token differs from the draft there, that row's token
included. With a draft that is one token for sure (prompt lookup), this is the standard
rejection rule: a draft d is kept with probability p(d), and otherwise the token comes from p
without d, renormalised; together, exactly p. So the output is the target model's whatever
the drafts, and at temperature 0 the same tokens as without speculation.

Structured output: drafts are cut where the grammar stops allowing them, and row i of a run
is masked by the grammar as it stands after the run's first i drafts (a copy that took them).

Drafts go only to sequences whose other sampling adjustments do not depend on the tokens
before a position within the run (no penalties, bad words, or min_tokens still pending), up
to the request's max_tokens and the context limit, and none while disable_by_batch_size
sequences or more run. How many a sequence gets adapts to how many it has been keeping: one
more than a running average of its kept drafts (halved each run), up to
num_speculative_tokens, so text that stopped copying costs one wasted row a step, not k, and
text that copies again soon gets k.

The KV written for rejected drafts is left where it is: those positions are not counted as
computed, no prefix-cache block holds them, and the next tokens overwrite them in the same
blocks.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from ringserve.config.speculative import SpeculativeConfig
from ringserve.engine.ngram_proposer import NgramIndex
from ringserve.engine.sequence import Sequence


class Drafter:
    """What every proposer shares: which sequences draft, how many tokens (adaptive k), and
    disable_by_batch_size. A proposer gives the drafts themselves (`propose`); one that
    needs the device fills them in after the scheduler has fitted them (`fill`)."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        # a sequence's running average of drafts kept per verified run (starts at k)
        self._kept: weakref.WeakKeyDictionary[Sequence, float] = weakref.WeakKeyDictionary()

    def drafting(self, batch_size: int) -> bool:
        """Whether sequences draft in a step of batch_size sequences (under data parallelism
        the largest replica's: the replicas step together): not at disable_by_batch_size."""
        limit = self.config.disable_by_batch_size
        return limit is None or batch_size < limit

    def propose_all(self, running: list[Sequence], max_context: int, drafting: bool) -> None:
        """Set each running sequence's drafts for the next step (none for any while drafting
        is off for the batch: then no token of theirs is read)."""
        for seq in running:
            k = self.num_drafts(seq, max_context) if drafting else 0
            seq.draft_token_ids = self.propose(seq, k) if k > 0 else []

    def fill(self, batch) -> None:
        """After scheduling (batch: the ScheduledBatch, its sequences' drafts cut to what
        fits): drafts only the device can make. Prompt lookup's are made already."""

    def record(self, seq: Sequence, num_kept: int) -> None:
        """A verified run of seq kept num_kept drafts: its next runs' length follows."""
        self._kept[seq] = (self._kept.get(seq, self.config.num_speculative_tokens) + num_kept) / 2

    def num_drafts(self, seq: Sequence, max_context: int) -> int:
        """How many drafts seq may check next step: 0 unless it decodes (one token to
        compute) and may take them (the module docstring); at most num_speculative_tokens,
        one more than its running average kept, and no more than its max_tokens and
        max_context (the longest sequence) leave room for."""
        p = seq.params
        if (
            seq.num_uncomputed_tokens != 1
            or seq.ends_when_read
            or not self.may_draft(seq)
            or len(seq.output_token_ids) < p.min_tokens
        ):
            return 0
        # The verified run keeps up to drafts + 1 tokens.
        room = min(p.max_tokens - len(seq.output_token_ids), max_context - seq.num_tokens) - 1
        kept = self._kept.get(seq, self.config.num_speculative_tokens)
        return min(self.config.num_speculative_tokens, round(kept) + 1, room)

    def may_draft(self, seq: Sequence) -> bool:
        """Whether seq's sampling lets it draft at all (nothing that depends on the tokens
        before a position within a run: penalties, bad words; no prompt logprobs pending)."""
        return not (seq.params.penalized or seq.bad_words_ids or seq.needs_prompt_logits)

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """At most k drafts to follow seq's tokens."""
        raise NotImplementedError


class NgramDrafter(Drafter):
    """Prompt-lookup drafts for the engine's sequences, each with its n-gram index (built once
    from the prompt, extended by the tokens each step keeps; gone with the sequence)."""

    def __init__(self, config: SpeculativeConfig):
        super().__init__(config)
        self._index: weakref.WeakKeyDictionary[Sequence, NgramIndex] = weakref.WeakKeyDictionary()

    def propose(self, seq: Sequence, k: int) -> list[int]:
        index = self._index.get(seq)
        if index is None:
            index = self._index[seq] = NgramIndex(
                self.config.prompt_lookup_min, self.config.prompt_lookup_max
            )
        index.extend(seq.token_slice(len(index.tokens), seq.num_tokens))
        drafts = index.propose(k)
        if seq.grammar is not None and drafts:  # only what the grammar allows can be kept
            del drafts[seq.grammar.valid_prefix(seq.output_token_ids, drafts) :]
        return drafts


def kept_run(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a verified run keeps: sampled [d + 1] (row i's token), drafts [d] -> the
    sampled tokens up to and including the first that differs from its draft (all d + 1
    when every draft matched)."""
    for i, draft in enumerate(drafts):
        if sampled[i] != draft:
            return sampled[: i + 1]
    return sampled[: len(drafts) + 1]


@dataclass
class SpecDecodeStats:
    """Counts since start (vLLM's spec_decode metrics): verified runs with drafts, their draft
    tokens, the drafts kept, and kept drafts by position in the run."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafted:
            self.accepted_per_position += [0] * (num_drafted - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verified run gave, on average (1 + drafts kept), as vLLM reports it."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
