"""How parallel (tp / cp) runs end, as a user meets it: Ctrl-C ends every rank within
seconds and quietly, no run leaks a semaphore, a server drains on SIGTERM and exits with an
error when one of its ranks is killed, and no process is left behind.

Every command runs as a shell runs it: in a process group of its own, so a Ctrl-C is SIGINT
to the whole group (as a terminal sends it) and "no process left" means the group is empty.
The built-in model on the CPU (gloo, float32); its 9 heads allow tp=3, not tp=2.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx2 as httpx
import pytest

from ringserve.parallel.local_world import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE = ["--device", "cpu", "--dtype", "float32"]
READY = "; KV cache "  # the engine's log line (-v) once every rank has loaded
LONG_PROMPT = " ".join(["hello"] * 1500)  # a prefill of seconds on the CPU


# Processes -----------------------------------------------------------------------------------


def _start(args: list[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ringserve.cli", *args],
        cwd=ROOT,
        start_new_session=True,  # its own process group, as a shell gives a command
        **kwargs,
    )


def _group(pgid: int) -> dict[int, int]:
    """pid -> parent pid of every live process in the group (a zombie has already ended)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
        except OSError:
            continue
        if state != "Z" and int(pgrp) == pgid:
            found[int(entry)] = int(ppid)
    return found


def _ranks(proc: subprocess.Popen) -> list[int]:
    """The worker ranks: forked by the forkserver, a child of rank 0."""
    group = _group(proc.pid)
    return sorted(pid for pid, ppid in group.items() if group.get(ppid) == proc.pid)


def _wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _left_after(proc: subprocess.Popen, timeout: float) -> dict[int, int]:
    """The group's processes still alive `timeout` seconds after rank 0 ended (or none)."""
    deadline = time.monotonic() + timeout
    while _group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _group(proc.pid)


def _kill_group(proc: subprocess.Popen) -> None:
    """After a failed test: nothing of it may outlive the test."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class _Lines:
    """A pipe's lines, read as they come by a thread (so the pipe never fills)."""

    def __init__(self, pipe):
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self.thread.start()

    def _read(self, pipe) -> None:
        for line in pipe:
            self.lines.append(line.decode(errors="replace").rstrip("\n"))

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


# Ctrl-C and semaphores ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "parallel,moment",
    [
        (["--tp", "3"], "load"),
        (["--tp", "3"], "prefill"),
        (["--cp", "2"], "prefill"),
        (["--cp", "2"], "decode"),
    ],
    ids=["tp3-load", "tp3-prefill", "cp2-prefill", "cp2-decode"],
)
def test_ctrl_c_ends_every_rank_within_seconds_quietly(parallel, moment):
    world_size = int(parallel[1])
    prompt = LONG_PROMPT if moment == "prefill" else "Count from 1 to 100."
    args = ["generate", *ENGINE, *parallel, "-v", "--no-chat", "--ignore-eos", "--max-tokens", "200"]
    proc = _start([*args, prompt], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stderr = _Lines(proc.stderr)
    try:
        if moment == "load":  # every rank started: joining, or loading its weights
            _wait_until(lambda: len(_ranks(proc)) == world_size - 1, 120, "the ranks to start")
            time.sleep(0.3)
        elif moment == "prefill":  # every rank loaded: the long prompt's first step runs
            _wait_until(lambda: READY in stderr.text, 120, "the engine to be ready")
            time.sleep(0.2)
        else:
            assert proc.stdout.read(1)  # the first token's text: decoding
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C, as a terminal sends it: to the group
        sent = time.monotonic()
        proc.wait(timeout=120)
        took = time.monotonic() - sent
        text = proc.stdout.read()
        left = _left_after(proc, 5)
        stderr.thread.join(5)
    finally:
        _kill_group(proc)
    messages = [line for line in stderr.lines if " INFO " not in line]  # less -v's log lines
    assert proc.returncode == 130 and messages == ["interrupted"], stderr.text[-3000:]
    assert took < 10, f"{took:.1f} s from Ctrl-C to exit"
    assert not left, f"processes left: {left}"
    if moment == "load":
        assert READY not in stderr.text  # it was interrupted while the ranks started
    if moment == "prefill":
        assert text == b""  # it was interrupted before the first token


def test_an_interrupted_step_stops_the_ranks_at_once(tiny_model_dir):
    """In Python (a notebook's interrupt): the world cannot step again, and says so."""
    from ringserve import LLM, SamplingParams
    from ringserve.engine.executor import WorkerError

    llm = LLM(tiny_model_dir("llama"), device="cpu", dtype="float32", tp=2, timeout_s=30)
    executor = llm.engine.executor
    (rank1,) = executor.procs

    def interrupted(step, all_logits=False):
        raise KeyboardInterrupt  # in rank 0's share of the step: rank 1 waits in a collective

    executor.worker.execute = interrupted
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert not rank1.is_alive()
    with pytest.raises(WorkerError, match="shut down"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    llm.close()
    assert time.monotonic() - started < 10  # not the 30 s collective timeout


def test_parallel_run_leaks_no_semaphore():
    done = _start(["generate", *ENGINE, "--tp", "3", "--max-tokens", "2", "hi"], stderr=subprocess.PIPE)
    try:
        _, err = done.communicate(timeout=300)
        left = _left_after(done, 5)
    finally:
        _kill_group(done)
    assert done.returncode == 0, err.decode()[-2000:]
    assert "leaked" not in err.decode(), err.decode()  # resource_tracker's warning
    assert not left, f"processes left: {left}"


# Servers ------------------------------------------------------------------------------------


def _serve(parallel: list[str], log) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = ["serve", *ENGINE, *parallel, "--port", str(port), "--max-model-len", "256", "--timeout", "20"]
    proc = _start(args, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, "the server exited while starting"
        try:
            return httpx.get(url + "/health").status_code == 200
        except httpx.TransportError:
            return False

    _wait_until(up, 180, "the server to start")
    return proc, url


def _stream(url: str, max_tokens: int):
    """A streamed completion's `data:` lines, as they come."""
    body = {"prompt": "Count:", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        yield from (line for line in r.iter_lines() if line)


@pytest.mark.parametrize("stop", ["sigterm", "ctrl-c"])
def test_stopping_a_parallel_server_drains_it_and_exits_0(stop, tmp_path):
    """SIGTERM to the server (as a process manager stops it), or Ctrl-C in its terminal
    (SIGINT to every process of the group: the ranks must not die of it, and the in-flight
    request must still finish)."""
    with open(tmp_path / "server.log", "w+b") as log:
        proc, url = _serve(["--cp", "2"], log)
        try:
            lines = _stream(url, 12)
            assert next(lines).startswith("data: {")
            if stop == "sigterm":
                proc.send_signal(signal.SIGTERM)
            else:
                os.killpg(proc.pid, signal.SIGINT)
            rest = list(lines)
            code = proc.wait(timeout=60)
            left = _left_after(proc, 5)
        finally:
            _kill_group(proc)
        log.seek(0)
        output = log.read().decode(errors="replace")
    assert rest[-1] == "data: [DONE]" and sum(line.startswith("data: {") for line in rest) == 11
    assert code == 0, output[-3000:]
    assert "Traceback" not in output and "leaked" not in output, output[-3000:]
    assert not left, f"processes left: {left}"


def test_killed_rank_fails_in_flight_requests_and_ends_the_server(tmp_path):
    with open(tmp_path / "server.log", "w+b") as log:
        proc, url = _serve(["--tp", "3"], log)
        try:
            victim = _ranks(proc)[0]
            answers = []
            body = {"prompt": "Count:", "max_tokens": 200, "ignore_eos": True}
            waiting = threading.Thread(
                target=lambda: answers.append(httpx.post(url + "/v1/completions", json=body, timeout=120))
            )
            waiting.start()
            lines = _stream(url, 200)
            assert next(lines).startswith("data: {")  # both requests are in flight
            os.kill(victim, signal.SIGKILL)
            rest = list(lines)
            waiting.join(60)

            def health_fails() -> bool:
                try:
                    return httpx.get(url + "/health", timeout=5).status_code != 200
                except httpx.TransportError:
                    return True  # stopped listening

            _wait_until(health_fails, 30, "/health to fail")
            code = proc.wait(timeout=60)
            left = _left_after(proc, 5)
        finally:
            _kill_group(proc)
        log.seek(0)
        output = log.read().decode(errors="replace")
    named = f"(pid {victim}) was killed by SIGKILL"
    (answer,) = answers
    assert answer.status_code == 500 and named in answer.json()["error"]["message"], answer.text
    # The stream had sent its headers: the error comes as an event, then [DONE], as vLLM.
    assert named in rest[-2] and rest[-1] == "data: [DONE]", rest[-3:]
    assert code == 1, output[-3000:]
    assert not left, f"processes left: {left}"


# A failing rank of a local world (the collectives' tests and benchmarks) -------------------


def _fail_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    return rank


def test_local_world_reports_a_failing_rank_at_once():
    from ringserve.parallel.local_world import run_local_world

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed: ValueError: rank 1 fails on purpose"):
        run_local_world(_fail_on_rank_1, 2, timeout_s=20)
    assert time.monotonic() - started < 15  # not the 20 + 30 s of waiting for a lost report


@pytest.mark.parametrize(
    "device_type, env, expected",
    [("cuda", None, 1), ("cuda", "4", 3), ("cpu", None, 3)],
)
def test_a_gpu_process_keeps_torch_to_one_cpu_thread_unless_told(monkeypatch, device_type, env, expected):
    """Beside a GPU, torch's CPU pool only competes with llguidance's mask threads (1.5-1.8x
    slower constrained steps on an H100, BENCHMARKS.md); OMP_NUM_THREADS, when set, decides."""
    import torch

    from ringserve.engine.executor import limit_host_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if env is not None:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        limit_host_threads(device_type)
        assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(before)
