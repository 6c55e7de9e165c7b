"""One definition of the engine's options: every option reaches the engine from LLM(...) and
from the command line, every invalid value is refused with a message naming it."""

from __future__ import annotations

import dataclasses
import inspect
import io
import os
import re
import sys

import pytest
import torch

import ringserve
from ringserve import LLM
from ringserve.cli.main import build_parser, main
from ringserve.config import EngineConfig, ParallelConfig
from ringserve.engine import loading as loading_module
from ringserve.engine.engine import LLMEngine
from ringserve.options import EngineOptions, add_cli_args, cli_flags, field_names, from_cli_args

QUESTION = "What is the capital of France?"
README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")


# Every option: a value other than its default, and where the engine shows that it arrived.
# A new option without an entry here fails test_the_table_covers_every_option.
REACHED = {
    "model": lambda e, rec: e.model_path,
    "device": lambda e, rec: e.options.device,
    "dtype": lambda e, rec: e.dtype,
    "tp": lambda e, rec: rec["spec"].parallel.tp,
    "cp": lambda e, rec: rec["spec"].parallel.cp,
    "dp": lambda e, rec: rec["spec"].parallel.dp,
    "ep": lambda e, rec: rec["spec"].parallel.ep,
    "ranks_per_host": lambda e, rec: rec["spec"].parallel.ranks_per_host,
    "allreduce": lambda e, rec: rec["spec"].allreduce,
    "cp_algo": lambda e, rec: e.cp_algo,
    "timeout_s": lambda e, rec: rec["spec"].timeout_s,
    "block_size": lambda e, rec: e.block_manager.block_size,
    "num_blocks": lambda e, rec: rec["spec"].engine_config.num_blocks,
    "kv_cache_memory": lambda e, rec: rec["spec"].engine_config.kv_cache_memory,
    "gpu_memory_utilization": lambda e, rec: rec["spec"].engine_config.gpu_memory_utilization,
    "max_model_len": lambda e, rec: e.max_model_len,
    "allow_long_max_model_len": lambda e, rec: e.options.allow_long_max_model_len,
    "max_num_batched_tokens": lambda e, rec: e.scheduler.max_num_batched_tokens,
    "max_prefill_tokens": lambda e, rec: e.scheduler.max_prefill_tokens,
    "max_num_seqs": lambda e, rec: e.scheduler.max_num_seqs,
    "quantization": lambda e, rec: rec["spec"].engine_config.quantization,
    "kv_cache_dtype": lambda e, rec: rec["spec"].engine_config.kv_cache_dtype,
    "enable_prefix_caching": lambda e, rec: e.block_manager.enable_prefix_caching,
    "speculative_config": lambda e, rec: e.options.speculative_config if e.speculative else None,
    "enforce_eager": lambda e, rec: rec["spec"].engine_config.enforce_eager,
    "async_scheduling": lambda e, rec: e.async_scheduling,
    "show_progress": lambda e, rec: rec["show_progress"],
    "tokenizer": lambda e, rec: e.tokenizer.name_or_path,
    "chat_template": lambda e, rec: e.input_processor.chat_template,
    "seed": lambda e, rec: e.seed_rng.initial_seed(),
    "generation_config": lambda e, rec: e.options.generation_config,
}


def non_default_values(model_dir: str, tokenizer_dir: str = "tok") -> dict:
    """A value for every option that differs from its default (a MoE model, so ep can be > 1)."""
    return dict(
        model=model_dir,
        device="cpu",
        dtype="bfloat16",
        tp=2,
        cp=3,
        dp=2,
        ep=6,
        ranks_per_host=2,
        allreduce="one_shot",
        cp_algo="pass_q",
        timeout_s=12.5,
        block_size=8,
        num_blocks=77,
        kv_cache_memory=1 << 20,
        gpu_memory_utilization=0.5,
        max_model_len=333,
        allow_long_max_model_len=True,
        max_num_batched_tokens=99,
        max_prefill_tokens=199,
        max_num_seqs=7,
        quantization="fp8",
        kv_cache_dtype="fp8",
        enable_prefix_caching=False,
        speculative_config='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}',
        enforce_eager=True,
        async_scheduling=False,
        show_progress=True,
        tokenizer=tokenizer_dir,
        chat_template="{{ messages[0]['content'] }}",
        seed=1234,
        generation_config="vllm",
    )


def cli_args(values: dict) -> list[str]:
    """The command line that sets `values`, built from each option's flags."""
    argv = []
    for name, value in values.items():
        flag = cli_flags(name)[0]
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


class _Stop(Exception):
    pass


@pytest.fixture
def engines(monkeypatch):
    """Build engines without starting ranks or reading weights: the executor is a fake that
    records what it was given, and each finished engine is recorded, then _Stop is raised."""
    built = []

    class FakeExecutor:
        def __init__(self, spec, *args):
            self.spec = spec
            self.show_progress = args[-1] if len(args) == 1 else args[1]
            self.num_blocks = spec.engine_config.num_blocks or 64

        def close(self):
            pass

    monkeypatch.setattr(loading_module, "MultiprocessExecutor", FakeExecutor)
    monkeypatch.setattr(loading_module, "LocalExecutor", FakeExecutor)
    init = LLMEngine.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append((self, {"spec": self.executor.spec, "show_progress": self.executor.show_progress}))
        raise _Stop

    monkeypatch.setattr(LLMEngine, "__init__", spy)
    return built


def test_the_table_covers_every_option(tiny_model_dir):
    values = non_default_values("x")
    assert list(values) == field_names() == list(REACHED)
    defaults = EngineOptions()
    for name, value in values.items():
        assert getattr(defaults, name) != value, name


def test_configs_take_their_fields_from_the_options():
    names = set(field_names())
    assert {f.name for f in dataclasses.fields(EngineConfig)} <= names
    assert {f.name for f in dataclasses.fields(ParallelConfig)} <= names
    # LLMEngine's shorthand arguments are options too (None: the option's default).
    params = set(inspect.signature(LLMEngine.__init__).parameters) - {"self", "options", "weights"}
    assert params - {"engine_config", "parallel"} <= names
    for name, p in inspect.signature(LLMEngine.__init__).parameters.items():
        if name not in ("self",):
            assert p.default is None, name
    # LLM takes the model and the options, nothing of its own.
    assert list(inspect.signature(LLM.__init__).parameters) == ["self", "model", "options"]


def test_every_option_reaches_the_engine_from_llm(tiny_model_dir, builtin_dir, engines):
    values = non_default_values(tiny_model_dir("qwen3_moe"), builtin_dir)
    with pytest.raises(_Stop):
        LLM(**values)
    engine, rec = engines[-1]
    for name, value in values.items():
        expected = getattr(torch, value) if name == "dtype" else value
        assert REACHED[name](engine, rec) == expected, name
    assert engine.options == EngineOptions(**values)


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"], ["serve", "--port", "0"]])
def test_every_option_reaches_the_engine_from_the_command_line(tiny_model_dir, builtin_dir, engines, command):
    values = non_default_values(tiny_model_dir("qwen3_moe"), builtin_dir)
    with pytest.raises(_Stop):
        main([*command, *cli_args(values)])
    engine, rec = engines[-1]
    for name, value in values.items():
        expected = getattr(torch, value) if name == "dtype" else value
        assert REACHED[name](engine, rec) == expected, name


def test_command_line_defaults_are_the_options_defaults():
    args = build_parser().parse_args(["generate"])
    assert from_cli_args(args) == EngineOptions()
    # A parser of its own (as `ringserve serve` builds one) reads the same options.
    import argparse

    parser = add_cli_args(argparse.ArgumentParser())
    assert from_cli_args(parser.parse_args(["--no-prefix-caching", "--max-num-seqs", "3"])) == EngineOptions(
        enable_prefix_caching=False, max_num_seqs=3
    )
    assert from_cli_args(parser.parse_args(["--timeout", "5"])).timeout_s == 5.0


def test_engine_shorthand_arguments_are_the_same_options(tiny_model_dir, engines):
    folder = tiny_model_dir("llama")
    with pytest.raises(_Stop):
        LLMEngine(
            folder,
            device="cpu",
            engine_config=EngineConfig(block_size=4, max_num_seqs=5),
            parallel=ParallelConfig(tp=2),
            cp_algo="pass_kv",
        )
    engine, _ = engines[-1]
    assert engine.options == EngineOptions(
        model=folder, device="cpu", block_size=4, max_num_seqs=5, tp=2, cp_algo="pass_kv"
    )
    with pytest.raises(TypeError, match="options"):
        LLMEngine(device="cpu", options=EngineOptions())


def test_unknown_option_names_the_close_matches():
    with pytest.raises(TypeError, match="'blok_size'.*block_size"):
        LLM(None, blok_size=4)
    with pytest.raises(TypeError, match="cp_algo"):
        LLM(None, cp_algorithm="pass_q")


def test_max_model_len_past_the_context_is_refused_unless_allowed(tiny_model_dir, engines, capsys):
    folder = tiny_model_dir("llama")  # a context of 512 positions
    with pytest.raises(ValueError, match=r"max_model_len 513 is longer than the model's context \(512"):
        LLM(folder, device="cpu", max_model_len=513)
    assert not engines  # refused before any rank or weight
    argv = ["generate", "hi", "--model", folder, "--device", "cpu", "--max-model-len", "100000"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--allow-long-max-model-len" in err and "Traceback" not in err, err
    for kwargs in (dict(max_model_len=512), dict(max_model_len=4096, allow_long_max_model_len=True)):
        with pytest.raises(_Stop):  # built (then stopped by the fixture)
            LLM(folder, device="cpu", **kwargs)
        assert engines[-1][0].max_model_len == kwargs["max_model_len"]


def test_yarn_context_is_its_original_length_times_its_factor(tiny_model_dir):
    from ringserve.config import ModelConfig

    config = ModelConfig.from_pretrained(tiny_model_dir("llama"))
    hf = config.hf_config
    hf.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
    assert config.context_length == 2048  # as vLLM derives it; max_position_embeddings says 512
    hf.rope_parameters = {"rope_type": "linear", "factor": 4.0}
    assert config.context_length == 512


# option -> values that cannot work. A new option without one fails the coverage test below.
INVALID = {
    "model": [""],
    "device": ["tpu", "cuda:x"] + ([] if torch.cuda.is_available() else ["cuda", "cuda:0"]),
    "dtype": ["float8", "int8"],
    "tp": [0, -1],
    "cp": [0],
    "dp": [0, -1],
    "ep": [0, -2],
    "ranks_per_host": [0],
    "allreduce": ["nccl"],
    "cp_algo": ["pass_x"],
    "timeout_s": [0, -1.0],
    "block_size": [0, -16],
    "num_blocks": [0],
    "kv_cache_memory": [0],
    "gpu_memory_utilization": [0, 1.5, -0.1],
    "max_model_len": [0, -5],
    "allow_long_max_model_len": [1],
    "max_num_batched_tokens": [0, -1],
    "max_prefill_tokens": [0, 1],  # 1: below max_num_batched_tokens
    "max_num_seqs": [0, -1],
    "quantization": ["int4", "", "FP8"],
    "kv_cache_dtype": ["int8", "fp8_e5m2", ""],
    "enable_prefix_caching": ["no"],
    "speculative_config": [
        "{not json",
        '{"method": "eagle3", "num_speculative_tokens": 3}',
        '{"method": "ngram"}',
        '{"method": "ngram", "num_speculative_tokens": 0}',
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
        '{"method": "ngram", "num_speculative_tokens": 2, "lookup": 2}',
    ],
    "enforce_eager": [1],
    "async_scheduling": ["on"],
    "show_progress": ["yes"],
    "tokenizer": ["/no/such/folder", ""],
    "chat_template": [""],
    "seed": [-1, 1.5],
    "generation_config": ["", "/no/such/folder", 1],
}
INVALID_CASES = [(name, value) for name, values in INVALID.items() for value in values]


def test_every_option_has_invalid_cases():
    assert list(INVALID) == field_names()


@pytest.mark.parametrize("name, value", INVALID_CASES)
def test_invalid_option_is_a_value_error_naming_it(name, value):
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        EngineOptions(**{name: value})
    with pytest.raises(ValueError, match=rf"^{name}\b"):  # before any model is read
        LLM("/nonexistent/model" if name != "model" else value, **({} if name == "model" else {name: value}))


BOOLS = (
    "enable_prefix_caching",
    "enforce_eager",
    "allow_long_max_model_len",
    "async_scheduling",
    "show_progress",
)  # flags without a value


@pytest.mark.parametrize("name, value", [(n, v) for n, v in INVALID_CASES if n not in BOOLS])
def test_invalid_flag_is_an_error_line_not_a_traceback(name, value, capsys):
    try:
        code = main(["generate", "hi", cli_flags(name)[0], str(value)])
    except SystemExit as e:  # argparse refuses a bad choice or a non-number itself
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert "error: " in err and cli_flags(name)[0] in err
    assert "Traceback" not in err


def test_tp_error_lists_the_sizes_that_work():
    # The built-in SmolLM2-135M has 9 heads and 3 KV heads: tp 1 or 3.
    with pytest.raises(ValueError, match=r"tp=4.*tp can be 1, 3$"):
        LLM(None, device="cpu", tp=4)


def test_valid_tp_sizes_divide_heads_kv_heads_and_mlp(tiny_model_dir):
    from ringserve.config import ModelConfig
    from ringserve.parallel.tp import valid_tp_sizes

    # 4 heads, 2 KV heads (replicated above 2), intermediate 96
    assert valid_tp_sizes(ModelConfig.from_pretrained(tiny_model_dir("llama"))) == [1, 2, 4]


def test_readme_tp_examples_split_their_model():
    """A tp example without a model runs the built-in model, which splits over tp 1 or 3 only."""
    with open(README) as f:
        text = f.read()
    examples = [line for line in text.splitlines() if re.search(r"(--tp\s+\d+|\btp=\d+)", line)]
    assert examples
    for line in examples:
        if "LLM(" in line or "ringserve" in line:
            tp = int(re.search(r"(?:--tp\s+|\btp=)(\d+)", line).group(1))
            if not re.search(r"--model|model=\"", line):
                assert tp in (1, 3), line


# The command line: stdin, --version, why generation stopped ------------------------------


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"ringserve {ringserve.__version__}"


def _generate(capsys, argv, stdin=None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    assert main(["generate", "--device", "cpu", *argv]) == 0
    return capsys.readouterr().out.strip().splitlines()


def test_prompt_from_stdin(capsys, monkeypatch):
    asked = _generate(capsys, ["What is 2 + 2?", "--max-tokens", "12"])
    piped = _generate(capsys, ["--max-tokens", "12"], stdin="What is 2 + 2?\n", monkeypatch=monkeypatch)
    assert piped[0] == asked[0]
    assert piped[-1].split(",")[:2] == asked[-1].split(",")[:2]  # same prompt and generated tokens
    dash = _generate(capsys, ["-", "--max-tokens", "12"], stdin="What is 2 + 2?", monkeypatch=monkeypatch)
    assert dash[0] == asked[0]
    # Nothing piped: the default question.
    default = _generate(capsys, ["--max-tokens", "12"], stdin="", monkeypatch=monkeypatch)
    assert default[0] == _generate(capsys, [QUESTION, "--max-tokens", "12"])[0]


def test_summary_says_why_generation_stopped(capsys):
    assert _generate(capsys, [QUESTION, "--max-tokens", "32"])[-1].endswith("finish: eos")
    assert _generate(capsys, [QUESTION, "--max-tokens", "3"])[-1].endswith("finish: length (max_tokens)")
    stop = _generate(capsys, [QUESTION, "--max-tokens", "32", "--stop", "France"])
    assert stop[-1].endswith("finish: stop string 'France'")
    batch = _generate(capsys, [QUESTION, "Count to twenty.", "--max-tokens", "3"])
    assert "(finish: length (max_tokens))" in batch
    assert batch[-1].endswith("finish: 2 length (max_tokens)")


def test_bad_flag_exits_2_with_one_error_line():
    import subprocess

    root = os.path.join(os.path.dirname(__file__), os.pardir)
    run = subprocess.run(
        [sys.executable, "-m", "ringserve.cli", "generate", "--block-size", "0"],
        input="hi\n",
        capture_output=True,
        text=True,
        cwd=root,
        timeout=120,
    )
    assert run.returncode == 2
    assert run.stderr.strip() == (
        "error: argument --block-size: block_size must be a positive integer (>= 1), got 0"
    )


# vLLM's names for the same options ---------------------------------------------------------


def test_vllm_flag_names_are_the_same_options():
    """`vllm serve` command lines work: vLLM's flag names are aliases of ringserve's options
    (one definition each), --enable-expert-parallel spreads the experts over every rank, and
    --max-model-len takes vLLM's k (1000) / K (1024) suffixes."""
    import argparse

    parser = add_cli_args(argparse.ArgumentParser())

    def parsed(*argv):
        return from_cli_args(parser.parse_args(list(argv)))

    assert parsed("-tp", "2", "-dp", "3") == parsed(
        "--tensor-parallel-size", "2", "--data-parallel-size", "3"
    )
    assert parsed("-tp", "2", "-dp", "3") == EngineOptions(tp=2, dp=3)
    assert parsed("--enable-expert-parallel").ep == 1
    assert parsed("-tp", "2", "--enable-expert-parallel", "-dp", "2") == EngineOptions(tp=2, dp=2, ep=4)
    assert parsed("--tp", "2", "--cp", "2", "--enable-expert-parallel") == EngineOptions(tp=2, cp=2, ep=4)
    for given, value in (("32k", 32000), ("32K", 32768), ("1.5k", 1500), ("2M", 2 * 2**20), ("4096", 4096)):
        assert parsed("--max-model-len", given).max_model_len == value, given


@pytest.mark.parametrize("value", ["1.5K", "12x", "k"])
def test_bad_human_readable_length_is_an_error_line(value, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--max-model-len", value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--max-model-len" in err and "Traceback" not in err
