"""
Per-token log-prob + entropy through the LM head, forward and backward w.r.t. hidden states and
weight, three ways on the same inputs, each in its own process (so one method's freed memory or warm
allocator cannot flatter another):

  ours    logprob_kernels.lm_head_logprobs: tiles of tokens x vocabulary folded into an online
          log-sum-exp; backward recomputes each tile (torch tile ops on CPU, the Triton fold on
          CUDA)
  trl     TRL 1.16's ChunkedLogProbFunction (what GRPOTrainer runs by default), 4,096 tokens x
          32,768 vocabulary
  naive   logits = hidden @ weight.T, log_softmax, gather; entropy from the same log-softmax

Each process builds the inputs from one seed, warms up on 64 tokens (Triton compiles, BLAS and
thread pools start), then runs forward+backward twice: the first with no .grad (a step's first
micro-batch), the second adding into the existing .grad (gradient accumulation: a method that
returns a fresh weight gradient for autograd to add holds two of them then). Peak memory is above
the inputs: the process resident-set high-water mark on CPU (large frees go straight back to the
OS), torch.cuda.max_memory_allocated on GPU. Agreement: every method's log-probs, entropies,
hidden gradient and 512 rows of the weight gradient against naive's. GPU: ours' TFLOP/s and
fraction of the matmul peak (four GEMMs of tokens x vocab x hidden per forward+backward) and of HBM
peak (the bytes its tiles move, a model).

  # CPU: fp32, 2,048 tokens, Qwen2.5-0.5B's head (896 x 151,936)
  python bench/bench_logprob.py
  # GPU: bf16 (fp32 weight, as under autocast), 16,384 tokens
  python bench/bench_logprob.py --gpu
  # one method, other tiles
  python bench/bench_logprob.py --methods=ours --tiles=1024x8192
  # each method twice, interleaved; the fastest round is reported
  python bench/bench_logprob.py --rounds=2

Needs TRL for 'trl' (requirements-bench.txt). The last line printed is JSON.
"""
import argparse
import ctypes
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

parser = argparse.ArgumentParser()
# the GPU preset: bf16 hidden, 16,384 tokens, CUDA memory
parser.add_argument('--gpu', action='store_true')
parser.add_argument('--tokens', type=int, default=None)  # default 2,048 (CPU) / 16,384 (GPU)
parser.add_argument('--vocab', type=int, default=151_936)
parser.add_argument('--hidden', type=int, default=896)
parser.add_argument('--dtype', default=None)  # hidden states' dtype: float32 (CPU) / bfloat16 (GPU)
parser.add_argument('--temperature', type=float, default=1.0)
parser.add_argument('--methods', default='ours,trl,naive')
# ours: TOKENSxVOCAB, e.g. 2048x4096; '' = logprob_kernels.HEAD_TILES
parser.add_argument('--tiles', default='')
parser.add_argument('--threads', type=int, default=2)  # CPU threads per process
# every method this many times, interleaved (load drifts)
parser.add_argument('--rounds', type=int, default=1)
# GPU dense bf16 peak; 0 = look the GPU up
parser.add_argument('--peak_tflops', type=float, default=0.0)
parser.add_argument('--peak_gbps', type=float, default=0.0)  # GPU HBM peak; 0 = look the GPU up
parser.add_argument('--worker', default='')  # internal: run one method, write its results to --out
parser.add_argument('--out', default='')
args = parser.parse_args()
GPU = args.gpu
N = args.tokens or (16_384 if GPU else 2048)
DTYPE = getattr(torch, args.dtype or ('bfloat16' if GPU else 'float32'))
DEVICE = 'cuda' if GPU else 'cpu'
# weight-gradient rows compared across processes (the whole of it is 0.5 GB in fp32)
ROWS = 512


def inputs():
    """The same inputs in every process: hidden (N, D) in DTYPE, fp32 weight (V, D) as the model
    keeps it."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, args.hidden, generator=g).to(DEVICE, DTYPE)
    # logits of std ~1.5
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * 0.05).to(DEVICE)
    targets = torch.randint(0, args.vocab, (N,), generator=g).to(DEVICE)
    return hidden.requires_grad_(), weight.requires_grad_(), targets


def method_fn(name):
    T = args.temperature
    if name == 'ours':
        from logprob_kernels import lm_head_logprobs
        tiles = tuple(int(x) for x in args.tiles.split('x')) if args.tiles else None

        def ours(h, w, t):
            return lm_head_logprobs(h, w, t, T, tiles=tiles)
        return ours
    if name == 'trl':
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

        # as add_fused_lm_head calls it, under autocast on GPU (its projection dtype)
        def trl(h, w, t):
            with torch.autocast(DEVICE, dtype=DTYPE, enabled=DTYPE != torch.float32):
                # autograd's apply takes positional arguments only
                out = ChunkedLogProbFunction.apply(h, w, None, t, T, _CHUNKED_LOGPROB_CHUNK_SIZE,
                                                   None, 1.0, ('entropy',))
                return out[:2]
        return trl

    def naive(h, w, t):  # what one writes first: the whole logits, log_softmax, gather
        logq = torch.log_softmax((h @ w.to(h.dtype).t()).float() / T, -1)
        return logq.gather(-1, t[:, None]).squeeze(-1), -(logq.exp() * logq).sum(-1)
    return naive


def _status_kb(field):
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def worker(name):
    """One method in this process: two timed forward+backward passes, each with its peak memory."""
    torch.set_num_threads(args.threads)
    # large frees go straight back to the OS, so the high-water mark measures live memory
    if not GPU:
        ctypes.CDLL('libc.so.6').mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD = 64 KiB, fixed
    fn = method_fn(name)
    hidden, weight, targets = inputs()
    # warm-up on a slice: Triton compiles, BLAS and thread pools start
    h = hidden[:64].detach().requires_grad_()
    sum(fn(h, weight, targets[:64])).sum().backward()
    weight.grad = None
    runs = []
    for i in range(2):  # 0: no .grad yet; 1: accumulating into it
        # the hidden gradient never accumulates in training (it flows on into the trunk)
        hidden.grad = None
        gc.collect()
        if GPU:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            with open('/proc/self/clear_refs', 'w') as f:
                f.write('5')  # resets the high-water mark to the current RSS
            base = _status_kb('VmRSS:') * 1024
        t0 = time.perf_counter()
        lp, ent = fn(hidden, weight, targets)
        (lp.sum() + ent.sum()).backward()
        if GPU:
            torch.cuda.synchronize()
        sec = time.perf_counter() - t0
        if GPU:
            peak = torch.cuda.max_memory_allocated() - base
        else:
            peak = _status_kb('VmHWM:') * 1024 - base
        runs.append(dict(s=round(sec, 3), peak_mib=round(peak / 2**20, 1)))
        print(f'  {name} run {i} ({"fresh .grad" if i == 0 else "accumulating"}): {sec:.3f} s, '
              f'peak {peak / 2**20:.1f} MiB', flush=True)
        if i == 0:
            order = torch.randperm(args.vocab, generator=torch.Generator().manual_seed(1))
            rows = order[:ROWS].to(DEVICE)
            grad_norm = math.sqrt(hidden.grad.float().norm().item() ** 2
                                  + weight.grad.float().norm().item() ** 2)
            torch.save(dict(logp=lp.detach().cpu(), entropy=ent.detach().cpu(),
                            d_hidden=hidden.grad.float().cpu(),
                            d_weight_rows=weight.grad[rows].float().cpu(), grad_norm=grad_norm),
                       args.out)
        del lp, ent
    with open(args.out + '.json', 'w') as f:
        json.dump(runs, f)


def gpu_peaks():
    """(dense bf16 TFLOP/s, HBM GB/s) of this GPU, from the flags or a table."""
    p = torch.cuda.get_device_properties(0)
    table = {'H200': (989, 4800), 'H100 PCIe': (756, 2000), 'H100': (989, 3350),
             'A100': (312, 2039)}
    flops, gbps = next((v for k, v in table.items() if k in p.name), (None, None))
    return args.peak_tflops or flops, args.peak_gbps or gbps


def main():
    load = os.getloadavg()[0]
    methods = [m for m in args.methods.split(',') if m]
    where = "cuda" if GPU else f"cpu, {args.threads} threads"
    print(f'{N} tokens x vocab {args.vocab} x hidden {args.hidden}, {str(DTYPE)[6:]} hidden, '
          f'T={args.temperature}, {where}; load average {load:.2f} on {os.cpu_count()} cores',
          flush=True)
    if not GPU and load > os.cpu_count() - 0.5:
        print(f'warning: the machine is busy (load average {load:.1f}): times are not comparable '
              'with an idle run')
    results, outs, runs = {}, {}, {m: [] for m in methods}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd, m in [(r, m) for r in range(args.rounds) for m in methods]:
            out = os.path.join(tmp, f'{m}.pt')
            passed = [a for a in sys.argv[1:] if not a.startswith(('--methods', '--rounds'))]
            cmd = [sys.executable, os.path.abspath(__file__), '--worker', m, '--out', out] + passed
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            print(r.stdout, end='', flush=True)
            if r.returncode != 0:
                print(f'{m} failed:\n{r.stderr[-2000:]}', flush=True)
                error = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else 'failed'
                results[m] = dict(error=error)
                continue
            with open(out + '.json') as f:
                runs[m].append(json.load(f))
            outs[m] = torch.load(out)
    # the fastest round: the one the machine's other load disturbed least
    for m, rs in runs.items():
        if rs:
            best = min(rs, key=lambda r: r[0]['s'])
            results[m] = dict(s=best[0]['s'], peak_mib=best[0]['peak_mib'],
                              s_accumulating=best[1]['s'],
                              peak_mib_accumulating=best[1]['peak_mib'],
                              grad_norm=round(outs[m]['grad_norm'], 4),
                              s_all_rounds=[r[0]['s'] for r in rs])
    ref = outs.get('naive')
    for m, o in outs.items():  # max |difference| / max |naive| per output
        if ref is not None and m != 'naive':
            keys = ('logp', 'entropy', 'd_hidden', 'd_weight_rows')
            results[m]['max_rel_diff_vs_naive'] = {
                k: float((o[k] - ref[k]).abs().max() / ref[k].abs().max()) for k in keys}
    if GPU and 'ours' in results and 's' in results['ours']:
        # per fwd+bwd: four GEMMs of N x V x D (forward, recompute, two gradients); the bytes our
        # tiles move at least: the logits tile written and read in forward, written, read, rewritten
        # and read twice in backward, plus the fp32 weight read and its gradient read and written
        # once per token tile
        tflops, gbps = gpu_peaks()
        if args.tiles:
            tt = int(args.tiles.split('x')[0])
        else:
            tt = __import__('logprob_kernels').HEAD_TILES['cuda'][0]
        flop = 4 * 2 * N * args.vocab * args.hidden
        nbytes = (7 * N * args.vocab * DTYPE.itemsize
                  + math.ceil(N / tt) * 4 * 4 * args.vocab * args.hidden)
        for m in ('s', 's_accumulating'):
            sec = results['ours'][m]
            key = '' if m == 's' else '_accumulating'
            results['ours'][f'tflops{key}'] = round(flop / sec / 1e12, 1)
            matmul_frac = round(flop / sec / 1e12 / tflops, 3) if tflops else None
            results['ours'][f'matmul_frac{key}'] = matmul_frac
            hbm_frac = round(nbytes / sec / 1e9 / gbps, 3) if gbps else None
            results['ours'][f'hbm_frac{key}'] = hbm_frac
    print(f'\n{"method":8s} {"peak MiB":>9s} {"time s":>8s} {"peak MiB (acc.)":>16s} '
          f'{"time s (acc.)":>14s} {"grad norm":>10s}  '
          'max rel. diff vs naive (logp, entropy, dhidden, dweight)')
    for m, r in results.items():
        if 'error' in r:
            print(f'{m:8s} {r["error"]}')
            continue
        d = r.get('max_rel_diff_vs_naive')
        print(f'{m:8s} {r["peak_mib"]:9.1f} {r["s"]:8.2f} {r["peak_mib_accumulating"]:16.1f} '
              f'{r["s_accumulating"]:14.2f} {r["grad_norm"]:10.4f}  '
              + (' '.join(f'{v:.1e}' for v in d.values()) if d else ''))
    summary = {}
    if 's' in results.get('ours', {}) and 's' in results.get('trl', {}):
        o, t = results['ours'], results['trl']
        peak_acc = round(o['peak_mib_accumulating'] / t['peak_mib_accumulating'], 3)
        summary = dict(peak_vs_trl=round(o['peak_mib'] / t['peak_mib'], 3),
                       time_vs_trl=round(o['s'] / t['s'], 3),
                       peak_vs_trl_accumulating=peak_acc,
                       time_vs_trl_accumulating=round(o['s_accumulating'] / t['s_accumulating'], 3))
        print(f'ours / trl: peak {summary["peak_vs_trl"]}x, time {summary["time_vs_trl"]}x '
              f'(accumulating: {summary["peak_vs_trl_accumulating"]}x, '
              f'{summary["time_vs_trl_accumulating"]}x)')
    device = torch.cuda.get_device_name(0) if GPU else f'cpu ({args.threads} threads)'
    peak_means = ('torch.cuda.max_memory_allocated above the inputs' if GPU else
                  'process RSS high-water mark above the inputs')
    print(json.dumps(dict(device=device, load_avg=round(load, 2),
                          load_avg_after=round(os.getloadavg()[0], 2), tokens=N, vocab=args.vocab,
                          hidden=args.hidden, dtype=str(DTYPE)[6:], temperature=args.temperature,
                          tiles=args.tiles or 'default', peak_means=peak_means,
                          **results, **summary)))


if __name__ == '__main__':
    if args.worker:
        worker(args.worker)
    else:
        main()
