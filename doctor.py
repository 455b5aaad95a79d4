"""
The run doctor: reads a GRPO run's logs after the fact and says what went wrong, at which steps,
with the numbers, the likely causes in order, and the fix.

    python doctor.py out/arith                # ours: metrics.jsonl (+ samples.jsonl)
    python doctor.py trl_out/checkpoint-500   # TRL: trainer_state.json's log_history
    python doctor.py verl_console.log         # verl: 'step:N - key:value - ...' lines
    python doctor.py wandb_history.csv        # a Weights & Biases history export
    python doctor.py train.log                # console: 'iter N: loss X, time Yms', our step lines
    python doctor.py RUN --device_gb=80       # also check memory against the device's 80 GB
    python doctor.py RUN --json               # the findings as JSON
    python doctor.py RUN --fail_on=warning    # exit 1 on warnings too (default: errors only)

Each source's metric names map onto a few series (SERIES) through a table (OURS, TRL, VERL, WANDB,
CONSOLE); names a table does not know are counted in the report and listed in --json, never dropped
unsaid. Each detector in DETECTORS reads the series and returns findings; the report prints them
most severe first and doctor.png (beside the input, or --out) draws the flagged series with the
findings' steps shaded. Exit code 0: nothing flagged at --fail_on or above (warnings alone exit 0 by
default: a CI step fails on a broken run, not on a vLLM run's memory at 90%); 1: a finding at
--fail_on or above; 2: PATH unreadable (or a bad argument).
"""
import argparse
import csv
import fnmatch
import json
import math
import os
import re
import statistics
import sys

# ------------------------------------------------------------------------------------ the series
SERIES = {  # what every source is mapped onto
    'reward': 'reward mean over the step\'s completions',
    'reward_std': 'reward std over the step\'s completions',
    'reward_max': 'highest reward of the step', 'reward_min': 'lowest reward of the step',
    'zero_std_frac': 'share of groups whose rewards all tie (no signal)',
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
    'time_old': 'old log-probs', 'time_values': 'critic values',
    'time_adv': 'advantages (with the reward, in verl before 0.4)', 'time_update': 'update',
    'time_critic': 'critic update', 'time_eval': 'validation', 'time_save': 'checkpoint',
    'throughput': 'tokens per second per GPU',
    'mem_gb': 'peak device memory, GB',
    'mem_frac': 'device memory in use, share of the device',
    'heldout': 'held-out accuracy (greedy pass@1, validation score; the mean over sources)',
}
PHASES = ['time_gen', 'time_reward', 'time_ref', 'time_old', 'time_values', 'time_adv',
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
    'mem/peak_gb': 'mem_gb', 'eval/pass@1': 'heldout',
    'step': None, 'lr': None, 'kl_coef': None, 'pg_loss': None, 'reward/*': None, 'ratio/*': None,
    'kl_old_new': None, 'rows_trained': None, 'tokens_trained': None, 'packed': None,
    'logprob/mean': None, 'logprob_gen_vs_train': None, 'response_len/max': None,
    'timing_s/eval': None, 'mem/allocated_gb': None, 'mem/reserved_gb': None, 'perf/*': None,
    'eval/*': None, 'warn/*': None, 'guard/*': None, 'dynamic/*': None, 'tis/*': None,
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
}
TABLES = {'ours': OURS, 'trl': TRL, 'verl': VERL, 'wandb': WANDB}  # JSON lines and CSV read all
STEP_COLUMNS = ['step', 'train/global_step', 'global_step', '_step', 'Step']  # first found wins

# ------------------------------------------------------------------------------------ thresholds
MIN_FLAT_STEPS = 3  # steps in a row of one exact value (with no reward spread) before it counts
LONG_FLAT_STEPS = 10  # a stretch this long counts even when the reward was low before it
MIN_FLAT_STEPS_NO_STD = 5  # the same when the reward's spread is not logged (ties by chance)
FIRST_STEP_MAX = 1  # the first update is step 1 (or 0): KL there is before the policy moved
KL_START_MAX = 0.01  # per-token KL at the first step above this: the reference is not the policy
KL_SPIKE_FLOOR = 0.1  # a KL spike must also exceed this (KL grows from 0 by large factors early)
KL_HIGH = 0.5  # KL to the reference above this over the last quarter of the run: drifted far
GRAD_SPIKE_FLOOR = 1.0  # a grad-norm spike must also exceed this (tiny norms jump by large factors)
SPIKE_FACTOR = 5.0  # a value this many times the median of the steps before it is a spike
SPIKE_WINDOW = 10  # steps before a point whose median it is compared with
WARMUP_FACTOR = 3.0  # first step this many times the median of the rest: compilation, warm-up
SLOWDOWN_FACTOR = 2.0  # later steps' median this many times the first step: recompilation
SLOW_STEP_FACTOR = 3.0  # one step this many times the median step: a stall
REWARD_WINDOW = 4  # steps averaged when comparing the reward's best stretch with its last
REWARD_FALL_FRAC = 0.5  # the last stretch below this share of the best ...
REWARD_FALL_ABS = 0.1  # ... and this much below it (rewards on a 0-1 scale): the policy got worse
ENTROPY_COLLAPSE_FRAC = 0.1  # entropy falling below this share of its start: collapsed
ENTROPY_MIN_START = 0.05  # nats; an entropy already below this at the start cannot collapse further
TRUNC_WARN = 0.5  # more than half the completions at the length limit (safety.py warns the same)
MEM_NEAR = 0.9  # device memory in use above this share of the device
HACK_REWARD_RISE = 0.05  # reward up by this much while ...
HACK_HELDOUT_DROP = 0.05  # ... held-out accuracy falls this much from its best: reward hacking
ZERO_SPREAD_WARN = 0.9  # median share of zero-spread groups above this: most of the batch is idle
CLIP_WARN = 0.2  # median share of clipped tokens above this: the policy moves too far per batch
MAX_PROBLEM_LINES = 20  # unreadable rows printed one line each, up to this many, then a count
UNKNOWN_SHOWN = 5  # names no table knows: the report counts them and shows this many (--json: all)
SEVERITIES = ['info', 'warning', 'error']


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


def unpack(entry):
    if isinstance(entry, tuple):
        return True, entry[0], entry[1]
    return True, entry, 1.0


def new_run(path, source):
    return {'path': path, 'source': source, 'series': {}, 'unknown': set(), 'problems': [],
            'samples': [], 'rows': 0, 'names': {}}


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


ANSI = re.compile(r'\x1b\[[0-9;]*m')  # terminal colour codes
VERL_LINE = re.compile(r'\bstep:(\d+) - (.*)')  # verl's console logger: 'step:N - key:value - ...'
ITER_LINE = re.compile(r'\biter (\d+):(.*)')  # nanoGPT: 'iter N: loss X, time Yms, mfu Z%'
STEP_LINE = re.compile(r'^step\s+(\d+)\s*[|:](.*)')  # ours: 'step     1 | reward ... | ...'
NUM = r'[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+|nan|inf)'
VALUE = re.compile(rf'({NUM})(?:([±/])({NUM}))?(ms|s|%|GB)?', re.IGNORECASE)


def read_console(path, run):
    """A console log: verl's 'step:N - key:value' lines, nanoGPT's 'iter N: ...' lines and our step
    lines; every other line (prints, warnings, tracebacks) is not a row and is passed over."""
    kinds = set()
    with open(path, errors='replace') as f:
        for n, line in enumerate(f, 1):
            line = ANSI.sub('', line.rstrip('\n'))  # Ray colours its '(TaskRunner pid=N)' prefix
            where = f"{path}:{n}"
            bad = []
            m = VERL_LINE.search(line)
            if m:
                kinds.add('verl')
                row, bad = verl_pairs(m.group(2))
                tables = [VERL]
            else:
                m = ITER_LINE.search(line) or STEP_LINE.search(line)
                if not m:
                    continue
                kinds.add('console')
                row = console_pairs(m.group(2))
                tables = [CONSOLE]
            if not row:
                problem(run, where, f"a step line with no readable value: {line.strip()[:60]!r}")
                continue
            if bad:
                problem(run, where, f"not key:value: {', '.join(bad)[:60]!r}; the line's other "
                                    "values kept")
            add_row(run, int(m.group(1)), row, tables, where)
    run['source'] = ' + '.join(sorted(kinds)) or 'console'


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
    for token in re.split(r'\s+|(?<=[,|()])|(?=[,|()])', body):
        token = re.sub(r'[=:](?=[-+.\d])', ' ', token.strip().rstrip(':'))  # loss=0.5, lr:3e-4
        if not token:
            continue
        if token in ',|()':
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
        return (f"{path}: no metrics.jsonl, trainer_state.json or checkpoint-*/trainer_state.json "
                "in this directory")
    kind, file = target
    run = new_run(file, kind)
    try:
        if kind == 'ours':
            read_jsonl(file, run)
            samples = os.path.join(os.path.dirname(file), 'samples.jsonl')
            if os.path.exists(samples):
                read_samples(samples, run)
        elif kind == 'trl':
            read_trainer_state(file, run)
        elif kind == 'wandb':
            read_csv(file, run)
        else:
            read_console(file, run)
    except OSError as e:
        return f"{file}: {e.strerror or e}"
    except ValueError as e:  # a file the doctor refuses as a whole (one line saying why)
        return f"{file}: {e}"
    if not any(run['series'].values()):
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
        if not ckpts:
            return None
        return 'trl', os.path.join(path, ckpts[max(ckpts)], 'trainer_state.json')
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


# ------------------------------------------------------------------------------------ detectors
def points(run, name):
    """[(step, value)] of a series, by step; NaN and inf included."""
    return sorted(run['series'].get(name, {}).items())


def finite(pts):
    return [(s, v) for s, v in pts if math.isfinite(v)]


def median(xs):
    return statistics.median(xs) if xs else float('nan')


def runs_of(run, steps):
    """Stretches of steps with no other logged step between them: [3, 4, 5, 9] -> [(3, 5), (9, 9)];
    logged every 10 steps, [60, 70, 80] -> [(60, 80)]."""
    pos = {s: i for i, s in enumerate(run['steps'])}
    out = []
    for s in sorted(steps):
        if out and pos.get(s, s) == pos.get(out[-1][1], out[-1][1]) + 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


def span_text(run, steps):
    """[3, 4, 5, 9] -> '3-5, 9'."""
    return ', '.join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs_of(run, steps))


def g(x):
    return f"{x:.3g}"


def found(name, severity, steps, *, evidence, causes, fix, series):
    return {'name': name, 'severity': severity, 'steps': sorted(set(steps)), 'evidence': evidence,
            'causes': causes, 'fix': fix, 'series': series}


def flat_stretches(pts, min_len):
    """Maximal stretches of consecutive points with exactly one value: [(first i, last i)]."""
    out, i = [], 0
    while i < len(pts):
        j = i
        while j + 1 < len(pts) and pts[j + 1][1] == pts[i][1]:
            j += 1
        if j - i + 1 >= min_len and math.isfinite(pts[i][1]):
            out.append((i, j))
        i = j + 1
    return out


def detect_flat_reward(run):
    """Reward exactly one value for several steps: after progress (a dead reward service, every
    call failing), from the start (reward wiring), or at its top (nothing left to learn)."""
    pts = points(run, 'reward')
    std = dict(points(run, 'reward_std'))
    tied = dict(points(run, 'zero_std_frac'))
    width = reward_range(run)
    has_spread = bool(std or tied or width)
    out = []
    for i, j in flat_stretches(pts, MIN_FLAT_STEPS if has_spread else MIN_FLAT_STEPS_NO_STD):
        steps = [s for s, _ in pts[i:j + 1]]
        if has_spread and not all(std.get(s, 0.0) == 0 and tied.get(s, 1.0) == 1
                                  and width.get(s, 0.0) == 0 for s in steps):
            continue  # the mean ties by chance while rewards differ
        c = pts[i][1]
        where = f"reward exactly {g(c)} on steps {span_text(run, steps)} ({len(steps)} steps)"
        if std or tied:
            where += ", every group's rewards tied (reward std 0)"
        elif width:
            where += ", every completion scored alike (the reward's max and min equal)"
        before = [v for _, v in finite(pts[:i])]
        drop = sum(before) / len(before) - c if before else 0.0
        if before and 0 < drop < REWARD_FALL_ABS and len(steps) < LONG_FLAT_STEPS:
            continue  # a low reward touching its floor for a few steps: chance, not a failure
        if drop > 0:
            out.append(reward_collapse(run, steps, c, before, where))
        elif before:
            out.append(found('reward_saturated', 'info', steps, series=['reward'],
                             evidence=f"{where}, at or above its earlier mean "
                                      f"{g(sum(before) / len(before))}",
                             causes=['every completion earns the top score: the prompts are solved',
                                     'a reward that cannot tell completions apart at the top'],
                             fix='harder prompts (or stop: there is nothing left to learn)'))
        else:
            out.append(reward_from_start(run, steps, c, where))
    return out


def reward_collapse(run, steps, c, before, where):
    first = steps[0]
    ev = (f"{where}, after a mean of {g(sum(before) / len(before))} (max {g(max(before))}) on the "
          f"{len(before)} steps before")
    ev += context(run, steps, ['grad_norm', 'resp_len', 'mem_frac', 'trunc_frac'])
    ev += sample_quote(run, steps)
    causes = ["the reward or rollout service died and its client returns a default score; "
              "nothing raised, so training went on",
              "every reward call fails and the failure is scored as a constant (ours: "
              "failure_reward, counted in reward/<fn>/errors)",
              "generation broke: empty or garbage completions score alike"]
    verdict, note = validation_verdict(run, first)
    if verdict != 'unknown':
        ev += note
    if length_jump(run, first) or verdict == 'fell':
        causes.insert(0, causes.pop(2))
    later = [s for s, v in finite(points(run, 'reward')) if s > steps[-1]]
    if later:
        causes.insert(0, f"a passing outage, or a policy that degenerated for a while (lr too "
                         f"high): the reward moves again from step {later[0]}")
    return found('reward_collapse', 'error', steps, evidence=ev, causes=causes,
                 series=['reward', 'reward_std', 'grad_norm', 'resp_len', 'mem_frac'],
                 fix=f"check the reward/rollout server's log around step {first}; score a few "
                     f"completions of step {first} by hand; restart from the last checkpoint "
                     "before it. Make a dead reward loud: ours stops after zero_reward_patience "
                     "steps of reward exactly 0; in TRL or verl let the reward function raise.")


def reward_from_start(run, steps, c, where):
    ev = where + ", from the first logged step"
    ev += context(run, steps, ['resp_len', 'trunc_frac'])
    ev += sample_quote(run, steps)
    if c == 0:
        causes = ["the reward function is wired wrong: its keyword arguments do not get the "
                  "fields it expects (TRL passes dataset columns by name: a column 'answer' and a "
                  "parameter 'solution=None'), so it never matches",
                  "it parses an answer format the model does not write (it looks for \\boxed{} "
                  "and the model writes '#### 42')",
                  "completions are cut before the answer",
                  "the prompts are far beyond the model (a few groups would then still score)"]
        inside = set(steps)
        trunc = [v for s, v in points(run, 'trunc_frac') if s in inside]
        if trunc and median(trunc) > TRUNC_WARN:
            causes.insert(0, causes.pop(2))
        name = 'reward_zero_from_start'
    else:
        causes = ["a judge or reward model gives every completion the same score (saturated, "
                  "wrong template, input cut off)",
                  "the reward function ignores the completion (a wrong argument, a constant "
                  "return)"]
        name = 'reward_constant_from_start'
    return found(name, 'error', steps, evidence=ev, causes=causes, series=['reward', 'reward_std'],
                 fix="call the reward function by hand on one logged completion and its example, "
                     "outside the trainer, print the arguments it receives, and check that a "
                     "right answer scores above a wrong one")


def context(run, steps, names):
    """', grad norm median 0.3 (0.32 before)' for each named series logged: the other numbers
    around a stretch of steps."""
    out = ''
    first, steps = min(steps), set(steps)
    labels = {'grad_norm': 'grad norm', 'resp_len': 'completion length',
              'mem_frac': 'device memory', 'trunc_frac': 'truncated share'}
    for name in names:
        pts = finite(points(run, name))
        during = [v for s, v in pts if s in steps]
        before = [v for s, v in pts if s < first]
        if not during:
            continue
        fmt = '.0%' if name in ('mem_frac', 'trunc_frac') else '.3g'
        out += f"; {labels[name]} median {median(during):{fmt}}"
        if before:
            out += f" ({median(before):{fmt}} before)"
    return out


def sample_quote(run, steps):
    """A logged completion from one of the steps (samples.jsonl), with its reward and grade."""
    steps = set(steps)
    for row in run['samples']:
        if row.get('step') in steps:
            text = str(row.get('completion', ''))[:80].replace('\n', '\\n')
            grade = ''
            if 'correct' in row:
                grade = ", graded correct by the task" if row['correct'] else ", graded wrong"
            return f"; a completion logged at step {row['step']}: '{text}' (reward " \
                   f"{row.get('reward')}{grade})"
    return ''


def length_jump(run, step):
    """Did the completion length change by more than half at this step?"""
    pts = finite(points(run, 'resp_len'))
    before = [v for s, v in pts if s < step]
    after = [v for s, v in pts if s >= step]
    if not before or not after:
        return False
    b, a = median(before), median(after)
    return abs(a - b) > 0.5 * max(b, 1e-9)


def detect_reward_fall(run):
    """Reward falling far below its best and staying there, not at one exact value: the policy got
    worse."""
    pts = finite(points(run, 'reward'))
    w = REWARD_WINDOW
    if len(pts) < 2 * w or len({v for _, v in pts[-w:]}) == 1:
        return []  # one exact value at the end is detect_flat_reward's
    means = [sum(v for _, v in pts[i - w:i]) / w for i in range(w, len(pts) + 1)]
    best_i = means.index(max(means))
    best, last = means[best_i], means[-1]
    if best - last < REWARD_FALL_ABS or last > REWARD_FALL_FRAC * best:
        return []
    best_steps = [s for s, _ in pts[best_i:best_i + w]]
    steps = [s for s, v in pts if s > best_steps[-1] and v < REWARD_FALL_FRAC * best]
    ev = (f"reward {g(best)} (mean over steps {span_text(run, best_steps)}), then {g(last)} over "
          f"the last {w} steps; below half its best from step {steps[0]}")
    ev += context(run, steps, ['grad_norm', 'resp_len', 'trunc_frac'])
    verdict, note = validation_verdict(run, steps[0])
    ev += note
    if verdict == 'held':
        return [found('reward_fell_validation_held', 'warning', steps, evidence=ev,
                      series=['reward', 'heldout', 'resp_len'],
                      causes=["the training prompts got harder (data order, a curriculum, a new "
                              "shard or epoch)",
                              "the reward changed mid-run (a schedule, a length or format "
                              "penalty switched on, a KL penalty inside the reward)",
                              "the reward scores part of each batch wrong (timeouts or failures "
                              "scored 0)"],
                      fix=f"read the low-reward completions after step {steps[0]} beside their "
                          "prompts and rescore a few by hand; compare the reward's code and "
                          "settings before and after; the policy itself holds on held-out "
                          "prompts, so keep its checkpoints")]
    return [found('reward_fell', 'warning', steps, evidence=ev,
                  series=['reward', 'heldout', 'grad_norm', 'kl', 'entropy', 'resp_len'],
                  causes=["the learning rate is too high: an update broke the policy (look for "
                          f"grad-norm or KL spikes just before step {steps[0]})",
                          "the policy slid into a degenerate mode (repetition, empty or endless "
                          "answers: see the completion length)",
                          "the data got harder, or the reward changed, mid-run"],
                  fix=f"restart from the checkpoint before step {steps[0]} with a lower lr "
                      "(3-10x), keep grad clipping, or anchor the policy with beta > 0")]


def validation_verdict(run, first):
    """('held' | 'fell' | 'unknown', evidence) for held-out scores from step `first` on against
    their best before it: tells a policy that got worse from a reward or batch that changed."""
    held = finite(points(run, 'heldout'))
    before = [(s, v) for s, v in held if s < first]
    after = [(s, v) for s, v in held if s >= first]
    if not before or not after:
        return 'unknown', "; no validation score on both sides of it to tell a worse policy apart"
    best = max(v for _, v in before)
    best_step = min(s for s, v in before if v == best)
    last_step, last = after[-1]
    scores = f"validation {g(best)} at step {best_step}, {g(last)} at step {last_step}"
    if best - last >= HACK_HELDOUT_DROP:
        return 'fell', f"; {scores}: it fell too, so the policy got worse"
    return 'held', f"; {scores}: it held, so the policy did not get worse on held-out prompts"


def detect_zero_loss(run):
    """Loss exactly 0 for several steps with no gradient: identical rewards in every group (zero
    advantages), or, with a reward spread, advantages that never reach the loss."""
    pts = points(run, 'loss')
    grad = dict(points(run, 'grad_norm'))
    out = []
    for i, j in flat_stretches(pts, MIN_FLAT_STEPS):
        if pts[i][1] != 0:
            continue
        steps = [s for s, _ in pts[i:j + 1]]
        grads = [grad[s] for s in steps if s in grad]
        if grads and median(grads) > 0:
            continue  # GRPO's loss value is about 0 by construction while its gradient is not
        ev = f"loss exactly 0 on steps {span_text(run, steps)} ({len(steps)} steps)"
        if grads:
            ev += ", grad norm 0"
        spread = reward_spread(run, steps)
        same = ["identical rewards in every group: all advantages are 0, so the loss is 0 by "
                "construction (a judge or reward scoring every completion alike, or a constant "
                "reward)",
                "groups whose completions are all the same (temperature too low, entropy "
                "collapsed)"]
        masked = ["the advantages never reach the loss: a completion mask of zeros (padding "
                  "side, a prompt/completion off-by-one, every completion masked as truncated)",
                  "the loss's policy term is scaled by 0 (a coefficient, or a log-prob ratio "
                  "detached on both sides)"]
        if spread == 'none':
            ev += "; the rewards tie in every group (reward std 0)"
            causes, fix = same, ("score one group's completions by hand: if they differ, the "
                                 "reward is broken; if they are identical, raise temperature "
                                 "or group_size")
        elif spread == 'some':
            ev += "; the rewards differ within groups"
            causes, fix = masked, ("print one micro-batch's loss parts: the mask's sum, the "
                                   "advantages, the per-token log-probs")
        else:
            ev += "; the reward's spread is not logged"
            causes = same + masked
            fix = ("log the reward's std per step; score one group's completions by hand; if "
                   "they differ, print one micro-batch's mask sum and advantages")
        ev += step_time_note(run, steps)
        out.append(found('zero_loss', 'error', steps, evidence=ev, causes=causes, fix=fix,
                         series=['loss', 'reward_std', 'zero_std_frac', 'grad_norm']))
    return out


def reward_spread(run, steps):
    """'none' (every group tied on every step), 'some', or 'unknown' (not logged)."""
    steps = set(steps)
    std = [v for s, v in points(run, 'reward_std') if s in steps]
    tied = [v for s, v in points(run, 'zero_std_frac') if s in steps]
    width = [v for s, v in reward_range(run).items() if s in steps]
    if not std and not tied and not width:
        return 'unknown'
    if all(v == 0 for v in std + width) and all(v == 1 for v in tied):
        return 'none'
    return 'some'


def reward_range(run):
    """{step: highest - lowest reward} where both are logged (verl logs no std)."""
    high, low = dict(points(run, 'reward_max')), dict(points(run, 'reward_min'))
    return {k: high[k] - low[k] for k in high if k in low}


def step_time_note(run, steps):
    t = dict(finite(points(run, 'step_time')))
    during = [t[s] for s in steps if s in t]
    return f"; {g(median(during))} s a step" if during else ''


def detect_step_time(run):
    """The first steps slow, then fast (compilation: info); every step after the first slower than
    it (recompilation, shape churn); single slow steps later on (stalls). A step's validation and
    checkpoint time (inside verl's step) is left out: those steps are slow by design."""
    pts = [(s, v) for s, v in work_time(run) if v > 0]
    if len(pts) < 3:
        return []
    lead = 0  # the leading slow steps: the first compile, and a second when shapes first change
    while lead < len(pts) - 1 and pts[lead][1] > WARMUP_FACTOR * median([v for _, v in pts]):
        lead += 1
    med = median([v for _, v in pts[max(lead, 1):]])
    out = []
    if lead:
        steps = [s for s, _ in pts[:lead]]
        took = ', '.join(g(v) for _, v in pts[:lead])
        out.append(found('first_steps_slow', 'info', steps, series=['step_time'],
                         evidence=f"step(s) {span_text(run, steps)} took {took} s, the rest "
                                  f"{g(med)} s (median)" + phase_note(run, steps),
                         causes=['compilation and warm-up (torch.compile, kernel autotuning, the '
                                 'allocator, CUDA graphs), and one more compile when shapes first '
                                 'change: expected'],
                         fix='nothing; it is paid once'))
    first_step, first = pts[0]
    if not lead and med > SLOWDOWN_FACTOR * first:
        steps = [s for s, v in pts[1:] if v > SLOWDOWN_FACTOR * first]
        causes = ["recompilation at every step: torch.compile meets new shapes (completion "
                  "lengths change every step); TORCH_LOGS=recompiles shows it",
                  "memory pressure: the allocator at its limit frees and retries, or the host "
                  "swaps",
                  "the machine is shared: other processes on the same GPU or CPU cores"]
        lens = finite(points(run, 'resp_len'))
        later = median([v for _, v in lens[1:]]) if len(lens) > 1 else 0
        if lens and lens[0][1] > 0 and later / lens[0][1] > med / first / 2:
            causes.insert(0, f"longer completions: length {g(lens[0][1])} at the first step, "
                             f"{g(later)} later")
        out.append(found('steps_slower_than_first', 'warning', steps, series=['step_time'],
                         evidence=f"steps after the first take {g(med)} s (median), "
                                  f"{med / first:.1f}x the first step's {g(first)} s; they do "
                                  "finish, so this is not a deadlock" + phase_note(run, steps),
                         causes=causes,
                         fix="find what changes between steps: compile with dynamic=True or pad "
                             "to a few fixed lengths, check memory headroom, run alone"))
        return out
    slow = [s for s, v in pts[max(lead, 1):] if v > SLOW_STEP_FACTOR * med]
    if slow:
        out.append(found('slow_steps', 'warning', slow, series=['step_time'],
                         evidence=f"steps {span_text(run, slow)} took up to "
                                  f"{g(max(v for s, v in pts if s in slow))} s against a median "
                                  f"of {g(med)} s" + phase_note(run, slow),
                         causes=['a stall: a reward or rollout service answering slowly, a '
                                 'checkpoint or evaluation inside the step, a straggler rank',
                                 'a recompilation for a new shape'],
                         fix='look at what those steps did differently (the phase that grew)'))
    return out


def work_time(run):
    """[(step, seconds)]: the step's time less its validation and checkpoint phases."""
    outside = [dict(points(run, name)) for name in OUTSIDE_WORK]
    return [(s, v - sum(phase.get(s, 0.0) for phase in outside))
            for s, v in finite(points(run, 'step_time'))]


def phase_note(run, steps):
    """'; the time went to time_gen (40 s vs 8 s)': the phase that grew most on these steps."""
    best, steps = None, set(steps)
    for name in PHASES:
        if name in OUTSIDE_WORK:
            continue
        pts = finite(points(run, name))
        on = [v for s, v in pts if s in steps]
        off = [v for s, v in pts if s not in steps]
        if on and off and (best is None or median(on) - median(off) > best[1] - best[2]):
            best = (name, median(on), median(off))
    if best is None:
        return ''
    return (f"; the time went to {SERIES[best[0]]} ({g(best[1])} s vs {g(best[2])} s on other "
            "steps)")


def detect_kl_at_start(run):
    """KL high at the first step, before any update: the reference is not the starting policy."""
    pts = finite(points(run, 'kl'))
    if not pts or pts[0][0] > FIRST_STEP_MAX or pts[0][1] <= KL_START_MAX:
        return []
    s, v = pts[0]
    return [found('kl_at_start', 'error', [s], series=['kl'],
                  evidence=f"KL to the reference {g(v)} at step {s}, before the policy moved "
                           f"from its starting weights, where it should be about 0 (under "
                           f"{KL_START_MAX})",
                  causes=["the reference is not the policy's starting weights (a base model "
                          "against an SFT policy, an adapter merged in one and not the other)",
                          "dropout on in one forward and off in the other (train() vs eval(), "
                          "dropout in the model config)",
                          "different numerics or inputs between the two log-prob passes: dtype, "
                          "attention kernel, temperature applied to one side only, different "
                          "tokens"],
                  fix="before training, compute the policy's and the reference's log-probs on "
                      "one batch: they must agree to about 1e-3 per token. Load the reference "
                      "from the very weights the policy starts from, eval() both, same dtype; "
                      "raising the KL threshold hides it")]


def detect_spikes(run):
    """Grad-norm and KL spikes against the median of the steps before; KL staying high."""
    out = []
    for name, floor in (('grad_norm', GRAD_SPIKE_FLOOR), ('kl', KL_SPIKE_FLOOR)):
        pts = finite(points(run, name))
        spikes = []
        for i in range(2, len(pts)):
            ref = median([v for _, v in pts[max(0, i - SPIKE_WINDOW):i]])
            if pts[i][1] > floor and pts[i][1] > SPIKE_FACTOR * ref:
                spikes.append((pts[i][0], pts[i][1], ref))
        if not spikes:
            continue
        ev = '; '.join(f"{g(v)} at step {s} (median before {g(r)})" for s, v, r in spikes[:5])
        if name == 'grad_norm':
            causes = ['the learning rate is too high for the model (or the warmup too short)',
                      'a batch of outliers: very long or degenerate completions',
                      'off-policy tokens: the sampler and trainer disagree (top_k/top_p, '
                      'different numerics), so importance ratios explode',
                      'fp16 overflow']
            fix = ('lower lr or lengthen warmup, keep grad clipping (1.0), read those steps\' '
                   'completions')
        else:
            causes = ['the learning rate is too high or beta too small',
                      'the policy found a degenerate mode (repetition) the reference finds '
                      'unlikely: check entropy and length',
                      'KL estimator outliers (k3 on tokens with a huge log-ratio)']
            fix = 'lower lr, raise beta, clamp the log-ratio in the KL estimate'
        out.append(found(f'{name}_spike', 'warning', [s for s, _, _ in spikes],
                         evidence=f"{name} spikes: {ev}", causes=causes, fix=fix,
                         series=[name]))
    kl = finite(points(run, 'kl'))
    tail = [v for _, v in kl[len(kl) * 3 // 4:]]
    if len(kl) >= 4 and median(tail) > KL_HIGH:
        steps = [s for s, v in kl if v > KL_HIGH]
        out.append(found('kl_high', 'warning', steps, series=['kl'],
                         evidence=f"KL to the reference {g(median(tail))} (median of the last "
                                  f"quarter), above {KL_HIGH} on steps {span_text(run, steps)}",
                         causes=['the policy drifted far from the reference: lr too high or '
                                 'beta too small'],
                         fix='lower lr or raise beta; check the completions still read well'))
    return out


def detect_nonfinite(run):
    """NaN or inf in the loss, gradient, KL, reward or entropy."""
    bad = {}
    for name in ('loss', 'grad_norm', 'kl', 'reward', 'entropy'):
        steps = [s for s, v in points(run, name) if not math.isfinite(v)]
        if steps:
            bad[name] = steps
    if not bad:
        return []
    steps = sorted({s for v in bad.values() for s in v})
    ev = '; '.join(f"{k} NaN/inf at steps {span_text(run, v)}" for k, v in bad.items())
    last = max(s for name in bad for s, _ in points(run, name))
    if last in steps:
        ev += f"; still non-finite at the last step ({last}): the weights may be NaN"
    return [found('nonfinite', 'error', steps, series=list(bad), evidence=ev,
                  causes=['fp16 overflow, or a log-prob of -inf (a token the model gives '
                          'probability 0) making a ratio or the KL infinite',
                          'the learning rate too high: check the grad norm before '
                          f'step {steps[0]}',
                          'a 0/0: advantages divided by a zero std with no epsilon, or a mean '
                          'over an empty mask',
                          'a reward returning NaN'],
                  fix=f"start from step {steps[0]}: bf16 or fp32 instead of fp16, lower lr, keep "
                      "grad clipping, an epsilon in the advantage's std; ours skips the update "
                      "and rolls back after nan_patience steps")]


def detect_entropy_collapse(run):
    """Entropy falling to a small share of where it started."""
    # exactly 0 is no measurement (ours logs 0 on a step with no tokens to train on)
    pts = [(s, v) for s, v in finite(points(run, 'entropy')) if v != 0]
    if len(pts) < 4:
        return []
    start = median([v for _, v in pts[:3]])
    end = median([v for _, v in pts[-3:]])
    if start < ENTROPY_MIN_START or end >= ENTROPY_COLLAPSE_FRAC * start:
        return []
    steps = [s for s, v in pts if v < ENTROPY_COLLAPSE_FRAC * start]
    ev = (f"entropy {g(start)} at the start, {g(end)} at the end; below "
          f"{ENTROPY_COLLAPSE_FRAC:.0%} of the start from step {steps[0]}")
    tied = finite(points(run, 'zero_std_frac'))
    if tied:
        ev += f"; groups with tied rewards {tied[0][1]:.0%} -> {tied[-1][1]:.0%}"
    return [found('entropy_collapse', 'warning', steps, series=['entropy', 'zero_std_frac'],
                  evidence=ev,
                  causes=['the learning rate is too high: the policy sharpens onto one answer '
                          'per prompt',
                          'nothing holds it: no KL (beta 0) or entropy term',
                          'no clip-higher: low-probability tokens cannot grow (DAPO)',
                          'sampling below temperature 1 reinforces the mode'],
                  fix="lower lr, eps_high=0.28 (clip-higher), beta > 0 or entropy_coef, "
                      "temperature 1.0; once collapsed, groups stop differing and learning "
                      "stops")]


def detect_truncation(run):
    """Completions hitting the length limit."""
    pts = finite(points(run, 'trunc_frac'))
    steps = [s for s, v in pts if v > TRUNC_WARN]
    if len(steps) < MIN_FLAT_STEPS:
        return []
    worst = max(v for _, v in pts)
    ev = (f"{worst:.0%} of completions at the length limit at worst; above {TRUNC_WARN:.0%} on "
          f"steps {span_text(run, steps)}")
    causes = ['the limit (max_new_tokens, max_completion_length, response_length) is too '
              'short for the answers',
              'the model rambles or repeats',
              'generation never stops: the stop/EOS token is not set']
    lens = finite(points(run, 'resp_len'))
    if lens:
        ev += f"; mean length {g(lens[0][1])} -> {g(lens[-1][1])}"
        if lens[0][1] > 0 and lens[-1][1] > 1.5 * lens[0][1]:
            causes.insert(0, causes.pop(1))
    return [found('truncated', 'warning', steps, evidence=ev, causes=causes,
                  series=['trunc_frac', 'resp_len'],
                  fix="raise the limit; add an overlong penalty (ours: {'name': 'length'}); "
                      "mask truncated completions; check the stop ids")]


def detect_memory(run):
    """Device memory near the device's limit."""
    pts = finite(points(run, 'mem_frac'))
    steps = [s for s, v in pts if v > MEM_NEAR]
    if not steps:
        return []
    first, last = pts[0][1], pts[-1][1]
    causes = ['an inference engine that reserves memory up front (vLLM\'s '
              'gpu_memory_utilization): expected then, but nothing is left for a longer batch',
              'the batch only just fits: a longer one runs out of memory, or the allocator frees '
              'and retries (slow steps)',
              'fragmentation or a leak, if it rises over the run']
    if last > first + 0.1:
        causes.insert(0, causes.pop())
    return [found('memory_near_limit', 'warning', steps, series=['mem_frac'], causes=causes,
                  evidence=f"device memory up to {max(v for _, v in pts):.0%} of the device, "
                           f"above {MEM_NEAR:.0%} on steps {span_text(run, steps)} "
                           f"({first:.0%} at the first logged step, {last:.0%} at the last)",
                  fix="fewer rows per micro-batch, gradient checkpointing, a shorter limit, "
                      "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; with a colocated "
                      "vLLM, a lower gpu_memory_utilization")]


def detect_reward_hacking(run):
    """Reward rising while held-out accuracy falls from its best."""
    held = finite(points(run, 'heldout'))
    rew = finite(points(run, 'reward'))
    if len(held) < 2 or len(rew) < 4:
        return []
    best = max(v for _, v in held[:-1])
    best_step = min(s for s, v in held if v == best)
    last_step, last = held[-1]
    before = [v for s, v in rew if s <= best_step] or [rew[0][1]]
    after = [v for s, v in rew if s > best_step]
    if not after or best - last < HACK_HELDOUT_DROP:
        return []
    rise = sum(after) / len(after) - sum(before) / len(before)
    if rise < HACK_REWARD_RISE:
        return []
    steps = [s for s, _ in rew if best_step < s <= last_step]
    mean_before, mean_after = sum(before) / len(before), sum(after) / len(after)
    return [found('reward_hacking', 'warning', steps, series=['reward', 'heldout'],
                  evidence=f"reward up {g(rise)} after step {best_step} (mean {g(mean_before)} "
                           f"-> {g(mean_after)}) while held-out accuracy fell from {g(best)} "
                           f"at step {best_step} to {g(last)} at step {last_step}",
                  causes=['the reward pays something other than being right (format, length, '
                          'a judge\'s taste) and the policy found it',
                          'the answer parser can be gamed (it takes any number, the first '
                          'boxed answer)',
                          'the training prompts differ from the held-out ones'],
                  fix="read the highest-reward completions of the late steps; weight "
                      "correctness higher, tighten the parser, evaluate more often")]


def detect_zero_spread(run):
    """Most groups with tied rewards: most of each batch teaches nothing."""
    pts = [(s, v) for s, v in finite(points(run, 'zero_std_frac')) if v < 1]
    if len(pts) < MIN_FLAT_STEPS:
        return []  # steps with every group tied are the flat-reward and zero-loss findings' case
    m = median([v for _, v in pts])
    if m <= ZERO_SPREAD_WARN:
        return []
    steps = [s for s, v in pts if v > ZERO_SPREAD_WARN]
    rew = finite(points(run, 'reward'))
    level = f"; reward mean {g(median([v for _, v in rew]))}" if rew else ''
    return [found('few_groups_learn', 'warning', steps, series=['zero_std_frac', 'reward'],
                  evidence=f"{m:.0%} of groups (median over steps) had identical rewards and "
                           f"no advantage{level}",
                  causes=['the prompts are too easy or too hard for the policy',
                          'too few samples per group, or sampling too cold',
                          'a coarse reward (0/1) on a hard task'],
                  fix="data nearer the policy's level, dynamic sampling (DAPO), a larger "
                      "group_size or temperature")]


def detect_clipping(run):
    """The PPO clip cutting a large share of tokens: the policy moves too far per batch."""
    pts = finite(points(run, 'clip_frac'))
    tail = [v for _, v in pts[len(pts) // 2:]]
    if len(pts) < MIN_FLAT_STEPS or median(tail) <= CLIP_WARN:
        return []
    steps = [s for s, v in pts if v > CLIP_WARN]
    return [found('clipped', 'warning', steps, series=['clip_frac'],
                  evidence=f"the clip cut {median(tail):.0%} of tokens (median, second half of "
                           f"the run); above {CLIP_WARN:.0%} on steps {span_text(run, steps)}",
                  causes=['the learning rate is too high',
                          'too many updates per batch (num_iterations, ppo_epochs)',
                          'stale or off-policy samples (asynchronous rollouts, a sampler that '
                          'disagrees with the trainer)'],
                  fix='lower lr, fewer iterations per batch, check the sampler/trainer '
                      'log-prob gap')]


DETECTORS = [detect_flat_reward, detect_reward_fall, detect_zero_loss, detect_nonfinite,
             detect_kl_at_start, detect_spikes, detect_entropy_collapse, detect_reward_hacking,
             detect_truncation, detect_memory, detect_clipping, detect_zero_spread,
             detect_step_time]


def diagnose(run):
    """Every detector's findings, most severe first (detector order within a severity)."""
    findings = [f for detect in DETECTORS for f in detect(run)]
    return [f for severity in reversed(SEVERITIES) for f in findings if f['severity'] == severity]


# ------------------------------------------------------------------------------------ output
def report(run, findings, png=None, fail_on='error'):
    """The plain-text report: what was read, one paragraph per finding, then one line each for the
    names no table knows, the exit code's reason and the plot."""
    steps = run['steps']
    lines = [f"doctor: {run['path']} ({run['source']}, {run['rows']} rows, steps "
             f"{steps[0]}-{steps[-1]})",
             "series: " + ', '.join(k for k in SERIES if run['series'].get(k))]
    if run['problems']:
        lines.append(f"unreadable rows: {len(run['problems'])} (first: {run['problems'][0]})")
    lines.append('')
    for f in findings:
        causes = '; '.join(f"({i}) {c}" for i, c in enumerate(f['causes'], 1))
        lines.append(f"{f['severity'].upper()} {f['name']} (steps {span_text(run, f['steps'])}): "
                     f"{f['evidence']}. Likely causes: {causes}. Fix: {f['fix'].rstrip('.')}.")
        lines.append('')
    if not findings:
        lines.append(f"nothing flagged ({len(DETECTORS)} detectors ran).")
    elif all(f['severity'] == 'info' for f in findings):
        lines.append("nothing flagged above info.")
    elif exit_code(findings, fail_on) == 0:
        lines.append("warnings only: exit code 0 (--fail_on=warning makes it 1).")
    unknown = sorted(run['unknown'])
    if unknown:
        first = ', '.join(unknown[:UNKNOWN_SHOWN])
        more = f"first {first}; --json lists all" if len(unknown) > UNKNOWN_SHOWN else first
        lines.append(f"not mapped: {len(unknown)} names ({more}); a table in doctor.py can map them")
    if png:
        lines.append(f"plot: {png}")
    return '\n'.join(lines)


def plot(run, findings, out_png):
    """The flagged series, one panel each (reward first), with each finding's steps shaded."""
    from matplotlib.figure import Figure  # imported here: only a plot pays for matplotlib
    from matplotlib.ticker import MaxNLocator

    names = ['reward'] + [n for f in findings for n in f['series']]
    names = [n for n in dict.fromkeys(names) if run['series'].get(n)][:8]
    if not names:
        names = [n for n in SERIES if run['series'].get(n)][:4]
    fig = Figure(figsize=(10, 1.9 * len(names) + 0.6), layout='constrained')
    axs = fig.subplots(len(names), 1, sharex=True, squeeze=False)[:, 0]
    colors = {'error': 'tab:red', 'warning': 'tab:orange', 'info': 'tab:gray'}
    for ax, name in zip(axs, names):
        pts = points(run, name)
        good = finite(pts)
        if good:
            ax.plot(*zip(*good), lw=1.2, marker='.' if len(good) < 60 else None)
        bad = [s for s, v in pts if not math.isfinite(v)]
        if bad:
            ax.plot(bad, [0.95] * len(bad), 'x', color='red', transform=ax.get_xaxis_transform())
        shown = [f for f in findings if name in f['series']]
        for k, f in enumerate(shown):
            for a, b in runs_of(run, f['steps']):
                ax.axvspan(a - 0.5, b + 0.5, color=colors[f['severity']], alpha=0.2, lw=0)
            ax.text(0.01, 0.92 - 0.13 * k, f['name'], transform=ax.transAxes, fontsize=7,
                    va='top', color=colors[f['severity']])
        if name.endswith('_frac'):
            ax.set_ylim(-0.03, 1.05)  # a share: drawn against its whole range
        ax.set_ylabel(name, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axs[-1].set_xlabel('step', fontsize=8)
    axs[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(f"doctor: {run['path']}", fontsize=9)
    fig.savefig(out_png, dpi=90)


def exit_code(findings, fail_on):
    """1 when a finding is at least `fail_on` severe ('error', or 'warning'), else 0."""
    worst = max((SEVERITIES.index(f['severity']) for f in findings), default=-1)
    return 1 if worst >= SEVERITIES.index(fail_on) else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0].strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('path', help='an out_dir, a TRL output dir or checkpoint, a log or CSV file')
    ap.add_argument('--out', default='', help='where to write the plot (default: beside PATH)')
    ap.add_argument('--json', action='store_true', help='print the findings as JSON')
    ap.add_argument('--no_plot', action='store_true', help='skip doctor.png')
    ap.add_argument('--device_gb', type=float, default=0.0,
                    help="the device's memory in GB, to check peak memory against")
    ap.add_argument('--fail_on', choices=['error', 'warning'], default='error',
                    help="exit 1 on a finding this severe or more (default: errors only; "
                         "warnings are printed and exit 0)")
    args = ap.parse_args(argv)
    run = load(args.path, args.device_gb)
    if isinstance(run, str):
        print(f"doctor: {run}", file=sys.stderr)
        return 2
    for line in run['problems'][:MAX_PROBLEM_LINES]:
        print(f"doctor: {line}", file=sys.stderr)
    if len(run['problems']) > MAX_PROBLEM_LINES:
        print(f"doctor: ... {len(run['problems']) - MAX_PROBLEM_LINES} more unreadable rows",
              file=sys.stderr)
    findings = diagnose(run)
    png = None
    if not args.no_plot:
        beside = args.path if os.path.isdir(args.path) else os.path.dirname(args.path)
        png = args.out or os.path.join(beside, 'doctor.png')
        try:
            plot(run, findings, png)
        except OSError as e:
            print(f"doctor: cannot write {png}: {e}", file=sys.stderr)
            png = None
    if args.json:
        out = {'path': run['path'], 'source': run['source'], 'rows': run['rows'],
               'series': sorted(k for k, v in run['series'].items() if v),
               'unknown': sorted(run['unknown']), 'problems': run['problems'],
               'findings': findings, 'plot': png}
        print(json.dumps(out, indent=1))
    else:
        print(report(run, findings, png, fail_on=args.fail_on))
    return exit_code(findings, args.fail_on)


if __name__ == '__main__':
    sys.exit(main())
