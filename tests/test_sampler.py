"""The batched sampler against exact distributions, per-row references and batch independence.

Distribution checks draw N samples with fixed seeds and compare the frequencies with the
target distribution, computed here independently of the sampler, by a chi-square test.
Each test rejects at p < 1e-4: were the sampler exact, a given choice of seeds would fail
a check with probability 1e-4 (the seeds are fixed, so a passing test stays passing).
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from ringserve.engine.sampler import SamplingTensors, filtered_logits, sample, sample_tokens
from ringserve.engine.sequence import Sequence
from ringserve.sampling_params import SamplingParams

P_THRESHOLD = 1e-4  # false-failure rate of each chi-square check for an exact sampler
# Ten tokens whose probabilities are all notable at temperatures 0.5 to 2 (expected counts >= 5).
LOGITS = torch.tensor([0.3, 2.0, -0.4, 1.5, 0.0, 1.0, -1.6, 0.6, -0.8, -1.2])


def make_seq(params: SamplingParams, generated: int = 0) -> Sequence:
    seq = Sequence("r", [1, 2, 3], params)
    seq.output_token_ids = [0] * generated  # the step counter of the request's RNG
    return seq


def reference_filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The sampler's former per-row filter, logits [V] -> logits with dropped tokens at -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop[0] = False
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def target_distribution(logits, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    """Exact float64 distribution [V]: softmax(logits / T) on the top-k set, then the nucleus
    (the likeliest tokens until their mass reaches top_p, the crossing one included), renormalised."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = torch.argsort(probs, descending=True).tolist()
    kept = order[:top_k] if top_k else order
    mass = probs[kept].sum()
    nucleus, before = [], 0.0
    for tok in kept:
        if before >= top_p:
            break
        nucleus.append(tok)
        before += (probs[tok] / mass).item()
    out = torch.zeros_like(probs)
    out[nucleus] = probs[nucleus]
    return out / out.sum()


def chi2_pvalue(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of counts [V] against probabilities [V] (zero-probability
    tokens are left out; callers check separately that they never occur)."""
    allowed = expected_probs > 0
    n = counts.sum().double()
    expected = n * expected_probs[allowed]
    assert expected.min() >= 5, "chi-square needs expected counts >= 5"
    stat = ((counts[allowed].double() - expected) ** 2 / expected).sum()
    dof = int(allowed.sum()) - 1
    # Survival function of chi2(dof): regularised upper incomplete gamma Q(dof/2, x/2).
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2).item()


def draw(params: SamplingParams, seeds: int, steps: int, logits=LOGITS) -> torch.Tensor:
    """Counts [V] of seeds * steps draws: `seeds` rows with distinct seeds, each at `steps` counters."""
    counts = torch.zeros(logits.shape[-1], dtype=torch.int64)
    batch = logits.expand(seeds, -1)
    for step in range(steps):
        seqs = [make_seq(SamplingParams(**{**vars(params), "seed": s}), step) for s in range(seeds)]
        tokens = sample_tokens(batch, SamplingTensors.from_seqs(seqs, "cpu", logits.shape[-1]))
        counts += torch.bincount(tokens, minlength=logits.shape[-1])
    return counts


def check_distribution(counts: torch.Tensor, target: torch.Tensor) -> None:
    outside = counts[target == 0]
    assert outside.sum() == 0, f"tokens outside the allowed set drawn: {counts.tolist()} vs {target.tolist()}"
    p = chi2_pvalue(counts, target)
    assert p > P_THRESHOLD, (
        f"p={p:.3g}: counts {counts.tolist()}, expected {(target * counts.sum()).tolist()}"
    )


def test_chi2_pvalue_sanity():
    """The test's own oracle: a perfect fit passes, a clear misfit fails."""
    probs = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    assert chi2_pvalue(torch.tensor([5000, 3000, 2000]), probs) == pytest.approx(1.0)
    assert chi2_pvalue(torch.tensor([5300, 2850, 1850]), probs) < P_THRESHOLD
    # chi2(2) sf(x) = exp(-x / 2): a known closed form.
    stat_counts = torch.tensor([5100, 3000, 1900])
    stat = (100**2 / 5000) + (100**2 / 2000)
    assert chi2_pvalue(stat_counts, probs) == pytest.approx(torch.exp(torch.tensor(-stat / 2)).item())


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_distribution(temperature):
    params = SamplingParams(temperature=temperature)
    check_distribution(draw(params, seeds=2000, steps=10), target_distribution(LOGITS, temperature))


def test_draws_vary_over_steps_of_one_seed():
    """One request's successive steps are independent draws (the counter feeds the RNG)."""
    counts = torch.zeros(10, dtype=torch.int64)
    for chunk in range(4):
        seqs = [make_seq(SamplingParams(seed=7), chunk * 5000 + i) for i in range(5000)]
        tokens = sample_tokens(LOGITS.expand(5000, -1), SamplingTensors.from_seqs(seqs, "cpu", 10))
        counts += torch.bincount(tokens, minlength=10)
    check_distribution(counts, target_distribution(LOGITS))


def test_draws_vary_over_seeds_at_one_step():
    counts = draw(SamplingParams(temperature=1.0), seeds=20000, steps=1)
    check_distribution(counts, target_distribution(LOGITS))


def test_top_k_distribution():
    params = SamplingParams(temperature=1.0, top_k=4)
    check_distribution(draw(params, seeds=2000, steps=10), target_distribution(LOGITS, top_k=4))


def test_top_p_keeps_the_crossing_token():
    """Sorted probabilities 0.4, 0.3, 0.2, 0.1 with top_p 0.6: the likeliest token alone (0.4)
    falls short, so the second one, which crosses 0.6, is kept with its 0.3; the third is not."""
    logits = torch.log(torch.tensor([0.1, 0.3, 0.4, 0.2]))
    target = target_distribution(logits, top_p=0.6)
    assert torch.allclose(target, torch.tensor([0, 3 / 7, 4 / 7, 0], dtype=torch.float64))
    check_distribution(draw(SamplingParams(top_p=0.6), seeds=2000, steps=10, logits=logits), target)


def test_top_p_at_an_exact_boundary_keeps_the_smallest_set_that_reaches_it():
    """Four equal tokens (0.25 each, exact in float32): top_p 0.5 is reached by two of them
    exactly, so the third is dropped; 0.75 by three; just above 0.5, three are needed."""
    logits = torch.zeros(1, 4)
    for top_p, kept in ((0.25, 1), (0.5, 2), (0.75, 3), (0.5001, 3)):
        params = SamplingParams(temperature=1.0, top_p=top_p)
        out = filtered_logits(logits, SamplingTensors.from_seqs([make_seq(params)], "cpu", 4))
        assert int(torch.isfinite(out).sum()) == kept, top_p


def test_top_p_of_one_keeps_every_top_k_token():
    """One token holds all the float32 mass: the cumulative sum before every other token is
    exactly 1.0, yet top_p = 1 must drop nothing beyond what top-k drops."""
    logits = torch.tensor([[100.0] + [0.0] * 99])
    seq = make_seq(SamplingParams(temperature=1.0, top_k=50, top_p=1.0))
    kept = filtered_logits(logits, SamplingTensors.from_seqs([seq], "cpu", 100)).isfinite()
    assert int(kept.sum()) == 100  # all tied at or above the 50th value: ties with the k-th kept


def test_top_p_distribution():
    """Cumulative probabilities 0.36, 0.58, 0.72, 0.81, 0.87, ...: top_p 0.85 keeps five tokens,
    the fifth (mass 0.07) because only 0.81 comes before it."""
    target = target_distribution(LOGITS, top_p=0.85)
    assert int((target > 0).sum()) == 5
    check_distribution(draw(SamplingParams(top_p=0.85), seeds=2000, steps=10), target)


def test_top_k_top_p_temperature_combined():
    """Top-p applies to the temperature-scaled distribution renormalised over the top-k set."""
    params = SamplingParams(temperature=1.5, top_k=6, top_p=0.75)
    target = target_distribution(LOGITS, 1.5, top_k=6, top_p=0.75)
    # Four tokens (the top-6 mass before the fourth is 0.70): fewer than top-k keeps, and not
    # the three kept at temperature 1.
    assert int((target > 0).sum()) == 4
    assert int((target_distribution(LOGITS, 1.0, top_k=6, top_p=0.75) > 0).sum()) == 3
    check_distribution(draw(params, seeds=2000, steps=10), target)


def test_filtering_per_row_matches_reference():
    """A batch with mixed parameters filters each row as the per-row reference does."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 50, generator=g) * 3
    params = [
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.5),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, top_k=20, top_p=0.9),
        SamplingParams(temperature=2.0, top_k=1),
        SamplingParams(temperature=0.9, top_p=0.05),  # the top token only
    ]
    tensors = SamplingTensors.from_seqs([make_seq(p) for p in params], "cpu", 50)
    assert tensors.needs_sort and not tensors.all_greedy
    got = filtered_logits(logits, tensors)
    for row, p in enumerate(params):
        if p.greedy:
            continue
        want = reference_filter(logits[row] / p.temperature, p.top_k, p.top_p)
        assert torch.equal(torch.isinf(got[row]), torch.isinf(want)), row
        assert torch.allclose(got[row][~torch.isinf(want)], want[~torch.isinf(want)]), row
    assert int(torch.isfinite(got[6]).sum()) == 1


@pytest.mark.parametrize("temperature", [1e-6, 1e-40, 1e-300, 5e-324])
def test_a_tiny_temperature_is_greedy(temperature):
    # found by fuzzing the server: 1e-300 is 0 in float32, so logits / temperature were NaN
    # and every seed drew the same arbitrary token
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=temperature, seed=seed) for seed in range(4)]
    assert all(p.greedy for p in params)
    assert [sample(logits, [make_seq(p)])[0] for p in params] == [int(logits.argmax())] * 4


def test_seed_reproduces_and_seeds_differ():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, seed=42)
    first = [sample(logits, [make_seq(params, step)])[0] for step in range(20)]
    again = [sample(logits, [make_seq(params, step)])[0] for step in range(20)]
    other = [sample(logits, [make_seq(SamplingParams(seed=43), step)])[0] for step in range(20)]
    assert first == again
    assert first != other
    assert len(set(first)) > 10  # the steps draw anew


def run_steps(seqs: list[Sequence], logits_of: dict[str, torch.Tensor], steps: int) -> dict[str, list[int]]:
    """Sample `steps` tokens for each sequence, appending them as the engine does; each
    request's logits at step t are logits_of[request_id][t]."""
    for step in range(steps):
        logits = torch.stack([logits_of[s.request_id][step] for s in seqs])
        for seq, token in zip(seqs, sample(logits, seqs)):
            seq.output_token_ids.append(token)
    return {s.request_id: s.output_token_ids for s in seqs}


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=5),
        SamplingParams(temperature=1.0, seed=5),  # no filter: no sort alone, a sort in the batch
    ],
)
def test_seeded_request_ignores_its_batch(params):
    """A seeded row draws the same tokens alone, or at any position among neighbours with
    other parameters (greedy, unseeded, other seeds, top-k / top-p)."""
    steps, vocab = 8, 200
    g = torch.Generator().manual_seed(2)
    names = ["target", "greedy", "unseeded", "other", "topk", "topp"]
    logits_of = {name: torch.randn(steps, vocab, generator=g) * 2 for name in names}
    neighbours = {
        "greedy": SamplingParams(temperature=0),
        "unseeded": SamplingParams(temperature=1.2),
        "other": SamplingParams(temperature=0.6, seed=6),
        "topk": SamplingParams(temperature=1.0, top_k=3, seed=5),  # the same seed, other params
        "topp": SamplingParams(temperature=1.0, top_p=0.3, seed=7),
    }

    def seq(name, p):
        return Sequence(name, [1, 2, 3], p)

    alone = run_steps([seq("target", params)], logits_of, steps)["target"]
    assert len(set(alone)) > 1
    for position in (0, 2, 5):
        batch = [seq(n, p) for n, p in neighbours.items()]
        batch.insert(position, seq("target", params))
        assert run_steps(batch, logits_of, steps)["target"] == alone, position
    # Joining neighbours that are already further on (other step counters): the same draws.
    late = [seq(n, p) for n, p in neighbours.items()]
    for s in late:
        s.output_token_ids = [0] * 3
    assert run_steps([*late, seq("target", params)], logits_of, steps)["target"] == alone


def test_greedy_rows_take_the_argmax():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=g)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_p=0.5, seed=1)] * 3
    tokens = torch.tensor(sample(logits, [make_seq(p) for p in params]))
    argmax = logits.argmax(dim=-1)
    assert torch.equal(tokens[0::2], argmax[0::2])
    # top_k=1 is greedy whatever the temperature.
    assert sample(logits, [make_seq(SamplingParams(temperature=5.0, top_k=1, seed=s)) for s in range(6)]) == (
        argmax.tolist()
    )


class RecordTorchCalls(TorchFunctionMode):
    """Records the names of the torch functions and tensor methods called under it."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def torch_calls(logits: torch.Tensor, seqs: list[Sequence]) -> list[str]:
    """The torch calls of sample_tokens for this batch, indexing and attribute reads left out."""
    tensors = SamplingTensors.from_seqs(seqs, "cpu", logits.shape[-1])
    with RecordTorchCalls() as record:
        sample_tokens(logits, tensors)
    return [n for n in record.names if n not in ("__get__", "__getitem__")]


SORTS = {"sort", "argsort", "msort", "topk", "kthvalue"}


def test_all_greedy_batch_only_takes_the_argmax():
    """Top-k / top-p of greedy requests are moot: no sort, no noise, just the argmax."""
    logits = torch.randn(4, 100)
    greedy = [make_seq(SamplingParams(temperature=0, top_k=5, top_p=0.5)) for _ in range(4)]
    assert torch_calls(logits, greedy) == ["argmax"]
    assert sample(logits, greedy) == logits.argmax(-1).tolist()


def test_one_sort_only_when_a_filter_needs_it():
    logits = torch.randn(3, 100)
    plain = [make_seq(SamplingParams(temperature=0.7, top_k=100)), make_seq(SamplingParams(temperature=0))]
    assert not SORTS & set(torch_calls(logits[:2], plain))  # top_k = V filters nothing
    calls = torch_calls(logits, [*plain, make_seq(SamplingParams(top_k=3))])
    assert [n for n in calls if n in SORTS] == ["sort"]  # one sort for the whole batch
    calls = torch_calls(logits[:2], [plain[0], make_seq(SamplingParams(top_p=0.9))])
    assert [n for n in calls if n in SORTS] == ["sort"]


def test_sample_tokens_does_not_read_the_device(monkeypatch):
    """No .item() / .tolist() / truth test of a tensor inside: nothing that would sync a GPU."""
    seqs = [
        make_seq(SamplingParams(temperature=0)),
        make_seq(SamplingParams(temperature=0.9, top_k=7, top_p=0.8, seed=3), 4),
        make_seq(SamplingParams(temperature=1.1)),
    ]
    tensors = SamplingTensors.from_seqs(seqs, "cpu", 64)
    logits = torch.randn(3, 64)

    def forbidden(*args, **kwargs):
        raise AssertionError("host read of a device tensor")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "numpy", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    tokens = sample_tokens(logits, tensors)
    monkeypatch.undo()
    assert tokens.shape == (3,) and tokens.dtype == torch.int64


def test_unseeded_requests_get_their_own_seed():
    a, b = make_seq(SamplingParams()), make_seq(SamplingParams())
    assert a.sampling_seed != b.sampling_seed
    assert make_seq(SamplingParams(seed=11)).sampling_seed == 11
    # Seeds of any size or sign are keyed by their 64 bits; seed and seed + 2^32 differ.
    logits = torch.zeros(1, 1000)
    draws = {s: sample(logits, [make_seq(SamplingParams(seed=s))]) for s in (-1, 1, 2**32 + 1, 2**70)}
    assert len({tuple(v) for v in draws.values()}) == 4


def test_empty_batch():
    assert sample(torch.zeros(0, 10), []) == []


def test_gumbel_noise_is_finite_and_exact_at_the_extreme_hashes():
    """The largest noise comes from hashes whose top 24 bits are all ones (u = 1 - 2^-25):
    it must be finite (in float32, u rounds to 1.0 there and the noise to +inf, a token that
    wins whatever its logit, even one top-k removed) and equal -log(-log(u)) in float64."""
    from ringserve.engine.sampler import _gumbel_of_hash

    h = torch.tensor([0, 1 << 8, (1 << 32) - (1 << 9), (1 << 32) - 1], dtype=torch.int64)
    noise = _gumbel_of_hash(h)
    u = ((h >> 8).double() + 0.5) / (1 << 24)
    expected = (-torch.log(-torch.log(u))).float()
    assert torch.isfinite(noise).all()
    torch.testing.assert_close(noise, expected, rtol=0, atol=0)
