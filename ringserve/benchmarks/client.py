"""One streamed request to an OpenAI-compatible server, timed as `vllm bench serve` times it."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx2 as httpx

from ringserve.benchmarks.datasets import SampleRequest


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0  # the server's usage.prompt_tokens (the dataset's count without usage)
    output_tokens: int = 0  # the server's usage.completion_tokens
    ttft: float = 0.0  # seconds from sending to the first chunk with tokens
    itl: list[float] = field(default_factory=list)  # seconds between chunks with tokens
    latency: float = 0.0  # seconds from sending to the end of the stream
    start: float = 0.0  # time.perf_counter() when sent
    generated_text: str = ""


def request_body(endpoint: str, model: str, sample: SampleRequest, ignore_eos: bool) -> dict:
    """Greedy (temperature 0, as vLLM's benchmark), streamed, with usage in the last chunk."""
    body = {
        "model": model,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": sample.prompt}]
        body["max_completion_tokens"] = sample.expected_output_len
    else:
        body["prompt"] = sample.prompt
        body["max_tokens"] = sample.expected_output_len
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def _error_message(status: int, raw: bytes) -> str:
    try:
        message = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = raw.decode(errors="replace")[:500]
    return f"HTTP {status}: {message}"


def _generated(choice: dict, endpoint: str) -> str | None:
    """The text a chunk's choice brings, "" for a token without text (part of a character);
    None for a chunk that brings no token (chat's opening role-only delta)."""
    if endpoint != "chat":
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    content = delta.get("content")
    if content or (content is not None and delta.get("role") is None):
        return content
    return None


async def send(
    client: httpx.AsyncClient, url: str, endpoint: str, body: dict, sample: SampleRequest
) -> RequestResult:
    """Send one request and read its server-sent events; any failure (an error status, an
    error event in the stream, a broken connection, no usage) is a failed result, not raised."""
    result = RequestResult(prompt_len=sample.prompt_len)
    result.start = last = time.perf_counter()
    usage = None
    texts = []
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = _error_message(response.status_code, await response.aread())
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:  # OpenAI's shape, {"message": ...}, or a bare string (transformers)
                    error = chunk["error"]
                    result.error = (
                        f"stream error: {error.get('message', error) if isinstance(error, dict) else error}"
                    )
                    return result
                usage = chunk.get("usage") or usage
                generated = [_generated(c, endpoint) for c in chunk.get("choices") or []]
                generated = [t for t in generated if t is not None]
                if generated:  # a chunk with tokens: the first sets TTFT, the rest ITL
                    now = time.perf_counter()
                    if not texts:
                        result.ttft = now - result.start
                    else:
                        result.itl.append(now - last)
                    last = now
                    texts.extend(generated)
    except (httpx.HTTPError, ValueError, OSError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = time.perf_counter() - result.start
    result.generated_text = "".join(texts)
    if usage is None:
        result.error = "the stream ended without usage (the server ignored stream_options.include_usage)"
        return result
    result.prompt_len = usage.get("prompt_tokens", sample.prompt_len)
    result.output_tokens = usage.get("completion_tokens", 0)
    result.success = True
    return result
