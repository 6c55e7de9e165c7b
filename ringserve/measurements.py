"""Machine measurements the engine's choices use (allreduce bands, CP rates), stored as JSON
under the cache folder (ringserve/cache_dir.py), keyed by device type."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from ringserve.cache_dir import cache_root
from ringserve.errors import MeasurementRejected

# Timings per measured cell (`--repeats` of `ringserve bench allreduce` / `cp-calibrate`);
# their median is what counts, so one noisy timing cannot decide a setting.
DEFAULT_REPEATS = 5


def measurement_path(name: str) -> str:
    return os.path.join(cache_root(), f"{name}.json")


def load_measurement(name: str, *keys: str):
    """The stored value under keys (e.g. device type, world size), or None."""
    try:
        with open(measurement_path(name)) as f:
            value = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def save_measurement(name: str, value, *keys: str) -> str:
    """Store value under keys, keeping the file's other entries; returns the path."""
    path = measurement_path(name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError):
        data = {}
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    return path


def save_unless_contradicted(problems: list[str], advice: str, save: bool, store: Callable[[], str]) -> None:
    """Store a derived setting (store() saves it and returns the path) only if nothing in the
    table it came from contradicts it: else MeasurementRejected (when saving) or a warning
    (printing only), naming each problem and what to do; the stored value stays as it was."""
    if problems:
        message = "; ".join(problems) + ". " + advice
        if save:
            raise MeasurementRejected(message + "; nothing was saved")
        print(f"warning: {message}")
    elif save:
        print(f"saved to {store()}")
