"""
Run safety: what makes a failing run loud. Per-step warnings that name the cause and the fix, guards
that decide when to roll back or stop, a watchdog that dumps every thread's stack when nothing
moves, signal handling that checkpoints before exiting, and the testing hooks that inject faults.

The guards' state is one dict (new_guards), saved with each checkpoint, so a resumed run remembers
its streaks.
"""
import faulthandler
import math
import os
import signal
import sys
import threading
import time

import torch

from parallel import finish, hard_exit
from reward import MODEL_REWARDS

# a model reward that ties all G completions in more than this share of groups is likely broken
SPREAD_WARN = 0.5


def new_guards():
    return {'nan_streak': 0, 'zero_streak': 0, 'kl_hist': [], 'recent': [], 'warn_counts': {}}


def stop(msg, master, code=3):
    """A guard decided the run cannot go on: say why in plain words, leave the last good checkpoint,
    exit non-zero. (Every rank stops here: guards decide from numbers all ranks share; one says
    why.)"""
    if master:
        print(f"\n{'=' * 100}\nSTOPPED: {msg}\n{'=' * 100}", file=sys.stderr, flush=True)
    finish(code)


def bad_knob(c):
    """The first knob whose value the run cannot use, as a one-line error (None: all fine)."""
    from loss import ADVANTAGES, KL_ESTIMATORS, LOSS_AGGS, LOSS_TYPES, TIS_MODES
    choices = {
        'loss_agg': LOSS_AGGS,
        'lr_schedule': ('cosine', 'linear', 'constant'),
        'export_best_mode': ('max', 'min'),
        'resume': ('auto', 'never'),
        'kl_estimator': KL_ESTIMATORS,
        'advantage': ADVANTAGES,
        'cispo_bounds': ('high', 'both'),
        'on_kl_max': ('rollback', 'stop'),
        'loss_type': LOSS_TYPES,
        'scale_rewards': ('group', 'batch', 'none'),
        'tis': ('',) + TIS_MODES,
        'export_dtype': ('', 'float32', 'bfloat16', 'float16'),
        'share_prompt': (True, False, 'auto'),
        'packed_attention': ('auto', 'flex', 'sdpa'),
        'deterministic': (None, True, False),
        'dtype': ('float32', 'bfloat16', 'float16'),
    }
    for key, allowed in choices.items():
        if c[key] not in allowed:
            return f"--{key}={c[key]!r}: expected one of {allowed}"
    error = bad_device(c['device']) or bad_range(c)
    if error is not None:
        return error
    if c['group_size'] < 2:
        return (f"--group_size={c['group_size']}: GRPO needs at least 2 samples per prompt "
                "to compare them")
    if c['mini_batches'] > c['batch_prompts']:
        return (f"--mini_batches={c['mini_batches']}: each mini-batch holds whole groups, at most "
                f"batch_prompts={c['batch_prompts']} of them")
    error = bad_objective_knob(c)
    if error is not None:
        return error
    if c['eval_samples'] == 1 or c['eval_samples'] < 0:
        return (f"--eval_samples={c['eval_samples']}: sampled completions per evaluation problem, "
                ">= 2 for pass@k and mean@k (0 = greedy pass@1 only)")
    if c['early_stop'] and not c['export_best']:
        return (f"--early_stop={c['early_stop']}: it counts evaluations without a new best of export_best's "
                "metric; set --export_best (e.g. 'eval/pass@1')")
    if c['export_best'] and c['eval_every'] <= 0:
        return (f"--export_best={c['export_best']!r}: the best weights are judged at each "
                "evaluation, and eval_every = 0 runs none")
    return None


# knob -> (the values it can take, what it is): a value outside is refused before anything runs
RANGES = {
    'lr': (lambda v: v >= 0, "the peak learning rate, >= 0"),
    'early_stop': (lambda v: v >= 0, "evaluations without a new best before the run stops, >= 0 (0 = never)"),
    'sft_lr': (lambda v: v >= 0, "the warm start's peak learning rate, >= 0"),
    'temperature': (lambda v: v > 0, "the sampling temperature, > 0: the loss's log-probs are "
                                     "taken at it, and greedy groups would not differ"),
    'eval_temperature': (lambda v: v >= 0, "the sampled evaluations' temperature, >= 0"),
    'top_p': (lambda v: 0 < v <= 1, "the probability mass sampled from, in (0, 1]; 1.0 = off"),
    'top_k': (lambda v: v >= 0, "the most likely tokens sampled from, >= 0; 0 = off"),
    'min_p': (lambda v: 0 <= v < 1, "the least probability drawn, as a share of the most likely "
                                    "token's, in [0, 1); 0.0 = off"),
    'stop_strings': (lambda v: all(isinstance(x, str) and x for x in v),
                     "strings that end a completion: a list of non-empty str"),
    'peak_flops': (lambda v: v >= 0, "the device's peak FLOP/s, >= 0; 0 = by the GPU's name"),
    'peak_bandwidth': (lambda v: v >= 0, "the device's peak memory bytes/s, >= 0; 0 = by the GPU's name"),
    'cov_ratio': (lambda v: 0 < v <= 1, "the share of the step's tokens Clip-Cov or KL-Cov picks, in (0, 1]"),
    'clip_cov_bounds': (lambda v: len(v) == 2, "Clip-Cov's covariance range, (low, high)"),
    'kl_cov_coef': (lambda v: v >= 0, "KL-Cov's penalty weight, >= 0"),
    'beta': (lambda v: v >= 0, "the KL penalty's weight, >= 0; 0 = no reference model"),
    'teacher_coef': (lambda v: v >= 0, "the weight of the teacher's per-token signal, >= 0"),
    'weight_decay': (lambda v: v >= 0, "AdamW's decay, >= 0"),
    'grad_clip': (lambda v: v >= 0, "the gradient norm's cap, >= 0; 0 = off"),
    'adam_betas': (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v),
                   "AdamW's (beta1, beta2), each in [0, 1)"),
    'min_lr_ratio': (lambda v: 0 <= v <= 1, "the decay's floor as a share of lr, in [0, 1]"),
    'max_steps': (lambda v: v >= 0, "GRPO steps, >= 0"),
    'epochs': (lambda v: v >= 0, "passes over the training set, >= 0; 0 = max_steps decides"),
    'warmup_steps': (lambda v: v >= 0, "steps of linear warmup, >= 0"),
    'sft_steps': (lambda v: v >= 0, "warm-start steps, >= 0"),
    'eval_examples': (lambda v: v >= 0, "held-out problems per evaluation, >= 0; 0 = all"),
    'eval_every': (lambda v: v >= 0, "steps between evaluations, >= 0; 0 = never"),
    'save_every': (lambda v: v >= 0, "steps between checkpoints, >= 0; 0 = at the end only"),
    'eps_low': (lambda v: 0 <= v < 1, "the PPO clip below 1, in [0, 1)"),
    'eps_high': (lambda v: v >= 0, "the PPO clip above 1, >= 0"),
    'adv_eps': (lambda v: v >= 0, "added to the reward spread before dividing by it, >= 0"),
    'sapo_tau_pos': (lambda v: v > 0, "SAPO's gate temperature for A > 0, > 0"),
    'sapo_tau_neg': (lambda v: v > 0, "SAPO's gate temperature for A <= 0, > 0"),
    'vespo_k_pos': (lambda v: v >= 0, "VESPO's power of the ratio for A >= 0, >= 0"),
    'vespo_k_neg': (lambda v: v >= 0, "VESPO's power of the ratio for A < 0, >= 0"),
    'vespo_lambda_pos': (lambda v: v > 0, "VESPO's decay past the peak for A >= 0, > 0"),
    'vespo_lambda_neg': (lambda v: v > 0, "VESPO's decay past the peak for A < 0, > 0"),
    'off_policy_mask': (lambda v: v >= 0, "the KL(sampler || policy) per token past which "
                                          "completions with A < 0 are masked, >= 0; 0 = off"),
    'ref_sync_every': (lambda v: v >= 0, "steps between moves of the KL reference, >= 0; "
                                         "0 = never"),
    'ref_sync_alpha': (lambda v: 0 < v <= 1, "the policy's share in the moved reference, in "
                                             "(0, 1]; 1 = a reset"),
    'kl_clamp': (lambda v: v > 0, "the bound on log ratios before the KL estimate, > 0"),
    'kl_max': (lambda v: v > 0, "the KL past which the run rolls back or stops, > 0"),
    'rollback_lr_scale': (lambda v: 0 < v <= 1, "the learning rate's factor at a rollback, in (0, 1]"),
    'drop_easy': (lambda v: v >= 0, "the mean group reward past which a problem is not drawn "
                                    "again, >= 0; 0 = off"),
    'dynamic_sampling': (lambda v: v >= 0, "the number of extra rounds of prompts, >= 0"),
    'export_best': (lambda v: v == '' or v.startswith('eval/'), "an eval/ metric to keep the "
                                                                "best weights of, e.g. "
                                                                "'eval/pass@1'; '' = off"),
    'micro_batch_tokens': (lambda v: v >= 0, "the most tokens a forward pass takes as padded, >= "
                                             "0; 0 = micro_batch_size rows alone"),
    'max_prompt_len': (lambda v: v >= 0, "the longest prompt trained or evaluated on, in "
                                         "tokens, >= 0; 0 = all that max_seq_len leaves"),
    'eval_max_new_tokens': (lambda v: v >= 0, "tokens per evaluation completion, >= 1 "
                                              "(0 = max_new_tokens)"),
}
# knob -> what it counts: each at least 1
COUNTS = {'max_new_tokens': 'tokens per completion', 'batch_prompts': 'prompts per step',
          'micro_batch_size': 'rows per forward pass',
          'num_iterations': 'optimizer steps per rollout batch',
          'mini_batches': 'mini-batches (optimizer steps) per iteration',
          'sft_batch_size': 'sequences per warm-start step',
          'eval_batch_size': 'problems per evaluation batch',
          'nan_patience': 'non-finite steps in a row before a rollback',
          'zero_reward_patience': 'zero-reward steps in a row before the stop'}
RANGES.update({key: (lambda v: v >= 1, f"the number of {what}, >= 1")
               for key, what in COUNTS.items()})


def bad_range(c, ranges=RANGES):
    """The first knob of ranges whose value is outside what it can take, as one line."""
    for key, (ok, what) in ranges.items():
        try:
            fine = ok(c[key])
        except TypeError:  # a tuple's length, a number compared with a tuple
            fine = False
        if not fine:
            return f"--{key}={c[key]!r}: {what}"
    return None


def bad_device(device):
    """--device as torch reads it, and CUDA only where this torch sees a GPU (one line, else None)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        return f"--device={device!r}: {e}"
    if dev.type != 'cuda':
        return None
    if not torch.cuda.is_available():
        return (f"--device={device!r}: torch {torch.__version__} sees no CUDA GPU on this machine; "
                "--device=cpu runs on the CPU")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        return f"--device={device!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)"
    return None


def bad_objective_knob(c):
    """The objective's knobs that only make sense together, as a one-line error (None: fine)."""
    if c['clip_ratio_c'] != 0 and c['clip_ratio_c'] <= 1:
        return (f"--clip_ratio_c={c['clip_ratio_c']}: the dual clip's cap on the ratio of tokens "
                "with A < 0 must be > 1 (verl uses 3.0); 0 = off")
    if c['clip_ratio_c'] > 0 and c['loss_type'] in ('cispo', 'sapo', 'vespo', 'kl_cov', 'gmpo'):
        return ("--clip_ratio_c: the dual clip caps the PPO clip of 'grpo', 'gspo' and 'clip_cov'; "
                "CISPO clips its weight instead (cispo_bounds), SAPO gates it (sapo_tau_pos/neg), "
                "VESPO weighs the sequence (vespo_k_pos/neg, vespo_lambda_pos/neg), KL-Cov has no "
                "clip (kl_cov_coef), GMPO clips log ratios (eps_low/eps_high)")
    lo, hi = c['clip_cov_bounds']
    if not lo < hi:
        return (f"--clip_cov_bounds={c['clip_cov_bounds']}: the covariance range Clip-Cov draws from, "
                "(low, high) with low < high (verl: (1.0, 5.0))")
    if c['loss_type'] == 'vespo' and c['tis'].startswith('sequence'):
        return (f"--tis={c['tis']!r}: VESPO takes the per-token weights into its sequence's "
                "importance weight; use 'token_truncate' or 'token_mask', as TRL requires")
    if not 0 <= c['tis_min'] < c['tis_cap']:
        return (f"--tis_min={c['tis_min']}: the lower bound on pi_train / pi_sampler, >= 0 and "
                f"below tis_cap={c['tis_cap']}")
    if not 0 <= c['top_entropy_quantile'] <= 1:
        return (f"--top_entropy_quantile={c['top_entropy_quantile']}: the share of tokens (by "
                "entropy) trained on, in [0, 1] (1 = all)")
    if c['adaptive_entropy'] and not (0 <= c['entropy_coef_min'] <= c['entropy_coef_max']):
        return (f"--entropy_coef_min={c['entropy_coef_min']}, --entropy_coef_max="
                f"{c['entropy_coef_max']}: adaptive entropy needs 0 <= min <= max")
    if c['ref_sync_every'] and not c['beta']:
        return (f"--ref_sync_every={c['ref_sync_every']}: there is no KL reference to move with "
                "beta = 0")
    if c['ref_sync_reset_optimizer'] and not c['ref_sync_every']:
        return ("--ref_sync_reset_optimizer=True: it resets the optimizer at each move of the KL "
                "reference, and ref_sync_every = 0 moves none")
    if c['ref_sync_every'] and c['lora_rank']:
        return (f"--ref_sync_every={c['ref_sync_every']}: with LoRA the reference is the base "
                "weights (the adapters off); moving it would mean merging the adapters into them")
    if c['advantage'] == 'none' and not c['teacher']:
        return ("--advantage='none': the rewards would train nothing; it is for on-policy distillation "
                "from a teacher alone (set --teacher)")
    own_scale = ('rloo', 'reinforce_pp', 'reinforce', 'maxrl', 'gdpo', 'opo')
    if c['advantage'] in own_scale and c['scale_rewards'] != 'group':
        return (f"--scale_rewards={c['scale_rewards']!r}: advantage={c['advantage']!r} has its own "
                "scale; scale_rewards applies to 'grpo' and 'passk' only")
    return None


def startup_warnings(c):
    """Settings that run, but not as their user may think: said once, before anything is spent."""
    if c['top_k'] > 0 or c['top_p'] < 1.0 or c['min_p'] > 0:
        print(f"WARNING [off_policy_sampling]: top_k={c['top_k']}, top_p={c['top_p']}, min_p="
              f"{c['min_p']} truncate the sampler's distribution, while the loss scores tokens "
              "under the full softmax: training is off-policy; use top_k=0, top_p=1.0, min_p=0.0 "
              "for on-policy GRPO", flush=True)
    if c['filter_zero_std'] and (c['beta'] or c['entropy_coef'] or c.get('adaptive_entropy')):
        print("note: filter_zero_std is off while beta or entropy_coef > 0: groups with equal "
              "rewards still have a KL or entropy gradient, so they are trained on", flush=True)
    if c['device'] == 'cpu':
        busy = cpu_contention()
        if busy:
            print(f"WARNING [cpu_contention]: {busy}", flush=True)


def cpu_contention(load=None, cores=None, threads=None):
    """A line when other processes already keep the CPU busy and torch would run several threads per
    op: they then wait on each other at every op's barrier, and a step can take several times as
    long as with one thread (measured on 2 cores at load 4-8: a warm-start step of the offline demo
    3.1-6.0 s with 2 threads, 0.54-2.0 s with 1)."""
    if load is None and hasattr(os, 'getloadavg'):
        load = os.getloadavg()[0]
    cores = cores or os.cpu_count() or 1
    threads = threads or torch.get_num_threads()
    if load is None or threads < 2 or load < cores - 0.5:
        return None
    return (f"the load average is {load:.1f} on {cores} CPU cores before this run starts, "
            f"and torch runs {threads} threads per op: contending threads make every step "
            "several times slower; run alone, or set OMP_NUM_THREADS=1 "
            "(or torch.set_num_threads) while the machine is shared")


def warn(guards, m, *, skipped, max_new_tokens, kl_warn=None, micro=(1, 0, 1)):
    """Print this step's warnings (each names a cause and a fix) and return the warn/* counters for
    the metrics. m: the step's metrics row; kl_warn: None when there is no reference model (no KL is
    measured); micro: (micro_batch_size, micro_batch_tokens, ranks)."""
    n_tok = m['tokens_trained']
    warns = []
    if m['frac_zero_std'] == 1.0 and 'teacher/reverse_kl' not in m:  # a teacher trains tied groups too
        warns.append(('all_zero_std', "every group got identical rewards: all advantages are "
                      "zero, so the loss is zero by construction; raise temperature or group_size, "
                      "check the reward"))
    if n_tok == 0 and m['frac_zero_std'] < 1.0:
        warns.append(('no_tokens', "no completion tokens to train on this step "
                      "(all filtered or masked: see mask_truncated / filter_zero_std / "
                      "void_turn_filter)"))
    if n_tok > 0 and abs(m['logprob/mean']) < 1e-3:
        warns.append(('logp_zero', "sampled tokens have log-prob ~0: the policy is "
                      "near-deterministic at this temperature, so groups barely differ; "
                      "raise temperature"))
    if not skipped and m['loss'] == 0.0 and m['grad_norm'] == 0.0:
        warns.append(('zero_loss_and_grad', "loss and grad norm are exactly 0: nothing is being "
                      "learned; check rewards and advantages (see reward/std, frac_zero_std)"))
    if m['response_len/clip_frac'] > 0.5:
        warns.append(('truncated', f"{m['response_len/clip_frac']:.0%} of completions hit "
                      f"max_new_tokens={max_new_tokens}: raise max_new_tokens, or add the 'length' "
                      "overlong penalty; their answers are likely missing"))
    for name in MODEL_REWARDS:
        tied = m.get(f'reward/{name}/frac_zero_std', 0.0)
        if tied > SPREAD_WARN:
            warns.append((f'{name}_zero_spread',
                          f"{name} gave all completions of a group the same score "
                          f"in {tied:.0%} of groups: " + model_reward_hint(name, m)))
    if m.get('dynamic/groups_short', 0) > 0:
        warns.append(('dynamic_short', f"dynamic sampling found {m['dynamic/groups_short']} "
                      f"groups too few with a reward spread in {m['dynamic/rounds']} rounds "
                      f"({m['dynamic/prompts']} prompts drawn), so this step trains on fewer: most "
                      "prompts are all-right or all-wrong for the policy; raise dynamic_sampling, "
                      "group_size or temperature, or use harder/easier data"))
    if m.get('off_policy/masked_frac', 0.0) > 0.5:
        warns.append(('off_policy_masked', f"the off-policy mask took {m['off_policy/masked_frac']:.0%} "
                      "of the trained tokens out of the policy gradient: the policy moved far from "
                      "the sampler within the step, or the sampler's numerics differ from the "
                      "trainer's (logprob_gen_vs_train); lower lr, num_iterations or mini_batches, "
                      "or raise off_policy_mask"))
    if m.get('vespo/phi_mean', 1.0) < 0.1:
        warns.append(('vespo_phi_low', f"VESPO's sequence weight averaged {m['vespo/phi_mean']:.3f}: "
                      "the whole-sequence ratios are far from 1 (long completions sum small per-token "
                      "gaps), so little trains; lower lr, num_iterations or mini_batches, turn tis "
                      "off, or flatten the weight (lower vespo_lambda_pos/neg)"))
    rows, passes = m.get('rows_trained', 0), m.get('micro_batches', 0) * micro[2]
    if micro[1] > 0 and micro[0] > 1 and 1 < rows <= passes:
        warns.append(('micro_batch_tokens', f"micro_batch_tokens={micro[1]} left one row (or fewer) a "
                      f"pass: {rows} rows in {passes} passes, where micro_batch_size={micro[0]} allows "
                      f"{micro[0]}; each pass is a forward and backward of its own, so the update is "
                      "slow; raise micro_batch_tokens to a few times the longest row's tokens"))
    guards['kl_hist'] = (guards['kl_hist'] + [m['kl']])[-10:]
    if kl_warn is not None and m['kl'] > kl_warn:
        warns.append(('kl', f"KL to the reference {m['kl']:.4f} > kl_warn={kl_warn} (last steps: "
                      f"{[round(k, 4) for k in guards['kl_hist']]}); lower lr or raise beta"))
    for key, msg in warns:
        guards['warn_counts'][key] = guards['warn_counts'].get(key, 0) + 1
        print(f"WARNING [{key}]: {msg}", flush=True)
    return {f'warn/{k}': v for k, v in guards['warn_counts'].items()}


def guard(guards, m, sc, texts, *, skipped, nan_patience, kl_max=None):
    """Update the streaks from this step's metrics m (sc: its scores, texts: its completions) and
    print what the guards saw. Returns (action, finite): action None, ('rollback', why) for a
    non-finite streak at nan_patience, or ('kl', why) for KL above kl_max (None: no reference
    model), which the caller turns into a rollback or a stop (on_kl_max)."""
    step = m['step']
    finite = math.isfinite(m['loss']) and math.isfinite(m['grad_norm'])
    if finite or skipped:
        guards['nan_streak'] = 0
    else:
        guards['nan_streak'] += 1
    if m['reward/mean'] == 0.0 or sc['all_failed']:
        guards['zero_streak'] += 1
    else:
        guards['zero_streak'] = 0
    guards['recent'] = (guards['recent'] + texts[:2])[-6:]
    decision = None
    if not finite and not skipped:
        print(f"guard: non-finite loss/grad at step {step} "
              f"(loss {m['loss']}, grad norm {m['grad_norm']}); "
              f"update skipped ({guards['nan_streak']}/{nan_patience} in a row)", flush=True)
        if guards['nan_streak'] >= nan_patience:
            decision = ('rollback', f"{guards['nan_streak']} non-finite steps in a row")
    if sc['all_failed']:
        done = 'no update applied' if skipped else "the update went on (advantage='none': rewards train nothing)"
        print(f"guard: every reward call failed at step {step}; {done}. errors: {sc['error_msgs'][:3]}",
              flush=True)
    if kl_max is not None and m['kl'] > kl_max:
        trend = [round(k, 4) for k in guards['kl_hist']]
        decision = ('kl', f"KL {m['kl']:.4f} > kl_max={kl_max} "
                          f"(trend over the last steps: {trend})")
    return decision, finite


def model_reward_hint(name, m):
    """What to check when a model reward gives no signal: said by the zero-spread warning and the
    zero-reward stop."""
    template = 'its chat template' if name == 'reward_model' else 'the template'
    clip = m.get('response_len/clip_frac')
    truncated = '' if clip is None else f"; {clip:.0%} truncated"
    mean = m.get(f'reward/{name}/mean', 0)
    return (f"check that its 'path' is the scorer you meant (see the 'reward: loaded' line), "
            f"that {template} shows it the prompt and the whole completion (truncated completions "
            f"score alike{truncated}), and that its scores are not saturated "
            f"(reward/{name}/mean {mean:.3f}; a judge's P(yes) stuck at 0 or 1 ties every group)")


def zero_reward_report(guards, sc, patience):
    """The stop message when the reward mean has been 0 (or every reward failed) for `patience`
    steps in a row."""
    errs = {k: v for k, v in sc['errors'].items() if v}
    means = {}
    for k, v in sc['per_fn'].items():
        v = [x for x in v if x is not None]  # the samples it applies to
        means[k] = round(sum(v) / max(len(v), 1), 4)
    recent = '\n---\n'.join(x[:300] for x in guards['recent'])
    msg = (f"reward mean has been 0 (or every reward failed) for {guards['zero_streak']} steps "
           f"in a row (zero_reward_patience={patience}).\nReward means this step: {means}; "
           f"errors: {errs or 'none'} {sc['error_msgs'][:3]}\nRecent completions:\n{recent}"
           "\nCheck the reward function, the prompt format and max_new_tokens.")
    for k in sc['per_fn']:
        if k in MODEL_REWARDS:
            msg += f"\n{k}: " + model_reward_hint(k, {f'reward/{k}/mean': means[k]})
    return msg


# ----------------------------------------------------------------------------- watchdog and signals

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
                msg = (f"\nwatchdog: no progress for {stalled:.0f}s (watchdog_s={watchdog_s}); "
                       "stacks of every thread:\n")
                with open(os.path.join(out_dir, 'watchdog_stacks.txt'), 'a') as f:
                    for stream in (sys.stderr, f):
                        stream.write(msg)
                        stream.flush()
                        faulthandler.dump_traceback(file=stream, all_threads=True)
                if exit_after:
                    hard_exit(4)
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
            msg = f"signal {sig} again: exiting now, no checkpoint (the newest one on disk stays)\n"
            os.write(2, msg.encode())
            hard_exit(128 + sig)
        if not caught:
            caught.extend([sig, time.time()])
            msg = (f"signal {sig}: saving at the end of this step, then exiting "
                   "(again to exit now)\n")
            os.write(1, msg.encode())
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)
    return caught


# ------------------------------------------------------------------------ CUDA out of memory

# train_grpo.py's functions -> the phase an out-of-memory error inside them stopped (the innermost
# one on the traceback names it; none: start-up)
OOM_PHASES = {'sample_step': 'generation', 'rollout': 'generation', 'run_eval': 'evaluation',
              'eval_set_metrics': 'evaluation', 'side_logprobs': 'old/reference log-probs',
              'update': 'update', 'micro_loss': 'update', 'sft_logprobs': 'warm start'}


def oom_phase(tb, script):
    """The phase a traceback was in: OOM_PHASES of the innermost of its frames that runs one of
    script's (train_grpo.py's) functions named there, else 'start-up'."""
    phase = 'start-up'
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename == script and code.co_name in OOM_PHASES:
            phase = OOM_PHASES[code.co_name]
        tb = tb.tb_next
    return phase


def oom_report(phase, c, sizes, mem):
    """What a run that ran out of device memory in phase can change, the sizes behind it first.
    c: the run's knobs; sizes (GiB, and the KV cache's shape): 'weights', 'train_state' (gradients
    and AdamW moments), 'sampler' (the sampler's own copy; 0: none), 'kv_cache' at 'kv_rows' x
    'kv_positions'; mem (GiB): 'allocated', 'reserved', 'total' on the device when it failed."""
    gib = '{:.3g} GiB'.format
    held = ''
    if mem['total']:
        held = f": {gib(mem['allocated'])} allocated, {gib(mem['reserved'])} reserved, of {gib(mem['total'])}"
    lines = [f"CUDA ran out of memory during {phase}{held}. Held for the whole run: weights "
             f"{gib(sizes['weights'])}, gradients and AdamW state {gib(sizes['train_state'])}, the "
             f"sampler's copy {gib(sizes['sampler'])}."]
    mbt = f" and micro_batch_tokens={c['micro_batch_tokens']}" if c['micro_batch_tokens'] else ''
    if phase == 'generation':
        lines.append(f"Generation holds a KV cache of {sizes['kv_rows']} rows (batch_prompts={c['batch_prompts']} x "
                     f"group_size={c['group_size']} per process) x up to {sizes['kv_positions']} positions: "
                     f"{gib(sizes['kv_cache'])}. Fix: fewer rows per GPU (a lower batch_prompts, or torchrun over "
                     f"more GPUs: each samples its share), or a lower max_new_tokens={c['max_new_tokens']}.")
    elif phase == 'evaluation':
        lines.append(f"Evaluation decodes eval_batch_size={c['eval_batch_size']} problems at once (each "
                     f"eval_samples={c['eval_samples']} times when >= 2). Fix: a lower eval_batch_size; it does "
                     f"not change the run.")
    elif phase in ('update', 'old/reference log-probs'):
        fix = (f"A pass holds the activations of up to micro_batch_size={c['micro_batch_size']} rows{mbt}. "
               f"Fix: halve micro_batch_size, or cap a pass's tokens with micro_batch_tokens (packed rows, up to "
               f"that many tokens each)")
        if phase == 'update' and not c['grad_checkpoint']:
            fix += "; grad_checkpoint=True keeps only each block's input and recomputes the rest in backward"
        lines.append(fix + '.')
    elif phase == 'warm start':
        lines.append(f"The warm start holds sft_batch_size={c['sft_batch_size']} sequences a step. Fix: a lower "
                     f"sft_batch_size.")
    if not c['lora_rank'] and 0 < mem['total'] < 4 * sizes['train_state']:
        lines.append(f"LoRA (--lora_rank=32 --lr=1e-5, and --lora_base_dtype=bfloat16) trains adapters only and "
                     f"frees most of the {gib(sizes['train_state'])} of gradients and AdamW state; torchrun with "
                     f"--fsdp=True shards them over GPUs.")
    spare = mem['reserved'] - mem['allocated']
    if mem['total'] and spare > 0.1 * mem['total']:
        lines.append(f"{gib(spare)} is reserved by PyTorch but unallocated (fragmentation): "
                     f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True may be enough.")
    if phase != 'evaluation':
        lines.append("Then rerun the same command with the change: it resumes from the newest checkpoint "
                     "(add --resume_changed=True: these knobs change the run's float rounding).")
    return '\n'.join(lines)


def device_memory(device):
    """GiB 'allocated', 'reserved' and in 'total' on a CUDA device; zeros elsewhere."""
    if torch.device(device).type != 'cuda' or not torch.cuda.is_available():
        return {'allocated': 0.0, 'reserved': 0.0, 'total': 0.0}
    return {'allocated': torch.cuda.memory_allocated(device) / 2**30,
            'reserved': torch.cuda.memory_reserved(device) / 2**30,
            'total': torch.cuda.get_device_properties(device).total_memory / 2**30}


def explain_out_of_memory(script, c, sizes, device, rank=0):
    """From here on, a torch.OutOfMemoryError that ends the run prints, after its traceback, the
    phase it stopped (oom_phase) and what to change (oom_report; sizes() gives its sizes). Anything
    else is reported as before."""
    before = sys.excepthook

    def hook(kind, value, tb):
        before(kind, value, tb)
        if issubclass(kind, torch.OutOfMemoryError):
            who = f"rank {rank}: " if rank else ''
            report = oom_report(oom_phase(tb, script), c, sizes(), device_memory(device))
            print(f"\n{'=' * 100}\n{who}{report}\n{'=' * 100}", file=sys.stderr, flush=True)
    sys.excepthook = hook


# ------------------------------------------------------------------------ testing: injected faults

def injected_faults(step, nan_steps, stall_step, stall_s, oom_steps=()):
    """The fault_* knobs, for the tests of the guards, the watchdog and the out-of-memory report:
    sleeps stall_s if this is stall_step, and says what this step's update is to meet: 'nan' (its
    loss made NaN), 'oom' (torch.OutOfMemoryError at its first pass) or None."""
    if step == stall_step:
        injected_stall(stall_s)
    if step in oom_steps:
        return 'oom'
    return 'nan' if step in nan_steps else None


def injected_oom():
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by fault_oom_steps)")


def injected_kill(done, at):
    """fault_kill_opt_step: SIGKILL this process right after its `at`-th GRPO optimizer step, as a
    kill at that instant would (no handler runs, nothing is saved)."""
    if done == at:
        os.kill(os.getpid(), signal.SIGKILL)


def kill_after(at):
    """fault_kill_opt_step as an optimizer step hook (torch's register_step_post_hook): counts the
    optimizer steps taken from now and calls injected_kill after each."""
    done = [0]

    def hook(optimizer, args, kwargs):
        done[0] += 1
        injected_kill(done[0], at)
    return hook


def injected_stall(seconds):  # named so the watchdog's stack dump points straight at it
    if seconds > 0:
        time.sleep(seconds)
