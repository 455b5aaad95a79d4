"""
Fused per-token log-prob + entropy, and a sort-free sampler, in Triton, with pure-torch reference paths.

GRPO's memory goes to logits: log_softmax(logits).gather(targets) materialises a full fp32 copy of a
[tokens, vocab] tensor and entropy wants another. token_logprobs reads each row of given logits once (forward)
and once more (backward), keeping a few floats per row; lm_head_logprobs, what training runs, never holds the
logits at all: it projects hidden states tile by tile and folds each tile into the same per-token statistics.
Triton runs on CUDA tensors; CPU tensors take torch paths unless use_triton=True (the tests force it under
TRITON_INTERPRET=1).
"""
import math
import struct

import torch
import triton
import triton.language as tl

# -----------------------------------------------------------------------------
# log-prob + entropy: triton kernels

@triton.jit
def _fold(base, n_loop, n_valid, m, s, w, inv_temp, BLOCK: tl.constexpr):
    # fold columns [0, n_loop) of one row (those from n_valid on read as -inf) into its online softmax of z = x / T:
    # m the running max of the RAW logits, s = sum e, w = sum e * d with d = (x - m) / T, e = exp(d)
    for start in range(0, n_loop, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < n_valid, other=float('-inf')).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        shift = (m - m_new) * inv_temp
        alpha = tl.exp(shift)
        d = (x - m_new) * inv_temp
        e = tl.exp(d)
        # rescale: sum e'(d') = alpha * (w + shift * s); p = 0 terms (x = -inf) add 0, not 0 * -inf
        w = alpha * (w + tl.where(s > 0, shift * s, 0.0)) + tl.sum(tl.where(e > 0, e * d, 0.0), 0)
        s = alpha * s + tl.sum(e, 0)
        m = m_new
    return m, s, w


@triton.jit
def _logprob_fwd_kernel(x_ptr, stride_b, stride_t, T1, tgt_ptr, mask_ptr, logp_ptr, ent_ptr, m_ptr, logs_ptr,
                        V, inv_temp, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    # one program per row; rows are (b, t) pairs so a sliced logits[:, :-1] needs no copy
    row = tl.program_id(0).to(tl.int64)  # int64: rows * vocab passes 2^31
    base = x_ptr + (row // T1) * stride_b + (row % T1) * stride_t
    keep = (tl.load(mask_ptr + row) != 0) if HAS_MASK else tl.full((), 1, tl.int1)
    n_cols = tl.where(keep, V, 0)  # padding rows skip the loop entirely
    # online softmax over z = x / T, tracked relative to the running max m of the RAW logits, so the
    # differences are small and exact-ish in fp32 even for logits of 1e4: s = sum e, w = sum e * d
    m = tl.full((), -1e30, tl.float32)  # finite sentinel: (m - m_new) * s must not be -inf * 0
    s = tl.zeros((), tl.float32)
    w = tl.zeros((), tl.float32)
    m, s, w = _fold(base, n_cols, V, m, s, w, inv_temp, BLOCK)
    tgt = tl.load(tgt_ptr + row)
    x_t = tl.load(base + tgt, mask=keep, other=0.0).to(tl.float32)
    logs = tl.log(s)
    logp = (x_t - m) * inv_temp - logs
    ent = logs - w / s  # H = log s - E_p[d]
    tl.store(logp_ptr + row, tl.where(keep, logp, 0.0))
    tl.store(ent_ptr + row, tl.where(keep, ent, 0.0))
    tl.store(m_ptr + row, m)
    tl.store(logs_ptr + row, tl.where(keep, logs, 0.0))


@triton.jit
def _logprob_bwd_kernel(x_ptr, stride_b, stride_t, T1, tgt_ptr, mask_ptr, m_ptr, logs_ptr, ent_ptr, g_lp_ptr,
                        g_ent_ptr, dx_ptr, V, inv_temp, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    # d logp / dz_i = [i == t] - p_i ;  d H / dz_i = -p_i (log p_i + H) ;  dx = dz / T
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + (row // T1) * stride_b + (row % T1) * stride_t
    keep = (tl.load(mask_ptr + row) != 0) if HAS_MASK else tl.full((), 1, tl.int1)
    m = tl.load(m_ptr + row)
    logs = tl.load(logs_ptr + row)
    ent = tl.load(ent_ptr + row)
    g_lp = tl.load(g_lp_ptr + row)
    g_ent = tl.load(g_ent_ptr + row)
    tgt = tl.load(tgt_ptr + row)
    n_read = tl.where(keep, V, 0)  # masked rows still write their zeros, but read nothing
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < n_read, other=0.0).to(tl.float32)
        logq = (x - m) * inv_temp - logs
        p = tl.exp(logq)
        dz = -g_lp * p - g_ent * tl.where(p > 0, p * (logq + ent), 0.0)
        dz += tl.where(cols == tgt, g_lp, 0.0)
        dx = tl.where(cols < n_read, dz * inv_temp, 0.0)
        tl.store(dx_ptr + row * V + cols, dx.to(dx_ptr.dtype.element_ty), mask=cols < V)


def _num_warps(block):
    return 8 if block >= 2048 else 4


def _rows(logits):
    """View logits as (B, T, V) without copying the common cases (2-D, 3-D, last-dim-contiguous slices)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    x = logits if logits.dim() == 3 else logits.reshape(1, -1, logits.shape[-1])
    return logits, x


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, mask, inv_temp, block):
        logits, x = _rows(logits)
        N, V = x.shape[0] * x.shape[1], x.shape[2]
        tgt = targets.reshape(-1).long().contiguous()
        mk = mask.reshape(-1).to(torch.int8).contiguous() if mask is not None else tgt  # tgt: unused dummy
        logp, ent, m, logs = (torch.empty(N, device=x.device, dtype=torch.float32) for _ in range(4))
        if N > 0:
            _logprob_fwd_kernel[(N,)](x, x.stride(0), x.stride(1), x.shape[1], tgt, mk, logp, ent, m, logs, V,
                                      inv_temp, HAS_MASK=mask is not None, BLOCK=block, num_warps=_num_warps(block))
        ctx.save_for_backward(logits, tgt, mk, m, logs, ent)
        ctx.has_mask, ctx.inv_temp, ctx.block = mask is not None, inv_temp, block
        shape = logits.shape[:-1]
        return logp.view(shape), ent.view(shape)

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, tgt, mk, m, logs, ent = ctx.saved_tensors
        _, x = _rows(logits)
        N, V = x.shape[0] * x.shape[1], x.shape[2]
        dx = torch.empty((N, V), device=x.device, dtype=x.dtype)  # written exactly once by the kernel
        g_logp = g_logp.float().contiguous().view(-1)  # the grad of a .sum() arrives as a stride-0 expand
        g_ent = g_ent.float().contiguous().view(-1)
        if N > 0:
            _logprob_bwd_kernel[(N,)](x, x.stride(0), x.stride(1), x.shape[1], tgt, mk, m, logs, ent, g_logp, g_ent,
                                      dx, V, ctx.inv_temp, HAS_MASK=ctx.has_mask, BLOCK=ctx.block,
                                      num_warps=_num_warps(ctx.block))
        return dx.view(logits.shape), None, None, None, None


# -----------------------------------------------------------------------------
# log-prob + entropy: public functions

def token_logprobs_ref(logits, targets, temperature=1.0, mask=None):
    """Pure-torch log p(target) and entropy of softmax(logits / T); fp32 out (fp64 in stays fp64)."""
    z = logits if logits.dtype == torch.float64 else logits.float()  # no copy for fp32 input
    # shift by the (detached, shift-invariant) row max first so logits of 1e4 keep fp32 precision
    d = z - z.detach().amax(-1, keepdim=True)
    logq = torch.log_softmax(d if temperature == 1.0 else d * (1.0 / temperature), -1)
    del z, d  # free the temporaries before the next full-size one is made
    p = logq.exp()
    # p = 0 terms (logit -inf) add 0, not 0 * -inf, and get finite gradients; einsum is a batched dot
    # (no p * logq temporary)
    entropy = -torch.einsum('...v,...v->...', p, logq.masked_fill(p == 0, 0.0))
    if mask is not None:
        targets = torch.where(mask, targets, 0)  # padding may hold any id, e.g. -100
    logp = logq.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    if mask is not None:
        logp, entropy = torch.where(mask, logp, 0.0), torch.where(mask, entropy, 0.0)
    return logp, entropy


def token_logprobs(logits, targets, temperature=1.0, mask=None, *, use_triton=None, block_size=None):
    """
    Per-token log p(target) and entropy under softmax(logits / temperature).
    logits (..., V) any float dtype, targets (...) int, mask (...) bool or None (False = padding: outputs 0,
    zero gradient). Returns (logp, entropy), fp32, shape (...), both differentiable w.r.t. logits.
    Triton on CUDA tensors (or when use_triton=True), the torch reference otherwise.
    """
    assert temperature > 0, 'temperature must be > 0 for log-probs'
    if not (logits.is_cuda if use_triton is None else use_triton):
        return token_logprobs_ref(logits, targets, temperature, mask)
    block = block_size or min(4096, triton.next_power_of_2(logits.shape[-1]))
    return _TokenLogprobs.apply(logits, targets, mask, 1.0 / temperature, block)


# -----------------------------------------------------------------------------
# LM head: log-prob + entropy straight from hidden states, never holding [tokens, vocab]
# Each (token tile x vocab tile) of logits is projected into one reused buffer and folded into per-token running
# statistics relative to the running max m: s = sum e, w = sum e * d with d = z - m, e = exp(d) (H = log s - w / s).
# Backward recomputes each tile, overwrites it with dlogits and adds its two products to the fp32 gradients.

@triton.jit
def _head_fwd_kernel(x_ptr, stride, n_cols, col0, tgt_ptr, m_ptr, s_ptr, w_ptr, xt_ptr, inv_temp,
                     BLOCK: tl.constexpr):
    # one program per token: fold one tile row into that token's (m, s, w) (_fold, as _logprob_fwd_kernel does)
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    m = tl.load(m_ptr + row)
    s = tl.load(s_ptr + row)
    w = tl.load(w_ptr + row)
    m, s, w = _fold(base, n_cols, n_cols, m, s, w, inv_temp, BLOCK)
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    tl.store(w_ptr + row, w)
    local = tl.load(tgt_ptr + row) - col0
    if (local >= 0) & (local < n_cols):  # this tile holds the target's logit
        tl.store(xt_ptr + row, tl.load(base + local).to(tl.float32))


@triton.jit
def _head_bwd_kernel(x_ptr, stride, n_cols, col0, tgt_ptr, lse_ptr, a_ptr, b_ptr, g_lp_ptr, inv_temp,
                     BLOCK: tl.constexpr):
    # grid (tokens, column blocks): overwrite the tile with dlogits = (p * (a + b * log p) + [i == t] g_lp) / T,
    # where a = -g_lp - g_ent * H and b = -g_ent fold both outputs' gradients into two floats per token
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ptrs = x_ptr + row * stride + cols
    x = tl.load(ptrs, mask=cols < n_cols, other=0.0).to(tl.float32)
    logq = x * inv_temp - tl.load(lse_ptr + row)  # lse = log sum exp(x / T)
    p = tl.exp(logq)
    dz = p * (tl.load(a_ptr + row) + tl.load(b_ptr + row) * logq)
    dz += tl.where(cols + col0 == tl.load(tgt_ptr + row), tl.load(g_lp_ptr + row), 0.0)
    tl.store(ptrs, (dz * inv_temp).to(x_ptr.dtype.element_ty), mask=cols < n_cols)


def _fold_fwd_torch(z, e, tgt, col0, m, s, w, zt):
    """_head_fwd_kernel for a whole tile in torch ops (CPU), temperature already applied: z (n, v) fp32 is clobbered,
    e is scratch of its shape; updates m, s, w, zt (n,) in place."""
    local = tgt - col0
    inside = (local >= 0) & (local < z.shape[1])
    zt.copy_(torch.where(inside, z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None]).squeeze(1), zt))
    m_new = torch.maximum(m, z.amax(1))
    z.sub_(m_new[:, None])
    torch.exp(z, out=e)
    shift = m - m_new  # <= 0; the sentinel -1e30 (not -inf) keeps shift * s = 0, not nan, before the first tile
    alpha = shift.exp()
    w.add_(shift * s).mul_(alpha)  # the old terms, now relative to m_new
    s.mul_(alpha).add_(e.sum(1))
    # sum e * d: in place in the scratch, summed by torch's cascade (a bmm dot loses ~1e-5 over a 4,096-wide row)
    w.add_(e.mul_(z).sum(1))
    m.copy_(m_new)


def _fold_bwd_torch(z, e, tgt, col0, shift, a, b, g_lp):
    """_head_bwd_kernel for a whole tile in torch ops (CPU), temperature already applied: z becomes dlogits.
    shift = m + log s, so z - shift = log p."""
    z.sub_(shift[:, None])
    torch.exp(z, out=e)
    if b is None:  # no entropy gradient
        torch.mul(e, a[:, None], out=z)
    else:
        torch.addcmul(a[:, None], z, b[:, None], out=z).mul_(e)
    local = tgt - col0
    rows = ((local >= 0) & (local < z.shape[1])).nonzero().squeeze(1)
    if g_lp is not None and len(rows):
        z.index_put_((rows, local[rows]), g_lp[rows], accumulate=True)


def _addmm_fp32(acc, x, y):
    """acc += x @ y in fp32 without rounding the product to x's dtype first (bf16 tiles)."""
    if acc.is_cuda and x.dtype != torch.float32:
        torch.addmm(acc, x, y, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(x.float(), y.float())  # no copies for fp32


def _grad_goes_to(weight, acc_node):
    """The weight's .grad, when backward may add to it directly instead of returning a second full-size gradient
    for autograd to add: a later micro-batch of .backward() (so .grad exists), fp32, and nothing between autograd
    and .grad. Not under autograd.grad (which must leave .grad alone: its AccumulateGrad node will not run), not with
    tensor hooks (they would miss this share), and not with FSDP2 (whose unsharded weight has no .grad here).
    A tied embedding is safe: its own share reaches AccumulateGrad after ours (the head runs last in forward, so
    first in backward), and DDP's hook, which fires there, reads .grad whole."""
    g = weight.grad
    if acc_node is None or g is None or weight._backward_hooks or g.dtype != torch.float32 or g.layout != torch.strided:
        return None
    try:
        runs = torch._C._will_engine_execute_node(acc_node)
    except (RuntimeError, AttributeError):  # raised for a leaf's node under autograd.grad(): it does not run there
        runs = False
    return g if runs and g.shape == weight.shape else None


def _tiles(hidden, weight, inv_temp, cd, tiles, triton_fold):
    """Yield (hidden tile, first token, first vocab id, logits tile, scratch, weight tile) for every tile, the logits
    tile projected in dtype cd into one reused buffer. The Triton fold reads raw logits x and divides by T itself;
    the torch fold gets fp32 z = x / T: in fp32 from hidden scaled once (_prescaled), else as an fp32 copy of the
    tile scaled on the way (scaling a bf16 hidden would round it twice)."""
    hs = hidden.float().mul(inv_temp).to(cd) if _prescaled(cd, inv_temp, triton_fold) else hidden.to(cd)
    N, V = hidden.shape[0], weight.shape[0]
    tt, vt = min(tiles[0], N), min(tiles[1], V)
    buf = torch.empty(tt * vt, device=hidden.device, dtype=cd)
    f32 = None if triton_fold or cd == torch.float32 else torch.empty(tt * vt, device=hidden.device,
                                                                       dtype=torch.float32)
    e = None if triton_fold else torch.empty(tt * vt, device=hidden.device, dtype=torch.float32)  # exp's output
    for t0 in range(0, N, tt):
        h = hs[t0:t0 + tt]
        for v0 in range(0, V, vt):
            wt = weight[v0:v0 + vt].to(cd)
            n, v = h.shape[0], wt.shape[0]
            tile = buf[:n * v].view(n, v)
            torch.mm(h, wt.t(), out=tile)
            if f32 is not None:  # (torch.mul(tile, k, out=fp32) would multiply in bf16)
                tile = f32[:n * v].view(n, v).copy_(tile).mul_(inv_temp)
            yield h, t0, v0, tile, None if e is None else e[:n * v].view(n, v), wt


def _prescaled(cd, inv_temp, triton_fold):
    """Whether the torch fold's hidden states are scaled by 1/T before the projection (fp32 only)."""
    return not triton_fold and cd == torch.float32 and inv_temp != 1.0


class _LMHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp, cd, tiles, triton_fold, acc_node):
        ctx.set_materialize_grads(False)  # an output nobody differentiates (often entropy) costs nothing in backward
        N = hidden.shape[0]
        f32 = dict(device=hidden.device, dtype=torch.float32)
        m = torch.full((N,), -1e30, **f32)  # finite sentinel: see _fold_fwd_torch
        s, w, xt = (torch.zeros(N, **f32) for _ in range(3))
        with torch.autocast(hidden.device.type, enabled=False):
            for h, t0, v0, tile, e, wt in _tiles(hidden, weight, inv_temp, cd, tiles, triton_fold):
                n, v = tile.shape
                if triton_fold:
                    blk = min(4096, triton.next_power_of_2(v))
                    _head_fwd_kernel[(n,)](tile, tile.stride(0), v, v0, targets[t0:], m[t0:], s[t0:], w[t0:], xt[t0:],
                                           inv_temp, BLOCK=blk, num_warps=_num_warps(blk))
                else:
                    _fold_fwd_torch(tile, e, targets[t0:t0 + n], v0, m[t0:t0 + n], s[t0:t0 + n], w[t0:t0 + n],
                                    xt[t0:t0 + n])
        u = inv_temp if triton_fold else 1.0  # the Triton fold's m and xt are raw logits, the torch fold's z = x / T
        logs = torch.log(s)
        logp, ent = (xt - m) * u - logs, logs - w / s
        ctx.save_for_backward(hidden, weight, targets, m * u + logs, ent)  # log p = z - (m*u + logs)
        ctx.args = inv_temp, cd, tiles, triton_fold, acc_node
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        inv_temp, cd, tiles, triton_fold, acc_node = ctx.args
        need_h, need_w = ctx.needs_input_grad[:2]
        if g_lp is None and g_ent is None:
            return (None,) * 8
        pre = _prescaled(cd, inv_temp, triton_fold)
        # dlogits = p * (a + b * log p) + [i == target] * g_lp, times dz/dtile: the torch fold folds that factor
        # (1/T unless the hidden states were prescaled) into a, b and g_lp; the Triton kernel applies 1/T itself
        k = 1.0 if triton_fold or pre else inv_temp
        g_lp = g_lp.float().contiguous() * k if g_lp is not None else None  # .contiguous(): .sum()'s grad is an expand
        b = -g_ent.float() * k if g_ent is not None else None
        a = (-g_lp if g_lp is not None else 0.0) + (b * ent if b is not None else 0.0)
        if triton_fold:  # the kernel reads every vector: a missing gradient is zeros
            g_lp = g_lp if g_lp is not None else torch.zeros_like(ent)
            b = b if b is not None else torch.zeros_like(ent)
        gh = torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float32) if need_h else None
        into = _grad_goes_to(weight, acc_node) if need_w else None
        gw = into if into is not None else (torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
                                            if need_w else None)
        with torch.autocast(hidden.device.type, enabled=False):
            for h, t0, v0, tile, e, wt in _tiles(hidden, weight, inv_temp, cd, tiles, triton_fold):
                n, v = tile.shape
                sl = slice(t0, t0 + n)
                if triton_fold:
                    blk = min(4096, triton.next_power_of_2(v))
                    _head_bwd_kernel[(n, triton.cdiv(v, blk))](tile, tile.stride(0), v, v0, targets[t0:], lse[t0:],
                                                               a[t0:], b[t0:], g_lp[t0:], inv_temp, BLOCK=blk,
                                                               num_warps=_num_warps(blk))
                else:
                    _fold_bwd_torch(tile, e, targets[sl], v0, lse[sl], a[sl], None if b is None else b[sl],
                                    None if g_lp is None else g_lp[sl])
                if gh is not None:
                    _addmm_fp32(gh[sl], tile, wt)
                if gw is not None:  # prescaled: h is hidden / T, as the chain rule wants
                    _addmm_fp32(gw[v0:v0 + v], tile.t(), h)
        if gh is not None:
            gh = (gh.mul_(inv_temp) if pre else gh).to(hidden.dtype)
        if gw is not None:
            gw = None if into is not None else gw.to(weight.dtype)
        return gh, gw, None, None, None, None, None, None


# (tokens, vocab) per tile. CPU, measured on 2 cores (2,048 tokens x vocab 32,768 x hidden 896, fp32, CPU seconds per
# forward+backward, 3 runs): 2048x4096 5.9, 2048x8192 5.7-5.9, 2048x16384 5.8, 2048x2048 6.5, 1024x8192 6.3,
# 1024x4096 7.1, 512x4096 8.4. GEMMs dominate (90%) and want many tokens; vocab widths 4,096-16,384 tie, so the
# narrowest (tile + scratch: 64 MiB). CUDA: not measured yet; bf16 tiles of 128 MiB, GEMMs large enough for full speed
HEAD_TILES = {'cpu': (2048, 4096), 'cuda': (4096, 16384)}


def lm_head_logprobs(hidden, weight, targets, temperature=1.0, mask=None, *, head_fp32=False, tiles=None,
                     use_triton=None):
    """
    Per-token log p(target) and entropy under softmax(hidden @ weight.T / temperature), never holding more logits
    than one tile of tiles = (tokens, vocab) (None or 0: HEAD_TILES for the device): forward keeps four floats per
    token, backward recomputes each tile. hidden (..., D), weight (V, D), targets (...) int, mask (...) bool or None
    (False: outputs 0, zero gradient, the target may be anything). Returns (logp, entropy) fp32 of shape (...),
    differentiable w.r.t. hidden and weight; their gradients are accumulated in fp32 (a later micro-batch adds the
    weight's straight into weight.grad: _grad_goes_to). The projection runs in hidden's dtype, or in fp32 with
    head_fp32 (hidden and weight upcast; under bf16 autocast the logits are then not rounded to bf16). Softmax math is
    always fp32. The fold is Triton on CUDA tensors (or when use_triton=True), torch tile ops otherwise.
    """
    assert temperature > 0, 'temperature must be > 0 for log-probs'
    triton_fold = hidden.is_cuda if use_triton is None else use_triton
    tiles = tuple(t or d for t, d in zip(tiles or (0, 0), HEAD_TILES['cuda' if hidden.is_cuda else 'cpu']))
    shape = hidden.shape[:-1]
    h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1).long()
    if mask is not None:  # score the kept tokens only
        keep = mask.reshape(-1)
        h, t = h[keep], t[keep]
    acc_node = None  # weight's AccumulateGrad, when backward may add into weight.grad directly
    if torch.is_grad_enabled() and weight.requires_grad and weight.is_leaf:
        acc_node = torch.autograd.graph.get_gradient_edge(weight).node
    cd = torch.float32 if head_fp32 else hidden.dtype
    logp, ent = _LMHead.apply(h, weight, t.contiguous(), 1.0 / temperature, cd, tiles, triton_fold, acc_node)
    if mask is not None:  # masked_scatter keeps an all-masked batch connected to the graph
        logp, ent = (x.new_zeros(keep.shape).masked_scatter(keep, x) for x in (logp, ent))
    return logp.view(shape), ent.view(shape)


# -----------------------------------------------------------------------------
# sampler: counter-based randomness shared by the torch and triton paths
# The uniform for (row b, vocab index j) is a pure function of (seeds[b], step, j): a row's draw never
# depends on its batch, and the torch reference draws the very same ids as the kernel.

_M32 = 0xFFFFFFFF


def _mul32(x, c):  # (x * c) mod 2^32 in int64 without overflowing it
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32_torch(x):  # "lowbias32" integer hash (C. Wellons), on int64 tensors holding uint32 values
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _row_keys(seeds, step):
    """Two 32-bit keys per row from (seed, step); int64 tensors (B,)."""
    seeds = seeds.long()
    step = torch.as_tensor(step, dtype=torch.long, device=seeds.device).expand_as(seeds) & _M32
    r1 = _mix32_torch((seeds & _M32) ^ _mix32_torch(((seeds >> 32) & _M32) ^ 0x9E3779B9))
    r2 = _mix32_torch(r1 ^ _mix32_torch(step ^ 0x85EBCA6B))
    return r1, r2


def _gumbel_torch(r1, r2, V):
    j = torch.arange(V, device=r1.device)
    h = _mix32_torch(_mix32_torch(j ^ r1[:, None]) ^ r2[:, None])
    u = ((h >> 8).float() + 0.5) * 2.0 ** -24  # 24 random bits -> (0, 1), exact in fp32
    return -torch.log(-torch.log(u))


@triton.jit
def _gumbel(r1, r2, cols):
    # h = mix32(mix32(j ^ r1) ^ r2) on uint32 (multiplies wrap mod 2^32); written out, not a helper call,
    # because the interpreter pays ~1 ms per nested jit call
    h = cols.to(tl.uint32) ^ r1
    for i in tl.static_range(2):
        h = h ^ (h >> 16)
        h = h * 0x7FEB352D
        h = h ^ (h >> 15)
        h = h * 0x846CA68B
        h = h ^ (h >> 16)
        if i == 0:
            h = h ^ r2
    u = ((h >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 2^-24
    return -tl.log(-tl.log(u))


# -----------------------------------------------------------------------------
# sampler: triton kernels
# Kept set = {z >= t} with z = logits / T and t = max(top-k threshold, top-p threshold, min-p threshold);
# the draw is the Gumbel-max argmax of z + g over the kept set. Thresholds are found without sorting by
# bisecting on the fp32 bit pattern (a monotone int32 key): NC candidates per pass over the row, so
# 8 passes of 16 pin down the exact k-th largest value / exact nucleus boundary.

_KEY_NEG_INF = struct.unpack('<i', struct.pack('<f', -math.inf))[0] ^ 0x7FFFFFFF  # smallest key of any float
_NC, _NPASS = 16, 8  # 16 ** 8 = 2 ** 32 covers every fp32 key


@triton.jit
def _key(z):  # fp32 -> int32, order-preserving (negative floats have their magnitude bits flipped)
    b = z.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _sample_pass_kernel(x_ptr, stride_row, V, inv_temp, tile, t_ptr, r1_ptr, r2_ptr, m_ptr, s_ptr, bv_ptr, bi_ptr,
                        HAS_THRESH: tl.constexpr, DRAW: tl.constexpr, GREEDY: tl.constexpr, BLOCK: tl.constexpr):
    # grid (rows, splits): each program covers one tile of one row (few rows -> many tiles fill the GPU),
    # writing partial softmax stats and, if DRAW, its best (z + gumbel) over the kept set
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
            w = z if GREEDY else z + _gumbel(r1, r2, cols)
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
def _bisect(base, V, inv_temp, m, lo, hi, k, target, COUNT: tl.constexpr, NC: tl.constexpr, NPASS: tl.constexpr,
            BLOCK: tl.constexpr):
    # Largest key t in [lo, hi) with count(key >= t) >= k (COUNT) or mass(key >= t) >= target (mass, where
    # mass = sum exp(z - m)). Invariant: the condition holds at lo and fails at hi. Also returns mass(>= t).
    mass_lo = tl.zeros((), tl.float32)
    for _ in range(NPASS):
        cand = lo + ((hi - lo) * tl.arange(0, NC).to(tl.int64)) // NC  # cand[0] == lo
        cand32 = cand.to(tl.int32)
        cnt = tl.zeros([NC], tl.int32)
        mass = tl.zeros([NC], tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inb = cols < V
            z = tl.load(base + cols, mask=inb, other=float('-inf')).to(tl.float32) * inv_temp
            b = z.to(tl.int32, bitcast=True)
            key = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)  # = _key(z), inlined for the interpreter's sake
            ge = (key[:, None] >= cand32[None, :]) & inb[:, None]
            if COUNT:
                cnt += tl.sum(ge.to(tl.int32), 0)
            mass += tl.sum(tl.where(ge, tl.exp(z - m)[:, None], 0.0), 0)
        ok = (cnt >= k) if COUNT else (mass >= target)
        hi = tl.min(tl.where(ok, hi, cand), 0)  # smallest failing candidate
        lo = tl.max(tl.where(ok, cand, lo), 0)  # largest passing candidate
        mass_lo = tl.min(tl.where(ok, mass, float('inf')), 0)  # mass falls as t rises
    return lo, mass_lo


@triton.jit
def _threshold_kernel(x_ptr, stride_row, V, inv_temp, m_ptr, s_ptr, t_ptr, top_k, top_p, KEY_NEG_INF: tl.constexpr,
                      DO_TOPK: tl.constexpr, DO_TOPP: tl.constexpr, NC: tl.constexpr, NPASS: tl.constexpr,
                      BLOCK: tl.constexpr):
    # one program per row: top-k first, then top-p on the renormalised top-k distribution (HF/vLLM order)
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_row
    m = tl.load(m_ptr + row)
    lo = tl.full((), KEY_NEG_INF, tl.int64)
    hi = _key(m).to(tl.int64) + 1
    mass_k = tl.load(s_ptr + row)
    if DO_TOPK:
        lo, mass_k = _bisect(base, V, inv_temp, m, lo, hi, top_k, 0.0, True, NC, NPASS, BLOCK)
    if DO_TOPP:
        lo, mass_k = _bisect(base, V, inv_temp, m, lo, hi, 0, top_p * mass_k, False, NC, NPASS, BLOCK)
    b = lo.to(tl.int32)
    b = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)  # the key map is its own inverse
    tl.store(t_ptr + row, b.to(tl.float32, bitcast=True))


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
        zs = z.masked_fill(z < t, -math.inf).sort(-1, descending=True).values  # on the renormalised top-k set
        c = torch.exp((zs - m).double()).cumsum(-1)
        n_before = (c < top_p * c[:, -1:]).sum(-1, keepdim=True)  # the token that reaches top_p is kept
        t = torch.maximum(t, zs.gather(-1, n_before))
    if min_p > 0.0:
        t = torch.maximum(t, m + math.log(min_p))  # p_i >= min_p * p_max
    return t


def sample_tokens_ref(logits, seeds, step, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Pure-torch sampler; draws the same ids as the triton kernel (same hash, same kept set)."""
    greedy = temperature == 0 or top_k == 1
    inv_temp = 1.0 if temperature == 0 else 1.0 / temperature
    z = logits.float() if inv_temp == 1.0 else logits.float() * inv_temp
    if greedy:
        ids = z.argmax(-1)
    else:
        t = _keep_threshold_ref(z, top_k, top_p, min_p)
        g = _gumbel_torch(*_row_keys(seeds.to(z.device), step), z.shape[-1])
        ids = torch.where(z >= t, z + g, -math.inf).argmax(-1)
    logp = torch.log_softmax(z, -1).gather(-1, ids[:, None]).squeeze(-1)
    return ids, logp


def sample_tokens(logits, seeds, step, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, *, use_triton=None,
                  n_split=None, block_size=None):
    """
    Draw one token per row of logits (B, V) from softmax(logits / temperature) restricted by top_k (0 = off),
    top_p (1 = off), min_p (0 = off). seeds (B,) int64 and step (int or (B,)) fix the draw: row b's id
    depends only on (seeds[b], step, logits[b]). temperature 0 or top_k 1 is greedy argmax.
    Returns ids int64 (B,) and logp fp32 (B,), the log-prob of each id under the FULL softmax at this
    temperature (temperature 1 when temperature is 0). Ties at the top-k / top-p boundary value are all kept.
    """
    if not (logits.is_cuda if use_triton is None else use_triton):
        return sample_tokens_ref(logits, seeds, step, temperature, top_k, top_p, min_p)
    assert logits.dim() == 2 and logits.stride(-1) == 1, 'logits must be (B, V) with contiguous rows'
    B, V = logits.shape
    greedy = temperature == 0 or top_k == 1
    inv_temp = 1.0 if temperature == 0 else 1.0 / temperature
    block = block_size or min(4096, triton.next_power_of_2(V))
    if n_split is None:  # few rows: split the vocabulary so there are ~4 programs per SM
        sms = torch.cuda.get_device_properties(logits.device).multi_processor_count if logits.is_cuda else 1
        n_split = max(1, min(triton.cdiv(4 * sms, B), triton.cdiv(V, block)))
    tile = triton.cdiv(triton.cdiv(V, n_split), block) * block
    S = triton.cdiv(V, tile)
    r1, r2 = _row_keys(seeds.to(logits.device), step)
    f32 = dict(device=logits.device, dtype=torch.float32)
    m_part, s_part, bv = (torch.empty(B, S, **f32) for _ in range(3))
    bi = torch.empty(B, S, device=logits.device, dtype=torch.int32)

    def one_pass(t, draw):
        _sample_pass_kernel[(B, S)](logits, logits.stride(0), V, inv_temp, tile, t, r1, r2, m_part, s_part, bv, bi,
                                    HAS_THRESH=t is not None, DRAW=draw, GREEDY=greedy, BLOCK=block,
                                    num_warps=_num_warps(block))
        m = m_part.amax(1)
        return m, (s_part * torch.exp(m_part - m[:, None])).sum(1)

    t = None
    do_topk, do_topp = (not greedy) and 0 < top_k < V, (not greedy) and top_p < 1.0
    if do_topk or do_topp or (min_p > 0.0 and not greedy):
        m, s = one_pass(None, draw=False)  # row max and sum for the threshold search
        t = torch.full((B,), -math.inf, **f32)
        if do_topk or do_topp:
            sblock = min(1024, block)  # NC candidates per element: keep the [BLOCK, NC] tile in registers
            _threshold_kernel[(B,)](logits, logits.stride(0), V, inv_temp, m, s, t, top_k, top_p,
                                    KEY_NEG_INF=_KEY_NEG_INF, DO_TOPK=do_topk, DO_TOPP=do_topp, NC=_NC,
                                    NPASS=_NPASS, BLOCK=sblock, num_warps=_num_warps(sblock))
        if min_p > 0.0:
            t = torch.maximum(t, m + math.log(min_p))
    m, s = one_pass(t, draw=True)
    best = bv.argmax(1, keepdim=True)  # ties -> first tile -> smallest id
    ids = bi.gather(1, best).squeeze(1).long()
    logp = logits.gather(1, ids[:, None]).squeeze(1).float() * inv_temp - m - torch.log(s)
    return ids, logp
