"""`ringserve bench serve`: runs against the live server on the built-in model (few prompts,
short lengths) and is checked against the server's own /metrics; the datasets, the arrival
process, the stream parsing and the cp comparison are checked as pure functions."""

from __future__ import annotations

import asyncio
import json
import sys

import httpx2 as httpx
import numpy as np
import pytest

from ringserve.benchmarks import BenchError
from ringserve.benchmarks.arrivals import send_times
from ringserve.benchmarks.client import RequestResult, send
from ringserve.benchmarks.compare import compare
from ringserve.benchmarks.datasets import (
    COPY_INSTRUCTIONS,
    PromptMaker,
    SampleRequest,
    copy_requests,
    prefix_repetition_requests,
    random_requests,
    sample_lengths,
    sharegpt_requests,
)
from ringserve.benchmarks.metrics import summarize
from ringserve.benchmarks.serve import max_rate_meeting_slos
from ringserve.cli.main import main

from conftest import KEY, MAX_MODEL_LEN, scrape_metrics

PNG = b"\x89PNG\r\n\x1a\n"


def _bench(live, tmp_path, *flags) -> tuple[int, dict]:
    """Run the CLI against the live server; its exit code and saved result."""
    path = tmp_path / "result.json"
    path.unlink(missing_ok=True)
    code = main(
        ["bench", "serve", "--base-url", live.url, "--api-key", KEY, "--disable-tqdm", "--save-result"]
        + ["--result-dir", str(tmp_path), "--result-filename", "result.json", *flags]
    )
    return code, json.loads(path.read_text())


def test_bench_against_the_live_server_agrees_with_its_metrics(live, tmp_path, capsys):
    before = scrape_metrics(live)
    code, result = _bench(
        live,
        tmp_path,
        *("--num-prompts", "6", "--random-input-len", "20", "--random-output-len", "5", "--ignore-eos"),
        *("--max-concurrency", "3", "--request-rate", "50", "--seed", "3", "--num-warmups", "1"),
        *("--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"),
        *("--plot", str(tmp_path / "latency.png")),
    )
    after = scrape_metrics(live)
    assert code == 0
    moved = {name: after.get(name, 0) - before.get(name, 0) for name in after}
    assert result["completed"] == 6 and result["failed"] == 0
    # token-id prompts: exactly the asked input lengths, as the server counted them
    assert result["input_lens"] == [20] * 6 and result["total_input_tokens"] == 120
    assert result["output_lens"] == [5] * 6 and result["total_output_tokens"] == 30  # --ignore-eos
    # the server counted what the bench sent and got, and the warm-up (the first prompt once)
    assert result["num_warmups"] == 1
    assert moved["vllm:prompt_tokens_total"] == result["total_input_tokens"] + 20
    assert moved["vllm:generation_tokens_total"] == result["total_output_tokens"] + 5
    assert moved["vllm:e2e_request_latency_seconds_count"] == result["completed"] + 1
    # one chunk per token: the gaps the bench saw are the gaps the server counted
    assert [len(itl) for itl in result["itls"]] == [4] * 6
    assert moved["vllm:inter_token_latency_seconds_count"] == 24 + 4
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p99"):
            assert result[f"{stat}_{metric}_ms"] > 0
        assert result[f"p50_{metric}_ms"] <= result[f"p90_{metric}_ms"] <= result[f"p99_{metric}_ms"]
    assert result["median_ttft_ms"] == pytest.approx(np.median(result["ttfts"]) * 1000)
    assert all(t < e for t, e in zip(result["ttfts"], result["e2els"]))
    for key in ("duration", "request_throughput", "output_throughput", "total_token_throughput"):
        assert result[key] > 0
    assert result["output_throughput"] == pytest.approx(30 / result["duration"])
    assert result["model_id"] == "smol" and result["server"]["parallel"] == {
        "tp": 1,
        "cp": 1,
        "ep": 1,
        "dp": 1,
    }
    assert (tmp_path / "latency.png").read_bytes()[:8] == PNG
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "P90 TPOT (ms):" in out and "Successful requests:" in out


def test_bench_chat_with_sharegpt_file(live, tmp_path):
    conversations = [
        {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "one two three four"}]}
        for q in ("What is the capital of France?", "Name three colours, please.")
    ]
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(conversations))
    code, result = _bench(
        live,
        tmp_path,
        *("--endpoint", "chat", "--dataset-name", "sharegpt", "--dataset-path", str(data)),
        *("--num-prompts", "2", "--sharegpt-output-len", "24", "--ignore-eos"),
    )
    assert code == 0 and result["completed"] == 2
    assert result["output_lens"] == [24, 24]  # the French answer ends (EOS) at ~8 tokens without it
    tok = live.engine.tokenizer
    expected = sorted(
        len(
            tok.encode(
                live.engine.input_processor.chat_prompt(
                    [{"role": "user", "content": c["conversations"][0]["value"]}]
                )[0],
                add_special_tokens=False,
            )
        )
        for c in conversations
    )
    assert sorted(result["input_lens"]) == expected  # the chat template's tokens included
    assert all(text for text in result["generated_texts"])


def test_an_error_response_is_a_failed_request(live, tmp_path, capsys):
    # prompts past the server's context: each answered 400, none crashes the benchmark
    code, result = _bench(live, tmp_path, "--num-prompts", "3", "--random-input-len", str(MAX_MODEL_LEN + 10))
    assert code == 1  # nothing completed
    assert result["completed"] == 0 and result["failed"] == 3
    assert all(e.startswith("HTTP 400: ") and "context is 512" in e for e in result["errors"])
    assert result["mean_ttft_ms"] is None
    out = capsys.readouterr().out
    assert "Failed requests:                         3" in out and "3 x HTTP 400" in out


def test_sweep_records_ttft_per_length_and_compares_by_cp(live, tmp_path, capsys):
    code, result = _bench(
        live,
        tmp_path,
        *("--sweep-input-lens", "16,48", "--sweep-num-prompts", "2", "--random-output-len", "2"),
        *("--plot", str(tmp_path / "sweep.png")),
    )
    assert code == 0 and result["max_concurrency"] == 1
    assert [p["input_len"] for p in result["sweep"]] == [16, 48]
    assert [p["input_lens"] for p in result["sweep"]] == [[16, 16], [48, 48]]
    assert all(len(p["ttfts"]) == 2 and p["median_ttft_ms"] > 0 for p in result["sweep"])
    assert (tmp_path / "sweep.png").read_bytes()[:8] == PNG
    assert "TTFT by input length" in capsys.readouterr().out

    # the same sweep as if run at cp=2, 1.6x faster: efficiency 1.6 / 2 = 80%
    cp2 = json.loads(json.dumps(result))
    cp2["server"]["parallel"]["cp"] = 2
    for point in cp2["sweep"]:
        point["ttfts"] = [t / 1.6 for t in point["ttfts"]]
    (tmp_path / "cp2.json").write_text(json.dumps(cp2))
    plot = tmp_path / "compare.png"
    assert compare([str(tmp_path / "cp2.json"), str(tmp_path / "result.json")], str(plot)) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("16 ", "48 "))]
    assert len(rows) == 2 and all(row[-1] == "(80%)" for row in rows), out
    assert out.index("cp=1") < out.index("cp=2")  # sorted by cp
    assert plot.read_bytes()[:8] == PNG


def test_rate_sweep_reports_goodput_per_rate_and_the_highest_rate_held(live, tmp_path, capsys):
    before = scrape_metrics(live)
    code, result = _bench(
        live,
        tmp_path,
        *("--num-prompts", "4", "--random-input-len", "40", "--random-output-len", "3", "--ignore-eos"),
        *("--request-rate-sweep", "20,40", "--goodput", "ttft:60000", "tpot:60000"),
        *("--plot", str(tmp_path / "rates.png")),
    )
    hits = scrape_metrics(live)["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    assert hits == 0  # each rate sends prompts of its own: none found cached from the last rate
    assert code == 0 and result["request_rate"] == [20, 40]
    points = result["rate_sweep"]
    assert [p["request_rate"] for p in points] == [20, 40]
    assert all(p["completed"] == 4 and p["request_goodput_share"] == 1.0 for p in points)
    assert result["completed"] == 8 and result["max_rate_meeting_slos"] == 40
    out = capsys.readouterr().out
    assert (
        "Goodput by request rate" in out and "highest rate at which 99% of requests meet every SLO: 40" in out
    )
    assert (tmp_path / "rates.png").read_bytes()[:8] == PNG


def test_efficiency_needs_a_cp1_run():
    """Without a cp=1 result no efficiency is computed or shown (not one against another
    degree taken as the base); with one, TTFT(cp=1) / (cp x TTFT(cp))."""
    from ringserve.benchmarks.compare import efficiency, format_comparison

    def run(cp, ttft_ms):
        return {"path": f"cp{cp}.json", "label": f"cp={cp}", "cp": cp, "ttft_ms": ttft_ms}

    runs = [run(2, {1024: 60.0, 4096: 200.0}), run(4, {1024: 40.0, 4096: 120.0})]
    efficiency(runs)
    assert all(e is None for r in runs for e in r["efficiency"].values())
    table = format_comparison(runs)
    assert "%" not in table  # no efficiency cell
    assert table.endswith("(no cp=1 result among them: efficiency needs one)")
    runs = [run(1, {1024: 100.0}), *runs]
    efficiency(runs)
    assert runs[1]["efficiency"] == {1024: pytest.approx(100 / (2 * 60)), 4096: None}  # no cp=1 at 4096
    assert runs[2]["efficiency"][1024] == pytest.approx(100 / (4 * 40))
    assert "needs one" not in format_comparison(runs)


def test_itl_is_measured_between_token_events(monkeypatch):
    """Each ITL is the time since the previous chunk with tokens, not since the request was
    sent; TTFT since it was sent. (A clock that advances one second per reading.)"""
    import itertools

    import ringserve.benchmarks.client as client

    ticks = itertools.count()
    monkeypatch.setattr(
        client, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: float(next(ticks)))})
    )
    r = _stream_once(
        lambda request: events(
            *({"choices": [{"index": 0, "text": t}]} for t in ("a", "b", "c", "d")),
            {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 4}},
        )
    )
    assert r.success and r.ttft == 1.0
    assert r.itl == [1.0, 1.0, 1.0]


def test_the_highest_rate_held_is_below_the_first_rate_that_misses():
    def point(rate, share):
        return {"request_rate": rate, "request_goodput_share": share}

    points = [point(16, 0.995), point(4, 1.0), point(8, 0.99), point(12, 0.97), point(20, 1.0)]
    assert max_rate_meeting_slos(points, 0.99) == 8  # 20 held again, past a miss: not counted
    assert max_rate_meeting_slos(points, 0.999) == 4
    assert max_rate_meeting_slos([point(4, 0.5)], 0.99) is None


def test_prompts_have_exact_token_lengths(live):
    tok = live.engine.tokenizer  # the built-in model's
    text = PromptMaker(tok, np.random.default_rng(0), as_text=True)
    for n in (1, 7, 50, 300):  # chat prompts: text that re-encodes to exactly n tokens
        assert len(tok.encode(text.make(n)[0], add_special_tokens=False)) == n
    ids = PromptMaker(tok, np.random.default_rng(0), as_text=False)
    reqs = prefix_repetition_requests(ids, 9, prefix_len=12, suffix_len=5, num_prefixes=3, output_len=4)
    assert all(len(r.prompt) == r.prompt_len == 17 and r.expected_output_len == 4 for r in reqs)
    prefixes = [tuple(r.prompt[:12]) for r in reqs]
    assert len(set(prefixes)) == 3 and all(prefixes.count(p) == 3 for p in prefixes)
    assert len({tuple(r.prompt[12:]) for r in reqs}) == 9
    special = {i for i, t in tok.added_tokens_decoder.items() if t.special}  # <|im_end|>, <file_sep>, ...
    assert len(special) == 17
    assert not special & set(ids.ids(20000))  # no EOS or chat markers inside a prompt


# Pure functions -----------------------------------------------------------------------------


def test_poisson_arrivals_have_the_asked_mean_gap():
    times = send_times(20000, 5.0, 1.0, np.random.default_rng(0))
    gaps = np.diff(times)
    assert times[0] == 0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 5.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    even = np.diff(send_times(20000, 5.0, 4.0, np.random.default_rng(0)))
    assert even.mean() == pytest.approx(0.2, rel=0.03)
    assert even.std() / even.mean() == pytest.approx(0.5, rel=0.05)  # gamma shape 4: CV 1/2
    assert np.array_equal(times, send_times(20000, 5.0, 1.0, np.random.default_rng(0)))  # seeded
    assert not send_times(10, float("inf"), 1.0, np.random.default_rng(0)).any()
    with pytest.raises(ValueError, match="burstiness"):
        send_times(3, 1.0, 0.0, np.random.default_rng(0))


def test_random_range_ratio_bounds():
    lengths = sample_lengths(np.random.default_rng(0), 100, 0.25, 5000)
    assert lengths.min() == 75 and lengths.max() == 125
    assert np.array_equal(sample_lengths(np.random.default_rng(0), 100, 0.0, 50), [100] * 50)
    assert sample_lengths(np.random.default_rng(0), 2, 0.9, 200).min() == 1  # never empty
    with pytest.raises(ValueError, match="range-ratio"):
        sample_lengths(np.random.default_rng(0), 100, 1.0, 5)
    # without a tokenizer: words, one per token asked, after a shared prefix
    maker = PromptMaker(None, np.random.default_rng(0), as_text=True)
    reqs = random_requests(maker, 50, 40, 8, range_ratio=0.5, prefix_len=6)
    assert all(26 <= r.prompt_len <= 66 and r.prompt_len == len(r.prompt.split()) for r in reqs)
    assert len({" ".join(r.prompt.split()[:6]) for r in reqs}) == 1
    assert {r.expected_output_len for r in reqs} <= set(range(4, 13))


def test_summary_follows_vllms_definitions():
    def done(ttft, itl, tokens, prompt=10):
        return RequestResult(True, "", prompt, tokens, ttft, itl, ttft + sum(itl))

    results = [
        done(0.1, [0.02, 0.04], 3),  # TPOT (0.16 - 0.1) / 2 = 30 ms
        done(0.3, [0.01] * 4, 5),  # TPOT 10 ms
        done(0.2, [], 1),  # one token: no TPOT
        RequestResult(error="HTTP 503: overloaded", prompt_len=7),
    ]
    s = summarize(results, 2.0, ["ttft", "tpot", "itl", "e2el"], [50, 100], goodput={"ttft": 0.25})
    assert (s["completed"], s["failed"]) == (3, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (30, 9)  # failed ones count nothing
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 4.5
    assert s["total_token_throughput"] == pytest.approx(39 / 2)
    assert s["request_goodput"] == 1.0  # two of the three under 250 ms TTFT, in 2 s
    assert s["request_goodput_share"] == 0.5  # two of four requests (a failure is not good)
    assert s["mean_ttft_ms"] == pytest.approx(200) and s["p100_ttft_ms"] == pytest.approx(300)
    assert s["mean_tpot_ms"] == pytest.approx(20) and s["p50_tpot_ms"] == pytest.approx(20)
    assert s["median_itl_ms"] == pytest.approx(10) and s["p100_itl_ms"] == pytest.approx(40)
    assert s["mean_e2el_ms"] == pytest.approx((160 + 340 + 200) / 3)
    # numpy's population std (ddof 0), as vLLM: TTFTs 100, 300, 200 ms -> sqrt(20000 / 3), not 100
    assert s["std_ttft_ms"] == pytest.approx((20000 / 3) ** 0.5)
    assert s["std_itl_ms"] == pytest.approx(float(np.std([20, 40, 10, 10, 10, 10])))
    assert s["errors"] == ["", "", "", "HTTP 503: overloaded"]
    empty = summarize(results[3:], 1.0, ["ttft"], [99])
    assert empty["mean_ttft_ms"] is None and empty["p99_ttft_ms"] is None


class WordTokenizer:
    """One token per word: ShareGPT's filters are about counts, not a real vocabulary."""

    def encode(self, text, add_special_tokens=True):
        return text.split()


def test_sharegpt_file_loading(tmp_path):
    def conv(prompt_words, answer_words, turns=2):
        turn = [
            {"from": "human", "value": "w " * prompt_words},
            {"from": "gpt", "value": "a " * answer_words},
        ]
        return {"conversations": turn[:turns]}

    data = [
        conv(10, 20),
        conv(3, 20),  # prompt under 4 tokens
        conv(10, 3),  # answer under 4 tokens
        conv(1100, 10),  # prompt over 1024
        conv(1000, 1100),  # over 2048 in all
        conv(10, 20, turns=1),  # no answer
        {"id": "no conversations"},
        conv(30, 40),
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    reqs = sharegpt_requests(str(path), WordTokenizer(), 2, np.random.default_rng(0))
    assert sorted((r.prompt_len, r.expected_output_len) for r in reqs) == [(10, 20), (30, 40)]
    assert all(isinstance(r.prompt, str) for r in reqs)
    # a fixed output length skips the answer-length filter; too few conversations repeat
    reqs = sharegpt_requests(str(path), WordTokenizer(), 7, np.random.default_rng(0), output_len=5)
    assert len(reqs) == 7 and {r.expected_output_len for r in reqs} == {5}
    assert sorted(r.prompt_len for r in reqs[:4]) == [10, 10, 30, 1000]  # answers' lengths ignored
    assert [r.prompt for r in reqs[4:]] == [r.prompt for r in reqs[:3]]
    with pytest.raises(ValueError, match="tokenizer"):
        sharegpt_requests(str(path), None, 2, np.random.default_rng(0))


def test_copy_dataset_asks_to_copy_passages_of_the_file(tmp_path, builtin_dir):
    """Each prompt is an instruction and a contiguous passage of the file, of the sampled
    length in tokens; max_tokens is the passage's length (the answer copies it)."""
    from transformers import AutoTokenizer

    words = [f"w{i}" for i in range(400)]
    path = tmp_path / "text.txt"
    path.write_text(" ".join(words))
    reqs = copy_requests(str(path), None, 20, 30, np.random.default_rng(0), range_ratio=0.5)
    for r in reqs:
        instruction, passage = r.prompt.split("\n\n")
        assert instruction in COPY_INSTRUCTIONS
        first = words.index(passage.split()[0])
        assert passage.split() == words[first : first + len(passage.split())]  # contiguous
        assert 15 <= r.expected_output_len == len(passage.split()) <= 45
        assert r.prompt_len == len(instruction.split()) + r.expected_output_len
    assert len({r.prompt for r in reqs}) == 20 and len({r.expected_output_len for r in reqs}) > 3
    tok = AutoTokenizer.from_pretrained(builtin_dir)
    path.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    for r in copy_requests(str(path), tok, 5, 24, np.random.default_rng(1)):
        passage = r.prompt.split("\n\n", 1)[1]
        assert r.expected_output_len == len(tok.encode(passage, add_special_tokens=False))
        assert abs(r.expected_output_len - 24) <= 2 and passage in path.read_text()
    with pytest.raises(ValueError, match="fewer than a passage"):
        copy_requests(str(path), None, 2, 1000, np.random.default_rng(0))


def test_bench_chat_with_the_copy_dataset(live, tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("Paris is the capital of France. Rome is the capital of Italy. " * 20)
    code, result = _bench(
        live,
        tmp_path,
        *("--endpoint", "chat", "--dataset-name", "copy", "--dataset-path", str(path)),
        *("--num-prompts", "2", "--copy-passage-len", "16", "--ignore-eos"),
    )
    assert code == 0 and result["completed"] == 2 and result["dataset_name"] == "copy"
    assert all(14 <= n <= 18 for n in result["output_lens"])  # each passage's own length


def _stream_once(handler, endpoint="completions") -> RequestResult:
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://x") as client:
            return await send(client, "/v1/x", endpoint, {"stream": True}, SampleRequest([1, 2], 2, 3))

    return asyncio.run(go())


def events(*chunks):
    """A 200 answer of server-sent events: the chunks, then [DONE]."""
    text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})


def test_chat_stream_times_tokens_not_the_role_chunk():
    usage = {"prompt_tokens": 9, "completion_tokens": 3}
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},  # OpenAI's opening
        *({"choices": [{"index": 0, "delta": {"role": None, "content": t}}]} for t in ("Pa", "", "ris")),
        {"choices": [], "usage": usage},
    ]
    r = _stream_once(lambda request: events(*chunks), endpoint="chat")
    assert r.success and r.generated_text == "Paris" and (r.prompt_len, r.output_tokens) == (9, 3)
    assert len(r.itl) == 2  # three tokens (one without text yet): two gaps; the role chunk is none


def test_stream_failures_are_results_not_exceptions():
    ok = _stream_once(
        lambda request: events(
            {"choices": [{"index": 0, "text": "a"}]},
            {"choices": [{"index": 0, "text": "b"}]},
            {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2}},
        )
    )
    assert ok.success and ok.generated_text == "ab" and ok.output_tokens == 2 and len(ok.itl) == 1
    error_body = {"error": {"message": "the prompt is too long", "type": "BadRequestError", "code": 400}}
    bad = _stream_once(lambda request: httpx.Response(400, json=error_body))
    assert not bad.success and bad.error == "HTTP 400: the prompt is too long"
    mid = _stream_once(
        lambda request: events({"choices": [{"text": "a"}]}, {"error": {"message": "rank 1 died"}})
    )
    assert not mid.success and mid.error == "stream error: rank 1 died"
    # transformers serve sends the error as a bare string (its CUDA out-of-memory mid-stream)
    bare = _stream_once(lambda request: events({"choices": [{"text": "a"}]}, {"error": "CUDA out of memory"}))
    assert not bare.success and bare.error == "stream error: CUDA out of memory"
    no_usage = _stream_once(lambda request: events({"choices": [{"text": "a"}]}))
    assert not no_usage.success and "usage" in no_usage.error

    def refuse(request):
        raise httpx.ConnectError("connection refused")

    down = _stream_once(refuse)
    assert not down.success and down.error == "ConnectError: connection refused"


def test_plot_without_matplotlib_says_what_to_install(monkeypatch):
    from ringserve.benchmarks.plot import plot_result

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails
    with pytest.raises(BenchError, match=r"pip install 'ringserve\[bench\]'"):
        plot_result({"errors": []}, "never.png")


def test_bad_flags_exit_2(capsys):
    assert main(["bench", "serve", "--num-prompts", "0"]) == 2
    assert "--num-prompts must be at least 1" in capsys.readouterr().err
    assert main(["bench", "serve", "--percentile-metrics", "ttft,speed"]) == 2
    assert "unknown speed" in capsys.readouterr().err
    assert main(["bench", "serve", "--port", "1", "--num-prompts", "1"]) == 2
    assert "cannot reach the server" in capsys.readouterr().err
    assert main(["bench", "serve", "--request-rate-sweep", "4,8"]) == 2
    assert "needs the SLOs it checks: --goodput" in capsys.readouterr().err
    assert main(["bench", "serve", "--request-rate-sweep", "4,0", "--goodput", "ttft:350"]) == 2
    assert "positive finite rates" in capsys.readouterr().err
    assert main(["bench", "serve", "--request-rate-sweep", "4,inf", "--goodput", "ttft:350"]) == 2
    assert "positive finite rates" in capsys.readouterr().err
    assert main(["bench", "serve", "--slo-share", "1.5"]) == 2
    assert "--slo-share must be in (0, 1]" in capsys.readouterr().err


def test_a_server_that_lists_no_model_is_benchmarked_under_the_given_model():
    """transformers serve lists no model in /v1/models: --model names it; without one the
    client says what to pass."""
    import http.server
    import json
    import threading
    from types import SimpleNamespace

    from ringserve.benchmarks.serve import BenchError, connect

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"object": "list", "data": []}).encode() if self.path == "/v1/models" else b"{}"
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        args = SimpleNamespace(
            base_url=f"http://127.0.0.1:{server.server_port}", api_key=None, model="/m/llama"
        )
        info = connect(args)
        assert info.model == "/m/llama" and info.model_root is None
        with pytest.raises(BenchError, match="lists no model: name one with --model"):
            connect(SimpleNamespace(**{**vars(args), "model": None}))
    finally:
        server.shutdown()
