"""
Operator calls per decode step at Qwen2.5-0.5B's shape (the real config, random weights, fp32 on
the CPU), counted with a TorchDispatchMode: every aten operator the dispatcher runs, views
included, as the GPU would see them one launch (or one host-side dispatch) each. Eager decoding of a
small model is bound by this count on a GPU: the H200 took 72 ms a decode step of 256 rows
(docs/performance.md, GPU figures) where its memory traffic needs well under 1 ms.

Counted, per call and per layer, and how many of them are views (a view launches no kernel
but costs a dispatch on the host all the same; on CUDA each of the others is about one launch,
except that F.rms_norm, six operators on the CPU, is one fused kernel there):
  decode_forward  GPT.forward of one new token per row with a KV cache (what each decode step runs)
  decode_step     one step of sample.generate's loop: the sampler (its torch path: on CUDA the
                  Triton kernel is a few launches instead), the forward and the loop's own ops
  prefill         GPT.forward of the prompts into an empty cache
  update_forward / update_backward
                  the training forward of packed rows (segment ids, as the update runs them) and
                  its backward, from hidden states through a sum

On a GPU (--device=cuda, bf16 by default there) it also counts what one decode forward launches
on the device, through torch.profiler: kernels and copies, the number a CUDA graph replays with one
launch. bench/bench_sample.py reports the same for the model it times (decode_forward_counts).

Usage: python bench/bench_decode_ops.py [--rows=4] [--prompt=20] [--layers=0 (the config's)]
                                        [--device=cpu] [--dtype=float32 (bfloat16 on cuda)]
The last line printed is JSON.
"""
import argparse
import collections
import json
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sample  # noqa: E402
from model import GPT, KVCache, qwen25_05b_config  # noqa: E402


class Count(TorchDispatchMode):
    """Counts aten operators by name; views (metadata only: no kernel, a host-side dispatch each)
    also under the key VIEWS."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        if func.is_view or func.overloadpacket.__name__ == '_unsafe_view':
            self.ops[VIEWS] += 1
        return func(*args, **(kwargs or {}))


VIEWS = ' views'


def counted(fn):
    with Count() as c:
        fn()
    return c.ops


def device_launches(fn):
    """What fn launches on the GPU (torch.profiler's device events: kernels, copies, fills)."""
    from torch.profiler import ProfilerActivity, profile
    fn()  # once outside the profiler: lazy initialisations are not counted
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def decode_forward_counts(model, rows, prompt):
    """One eager decode forward of model (one new token a row, rows rows, a KV cache holding a
    random prompt of that many tokens): aten operators, how many of them views, and on CUDA the
    device launches. -> dict."""
    cfg = model.config
    device, dtype = model.wte.weight.device, model.wte.weight.dtype
    ids = torch.randint(0, cfg.vocab_size, (rows, prompt), device=device)
    new = torch.randint(0, cfg.vocab_size, (rows, 1), device=device)
    with torch.no_grad():
        def decode():
            cache = KVCache(cfg, rows, prompt + 8, dtype, device)
            model(ids, kv_cache=cache, input_lengths=torch.full((rows,), prompt, device=device),
                  last_only=True)
            return cache
        cache = decode()
        ops = counted(lambda: model(new, kv_cache=cache))
        views = ops.pop(VIEWS, 0)
        n = sum(ops.values())
        out = {'ops': n, 'views': views, 'per_layer': round(n / cfg.n_layer, 1)}
        if device.type == 'cuda':
            out['device_launches'] = device_launches(lambda: model(new, kv_cache=decode()))
            # less the prefill's, counted alone
            out['device_launches'] -= device_launches(decode)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--rows', type=int, default=4)  # decode batch
    parser.add_argument('--prompt', type=int, default=20)  # prompt tokens per row
    parser.add_argument('--layers', type=int, default=0)  # 0: Qwen2.5-0.5B's 24 (fewer: quicker)
    parser.add_argument('--device', default='cpu')  # cpu or cuda
    parser.add_argument('--dtype', default='')  # '': float32 on the CPU, bfloat16 on CUDA
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype or ('bfloat16' if args.device == 'cuda' else 'float32'))
    cfg = qwen25_05b_config()
    if args.layers:
        cfg.n_layer = args.layers
    torch.manual_seed(0)
    model = GPT(cfg).to(args.device, dtype).eval()
    dev = model.wte.weight.device
    B, P, L = args.rows, args.prompt, cfg.n_layer
    ids = torch.randint(0, cfg.vocab_size, (B, P), device=dev)
    out = {}
    with torch.no_grad():
        cache = KVCache(cfg, B, P + 8, dtype, dev)
        out['prefill'] = counted(lambda: model(ids, kv_cache=cache,
                                               input_lengths=torch.full((B,), P, device=dev),
                                               last_only=True))
        new = torch.randint(0, cfg.vocab_size, (B, 1), device=dev)
        out['decode_forward'] = counted(lambda: model(new, kv_cache=cache))
        # a whole step of the loop: generate for 3 tokens minus generate for 2, the same prompts
        prompts = ids.tolist()
        tok = type('Tok', (), {'pad_id': 0, 'stop_ids': [cfg.vocab_size - 1],
                               'decode': staticmethod(lambda ids: '')})

        def gen(n):
            return counted(lambda: sample.generate(model, tok, prompts, max_new_tokens=n,
                                                   top_p=0.9))
        out['decode_step'] = gen(3) - gen(2)
    # the update: packed rows (a prompt and its completions, segment ids), forward then backward
    seg = torch.tensor([[0] * P + [1] * 8 + [2] * 8 + [-1] * 4] * 2, device=dev)
    pos = torch.tensor([list(range(P)) + list(range(P, P + 8)) * 2 + [0] * 4] * 2, device=dev)
    x = torch.randint(0, cfg.vocab_size, seg.shape, device=dev)
    model.train()
    with Count() as c:
        h = model.hidden(x, pos=pos, attn_mask=seg)
    out['update_forward'] = c.ops
    loss = h.float().pow(2).mean()
    with Count() as c:
        loss.backward()
    out['update_backward'] = c.ops
    result = {'config': 'qwen25_05b' + (f' ({L} layers)' if args.layers else ''), 'rows': B,
              'prompt': P, 'device': str(dev), 'dtype': str(dtype), 'torch': torch.__version__}
    if dev.type == 'cuda':
        result['device_name'] = torch.cuda.get_device_name()
        n = decode_forward_counts(model.eval(), B, P)['device_launches']
        result['decode_forward_device_launches'] = n
        print(f"decode forward: {n} device launches (kernels, copies, fills; torch.profiler)")
    for name, ops in out.items():
        views = ops.pop(VIEWS, 0)
        n = sum(ops.values())
        result[name] = {'ops': n, 'per_layer': round(n / L, 1), 'views': views,
                        'not_views': n - views, 'top': dict(ops.most_common(8))}
        print(f"{name:16s} {n:6d} ops  {n / L:6.1f} per layer  {views:5d} views  "
              + ', '.join(f'{k} {v}' for k, v in ops.most_common(6)))
    print(json.dumps(result))


if __name__ == '__main__':
    main()
