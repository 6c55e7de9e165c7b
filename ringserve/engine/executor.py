"""Where the model runs: in this process, or on a world of dp x cp x tp ranks driven by rank 0.

With several ranks, rank 0 (this process) schedules and samples (every replica's, under
data parallelism); every step it sends the StepInput (a DataParallelStep with dp > 1) to all
ranks over a gloo control group and runs its own shard. The other local
ranks are started here (forkserver processes, torch preloaded); under torchrun every rank
was started by torchrun and the non-zero ranks serve steps inside `LLM(...)` until rank 0
closes, then exit.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing import forkserver, resource_tracker

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ringserve.config import EngineConfig, ModelConfig, ParallelConfig
from ringserve.errors import RingserveError
from ringserve.parallel.comm import broadcast_object
from ringserve.parallel.local_world import free_port
from ringserve.parallel.mesh import ParallelGroups, init_groups
from ringserve.worker.step_input import StepInput
from ringserve.worker.worker import Worker

logger = logging.getLogger(__name__)

# Workers wait on the control group between requests for as long as the server idles.
_CONTROL_TIMEOUT = datetime.timedelta(days=7)


class WorkerError(RingserveError):
    """A rank died, failed or stopped answering; the whole world has been shut down."""


@dataclass
class WorkerSpec:
    """Everything a rank needs to build its share of the model (sent to every rank)."""

    model_path: str
    config: ModelConfig
    dtype: torch.dtype
    engine_config: EngineConfig
    max_model_len: int
    parallel: ParallelConfig
    device_type: str
    allreduce: str = "auto"
    timeout_s: float = 60.0
    # An FP8 KV cache's calibration prompt (worker/kv_calibration.py); None: no FP8 cache
    kv_calibration_ids: list[int] | None = None
    # A draft model's share of the memory (Worker's draft_memory): its KV bytes per block, weights
    draft_memory: tuple[int, int] = (0, 0)
    # An EAGLE-3 head's input kept by rank 0 (Worker's eagle3_capture)
    eagle3_capture: tuple[str, tuple[int, ...], int] | None = None

    def device(self, local_rank: int) -> torch.device:
        return torch.device(f"cuda:{local_rank}") if self.device_type == "cuda" else torch.device("cpu")

    def build_worker(self, groups: ParallelGroups, show_progress: bool = False, weights=None) -> Worker:
        return Worker(
            self.model_path,
            self.config,
            self.dtype,
            self.engine_config,
            self.max_model_len,
            groups,
            self.allreduce,
            weights=weights,
            show_progress=show_progress,
            kv_calibration_ids=self.kv_calibration_ids,
            draft_memory=self.draft_memory,
            eagle3_capture=self.eagle3_capture,
        )


class LocalExecutor:
    """One rank: the worker lives in this process."""

    def __init__(self, spec: WorkerSpec, device: torch.device, show_progress: bool, weights=None):
        self.worker = spec.build_worker(ParallelGroups.single(device), show_progress, weights)
        self.num_blocks = self.worker.num_blocks

    def execute(
        self, step: StepInput, all_logits: bool = False, pending_tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.worker.execute(step, all_logits, pending_tokens)

    def check_health(self) -> None:
        """Nothing to check: the only rank is this process."""

    def close(self) -> None:
        self.worker = None


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when launched by torchrun, else None."""
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "MASTER_ADDR" in os.environ):
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    return None


def _join(
    spec: WorkerSpec, rank: int, world_size: int, local_rank: int, init_method: str, check_peers=None
) -> ParallelGroups:
    if spec.parallel.ranks_per_host is None and "LOCAL_WORLD_SIZE" in os.environ:
        # torchrun knows the hosts (its processes per host): the mesh's host dimension.
        spec.parallel.ranks_per_host = int(os.environ["LOCAL_WORLD_SIZE"])
    groups = init_groups(
        spec.parallel, rank, world_size, spec.device(local_rank), init_method, spec.timeout_s, check_peers
    )
    groups.control_group = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
    return groups


def serve_steps(worker: Worker, groups: ParallelGroups) -> None:
    """A non-zero rank's life: run every step rank 0 sends, until it says stop."""
    while True:
        kind, *payload = broadcast_object(None, src=0, group=groups.control_group)
        if kind == "stop":
            return
        worker.execute(*payload)


def _build_and_serve(spec: WorkerSpec, groups: ParallelGroups) -> None:
    """A non-zero rank: load its shard, then serve rank 0's steps until it closes."""
    worker = spec.build_worker(groups)
    limit_host_threads(spec.device_type)
    serve_steps(worker, groups)


def run_torchrun_rank(spec: WorkerSpec) -> None:
    """Entry of a non-zero torchrun rank: serve rank 0, then end the process."""
    rank, world_size, local_rank = torchrun_env()
    groups = _join(spec, rank, world_size, local_rank, "env://")
    _build_and_serve(spec, groups)
    dist.destroy_process_group()
    sys.exit(0)


def _watch_parent(parent_pid: int) -> None:
    """End this rank when rank 0's process is gone (no orphans)."""
    while True:
        try:
            os.kill(parent_pid, 0)
        except OSError:
            os._exit(1)
        time.sleep(0.5)


def _start_forkserver_deaf_to_ctrl_c() -> None:
    """Start the forkserver (if not yet running) with SIGINT blocked.

    The signal mask is inherited through fork and exec, so the forkserver and every rank it
    forks are deaf to Ctrl-C (which a terminal sends to the whole process group) from their
    first instruction: a rank interrupted while it starts would leave rank 0 waiting in the
    rendezvous. A Ctrl-C that comes meanwhile waits in rank 0 until the mask is restored.
    """
    resource_tracker.ensure_running()  # first: starting its process unblocks SIGINT again
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def limit_host_threads(device_type: str) -> None:
    """After loading, a process that drives a GPU does its CPU work in small ops, and torch's
    intra-op pool (a thread per core) then only competes with the threads that do real host
    work: beside it, llguidance's threads took 1-6 ms for a batch of 64 grammar masks on an
    H100 host, and 64 JSON-constrained decode steps ran 1.5-1.8x slower than free ones; with
    one torch thread, 1.01-1.07x (BENCHMARKS.md). vLLM keeps its GPU workers to one thread
    too. OMP_NUM_THREADS, when set, decides instead."""
    if device_type == "cuda" and "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() > 1:
        logger.info(
            "torch's CPU threads: %d -> 1 beside the GPU (set OMP_NUM_THREADS to choose)",
            torch.get_num_threads(),
        )
        torch.set_num_threads(1)


def _child_main(
    rank: int, world_size: int, init_method: str, spec: WorkerSpec, parent_pid: int, errors
) -> None:
    # Ctrl-C in a terminal reaches every process of its group. Rank 0 alone decides how the
    # world stops: a rank that left on its own mid-collective would leave the others waiting
    # out the timeout. Rank 0 ends this process with SIGTERM when it cannot stop it in step.
    # (SIGINT is blocked already when rank 0 started the forkserver; ignored also when not.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if spec.device_type == "cpu":
        torch.set_num_threads(1)  # several ranks share the host's cores
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    try:
        groups = _join(spec, rank, world_size, rank, init_method)
        _build_and_serve(spec, groups)
        dist.destroy_process_group()
    except BaseException as e:
        errors.put((rank, f"{type(e).__name__}: {e}", traceback.format_exc()))
        sys.exit(1)
    # Returning (rather than os._exit) lets multiprocessing run this process's exit
    # finalizers, which unlink any semaphore it made (else resource_tracker warns of a leak).


class MultiprocessExecutor:
    """Rank 0's side of a dp x cp x tp world."""

    def __init__(self, spec: WorkerSpec, show_progress: bool):
        self.spec = spec
        self.procs: list = []
        self.errors = None
        self.closed = False
        env = torchrun_env()
        try:
            if env is not None:
                rank, world_size, local_rank = env
                assert rank == 0, "non-zero torchrun ranks serve steps and never build an executor"
                groups = _join(spec, 0, world_size, local_rank, "env://")
            else:
                world_size = spec.parallel.world_size
                init_method = f"tcp://127.0.0.1:{free_port()}"
                self._start_children(world_size, init_method)
                groups = _join(spec, 0, world_size, 0, init_method, self._check_started)
            self.groups = groups
            self.worker = spec.build_worker(groups, show_progress)
        except Exception as e:
            self._fail(e, "while starting")
        except BaseException:  # Ctrl-C while the ranks start: stop them, then let it through
            self._shutdown(graceful=False)
            raise
        self.num_blocks = self.worker.num_blocks

    def _start_children(self, world_size: int, init_method: str) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "ringserve.engine.executor"])
        _start_forkserver_deaf_to_ctrl_c()
        self.errors = ctx.SimpleQueue()
        for rank in range(1, world_size):
            proc = ctx.Process(
                target=_child_main,
                args=(rank, world_size, init_method, self.spec, os.getpid(), self.errors),
                name=f"ringserve-rank{rank}",
                daemon=True,
            )
            proc.start()
            self.procs.append(proc)

    def _check_started(self) -> None:
        if any(not proc.is_alive() for proc in self.procs):
            raise WorkerError("a rank exited before joining")

    def _send(self, message) -> None:
        broadcast_object(message, src=0, group=self.groups.control_group, timeout_s=self.spec.timeout_s)

    def check_health(self) -> None:
        """Raise WorkerError (after stopping the world) when a local rank has exited."""
        if self.closed:
            raise WorkerError("the parallel workers have been shut down")
        if any(not proc.is_alive() for proc in self.procs):
            self._fail(WorkerError("a rank exited"), "between steps")

    def execute(
        self, step: StepInput, all_logits: bool = False, pending_tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        if pending_tokens is not None:  # the other ranks could not see them
            raise ValueError("tokens pending on the device (async scheduling) need one rank")
        self.check_health()  # a dead rank fails here, not in a collective that waits for it
        try:
            self._send(("step", step, all_logits))
            return self.worker.execute(step, all_logits)
        except Exception as e:
            self._fail(e, "during a step")
        except BaseException:
            # Interrupted (Ctrl-C) mid-step: the other ranks may be inside a collective this
            # rank will never finish. A "stop" message could not reach them (close() would
            # wait out the timeout) and the world cannot step again: stop the ranks now.
            self._shutdown(graceful=False)
            raise

    def _fail(self, cause: Exception, when: str):
        """Explain which rank failed, stop every rank, and raise WorkerError."""
        deadline = time.monotonic() + 2.0
        while self.procs and time.monotonic() < deadline and all(p.is_alive() for p in self.procs):
            time.sleep(0.05)  # give a failing rank a moment to report or exit
        reports = {}
        while self.errors is not None and not self.errors.empty():
            rank, message, _ = self.errors.get()
            reports[rank] = message
        # A rank that times out waiting for another is a victim, not the cause.
        errors = {r: m for r, m in reports.items() if "timed out" not in m.lower()}
        dead, silent = [], []
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.exitcode
            if proc.is_alive() and rank not in reports:
                silent.append(
                    f"rank {rank} (pid {proc.pid}) did not answer within {self.spec.timeout_s:.0f} s"
                )
            elif code and rank not in reports:
                how = (
                    f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
                )
                if code == 1 and when == "while starting":
                    how += (
                        " before reporting (ranks start by importing the main script: start "
                        'ringserve under `if __name__ == "__main__":`)'
                    )
                dead.append(f"rank {rank} (pid {proc.pid}) {how}")
        reasons = dead + [f"rank {r} failed: {m}" for r, m in sorted(errors.items())]
        if not reasons and "timed out" in str(cause).lower():
            reasons = silent
        if not reasons:
            reasons = [f"{type(cause).__name__}: {cause}"]
        self._shutdown(graceful=False)
        raise WorkerError(f"parallel run stopped {when}: " + "; ".join(reasons)) from cause

    def _shutdown(self, graceful: bool) -> None:
        self.closed = True
        try:
            if graceful:
                try:
                    self._send(("stop",))
                except Exception:
                    graceful = False
        finally:  # even when a second Ctrl-C lands here: no rank outlives this call
            self._stop_processes(grace_s=5.0 if graceful else 0.0)
            if self.errors is not None:
                self.errors.close()
            try:
                if dist.is_initialized():
                    dist.destroy_process_group()
            except Exception:  # a broken world may not tear down cleanly; the processes are gone
                pass

    def _stop_processes(self, grace_s: float) -> None:
        """Give the ranks grace_s to exit on their own, then SIGTERM them (they ignore SIGINT;
        SIGTERM ends a rank even inside a collective), then SIGKILL what is left."""
        try:
            deadline = time.monotonic() + grace_s
            for proc in self.procs:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
            for proc in self.procs:
                if proc.is_alive():
                    proc.terminate()
            deadline = time.monotonic() + 2.0
            for proc in self.procs:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        finally:  # also when a second Ctrl-C cuts the grace short
            for proc in self.procs:
                if proc.is_alive():
                    proc.kill()
                    proc.join()

    def close(self) -> None:
        if not self.closed:
            self._shutdown(graceful=True)
