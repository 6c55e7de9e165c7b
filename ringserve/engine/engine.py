"""The engine: requests in, one batched step at a time, outputs out.

Owns the model, the KV cache, the scheduler and the tokenizer. Not thread-safe: one
caller drives `step()` (the LLM class, or the server's engine loop).
"""

from __future__ import annotations

import collections
import itertools
import logging
import numbers
import os
import time
from collections.abc import Mapping

import torch

from ringserve import chat
from ringserve.config import EngineConfig, ModelConfig, ParallelConfig, resolve_dtype
from ringserve.engine.block_manager import BlockManager
from ringserve.engine.detokenizer import IncrementalDetokenizer
from ringserve.engine.executor import (
    LocalExecutor,
    MultiprocessExecutor,
    WorkerSpec,
    run_torchrun_rank,
    torchrun_env,
)
from ringserve.engine.runner import StepInput
from ringserve.engine.sampler import sample
from ringserve.engine.scheduler import Scheduler
from ringserve.engine.sequence import Sequence
from ringserve.errors import ModelLoadError, RequestError, RequestTooLargeError
from ringserve.gguf_import import builtin_model_path, converted_folder
from ringserve.options import EngineOptions
from ringserve.outputs import RequestOutput, TokenLogprob
from ringserve.parallel.cp import CPCalibration, choose_cp_algo
from ringserve.parallel.tp import validate_tp
from ringserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def resolve_model_path(model: str | None, show_progress: bool = False) -> str:
    """A Hugging Face folder for `model`: a folder as is, a .gguf file converted (with a
    progress bar when show_progress), None the built-in."""
    if model is None:
        return converted_folder(builtin_model_path(), show_progress)
    if os.path.isfile(model) and model.endswith(".gguf"):
        return converted_folder(model, show_progress)
    if os.path.isdir(model):
        return model
    raise ModelLoadError(
        f"model not found: {model!r} is neither a folder with config.json and safetensors "
        "nor a .gguf file (models are loaded from local paths, not downloaded)"
    )


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for, but PyTorch sees no CUDA GPU")
    return device


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
        self._start(weights)

    def _start(self, weights: Mapping[str, torch.Tensor] | None) -> None:
        """Load the model and start the ranks, the KV cache and the scheduler."""
        options, ec, parallel = self.options, self.engine_config, self.parallel
        self.model_path = resolve_model_path(options.model, self.show_progress)
        self.device = resolve_device(options.device)
        self.model_config = config = ModelConfig.from_pretrained(self.model_path)
        # Refuse what cannot work before any process starts or any weight is read.
        if parallel.tp > 1:
            validate_tp(config, parallel.tp)
        gpus = torch.cuda.device_count() if self.device.type == "cuda" else 0
        if self.device.type == "cuda" and torchrun_env() is None and parallel.world_size > gpus:
            raise ValueError(
                f"tp x cp = {parallel.world_size} ranks need as many GPUs; this machine has {gpus}"
            )
        if parallel.ep > 1 and (not config.is_moe or config.num_experts % parallel.ep):
            raise ValueError(
                f"ep={parallel.ep} needs a mixture-of-experts model whose experts divide evenly; "
                f"{config.architecture} has {config.num_experts} experts"
            )
        self.dtype = resolve_dtype(options.dtype, config.dtype, self.device)
        self.max_model_len = ec.max_model_len or config.max_position_embeddings
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
        if parallel.world_size > 1 or torchrun_env() is not None:
            if weights is not None:
                raise ValueError("in-memory weights are only supported on one rank")
            env = torchrun_env()
            if env is not None and env[0] != 0:
                run_torchrun_rank(spec)  # serves rank 0's steps, then ends this process
            self.executor = MultiprocessExecutor(spec, self.show_progress)
        else:
            self.executor = LocalExecutor(spec, self.device, self.show_progress, weights)
        self.tokenizer = _load_tokenizer(self.model_path)
        self.eos_token_ids = _eos_token_ids(self.model_path, config, self.tokenizer)
        self.cp_calibration = CPCalibration.load(self.device.type)
        num_blocks = self.executor.num_blocks * parallel.cp  # each CP rank has its own pool
        self.block_manager = BlockManager(num_blocks, ec.block_size, ec.enable_prefix_caching, parallel.cp)
        self.scheduler = Scheduler(self.block_manager, ec.max_num_batched_tokens, ec.max_num_seqs)
        self.seqs: dict[str, Sequence] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self.num_computed_tokens = 0  # tokens run through the model (prefix-cache hits are not)
        self.cp_steps: collections.Counter[str] = collections.Counter()  # steps per ring that ran
        logger.info(
            "model %s (%s) on %s in %s, tp=%d cp=%d; KV cache %d blocks of %d tokens",
            self.model_path,
            config.architecture,
            self.device,
            self.dtype,
            parallel.tp,
            parallel.cp,
            num_blocks,
            ec.block_size,
        )

    # Requests -------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        """A prompt's token ids: text through the tokenizer (chat: as one user message through
        the chat template), token ids as plain ints (numpy integers too; floats are refused)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"{self.model_path} has no tokenizer: pass token ids, not text")
            if chat:
                return self.chat_prompt([{"role": "user", "content": prompt}])[1]
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
    ) -> tuple[str, list[int]]:
        """One conversation through the chat template: (the prompt text, its token ids).

        The one place messages become a prompt (LLM.chat, `ringserve chat`, the server)."""
        text = chat.render(
            self.tokenizer,
            messages,
            self.model_path,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        # The template writes the special tokens (BOS and the turn markers) itself.
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    def apply_chat_template(self, messages: list[dict]) -> str:
        return self.chat_prompt(messages)[0]

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        chat: bool = False,
        prompt_token_ids: list[int] | None = None,
    ) -> str:
        """Queue a request; a request that cannot be served raises RequestError, alone.

        prompt_token_ids: the prompt already tokenised (prompt then only labels the output).
        """
        params = params or SamplingParams()
        token_ids = prompt_token_ids if prompt_token_ids is not None else self.tokenize(prompt, chat)
        self._check_prompt(token_ids)
        self.check_params(params)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.seqs:
            raise RequestError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, token_ids, params, prompt if isinstance(prompt, str) else None)
        seq.arrival_time = time.monotonic()
        self.seqs[request_id] = seq
        if self.tokenizer is not None:
            self.detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, seq)
        self.scheduler.add(seq)
        return request_id

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise RequestError("the prompt is empty")
        blocks = -(-len(token_ids) // self.block_manager.block_size)
        if blocks > self.block_manager.num_blocks:
            raise RequestError(
                f"the prompt has {len(token_ids)} tokens, more than the whole KV cache holds "
                f"({self.block_manager.num_blocks} blocks of {self.block_manager.block_size})"
            )
        if len(token_ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(token_ids)} tokens, but the model's context is "
                f"{self.max_model_len} (max_model_len) including at least one new token"
            )
        vocab = self.model_config.vocab_size
        # type(t) is int: a float or bool id would pass the range test and fail inside a step.
        bad = [t for t in token_ids if type(t) is not int or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token ids out of the vocabulary (0..{vocab - 1}) or not integers: {bad[:5]}")

    def check_params(self, params: SamplingParams) -> None:
        """Sampling parameters this model can serve; RequestError names the field."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.verify()  # again: a field may have changed since construction
        if params.max_tokens > self.max_model_len:
            raise RequestError(
                f"max_tokens={params.max_tokens} can never be reached: the model's context is "
                f"{self.max_model_len} tokens (max_model_len), prompt included"
            )
        vocab = self.model_config.vocab_size
        if params.logprobs is not None and params.logprobs > vocab:
            raise RequestError(f"logprobs={params.logprobs} is more than the vocabulary's {vocab} tokens")

    def abort(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        self.detokenizers.pop(request_id, None)
        if seq is not None and not seq.finished:
            self.scheduler.finish(seq)
            seq.finish_reason = "abort"

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # Stepping -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One forward pass over the scheduled tokens; an output per sequence that sampled."""
        try:
            batch = self.scheduler.schedule()
        except RequestTooLargeError as e:  # that request alone fails; the others go on
            self.seqs.pop(e.request_id, None)
            self.detokenizers.pop(e.request_id, None)
            raise
        if not batch:
            return []
        step = StepInput.from_batch(batch)
        if self.parallel.cp > 1:
            step.cp_algo = self._choose_cp_algo(batch)
            self.cp_steps[step.cp_algo] += 1
        logits = self.executor.execute(step)
        self.num_computed_tokens += sum(batch.num_tokens)
        sampling = []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                sampling.append(seq)
        now = time.monotonic()
        outputs = []
        tokens, logprobs, errors = _sample(logits, sampling)
        for i, (seq, token) in enumerate(zip(sampling, tokens)):
            try:
                if i in errors:
                    raise errors[i]
                seq.output_token_ids.append(token)
                if seq.first_token_time is None:
                    seq.first_token_time = now
                detok = self.detokenizers.get(seq.request_id)
                if detok is not None:
                    detok.add_token(seq, token)
                self._check_finished(seq, token)
                if seq.finish_reason is not None:
                    self.scheduler.finish(seq)
                out = self._output(seq, [token])
                if logprobs[i] is not None:
                    out.new_logprobs = [logprobs[i]]
            except Exception as e:  # whatever it was, it ends this request alone
                out = self._fail_request(seq, e)
            outputs.append(out)
            if seq.finished:
                self.seqs.pop(seq.request_id, None)
                self.detokenizers.pop(seq.request_id, None)
        return outputs

    def _fail_request(self, seq: Sequence, error: Exception) -> RequestOutput:
        """End a request whose own processing failed in a step (finish_reason "error"); its
        blocks are freed and the other requests of the step go on."""
        logger.error("request %s failed in a step and was ended", seq.request_id, exc_info=error)
        self.detokenizers.pop(seq.request_id, None)  # the output below must not decode again
        if not seq.finished:
            self.scheduler.finish(seq)
        seq.finish_reason, seq.stop_reason = "error", None
        out = self._output(seq, [])
        out.error = f"{type(error).__name__}: {error}"
        return out

    def _choose_cp_algo(self, batch) -> str:
        if self.cp_algo != "auto":
            return self.cp_algo
        c = self.model_config
        new = sum(batch.num_tokens)
        cached = sum(seq.num_computed_tokens for seq in batch.seqs)
        algo = choose_cp_algo(
            new,
            cached,
            self.parallel.cp,
            c.num_attention_heads,
            c.num_key_value_heads,
            torch.empty((), dtype=self.dtype).element_size(),
            self.cp_calibration,
        )
        logger.debug(
            "cp step: %d new, %d cached tokens over %d ranks -> %s", new, cached, self.parallel.cp, algo
        )
        return algo

    def _check_finished(self, seq: Sequence, token: int) -> None:
        params = seq.params
        if seq.finish_reason is not None:  # a stop string, found by the detokenizer
            return
        if token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif not params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    def _output(self, seq: Sequence, new_tokens: list[int]) -> RequestOutput:
        detok = self.detokenizers.get(seq.request_id)
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            text=seq.text,
            token_ids=list(seq.output_token_ids),
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            new_text=detok.new_text(seq) if detok is not None else "",
            new_token_ids=new_tokens,
            num_cached_tokens=seq.num_prefix_cached_tokens,
            time_to_first_token=(seq.first_token_time - seq.arrival_time) if seq.first_token_time else None,
        )

    # Statistics -----------------------------------------------------------------------

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def close(self) -> None:
        for request_id in list(self.seqs):
            self.abort(request_id)
        if self.executor is not None:
            self.executor.close()
            self.executor = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _sample(
    logits: torch.Tensor, seqs: list[Sequence]
) -> tuple[list[int | None], list[TokenLogprob | None], dict[int, Exception]]:
    """The rows' tokens and logprobs (logits [S, V], one row per sequence), and the rows
    that failed. Should the batch fail, each row is sampled alone, so a request whose
    parameters break sampling fails alone instead of the whole step."""
    try:
        tokens = sample(logits, seqs)
        return tokens, _logprobs(logits, seqs, tokens), {}
    except Exception:  # find the rows to blame below
        pass
    tokens, logprobs, errors = [], [], {}
    for i, seq in enumerate(seqs):
        try:
            token = sample(logits[i : i + 1], [seq])
            tokens.append(token[0])
            logprobs.append(_logprobs(logits[i : i + 1], [seq], token)[0])
        except Exception as e:
            tokens.append(None)
            logprobs.append(None)
            errors[i] = e
    return tokens, logprobs, errors


def _logprobs(logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list[TokenLogprob | None]:
    """Per row, the chosen token's log-probability and the top-N, for the rows that asked."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
    result: list[TokenLogprob | None] = [None] * len(seqs)
    if not rows:
        return result
    k = min(max(seqs[i].params.logprobs for i in rows), logits.shape[-1])
    lp = torch.log_softmax(logits[rows].float(), dim=-1)
    chosen = lp.gather(1, torch.tensor([tokens[i] for i in rows], device=lp.device)[:, None])[:, 0].tolist()
    top_vals, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        n = seqs[i].params.logprobs
        result[i] = TokenLogprob(tokens[i], chosen[j], list(zip(top_ids[j][:n], top_vals[j][:n])))
    return result


def _load_tokenizer(folder: str):
    if not any(
        os.path.isfile(os.path.join(folder, f))
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        logger.warning("%s has no tokenizer: prompts must be token ids", folder)
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _eos_token_ids(folder: str, config: ModelConfig, tokenizer) -> set[int]:
    """EOS ids from config.json, generation_config.json and the tokenizer, together."""
    ids = set(config.eos_token_ids)
    path = os.path.join(folder, "generation_config.json")
    if os.path.isfile(path):
        import json

        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
