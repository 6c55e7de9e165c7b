"""Speculative decoding with a draft model (--speculative-config '{"method": "draft_model",
"model": FOLDER, "num_speculative_tokens": k}', vLLM's): a smaller model with the same
tokenizer guesses the next k tokens greedily, and the target checks them in one verify step
(engine/speculative.py), so the output is the target's whatever the draft.

Where it runs: in the engine's process, on rank 0's device, whatever the tensor or context
parallelism (vLLM's draft_tensor_parallel_size=1): a one-rank Worker of its own (its weights,
KV cache and, on a GPU, decode graphs; under CP its cache has every rank's block ids). Its cache has as many blocks as the target's, and a
sequence's draft KV lies in the same block ids as its target KV (the target's full-attention
block table): the scheduler's blocks for a sequence and its drafts hold the draft's KV too,
and a freed block is free for both. The KV budget leaves room for both (Worker's draft_memory).

Each step, after the scheduler has fitted every sequence's drafts (Drafter.num_drafts, cut
to the budget and the blocks), `fill` runs the draft over the drafted sequences:
  pass 1: the tokens of each that the draft has not seen -> its first draft: its last token
          (after a run that kept all k drafts, the k-th draft as well). The same pass runs
          the step's prompt chunks of sequences that may draft later, so the draft's cache
          follows a prefill chunk by chunk and a first draft needs no long catch-up;
  pass j (2 .. k): the previous pass's drafts, one token a sequence, fed on the device
          (no host round trip; the draft's decode graphs replay) -> the j-th drafts.
One host sync then reads them all. A draft is the draft model's greedy choice, a function of
the context, i.e. a point mass, for which the verify rule is the exact rejection rule.

The draft KV of a position stays valid when the verify keeps the token there: after a run
that kept j of k drafts, the draft has seen the tokens through the min(j, k - 1)-th draft,
and the next pass 1 starts there. Preemption starts a sequence's draft over (its blocks were
freed), as does its first draft after admission.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from dataclasses import dataclass

import torch

from ringserve.config import EngineConfig, ModelConfig
from ringserve.config.speculative import SpeculativeConfig
from ringserve.engine.loading import load_tokenizer, resolve_model_path
from ringserve.engine.sequence import PENDING_TOKEN, Sequence
from ringserve.engine.speculative import Drafter
from ringserve.errors import ModelLoadError
from ringserve.model.weights import checkpoint_files
from ringserve.parallel.mesh import ParallelGroups
from ringserve.worker.kv_cache import KVCache
from ringserve.worker.kv_groups import KVGroups
from ringserve.worker.step_input import StepInput

logger = logging.getLogger(__name__)


def full_attention_group(target_groups: KVGroups) -> int:
    """The target's KV group whose block table a draft's cache follows: a full-attention
    one (a windowed group's blocks are released behind its window)."""
    full = [i for i, group in enumerate(target_groups.groups) if group.lookback is None]
    if not full:
        raise ModelLoadError(
            "a draft model or head needs a target with full-attention layers: a sequence's draft "
            "KV follows their block table (every layer of this model is windowed)"
        )
    return full[0]


@dataclass
class DraftModel:
    """A draft model checked against the target, before either is loaded."""

    path: str  # its Hugging Face folder
    config: ModelConfig
    table_group: int  # the target's KV group whose block table the draft's KV follows
    vocab_size: int  # the ids both models score (drafts are taken among them)

    @classmethod
    def check(
        cls,
        spec: SpeculativeConfig,
        target: ModelConfig,
        target_groups: KVGroups,
        tokenizer,
        show_progress=False,
    ) -> DraftModel:
        """Refuse a draft that cannot draft for this target, with the reason."""
        path = resolve_model_path(spec.model, show_progress)
        config = ModelConfig.from_pretrained(path)
        table_group = full_attention_group(target_groups)
        if len(KVGroups.for_model(config).groups) > 1:
            raise ModelLoadError(
                f"draft model {spec.model}: one kind of attention layer is supported, not a hybrid"
            )
        draft_tokenizer = load_tokenizer(path)
        if (
            tokenizer is not None
            and draft_tokenizer is not None
            and draft_tokenizer.get_vocab() != tokenizer.get_vocab()
        ):
            raise ModelLoadError(
                f"draft model {spec.model} has another tokenizer than the model: its drafts would "
                "be other tokens (a draft model must share the target's vocabulary)"
            )
        return cls(path, config, table_group, min(config.vocab_size, target.vocab_size))

    def memory(self, engine_config: EngineConfig, dtype: torch.dtype, tp: int) -> tuple[int, int]:
        """(its KV bytes per block, its weights' bytes at most): Worker's draft_memory. tp: the
        model's (the draft holds its whole weights on the first GPU whatever it is)."""
        c = self.config
        per_block = KVCache.bytes_per_block(
            KVGroups.for_model(c), engine_config.block_size, c.num_key_value_heads, c.head_dim, dtype
        )
        return per_block, weight_bytes(self.path)


def weight_bytes(folder: str) -> int:
    """The bytes of a model folder's weight files (what its loader reads): what its weights
    take at most in memory."""
    return sum(os.path.getsize(f) for f in checkpoint_files(folder))


@dataclass
class _DraftState:
    """What the draft's cache holds of one sequence."""

    admission: int  # the sequence's admission this belongs to (Sequence.num_admissions)
    synced: int = 0  # leading blocks of its table in the draft runner's row
    seen: int = 0  # its leading tokens whose draft KV is in the draft's cache
    # the last fill: its tokens then, and how many the draft saw if every draft is kept
    base: int = 0
    seen_if_kept: int = 0


class PagedDrafter(Drafter):
    """A drafter with a KV cache of its own in the target's block ids (a draft model, an
    EAGLE head): what its cache holds of each sequence, and its runner's block tables.

    Under data parallelism every replica has its own block ids and runner rows; the
    drafter's cache and rows hold all of them: replica r's block b is the drafter's block
    r * replica_blocks + b, its row i the drafter's row r * replica_rows + i."""

    def __init__(
        self,
        config: SpeculativeConfig,
        runner,
        table_group: int,
        max_pass_tokens: int,
        replica_blocks: int = 0,
        replica_rows: int = 0,
    ):
        super().__init__(config)
        self.runner = runner  # the drafter's ModelRunner (its own block tables and cache)
        self.table_group = table_group
        # tokens a pass 1 computes at most: the model's largest step (EngineConfig.prefill_budget)
        self.max_pass_tokens = max_pass_tokens
        self.replica_blocks = replica_blocks
        self.replica_rows = replica_rows
        self._state: weakref.WeakKeyDictionary[Sequence, _DraftState] = weakref.WeakKeyDictionary()

    def _row(self, seq: Sequence) -> int:
        """seq's row of the drafter's runner."""
        return seq.replica * self.replica_rows + seq.row

    def propose(self, seq: Sequence, k: int) -> list[int]:
        return [PENDING_TOKEN] * k  # made by `fill`, once the scheduler has fitted them

    def _state_of(self, seq: Sequence) -> _DraftState:
        state = self._state.get(seq)
        if state is None or state.admission != seq.num_admissions:  # new, or preempted since
            state = self._state[seq] = _DraftState(seq.num_admissions)
        return state

    def _table_updates(self, seqs: list[Sequence], states: list[_DraftState]) -> list:
        """The drafter's block-table rows follow the target's table: the blocks not sent yet."""
        updates = []
        for seq, state in zip(seqs, states):
            table = seq.block_tables[self.table_group]
            if len(table) > state.synced:
                offset = seq.replica * self.replica_blocks
                updates.append((0, self._row(seq), state.synced, [b + offset for b in table[state.synced :]]))
                state.synced = len(table)
        return updates

    @staticmethod
    def _read_guesses(passes: list[torch.Tensor], who: list[list[int]], count: int) -> list[list[int]]:
        """Each drafted sequence's guesses: passes[j] [len(who[j])] on the device holds the
        j-th guess of the sequences who[j] (indices among `count`). The one host sync."""
        flat = torch.cat(passes).tolist()
        guesses: list[list[int]] = [[] for _ in range(count)]
        first = 0
        for active in who:
            for m, b in enumerate(active):
                guesses[b].append(flat[first + m])
            first += len(active)
        return guesses

    def _pass_one(self, batch, wanted: list[tuple[int, Sequence, int]]) -> list[tuple[int, Sequence, int]]:
        """wanted: (index in the batch, sequence, where pass 1 would take it: the end of its
        tokens or positions to read) -> those pass 1 runs, each with the end it reaches
        within max_pass_tokens in all, drafting sequences first. A drafting sequence that
        falls short (a long catch-up: a prefix-cache hit, a stretch without drafting) drafts
        nothing this step, and catches up over the next steps."""
        left, runs = self.max_pass_tokens, []
        for i, seq, end in sorted(wanted, key=lambda w: not w[1].draft_token_ids):
            seen = self._state_of(seq).seen
            reach = min(end, seen + left)
            if reach < end and seq.draft_token_ids:
                self._set_drafts(batch, i, seq, [])
            if reach > seen:
                runs.append((i, seq, reach))
                left -= reach - seen
        return runs

    def _set_drafts(self, batch, i: int, seq: Sequence, drafts: list[int]) -> None:
        """Set seq's drafts (batch index i), cut where its grammar refuses them; the step
        then computes fewer of its tokens."""
        if seq.grammar is not None:  # only what the grammar allows can be kept
            del drafts[seq.grammar.valid_prefix(seq.output_token_ids, drafts) :]
        batch.num_tokens[i] -= len(seq.draft_token_ids) - len(drafts)
        seq.draft_token_ids = drafts


class DraftModelDrafter(PagedDrafter):
    def __init__(
        self,
        config: SpeculativeConfig,
        draft: DraftModel,
        worker,
        max_pass_tokens,
        replica_blocks,
        replica_rows,
    ):
        super().__init__(
            config, worker.runner, draft.table_group, max_pass_tokens, replica_blocks, replica_rows
        )
        self.draft = draft
        self.worker = worker  # the draft's one-rank Worker

    @classmethod
    def start(
        cls,
        config: SpeculativeConfig,
        draft: DraftModel,
        device: torch.device,
        dtype: torch.dtype,
        engine_config: EngineConfig,
        max_model_len: int,
        num_blocks: int,
        replicas: int = 1,
        show_progress: bool = False,
    ) -> DraftModelDrafter:
        """num_blocks: a replica's pool (every CP rank's blocks); replicas: data-parallel
        replicas, whose blocks and rows the draft's cache and runner all hold."""
        from ringserve.worker.worker import Worker

        # Its cache: the target's block count in its own geometry, in its own dtype.
        ec = dataclasses.replace(
            engine_config,
            num_blocks=num_blocks * replicas,
            max_num_seqs=engine_config.max_num_seqs * replicas,
            quantization=None,
            kv_cache_dtype="auto",
        )
        worker = Worker(
            draft.path,
            draft.config,
            dtype,
            ec,
            max_model_len,
            ParallelGroups.single(device),
            show_progress=show_progress,
        )
        logger.info(
            "speculative decoding: draft model %s (%s), up to %d drafts a step",
            draft.path,
            draft.config.architecture,
            config.num_speculative_tokens,
        )
        return cls(
            config, draft, worker, engine_config.prefill_budget(), num_blocks, engine_config.max_num_seqs
        )

    def record(self, seq: Sequence, num_kept: int) -> None:
        super().record(seq, num_kept)
        state = self._state.get(seq)
        if state is not None:
            state.seen = min(state.base + num_kept, state.seen_if_kept)

    @torch.inference_mode()
    def fill(self, batch) -> None:
        # Pass 1 runs the drafted sequences (what they have not shown the draft, their last
        # token included) and those computing a prompt chunk that may draft later (the same
        # chunk: the draft follows a prefill as it goes, so a first draft after a long prompt
        # costs no long catch-up inside a decode step).
        wanted = []  # (index in the batch, sequence, its tokens seen by the draft after pass 1)
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            if seq.draft_token_ids:
                wanted.append((i, seq, seq.num_tokens))
            elif n > 1 and self.may_draft(seq):
                wanted.append((i, seq, seq.num_computed_tokens + n))
        ran = self._pass_one(batch, wanted)
        if not ran:
            return
        states = [self._state_of(seq) for _, seq, _ in ran]
        updates = self._table_updates([seq for _, seq, _ in ran], states)
        new = [seq.token_slice(state.seen, end) for (_, seq, end), state in zip(ran, states)]
        drafting = [bool(seq.draft_token_ids) for _, seq, _ in ran]
        step = StepInput(
            [self._row(seq) for _, seq, _ in ran], new, [s.seen for s in states], drafting, updates
        )
        for (_, _, end), state in zip(ran, states):
            state.seen = end
        if not any(drafting):  # prefill chunks only: the draft's cache follows, nothing to read
            self.runner.forward(step)
            return
        if all(drafting) and all(len(t) <= 1 + self.config.num_speculative_tokens for t in new):
            # A few tokens each: the earlier ones as "drafts", so the step has the verify shape
            # that replays the decode graphs (their logits rows come back too, unread).
            step.drafts = [(j, len(t) - 1) for j, t in enumerate(new) if len(t) > 1]
        drafted = [(i, seq) for (i, seq, _), d in zip(ran, drafting) if d]
        states = [state for state, d in zip(states, drafting) if d]
        rows = [self._row(seq) for _, seq in drafted]
        counts = [len(seq.draft_token_ids) for _, seq in drafted]
        tokens = self._greedy(self.runner.forward(step)[: len(rows)])  # [B] on the device
        passes, who = [tokens], [list(range(len(rows)))]
        for j in range(1, max(counts)):
            # Pass j + 1: the sequences that want more than j drafts feed their j-th.
            active = [b for b in who[-1] if counts[b] > j]
            prev_row = {b: r for r, b in enumerate(who[-1])}
            step = StepInput(
                [rows[b] for b in active],
                [[PENDING_TOKEN]] * len(active),
                [drafted[b][1].num_tokens - 1 + j for b in active],
                [True] * len(active),
                [],
                pending=[(m, prev_row[b]) for m, b in enumerate(active)],
            )
            passes.append(self._greedy(self.runner.forward(step, pending_tokens=passes[-1])))
            who.append(active)
        drafts = self._read_guesses(passes, who, len(drafted))
        for b, ((i, seq), state) in enumerate(zip(drafted, states)):
            state.base = seq.num_tokens
            state.seen_if_kept = seq.num_tokens + counts[b] - 1
            self._set_drafts(batch, i, seq, drafts[b])

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V_draft] -> [B] int64: the likeliest of the ids both models know."""
        return logits[:, : self.draft.vocab_size].argmax(dim=-1)
