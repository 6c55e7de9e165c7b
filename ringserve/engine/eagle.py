"""Speculative decoding with an EAGLE-3 head (--speculative-config '{"method": "eagle3",
"model": FOLDER, "num_speculative_tokens": k}', vLLM's): one decoder layer that guesses from
the target's own hidden states (model/eagle3.py), so it costs a fraction of a draft model's
step and guesses better.

The target's rank 0 keeps, for every token computed, the head's mix of three of its layers'
hidden states, in a cache by token slot (HiddenCapture; the same block ids as the KV cache,
so prefix-cache hits bring theirs along; under context parallelism every rank's tokens,
gathered each step). The head runs in the engine's process on
rank 0's device, with a one-layer KV cache of its own in those block ids. Each step, after
the scheduler has fitted the drafts:
  pass 1: for each drafted sequence, the positions i the head has not read yet, up to its
          last computed one: the token at i + 1 with the target's mix at i -> its first draft
          (the guess for the token after its last). The same pass reads the positions the
          target computed in the previous step of sequences still prefilling, so the head
          follows a prompt chunk by chunk.
  pass j (2 .. k): the previous pass's guess with the head's own output hidden state, one
          position further -> the j-th guess (tokens and hidden states stay on the device).
One host sync then reads the guesses. The head's KV at positions past the last computed one
came from its own hidden states; the next pass 1 writes those positions again from the
target's, once the verify step has computed them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ringserve.config import EngineConfig, ModelConfig
from ringserve.config.speculative import SpeculativeConfig
from ringserve.engine.draft_model import PagedDrafter, full_attention_group
from ringserve.engine.sequence import PENDING_TOKEN, Sequence
from ringserve.errors import ModelLoadError
from ringserve.model.eagle3 import Eagle3Checkpoint, Eagle3Head
from ringserve.model.weights import checkpoint_files, default_dtype
from ringserve.parallel.allreduce import AllReduce
from ringserve.parallel.ep import LocalExperts
from ringserve.worker.graphs import MAX_GRAPH_BATCH, DecodeGraphs
from ringserve.worker.kv_cache import KVCache
from ringserve.worker.kv_groups import KVGroups
from ringserve.worker.runner import ModelRunner
from ringserve.worker.step_input import StepInput

logger = logging.getLogger(__name__)


@dataclass
class Eagle3Draft:
    """An EAGLE-3 head checked against the target, before either is loaded."""

    checkpoint: Eagle3Checkpoint
    table_group: int

    @classmethod
    def check(cls, spec: SpeculativeConfig, target: ModelConfig, target_groups: KVGroups) -> Eagle3Draft:
        return cls(Eagle3Checkpoint.read(spec.model, target), full_attention_group(target_groups))

    @property
    def capture(self) -> tuple[str, tuple[int, ...], int]:
        """What the target's rank 0 needs to keep the head's input (Worker's eagle3_capture)."""
        return self.checkpoint.path, self.checkpoint.aux_layers, self.table_group

    def memory(self, engine_config: EngineConfig, dtype: torch.dtype, tp: int) -> tuple[int, int]:
        """(bytes per block of its KV cache and of the hidden-state cache, its weights' bytes:
        under tensor parallelism with the whole embedding it reads when it has none)."""
        c = self.checkpoint.config
        bs = engine_config.block_size
        kv = KVCache.bytes_per_block(KVGroups.for_model(c), bs, c.num_key_value_heads, c.head_dim, dtype)
        weights = self.checkpoint.weight_bytes()
        if tp > 1 and not self.checkpoint.has_embedding():
            weights += c.vocab_size * c.hidden_size * torch.empty((), dtype=dtype).element_size()
        return kv + bs * self.checkpoint.bytes_per_token(dtype), weights


def _read_target_embedding(folder: str) -> torch.Tensor:
    from safetensors import safe_open

    for path in checkpoint_files(folder):
        with safe_open(path, "pt") as f:
            if "model.embed_tokens.weight" in f.keys():
                return f.get_tensor("model.embed_tokens.weight")
    raise ModelLoadError(f"EAGLE-3 head: no embed_tokens.weight in it or in the model's files ({folder})")


class Eagle3Drafter(PagedDrafter):
    def __init__(
        self,
        config: SpeculativeConfig,
        head: Eagle3Head,
        runner: ModelRunner,
        capture,
        table_group,
        max_pass_tokens,
        replica_blocks,
        replica_rows,
    ):
        super().__init__(config, runner, table_group, max_pass_tokens, replica_blocks, replica_rows)
        self.head = head
        self.capture = capture  # the target's HiddenCapture: its cache holds the head's input

    @classmethod
    def start(
        cls,
        config: SpeculativeConfig,
        draft: Eagle3Draft,
        target_model,
        target_path: str,
        device: torch.device,
        dtype: torch.dtype,
        engine_config: EngineConfig,
        max_model_len: int,
        num_blocks: int,
        replicas: int = 1,
    ) -> Eagle3Drafter:
        """target_model: rank 0's Transformer, with its HiddenCapture (and, on one rank, the
        embedding the head shares when its checkpoint has none; under tensor parallelism
        it is read from the target's folder, target_path). num_blocks: a replica's pool
        (every CP rank's blocks); replicas: data-parallel replicas, whose blocks and rows
        the head's cache and runner all hold."""
        checkpoint = draft.checkpoint
        with torch.device("meta"), default_dtype(dtype):
            head = Eagle3Head(checkpoint)
        head = head.to_empty(device=device)
        for rotary in head.model.rotary_emb.values():  # computed, not loaded: again after to_empty
            rotary.reset_buffers()
        embedding = target_model.model.embed_tokens
        if embedding.whole:  # shared with the target on one rank
            embedding = embedding.weight
        else:  # rank 0 holds a vocabulary shard: the whole table from the target's files
            embedding = _read_target_embedding(target_path).to(device=device, dtype=dtype)
        head.load(checkpoint.tensors(), embedding)
        c = checkpoint.config
        kv_cache = KVCache(
            KVGroups.for_model(c),
            num_blocks * replicas,
            engine_config.block_size,
            c.num_key_value_heads,
            c.head_dim,
            dtype,
            device,
        )
        all_reduce = AllReduce(None, "auto", device)
        runner = ModelRunner(
            head,
            kv_cache,
            device,
            all_reduce,
            LocalExperts(all_reduce),
            engine_config.max_num_seqs * replicas,
            max_model_len,
        )
        # The head's input and output hidden states: buffers its graphs read and write in place.
        rows = min(engine_config.max_num_seqs * replicas, MAX_GRAPH_BATCH)
        head.hidden_in = torch.zeros(rows, c.hidden_size, dtype=dtype, device=device)
        head.hidden_out = torch.zeros_like(head.hidden_in)
        if device.type == "cuda" and not engine_config.enforce_eager:
            try:
                runner.graphs = DecodeGraphs(runner, rows)
            except RuntimeError as e:
                logger.warning("the EAGLE-3 head runs eagerly: capturing CUDA graphs failed (%s)", e)
        if device.type == "cuda":  # the paged kernel's prefill tiles for its pass 1, before traffic
            buffers = head.hidden_in, head.hidden_out
            head.hidden_in = head.hidden_out = torch.zeros(4096, c.hidden_size, dtype=dtype, device=device)
            runner.warm_up_cached_prefill()
            head.hidden_in, head.hidden_out = buffers
        logger.info(
            "speculative decoding: EAGLE-3 head %s (hidden states of layers %s, %d draft ids), up to %d drafts a step",
            checkpoint.path,
            list(checkpoint.aux_layers),
            checkpoint.draft_vocab_size,
            config.num_speculative_tokens,
        )
        return cls(
            config,
            head,
            runner,
            target_model.hidden_capture,
            draft.table_group,
            engine_config.prefill_budget(),
            num_blocks,
            engine_config.max_num_seqs,
        )

    @torch.inference_mode()
    def fill(self, batch) -> None:
        wanted = []  # (index in the batch, sequence, computed): pass 1 reads positions seen .. computed - 1
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            if seq.draft_token_ids or (
                n > 1 and self.may_draft(seq) and self._state_of(seq).seen < seq.num_computed_tokens
            ):
                wanted.append((i, seq, seq.num_computed_tokens))
        ran = self._pass_one(batch, wanted)
        if not ran:
            return
        seqs = [seq for _, seq, _ in ran]
        states = [self._state_of(seq) for seq in seqs]
        updates = self._table_updates(seqs, states)
        # The token after each position, and the target's mix at each position (by slot).
        new = [seq.token_slice(s.seen + 1, end + 1) for (_, seq, end), s in zip(ran, states)]
        slots = torch.tensor(
            [slot for (_, seq, end), s in zip(ran, states) for slot in self._slots(seq, s.seen, end)],
            dtype=torch.int64,
        )
        drafting = [bool(seq.draft_token_ids) for seq in seqs]
        step = StepInput([self._row(seq) for seq in seqs], new, [s.seen for s in states], drafting, updates)
        for (_, _, end), state in zip(ran, states):
            state.seen = end
        cache = self.capture.cache
        hidden = cache.index_select(0, slots.to(cache.device, non_blocking=True))
        if all(drafting) and all(len(t) <= 1 + self.config.num_speculative_tokens for t in new):
            # A few tokens each: the earlier ones as "drafts", so the step has the verify shape
            # that replays the head's decode graphs (their logits rows come back too, unread).
            step.drafts = [(j, len(t) - 1) for j, t in enumerate(new) if len(t) > 1]
        logits, prenorm = self._forward(step, hidden)
        if not any(drafting):  # prompt positions only: the head's cache follows, nothing to read
            return
        drafted = [(i, seq) for (i, seq, _), d in zip(ran, drafting) if d]
        counts = [len(seq.draft_token_ids) for _, seq in drafted]
        passes, who = [self.head.target_ids(logits)], [list(range(len(drafted)))]  # [B] on the device
        for j in range(1, max(counts)):
            # Pass j + 1: the sequences that want more than j drafts feed their j-th guess.
            active = [b for b in who[-1] if counts[b] > j]
            row_of = {b: r for r, b in enumerate(who[-1])}
            prev = [row_of[b] for b in active]
            step = StepInput(
                [self._row(drafted[b][1]) for b in active],
                [[PENDING_TOKEN]] * len(active),
                [drafted[b][1].num_computed_tokens + j - 1 for b in active],
                [True] * len(active),
                [],
                pending=[(m, r) for m, r in enumerate(prev)],
            )
            index = torch.tensor(prev, dtype=torch.int64).to(prenorm.device, non_blocking=True)
            logits, prenorm = self._forward(step, prenorm.index_select(0, index), passes[-1])
            passes.append(self.head.target_ids(logits))
            who.append(active)
        drafts = self._read_guesses(passes, who, len(drafted))
        for (i, seq), guesses in zip(drafted, drafts):
            self._set_drafts(batch, i, seq, guesses)

    def _forward(self, step: StepInput, hidden: torch.Tensor, pending_tokens=None):
        """The head over a step (hidden [T, H]: each new token's input hidden state, in packed
        order) -> (logits [S, draft vocabulary], next input hidden states [S, H]) of its S
        sampling rows. Through the head's graphs where the step has their shape."""
        head, t = self.head, hidden.shape[0]
        buffers = head.hidden_in, head.hidden_out
        if t > buffers[0].shape[0]:  # a long pass (eager): buffers of its own size for once
            head.hidden_in, head.hidden_out = hidden, torch.empty_like(hidden)
        else:
            head.hidden_in[:t].copy_(hidden)
        try:
            logits = self.runner.forward(step, pending_tokens=pending_tokens)
            sampling = sum(step.sample)
            rows = step.logit_rows()[:sampling]  # packed rows of the sampling tokens
            index = torch.tensor(rows, dtype=torch.int64).to(hidden.device, non_blocking=True)
            return logits[:sampling], head.hidden_out.index_select(0, index)
        finally:
            head.hidden_in, head.hidden_out = buffers

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """The hidden-state cache slots of seq's positions start .. end - 1 (its replica's
        blocks after the other replicas', as in HiddenCapture); host ints, one tensor a step."""
        bs = self.runner.kv_cache.block_size
        table, offset = seq.block_tables[self.table_group], seq.replica * self.replica_blocks
        return [(table[p // bs] + offset) * bs + p % bs for p in range(start, end)]
