"""Tensor parallelism on gloo ranks: tokens and logits equal the single-rank result (which
the model tests check against transformers) and transformers' own greedy tokens."""

import os
import signal
import time

import pytest
import torch

from ringserve import LLM, SamplingParams
from ringserve.engine.executor import WorkerError
from ringserve.engine.logits_probe import engine_logits
from ringserve.model.tiny_models import hf_greedy, hf_model

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], list(range(10, 41)), [200, 1, 77]]


def single_rank(folder):
    with LLM(folder, device="cpu", dtype="float32") as llm:
        tokens = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        logits = engine_logits(llm.engine, list(range(3, 30)), prefill=20)
    return tokens, logits


# llama: 4 query / 2 KV heads, so tp=4 replicates each KV head on two ranks; tied embeddings.
@pytest.mark.parametrize(
    "arch,tp",
    [
        ("llama", 2),
        ("llama", 4),
        ("mistral", 2),
        ("qwen3", 2),
        ("mixtral", 2),
        ("qwen3_moe", 4),
        ("qwen2", 2),
        ("gemma3", 2),
        ("llama4", 2),  # experts' gate and up halves split apart; the shared expert TP-split
        ("gpt_oss", 2),  # sinks and q/k/v biases by head, o_proj and expert down biases added once
    ],
)
def test_tp_equals_single_rank_and_transformers(arch, tp, tiny_model_dir):
    folder = tiny_model_dir(arch)
    ref_tokens, ref_logits = single_rank(folder)
    with LLM(folder, device="cpu", dtype="float32", tp=tp, timeout_s=60) as llm:
        tokens = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        logits = engine_logits(llm.engine, list(range(3, 30)), prefill=20)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    hf = hf_model(folder)
    assert tokens[0] == hf_greedy(hf, PROMPTS[0], 16)


def test_each_rank_holds_its_share_of_the_weights(tiny_model_dir):
    folder = tiny_model_dir("mixtral")
    with LLM(folder, device="cpu", dtype="float32") as llm:
        model = llm.engine.executor.worker.model
        params = dict(model.named_parameters())
    total = sum(p.numel() for p in params.values())
    replicated = sum(p.numel() for n, p in params.items() if "norm" in n or n.endswith("mlp.gate.weight"))
    config = model.config
    num_kv_heads = config.num_key_value_heads  # 2
    # k and v rows of the fused qkv_proj weights
    kv = config.num_hidden_layers * 2 * num_kv_heads * config.head_dim * config.hidden_size
    for tp in (2, 4):
        with LLM(folder, device="cpu", dtype="float32", tp=tp) as llm:
            held = sum(p.numel() for p in llm.engine.executor.worker.model.parameters())
        # 1/tp of the sharded weights, the replicated ones whole, and KV heads split at most
        # num_kv_heads ways (at tp=4 each of the 2 KV heads sits on two ranks).
        expected = (total - replicated - kv) // tp + replicated + kv // min(tp, num_kv_heads)
        assert held == expected
        assert held < total / tp * 1.2


def test_heads_not_divisible_fail_before_loading(tmp_path, tiny_model_dir):
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"num_attention_heads=4.*not divisible by 3"):
        LLM(tiny_model_dir("llama"), device="cpu", tp=3)
    assert time.monotonic() - started < 5  # no process was started, no weight read


def _children(llm):
    return llm.engine.executor.procs


def test_killed_rank_ends_the_run_with_an_error(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), device="cpu", dtype="float32", tp=2, timeout_s=10)
    (child,) = _children(llm)
    os.kill(child.pid, signal.SIGKILL)
    child.join(5)
    started = time.monotonic()
    with pytest.raises(WorkerError, match=rf"rank 1 \(pid {child.pid}\) was killed by SIGKILL"):
        llm.generate(PROMPTS, GREEDY)
    assert time.monotonic() - started < 10
    with pytest.raises(WorkerError, match="shut down"):
        llm.generate(PROMPTS, GREEDY)
    llm.close()


def test_hung_rank_times_out_and_no_process_remains(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), device="cpu", dtype="float32", tp=4, timeout_s=5)
    children = _children(llm)
    os.kill(children[1].pid, signal.SIGSTOP)  # rank 2 stops answering
    started = time.monotonic()
    with pytest.raises(WorkerError, match=rf"rank 2 \(pid {children[1].pid}\) did not answer within 5 s"):
        llm.generate(PROMPTS, GREEDY)
    assert time.monotonic() - started < 5 + 15
    assert not any(c.is_alive() for c in children)
    llm.close()


def test_torchrun_world_runs_the_cli(tmp_path):
    """Under torchrun every rank joins the launched world: the built-in model (9 heads,
    3 KV heads) at tp=3, rank 0 printing the answer."""
    import subprocess
    import sys

    from ringserve.parallel.local_world import free_port

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "3",
        "--master-port",
        str(free_port()),
        "-m",
        "ringserve.cli",
        "generate",
        "What is the capital of France?",
        "--tp",
        "3",
        "--device",
        "cpu",
        "--max-tokens",
        "16",
        "--timeout",
        "60",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Paris" in done.stdout
    assert done.stdout.count("prompt tokens:") == 1  # only rank 0 reports


def test_cli_reports_indivisible_heads(capsys):
    from ringserve.cli.main import main

    assert main(["generate", "hi", "--tp", "2", "--device", "cpu"]) == 2
    assert "num_attention_heads=9" in capsys.readouterr().err


def test_tp_with_a_vocabulary_that_tp_does_not_divide(tmp_path):
    """Vocabulary 255 over 2 ranks: rank 1 holds 127 real rows and a padding row. The
    gathered logits are the 255 of the single-rank run (the padding row cut off, never
    sampled), and so are the greedy tokens."""
    from ringserve.model.tiny_models import make_hf_config, save_random_model

    config = make_hf_config("llama")
    config.vocab_size = 255
    folder = save_random_model(config, str(tmp_path / "llama255"))
    prompts = [[5, 17, 42, 99, 3, 250, 7], [254, 1, 77]]
    results = []
    for tp in (1, 2):
        with LLM(folder, device="cpu", dtype="float32", tp=tp, timeout_s=60) as llm:
            tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
            logits = engine_logits(llm.engine, list(range(3, 30)), prefill=20)
        results.append((tokens, logits))
    (ref_tokens, ref_logits), (tokens, logits) = results
    assert ref_logits.shape[-1] == logits.shape[-1] == 255
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert tokens == ref_tokens and all(t < 255 for ts in tokens for t in ts)
