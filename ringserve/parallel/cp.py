"""Context parallelism: exact ring attention over a sequence-sharded, persistent KV cache.

Every CP rank holds the whole model (or its TP shard) and the KV of the logical blocks
placed on it (block_manager.place_blocks: load-balanced 2N chunks for a prefill, round
robin for decode). In a step, rank k computes the new tokens whose blocks it holds, writes
their KV into its cache, and attends them to every visible key of their sequences, wherever
it lies, by one of two rings:

- pass-KV: the KV a rank holds for the batch's sequences travels the ring; each rank
  attends its queries to the block it holds while it sends that block on and receives the
  next (isend/irecv, double-buffered); partials are merged locally by log-sum-exp.
- pass-Q: queries (with positions and sequences) travel; each rank attends them to its own
  KV; the partial outputs and LSEs go home in one all-to-all and are merged there.

All ranks derive the same layout from the StepInput (every rank's queries and keys per
sequence, with global positions), so no sizes are exchanged, and every message of a ring
is padded to the largest rank's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringserve.attention import VarlenBatch, attention_rows
from ringserve.lse_merge import merge_partials
from ringserve.measurements import load_measurement

logger = logging.getLogger(__name__)

CP_ALGOS = ("auto", "pass_kv", "pass_q")


@dataclass
class RankShare:
    """What one CP rank holds of a step: its new tokens (queries) and its keys, per sequence."""

    q_positions: list[torch.Tensor]  # per sequence: global positions of this rank's new tokens
    k_positions: list[torch.Tensor]  # per sequence: positions of the keys (cached + new) it holds
    k_slots: list[torch.Tensor]  # per sequence: local cache slots of those keys

    def varlen(self, keys: RankShare, device) -> VarlenBatch:
        """The attention metadata of this rank's queries against `keys`' KV."""
        q_lens = [len(p) for p in self.q_positions]
        k_lens = [len(p) for p in keys.k_positions]
        cu_q = [0]
        cu_k = [0]
        for a, b in zip(q_lens, k_lens):
            cu_q.append(cu_q[-1] + a)
            cu_k.append(cu_k[-1] + b)
        q_positions, k_positions = torch.cat(self.q_positions), torch.cat(keys.k_positions)

        def to_device(t):
            return t.to(device, non_blocking=True)

        return VarlenBatch(
            cu_seqlens_q=to_device(torch.tensor(cu_q, dtype=torch.int32)),
            cu_seqlens_k=to_device(torch.tensor(cu_k, dtype=torch.int32)),
            max_seqlen_q=max(q_lens, default=0),
            max_seqlen_k=max(k_lens, default=0),
            q_positions=to_device(q_positions),
            k_positions=to_device(k_positions),
            causal_suffix=False,
            q_bounds=cu_q,
            k_bounds=cu_k,
            q_positions_host=q_positions,
            k_positions_host=k_positions,
        )

    @property
    def num_queries(self) -> int:
        return sum(len(p) for p in self.q_positions)

    @property
    def num_keys(self) -> int:
        return sum(len(p) for p in self.k_positions)


def split_step(token_counts, starts, block_tables, block_size: int, blocks_per_rank: int, cp_size: int):
    """Every rank's share of a step, from the block tables (block b lives on rank b // blocks_per_rank).

    Returns (shares per rank, owner per new token in packed order).
    """
    shares = [RankShare([], [], []) for _ in range(cp_size)]
    owners = []
    for count, start, table in zip(token_counts, starts, block_tables):
        end = start + count
        positions = torch.arange(end)
        blocks = torch.tensor(table, dtype=torch.int64)[positions // block_size]
        rank_of = blocks // blocks_per_rank
        slots = (blocks % blocks_per_rank) * block_size + positions % block_size
        new_owner = rank_of[start:]
        owners.append(new_owner)
        for r, share in enumerate(shares):
            mine = rank_of == r
            share.k_positions.append(positions[mine])
            share.k_slots.append(slots[mine])
            share.q_positions.append(positions[start:][new_owner == r])
    return shares, torch.cat(owners) if owners else torch.empty(0, dtype=torch.int64)


class RingAttention:
    """Attention of this rank's new tokens over all ranks' KV, by pass-KV or pass-Q."""

    # Partial outputs pass-KV keeps before folding them into a running result: merging all
    # at the end is fastest for short prompts (one launch), but a rank's partials of a 1M-token
    # prompt over CP8 are 1 GiB each.
    max_partial_bytes = 512 << 20

    def __init__(self, group, shares: list[RankShare], algo: str, scale: float, device):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next_peer = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev_peer = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self.shares = shares
        self.algo = algo
        self.scale = scale
        self.device = device
        # (query rank, key rank) -> attention metadata, built once per step for all layers.
        self._batches = {}

    def _batch(self, q_rank: int, k_rank: int) -> VarlenBatch:
        key = (q_rank, k_rank)
        if key not in self._batches:
            self._batches[key] = self.shares[q_rank].varlen(self.shares[k_rank], self.device)
        return self._batches[key]

    def _exchange(self, send: torch.Tensor, recv: torch.Tensor):
        """Start sending `send` to the next rank and receiving into `recv` from the previous."""
        return [
            dist.isend(send, self.next_peer, group=self.group),
            dist.irecv(recv, self.prev_peer, group=self.group),
        ]

    def __call__(self, q, k_local, v_local):
        """q [Tq, NH, D]: this rank's new tokens; k/v_local [Tk, NKV, D]: all keys it holds."""
        if self.algo == "pass_kv":
            return self._pass_kv(q, k_local, v_local)
        return self._pass_q(q, k_local, v_local)

    def _pass_kv(self, q, k_local, v_local):
        longest = max(s.num_keys for s in self.shares)
        current = k_local.new_zeros(longest, 2, *k_local.shape[1:])  # K and V travel together
        current[: k_local.shape[0], 0] = k_local
        current[: k_local.shape[0], 1] = v_local
        incoming = torch.empty_like(current)
        outs, lses, first_rows = [], [], []
        rows = q.shape[0]
        for step in range(self.size):
            src = (self.rank - step) % self.size  # the rank this KV block started on
            pending = self._exchange(current, incoming) if step + 1 < self.size else []
            n = self.shares[src].num_keys
            out, lse, first = attention_rows(
                q, current[:n, 0], current[:n, 1], self._batch(self.rank, src), self.scale
            )
            outs.append(out)
            lses.append(lse)
            first_rows.append(first)
            if len(outs) > 1 and sum(o.nbytes for o in outs) > self.max_partial_bytes:
                # Long prompts: fold the partials into one float32 running result, so a rank
                # holds about two instead of N (a merge costs little next to such steps).
                merged = merge_partials(outs, lses, first_rows, rows, out_dtype=torch.float32)
                outs, lses, first_rows = [merged[0]], [merged[1]], [0]
            for request in pending:
                request.wait()
            current, incoming = incoming, current
        return merge_partials(outs, lses, first_rows, rows, out_dtype=q.dtype)[0]

    def _pass_q(self, q, k_local, v_local):
        longest = max(s.num_queries for s in self.shares)
        current = q.new_zeros(longest, *q.shape[1:])
        current[: q.shape[0]] = q
        incoming = torch.empty_like(current)
        outs = q.new_zeros(self.size, longest, *q.shape[1:])  # partials for each origin rank
        lses = torch.full((self.size, longest, q.shape[1]), float("-inf"), device=q.device)
        for step in range(self.size):
            src = (self.rank - step) % self.size  # whose queries these are
            pending = self._exchange(current, incoming) if step + 1 < self.size else []
            n = self.shares[src].num_queries
            out, lse, first = attention_rows(
                current[:n], k_local, v_local, self._batch(src, self.rank), self.scale
            )
            outs[src, first : first + out.shape[0]] = out  # other rows stay 0 / -inf: unseen
            lses[src, first : first + out.shape[0]] = lse
            for request in pending:
                request.wait()
            current, incoming = incoming, current
        # Send every origin its partials; receive ours from every rank.
        home_outs, home_lses = torch.empty_like(outs), torch.empty_like(lses)
        dist.all_to_all_single(home_outs, outs, group=self.group)
        dist.all_to_all_single(home_lses, lses, group=self.group)
        n = q.shape[0]
        return merge_partials([o[:n] for o in home_outs], [lse[:n] for lse in home_lses])[0]


# Choosing the ring (DESIGN.md 2.5) --------------------------------------------------------


@dataclass
class CPCalibration:
    attention_flops: float = 600e12  # achieved attention FLOP/s on one rank (C)
    link_bytes_per_s: float = 50e9  # CP link bandwidth (BW)

    @classmethod
    def load(cls, device_type: str) -> CPCalibration:
        """Measured by `ringserve bench cp-calibrate`, else defaults for the device type."""
        measured = load_measurement("cp_calibration", device_type)
        if measured:
            return cls(**measured)
        if device_type == "cpu":
            return cls(attention_flops=20e9, link_bytes_per_s=2e9)
        return cls()


def choose_cp_algo(
    new_tokens: int,
    cached_tokens: int,
    cp_size: int,
    num_heads: int,
    num_kv_heads: int,
    element_bytes: int,
    calibration: CPCalibration,
) -> str:
    """pass_kv or pass_q for a step with T new and P cached tokens (DESIGN.md 2.5).

    pass-KV if its transfer hides under the attention compute (T >= N*C*NKV*e / (2*NH*BW)),
    or if the new tokens are a large enough share of the context once pass-Q's all-to-all
    is counted (T/(T+P) >= 2*NKV/NH - 4*T*BW / (N*C*e)); pass-Q otherwise.
    """
    t, p, n = new_tokens, cached_tokens, cp_size
    c, bw, e = calibration.attention_flops, calibration.link_bytes_per_s, element_bytes
    if t >= n * c * num_kv_heads * e / (2 * num_heads * bw):
        return "pass_kv"
    if t / (t + p) >= 2 * num_kv_heads / num_heads - 4 * t * bw / (n * c * e):
        return "pass_kv"
    return "pass_q"
