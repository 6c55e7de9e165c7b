"""Log-probabilities of chosen tokens and the likeliest alternatives, for sampled and prompt tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringserve.outputs import TokenLogprob


@dataclass
class DeviceLogprobs:
    """Log-probabilities computed on the device, read to the host later (with a step's
    tokens under async scheduling). R = rows, k = the most alternatives any row lists."""

    token_ids: torch.Tensor  # [R] int64: the token scored at each row
    chosen: torch.Tensor  # [R] float32: its log-probability
    ranks: torch.Tensor  # [R] int64: 1 + how many tokens are likelier
    top_values: torch.Tensor  # [R, k] float32, likeliest first
    top_ids: torch.Tensor  # [R, k] int64
    num_top: list[int]  # [R]: how many alternatives each row lists

    @classmethod
    def compute(cls, logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> DeviceLogprobs:
        """logits [R, V] (any float dtype), token_ids [R] int64 on the same device. Values come
        from the model's raw distribution, log_softmax in float32, as vLLM reports them. No
        host sync."""
        lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
        chosen = lp.gather(1, token_ids[:, None])[:, 0]  # [R]
        ranks = (lp > chosen[:, None]).sum(dim=-1) + 1  # [R]
        k = min(max(num_top, default=0), lp.shape[-1])
        top_values, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())  # [R, k]
        return cls(token_ids, chosen, ranks, top_values, top_ids, num_top)

    def read(self) -> list[TokenLogprob]:
        """Five host transfers for the whole batch of rows."""
        ids, chosen, ranks = self.token_ids.tolist(), self.chosen.tolist(), self.ranks.tolist()
        values, top_ids = self.top_values.tolist(), self.top_ids.tolist()
        return [
            TokenLogprob(ids[r], chosen[r], list(zip(top_ids[r][:n], values[r][:n])), ranks[r])
            for r, n in enumerate(self.num_top)
        ]


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprob]:
    """logits [R, V]; token_ids [R]: the token scored at each row (known on the host);
    num_top [R]: how many of the likeliest tokens each row lists."""
    ids = torch.tensor(token_ids, dtype=torch.int64).to(logits.device, non_blocking=True)
    return DeviceLogprobs.compute(logits, ids, num_top).read()
