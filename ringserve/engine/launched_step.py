"""A step launched on the device whose sampled tokens the host reads later (async scheduling
reads them one step on, while the next step runs)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from ringserve.engine.logprobs import DeviceLogprobs
from ringserve.engine.scheduler import ScheduledBatch
from ringserve.engine.sequence import Sequence
from ringserve.outputs import TokenLogprob


@dataclass
class LaunchedStep:
    """A step on its way through the device: its tokens are sampled there and read later."""

    batch: ScheduledBatch
    sampling: list[Sequence]  # the sequences that sample, in the order of their rows of `tokens`
    tokens: torch.Tensor  # [rows] int64 on the device: a row per sequence, d + 1 with d drafts
    # (rows of `tokens` whose request asked for logprobs, their logprobs on the device)
    logprobs: tuple[list[int], DeviceLogprobs] | None
    no_token: list[Sequence]  # max_tokens=0: end after this step's prefill without a token
    failed: list[tuple[Sequence, Exception]]  # sequences whose sampling failed: they end alone
    # each sampling sequence's drafts checked by this step (speculative.py); None: none
    drafts: list[list[int]] | None = None
    row_of: dict[str, int] = field(init=False)  # request id -> its (last) row of `tokens`
    _host: torch.Tensor = field(init=False)  # [rows] int64, the tokens' copy on the host
    _ready: torch.cuda.Event | None = field(init=False)

    def __post_init__(self):
        if self.drafts is None:
            self.row_of = {seq.request_id: i for i, seq in enumerate(self.sampling)}
        else:
            ends = itertools.accumulate(len(d) + 1 for d in self.drafts)
            self.row_of = {seq.request_id: end - 1 for seq, end in zip(self.sampling, ends)}
        if self.tokens.is_cuda:  # start the copy now; read_tokens waits for it alone
            self._host = torch.empty(self.tokens.shape, dtype=self.tokens.dtype, pin_memory=True)
            self._host.copy_(self.tokens, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = self.tokens, None

    def read_tokens(self) -> list[int]:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()

    def read_logprobs(self) -> list[TokenLogprob | None] | None:
        """Per row of `tokens`, the logprobs its request asked for (None: none asked)."""
        if self.logprobs is None:
            return None
        rows, device_logprobs = self.logprobs
        result: list[TokenLogprob | None] = [None] * self.tokens.shape[0]
        for row, lp in zip(rows, device_logprobs.read()):
            result[row] = lp
        return result
