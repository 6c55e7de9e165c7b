"""POST /v1/completions (vLLM's serving_completion): prompts as text or token ids, n choices
each, with echo, the legacy logprobs object and vLLM's prompt_logprobs. Its stream and full
generators build the choices; OpenAIServing.respond sends them with finish reasons and usage."""

from __future__ import annotations

from collections.abc import AsyncIterator

from ringserve.outputs import RequestOutput, TokenLogprob
from ringserve.server import protocol as P
from ringserve.server.logprobs import add_completion_logprobs, vllm_prompt_logprobs
from ringserve.server.serving import ApiError, Generation, OpenAIServing, finish_reason
from ringserve.server.token_pieces import OffsetCounter


class ServingCompletions(OpenAIServing):
    response_type = P.CompletionResponse
    chunk_type = P.CompletionResponse  # a streamed event has the whole answer's shape

    async def create(self, body: P.CompletionRequest, request):
        self.check_request(body)
        if body.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")
        # echo with logprobs scores the prompt too (what eval harnesses send); vLLM's
        # prompt_logprobs asks for the same alone. The engine computes the larger top-N.
        asked = [body.prompt_logprobs, body.logprobs if body.echo else None]
        prompt_logprobs = max((k for k in asked if k is not None), default=None)
        if body.max_tokens == 0 and not body.echo and body.prompt_logprobs is None:
            raise ApiError(
                400, "max_tokens must be at least 1 (0 only with echo or prompt_logprobs)", "max_tokens"
            )
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ApiError(400, "the prompt is empty", "prompt")
        token_ids = await self.tokenize(prompts)
        texts = [p if isinstance(p, str) else None for p in prompts]
        if body.echo:
            texts = await self.off_loop(
                lambda: [
                    t if t is not None else self.engine.tokenizer.decode(ids)
                    for t, ids in zip(texts, token_ids)
                ]
            )
        structure = await self.structured_outputs(body)
        n = body.n
        request_id = P.random_id("cmpl")
        items = []
        for i, ids in enumerate(token_ids):
            max_tokens = self.max_tokens(body.max_tokens, len(ids))
            for j in range(n):
                params = self.params(body, max_tokens, body.logprobs, j, prompt_logprobs, structure)
                items.append((f"{request_id}-{i * n + j}", ids, params))
        generation = self.submit(request_id, items, n, sum(len(ids) for ids in token_ids))
        echo = [texts[k // n] if body.echo else "" for k in range(len(items))]
        return await self.respond(
            body,
            generation,
            request,
            lambda: self.stream_choices(body, generation, echo),
            lambda index, out, lps: self.full_choice(body, echo[index], index, out, lps),
        )

    async def stream_choices(
        self, body: P.CompletionRequest, generation: Generation, echo: list[str]
    ) -> AsyncIterator[P.CompletionChoice]:
        """A choice per output: its new text (the echoed prompt before the first) and logprobs."""
        started = [False] * len(echo)
        counters: list[OffsetCounter | None] = [None] * len(echo)  # each choice's text offsets
        async for index, out in generation.outputs():
            text, vllm = out.new_text, None
            lp = P.CompletionLogprobs() if body.logprobs is not None else None
            if not started[index]:
                started[index] = True
                text = echo[index] + text
                lp, counters[index], vllm = self.first_extras(body, echo[index], out)
            if lp is not None:
                add_completion_logprobs(
                    lp,
                    self.server.pieces,
                    out.new_token_ids,
                    out.new_logprobs,
                    body.logprobs,
                    counters[index],
                )
            yield self.choice(index, text, lp, out, vllm)

    def full_choice(
        self, body: P.CompletionRequest, echo: str, index: int, out: RequestOutput, lps: list[TokenLogprob]
    ) -> P.CompletionChoice:
        """A choice whole: the echoed prompt and the generated text, with all their logprobs."""
        lp, counter, vllm = self.first_extras(body, echo, out)
        if lp is not None:
            add_completion_logprobs(lp, self.server.pieces, out.token_ids, lps, body.logprobs, counter)
        return self.choice(index, echo + out.text, lp, out, vllm)

    @staticmethod
    def choice(index: int, text: str, lp, out: RequestOutput, vllm) -> P.CompletionChoice:
        return P.CompletionChoice(
            index=index,
            text=text,
            logprobs=lp,
            finish_reason=finish_reason(out),
            stop_reason=out.stop_reason,
            prompt_logprobs=vllm,
        )

    def first_extras(
        self, body: P.CompletionRequest, echo: str, out: RequestOutput
    ) -> tuple[P.CompletionLogprobs | None, OffsetCounter, list | None]:
        """What a choice's first (or only) part carries: the logprobs of its echoed prompt
        (legacy shape), the counter of its generated tokens' text offsets (they start after
        the echoed text), and vLLM's prompt_logprobs."""
        pieces = self.server.pieces
        lp = None
        counter = pieces.counter(len(echo), body.skip_special_tokens)
        if body.logprobs is not None:
            lp = P.CompletionLogprobs()
            if body.echo:
                # the echoed text is the prompt as given: its tokens are placed in it
                offsets = pieces.align(echo, out.prompt_token_ids)
                add_completion_logprobs(
                    lp, pieces, out.prompt_token_ids, out.prompt_logprobs, body.logprobs, iter(offsets)
                )
        vllm = None
        if body.prompt_logprobs is not None:
            vllm = vllm_prompt_logprobs(
                pieces, out.prompt_token_ids, out.prompt_logprobs, body.prompt_logprobs
            )
        return lp, counter, vllm
