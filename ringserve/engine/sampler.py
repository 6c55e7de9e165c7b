"""Next-token choice per sequence: greedy, or temperature / top-k / top-p sampling.

Rows of one batch may carry different parameters; a seeded request draws from its own
generator so that its output does not depend on what else is in the batch.
"""

from __future__ import annotations

import torch

from ringserve.engine.sequence import Sequence


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] -> logits with the tokens outside top-k and the top-p nucleus at -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the likelier ones before it already reach top_p.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop[0] = False
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits [S, V] float32, one row per sequence -> the chosen token ids."""
    choices = logits.argmax(dim=-1)
    sampled = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
    if sampled:
        choices = choices.clone()
        for i in sampled:
            params = seqs[i].params
            row = filter_logits(logits[i] / params.temperature, params.top_k, params.top_p)
            probs = torch.softmax(row, dim=-1)
            gen = seqs[i].generator
            if gen is None and params.seed is not None:
                gen = seqs[i].generator = torch.Generator(device=logits.device).manual_seed(params.seed)
            choices[i] = torch.multinomial(probs, 1, generator=gen)[0]
    return choices.tolist()
