"""Prometheus metrics under vLLM's names, in a registry of the app's own (no global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


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
        self.request_success = Counter(
            "vllm:request_success",
            "Count of finished requests.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self._cp_steps = Counter(
            "ringserve:cp_steps",
            "Context-parallel steps per ring algorithm.",
            ["model_name", "algo"],
            registry=r,
        )

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
