"""Would our own skinny matmuls pay inside the decode graph? Llama-3-8B's 32 layers of
matmuls and the small kernels between them (attention left out: it is the same in every
variant), captured in one CUDA graph and replayed, at batch 1 and 16:

  base      cuBLAS (F.linear) with the engine's fused add+RMSNorm and SiLU-mul kernels
  skinny    the same chain with a Triton skinny matmul for every linear
  normepi   no norm kernels: each RMSNorm's weight folded into the matmul after it, whose
            epilogue scales by rstd; the matmul before it adds the residual in its epilogue
            and adds its columns' sum of squares to the row's (atomics); one memset a step
  glu       skinny, with gate/up's SiLU-mul in its epilogue (ringserve.kernels.skinny_matmul's
            gated_linear: no SiLU-mul kernel, no [M, 2I] round trip); tiles swept first
  normepi+glu  both: gate/up's gated epilogue scales by rstd, then applies SiLU-mul
  (programmatic dependent launch with each skinny program's first weight tile read before
  waiting, peeled out of its loop, was measured slower at 8a52eca: BENCHMARKS.md; waiting
  first, as the engine's kernels now do, is faster: kind "engine" below)
  with --sweep, first a sweep of tiles per shape (else the tiles found at 75c910a), and:
  silu      down_proj reads gate/up and applies SiLU-mul as it loads (no SiLU-mul kernel)
  norm      qkv and gate_up add the residual and apply the RMSNorm as they load (no norm
            kernel; program 0 writes the new residual stream)

  with --attention, each layer also runs its attention (ringserve's RoPE + KV store, paged
  kernel and split merge over a 1K context, the splits an engine sized for 128K takes)
  (weight tiles loaded through TMA descriptors, swept per shape and chained as "glu+tma",
  gained nothing at e455245^ and were dropped: BENCHMARKS.md; the code is in e455245)
  (an L2 prefetch of o_proj's weight on a side stream while attention runs was measured
  slower at e982a09 and dropped: BENCHMARKS.md; its code is in commit 2327384)
  engine    the engine's own functions (ringserve.kernels.elementwise, skinny_matmul, paged_attention),
            every kernel launched with programmatic dependent launch (ringserve.kernels.pdl); with
            --attention, q/k/v's matmul does RoPE and the KV store (qkv_rope_store)
  engine-nopdl  the same without PDL
  (PDL with the skinny matmul letting the next kernel launch only after its weight stream,
  or prefetching its first 1-2 weight tiles into L2 before waiting, and normepi+glu with
  PDL, were measured slower at e455245^ / e455245 and dropped: BENCHMARKS.md)

  PYTHONPATH=. python bench/bench_decode_chain.py [--batch 1 16] [--sweep] [--attention]

Prints each variant's replay time per step and its difference to base, and checks every
variant's output against base (bf16 rounding differs where the norm is fused).
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ringserve.attention import paged as pa
from ringserve.kernels.elementwise import add_rms_norm, rotary_store_kv, silu_mul
from ringserve.kernels.skinny_matmul import (
    gated_activation,
    qkv_rope_store,
    skinny_linear,
    skinny_plan,
    stream_weights,
)

H, INTER, NQKV, V, LAYERS = 4096, 14336, 6144, 128256, 32
NH, NKV, D, PAGE, CONTEXT = 32, 8, 128, 16, 1024


@triton.jit
def _tile(
    acc, sq, w, k0, pid, x_ptr, res_ptr, nw_ptr, res_out_ptr, rm, rk, m_ok, stride_x, K: tl.constexpr,
    PROLOGUE: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """One BLOCK_K step: x's tile through the prologue, times the weight tile w."""
    kk = k0 + rk
    x = tl.load(x_ptr + rm[:, None] * stride_x + kk[None, :], mask=m_ok, other=0.0)
    if PROLOGUE == 1:
        r = tl.load(res_ptr + rm[:, None] * K + kk[None, :], mask=m_ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        if pid == 0:
            tl.store(res_out_ptr + rm[:, None] * K + kk[None, :], x, mask=m_ok)
        xf = x.to(tl.float32)
        sq += xf * xf
        x = (xf * tl.load(nw_ptr + kk).to(tl.float32)[None, :]).to(x.dtype)
    if PROLOGUE == 2:
        u = tl.load(x_ptr + rm[:, None] * stride_x + K + kk[None, :], mask=m_ok, other=0.0)
        g = x.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(u.dtype)
        x = (act.to(tl.float32) * u.to(tl.float32)).to(u.dtype)
    if BLOCK_M >= 16:
        acc += tl.dot(x, tl.trans(w))
    else:
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    return acc, sq


@triton.jit
def _skinny(
    x_ptr, w_ptr, y_ptr, res_ptr, nw_ptr, res_out_ptr, M, N, stride_x, eps, K: tl.constexpr,
    PROLOGUE: tl.constexpr,  # 0: x; 1: x + res, RMS-normed by nw; 2: silu(x[:, :K]) * x[:, K:]
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # y[M, N] = prologue(x)[M, K] @ w[N, K]^T; one program per BLOCK_N output columns, all of
    # K. BLOCK_M >= 16 runs tensor-core dots; below, a broadcast multiply and sum (a GEMV).
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm[:, None] < M
    w_rows = w_ptr + rn[:, None] * K
    n_ok = rn[:, None] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sq = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = tl.load(w_rows + (k0 + rk)[None, :], mask=n_ok, other=0.0)
        acc, sq = _tile(
            acc,
            sq,
            w,
            k0,
            pid,
            x_ptr,
            res_ptr,
            nw_ptr,
            res_out_ptr,
            rm,
            rk,
            m_ok,
            stride_x,
            K,
            PROLOGUE,
            BLOCK_M,
        )
    if PROLOGUE == 1:
        acc *= tl.rsqrt(tl.sum(sq, axis=1) / K + eps)[:, None]
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=m_ok & n_ok.T)


@triton.jit
def _skinny_epi(
    x_ptr, w_ptr, y_ptr, res_ptr, sq_in_ptr, sq_out_ptr, M, N, stride_x, eps, K: tl.constexpr,
    RSTD: tl.constexpr, RESIDUAL: tl.constexpr, GATED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # The norm moved into epilogues, nothing on x's load path (GATED: w is [2N, K], gate
    # rows then up rows, and y = silu(gate) * up, both scaled by rstd first):
    #   RSTD: x is the residual stream and w has the RMSNorm weight folded in (w * nw), so
    #         norm(x) @ w^T = (x @ (w * nw)^T) * rstd, rstd = rsqrt(sq_in[m] / K + eps);
    #   RESIDUAL: y = x @ w^T + res, rounded, stored, and sum(y^2) over this program's
    #         columns added to sq_out[m] (the next norm's sum of squares, by atomics).
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    n_ok = rn < N
    w_rows = w_ptr + rn[:, None] * K
    acc, acc_up = stream_weights(
        x_ptr, w_rows, w_rows + N * K, stride_x, rm, tl.arange(0, BLOCK_K), m_ok[:, None], n_ok, K, GATED,
        BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    if RSTD:
        rstd = tl.rsqrt(tl.load(sq_in_ptr + rm, mask=m_ok, other=0.0) / K + eps)[:, None]
        acc *= rstd
        acc_up *= rstd
    if GATED:  # SiLU-mul
        acc = gated_activation(acc, acc_up, y_ptr.dtype.element_ty, 1)
    ok = m_ok[:, None] & n_ok[None, :]
    if RESIDUAL:
        acc += tl.load(res_ptr + rm[:, None] * N + rn[None, :], mask=ok, other=0.0).to(tl.float32)
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], y, mask=ok)
    if RESIDUAL:
        yf = tl.where(ok, y.to(tl.float32), 0.0)
        tl.atomic_add(sq_out_ptr + rm, tl.sum(yf * yf, axis=1), mask=m_ok)


def skinny_epi(x, w, cfg, rstd_from=None, res=None, sq_out=None, eps=1e-5, gated=False):
    m = x.shape[0]
    n, k = w.shape
    n = n // 2 if gated else n
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bn, bk, warps, stages = cfg
    _skinny_epi[(triton.cdiv(n, bn),)](
        x, w, y, res if res is not None else y, rstd_from if rstd_from is not None else y,
        sq_out if sq_out is not None else y, m, n, x.stride(0), eps, K=k, RSTD=rstd_from is not None,
        RESIDUAL=res is not None, GATED=gated, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    return y


def attention_stand_in(m: int, device, dtype):
    """attend(i, qkv) -> [m, H]: layer i's decode attention over a 1K context per row, as the
    engine runs it (RoPE, KV store, paged kernel + merge); (lambda: qkv's q columns) if None."""
    blocks = m * CONTEXT // PAGE
    caches = [
        (torch.randn(blocks * PAGE, NKV, D, device=device, dtype=dtype), torch.randn(blocks * PAGE, NKV, D, device=device, dtype=dtype))
        for _ in range(LAYERS)
    ]  # fmt: skip
    tables = torch.randperm(blocks, device=device).int().view(m, CONTEXT // PAGE)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    rows = list(range(m))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    splits = pa.decode_splits(m, NKV, 131200, sms)  # an engine sized for 128K, as bench_decode
    paged = pa.PagedBatch(
        i32(rows), i32(list(range(m + 1))), i32([CONTEXT] * m), i32(rows), i32([0] * m), 1, splits
    )
    slots = tables[:, -1].long() * PAGE + (CONTEXT - 1) % PAGE
    angle = torch.randn(m, 1, D // 2, device=device)
    cos, sin = torch.cat([angle.cos()] * 2, -1).to(dtype), torch.cat([angle.sin()] * 2, -1).to(dtype)
    print(f"M={m:2d} attention: {splits} splits", flush=True)

    def attend(i, qkv, pdl=False):
        q = qkv[:, : NH * D].view(m, NH, D)
        k = qkv[:, NH * D : (NH + NKV) * D].view(m, NKV, D)
        v = qkv[:, (NH + NKV) * D :].view(m, NKV, D)
        q, _ = rotary_store_kv(q, k, v, cos, sin, *caches[i], slots, pdl=pdl)
        out, _ = pa.paged_attention(q, *caches[i], tables, paged, PAGE, D**-0.5, pdl=pdl)
        return out.view(m, H)

    def scramble():
        """Noise in the slots this step writes, as a graph replay finds them: the paged
        kernel must read what RoPE + KV store wrote there, not what it found."""
        for k_cache, v_cache in caches:
            k_cache[slots] = torch.randn_like(k_cache[slots])
            v_cache[slots] = torch.randn_like(v_cache[slots])

    attend.scramble = scramble

    def projected(i, h, w_qkv, pdl=False):
        """attend(i, h @ w_qkv^T) as the engine runs it: the projection, RoPE and the KV store
        in one kernel (skinny_matmul.qkv_rope_store), then the paged kernel and merge."""
        q, _, _ = qkv_rope_store(h, w_qkv, None, cos, sin, *caches[i], slots, pdl=pdl)
        out, _ = pa.paged_attention(q, *caches[i], tables, paged, PAGE, D**-0.5, pdl=pdl)
        return out.view(m, H)

    attend.projected = projected
    return attend


def norm_epilogue_chain(x0, layers, lm_head, final_ln, best, attend, glu_cfg=None):
    """The chain with every RMSNorm in epilogues (kind "normepi"): norm weights folded into
    the next matmul's weight, one memset of the per-layer sums of squares per step."""
    folded = [
        {"qkv": layer["qkv"] * layer["ln1"][None, :], "gu": layer["gu"] * layer["ln2"][None, :]}
        for layer in layers
    ]
    lm_folded = lm_head * final_ln[None, :]
    sums = torch.zeros(2 * len(layers) + 1, x0.shape[0], device=x0.device, dtype=torch.float32)

    def cfg(name):
        return best[name, 0][0]

    def run():
        sums.zero_()
        sums[0] = x0.float().pow(2).sum(-1)
        h = x0
        for i, (layer, f) in enumerate(zip(layers, folded)):
            qkv = skinny_epi(h, f["qkv"], cfg("qkv"), rstd_from=sums[2 * i])
            h = skinny_epi(attend(i, qkv), layer["o"], cfg("o"), res=h, sq_out=sums[2 * i + 1])
            if glu_cfg is None:
                act = silu_mul(skinny_epi(h, f["gu"], cfg("gu"), rstd_from=sums[2 * i + 1]))
            else:  # normepi+glu: the gated epilogue scales by rstd first
                act = skinny_epi(h, f["gu"], glu_cfg, rstd_from=sums[2 * i + 1], gated=True)
            h = skinny_epi(act, layer["down"], cfg("down"), res=h, sq_out=sums[2 * i + 2])
        return skinny_epi(h, lm_folded, cfg("lm"), rstd_from=sums[-1])

    return run


def engine_chain(x0, layers, lm_head, final_ln, attend, pdl):
    """The chain through the engine's own functions (kinds "engine", "engine-nopdl")."""

    def lin(x, w, activation=None):
        plan = skinny_plan(x, w, gated=activation is not None)
        return skinny_linear(x, w, None, plan, activation, pdl=pdl)

    def run():
        x, residual = x0, torch.zeros_like(x0)
        for i, layer in enumerate(layers):
            h, residual = add_rms_norm(x, residual, layer["ln1"], 1e-5, pdl=pdl)
            if hasattr(attend, "projected"):  # the q/k/v matmul with RoPE and the KV store
                a = lin(attend.projected(i, h, layer["qkv"], pdl=pdl), layer["o"])
            else:
                a = lin(attend(i, lin(h, layer["qkv"]), pdl=pdl), layer["o"])
            h, residual = add_rms_norm(a, residual, layer["ln2"], 1e-5, pdl=pdl)
            x = lin(lin(h, layer["gu"], "silu"), layer["down"])
        h, _ = add_rms_norm(x, residual, final_ln, 1e-5, pdl=pdl)
        return lin(h, lm_head)

    return run


def skinny(x, w, cfg, prologue=0, res=None, nw=None, res_out=None, eps=1e-5, out=None, block_m=16):
    m = x.shape[0]
    n, k = w.shape
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    bn, bk, warps, stages = cfg
    _skinny[(triton.cdiv(n, bn),)](
        x, w, y, res if res is not None else x, nw if nw is not None else x, res_out if res_out is not None else y,
        m, n, x.stride(0), eps, K=k, PROLOGUE=prologue, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


def sweep_glu(m, ws):
    """The gated gate/up matmul's fastest (BLOCK_N per half, BLOCK_K, stages) over ws."""
    x = torch.randn(m, H, device=ws[0].device, dtype=ws[0].dtype)
    results = []
    for plan in itertools.product((16, 32, 64), (64, 128, 256), (3, 4)):
        if plan[0] * plan[1] * 4 * plan[2] > 200_000:
            continue
        try:
            t, _ = graph_ms(
                lambda plan=plan: [skinny_linear(x, w, None, plan, "silu", pdl=False) for w in ws], reps=20
            )
        except Exception as e:
            print(f"  glu {plan}: {type(e).__name__}", flush=True)
            continue
        results.append((t * 1000 / len(ws), plan))
    results.sort()
    t_sep, _ = graph_ms(lambda: [silu_mul(F.linear(x, w)) for w in ws])
    print(
        f"M={m:2d} gate_up + SiLU-mul: gated best {results[0][0]:6.1f} us {results[0][1]} | cuBLAS + "
        f"kernel {t_sep * 1000 / len(ws):6.1f} us | next {[(round(t, 1), p) for t, p in results[1:4]]}",
        flush=True,
    )
    return results[0][1]


def graph_ms(fn, reps=50):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000 / reps, g


def sweep(m, name, ws, k, prologue, configs):
    """The (config, BLOCK_M) fastest over the weights ws back to back in a graph, m rows."""
    dev, dt = ws[0].device, ws[0].dtype
    xin = torch.randn(m, 2 * k if prologue == 2 else k, device=dev, dtype=dt)
    extra = {}
    if prologue == 1:
        extra = dict(res=torch.randn(m, k, device=dev, dtype=dt), nw=torch.ones(k, device=dev, dtype=dt))
        extra["res_out"] = torch.empty_like(extra["res"])
    block_ms = (16, triton.next_power_of_2(m)) if m < 16 else (16,)
    results = []
    for cfg, block_m in itertools.product(configs, block_ms):
        if cfg[0] * cfg[1] * 2 * cfg[3] > 200_000 or (block_m < 16 and cfg[0] * cfg[1] > 8192):
            continue
        try:
            t, _ = graph_ms(
                lambda cfg=cfg, bm=block_m: [skinny(xin, w, cfg, prologue, block_m=bm, **extra) for w in ws],
                reps=20,
            )
        except Exception as e:  # out of shared memory, etc.
            print(f"  {name} {cfg}: {type(e).__name__}", flush=True)
            continue
        results.append((t, cfg, block_m))
    results.sort()
    per = 1000 / len(ws)
    line = (
        f"M={m:2d} {name:5s} prologue {prologue}: skinny best {results[0][0] * per:6.1f} us {results[0][1:]}"
    )
    if prologue == 0:
        t_cublas, _ = graph_ms(lambda: [F.linear(xin, w) for w in ws])
        line += f" | cuBLAS {t_cublas * per:6.1f} us"
    print(f"{line} | next {[(round(t * per, 1), c, b) for t, c, b in results[1:4]]}", flush=True)
    return results[0][1:]


def run_batch(m, layers, lm_head, final_ln, shapes, configs, args):
    dev, dt = lm_head.device, lm_head.dtype
    x0 = torch.randn(m, H, device=dev, dtype=dt)
    # (name, prologue) -> (config, BLOCK_M), by a sweep over 32 distinct weights, or as the
    # sweep of commit 75c910a found them on an H200
    best = {
        ("qkv", 0): ((64, 256, 4, 4), 16),
        ("o", 0): ((32, 512, 4, 4), 16),
        ("gu", 0): ((32, 128, 4, 3), 16),
        ("down", 0): ((32, 512, 4, 4), 16),
        ("lm", 0): ((64, 128, 4, 3), 16),
    }
    for name, (_n, k) in shapes.items() if args.sweep else ():
        ws = [layer[name] for layer in layers] if name != "lm" else [lm_head]
        for prologue in {"qkv": (0, 1), "gu": (0, 1), "down": (0, 2)}.get(name, (0,)):
            best[name, prologue] = sweep(m, name, ws, k, prologue, configs)

    glu_plan = sweep_glu(m, [layer["gu"] for layer in layers])
    attend = attention_stand_in(m, dev, dt) if args.attention else (lambda i, qkv, pdl=False: qkv[:, :H])

    def chain(kind: str):
        if kind.startswith("engine"):
            return engine_chain(x0, layers, lm_head, final_ln, attend, kind == "engine")
        if kind.startswith("normepi"):
            glu_cfg = (glu_plan[0], glu_plan[1], 4, glu_plan[2]) if kind == "normepi+glu" else None
            return norm_epilogue_chain(x0, layers, lm_head, final_ln, best, attend, glu_cfg)

        def lin(x, name, w, prologue=0, **kw):
            if kind == "base":
                return F.linear(x, w)
            cfg, block_m = best[name, prologue]
            return skinny(x, w, cfg, prologue, block_m=block_m, **kw)

        def normed(x, residual, ln, name, w):
            """(w applied to norm(x + residual), x + residual): the norm a kernel, or in the
            matmul's prologue (kind "norm")."""
            if kind == "norm":
                new_res = torch.empty_like(x)
                return lin(x, name, w, 1, res=residual, nw=ln, res_out=new_res), new_res
            h, residual = add_rms_norm(x, residual, ln, 1e-5, pdl=False)
            return lin(h, name, w), residual

        def run():
            x, residual = x0, torch.zeros_like(x0)
            for i, layer in enumerate(layers):
                qkv, residual = normed(x, residual, layer["ln1"], "qkv", layer["qkv"])
                a = lin(attend(i, qkv), "o", layer["o"])
                if kind.startswith("glu"):
                    h, residual = add_rms_norm(a, residual, layer["ln2"], 1e-5, pdl=False)
                    x = lin(
                        skinny_linear(h, layer["gu"], None, glu_plan, "silu", pdl=False),
                        "down",
                        layer["down"],
                    )
                    continue
                gu, residual = normed(a, residual, layer["ln2"], "gu", layer["gu"])
                if kind in ("base", "skinny"):
                    x = lin(silu_mul(gu), "down", layer["down"])
                else:
                    x = lin(gu, "down", layer["down"], 2)
            h, _ = add_rms_norm(x, residual, final_ln, 1e-5, pdl=False)
            return lin(h, "lm", lm_head)

        return run

    outs = {}
    base_ms = None
    kinds = ["base", "skinny", "glu", "normepi", "normepi+glu"] + (["silu", "norm"] if args.sweep else [])
    kinds += ["engine-nopdl", "engine"]
    for kind in kinds:
        fn = chain(kind)
        try:
            ms, g = graph_ms(fn)
        except Exception as e:
            print(f"M={m:2d} {kind}: failed {type(e).__name__}: {e}", flush=True)
            continue
        out = fn().float()
        outs[kind] = out
        base_ms = base_ms or ms
        err = ((out - outs["base"]).norm() / outs["base"].norm()).item()
        print(
            f"M={m:2d} chain {kind:7s}: {ms:6.3f} ms ({ms - base_ms:+.3f} vs base), "
            f"rel err vs base {err:.1e}",
            flush=True,
        )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--sweep", action="store_true", help="sweep tiles, and run the prologue variants")
    parser.add_argument(
        "--attention", action="store_true", help="attention in each layer, as the engine runs it"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    layers = [
        {
            "ln1": 1 + 0.1 * torch.randn(H, device=dev, dtype=dt),
            "ln2": 1 + 0.1 * torch.randn(H, device=dev, dtype=dt),
            "qkv": 0.02 * torch.randn(NQKV, H, device=dev, dtype=dt),
            "o": 0.02 * torch.randn(H, H, device=dev, dtype=dt),
            "gu": 0.02 * torch.randn(2 * INTER, H, device=dev, dtype=dt),
            "down": 0.02 * torch.randn(H, INTER, device=dev, dtype=dt),
        }
        for _ in range(LAYERS)
    ]
    lm_head = 0.02 * torch.randn(V, H, device=dev, dtype=dt)
    final_ln = torch.ones(H, device=dev, dtype=dt)
    shapes = {"qkv": (NQKV, H), "o": (H, H), "gu": (2 * INTER, H), "down": (H, INTER), "lm": (V, H)}
    configs = list(itertools.product((16, 32, 64), (128, 256, 512), (4,), (3, 4)))
    for m in args.batch:
        run_batch(m, layers, lm_head, final_ln, shapes, configs, args)


if __name__ == "__main__":
    main()
