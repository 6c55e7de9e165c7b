"""CUDA graphs of the decode step: one per batch-size bucket, replayed instead of launching
every kernel from Python.

A decode step of B sequences runs as the smallest bucket >= B; its inputs (token, position,
row, length per sequence) are copied into static buffers, padded with rows that use the
block tables' pad row: they write only the KV cache's scratch block and see no key, so real
rows are unchanged. Graphs are captured at start-up, largest bucket first, in one memory
pool; steps above the largest bucket, prefill and mixed steps run eagerly. A bucket whose
split-KV has more than one split also has a graph for short contexts, where every split is
one loop step of the paged kernel (PagedBatch.one_block): its cached keys are read while
the kernel before it runs (about -0.05 ms a step at batch 1 in bench_decode_chain,
BENCHMARKS.md).

A speculative-decoding verify step (StepInput.is_verify) replays the same graphs: each of a
sequence's new tokens (its last one and its drafts) is a decode row of its own, with the
sequence's block-table row, its own position, and the keys up to it, so the rows of one
sequence see each other causally (all of their K/V are written before attention reads).

Without capture (CPU, or to test the padding) `run` calls the same padded forward eagerly.
"""

from __future__ import annotations

import logging
import time

import torch

from ringserve.attention.paged import fits_one_block
from ringserve.worker.step_state import fill_pending_tokens

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 256  # larger decode batches run eagerly (their launch cost is amortised)


def decode_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16 up to max_batch (which is always a bucket)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, capture: bool = True):
        self.runner = runner
        self.buckets = decode_buckets(max_batch)
        largest = self.buckets[-1]
        dev = runner.device
        # Rows: token ids, positions, block-table rows, sequence lengths; [4, largest] int64.
        self.inputs = torch.zeros(4, largest, dtype=torch.int64, device=dev)
        # [largest, V] float32, written by every bucket's graph (the LM head's own output)
        self.logits = torch.empty(largest, runner.model.logits_width, dtype=torch.float32, device=dev)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # by (bucket, one_block)
        # Split-KV is fixed per bucket (a graph's launch grid cannot change): sized for the
        # longest context, a short one leaves most splits empty, which costs little.
        self.splits = {b: runner.decode_splits(b, runner.max_model_len) for b in self.buckets}
        if capture:
            self._capture_all()

    def fits(self, step) -> bool:
        return len(step.rows) + sum(d for _, d in step.drafts) <= self.buckets[-1]

    def graph_key(self, batch: int, longest: int) -> tuple[int, bool]:
        """(bucket, one_block) that runs a decode step of `batch` sequences, the longest of
        them `longest` keys long after it."""
        b = next(size for size in self.buckets if size >= batch)
        return b, self.splits[b] > 1 and fits_one_block(longest, self.splits[b])

    def _forward(self, b: int, one_block: bool) -> torch.Tensor:
        return self.runner.decode_logits(self.inputs[:, :b], self.splits[b], one_block, out=self.logits[:b])

    def _capture_all(self) -> None:
        begin = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        self._fill_padding(self.buckets[-1], 0)
        with torch.inference_mode():
            for b in reversed(self.buckets):
                for one_block in (False, True) if self.splits[b] > 1 else (False,):
                    self._forward(b, one_block)  # warm-up: kernels compiled, workspaces made outside
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self._forward(b, one_block)
                    self.graphs[b, one_block] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured %d decode CUDA graphs (batch %s; short contexts apart where split) in %.1f s",
            len(self.graphs),
            ", ".join(map(str, self.buckets)),
            time.monotonic() - begin,
        )

    def _fill_padding(self, b: int, first: int) -> None:
        self.inputs[:, first:b] = 0
        self.inputs[2, first:b] = self.runner.block_tables.pad_row

    def run(self, step, pending_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [new tokens, V] of a decode or verify step (block tables already updated);
        pending_tokens: the previous step's sampled ids, for the rows step.pending names."""
        if step.drafts:  # a verify step: a decode row per new token
            token_ids = [token for tokens in step.token_ids for token in tokens]
            positions = [
                start + j for start, tokens in zip(step.starts, step.token_ids) for j in range(len(tokens))
            ]
            rows = [row for row, tokens in zip(step.rows, step.token_ids) for _ in tokens]
        else:
            token_ids, positions, rows = [tokens[0] for tokens in step.token_ids], step.starts, step.rows
        n = len(positions)
        b, one_block = self.graph_key(n, max(positions) + 1)
        # One upload: the four input rows, then the (index, sampled row) pairs of step.pending.
        host = torch.tensor(
            token_ids
            + positions
            + rows
            + [position + 1 for position in positions]
            + [i for pair in step.pending for i in pair],
            dtype=torch.int64,
        )
        self.runner.host_elements += host.numel()
        if step.pending:
            dev = host.to(self.inputs.device, non_blocking=True)
            self.inputs[:, :n].copy_(dev[: 4 * n].view(4, n))
            fill_pending_tokens(self.inputs[0], dev[4 * n :].view(-1, 2), pending_tokens)
        else:  # straight into the static inputs (synchronous steps: no copy on the device)
            self.inputs[:, :n].copy_(host.view(4, n), non_blocking=True)
        if b > n:
            self._fill_padding(b, n)
        if (b, one_block) in self.graphs:
            self.graphs[b, one_block].replay()
            return self.logits[:n]
        with torch.inference_mode():
            return self._forward(b, one_block)[:n]
