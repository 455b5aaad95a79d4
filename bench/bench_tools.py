"""
Rollouts that call tools: ours (sample.generate_with_tools: a row pauses when it closes a call, and
the tool's answer is prefilled into that row's own KV cache as one chunk) against re-prefilling the
whole conversation for every turn, as TRL's transformers path does (a fresh batched generate per
turn from the prompt and every id so far, sampled and inserted). Same model, same rows, same ids.

The model is a random Qwen2-shaped GPT whose logits get a large bias (+60) on the token a fixed
script wants at each absolute position: every row writes the same completion, some text, a
```calculator call, the answer inserted, more text, ... three calls, then '#### N' and the stop
token. All prompts have the same length, so the script sits at the same positions in every row.
Both sides sample at temperature 1.0 from the same row seeds, but only the first turn draws the
same random numbers: ours draws a row's k-th sampled token with step k of its seed, while each of
the reference's generate calls starts again at step 0 with seeds of its own. The bias is what makes
the two agree token for token (the sampler's Gumbel noise is far below 60); the ids of every row
are compared, and any difference fails the run.

The reference stops a row with stop_strings=['```\\n'] (the script's next token after a closing
fence is the '\\n' that starts the answer), cuts the turn back to the token that closed the call
(tool_calls.call_closed), runs the call and appends the answer's ids, as ours inserts them; its
first turn prefills each prompt once for its G samples, as ours does, so the two differ only in
what later turns prefill again. The budget rules are ours: max_new_tokens counts sampled and
inserted ids, a call closed on the budget's last token never runs, an answer that does not fit
ends the row.

Prefill tokens: the ids that go through a forward as part of a prompt or chunk rather than as one
decode step. Ours: each prompt once, plus per call the closing token and the answer (one chunk).
The reference: each prompt once in the first turn, then every row's whole conversation so far at
every later turn.

Usage: python bench/bench_tools.py [--n_layer=4] [--n_embd=128] [--prompts=8] [--group_size=8]
                                   [--max_new_tokens=256] [--prompt_len=350] [--reps=3]
                                   [--threads=0 (as the machine gives)]
The last line printed is JSON.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sandbox  # noqa: E402
import tool_calls  # noqa: E402
from model import ModelConfig, from_scratch  # noqa: E402
from sample import generate, generate_with_tools  # noqa: E402
from tokenizer import byte_tokenizer  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument('--n_layer', type=int, default=4)
parser.add_argument('--n_embd', type=int, default=128)  # heads of 32 wide, half as many kv heads
parser.add_argument('--prompts', type=int, default=8)
parser.add_argument('--group_size', type=int, default=8)  # samples per prompt (GRPO's G)
# the budget per completion (sampled + inserted ids); the script's text is sized to fill ~90% of it
parser.add_argument('--max_new_tokens', type=int, default=256)
# tokens per prompt, all alike: config/gsm8k_tools.py's prompts (Qwen2.5's system turn with the
# python tool's schema, a GSM8K question, the instruction) are 1,363 characters, about 350 tokens
parser.add_argument('--prompt_len', type=int, default=350)
parser.add_argument('--reps', type=int, default=3)  # timed runs of each after one warm-up; median
parser.add_argument('--threads', type=int, default=0)  # torch.set_num_threads; 0: leave as it is
parser.add_argument('--seed', type=int, default=0)
parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
args = parser.parse_args()
if args.threads:
    torch.set_num_threads(args.threads)

TOK = byte_tokenizer()
TOOLS = {'calculator': sandbox.calculator}
FENCE_END = '```\n'  # the reference's stop string: a closing fence and the newline after it
STRENGTH = 60.0
MAX_TOOL_CALLS = 4
FILLER = "we read the numbers again, and write each step down before the next one; "
# (text before the call, the call's expression); then the final text
CALLS = [("First\n", '12*7'), ("then\n", '84+1'), ("check\n", '85-0')]
FINAL = "#### 85"


class Scripted(torch.nn.Module):
    """A random GPT whose next-token logits get `strength` on the token the script wants at each
    absolute position (-1 in the table: no bias), with or without a KV cache alike."""

    def __init__(self, cfg, table, strength, seed=0):
        super().__init__()
        self.inner = from_scratch(cfg, seed=seed).eval()
        self.config = cfg
        self.register_buffer('table', table)
        self.strength = strength

    def forward(self, idx, kv_cache=None, input_lengths=None, *, last_only=False):
        B, T = idx.shape
        # the absolute position of idx[:, 0], read before the inner forward advances the cache
        start = torch.zeros(B, dtype=torch.long, device=idx.device)
        if kv_cache is not None:
            start = kv_cache.lengths.clone()
        logits = self.inner(idx, kv_cache, input_lengths, last_only=last_only).float()
        if last_only:
            last = (torch.full((B,), T - 1, device=idx.device) if input_lengths is None
                    else input_lengths.to(idx.device) - 1)
            pos = (start + last)[:, None]
        else:
            pos = start[:, None] + torch.arange(T, device=idx.device)
        want = self.table[pos.clamp(min=0, max=len(self.table) - 1)]
        bias = torch.nn.functional.one_hot(want.clamp(min=0), logits.shape[-1]) * self.strength
        return logits + bias * (want >= 0)[..., None]


def answer_ids(results, after):
    """The ids inserted after a call, as generate_with_tools builds them: the ```output blocks,
    starting a line of their own."""
    text = tool_calls.response_text(results, 'fenced')
    if not TOK.decode(after[-1:]).endswith('\n'):
        text = '\n' + text
    return TOK.encode(text)


def run_calls(turn_ids):
    calls = tool_calls.parse_calls(TOK.decode(turn_ids), 'fenced', names=TOOLS)
    return [tool_calls.run_call(c, TOOLS, 5.0) for c in calls]


def script_ids(budget):
    """The completion the scripted model writes: text, a call, its answer (inserted), ... then the
    final text and the stop token; the text pieces padded so that it all fills ~90% of budget."""
    def call_and_answer(expression):
        call = TOK.encode(f"```calculator\n{expression}\n```")
        return call + answer_ids(run_calls(call), call)

    fixed = sum(len(TOK.encode(text)) + len(call_and_answer(e)) for text, e in CALLS)
    fixed += len(TOK.encode(FINAL)) + 1
    pad = max(0, (budget * 9 // 10 - fixed) // (len(CALLS) + 1))
    filler = (FILLER * (pad // len(FILLER) + 1))[:pad]
    ids = []
    for text, expression in CALLS:
        ids += TOK.encode(filler + text) + call_and_answer(expression)
    ids += TOK.encode(filler + FINAL) + [TOK.eos_id]
    if len(ids) > budget:
        raise SystemExit(f"the script needs {len(ids)} tokens: raise --max_new_tokens")
    return ids


def make_prompts(n, length, seed):
    g = torch.Generator().manual_seed(seed)
    letters = 'abcdefghijklmnopqrstuvwxyz0123456789 '
    return [TOK.encode('Q: ' + ''.join(letters[i] for i in
                                       torch.randint(len(letters), (length - 3,), generator=g)))
            for _ in range(n)]


def closed_at(turn_ids):
    """The length of the shortest prefix of turn_ids that ends with a closed call, or None."""
    for k, token in enumerate(turn_ids):
        if '`' in TOK.decode([token]) and tool_calls.call_closed(
                TOK.decode(turn_ids[:k + 1]), 'fenced', names=TOOLS):
            return k + 1
    return None


@torch.no_grad()
def reprefill_rollout(model, prompts, group_size, max_new_tokens, *, seed):
    """Turn by turn: a fresh generate from each live row's whole conversation, each row cut at the
    call it closes; the calls run and their answers are appended. -> (ids per row, prefill tokens,
    turns)"""
    G = group_size
    N = len(prompts) * G
    ids = [[] for _ in range(N)]
    turn_start, n_calls, live = [0] * N, [0] * N, list(range(N))
    prefill, turns = 0, 0
    stop_set = set(TOK.stop_ids)
    while live:
        budget = max(max_new_tokens - len(ids[r]) for r in live)
        common = dict(temperature=1.0, seed=seed, stop_strings=[FENCE_END])
        if turns == 0:  # every prompt once for its G samples, as ours
            outs = generate(model, TOK, prompts, G, budget, **common)
            prefill += sum(map(len, prompts))
        else:
            convs = [prompts[r // G] + ids[r] for r in live]
            outs = generate(model, TOK, convs, 1, budget, prompt_index=live, **common)
            prefill += sum(map(len, convs))
        turns += 1
        still = []
        for r, out in zip(live, outs):
            new = out['ids'][:max_new_tokens - len(ids[r])]
            cut = closed_at(ids[r][turn_start[r]:] + new)
            if cut is not None:
                new = new[:cut - (len(ids[r]) - turn_start[r])]
            ids[r] += new
            if cut is not None and len(ids[r]) < max_new_tokens:
                results = run_calls(ids[r][turn_start[r]:])
                n_calls[r] += len(results)
                inserted = answer_ids(results, ids[r])
                if n_calls[r] > MAX_TOOL_CALLS or len(ids[r]) + len(inserted) > max_new_tokens:
                    continue  # over the call limit, or no room for the answer: the row ends
                ids[r] += inserted
                turn_start[r] = len(ids[r])
                still.append(r)
            elif new and new[-1] not in stop_set and len(ids[r]) < max_new_tokens:
                still.append(r)  # stopped on a fence that closed no call: the turn goes on
        live = still
    return ids, prefill, turns


def sync():
    if args.device.startswith('cuda'):
        torch.cuda.synchronize()


def machine():
    name = platform.processor() or platform.machine()
    if os.path.exists('/proc/cpuinfo'):
        with open('/proc/cpuinfo') as f:
            name = next((line.split(':', 1)[1].strip() for line in f
                         if line.startswith('model name')), name)
    text = (f"{name}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, "
            f"load average {os.getloadavg()[0]:.2f}")
    if args.device.startswith('cuda'):
        text = f"{torch.cuda.get_device_name()}; {text}"
    return text


def main():
    P, G, budget = args.prompts, args.group_size, args.max_new_tokens
    want = script_ids(budget)
    prompts = make_prompts(P, args.prompt_len, args.seed)
    L = args.prompt_len
    n_head = max(1, args.n_embd // 32)
    cfg = ModelConfig(arch='qwen2', vocab_size=TOK.vocab_size, n_layer=args.n_layer,
                      n_head=n_head, n_kv_head=max(1, n_head // 2), n_embd=args.n_embd,
                      intermediate_size=3 * args.n_embd, max_seq_len=L + budget + 8,
                      tie_word_embeddings=True)
    table = torch.full((cfg.max_seq_len + 1,), -1, dtype=torch.long)
    table[L - 1:L - 1 + len(want)] = torch.tensor(want)  # logits at L-1 predict the first id
    model = Scripted(cfg, table, STRENGTH, seed=args.seed).to(args.device)
    n_params = sum(p.numel() for p in model.inner.parameters())

    def ours():
        out = generate_with_tools(model, TOK, prompts, G, budget, tools=TOOLS, temperature=1.0,
                                  seed=args.seed, max_tool_calls=MAX_TOOL_CALLS)
        return [c['ids'] for c in out], out

    def reprefill():
        return reprefill_rollout(model, prompts, G, budget, seed=args.seed)

    print(f"device {args.device}, {torch.get_num_threads()} threads, load average "
          f"{os.getloadavg()[0]:.2f}; Qwen2-shaped {args.n_layer} layers x {args.n_embd}, "
          f"{n_params / 1e6:.2f}M params; {P} prompts x {G} samples, prompts of {L} tokens, "
          f"a scripted completion of {len(want)} tokens with {len(CALLS)} calls")
    fns = {'ours': ours, 'reprefill': reprefill}
    res = {name: dict(wall=[], cpu=[]) for name in fns}
    for name, fn in fns.items():  # warm-up, and the ids compared
        res[name]['out'] = fn()
    for _ in range(args.reps):  # alternate, so a change in machine load hits both
        for name, fn in fns.items():
            sync()
            w, c = time.perf_counter(), time.process_time()
            fn()
            sync()
            res[name]['wall'].append(time.perf_counter() - w)
            res[name]['cpu'].append(time.process_time() - c)

    ours_ids, ours_out = res['ours']['out']
    ref_ids, prefill_ref, turns = res['reprefill']['out']
    mismatches = sum(a != b for a, b in zip(ours_ids, ref_ids))
    on_script = sum(a == want for a in ours_ids)
    calls = [len(c['tool_calls']) for c in ours_out]
    prefill_ours = sum(map(len, prompts)) + sum(
        len(c['tool_calls']) + sum(c['tool_mask']) for c in ours_out)
    med = {n: {k: statistics.median(r[k]) for k in ('wall', 'cpu')} for n, r in res.items()}
    for name in fns:
        print(f"{name:9s} wall {[round(t, 3) for t in res[name]['wall']]} s, "
              f"cpu {[round(t, 3) for t in res[name]['cpu']]} s")
    speedup = med['reprefill']['wall'] / med['ours']['wall']
    print(f"ours {speedup:.2f}x faster by wall time "
          f"({med['reprefill']['cpu'] / med['ours']['cpu']:.2f}x by CPU time); prefill tokens "
          f"{prefill_ours} ours, {prefill_ref} re-prefilling over {turns} turns; "
          f"{len(ours_ids) - mismatches}/{len(ours_ids)} rows with the same ids, "
          f"{on_script} on the script, calls per completion {statistics.mean(calls):.2f}")
    config = dict(n_layer=args.n_layer, n_embd=args.n_embd, n_head=cfg.n_head,
                  n_kv_head=cfg.n_kv_head, params=n_params, prompts=P, group_size=G,
                  prompt_len=L, max_new_tokens=budget, completion_len=len(want),
                  tool_calls=len(CALLS), reps=args.reps, seed=args.seed, device=args.device,
                  threads=torch.get_num_threads())
    out = dict(bench='tools', ours_s=round(med['ours']['wall'], 4),
               reprefill_s=round(med['reprefill']['wall'], 4), speedup=round(speedup, 3),
               speedup_cpu_time=round(med['reprefill']['cpu'] / med['ours']['cpu'], 3),
               prefill_tokens_ours=prefill_ours, prefill_tokens_reprefill=prefill_ref,
               ids_equal=mismatches == 0, mismatches=mismatches, rows_on_script=on_script,
               calls_per_completion=statistics.mean(calls), turns=turns, config=config,
               machine=machine(), torch=torch.__version__)
    failed = []
    if mismatches:
        r = next(i for i, (a, b) in enumerate(zip(ours_ids, ref_ids)) if a != b)
        failed.append(f"{mismatches} rows differ; row {r}:\n  ours      "
                      f"{TOK.decode(ours_ids[r])!r}\n  reprefill {TOK.decode(ref_ids[r])!r}")
    if on_script != len(ours_ids):
        failed.append(f"only {on_script}/{len(ours_ids)} rows followed the script: the two sides "
                      f"did not do the work the bench means to time")
    for message in failed:
        print(f"FAILED: {message}", file=sys.stderr)
    print(json.dumps(out))
    if failed:
        sys.exit(1)


if __name__ == '__main__':
    main()
