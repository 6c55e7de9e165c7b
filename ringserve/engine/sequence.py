"""A request as the engine tracks it: its tokens, its KV blocks, how far it has been computed."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ringserve.outputs import TokenLogprob
from ringserve.sampling_params import SamplingParams


def _draw_seed(params: SamplingParams, rng: torch.Generator | None) -> int:
    """A random 63-bit seed for an unseeded sampled request (from rng, else torch's global
    generator); greedy ones never use it."""
    if params.greedy:
        return 0
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64, generator=rng))


# Stands in a sequence's token list for a token sampled on the device but not read yet
# (async scheduling); the next step takes the real id from the device.
PENDING_TOKEN = -1


class Status(enum.Enum):
    WAITING = "waiting"  # no KV in the cache (new, or preempted to be recomputed)
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt=None,
        seed_rng: torch.Generator | None = None,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.status = Status.WAITING
        # Per KV group (kv_groups.py), the block of each block_size tokens; [] when it holds none.
        self.block_tables: list[list[int]] = []
        self.row: int | None = None  # its row of the runners' step state while running
        self.num_admissions = 0  # times it took a row (a preempted one is admitted again)
        self.replica = 0  # the data-parallel replica serving it (engine/dp_scheduler.py)
        self.num_synced_blocks = 0  # leading blocks of block_table the runners already hold
        self.num_released_blocks: list[int] = []  # per group, leading blocks released (behind its window)
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        # Speculative decoding: tokens guessed to follow, checked in this step with the last
        # one (engine/speculative.py); not among its tokens unless the check keeps them.
        self.draft_token_ids: list[int] = []
        self.ends_when_read = False  # its pending token (async scheduling) reaches its length limit
        self.num_prefix_cached_tokens = 0  # of those, found in the prefix cache
        self.block_hashes: list[bytes] = []  # prefix-cache hash (SHA-256) of each full block of tokens
        self.num_registered_blocks = 0  # leading blocks already offered to the prefix cache
        self.finish_reason: str | None = None  # "stop" (EOS, stop token or string) or "length"
        self.stop_reason: int | str | None = None  # the stop token or string that ended it
        self.text = ""
        # The request's sampling RNG key (with its step count): its own seed, or one drawn once
        # here from torch's global RNG, so no neighbour in a batch can change its draws.
        self.sampling_seed: int = params.seed if params.seed is not None else _draw_seed(params, seed_rng)
        # With params.prompt_logprobs: each prompt token's log-probability, filled as the
        # prefill chunks run (entry i comes from the logits at position i - 1; the first
        # token has none). Positions already scored are not scored again after a preemption.
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            None if params.prompt_logprobs is None else [None]
        )
        self.arrival_time = 0.0
        self.first_token_time: float | None = None
        # With params.structured_outputs: where its output stands in the grammar (the engine's
        # structured_output.Grammar), advanced as tokens are read.
        self.grammar = None
        # With params.bad_words: each word's token ids (logits_adjust.bad_words_token_ids)
        self.bad_words_ids: list[list[int]] = []

    @property
    def block_table(self) -> list[int]:
        """The first KV group's table: its length is every group's, and under context
        parallelism (one group) it is the table the CP layout places."""
        return self.block_tables[0] if self.block_tables else []

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
    def needs_prompt_logits(self) -> bool:
        """Whether some prompt token still waits for its log-probability."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    def prompt_logits_wanted(self, start: int, n: int) -> tuple[int, int]:
        """(first, count): which of the new tokens at positions start .. start + n - 1 give
        logits that score a prompt token not scored yet (the token after each of them)."""
        if not self.needs_prompt_logits:
            return 0, 0
        first = max(start, len(self.prompt_logprobs) - 1)
        end = min(start + n, len(self.prompt_token_ids) - 1)
        return first - start, max(0, end - first)

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


@dataclass
class ContextLimit:
    """The longest sequence (prompt and output) the engine serves, max_model_len: one object
    that the engine and its input and output processors share, so they cannot disagree."""

    max_model_len: int
