"""
Time and peak memory of logprob_kernels.py and sample_kernels.py next to the torch ways of doing the same,
on the same inputs, in one run.

  log-prob + entropy, forward and forward+backward:
    ours            token_logprobs (Triton on GPU; on CPU the torch reference path)
    log_softmax     log_softmax(logits / T) + gather, entropy from the same log-softmax
    trl_loop        a per-row loop like TRL's selective_log_softmax (log-probs only, no entropy)
  sampler, temperature + top-p:
    ours            sample_tokens (Triton on GPU; on CPU the torch reference path)
    torch_sort      sort-based top-p as in HF/TRL: sort, softmax, cumsum, mask, multinomial
  packed-group attention (--attention=1), Qwen2.5-0.5B's heads (14 query, 2 key/value, head_dim
  64), --attn_shape groups x (prompt + G completions): forward, and forward+backward on GPU (CPU
  FlexAttention has no backward):
    flex            the packed rows through FlexAttention with the block mask
                    (model.packed_mask / model.flex)
    sdpa_dense      the packed rows through SDPA with the dense (B, 1, T, T) mask, K/V repeated
                    (the fallback)
    rows            one row per completion (prompt + completion), SDPA causal with GQA
                    (share_prompt=False)
    and the time to build each mask from the segment ids on the device

On a GPU it also reports the fraction of peak HBM bandwidth the log-prob kernel reaches. The last
line printed is JSON. Usage:
    python bench/bench_kernels.py [--tokens=N] [--vocab=V] [--dtype=bfloat16] [--rows=B]
                                  [--attention=0|1] [--attn_shape=groups,prompt,G,completion]
"""
import argparse
import ctypes
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model as M  # noqa: E402
from logprob_kernels import token_logprobs  # noqa: E402
from sample_kernels import sample_tokens  # noqa: E402

GPU = torch.cuda.is_available()
parser = argparse.ArgumentParser()
# rows of logits (batch x seq)
parser.add_argument('--tokens', type=int, default=8 * 1024 if GPU else 2048)
parser.add_argument('--vocab', type=int, default=151_936 if GPU else 32_768)  # Qwen2's vocab on GPU
parser.add_argument('--dtype', default='bfloat16' if GPU else 'float32')  # logits dtype
parser.add_argument('--rows', type=int, default=256 if GPU else 64)  # sampler batch
parser.add_argument('--temperature', type=float, default=1.0)
parser.add_argument('--top_p', type=float, default=0.9)
# CPU timing repeats (GPU uses triton.testing.do_bench)
parser.add_argument('--reps', type=int, default=3)
parser.add_argument('--peak_gbps', type=float, default=0.0)  # HBM peak; 0 = look the GPU up
# also time packed-group attention (flex / sdpa / rows)
parser.add_argument('--attention', type=int, default=1)
# groups, prompt, G, completion
parser.add_argument('--attn_shape', default='4,380,8,300' if GPU else '2,100,4,60')
args = parser.parse_args()
device = 'cuda' if GPU else 'cpu'
dtype = getattr(torch, args.dtype)

# large frees go straight back to the OS, so the resident-set high-water mark measures peak use
if not GPU:
    try:
        ctypes.CDLL('libc.so.6').mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD = 64 KiB, fixed
    except OSError:
        pass


def _status_kb(field):
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def measure(fn):
    """(median ms, peak MiB above what was allocated before the call)."""
    gc.collect()
    if GPU:
        import triton.testing
        ms = triton.testing.do_bench(fn, return_mode='median')
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return ms, (torch.cuda.max_memory_allocated() - base) / 2**20
    fn()  # warm up
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    gc.collect()
    try:
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')  # resets the high-water mark to the current RSS
        base = _status_kb('VmRSS:')
        fn()
        peak = (_status_kb('VmHWM:') - base) / 1024
    except OSError:
        peak = None
    return statistics.median(times), peak


def peak_hbm_gbps():
    if args.peak_gbps:
        return args.peak_gbps
    p = torch.cuda.get_device_properties(0)
    clock = getattr(p, 'memory_clock_rate', 0)  # kHz
    bus = getattr(p, 'memory_bus_width', 0)  # bits
    if clock and bus:
        return 2 * clock * 1e3 * bus / 8 / 1e9
    table = {'H200': 4800, 'H100 PCIe': 2000, 'H100': 3350, 'A100-SXM4-80GB': 2039, 'A100': 1555}
    return next((v for k, v in table.items() if k in p.name), None)


# ----------------------------------------------------------------------------- log-prob + entropy
N, V, T = args.tokens, args.vocab, args.temperature
g = torch.Generator(device=device).manual_seed(0)
logits = (2 * torch.randn(N, V, device=device, generator=g)).to(dtype)
targets = torch.randint(0, V, (N,), device=device, generator=g)


def ours(x):
    return token_logprobs(x, targets, T)


def log_softmax_gather(x):
    logq = torch.log_softmax(x.float() / T, -1)
    entropy = -(logq.exp() * logq).sum(-1)
    return logq.gather(-1, targets[:, None]).squeeze(-1), entropy


def trl_loop(x):  # TRL's selective_log_softmax: per-row log_softmax to bound peak memory
    return torch.stack([torch.log_softmax(r.float() / T, -1)[t] for r, t in zip(x, targets)]), None


def fwd(method, x):
    def run():
        with torch.no_grad():
            method(x)
    return run


def fwd_bwd(method, x):
    def run():
        x.grad = None
        lp, ent = method(x)
        (lp.sum() + (ent.sum() if ent is not None else 0)).backward()
        x.grad = None
    return run


def summary(ms, peak):
    return {'ms': round(ms, 3), 'peak_mib': None if peak is None else round(peak, 1)}


def time_logprob(name, mode, run):
    ms, peak = measure(run)
    results[f'{name}_{mode}'] = summary(ms, peak)
    print(f'logprob {name:12s} {mode:8s} {ms:9.3f} ms  peak {peak} MiB', flush=True)


x_grad = logits.clone().requires_grad_()
results = {}
for name, method in [('ours', ours), ('log_softmax', log_softmax_gather), ('trl_loop', trl_loop)]:
    time_logprob(name, 'fwd', fwd(method, logits))
    time_logprob(name, 'fwd_bwd', fwd_bwd(method, x_grad))
with torch.no_grad():
    (lp, ent), (ref_lp, ref_ent) = ours(logits), log_softmax_gather(logits)
results['max_abs_diff_vs_log_softmax'] = {'logp': (lp - ref_lp).abs().max().item(),
                                          'entropy': (ent - ref_ent).abs().max().item()}
# the kernel's floor is reading the logits once (forward) or twice and writing dlogits once
if GPU:
    bw, nbytes = peak_hbm_gbps(), N * V * logits.element_size()
    for mode, passes in [('fwd', 1), ('fwd_bwd', 3)]:
        gbps = passes * nbytes / (results[f'ours_{mode}']['ms'] * 1e-3) / 1e9
        hbm_frac = round(gbps / bw, 3) if bw else None
        results[f'ours_{mode}'].update(gbps=round(gbps, 1), hbm_frac=hbm_frac)
del logits, x_grad

# ----------------------------------------------------------------------------- sampler
B = args.rows
s_logits = (2 * torch.randn(B, V, device=device, generator=g)).to(dtype)
seeds = torch.arange(B, device=device) + 12345


def ours_sample():
    return sample_tokens(s_logits, seeds, 0, temperature=T, top_p=args.top_p)


def torch_sort_sample():  # the usual top-p: full sort of every row
    z = s_logits.float() / T
    sorted_z, order = z.sort(-1, descending=True)
    probs = sorted_z.softmax(-1)
    drop = probs.cumsum(-1) - probs > args.top_p  # mass before the token already reaches top_p
    sorted_z = sorted_z.masked_fill(drop, float('-inf'))
    z = torch.empty_like(z).scatter_(-1, order, sorted_z)
    ids = torch.multinomial(z.softmax(-1), 1).squeeze(-1)
    logp = torch.log_softmax(s_logits.float() / T, -1).gather(-1, ids[:, None]).squeeze(-1)
    return ids, logp


sampler = {}
for name, fn in [('ours', ours_sample), ('torch_sort', torch_sort_sample)]:
    ms, peak = measure(fn)
    sampler[name] = summary(ms, peak)
    print(f'sampler {name:12s} {ms:9.3f} ms  peak {peak} MiB', flush=True)
sampler['speedup_vs_sort'] = round(sampler['torch_sort']['ms'] / sampler['ours']['ms'], 2)


# ----------------------------------------------------------------------------- packed attention
def packed_attention():
    """Forward (and on GPU forward+backward) ms of one attention layer over a step's packed groups,
    three ways."""
    n_groups, P, G, C = (int(v) for v in args.attn_shape.split(','))
    nh, nkv, hd = 14, 2, 64
    T = P + G * (C - 1)  # pack_groups: the prompt, then each completion less its last token
    completions = [torch.full((C - 1,), s) for s in range(1, G + 1)]
    seg = torch.cat([torch.zeros(P, dtype=torch.long)] + completions)
    seg = seg.repeat(n_groups, 1).to(device)
    adt = dtype if GPU else torch.float32

    def qkv(B, L):
        out = []
        for h in (nh, nkv, nkv):
            x = 0.5 * torch.randn(B, h, L, hd, device=device, generator=g)
            out.append(x.to(adt).requires_grad_(GPU))
        return out

    res = {'groups': n_groups, 'prompt': P, 'G': G, 'completion': C, 'packed_T': T,
           'heads': [nh, nkv, hd], 'dtype': str(adt).replace('torch.', '')}
    packed, rows = qkv(n_groups, T), qkv(n_groups * G, P + C - 1)
    dense = M.packed_mask(seg, 'sdpa')
    ms, _ = measure(lambda: M.packed_mask(seg, 'sdpa'))
    res['mask_sdpa_build_ms'] = round(ms, 3)

    def sdpa_dense(q, k, v):
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense)

    def per_row(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    methods = {'sdpa_dense': (sdpa_dense, packed), 'rows': (per_row, rows)}
    if M.flex_attention is not None:
        t = time.perf_counter()
        bm = M.packed_mask(seg, 'flex')
        # (CUDA: includes compiling it)
        res['mask_flex_first_build_s'] = round(time.perf_counter() - t, 2)
        ms, _ = measure(lambda: M.packed_mask(seg, 'flex'))
        res['mask_flex_build_ms'] = round(ms, 3)
        res['flex_blocks_kept_frac'] = round(float(bm.to_dense().float().mean()), 4)
        t = time.perf_counter()
        with torch.no_grad():
            M.flex(*packed, bm, True)
        res['flex_first_call_s'] = round(time.perf_counter() - t, 2)  # compiling the kernel

        def flex(q, k, v):
            return M.flex(q, k, v, bm, True)
        methods = {'flex': (flex, packed), **methods}
    else:
        res['flex'] = f'torch {torch.__version__} has no FlexAttention'
    for name, (fn, inputs) in methods.items():
        def fwd():
            with torch.no_grad():
                fn(*inputs)
        ms, peak = measure(fwd)
        res[f'{name}_fwd'] = summary(ms, peak)
        if GPU:
            def fwd_bwd():
                for x in inputs:
                    x.grad = None
                fn(*inputs).float().sum().backward()
            ms, peak = measure(fwd_bwd)
            res[f'{name}_fwd_bwd'] = summary(ms, peak)
        line = f"attention {name:10s} fwd {res[f'{name}_fwd']['ms']:9.3f} ms"
        if GPU:
            line += f"  fwd+bwd {res[f'{name}_fwd_bwd']['ms']:9.3f} ms"
        print(line, flush=True)
    # the same outputs, flex vs dense (packed layout), as a check that both ran the same mask
    with torch.no_grad():
        if 'flex' in methods:
            ref = methods['sdpa_dense'][0](*packed).float()
            diff = (methods['flex'][0](*packed).float() - ref).abs().max().item()
            res['flex_vs_sdpa_max_abs_diff'] = diff
    return res


attention = packed_attention() if args.attention else None

out = {
    'device': torch.cuda.get_device_name(0) if GPU else 'cpu',
    'note': ('GPU: Triton kernels' if GPU else
             'no GPU: torch paths only (ours = the torch reference path, not Triton)'),
    'peak_mib_means': ('torch.cuda.max_memory_allocated above baseline' if GPU else
                       'process RSS high-water mark above baseline'),
    'logprob': {'tokens': N, 'vocab': V, 'dtype': args.dtype, 'temperature': T, **results},
    'sampler': {'rows': B, 'vocab': V, 'dtype': args.dtype, 'top_p': args.top_p, **sampler},
    'packed_attention': attention,
}
if GPU:
    out['peak_hbm_gbps'] = peak_hbm_gbps()
print(json.dumps(out))
