"""Test helpers that drive the engine's pieces directly, and a live server on a free port."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import torch

from ringserve.engine.block_manager import BlockManager
from ringserve.engine.runner import StepInput
from ringserve.engine.scheduler import ScheduledBatch
from ringserve.engine.sequence import Sequence
from ringserve.parallel.cp import RingStep
from ringserve.sampling_params import SamplingParams


def engine_logits(engine, token_ids: list[int], prefill: int, chunks: list[int] = ()) -> torch.Tensor:
    """Logits [len, V] of every position: `prefill` tokens in one step, then a step per
    chunk (sizes in `chunks`) after that cached prefix, then one token per step through
    the paged cache, as decoding computes them (under CP through the ring the engine picks)."""
    seq = Sequence("probe", token_ids[:prefill], SamplingParams())
    engine.scheduler.take_row(seq)
    rows = []
    steps = [prefill, *chunks] + [1] * (len(token_ids) - prefill - sum(chunks))
    for n in steps:
        seq.prompt_token_ids = token_ids[: seq.num_computed_tokens + n]
        assert engine.block_manager.allocate(seq, n)
        batch = ScheduledBatch([seq], [n])
        step = StepInput.from_batch(batch, engine.block_manager.layout)
        step.cp_algo = engine._choose_cp_algo(batch)  # the engine's ring (a forced one, or auto)
        rows.append(engine.executor.execute(step, all_logits=True))
        seq.num_computed_tokens += n
    engine.block_manager.free(seq)
    engine.scheduler.free_rows.append(seq.row)
    return torch.cat(rows)


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation, past any EOS (as ignore_eos=True)."""
    ids = torch.tensor([prompt])
    model.generation_config.eos_token_id = None
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    tokens = out[0, len(prompt) :].tolist()
    assert len(tokens) == max_new_tokens
    return tokens


def ring_step(starts: list[int], totals: list[int], block_size: int, cp: int, lookback: int | None = None):
    """A step of sequences whose first starts[i] tokens are cached and which compute up to
    totals[i], placed by a CP layout as the engine places them (cached blocks first, then
    the new ones): (RingStep, the layout, each sequence's per-rank key positions).
    lookback: of the model's attention windows (ModelConfig.local_lookback)."""
    num_blocks = -(-max(totals) // block_size) * len(totals) * cp
    manager = BlockManager(num_blocks, block_size, False, cp, lookback)
    seqs = []
    for i, (start, total) in enumerate(zip(starts, totals)):
        seq = Sequence(str(i), [0] * total, SamplingParams())
        seq.row = i
        if start:
            assert manager.allocate(seq, start)
            seq.num_computed_tokens = start
        assert manager.allocate(seq, total - start)
        seqs.append(seq)
    counts = [t - s for s, t in zip(starts, totals)]
    layout = manager.layout
    step = RingStep(layout.step(seqs, counts), counts, cp)
    key_positions = [
        [
            torch.tensor([p for p in range(total) if layout.where(seq.block_table, p)[0] == r])
            for r in range(cp)
        ]
        for seq, total in zip(seqs, totals)
    ]
    return step, layout, key_positions


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(app, timeout_s: float = 60.0) -> Iterator[str]:
    """Serve an ASGI app with uvicorn in a thread of this process (so tests can look at its
    engine) on a free local port; yields its base URL, stops it on exit."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(30)
