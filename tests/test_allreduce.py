"""Every allreduce backend against torch.distributed.all_reduce, on gloo ranks."""

import pytest
import torch
import torch.distributed as dist

from ringserve.parallel.allreduce import AllReduce, load_thresholds
from ringserve.parallel.local_world import run_local_world

SIZES = [1, 3, 7, 64, 1000, 4097, 65537]  # odd sizes: not multiples of the world size


def _compare_backends(rank, world_size):
    worst = {}
    for backend in ("torch", "one_shot", "two_shot", "auto"):
        op = AllReduce(dist.group.WORLD, backend)
        for size in SIZES:
            for shape in ((size,), (size, 3)):
                g = torch.Generator().manual_seed(1000 * size + rank)
                x = torch.randn(*shape, generator=g)
                expected = x.clone()
                dist.all_reduce(expected)
                got = op(x.clone())
                assert got.shape == x.shape
                err = (got - expected).abs().max().item()
                worst[backend] = max(worst.get(backend, 0.0), err)
                # Every rank must hold the very same sum.
                gathered = [torch.empty_like(got) for _ in range(world_size)]
                dist.all_gather(gathered, got)
                assert all(torch.equal(gathered[0], t) for t in gathered)
    return worst


@pytest.mark.parametrize("world_size", [2, 4])
def test_backends_equal_torch_all_reduce(world_size):
    for worst in run_local_world(_compare_backends, world_size, timeout_s=60):
        for backend, err in worst.items():
            assert err < 1e-5, f"{backend} differs from all_reduce by {err}"


def _dispatch(rank, world_size):
    op = AllReduce(
        dist.group.WORLD, "auto", thresholds={"one_shot_max_bytes": 1024, "two_shot_max_bytes": 8192}
    )
    return [op.choose(n) for n in (4, 1024, 1028, 8192, 8196)]


def test_auto_picks_by_message_size():
    assert run_local_world(_dispatch, 2)[0] == ["one_shot", "one_shot", "two_shot", "two_shot", "torch"]


def test_default_thresholds_follow_published_figures():
    assert load_thresholds("no-such-device", 8)["one_shot_max_bytes"] == 256 << 10


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown allreduce backend"):
        AllReduce(None, "ring")


def test_bench_allreduce_command_stores_thresholds(tmp_path, monkeypatch, capsys):
    """Real timings on two gloo ranks. One size: whichever backend wins there, size bands can
    follow it, so a busy machine cannot make the result contradict its table (that refusal
    is tested on synthetic tables in test_measured_settings.py)."""
    from ringserve.cli.main import main

    monkeypatch.setenv("RINGSERVE_CACHE", str(tmp_path))
    assert (
        main(
            [
                "bench",
                "allreduce",
                "--world-size",
                "2",
                "--device",
                "cpu",
                "--sizes",
                "65536",
                "--iters",
                "2",
                "--repeats",
                "3",
            ]
        )
        == 0
    )
    assert "auto thresholds" in capsys.readouterr().out
    stored = load_thresholds("cpu", 2)
    assert set(stored) == {"one_shot_max_bytes", "two_shot_max_bytes"}
    assert (tmp_path / "allreduce_thresholds.json").is_file()
