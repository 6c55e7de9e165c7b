"""Next-token choice for the whole batch on the device: greedy, temperature, min-p, top-k, top-p.

Rows of one batch may carry different parameters. Everything is batched tensor ops with no
host sync until the caller reads the chosen ids (one transfer per step), so `sample_tokens`
can later run inside a CUDA graph or overlap the next step.

Random numbers come from a counter-based RNG, not from per-sequence torch.Generator state:
the uniform for (row, vocab index v) is a hash of (the request's seed, the number of tokens
that request has generated so far, v). Step t of a seeded request therefore uses the same
random numbers whatever its neighbours, its position in the batch, or a preemption that
recomputes it. The draw is a Gumbel-max race: argmax(filtered_logits + Gumbel noise)
samples from softmax(filtered_logits), with only elementwise ops and an argmax per row
(no reduction whose rounding could depend on the batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringserve.engine.sequence import Sequence
from ringserve.sampling_params import SamplingParams

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton
    triton = None

_MASK32 = 0xFFFFFFFF
_NO_TOP_K = 2**31 - 1  # top_k "all" when the vocabulary size is not known yet; clamped to V


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of one batch, on the device. S = rows (sequences)."""

    temperature: torch.Tensor  # [S] float32; greedy rows hold 1.0 (never divided by 0)
    greedy: torch.Tensor  # [S] bool
    top_k: torch.Tensor  # [S] int64; "all" is V (or _NO_TOP_K, clamped to V when sampling)
    top_p: torch.Tensor  # [S] float32; 1.0 keeps all
    min_p: torch.Tensor  # [S] float32; 0.0 keeps all
    # [S] int64 in [0, 2^32): the row's RNG keys, hashes of its request's 64-bit seed and
    # counter (the tokens it has generated so far), made on the host with the row's params.
    key: torch.Tensor
    key2: torch.Tensor
    all_greedy: bool  # host flag: the batch needs only an argmax
    needs_sort: bool  # host flag: some sampled row has top-k < V or top-p < 1
    needs_min_p: bool = False  # host flag: some sampled row has min_p > 0

    @classmethod
    def from_seqs(
        cls,
        seqs: list[Sequence],
        device: torch.device | str,
        vocab_size: int | None = None,
        positions: list[int] | None = None,
    ) -> SamplingTensors:
        """O(S) host work and two host-to-device copies; the flags come from the params, not the device.
        positions: each row's place after its sequence's next token (0 for the next token
        itself; a verified run's rows count on, engine/speculative.py), whose draw it keys."""
        floats, ints = [], []
        all_greedy, needs_sort, needs_min_p = True, False, False
        for row, seq in enumerate(seqs):
            p = seq.params
            greedy = p.greedy
            top_k = p.top_k if p.top_k > 0 else (vocab_size or _NO_TOP_K)
            if vocab_size is not None:
                top_k = min(top_k, vocab_size)
            top_p, min_p = p.top_p, p.min_p
            if greedy:
                top_k, top_p, min_p = vocab_size or _NO_TOP_K, 1.0, 0.0
            else:
                all_greedy = False
                needs_sort |= top_p < 1.0 or top_k < (vocab_size or _NO_TOP_K)
                needs_min_p |= min_p > 0
            # Greedy rows draw nothing: no keys to hash.
            key, key2 = (
                (0, 0)
                if greedy
                else _row_keys(
                    seq.sampling_seed & 0xFFFFFFFFFFFFFFFF,
                    len(seq.output_token_ids) + (positions[row] if positions else 0),
                )
            )
            floats.append((1.0 if greedy else p.temperature, top_p, min_p))
            ints.append((int(greedy), top_k, key, key2))
        f = torch.tensor(floats, dtype=torch.float32).reshape(-1, 3).to(device, non_blocking=True)
        i = torch.tensor(ints, dtype=torch.int64).reshape(-1, 4).to(device, non_blocking=True)
        return cls(
            temperature=f[:, 0],
            greedy=i[:, 0].bool(),
            top_k=i[:, 1],
            top_p=f[:, 1],
            min_p=f[:, 2],
            key=i[:, 2],
            key2=i[:, 3],
            all_greedy=all_greedy,
            needs_sort=needs_sort,
            needs_min_p=needs_min_p,
        )


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) held in int64, c a 32-bit constant.

    c is split into 16-bit halves so that no product reaches 2^63 (int64 overflow is
    undefined behaviour on some backends): x * c_lo < 2^48, x * c_hi < 2^48."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) of x in [0, 2^32), in int64 ops."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    """_mix32 on one Python int (a row's key is made on the host: no per-row device ops)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _row_keys(seed: int, counter: int) -> tuple[int, int]:
    """A row's two 32-bit keys from its 64-bit seed and its counter."""
    key = _mix32_int((seed & _MASK32) ^ 0x9E3779B9)
    key = _mix32_int(key ^ (seed >> 32))
    key = _mix32_int(key ^ (counter & _MASK32))
    return key, _mix32_int(key ^ 0x85EBCA6B)


def _gumbel(t: SamplingTensors, vocab_size: int) -> torch.Tensor:
    """[S, V] float32 Gumbel noise that depends only on (seed, counter, vocab index) of each row."""
    key, key2 = t.key, t.key2
    if triton is not None and key.is_cuda:
        return _gumbel_triton(key, key2, vocab_size)
    index = torch.arange(vocab_size, device=key.device, dtype=torch.int64)
    h = _mix32(_mix32(key[:, None] ^ index) ^ key2[:, None])  # [S, V] in [0, 2^32)
    return _gumbel_of_hash(h)


def _gumbel_of_hash(h: torch.Tensor) -> torch.Tensor:
    """Hashes in [0, 2^32) (int64) -> float32 Gumbel noise."""
    # The top 24 bits give u in (0, 1) strictly: 2^-25 <= u <= 1 - 2^-25, exact in float64
    # (not in float32, where u near 1 rounds to 1.0 and the noise to +inf), so -log(u) > 0
    # and the noise is finite. The largest noise, which wins the argmax, comes from u near
    # 1, where -log(u) is tiny: float64 keeps it exact enough.
    u = ((h >> 8).to(torch.float64) + 0.5) * (1.0 / (1 << 24))
    return (-torch.log(-torch.log(u))).to(torch.float32)


def _gumbel_triton(key, key2, vocab_size: int) -> torch.Tensor:
    """The same noise in one pass: the [S, V] hash in 32-bit registers instead of ~30 int64
    tensor ops (3.1 ms for 64 x 128256 on an H200 before)."""
    out = torch.empty(key.shape[0], vocab_size, dtype=torch.float32, device=key.device)
    block = 1024
    # The keys are columns of one [S, 4] tensor (SamplingTensors.from_seqs): strided, so the
    # kernel is given their strides (read as if contiguous, rows took other rows' fields).
    _gumbel_kernel[(key.shape[0], triton.cdiv(vocab_size, block))](
        key, key.stride(0), key2, key2.stride(0), out, out.stride(0), vocab_size, BLOCK=block, num_warps=4
    )
    return out


if triton is not None:

    @triton.jit
    def _mul32_tl(x, c):
        # (x * c) mod 2^32 with x uint32: the product is taken in uint64 and masked, so the
        # result does not depend on how Triton types the constant (0x846CA68B does not fit
        # an int32; compiled, the unmasked form differed from the CPU's hash on an H200).
        return ((x.to(tl.uint64) * c) & 0xFFFFFFFF).to(tl.uint32)

    @triton.jit
    def _mix32_tl(x):
        # lowbias32 on uint32, as _mix32 computes it.
        x = x ^ (x >> 16)
        x = _mul32_tl(x, 0x7FEB352D)
        x = x ^ (x >> 15)
        x = _mul32_tl(x, 0x846CA68B)
        return x ^ (x >> 16)

    @triton.jit
    def _gumbel_kernel(
        key_ptr, stride_key, key2_ptr, stride_key2, out_ptr, stride_out, vocab_size, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0)
        index = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        key = tl.load(key_ptr + row * stride_key).to(tl.uint32)
        key2 = tl.load(key2_ptr + row * stride_key2).to(tl.uint32)
        h = _mix32_tl(_mix32_tl(key ^ index.to(tl.uint32)) ^ key2)
        # float64 as in _gumbel: in float32, u near 1 rounds to 1.0, and the GPU's fast log
        # loses -log(u) there, where the largest noise (the argmax's winner) comes from.
        u = ((h >> 8).to(tl.float64) + 0.5) * (1.0 / 16777216.0)
        noise = (-tl.log(-tl.log(u))).to(tl.float32)
        tl.store(out_ptr + row.to(tl.int64) * stride_out + index, noise, mask=index < vocab_size)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [S, V] -> [S] int64, the first index of each row's largest value (torch.argmax).

    Why ours on a GPU: torch reduces one row of 128K logits in one block (27 us on an H200
    at batch 1, 0.6% of a decode step); here chunks of the row are reduced in parallel, then
    the chunks' winners, the earlier chunk winning a tie. NaN is not treated as the largest
    value (torch's is): logits with NaN have no meaningful choice either way."""
    if triton is None or not x.is_cuda or x.dim() != 2 or x.shape[0] == 0 or x.stride(-1) != 1:
        return x.argmax(dim=-1)
    return _argmax_triton(x)


def _argmax_triton(x: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    rows, vocab_size = x.shape
    chunks = triton.cdiv(vocab_size, chunk)
    vals = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, chunks, dtype=torch.int64, device=x.device)
    _argmax_chunks_kernel[(rows, chunks)](
        x, x.stride(0), vals, idx, vocab_size, chunks, CHUNK=chunk, BLOCK=min(chunk, 1024), num_warps=4
    )
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    _argmax_winners_kernel[(rows,)](vals, idx, out, chunks, BLOCK=triton.next_power_of_2(chunks), num_warps=1)
    return out


if triton is not None:

    @triton.jit
    def _argmax_chunks_kernel(
        x_ptr, stride_x, vals_ptr, idx_ptr, vocab_size, chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr
    ):
        # Program (row, c): the largest value of columns c * CHUNK .. and its first index.
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        lane = c * CHUNK + tl.arange(0, BLOCK)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_i = lane.to(tl.int64)  # a row of -inf picks its first column, as torch does
        for off in range(0, CHUNK, BLOCK):
            cols = lane + off
            v = tl.load(x_ptr + row * stride_x + cols, mask=cols < vocab_size, other=float("-inf")).to(
                tl.float32
            )
            take = v > best  # strictly: each lane keeps its earliest maximum
            best = tl.where(take, v, best)
            best_i = tl.where(take, cols.to(tl.int64), best_i)
        top = tl.max(best, 0)
        first = tl.min(tl.where(best == top, best_i, 2**62), 0)
        tl.store(vals_ptr + row * chunks + c, top)
        tl.store(idx_ptr + row * chunks + c, first)

    @triton.jit
    def _argmax_winners_kernel(vals_ptr, idx_ptr, out_ptr, chunks, BLOCK: tl.constexpr):
        # One program per row: the chunk with the largest value, the earliest on a tie.
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        ok = c < chunks
        vals = tl.load(vals_ptr + row * chunks + c, mask=ok, other=float("-inf"))
        idx = tl.load(idx_ptr + row * chunks + c, mask=ok, other=2**62)
        top = tl.max(vals, 0)
        tl.store(out_ptr + row, tl.min(tl.where(ok & (vals == top), idx, 2**62), 0))


def filtered_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """logits [S, V] -> [S, V] float32 logits / temperature, tokens outside min-p, top-k and
    top-p at -inf (vLLM's order: min-p on the scaled distribution, then top-k, then top-p).

    One descending sort of the batch serves both filters. Top-k keeps the tokens at least as
    likely as the k-th (ties with it kept). Top-p, on the top-k survivors: a token is dropped
    when the likelier tokens before it already reach top_p, so the one that crosses top_p is
    kept, and so is the top token. Rows without filters come out exactly as without the sort,
    so a row's draw does not depend on whether a neighbour needed one."""
    scaled = logits.float() / t.temperature[:, None]
    if t.needs_min_p:  # a row with min_p = 0 drops nothing: no probability is below 0
        probs = torch.softmax(scaled, dim=-1)
        below = probs < t.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        scaled = scaled.masked_fill(below, float("-inf"))
    if not t.needs_sort:
        return scaled
    vocab_size = scaled.shape[-1]
    sorted_vals, order = torch.sort(scaled, dim=-1, descending=True)  # [S, V]
    k = t.top_k.clamp(min=1, max=vocab_size)
    kth = sorted_vals.gather(1, (k - 1)[:, None])  # [S, 1]
    drop = sorted_vals < kth
    sorted_vals = sorted_vals.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_vals, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of the likelier tokens
    # Never the top token: 0 before it, top_p > 0, k >= 1. Rows with top_p = 1 drop nothing
    # here: their float32 cumulative sum can round to 1.0 before the tail ends.
    drop |= (before >= t.top_p[:, None]) & (t.top_p[:, None] < 1.0)
    drop = torch.zeros_like(drop).scatter_(1, order, drop)  # back to vocabulary order
    return scaled.masked_fill(drop, float("-inf"))


def sample_tokens(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """logits [S, V] -> chosen ids [S] int64, on the device, without a host sync.

    Greedy rows take the plain argmax of the logits (bit-exact with an argmax outside)."""
    greedy = argmax_rows(logits)
    if t.all_greedy:
        return greedy
    scores = filtered_logits(logits, t) + _gumbel(t, logits.shape[-1])
    return torch.where(t.greedy, greedy, argmax_rows(scores))


def sample_on_device(
    logits: torch.Tensor, seqs: list[Sequence], positions: list[int] | None = None
) -> torch.Tensor:
    """logits [S, V] float32, one row per sequence (or per position of a verified run:
    SamplingTensors.from_seqs' positions) -> the chosen ids [S] int64 on the device; nothing
    waits for the device."""
    if all(seq.params.greedy for seq in seqs):  # the common decode batch: no per-row tensors to build
        return argmax_rows(logits)
    tensors = SamplingTensors.from_seqs(seqs, logits.device, logits.shape[-1], positions)
    return sample_tokens(logits, tensors)


def warm_up(device: torch.device, vocab_size: int) -> None:
    """Build the sampler's Triton kernels (the argmax's two, the Gumbel noise's) before any
    request: on an H100 the first greedy request after start-up took 575 ms to its first
    token, against ~35 ms after it, most of it these compiles (bench/first_burst.py). One
    greedy row alone (a decode batch's path) and beside a sampled row with every filter on,
    laid out as from_seqs lays requests out, so the kernels see the arguments they will."""
    if triton is None or device.type != "cuda":
        return
    greedy = Sequence("warm-up-greedy", [0], SamplingParams(temperature=0.0))
    sampled = Sequence(
        "warm-up-sampled", [0], SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, seed=0)
    )
    logits = torch.zeros(2, vocab_size, device=device)
    sample_on_device(logits[:1], [greedy])
    sample_on_device(logits, [greedy, sampled], positions=[0, 1])
    torch.cuda.synchronize(device)


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """The chosen token ids on the host (one transfer)."""
    return sample_on_device(logits, seqs).tolist()
