"""
A step's rewards when each call waits on something outside the process (an LLM judge behind an HTTP
API, a remote verifier): the same per-sample reward written as a plain function and as an
`async def`, scored by reward.score for one step's completions. The plain one waits for each call
in turn; the async one has them all in flight at once on the run's event loop (reward.awaited).
The wait is simulated (time.sleep / asyncio.sleep of --latency seconds), so the figures say what
the scoring loop adds, not what any API takes.

  python bench/bench_rewards.py                       # 256 completions, 50 ms a call
  python bench/bench_rewards.py --samples=64 --latency=0.2

The last line printed is JSON.
"""
import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from reward import score  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--samples', type=int, default=256)  # config/gsm8k.py's completions a step
    ap.add_argument('--latency', type=float, default=0.05)  # seconds each call waits
    a = ap.parse_args()

    def plain(completion, example):
        time.sleep(a.latency)
        return len(completion) % 2

    async def awaiting(completion, example):
        await asyncio.sleep(a.latency)
        return len(completion) % 2

    texts = [str(i) * (i % 7 + 1) for i in range(a.samples)]
    out = {'samples': a.samples, 'latency_s': a.latency}
    totals = {}
    for name, fn in (('plain', plain), ('async', awaiting)):
        t = time.perf_counter()
        totals[name] = score(texts, [{}] * a.samples, [(fn, 1.0)])['total']
        out[f'{name}_s'] = round(time.perf_counter() - t, 3)
        print(f"{name:>5}: {out[f'{name}_s']:.3f} s for {a.samples} calls of {a.latency * 1000:g} ms")
    assert totals['plain'] == totals['async'], "the two rewards disagree"
    out['speedup'] = round(out['plain_s'] / out['async_s'], 1)
    print(json.dumps(out))


if __name__ == '__main__':
    main()
