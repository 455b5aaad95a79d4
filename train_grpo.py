"""
GRPO fine-tuning on one GPU (or a CPU), one flat script, top to bottom:
prompts -> G completions each (sample.py, colocated) -> rewards (reward.py) -> group-relative advantages ->
old/reference log-probs -> clipped policy-gradient update in micro-batches -> grad clip -> AdamW -> LR schedule -> log.

    python train_grpo.py config/arith.py            # the offline demo: tiny model, CPU, minutes
    python train_grpo.py config/gsm8k.py            # Qwen2.5-0.5B-Instruct on GSM8K, one GPU
    python train_grpo.py config/gsm8k.py --lr=2e-6 --group_size=16
    python train_grpo.py --plot=out/gsm8k           # redraw curves.png from metrics.jsonl
"""
import contextlib
import copy
import faulthandler
import importlib
import json
import math
import os
import resource
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

# -----------------------------------------------------------------------------
# I/O
out_dir = 'out/grpo'  # metrics.jsonl, samples.jsonl, curves.png, checkpoints, hf/ go here
init_from = 'Qwen/Qwen2.5-0.5B-Instruct'  # HF snapshot dir or hub id; 'scratch' = a small random model (byte tokenizer)
resume = 'auto'  # 'auto': continue from the newest checkpoint in out_dir that loads; 'never': start fresh
plot = ''  # --plot=OUT_DIR: redraw OUT_DIR/curves.png from its metrics.jsonl and exit
# data
data = 'gsm8k'  # 'gsm8k' or 'arith' (built-in offline task)
data_dir = ''  # local dir with train.jsonl/test.jsonl (e.g. ../shared/gsm8k); '' = download openai/gsm8k
skip_bad_rows = False  # malformed data rows: False = stop with file:line, True = skip and count them
arith_difficulty = 'easy'  # arith task preset: 'starter', 'easy', 'medium', 'hard' (data.DIFFICULTY)
arith_digits = 0  # arith: max digits per number (0 = the preset's)
arith_ops = ''  # arith: operations drawn from '+-*/' ('' = the preset's)
arith_steps = 0  # arith: operations per problem (0 = the preset's)
arith_operand_digits = 0  # arith: max digits of the amounts added/removed (0 = the preset's)
arith_n_train = 5000  # arith training problems
arith_n_test = 200  # arith held-out problems (fixed split)
arith_count_on = 0.0  # arith: share of training solutions that count on, '46+7: 47(1) 48(2) ...' (data.count_on)
system_prompt = "You are a helpful assistant that solves math problems."  # system turn; '' = none
instruction = "Reason step by step, then put the final answer in \\boxed{}."  # appended to every question
# scratch model (init_from='scratch')
n_layer = 4  # transformer blocks
n_embd = 128  # width
n_head = 4  # attention heads
n_kv_head = 2  # key/value heads (GQA)
max_seq_len = 512  # positions
# supervised warm start on reference solutions, before GRPO (for scratch models; 0 = off)
sft_steps = 0  # optimizer steps of cross-entropy on (prompt, solution) pairs
sft_lr = 1e-3  # its peak learning rate (warmup 10%, cosine to 10%)
sft_batch_size = 32  # sequences per SFT step
# GRPO rollout
group_size = 8  # G: completions per prompt; advantages are relative within a group
batch_prompts = 16  # prompts per step (rows per step = batch_prompts * group_size)
micro_batch_size = 16  # rows per forward/backward pass (gradient accumulation); share_prompt: whole groups, >= 1
share_prompt = True  # update: each group's prompt once per forward, its G completions packed after it (pack_groups)
max_new_tokens = 512  # completion budget; hitting it counts as truncated
temperature = 1.0  # sampling temperature; the loss's log-probs use the same temperature
top_k = 0  # 0 = off
top_p = 1.0  # 1.0 = off (the loss uses the full softmax either way)
# GRPO objective
adv_std_scale = True  # True: (r - mean) / (std + adv_eps) as in GRPO; False: r - mean as in Dr. GRPO
adv_eps = 1e-4  # keeps the division finite for groups with tiny spread
loss_agg = 'token_mean'  # 'token_mean' (DAPO: over all the step's tokens), 'seq_mean_token_mean' (GRPO), 'seq_sum_const' (Dr. GRPO)
eps_low = 0.2  # PPO clip below: ratio >= 1 - eps_low
eps_high = 0.28  # PPO clip above (clip-higher, DAPO): ratio <= 1 + eps_high
num_iterations = 1  # mu: optimizer steps on each rollout batch (1 = on-policy, ratio is 1)
beta = 0.0  # KL penalty weight to the frozen reference (0 = no reference model is loaded)
kl_estimator = 'k3'  # 'k1' (log ratio) or 'k3' (Schulman's unbiased, non-negative)
kl_clamp = 10.0  # log ratios are clamped to +-this before the KL estimate
kl_warmup_steps = 0  # beta ramps linearly from 0 over this many steps
filter_zero_std = True  # skip groups whose rewards are all equal: zero advantage, no gradient, pure cost
mask_truncated = False  # exclude completions that hit max_new_tokens from the loss
entropy_coef = 0.0  # entropy bonus weight (0 = off)
logprob_chunk = 0  # 0: logits for the micro-batch at once; N: LM head in chunks of N tokens (memory-lean)
# rewards: built-in names from reward.REWARD_FNS or 'module:function'; every kwarg reaches the function
rewards = [{'name': 'correct', 'weight': 1.0}, {'name': 'format', 'weight': 0.1}]
failure_reward = 0.0  # reward of a sample whose reward function raised
# optimization
lr = 1e-6  # peak learning rate
min_lr_ratio = 0.1  # cosine decays to lr * min_lr_ratio
warmup_steps = 10  # linear warmup
max_steps = 200  # GRPO steps
weight_decay = 0.0  # AdamW decay on matrices
adam_betas = (0.9, 0.99)  # AdamW betas
grad_clip = 1.0  # max gradient norm (0 = off)
# evaluation and logging
eval_every = 50  # greedy pass@1 on the held-out split every N steps (0 = never; also at start and end)
eval_examples = 200  # held-out problems per evaluation (0 = all)
eval_max_new_tokens = 0  # 0 = max_new_tokens
eval_batch_size = 64  # problems per generate() call during eval
log_samples_every = 10  # write a few (prompt, completion, answer, rewards) to samples.jsonl every N steps
verbose = False  # numbered per-stage lines with elapsed time and memory
# checkpoints and guards
save_every = 50  # checkpoint every N steps (also on SIGINT/SIGTERM and at the end)
keep_last = 2  # checkpoints kept on disk
export_hf = True  # also write out_dir/hf/ (HF snapshot of the latest weights) at each checkpoint
nan_patience = 3  # non-finite loss/grad this many steps in a row -> roll back to the last checkpoint
rollback_lr_scale = 0.5  # LR multiplier applied at each rollback
max_rollbacks = 2  # more rollbacks than this -> stop with a diagnosis
kl_warn = 0.5  # warn when the per-token KL to the reference exceeds this
kl_max = 2.0  # above this: roll back or stop (on_kl_max); only measured when beta > 0
on_kl_max = 'rollback'  # 'rollback' or 'stop'
zero_reward_patience = 20  # reward mean exactly 0 (or all rewards failing) this many steps in a row -> stop
watchdog_s = 1800.0  # no progress for this long -> dump every thread's stack (0 = off)
watchdog_exit = False  # after the dump: False = keep waiting, True = exit (code 4)
plot_every = 10  # redraw curves.png every N steps (and at the end)
fault_nan_steps = []  # testing: steps whose loss is made NaN
fault_stall_step = -1  # testing: step that sleeps fault_stall_s before its update (to trip the watchdog)
fault_stall_s = 0.0  # testing: length of that stall
# system
device = 'cuda' if torch.cuda.is_available() else 'cpu'  # 'cpu', 'cuda', 'cuda:1'
dtype = 'bfloat16' if torch.cuda.is_available() else 'float32'  # compute dtype (weights stay fp32 for AdamW)
compile = False  # torch.compile the training forward
compile_decode = False  # torch.compile the sampler's prefill and decode step (sample.decode_forward): fused kernels
grad_checkpoint = False  # recompute activations in backward (long completions)
fsdp = False  # torchrun only: shard weights, grads and AdamW state across ranks (FSDP2), for models that do not fit one GPU
seed = 1337  # data order, sampling and init: the whole run is a function of it
# -----------------------------------------------------------------------------
from configurator import configure, save_config  # noqa: E402

config = configure(globals())
if plot:
    from plot import plot_metrics
    plot_metrics(os.path.join(plot, 'metrics.jsonl'), os.path.join(plot, 'curves.png'))
    sys.exit(0)

from checkpoint import (atomic_write, full_state, list_checkpoints, load_newest, load_state, rng_state,  # noqa: E402
                        save_checkpoint, set_rng_state, trim_metrics)
from data import arith_splits, batch_at, load_gsm8k  # noqa: E402
from kernels import chunked_token_logprobs, token_logprobs  # noqa: E402
from loss import group_advantages, micro_batches, pack, pack_groups, policy_loss, token_weights  # noqa: E402
from model import ModelConfig, from_pretrained, from_scratch, save_pretrained  # noqa: E402
from plot import plot_metrics  # noqa: E402
from reward import check_reward_config, extract_answer, score  # noqa: E402
from sample import encode_prompts, evaluate, generate  # noqa: E402
from tokenizer import byte_tokenizer  # noqa: E402


def finish(code=0, together=True):
    """Exit. Under torchrun: (when every rank gets here together) a barrier and the process group torn down, then
    os._exit, skipping interpreter teardown: gloo's worker threads may still be dropping finished work that holds
    tensors, need the GIL for it while Python finalizes, and abort the rank ("terminate called without an active
    exception", pytorch#179291; DDP keeps the group alive, so destroy_process_group does not join those threads)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        if together:
            dist.barrier()
            dist.destroy_process_group()
        os._exit(code)
    sys.exit(code)


def die(msg, code=1):
    print(f"error: {msg}", file=sys.stderr, flush=True)
    finish(code, together=False)


def stop(msg, code=3):
    """A guard decided the run cannot go on: say why in plain words, leave the last good checkpoint, exit non-zero."""
    if master:  # (every rank stops here: guards decide from numbers all ranks share; one says why)
        print(f"\n{'=' * 100}\nSTOPPED: {msg}\n{'=' * 100}", file=sys.stderr, flush=True)
    finish(code)


# knob checks: a typo'd choice is an error here, not a silent default deep in the loop
for key, allowed in [('loss_agg', ('token_mean', 'seq_mean_token_mean', 'seq_sum_const')), ('kl_estimator', ('k1', 'k3')),
                     ('on_kl_max', ('rollback', 'stop')), ('data', ('gsm8k', 'arith')), ('resume', ('auto', 'never'))]:
    if config[key] not in allowed:
        die(f"--{key}={config[key]!r}: expected one of {allowed}", 2)
if group_size < 2:
    die(f"--group_size={group_size}: GRPO needs at least 2 samples per prompt to compare them", 2)
reward_fns = []  # the config's rewards with 'module:function' names (a user's reward function) imported
for entry in rewards:
    if isinstance(entry, dict) and ':' in str(entry.get('name', '')):
        mod, _, fn = entry['name'].partition(':')
        try:
            entry = {**entry, 'name': getattr(importlib.import_module(mod), fn)}
        except (ImportError, AttributeError) as e:
            die(f"rewards: cannot import {mod}:{fn} ({e})", 2)
    reward_fns.append(entry)
try:
    check_reward_config(reward_fns)
except ValueError as e:
    die(str(e), 2)
# torchrun sets RANK: one process per GPU (or CPU core group), each sampling and training on its share of the prompts
ddp = int(os.environ.get('RANK', -1)) != -1
rank, world = (int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])) if ddp else (0, 1)
master = rank == 0  # the one rank that prints, logs, plots and writes checkpoints
if ddp:
    if batch_prompts % world:
        die(f"--batch_prompts={batch_prompts} must be divisible by the number of ranks ({world}): each rank samples "
            "whole groups", 2)
    if device.startswith('cuda'):
        device = f"cuda:{os.environ['LOCAL_RANK']}"
        torch.cuda.set_device(device)
    dist.init_process_group('nccl' if device.startswith('cuda') else 'gloo')
    if not master:
        sys.stdout = open(os.devnull, 'w')  # one voice: the other ranks' lines would repeat rank 0's
elif fsdp:
    die("--fsdp=True shards the model across ranks: launch with torchrun (see README)", 2)


def all_reduce(values, op='sum'):
    """A list of floats summed (or maxed) over ranks; unchanged in one process."""
    if not ddp:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, dist.ReduceOp.SUM if op == 'sum' else dist.ReduceOp.MAX)
    return t.tolist()


def barrier():
    if ddp:
        dist.barrier()


if master:
    save_config(config, out_dir)
torch.manual_seed(seed)
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
autocast = torch.autocast(device.split(':')[0], dtype=ptdtype, enabled=ptdtype != torch.float32)
no_autocast = torch.autocast(device.split(':')[0], enabled=False)  # the log-prob kernels do their own fp32 math

# ----------------------------------------------------------------------------- data
try:
    if data == 'gsm8k':
        stats = {}
        train_set = load_gsm8k('train', data_dir or None, skip_bad_rows, stats)
        test_set = load_gsm8k('test', data_dir or None, skip_bad_rows, stats)
        if stats.get('skipped'):
            print(f"data: skipped {stats['skipped']} malformed rows (skip_bad_rows=True)")
    else:
        train_set, test_set = arith_splits(arith_n_train, arith_n_test, seed=seed, difficulty=arith_difficulty,
                                           digits=arith_digits or None, ops=arith_ops or None, steps=arith_steps or None,
                                           operand_digits=arith_operand_digits or None, count_on_frac=arith_count_on)
except (ValueError, RuntimeError, FileNotFoundError) as e:
    die(str(e))
eval_set = test_set[:eval_examples] if eval_examples > 0 else test_set
print(f"data: {data}, {len(train_set)} train / {len(eval_set)} eval problems")

# ----------------------------------------------------------------------------- model
try:
    if init_from == 'scratch':
        tok = byte_tokenizer()
        mcfg = ModelConfig(arch='qwen2', vocab_size=tok.vocab_size, n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head,
                           n_embd=n_embd, intermediate_size=4 * n_embd, max_seq_len=max_seq_len, tie_word_embeddings=True)
        model = from_scratch(mcfg, dtype=torch.float32, device=device, seed=seed)
    else:
        model, tok = from_pretrained(init_from, dtype=torch.float32, device=device)
        if tok is None:
            die(f"{init_from}: the snapshot has no tokenizer files")
except (ValueError, OSError) as e:
    die(str(e))
model.grad_checkpoint = grad_checkpoint
print(f"model: {init_from}, {model.num_params() / 1e6:.1f}M parameters, compute {dtype} on {device}")
# the sampler reads a low-precision copy (weights cast once per step, not once per decode step), synced after updates
# (with FSDP always a copy: the trained model holds only this rank's shard)
gen_model = model if ptdtype == torch.float32 and not fsdp else copy.deepcopy(model).to(ptdtype).eval()
if fsdp:  # each block's weights are gathered for its forward and backward, then freed; gradients are reduce-scattered
    from torch.distributed.fsdp import fully_shard
    for block in model.h:
        fully_shard(block)
    fully_shard(model)
train_model = torch.compile(model) if compile else model  # the training forward; sampler and reference stay eager
if ddp and not fsdp:  # gradients all-reduced (averaged over ranks) in backward
    from torch.nn.parallel import DistributedDataParallel as DDP
    train_model = DDP(train_model, device_ids=[torch.device(device).index] if device.startswith('cuda') else None,
                      broadcast_buffers=False)


def sync_gen_model():
    if gen_model is not model:
        with torch.no_grad():
            for p, q in zip(gen_model.parameters(), model.parameters()):
                p.copy_(q.full_tensor() if fsdp else q)  # FSDP: gathers each weight (every rank takes part)


decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW([{'params': decay, 'weight_decay': weight_decay}, {'params': no_decay, 'weight_decay': 0.0}],
                              lr=lr, betas=adam_betas, fused=device.startswith('cuda'))


def lr_at(step, peak, total, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def gather_step(comps, sc):
    """Every rank's completions (less their per-token log-probs, needed only where they are trained on) and reward
    scores, on every rank, in prompt order: the whole step as one process sees it."""
    parts = [None] * world
    dist.all_gather_object(parts, ([{k: v for k, v in c.items() if k != 'logprobs'} for c in comps], sc))
    parts[rank] = (comps, sc)
    scs = [s for _, s in parts]
    return [c for cs, _ in parts for c in cs], {
        'total': [x for s in scs for x in s['total']],
        'per_fn': {k: [x for s in scs for x in s['per_fn'][k]] for k in sc['per_fn']},
        'errors': {k: sum(s['errors'][k] for s in scs) for k in sc['errors']},
        'error_msgs': [msg for s in scs for msg in s['error_msgs']][:5],
        'all_failed': all(s['all_failed'] for s in scs)}


def mem_stats():
    if device.startswith('cuda'):
        return {'mem/allocated_gb': torch.cuda.memory_allocated() / 2**30, 'mem/reserved_gb': torch.cuda.memory_reserved() / 2**30,
                'mem/peak_gb': torch.cuda.max_memory_allocated() / 2**30}
    rss = os.sysconf('SC_PAGE_SIZE') * int(open('/proc/self/statm').read().split()[1]) / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return {'mem/allocated_gb': rss, 'mem/reserved_gb': rss, 'mem/peak_gb': peak}


def completion_logprobs(net, rows, temp=None):
    """Per-token log p(token) and entropy of every completion token in rows (flat, row-major), at the sampling
    temperature unless told otherwise, through the fused kernel (or its chunked hidden-state form)."""
    temp = temperature if temp is None else temp
    if share_prompt and 'group' in rows[0]:
        x, pos, amask, select, targets = pack_groups(rows, tok.pad_id, device)
        kw = dict(pos=pos, attn_mask=amask, select=select)
    else:
        x, select = pack(rows, tok.pad_id, device)
        targets, x, kw = x[:, 1:][select], x[:, :-1], dict(select=select)

    def head(h, weight):  # runs inside net's forward: a DDP/FSDP wrapper sees (FSDP has gathered) the LM head weight
        if logprob_chunk > 0:
            with no_autocast:
                return chunked_token_logprobs(h, weight, targets, temp, chunk_size=logprob_chunk)
        logits = F.linear(h, weight)
        with no_autocast:
            return token_logprobs(logits, targets, temp)

    if compile:  # torch.compile the trunk only; the kernels run as they are
        head = torch.compiler.disable(head)
    with autocast:
        return net(x, head=head, **kw)


# ----------------------------------------------------------------------------- resume / fresh start
step, cursor, lr_scale, rollbacks, metrics_path = 0, 0, 1.0, 0, os.path.join(out_dir, 'metrics.jsonl')
guards = {'nan_streak': 0, 'zero_streak': 0, 'kl_hist': [], 'recent': [], 'warn_counts': {}}  # saved with checkpoints


def load_newest_everywhere():
    """The newest checkpoint that loads, on every rank; rank 0 looks first, as it also deletes half-written files."""
    found = load_newest(out_dir) if master else None
    barrier()
    return found if master else load_newest(out_dir)


ckpt_path, state = load_newest_everywhere() if resume == 'auto' else (None, None)
if resume == 'never' and list_checkpoints(out_dir):
    die(f"resume='never' but {out_dir} holds checkpoints; pick a new --out_dir (nothing is overwritten)", 2)
barrier()  # every rank has chosen before rank 0 writes anything
if state is not None:
    load_state(model, optimizer, state['model'], state['optimizer'], fsdp)
    step, cursor, lr_scale, rollbacks = state['step'], state['cursor'], state['lr_scale'], state['rollbacks']
    set_rng_state(state['rng'])
    guards = state['guards']
    if master:
        trim_metrics(metrics_path, step)
    sync_gen_model()
    print(f"resume: {ckpt_path} (step {step}, data cursor {cursor}, lr scale {lr_scale})")
elif master and os.path.exists(metrics_path):
    os.replace(metrics_path, metrics_path + f'.old.{int(time.time())}')  # never overwrite what the user had


def save(step_done):
    """Checkpoint + HF export, only from finite weights: a bad model is never written over a good one. Rank 0 writes
    (FSDP first gathers the weights onto it); the others wait, so no rank reads a checkpoint still being written.
    Every rank restores the one RNG state saved: they all seed alike and draw no rank-specific random numbers."""
    msd, osd = full_state(model, optimizer, fsdp)
    ok = all(torch.isfinite(t).all() for t in msd.values())
    if master and not ok:
        print(f"guard: weights are not finite at step {step_done}; NOT saving (the last good checkpoint stays)", flush=True)
    elif master:
        save_checkpoint(out_dir, step_done, {'model': msd, 'optimizer': osd,
                                             'step': step_done, 'cursor': cursor, 'lr_scale': lr_scale, 'rollbacks': rollbacks,
                                             'rng': rng_state(), 'config': config, 'ref_source': init_from,
                                             'guards': guards}, keep_last)
        if export_hf:
            save_pretrained(model, tok, os.path.join(out_dir, 'hf'), state_dict=msd)
    barrier()
    return ok


def log_metrics(row):
    if not master:
        return
    with open(metrics_path, 'a') as f:
        f.write(json.dumps(row) + '\n')


def run_eval(at_step):
    t = time.time()
    lo, hi = len(eval_set) * rank // world, len(eval_set) * (rank + 1) // world  # each rank its share
    s = evaluate(gen_model, tok, eval_set[lo:hi], system_prompt, instruction,
                 max_new_tokens=eval_max_new_tokens or max_new_tokens, batch_size=eval_batch_size,
                 compile=compile_decode, progress=verbose and master)
    if ddp:
        n, hits, trunc = all_reduce([s['n'], round(s['pass@1'] * s['n']), s['truncated'] * s['n']])
        s = {'n': int(n), 'pass@1': hits / max(n, 1), 'truncated': trunc / max(n, 1)}
    print(f"eval @ step {at_step}: greedy pass@1 {s['pass@1']:.3f} on {s['n']} problems ({time.time() - t:.1f}s)", flush=True)
    return {'eval/pass@1': s['pass@1'], 'eval/truncated': s['truncated'], 'timing_s/eval': time.time() - t}


# ----------------------------------------------------------------------------- supervised warm start
if state is None and sft_steps > 0:
    print(f"sft: {sft_steps} steps of cross-entropy on reference solutions, batch {sft_batch_size}")
    t0, sft_cursor = time.time(), 0
    for it in range(sft_steps):
        batch, sft_cursor = batch_at(train_set, seed + 1, sft_cursor, sft_batch_size)
        rows = [{'prompt': p, 'ids': tok.encode(ex['solution']) + [tok.eos_id]}
                for p, ex in zip(encode_prompts(tok, batch, system_prompt, instruction), batch)]
        logp, _ = completion_logprobs(train_model, rows, temp=1.0)  # plain cross-entropy, whatever GRPO samples at
        loss = -logp.mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for g in optimizer.param_groups:
            g['lr'] = lr_at(it, sft_lr, sft_steps, max(1, sft_steps // 10))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if it % 50 == 0 or it == sft_steps - 1:
            print(f"sft {it:4d} | loss {loss.item():.4f} | {time.time() - t0:.1f}s", flush=True)
    optimizer.state.clear()  # fresh Adam moments for GRPO
    sync_gen_model()
# frozen reference (beta > 0): the policy GRPO starts from (after SFT, if any), kept beside the checkpoints, since a
# resumed run cannot rebuild it from init_from when SFT made it
ref_model, ref_path = None, os.path.join(out_dir, 'ref.pt')
if beta > 0:
    ref_model = copy.deepcopy(gen_model if fsdp else model).to(ptdtype).eval().requires_grad_(False)
    if state is not None:
        ref_model.load_state_dict(torch.load(ref_path, map_location=device))
    elif master:
        atomic_write(ref_path, lambda f: torch.save(ref_model.state_dict(), f))
if state is None:
    row = {'step': 0, **(run_eval(0) if eval_every > 0 else {})}
    log_metrics(row)
    save(0)  # the first rollback target

# ----------------------------------------------------------------------------- watchdog and signals
last_progress = [time.time()]


def watchdog():
    fired = False
    while True:
        time.sleep(min(5.0, watchdog_s / 4))
        stalled = time.time() - last_progress[0]
        if stalled < watchdog_s:
            fired = False
        elif not fired:
            fired = True
            msg = f"\nwatchdog: no progress for {stalled:.0f}s (watchdog_s={watchdog_s}); stacks of every thread:\n"
            with open(os.path.join(out_dir, 'watchdog_stacks.txt'), 'a') as f:
                for stream in (sys.stderr, f):
                    stream.write(msg)
                    stream.flush()
                    faulthandler.dump_traceback(file=stream, all_threads=True)
            if watchdog_exit:
                os._exit(4)


if watchdog_s > 0:
    threading.Thread(target=watchdog, daemon=True).start()
stop_signal = []
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda s, f: stop_signal.append(s))


def injected_stall(seconds):  # named so the watchdog's stack dump points straight at it
    time.sleep(seconds)


# ----------------------------------------------------------------------------- GRPO
P, G = batch_prompts, group_size
compiling = ' and compiles the sampler (compile_decode: seconds to minutes)' if compile_decode else ''
print(f"workload per step: {P} prompts x {G} samples x <= {max_new_tokens} new tokens = <= {P * G * max_new_tokens:,} "
      f"generated tokens, then {num_iterations} update(s) in micro-batches of {micro_batch_size} rows. The first step also "
      f"warms up kernels/allocator{compiling}; a progress line shows during generation.", flush=True)
while step < max_steps:
    t_step = time.time()
    timing, m = {}, {}
    stage = [0]

    def mark(name):  # verbose: numbered stage lines with elapsed time and memory
        last_progress[0] = time.time()
        if verbose:
            stage[0] += 1
            mg = mem_stats()
            print(f"  [{step + 1}.{stage[0]}] {name}: {time.time() - t_step:.2f}s, mem {mg['mem/allocated_gb']:.2f} GB "
                  f"(peak {mg['mem/peak_gb']:.2f})", flush=True)

    # 1. prompts and completions: each rank samples whole groups for its share of the prompts; a row's randomness
    #    comes from its global prompt index, so completions do not depend on the number of ranks
    batch, next_cursor = batch_at(train_set, seed, cursor, P)
    prompts = encode_prompts(tok, batch, system_prompt, instruction)
    mine = range(rank * P // world, (rank + 1) * P // world)
    t = time.time()
    comps = generate(gen_model, tok, [prompts[i] for i in mine], G, max_new_tokens, temperature, top_k, top_p,
                     seed=seed * 100_003 + step, prompt_index=mine, compile=compile_decode,
                     progress=master and (step == 0 or verbose),
                     on_step=lambda: last_progress.__setitem__(0, time.time()))
    timing['gen'] = time.time() - t
    mark(f"generated {len(comps)} completions")
    # 2. rewards
    t = time.time()
    examples = [batch[c['prompt_idx']] for c in comps]
    sc = score([c['text'] for c in comps], examples, reward_fns, failure_reward,
               [{'n_tokens': len(c['ids']), 'truncated': c['truncated']} for c in comps])
    timing['reward'] = time.time() - t
    if ddp:  # the whole step's completions and rewards on every rank: advantages, loss normalisers, guards and
        comps, sc = gather_step(comps, sc)  # metrics are then the numbers one process computes
    mark("rewards scored")
    # 3. group-relative advantages
    r = torch.tensor(sc['total'], dtype=torch.float32).view(P, G)
    adv, zero_std = group_advantages(r, adv_std_scale, adv_eps)
    rows, n_tok, n_seq = [], 0, 0
    for i, c in enumerate(comps):
        if (filter_zero_std and zero_std[i // G]) or (mask_truncated and c['truncated']) or not c['ids']:
            continue
        n_tok, n_seq = n_tok + len(c['ids']), n_seq + 1  # the whole step's (every rank's): the loss normalisers
        if c['prompt_idx'] in mine:  # each rank trains on its own prompts' completions
            rows.append({'prompt': prompts[c['prompt_idx']], 'ids': c['ids'], 'adv': float(adv.view(-1)[i]),
                         'gen_logp': c['logprobs'], 'group': c['prompt_idx']})
    micro = micro_batches(rows, micro_batch_size, whole_groups=share_prompt)  # share_prompt packs whole groups
    n_real = len(micro)
    if ddp:  # every rank runs as many forward/backward passes, so their collectives pair up: pad with zero-weight ones
        pad = {'prompt': [tok.pad_id], 'ids': [tok.pad_id], 'adv': 0.0, 'gen_logp': [0.0], 'group': -1}
        micro += [[pad]] * int(all_reduce([n_real], 'max')[0] - n_real)
    # 4. old (mu > 1) and reference (beta > 0) log-probs, no grad
    t = time.time()
    old_lp = None
    if num_iterations > 1:
        with torch.no_grad():
            old_lp = [completion_logprobs(train_model, mb)[0] for mb in micro]
    timing['old_logprob'] = time.time() - t
    t = time.time()
    ref_lp = None
    if ref_model is not None:
        with torch.no_grad():
            ref_lp = [completion_logprobs(ref_model, mb)[0].float() for mb in micro]
    timing['ref'] = time.time() - t
    mark("old/ref log-probs computed")
    # 5. policy-gradient update: each micro-batch adds its share of the step's loss, so the gradient does not
    #    depend on how the step is cut into micro-batches
    t = time.time()
    beta_now = beta * min(1.0, (step + 1) / kl_warmup_steps) if kl_warmup_steps > 0 else beta
    lr_now = lr_at(step, lr, max_steps, warmup_steps) * lr_scale
    for g in optimizer.param_groups:
        g['lr'] = lr_now
    if fault_stall_step == step + 1:
        injected_stall(fault_stall_s)
    acc = {k: 0.0 for k in ('loss', 'pg_loss', 'kl', 'entropy', 'clip_frac', 'logprob/mean', 'logprob_gen_vs_train')}
    grad_norm, skipped = 0.0, n_tok == 0 or sc['all_failed']  # skipped: no update attempted, gradient 0
    for it in range(num_iterations if not skipped else 0):
        for j, mb in enumerate(micro):
            # DDP all-reduces the gradients once, in the last micro-batch's backward (FSDP reduce-scatters each)
            with train_model.no_sync() if ddp and not fsdp and j < len(micro) - 1 else contextlib.nullcontext():
                logp, ent = completion_logprobs(train_model, mb)
            lens = torch.tensor([len(rw['ids']) for rw in mb], device=logp.device)
            A = torch.repeat_interleave(torch.tensor([rw['adv'] for rw in mb], device=logp.device), lens)
            w = token_weights(lens, loss_agg, n_tok, n_seq, max_new_tokens) * (j < n_real)  # padding weighs 0
            loss, st = policy_loss(logp, old_lp[j] if old_lp is not None else logp.detach(), A, w, eps_low, eps_high,
                                   ref_lp[j] if ref_lp is not None else None, beta_now, kl_estimator, kl_clamp,
                                   ent, entropy_coef)
            if step + 1 in fault_nan_steps:
                loss = loss * float('nan')
            (loss * world).backward()  # DDP/FSDP average the ranks' gradients: the step's gradient is their sum
            if it == 0 and j < n_real:  # metrics describe the rollout batch as the policy first saw it
                tw = 1.0 / n_tok
                acc['loss'] += loss.item()
                acc['pg_loss'] += (st['pg'] * w).sum().item()
                acc['kl'] += st['kl'].sum().item() * tw
                acc['entropy'] += ent.sum().item() * tw
                acc['clip_frac'] += st['clipped'].float().sum().item() * tw
                acc['logprob/mean'] += logp.sum().item() * tw
                gen = torch.tensor([x for rw in mb for x in rw['gen_logp']], device=logp.device)
                acc['logprob_gen_vs_train'] += (gen - logp.detach()).abs().sum().item() * tw
        if it == 0 and ddp:  # each rank summed its own tokens' shares of the step's loss and metrics
            acc = dict(zip(acc, all_reduce(list(acc.values()))))
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float('inf')).item()
        if not (math.isfinite(grad_norm) and math.isfinite(acc['loss'])):
            break
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    optimizer.zero_grad(set_to_none=True)  # a skipped (non-finite) update leaves no gradient behind
    sync_gen_model()
    timing['update'] = time.time() - t
    mark("update done")
    step += 1
    cursor = next_cursor
    # 6. metrics, warnings, guards
    timing['step'] = time.time() - t_step
    if ddp:  # the slowest rank's: the step waits for it
        timing = dict(zip(timing, all_reduce(list(timing.values()), 'max')))
    lens_all = [len(c['ids']) for c in comps]
    m = {'step': step, 'lr': lr_now, 'reward/mean': r.mean().item(), 'reward/std': r.std().item(),
         **{f'reward/{k}/mean': sum(v) / len(v) for k, v in sc['per_fn'].items()},
         **{f'reward/{k}/errors': v for k, v in sc['errors'].items()},
         'frac_zero_std': zero_std.float().mean().item(), **acc, 'grad_norm': grad_norm, 'kl_coef': beta_now,
         'rows_trained': n_seq, 'tokens_trained': n_tok,
         'response_len/mean': sum(lens_all) / len(lens_all), 'response_len/max': max(lens_all),
         'response_len/clip_frac': sum(c['truncated'] for c in comps) / len(comps),
         **{f'timing_s/{k}': v for k, v in timing.items()}, **mem_stats(),
         'perf/gen_tokens_per_s': sum(lens_all) / max(timing['gen'], 1e-9),
         'perf/tokens_per_s': sum(len(p) for p in prompts) * G / max(timing['step'], 1e-9) + sum(lens_all) / max(timing['step'], 1e-9)}
    warns = []
    if m['frac_zero_std'] == 1.0:
        warns.append(('all_zero_std', "every group got identical rewards: all advantages are zero, so the loss is zero "
                      "by construction; raise temperature or group_size, check the reward"))
    if n_tok == 0 and m['frac_zero_std'] < 1.0:
        warns.append(('no_tokens', "no completion tokens to train on this step (all filtered or masked: see "
                      "mask_truncated / filter_zero_std)"))
    if n_tok > 0 and abs(m['logprob/mean']) < 1e-3:
        warns.append(('logp_zero', "sampled tokens have log-prob ~0: the policy is near-deterministic at this temperature, "
                      "so groups barely differ; raise temperature"))
    if not skipped and m['loss'] == 0.0 and grad_norm == 0.0:
        warns.append(('zero_loss_and_grad', "loss and grad norm are exactly 0: nothing is being learned; check rewards "
                      "and advantages (see reward/std, frac_zero_std)"))
    if m['response_len/clip_frac'] > 0.5:
        warns.append(('truncated', f"{m['response_len/clip_frac']:.0%} of completions hit max_new_tokens={max_new_tokens}: "
                      "raise max_new_tokens, or add the 'length' overlong penalty; their answers are likely missing"))
    guards['kl_hist'] = (guards['kl_hist'] + [m['kl']])[-10:]
    if ref_model is not None and m['kl'] > kl_warn:
        warns.append(('kl', f"KL to the reference {m['kl']:.4f} > kl_warn={kl_warn} (last steps: "
                      f"{[round(k, 4) for k in guards['kl_hist']]}); lower lr or raise beta"))
    for key, msg in warns:
        guards['warn_counts'][key] = guards['warn_counts'].get(key, 0) + 1
        print(f"WARNING [{key}]: {msg}", flush=True)
    m.update({f'warn/{k}': v for k, v in guards['warn_counts'].items()})
    if eval_every > 0 and (step % eval_every == 0 or step == max_steps):
        m.update(run_eval(step))
    # guards
    finite = math.isfinite(m['loss']) and math.isfinite(grad_norm)
    guards['nan_streak'] = 0 if finite or skipped else guards['nan_streak'] + 1
    guards['zero_streak'] = guards['zero_streak'] + 1 if (m['reward/mean'] == 0.0 or sc['all_failed']) else 0
    guards['recent'] = (guards['recent'] + [c['text'] for c in comps[:2]])[-6:]
    action = None
    if not finite and not skipped:
        print(f"guard: non-finite loss/grad at step {step} (loss {m['loss']}, grad norm {grad_norm}); update skipped "
              f"({guards['nan_streak']}/{nan_patience} in a row)", flush=True)
        if guards['nan_streak'] >= nan_patience:
            action = f"{guards['nan_streak']} non-finite steps in a row"
    if sc['all_failed']:
        print(f"guard: every reward call failed at step {step}; no update applied. errors: {sc['error_msgs'][:3]}", flush=True)
    if ref_model is not None and m['kl'] > kl_max:
        msg = f"KL {m['kl']:.4f} > kl_max={kl_max} (trend over the last steps: {[round(k, 4) for k in guards['kl_hist']]})"
        if on_kl_max == 'stop':
            log_metrics({**m, 'guard/kl_stop': 1})
            stop(msg + "; lower lr, raise beta, or raise kl_max if this KL is expected")
        action = msg
    m.update({'guard/nan_streak': guards['nan_streak'], 'guard/zero_reward_streak': guards['zero_streak'], 'guard/rollbacks': rollbacks,
              'guard/skipped_update': int(skipped or not finite)})
    log_metrics(m)
    print(f"step {step:5d} | reward {m['reward/mean']:.3f}±{m['reward/std']:.3f} | zero_std {m['frac_zero_std']:.2f} | "
          f"loss {m['loss']:.4f} | kl {m['kl']:.4f} | clip {m['clip_frac']:.3f} | ent {m['entropy']:.3f} | "
          f"gnorm {grad_norm:.3f} | len {m['response_len/mean']:.0f} | {timing['step']:.1f}s (gen {timing['gen']:.1f} "
          f"rew {timing['reward']:.1f} ref {timing['ref']:.1f} old {timing['old_logprob']:.1f} upd {timing['update']:.1f}) | "
          f"mem {m['mem/peak_gb']:.2f}GB", flush=True)
    if master and log_samples_every > 0 and step % log_samples_every == 0:
        with open(os.path.join(out_dir, 'samples.jsonl'), 'a') as f:
            for c in comps[:: max(1, len(comps) // 4)][:4]:
                f.write(json.dumps({'step': step, 'prompt': tok.decode(prompts[c['prompt_idx']]), 'completion': c['text'],
                                    'answer': extract_answer(c['text']), 'reference': batch[c['prompt_idx']]['answer'],
                                    'reward': sc['total'][comps.index(c)]}) + '\n')
    if guards['zero_streak'] >= zero_reward_patience:
        errs = {k: v for k, v in sc['errors'].items() if v}
        stop(f"reward mean has been 0 (or every reward failed) for {guards['zero_streak']} steps in a row "
             f"(zero_reward_patience={zero_reward_patience}).\nReward errors this step: {errs or 'none'} "
             f"{sc['error_msgs'][:3]}\nRecent completions:\n" + '\n---\n'.join(x[:300] for x in guards['recent']) +
             "\nCheck the reward function, the prompt format and max_new_tokens.")
    if action is not None:
        rollbacks += 1
        if rollbacks > max_rollbacks:
            stop(f"{action}; already rolled back {max_rollbacks} times (max_rollbacks). Lower lr, check the data "
                 "and the reward; the last good checkpoint is in out_dir.")
        path, good = load_newest_everywhere()
        load_state(model, optimizer, good['model'], good['optimizer'], fsdp)
        lr_scale *= rollback_lr_scale
        guards['nan_streak'] = 0
        sync_gen_model()
        print(f"guard: {action} -> rolled back to {path} (step {good['step']}); lr scale now {lr_scale} "
              f"(rollback {rollbacks}/{max_rollbacks}); continuing with new data", flush=True)
        continue
    last_progress[0] = time.time()
    stopping = all_reduce([float(bool(stop_signal))], 'max')[0] > 0  # a signal to any rank stops all at this step
    if stopping or step % save_every == 0 or step == max_steps:
        save(step)
    if master and plot_every > 0 and (step % plot_every == 0 or step == max_steps):
        plot_metrics(metrics_path, os.path.join(out_dir, 'curves.png'))
    if stopping:
        sig = stop_signal[0] if stop_signal else int(signal.SIGTERM)
        print(f"signal {sig}: checkpoint saved at step {step}; exiting. Rerun the same command to resume.")
        finish(128 + sig)
print(f"done: {step} steps. metrics: {metrics_path}, curves: {os.path.join(out_dir, 'curves.png')}")
finish(0)
