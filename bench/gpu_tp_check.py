"""Tensor-parallel code on one GPU, through the same path as several (run under torchrun):

  python3 -m torch.distributed.run --nproc-per-node 1 bench/gpu_tp_check.py

The engine joins the torchrun world (NCCL, the device mesh, the gloo control group) at tp=1
and must give transformers' greedy tokens; then the symmetric-memory allreduce is set up on
the TP group and each algorithm is checked eagerly and inside a CUDA graph.
"""

from __future__ import annotations

import tempfile

import torch

from ringserve import LLM, SamplingParams
from ringserve.engine.executor import MultiprocessExecutor
from ringserve.model.tiny_models import (
    hf_greedy,
    hf_model,
    save_tiny_model,
)
from ringserve.parallel.allreduce import AllReduce


def main():
    with tempfile.TemporaryDirectory() as tmp:
        prompt = list(range(5, 25))
        # A dense model decodes under CUDA graphs through the multi-rank path (the vocabulary
        # gather and the allreduce inside the graph); greedy tokens must equal transformers'.
        dense = save_tiny_model("llama", f"{tmp}/dense")
        with LLM(dense, device="cuda", dtype="float32", tp=1) as llm:
            assert llm.engine.executor.worker.runner.graphs is not None, "expected decode graphs"
            got = llm.generate([prompt], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))[0]
            want = hf_greedy(hf_model(dense), prompt, 64)
            print(
                f"tp=1 under torchrun, CUDA graphs: 64 greedy tokens equal transformers': {got.token_ids == want}"
            )
            assert got.token_ids == want
        folder = save_tiny_model("qwen3_moe", f"{tmp}/m")
        llm = LLM(folder, device="cuda", dtype="float32", tp=1)
        assert isinstance(llm.engine.executor, MultiprocessExecutor), "expected the torchrun path"
        got = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[
            0
        ].token_ids
        want = hf_greedy(hf_model(folder), prompt, 16)
        print(f"tp=1 under torchrun on CUDA: greedy equals transformers: {got == want}")
        assert got == want
        groups = llm.engine.executor.groups
        op = AllReduce(groups.tp_group, "one_shot", groups.device)
        op._init_symmetric_memory()  # world size 1 skips it in normal use; force it here
        if op.symm_buffer is None:
            print("symmetric memory: fell back to NCCL (see the warning above)")
        else:
            x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
            for algo in ("one_shot", "two_shot"):
                eager = op._symmetric(x, algo)
                graph = torch.cuda.CUDAGraph()
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    op._symmetric(x, algo)  # warm up outside the capture
                torch.cuda.current_stream().wait_stream(stream)
                with torch.cuda.graph(graph):
                    captured = op._symmetric(x, algo)
                graph.replay()
                torch.cuda.synchronize()
                print(
                    f"symmetric memory {algo}: eager equal {torch.equal(eager, x)}, "
                    f"CUDA graph replay equal {torch.equal(captured, x)}"
                )
                assert torch.equal(eager, x) and torch.equal(captured, x)
        llm.close()
    print("GPU TP CHECK PASSED")


if __name__ == "__main__":
    main()
