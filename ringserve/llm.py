"""The Python API, vLLM-style: `LLM(...).generate(prompts, SamplingParams(...))` and
`LLM(...).chat(messages)`."""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Sequence

from tqdm import tqdm

from ringserve.engine.chat_template import check_conversation, is_batch
from ringserve.errors import RequestError
from ringserve.options import EngineOptions
from ringserve.outputs import RequestOutput
from ringserve.sampling_params import SamplingParams

Prompt = str | list[int]
Conversation = list[dict]  # [{"role": "user", "content": "..."}, ...]


def _is_token_ids(prompts) -> bool:
    """One prompt of token ids (not a list of prompts): a flat list starting with a number.
    Floats count, so that [1.0, 2.0] is refused as token ids, not as two prompts."""
    return isinstance(prompts, (list, tuple)) and bool(prompts) and isinstance(prompts[0], numbers.Number)


class LLM:
    """An engine for offline generation.

    model: a Hugging Face folder, a .gguf file, or None for the built-in SmolLM2-135M-Instruct.
    Every other keyword is an engine option, defined with its default and meaning in
    ringserve/options.py (EngineOptions): device, dtype, tp, cp, dp, ep, ranks_per_host,
    allreduce, cp_algo, timeout_s, block_size, num_blocks, kv_cache_memory,
    gpu_memory_utilization, max_model_len, max_num_batched_tokens, max_prefill_tokens, max_num_seqs,
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
        from ringserve.engine.engine import LLMEngine  # here: `import ringserve` stays light

        self.engine = LLMEngine.from_options(options)
        self.parallel_config = self.engine.parallel

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _add(self, prompts: list, token_ids: list[list[int]], sampling_params) -> list[str]:
        """Queue one request per prompt; check them all first, so a bad one queues nothing."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or self.engine.input_processor.default_params()] * len(prompts)
        elif not isinstance(sampling_params, (list, tuple)):
            raise RequestError(
                f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}"
            )
        if len(sampling_params) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        for ids, params in zip(token_ids, sampling_params):
            self.engine.input_processor.check_prompt(ids)
            self.engine.input_processor.check_params(params)
        return [
            self.engine.add_request(p, params, prompt_token_ids=ids, checked=True)
            for p, ids, params in zip(prompts, token_ids, sampling_params)
        ]

    def _tokenize(self, prompts, chat: bool) -> tuple[list, list[list[int]]]:
        if isinstance(prompts, str) or _is_token_ids(prompts):
            prompts = [prompts]
        elif not isinstance(prompts, (list, tuple)):
            raise RequestError(
                f"prompts must be a string, a list of token ids, or a list of either; got {type(prompts).__name__}"
            )
        return list(prompts), [self.engine.input_processor.tokenize(p, chat) for p in prompts]

    def generate_stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat: bool = False,
    ) -> Iterator[RequestOutput]:
        """Yield an output each time a request gains a token (new_text / new_token_ids)."""
        ids = set(self._add(*self._tokenize(prompts, chat), sampling_params))
        return self._stream(ids)

    def _stream(self, ids: set[str]) -> Iterator[RequestOutput]:
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
        use_tqdm: bool = True,
        chat: bool = False,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs in the order of the prompts.

        prompts: a string, a list of token ids, or a list of either. chat=True wraps each
        string in the model's chat template as a user message. use_tqdm: a progress bar
        over finished requests on stderr, when stderr is a terminal.
        """
        return self._run(self._add(*self._tokenize(prompts, chat), sampling_params), use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation, or a list of them (each a list of {"role", "content"}
        dicts), through the model's chat template; outputs in the order of the conversations.

        Each output's prompt is the conversation as the template wrote it. chat_template: a
        Jinja template to use instead of the model's own. add_generation_prompt: end with the
        assistant's turn header, so the model answers; continue_final_message: let the model
        continue the last (assistant) message instead. tools: OpenAI function tools
        ({"type": "function", "function": {"name", "description", "parameters"}}) that the
        template describes to the model, as vLLM's LLM.chat takes them.
        """
        conversations = messages if is_batch(messages) else [messages]
        for i, conversation in enumerate(conversations):  # all checked before any is rendered
            check_conversation(conversation, f"conversation {i}: " if len(conversations) > 1 else "")
        texts, token_ids = [], []
        for conversation in conversations:
            text, ids = self.engine.input_processor.chat_prompt(
                conversation, chat_template, add_generation_prompt, continue_final_message, tools
            )
            texts.append(text)
            token_ids.append(ids)
        return self._run(self._add(texts, token_ids, sampling_params), use_tqdm)

    def _run(self, order: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        # disable=None: tqdm shows the bar only when stderr is a terminal.
        with tqdm(
            total=len(order), desc="Processed prompts", unit="prompt", disable=None if use_tqdm else True
        ) as bar:
            for out in self._stream(set(order)):
                if out.finished:
                    final[out.request_id] = out
                    bar.update()
        return [final[r] for r in order]

    def close(self) -> None:
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
