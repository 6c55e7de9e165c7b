"""Per-request adjustments of the logits before sampling, batched on the device: logit_bias,
min_tokens, bad_words, and the presence, frequency and repetition penalties, with vLLM's
meanings.

The penalties need how often each token was generated. The host cannot count it under async
scheduling: a sequence's last token is still on the device when the next step is sampled.
So the counts live on the device, one row (slot) per running sequence that uses a penalty,
and each step adds its sampled tokens there right after sampling, in the device's own order.
A slot also marks the prompt's tokens once (repetition_penalty covers the prompt as well).
Host work per step is O(rows adjusted + bias entries), not O(tokens generated).
"""

from __future__ import annotations

import torch

from ringserve.engine.sequence import PENDING_TOKEN, Sequence


class LogitsAdjuster:
    """The engine's one instance: slots for penalised sequences, freed when they leave."""

    def __init__(self, vocab_size: int, device: torch.device, eos_token_ids):
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids = sorted(eos_token_ids)
        # request id -> (its sequence, its row of counts and in_prompt); the sequence tells a
        # request id used again apart from the one that held the slot
        self.slot_of: dict[str, tuple[Sequence, int]] = {}
        self.free: list[int] = []
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)  # [slots, V]
        self.in_prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)  # [slots, V]

    def adjust(self, logits: torch.Tensor, seqs: list[Sequence], pending: dict[str, int]) -> torch.Tensor:
        """logits [S, V] float32, one row per sequence -> the adjusted logits (a new tensor
        when some row is adjusted; the raw ones stay for logprobs). pending: request id -> the
        token still in flight at the end of its output, for the sequences whose bad words
        span several tokens (the host must see their last tokens)."""
        rows = [i for i, seq in enumerate(seqs) if seq.params.adjusts_logits]
        if not rows:
            return logits
        logits = logits.clone()
        bias_rows, bias_ids, bias_values = [], [], []
        ban_rows, ban_ids = [], []
        penalised = []
        for i in rows:
            seq = seqs[i]
            p = seq.params
            if p.logit_bias:
                bias_rows += [i] * len(p.logit_bias)
                bias_ids += p.logit_bias.keys()
                bias_values += p.logit_bias.values()
            # Pending tokens count: under async scheduling the last one is on the device.
            if len(seq.output_token_ids) < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
                stops = [t for t in stops if 0 <= t < self.vocab_size]
                ban_rows += [i] * len(stops)
                ban_ids += stops
            if seq.bad_words_ids:
                banned = banned_by_bad_words(
                    seq.bad_words_ids, seq.output_token_ids, pending.get(seq.request_id)
                )
                ban_rows += [i] * len(banned)
                ban_ids += banned
            if p.penalized:
                penalised.append(i)
        device = logits.device
        if bias_rows:
            index = (_ids(bias_rows, device), _ids(bias_ids, device))
            values = torch.tensor(bias_values, dtype=torch.float32).to(device, non_blocking=True)
            logits.index_put_(index, values, accumulate=True)
        if ban_rows:
            logits[_ids(ban_rows, device), _ids(ban_ids, device)] = float("-inf")
        if penalised:
            self._penalise(logits, [seqs[i] for i in penalised], penalised)
        return logits

    def _penalise(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
        slots = [self._slot(seq) for seq in seqs]
        params = [
            (s.params.presence_penalty, s.params.frequency_penalty, s.params.repetition_penalty) for s in seqs
        ]
        device = logits.device
        p = torch.tensor(params, dtype=torch.float32).to(device, non_blocking=True)  # [P, 3]
        slot_index, row_index = _ids(slots, device), _ids(rows, device)
        counts = self.counts.index_select(0, slot_index)  # [P, V] int32
        generated = counts > 0
        x = logits.index_select(0, row_index)  # [P, V]
        seen = generated | self.in_prompt.index_select(0, slot_index)
        r = p[:, 2:3]
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        x = x - p[:, 1:2] * counts - p[:, 0:1] * generated
        logits.index_copy_(0, row_index, x)

    def _slot(self, seq: Sequence) -> int:
        held = self.slot_of.get(seq.request_id)
        if held is not None and held[0] is seq:
            return held[1]
        if held is not None:  # a finished request's id, used again: not its counts
            self.free.append(held[1])
        if not self.free:
            self._grow()
        slot = self.free.pop()
        self.slot_of[seq.request_id] = (seq, slot)
        self.counts[slot] = 0
        self.in_prompt[slot] = False
        self.in_prompt[slot, _ids(seq.prompt_token_ids, self.device)] = True
        # Tokens generated before the first penalised step (none, unless the request was
        # scheduled without one): those the host knows; a pending one is added by record().
        known = [t for t in seq.output_token_ids if t != PENDING_TOKEN]
        if known:
            self.counts[slot].index_put_(
                (_ids(known, self.device),),
                torch.ones(len(known), dtype=torch.int32, device=self.device),
                accumulate=True,
            )
        return slot

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(8, 2 * old)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
        in_prompt = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        counts[:old] = self.counts
        in_prompt[:old] = self.in_prompt
        self.counts, self.in_prompt = counts, in_prompt
        self.free += range(new - 1, old - 1, -1)

    def record(self, seqs: list[Sequence], tokens: torch.Tensor) -> None:
        """Count the tokens just sampled (tokens [S] on the device, one per sequence) for the
        sequences that hold a slot; nothing waits for the device."""
        if not self.slot_of:
            return
        pairs = [
            (i, held[1])
            for i, seq in enumerate(seqs)
            if (held := self.slot_of.get(seq.request_id)) is not None and held[0] is seq
        ]
        if not pairs:
            return
        rows, slots = zip(*pairs)
        device = tokens.device
        index = (_ids(slots, device), tokens.index_select(0, _ids(rows, device)))
        self.counts.index_put_(
            index, torch.ones(len(rows), dtype=torch.int32, device=device), accumulate=True
        )

    def release_finished(self, alive: dict[str, Sequence]) -> None:
        """Free the slots of sequences no longer in `alive` (the engine's, by request id)."""
        gone = [rid for rid, (seq, _) in self.slot_of.items() if alive.get(rid) is not seq]
        for request_id in gone:
            self.free.append(self.slot_of.pop(request_id)[1])


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word's token ids as it starts the text and, where that tokenizes differently
    into as many tokens, after a space (mid-text), as vLLM finds them."""
    found = []
    for word in words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        found.append(alone)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            found.append(spaced)
    return [ids for ids in found if ids]


def banned_by_bad_words(bad_words_ids: list[list[int]], output: list[int], pending: int | None) -> list[int]:
    """The tokens the next step may not draw: a bad word's last token, where the output ends
    with the rest of it (a one-token word: always)."""
    tail = output[-max(len(ids) for ids in bad_words_ids) :]
    if pending is not None:
        tail = [*tail[:-1], pending]  # the last token is still on the device
    banned = []
    for ids in bad_words_ids:
        prefix = ids[:-1]
        if not prefix or (len(tail) >= len(prefix) and tail[len(tail) - len(prefix) :] == prefix):
            banned.append(ids[-1])
    return banned


def _ids(values, device: torch.device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64).to(device, non_blocking=True)
