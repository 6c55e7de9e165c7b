"""The engine core: requests in, one batched step at a time, outputs out.

`step()` is schedule -> execute (launch on the ranks, sample on the device) -> update (read
the tokens, end what ended, build the outputs), with async scheduling's one step in flight.
Prompts become tokens and meet their checks in the input processor; tokens become text and
RequestOutputs in the output processor. Not thread-safe: one caller drives `step()` (the
LLM class, or the server's engine thread).
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Mapping

import torch

from ringserve.config import EngineConfig, ModelConfig, ParallelConfig, resolve_dtype
from ringserve.engine import chat_template as chat
from ringserve.engine.block_manager import BlockManager
from ringserve.engine.dp_scheduler import DataParallelScheduler
from ringserve.engine.draft_model import DraftModel, DraftModelDrafter
from ringserve.engine.eagle import Eagle3Draft, Eagle3Drafter
from ringserve.engine.executor import WorkerError, WorkerSpec, limit_host_threads
from ringserve.engine.input_processor import InputProcessor
from ringserve.engine.kv_calibration_text import kv_calibration_ids
from ringserve.engine.launched_step import LaunchedStep
from ringserve.engine.loading import (
    check_parallel_layout,
    eos_token_ids,
    generation_defaults,
    load_tokenizer,
    resolve_device,
    resolve_model_path,
    start_executor,
)
from ringserve.engine.logits_adjust import LogitsAdjuster, bad_words_token_ids
from ringserve.engine.logprobs import DeviceLogprobs, token_logprobs
from ringserve.engine.output_processor import OutputProcessor
from ringserve.engine.sampler import sample_on_device
from ringserve.engine.sampler import warm_up as warm_up_sampler
from ringserve.engine.scheduler import ScheduledBatch, Scheduler
from ringserve.engine.sequence import PENDING_TOKEN, ContextLimit, Sequence
from ringserve.engine.speculative import NgramDrafter, SpecDecodeStats, kept_run
from ringserve.engine.structured_output import GrammarCompiler, GrammarMasks
from ringserve.engine.text_bound import max_prompt_chars
from ringserve.errors import RequestError, RequestTooLargeError
from ringserve.options import EngineOptions, OptionError
from ringserve.outputs import RequestOutput
from ringserve.parallel.cp.policy import CPPolicy
from ringserve.sampling_params import SamplingParams
from ringserve.worker.kv_groups import KVGroups
from ringserve.worker.step_input import StepInput

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        model: str | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        engine_config: EngineConfig | None = None,
        show_progress: bool | None = None,
        weights: Mapping[str, torch.Tensor] | None = None,
        parallel: ParallelConfig | None = None,
        allreduce: str | None = None,
        timeout_s: float | None = None,
        cp_algo: str | None = None,
        *,
        options: EngineOptions | None = None,
    ):
        """options: every engine option (ringserve/options.py), e.g. from `EngineOptions(...)`,
        `LLM(...)` or the command line. The other arguments are a shorthand for them (None:
        the option's default; engine_config and parallel give their fields).
        weights: tensors by Hugging Face name to use instead of the folder's files (the
        folder still gives config and tokenizer), e.g. a transformers model's state_dict."""
        legacy = dict(
            model=model,
            device=device,
            dtype=dtype,
            show_progress=show_progress,
            allreduce=allreduce,
            timeout_s=timeout_s,
            cp_algo=cp_algo,
        )
        if options is None:
            options = EngineOptions.from_configs(engine_config, parallel, **legacy)
        elif engine_config is not None or parallel is not None or any(v is not None for v in legacy.values()):
            raise TypeError("LLMEngine(options=...) takes no other options: set them on the EngineOptions")
        options.validate()
        # Everything below reads the options from here; nothing else configures the engine.
        self.options = options
        self.engine_config = options.engine_config()
        self.parallel = options.parallel_config()
        self.cp_algo = options.cp_algo
        self.show_progress = options.resolved_show_progress()
        self.executor = None
        try:
            self._start(weights)
        except BaseException:  # e.g. Ctrl-C while loading the tokenizer: no rank outlives it
            if self.executor is not None:
                self.executor.close()
            raise

    @property
    def kv_cache_dtype(self) -> str:
        """--kv-cache-dtype as given (auto: the model's dtype)."""
        return self.engine_config.kv_cache_dtype

    @property
    def max_model_len(self) -> int:
        return self.context.max_model_len

    @max_model_len.setter
    def max_model_len(self, value: int) -> None:
        self.context.max_model_len = value

    @property
    def eos_token_ids(self):
        """The ids that end a request (unless ignore_eos): the output processor's."""
        return self.output_processor.eos_token_ids

    @classmethod
    def from_options(
        cls, options: EngineOptions, weights: Mapping[str, torch.Tensor] | None = None
    ) -> LLMEngine:
        """The engine that options describe. weights: in-memory tensors by Hugging Face name."""
        return cls(options=options, weights=weights)

    def _start(self, weights: Mapping[str, torch.Tensor] | None) -> None:
        """Load the model and start the ranks, the KV cache and the scheduler."""
        options, ec, parallel = self.options, self.engine_config, self.parallel
        self.model_path = resolve_model_path(options.model, self.show_progress)
        self.device = resolve_device(options.device)
        self.model_config = config = ModelConfig.from_pretrained(self.model_path)
        check_parallel_layout(config, parallel, self.device)  # before any process or weight
        self.dtype = resolve_dtype(options.dtype, config.dtype, self.device)
        self.context = ContextLimit(ec.max_model_len or config.max_position_embeddings)
        context = config.context_length
        if self.max_model_len > context and not options.allow_long_max_model_len:
            # refused as vLLM refuses it: RoPE past the trained positions gives garbage, not an error
            raise OptionError(
                "max_model_len",
                f"max_model_len {self.max_model_len} is longer than the model's context ({context} "
                f"tokens, from {self.model_path}'s config.json); positions past it were never trained. "
                "To run it anyway, set allow_long_max_model_len (--allow-long-max-model-len)",
            )
        self.tokenizer = load_tokenizer(options.tokenizer or self.model_path)
        self.kv_groups = KVGroups.for_model(config)  # the workers' grouping
        self.speculative = options.speculative()
        draft = None  # a draft model or EAGLE-3 head, checked before any weight is loaded
        spec_method = self.speculative.method if self.speculative is not None else None
        if spec_method == "draft_model":
            draft = DraftModel.check(
                self.speculative, config, self.kv_groups, self.tokenizer, self.show_progress
            )
        elif spec_method == "eagle3":
            draft = Eagle3Draft.check(self.speculative, config, self.kv_groups)
        spec = WorkerSpec(
            self.model_path,
            config,
            self.dtype,
            ec,
            self.max_model_len,
            parallel,
            self.device.type,
            options.allreduce,
            options.timeout_s,
        )
        if draft is not None:
            # Rank 0's draft cache holds every CP rank's and replica's block ids.
            per_block, weights_bytes = draft.memory(ec, self.dtype, parallel.tp)
            spec.draft_memory = (per_block * parallel.cp * parallel.dp, weights_bytes)
        if isinstance(draft, Eagle3Draft):
            spec.eagle3_capture = draft.capture
        if ec.kv_cache_dtype != "auto":  # an FP8 cache: its scales measured on this text
            spec.kv_calibration_ids = kv_calibration_ids(
                self.tokenizer, config.vocab_size, self.max_model_len
            )
        self.executor = start_executor(spec, self.device, self.show_progress, weights)
        warm_up_sampler(self.device, config.vocab_size)  # its kernels built before any request
        limit_host_threads(self.device.type)
        # the sampling seeds of unseeded requests, from --seed when given (reproducible runs)
        self.seed_rng = torch.Generator().manual_seed(options.seed) if options.seed is not None else None
        eos = eos_token_ids(self.model_path, config, self.tokenizer)
        self.logits_adjuster = LogitsAdjuster(config.vocab_size, self.device, eos)
        self.grammar_compiler = GrammarCompiler(self.tokenizer, config.vocab_size, eos)
        self.grammar_masks = GrammarMasks(config.vocab_size, self.device)
        self.cp_policy = CPPolicy(self.cp_algo, parallel.cp, config, self.dtype, self.device.type)
        num_blocks = self.executor.num_blocks * parallel.cp  # each CP rank has its own pool
        # One scheduler and KV-cache pool per data-parallel replica (each its own requests).
        self.replicas = [
            Scheduler(
                BlockManager(
                    num_blocks,
                    ec.block_size,
                    ec.enable_prefix_caching,
                    parallel.cp,
                    config.local_lookback,
                    group_lookbacks=self.kv_groups.lookbacks,
                ),
                ec.max_num_batched_tokens,
                ec.max_num_seqs,
                ec.prefill_budget(),
            )
            for _ in range(parallel.dp)
        ]
        self.block_manager = self.replicas[0].block_manager  # every replica's pool is this size
        self.scheduler = self.replicas[0] if parallel.dp == 1 else DataParallelScheduler(self.replicas)
        self.seqs: dict[str, Sequence] = {}
        self.input_processor = InputProcessor(
            self.tokenizer,
            self.model_path,
            chat.read_template(options.chat_template),
            self.context,
            max_prompt_chars(self.tokenizer, self.max_model_len) if self.tokenizer is not None else None,
            config.vocab_size,
            generation_defaults(options.generation_config, self.model_path),
            self.grammar_compiler,
            (self.block_manager.num_blocks, self.block_manager.block_size, self.kv_groups),
        )
        self.output_processor = OutputProcessor(self.tokenizer, eos, self.context)
        self._ids = itertools.count()
        self.num_computed_tokens = 0  # tokens run through the model (prefix-cache hits are not)
        self.cp_steps: collections.Counter[str] = collections.Counter()  # steps per ring that ran
        self.async_scheduling = options.resolved_async_scheduling(self.device)
        self.drafter = None  # speculative decoding's (engine/speculative.py)
        self.spec_stats = SpecDecodeStats()
        if isinstance(draft, Eagle3Draft):
            self.drafter = Eagle3Drafter.start(
                self.speculative,
                draft,
                self.executor.worker.model,  # rank 0's, in this process
                self.model_path,
                spec.device(0),
                self.dtype,
                ec,
                self.max_model_len,
                num_blocks,  # every CP rank's pool, as the hidden-state cache
                parallel.dp,
            )
        elif draft is not None:
            self.drafter = DraftModelDrafter.start(
                self.speculative,
                draft,
                spec.device(0),  # rank 0's
                self.dtype,
                ec,
                self.max_model_len,
                num_blocks,  # every CP rank's pool: the draft's cache is not sharded
                parallel.dp,
                self.show_progress,
            )
        elif self.speculative is not None:
            self.drafter = NgramDrafter(self.speculative)
            logger.info("speculative decoding: %s", self.speculative)
        self._inflight: LaunchedStep | None = None  # launched, its tokens not read yet
        self._undelivered: list[RequestOutput] = []  # read by a step that then raised
        self.steps_scheduled_ahead = 0  # steps launched before the previous one's tokens were read
        logger.info(
            "model %s (%s) on %s in %s, dp=%d tp=%d cp=%d ep=%d; KV cache %d blocks of %d tokens "
            "= %d tokens in %s (per replica); async scheduling %s",
            self.model_path,
            config.architecture,
            self.device,
            self.dtype,
            parallel.dp,
            parallel.tp,
            parallel.cp,
            parallel.ep,
            num_blocks,
            ec.block_size,
            num_blocks * ec.block_size,
            "fp8 (e4m3)" if ec.kv_cache_dtype != "auto" else self.dtype,
            "on" if self.async_scheduling else "off",
        )

    # Requests -------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        chat: bool = False,
        prompt_token_ids: list[int] | None = None,
        checked: bool = False,
    ) -> str:
        """Queue a request; a request that cannot be served raises RequestError, alone.

        prompt_token_ids: the prompt already tokenised (prompt then only labels the output).
        checked: the caller ran the input processor's check_prompt and check_params on these
        very ids and params (LLM before queuing any, the server off its event loop), so they
        are not run again here: on the engine thread a 1M-token prompt's check costs ~20 ms.
        """
        inputs = self.input_processor
        params = params or inputs.default_params()
        token_ids = prompt_token_ids if prompt_token_ids is not None else inputs.tokenize(prompt, chat)
        if not checked:
            inputs.check_prompt(token_ids)
            inputs.check_params(params)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.seqs:
            raise RequestError(f"request id {request_id!r} is already in use")
        seq = Sequence(
            request_id, token_ids, params, prompt if isinstance(prompt, str) else None, self.seed_rng
        )
        if params.structured_outputs is not None:
            seq.grammar = self.grammar_compiler.matcher(params.structured_outputs)
        if params.bad_words:
            seq.bad_words_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        seq.arrival_time = time.monotonic()
        self.seqs[request_id] = seq
        self.output_processor.add(seq)
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        self.output_processor.remove(request_id)
        if seq is not None and not seq.finished:
            self.scheduler.finish(seq)
            seq.finish_reason = "abort"

    def has_unfinished(self) -> bool:
        """Requests not finished, or a launched step whose tokens are not read yet."""
        return self.scheduler.has_unfinished() or self._inflight is not None

    # Stepping -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One forward pass over the scheduled tokens; an output per sequence that sampled.

        With async scheduling the step's tokens are read one call later: the next step is
        scheduled and launched while this one runs on the device, so the host's work (the
        scheduler, the step message, detokenizing, the outputs) hides behind the device's.
        The next step counts each sequence's pending token (a placeholder the device fills
        in) and skips a sequence whose pending token reaches its length limit; one that ends
        on a stop token or string has had one token computed past its end, which is dropped.
        Under speculative decoding, steps overlap only while drafting is off for the batch.
        """
        outputs, self._undelivered = self._undelivered, []
        inflight = self._inflight
        batch_size = max(len(replica.running) for replica in self.replicas)
        drafting = self.drafter is not None and self.drafter.drafting(batch_size)
        if inflight is not None and (drafting or inflight.drafts is not None):
            # Drafts follow each sequence's latest tokens, and how many tokens a drafted step
            # keeps is known only once it is read: the step in flight is read first. Only
            # while drafting is off for the batch (disable_by_batch_size) do steps overlap.
            outputs += self._finish_step(inflight)
            self._inflight = inflight = None
        if self.drafter is not None:  # drafts, or none for any while drafting is off
            self.drafter.propose_all(self.scheduler.running, self.max_model_len, drafting)
        try:
            batch = self.scheduler.schedule()
        except RequestTooLargeError as e:  # that request alone fails; the others go on
            self.seqs.pop(e.request_id, None)
            self.output_processor.remove(e.request_id)
            self._undelivered = outputs
            raise
        if drafting:  # drafts a draft model makes for the scheduled sequences
            self.drafter.fill(batch)
        if not batch:
            if inflight is not None:
                outputs += self._finish_step(inflight)
                self._inflight = None
            return outputs
        launched = self._launch(batch, inflight)
        if inflight is not None:
            self.steps_scheduled_ahead += 1
            outputs += self._finish_step(inflight)
        outputs += self._commit(launched)
        if self.async_scheduling:
            self._inflight = launched
        else:
            self._inflight = None
            outputs += self._finish_step(launched)
        return outputs

    def _launch(self, batch: ScheduledBatch, inflight: LaunchedStep | None) -> LaunchedStep:
        """Send a step to the device and sample it there; nothing waits for the device."""
        choose_cp_algo = self._choose_cp_algo if self.parallel.cp > 1 else None
        if self.parallel.dp > 1:  # each replica's part of the step, its own ring under CP
            step = self.scheduler.step_input(batch, choose_cp_algo)
        else:
            step = StepInput.from_batch(batch, self.block_manager.layout)
            if choose_cp_algo is not None:
                step.cp_algo = choose_cp_algo(batch)
        pending_tokens = None
        if inflight is not None:
            # A sequence's last token may still be on the device, sampled by `inflight`.
            flat = 0
            for seq, tokens in zip(batch.seqs, step.token_ids):
                flat += len(tokens)
                if tokens[-1] == PENDING_TOKEN:
                    step.pending.append((flat - 1, inflight.row_of[seq.request_id]))
            pending_tokens = inflight.tokens if step.pending else None
        logits = self.executor.execute(step, pending_tokens=pending_tokens)  # [S + R + D, V]
        num_sampling = sum(step.sample)
        num_scored = sum(count for _, _, count in step.scored)
        if step.scored:  # prompt logprobs: the rows after the sampled ones (read now, rare)
            self._score_prompts(batch, step, logits[num_sampling : num_sampling + num_scored])
        draft_logits = logits[num_sampling + num_scored :]  # [D, V]: drafted sequences' other rows
        sampling = [
            seq
            for seq, n in zip(batch.seqs, batch.num_tokens)
            if seq.num_computed_tokens + n - len(seq.draft_token_ids) == seq.num_tokens
        ]
        # max_tokens=0 (prompt logprobs only): done after the prefill, no token drawn.
        keep = [i for i, seq in enumerate(sampling) if seq.params.max_tokens > 0]
        no_token = [seq for seq in sampling if seq.params.max_tokens == 0]
        logits = logits[:num_sampling] if not no_token else logits[keep]
        sampling = [sampling[i] for i in keep]
        pending = _pending_tokens(sampling, inflight)
        self.logits_adjuster.release_finished(self.seqs)
        # A drafted sequence has a row per position of its run (speculative.py), sampled as
        # the token at that position: its drafts' rows, then its own. row_seqs [rows]: whose.
        drafts, row_seqs, positions = None, sampling, None  # a row per sequence
        if step.drafts:
            drafts = [list(seq.draft_token_ids) for seq in sampling]
            logits = _with_draft_rows(logits, sampling, draft_logits, batch, step)
            row_seqs = [seq for seq, d in zip(sampling, drafts) for _ in range(len(d) + 1)]
            positions = [i for d in drafts for i in range(len(d) + 1)]
        if any(seq.grammar is not None for seq in sampling):  # masked before the logprobs, as vLLM
            logits = self._constrain(logits, sampling, row_seqs, positions, pending)
        # logits stay raw for the logprobs (vLLM's default); the tokens come from the adjusted
        tokens, kept, errors = _sample_or_blame(logits, row_seqs, self.logits_adjuster, pending, positions)
        failed = list({id(row_seqs[i]): (row_seqs[i], e) for i, e in errors.items()}.values())
        if errors:  # a sequence with a failed row ends; its other rows go too
            gone = {id(seq) for seq, _ in failed}
            rows = [i for i in kept if id(row_seqs[i]) not in gone]
            tokens = tokens[[kept.index(i) for i in rows]]
            logits, row_seqs = logits[rows], [row_seqs[i] for i in rows]
            if drafts is not None:
                drafts = [d for seq, d in zip(sampling, drafts) if id(seq) not in gone]
            sampling = [seq for seq in sampling if id(seq) not in gone]
        self.logits_adjuster.record(row_seqs, tokens)
        logprobs = _sampled_logprobs(logits, row_seqs, tokens)
        return LaunchedStep(batch, sampling, tokens, logprobs, no_token, failed, drafts)

    def _constrain(
        self,
        logits: torch.Tensor,
        sampling: list[Sequence],
        row_seqs: list[Sequence],
        positions: list[int] | None,
        pending: dict[str, int],
    ) -> torch.Tensor:
        """logits [rows, V] (row_seqs: whose; positions: each row's place in a drafted run)
        -> the disallowed tokens of the rows with a grammar at -inf. Each grammar first takes
        the tokens it has not seen (the last one maybe from `pending`); a drafted run's row i
        is masked by the grammar as it stands after the run's first i drafts."""
        constrained = [seq for seq in sampling if seq.grammar is not None]
        new_tokens = [
            seq.grammar.new_tokens(seq.output_token_ids, pending.get(seq.request_id)) for seq in constrained
        ]
        self.grammar_masks.advance([seq.grammar for seq in constrained], new_tokens)
        rows = [i for i, seq in enumerate(row_seqs) if seq.grammar is not None]
        grammars = [
            row_seqs[i].grammar.after(row_seqs[i].draft_token_ids[: positions[i]])
            if positions
            else row_seqs[i].grammar
            for i in rows
        ]
        return self.grammar_masks.apply(logits, rows, grammars)

    def _commit(self, launched: LaunchedStep) -> list[RequestOutput]:
        """The host's record of a launched step: computed tokens, full blocks offered to the
        prefix cache, and a placeholder for each token sampled but not read yet. Returns the
        outputs of requests that end without a token (max_tokens=0)."""
        batch = launched.batch
        self.num_computed_tokens += sum(batch.num_tokens)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if seq.finished:  # ended (stop, abort) while this step was being launched
                continue
            seq.num_computed_tokens += n - len(seq.draft_token_ids)  # drafts count once kept
            block_manager = self.replicas[seq.replica].block_manager
            block_manager.cache_full_blocks(seq)
            block_manager.release_outside_window(seq)
        for seq in launched.sampling:
            if not seq.finished:
                seq.output_token_ids.append(PENDING_TOKEN)
                # Its length limit ends it when this token is read: no step computes past it.
                seq.ends_when_read = self.output_processor.at_length_limit(seq)
        outputs = [self._finish_without_token(seq) for seq in launched.no_token if not seq.finished]
        return outputs + [self._fail_request(seq, e) for seq, e in launched.failed if not seq.finished]

    def _finish_step(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's tokens (the one host sync of a step) and make its outputs."""
        tokens = launched.read_tokens()
        logprobs = launched.read_logprobs()
        now = time.monotonic()
        outputs = []
        first = 0  # the sequence's first row of tokens
        for seq, drafts in zip(launched.sampling, launched.drafts or itertools.repeat(())):
            rows = slice(first, first + len(drafts) + 1)
            first = rows.stop
            if seq.finished:  # ended while its step ran: the token computed past its end is dropped
                continue
            try:
                run = kept_run(drafts, tokens[rows])
                placeholder = seq.output_token_ids.pop()
                assert placeholder == PENDING_TOKEN
                if seq.first_token_time is None:
                    seq.first_token_time = now
                new = []
                for token in run:  # each read as if it came alone: a stop inside the run ends it
                    seq.output_token_ids.append(token)
                    new.append(token)
                    self.output_processor.take_token(seq, token)
                    if seq.finish_reason is not None:
                        break
                if drafts:
                    self.spec_stats.record(len(drafts), len(run) - 1)
                    self.drafter.record(seq, len(run) - 1)
                    seq.draft_token_ids = []
                if seq.finish_reason is not None:
                    self.scheduler.finish(seq)
                elif drafts:  # the kept drafts' KV is the cache's now; the last token is computed next
                    seq.num_computed_tokens += len(run) - 1
                    self.replicas[seq.replica].block_manager.cache_full_blocks(seq)
                out = self.output_processor.output(seq, new)
                if logprobs is not None and logprobs[rows.start] is not None:
                    out.new_logprobs = logprobs[rows][: len(new)]
            except Exception as e:  # whatever it was, it ends this request alone
                out = self._fail_request(seq, e)
            outputs.append(out)
            if seq.finished:
                self.seqs.pop(seq.request_id, None)
                self.output_processor.remove(seq.request_id)
        return outputs

    def _score_prompts(self, batch, step: StepInput, logits: torch.Tensor) -> None:
        """logits [R, V] of step.scored's rows -> each row scores the prompt token after it."""
        targets, num_top = [], []
        for i, first, count in step.scored:
            seq, position = batch.seqs[i], step.starts[i] + first
            targets += seq.prompt_token_ids[position + 1 : position + 1 + count]
            num_top += [seq.params.prompt_logprobs] * count
        scored = iter(token_logprobs(logits, targets, num_top))
        for i, _, count in step.scored:
            batch.seqs[i].prompt_logprobs.extend(itertools.islice(scored, count))

    def _finish_without_token(self, seq: Sequence) -> RequestOutput:
        seq.finish_reason = "length"
        self.scheduler.finish(seq)
        self.seqs.pop(seq.request_id, None)
        self.output_processor.remove(seq.request_id)
        return self.output_processor.output(seq, [])

    def _fail_request(self, seq: Sequence, error: Exception) -> RequestOutput:
        """End a request whose own processing failed in a step (finish_reason "error"); its
        blocks are freed and the other requests of the step go on."""
        if isinstance(error, RequestError):  # the request's own doing: no traceback
            logger.info("request %s was ended: %s", seq.request_id, error)
        else:
            logger.error("request %s failed in a step and was ended", seq.request_id, exc_info=error)
        self.output_processor.remove(seq.request_id)  # the output below must not decode again
        if not seq.finished:
            self.scheduler.finish(seq)
        seq.finish_reason, seq.stop_reason = "error", None
        out = self.output_processor.output(seq, [])
        out.error = f"{type(error).__name__}: {error}"
        out.request_at_fault = isinstance(error, RequestError)
        self.seqs.pop(seq.request_id, None)
        return out

    def _choose_cp_algo(self, batch: ScheduledBatch) -> str:
        """The ring of a step (of one replica's part of it), counted in cp_steps."""
        algo = self.cp_policy.choose(batch)
        self.cp_steps[algo] += 1
        return algo

    # Statistics -----------------------------------------------------------------------

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def check_health(self) -> None:
        """Raise WorkerError when a parallel rank has died (the world is then shut down)."""
        if self.executor is None:
            raise WorkerError("the engine is closed")
        self.executor.check_health()

    def close(self) -> None:
        for request_id in list(self.seqs):
            self.abort(request_id)
        if self.executor is not None:
            self.executor.close()
            self.executor = None
        self.drafter = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _pending_tokens(sampling: list[Sequence], inflight: LaunchedStep | None) -> dict[str, int]:
    """request id -> its last token, still in flight (async scheduling), for the sequences
    whose next logits the host shapes from their last tokens (a grammar, bad words of several
    tokens). Read from the step in flight: it was sampled before this step's forward pass,
    so the wait is short, and this step's forward pass runs meanwhile."""
    need = [
        seq
        for seq in sampling
        if (seq.grammar is not None or any(len(ids) > 1 for ids in seq.bad_words_ids))
        and seq.output_token_ids
        and seq.output_token_ids[-1] == PENDING_TOKEN
    ]
    if not need:
        return {}
    tokens = inflight.read_tokens()
    return {seq.request_id: tokens[inflight.row_of[seq.request_id]] for seq in need}


def _with_draft_rows(
    logits: torch.Tensor, sampling: list[Sequence], draft_logits: torch.Tensor, batch, step: StepInput
) -> torch.Tensor:
    """logits [S, V] (a row per sampling sequence) and the drafted sequences' other rows
    draft_logits [D, V] (step.drafts' order) -> [S + D, V]: each sequence's rows in the order
    of its run's positions (its drafts' rows, then its own)."""
    draft_rows, first = {}, 0
    for i, d in step.drafts:
        draft_rows[id(batch.seqs[i])] = range(first, first + d)
        first += d
    order = []
    for row, seq in enumerate(sampling):
        order += [len(sampling) + r for r in draft_rows.get(id(seq), ())] + [row]
    index = torch.tensor(order, dtype=torch.int64).to(logits.device, non_blocking=True)
    return torch.cat([logits, draft_logits]).index_select(0, index)


def _sample_or_blame(
    logits: torch.Tensor,
    seqs: list[Sequence],
    adjuster: LogitsAdjuster,
    pending: dict[str, int],
    positions: list[int] | None = None,
) -> tuple[torch.Tensor, list[int], dict[int, Exception]]:
    """The rows' tokens on the device (logits [S, V], a row per sequence, or per position of
    a drafted sequence's run: `positions` counts them from its next token), the rows they
    are for, and the rows that failed. Should the batch fail, each row is sampled alone, so
    a request whose parameters break sampling fails alone instead of the whole step."""
    try:
        tokens = sample_on_device(adjuster.adjust(logits, seqs, pending), seqs, positions)
        return tokens, list(range(len(seqs))), {}
    except Exception:  # find the rows to blame below
        pass
    tokens, kept, errors = [], [], {}
    for i, seq in enumerate(seqs):
        try:
            position = None if positions is None else positions[i : i + 1]
            tokens.append(
                sample_on_device(adjuster.adjust(logits[i : i + 1], [seq], pending), [seq], position)
            )
            kept.append(i)
        except Exception as e:
            errors[i] = e
    empty = torch.empty(0, dtype=torch.int64, device=logits.device)
    return (torch.cat(tokens) if tokens else empty), kept, errors


def _sampled_logprobs(
    logits: torch.Tensor, seqs: list[Sequence], tokens: torch.Tensor
) -> tuple[list[int], DeviceLogprobs] | None:
    """For the rows whose request asked for logprobs: (those rows, their logprobs on the
    device). logits [S, V], tokens [S] on the device; no host sync."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
    if not rows:
        return None
    index = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
    num_top = [seqs[i].params.logprobs for i in rows]
    return rows, DeviceLogprobs.compute(logits.index_select(0, index), tokens.index_select(0, index), num_top)
