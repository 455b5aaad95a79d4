"""
Generated tokens/s of our sample.generate next to transformers' model.generate, on the same weights,
prompts, batch and number of new tokens, measured side by side in one run.

Both decode greedily for exactly --new_tokens steps, so they do the same work: ours with temperature
0 and no stop ids; transformers with do_sample=False, min_new_tokens = max_new_tokens and no eos
token (so nothing stops early and no logits processor touches the logits). The weights are a random
Qwen2 built by transformers, every parameter (biases and norm gains too) perturbed from a fixed seed
so that a wrongly loaded tensor shows up as a token mismatch; it is saved with the byte tokenizer
and loaded into ours with hf.from_pretrained. Prompts are random bytes of different lengths: ours
takes them as they are (per-row lengths), transformers left-padded with an attention mask. The
greedy tokens of the two are compared to show that the work is the same.

  CPU: tiny Qwen2 (hidden 128, 4 layers, 4/2 heads, vocab 260) in fp32, batch 32 x 64 new tokens,
       2 threads.
  GPU: Qwen2.5-0.5B's exact shape, random init, bf16, batch 64 x 256 new tokens, and the fraction
       of the HBM roofline: every forward reads all weights and the KV cache held at that step;
       bytes over time over peak.

Ours runs eager, with compile=True (prefill and decode steps through torch.compile; its first call,
the warm-up, compiles and is reported as compile_s) and with graphs=True (fixed-shape decode steps,
CUDA graphs on a GPU; on by default there). Timed runs alternate ours / transformers / ours compiled
/ ours graphs, in that order of priority, so a change in machine load hits all of them; each is
warmed up just before its first timed call, and a JSON line of the tokens/s so far follows each
timed call, so a run cut short by a time limit keeps what it had. On CPU the process CPU time is
reported next to wall time: on a shared machine it is the steadier of the two.

Usage: python bench/bench_sample.py [--batch=B] [--new_tokens=N] [--prompt_len=L] [--reps=R]
                                   [--threads=T]
                                   [--gen_kwargs='{"compact": false}']   (passed on to
                                                                          sample.generate)
                                   [--compile=0]   (leave out the compiled run)
The last line printed is JSON.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import hf as H
import model as M  # noqa: E402
from sample import generate  # noqa: E402
from tokenizer import byte_tokenizer  # noqa: E402

GPU = torch.cuda.is_available()
parser = argparse.ArgumentParser()
# 'tiny' or 'qwen25_05b' (exact shape)
parser.add_argument('--shape', default='qwen25_05b' if GPU else 'tiny')
# weights and activations, both sides
parser.add_argument('--dtype', default='bfloat16' if GPU else 'float32')
parser.add_argument('--batch', type=int, default=64 if GPU else 32)  # prompts decoded together
# samples per prompt (GRPO's G): ours prefills each prompt once and shares its cache; transformers
# gets every prompt repeated G times, as TRL feeds it
parser.add_argument('--group_size', type=int, default=1)
# mean prompt length; each is within +-20% of it
parser.add_argument('--prompt_len', type=int, default=40)
# generated per prompt, no early stop
parser.add_argument('--new_tokens', type=int, default=256 if GPU else 64)
# timed runs of each after one warm-up; median
parser.add_argument('--reps', type=int, default=3 if GPU else 5)
# new tokens of eager ours' and transformers' warm-up calls
parser.add_argument('--warmup_tokens', type=int, default=16)
# a row matches when its first this-many tokens agree
parser.add_argument('--match_tokens', type=int, default=8)
# noise added to every HF-initialised parameter
parser.add_argument('--init_std', type=float, default=0.05)
parser.add_argument('--threads', type=int, default=2)  # CPU threads (torch.set_num_threads)
parser.add_argument('--seed', type=int, default=0)  # weights and prompts
# HBM bytes/s; 0 = look the GPU's name up in PEAK_BW
parser.add_argument('--peak_bw', type=float, default=0.0)
# extra sample.generate kwargs, a JSON object
parser.add_argument('--gen_kwargs', type=json.loads, default={})
parser.add_argument('--compile', type=int, default=1)  # also time ours with compile=True
# also time ours with graphs=True (fixed-shape decode steps: CUDA graphs on a GPU)
parser.add_argument('--graphs', type=int, default=int(GPU))
args = parser.parse_args()
device = 'cuda' if GPU else 'cpu'
dtype = getattr(torch, args.dtype)
if not GPU:
    torch.set_num_threads(args.threads)

# peak HBM bandwidth in bytes/s by a substring of torch.cuda.get_device_name(); the first match wins
PEAK_BW = [('H200', 4.8e12), ('H100 PCIe', 2.0e12), ('H100', 3.35e12), ('A100', 2.0e12)]


def hf_config():
    import transformers
    if args.shape == 'qwen25_05b':
        c = M.qwen25_05b_config()
    elif args.shape == 'tiny':
        c = M.ModelConfig(arch='qwen2', vocab_size=260, n_layer=4, n_head=4, n_kv_head=2,
                          n_embd=128, intermediate_size=384, max_seq_len=1024,
                          tie_word_embeddings=True)
    else:
        raise ValueError(f"unknown --shape {args.shape!r}: expected 'tiny' or 'qwen25_05b'")
    # no bos/eos: transformers must neither stop early nor mask eos for min_new_tokens (ours gets
    # stop_ids=[])
    return transformers.Qwen2Config(
        vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head,
        max_position_embeddings=c.max_seq_len, rope_theta=c.rope_theta, rms_norm_eps=c.norm_eps,
        tie_word_embeddings=c.tie_word_embeddings, bos_token_id=None, eos_token_id=None)


def build(path):
    """(transformers model, our model, tokenizer) with the same random weights, passed through a
    snapshot."""
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    # built and perturbed on the CPU: same weights on any device
    hf = transformers.Qwen2ForCausalLM(hf_config())
    g = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        # HF zeroes biases and sets norms to 1: make every tensor random
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g) * args.init_std)
    hf = hf.to(device=device, dtype=dtype).eval()
    tok = byte_tokenizer()
    hf.generation_config.eos_token_id = hf.generation_config.bos_token_id = None
    hf.generation_config.pad_token_id = tok.pad_id
    hf.save_pretrained(path)
    tok.save(path)
    ours, tok = H.from_pretrained(path, dtype=dtype, device=device)
    return hf, ours.eval(), tok


def make_prompts():
    g = torch.Generator().manual_seed(args.seed + 1)
    lo, hi = max(1, args.prompt_len * 4 // 5), max(1, args.prompt_len * 6 // 5)
    lens = torch.randint(lo, hi + 1, (args.batch,), generator=g).tolist()
    # byte ids: no special tokens
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]


def left_pad(prompts, pad_id):
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), T), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):], mask[i, T - len(p):] = torch.tensor(p), 1
    return ids.to(device), mask.to(device)


def sync():
    if GPU:
        torch.cuda.synchronize()


def run_timed(fns, reps, tokens):
    """fns: {name: (fn, warm_up)}. reps rounds, each running every fn once in turn, a fn's warm_up
    (first CUDA calls, compiles, captures) just before its first timed call. After each timed call a
    JSON line of the tokens/s so far (tokens a call), so a run killed part-way still ends with the
    figures it had. -> {name: dict(wall=[s], cpu=[s], extra_gb=peak GPU memory above what was
    allocated at the call, out=the last call's, warmup=s)}"""
    res = {}
    for r in range(reps):
        for name, (fn, warm_up) in fns.items():
            if r == 0:
                w = time.perf_counter()
                warm_up()
                sync()
                res[name] = dict(wall=[], cpu=[], extra_gb=0.0, warmup=time.perf_counter() - w)
                print(f"  {name}: warm-up {res[name]['warmup']:.1f} s", flush=True)
            sync()
            if GPU:
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            w, c = time.perf_counter(), time.process_time()
            res[name]['out'] = fn()
            sync()
            res[name]['wall'].append(time.perf_counter() - w)
            res[name]['cpu'].append(time.process_time() - c)
            print(f"  {name}: {res[name]['wall'][-1]:.3f} s", flush=True)
            if GPU:
                extra = (torch.cuda.max_memory_allocated() - base) / 1e9
                res[name]['extra_gb'] = max(res[name]['extra_gb'], extra)
            so_far = {f'{n}_tok_s': round(tokens / statistics.median(v['wall']), 1)
                      for n, v in res.items() if v['wall']}
            print(json.dumps({'partial': True, **so_far}), flush=True)
    return res


def decode_bytes(cfg, weight_bytes, prompts, N, elem):
    """HBM bytes a greedy decode of N tokens must read at the least: all weights once per forward
    (the tied head reads the whole embedding matrix), plus every row's KV cache as held at that
    forward (its real length; the padding up to the longest row is not counted). N forwards: the
    prefill that yields token 1, then N - 1 steps; the prefill is counted like a step that holds the
    prompt, which it writes rather than reads (a small overcount)."""
    kv_per_pos = 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * elem
    P, B = sum(len(p) for p in prompts), len(prompts)
    return N * weight_bytes + kv_per_pos * sum(P + t * B for t in range(N))


def main():
    N, G = args.new_tokens, args.group_size
    B = args.batch * G  # rows decoded together
    with tempfile.TemporaryDirectory() as path:
        hf, ours, tok = build(path)
    prompts = make_prompts()
    ids, mask = left_pad([p for p in prompts for _ in range(G)], tok.pad_id)
    if GPU:
        dev_name = torch.cuda.get_device_name()
    else:
        load = os.getloadavg()[0]
        dev_name = (f'cpu ({torch.get_num_threads()} threads, load average {load:.1f} on '
                    f'{os.cpu_count()} cores)')
    lens = f"{min(map(len, prompts))}-{max(map(len, prompts))}"
    print(f"device {dev_name}; {args.shape} Qwen2 in {args.dtype}, "
          f"{ours.num_params() / 1e6:.2f}M params; batch {args.batch} prompts x {G} samples, "
          f"prompts of {lens} tokens, {N} new tokens each", flush=True)
    if not GPU and load > os.cpu_count() - 0.5:
        print(f"warning: the machine is busy (load average {load:.1f}, {os.cpu_count()} cores): "
              f"wall times are inflated, and with more than one thread each op can wait a "
              f"scheduler slice for its second thread (try --threads=1; the CPU-time ratio is the "
              f"steadier number)")

    def run_ours(n=N, **kw):
        return generate(ours, tok, prompts, group_size=G, max_new_tokens=n, temperature=0.0,
                        stop_ids=[], **{**args.gen_kwargs, **kw})

    def run_ours_compiled():
        return run_ours(compile=True)

    def run_ours_graphs():
        return run_ours(graphs=True)

    def run_hf(n=N):
        with torch.no_grad():
            return hf.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                               max_new_tokens=n, min_new_tokens=n, pad_token_id=tok.pad_id,
                               eos_token_id=None)

    # (timed, warm-up): eager ours and transformers warm up on a few tokens (the first CUDA calls
    # and Triton's compiles need no more); compiled and graphs on the whole length, so that their
    # timed calls meet the shapes they compiled for (graphs: the static cache's length)
    W = min(N, args.warmup_tokens)
    fns = {'ours': (run_ours, lambda: run_ours(W)), 'hf': (run_hf, lambda: run_hf(W)),
           'ours_compiled': (run_ours_compiled, run_ours_compiled),
           'ours_graphs': (run_ours_graphs, run_ours_graphs)}
    if not args.compile:
        del fns['ours_compiled']
    if not args.graphs:
        del fns['ours_graphs']
    res = run_timed(fns, args.reps, B * N)
    ours_ids = [r['ids'] for r in res['ours']['out']]
    hf_ids = res['hf']['out'][:, ids.shape[1]:].tolist()
    assert all(len(r) == N for r in ours_ids), (
        'ours stopped early: the two did not do the same work')
    if args.compile:
        compiled_ids = [r['ids'] for r in res['ours_compiled']['out']]
        same = sum(c == a for c, a in zip(compiled_ids, ours_ids)) / B
        print(f"compiled vs eager: {same:.1%} of rows generate the very same tokens")
    assert all(len(r) == N for r in hf_ids), (
        'transformers stopped early: the two did not do the same work')
    k = min(args.match_tokens, N)
    match_frac = sum(a[:k] == b[:k] for a, b in zip(ours_ids, hf_ids)) / B
    match_all = sum(a == b for a, b in zip(ours_ids, hf_ids)) / B
    same_positions = sum(sum(x == y for x, y in zip(a, b)) for a, b in zip(ours_ids, hf_ids))
    agree = same_positions / (B * N)

    med = {n: {t: statistics.median(r[t]) for t in ('wall', 'cpu')} for n, r in res.items()}
    ours_tps, hf_tps = B * N / med['ours']['wall'], B * N / med['hf']['wall']
    labels = (('ours', 'ours'), ('ours_graphs', 'ours graphs'), ('ours_compiled', 'ours compiled'),
              ('hf', 'transformers'))
    for name, label in labels:
        if name not in res:
            continue
        walls = [round(t, 3) for t in res[name]['wall']]
        cpus = [round(t, 3) for t in res[name]['cpu']]
        print(f"{label:13s} {B * N / med[name]['wall']:9.0f} tok/s  wall {walls} s, cpu {cpus} s")
    print(f"ratio {ours_tps / hf_tps:.2f}x by wall time "
          f"({med['hf']['cpu'] / med['ours']['cpu']:.2f}x by CPU time); greedy tokens: "
          f"the first {k} agree in {match_frac:.1%} of rows, all {N} in {match_all:.1%}, "
          f"{agree:.1%} of positions")
    mc = ours.config
    config = dict(shape=args.shape, dtype=args.dtype, n_layer=mc.n_layer, n_embd=mc.n_embd,
                  n_head=mc.n_head, n_kv_head=mc.n_kv_head, vocab_size=mc.vocab_size,
                  params=ours.num_params())
    out = dict(device=dev_name, config=config, batch=args.batch, group_size=G,
               prompt_len=args.prompt_len, new_tokens=N, ours_tok_s=round(ours_tps, 1),
               hf_tok_s=round(hf_tps, 1), ratio=round(ours_tps / hf_tps, 3),
               match_frac=round(match_frac, 4), match_frac_all_tokens=round(match_all, 4),
               ours_s=round(med['ours']['wall'], 4), hf_s=round(med['hf']['wall'], 4),
               gen_kwargs=args.gen_kwargs)
    if args.compile:
        ctps = B * N / med['ours_compiled']['wall']
        cpu_ratio = med['hf']['cpu'] / med['ours_compiled']['cpu']
        print(f"ratio {ctps / hf_tps:.2f}x compiled, by wall time ({cpu_ratio:.2f}x "
              f"by CPU time); compile (the warm-up call) took "
              f"{res['ours_compiled']['warmup']:.1f} s")
        out.update(ours_compiled_tok_s=round(ctps, 1), ratio_compiled=round(ctps / hf_tps, 3),
                   ours_compiled_s=round(med['ours_compiled']['wall'], 4),
                   compile_s=round(res['ours_compiled']['warmup'], 1),
                   compiled_same_tokens=round(same, 4))
    if args.graphs:
        gtps = B * N / med['ours_graphs']['wall']
        same_g = sum(r['ids'] == a for r, a in zip(res['ours_graphs']['out'], ours_ids)) / B
        # compiled graphs that torch ran without a CUDA graph (it says why in a warning above)
        skips = counters['inductor']['cudagraph_skips']
        print(f"graphs: {gtps:.0f} tok/s, {gtps / ours_tps:.2f}x eager; {same_g:.1%} of rows the "
              f"very same tokens as eager; the first call (compiles, captures) took "
              f"{res['ours_graphs']['warmup']:.1f} s" + (f"; CUDA graphs skipped: {skips}" if GPU
                                                          else ''))
        out.update(ours_graphs_tok_s=round(gtps, 1), graphs_vs_eager=round(gtps / ours_tps, 3),
                   graphs_first_call_s=round(res['ours_graphs']['warmup'], 1),
                   graphs_same_tokens=round(same_g, 4), graphs_cudagraph_skips=skips)
    if GPU:
        cfg = ours.config
        weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
        timed = [n for n in ('ours', 'ours_graphs', 'ours_compiled') if n in med]
        best = min(timed, key=lambda n: med[n]['wall'])
        rows = [p for p in prompts for _ in range(G)]
        achieved = decode_bytes(cfg, weight_bytes, rows, N, dtype.itemsize) / med[best]['wall']
        peak_bw = args.peak_bw or next((bw for name, bw in PEAK_BW if name in dev_name), None)
        roofline = None if peak_bw is None else achieved / peak_bw
        # each side's own weights plus the most its generate call held above what was allocated
        # before it (both models sit on the GPU together, so the raw high-water mark would count the
        # other's weights too)
        hf_weights = sum(p.numel() * p.element_size() for p in hf.parameters()) / 1e9
        peak_ours = weight_bytes / 1e9 + res['ours']['extra_gb']
        peak_hf = hf_weights + res['hf']['extra_gb']
        frac = '?' if roofline is None else f'{roofline:.1%}'
        print(f"{best} reads {achieved / 1e9:.0f} GB/s = {frac} of peak HBM bandwidth; "
              f"peak memory ours {peak_ours:.2f} GB, transformers {peak_hf:.2f} GB")
        out.update(roofline_of=best,
                   roofline_frac=None if roofline is None else round(roofline, 4),
                   achieved_gb_s=round(achieved / 1e9, 1), peak_bw_gb_s=peak_bw and peak_bw / 1e9,
                   peak_mem_gb=round(peak_ours, 3), hf_peak_mem_gb=round(peak_hf, 3))
        # what one eager decode forward of ours dispatches at this batch, and launches on the GPU:
        # counted after the timing (bench_decode_ops.py); a failure here loses no figure above
        try:
            from bench_decode_ops import decode_forward_counts
            c = decode_forward_counts(ours, B, args.prompt_len)
            print(f"one eager decode forward of {B} rows: {c['ops']} aten operators "
                  f"({c['views']} views), {c['device_launches']} device launches")
            out.update(decode_forward_ops=c['ops'], decode_forward_views=c['views'],
                       decode_forward_launches=c['device_launches'])
        except Exception as e:  # reported in the JSON instead
            out['decode_forward_counts_error'] = repr(e)[:500]
    else:
        out.update(ratio_cpu_time=round(med['hf']['cpu'] / med['ours']['cpu'], 3),
                   threads=torch.get_num_threads(), load_avg=round(load, 2))
    print(json.dumps(out))


if __name__ == '__main__':
    main()
