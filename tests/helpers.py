"""Test helpers that drive the engine's pieces directly, and a live server on a free port."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import torch

from ringserve.engine.block_manager import BlockManager
from ringserve.engine.sequence import Sequence
from ringserve.parallel.cp.plan import RingStep
from ringserve.parallel.local_world import free_port
from ringserve.sampling_params import SamplingParams

VOCAB = 256  # the tiny models' vocabulary (tests/conftest.py)


def scored(max_tokens: int) -> SamplingParams:
    """Greedy, with the log-probabilities of the whole vocabulary at every generated token."""
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=VOCAB)


def run_requests(engine, prompts, params) -> list[tuple[list[int], torch.Tensor]]:
    """Every request to the end, stepping the engine: per prompt (its tokens, [tokens, V]
    log-probabilities of the vocabulary at each generated position)."""
    ids = [engine.add_request(p, params) for p in prompts]
    tokens = {i: [] for i in ids}
    rows = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            for lp in out.new_logprobs or []:
                row = torch.full((VOCAB,), float("nan"))
                for token, value in lp.top:
                    row[token] = value
                rows[out.request_id].append(row)
    return [(tokens[i], torch.stack(rows[i]) if rows[i] else torch.empty(0, VOCAB)) for i in ids]


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
            torch.tensor(
                [p for p in range(total) if layout.where(seq.block_table, p)[0] == r], dtype=torch.int64
            )
            for r in range(cp)
        ]
        for seq, total in zip(seqs, totals)
    ]
    return step, layout, key_positions


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


def ring_inputs(step, key_positions, totals: list[int], rank: int, heads: int, kv_heads: int, dim: int):
    """Random whole-sequence q/k/v (seed 0) for a ring_step, and this rank's share of them
    as the engine packs it: (qs, ks, vs, q_positions, q, k, v), where qs[i] [totals[i], heads,
    dim] is sequence i's every query, q_positions[i] the positions of those on this rank, and
    q, k, v the rank's packed queries and keys."""
    g = torch.Generator().manual_seed(0)
    qs = [torch.randn(t, heads, dim, generator=g) for t in totals]
    ks = [torch.randn(t, kv_heads, dim, generator=g) for t in totals]
    vs = [torch.randn(t, kv_heads, dim, generator=g) for t in totals]
    mine = step.owners == rank
    q_positions = [step.positions[mine & (step.seq == i)] for i in range(len(totals))]
    q = torch.cat([x[p] for x, p in zip(qs, q_positions)])
    k = torch.cat([x[p[rank]] for x, p in zip(ks, key_positions)])
    v = torch.cat([x[p[rank]] for x, p in zip(vs, key_positions)])
    return qs, ks, vs, q_positions, q, k, v


def prompts_of_lengths(lengths, seed=0, vocab: int = 256) -> list[list[int]]:
    """Random token-id prompts of these lengths (ids below `vocab`), the same for a seed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def fp8_layout_run(folder: str, **options):
    """A parallel layout's run of the FP8 tests (tests/test_fp8_*.py), float32 on the CPU with
    `options` (the FP8 ones, the layout): greedy tokens of a 61-token prompt and of a batch of
    three, the logits of a 30-token prefill then decode (None under data parallelism, whose
    replicas engine_logits does not address), and the FP8 KV cache's scales (None under tensor
    parallelism, where each rank holds its heads' only)."""
    from ringserve import LLM
    from ringserve.engine.logits_probe import engine_logits
    from ringserve.sampling_params import SamplingParams

    long = prompts_of_lengths([61], seed=7)[0]
    batch = prompts_of_lengths([23, 5, 40], seed=8)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with LLM(folder, device="cpu", dtype="float32", block_size=4, timeout_s=60, **options) as llm:
        tokens = [o.token_ids for o in llm.generate([long, *batch], params)]
        logits = engine_logits(llm.engine, long[:40], prefill=30) if options.get("dp", 1) == 1 else None
        scales = llm.engine.executor.worker.kv_cache.scales
        scales = scales.clone() if scales is not None and options.get("tp", 1) == 1 else None
    return tokens, logits, scales


FP8_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_inputs_per_token(model, names=FP8_PROJECTIONS):
    """Hooks on a transformers model's projections named `names` that quantise each one's
    input per token to e4m3 and read it back, as an FP8 projection's matmul does
    (kernels/skinny_matmul.fp8_matmul); returns the model."""
    from ringserve.kernels.skinny_matmul import quantize_rows

    def quantize_input(module, args):
        (x,) = args
        xq, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
        return ((xq.float() * scale).reshape(x.shape).to(x.dtype),)

    for name, module in model.named_modules():
        if name.endswith(names):
            module.register_forward_pre_hook(quantize_input)
    return model


def fake_quantized_moe_hf(folder: str):
    """transformers' MoE model with each projection's and each expert's weights quantised per
    row and read back, and (quantized_inputs) the input of every matmul with one of those
    weights quantised per token, as the engine's FP8 matmuls do."""
    from ringserve.kernels.skinny_matmul import quantize_rows
    from ringserve.model.tiny_models import hf_model

    model = hf_model(folder)
    model.config._experts_implementation = "eager"  # expert by expert, through F.linear
    weights = set()
    with torch.no_grad():
        for name, module in model.named_modules():
            stacked = [module.gate_up_proj, module.down_proj] if name.endswith("mlp.experts") else []
            rows = (
                [module.weight]
                if name.endswith(FP8_PROJECTIONS)
                else [w[e] for w in stacked for e in range(len(w))]
            )
            for weight in rows:
                wq, scale = quantize_rows(weight)
                weight.copy_(wq.float() * scale)
                weights.add(weight.data_ptr())
    original = torch.nn.functional.linear

    def quantized_inputs(x, weight, bias=None):
        if weight.data_ptr() in weights:
            xq, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
            x = (xq.float() * scale).reshape(x.shape).to(x.dtype)
        return original(x, weight, bias)

    return model, quantized_inputs


def varied_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """`count` random prompts of 3 .. 42 tokens (lengths cycling through that range)."""
    return prompts_of_lengths([3 + (i * 7) % 40 for i in range(count)], seed=seed)


def generate_tokens(folder: str, prompts, params, **options):
    """(each prompt's output tokens, the engine's spec_stats, its preemptions) of one LLM
    run in float32 on the CPU with blocks of 4 tokens."""
    from ringserve import LLM

    with LLM(folder, device="cpu", dtype="float32", block_size=4, **options) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.token_ids) for o in outputs], llm.engine.spec_stats, llm.engine.num_preemptions
