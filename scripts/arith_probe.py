"""
What an arithmetic-demo model (config/arith.py) has learned, style by style: greedy pass@1 as
evaluated; greedy pass@1 with the prompt followed by the first line's "80-7:", which forces the
counting style; and, over 8 samples a problem at temperature 1, how many count on and how many of
those are right. GRPO on this task mostly chooses the counting style; it ends near the forced
figure, so that is how well the warm start taught counting.

    # an HF export of an arith run (its grpo_run.json gives the knobs)
    python scripts/arith_probe.py out/arith/hf
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import tasks  # noqa: E402
from hf import load_model  # noqa: E402
from sample import encode_prompts, generate, run_config  # noqa: E402


def probe(path, samples=8):
    run = run_config(path)
    if run.get('task') != 'arith':
        raise SystemExit(f"error: {path}: not an export of an arith run "
                         f"(grpo_run.json task {run.get('task')!r})")
    mod = tasks.resolve('arith')
    tasks.set_knobs(mod, {k: run.get(k, v) for k, v in tasks.knobs(mod).items()})
    test = mod.load('test', seed=run.get('seed', 0))
    model, tok = load_model(path, torch.float32, 'cpu', 0)
    # as the run evaluated
    max_new_tokens = run.get('eval_max_new_tokens') or run.get('max_new_tokens') or 80
    model.eval()
    prompts = encode_prompts(tok, mod, test)
    forced = [p + tok.encode(ex['solution'].split('=')[0] + ':') for p, ex in zip(prompts, test)]
    with torch.no_grad():
        greedy = generate(model, tok, prompts, 1, max_new_tokens, temperature=0.0)
        counted = generate(model, tok, forced, 1, max_new_tokens, temperature=0.0)
        sampled = generate(model, tok, prompts, samples, max_new_tokens, temperature=1.0, seed=0)
    n = len(test)
    counts = [':' in c['text'].split('\n')[0] for c in sampled]
    right = [bool(mod.grade(c['text'], test[i // samples])) for i, c in enumerate(sampled)]
    greedy_right = sum(mod.grade(c['text'], ex) for c, ex in zip(greedy, test))
    counted_right = sum(mod.grade(c['text'], ex) for c, ex in zip(counted, test))
    count_and_right = sum(c and r for c, r in zip(counts, right))
    return {'greedy_pass@1': greedy_right / n,
            'forced_count_pass@1': counted_right / n,
            'sampled_count_share': sum(counts) / len(sampled),
            'sampled_count_right': count_and_right / max(1, sum(counts))}


if __name__ == '__main__':
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(json.dumps(probe(sys.argv[1])))
