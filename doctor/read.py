"""
Reading a run's logs into the doctor's series: each source's metric names map onto the few series
of SERIES through a table (OURS, TRL, VERL, WANDB, OPENRLHF, PRIME_RL, CONSOLE, NANOCHAT); names a
table does not know are counted in the report and listed in --json, never dropped unsaid. load(path)
finds the log of a path (an out_dir, a TRL output directory or checkpoint, a verl, nanochat or
nanoGPT console log, a W&B history CSV, TensorBoard event files) and returns the run: {step: value}
per series, the unknown names and one line per unreadable row.
"""
import ast
import collections
import csv
import fnmatch
import json
import math
import os
import re

import doctor.tfevents as tfevents

# ------------------------------------------------------------------------------------ the series
SERIES = {  # what every source is mapped onto
    'reward': 'reward mean over the step\'s completions',
    'reward_std': 'reward std over the step\'s completions',
    'reward_max': 'highest reward of the step', 'reward_min': 'lowest reward of the step',
    'zero_std_frac': 'share of groups whose rewards all tie (no signal)',
    'teacher_kl': "per-token KL to an on-policy distillation teacher (its signal trains tied groups)",
    'loss': 'the optimized loss',
    'grad_norm': 'gradient norm before clipping',
    'kl': 'KL to the reference model',
    'entropy': 'per-token entropy of the policy',
    'resp_len': 'mean completion length',
    'trunc_frac': 'share of completions that hit the length limit',
    'clip_frac': 'share of tokens the PPO clip cut (clip_low + clip_high when not logged)',
    'clip_low': 'share clipped below', 'clip_high': 'share clipped above',
    'step_time': 'seconds per step (the sum of its phases when only they are logged)',
    'time_gen': 'generation', 'time_reward': 'reward', 'time_ref': 'reference log-probs',
    'time_old': 'old log-probs', 'time_teacher': "a distillation teacher's log-probs",
    'time_values': 'critic values',
    'time_adv': 'advantages (with the reward, in verl before 0.4)', 'time_update': 'update',
    'time_critic': 'critic update', 'time_eval': 'validation', 'time_save': 'checkpoint',
    'time_compile': 'torch.compile building graphs (inside the phases)',
    'compile_graphs': 'graphs torch.compile built in the step',
    'throughput': 'tokens per second per GPU',
    'mem_gb': 'peak device memory, GB',
    'mem_frac': 'device memory in use, share of the device',
    'gen_hbm_frac': "generation's memory traffic, share of the device's bandwidth",
    'heldout': 'held-out accuracy (greedy pass@1, validation score; the mean over sources)',
}
PHASES = ['time_gen', 'time_reward', 'time_ref', 'time_old', 'time_teacher', 'time_values', 'time_adv',
          'time_update', 'time_critic', 'time_eval', 'time_save']  # seconds per step in each
OUTSIDE_WORK = ['time_eval', 'time_save']  # inside verl's step time, slow by design: left out
MEAN_OVER_NAMES = {'heldout'}  # several names of one row for it (one per data source): their mean

# A table maps a source's metric name to a series; None: known, not diagnosed; (series, scale):
# multiplied on reading. A '*' in a name matches any text ('rewards/*', 'val-core/*/mean@*'); of
# the patterns of a table that match, the longest wins. To read another trainer, add its names to
# the table of its format (or a new dict to TABLES, for JSON lines and CSV):
# {'my/score': 'reward', 'my/val_acc': 'heldout'}.
OURS = {  # metrics.jsonl (docs/metrics.md)
    'reward/mean': 'reward', 'reward/std': 'reward_std', 'frac_zero_std': 'zero_std_frac',
    'loss': 'loss', 'grad_norm': 'grad_norm', 'kl': 'kl', 'entropy': 'entropy',
    'response_len/mean': 'resp_len', 'response_len/clip_frac': 'trunc_frac',
    'clip/low_frac': 'clip_low', 'clip/high_frac': 'clip_high', 'timing_s/step': 'step_time',
    'timing_s/gen': 'time_gen', 'timing_s/reward': 'time_reward', 'timing_s/ref': 'time_ref',
    'timing_s/old_logprob': 'time_old', 'timing_s/update': 'time_update',
    'timing_s/teacher': 'time_teacher', 'mem/peak_gb': 'mem_gb', 'eval/pass@1': 'heldout',
    'perf/gen_hbm_frac': 'gen_hbm_frac',
    'step': None, 'lr': None, 'kl_coef': None, 'pg_loss': None, 'reward/*': None, 'ratio/*': None,
    'kl_old_new': None, 'rows_trained': None, 'tokens_trained': None, 'packed': None,
    'micro_batches': None,
    'logprob/mean': None, 'logprob_gen_vs_train': None, 'response_len/max': None,
    'timing_s/eval': None, 'mem/allocated_gb': None, 'mem/reserved_gb': None, 'perf/*': None,
    'timing_s/compile': 'time_compile', 'compile/graphs': 'compile_graphs',
    'eval/*': None, 'warn/*': None, 'guard/*': None, 'dynamic/*': None, 'tis/*': None,
    'off_policy/*': None, 'vespo/*': None, 'data/*': None, 'entropy_coef': None,
    'entropy_cut': None, 'clip/*': None, 'mix/*': None, 'cov/*': None, 'teacher/reverse_kl': 'teacher_kl',
}
# TRL's GRPOTrainer (trl/trainer/grpo_trainer.py), as the Trainer's log_history keeps it. 0.14-0.16:
# completion_length, rewards/<fn>, clip_ratio (0.16); 0.17: completions/*, rewards/<fn>/{mean,std},
# clip_ratio/{low,high,region}_*; 0.18: frac_reward_zero_std; 0.20: entropy; 0.26: step_time.
# Evaluation rows (eval_strategy, 0.16 on) carry the same names prefixed 'eval_'.
TRL = {
    'reward': 'reward', 'reward_std': 'reward_std', 'frac_reward_zero_std': 'zero_std_frac',
    'loss': 'loss', 'grad_norm': 'grad_norm', 'kl': 'kl', 'entropy': 'entropy',
    'completions/mean_length': 'resp_len', 'completion_length': 'resp_len',
    'completions/clipped_ratio': 'trunc_frac', 'clip_ratio/region_mean': 'clip_frac',
    'clip_ratio': 'clip_frac', 'clip_ratio/low_mean': 'clip_low',
    'clip_ratio/high_mean': 'clip_high', 'step_time': 'step_time', 'eval_reward': 'heldout',
    'step': None, 'epoch': None, 'learning_rate': None, 'num_tokens': None, 'rewards/*': None,
    'completions/*': None, 'clip_ratio/*': None, 'sampling/*': None, 'train_runtime': None,
    'train_samples_per_second': None, 'train_steps_per_second': None, 'train_loss': None,
    'total_flos': None, 'eval_*': None, 'entropy_coef': None, 'policy_loss': None,
    'aux_loss': None, 'cispo_clip_ratio': None, 'tools/*': None, 'vespo/*': None,
}
# verl's metrics (verl/trainer/ppo/ray_trainer.py, from 0.3 also metric_utils.py; the actor's
# dp_actor.py and core_algos.py; fsdp_workers.py). Old and new spellings side by side; tags and
# dated commits of volcengine/verl.
VERL = {
    # the task score (critic/score/*) and the reward after an in-reward KL (critic/rewards/*): 0.1 on
    'critic/score/mean': 'reward', 'critic/score/max': 'reward_max',
    'critic/score/min': 'reward_min', 'critic/rewards/*': None,
    # policy: pg_loss, pg_clipfrac, ppo_kl, grad_norm 0.1 on; kl_loss, kl_coef, lr 0.2 on.
    # pg_clipfrac_lower (0.4 on) is dual-clip's share (clip_ratio_c), not a lower eps side.
    'actor/pg_loss': 'loss', 'actor/grad_norm': 'grad_norm', 'actor/kl_loss': 'kl',
    'actor/pg_clipfrac': 'clip_frac', 'actor/pg_clipfrac_lower': None, 'actor/ppo_kl': None,
    'actor/lr': None, 'actor/kl_coef': None, 'actor/mfu': None,
    # the in-reward KL: critic/kl and critic/kl_coeff to 0.3, actor/reward_kl_penalty(_coeff) 0.4 on
    'critic/kl': 'kl', 'actor/reward_kl_penalty': 'kl', 'critic/kl_coeff': None,
    'actor/reward_kl_penalty_coeff': None,
    # entropy: actor/entropy_loss (the mean entropy; 0.1-0.4.0), actor/entropy (0.4.1 on)
    'actor/entropy': 'entropy', 'actor/entropy_loss': 'entropy',
    # response_length/*: 0.1 on, clip_ratio from 2025-01-17 (#111); *_non_aborted/* 0.6 on
    'response_length/mean': 'resp_len', 'response_length/clip_ratio': 'trunc_frac',
    'response_length/*': None, 'response_length_non_aborted/*': None, 'response/*': None,
    'prompt_length/*': None,
    # phase times: timing/<phase> (0.1 to 2025-01-17, no step total), timing(s)/<phase> (2025-01-17,
    # #111, which added the step), timing_s/<phase> (2025-01-21, #120, on). old_log_prob from 0.2,
    # reward from 0.4; testing and save_checkpoint run inside the step.
    'timing_s/step': 'step_time', 'timing(s)/step': 'step_time', 'perf/time_per_step': 'step_time',
    'timing/*': None, 'timing(s)/*': None, 'timing_s/*': None, 'timing_per_token*': None,
    # perf/* (0.3 on): throughput, tokens, memory; mfu/* in 0.2
    'perf/throughput': 'throughput', 'perf/max_memory_allocated_gb': 'mem_gb', 'perf/*': None,
    'mfu/*': None,
    # validation: val/test_score/<source> (0.1-0.3; the first row, 2025-01-02 to 01-17: without
    # 'val/'), val-core/<source>/<acc or reward>/mean@N (0.4 on; best@N, maj@N and val-aux/* beside)
    'val/test_score/*': 'heldout', 'test_score/*': 'heldout', 'val-core/*/mean@*': 'heldout',
    'val-core/*': None, 'val-aux/*': None,
    'critic/*': None, 'training/*': None, 'global_seqlen/*': None,
}
VERL_PHASES = {'gen': 'time_gen', 'reward': 'time_reward', 'ref': 'time_ref', 'old_log_prob': 'time_old',
               'values': 'time_values', 'adv': 'time_adv', 'update_actor': 'time_update',
               'update_critic': 'time_critic', 'testing': 'time_eval', 'save_checkpoint': 'time_save'}
VERL.update({f"{spelling}/{phase}": series for spelling in ('timing', 'timing(s)', 'timing_s')
             for phase, series in VERL_PHASES.items()})
# A W&B export's own columns and system metrics. TRL's names reach W&B through transformers'
# rewrite_logs (integrations/integration_utils.py): 'train/<name>', and 'eval/<name>' for 'eval_'.
WANDB = {
    '_step': None, '_runtime': None, '_timestamp': None, 'global_step': None, 'Step': None,
    'eval/reward': 'heldout',
    'system/gpu.0.memoryAllocated': ('mem_frac', 0.01),  # a percentage
    'system.gpu.0.memoryAllocated': ('mem_frac', 0.01),
}
CONSOLE = {  # console lines: nanoGPT's 'iter N: loss X, time Yms, mfu Z%' and our step line
    'loss': 'loss', 'time': 'step_time', 'reward': 'reward', 'reward_std': 'reward_std',
    'zero_std': 'zero_std_frac', 'kl': 'kl', 'ent': 'entropy', 'entropy': 'entropy',
    'gnorm': 'grad_norm', 'grad_norm': 'grad_norm', 'len': 'resp_len', 'mem': 'mem_gb',
    'clip_low': 'clip_low', 'clip_high': 'clip_high', 'gen': 'time_gen', 'rew': 'time_reward',
    'ref': 'time_ref', 'old': 'time_old', 'upd': 'time_update', 'mfu': None, 'lr': None,
    'compile': 'time_compile', 'for': 'compile_graphs',  # our step line's '; compile S for N graphs)'
}
# nanochat's scripts/chat_rl.py (karpathy/nanochat at da4d9b5): its console lines, the words before
# each value joined by '_' (console_pairs). 'Step N/M | Average reward: R | Average sequence length:
# L' ends a step (the length counts the prompt); 'Step N/M | Example step E | Pass P | loss: X |
# Average reward: R' is one micro-batch's (its loss a share of the step's: their sum is the step's);
# 'Step N | Pass@1: A, Pass@2: B, ...' an evaluation before step N
NANOCHAT = {
    'Average_reward': 'reward', 'Average_sequence_length': 'resp_len', 'loss': 'loss', 'Pass@1': 'heldout',
    'Pass@*': None,
}
# OpenRLHF (openrlhf/trainer/ppo_trainer.py, ray/ppo_actor.py; main at 3c3be62, 2026): its loggers
# write a step's status as 'train/<name>' (TensorBoard's SummaryWriter and W&B alike) and an
# evaluation as 'eval/eval_<data source>_pass1', ...; rollout/* (the rewards before dynamic filtering)
# and timing/* are recent.
OPENRLHF = {
    'reward': 'reward', 'rollout/reward_mean': 'reward', 'rollout/reward_std': 'reward_std',
    'policy_loss': 'loss', 'actor_grad_norm': 'grad_norm', 'kl': 'kl',
    'response_length': 'resp_len', 'rollout/response_length_mean': 'resp_len',
    'rollout/truncated_rate': 'trunc_frac', 'ppo_clip_ratio': 'clip_frac',
    'timing/generation': 'time_gen', 'timing/ppo_train': 'time_update',
    'timing/step_total': 'step_time', 'eval/eval_*_pass1': 'heldout',
    'return': None, 'total_length': None, 'actor_lr': None, 'entropy_loss': None, 'ppo_kl': None,
    'vllm_kl': None, 'logprobs_diff': None, 'group_reward_std': None, 'rollout/*': None,
    'timing/*': None, 'dynamic_filtering_pass_rate': None, 'critic_loss': None, 'values': None,
    'critic_lr': None, 'critic_grad_norm': None, 'global_step': None, 'eval/*': None,
}
# prime-rl (orchestrator/orchestrator.py and metrics.py, trainer/rl/train.py; main at 559b447,
# 2026-08-21), as its W&B runs hold them: the orchestrator's rollouts as
# train/<agg or env>/<all or effective>/<agent>/<name>/{mean,max,min,p10,p90}, the trainer's loss,
# entropy and optimizer; orchestrator and trainer log to a run each (a CSV holds one of them).
PRIME_RL = {
    'train/agg/all/*/reward/mean': 'reward', 'train/agg/all/*/reward/max': 'reward_max',
    'train/agg/all/*/reward/min': 'reward_min', 'train/agg/all/*/num_output_tokens/mean': 'resp_len',
    'train/agg/all/*/is_truncated/mean': 'trunc_frac', 'loss/mean': 'loss',
    'entropy/all/mean': 'entropy', 'optim/grad_norm': 'grad_norm', 'time/step': 'step_time',
    'perf/peak_memory': 'mem_gb', 'perf/throughput': 'throughput',
    # opd/opsd (on-policy distillation): ref_kl is log p_teacher - log p_policy, minus our teacher/reverse_kl
    'ref_kl/mean': ('teacher_kl', -1.0),
    'train/*/all/*': None, 'train/*/effective/*': None, 'eval/*': None, 'progress/*': None,
    'time/*': None, 'perf/*': None,
    'optim/*': None, 'off_policy/*': None, 'batch/*': None, 'loss/*': None, 'entropy/*': None,
    'mismatch_kl/*': None, 'masked_mismatch_kl/*': None, 'unmasked_mismatch_kl/*': None,
    'is_masked*': None, 'masked_advantage_*': None, 'ref_kl/*': None, 'kl_ent_ratio/*': None,
}
# JSON lines, CSV and TensorBoard read all (CSV and TensorBoard: the table knowing most names first)
TABLES = {'ours': OURS, 'trl': TRL, 'verl': VERL, 'wandb': WANDB, 'openrlhf': OPENRLHF,
          'prime_rl': PRIME_RL}
STEP_COLUMNS = ['step', 'train/global_step', 'global_step', '_step', 'Step']  # first found wins


# ------------------------------------------------------------------------------------ reading
def lookup(name, tables):
    """-> (found, series or None, scale) for a metric name in the first table that knows it: exact
    names first, then the longest pattern with '*'. A W&B export's 'train/' prefix (TRL) is looked
    through."""
    for n in (name, name[6:] if name.startswith('train/') else None):
        if n is None:
            continue
        for table in tables:
            if n in table:
                return unpack(table[n])
        for table in tables:
            patterns = [k for k in table if '*' in k and fnmatch.fnmatchcase(n, k)]
            if patterns:
                return unpack(table[max(patterns, key=len)])
    return False, None, 1.0


def ranked(tables, names):
    """tables, the one whose exact names (a 'train/' prefix looked through) the source uses most
    first: where two trainers give one name two meanings (TRL's policy_loss is a part of its loss,
    OpenRLHF's the loss), the source's own trainer decides. Ties keep the order given."""
    bare = {n[6:] if n.startswith('train/') else n for n in names}
    return sorted(tables, key=lambda table: -len(bare & set(table)))


def unpack(entry):
    if isinstance(entry, tuple):
        return True, entry[0], entry[1]
    return True, entry, 1.0


def new_run(path, source):
    return {'path': path, 'source': source, 'series': {}, 'unknown': set(), 'problems': [],
            'samples': [], 'rows': 0, 'names': {}, 'crashes': []}


def problem(run, where, msg):
    """One unreadable row, as one line naming the file and line (main prints them on stderr)."""
    run['problems'].append(f"{where}: {msg}")


def to_number(v):
    """A float from a JSON/CSV/console value (None when it is not a number). NaN and inf stay:
    they are what the nonfinite detector looks for."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        m = re.fullmatch(r'\s*(?:np\.(?:float|int)\d+\()?([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+|nan|inf'
                         r'|infinity))\)?\s*', v, re.IGNORECASE)
        if m:
            return float(m.group(1))
    return None


def add_row(run, step, row, tables, where):
    """Put one row's metrics into the run's series (a later row of the same step overwrites)."""
    bad, several = [], {}
    for name, v in row.items():
        key = (name, tuple(map(id, tables)))  # each name is looked up once per run and table list
        if key not in run['names']:
            run['names'][key] = lookup(name, tables)
        found, series, scale = run['names'][key]
        if not found:
            run['unknown'].add(name)
            continue
        if series is None:
            continue
        x = to_number(v)
        if x is None:
            if v not in (None, ''):  # an empty cell or a JSON null is a missing value, not an error
                bad.append(f"{name}={str(v)[:20]!r}")
            continue
        if series in MEAN_OVER_NAMES:
            several.setdefault(series, []).append(x * scale)
            continue
        run['series'].setdefault(series, {})[step] = x * scale
    for series, xs in several.items():
        run['series'].setdefault(series, {})[step] = sum(xs) / len(xs)
    if bad:
        problem(run, where, f"not a number: {', '.join(bad[:3])}; the row's other values kept")
    run['rows'] += 1


def read_jsonl(path, run):
    """Our metrics.jsonl (or any trainer's JSON lines with a step): one row a line."""
    tables = list(TABLES.values())
    with open(path, errors='replace') as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                row = json.loads(line)
            except ValueError:
                problem(run, where, f"unreadable row (cut short, or not JSON): "
                                    f"{line.strip()[:60]!r}")
                continue
            step = step_of(row) if isinstance(row, dict) else None
            if step is None:
                problem(run, where, "a row without a whole-number step; skipped")
                continue
            add_row(run, step, row, tables, where)


def step_of(row):
    for k in STEP_COLUMNS:
        x = to_number(row.get(k))
        if x is not None and math.isfinite(x) and x == int(x):
            return int(x)
    return None


def read_samples(path, run):
    """samples.jsonl beside our metrics: the logged completions, quoted as evidence."""
    with open(path, errors='replace') as f:
        for n, line in enumerate(f, 1):
            try:
                row = json.loads(line)
                int(row['step'])
            except (ValueError, KeyError, TypeError):
                if line.strip():
                    problem(run, f"{path}:{n}", "unreadable sample row; skipped")
                continue
            run['samples'].append(row)


def read_trainer_state(path, run):
    """TRL (any transformers Trainer): trainer_state.json's log_history, one dict per logging step.
    A file cut short is read up to the last whole entry."""
    with open(path, errors='replace') as f:
        text = f.read()
    try:
        history = json.loads(text).get('log_history')
    except (ValueError, AttributeError):
        history = salvage_log_history(text, path, run)
    if not isinstance(history, list):
        problem(run, path, "no log_history list")
        return
    for i, row in enumerate(history):
        where = f"{path}: log_history[{i}]"
        step = step_of(row) if isinstance(row, dict) else None
        if step is None:
            problem(run, where, "an entry without a step; skipped")
            continue
        add_row(run, step, row, [TRL], where)


def salvage_log_history(text, path, run):
    """The whole entries of a trainer_state.json that does not parse (a crash mid-write)."""
    start = text.find('"log_history"')
    start = text.find('[', start) + 1 if start >= 0 else 0
    if start == 0:
        return None
    decoder, out, i = json.JSONDecoder(), [], start
    while True:
        while i < len(text) and text[i] in ' \t\r\n,':
            i += 1
        if i >= len(text) or text[i] == ']':
            break
        try:
            row, i = decoder.raw_decode(text, i)
        except ValueError:
            problem(run, path, f"cut short or malformed after log_history entry {len(out)} "
                               f"(character {i}); the {len(out)} entries before it are read")
            break
        out.append(row)
    return out


def read_csv(path, run):
    """A W&B history: a chart panel's export ('Step' and '<run name> - <key>' columns, with
    '__MIN'/'__MAX' companions, skipped) or run.history() saved by pandas (an unnamed index column,
    skipped; '_step' and the keys). An empty cell is a missing value. A panel export of several runs
    is refused: their series would mix."""
    tables = list(TABLES.values())
    with open(path, errors='replace', newline='') as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if not header:
            problem(run, path, "empty CSV")
            return
        runs = sorted({h.split(' - ', 1)[0] for h in header if ' - ' in h})
        if len(runs) > 1:
            raise ValueError(f"a chart export of {len(runs)} runs ({', '.join(runs[:3])}): the "
                             "doctor reads one run; hide the others in the chart and export again")
        names = [h.split(' - ', 1)[-1].strip() for h in header]
        tables = ranked(tables, names)
        for n, cells in enumerate(reader, 2):
            where = f"{path}:{n}"
            if len(cells) != len(names):
                problem(run, where, f"{len(cells)} cells for {len(names)} columns; skipped")
                continue
            row = {k: v for k, v in zip(names, cells) if k and not k.endswith(('__MIN', '__MAX'))}
            step = step_of(row)
            if step is None:
                problem(run, where, "no whole-number step; skipped")
                continue
            add_row(run, step, row, tables, where)


def tensorboard_files(path):
    """The event files of one TensorBoard run at path: the file itself, or those of the one folder
    under path that holds any (a run is a folder: TRL's runs/<date>_<host>/, OpenRLHF's
    <use_tensorboard>/<run name>/). Raises ValueError when several folders do."""
    if not os.path.isdir(path):
        return [path]
    folders = {}
    for root, dirs, names in os.walk(path):
        dirs.sort()
        found = sorted(n for n in names if 'tfevents' in n)
        if found:
            folders[root] = [os.path.join(root, n) for n in found]
    if len(folders) > 1:
        shown = ', '.join(os.path.relpath(f, path) for f in list(folders)[:3])
        raise ValueError(f"{len(folders)} TensorBoard runs under it ({shown}, ...): the doctor "
                         "reads one run; point at its folder")
    return next(iter(folders.values()), [])


def read_tensorboard(path, run):
    """TensorBoard event files (doctor/tfevents.py): their numeric scalars, one row a step, files in
    name order (their names start with the time they were opened: a resumed run's later file
    overwrites the steps it redid)."""
    rows = {}
    for file in tensorboard_files(path):
        with open(file, 'rb') as f:
            data = f.read()
        for n, (record, why) in enumerate(tfevents.records(data)):
            if why is not None:
                problem(run, file, why)
                continue
            try:
                for step, tag, value in tfevents.scalars(record):
                    rows.setdefault(step, {})[tag] = value
            except ValueError as e:
                problem(run, f"{file}: record {n + 1}", f"not an Event ({e}); skipped")
    tables = ranked(list(TABLES.values()), {tag for row in rows.values() for tag in row})
    for step in sorted(rows):
        add_row(run, step, rows[step], tables, f"{path}: step {step}")


ANSI = re.compile(r'\x1b\[[0-9;]*m')  # terminal colour codes
# the errors a run's console can end in, (kind, the lines that say it): the first kind that matches
# a line names it. Host memory first (Ray's memory monitor raises an OutOfMemoryError of its own)
FATAL = [
    ('host_out_of_memory', re.compile(r'node running low on memory|exceeds the memory usage threshold|'
                                      r'^Killed$|\d+ Killed\s')),
    # the device's: PyTorch's error, a CUDA call's, vLLM's KV cache finding no room
    ('out_of_memory', re.compile(r'CUDA out of memory|OutOfMemoryError\b|CUDA error: out of memory|'
                                 r'No available memory for the cache blocks')),
    ('killed', re.compile(r'Signal 9 \(SIGKILL\)|exitcode\s*: -9\b')),  # torchrun's summary of a rank
    ('collective_timeout', re.compile(r'Watchdog caught collective operation timeout|Timed out waiting \d+ms')),
    ('nonfinite_probabilities', re.compile(r'probability tensor contains either')),  # torch.multinomial's
    ('cuda_error', re.compile(r'device-side assert triggered|illegal memory access|CUBLAS_STATUS_\w+|'
                              r'CUDA error: ')),
    # the process died below Python: faulthandler's report, the shell's, torchrun's, C++'s std::terminate
    ('native_crash', re.compile(r'Fatal Python error: (Segmentation fault|Aborted|Bus error|Floating point exception|'
                                r'Illegal instruction)|Segmentation fault \(core dumped\)|'
                                r'Signal (11|6|7|4|8) \(SIG(SEGV|ABRT|BUS|ILL|FPE)\)|terminate called after throwing')),
]
TRL_ROW = re.compile(r"\{'(?:loss|reward|eval_\w+|grad_norm|learning_rate)': .*\}")  # a printed log dict
TQDM_STEP = re.compile(r'\| *(\d+)/(\d+) \[')  # tqdm's bar, '| 25/500 [03:12<1:00:58, 7.70s/it]'
SOURCE_LINE = re.compile(r'(raise|except)\b|File "')  # a traceback's quoted source, not the error
CRASH_CONTEXT = 200  # lines kept before such an error (its traceback) and after it (a report)
VERL_LINE = re.compile(r'\bstep:(\d+) - (.*)')  # verl's console logger: 'step:N - key:value - ...'
ITER_LINE = re.compile(r'\biter (\d+):(.*)')  # nanoGPT: 'iter N: loss X, time Yms, mfu Z%'
NANOCHAT_LINE = re.compile(r'^Step (\d+)(?:/\d+)? \| (.*)')  # nanochat's chat_rl.py (NANOCHAT)
STEP_LINE = re.compile(r'^step\s+(\d+)\s*[|:](.*)')  # ours: 'step     1 | reward ... | ...'
NUM = r'[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+|nan|inf)'
VALUE = re.compile(rf'({NUM})(?:([±/])({NUM}))?(ms|s|%|GB)?', re.IGNORECASE)


def read_console(path, run, rows=True):
    """A console log: verl's 'step:N - key:value' lines, nanoGPT's 'iter N: ...' lines, our step
    lines and TRL's (transformers') printed log dicts; every other line (prints, warnings,
    tracebacks) is not a row and is passed over, but for a fatal error (FATAL), kept in
    run['crashes'] with its kind, the lines around it and the last step logged before it. rows=False:
    the crashes alone (our out_dir's console.log, whose rows metrics.jsonl holds)."""
    kinds, last_step = set(), None
    # TRL: the last progress bar's (step, total) before the first row, whose total is then the
    # training bar's (loading weights and evaluation draw bars of their own); its step; rows so far
    last_bar, bar_total, bar_step, trl_rows = None, None, None, 0
    pass_loss = {}  # nanochat: step -> the sum of its micro-batches' losses so far
    recent = collections.deque(maxlen=CRASH_CONTEXT)
    with open(path, errors='replace') as f:
        for n, line in enumerate(f, 1):
            line = ANSI.sub('', line.rstrip('\n'))  # Ray colours its '(TaskRunner pid=N)' prefix
            for crash in run['crashes'][-3:]:  # (errors of several ranks come together)
                if len(crash['after']) < CRASH_CONTEXT:
                    crash['after'].append(line)
            kind = fatal_kind(line)
            if kind is not None:
                run['crashes'].append({'kind': kind, 'line': n, 'text': line.strip(), 'before': list(recent),
                                       'after': [], 'after_step': last_step})
            recent.append(line)
            where = f"{path}:{n}"
            bad = []
            bar = None
            for bar in TQDM_STEP.finditer(line):  # the last on the line (a log with its \r removed)
                pass
            if bar:
                last_bar = (int(bar.group(1)), bar.group(2))
            if bar and bar.group(2) == bar_total:
                bar_step = last_bar[0]
            row = trl_row(line)
            if row is not None:  # (its step: the bar's, else the row's number: logging_steps=1)
                if not trl_rows and last_bar:
                    bar_step, bar_total = last_bar
                kinds.add('trl')
                trl_rows += 1
                last_step = bar_step if bar_step is not None else trl_rows
                if rows:
                    add_row(run, last_step, row, [TRL], where)
                continue
            m = VERL_LINE.search(line)
            nanochat = None if m else NANOCHAT_LINE.match(line)
            if m:
                kinds.add('verl')
                row, bad = verl_pairs(m.group(2))
                tables = [VERL]
            elif nanochat:
                m = nanochat
                kinds.add('nanochat')
                row, tables = console_pairs(m.group(2)), [NANOCHAT]
                if 'Example_step' in row:  # a micro-batch: its loss counts in the step's line
                    pass_loss[int(m.group(1))] = pass_loss.get(int(m.group(1)), 0.0) + row.get('loss', math.nan)
                    last_step = int(m.group(1))
                    continue
                if 'Average_reward' in row and int(m.group(1)) in pass_loss:
                    row['loss'] = pass_loss.pop(int(m.group(1)))
            else:
                m = ITER_LINE.search(line) or STEP_LINE.search(line)
                if not m:
                    continue
                kinds.add('console')
                row = console_pairs(m.group(2))
                tables = [CONSOLE]
            last_step = int(m.group(1))
            if not rows:
                continue
            if not row:
                problem(run, where, f"a step line with no readable value: {line.strip()[:60]!r}")
                continue
            if bad:
                problem(run, where, f"not key:value: {', '.join(bad)[:60]!r}; the line's other "
                                    "values kept")
            add_row(run, last_step, row, tables, where)
    if rows:
        run['source'] = ' + '.join(sorted(kinds)) or 'console'


def fatal_kind(line):
    """The FATAL kind a console line reports, or None (a traceback's quoted source line is none)."""
    if SOURCE_LINE.match(line.strip()):
        return None
    for kind, pattern in FATAL:
        if pattern.search(line):
            return kind
    return None


def trl_row(line):
    """The metrics of a TRL console line: transformers prints each log as a dict, its floats as
    '%.4g' strings under the progress bar (ProgressCallback), raw without it (PrinterCallback).
    None for any other line, and for the run's closing summary (train_runtime, ...)."""
    m = TRL_ROW.search(line)
    if not m:
        return None
    try:
        row = ast.literal_eval(m.group(0))
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    if not isinstance(row, dict) or 'train_runtime' in row:
        return None
    return row


def verl_pairs(body):
    """'actor/kl_loss:0.853 - critic/score/mean:0.121' -> ({name: value}, [parts not key:value])."""
    row, bad = {}, []
    for part in body.split(' - '):
        key, sep, value = part.strip().rpartition(':')
        if sep and key:
            row[key] = value
        else:
            bad.append(part.strip())
    return row, bad


def console_pairs(body):
    """'loss 0.0000 (main 0.0000, critic 0.0000), time 103634.20ms' -> {'loss': 0.0, 'main': 0.0,
    'critic': 0.0, 'time': 103.6342}. Words before a number name it; a bare time ('0.5s') is
    'time'; 'a±b' gives name and name_std, 'a/b' name_low and name_high; ms become seconds."""
    row, words = {}, []
    for token in re.split(r'\s+|(?<=[,;|()])|(?=[,;|()])', body):
        token = re.sub(r'[=:](?=[-+.\d])', ' ', token.strip().rstrip(':'))  # loss=0.5, lr:3e-4
        if not token:
            continue
        if token in ',;|()':
            words = []
            continue
        name, _, rest = token.rpartition(' ') if ' ' in token else ('', '', token)
        m = VALUE.fullmatch(rest)
        if name:
            words.append(name)
        if not m:
            words.append(rest)
            continue
        key = '_'.join(words) or ('time' if m.group(4) in ('s', 'ms') else 'value')
        x = float(m.group(1)) / (1000 if m.group(4) == 'ms' else 1)
        row[key] = x
        if m.group(2) == '±':
            row[key + '_std'] = float(m.group(3))
        elif m.group(2) == '/':
            row[key + '_low'], row[key + '_high'] = row.pop(key), float(m.group(3))
        words = []
    return row


def load(path, device_gb=0.0):
    """-> the run (series by step, unknown names, unreadable rows), or a one-line reason it cannot
    be read."""
    if not os.path.exists(path):
        return f"{path}: no such file or directory"
    target = find_log(path)
    if target is None:
        return (f"{path}: no metrics.jsonl, trainer_state.json, checkpoint-*/trainer_state.json "
                "or TensorBoard event file in this directory")
    kind, file = target
    run = new_run(file, kind)
    try:
        if kind == 'ours':
            read_jsonl(file, run)
            samples = os.path.join(os.path.dirname(file), 'samples.jsonl')
            if os.path.exists(samples):
                read_samples(samples, run)
            console = os.path.join(os.path.dirname(file), 'console.log')
            if os.path.exists(console):  # what the run printed: what ended it, if it crashed
                read_console(console, run, rows=False)
        elif kind == 'trl':
            read_trainer_state(file, run)
        elif kind == 'wandb':
            read_csv(file, run)
        elif kind == 'tensorboard':
            read_tensorboard(file, run)
        else:
            read_console(file, run)
    except OSError as e:
        return f"{file}: {e.strerror or e}"
    except ValueError as e:  # a file the doctor refuses as a whole (one line saying why)
        return f"{file}: {e}"
    if not any(run['series'].values()) and not run['crashes']:
        return f"{file}: no metric rows could be read ({len(run['problems'])} unreadable)"
    derive(run, device_gb)
    run['steps'] = sorted({s for v in run['series'].values() for s in v})
    return run


def find_log(path):
    """(kind, file) for a path: an out_dir, a TRL output dir or checkpoint, or a log file."""
    if os.path.isdir(path):
        for name, kind in (('metrics.jsonl', 'ours'), ('trainer_state.json', 'trl')):
            if os.path.isfile(os.path.join(path, name)):
                return kind, os.path.join(path, name)
        ckpts = {int(d[11:]): d for d in os.listdir(path) if re.fullmatch(r'checkpoint-\d+', d)
                 and os.path.isfile(os.path.join(path, d, 'trainer_state.json'))}
        if ckpts:
            return 'trl', os.path.join(path, ckpts[max(ckpts)], 'trainer_state.json')
        if any('tfevents' in n for _, _, names in os.walk(path) for n in names):
            return 'tensorboard', path
        return None
    if 'tfevents' in os.path.basename(path):
        return 'tensorboard', path
    if path.endswith('.jsonl'):
        return 'ours', path
    if path.endswith('.json'):
        return 'trl', path
    if path.endswith('.csv'):
        return 'wandb', path
    return 'console', path


def derive(run, device_gb):
    """Series a source gives in parts: clip_frac from its two sides, mem_frac from GB and the
    device's size, the step's time from its phases (verl before 2025-01-17 logged no total)."""
    s = run['series']
    if 'step_time' not in s:
        phases = [s[name] for name in PHASES if s.get(name)]
        steps = {k for phase in phases for k in phase}
        if steps:
            s['step_time'] = {k: sum(phase.get(k, 0.0) for phase in phases) for k in steps}
    low, high = s.get('clip_low', {}), s.get('clip_high', {})
    if 'clip_frac' not in s and (low or high):
        s['clip_frac'] = {k: low.get(k, 0.0) + high.get(k, 0.0) for k in set(low) | set(high)}
    if device_gb and 'mem_frac' not in s and s.get('mem_gb'):
        s['mem_frac'] = {k: v / device_gb for k, v in s['mem_gb'].items()}
