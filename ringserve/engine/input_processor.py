"""Requests before they reach the engine core: prompts to token ids (text through the
tokenizer, conversations through the chat template), the sampling defaults of the model's
generation_config.json, and the checks that refuse what this model cannot serve.

One instance per engine; the LLM class, `ringserve chat` and the server all go through it,
so a prompt becomes the same tokens and meets the same checks whatever the entry point.
"""

from __future__ import annotations

import numbers

from ringserve.engine import chat_template as chat
from ringserve.engine.request_checks import check_params, check_prompt, check_text
from ringserve.engine.sequence import ContextLimit
from ringserve.engine.structured_output import GrammarCompiler
from ringserve.errors import RequestError
from ringserve.sampling_params import SamplingParams
from ringserve.worker.kv_groups import KVGroups


class InputProcessor:
    def __init__(
        self,
        tokenizer,
        model_path: str,
        chat_template: str | None,
        context: ContextLimit,
        max_prompt_chars: int | None,
        vocab_size: int,
        sampling_defaults: dict,
        grammar_compiler: GrammarCompiler,
        kv_capacity: tuple[int, int, KVGroups],
    ):
        """max_prompt_chars: a text longer than this cannot fit (engine/text_bound.py); None
        without a tokenizer. kv_capacity: (blocks, block size, KV groups) of one replica's
        pool, which a prompt must fit."""
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.chat_template = chat_template
        self.context = context
        self.max_prompt_chars = max_prompt_chars
        self.vocab_size = vocab_size
        self.sampling_defaults = sampling_defaults
        self.grammar_compiler = grammar_compiler
        self.num_blocks, self.block_size, self.kv_groups = kv_capacity

    def tokenize(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        """A prompt's token ids: text through the tokenizer (chat: as one user message through
        the chat template), token ids as plain ints (numpy integers too; floats are refused)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"{self.model_path} has no tokenizer: pass token ids, not text")
            check_text(prompt)
            if chat:
                return self.chat_prompt([{"role": "user", "content": prompt}])[1]
            self.check_text_length(prompt)
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) and not hasattr(prompt, "tolist"):
            raise RequestError(
                f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}"
            )
        ids = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)  # numpy / torch too
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise RequestError(
                    f"token ids must be integers; position {i} holds {t!r} ({type(t).__name__})"
                )
        return [int(t) for t in ids]

    def chat_prompt(
        self,
        messages: list[dict],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
    ) -> tuple[str, list[int]]:
        """One conversation through the chat template: (the prompt text, its token ids).

        The one place messages become a prompt (LLM.chat, `ringserve chat`, the server).
        tools: OpenAI function tools the template describes to the model."""
        text = chat.render(
            self.tokenizer,
            messages,
            self.model_path,
            chat_template=chat_template or self.chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
        )
        check_text(text)
        # the rendered text, not the messages: a template may leave parts of them out
        self.check_text_length(text)
        # The template writes the special tokens (BOS and the turn markers) itself.
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    def check_text_length(self, text: str) -> None:
        """Refuse a text too long to fit in max_model_len tokens, whatever its tokens, without
        tokenizing it (engine/text_bound.py says why the bound holds)."""
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise RequestError(
                f"the prompt is {len(text)} characters long; no text over {self.max_prompt_chars} "
                f"characters fits this model's context of {self.context.max_model_len} tokens (max_model_len) "
                "with this tokenizer"
            )

    def default_params(self, **given) -> SamplingParams:
        """SamplingParams with the model's recommended defaults (generation_config.json) where
        `given` leaves a field unset (None); max_tokens capped by the recommended one."""
        values = {**self.sampling_defaults, **{k: v for k, v in given.items() if v is not None}}
        if (
            "max_tokens" in given
            and given["max_tokens"] is not None
            and "max_tokens" in self.sampling_defaults
        ):
            values["max_tokens"] = min(given["max_tokens"], self.sampling_defaults["max_tokens"])
        return SamplingParams(**values)

    def check_prompt(self, token_ids: list[int]) -> None:
        """A prompt this engine can serve (request_checks.py); RequestError says why not."""
        check_prompt(
            token_ids,
            max_model_len=self.context.max_model_len,
            vocab_size=self.vocab_size,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            kv_groups=self.kv_groups,
        )

    def check_params(self, params: SamplingParams) -> None:
        """Sampling parameters this model can serve; RequestError names the field. A grammar
        is compiled here (kept for add_request): call it off an event loop."""
        check_params(params, max_model_len=self.context.max_model_len, vocab_size=self.vocab_size)
        if params.structured_outputs is not None:
            self.grammar_compiler.check(params.structured_outputs)
        if params.bad_words and self.tokenizer is None:
            raise RequestError(f"bad_words: {self.model_path} has no tokenizer to find the words' tokens")
