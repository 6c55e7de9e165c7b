"""The Python API: `LLM(...).generate(prompts, SamplingParams(...))`, vLLM-style."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ringserve.config import EngineConfig, ParallelConfig
from ringserve.engine.engine import LLMEngine
from ringserve.outputs import RequestOutput
from ringserve.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """An engine for offline generation.

    model: a Hugging Face folder, a .gguf file, or None for the built-in SmolLM2-135M-Instruct.
    device: "cpu", "cuda", "cuda:N" or "auto"; dtype: float32, bfloat16, float16 or auto.
    tp: tensor-parallel ranks, started by this call (gloo on CPU, NCCL on CUDA) or, under
    torchrun, the launched world; allreduce: auto, torch, one_shot or two_shot; timeout_s:
    how long a collective may wait before a dead or hung rank ends the run with an error.
    cp: context-parallel ranks (cp_algo: auto, pass_kv or pass_q). ep: expert-parallel ranks
    for MoE models, the same processes as tp, cp or tp x cp; ranks_per_host: when the EP
    group spans hosts, its all-to-all goes two-shot (inside the host, then across).
    Further keyword arguments set EngineConfig fields (block_size, num_blocks,
    max_model_len, max_num_batched_tokens, max_num_seqs, enable_prefix_caching,
    enforce_eager: no CUDA graphs for decode, ...).
    """

    def __init__(
        self,
        model: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        tp: int = 1,
        cp: int = 1,
        ep: int = 1,
        ranks_per_host: int | None = None,
        allreduce: str = "auto",
        cp_algo: str = "auto",
        timeout_s: float = 60.0,
        show_progress: bool = False,
        **engine_kwargs,
    ):
        self.parallel_config = ParallelConfig(tp=tp, cp=cp, ep=ep, ranks_per_host=ranks_per_host)
        self.engine = LLMEngine(
            model,
            device,
            dtype,
            EngineConfig(**engine_kwargs),
            show_progress,
            parallel=self.parallel_config,
            allreduce=allreduce,
            timeout_s=timeout_s,
            cp_algo=cp_algo,
        )

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
