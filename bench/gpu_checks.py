"""Correctness on CUDA before any timing: the attention kernels against the math path, and
tiny models through the engine against transformers on the same GPU."""

from __future__ import annotations

import itertools
import sys
import tempfile

import torch

from ringserve import LLM, SamplingParams
from ringserve.attention.dense import VarlenBatch, _math_varlen, attention_with_lse
from ringserve.config import AttentionWindow
from ringserve.engine.engine import LLMEngine
from ringserve.engine.logits_probe import engine_logits
from ringserve.kernels import lse_merge
from ringserve.model.tiny_models import (
    ARCHITECTURES,
    hf_greedy,
    hf_model,
    make_hf_config,
    save_random_model,
)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_attention():
    torch.manual_seed(0)
    nh, nkv, d = 32, 8, 128
    cases = {
        "prefill": ([700, 300], [700, 300]),
        "chunk after prefix": ([256, 5], [1024, 77]),
        "long chunks after prefix (cuDNN)": ([600, 512], [2048, 900]),
        "decode": ([1] * 8, [33, 900, 1, 64, 2048, 7, 100, 513]),
    }
    windows = {
        "": AttentionWindow(),
        ", sliding 128": AttentionWindow(sliding=128),
        ", chunk 256": AttentionWindow(chunk=256),
    }
    for (name, (lq, lk)), (window_name, window) in itertools.product(cases.items(), windows.items()):
        name += window_name
        q = torch.randn(sum(lq), nh, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(sum(lk), nkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(sum(lk), nkv, d, device="cuda", dtype=torch.bfloat16)
        cu_q = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        q_pos = torch.cat([torch.arange(b - a, b) for a, b in zip(lq, lk)]).cuda()
        k_pos = torch.cat([torch.arange(b) for b in lk]).cuda()
        bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
        batch = VarlenBatch(cu_q, cu_k, max(lq), max(lk), q_pos, k_pos, True, bounds_q, bounds_k)
        out, lse = attention_with_lse(q, k, v, batch, d**-0.5, window)
        ref_out, ref_lse = _math_varlen(q, k, v, batch, d**-0.5, window)
        e_out, e_lse = rel(out, ref_out), (lse - ref_lse).abs().max().item()
        print(f"attention {name:40s} out rel err {e_out:.1e}  lse max abs err {e_lse:.1e}")
        assert e_out < 2e-2 and e_lse < 2e-2, name


def _positions_batch(q_pos: list, k_pos: list) -> VarlenBatch:
    """Packed sequences with the given query and key positions (host copies kept)."""
    cu_q = torch.tensor([0, *torch.tensor([len(p) for p in q_pos]).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor([len(p) for p in k_pos]).cumsum(0).tolist()], dtype=torch.int32)
    qp, kp = torch.cat(q_pos), torch.cat(k_pos)
    return VarlenBatch(
        cu_q.cuda(),
        cu_k.cuda(),
        max(len(p) for p in q_pos),
        max(len(p) for p in k_pos),
        qp.cuda(),
        kp.cuda(),
        False,
        cu_q.tolist(),
        cu_k.tolist(),
        qp,
        kp,
    )


def _check_against_math(name: str, batch: VarlenBatch, attend) -> None:
    nh, nkv, d = 32, 8, 128
    q = torch.randn(len(batch.q_positions_host), nh, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(len(batch.k_positions_host), nkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(len(batch.k_positions_host), nkv, d, device="cuda", dtype=torch.bfloat16)
    out, lse = attend(q, k, v, batch, d**-0.5)
    ref_out, ref_lse = _math_varlen(q, k, v, batch, d**-0.5)
    seen = torch.isfinite(ref_lse)  # queries with no visible key: LSE -inf on both sides
    assert torch.equal(seen, torch.isfinite(lse)), name
    e_out, e_lse = rel(out, ref_out), (lse[seen] - ref_lse[seen]).abs().max().item()
    print(f"{name} out rel err {e_out:.1e}  lse max abs err {e_lse:.1e}")
    assert e_out < 2e-2 and e_lse < 2e-2, name


def check_ring_blocks():
    """The ring's attention paths against the masked math path."""
    # Zigzag chunks with a cached prefix, and a decode token over its block: cuDNN blocks.
    batch = _positions_batch(
        [torch.cat([torch.arange(1024, 1536), torch.arange(3584, 4096)]), torch.tensor([777])],
        [
            torch.cat([torch.arange(0, 512), torch.arange(1024, 1536), torch.arange(3072, 4096)]),
            torch.arange(768, 778),
        ],
    )
    _check_against_math("ring blocks (cuDNN)", batch, attention_with_lse)
    # A rank's own zigzag chunks, and another rank's earlier chunk: one cuDNN call each.
    own = torch.cat([torch.arange(1024, 2048), torch.arange(6144, 7168)])
    other = torch.cat([torch.arange(0, 1024), torch.arange(7168, 8192)])
    for name, keys in (("local step", own), ("earlier chunk", other)):
        batch = _positions_batch([own], [keys])
        assert sum(len(g) for g in batch.plan().groups) == 1
        _check_against_math(f"ring zigzag {name} (one cuDNN call)", batch, attention_with_lse)
    # A decode step of the ring: one token per sequence, every key at or before it.
    batch = _positions_batch(
        [torch.tensor([900]), torch.tensor([40])],
        [torch.cat([torch.arange(0, 256), torch.arange(512, 900 + 1)]), torch.arange(0, 41)],
    )
    assert batch.plan().decode is not None
    _check_against_math("ring decode step (flash varlen)", batch, attention_with_lse)
    # Batched decode on one rank: sequences whose token is elsewhere, or with no key here.
    none = torch.tensor([], dtype=torch.int64)
    batch = _positions_batch(
        [torch.tensor([900]), none, torch.tensor([40]), torch.tensor([7]), torch.tensor([300])],
        [torch.arange(0, 600, 2), torch.arange(0, 64), torch.arange(0, 41), none, torch.arange(256, 300)],
    )
    assert batch.plan().decode is not None and batch.plan().decode.rows == [0, 1, 3]
    _check_against_math(
        "ring decode, sequences left out (flash varlen, seqused_k)", batch, attention_with_lse
    )


def check_merge():
    """The Triton merge against the torch merge, with parts that see nothing."""
    print(f"triton: {lse_merge.triton.__version__ if lse_merge.triton else 'not installed'}")
    torch.manual_seed(1)
    outs = [torch.randn(3000, 32, 128, device="cuda", dtype=torch.bfloat16) for _ in range(11)]
    lses = [torch.randn(3000, 32, device="cuda") * 4 for _ in range(11)]
    for lse in lses[::3]:
        lse[::7] = float("-inf")
    for lse in lses:
        lse[5] = float("-inf")  # a query that saw no key anywhere
    outs[2][lses[2] == float("-inf")] = float("nan")  # never read: its weight is 0
    out, lse = lse_merge.merge_partials(outs, lses)
    ref_out, ref_lse = lse_merge._merge_torch(outs, lses)
    e_out = rel(out, ref_out)
    finite = torch.isfinite(ref_lse)
    e_lse = (lse[finite] - ref_lse[finite]).abs().max().item()
    print(f"merge of 11 parts (Triton) out rel err {e_out:.1e}  lse max abs err {e_lse:.1e}")
    assert e_out < 1e-2 and e_lse < 1e-4 and (out[5] == 0).all() and torch.isinf(lse[5]).all()
    assert torch.equal(finite, torch.isfinite(lse))
    # A running merge (pass-KV on long prompts): float32 result, then merged on with the rest.
    head = lse_merge.merge_partials(outs[:3], lses[:3], out_dtype=torch.float32)
    out, lse = lse_merge.merge_partials([head[0], *outs[3:6]], [head[1], *lses[3:6]])
    ref_out, ref_lse = lse_merge._merge_torch(outs[:6], lses[:6])
    finite = torch.isfinite(ref_lse)
    e_out, e_lse = rel(out, ref_out), (lse[finite] - ref_lse[finite]).abs().max().item()
    print(f"running merge (Triton) out rel err {e_out:.1e}  lse max abs err {e_lse:.1e}")
    assert out.dtype == torch.bfloat16 and e_out < 1e-2 and e_lse < 1e-4
    # Parts holding a run of rows each, LSE in cuDNN's head-major layout.
    firsts = [0, 1000, 0, 2999, 1500]
    held = [(o[f:], lse.t().contiguous().t()[f:]) for o, lse, f in zip(outs, lses, firsts)]
    held[1] = (held[1][0][:700], held[1][1][:700])
    out, lse = lse_merge.merge_partials([h[0] for h in held], [h[1] for h in held], firsts, 3000)
    ref_out, ref_lse = lse_merge._merge_torch(
        *lse_merge._full_rows([h[0] for h in held], [h[1] for h in held], firsts, 3000)
    )
    finite = torch.isfinite(ref_lse)
    e_out, e_lse = rel(out, ref_out), (lse[finite] - ref_lse[finite]).abs().max().item()
    print(f"merge of row runs (Triton) out rel err {e_out:.1e}  lse max abs err {e_lse:.1e}")
    assert e_out < 1e-2 and e_lse < 1e-4 and torch.equal(finite, torch.isfinite(lse))


def check_skinny():
    """The skinny decode matmul on Llama-3-8B's and a tp=2 shard's shapes against cuBLAS in
    float32, for 1, 3 and 16 rows, with and without a bias; and that it is the path taken."""
    from ringserve.kernels import skinny_matmul

    torch.manual_seed(0)
    shapes = [
        (6144, 4096),
        (4096, 4096),
        (28672, 4096),
        (4096, 14336),
        (128256, 4096),
        (7168, 4096),
        (2048, 7168),
    ]
    worst = 0.0
    for (n, k), m, bias in itertools.product(shapes, (1, 3, 16), (False, True)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        x = torch.randn(m, k + 8, device="cuda", dtype=torch.bfloat16)[:, :k]  # strided rows
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
        plan = skinny_matmul.skinny_plan(x, w)
        assert plan is not None, (n, k)
        got = skinny_matmul.linear(x, w, b)
        want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        worst = max(worst, rel(got, want))
    print(f"skinny matmul against float32: worst rel err {worst:.1e} over {len(shapes)} shapes x 3 batches")
    assert worst < 1e-2
    # gate/up with the activation in the epilogue: Llama-3-8B's and a tp=2 shard's [2I, H]
    worst = 0.0
    for (n, k), m, activation in itertools.product(
        [(28672, 4096), (14336, 4096), (11264, 2048)], (1, 3, 16), skinny_matmul.GATED_ACTIVATIONS
    ):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        assert skinny_matmul.skinny_plan(x, w, gated=True) is not None, (n, k)
        got = skinny_matmul.gated_linear(x, w, activation)
        gate_up = torch.nn.functional.linear(x.float(), w.float())
        want = skinny_matmul.GATED_ACTIVATIONS[activation](gate_up)  # the CPU-form ops in float32
        worst = max(worst, rel(got, want))
    print(f"gated skinny matmul (silu, gelu) against float32: worst rel err {worst:.1e}")
    assert worst < 1e-2


def check_qkv_rope():
    """q/k/v's matmul with RoPE and the KV store in its epilogue (skinny_matmul.qkv_rope_store)
    against float32 (F.linear, then HF's RoPE) and against the two kernels it replaces (the
    skinny matmul, then kernels.rotary_store_kv), on Llama-3-8B's qkv, a tp=4 shard with a
    bias (Qwen2-like), head_dim 64, and a 2048-wide model (16 pairs a program): no larger
    error than the two kernels' (within 1.25x: the two differ by a bfloat16 rounding here and
    there, the matmul's dot having 32 columns, not 64), the cache slots holding exactly the k
    and v returned, and no other slot touched."""
    from ringserve.kernels import elementwise as kernels
    from ringserve.kernels import skinny_matmul

    errs = {"fused": 0.0, "two kernels": 0.0}
    diff = 0.0
    for (nq, nkv, d, hidden, bias), m in itertools.product(
        [
            (32, 8, 128, 4096, False),
            (8, 2, 128, 4096, True),
            (32, 8, 64, 2048, False),
            (16, 4, 128, 2048, True),
        ],
        (1, 3, 16),
    ):
        w = torch.randn((nq + 2 * nkv) * d, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5
        b = torch.randn(w.shape[0], device="cuda", dtype=torch.bfloat16) if bias else None
        x = torch.randn(m, hidden + 8, device="cuda", dtype=torch.bfloat16)[:, :hidden]
        angle = 1000 * torch.rand(m, 1, d // 2, device="cuda")
        cos = torch.cat([angle.cos()] * 2, -1).bfloat16()
        sin = torch.cat([angle.sin()] * 2, -1).bfloat16()
        slots = torch.randperm(64, device="cuda")[:m]
        caches = [torch.randn(64, nkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        before = [c.clone() for c in caches]
        got = skinny_matmul.qkv_rope_store(x, w, b, cos, sin, *caches, slots)
        assert got is not None, (nq, nkv, d, hidden)
        assert torch.equal(caches[0][slots], got[1]) and torch.equal(caches[1][slots], got[2])
        others = torch.ones(64, dtype=torch.bool, device="cuda")
        others[slots] = False
        assert all(torch.equal(c[others], c0[others]) for c, c0 in zip(caches, before))

        def split(y, m=m, d=d, parts=(nq * d, nkv * d, nkv * d)):
            return [part.view(m, -1, d) for part in y.split(list(parts), -1)]

        q, k, v = split(skinny_matmul.linear(x, w, b))
        two = (*kernels.rotary_store_kv(q, k, v, cos, sin, *[c.clone() for c in before], slots), v)
        q32, k32, v32 = split(
            torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        )
        want = (
            kernels.apply_rotary(q32, cos.float(), sin.float()),
            kernels.apply_rotary(k32, cos.float(), sin.float()),
            v32,
        )
        errs["fused"] = max(errs["fused"], *(rel(a, e) for a, e in zip(got, want)))
        errs["two kernels"] = max(errs["two kernels"], *(rel(a, e) for a, e in zip(two, want)))
        diff = max(diff, *((a.float() - e.float()).abs().max().item() for a, e in zip(got, two)))
    print(
        "q/k/v matmul with RoPE and KV store: worst rel err against float32 "
        + ", ".join(f"{k} {v:.2e}" for k, v in errs.items())
        + f"; max abs diff between the two {diff:.1e}"
    )
    assert errs["fused"] < 1e-2 and errs["fused"] <= 1.25 * errs["two kernels"]


def check_skinny_engine():
    """The skinny matmul inside the engine, where the tiny models never take it (too narrow):
    a 4-layer Llama of widths where every linear does (hidden 2048), bf16, a prefill and 24
    decode steps (CUDA graphs). Its logits' error against transformers in float32 on the
    same (bf16-rounded) weights must be no larger than the engine's own with cuBLAS for every
    matmul (transformers' own bf16 error is printed beside them for scale). (Greedy tokens of graphs against eager are not
    compared here: with these random weights the top logits lie closer than bf16's rounding,
    and eager decode splits the keys by the context, graphs by the longest one, so the two
    round differently; bench/gpu_decode_checks.py compares them on the tiny models.)"""
    import transformers as tf

    from ringserve.kernels import skinny_matmul

    config = tf.LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    calls, fused_calls = [], []
    kernel, plan, fused = (
        skinny_matmul.skinny_linear,
        skinny_matmul.skinny_plan,
        skinny_matmul.skinny_qkv_rope,
    )

    def counted(*args, **kwargs):
        calls.append(args[1].shape)
        return kernel(*args, **kwargs)

    def counted_fused(*args, **kwargs):
        fused_calls.append(args[1].shape)
        return fused(*args, **kwargs)

    with tempfile.TemporaryDirectory() as tmp:
        folder = save_random_model(config, f"{tmp}/llama_wide")
        tokens = torch.randint(0, 32000, (64,), generator=torch.Generator().manual_seed(2)).tolist()
        with torch.no_grad():
            ref = hf_model(folder).cuda().to(torch.bfloat16)
            ids = torch.tensor([tokens], device="cuda")
            hf_bf16 = ref(ids).logits[0]
            ref32 = ref.float()(ids).logits[0]  # the same bf16 weights, computed in float32
        errs = {}
        try:
            skinny_matmul.skinny_linear, skinny_matmul.skinny_qkv_rope = counted, counted_fused
            engine = LLMEngine(folder, device="cuda", dtype="bfloat16")
            errs["skinny"] = rel(engine_logits(engine, tokens, prefill=40), ref32)
            engine.close()
            taken, taken_fused = len(calls), len(fused_calls)
            skinny_matmul.skinny_plan = lambda *a, **kw: None
            engine = LLMEngine(folder, device="cuda", dtype="bfloat16")
            errs["cublas"] = rel(engine_logits(engine, tokens, prefill=40), ref32)
            engine.close()
        finally:
            skinny_matmul.skinny_linear, skinny_matmul.skinny_plan = kernel, plan
            skinny_matmul.skinny_qkv_rope = fused
    errs["transformers bf16"] = rel(hf_bf16, ref32)
    print(
        f"skinny matmul in the engine: {taken} calls and {taken_fused} of q/k/v with RoPE in 24 decode "
        f"steps; bf16 logits rel err against float32: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items())
    )
    # every decode step's 4 layers: o_proj, gate/up, down and the LM head; q/k/v fused
    assert taken >= 24 * (3 * 4 + 1) and taken_fused >= 24 * 4
    assert errs["skinny"] <= 1.05 * errs["cublas"]


MOE_ARCHITECTURES = ("mixtral", "qwen3_moe", "llama4", "gpt_oss")


def check_pdl():
    """Programmatic dependent launch changes no bit of the result: four Llama-3-8B-shaped
    decode layers of the engine's kernels (norm, qkv with RoPE and the KV store, paged attention
    and its merge, o_proj, gated gate/up, down) and an LM head, in a CUDA graph with PDL and in one
    without, each replayed 20 times at batch 1 and 16, every output equal to the first
    without PDL. (A kernel reading its input before the one before it finished would give
    other bits, some of the time: before each replay the KV slots the step writes are filled
    with noise, so the paged kernel reading this step's keys early would see it.)"""
    import bench_decode_chain as chain

    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape, scale=0.02):
        return scale * torch.randn(*shape, device=dev, dtype=dt, generator=gen)

    layers = [
        {"ln1": 1 + randn(chain.H, scale=0.1), "ln2": 1 + randn(chain.H, scale=0.1),
         "qkv": randn(chain.NQKV, chain.H), "o": randn(chain.H, chain.H),
         "gu": randn(2 * chain.INTER, chain.H), "down": randn(chain.H, chain.INTER)}
        for _ in range(4)
    ]  # fmt: skip
    lm_head, final_ln = randn(32000, chain.H), torch.ones(chain.H, device=dev, dtype=dt)
    for m in (1, 16):
        x0 = randn(m, chain.H, scale=1.0)
        attend = chain.attention_stand_in(m, dev, dt)
        outs = {}
        for pdl in (False, True):
            run = chain.engine_chain(x0, layers, lm_head, final_ln, attend, pdl)
            run()  # compiles the kernels outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = run()
            outs[pdl] = []
            for _ in range(20):
                attend.scramble()
                graph.replay()
                outs[pdl].append(out.clone())
        ref = outs[False][0]
        differ = sum(not torch.equal(out, ref) for out in outs[False] + outs[True])
        print(f"PDL at batch {m}: {differ} of 40 replays differ from the first without PDL")
        assert differ == 0


def reference_config(arch: str):
    """The tiny model's config, as this machine's transformers runs it: releases before 5.2x
    hard-code gpt-oss's SwiGLU limit (7.0) and ignore the config's, so the tiny model's limit
    of 1.0 (exercised on the CPU against a newer transformers) is raised to theirs."""
    config = make_hf_config(arch)
    if arch == "gpt_oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        hard_coded = GptOssExperts(config).limit
        if hard_coded != config.swiglu_limit:
            print(
                f"gpt_oss: this transformers ignores swiglu_limit (uses {hard_coded}): the check uses it too"
            )
            config.swiglu_limit = hard_coded
    return config


def check_models():
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHITECTURES:
            folder = save_random_model(reference_config(arch), f"{tmp}/{arch}")
            tokens = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(1)).tolist()
            ref = hf_model(folder).cuda()
            with torch.no_grad():
                ref_logits = ref(torch.tensor([tokens], device="cuda")).logits[0]
            ours = engine_logits(LLMEngine(folder, device="cuda", dtype="float32"), tokens, prefill=40)
            e32 = rel(ours, ref_logits)
            ours16 = engine_logits(LLMEngine(folder, device="cuda", dtype="bfloat16"), tokens, prefill=40)
            with torch.no_grad():  # bf16 against transformers in bf16: the same rounding regime
                ref16 = (
                    hf_model(folder)
                    .cuda()
                    .to(torch.bfloat16)(torch.tensor([tokens], device="cuda"))
                    .logits[0]
                )
            e16 = rel(ours16, ref16)
            prompt = tokens[:20]
            with LLM(folder, device="cuda", dtype="float32") as llm:
                got = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
            want = hf_greedy(ref.cpu(), prompt, 16)
            print(
                f"{arch:10s} cuda fp32 logits rel err {e32:.1e}, bf16 {e16:.1e}, "
                f"greedy equal: {got.token_ids == want}"
            )
            # MoE in bf16: a rounding difference can flip a token's expert choice, which moves
            # that token's output a lot in a tiny random model; float32 is the exact check.
            assert e32 < 1e-4 and e16 < (1e-1 if arch in MOE_ARCHITECTURES else 3e-2), arch
            assert got.token_ids == want, arch


def check_paged():
    """The paged kernel in bf16 against the math path over each context gathered by hand."""
    from ringserve.attention import paged as pa

    torch.manual_seed(0)
    nh, nkv, d, bs = 32, 8, 128, 16
    cases = {
        "decode, split-KV": ([1] * 6, [1, 17, 300, 2048, 5000, 64], 8),
        "decode, no split": ([1] * 3, [33, 900, 4000], 1),
        "chunks after a prefix, mixed": ([1, 200, 37, 1], [700, 900, 37, 12], 1),
    }
    windows = {
        "": AttentionWindow(),
        ", sliding 128": AttentionWindow(sliding=128),
        ", chunk 256": AttentionWindow(chunk=256),
    }
    for (name, (q_lens, seq_lens, splits)), (window_name, window) in itertools.product(
        cases.items(), windows.items()
    ):
        name += window_name
        blocks = sum(-(-n // bs) for n in seq_lens)
        k_cache = torch.randn(blocks * bs, nkv, d, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn(blocks * bs, nkv, d, device="cuda", dtype=torch.bfloat16)
        tables = torch.zeros(len(q_lens), 512, dtype=torch.int32, device="cuda")
        perm, used = torch.randperm(blocks), 0
        for row, n in enumerate(seq_lens):
            tables[row, : -(-n // bs)] = perm[used : used + -(-n // bs)].int().cuda()
            used += -(-n // bs)
        q = torch.randn(sum(q_lens), nh, d, device="cuda", dtype=torch.bfloat16)
        cu = [0] + torch.tensor(q_lens).cumsum(0).tolist()
        decode = all(n == 1 for n in q_lens)
        qpt = pa.tile_queries(nh, nkv, decode)
        tile_seq = [i for i, n in enumerate(q_lens) for _ in range(0, n, qpt)]
        tile_q0 = [q0 for n in q_lens for q0 in range(0, n, qpt)]

        def i32(x):
            return torch.tensor(x, dtype=torch.int32, device="cuda")

        rows = list(range(len(q_lens)))
        batch = pa.PagedBatch(i32(rows), i32(cu), i32(seq_lens), i32(tile_seq), i32(tile_q0), qpt, splits)
        out, lse = pa.paged_attention(q, k_cache, v_cache, tables, batch, bs, d**-0.5, window)
        ref_out, ref_lse = pa.paged_attention_reference(
            q.float(), k_cache.float(), v_cache.float(), tables, batch, bs, d**-0.5, window
        )
        e_out, e_lse = rel(out, ref_out), (lse - ref_lse).abs().max().item()
        # The same reference on the CPU: tells a wrong kernel from a wrong GPU reference path.
        cpu_out, cpu_lse = pa.paged_attention_reference(
            q.float().cpu(),
            k_cache.float().cpu(),
            v_cache.float().cpu(),
            tables.cpu(),
            batch,
            bs,
            d**-0.5,
            window,
        )
        e_cpu = rel(out.cpu(), cpu_out)
        e_ref = rel(ref_out.cpu(), cpu_out)
        print(
            f"paged {name:45s} out rel err {e_out:.1e}  lse max abs err {e_lse:.1e}  "
            f"(kernel vs CPU reference {e_cpu:.1e}, GPU vs CPU reference {e_ref:.1e})"
        )
        assert e_cpu < 1e-2 and e_ref < 1e-3 and e_out < 1e-2 and e_lse < 2e-2, name


def check_sampler():
    """Batched sampling on the GPU: no host sync inside, the same tokens as on the CPU
    (the random numbers are integer hashes), and its time for a batch of 64."""
    from ringserve.engine.sampler import SamplingTensors, sample_tokens
    from ringserve.engine.sequence import Sequence

    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1),
        SamplingParams(temperature=1.0, top_k=50, seed=2),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.5, seed=3),
    ]
    seqs = [Sequence(str(i), [1, 2, 3], params[i % 4]) for i in range(64)]
    logits = torch.randn(64, 128256, device="cuda") * 3
    tensors = SamplingTensors.from_seqs(seqs, logits.device, logits.shape[1])
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = sample_tokens(logits, tensors)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu = sample_tokens(logits.cpu(), SamplingTensors.from_seqs(seqs, torch.device("cpu"), logits.shape[1]))
    same = (tokens.cpu() == cpu).float().mean().item()
    # Where a difference comes from: the noise (integer hash, then float64 logs) or the filters.
    from ringserve.engine.sampler import _gumbel, filtered_logits

    cpu_tensors = SamplingTensors.from_seqs(seqs, torch.device("cpu"), logits.shape[1])
    noise_gpu, noise_cpu = _gumbel(tensors, logits.shape[1]).cpu(), _gumbel(cpu_tensors, logits.shape[1])
    kept_gpu = filtered_logits(logits, tensors).isfinite().cpu()
    kept_cpu = filtered_logits(logits.cpu(), cpu_tensors).isfinite()
    print(
        f"sampler parts: noise max |GPU - CPU| {(noise_gpu - noise_cpu).abs().max().item():.3g}, "
        f"equal {(noise_gpu == noise_cpu).float().mean().item():.4f}; kept-token masks differ in "
        f"{(kept_gpu != kept_cpu).sum().item()} of {kept_cpu.numel()} entries"
    )
    from common import event_time_ms

    ms = event_time_ms(lambda: sample_tokens(logits, tensors))
    print(
        f"sampler: no host sync; GPU tokens equal the CPU's for {same:.0%} of 64 rows; {ms:.3f} ms for 64 x 128256"
    )
    assert same > 0.95


if __name__ == "__main__":
    checks = [
        check_skinny,
        check_qkv_rope,
        check_skinny_engine,
        check_pdl,
        check_sampler,
        check_paged,
        check_attention,
        check_ring_blocks,
        check_merge,
        check_models,
    ]
    only = sys.argv[1:]  # names of checks to run (default: all)
    unknown = set(only) - {check.__name__ for check in checks}
    if unknown:
        sys.exit(f"no such check: {', '.join(sorted(unknown))}; the checks: {[c.__name__ for c in checks]}")
    failed = []
    for check in checks:
        if only and check.__name__ not in only:
            continue
        try:
            check()
        except Exception as e:  # the other checks still run: one report of everything
            print(f"FAILED {check.__name__}: {type(e).__name__}: {e}")
            failed.append(check.__name__)
    print(f"GPU CHECKS FAILED: {', '.join(failed)}" if failed else "GPU CHECKS PASSED")
    sys.exit(1 if failed else 0)
