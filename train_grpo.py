"""
GRPO fine-tuning on one GPU (or a CPU, or several through torchrun), top to bottom: knobs -> setup
-> a loop of named stages: 1 prompts and completions (sample.py) -> 2 rewards (the task's) -> 3
group-relative advantages -> 4 old and reference log-probs -> 5 clipped policy-gradient update -> 6
metrics, warnings, guards -> 7 checkpoint. The operations are in files named for them: tasks/,
batch.py, loss.py, safety.py, parallel.py, checkpoint.py, sft.py.

    python train_grpo.py config/arith.py            # the offline demo: tiny model, CPU, minutes
    python train_grpo.py config/gsm8k.py            # Qwen2.5-0.5B-Instruct on GSM8K, one GPU
    python train_grpo.py config/gsm8k.py --lr=2e-6 --group_size=16
    python train_grpo.py --task=path/to/my_task.py --init_from=...   # your own task (README: Add a task)
    python train_grpo.py --plot=out/gsm8k           # redraw curves.png from metrics.jsonl
"""
import contextlib
import math
import os
import signal
import sys
import time

import torch

# I/O
out_dir = 'out/grpo'  # metrics.jsonl, samples.jsonl, curves.png, checkpoints, hf/ go here
init_from = 'Qwen/Qwen2.5-0.5B-Instruct'  # HF snapshot dir or hub id; 'scratch' = a small random model (byte tokenizer)
resume = 'auto'  # 'auto': continue from the newest checkpoint in out_dir that loads; 'never': start fresh
resume_changed = False  # resume even though knobs that change the run differ from the checkpoint's (printed)
plot = ''  # --plot=OUT_DIR: redraw OUT_DIR/curves.png from its metrics.jsonl and exit
# task (tasks/): its data, prompts, grading and default rewards; its own knobs (e.g. arith_*) are in
# its file
task = 'gsm8k'  # 'gsm8k', 'arith' (built-in, offline), 'mymodule:my_task' or 'path/to/task.py'
data_dir = ''  # local dir with the task's train/test .jsonl or .parquet (e.g. ../shared/gsm8k); '' = its default source
system_prompt = None  # system turn; None = the task's default, '' = none
instruction = None  # appended to every question; None = the task's default, '' = none
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
share_prompt = 'auto'  # True: a group's prompt once, its completions packed after it; False: a row each; 'auto': cheaper
packed_attention = 'auto'  # packed rows' attention: 'flex' (FlexAttention block mask), 'sdpa' (dense mask), 'auto' flex on CUDA
max_new_tokens = 512  # completion budget; hitting it counts as truncated
temperature = 1.0  # sampling temperature; the loss's log-probs use the same temperature
top_k = 0  # 0 = off. top_k/top_p make training off-policy: the loss scores tokens under the full softmax
top_p = 1.0  # 1.0 = off
# GRPO objective
scale_rewards = 'group'  # advantage = r - group mean, divided by: 'group' std (GRPO), 'batch' std, 'none' (Dr. GRPO)
adv_eps = 1e-4  # keeps the division finite for groups with tiny spread
loss_agg = 'token_mean'  # 'token_mean' (DAPO: over all the step's tokens), 'seq_mean_token_mean' (GRPO), 'seq_sum_const' (Dr. GRPO)
loss_type = 'grpo'  # 'grpo' (token ratio, PPO clip), 'gspo' (sequence ratio), 'cispo' (clipped IS weight): loss.py
eps_low = 0.2  # PPO clip below: ratio >= 1 - eps_low
eps_high = 0.28  # PPO clip above (clip-higher, DAPO): ratio <= 1 + eps_high
num_iterations = 1  # mu: optimizer steps on each rollout batch (1 = on-policy: ratio is 1 and nothing clips)
beta = 0.0  # KL penalty weight to the frozen reference (0 = no reference model is loaded)
kl_estimator = 'k3'  # 'k3': gradient of KL(ref||pi) (GRPO, TRL); 'k2': of KL(pi||ref); 'k1': in the advantage
kl_clamp = 10.0  # log ratios are clamped to +-this before the KL estimate
kl_warmup_steps = 0  # beta ramps linearly from 0 over this many steps
filter_zero_std = True  # skip groups whose rewards are all equal (zero gradient when beta = entropy_coef = 0)
dynamic_sampling = 0  # DAPO: up to N more rounds of prompts per step until batch_prompts groups have a reward spread
mask_truncated = False  # exclude completions that hit max_new_tokens from the loss
entropy_coef = 0.0  # entropy bonus weight (0 = off)
lm_head_tiles = (0, 0)  # LM head's (tokens, vocab) tile: never more logits than that; 0 = kernels.HEAD_TILES
lm_head_fp32 = True  # the training LM head's matmul in fp32 (bf16 logits round every log-prob; batch.py)
tis = ''  # truncated importance sampling vs the sampler: '' off, 'token_truncate', 'token_mask', 'sequence_*' (loss.py)
tis_cap = 3.0  # its cap C_max on pi_train / pi_sampler (TRL's default)
# rewards: reward.REWARD_FNS names, 'reward_model'/'judge' (reward_model.py) or 'module:function';
# kwargs reach them
rewards = None  # None = the task's default rewards ('correct' pays the task's grade())
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
export_dtype = ''  # the HF snapshot's weights: '' = as trained (float32), 'bfloat16' (half the disk)
export_every = 0  # also checkpoint and keep out_dir/hf_{step:07d}/ every N steps, for later comparison (0 = off)
wandb_log = False  # also send every metrics.jsonl row to Weights & Biases (pip install wandb; curves.png needs none)
wandb_project = 'grpo'  # its project
wandb_run_name = ''  # its run name ('' = wandb's); a resumed run continues the same wandb run (out_dir/wandb_id)
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
lora_rank = 0  # LoRA (lora.py): adapter rank, base frozen (0 = off); 32 is a common start, with ~10x the full-FT lr
lora_alpha = 64.0  # adapter scale = lora_alpha / lora_rank (peft's convention)
lora_dropout = 0.0  # dropout on the adapters' input, in the gradient forward only
lora_targets = 'all-linear'  # every linear layer of the blocks, or HF module names: 'q_proj,v_proj' (GPT-2: 'c_attn')
fsdp = False  # torchrun only: shard weights, grads and AdamW state across ranks (FSDP2), for models that do not fit one GPU
seed = 1337  # data order, sampling and init: the whole run is a function of it
# -----------------------------------------------------------------------------
import tasks  # noqa: E402
from configurator import configure, save_config  # noqa: E402
from plot import metrics_log, plot_metrics  # noqa: E402

config = configure(globals(), more_knobs=lambda s: tasks.knobs(tasks.resolve(s['task'])))  # + the task's knobs
if plot:
    plot_metrics(os.path.join(plot, 'metrics.jsonl'), os.path.join(plot, 'curves.png'))
    sys.exit(0)

from batch import choose_share_prompt, completion_logprobs, keep_groups, micro_batches, pad_micro_batches, train_rows  # noqa: E402
from checkpoint import load_newest_everywhere, load_state, reference_model, resume_run, save_run  # noqa: E402
from data import batch_at  # noqa: E402
from loss import group_advantages, policy_loss, tis_weights, token_weights  # noqa: E402
from hf import load_model  # noqa: E402
import lora  # noqa: E402
from parallel import all_reduce, die, finish, gather_step, setup, wrap  # noqa: E402
from reward import merge_scores, resolve_rewards, score  # noqa: E402
import safety  # noqa: E402
from sft import warm_start  # noqa: E402
from sample import encode_prompts, evaluate, generate  # noqa: E402

if (error := safety.bad_knob(config) or lora.bad_knob(config)) is not None:  # a typo'd choice: an error here, not in the loop
    die(error, 2)
task_mod = tasks.resolve(task)
tasks.set_knobs(task_mod, config)
try:
    tasks.check_prompt_overrides(task_mod, task, system_prompt, instruction)
    reward_fns = resolve_rewards(tasks.default_rewards(task_mod) if rewards is None else rewards, task_mod.grade,
                                 device, dtype, lambda ex: tasks.messages(task_mod, ex, system_prompt, instruction))
except ValueError as e:
    die(str(e), 2)
if sft_steps > 0 and not callable(getattr(task_mod, 'solution', None)):
    die(f"--sft_steps={sft_steps}: task {task!r} has no solution() to warm start on", 2)
rank, world, device = setup(device, batch_prompts, fsdp)
ddp, master = world > 1 or rank > 0, rank == 0  # master: the one rank that prints, logs, plots and writes
if master:
    save_config(config, out_dir)
    safety.startup_warnings(config)
torch.manual_seed(seed)
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
# ----------------------------------------------------------------------------- data
try:
    train_set, test_set = (task_mod.load(split, data_dir=data_dir, seed=seed) for split in ('train', 'test'))
except (ValueError, RuntimeError, FileNotFoundError) as e:
    die(f"task {task!r}: {e}")
eval_set = test_set[:eval_examples] if eval_examples > 0 else test_set
print(f"task: {task}, {len(train_set)} train / {len(eval_set)} eval problems")


def prompts_for(examples):
    return encode_prompts(tok, task_mod, examples, system_prompt, instruction)


# ----------------------------------------------------------------------------- model
try:
    model, tok = load_model(init_from, torch.float32, device, seed, n_layer, n_head, n_kv_head, n_embd, max_seq_len)
    lora.apply(model, lora_rank, lora_alpha, lora_dropout, lora_targets, seed)  # base frozen, adapters added (rank > 0)
except (ValueError, OSError) as e:
    die(str(e))
model.grad_checkpoint, model.packed_attention = grad_checkpoint, packed_attention
print(f"model: {init_from}, {model.num_params() / 1e6:.1f}M parameters, compute {dtype} on {device}")
# the sampler: the model itself in fp32, else a low-precision copy (LoRA: of the merged weights);
# synced after updates
gen_model, sync_gen_model = lora.sampler(model, ptdtype, fsdp)
train_model = wrap(model, device, fsdp, compile)
step_share = share_prompt is True  # this step's update layout (share_prompt='auto': batch.choose_share_prompt per step)


def logprobs(net, rows, temp=None):  # per-token log-probs and entropies of rows' completions (batch.py)
    return completion_logprobs(net, rows, tok.pad_id, temperature if temp is None else temp, step_share,
                               ptdtype, compile, lm_head_fp32, lm_head_tiles)


optimizer = torch.optim.AdamW(lora.param_groups(model, weight_decay), lr=lr, betas=adam_betas, fused=device.startswith('cuda'))


def lr_at(step, peak, total, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# ----------------------------------------------------------------------------- resume / fresh start
step, cursor, lr_scale, rollbacks, metrics_path = 0, 0, 1.0, 0, os.path.join(out_dir, 'metrics.jsonl')
guards = safety.new_guards()  # saved with checkpoints
state = resume_run(out_dir, resume, master, model, optimizer, fsdp, config, resume_changed)  # None: a fresh start
if state is not None:
    step, cursor, lr_scale, rollbacks, guards = (state[k] for k in ('step', 'cursor', 'lr_scale', 'rollbacks', 'guards'))
    sync_gen_model()


def save(step_done):  # checkpoint.py: atomic, finite weights only, rank 0 writes, with the HF export
    return save_run(out_dir, step_done, model, optimizer, fsdp, master, keep_last, {
        'cursor': cursor, 'lr_scale': lr_scale, 'rollbacks': rollbacks, 'guards': guards, 'ref_source': init_from},
        tok if export_hf else None, config, getattr(torch, export_dtype or 'float32'),
        export_every > 0 and step_done % export_every == 0)


log_metrics = metrics_log(metrics_path, master, out_dir, wandb_log, wandb_project, wandb_run_name, config)  # plot.py


def run_eval(at_step):
    t = time.time()
    lo, hi = len(eval_set) * rank // world, len(eval_set) * (rank + 1) // world  # each rank its share
    s = evaluate(gen_model, tok, task_mod, eval_set[lo:hi], system_prompt, instruction,
                 max_new_tokens=eval_max_new_tokens or max_new_tokens, batch_size=eval_batch_size,
                 compile=compile_decode, progress=verbose and master)
    if ddp:
        n, hits, trunc = all_reduce([s['n'], round(s['pass@1'] * s['n']), s['truncated'] * s['n']], device)
        s = {**s, 'n': int(n), 'pass@1': hits / max(n, 1), 'truncated': trunc / max(n, 1)}  # task's: rank 0's share
    print(f"eval @ step {at_step}: greedy pass@1 {s['pass@1']:.3f} on {s['n']} problems ({time.time() - t:.1f}s)", flush=True)
    return {**{f'eval/{k}': v for k, v in s.items() if k not in ('n', 'seconds')}, 'timing_s/eval': time.time() - t}


# ----------------------------------------------------------------------------- supervised warm start
if state is None and sft_steps > 0:
    warm_start(model, lambda rows: logprobs(train_model, rows, temp=1.0), optimizer, train_set, lambda batch: [
        {'prompt': p, 'ids': tok.encode(task_mod.solution(ex)) + [tok.eos_id]} for p, ex in zip(prompts_for(batch), batch)],
        sft_steps, sft_batch_size, seed + 1, lambda it: lr_at(it, sft_lr, sft_steps, max(1, sft_steps // 10)))
    sync_gen_model()
# frozen KL reference (beta > 0): the starting policy, kept as ref.pt beside the checkpoints (LoRA:
# adapters off, no copy)
ref_model = None if beta == 0 else train_model if lora_rank else reference_model(gen_model if fsdp else model, ptdtype,
    os.path.join(out_dir, 'ref.pt'), state is not None, master, device, None if sft_steps else lambda: load_model(
        init_from, torch.float32, 'cpu', seed, n_layer, n_head, n_kv_head, n_embd, max_seq_len)[0])
if state is None:
    log_metrics({'step': 0, **(run_eval(0) if eval_every > 0 else {})})
    save(0)  # the first rollback target
last_progress = [time.time()]  # the watchdog's heartbeat: refreshed at every stage and decode step
safety.start_watchdog(last_progress, watchdog_s, out_dir, watchdog_exit)
stop_signal = safety.catch_signals()

# ----------------------------------------------------------------------------- GRPO
P, G = batch_prompts, group_size
print(safety.workload_line(P, G, max_new_tokens, num_iterations, micro_batch_size, compile_decode), flush=True)


def rollout(examples, first, step, timing):  # this rank's groups, sampled and scored; row i's randomness: first + i
    mine, prompts = range(first + rank * len(examples) // world, first + (rank + 1) * len(examples) // world), \
        prompts_for(examples)
    t = time.time()
    comps = generate(gen_model, tok, [prompts[i - first] for i in mine], G, max_new_tokens, temperature, top_k, top_p,
                     seed=seed * 100_003 + step, prompt_index=mine, compile=compile_decode,
                     progress=master and (step == 0 or verbose), on_step=lambda: last_progress.__setitem__(0, time.time()))
    timing['gen'], t = timing.get('gen', 0.0) + time.time() - t, time.time()
    sc = score([c['text'] for c in comps], [examples[c['prompt_idx'] - first] for c in comps], reward_fns, failure_reward,
               [{'n_tokens': len(c['ids']), 'truncated': c['truncated'], 'max_new_tokens': max_new_tokens} for c in comps])
    timing['reward'] = timing.get('reward', 0.0) + time.time() - t
    return (prompts, mine, *gather_step(comps, sc))  # torchrun: every rank's completions and rewards on every rank


while step < max_steps:
    t_step = time.time()
    timing, mark = {}, safety.stage_marker(step + 1, t_step, last_progress, verbose, device)
    # 1-2. prompts, completions, rewards; dynamic_sampling (DAPO): draw more prompts until P groups
    # have a spread
    batch, prompts, comps, scs, owned, next_cursor = [], [], [], [], set(), cursor
    for rnd in range(1 + dynamic_sampling):  # a refill draws enough prompts to fill the step at the rate seen so far
        n = P if rnd == 0 else min(P, math.ceil((P - n_spread) * len(batch) / max(n_spread, 1)))
        more, next_cursor = batch_at(train_set, seed, next_cursor, n)
        p, mine, c, sc = rollout(more, len(batch), step, timing)
        batch, prompts, comps, scs, owned = batch + more, prompts + p, comps + c, scs + [sc], owned | set(mine)
        r_all = torch.tensor([x for s in scs for x in s['total']], dtype=torch.float32).view(-1, G)
        zero_all = group_advantages(r_all, scale_rewards, adv_eps)[1]
        if (n_spread := int((~zero_all).sum())) >= P:
            break
    sc = merge_scores(scs)
    mark(f"generated and scored {len(comps)} completions")
    # 3. group-relative advantages of the step's groups (dynamic sampling: the first P with a
    # spread); rows to train on
    kept = keep_groups(zero_all, P) if dynamic_sampling else list(range(P))
    adv, zero_std = group_advantages(r_all[kept], scale_rewards, adv_eps)
    rows, n_tok, n_seq, (n_trained, t_trained) = train_rows(  # a zero-spread group's gradient is 0 without KL/entropy
        comps, adv, zero_std, prompts, owned, kept, filter_zero_std and not (beta or entropy_coef), mask_truncated)
    step_share = share_prompt if share_prompt != 'auto' else choose_share_prompt(rows, model.config, model.packed_kind())
    micro = micro_batches(rows, micro_batch_size, whole_groups=step_share)  # packed: whole groups per micro-batch
    n_real = len(micro)  # (torchrun: padded with passes of weight 0, as many on every rank)
    micro = pad_micro_batches(micro, tok.pad_id, device) if ddp else micro
    # 4. old (mu > 1) and reference (beta > 0) log-probs, no grad
    t = time.time()
    with torch.no_grad():
        old_lp = [logprobs(train_model, mb)[0] for mb in micro] if num_iterations > 1 else None
        timing['old_logprob'], t = time.time() - t, time.time()
        with lora.disabled(model):  # LoRA: the reference is the base; a no-op otherwise
            ref_lp = [logprobs(ref_model, mb)[0].float() for mb in micro] if ref_model is not None else None
    timing['ref'] = time.time() - t
    gen_lp = [torch.tensor([x for rw in mb for x in rw['gen_logp']], device=device) for mb in micro]  # the sampler's
    mark("old/ref log-probs computed")
    # 5. policy-gradient update: each micro-batch adds its share of the step's loss, so the gradient
    # does not
    #    depend on how the step is cut into micro-batches
    t = time.time()
    beta_now = beta * min(1.0, (step + 1) / kl_warmup_steps) if kl_warmup_steps > 0 else beta
    lr_now = lr_at(step, lr, max_steps, warmup_steps) * lr_scale
    for g in optimizer.param_groups:
        g['lr'] = lr_now
    safety.injected_stall(fault_stall_s if fault_stall_step == step + 1 else 0)
    first, last = safety.update_metrics(tis=bool(tis)), safety.update_metrics(moved=True)  # rollout; last iteration
    grad_norm, skipped = 0.0, n_trained == 0 or sc['all_failed']  # skipped: no update attempted, gradient 0
    for it in range(num_iterations if not skipped else 0):
        for j, mb in enumerate(micro):
            # DDP all-reduces the gradients once, in the last micro-batch's backward (FSDP
            # reduce-scatters each)
            with train_model.no_sync() if ddp and not fsdp and j < len(micro) - 1 else contextlib.nullcontext():
                logp, ent = logprobs(train_model, mb)
            lens = torch.tensor([len(rw['ids']) for rw in mb], device=logp.device)
            A = torch.repeat_interleave(torch.tensor([rw['adv'] for rw in mb], device=logp.device), lens)
            w = token_weights(lens, loss_agg, n_tok, n_seq, max_new_tokens) * (j < n_real)  # padding weighs 0
            old, gen = old_lp[j] if old_lp is not None else logp.detach(), gen_lp[j]
            isw = tis_weights(old, gen, lens, tis, tis_cap) if tis else None  # (weights, above the cap)
            loss, st = policy_loss(logp, old, A, w, lens, eps_low, eps_high, loss_type, ref_lp[j] if ref_lp is not None
                                   else None, beta_now, kl_estimator, kl_clamp, ent, entropy_coef, isw[0] if isw else None)
            if step + 1 in fault_nan_steps:
                loss = loss * float('nan')
            (loss * world).backward()  # DDP/FSDP average the ranks' gradients: the step's gradient is their sum
            if j < n_real:  # iteration 0: the rollout batch as the policy first saw it; the last (mu > 1): how far it moved
                safety.add_metrics(first if it == 0 else last, loss, st, w, logp, ent, old, gen, isw, t_trained, it == 0,
                                   0 < it == num_iterations - 1)
        if ddp and (it == 0 or it == num_iterations - 1):  # each rank summed its own tokens' shares
            safety.reduce_metrics(first if it == 0 else last, lambda v, op: all_reduce(v, device, op))
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float('inf')).item()
        if not (math.isfinite(grad_norm) and math.isfinite(first['sum']['loss'])):
            break
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    optimizer.zero_grad(set_to_none=True)  # a skipped (non-finite) update leaves no gradient behind
    sync_gen_model()
    timing['update'] = time.time() - t
    mark("update done")
    step, cursor = step + 1, next_cursor
    # 6. metrics, warnings, guards
    timing['step'] = time.time() - t_step
    if ddp:  # the slowest rank's: the step waits for it
        timing = dict(zip(timing, all_reduce(list(timing.values()), device, 'max')))
    m = {'step': step, 'lr': lr_now, **safety.rollout_metrics(r_all, zero_all, sc, comps, prompts, G, timing),
         **({'dynamic/prompts': len(batch), 'dynamic/rounds': rnd + 1, 'dynamic/groups_short': P - len(kept)}
            if dynamic_sampling else {}), **safety.metrics_of(first), 'grad_norm': grad_norm,
         **(safety.metrics_of(last) if num_iterations > 1 and not skipped else {}), 'kl_coef': beta_now,
         'rows_trained': n_trained, 'tokens_trained': t_trained, 'packed': int(step_share), **safety.mem_stats(device)}
    m.update(safety.warn(guards, m, t_trained, skipped, grad_norm, max_new_tokens, kl_warn if ref_model is not None else None))
    if eval_every > 0 and (step % eval_every == 0 or step == max_steps):
        m.update(run_eval(step))
    action, finite = safety.guard(guards, m, step, skipped, sc, [c['text'] for c in comps], nan_patience,
                                  kl_max if ref_model is not None else None)
    if action and action[0] == 'kl' and on_kl_max == 'stop':
        log_metrics({**m, 'guard/kl_stop': 1})
        safety.stop(action[1] + "; lower lr, raise beta, or raise kl_max if this KL is expected", master)
    m.update({'guard/nan_streak': guards['nan_streak'], 'guard/zero_reward_streak': guards['zero_streak'],
              'guard/rollbacks': rollbacks, 'guard/skipped_update': int(skipped or not finite)})
    log_metrics(m)
    print(safety.step_line(m), flush=True)
    if master and log_samples_every > 0 and step % log_samples_every == 0:
        safety.log_samples(os.path.join(out_dir, 'samples.jsonl'), step, comps, batch, prompts, sc['total'], tok, task_mod)
    if guards['zero_streak'] >= zero_reward_patience:
        safety.stop(safety.zero_reward_report(guards, sc, zero_reward_patience), master)
    if action is not None:  # roll back to the newest checkpoint, at a lower learning rate, and go on with new data
        rollbacks, lr_scale, guards['nan_streak'] = rollbacks + 1, lr_scale * rollback_lr_scale, 0
        if rollbacks > max_rollbacks:
            safety.stop(f"{action[1]}; already rolled back {max_rollbacks} times (max_rollbacks). Lower lr, check the "
                        "data and the reward; the last good checkpoint is in out_dir.", master)
        path, good = load_newest_everywhere(out_dir, master)
        load_state(model, optimizer, good['model'], good['optimizer'], fsdp)
        sync_gen_model()
        print(f"guard: {action[1]} -> rolled back to {path} (step {good['step']}); lr scale now {lr_scale} "
              f"(rollback {rollbacks}/{max_rollbacks}); continuing with new data", flush=True)
        continue
    # 7. checkpoint (every save_every steps, at the end, and when a signal asks to stop), curves
    last_progress[0] = time.time()
    stopping = all_reduce([float(bool(stop_signal))], device, 'max')[0] > 0  # a signal to any rank stops all here
    if (stopping or step % save_every == 0 or step == max_steps or export_every and step % export_every == 0) \
            and guards['nan_streak'] == 0:
        save(step)  # never inside a non-finite streak: a rollback must not return to the weights that caused it
    if master and plot_every > 0 and (step % plot_every == 0 or step == max_steps):
        plot_metrics(metrics_path, os.path.join(out_dir, 'curves.png'))
    if stopping:
        sig = stop_signal[0] if stop_signal else int(signal.SIGTERM)
        print(f"signal {sig}: checkpoint saved at step {step}; exiting. Rerun the same command to resume.")
        finish(128 + sig)
print(f"done: {step} steps. metrics: {metrics_path}, curves: {os.path.join(out_dir, 'curves.png')}")
finish(0)
