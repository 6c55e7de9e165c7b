"""The engine's options, defined once: `LLM(...)`, `ringserve generate` and `ringserve serve` are built from them.

`EngineOptions` holds every option with its default and help text, and `validate()` checks
them all (a ValueError that names the option). From it come the command-line flags
(`add_cli_args`, `from_cli_args`), the configs the engine runs on (`parallel_config()`,
`engine_config()`), from which the engine builds itself (`LLMEngine.from_options`). A new
option is a new field
here; tests/test_options.py fails until it reaches the engine from every entry point.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from ringserve.config import DTYPES, EngineConfig, ParallelConfig
from ringserve.config.names import ALLREDUCE_BACKENDS, CP_ALGOS, KV_CACHE_DTYPES, QUANTIZATION_METHODS
from ringserve.config.speculative import SpeculativeConfig
from ringserve.errors import RingserveError


class OptionError(RingserveError, ValueError):
    """An engine option has a value that cannot work; `option` is its name."""

    def __init__(self, option: str, message: str):
        """message: what is wrong; the option's name is put in front unless it starts with it."""
        super().__init__(message if message.startswith(option) else f"{option} {message}")
        self.option = option


def _opt(default, help: str, **meta) -> Any:
    """A field with its help text; meta: cli_flags (the flags, when not --field-name; the
    first is the main one, the others vLLM's names for it), cli_negative (extra flags that
    set a bool to False), cli_all_ranks (a switch that sets the option to every rank of the
    layout, tp x cp x dp), cli_type ("human_int": 32k / 32K), choices."""
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class EngineOptions:
    """Every engine option. Keyword arguments of `LLM(...)`; flags of `ringserve generate/serve`."""

    # The model and where it runs.
    model: str | None = _opt(
        None,
        "Hugging Face model folder (config.json + safetensors) or a .gguf file; "
        "default: the built-in SmolLM2-135M-Instruct",
    )
    device: str = _opt("auto", "cpu, cuda, cuda:N, or auto (a GPU if there is one)")
    dtype: str = _opt(
        "auto", "float32, bfloat16, float16, or auto (the checkpoint's own)", choices=("auto", *DTYPES)
    )
    # Parallelism (ParallelConfig).
    tp: int = _opt(1, "tensor-parallel ranks", cli_flags=("--tp", "-tp", "--tensor-parallel-size"))
    cp: int = _opt(1, "context-parallel ranks")
    dp: int | None = _opt(
        None,
        "data-parallel replicas, each tp x cp ranks with its own requests, scheduler and KV "
        "cache; requests go to the least loaded (default: ep / (tp x cp) when ep needs more "
        "ranks than tp x cp, else 1)",
        cli_flags=("--dp", "-dp", "--data-parallel-size"),
    )
    ep: int = _opt(
        1,
        "expert-parallel ranks (MoE models): tp, cp, dp or a product of them (ep over dp: "
        "attention data-parallel, experts over the replicas)",
        # vLLM's switch: the experts spread over every rank of the layout
        cli_all_ranks="--enable-expert-parallel",
    )
    ranks_per_host: int | None = _opt(
        None,
        "processes per host (hosts hold consecutive ranks, rank = (dp_rank x cp + cp_rank) x tp + tp_rank); "
        "an EP group spanning hosts uses the two-shot all-to-all "
        "(default under torchrun: its LOCAL_WORLD_SIZE; otherwise one host)",
    )
    allreduce: str = _opt(
        "auto",
        "tensor-parallel allreduce: auto picks by message size from `ringserve bench allreduce`",
        choices=ALLREDUCE_BACKENDS,
    )
    cp_algo: str = _opt(
        "auto", "context-parallel ring: auto chooses per step from new vs cached tokens", choices=CP_ALGOS
    )
    timeout_s: float = _opt(
        60.0,
        "seconds a collective may wait before a dead or hung rank stops the run",
        cli_flags=("--timeout", "--timeout-s"),
    )
    # Memory and scheduling (EngineConfig).
    block_size: int = _opt(16, "tokens per KV-cache block")
    num_blocks: int | None = _opt(None, "KV-cache blocks per rank; default: from the memory budget")
    kv_cache_memory: int | None = _opt(
        None,
        "bytes for the KV cache per rank; default: gpu_memory_utilization of free GPU memory, 1 GiB on CPU",
    )
    gpu_memory_utilization: float = _opt(
        0.9, "share of the GPU's free memory (after the weights) the KV cache may take, in (0, 1]"
    )
    max_model_len: int | None = _opt(
        None,
        "longest sequence (prompt + output) in tokens; on the command line 32k is 32000 and "
        "32K is 32768, as vLLM reads them; default: the model's context",
        cli_type="human_int",
    )
    allow_long_max_model_len: bool = _opt(
        False,
        "take a max_model_len above the model's context (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN=1); "
        "positions past the context were never trained, so what the model makes of them is unknown",
    )
    max_num_batched_tokens: int = _opt(
        2048,
        "tokens computed per step while some sequence decodes (so its next token is not held "
        "back); longer prompts are prefilled in chunks",
    )
    max_prefill_tokens: int | None = _opt(
        None,
        "tokens computed per step while no sequence decodes (prompts only: a long prompt alone, "
        "a burst of arrivals); default: the larger of 16384 and max_num_batched_tokens",
    )
    max_num_seqs: int = _opt(256, "sequences running at once")
    quantization: str | None = _opt(
        None,
        "quantise the checkpoint's weights as they load (vLLM's -q / --quantization): fp8 stores "
        "each projection in float8 e4m3 with a scale per output row, activations quantised per "
        "token (half the weight bytes of bf16; GPUs of compute capability 8.9+, and CPUs)",
        cli_flags=("--quantization", "-q"),
        choices=QUANTIZATION_METHODS,
    )
    kv_cache_dtype: str = _opt(
        "auto",
        "KV-cache storage: auto (the model's dtype), or fp8 / fp8_e4m3: float8 e4m3 with a scale "
        "per layer and KV head, twice the tokens in the same memory (vLLM's --kv-cache-dtype)",
        choices=KV_CACHE_DTYPES,
    )
    enable_prefix_caching: bool = _opt(
        True, "reuse cached prompt prefixes", cli_negative=("--no-prefix-caching",)
    )
    speculative_config: str | dict | None = _opt(
        None,
        "speculative decoding, a JSON object as vLLM's: "
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4} guesses up to 4 '
        "tokens a step from the latest earlier occurrence of the last n-gram (n from "
        "prompt_lookup_min to prompt_lookup_max) and checks them in one forward pass; "
        '{"model": "/models/small", "num_speculative_tokens": 4} has a draft model with the same '
        'tokenizer guess them, {"method": "eagle3", "model": "/models/head", ...} an EAGLE-3 head. '
        "The output is the same as without it, in every layout; "
        "under async scheduling steps overlap only while disable_by_batch_size stops drafting",
    )
    enforce_eager: bool = _opt(
        False, "no CUDA graphs: decode steps launch their kernels from Python (slower; for debugging)"
    )
    async_scheduling: bool | None = _opt(
        None,
        "schedule and launch the next step while the device runs this one, so the host's "
        "work hides behind the device's (one rank only); default: on for a one-rank GPU engine",
    )
    show_progress: bool | None = _opt(
        None,
        "progress bars while converting a GGUF file and loading weights; default: when stderr is a terminal",
    )
    tokenizer: str | None = _opt(
        None, "tokenizer folder (its tokenizer files and chat template); default: the model's"
    )
    chat_template: str | None = _opt(
        None, "chat template: a Jinja file, or the template itself; default: the tokenizer's own"
    )
    seed: int | None = _opt(
        None,
        "seed of the sampling seeds that requests without one are given, in the order they "
        "come (vLLM's --seed); default: a new one each start",
    )
    generation_config: str = _opt(
        "auto",
        "where a request's default temperature, top_p, top_k, min_p, repetition_penalty and "
        "max_tokens cap come from: auto (the model folder's generation_config.json, as vLLM), "
        "vllm (none: vLLM's own defaults), or a folder holding a generation_config.json",
    )

    def __post_init__(self):
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        self.validate()
        if self.dp is None:  # resolved once (ep alone implies its replicas): equal layouts compare equal
            self.dp = self.parallel_config().dp

    # Validation -----------------------------------------------------------------------

    def validate(self) -> None:
        """Raise OptionError (a ValueError) naming the first option that cannot work."""
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise OptionError("model", f"must be a path or None (the built-in model), got {self.model!r}")
        self._check_device()
        if not isinstance(self.dtype, torch.dtype):
            _check_choice("dtype", self.dtype, _field("dtype").metadata["choices"])
        for name in ("tp", "cp", "ep", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            _check_int(name, getattr(self, name))
        for name in (
            "dp",
            "ranks_per_host",
            "num_blocks",
            "kv_cache_memory",
            "max_model_len",
            "max_prefill_tokens",
        ):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name))
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < self.max_num_batched_tokens:
            raise OptionError(
                "max_prefill_tokens",
                f"must be at least max_num_batched_tokens ({self.max_num_batched_tokens}), "
                f"got {self.max_prefill_tokens}",
            )
        _check_choice("allreduce", self.allreduce, ALLREDUCE_BACKENDS)
        _check_choice("cp_algo", self.cp_algo, CP_ALGOS)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.quantization is not None:
            _check_choice("quantization", self.quantization, QUANTIZATION_METHODS)
        if not _is_number(self.timeout_s) or not 0 < self.timeout_s < math.inf:
            raise OptionError("timeout_s", f"must be a positive number of seconds, got {self.timeout_s!r}")
        u = self.gpu_memory_utilization
        if not _is_number(u) or not 0 < u <= 1:
            raise OptionError("gpu_memory_utilization", f"must be in (0, 1], got {u!r}")
        for name in ("enable_prefix_caching", "enforce_eager", "allow_long_max_model_len"):
            if not isinstance(getattr(self, name), bool):
                raise OptionError(name, f"must be True or False, got {getattr(self, name)!r}")
        for name in ("async_scheduling", "show_progress"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise OptionError(name, f"must be True, False or None, got {getattr(self, name)!r}")
        if self.tokenizer is not None and (
            not isinstance(self.tokenizer, str) or not os.path.isdir(self.tokenizer)
        ):
            raise OptionError("tokenizer", f"must be a folder, got {self.tokenizer!r}")
        if self.chat_template is not None and (
            not isinstance(self.chat_template, str) or not self.chat_template
        ):
            raise OptionError("chat_template", f"must be a file or a template, got {self.chat_template!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0
        ):
            raise OptionError("seed", f"must be an integer >= 0, got {self.seed!r}")
        g = self.generation_config
        if not isinstance(g, str) or not g or (g not in ("auto", "vllm") and not os.path.isdir(g)):
            raise OptionError("generation_config", f"must be auto, vllm or a folder, got {g!r}")
        try:
            self.speculative()  # parsed here so that a bad value is refused at once
        except ValueError as e:
            raise OptionError("speculative_config", str(e)) from None
        try:
            parallel = self.parallel_config()
        except ValueError as e:
            raise OptionError("ep", str(e)) from None
        if self.async_scheduling and parallel.world_size > 1:
            raise OptionError(
                "async_scheduling",
                f"needs one rank (dp=1, tp=1, cp=1), got dp={parallel.dp} tp={self.tp} cp={self.cp}: "
                "the other ranks could not see tokens that stay on rank 0's device",
            )

    def _check_device(self) -> None:
        device = self.device
        if device == "auto":
            return
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError):
            raise OptionError("device", f"must be cpu, cuda, cuda:N or auto, got {device!r}") from None
        if dev.type not in ("cpu", "cuda"):
            raise OptionError("device", f"must be cpu, cuda, cuda:N or auto, got {device!r}")
        if dev.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count == 0:
                raise OptionError(
                    "device", f"{str(device)!r} was asked for, but PyTorch sees no CUDA GPU (use cpu or auto)"
                )
            if dev.index is not None and dev.index >= count:
                raise OptionError(
                    "device", f"{str(device)!r} is out of range: this machine has {count} GPU(s)"
                )

    # What the engine runs on ------------------------------------------------------------

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ParallelConfig)})

    def engine_config(self) -> EngineConfig:
        return EngineConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig)})

    def speculative(self) -> SpeculativeConfig | None:
        """speculative_config parsed (None: no speculation); a ValueError says what is wrong."""
        return SpeculativeConfig.parse(self.speculative_config)

    def resolved_async_scheduling(self, device: torch.device) -> bool:
        if self.async_scheduling is None:
            return device.type == "cuda" and self.parallel_config().world_size == 1
        return self.async_scheduling

    def resolved_show_progress(self) -> bool:
        if self.show_progress is None:
            return sys.stderr is not None and sys.stderr.isatty()
        return self.show_progress

    # Construction -----------------------------------------------------------------------

    @classmethod
    def from_kwargs(cls, caller: str = "LLM()", **kwargs) -> EngineOptions:
        """Options from keyword arguments; an unknown name is a TypeError naming close matches."""
        names = field_names()
        for key in kwargs:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=3)
                hint = f"; did you mean {' or '.join(close)}?" if close else ""
                raise TypeError(
                    f"{caller} got an unknown option {key!r}{hint} (options: {', '.join(names)}; "
                    "see ringserve/options.py)"
                )
        return cls(**kwargs)

    @classmethod
    def from_configs(
        cls,
        engine_config: EngineConfig | None = None,
        parallel: ParallelConfig | None = None,
        **kwargs,
    ) -> EngineOptions:
        """Options from config objects plus keyword options (None: the default)."""
        for config in (engine_config, parallel):
            if config is not None:
                kwargs.update(dataclasses.asdict(config))
        return cls.from_kwargs("LLMEngine()", **{k: v for k, v in kwargs.items() if v is not None})


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(EngineOptions)]


def _field(name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(EngineOptions) if f.name == name)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise OptionError(name, f"must be a positive integer (>= 1), got {value!r}")


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise OptionError(name, f"{name}: unknown {name} {value!r}; choose one of {', '.join(choices)}")


# Command line -----------------------------------------------------------------------------


def cli_flags(name: str) -> tuple[str, ...]:
    """The command-line flags of option `name` (the first is the main one)."""
    return _field(name).metadata.get("cli_flags") or ("--" + name.replace("_", "-"),)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add a flag per engine option (and -v) to `parser`; `from_cli_args` reads them back.

    Flags left out keep no value in the namespace, so the defaults live only in EngineOptions.
    """
    group = parser.add_argument_group("engine options (ringserve/options.py)")
    for f in dataclasses.fields(EngineOptions):
        flags = cli_flags(f.name)
        default = f.default
        help = f.metadata["help"]
        kind = _field_type(f)
        if kind is bool:
            negative = ("--no-" + flags[0][2:], *f.metadata.get("cli_negative", ()))
            on = f"{help} (default: {'on' if default else 'off' if default is False else 'auto'})"
            group.add_argument(*flags, dest=f.name, action="store_true", default=argparse.SUPPRESS, help=on)
            group.add_argument(
                *negative,
                dest=f.name,
                action="store_false",
                default=argparse.SUPPRESS,
                help="turn off: " + help,
            )
            continue
        if "cli_all_ranks" in f.metadata:
            group.add_argument(
                f.metadata["cli_all_ranks"],
                dest=f.name,
                action="store_const",
                const=_ALL_RANKS,
                default=argparse.SUPPRESS,
                help=f"{f.name} = tp x cp x dp: every rank of the layout (vLLM's flag)",
            )
        if f.metadata.get("cli_type") == "human_int":
            kind = human_readable_int
        kwargs = {"dest": f.name, "type": kind, "default": argparse.SUPPRESS}
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        if default is not None:
            help += f" (default: {default})"
        group.add_argument(*flags, help=help, metavar=f.name.upper(), **kwargs)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="-v: info logs, -vv: debug logs")
    return parser


def from_cli_args(args: argparse.Namespace) -> EngineOptions:
    """The options a parsed command line gives; an invalid value raises OptionError."""
    given = {name: getattr(args, name) for name in field_names() if hasattr(args, name)}
    for name, value in given.items():
        if value is _ALL_RANKS:
            given[name] = given.get("tp", 1) * given.get("cp", 1) * (given.get("dp") or 1)
    return EngineOptions(**given)


class _AllRanks:
    """What a cli_all_ranks switch stores until the layout's sizes are all read."""

    def __repr__(self) -> str:
        return "all ranks"


_ALL_RANKS = _AllRanks()


def human_readable_int(value: str) -> int:
    """An integer as vLLM's flags read it: 32k (lowercase: decimal, 32000; 1.5k is 1500),
    32K (uppercase: binary, 32768), 2m / 2M, 1g / 1G, 1t / 1T, or plain digits."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value.strip())
    if not match:
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer: {value!r} (e.g. 32768, 32k, 32K)") from None
    number, suffix = match.groups()
    power = "kmgt".index(suffix.lower()) + 1
    if suffix.islower():
        return int(float(number) * 1000**power)
    if "." in number:  # as vLLM: 1.5K is no whole number of binary units
        raise argparse.ArgumentTypeError(
            f"decimals need a decimal suffix: {value!r} (did you mean {number}{suffix.lower()}?)"
        )
    return int(number) * 1024**power


def cli_error(e: OptionError) -> str:
    """The message for a bad flag: `argument --block-size: block_size must be ...`."""
    return f"argument {'/'.join(cli_flags(e.option))}: {e}"


def _field_type(f: dataclasses.Field):
    """bool, int, float or str, from the annotation (a string under `from __future__ import annotations`)."""
    t = str(f.type)
    for name, kind in (("bool", bool), ("int", int), ("float", float)):
        if t.startswith(name):
            return kind
    return str
