"""A request as the engine tracks it: its tokens, its KV blocks, how far it has been computed."""

from __future__ import annotations

import enum

import torch

from ringserve.sampling_params import SamplingParams


def _draw_seed(params: SamplingParams) -> int:
    """A random 63-bit seed for an unseeded sampled request; greedy ones never use it."""
    if params.greedy:
        return 0
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))


class Status(enum.Enum):
    WAITING = "waiting"  # no KV in the cache (new, or preempted to be recomputed)
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt=None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.status = Status.WAITING
        self.block_table: list[int] = []  # KV-cache block of each block_size tokens
        self.row: int | None = None  # its row of the runners' step state while running
        self.num_synced_blocks = 0  # leading blocks of block_table the runners already hold
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_prefix_cached_tokens = 0  # of those, found in the prefix cache
        self.block_hashes: list[int] = []  # prefix-cache hash of each full block of tokens
        self.num_registered_blocks = 0  # leading blocks already offered to the prefix cache
        self.finish_reason: str | None = None  # "stop" (EOS, stop token or string) or "length"
        self.stop_reason: int | str | None = None  # the stop token or string that ended it
        self.text = ""
        # The request's sampling RNG key (with its step count): its own seed, or one drawn once
        # here from torch's global RNG, so no neighbour in a batch can change its draws.
        self.sampling_seed: int = params.seed if params.seed is not None else _draw_seed(params)
        self.arrival_time = 0.0
        self.first_token_time: float | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list (a decode step's hot path)."""
        prompt = len(self.prompt_token_ids)
        if start >= prompt:
            return self.output_token_ids[start - prompt : end - prompt]
        return self.prompt_token_ids[start:end] + self.output_token_ids[: max(0, end - prompt)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self):
        return (
            f"Sequence({self.request_id}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.value})"
        )
