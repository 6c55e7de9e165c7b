"""Log-probabilities of chosen tokens and the likeliest alternatives, for sampled and prompt tokens."""

from __future__ import annotations

import torch

from ringserve.outputs import TokenLogprob


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprob]:
    """logits [R, V] (any float dtype, any device); token_ids [R]: the token scored at each
    row; num_top [R]: how many of the likeliest tokens each row lists. Values come from the
    model's raw distribution, log_softmax in float32, as vLLM reports them. Four host transfers
    for the whole batch of rows."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    ids = torch.tensor(token_ids, dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, ids[:, None])[:, 0]  # [R]
    ranks = (lp > chosen[:, None]).sum(dim=-1) + 1  # [R]
    k = min(max(num_top, default=0), lp.shape[-1])
    top_vals, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())  # [R, k]
    chosen, ranks, top_vals, top_ids = chosen.tolist(), ranks.tolist(), top_vals.tolist(), top_ids.tolist()
    return [
        TokenLogprob(token_ids[r], chosen[r], list(zip(top_ids[r][:n], top_vals[r][:n])), ranks[r])
        for r, n in enumerate(num_top)
    ]
