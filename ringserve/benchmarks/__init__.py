"""`ringserve bench serve`: a serving benchmark against any OpenAI-compatible server, shaped
like `vllm bench serve` (datasets, arrivals, one streamed request, metrics, plots)."""


class BenchError(Exception):
    """A setup the benchmark cannot run with: a bad flag, an unreachable server, no matplotlib."""
