"""Issue 5's one-GPU figures: a Mixtral-8x7B-shaped MoE layer (hidden 4096, 8 experts of
14336, top-2, random bf16), ringserve's against transformers' in the same run and the roofline.

  python bench/bench_moe.py      # writes $OUT/bench_moe.json and prints a table

Decode batches of 1 to 64 tokens and a 4K-token prefill. Roofline: decode reads every
expert the batch routes to once (bytes / copy rate); prefill is the routed FLOPs
(2 x tokens x top-k x 3 x hidden x intermediate) / matmul rate.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import event_time_ms, machine_info, measure_ceilings, write_json  # noqa: E402

from ringserve.config import ModelConfig, TPShard  # noqa: E402
from ringserve.model.decoder import SparseMoeBlock  # noqa: E402
from ringserve.parallel.ep import LocalExperts  # noqa: E402

H, INTER, E, K = 4096, 14336, 8, 2


class _Ctx:
    run_experts = LocalExperts(lambda y: y)


def build():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(
        hidden_size=H,
        intermediate_size=INTER,
        num_local_experts=E,
        num_experts_per_tok=K,
        num_hidden_layers=1,
        architectures=["MixtralForCausalLM"],
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = MixtralSparseMoeBlock(cfg).to(torch.bfloat16)
        for p in hf.parameters():
            torch.nn.init.normal_(p, std=0.02)
        ours = SparseMoeBlock(
            ModelConfig.from_hf(cfg, "MixtralForCausalLM"),
            TPShard.of(ModelConfig.from_hf(cfg, "MixtralForCausalLM"), 0, 1),
        ).to(torch.bfloat16)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.experts.gate_proj.copy_(hf.experts.gate_up_proj[:, :INTER])
        ours.experts.up_proj.copy_(hf.experts.gate_up_proj[:, INTER:])
        ours.experts.down_proj.copy_(hf.experts.down_proj)
    return cfg, hf, ours


@torch.inference_mode()
def main():
    info = machine_info()
    ceilings = measure_ceilings()
    cfg, hf, ours = build()
    expert_bytes = 3 * H * INTER * 2
    rows = []
    print(
        f"{'tokens':>7s} {'ringserve':>10s} {'transformers':>13s} {'roofline':>9s} {'of roof':>8s} "
        f"{'vs hf':>6s} {'rel err':>8s}"
    )
    for tokens in (1, 2, 4, 8, 16, 32, 64, 4096):
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
        ref = hf(x.unsqueeze(0))[0]
        got = ours(x, _Ctx)
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        ours_ms = event_time_ms(lambda x=x: ours(x, _Ctx), warmup=3, reps=20)
        hf_ms = event_time_ms(lambda x=x: hf(x.unsqueeze(0)), warmup=3, reps=20)
        hit = len(torch.unique(ours.route(x)[0]))
        if tokens <= 64:
            roof = (hit * expert_bytes + E * H * 2) / ceilings["copy_bytes_per_s"] * 1000
        else:
            roof = 2 * tokens * K * 3 * H * INTER / ceilings["bf16_matmul_flops"] * 1000
        rows.append(
            {
                "tokens": tokens,
                "experts_hit": hit,
                "ringserve_ms": ours_ms,
                "transformers_ms": hf_ms,
                "roofline_ms": roof,
                "rel_err_vs_transformers": err,
            }
        )
        print(
            f"{tokens:7d} {ours_ms:8.3f}ms {hf_ms:11.3f}ms {roof:7.3f}ms {roof / ours_ms:8.2f} "
            f"{hf_ms / ours_ms:6.2f} {err:8.1e}",
            flush=True,
        )
        assert err < 2e-2
    write_json("bench_moe.json", {"machine": info, "ceilings": ceilings, "rows": rows})


if __name__ == "__main__":
    main()
