"""Prometheus metrics under vLLM's names, in a registry of the app's own (no global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
# vLLM v1's buckets for the prefill and decode phases (longer requests than end-to-end's)
_PHASE = (*_REQUEST, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_PARAMS_N = (1, 2, 5, 10, 20)


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to limit, as vLLM buckets a request's token counts."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(m * scale)
        scale *= 10


class Metrics:
    """Updated by the engine loop thread (prometheus_client is thread-safe), read by /metrics."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]

        def hist(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(model_name)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token in seconds.", _LATENCY)
        self.itl = hist("vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", _LATENCY)
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.", _REQUEST
        )
        self.queue_time = hist(
            "vllm:request_queue_time_seconds",
            "Time spent waiting before the first step, in seconds.",
            _REQUEST,
        )
        # Per data-parallel replica, under vLLM's label for it ("engine": "0" with one replica).
        per_replica = ["model_name", "engine"]
        self._running = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            per_replica,
            registry=r,
        )
        self._waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            per_replica,
            registry=r,
        )
        self._kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", per_replica, registry=r
        )
        self._preemptions = Counter(
            "vllm:num_preemptions", "Cumulative number of preemptions.", per_replica, registry=r
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix-cache hits, in prompt tokens.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prefix-cache queries, in prompt tokens.")
        # per replica ("engine"), as vLLM v1 labels it
        self._request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ["model_name", "engine", "finished_reason"],
            registry=r,
        )
        self._prefill_time = Histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            per_replica,
            buckets=_PHASE,
            registry=r,
        )
        self._decode_time = Histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            per_replica,
            buckets=_PHASE,
            registry=r,
        )
        self.iteration_tokens = hist(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", _ITERATION_TOKENS
        )
        self.params_n = hist("vllm:request_params_n", "Histogram of the n request parameter.", _PARAMS_N)
        # bucketed up to the longest sequence, known once the engine is built (set_max_model_len)
        self._request_prompt_tokens = self._request_generation_tokens = None
        self._cp_steps = Counter(
            "ringserve:cp_steps",
            "Context-parallel steps per ring algorithm.",
            ["model_name", "algo"],
            registry=r,
        )
        # Speculative decoding, vLLM's spec_decode series (engine/speculative.py's counts).
        self._spec = {
            name: Counter(f"vllm:spec_decode_{name}", doc, per_replica, registry=r)
            for name, doc in (
                ("num_drafts", "Number of spec decoding drafts."),
                ("num_draft_tokens", "Number of draft tokens."),
                ("num_accepted_tokens", "Number of accepted tokens."),
            )
        }
        self._spec_per_position = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            [*per_replica, "position"],
            registry=r,
        )

    def set_cache_config(self, num_blocks: int, block_size: int, cache_dtype: str) -> None:
        """vLLM's `vllm:cache_config_info` (value 1, the cache in its labels): how many blocks of
        how many tokens each replica's KV cache holds, and in what dtype ("auto": the model's)."""
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["model_name", "block_size", "cache_dtype", "num_gpu_blocks", "num_gpu_tokens"],
            registry=self.registry,
        )
        info.labels(
            self.model_name, str(block_size), cache_dtype, str(num_blocks), str(num_blocks * block_size)
        ).set(1)

    def set_max_model_len(self, max_model_len: int) -> None:
        """Make the token-count histograms, bucketed 1, 2, 5, 10, ... up to max_model_len as
        vLLM's; called once the engine is built, before any request."""
        if self._request_prompt_tokens is not None:
            return
        buckets = buckets_1_2_5(max_model_len)
        labels = ["model_name", "engine"]
        self._request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            labels,
            buckets=buckets,
            registry=self.registry,
        )
        self._request_generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            labels,
            buckets=buckets,
            registry=self.registry,
        )

    def finished(
        self,
        replica: int,
        finish_reason: str,
        prompt_tokens: int,
        generation_tokens: int,
        prefill_s: float | None,
        decode_s: float | None,
    ) -> None:
        """A request that ended: its counts and phases, under its replica's engine label."""
        engine = str(replica)
        self._request_success.labels(self.model_name, engine, finish_reason).inc()
        if self._request_prompt_tokens is not None:
            self._request_prompt_tokens.labels(self.model_name, engine).observe(prompt_tokens)
            self._request_generation_tokens.labels(self.model_name, engine).observe(generation_tokens)
        if prefill_s is not None:
            self._prefill_time.labels(self.model_name, engine).observe(prefill_s)
        if decode_s is not None:
            self._decode_time.labels(self.model_name, engine).observe(decode_s)

    def running(self, replica: int):
        return self._running.labels(self.model_name, str(replica))

    def waiting(self, replica: int):
        return self._waiting.labels(self.model_name, str(replica))

    def kv_usage(self, replica: int):
        return self._kv_usage.labels(self.model_name, str(replica))

    def preemptions(self, replica: int):
        return self._preemptions.labels(self.model_name, str(replica))

    def cp_steps(self, algo: str):
        return self._cp_steps.labels(self.model_name, algo)

    def spec_decode(self, name: str, replica: int = 0):
        """One of vLLM's spec_decode counters: num_drafts, num_draft_tokens, num_accepted_tokens."""
        return self._spec[name].labels(self.model_name, str(replica))

    def spec_decode_accepted_at(self, position: int, replica: int = 0):
        return self._spec_per_position.labels(self.model_name, str(replica), str(position))
