"""The Python API: `LLM(...).generate(prompts, SamplingParams(...))`, vLLM-style."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ringserve.options import EngineOptions
from ringserve.outputs import RequestOutput
from ringserve.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """An engine for offline generation.

    model: a Hugging Face folder, a .gguf file, or None for the built-in SmolLM2-135M-Instruct.
    Every other keyword is an engine option, defined with its default and meaning in
    ringserve/options.py (EngineOptions): device, dtype, tp, cp, ep, ranks_per_host,
    allreduce, cp_algo, timeout_s, block_size, num_blocks, kv_cache_memory,
    gpu_memory_utilization, max_model_len, max_num_batched_tokens, max_num_seqs,
    enable_prefix_caching, enforce_eager, show_progress. An unknown keyword is a TypeError
    naming the close matches; a value that cannot work is a ValueError naming the option.
    """

    def __init__(self, model: str | None = None, **options):
        self._init(EngineOptions.from_kwargs(model=model, **options))

    @classmethod
    def from_options(cls, options: EngineOptions) -> LLM:
        """An LLM from an EngineOptions (e.g. `from_cli_args(args)`)."""
        llm = cls.__new__(cls)
        llm._init(options)
        return llm

    def _init(self, options: EngineOptions) -> None:
        self.options = options
        self.engine = options.create_engine()
        self.parallel_config = self.engine.parallel

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _add(self, prompts, sampling_params, chat: bool) -> list[str]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        # Tokenise and check every prompt before queueing any, so a bad one loses nothing.
        token_ids = [self.engine.tokenize(p, chat) for p in prompts]
        for ids in token_ids:
            self.engine._check_prompt(ids)
        return [
            self.engine.add_request(p, params, prompt_token_ids=ids)
            for p, ids, params in zip(prompts, token_ids, sampling_params)
        ]

    def generate_stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat: bool = False,
    ) -> Iterator[RequestOutput]:
        """Yield an output each time a request gains a token (new_text / new_token_ids)."""
        ids = set(self._add(prompts, sampling_params, chat))
        try:
            while ids:
                for out in self.engine.step():
                    if out.request_id in ids:
                        if out.finished:
                            ids.discard(out.request_id)
                        yield out
        finally:
            for request_id in ids:  # the caller stopped early
                self.engine.abort(request_id)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat: bool = False,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs in the order of the prompts.

        prompts: a string, a list of token ids, or a list of either. chat=True wraps each
        string in the model's chat template as a user message.
        """
        order = self._add(prompts, sampling_params, chat)
        pending = set(order)
        final: dict[str, RequestOutput] = {}
        while pending:
            for out in self.engine.step():
                if out.finished and out.request_id in pending:
                    final[out.request_id] = out
                    pending.discard(out.request_id)
        return [final[r] for r in order]

    def close(self) -> None:
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
