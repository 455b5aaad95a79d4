"""
Everything a GPU machine is asked to measure, in one command that ends by a deadline: the parts run
in priority order, each in its own subprocess under its own share of the deadline (one failure or
hang does not lose the others), each writing its JSON as soon as it ends, so a run killed from
outside still leaves what it had.

  # on a GPU: the default plan, done by 480 s, into --out
  python bench/gpu_check.py --deadline=480 --out=results
  # some parts, or another order (the order given is the priority)
  python bench/gpu_check.py --parts=tests,kernel
  # the same plan on the CPU at toy sizes, about 1.5 min on 2 cores
  python bench/gpu_check.py --cpu-smoke

The default plan, in priority order (file names: <part>.json; every part's output goes to
gpu_check.log; summary.json, rewritten after each part, lists every part's status and headline
figures next to the targets in TARGETS):
  tests        pytest tests/test_cuda.py tests/test_flex.py with GRPO_TEST_DEVICE=cuda,
               TRITON_INTERPRET=0: the Triton kernels compiled for real on CUDA against the fp64
               oracles of test_kernels/test_lmhead, model and sampler in bf16 on CUDA,
               FlexAttention's CUDA kernels (forward and backward) = SDPA. (--cpu-smoke runs
               test_cuda.py's own code on the CPU: GRPO_CUDA_TESTS_DEVICE=cpu.)
  kernel       bench/bench_kernels.py at 8 x 1024 x 151,936 bf16: log-prob + entropy forward and
               forward+backward, fraction of HBM peak, peak memory, next to log_softmax+gather and
               a TRL-style loop; the sampler at 256 x 151,936 with top-p next to sort-based top-p;
               packed-group attention, flex vs dense SDPA vs rows
  step_gsm8k   bench/bench_step.py --config=config/gsm8k.py: 1 warm-up + 3 measured steps of the
               GSM8K config's shape (32 GSM8K prompts x 8 x 512 tokens) from random weights at
               Qwen2.5-0.5B's shape: per-phase time and peak memory per step. Needs GSM8K's
               train.jsonl in --data_dir (bench/device_prep.sh copies it into .gsm8k/): without
               it the part is skipped and says why; it never falls back to other prompts.
  sample       bench/bench_sample.py at Qwen2.5-0.5B's shape, random weights, bf16, 64 prompts x 8
               samples x 256 tokens: tokens/s eager, graphs and compiled next to transformers'
               generate (one timed run each), fraction of the HBM roofline; then what one eager
               decode forward dispatches (aten operators) and launches on the GPU (profiler)
Not in the default plan (--parts=...,step): step, bench/bench_step.py --preset=gpu next to TRL's
GRPOTrainer (needs trl and datasets; without them ours alone after a skip line); step_graphs,
step_gsm8k with --decode_graphs=True (decode steps captured as CUDA graphs), to set beside it;
step_compiled, step_gsm8k with --compile_decode=True (prefill and decode steps through
torch.compile, dynamic shapes). Both: 2 measured steps, then one profiled (its operator table in
the log).

Time: a part starts only if what is left of the deadline (less RESERVE_S) covers its estimate, else
it is skipped with that reason. It then runs until the end of its share (the parts' SHARES split
the deadline in proportion, and time a part leaves unused passes to the next), never less than its
estimate and never past the deadline; one that reaches its limit is killed and recorded 'timeout'.
--share=PART=SECONDS gives a part exactly that limit instead. Exit status 0 only when every part is
'ok'.
"""
import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

# the deadline counts from here: the interpreter's start and torch's import are in it
START = time.time()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
PARTS = ('tests', 'kernel', 'step_gsm8k', 'sample', 'step', 'step_graphs', 'step_compiled')
PLAN = ('tests', 'kernel', 'step_gsm8k', 'sample')  # the default: the most wanted first
DEFAULT_DEADLINE_S = 480
# seconds kept back from the deadline for the last summary and the interpreter's exit
RESERVE_S = 5
# (estimate, share) in seconds per part. GPU: from the first run on a fresh H200 (2026-11-27, cold
# caches; docs/performance.md): tests 60 s, and 30 s more guessed for the CUDA-graph decode test
# added since (a compile and capture for each of three batch sizes); kernel 136 s, of which 93 s a
# compiled block-mask build that is gone since; step_gsm8k a 72 s first step and 50 s steps
# (decode-bound); sample's eager warm-up alone 20 s. Shares are weights: at the default deadline
# they add up to it, less RESERVE_S.
GPU_BUDGET = {'tests': (90, 92), 'kernel': (45, 48), 'step_gsm8k': (230, 232),
              'sample': (100, 103), 'step': (300, 360), 'step_graphs': (200, 240),
              'step_compiled': (200, 240)}
# --cpu-smoke: about the longest of its runs on a busy 2-core CPU (load average 4-5)
SMOKE_BUDGET = {'tests': (40, 60), 'kernel': (30, 60), 'step_gsm8k': (40, 80), 'sample': (20, 60),
                'step': (40, 80), 'step_graphs': (60, 100),
                'step_compiled': (60, 100)}
FILES = {'kernel': 'kernels.json', 'step': 'step_vs_trl.json',
         'step_gsm8k': 'step_gsm8k_shape.json', 'step_graphs': 'step_gsm8k_graphs.json',
         'step_compiled': 'step_gsm8k_compiled.json'}
LOG = 'gpu_check.log'
# what the parts import, by module -> distribution: a machine that lacks one needs it as a wheel
# (bench/device_prep.sh NAME==VERSION)
NEEDS = {'torch': 'torch', 'triton': 'triton', 'numpy': 'numpy', 'transformers': 'transformers',
         'tokenizers': 'tokenizers', 'safetensors': 'safetensors', 'jinja2': 'jinja2',
         'tiktoken': 'tiktoken', 'pytest': 'pytest', 'xdist': 'pytest-xdist'}
# the targets: (part, path into its result, comparison, value, what)
TARGETS = [('kernel', ('logprob', 'ours_fwd', 'ms'), '<=', 0.87,
            'log-prob+entropy forward, H100 (ms)'),
           ('kernel', ('logprob', 'ours_fwd_bwd', 'ms'), '<=', 2.6,
            'log-prob+entropy forward+backward, H100 (ms)'),
           ('kernel', ('sampler', 'speedup_vs_sort'), '>=', 3.0,
            'sampler vs sort-based top-p (x)')]


def elapsed():
    return time.time() - START


def device_name(smoke):
    import torch
    if torch.cuda.is_available() and not smoke:
        return torch.cuda.get_device_name(0)
    return f"cpu-smoke ({os.cpu_count()} cores)" if smoke else 'cpu'


def versions():
    out = {'python': sys.version.split()[0]}
    for mod in ('torch', 'triton', 'numpy', 'transformers', 'peft', 'trl', 'datasets'):
        # from the installed metadata: importing transformers and peft only to read a version costs
        # seconds
        try:
            out[mod] = importlib.metadata.version(mod)
        except importlib.metadata.PackageNotFoundError:
            # an absent optional package is a fact to record
            out[mod] = 'not installed'
    import torch
    out['cuda'] = torch.version.cuda
    out['commit'] = commit()
    return out


def commit():
    """The repository's commit: from git, else (a copy without .git, as a GPU machine receives)
    from .gsm8k/COMMIT, which bench/device_prep.sh writes; 'unknown' without either."""
    try:
        head = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, text=True,
                              capture_output=True, timeout=10)
        if head.returncode == 0 and head.stdout.strip():
            return head.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open(os.path.join(ROOT, '.gsm8k', 'COMMIT')) as f:
            return f.read().strip() or 'unknown'
    except OSError:
        return 'unknown'


def missing_imports():
    """Distributions the parts import that this Python cannot find (without importing them)."""
    return sorted(dist for mod, dist in NEEDS.items() if importlib.util.find_spec(mod) is None)


def default_data_dir():
    """GSM8K's jsonl: the repository's .gsm8k/ (bench/device_prep.sh fills it, and it travels with
    the repository) when it holds train.jsonl, else ../shared/gsm8k beside the repository."""
    local = os.path.join(ROOT, '.gsm8k')
    if os.path.isfile(os.path.join(local, 'train.jsonl')):
        return local
    return os.path.join(os.path.dirname(ROOT), 'shared', 'gsm8k')


def commands(args, smoke, data_dir):
    """{part: (argv, extra env)}: the GPU sizes, or toy sizes for --cpu-smoke."""
    def bench(name):
        return [PY, os.path.join(ROOT, 'bench', name)]

    gsm8k = ['--task=gsm8k', f'--data_dir={data_dir}']
    trl = [f'--trl={args.trl}']
    pytest = [PY, '-m', 'pytest', '-v', '-n', '0', '-p', 'no:cacheprovider']
    def decoding(step_args, knob):
        # the same step with knob (decode_graphs=True: CUDA graphs on a GPU; compile_decode=True),
        # 2 measured steps, then one more under torch.profiler: its table of operators (in the log)
        # says where the update goes
        ours = [a for a in step_args if a.startswith('--ours_args=')]
        rest = [a for a in step_args if not a.startswith(('--ours_args=', '--steps='))]
        extra = ours[0][len('--ours_args='):] + ' ' if ours else ''
        return bench('bench_step.py') + rest + ['--steps=2', '--profile=1',
                                                f'--ours_args={extra}--{knob}=True']

    if smoke:
        # test_cuda.py but its slow cases on a CPU (the Qwen-shape LM head, 70 s, the compiled
        # decode, 30 s, and the captured one, 5 s, on 2 cores; the GPU plan runs them, and
        # test_sample.py the last two's CPU cases)
        slow = ['test_lm_head_default_tiles_at_qwen_shape',
                'test_compiled_decode_on_cuda_generates_as_eager',
                'test_graph_decode_on_cuda_generates_as_eager']
        tests = ['tests/test_cuda.py', 'tests/test_flex.py::test_masks_from_segments_are_the_layout']
        tests += [f'--deselect=tests/test_cuda.py::{name}' for name in slow]
        kernel = ['--tokens=64', '--vocab=1000', '--rows=8', '--reps=1',
                  f'--attention={int(not args.smoke_no_flex)}', '--attn_shape=1,8,2,4']
        sample = ['--shape=tiny', '--batch=4', '--group_size=2', '--new_tokens=8', '--reps=1',
                  '--compile=0', '--prompt_len=10']
        step_gsm8k = ['--preset=smoke', '--config=config/gsm8k.py', '--steps=2', '--warmup=0',
                      '--trl=0', *gsm8k,
                      '--ours_args=--batch_prompts=2 --group_size=4 --max_new_tokens=16 '
                      '--micro_batch_size=8']
        return {
            # test_cuda.py's own code on the CPU (its kernels take their torch paths)
            'tests': (pytest + tests, {'GRPO_CUDA_TESTS_DEVICE': 'cpu'}),
            'kernel': (bench('bench_kernels.py') + kernel, {}),
            'step_gsm8k': (bench('bench_step.py') + step_gsm8k, {}),
            'sample': (bench('bench_sample.py') + sample, {}),
            'step': (bench('bench_step.py') + ['--preset=smoke', *gsm8k, *trl], {}),
            'step_graphs': (decoding(step_gsm8k, 'decode_graphs'), {}),
            'step_compiled': (decoding(step_gsm8k, 'compile_decode'), {}),
        }
    env = {'GRPO_TEST_DEVICE': 'cuda', 'TRITON_INTERPRET': '0'}
    kernel = ['--tokens=8192', '--vocab=151936', '--dtype=bfloat16', '--rows=256']
    sample = ['--shape=qwen25_05b', '--dtype=bfloat16', '--batch=64', '--group_size=8',
              '--new_tokens=256', '--reps=1']
    step_gsm8k = ['--preset=gpu', '--config=config/gsm8k.py', '--steps=3', '--warmup=1', '--trl=0',
                  *gsm8k]
    return {
        'tests': (pytest + ['tests/test_cuda.py', 'tests/test_flex.py'], env),
        'kernel': (bench('bench_kernels.py') + kernel, {}),
        'step_gsm8k': (bench('bench_step.py') + step_gsm8k, {}),
        'sample': (bench('bench_sample.py') + sample, {}),
        'step': (bench('bench_step.py') + ['--preset=gpu', *gsm8k, *trl], {}),
        'step_graphs': (decoding(step_gsm8k, 'decode_graphs'), {}),
        'step_compiled': (decoding(step_gsm8k, 'compile_decode'), {}),
    }


def window_ends(parts, budget, shares, deadline):
    """Seconds from the start at which each part's share of the deadline ends: what is left of the
    deadline (less RESERVE_S) split in proportion to the parts' shares, an explicit --share taking
    its seconds first; cumulative, so time a part leaves unused passes to the next."""
    usable = deadline - RESERVE_S - elapsed()
    fixed = sum(shares[p] for p in parts if p in shares)
    weights = sum(budget[p][1] for p in parts if p not in shares)
    scale = max(usable - fixed, 0.0) / weights if weights else 0.0
    ends, t = {}, elapsed()
    for p in parts:
        t += shares[p] if p in shares else budget[p][1] * scale
        ends[p] = t
    return ends


def part_limit(*, estimate, share, end, deadline):
    """(time limit in seconds, None), or (None, why it is skipped) when it no longer fits."""
    left = deadline - RESERVE_S - elapsed()
    need = estimate if share is None else min(estimate, share)
    if left < need:
        return None, (f"no longer fits: about {need:.0f} s needed, {max(left, 0):.0f} s left "
                      f"before the {deadline:g} s deadline")
    if share is not None:
        return min(left, share), None
    return min(left, max(end - elapsed(), estimate)), None


def run_part(argv, env, limit, log_path):
    """Run argv from the repository root with a time limit (its whole process group killed on
    expiry, or when this process is stopped), its output appended to log_path. Returns (status, rc,
    wall seconds, its output)."""
    # (GPU tests: TRITON_INTERPRET=0, which triton reads as off; tests/conftest.py sets 1 only where
    # it is absent)
    # HF_HUB_OFFLINE: every model here is built from random weights on the spot, so nothing may wait
    # on a hub the GPU machine cannot reach
    full_env = {'HF_HUB_OFFLINE': '1', **os.environ, 'PYTHONUNBUFFERED': '1', **env}
    t = time.time()
    with open(log_path, 'a') as log:
        start = log.tell()
        log.write(f"$ {' '.join(argv)}\n")
        log.flush()
        # in a process group of its own, so a timeout can kill all of it (the bench and the
        # train_grpo.py it starts)
        p = subprocess.Popen(argv, cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            rc = p.wait(timeout=limit)
            status = 'ok' if rc == 0 else 'failed'
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            rc, status = p.wait(), 'timeout'
        finally:
            if p.poll() is None:
                # stopped from outside: take the part down with this process
                os.killpg(p.pid, signal.SIGKILL)
    with open(log_path, errors='replace') as f:
        f.seek(start)
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
    """Counts and failed test names: from pytest's junit XML, or, when pytest was killed before
    writing it, from its -v lines (the tests that finished)."""
    outcome = {}
    if os.path.exists(junit):
        for c in ET.parse(junit).getroot().iter('testcase'):
            name = f"{c.get('classname')}::{c.get('name')}"
            kinds = {child.tag for child in c}
            if kinds & {'failure', 'error'}:
                outcome[name] = 'failed'
            elif 'skipped' in kinds:
                outcome[name] = 'skipped'
            else:
                outcome[name] = 'passed'
        os.remove(junit)
        source = 'junit'
    else:
        verdicts = {'PASSED': 'passed', 'FAILED': 'failed', 'ERROR': 'failed', 'SKIPPED': 'skipped',
                    'XFAIL': 'skipped', 'XPASS': 'passed'}
        for m in re.finditer(r'^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)', text,
                             re.MULTILINE):
            outcome[m.group(1)] = verdicts[m.group(2)]
        source = 'output (no junit: pytest did not finish)'
    res = {'summary': next((ln.strip() for ln in reversed(text.splitlines())
                            if re.search(r'\d+ (passed|failed|skipped|error)', ln)), None),
           'from': source}
    for k in ('passed', 'failed', 'skipped'):
        res[k] = sum(v == k for v in outcome.values())
    res['failed_tests'] = [n for n, v in outcome.items() if v == 'failed']
    res['skipped_tests'] = [n for n, v in outcome.items() if v == 'skipped']
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
            'sample': [('ours_tok_s',), ('ours_graphs_tok_s',), ('ours_compiled_tok_s',),
                       ('hf_tok_s',), ('ratio',), ('ratio_compiled',), ('graphs_vs_eager',),
                       ('roofline_frac',), ('peak_mem_gb',), ('decode_forward_ops',),
                       ('decode_forward_launches',)],
            'step': [('ours_step_s',), ('trl_step_s',), ('ratio',), ('ours_phases',),
                     ('ours_peak_mem_gb',), ('trl',)],
            'step_gsm8k': [('ours_step_s',), ('ours_phases',), ('ours_peak_mem_gb',),
                           ('ours_gen_tokens_per_s',), ('ours_completion_len',)],
            'step_graphs': [('ours_step_s',), ('ours_phases',), ('ours_peak_mem_gb',),
                            ('ours_gen_tokens_per_s',), ('ours_completion_len',)],
            'step_compiled': [('ours_step_s',), ('ours_phases',), ('ours_peak_mem_gb',),
                              ('ours_gen_tokens_per_s',), ('ours_completion_len',)],
            'tests': [('summary',), ('failed',), ('failed_tests',)]}.get(part, [])
    return {'.'.join(k): dig(result, k) for k in keys}


def write_json(path, obj):
    """Whole or not at all: a run killed mid-write leaves the previous file, never half of one."""
    with open(path + '.tmp', 'w') as f:
        json.dump(obj, f, indent=1)
    os.replace(path + '.tmp', path)


def parse_shares(items):
    """--share=PART=SECONDS (repeatable) -> {part: seconds}; one clear error for a bad one."""
    shares = {}
    for item in items:
        part, sep, value = item.partition('=')
        if not sep or part not in PARTS:
            sys.exit(f"--share={item}: expected PART=SECONDS with PART one of {list(PARTS)}")
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if not seconds > 0:
            sys.exit(f"--share={item}: SECONDS must be a number above 0")
        shares[part] = seconds
    return shares


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    # toy sizes on the CPU, the same plan and deadline logic
    ap.add_argument('--cpu-smoke', dest='smoke', action='store_true')
    ap.add_argument('--out', default='')  # results folder; '' = bench/results/<date>_<device>/
    # comma-separated parts of PARTS, run in the order given (the priority)
    ap.add_argument('--parts', default=','.join(PLAN))
    # seconds from this script's start by which everything has ended (parts that no longer fit are
    # skipped, a part that outruns its share is killed)
    ap.add_argument('--deadline', type=float, default=DEFAULT_DEADLINE_S)
    # PART=SECONDS: that part's time limit instead of its share of the deadline (repeatable)
    ap.add_argument('--share', action='append', default=[])
    # GSM8K jsonl for the step parts; '' = .gsm8k/ in the repository if filled, else ../shared/gsm8k
    ap.add_argument('--data_dir', default='')
    # bench_step's TRL side (auto: if importable)
    ap.add_argument('--trl', default='auto', choices=['auto', '1', '0'])
    # --cpu-smoke: leave out the attention timing (its CPU FlexAttention compile is most of the
    # kernel part's time)
    ap.add_argument('--smoke_no_flex', action='store_true')
    args = ap.parse_args(argv)
    args.parts = [p for p in args.parts.split(',') if p]
    bad = [p for p in args.parts if p not in PARTS]
    if bad or not args.parts or len(set(args.parts)) != len(args.parts):
        ap.exit(2, f"--parts: expected some of {list(PARTS)}, each once; got {args.parts}\n")
    if not args.deadline > 0:
        ap.exit(2, f"--deadline={args.deadline:g}: must be a number of seconds above 0\n")
    args.share = parse_shares(args.share)
    args.data_dir = os.path.abspath(args.data_dir or default_data_dir())
    return args


def step_prompts_problem(data_dir):
    """Why the step parts cannot have GSM8K's prompts, or None when they can."""
    if os.path.isfile(os.path.join(data_dir, 'train.jsonl')):
        return None
    return (f"no GSM8K prompts: {data_dir}/train.jsonl does not exist (run bench/device_prep.sh, "
            "or give --data_dir); the step is measured on GSM8K's prompt lengths or not at all")


def record(part, *, ctx, status, **fields):
    """A part's JSON, written now (also at its start, so a run killed mid-part says which)."""
    argv, env = ctx['cmds'][part]
    rec = {'part': part, 'device': ctx['device'], 'status': status, 'smoke': ctx['smoke'],
           'command': ' '.join(argv), 'env': env,
           'step_prompts': ctx['data_dir'] if part.startswith('step') else None,
           'versions': ctx['versions'],
           'when': datetime.datetime.now().isoformat(timespec='seconds'),
           'result': None, 'log': LOG, **fields}
    write_json(os.path.join(ctx['out_dir'], FILES.get(part, f'{part}.json')), rec)
    return rec


def run_plan(ctx, args, budget):
    """Every part of args.parts in order: skipped, or run under its limit; its JSON written as it
    ends, and the summary after each."""
    ends = window_ends(args.parts, budget, args.share, args.deadline)
    prompts_problem = step_prompts_problem(args.data_dir)
    for part in args.parts:
        estimate = budget[part][0]
        limit, why = part_limit(estimate=estimate, share=args.share.get(part), end=ends[part],
                                deadline=args.deadline)
        if part.startswith('step') and prompts_problem:
            limit, why = None, prompts_problem
        if limit is None:
            ctx['records'][part] = record(part, ctx=ctx, status='skipped', reason=why,
                                          estimate_s=estimate)
            print(f"[{part}] skipped: {why}", flush=True)
            summarize(ctx, args)
            continue
        argv, env = ctx['cmds'][part]
        junit = os.path.join(ctx['out_dir'], f'.{part}.junit.xml')
        if part == 'tests':
            argv = argv + [f'--junitxml={junit}']
        shown = ' '.join(os.path.relpath(a, ROOT) if a.startswith(ROOT) else a for a in argv)
        print(f"[{part}] {shown} (limit {limit:.0f} s, estimate {estimate} s)", flush=True)
        ctx['records'][part] = record(part, ctx=ctx, status='running', limit_s=round(limit, 1),
                                      estimate_s=estimate)
        summarize(ctx, args)
        status, rc, wall, text = run_part(argv, env, limit, os.path.join(ctx['out_dir'], LOG))
        result = pytest_result(text, junit) if part == 'tests' else last_json(text)
        if part != 'tests' and status == 'ok' and result is None:
            status = 'failed'  # exited 0 without its JSON line
        fields = {'rc': rc, 'wall_s': wall, 'limit_s': round(limit, 1), 'estimate_s': estimate,
                  'result': result}
        if status == 'timeout':
            fields['reason'] = f"outran its limit of {limit:.0f} s and was killed"
        if status != 'ok':
            fields['log_tail'] = text[-3000:]
        if isinstance(result, dict) and 'device' in result:
            fields['bench_device'] = result['device']  # the bench's own wording (threads, load)
        ctx['records'][part] = record(part, ctx=ctx, status=status, **fields)
        skips = (ln for ln in text.splitlines() if ln.startswith('TRL') and 'skipped (' in ln)
        skip = next(skips, None)
        print(f"[{part}] {status} in {wall} s" + (f"; {skip}" if skip else ''), flush=True)
        if status != 'ok':
            print('\n'.join('    ' + ln for ln in text.strip().splitlines()[-8:]), flush=True)
        summarize(ctx, args)


def summarize(ctx, args):
    """summary.json from this run's parts, in plan order (a part not reached yet: 'pending')."""
    parts, targets = {}, []
    for part in args.parts:
        rec = ctx['records'].get(part, {'status': 'pending', 'result': None, 'smoke': ctx['smoke']})
        parts[part] = {'file': FILES.get(part, f'{part}.json'), 'status': rec['status'],
                       'reason': rec.get('reason'), 'wall_s': rec.get('wall_s'),
                       'limit_s': rec.get('limit_s'), 'estimate_s': rec.get('estimate_s'),
                       'headline': headline(part, rec['result'])}
        for t_part, path, op, want, what in TARGETS:
            if t_part != part:
                continue
            got = dig(rec['result'], path)
            if got is None or rec['smoke']:
                met = None
            elif op == '<=':
                met = got <= want
            else:
                met = got >= want
            targets.append({'what': what, 'target': f'{op} {want}', 'measured': got, 'met': met})
    summary = {'device': ctx['device'], 'deadline_s': args.deadline,
               'elapsed_s': round(elapsed(), 1), 'step_prompts': args.data_dir,
               'step_prompts_problem': step_prompts_problem(args.data_dir),
               'missing_imports': ctx['missing'], 'versions': ctx['versions'], 'parts': parts,
               'targets': targets, 'all_ok': all(p['status'] == 'ok' for p in parts.values())}
    write_json(os.path.join(ctx['out_dir'], 'summary.json'), summary)
    return summary


def stop(signum, frame):
    # SIGTERM / SIGHUP from whoever runs this: unwind, so the running part's group is killed and the
    # summary says where it stopped
    raise SystemExit(128 + signum)


def main():
    args = parse_args()
    import torch
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("no CUDA device: bench/gpu_check.py measures a GPU; --cpu-smoke runs its plan "
                 "on the CPU")
    dev = device_name(args.smoke)
    slug = re.sub(r'[^A-Za-z0-9]+', '-', dev.split(' (')[0]).strip('-')
    out_dir = args.out or os.path.join(ROOT, 'bench', 'results', f"{datetime.date.today()}_{slug}")
    os.makedirs(out_dir, exist_ok=True)
    budget = SMOKE_BUDGET if args.smoke else GPU_BUDGET
    ctx = {'device': dev, 'smoke': args.smoke, 'out_dir': out_dir, 'data_dir': args.data_dir,
           'cmds': commands(args, args.smoke, args.data_dir), 'versions': versions(),
           'missing': missing_imports(), 'records': {}}
    print(f"device {dev}; results in {out_dir}; parts {args.parts}; deadline {args.deadline:g} s "
          f"({elapsed():.0f} s gone at start)", flush=True)
    print(f"step prompts: {step_prompts_problem(args.data_dir) or args.data_dir}", flush=True)
    if ctx['missing']:
        print(f"missing here: {ctx['missing']} (carry them as wheels: bench/device_prep.sh "
              "NAME==VERSION)", flush=True)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    try:
        run_plan(ctx, args, budget)
    except (KeyboardInterrupt, SystemExit):
        for part, rec in ctx['records'].items():
            if rec['status'] == 'running':
                ctx['records'][part] = record(part, ctx=ctx, status='interrupted',
                                              reason='this script was stopped while the part ran')
        summarize(ctx, args)
        raise
    summary = summarize(ctx, args)
    print(f"summary ({elapsed():.0f} s of the {args.deadline:g} s deadline) -> "
          f"{os.path.join(out_dir, 'summary.json')}", flush=True)
    for part, p in summary['parts'].items():
        extra = p['reason'] or ''
        print(f"  {part:11s} {p['status']:8s} {p['wall_s'] or '':>7} s  {extra}")
    for t in summary['targets']:
        print(f"  target {t['what']}: {t['target']}, measured {t['measured']}, met {t['met']}")
    sys.exit(0 if summary['all_ok'] else 1)


if __name__ == '__main__':
    main()
