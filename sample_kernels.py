"""
A sort-free sampler in Triton, with a pure-torch reference path that draws the very same ids: one
token per row of logits under temperature, top-k, top-p and min-p, without sorting the vocabulary (a
threshold found by bisection, then a Gumbel-max draw over the tokens above it). Triton runs on CUDA
tensors; CPU tensors take the torch path unless use_triton=True (the tests force it under
TRITON_INTERPRET=1).
"""
import math
import struct

import torch
import triton
import triton.language as tl

from logprob_kernels import num_warps

# -----------------------------------------------------------------------------
# sampler: counter-based randomness shared by the torch and triton paths
# The uniform for (row b, vocab index j) is a pure function of (seeds[b], step, j): a row's draw
# never depends on its batch, and the torch reference draws the very same ids as the kernel.

_M32 = 0xFFFFFFFF


def _mul32_(x, c):  # x = (x * c) mod 2^32 in place, in int64 without overflowing it
    lo = x * (c & 0xFFFF)
    return x.mul_(c >> 16).bitwise_and_(0xFFFF).bitwise_left_shift_(16).add_(lo).bitwise_and_(_M32)


def _mix32_(x):
    # "lowbias32" integer hash (C. Wellons), in place on int64 tensors holding uint32 values
    x.bitwise_xor_(x >> 16)
    _mul32_(x, 0x7FEB352D)
    x.bitwise_xor_(x >> 15)
    _mul32_(x, 0x846CA68B)
    return x.bitwise_xor_(x >> 16)


def _mix32_torch(x):
    return _mix32_(x.clone())


def _row_keys(seeds, step):
    """Two 32-bit keys per row from (seed, step); int64 tensors (B,)."""
    seeds = seeds.long()
    step = torch.as_tensor(step, dtype=torch.long, device=seeds.device).expand_as(seeds) & _M32
    r1 = _mix32_torch((seeds & _M32) ^ _mix32_torch(((seeds >> 32) & _M32) ^ 0x9E3779B9))
    r2 = _mix32_torch(r1 ^ _mix32_torch(step ^ 0x85EBCA6B))
    return r1, r2


# Gumbel noise from a 32-bit hash h, the same fp32 arithmetic in both paths:
#   v = min((h + 0.5) * 2^-32, 1 - 2^-24)   uniform, strictly inside (0, 1)
#   E = -log1p(-v)                          Exponential(1); small E is a large noise
#   g = -log(E)                             Gumbel(0, 1)
# Why these constants. Near 0 a float32 holds all 32 bits of h, so v >= 2^-33 and E >= 2^-33:
# g <= 22.9, and the winner's noise (the large-g end, where Gumbel-max needs precision) is resolved
# to 2^-32 in v. Near 1 no float32 can (the floats below 1 are 2^-24 apart), so v stops at
# 1 - 2^-24, the largest float32 below 1: E <= 16.64, g >= -2.81. Every noise is finite; a token
# more than ~25.7 nats below its row's best logit is never drawn (true probability < 7e-12 each).
# The naive ((h >> 8) + 0.5) * 2^-24 is NOT exact: for h >> 8 = 2^24 - 1, 16777215.5 is not a
# float32 and rounds up, u == 1.0, -log(-log u) = +inf, and that token wins whatever its logit
# (about V / 2^24 of all draws). log1p(-v) is written with Kahan's trick, log(y) * v / (1 - y) with
# y = 1 - v rounded (the rounding error of y cancels in the ratio), since not every supported
# Triton has a log1p; 1 - y >= 2^-24 whenever y < 1, and y == 1 means v <= 2^-25, where
# log1p(-v) = -v in fp32.
_U_MAX = 1.0 - 2.0 ** -24  # the largest float32 below 1
_EPS24 = 2.0 ** -24


def _uniform_torch(h):
    """Uniform in (0, 1), fp32, from hashes h (int64 tensor holding uint32 values); see above."""
    return h.float().add_(0.5).mul_(2.0 ** -32).clamp_(max=_U_MAX)


def _gumbel_torch(h):
    """Gumbel noise (fp32) from hashes h (int64 tensor holding uint32 values); see above."""
    v = _uniform_torch(h)
    y = 1.0 - v
    e = torch.where(y < 1.0, torch.log(y).neg_().mul_(v / (1.0 - y).clamp_(min=_EPS24)), v)
    return e.log_().neg_()


def _noise_torch(r1, r2, V):
    """Gumbel noise (B, V) fp32 for every vocabulary index j < V of each row: h = mix32(mix32(j ^
    r1) ^ r2). In place and in chunks of rows about 2^20 elements, which a CPU keeps in cache (9x
    faster than whole-tensor ops at V = 151,936)."""
    out = torch.empty(len(r1), V, device=r1.device)
    j = torch.arange(V, device=r1.device)
    step = max(1, 2 ** 20 // V)
    for i in range(0, len(r1), step):
        h = _mix32_(j ^ r1[i:i + step, None])
        out[i:i + step] = _gumbel_torch(_mix32_(h.bitwise_xor_(r2[i:i + step, None])))
    return out


@triton.jit
def _hash(r1, r2, cols):
    # h = mix32(mix32(j ^ r1) ^ r2) on uint32 (multiplies wrap mod 2^32); the two rounds written
    # as a loop, not a call to another jit function: the interpreter pays ~1 ms per nested call
    h = cols.to(tl.uint32) ^ r1
    for i in tl.static_range(2):
        h = h ^ (h >> 16)
        h = h * 0x7FEB352D
        h = h ^ (h >> 15)
        h = h * 0x846CA68B
        h = h ^ (h >> 16)
        if i == 0:
            h = h ^ r2
    return h


@triton.jit
def _gumbel(h):
    # _gumbel_torch, term for term: 2^-32, 1 - 2^-24 and 2^-24 are exact float32 constants
    v = tl.minimum((h.to(tl.float32) + 0.5) * 2.3283064365386963e-10, 0.999999940395355224609375)
    y = 1.0 - v
    e = tl.where(y < 1.0, -tl.log(y) * (v / tl.maximum(1.0 - y, 5.9604644775390625e-08)), v)
    return -tl.log(e)


# -----------------------------------------------------------------------------
# sampler: triton kernels
# Kept set = {z >= t} with z = logits / T and t = max(top-k threshold, top-p threshold, min-p
# threshold); the draw is the Gumbel-max argmax of z + g over the kept set. Thresholds are found
# without sorting by bisecting on the fp32 bit pattern (a monotone int32 key): NC candidates per
# pass over the row, so 8 passes of 16 pin down the exact k-th largest value / exact nucleus
# boundary.

# the smallest key of any float
_KEY_NEG_INF = struct.unpack('<i', struct.pack('<f', -math.inf))[0] ^ 0x7FFFFFFF
_NC, _NPASS = 16, 8  # 16 ** 8 = 2 ** 32 covers every fp32 key


@triton.jit
def _key(z):  # fp32 -> int32, order-preserving (negative floats have their magnitude bits flipped)
    b = z.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _sample_pass_kernel(x_ptr, stride_row, V, inv_temp, tile, t_ptr,
                        r1_ptr, r2_ptr, m_ptr, s_ptr, bv_ptr, bi_ptr, HAS_THRESH: tl.constexpr,
                        DRAW: tl.constexpr, GREEDY: tl.constexpr, BLOCK: tl.constexpr):
    # grid (rows, splits): each program covers one tile of one row (few rows -> many tiles fill the
    # GPU), writing partial softmax stats and, if DRAW, its best (z + gumbel) over the kept set
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    out = row * tl.num_programs(1) + split
    base = x_ptr + row * stride_row
    lo = split * tile
    hi = tl.minimum(lo + tile, V)
    t = tl.load(t_ptr + row) if HAS_THRESH else float('-inf')
    r1 = tl.load(r1_ptr + row).to(tl.uint32)
    r2 = tl.load(r2_ptr + row).to(tl.uint32)
    m = tl.full((), -1e30, tl.float32)
    s = tl.zeros((), tl.float32)
    best_v = tl.full((), float('-inf'), tl.float32)
    best_i = tl.zeros((), tl.int32)
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inb = cols < hi
        z = tl.load(base + cols, mask=inb, other=float('-inf')).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(z, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m = m_new
        if DRAW:
            w = z if GREEDY else z + _gumbel(_hash(r1, r2, cols))
            w = tl.where(inb & (z >= t), w, float('-inf'))
            bv = tl.max(w, 0)
            bi = tl.argmax(w, 0) + start  # first index among ties, like torch.argmax
            better = bv > best_v  # strict: earlier blocks win ties
            best_i = tl.where(better, bi, best_i)
            best_v = tl.where(better, bv, best_v)
    tl.store(m_ptr + out, m)
    tl.store(s_ptr + out, s)
    if DRAW:
        tl.store(bv_ptr + out, best_v)
        tl.store(bi_ptr + out, best_i)


@triton.jit
def _bisect_pass_kernel(x_ptr, stride_row, V, inv_temp, tile, m_ptr, lo_ptr, hi_ptr, tgt_ptr,
                        cnt_ptr, mass_ptr, done_ptr, mass_lo_ptr, t_ptr, top_k,
                        COUNT: tl.constexpr, FIRST: tl.constexpr, NC: tl.constexpr,
                        BLOCK: tl.constexpr):
    # One pass of the search for a row's threshold key t: the largest key in [lo, hi) with
    # count(key >= t) >= top_k (COUNT) or mass(key >= t) >= target (mass = sum exp(z - m)); the
    # condition holds at lo and fails at hi. Grid (rows, splits), as the sampling pass: each
    # program counts its tile at NC candidates spread over [lo, hi), and the row's last program to
    # finish adds the tiles up and narrows [lo, hi) to the gap after the largest passing candidate
    # (NC ** passes >= 2 ** 32 finds any fp32 key). FIRST: hi starts above the row's max.
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    S = tl.num_programs(1)
    base = x_ptr + row * stride_row
    m = tl.load(m_ptr + row)
    lo = tl.load(lo_ptr + row)
    if FIRST:
        hi = _key(m).to(tl.int64) + 1
    else:
        hi = tl.load(hi_ptr + row)
    cand = lo + ((hi - lo) * tl.arange(0, NC).to(tl.int64)) // NC  # cand[0] == lo
    cand32 = cand.to(tl.int32)
    cnt = tl.zeros([NC], tl.int32)
    mass = tl.zeros([NC], tl.float32)
    first = split * tile
    last = tl.minimum(first + tile, V)
    for start in range(first, last, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inb = cols < last
        z = tl.load(base + cols, mask=inb, other=float('-inf')).to(tl.float32) * inv_temp
        b = z.to(tl.int32, bitcast=True)
        key = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)  # = _key(z), inlined for the interpreter's sake
        ge = (key[:, None] >= cand32[None, :]) & inb[:, None]
        if COUNT:
            cnt += tl.sum(ge.to(tl.int32), 0)
        mass += tl.sum(tl.where(ge, tl.exp(z - m)[:, None], 0.0), 0)
    part = (row * S + split) * NC + tl.arange(0, NC)
    tl.store(cnt_ptr + part, cnt)
    tl.store(mass_ptr + part, mass)
    # every thread's stores before the count goes up; the atomic (acq_rel) publishes them, and
    # the last program's reads (past L1) see them all
    tl.debug_barrier()
    if tl.atomic_add(done_ptr + row, 1) == S - 1:
        cnt = tl.zeros([NC], tl.int32)
        mass = tl.zeros([NC], tl.float32)
        for j in range(0, S):
            part = (row * S + j) * NC + tl.arange(0, NC)
            cnt += tl.load(cnt_ptr + part, cache_modifier='.cg')
            mass += tl.load(mass_ptr + part, cache_modifier='.cg')
        if COUNT:
            ok = cnt >= top_k
        else:
            ok = mass >= tl.load(tgt_ptr + row)
        lo_new = tl.max(tl.where(ok, cand, lo), 0)  # largest passing candidate
        tl.store(lo_ptr + row, lo_new)
        tl.store(hi_ptr + row, tl.min(tl.where(ok, hi, cand), 0))  # smallest failing one
        tl.store(mass_lo_ptr + row, tl.min(tl.where(ok, mass, float('inf')), 0))
        b = lo_new.to(tl.int32)
        b = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)  # the key map is its own inverse
        tl.store(t_ptr + row, b.to(tl.float32, bitcast=True))
        tl.store(done_ptr + row, 0)  # ready for the next pass


# -----------------------------------------------------------------------------
# sampler: public functions

def _keep_threshold_ref(z, top_k, top_p, min_p):
    """Per-row threshold t (B, 1): keep z >= t. Exact, sort-based (this is the reference)."""
    V = z.shape[-1]
    m = z.amax(-1, keepdim=True)
    t = torch.full_like(m, -math.inf)
    if 0 < top_k < V:
        t = z.topk(top_k, -1).values[:, -1:]
    if top_p < 1.0:
        # on the renormalised top-k set
        zs = z.masked_fill(z < t, -math.inf).sort(-1, descending=True).values
        c = torch.exp((zs - m).double()).cumsum(-1)
        # the token that reaches top_p is kept
        n_before = (c < top_p * c[:, -1:]).sum(-1, keepdim=True)
        t = torch.maximum(t, zs.gather(-1, n_before))
    if min_p > 0.0:
        t = torch.maximum(t, m + math.log(min_p))  # p_i >= min_p * p_max
    return t


def sample_tokens_ref(logits, seeds, step, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Pure-torch sampler; draws the same ids as the triton kernel (same hash, same kept set)."""
    greedy = temperature == 0 or top_k == 1
    inv_temp = 1.0 if temperature == 0 else 1.0 / temperature
    z = logits.float() if inv_temp == 1.0 else logits.float() * inv_temp
    if greedy:
        ids = z.argmax(-1)
    else:
        t = _keep_threshold_ref(z, top_k, top_p, min_p)
        g = _noise_torch(*_row_keys(seeds.to(z.device), step), z.shape[-1])
        ids = torch.where(z >= t, z + g, -math.inf).argmax(-1)
    logp = torch.log_softmax(z, -1).gather(-1, ids[:, None]).squeeze(-1)
    return ids, logp


def sample_tokens(logits, seeds, step, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                  use_triton=None, n_split=None, block_size=None):
    """
    Draw one token per row of logits (B, V) from softmax(logits / temperature) restricted by top_k
    (0 = off), top_p (1 = off), min_p (0 = off). seeds (B,) int64 and step (int or (B,)) fix the
    draw: row b's id depends only on (seeds[b], step, logits[b]). temperature 0 or top_k 1 is greedy
    argmax. Returns ids int64 (B,) and logp fp32 (B,), the log-prob of each id under the FULL
    softmax at this temperature (temperature 1 when temperature is 0). Ties at the top-k / top-p
    boundary value are all kept. n_split (tiles a row) and block_size (the vocabulary block of every
    kernel, the threshold search's too) override the GPU's choices: tests set them.
    """
    if not (logits.is_cuda if use_triton is None else use_triton):
        return sample_tokens_ref(logits, seeds, step, temperature=temperature, top_k=top_k,
                                 top_p=top_p, min_p=min_p)
    assert logits.dim() == 2 and logits.stride(-1) == 1, (
        'logits must be (B, V) with contiguous rows')
    B, V = logits.shape
    greedy = temperature == 0 or top_k == 1
    inv_temp = 1.0 if temperature == 0 else 1.0 / temperature
    block = block_size or min(4096, triton.next_power_of_2(V))
    if n_split is None:  # few rows: split the vocabulary so there are ~4 programs per SM
        sms = 1
        if logits.is_cuda:
            sms = torch.cuda.get_device_properties(logits.device).multi_processor_count
        n_split = max(1, min(triton.cdiv(4 * sms, B), triton.cdiv(V, block)))
    tile = triton.cdiv(triton.cdiv(V, n_split), block) * block
    S = triton.cdiv(V, tile)
    r1, r2 = _row_keys(seeds.to(logits.device), step)
    f32 = dict(device=logits.device, dtype=torch.float32)
    m_part, s_part, bv = (torch.empty(B, S, **f32) for _ in range(3))
    bi = torch.empty(B, S, device=logits.device, dtype=torch.int32)

    def one_pass(t, draw):
        _sample_pass_kernel[(B, S)](logits, logits.stride(0), V, inv_temp, tile, t,
                                    r1_ptr=r1, r2_ptr=r2, m_ptr=m_part, s_ptr=s_part, bv_ptr=bv,
                                    bi_ptr=bi, HAS_THRESH=t is not None, DRAW=draw, GREEDY=greedy,
                                    BLOCK=block, num_warps=num_warps(block))
        m = m_part.amax(1)
        return m, (s_part * torch.exp(m_part - m[:, None])).sum(1)

    t = None
    do_topk = (not greedy) and 0 < top_k < V
    do_topp = (not greedy) and top_p < 1.0
    if do_topk or do_topp or (min_p > 0.0 and not greedy):
        m, s = one_pass(None, draw=False)  # row max and sum for the threshold search
        t = torch.full((B,), -math.inf, **f32)
        if do_topk or do_topp:
            # the threshold search on the sampling pass's grid; BLOCK 256 on a GPU: its [BLOCK, NC]
            # tiles fit in registers. Each pass's last program per row moves the search on, so a
            # pass is one launch
            sblock = block_size or min(256, block)
            lo = torch.full((B,), _KEY_NEG_INF, device=logits.device, dtype=torch.int64)
            hi, mass_k = torch.empty_like(lo), torch.empty_like(s)
            cnt = torch.empty(B, S, _NC, device=logits.device, dtype=torch.int32)
            mass = torch.empty(B, S, _NC, **f32)
            done = torch.zeros(B, device=logits.device, dtype=torch.int32)

            def search(count, target):
                for p in range(_NPASS):
                    _bisect_pass_kernel[(B, S)](
                        logits, logits.stride(0), V, inv_temp, tile, m, lo, hi, target, cnt, mass,
                        done, mass_k, t, top_k, COUNT=count, FIRST=p == 0, NC=_NC, BLOCK=sblock,
                        num_warps=num_warps(sblock))
            if do_topk:
                search(True, s)
            if do_topp:  # on the renormalised top-k distribution (HF/vLLM order)
                search(False, top_p * (mass_k if do_topk else s))
        if min_p > 0.0:
            t = torch.maximum(t, m + math.log(min_p))
    m, s = one_pass(t, draw=True)
    best = bv.argmax(1, keepdim=True)  # ties -> first tile -> smallest id
    ids = bi.gather(1, best).squeeze(1).long()
    logp = logits.gather(1, ids[:, None]).squeeze(1).float() * inv_temp - m - torch.log(s)
    return ids, logp
