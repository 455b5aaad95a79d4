"""
Run safety: what makes a failing run loud. Per-step warnings that name the cause and the fix, guards
that decide when to roll back or stop, a watchdog that dumps every thread's stack when nothing
moves, signal handling that checkpoints before exiting, and the memory figures every step logs.

The guards' state is one dict (new_guards), saved with each checkpoint, so a resumed run remembers
its streaks.
"""
import faulthandler
import json
import math
import os
import resource
import signal
import sys
import threading
import time

import torch

import tasks
from parallel import finish
from reward import MODEL_REWARDS

SPREAD_WARN = 0.5  # a model reward that ties all G completions in more than this share of groups is likely broken


def new_guards():
    return {'nan_streak': 0, 'zero_streak': 0, 'kl_hist': [], 'recent': [], 'warn_counts': {}}


def stop(msg, master, code=3):
    """A guard decided the run cannot go on: say why in plain words, leave the last good checkpoint,
    exit non-zero. (Every rank stops here: guards decide from numbers all ranks share; one says
    why.)"""
    if master:
        print(f"\n{'=' * 100}\nSTOPPED: {msg}\n{'=' * 100}", file=sys.stderr, flush=True)
    finish(code)


def mem_stats(device):
    if device.startswith('cuda'):
        return {'mem/allocated_gb': torch.cuda.memory_allocated() / 2**30, 'mem/reserved_gb': torch.cuda.memory_reserved() / 2**30,
                'mem/peak_gb': torch.cuda.max_memory_allocated() / 2**30}
    rss = os.sysconf('SC_PAGE_SIZE') * int(open('/proc/self/statm').read().split()[1]) / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return {'mem/allocated_gb': rss, 'mem/reserved_gb': rss, 'mem/peak_gb': peak}


def bad_knob(c):
    """The first knob whose value the run cannot use, as a one-line error (None: all fine)."""
    from loss import LOSS_TYPES, TIS_MODES
    for key, allowed in [('loss_agg', ('token_mean', 'seq_mean_token_mean', 'seq_sum_const')), ('resume', ('auto', 'never')),
                         ('kl_estimator', ('k1', 'k2', 'k3')), ('on_kl_max', ('rollback', 'stop')), ('loss_type', LOSS_TYPES),
                         ('scale_rewards', ('group', 'batch', 'none')), ('tis', ('',) + TIS_MODES),
                         ('export_dtype', ('', 'float32', 'bfloat16', 'float16')), ('share_prompt', (True, False, 'auto')),
                         ('packed_attention', ('auto', 'flex', 'sdpa'))]:
        if c[key] not in allowed:
            return f"--{key}={c[key]!r}: expected one of {allowed}"
    if c['group_size'] < 2:
        return f"--group_size={c['group_size']}: GRPO needs at least 2 samples per prompt to compare them"
    if c['dynamic_sampling'] < 0:
        return f"--dynamic_sampling={c['dynamic_sampling']}: the number of extra rounds of prompts, >= 0"
    return None


def startup_warnings(c):
    """Settings that run, but not as their user may think: said once, before anything is spent."""
    if c['top_k'] > 0 or c['top_p'] < 1.0:
        print(f"WARNING [off_policy_sampling]: top_k={c['top_k']}, top_p={c['top_p']} truncate the sampler's distribution, "
              "while the loss scores tokens under the full softmax: training is off-policy; use top_k=0, top_p=1.0 for "
              "on-policy GRPO", flush=True)
    if c['filter_zero_std'] and (c['beta'] or c['entropy_coef']):
        print("note: filter_zero_std is off while beta or entropy_coef > 0: groups with equal rewards still have a KL or "
              "entropy gradient, so they are trained on", flush=True)
    busy = cpu_contention() if c['device'] == 'cpu' else None
    if busy:
        print(f"WARNING [cpu_contention]: {busy}", flush=True)


def cpu_contention(load=None, cores=None, threads=None):
    """A line when other processes already keep the CPU busy and torch would run several threads per
    op: they then wait on each other at every op's barrier, and a step can take several times as
    long as with one thread (measured on 2 cores at load 4-8: a warm-start step of the offline demo
    3.1-6.0 s with 2 threads, 0.54-2.0 s with 1)."""
    load = os.getloadavg()[0] if load is None and hasattr(os, 'getloadavg') else load
    cores, threads = cores or os.cpu_count() or 1, threads or torch.get_num_threads()
    if load is None or threads < 2 or load < cores - 0.5:
        return None
    return (f"the load average is {load:.1f} on {cores} CPU cores before this run starts, and torch runs {threads} "
            f"threads per op: contending threads make every step several times slower; run alone, or set "
            f"OMP_NUM_THREADS=1 (or torch.set_num_threads) while the machine is shared")


def warn(guards, m, n_tok, skipped, grad_norm, max_new_tokens, kl_warn=None):
    """Print this step's warnings (each names a cause and a fix) and return the warn/* counters for
    the metrics. kl_warn: None when there is no reference model (no KL is measured)."""
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
    for name in MODEL_REWARDS:
        if m.get(f'reward/{name}/frac_zero_std', 0.0) > SPREAD_WARN:
            warns.append((f'{name}_zero_spread', f"{name} gave all completions of a group the same score in "
                          f"{m[f'reward/{name}/frac_zero_std']:.0%} of groups: " + model_reward_hint(name, m)))
    if m.get('dynamic/groups_short', 0) > 0:
        warns.append(('dynamic_short', f"dynamic sampling found {m['dynamic/groups_short']} groups too few with a reward "
                      f"spread in {m['dynamic/rounds']} rounds ({m['dynamic/prompts']} prompts drawn), so this step trains "
                      "on fewer: most prompts are all-right or all-wrong for the policy; raise dynamic_sampling, "
                      "group_size or temperature, or use harder/easier data"))
    guards['kl_hist'] = (guards['kl_hist'] + [m['kl']])[-10:]
    if kl_warn is not None and m['kl'] > kl_warn:
        warns.append(('kl', f"KL to the reference {m['kl']:.4f} > kl_warn={kl_warn} (last steps: "
                      f"{[round(k, 4) for k in guards['kl_hist']]}); lower lr or raise beta"))
    for key, msg in warns:
        guards['warn_counts'][key] = guards['warn_counts'].get(key, 0) + 1
        print(f"WARNING [{key}]: {msg}", flush=True)
    return {f'warn/{k}': v for k, v in guards['warn_counts'].items()}


def guard(guards, m, step, skipped, sc, texts, nan_patience, kl_max=None):
    """Update the streaks from this step's metrics m and print what the guards saw. Returns (action,
    finite): action None, ('rollback', why) for a non-finite streak at nan_patience, or ('kl', why)
    for KL above kl_max (None: no reference model), which the caller turns into a rollback or a stop
    (on_kl_max)."""
    finite = math.isfinite(m['loss']) and math.isfinite(m['grad_norm'])
    guards['nan_streak'] = 0 if finite or skipped else guards['nan_streak'] + 1
    guards['zero_streak'] = guards['zero_streak'] + 1 if (m['reward/mean'] == 0.0 or sc['all_failed']) else 0
    guards['recent'] = (guards['recent'] + texts[:2])[-6:]
    decision = None
    if not finite and not skipped:
        print(f"guard: non-finite loss/grad at step {step} (loss {m['loss']}, grad norm {m['grad_norm']}); update skipped "
              f"({guards['nan_streak']}/{nan_patience} in a row)", flush=True)
        if guards['nan_streak'] >= nan_patience:
            decision = ('rollback', f"{guards['nan_streak']} non-finite steps in a row")
    if sc['all_failed']:
        print(f"guard: every reward call failed at step {step}; no update applied. errors: {sc['error_msgs'][:3]}", flush=True)
    if kl_max is not None and m['kl'] > kl_max:
        why = f"KL {m['kl']:.4f} > kl_max={kl_max} (trend over the last steps: {[round(k, 4) for k in guards['kl_hist']]})"
        decision = ('kl', why)
    return decision, finite


def stage_marker(step, t_step, last_progress, verbose, device):
    """mark(name) after each stage of a step: refreshes the watchdog's heartbeat; verbose: prints a
    numbered stage line with the time since the step began and the memory in use."""
    n = [0]

    def mark(name):
        last_progress[0] = time.time()
        if verbose:
            n[0] += 1
            mg = mem_stats(device)
            print(f"  [{step}.{n[0]}] {name}: {time.time() - t_step:.2f}s, mem {mg['mem/allocated_gb']:.2f} GB "
                  f"(peak {mg['mem/peak_gb']:.2f})", flush=True)
    return mark


def workload_line(P, G, max_new_tokens, num_iterations, micro_batch_size, compile_decode):
    """Printed before the first step, which may take long enough to look like a hang: what it is
    about to do."""
    compiling = ' and compiles the sampler (compile_decode: seconds to minutes)' if compile_decode else ''
    return (f"workload per step: {P} prompts x {G} samples x <= {max_new_tokens} new tokens = <= {P * G * max_new_tokens:,} "
            f"generated tokens, then {num_iterations} update(s) in micro-batches of {micro_batch_size} rows. The first "
            f"step also warms up kernels/allocator{compiling}; a progress line shows during generation.")


def log_samples(path, step, comps, batch, prompts, totals, tok, task):
    """Four of the step's completions, spread over its groups, with their prompt, the task's answer
    and grade, the reference and the reward, appended to path (samples.jsonl): what the model
    actually writes."""
    answer = tasks.answer_fn(task)
    with open(path, 'a') as f:
        for i in range(0, len(comps), max(1, len(comps) // 4))[:4]:
            ex, text = batch[comps[i]['prompt_idx']], comps[i]['text']
            f.write(json.dumps({'step': step, 'prompt': tok.decode(prompts[comps[i]['prompt_idx']]), 'completion': text,
                                'answer': answer(text), 'reference': ex.get('answer'),
                                'correct': bool(task.grade(text, ex)), 'reward': totals[i]}) + '\n')


def update_metrics(moved=False, tis=False):
    """Accumulators for what a step logs about its update: the rollout's (iteration 0) or,
    moved=True, the last iteration's. Every key is there from the start, so every rank all-reduces
    the same list (reduce_metrics)."""
    if moved:
        keys = ('clip/low_frac', 'clip/high_frac', 'ratio/mean', 'kl_old_new')
        return {'sum': dict.fromkeys(keys, 0.0), 'max': {'ratio/max': -math.inf, 'ratio/min': -math.inf}}
    keys = ('loss', 'pg_loss', 'kl', 'entropy', 'logprob/mean', 'logprob_gen_vs_train') + \
        (('tis/weight_mean', 'tis/capped_frac') if tis else ())
    return {'sum': dict.fromkeys(keys, 0.0), 'max': {}}


def add_metrics(acc, loss, st, w, logp, entropy, old_logp, gen_logp, is_weight, n_tokens, rollout, moved):
    """Add one micro-batch's share. rollout (iteration 0): loss, its policy-gradient part, and means
    over the tokens trained on of KL to the reference, entropy, log-prob, |sampler - trainer|
    log-prob and, with tis, the importance weight and the share of tokens whose ratio was above the
    cap (is_weight: tis_weights' pair). moved (the last iteration, num_iterations > 1): clipped
    fractions on each side, the ratio's mean and range, and KL(old || new) by k3 on the tokens drawn
    from old. Means divide by n_tokens, the step's trained tokens over every rank."""
    s, mx = acc['sum'], acc['max']
    add = {}
    if rollout:
        add = {'loss': loss.item(), 'pg_loss': (st['pg'] * w).sum().item()}
        tis = () if is_weight is None else (('tis/weight_mean', is_weight[0]), ('tis/capped_frac', is_weight[1].float()))
        for k, v in (('kl', st['kl']), ('entropy', entropy), ('logprob/mean', logp),
                     ('logprob_gen_vs_train', (gen_logp - logp.detach()).abs()), *tis):
            add[k] = v.sum().item() * (1.0 / n_tokens)
    if moved:
        r, d = st['ratio'], (logp.detach() - old_logp).exp()
        for k, v in (('clip/low_frac', st['clip_low'].float()), ('clip/high_frac', st['clip_high'].float()),
                     ('ratio/mean', r), ('kl_old_new', d - 1 - d.log())):
            add[k] = v.sum().item() / n_tokens
        for k, v in (('ratio/max', r.max().item()), ('ratio/min', -r.min().item())):
            mx[k] = max(mx[k], v)
    for k, v in add.items():
        s[k] += v


def reduce_metrics(acc, all_reduce):
    """torchrun: each rank's sums summed, maxima maxed. all_reduce(values, op) -> values."""
    for part, op in (('sum', 'sum'), ('max', 'max')):
        if acc[part]:
            acc[part] = dict(zip(acc[part], all_reduce(list(acc[part].values()), op)))


def reward_spread(sc, G):
    """Per reward function: the std of its scores and the share of groups (G consecutive samples)
    whose G scores are all equal, i.e. groups that function gives no signal to."""
    out = {}
    for k, v in sc['per_fn'].items():
        mean, groups = sum(v) / len(v), [v[i:i + G] for i in range(0, len(v), G)]
        out[f'reward/{k}/std'] = math.sqrt(sum((x - mean) ** 2 for x in v) / max(len(v) - 1, 1))
        out[f'reward/{k}/frac_zero_std'] = sum(max(g) == min(g) for g in groups) / max(len(groups), 1)
    return out


def model_reward_hint(name, m):
    """What to check when a model reward gives no signal: said by the zero-spread warning and the
    zero-reward stop."""
    clip = m.get('response_len/clip_frac')
    return (f"check that its 'path' is the scorer you meant (see the 'reward: loaded' line), that "
            f"{'its chat template' if name == 'reward_model' else 'the template'} shows it the prompt and the whole "
            "completion (truncated completions score alike" + (f"; {clip:.0%} truncated" if clip is not None else '')
            + f"), and that its scores are not saturated (reward/{name}/mean {m.get(f'reward/{name}/mean', 0):.3f}; a "
            "judge's P(yes) stuck at 0 or 1 ties every group)")


def rollout_metrics(r, zero_std, sc, comps, prompts, G, timing):
    """The step's rewards (r: (groups, G), every group drawn; per function: reward_spread),
    completion lengths, timing and throughput."""
    lens = [len(c['ids']) for c in comps]
    return {'reward/mean': r.mean().item(), 'reward/std': r.std().item(),
            **{f'reward/{k}/mean': sum(v) / len(v) for k, v in sc['per_fn'].items()},
            **reward_spread(sc, G), **{f'reward/{k}/errors': v for k, v in sc['errors'].items()},
            'frac_zero_std': zero_std.float().mean().item(),
            'response_len/mean': sum(lens) / len(lens), 'response_len/max': max(lens),
            'response_len/clip_frac': sum(c['truncated'] for c in comps) / len(comps),
            **{f'timing_s/{k}': v for k, v in timing.items()}, 'perf/gen_tokens_per_s': sum(lens) / max(timing['gen'], 1e-9),
            'perf/tokens_per_s': (sum(len(p) for p in prompts) * G + sum(lens)) / max(timing['step'], 1e-9)}


def metrics_of(acc):
    return {**acc['sum'], **{k: -v if k == 'ratio/min' else v for k, v in acc['max'].items()}}


def step_line(m):
    """The one line each step prints: the numbers to watch and where the time went."""
    return (f"step {m['step']:5d} | reward {m['reward/mean']:.3f}±{m['reward/std']:.3f} | zero_std {m['frac_zero_std']:.2f} | "
            f"loss {m['loss']:.4f} | kl {m['kl']:.4f} | " + (f"clip {m['clip/low_frac']:.3f}/{m['clip/high_frac']:.3f} | "
                                                        if 'clip/low_frac' in m else '') + f"ent {m['entropy']:.3f} | "
            f"gnorm {m['grad_norm']:.3f} | len {m['response_len/mean']:.0f} | {m['timing_s/step']:.1f}s (gen "
            f"{m['timing_s/gen']:.1f} rew {m['timing_s/reward']:.1f} ref {m['timing_s/ref']:.1f} old "
            f"{m['timing_s/old_logprob']:.1f} upd {m['timing_s/update']:.1f}) | mem {m['mem/peak_gb']:.2f}GB")


def zero_reward_report(guards, sc, patience):
    """The stop message when the reward mean has been 0 (or every reward failed) for `patience`
    steps in a row."""
    errs = {k: v for k, v in sc['errors'].items() if v}
    means = {k: round(sum(v) / max(len(v), 1), 4) for k, v in sc['per_fn'].items()}
    models = [k for k in sc['per_fn'] if k in MODEL_REWARDS]
    return (f"reward mean has been 0 (or every reward failed) for {guards['zero_streak']} steps in a row "
            f"(zero_reward_patience={patience}).\nReward means this step: {means}; errors: {errs or 'none'} "
            f"{sc['error_msgs'][:3]}\nRecent completions:\n" + '\n---\n'.join(x[:300] for x in guards['recent']) +
            "\nCheck the reward function, the prompt format and max_new_tokens." +
            ''.join(f"\n{k}: " + model_reward_hint(k, {f'reward/{k}/mean': means[k]}) for k in models))


def start_watchdog(last_progress, watchdog_s, out_dir, exit_after):
    """A daemon thread: when last_progress[0] (a time.time() the loop refreshes) is older than
    watchdog_s, dump every thread's stack to stderr and out_dir/watchdog_stacks.txt, once per stall;
    exit_after: then exit with code 4."""
    def watch():
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
                if exit_after:
                    os._exit(4)
    if watchdog_s > 0:
        threading.Thread(target=watch, daemon=True).start()


def catch_signals(again_after_s=1.0):
    """The first SIGINT/SIGTERM is noted, not acted on: the loop checkpoints at the end of the step
    and exits 128 + signal. A second one, at least again_after_s later (a repeat within it is the
    same Ctrl-C reaching us twice, e.g. through torchrun), exits at once without a checkpoint: for a
    step stuck in a collective or a long generation."""
    caught = []

    def on_signal(sig, frame):
        if caught and time.time() - caught[1] >= again_after_s:
            os.write(2, f"signal {sig} again: exiting now, no checkpoint (the newest one on disk stays)\n".encode())
            os._exit(128 + sig)
        if not caught:
            caught.extend([sig, time.time()])
            os.write(1, f"signal {sig}: saving at the end of this step, then exiting (again to exit now)\n".encode())
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)
    return caught


def injected_stall(seconds):  # testing (fault_stall_step): named so the watchdog's stack dump points straight at it
    if seconds > 0:
        time.sleep(seconds)
