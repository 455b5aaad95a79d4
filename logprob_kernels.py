"""
Fused per-token log-prob + entropy in Triton, with pure-torch reference paths (the sampler's
kernels: sample_kernels.py).

GRPO's memory goes to logits: log_softmax(logits).gather(targets) materialises a full fp32 copy of a
[tokens, vocab] tensor and entropy wants another. token_logprobs reads each row of given logits once
(forward) and once more (backward), keeping a few floats per row; lm_head_logprobs, what training
runs, never holds the logits at all: it projects hidden states tile by tile and folds each tile into
the same per-token statistics. Triton runs on CUDA tensors; CPU tensors take torch paths unless
use_triton=True (the tests force it under TRITON_INTERPRET=1).
"""
import torch
import triton
import triton.language as tl

# -----------------------------------------------------------------------------
# log-prob + entropy: triton kernels

@triton.jit
def _fold(base, n_loop, n_valid, m, s, w, inv_temp, BLOCK: tl.constexpr):
    # fold columns [0, n_loop) of one row (those from n_valid on read as -inf) into its online
    # softmax of z = x / T: m the running max of the RAW logits, s = sum e, w = sum e * d with d =
    # (x - m) / T, e = exp(d). Each block's load is issued one block ahead, so it is in flight
    # while the block before it is reduced (the reductions wait on every warp; the load does not)
    cols = tl.arange(0, BLOCK)
    ahead = (cols < n_valid) & (cols < n_loop)
    x_next = tl.load(base + cols, mask=ahead, other=float('-inf')).to(tl.float32)
    for start in range(0, n_loop, BLOCK):
        x = x_next
        cols = start + BLOCK + tl.arange(0, BLOCK)
        ahead = (cols < n_valid) & (cols < n_loop)
        x_next = tl.load(base + cols, mask=ahead, other=float('-inf')).to(tl.float32)
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
def _logprob_fwd_kernel(x_ptr, stride_b, stride_t, T1, tgt_ptr, mask_ptr,
                        logp_ptr, ent_ptr, m_ptr, logs_ptr, V, inv_temp,
                        HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
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
    m, s, w = _fold(base, n_cols, V, m, s, w, inv_temp=inv_temp, BLOCK=BLOCK)
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
def _logprob_bwd_kernel(x_ptr, stride_b, stride_t, T1, tgt_ptr, mask_ptr,
                        m_ptr, logs_ptr, ent_ptr, g_lp_ptr, g_ent_ptr, dx_ptr, V, inv_temp,
                        HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
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


def num_warps(block):  # per program over a block of the vocabulary (the sampler uses it too)
    return 8 if block >= 2048 else 4


def _rows(logits):
    """View logits as (B, T, V) without copying the common cases (2-D, 3-D, last-dim-contiguous
    slices)."""
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
        # without a mask, tgt stands in as an unused dummy
        mk = mask.reshape(-1).to(torch.int8).contiguous() if mask is not None else tgt
        f32 = dict(device=x.device, dtype=torch.float32)
        logp, ent, m, logs = (torch.empty(N, **f32) for _ in range(4))
        if N > 0:
            _logprob_fwd_kernel[(N,)](x, x.stride(0), x.stride(1), x.shape[1], tgt, mk,
                                      logp_ptr=logp, ent_ptr=ent, m_ptr=m, logs_ptr=logs, V=V,
                                      inv_temp=inv_temp, HAS_MASK=mask is not None, BLOCK=block,
                                      num_warps=num_warps(block))
        ctx.save_for_backward(logits, tgt, mk, m, logs, ent)
        ctx.has_mask = mask is not None
        ctx.inv_temp = inv_temp
        ctx.block = block
        shape = logits.shape[:-1]
        return logp.view(shape), ent.view(shape)

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, tgt, mk, m, logs, ent = ctx.saved_tensors
        _, x = _rows(logits)
        N, V = x.shape[0] * x.shape[1], x.shape[2]
        # written exactly once by the kernel
        dx = torch.empty((N, V), device=x.device, dtype=x.dtype)
        # the grad of a .sum() arrives as a stride-0 expand
        g_logp = g_logp.float().contiguous().view(-1)
        g_ent = g_ent.float().contiguous().view(-1)
        if N > 0:
            _logprob_bwd_kernel[(N,)](x, x.stride(0), x.stride(1), x.shape[1], tgt, mk,
                                      m_ptr=m, logs_ptr=logs, ent_ptr=ent, g_lp_ptr=g_logp,
                                      g_ent_ptr=g_ent, dx_ptr=dx, V=V, inv_temp=ctx.inv_temp,
                                      HAS_MASK=ctx.has_mask, BLOCK=ctx.block,
                                      num_warps=num_warps(ctx.block))
        return dx.view(logits.shape), None, None, None, None


# -----------------------------------------------------------------------------
# log-prob + entropy: public functions

def token_logprobs_ref(logits, targets, temperature=1.0, mask=None):
    """Pure-torch log p(target) and entropy of softmax(logits / T); fp32 out (fp64 in stays
    fp64)."""
    z = logits if logits.dtype == torch.float64 else logits.float()  # no copy for fp32 input
    # shift by the (detached, shift-invariant) row max first so logits of 1e4 keep fp32 precision
    d = z - z.detach().amax(-1, keepdim=True)
    logq = torch.log_softmax(d if temperature == 1.0 else d * (1.0 / temperature), -1)
    del z, d  # free the temporaries before the next full-size one is made
    p = logq.exp()
    # p = 0 terms (logit -inf) add 0, not 0 * -inf, and get finite gradients; einsum is a batched
    # dot (no p * logq temporary)
    entropy = -torch.einsum('...v,...v->...', p, logq.masked_fill(p == 0, 0.0))
    if mask is not None:
        targets = torch.where(mask, targets, 0)  # padding may hold any id, e.g. -100
    logp = logq.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    if mask is not None:
        logp, entropy = torch.where(mask, logp, 0.0), torch.where(mask, entropy, 0.0)
    return logp, entropy


def token_logprobs(logits, targets, temperature=1.0, mask=None, *, use_triton=None,
                   block_size=None):
    """
    Per-token log p(target) and entropy under softmax(logits / temperature). logits (..., V) any
    float dtype, targets (...) int, mask (...) bool or None (False = padding: outputs 0, zero
    gradient). Returns (logp, entropy), fp32, shape (...), both differentiable w.r.t. logits. Triton
    on CUDA tensors (or when use_triton=True), the torch reference otherwise.
    """
    assert temperature > 0, 'temperature must be > 0 for log-probs'
    if not (logits.is_cuda if use_triton is None else use_triton):
        return token_logprobs_ref(logits, targets, temperature, mask)
    block = block_size or min(4096, triton.next_power_of_2(logits.shape[-1]))
    return _TokenLogprobs.apply(logits, targets, mask, 1.0 / temperature, block)


# -----------------------------------------------------------------------------
# LM head: log-prob + entropy straight from hidden states, never holding [tokens, vocab]
# Each (token tile x vocab tile) of logits is projected into one reused buffer and folded into
# per-token running statistics relative to the running max m: s = sum e, w = sum e * d with
# d = z - m, e = exp(d) (H = log s - w / s). Backward recomputes each tile, overwrites it with
# dlogits and adds its two products to the fp32 gradients.

@triton.jit
def _head_fwd_kernel(x_ptr, stride, n_cols, col0, tgt_ptr, m_ptr, s_ptr, w_ptr, xt_ptr, inv_temp,
                     BLOCK: tl.constexpr):
    # one program per token: fold one tile row into that token's (m, s, w) (_fold, as
    # _logprob_fwd_kernel does)
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    m = tl.load(m_ptr + row)
    s = tl.load(s_ptr + row)
    w = tl.load(w_ptr + row)
    m, s, w = _fold(base, n_cols, n_cols, m, s, w, inv_temp=inv_temp, BLOCK=BLOCK)
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    tl.store(w_ptr + row, w)
    local = tl.load(tgt_ptr + row) - col0
    if (local >= 0) & (local < n_cols):  # this tile holds the target's logit
        tl.store(xt_ptr + row, tl.load(base + local).to(tl.float32))


@triton.jit
def _head_bwd_kernel(x_ptr, stride, n_cols, col0, tgt_ptr, lse_ptr, a_ptr, b_ptr, g_lp_ptr,
                     inv_temp, BLOCK: tl.constexpr):
    # grid (tokens, column blocks): overwrite the tile with dlogits = (p * (a + b * log p) + [i ==
    # t] g_lp) / T, where a = -g_lp - g_ent * H and b = -g_ent fold both outputs' gradients into two
    # floats per token
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ptrs = x_ptr + row * stride + cols
    x = tl.load(ptrs, mask=cols < n_cols, other=0.0).to(tl.float32)
    logq = x * inv_temp - tl.load(lse_ptr + row)  # lse = log sum exp(x / T)
    p = tl.exp(logq)
    dz = p * (tl.load(a_ptr + row) + tl.load(b_ptr + row) * logq)
    dz += tl.where(cols + col0 == tl.load(tgt_ptr + row), tl.load(g_lp_ptr + row), 0.0)
    tl.store(ptrs, (dz * inv_temp).to(x_ptr.dtype.element_ty), mask=cols < n_cols)


def _fold_fwd_torch(z, e, tgt, col0, *, m, s, w, zt):
    """_head_fwd_kernel for a whole tile in torch ops (CPU), temperature already applied: z (n, v)
    fp32 is clobbered, e is scratch of its shape; updates m, s, w, zt (n,) in place."""
    local = tgt - col0
    inside = (local >= 0) & (local < z.shape[1])
    z_target = z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None]).squeeze(1)
    zt.copy_(torch.where(inside, z_target, zt))
    m_new = torch.maximum(m, z.amax(1))
    z.sub_(m_new[:, None])
    torch.exp(z, out=e)
    # shift <= 0; the sentinel -1e30 (not -inf) keeps shift * s = 0, not nan, before the first tile
    shift = m - m_new
    alpha = shift.exp()
    w.add_(shift * s).mul_(alpha)  # the old terms, now relative to m_new
    s.mul_(alpha).add_(e.sum(1))
    # sum e * d: in place in the scratch, summed by torch's cascade (a bmm dot loses ~1e-5 over a
    # 4,096-wide row)
    w.add_(e.mul_(z).sum(1))
    m.copy_(m_new)


def _fold_bwd_torch(z, e, tgt, col0, *, shift, a, b, g_lp):
    """_head_bwd_kernel for a whole tile in torch ops (CPU), temperature already applied: z becomes
    dlogits. shift = m + log s, so z - shift = log p."""
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
    """The weight's .grad, when backward may add to it directly instead of returning a second
    full-size gradient for autograd to add: a later micro-batch of .backward() (so .grad exists),
    fp32, and nothing between autograd and .grad. Not under autograd.grad (which must leave .grad
    alone: its AccumulateGrad node will not run), not with tensor hooks (they would miss this
    share), and not with FSDP2 (whose unsharded weight has no .grad here). A tied embedding is safe:
    its own share reaches AccumulateGrad after ours (the head runs last in forward, so first in
    backward), and DDP's hook, which fires there, reads .grad whole."""
    g = weight.grad
    if acc_node is None or g is None or weight._backward_hooks:
        return None
    if g.dtype != torch.float32 or g.layout != torch.strided:
        return None
    try:
        runs = torch._C._will_engine_execute_node(acc_node)
    except (RuntimeError, AttributeError):
        # raised for a leaf's node under autograd.grad(): it does not run there
        runs = False
    return g if runs and g.shape == weight.shape else None


def _tiles(hidden, weight, inv_temp, cd, tiles, triton_fold):
    """Yield (hidden tile, first token, first vocab id, logits tile, scratch, weight tile) for every
    tile, the logits tile projected in dtype cd into one reused buffer. The Triton fold reads raw
    logits x and divides by T itself; the torch fold gets fp32 z = x / T: in fp32 from hidden scaled
    once (_prescaled), else as an fp32 copy of the tile scaled on the way (scaling a bf16 hidden
    would round it twice)."""
    if _prescaled(cd, inv_temp, triton_fold):
        hs = hidden.float().mul(inv_temp).to(cd)
    else:
        hs = hidden.to(cd)
    N, V = hidden.shape[0], weight.shape[0]
    tt, vt = min(tiles[0], N), min(tiles[1], V)
    buf = torch.empty(tt * vt, device=hidden.device, dtype=cd)
    opts32 = dict(device=hidden.device, dtype=torch.float32)
    f32 = None if triton_fold or cd == torch.float32 else torch.empty(tt * vt, **opts32)
    e = None if triton_fold else torch.empty(tt * vt, **opts32)  # exp's output
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
    """Whether the torch fold's hidden states are scaled by 1/T before the projection (fp32
    only)."""
    return not triton_fold and cd == torch.float32 and inv_temp != 1.0


class _LMHead(torch.autograd.Function):
    # settings = (inv_temp, cd, tiles, triton_fold, acc_node), one tuple: apply() takes positional
    # arguments only
    @staticmethod
    def forward(ctx, hidden, weight, targets, settings):
        # an output nobody differentiates (often entropy) costs nothing in backward
        ctx.set_materialize_grads(False)
        inv_temp, cd, tiles, triton_fold, acc_node = settings
        N = hidden.shape[0]
        f32 = dict(device=hidden.device, dtype=torch.float32)
        m = torch.full((N,), -1e30, **f32)  # finite sentinel: see _fold_fwd_torch
        s, w, xt = (torch.zeros(N, **f32) for _ in range(3))
        with torch.autocast(hidden.device.type, enabled=False):
            for h, t0, v0, tile, e, wt in _tiles(hidden, weight, inv_temp, cd, tiles, triton_fold):
                n, v = tile.shape
                if triton_fold:
                    blk = min(4096, triton.next_power_of_2(v))
                    _head_fwd_kernel[(n,)](tile, tile.stride(0), v, v0, targets[t0:],
                                           m_ptr=m[t0:], s_ptr=s[t0:], w_ptr=w[t0:], xt_ptr=xt[t0:],
                                           inv_temp=inv_temp, BLOCK=blk, num_warps=num_warps(blk))
                else:
                    sl = slice(t0, t0 + n)
                    _fold_fwd_torch(tile, e, targets[sl], v0, m=m[sl], s=s[sl], w=w[sl], zt=xt[sl])
        # the Triton fold's m and xt are raw logits, the torch fold's z = x / T
        u = inv_temp if triton_fold else 1.0
        logs = torch.log(s)
        logp = (xt - m) * u - logs
        ent = logs - w / s
        # log p = z - (m*u + logs)
        ctx.save_for_backward(hidden, weight, targets, m * u + logs, ent)
        ctx.settings = settings
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        inv_temp, cd, tiles, triton_fold, acc_node = ctx.settings
        need_h, need_w = ctx.needs_input_grad[:2]
        if g_lp is None and g_ent is None:
            return (None,) * 4
        pre = _prescaled(cd, inv_temp, triton_fold)
        # dlogits = p * (a + b * log p) + [i == target] * g_lp, times dz/dtile: the torch fold folds
        # that factor (1/T unless the hidden states were prescaled) into a, b and g_lp; the Triton
        # kernel applies 1/T itself
        k = 1.0 if triton_fold or pre else inv_temp
        # .contiguous(): .sum()'s grad is an expand
        g_lp = g_lp.float().contiguous() * k if g_lp is not None else None
        b = -g_ent.float() * k if g_ent is not None else None
        a_lp = -g_lp if g_lp is not None else 0.0
        a_ent = b * ent if b is not None else 0.0
        a = a_lp + a_ent
        if triton_fold:  # the kernel reads every vector: a missing gradient is zeros
            g_lp = g_lp if g_lp is not None else torch.zeros_like(ent)
            b = b if b is not None else torch.zeros_like(ent)
        gh = None
        if need_h:
            gh = torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float32)
        into = _grad_goes_to(weight, acc_node) if need_w else None
        gw = into
        if gw is None and need_w:
            gw = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
        with torch.autocast(hidden.device.type, enabled=False):
            for h, t0, v0, tile, e, wt in _tiles(hidden, weight, inv_temp, cd, tiles, triton_fold):
                n, v = tile.shape
                sl = slice(t0, t0 + n)
                if triton_fold:
                    blk = min(4096, triton.next_power_of_2(v))
                    grid = (n, triton.cdiv(v, blk))
                    _head_bwd_kernel[grid](tile, tile.stride(0), v, v0, targets[t0:],
                                           lse_ptr=lse[t0:], a_ptr=a[t0:], b_ptr=b[t0:],
                                           g_lp_ptr=g_lp[t0:], inv_temp=inv_temp, BLOCK=blk,
                                           num_warps=num_warps(blk))
                else:
                    b_sl = None if b is None else b[sl]
                    g_lp_sl = None if g_lp is None else g_lp[sl]
                    _fold_bwd_torch(tile, e, targets[sl], v0, shift=lse[sl], a=a[sl], b=b_sl,
                                    g_lp=g_lp_sl)
                if gh is not None:
                    _addmm_fp32(gh[sl], tile, wt)
                if gw is not None:  # prescaled: h is hidden / T, as the chain rule wants
                    _addmm_fp32(gw[v0:v0 + v], tile.t(), h)
        if gh is not None:
            gh = (gh.mul_(inv_temp) if pre else gh).to(hidden.dtype)
        if gw is not None:
            gw = None if into is not None else gw.to(weight.dtype)
        return gh, gw, None, None


# (tokens, vocab) per tile. CPU, measured on 2 cores (2,048 tokens x vocab 32,768 x hidden 896,
# fp32, CPU seconds per forward+backward, 3 runs): 2048x4096 5.9, 2048x8192 5.7-5.9,
# 2048x16384 5.8, 2048x2048 6.5, 1024x8192 6.3, 1024x4096 7.1, 512x4096 8.4. GEMMs dominate (90%)
# and want many tokens; vocab widths 4,096-16,384 tie, so the narrowest (tile + scratch: 64 MiB).
# CUDA: not measured yet; bf16 tiles of 128 MiB, GEMMs large enough for full speed
HEAD_TILES = {'cpu': (2048, 4096), 'cuda': (4096, 16384)}


def lm_head_logprobs(hidden, weight, targets, temperature=1.0, mask=None, *, head_fp32=False,
                     tiles=None, use_triton=None):
    """
    Per-token log p(target) and entropy under softmax(hidden @ weight.T / temperature), never
    holding more logits than one tile of tiles = (tokens, vocab) (None or 0: HEAD_TILES for the
    device): forward keeps four floats per token, backward recomputes each tile. hidden (..., D),
    weight (V, D), targets (...) int, mask (...) bool or None (False: outputs 0, zero gradient, the
    target may be anything). Returns (logp, entropy) fp32 of shape (...), differentiable w.r.t.
    hidden and weight; their gradients are accumulated in fp32 (a later micro-batch adds the
    weight's straight into weight.grad: _grad_goes_to). The projection runs in hidden's dtype, or in
    fp32 with head_fp32 (hidden and weight upcast; under bf16 autocast the logits are then not
    rounded to bf16). Softmax math is always fp32. The fold is Triton on CUDA tensors (or when
    use_triton=True), torch tile ops otherwise.
    """
    assert temperature > 0, 'temperature must be > 0 for log-probs'
    triton_fold = hidden.is_cuda if use_triton is None else use_triton
    default_tiles = HEAD_TILES['cuda' if hidden.is_cuda else 'cpu']
    tiles = tuple(t or d for t, d in zip(tiles or (0, 0), default_tiles))
    shape = hidden.shape[:-1]
    h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1).long()
    if mask is not None:  # score the kept tokens only
        keep = mask.reshape(-1)
        h, t = h[keep], t[keep]
    acc_node = None  # weight's AccumulateGrad, when backward may add into weight.grad directly
    if torch.is_grad_enabled() and weight.requires_grad and weight.is_leaf:
        acc_node = torch.autograd.graph.get_gradient_edge(weight).node
    cd = torch.float32 if head_fp32 else hidden.dtype
    settings = (1.0 / temperature, cd, tiles, triton_fold, acc_node)
    logp, ent = _LMHead.apply(h, weight, t.contiguous(), settings)
    if mask is not None:  # masked_scatter keeps an all-masked batch connected to the graph
        logp, ent = (x.new_zeros(keep.shape).masked_scatter(keep, x) for x in (logp, ent))
    return logp.view(shape), ent.view(shape)
