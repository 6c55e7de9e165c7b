"""Expert parallelism on gloo ranks: against the single-rank result (checked against
transformers by the model tests), transformers itself, and the flat all-to-all."""

import datetime

import pytest
import torch

from ringserve import LLM, SamplingParams
from ringserve.config import ParallelConfig
from ringserve.engine.logits_probe import engine_logits
from ringserve.model.decoder import Experts
from ringserve.model.tiny_models import hf_greedy, hf_model
from ringserve.parallel.ep import ExpertParallel, LocalExperts
from ringserve.parallel.local_world import run_local_world
from ringserve.parallel.mesh import Mesh, build_groups

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = [list(range(3, 40)), [5, 17, 42, 99, 3, 250, 7]]


def outputs(folder, **kw):
    with LLM(folder, device="cpu", dtype="float32", block_size=4, timeout_s=60, **kw) as llm:
        tokens = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        logits = engine_logits(llm.engine, list(range(3, 40)), prefill=30)
        experts_held = sum(
            m.gate_proj.shape[0] for m in llm.engine.executor.worker.model.modules() if isinstance(m, Experts)
        )
    return tokens, logits, experts_held


@pytest.mark.parametrize(
    "arch,layout",
    [
        ("mixtral", dict(tp=2, ep=2)),  # attention TP over 2, experts spread over the same 2
        ("mixtral", dict(tp=4, ep=4)),
        ("qwen3_moe", dict(cp=2, ep=2)),
        ("mixtral", dict(tp=2, cp=2, ep=4, ranks_per_host=2)),  # two hosts of 2: two-shot
        # Two EP groups (the TP pairs), each spanning two hosts of one rank: two-shot.
        ("mixtral", dict(tp=2, cp=2, ep=2, ranks_per_host=1)),
        # Fused expert tensors sliced by expert; Llama 4's shared expert stays TP-split.
        ("llama4", dict(tp=2, ep=2)),
        ("llama4", dict(cp=2, ep=2)),  # the shared expert replicated on both ranks, not dispatched
        ("gpt_oss", dict(tp=2, ep=2)),
    ],
)
def test_ep_equals_single_rank_and_transformers(arch, layout, tiny_model_dir):
    folder = tiny_model_dir(arch)
    ref_tokens, ref_logits, all_experts = outputs(folder)
    tokens, logits, held = outputs(folder, **layout)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert tokens == ref_tokens
    assert tokens[1] == hf_greedy(hf_model(folder), PROMPTS[1], 16)
    assert held == all_experts // layout["ep"]  # each rank loaded only its own experts


def _experts(num_experts, seed=0):
    g = torch.Generator().manual_seed(seed)
    e = Experts(num_experts, 16, 24)
    with torch.no_grad():
        for p in e.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return e


def _ep_rank(rank, world_size, parallel):
    """Each EP group of the mesh runs its experts flat and two-shot, with random and skewed
    routing, against every expert run on this rank."""
    groups = build_groups(Mesh.of(parallel), rank, torch.device("cpu"), datetime.timedelta(seconds=30))
    torch.manual_seed(0)
    num_experts, top_k, tokens = 8, 2, 24
    full = _experts(num_experts)
    per = num_experts // groups.ep_size
    mine = Experts(per, 16, 24)
    with torch.no_grad():
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(mine, name).copy_(getattr(full, name)[groups.ep_rank * per : (groups.ep_rank + 1) * per])
    hosts = (groups.ep_intra_host_group, groups.ep_peer_group)
    results = {}
    for routing in ("random", "skewed"):
        g = torch.Generator().manual_seed(100 + rank)  # every rank has its own tokens
        x = torch.randn(tokens, 16, generator=g)
        if routing == "skewed":  # every choice on EP rank 0's experts: the others receive nothing
            ids = torch.tensor([[0, 1]] * tokens)
        else:
            ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
        w = torch.softmax(torch.randn(tokens, top_k, generator=g), -1)
        expected = LocalExperts(lambda y: y)(full, x, ids, w)
        flat = ExpertParallel(groups.ep_group, num_experts, None, *hosts, two_shot=False)
        two = ExpertParallel(groups.ep_group, num_experts, None, *hosts)
        got_flat, got_two = flat(mine, x, ids, w), two(mine, x, ids, w)
        results[routing] = (
            (got_flat - expected).abs().max().item(),
            (got_two - expected).abs().max().item(),
            flat.cross_host_bytes,
            two.cross_host_bytes,
            two.two_shot,
        )
    return results


@pytest.mark.parametrize(
    "parallel",
    [
        ParallelConfig(cp=4, ep=4, ranks_per_host=2),  # one EP group over two hosts of 2
        # Two EP groups (the CP groups 0,2,4,6 and 1,3,5,7), each with two ranks on each of
        # two hosts of 4.
        ParallelConfig(tp=2, cp=4, ep=4, ranks_per_host=4),
        # Experts over two data-parallel replicas (one per host) of cp=2.
        ParallelConfig(dp=2, cp=2, ep=4, ranks_per_host=2),
    ],
)
def test_two_shot_equals_flat_and_sends_less_across_hosts(parallel):
    per_rank = run_local_world(_ep_rank, parallel.world_size, parallel, timeout_s=60)
    for routing in ("random", "skewed"):
        results = [r[routing] for r in per_rank]
        for err_flat, err_two, _, _, two_shot in results:
            assert err_flat < 1e-5 and err_two < 1e-5
            assert two_shot
        flat_bytes = sum(r[2] for r in results)
        two_bytes = sum(r[3] for r in results)
        assert 0 < two_bytes < flat_bytes
        if routing == "skewed":
            # Both choices of every token live on EP rank 0: flat sends two rows per token
            # from the other host, two-shot one.
            assert two_bytes * 2 == flat_bytes


def test_ep_must_match_the_processes():
    with pytest.raises(ValueError, match=r"ep=3 is no product of the mesh's axes dp=1, cp=1, tp=2"):
        LLM(None, device="cpu", tp=2, ep=3)


def test_ep_needs_experts_that_divide(tiny_model_dir):
    with pytest.raises(ValueError, match="ep=2 needs a mixture-of-experts model"):
        LLM(tiny_model_dir("llama"), device="cpu", tp=2, ep=2)
    with pytest.raises(ValueError, match="has 6 experts"):
        LLM(tiny_model_dir("qwen3_moe"), device="cpu", tp=4, ep=4)


def test_local_experts_read_nothing_back_from_the_device(monkeypatch):
    """One rank's MoE path takes every (token, choice) pair as it is: no nonzero (its size is
    data), no bincount, no .tolist() or .item(); on a GPU each would wait for the device in
    every MoE layer. The experts get their group ends as a tensor (only the CPU loop, here,
    reads them on the host)."""
    experts, num_experts, tokens, top_k = _experts(6), 6, 10, 3
    g = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, 16, generator=g)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    ids[0] = torch.tensor([5, 0, 2])  # out of order within a token
    w = torch.softmax(torch.randn(tokens, top_k, generator=g), -1)

    def expert(e, h):
        return (torch.nn.functional.silu(h @ experts.gate_proj[e].t()) * (h @ experts.up_proj[e].t())) @ (
            experts.down_proj[e].t()
        )

    expected = torch.stack(
        [sum(w[t, j] * expert(ids[t, j], x[t]) for j in range(top_k)) for t in range(tokens)]
    )
    reading_allowed, ends_seen = [False], []

    def forbidden(*args, **kwargs):
        raise AssertionError("the local MoE path synchronised with the device")

    def guarded(real):
        def call(*args, **kwargs):
            if not reading_allowed[0]:
                forbidden()
            return real(*args, **kwargs)

        return call

    real_grouped = Experts.grouped_forward

    def grouped_forward(self, rows, ends):
        ends_seen.append(ends)
        reading_allowed[0] = True  # the CPU loop reads the ends: the CPU is the host
        try:
            return real_grouped(self, rows, ends)
        finally:
            reading_allowed[0] = False

    monkeypatch.setattr(Experts, "grouped_forward", grouped_forward)
    for name in ("nonzero", "bincount", "unique"):
        monkeypatch.setattr(torch, name, guarded(getattr(torch, name)))
    for name in ("nonzero", "tolist", "item", "bincount"):
        monkeypatch.setattr(torch.Tensor, name, guarded(getattr(torch.Tensor, name)))
    got = LocalExperts(lambda y: y)(experts, x, ids, w)
    monkeypatch.undo()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    (ends,) = ends_seen
    assert ends.dtype == torch.int32
    assert ends.tolist() == torch.bincount(ids.flatten(), minlength=num_experts).cumsum(0).tolist()
