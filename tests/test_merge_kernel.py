"""The Triton log-sum-exp merge kernel (kernels/lse_merge.py) against the torch merge, run on the
CPU by Triton's interpreter (TRITON_INTERPRET=1, set before the kernel is defined: hence a
fresh process)."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import torch
from ringserve.kernels import lse_merge

torch.manual_seed(0)
tokens, heads, head_dim = 40, 3, 96  # head_dim not a power of two: masked columns
outs = [torch.randn(tokens, heads, head_dim) for _ in range(11)]
lses = [torch.randn(tokens, heads) * 4 for _ in range(11)]
for lse in lses[::3]:
    lse[::7] = float("-inf")  # parts that saw nothing for some queries
for lse in lses:
    lse[5] = float("-inf")  # a query that saw nothing anywhere
outs[2][lses[2] == float("-inf")] = float("nan")  # never read: weight 0

def check(got, want):
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)

for count in (1, 3, 8, 11):  # 11: two launches, the first round kept in float32
    check(lse_merge._merge_triton(outs[:count], lses[:count], [0] * count, tokens),
          lse_merge._merge_torch(outs[:count], lses[:count]))
# Parts holding runs of rows, LSE in cuDNN's head-major layout.
firsts = [0, 10, 0, 39, 25]
held = [(o[f:], lse.t().contiguous().t()[f:]) for o, lse, f in zip(outs, lses, firsts)]
held[1] = (held[1][0][:7], held[1][1][:7])
parts = ([h[0] for h in held], [h[1] for h in held])
check(lse_merge._merge_triton(*parts, firsts, tokens),
      lse_merge._merge_torch(*lse_merge._full_rows(*parts, firsts, tokens)))
out, lse = lse_merge._merge_triton(outs, lses, [0] * 11, tokens)
assert (out[5] == 0).all() and torch.isinf(lse[5]).all()
print("ok")
"""


def test_triton_merge_kernel_matches_the_torch_merge():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-4000:]
