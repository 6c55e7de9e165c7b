"""Structured output: each sampled token of a request keeps its output inside a JSON schema,
a regular expression, a choice of strings or a grammar, through llguidance.

llguidance was measured against xgrammar on this engine's tokenizer (bench/grammar_engines.py,
BENCHMARKS.md): about 2 ms to compile a request's schema against 194 ms, and 18 us a mask
against 38 us, in a 3 MB wheel with no dependencies.

Per step, for the rows whose request has a grammar: the host advances each row's matcher by
the tokens it has not consumed yet (under async scheduling the last one is read from the step
still in flight), computes the rows' allowed-token bitmasks into one buffer (llguidance's
threads, without the GIL), and the device sets the logits of the disallowed tokens to -inf.
The engine does this after the step's forward pass is launched and before its sampling, so
the host's share runs while the device computes.
"""

from __future__ import annotations

import collections
import json
import threading

import llguidance
import torch

from ringserve.errors import RequestError
from ringserve.sampling_params import StructuredOutputsParams

COMPILED_GRAMMARS_KEPT = 64  # a request whose grammar was checked finds it here when added


def grammar_of(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for a request's structured output (not compiled yet)."""
    # Free whitespace lets a model write JSON its own way; vLLM's disable_any_whitespace removes it.
    options = {"whitespace_flexible": not spec.disable_any_whitespace}
    try:
        if spec.json is not None:
            return llguidance.LLMatcher.grammar_from_json_schema(spec.json, defaults=options)
        if spec.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
        if spec.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            return llguidance.grammar_from("choice", json.dumps(spec.choice))
        return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to it
    except ValueError as e:  # text that is not JSON, a GBNF grammar that does not convert
        raise RequestError(f"structured_outputs: {e}") from None


class GrammarCompiler:
    """Compiles the grammars of requests against the model's tokenizer. Thread-safe: the
    server checks a request's grammar on a worker thread, the engine thread adds it."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width: the masks cover every row of it
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use (~0.5 s)
        self._compiled: collections.OrderedDict[str, llguidance.LLMatcher] = collections.OrderedDict()
        self._lock = threading.Lock()

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                if self.hf_tokenizer is None:
                    raise RequestError("structured output needs the model's tokenizer, and it has none")
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                )
            return self._tokenizer

    def check(self, spec: StructuredOutputsParams) -> None:
        """Compile a request's grammar (kept for when the request is added); RequestError
        says why it cannot be used."""
        self._compile(grammar_of(spec))

    def matcher(self, spec: StructuredOutputsParams) -> Grammar:
        """A new sequence's grammar state, at the start of its output."""
        return Grammar(self._compile(grammar_of(spec)).deep_copy())

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        with self._lock:
            matcher = self._compiled.get(grammar)
            if matcher is not None:
                self._compiled.move_to_end(grammar)
                return matcher
        # Outside the lock: a large grammar takes long, and llguidance releases the GIL.
        matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"structured_outputs: the grammar cannot be used: {matcher.get_error()}")
        with self._lock:
            self._compiled[grammar] = matcher
            while len(self._compiled) > COMPILED_GRAMMARS_KEPT:
                self._compiled.popitem(last=False)
        return matcher


class Grammar:
    """One sequence's place in its grammar: the matcher and how many output tokens it took."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher
        self.num_consumed = 0

    def new_tokens(self, output_token_ids: list[int], pending_token: int | None = None) -> list[int]:
        """The output tokens not consumed yet; pending_token stands for a last token that the
        host has not read yet (PENDING_TOKEN in output_token_ids)."""
        tokens = output_token_ids[self.num_consumed :]
        if pending_token is not None and tokens:
            tokens = [*tokens[:-1], pending_token]
        return tokens

    def advance(self, output_token_ids: list[int]) -> None:
        """Consume the output tokens not consumed yet."""
        tokens = self.new_tokens(output_token_ids)
        if tokens and not self.matcher.is_error():
            self.matcher.consume_tokens(tokens)
        self.num_consumed += len(tokens)

    def valid_prefix(self, output_token_ids: list[int], tokens: list[int]) -> int:
        """How many of `tokens` (drafts) the grammar takes after the output so far (which it
        consumes first); the grammar itself does not take them."""
        self.advance(output_token_ids)
        return 0 if self.matcher.is_error() else self.matcher.validate_tokens(tokens)

    def after(self, tokens: list[int]) -> Grammar:
        """This grammar (no tokens), or a copy that took `tokens` too: a drafted run's row is
        masked as the grammar stands after the drafts before it."""
        if not tokens:
            return self
        copy = Grammar(self.matcher.deep_copy())
        copy.matcher.consume_tokens(tokens)
        return copy

    @property
    def done(self) -> bool:
        """Nothing more may follow (the grammar is complete and admits no continuation)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


class GrammarMasks:
    """The engine's one instance: the batch's bitmasks and the threads that fill them.

    Nothing here allocates pinned memory per step: two host buffers, used in turn, hold the
    constrained rows' bitmasks and the rows they are for, so the step's only transfers are
    copies from pinned memory that do not wait for the device. The device's work scales with
    the constrained rows, not the batch."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.words = (vocab_size + 31) // 32  # a row's bitmask: 32 tokens to an int32
        self._executor: llguidance.LLExecutor | None = None  # threads started on first use
        # bit j of a byte, for unpacking on the device: [8] uint8
        self._bits = torch.arange(8, dtype=torch.uint8, device=device)
        # 2 x ([rows, words] int32 bitmasks, [rows] int64 row indices), pinned on CUDA
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._copied: list[torch.cuda.Event | None] = [None, None]  # each buffer's last copy
        self._turn = 0

    def advance(self, grammars: list[Grammar], new_tokens: list[list[int]]) -> None:
        """Each grammar consumes its new tokens. A decode step brings one a row: those are
        consumed on llguidance's threads at once (about 20 us a row of JSON on one core)."""
        one = [(g.matcher, t[0]) for g, t in zip(grammars, new_tokens) if len(t) == 1 and g.error is None]
        if one:
            self._threads().consume_token_par(one)  # a failed token leaves its matcher in error
        for grammar, tokens in zip(grammars, new_tokens):
            if len(tokens) > 1 and grammar.error is None:
                grammar.matcher.consume_tokens(tokens)
            grammar.num_consumed += len(tokens)

    def apply(self, logits: torch.Tensor, rows: list[int], grammars: list[Grammar]) -> torch.Tensor:
        """logits [S, V] -> the same with the disallowed tokens of each row in `rows` at -inf
        (a new tensor). A row whose grammar is done or failed is left as it is: its sequence
        ends when this step's token is read, and the token is dropped."""
        live = [(g.matcher, row) for row, g in zip(rows, grammars) if not g.done and g.error is None]
        if not live:
            return logits
        bitmasks, index = self._host_buffers(len(live))  # [R, W], [R]
        index.copy_(torch.tensor([row for _, row in live]))
        self._threads().unsafe_compute_mask_ptr(
            [(matcher, i) for i, (matcher, _) in enumerate(live)],
            bitmasks.data_ptr(),
            self.words * 4,
            len(live),
        )
        words = bitmasks.to(self.device, non_blocking=True)
        rows_on_device = index.to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            self._copied[self._turn] = torch.cuda.Event()
            self._copied[self._turn].record(torch.cuda.current_stream(self.device))
        # Little-endian words: byte b of word w holds tokens 32w + 8b .. + 7, so the bytes'
        # bits in order are the tokens in order. [R, 4W, 8] uint8 -> [R, V]
        allowed = ((words.view(torch.uint8).unsqueeze(-1) >> self._bits) & 1).view(len(live), -1)
        masked = logits.index_select(0, rows_on_device).masked_fill_(
            allowed[:, : logits.shape[1]] == 0, float("-inf")
        )
        return logits.index_copy(0, rows_on_device, masked)

    def _threads(self) -> llguidance.LLExecutor:
        if self._executor is None:  # llguidance's threads: 80% of the cores, at most 32
            self._executor = llguidance.LLExecutor()
        return self._executor

    def _host_buffers(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next host buffers in turn, for num_rows rows, once their last copies are done
        (those of two steps ago: long finished when the host reads the tokens in between)."""
        self._turn = 1 - self._turn
        if not self._buffers or self._buffers[0][0].shape[0] < num_rows:
            cuda = self.device.type == "cuda"
            if cuda:
                torch.cuda.current_stream(self.device).synchronize()  # the old buffers' copies are done
            self._buffers = [
                (
                    torch.empty((num_rows, self.words), dtype=torch.int32, pin_memory=cuda),
                    torch.empty(num_rows, dtype=torch.int64, pin_memory=cuda),
                )
                for _ in range(2)
            ]
            self._copied = [None, None]
        elif self._copied[self._turn] is not None:
            self._copied[self._turn].synchronize()
        bitmasks, index = self._buffers[self._turn]
        return bitmasks[:num_rows], index[:num_rows]
