"""Tests are hermetic: what ringserve writes to its cache (measurements, GGUF conversions)
goes to the test session's temporary cache (conftest.pytest_configure), in this process and
in the processes it starts, never to the user's ~/.cache/ringserve."""

import os
import subprocess
import sys

from ringserve.cache_dir import CACHE_ENV, cache_root


def test_nothing_reaches_the_home_cache(tmp_path, monkeypatch, capsys, builtin_dir, pytestconfig):
    from ringserve.cli.main import main
    from ringserve.model.gguf_import import builtin_model_path, converted_folder

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))  # where ~ would lead, were the session cache not set
    # A conversion of the built-in model, a measurement saved here and one saved by a process
    # started here.
    converted = converted_folder(builtin_model_path())
    args = ["bench", "allreduce", "--world-size", "2", "--device", "cpu", "--sizes", "4096"]
    assert main(args + ["--iters", "1", "--repeats", "1"]) == 0
    code = "from ringserve.measurements import save_measurement; print(save_measurement('probe', 1, 'cpu'))"
    saved = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout

    assert list(home.iterdir()) == []
    session_cache = pytestconfig.ringserve_cache
    assert os.environ[CACHE_ENV] == cache_root() == session_cache
    assert converted == builtin_dir and builtin_dir.startswith(session_cache)  # converted once
    assert f"saved to {session_cache}" in capsys.readouterr().out
    assert saved.strip() == os.path.join(session_cache, "probe.json")
