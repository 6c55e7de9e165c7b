"""Settings measured by `ringserve bench allreduce` and `cp-calibrate` cannot contradict the
tables they come from: derived from medians over repeats, in size bands auto can follow,
and refused (exit 1, nothing saved) when they disagree with their table. The derivations
are pure functions, checked here on synthetic timing tables; no ranks are started."""

import json
import math
import random

import pytest

from ringserve.parallel import allreduce_bench
from ringserve.parallel.allreduce import load_thresholds
from ringserve.parallel.allreduce_bench import (
    ALGORITHMS,
    contradictions,
    median_latency,
    thresholds_from,
)
from ringserve.parallel.cp import calibrate as cp_calibrate
from ringserve.parallel.cp.policy import CPCalibration

KIB, MIB = 1 << 10, 1 << 20
SIZES = allreduce_bench.DEFAULT_SIZES[:6]  # 4 KiB .. 4 MiB, as `ringserve bench allreduce` on CPU


def table(winners: dict, margin: float = 1.0) -> dict:
    """(nbytes, algorithm) -> latency: the winner of each size at 10 us, the others slower by
    `margin` (relative)."""
    return {(n, a): 10.0 if a == w else 10.0 * (1 + margin) for n, w in winners.items() for a in ALGORITHMS}


def bands(thresholds: dict) -> tuple[int, int]:
    return thresholds["one_shot_max_bytes"], thresholds["two_shot_max_bytes"]


def real_case_samples(repeats: int = 5) -> dict:
    """The case that once saved one_shot_max_bytes 0: one_shot fastest from 4 KiB to 1 MiB,
    two_shot at 4 MiB, but in one repeat (the sweep's very first collectives) one_shot at
    4 KiB took 300 us against torch's 40."""
    samples = {}
    for n in SIZES:
        winner = "one_shot" if n <= MIB else "two_shot"
        for a in ALGORITHMS:
            samples[(n, a)] = [(20.0 if a == winner else 40.0) + r for r in range(repeats)]
    samples[(4 * KIB, "one_shot")][0] = 300.0
    return samples


def test_real_case_a_noisy_repeat_does_not_turn_the_fast_path_off():
    samples = real_case_samples()
    latency = median_latency(samples)
    assert bands(thresholds_from(latency, SIZES)) == (MIB, 4 * MIB)
    assert contradictions(latency, SIZES, thresholds_from(latency, SIZES)) == []
    # What the old derivation saved from that table contradicts it at every one_shot size.
    wrong = contradictions(latency, SIZES, {"one_shot_max_bytes": 0, "two_shot_max_bytes": 0})
    assert [w.split()[0] for w in wrong] == [str(n) for n in SIZES]
    assert "16384 bytes would use torch (42.0 us) but one_shot took 22.0 us" in wrong[1]
    # The noisy sweep on its own gives bands that its own table refutes: never saved.
    first_sweep = {key: values[0] for key, values in samples.items()}
    assert contradictions(first_sweep, SIZES, thresholds_from(first_sweep, SIZES)) != []


def test_a_single_size_within_tolerance_does_not_split_a_band():
    winners = {n: "one_shot" for n in SIZES}
    latency = table(winners)
    # At 64 KiB two_shot is 5% faster, at 4 KiB torch is: noise, not a band of their own.
    latency[(64 * KIB, "two_shot")] = latency[(64 * KIB, "one_shot")] / 1.05
    latency[(4 * KIB, "torch")] = latency[(4 * KIB, "one_shot")] / 1.05
    thresholds = thresholds_from(latency, SIZES)
    assert bands(thresholds) == (4 * MIB, 4 * MIB)
    assert contradictions(latency, SIZES, thresholds) == []


def test_non_monotone_wins_give_the_best_bands_and_are_refused():
    # one_shot, torch, one_shot, one_shot, two_shot, torch: torch's clear win at 16 KiB
    # cannot be followed by size bands.
    winners = dict(zip(SIZES, ["one_shot", "torch", "one_shot", "one_shot", "two_shot", "torch"]))
    latency = table(winners)
    thresholds = thresholds_from(latency, SIZES)
    assert bands(thresholds) == (256 * KIB, MIB)
    wrong = contradictions(latency, SIZES, thresholds)
    assert len(wrong) == 1 and wrong[0].startswith(
        "16384 bytes would use one_shot (20.0 us) but torch took 10.0"
    )
    # two_shot winning inside one_shot's band, by 2x: three fits lose as much (256 KiB to
    # torch or two_shot, or 64 KiB to one_shot); the first, with the smaller bands.
    winners = dict(zip(SIZES, ["one_shot", "one_shot", "two_shot", "one_shot", "torch", "torch"]))
    latency = table(winners)
    thresholds = thresholds_from(latency, SIZES)
    assert bands(thresholds) == (16 * KIB, 64 * KIB)
    assert [w.split()[0] for w in contradictions(latency, SIZES, thresholds)] == [str(256 * KIB)]


def test_band_shaped_tables_give_their_own_bands():
    """Any table whose winners already form the three bands (with noise below the tolerance
    on every cell) gives exactly those bands and no contradiction; and a band is a
    contiguous range of sizes whatever the table."""
    rng = random.Random(0)
    for _ in range(300):
        i = rng.randint(0, len(SIZES))
        j = rng.randint(i, len(SIZES))
        winners = dict(zip(SIZES, ["one_shot"] * i + ["two_shot"] * (j - i) + ["torch"] * (len(SIZES) - j)))
        latency = {
            key: value * rng.uniform(1, 1.04) for key, value in table(winners, rng.uniform(0.2, 3)).items()
        }
        thresholds = thresholds_from(latency, SIZES)
        assert bands(thresholds) == (SIZES[i - 1] if i else 0, SIZES[j - 1] if j else 0)
        assert contradictions(latency, SIZES, thresholds) == []
        noisy = {key: value * rng.uniform(0.3, 3) for key, value in latency.items()}
        one_shot_max, two_shot_max = bands(thresholds_from(noisy, SIZES))
        assert one_shot_max <= two_shot_max and {one_shot_max, two_shot_max} <= {0, *SIZES}


def run_bench(main, *extra):
    return main(
        ["bench", "allreduce", "--world-size", "2", "--device", "cpu", "--sizes"]
        + [str(n) for n in SIZES]
        + list(extra)
    )


def test_bench_allreduce_refuses_to_save_a_contradicting_result(tmp_path, monkeypatch, capsys):
    from ringserve.cli.main import main

    monkeypatch.setenv("RINGSERVE_CACHE", str(tmp_path))
    stored = tmp_path / "allreduce_thresholds.json"
    winners = dict(zip(SIZES, ["one_shot", "torch", "one_shot", "one_shot", "two_shot", "torch"]))
    samples = {key: [value] * 3 for key, value in table(winners).items()}
    monkeypatch.setattr(allreduce_bench, "measure", lambda *args: samples)
    assert run_bench(main) == 1
    captured = capsys.readouterr()
    assert "16384 bytes would use one_shot" in captured.err and "nothing was saved" in captured.err
    assert not stored.exists()
    # Printing only: the same warning, exit 0.
    assert run_bench(main, "--no-save") == 0
    assert "warning: these thresholds contradict the table" in capsys.readouterr().out
    # A table that bands follow is saved, and auto then reads it.
    monkeypatch.setattr(allreduce_bench, "measure", lambda *args: real_case_samples())
    assert run_bench(main) == 0
    assert bands(load_thresholds("cpu", 2)) == (MIB, 4 * MIB)
    # A later contradicting run leaves it as it was.
    before = stored.read_text()
    monkeypatch.setattr(allreduce_bench, "measure", lambda *args: {k: [v] for k, v in table(winners).items()})
    assert run_bench(main) == 1
    assert stored.read_text() == before and json.loads(before)["cpu"]["2"]["one_shot_max_bytes"] == MIB


# cp-calibrate ----------------------------------------------------------------------------


def test_calibration_is_the_median_of_its_repeats():
    flops = [2.0e10, 2.1e10, 9.0e10, 1.9e10, 2.0e10]  # one run 4x too fast: a timer glitch
    bandwidth = [1.0e9, 1.1e9, 0.9e9, 0.2e9, 1.0e9]  # one hop slowed by another process
    result = cp_calibrate.calibration_from(flops, bandwidth)
    assert result == CPCalibration(attention_flops=2.0e10, link_bytes_per_s=1.0e9)
    assert cp_calibrate.contradictions(flops, bandwidth, result) == []
    # The best repeat (what a min-time measurement stores) is the outlier: refused.
    best = CPCalibration(attention_flops=max(flops), link_bytes_per_s=max(bandwidth))
    wrong = cp_calibrate.contradictions(flops, bandwidth, best)
    assert len(wrong) == 1 and wrong[0].startswith("attention 0.09 TFLOP/s but only 1 of 5 repeats")


@pytest.mark.parametrize(
    "flops, bandwidth, problem",
    [
        ([1e9, 3e9, 9e9, 27e9, 81e9], [1e9] * 5, "attention 0.009 TFLOP/s but only 1 of 5 repeats"),
        ([2e10] * 5, [1e9, 1e9, math.inf, math.inf, math.inf], "ring hop rate inf is not a positive number"),
    ],
)
def test_calibration_refuses_repeats_that_do_not_agree(flops, bandwidth, problem):
    result = cp_calibrate.calibration_from(flops, bandwidth)
    wrong = cp_calibrate.contradictions(flops, bandwidth, result)
    assert len(wrong) == 1 and wrong[0].startswith(problem)


def test_cp_calibrate_refuses_to_save_a_contradicting_result(tmp_path, monkeypatch, capsys):
    from ringserve.cli.main import main

    monkeypatch.setenv("RINGSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(cp_calibrate, "measure_attention_flops", lambda device, repeats: [1e9, 3e9, 9e9])
    monkeypatch.setattr(cp_calibrate, "measure_ring_bandwidth", lambda device, repeats: [1e9] * 3)
    assert main(["bench", "cp-calibrate", "--device", "cpu", "--repeats", "3"]) == 1
    assert "nothing was saved" in capsys.readouterr().err
    assert not (tmp_path / "cp_calibration.json").exists()
    assert CPCalibration.load("cpu") == CPCalibration(attention_flops=20e9, link_bytes_per_s=2e9)
