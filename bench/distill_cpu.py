"""
On-policy distillation on the CPU: how fast a student's reverse KL to its teacher falls. The teacher is
a random 1-layer byte model (the tests' tiny shape, seed 7) whose tied embeddings are scaled, so its
logits are `--sharpen` times the init's (a peaked, context-dependent target); the student starts from
another random init (the run's seed) and trains on the teacher's signal alone (`advantage='none'`).
Prints the mean of `teacher/reverse_kl` over each window of steps.

  python bench/distill_cpu.py                         # 160 steps at lr 1e-2, windows of 20
  python bench/distill_cpu.py --steps=60 --lr=3e-3

The last line printed is JSON.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from hf import load_model, save_pretrained  # noqa: E402

SHAPE = dict(n_layer=1, n_head=2, n_kv_head=1, n_embd=32, max_seq_len=160)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--steps', type=int, default=160)
    ap.add_argument('--lr', type=float, default=1e-2)
    ap.add_argument('--window', type=int, default=20)
    ap.add_argument('--sharpen', type=float, default=8.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        teacher, tok = load_model('scratch', torch.float32, 'cpu', 7, **SHAPE)
        with torch.no_grad():
            teacher.wte.weight.mul_(args.sharpen)
        save_pretrained(teacher, tok, os.path.join(tmp, 'teacher'))
        out = os.path.join(tmp, 'run')
        cmd = [sys.executable, os.path.join(ROOT, 'train_grpo.py'), '--init_from=scratch', '--task=arith',
               '--system_prompt=', '--instruction=', *(f'--{k}={v}' for k, v in SHAPE.items()),
               '--group_size=4', '--batch_prompts=8', '--micro_batch_size=32', '--max_new_tokens=16',
               '--eval_every=0', '--device=cpu', '--dtype=float32', '--plot_every=0', '--export_hf=False',
               '--watchdog_s=0', '--save_every=0', '--warmup_steps=1', '--lr_schedule=constant',
               f'--lr={args.lr}', f'--max_steps={args.steps}', f'--out_dir={out}',
               f"--teacher={os.path.join(tmp, 'teacher')}", '--advantage=none']
        t = time.time()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
        seconds = time.time() - t
        rows = [json.loads(line) for line in open(os.path.join(out, 'metrics.jsonl'))]
    kl = [r['teacher/reverse_kl'] for r in rows if 'teacher/reverse_kl' in r]
    windows = {f'{i + 1}-{min(i + args.window, len(kl))}': round(sum(kl[i:i + args.window])
                                                                  / len(kl[i:i + args.window]), 4)
               for i in range(0, len(kl), args.window)}
    for span, v in windows.items():
        print(f"steps {span:>9}: teacher/reverse_kl {v:.4f}")
    print(json.dumps({'steps': len(kl), 'lr': args.lr, 'sharpen': args.sharpen, 'seconds': round(seconds, 1),
                      'reverse_kl_by_window': windows}))


if __name__ == '__main__':
    main()
