"""
Everything a GPU machine is asked to measure, in one command: each part in its own subprocess with a
timeout (one failure or hang does not lose the others), one JSON per part in a results folder, each
with a `device` field.

  # on a GPU: all parts, ~15-20 min, bench/results/<date>_<gpu>/
  python bench/gpu_check.py
  # some parts (same folder: a later run adds to it)
  python bench/gpu_check.py --parts=tests,kernel
  # the same pipeline on the CPU at toy sizes, 1-2 min
  python bench/gpu_check.py --cpu-smoke

Parts (file names: <part>.json, its full output in <part>.log; summary.json lists every part's
status and headline figures next to the targets in TARGETS):
  tests        pytest tests/test_cuda.py tests/test_flex.py with GRPO_TEST_DEVICE=cuda,
               TRITON_INTERPRET=0: the Triton kernels compiled for real on CUDA against the fp64
               oracles of test_kernels/test_lmhead, model and sampler in bf16 on CUDA,
               FlexAttention's CUDA kernels (forward and backward) = SDPA. (The CPU suites
               tests/test_kernels.py and test_lmhead.py build their data on the CPU and need the
               interpreter.)
  kernel       bench/bench_kernels.py at 8 x 1024 x 151,936 bf16: log-prob + entropy forward and
               forward+backward, fraction of HBM peak, peak memory, next to log_softmax+gather and
               a TRL-style loop; the sampler at 256 x 151,936 with top-p next to sort-based top-p;
               packed-group attention, flex vs dense SDPA vs rows
  sample       bench/bench_sample.py at Qwen2.5-0.5B's shape, random weights, bf16, 64 prompts x 8
               samples x 256 tokens: tokens/s eager and compiled next to transformers' generate,
               fraction of the HBM roofline
  step         bench/bench_step.py --preset=gpu next to TRL's GRPOTrainer (a skip line when
               trl/datasets do not import: ours alone then)
  step_gsm8k   bench/bench_step.py --config=config/gsm8k.py: 20 steps of the GSM8K config's shape
               (32 prompts x 8 x 512 tokens) from random weights at Qwen2.5-0.5B's shape: per-phase
               time and peak memory per step
GSM8K prompts come from --data_dir (default ../shared/gsm8k); without it the step parts use the
arithmetic task's prompts (shorter: the JSON says so). Where a machine allows 10 minutes per
command, run the parts in two or three calls (e.g. --parts=tests,kernel then --parts=sample,step
then --parts=step_gsm8k) into the same --out folder.
"""
import argparse
import datetime
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
PARTS = ('tests', 'kernel', 'sample', 'step', 'step_gsm8k')
# the targets: (part, path into its result, comparison, value, what)
TARGETS = [('kernel', ('logprob', 'ours_fwd', 'ms'), '<=', 0.87,
            'log-prob+entropy forward, H100 (ms)'),
           ('kernel', ('logprob', 'ours_fwd_bwd', 'ms'), '<=', 2.6,
            'log-prob+entropy forward+backward, H100 (ms)'),
           ('kernel', ('sampler', 'speedup_vs_sort'), '>=', 3.0,
            'sampler vs sort-based top-p (x)')]


def device_name(smoke):
    import torch
    if torch.cuda.is_available() and not smoke:
        return torch.cuda.get_device_name(0)
    return f"cpu-smoke ({os.cpu_count()} cores)" if smoke else 'cpu'


def versions():
    out = {'python': sys.version.split()[0]}
    for mod in ('torch', 'triton', 'transformers', 'peft', 'trl', 'datasets'):
        # from the installed metadata: importing transformers and peft only to read a version costs
        # seconds
        try:
            out[mod] = importlib.metadata.version(mod)
        except importlib.metadata.PackageNotFoundError:
            # an absent optional package is a fact to record
            out[mod] = 'not installed'
    try:
        import torch
        out['cuda'] = torch.version.cuda
    except Exception:
        pass
    return out


def commands(args, smoke, task):
    """{part: (argv, extra env, timeout s)}: the GPU sizes, or toy sizes for --cpu-smoke."""
    def bench(name):
        return [PY, os.path.join(ROOT, 'bench', name)]

    data = [f'--task={task}'] + ([f'--data_dir={args.data_dir}'] if task == 'gsm8k' else [])
    trl = [f'--trl={args.trl}']
    pytest = [PY, '-m', 'pytest', '-q', '-n', '0', '-p', 'no:cacheprovider']
    if smoke:
        tests = ['tests/test_cuda.py',
                 'tests/test_flex.py::test_masks_from_segments_are_the_layout']
        kernel = ['--tokens=64', '--vocab=1000', '--rows=8', '--reps=1',
                  f'--attention={int(not args.smoke_no_flex)}', '--attn_shape=1,8,2,4']
        sample = ['--shape=tiny', '--batch=4', '--group_size=2', '--new_tokens=8', '--reps=1',
                  '--compile=0', '--prompt_len=10']
        step_gsm8k = ['--preset=smoke', '--config=config/gsm8k.py', '--steps=2', '--warmup=0',
                      '--trl=0', '--task=arith',
                      '--ours_args=--batch_prompts=2 --group_size=4 --max_new_tokens=16 '
                      '--micro_batch_size=8']
        return {
            'tests': (pytest + tests, {}, 120),
            'kernel': (bench('bench_kernels.py') + kernel, {}, 180),
            'sample': (bench('bench_sample.py') + sample, {}, 180),
            'step': (bench('bench_step.py') + ['--preset=smoke', '--task=arith', *trl], {}, 240),
            'step_gsm8k': (bench('bench_step.py') + step_gsm8k, {}, 240),
        }
    env = {'GRPO_TEST_DEVICE': 'cuda', 'TRITON_INTERPRET': '0'}
    kernel = ['--tokens=8192', '--vocab=151936', '--dtype=bfloat16', '--rows=256']
    sample = ['--shape=qwen25_05b', '--dtype=bfloat16', '--batch=64', '--group_size=8',
              '--new_tokens=256', '--reps=3']
    step_gsm8k = ['--preset=gpu', '--config=config/gsm8k.py', '--steps=20', '--warmup=0', '--trl=0',
                  *data]
    return {
        'tests': (pytest + ['tests/test_cuda.py', 'tests/test_flex.py'], env, 480),
        'kernel': (bench('bench_kernels.py') + kernel, {}, 360),
        'sample': (bench('bench_sample.py') + sample, {}, 540),
        'step': (bench('bench_step.py') + ['--preset=gpu', *data, *trl], {}, 570),
        'step_gsm8k': (bench('bench_step.py') + step_gsm8k, {}, 570),
    }


def run_part(part, argv, env, timeout, out_dir):
    """Run argv from the repository root with a timeout (its whole process group killed on expiry);
    its output to <out_dir>/<part>.log. Returns (status, rc, wall seconds, log text)."""
    log_path = os.path.join(out_dir, f'{part}.log')
    # (GPU tests: TRITON_INTERPRET=0, which triton reads as off; tests/conftest.py sets 1 only where
    # it is absent)
    full_env = {**os.environ, 'PYTHONUNBUFFERED': '1', **env}
    t = time.time()
    with open(log_path, 'w') as log:
        log.write(f"$ {' '.join(argv)}\n")
        log.flush()
        # in a process group of its own, so a timeout can kill all of it
        p = subprocess.Popen(argv, cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
            status = 'ok' if rc == 0 else 'failed'
        except subprocess.TimeoutExpired:
            # the bench and whatever it started (train_grpo.py subprocesses)
            os.killpg(p.pid, signal.SIGKILL)
            rc, status = p.wait(), 'timeout'
    with open(log_path, errors='replace') as f:
        text = f.read()
    return status, rc, round(time.time() - t, 1), text


def last_json(text):
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith('{'):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def pytest_result(text, junit):
    """Counts and failed test names from pytest's junit XML (and its summary line)."""
    res = {'summary': next((ln.strip() for ln in reversed(text.splitlines())
                            if re.search(r'\d+ (passed|failed|skipped|error)', ln)), None)}
    if os.path.exists(junit):
        cases = ET.parse(junit).getroot().iter('testcase')
        outcome = {}
        for c in cases:
            name = f"{c.get('classname')}::{c.get('name')}"
            kinds = {child.tag for child in c}
            if kinds & {'failure', 'error'}:
                outcome[name] = 'failed'
            elif 'skipped' in kinds:
                outcome[name] = 'skipped'
            else:
                outcome[name] = 'passed'
        for k in ('passed', 'failed', 'skipped'):
            res[k] = sum(v == k for v in outcome.values())
        res['failed_tests'] = [n for n, v in outcome.items() if v == 'failed']
        res['skipped_tests'] = [n for n, v in outcome.items() if v == 'skipped']
        os.remove(junit)
    return res


def dig(d, path):
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def headline(part, result):
    """The few figures a README row needs, from a part's result."""
    if not isinstance(result, dict):
        return None
    keys = {'kernel': [('logprob', 'ours_fwd', 'ms'), ('logprob', 'ours_fwd_bwd', 'ms'),
                       ('logprob', 'ours_fwd', 'hbm_frac'),
                       ('logprob', 'log_softmax_fwd_bwd', 'ms'),
                       ('logprob', 'trl_loop_fwd_bwd', 'ms'),
                       ('sampler', 'speedup_vs_sort'), ('packed_attention', 'flex_fwd', 'ms'),
                       ('packed_attention', 'sdpa_dense_fwd', 'ms'),
                       ('packed_attention', 'rows_fwd', 'ms'),
                       ('packed_attention', 'flex_fwd_bwd', 'ms'),
                       ('packed_attention', 'sdpa_dense_fwd_bwd', 'ms'),
                       ('packed_attention', 'rows_fwd_bwd', 'ms')],
            'sample': [('ours_tok_s',), ('ours_compiled_tok_s',), ('hf_tok_s',), ('ratio',),
                       ('ratio_compiled',), ('roofline_frac',), ('peak_mem_gb',)],
            'step': [('ours_step_s',), ('trl_step_s',), ('ratio',), ('ours_phases',),
                     ('ours_peak_mem_gb',), ('trl',)],
            'step_gsm8k': [('ours_step_s',), ('ours_phases',), ('ours_peak_mem_gb',),
                           ('ours_gen_tokens_per_s',), ('ours_completion_len',)],
            'tests': [('summary',), ('failed',), ('failed_tests',)]}.get(part, [])
    return {'.'.join(k): dig(result, k) for k in keys}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    # toy sizes on the CPU, the same pipeline
    ap.add_argument('--cpu-smoke', dest='smoke', action='store_true')
    ap.add_argument('--out', default='')  # results folder; '' = bench/results/<date>_<device>/
    ap.add_argument('--parts', default=','.join(PARTS))  # comma-separated subset of PARTS
    # GSM8K jsonl
    ap.add_argument('--data_dir', default=os.path.join(os.path.dirname(ROOT), 'shared', 'gsm8k'))
    # bench_step's TRL side (auto: if importable)
    ap.add_argument('--trl', default='auto', choices=['auto', '1', '0'])
    ap.add_argument('--timeout', type=int, default=0)  # seconds per part; 0 = each part's own
    # --cpu-smoke: leave out the attention timing (its CPU FlexAttention compile is most of the
    # smoke's time)
    ap.add_argument('--smoke_no_flex', action='store_true')
    args = ap.parse_args()
    parts = [p for p in args.parts.split(',') if p]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        sys.exit(f"--parts: unknown {bad}; expected some of {list(PARTS)}")
    import torch
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("no CUDA device: bench/gpu_check.py measures a GPU; --cpu-smoke runs its pipeline "
                 "on the CPU")
    dev = device_name(args.smoke)
    slug = re.sub(r'[^A-Za-z0-9]+', '-', dev.split(' (')[0]).strip('-')
    folder = f"{datetime.date.today().isoformat()}_{slug}"
    out_dir = args.out or os.path.join(ROOT, 'bench', 'results', folder)
    os.makedirs(out_dir, exist_ok=True)
    task = 'gsm8k' if os.path.isfile(os.path.join(args.data_dir, 'train.jsonl')) else 'arith'
    cmds = commands(args, args.smoke, task)
    env_info = versions()
    print(f"device {dev}; results in {out_dir}; parts {parts}; step prompts: {task}"
          + ('' if task == 'gsm8k' else f' (no {args.data_dir}/train.jsonl)'), flush=True)
    for part in parts:
        argv, env, timeout = cmds[part]
        timeout = args.timeout or timeout
        junit = os.path.join(out_dir, f'.{part}.junit.xml')
        if part == 'tests':
            argv = argv + [f'--junitxml={junit}']
        shown = ' '.join(os.path.relpath(a, ROOT) if a.startswith(ROOT) else a for a in argv)
        print(f"[{part}] {shown} (timeout {timeout} s)", flush=True)
        status, rc, wall, text = run_part(part, argv, env, timeout, out_dir)
        result = pytest_result(text, junit) if part == 'tests' else last_json(text)
        if part != 'tests' and status == 'ok' and result is None:
            status = 'failed'  # exited 0 without its JSON line
        rec = {'part': part, 'device': dev, 'status': status, 'rc': rc, 'wall_s': wall,
               'timeout_s': timeout, 'smoke': args.smoke, 'command': ' '.join(argv),
               'env': {k: v for k, v in env.items()},
               'step_prompts': task if part.startswith('step') else None, 'versions': env_info,
               'when': datetime.datetime.now().isoformat(timespec='seconds'), 'result': result,
               'log': f'{part}.log'}
        if status != 'ok':
            rec['log_tail'] = text[-3000:]
        if isinstance(result, dict) and 'device' in result:
            # the bench's own wording (threads, load average)
            rec['bench_device'] = result['device']
        files = {'kernel': 'kernels.json', 'step': 'step_vs_trl.json',
                 'step_gsm8k': 'step_gsm8k_shape.json'}
        name = files.get(part, f'{part}.json')
        with open(os.path.join(out_dir, name), 'w') as f:
            json.dump(rec, f, indent=1)
        skips = (ln for ln in text.splitlines() if 'skipped (' in ln and ln.startswith('TRL'))
        skip = next(skips, None)
        print(f"[{part}] {status} in {wall} s -> {name}" + (f"; {skip}" if skip else ''),
              flush=True)
        if status != 'ok':
            print('\n'.join('    ' + ln for ln in text.strip().splitlines()[-8:]), flush=True)
    summarize(out_dir, dev)


def summarize(out_dir, dev):
    """summary.json from every part's JSON in the folder (parts run in earlier calls included)."""
    parts, targets = {}, []
    for name in sorted(os.listdir(out_dir)):
        if not name.endswith('.json') or name == 'summary.json':
            continue
        with open(os.path.join(out_dir, name)) as f:
            rec = json.load(f)
        if not isinstance(rec, dict) or 'part' not in rec:
            continue
        parts[rec['part']] = {'file': name, 'status': rec['status'], 'wall_s': rec['wall_s'],
                              'device': rec['device'],
                              'headline': headline(rec['part'], rec['result'])}
        for part, path, op, want, what in TARGETS:
            if part == rec['part']:
                got = dig(rec['result'], path)
                if got is None or rec['smoke']:
                    met = None
                elif op == '<=':
                    met = got <= want
                else:
                    met = got >= want
                targets.append({'what': what, 'target': f'{op} {want}', 'measured': got,
                                'met': met})
    summary = {'device': dev, 'parts': parts, 'targets': targets,
               'all_ok': all(p['status'] == 'ok' for p in parts.values())}
    with open(os.path.join(out_dir, 'summary.json'), 'w') as f:
        json.dump(summary, f, indent=1)
    n_ok = sum(p['status'] == 'ok' for p in parts.values())
    print(f"summary: {n_ok}/{len(parts)} parts ok -> {os.path.join(out_dir, 'summary.json')}",
          flush=True)
    for t in targets:
        print(f"  target {t['what']}: {t['target']}, measured {t['measured']}, met {t['met']}")


if __name__ == '__main__':
    main()
