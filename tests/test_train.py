"""train_grpo.py end to end on CPU: it learns, it resumes exactly, and every guard fires within a
step of its cause."""
import concurrent.futures
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import warm

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT.parent / 'shared' / 'gsm8k'
# a tiny model and a tiny step: these tests are about the loop's behaviour, not its speed
TINY = ['--init_from=scratch', '--task=arith', '--system_prompt=', '--instruction=', '--n_layer=1',
        '--n_embd=32', '--n_head=2', '--n_kv_head=1', '--max_seq_len=160', '--group_size=4',
        '--batch_prompts=4', '--micro_batch_size=8', '--max_new_tokens=8', '--arith_n_train=200',
        '--arith_n_test=8', '--eval_examples=4', '--eval_every=0', '--device=cpu',
        '--dtype=float32', '--plot_every=0', '--export_hf=False', '--lr=1e-3', '--warmup_steps=1',
        '--watchdog_s=0', "--rewards=[{'name': 'grpo_test_rewards:digit_fraction'}]"]
# wall-clock and memory: the only keys allowed to differ between runs
VOLATILE = ('timing_s/', 'mem/', 'perf/')


def env():
    """The runs' environment, read at each call: a test may set variables first
    (monkeypatch.setenv); tests/ holds the test rewards."""
    return {**os.environ, 'PYTHONPATH': str(ROOT / 'tests'), 'PYTHONUNBUFFERED': '1'}


def command(out_dir, *args):
    """A tiny train_grpo.py run into out_dir."""
    return [sys.executable, str(ROOT / 'train_grpo.py'), *TINY, f'--out_dir={out_dir}', *args]


def run(out_dir, *args, timeout=120, check=True):
    p = warm.run(command(out_dir, *args), cwd=ROOT, env=env(), timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"train_grpo.py exited {p.returncode}\n--- stdout\n{p.stdout[-3000:]}"
                             f"\n--- stderr\n{p.stderr[-3000:]}")
    return p


def run_together(*jobs, timeout=120, check=True):
    """Independent runs side by side, [out_dir, *args] each, checked like run(): the second core
    does one while the first does another (a run alone is mostly one busy thread: start-up, tiny
    ops). Same results as one after the other: no run reads another's out_dir."""
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(run, *job, timeout=timeout, check=check) for job in jobs]
        return [f.result() for f in futures]


def start(out_dir, *args):
    return subprocess.Popen(command(out_dir, *args), cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def metrics(out_dir):
    return [json.loads(line) for line in open(Path(out_dir) / 'metrics.jsonl')]


def stable(row):
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def weights(out_dir, step):
    return torch.load(Path(out_dir) / f'ckpt_{step:07d}.pt', weights_only=False)['model']


def all_finite_on_disk(out_dir):
    for p in Path(out_dir).glob('ckpt_*.pt'):
        sd = torch.load(p, weights_only=False)['model']
        assert all(torch.isfinite(t).all() for t in sd.values()), f"{p} holds non-finite weights"


def test_grpo_raises_mean_reward(tmp_path):
    """Regression test that the loop learns at all: reward = fraction of digits in the
    completion."""
    run(tmp_path, '--max_steps=20', '--lr=2e-2', '--group_size=8', '--batch_prompts=8',
        '--micro_batch_size=64', '--max_new_tokens=12', '--save_every=100')
    r = [m['reward/mean'] for m in metrics(tmp_path) if 'reward/mean' in m]
    first = sum(r[:5]) / 5
    last = sum(r[-5:]) / 5
    assert last > first + 0.3, \
        f"mean reward did not rise: first 5 steps {first:.3f}, last 5 {last:.3f}: {r}"


def test_metrics_keys_and_files(tmp_path):
    run(tmp_path, '--max_steps=2', '--eval_every=2', '--log_samples_every=1', '--save_every=1',
        '--plot_every=2', '--export_hf=True', '--peak_flops=1e12', '--peak_bandwidth=1e10')
    rows = metrics(tmp_path)
    assert [r['step'] for r in rows] == [0, 1, 2]
    # the hardware's use against the peaks given (a CPU has none of its own)
    r = rows[1]
    assert 0 < r['perf/update_mfu'] == r['perf/update_tflops'] and 0 < r['perf/gen_hbm_frac'], r
    assert math.isclose(r['perf/gen_hbm_frac'], r['perf/gen_gb_s'] / 10), r
    need = ['step', 'lr', 'reward/mean', 'reward/std', 'reward/digit_fraction/mean',
            'frac_zero_std', 'loss', 'pg_loss', 'kl', 'entropy', 'grad_norm', 'response_len/mean',
            'response_len/clip_frac', 'timing_s/gen', 'timing_s/reward', 'timing_s/ref',
            'timing_s/old_logprob', 'timing_s/update', 'timing_s/step', 'timing_s/compile',
            'compile/graphs', 'mem/allocated_gb',
            'mem/reserved_gb', 'mem/peak_gb', 'perf/gen_tokens_per_s', 'perf/tokens_per_s',
            'packed']
    missing = [k for k in need if k not in rows[1]]
    assert not missing, f"metrics.jsonl lacks {missing}"
    assert 'eval/pass@1' in rows[0] and 'eval/pass@1' in rows[2], \
        "eval at start and every eval_every steps"
    assert rows[1]['packed'] == 1, \
        "share_prompt='auto' packs short completions (batch.choose_share_prompt)"
    assert (tmp_path / 'samples.jsonl').exists() and (tmp_path / 'curves.png').exists()
    saved = json.load(open(tmp_path / 'config.json'))
    assert saved['max_steps'] == 2
    assert saved['rewards'] == [{'name': 'grpo_test_rewards:digit_fraction'}], \
        "config.json must keep the reward's name"
    from hf import from_pretrained
    model, tok = from_pretrained(str(tmp_path / 'hf'))
    sd = weights(tmp_path, 2)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in sd.items()), \
        "hf/ export != the step-2 weights"


def test_update_metrics_come_from_the_last_iteration(tmp_path):
    """num_iterations = 1: the ratio is 1, so no clip/ratio metrics are logged (a constant 0 would
    look like a measurement). num_iterations = 3: the last iteration's clip fractions, ratio range
    and KL(old || new) show the updates moved the policy."""
    run(tmp_path / 'mu1', '--max_steps=1')
    row = metrics(tmp_path / 'mu1')[1]
    assert not any(k.startswith(('clip/', 'ratio/', 'kl_old_new')) for k in row)
    run(tmp_path / 'mu3', '--max_steps=2', '--num_iterations=3', '--lr=3e-2')
    row = metrics(tmp_path / 'mu3')[2]
    assert row['kl_old_new'] > 0 and row['ratio/min'] < 1 < row['ratio/max'], row
    assert 0 <= row['clip/low_frac'] <= 1 and 0 <= row['clip/high_frac'] <= 1
    assert row['clip/low_frac'] + row['clip/high_frac'] > 0, \
        "lr 3e-2 over 3 iterations must clip some tokens"


# knobs that act on the whole step's tokens or rows, each with filter_zero_std on and off: a coin-flip
# reward leaves about half of the groups of 2 with equal rewards
FILTER_NEUTRAL = {
    'seq_mean_token_mean': ['--max_steps=1', '--loss_agg=seq_mean_token_mean'],
    # the entropy cut is taken over every sampled token of the step, the skipped groups' too
    'top_entropy_quantile': ['--max_steps=1', '--top_entropy_quantile=0.2'],
    # one group per mini-batch: a mini-batch of equal rewards takes no optimizer step either way
    'mini_batches': ['--max_steps=2', '--batch_prompts=4', '--mini_batches=4', '--num_iterations=2',
                     '--loss_agg=seq_mean_token_sum'],
    'tis_cispo': ['--max_steps=1', '--num_iterations=2', '--dtype=bfloat16', '--tis=token_mask',
                  '--tis_cap=1.01', '--loss_type=cispo', '--loss_agg=token_sum'],
    'dynamic_sampling': ['--max_steps=2', '--dynamic_sampling=2', '--batch_prompts=4',
                         '--loss_agg=seq_sum_const', '--scale_rewards=batch'],
    # Clip-Cov picks among every sampled token of the step, the skipped groups' too
    'clip_cov': ['--max_steps=1', '--loss_type=clip_cov', '--cov_ratio=0.3', '--clip_cov_bounds=(-9.0, 9.0)'],
}


@pytest.mark.parametrize('knobs', FILTER_NEUTRAL.values(), ids=FILTER_NEUTRAL.keys())
def test_zero_std_filter_saves_compute_without_changing_the_training(tmp_path, knobs):
    """filter_zero_std leaves zero-spread groups out of the forward/backward but not out of the loss
    normalisers, the entropy cut, or the choice of which mini-batches take an optimizer step: the
    same loss and gradient norm at every step, and the same weights, with the filter on or off."""
    args = ["--rewards=[{'name': 'grpo_test_rewards:first_char_even'}]", '--group_size=2',
            '--batch_prompts=8', '--save_every=1', *knobs]
    run_together([tmp_path / 'on', *args], [tmp_path / 'off', *args, '--filter_zero_std=False'])
    on, off = metrics(tmp_path / 'on')[1:], metrics(tmp_path / 'off')[1:]
    assert any(0 < a['frac_zero_std'] for a in on), \
        f"the test needs zero-spread groups: {[a['frac_zero_std'] for a in on]}"
    assert '--dynamic_sampling=2' in knobs or on[0]['rows_trained'] < off[0]['rows_trained'], \
        "the filter must leave rows out"
    for a, b in zip(on, off):
        for key in ('grad_norm', 'loss', 'entropy_cut'):
            assert math.isclose(a.get(key, 0), b.get(key, 0), rel_tol=1e-5, abs_tol=1e-9), \
                (a['step'], key, a.get(key), b.get(key))
    if '--dtype=bfloat16' in knobs:  # bf16 rounds the two layouts apart; AdamW then moves
        return  # near-zero-gradient weights by up to lr either way (the norms above agree)
    step = on[-1]['step']
    wa, wb = weights(tmp_path / 'on', step), weights(tmp_path / 'off', step)
    worst = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    assert worst < 2e-5, f"weights after step {step} differ by {worst} with the filter on and off"


@pytest.mark.parametrize('loss_agg,cut', [('token_sum', ['--micro_batch_size=1']),
                                          ('seq_mean_token_sum',
                                           ['--micro_batch_size=16', '--micro_batch_tokens=250']),
                                          ('token_mean',
                                           ['--micro_batch_size=16', '--micro_batch_tokens=100'])])
def test_summed_aggregations_do_not_depend_on_the_micro_batches(tmp_path, loss_agg, cut):
    """A step of 16 rows in micro-batches of one row, or of uneven row counts cut by a token budget,
    or all at once: the same loss and gradient norm (each micro-batch's loss is its share of the
    step's, loss.token_weights). A budget that leaves one row a pass where micro_batch_size allows
    more is a warning (the update is slow for it)."""
    args = ['--max_steps=1', f'--loss_agg={loss_agg}', '--share_prompt=False']
    p, _ = run_together([tmp_path / 'one', *args, *cut],
                        [tmp_path / 'all', *args, '--micro_batch_size=16'])
    a, b = metrics(tmp_path / 'one')[1], metrics(tmp_path / 'all')[1]
    assert a['rows_trained'] > 1 and b['micro_batches'] == 1, (a, b)
    if '--micro_batch_tokens=250' in cut:  # rows of 80-94 tokens: two or three to a pass
        assert 1 < a['micro_batches'] < a['rows_trained'], a
    alone = '--micro_batch_tokens=100' in cut  # one row a pass
    assert ('WARNING [micro_batch_tokens]' in p.stdout) == alone, p.stdout[-2000:]
    assert not alone or a['micro_batches'] == a['rows_trained'], a
    assert math.isclose(a['grad_norm'], b['grad_norm'], rel_tol=1e-5), (a['grad_norm'], b['grad_norm'])
    # on-policy the loss is minus the advantages summed over tokens: about 0, up to float rounding
    assert math.isclose(a['loss'], b['loss'], abs_tol=1e-5), (a['loss'], b['loss'])


def test_dynamic_sampling_refills_the_step_with_groups_that_have_a_spread(tmp_path):
    """dynamic_sampling (DAPO): a coin-flip reward leaves about half of the groups of 2 with equal
    rewards; the step draws more prompts until 8 groups have a spread and trains on exactly those.
    The data cursor moves past every prompt drawn, so a resumed run continues with the same prompts
    as one that did not stop."""
    args = ['--group_size=2', '--batch_prompts=8', '--dynamic_sampling=6', '--save_every=1',
            "--rewards=[{'name': 'grpo_test_rewards:first_char_even'}]"]
    run_together([tmp_path / 'a', '--max_steps=3', *args], [tmp_path / 'b', '--max_steps=2', *args])
    rows = metrics(tmp_path / 'a')[1:]
    for row in rows:
        assert row['dynamic/prompts'] > 8 and row['dynamic/rounds'] >= 2, row
        # 8 groups x 2, all with a spread
        assert row['dynamic/groups_short'] == 0 and row['rows_trained'] == 16, row
        assert 0 < row['frac_zero_std'] < 1, row
    ckpt = torch.load(tmp_path / 'a' / 'ckpt_0000003.pt', weights_only=False)
    assert ckpt['cursor'] == sum(r['dynamic/prompts'] for r in rows), \
        "the cursor must move past every prompt drawn"
    # resume_changed: the same LR at every step
    resumed = [tmp_path / 'b', '--max_steps=3', '--resume_changed=True', *args]
    short = [tmp_path / 'c', '--max_steps=1', *args[:2], '--dynamic_sampling=1',
             "--rewards=[{'name': 'grpo_test_rewards:always_zero'}]"]
    _, p = run_together(resumed, short)
    assert stable(metrics(tmp_path / 'b')[-1]) == stable(rows[-1]), \
        "resume after refills continues elsewhere"
    assert 'WARNING [dynamic_short]' in p.stdout, p.stdout
    assert metrics(tmp_path / 'c')[1]['dynamic/groups_short'] == 8, p.stdout


def test_no_checkpoint_inside_a_nan_streak(tmp_path):
    """NaN at steps 2 and 3, save_every=2: step 2 is not saved (it is inside the streak), so the
    rollback at step 3 (nan_patience=2) goes to step 0's weights, not to the step the streak started
    from."""
    p = run(tmp_path, '--max_steps=5', '--save_every=2', '--keep_last=10',
            '--fault_nan_steps=[2, 3]', '--nan_patience=2', '--max_rollbacks=2')
    assert not (tmp_path / 'ckpt_0000002.pt').exists(), \
        "a checkpoint was written inside a non-finite streak"
    assert 'ckpt_0000000.pt (step 0)' in p.stdout, p.stdout[-2000:]


def test_a_rollback_goes_before_the_weights_that_tripped_it(tmp_path):
    """NaN at steps 3 and 4 (nan_patience=2), save_every=1: the streak started from step 2's
    weights, so the rollback goes to step 1's checkpoint and deletes step 2's (a later rollback or
    a resume must not return to it). A checkpoint-like file of a later step (not this run's) pushes
    none of the run's own out of keep_last."""
    (tmp_path / 'a').mkdir()
    (tmp_path / 'a' / 'ckpt_0000009.pt').write_bytes(b'not a checkpoint')
    a, b = run_together([tmp_path / 'a', '--max_steps=5', '--save_every=1', '--keep_last=3',
                         '--fault_nan_steps=[3, 4]', '--nan_patience=2'],
                        [tmp_path / 'b', '--max_steps=3', '--save_every=1', '--keep_last=1',
                         '--fault_nan_steps=[2, 3]', '--nan_patience=2'], check=False)
    assert a.returncode == 0 and 'ckpt_0000001.pt (step 1)' in a.stdout, a.stdout[-2000:]
    kept = sorted(p.name for p in (tmp_path / 'a').glob('ckpt_*.pt'))
    assert kept == ['ckpt_0000000.pt', 'ckpt_0000001.pt', 'ckpt_0000005.pt', 'ckpt_0000009.pt'], kept
    # keep_last=1: only the weights the streak started from are left, so the run stops and says why
    assert b.returncode == 3 and 'no checkpoint older than the weights step 2 started from' in b.stderr, \
        b.stdout[-2000:] + b.stderr[-2000:]


def test_out_of_memory_names_its_phase_and_the_fix(tmp_path):
    """An out-of-memory error in step 2's update (injected: a CPU never runs out this way) ends the
    run as any exception does (traceback, exit 1), then says where and what to change; step 1's
    checkpoint is there to resume from."""
    p = run(tmp_path, '--max_steps=3', '--save_every=1', '--fault_oom_steps=[2]', '--micro_batch_size=4',
            check=False)
    assert p.returncode == 1 and 'torch.OutOfMemoryError' in p.stderr, p.stderr[-2000:]
    report = p.stderr[p.stderr.index('torch.OutOfMemoryError'):]
    assert 'CUDA ran out of memory during update' in report, report
    assert 'micro_batch_size=4' in report and 'grad_checkpoint=True' in report, report
    assert '--resume_changed=True' in report, report
    assert (tmp_path / 'ckpt_0000001.pt').exists() and not (tmp_path / 'ckpt_0000002.pt').exists()
    # out_dir/console.log holds what it printed, so the run doctor, given the out_dir, says what ended it
    log = (tmp_path / 'console.log').read_text()
    assert 'step     1 |' in log and 'CUDA ran out of memory during update' in log, log[-2000:]
    import doctor
    found = {f['name']: f for f in doctor.diagnose(doctor.load(str(tmp_path)))}
    assert 'after step 1, in update' in found['out_of_memory']['evidence'], found.get('out_of_memory')
    run(tmp_path, '--max_steps=3', '--save_every=1', '--micro_batch_size=4')  # resumed: appended
    log = (tmp_path / 'console.log').read_text()
    assert 'ckpt_0000001.pt (step 1' in log and 'step     3 |' in log and 'CUDA ran out of memory' in log
    oom = {f['name']: f for f in doctor.diagnose(doctor.load(str(tmp_path)))}['out_of_memory']
    assert oom['severity'] == 'warning' and 'resumed and went on to step 3' in oom['evidence'], oom


# prints on both streams in each way a run's process can: Python's, below Python (a C++ library's
# write to the file descriptor), a child process's; then ends as argv[2] says
CONSOLE_SCRIPT = """
import os, signal, subprocess, sys
import metrics
metrics.console_log(sys.argv[1])
print('python out')
print('python err', file=sys.stderr)
os.write(1, b'native out\\n')
os.write(2, b'native err\\n')
subprocess.run(['sh', '-c', 'echo child out; echo child err >&2'])
os.write(2, b'last words\\n')
if sys.argv[2] == 'kill':
    os.kill(os.getpid(), signal.SIGKILL)
print('python end')
"""


def test_console_log_holds_what_is_written_below_python(tmp_path):
    """out_dir/console.log gets what a C++ library or a child process writes to file descriptors 1
    and 2 as well as Python's prints, and the terminal still gets each on its own stream; a process
    killed by SIGKILL loses nothing it wrote before."""
    for end in ('exit', 'kill'):
        (tmp_path / end).mkdir()
        p = subprocess.run([sys.executable, '-c', CONSOLE_SCRIPT, str(tmp_path / end), end], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == (0 if end == 'exit' else -signal.SIGKILL), p.stderr[-2000:]
        out = ['python out', 'native out', 'child out'] + (['python end'] if end == 'exit' else [])
        err = ['python err', 'native err', 'child err', 'last words']
        log = (tmp_path / end / 'console.log').read_text()
        assert all(line in log for line in out + err), (end, log)
        assert all(line in p.stdout for line in out) and not any(line in p.stdout for line in err), (end, p.stdout)
        assert all(line in p.stderr for line in err) and not any(line in p.stderr for line in out), (end, p.stderr)


def test_a_crash_below_python_is_in_console_log_and_the_doctor_names_it(tmp_path):
    """A reward function that segfaults in step 2, as a broken compiled extension would: the run
    dies of SIGSEGV with no Python traceback, yet console.log holds the line the library wrote and
    faulthandler's stacks, and the run doctor, given the out_dir, says what ended it, after which
    step, in which phase and from which line."""
    p = run(tmp_path, '--max_steps=3', "--rewards=[{'name': 'grpo_test_rewards:segfault_after_step_1'}]",
            check=False)
    assert p.returncode == -signal.SIGSEGV, p.stderr[-2000:]
    log, deadline = '', time.time() + 30
    while 'Extension modules' not in log and time.time() < deadline:  # (the copier outlives the run)
        time.sleep(0.1)
        log = (tmp_path / 'console.log').read_text()
    assert 'step     1 |' in log and 'native library: about to fail' in log, log[-3000:]
    assert 'Fatal Python error: Segmentation fault' in log and 'segfault_after_step_1' in log, log[-3000:]
    import doctor
    found = {f['name']: f for f in doctor.diagnose(doctor.load(str(tmp_path)))}
    crash = found['native_crash']
    assert crash['severity'] == 'error' and 'after step 1, in reward' in crash['evidence'], crash
    assert 'string_at (ctypes/__init__.py:' in crash['evidence'], crash['evidence']
    assert 'segfault_after_step_1 (tests/grpo_test_rewards.py:' in crash['evidence'], crash['evidence']


def test_early_stop_after_evaluations_without_a_new_best(tmp_path):
    """eval/truncated (mode 'min') at every step: early_stop=2 ends the run after the second
    evaluation in a row that is no new best (a tie is none), with a checkpoint and exit 0; rerunning
    the same command resumes there and stops at once; a higher early_stop goes on to max_steps."""
    args = ['--max_steps=8', '--eval_every=1', '--export_best=eval/truncated', '--export_best_mode=min',
            '--export_hf=True', '--save_every=100']
    p = run(tmp_path, *args, '--early_stop=2')
    rows = metrics(tmp_path)
    values = [r['eval/truncated'] for r in rows]
    stop, best, since = None, None, 0
    for step, v in enumerate(values):
        since = 0 if best is None or v < best else since + 1
        best = v if since == 0 else best
        if since == 2:
            stop = step
            break
    assert stop is not None and rows[-1]['step'] == stop < 8, (values, p.stdout[-1500:])
    assert 'early_stop: eval/truncated has not beaten' in p.stdout and (tmp_path / f'ckpt_{stop:07d}.pt').exists()
    again = run(tmp_path, *args, '--early_stop=2')
    assert metrics(tmp_path)[-1]['step'] == stop and 'early_stop' in again.stdout, again.stdout[-1500:]
    run(tmp_path, *args, '--early_stop=100')
    assert metrics(tmp_path)[-1]['step'] == 8


def test_an_async_reward_trains_as_its_sync_twin(tmp_path):
    """digit_fraction as an `async def`: the same rewards, so the same run, metric for metric."""
    sync = [tmp_path / 'sync', '--max_steps=2', "--rewards=[{'name': 'grpo_test_rewards:digit_fraction'}]"]
    run_together(sync, [tmp_path / 'async', '--max_steps=2',
                        "--rewards=[{'name': 'grpo_test_rewards:async_digit_fraction'}]"])
    a, b = metrics(tmp_path / 'sync'), metrics(tmp_path / 'async')
    rename = {k: k.replace('async_digit_fraction', 'digit_fraction') for k in b[-1]}
    assert [stable(r) for r in a] == [stable({rename.get(k, k): v for k, v in r.items()}) for r in b]
    assert a[-1]['reward/mean'] > 0


def test_save_every_0_saves_only_at_the_end(tmp_path):
    """save_every=0: no periodic checkpoints (before, step % 0 stopped the run): the start's (the
    rollback base) and the last."""
    run(tmp_path, '--max_steps=3', '--save_every=0', '--keep_last=10')
    assert sorted(p.name for p in tmp_path.glob('ckpt_*.pt')) == ['ckpt_0000000.pt', 'ckpt_0000003.pt']


def test_length_penalty_follows_max_new_tokens(tmp_path):
    """The 'length' reward with no kwargs penalises the last quarter of the run's own max_new_tokens
    (8 here): before, its fixed 1024-token default gave 0 to every completion of any run with
    max_new_tokens <= 768."""
    run(tmp_path, '--max_steps=1', "--rewards=[{'name': 'length'}]")
    row = metrics(tmp_path)[1]
    assert row['response_len/clip_frac'] > 0 and row['reward/length/mean'] < 0, row


def test_bf16_with_truncated_importance_sampling(tmp_path):
    """bf16 on the CPU: sampler and trainer compute the policy in different numerics; tis reweights
    by their ratio and logs the weights."""
    run(tmp_path, '--max_steps=2', '--dtype=bfloat16', '--tis=token_truncate', '--tis_cap=1.01')
    row = metrics(tmp_path)[2]
    assert row['logprob_gen_vs_train'] > 0, row
    assert 0 < row['tis/weight_mean'] <= 1.01 and 0 <= row['tis/capped_frac'] <= 1, row
    assert math.isfinite(row['loss']) and row['grad_norm'] > 0


def test_objective_variants_train(tmp_path):
    """The new objective knobs reach the loss: REINFORCE++-baseline trains on every row (its equal
    groups have an advantage), the dual clip logs its fraction, k3_is gives a KL, both TIS bounds
    and CISPO's two bounds run, as do the two summed aggregations, SAPO's gate and VESPO's weight
    (with per-token TIS and the off-policy mask), and KL-Cov (with GDPO)."""
    # seed 1: step 2 has groups with no reward spread, which REINFORCE++ must still train
    args = ['--max_steps=2', '--num_iterations=2', '--lr=3e-2', '--seed=1']
    run_together([tmp_path / 'a', *args, '--advantage=reinforce_pp', '--clip_ratio_c=1.5',
                  '--beta=0.04', '--kl_estimator=k3_is', '--dtype=bfloat16',
                  '--tis=token_truncate', '--tis_min=0.5', '--loss_agg=token_sum'],
                 [tmp_path / 'b', *args, '--advantage=rloo', '--loss_type=cispo',
                  '--cispo_bounds=both', '--kl_estimator=k3+', '--beta=0.04',
                  '--loss_agg=seq_mean_token_sum'])
    a, b = metrics(tmp_path / 'a')[2], metrics(tmp_path / 'b')[2]
    assert a['frac_zero_std'] > 0 and a['rows_trained'] == 16, a
    assert 0 <= a['clip/dual_frac'] <= 1, a
    assert a['kl'] > 0 and 0.5 <= a['tis/weight_mean'] <= 3.0, a
    assert b['kl'] > 0 and math.isfinite(b['loss']) and b['grad_norm'] > 0, b
    sapo = [*args, '--loss_type=sapo', '--sapo_tau_neg=2.0']
    # GDPO on two rewards: each normalised in its group, then the weighted sum over the step
    two = ("--rewards=[{'name': 'grpo_test_rewards:digit_fraction'}, "
           "{'name': 'grpo_test_rewards:first_char_even', 'weight': 0.5}]")
    vespo = [*args, '--loss_type=vespo', '--tis=token_mask', '--tis_min=0.5', '--off_policy_mask=1e-3']
    run_together([tmp_path / 'd', *sapo, '--off_policy_mask=1e-3'], [tmp_path / 'e', *sapo],
                 [tmp_path / 'f', '--max_steps=2', '--advantage=gdpo', two, '--dynamic_sampling=1',
                  '--loss_type=kl_cov', '--num_iterations=2', '--cov_ratio=0.1'],
                 [tmp_path / 'g', *vespo])
    c, e = metrics(tmp_path / 'd')[2], metrics(tmp_path / 'e')[2]
    g = metrics(tmp_path / 'g')[2]
    assert math.isfinite(g['loss']) and g['grad_norm'] > 0 and 0 < g['off_policy/masked_frac'] < 1, g
    # phi peaks at 1.21 (A >= 0) and 1.24 (A < 0); the second iteration's ratios are off 1
    assert 0 < g['vespo/phi_mean'] < 1.25 and g['vespo/phi_mean'] != 1.0, g
    assert math.isfinite(c['loss']) and c['grad_norm'] > 0 and c['clip/high_frac'] == 0, c
    # the second iteration's policy has moved off the sampler's: some A < 0 completions masked,
    # and the update is not the one without the mask
    assert 0 < c['off_policy/masked_frac'] < 1, c
    assert 'off_policy/masked_frac' not in e and c['grad_norm'] != e['grad_norm'], (c, e)
    from doctor.read import load
    for d in 'abdg':  # the run doctor knows every name these runs log
        assert not load(str(tmp_path / d))['unknown'], (d, load(str(tmp_path / d))['unknown'])
    f = metrics(tmp_path / 'f')[2]
    assert math.isfinite(f['loss']) and f['grad_norm'] > 0 and f['rows_trained'] > 0, f
    assert 0.09 < f['cov/selected_frac'] <= 0.1, f  # KL-Cov: a tenth of the step's tokens
    p = run(tmp_path / 'c', '--advantage=maxrl', '--scale_rewards=none', check=False)
    assert p.returncode == 2 and '--scale_rewards' in p.stderr, p.stderr


def test_a_teacher_scores_the_completions_and_trains_the_policy_toward_it(tmp_path):
    """On-policy distillation (teacher): a teacher that is the policy's own random init leaves the run
    as it was, to the bit (its KL 0: its log-probs line up with the policy's token for token);
    another teacher's reverse KL is logged and, with advantage='none', trains every row alone (no
    group skipped for its equal rewards, no update or run stopped by rewards that all fail, which
    train nothing). A teacher whose tokenizer ids differ is refused. teacher='self' scores with the
    policy shown the solution (a task without solution() is refused)."""
    from hf import load_model, save_pretrained
    net, byte_tok = load_model('scratch', torch.float32, 'cpu', 7, n_layer=1, n_head=2, n_kv_head=1,
                               n_embd=32, max_seq_len=160)
    with torch.no_grad():
        net.wte.weight.mul_(8)  # (tied) logits 8x the init's: a peaked teacher
    save_pretrained(net, byte_tok, tmp_path / 'teacher')
    spec = json.loads((tmp_path / 'teacher' / 'tokenizer.json').read_text())
    spec['added_tokens'][0]['content'] = '<|eot|>'
    other = shutil.copytree(tmp_path / 'teacher', tmp_path / 'other_tokenizer')
    (other / 'tokenizer.json').write_text(json.dumps(spec))
    args = ['--max_steps=1', '--filter_zero_std=False']
    *ran, refused = run_together([tmp_path / 'a', *args], [tmp_path / 'b', *args, '--teacher=scratch'],
                               [tmp_path / 'c', '--max_steps=2', f"--teacher={tmp_path / 'teacher'}",
                                '--advantage=none', '--teacher_coef=0.5', '--zero_reward_patience=1',
                                '--num_iterations=2',
                                "--rewards=[{'name': 'grpo_test_rewards:always_raise'}]"],
                               [tmp_path / 'e', *args, '--teacher=self', '--advantage=none', '--max_seq_len=192'],
                               [tmp_path / 'f', '--teacher=self', "--mix_tasks=['tests/grpo_test_task.py']"],
                               [tmp_path / 'd', *args, f'--teacher={other}'], check=False)
    *ran, no_solution = ran
    assert [p.returncode for p in ran] == [0, 0, 0, 0], [p.stdout[-2000:] for p in ran]
    assert refused.returncode == 2 and "its tokenizer's ids are not the policy's" in refused.stderr, refused.stderr
    assert no_solution.returncode == 2 and 'has no solution()' in no_solution.stderr, no_solution.stderr
    # 'self': the policy itself, shown each problem's solution first, so not quite the policy: a KL
    # that is not 0 (b's is 0 to the bit); the problems whose prompt and solution leave no room for
    # a completion are left out, and said so
    assert 'problems whose prompt and solution leave fewer than' in ran[3].stdout, ran[3].stdout[-2000:]
    (e,) = metrics(tmp_path / 'e')[1:]
    assert e['teacher/reverse_kl'] != 0 and e['rows_trained'] == 16 and e['grad_norm'] > 0, e
    (a,), (b,), c = (metrics(tmp_path / x)[1:] for x in 'abc')
    assert b.pop('teacher/reverse_kl') == 0.0 and b.pop('timing_s/teacher') >= 0
    assert stable(a) == stable(b) and a['grad_norm'] > 0
    wa, wb = weights(tmp_path / 'a', 1), weights(tmp_path / 'b', 1)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert 'all advantages are zero' not in ran[2].stdout  # tied groups learn from the teacher
    for row in c:
        assert 'warn/all_zero_std' not in row
        assert row['teacher/reverse_kl'] > 0.1 and row['rows_trained'] == 16 and row['grad_norm'] > 0, row
    assert c[0]['pg_loss'] == pytest.approx(0.5 * c[0]['teacher/reverse_kl'])
    from doctor.read import load
    assert not load(str(tmp_path / 'c'))['unknown']


def test_distillation_brings_the_reverse_kl_to_the_teacher_down():
    """bench/distill_cpu.py: a random student distilled from a peaked random teacher of its shape by
    the teacher alone (advantage='none'; the task's reward stays 0, which stops no such run) more
    than halves its reverse KL in 80 steps (0.74 -> 0.31 on the CPU; lr 0 keeps it at 0.75, the
    advantage's sign flipped drives it to 3.8)."""
    p = warm.run([sys.executable, str(ROOT / 'bench' / 'distill_cpu.py'), '--steps=80'], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    kl = json.loads(p.stdout.splitlines()[-1])['reverse_kl_by_window']
    assert kl['61-80'] < 0.5 * kl['1-20'], kl


def test_rewards_get_the_step_and_may_not_apply(tmp_path):
    """A reward that names `step` gets the steps done (0, then 1); one that returns None for every
    sample logs no mean and no error, and the run trains on the other reward."""
    rewards = ("--rewards=[{'name': 'grpo_test_rewards:step_count'}, "
               "{'name': 'grpo_test_rewards:digit_fraction'}, "
               "{'name': 'grpo_test_rewards:not_applicable'}]")
    run(tmp_path, '--max_steps=2', rewards)
    rows = metrics(tmp_path)[1:]
    assert [r['reward/step_count/mean'] for r in rows] == [0.0, 1.0], rows
    assert all('reward/not_applicable/mean' not in r for r in rows), rows[0]
    assert all(r['reward/not_applicable/errors'] == 0 for r in rows), rows[0]


def test_sampled_evaluation_logs_pass_at_k_and_leaves_training_alone(tmp_path):
    """eval_samples=4: eval/pass@4, eval/mean@4 beside greedy eval/pass@1 at every evaluation,
    and the same for an eval_tasks set under eval/<name>/; the sampler's own seeds leave the
    training RNG alone: the same training rows and weights as a run without them."""
    args = ['--max_steps=2', '--eval_every=1', '--eval_examples=6']
    # with a second held-out set too (eval_tasks), a task of its own whose knob the run sets
    more = ["--eval_tasks=['tests/grpo_test_task.py']", '--parity_n_test=5']
    k, _ = run_together([tmp_path / 'k', *args, '--eval_samples=4', '--eval_temperature=1.5',
                         *more], [tmp_path / 'greedy', *args])
    assert 'eval @ step 2 (grpo_test_task): greedy pass@1' in k.stdout, k.stdout[-2000:]
    assert 'on 5 problems' in k.stdout
    rows, plain = metrics(tmp_path / 'k'), metrics(tmp_path / 'greedy')
    for r, p in zip(rows, plain):
        assert 0 <= r['eval/mean@4'] <= r['eval/pass@2'] <= r['eval/pass@4'] <= 1 and 'eval/maj@4' in r, r
        assert 0 <= r['eval/grpo_test_task/pass@1'] <= r['eval/grpo_test_task/pass@4'] <= 1, r
        assert r['eval/pass@1'] == p['eval/pass@1'], "greedy pass@1 is unchanged"
        assert {k: v for k, v in stable(r).items() if not k.startswith('eval/')} == \
            {k: v for k, v in stable(p).items() if not k.startswith('eval/')}, r['step']
    wk, wg = weights(tmp_path / 'k', 2), weights(tmp_path / 'greedy', 2)
    assert all(torch.equal(wk[k], wg[k]) for k in wk), "sampled evaluation changed the training"
    # a knob of a task only evaluated changes no training: a resume may change it
    p = run(tmp_path / 'k', *args, '--eval_samples=4', '--eval_temperature=1.5', *more[:1],
            '--parity_n_test=4')
    assert 'parity_n_test: 5 -> 4\n' in p.stdout, p.stdout[-2000:]


def test_entropy_control_trains_and_resumes(tmp_path):
    """adaptive_entropy with a target above any entropy: no bonus at step 1 (no entropy measured
    yet), then 0.01 + 0.05 and + 0.10; killed after step 3's update and rerun, the coefficient
    resumes from the checkpoint. top_entropy_quantile=0.2 logs the entropy cut it trained above."""
    args = ['--max_steps=3', '--save_every=1', '--adaptive_entropy=True', '--entropy_coef=0.01',
            '--entropy_coef_delta=0.05', '--entropy_target=100.0', '--top_entropy_quantile=0.2']
    straight, killed = tmp_path / 'straight', tmp_path / 'killed'
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = pool.submit(run, straight, *args)
        k = run(killed, *args, '--fault_kill_opt_step=3', check=False)
        done.result()
    assert k.returncode == -signal.SIGKILL and newest_ckpt(killed)[0] == 2, k.returncode
    rows = metrics(straight)
    assert [round(r['entropy_coef'], 6) for r in rows[1:]] == [0.0, 0.06, 0.11], rows
    assert all(0 < r['entropy_cut'] for r in rows[1:]), rows
    run(killed, *args)
    assert [stable(r) for r in metrics(killed)] == [stable(r) for r in rows]
    wa, wb = weights(straight, 3), weights(killed, 3)
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "weights differ after resume"


def test_lr_schedules_decay_as_named(tmp_path):
    """lr_schedule after one warmup step, 4 steps: linear to min_lr_ratio x lr at the last, or
    constant; each step's row logs the rate it applied."""
    args = ['--max_steps=4', '--warmup_steps=1', '--lr=1e-3', '--min_lr_ratio=0.25']
    run_together([tmp_path / 'linear', *args, '--lr_schedule=linear'],
                 [tmp_path / 'constant', *args, '--lr_schedule=constant'])
    for name, want in (('linear', [1.0, 1.0, 0.75, 0.5]), ('constant', [1.0] * 4)):
        got = [r['lr'] * 1e3 for r in metrics(tmp_path / name)[1:]]
        assert got == pytest.approx(want), (name, got)


def test_shuffle_false_draws_the_problems_in_their_own_order(tmp_path):
    """shuffle=False (a curriculum): step 1 samples training problems 0-3, step 2 problems 4-7, as the
    task lists them (samples.jsonl logs one completion of each group)."""
    run(tmp_path, '--shuffle=False', '--max_steps=2', '--log_samples_every=1')
    train = tiny_examples()[0][0]
    rows = [json.loads(line) for line in (tmp_path / 'samples.jsonl').read_text().splitlines()]
    for row, ex in zip(rows, train[:8]):
        assert ex['question'] in row['prompt'], (row['step'], row['prompt'], ex['question'])


def test_epochs_set_the_runs_length_from_the_training_set(tmp_path):
    """epochs=2 over 6 problems at 4 a step: ceil(12 / 4) = 3 steps, whatever max_steps says."""
    p = run(tmp_path, '--epochs=2.0', '--arith_n_train=6', '--max_steps=50')
    assert 'epochs: 2.0 x 6 problems / 4 a step = 3 steps (max_steps)' in p.stdout, p.stdout[-2000:]
    assert [r['step'] for r in metrics(tmp_path)] == [0, 1, 2, 3]


def test_truncated_sampling_warns_that_training_is_off_policy(tmp_path):
    """top_k, top_p and min_p warn; and min_p reaches the sampler: at 0.99 only the most likely
    token is drawn, so every group's completions are one and the same (the random model's samples
    at temperature 1 differ without it)."""
    p, q = run_together([tmp_path / 'k', '--max_steps=1', '--top_k=5'],
                        [tmp_path / 'p', '--max_steps=1', '--min_p=0.99'])
    assert 'WARNING [off_policy_sampling]' in p.stdout and 'top_k=5' in p.stdout
    assert 'WARNING [off_policy_sampling]' in q.stdout and 'min_p=0.99' in q.stdout
    assert metrics(tmp_path / 'p')[1]['frac_zero_std'] == 1.0
    assert metrics(tmp_path / 'k')[1]['frac_zero_std'] < 1.0


def test_all_zero_std_warning_names_cause_and_fix(tmp_path):
    p = run(tmp_path, '--max_steps=1', "--rewards=[{'name': 'grpo_test_rewards:always_zero'}]")
    assert "all advantages are zero" in p.stdout and "raise temperature or group_size" in p.stdout
    assert metrics(tmp_path)[-1]['warn/all_zero_std'] == 1


def test_exact_resume_after_sigkill(tmp_path):
    """6 steps straight vs. killed after step 3 and restarted with the same command: same metrics,
    same weights."""
    a = tmp_path / 'straight'
    b = tmp_path / 'killed'
    # step 4 sleeps 2 s before its update (in every run: the same command), so the kill lands
    # mid-run however fast the steps are; the sleep touches no state
    args = ['--max_steps=6', '--save_every=1', '--keep_last=10', '--eval_every=3',
            '--fault_stall_step=4', '--fault_stall_s=2']
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # run A goes straight through beside B, which is killed after step 3
        straight = pool.submit(run, a, *args)
        proc = start(b, *args)
        deadline = time.time() + 120
        while not (b / 'ckpt_0000003.pt').exists():
            assert time.time() < deadline and proc.poll() is None, "run B never reached step 3"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not (b / 'ckpt_0000006.pt').exists(), "killed too late to test anything"
        p = run(b, *args)
        straight.result()
    assert 'resume:' in p.stdout
    ra = metrics(a)
    rb = metrics(b)
    steps = [r['step'] for r in rb]
    assert steps == [0, 1, 2, 3, 4, 5, 6], f"duplicate or missing steps: {steps}"
    for x, y in zip(ra, rb):
        assert stable(x) == stable(y), \
            f"step {x['step']} differs after resume:\n{stable(x)}\n{stable(y)}"
    wa = weights(a, 6)
    wb = weights(b, 6)
    assert all(torch.equal(wa[k], wb[k]) for k in wa), \
        "final weights are not bit-identical after resume"


def test_mini_batches_resume_exactly_after_a_kill_between_optimizer_steps(tmp_path):
    """mini_batches=2 x num_iterations=2: four optimizer steps per GRPO step, each mini-batch's
    ratio against the old log-probs taken before the first. Killed (SIGKILL) right after the 4th
    optimizer step (step 1's last, before its checkpoint) and after the 6th (step 2's second of
    four, between its iterations; a kill between any two of step 2's resumes from the same
    checkpoint), then rerun: the same metrics and weights as the run that was not."""
    args = ['--max_steps=2', '--mini_batches=2', '--num_iterations=2', '--save_every=1',
            '--keep_last=10', '--lr=3e-2']
    kills = (4, 6)
    jobs = [[tmp_path / 'straight', *args], [tmp_path / 'mu1', '--max_steps=1', '--mini_batches=2']]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = [pool.submit(run, *job) for job in jobs]
        killed = [pool.submit(run, tmp_path / f'kill{n}', *args, f'--fault_kill_opt_step={n}',
                              check=False) for n in kills]
        for n, k in zip(kills, killed):
            assert k.result().returncode == -signal.SIGKILL, f"kill {n}: the run was not killed"
            newest = newest_ckpt(tmp_path / f'kill{n}')[0]
            assert newest == (n - 1) // 4, f"kill {n}: newest checkpoint {newest}"
        resumed = [pool.submit(run, tmp_path / f'kill{n}', *args) for n in kills]
        [f.result() for f in done + resumed]
    ra = metrics(tmp_path / 'straight')
    wa = weights(tmp_path / 'straight', 2)
    opt = torch.load(tmp_path / 'straight' / 'ckpt_0000002.pt', weights_only=False)['optimizer']
    assert all(int(st['step']) == 8 for st in opt['state'].values()), "2 steps x 2 x 2"
    for n in kills:
        rb = metrics(tmp_path / f'kill{n}')
        assert [r['step'] for r in rb] == [0, 1, 2], f"kill {n}: steps {rb}"
        for x, y in zip(ra, rb):
            assert stable(x) == stable(y), f"kill {n}: step {x['step']} differs after resume"
        wb = weights(tmp_path / f'kill{n}', 2)
        assert all(torch.equal(wa[k], wb[k]) for k in wa), f"kill {n}: weights differ"
    # one iteration of two mini-batches: the second is trained by a policy the first moved
    row = metrics(tmp_path / 'mu1')[1]
    assert row['ratio/min'] < 1 < row['ratio/max'] and row['kl_old_new'] > 0, row
    assert ra[1]['clip/low_frac'] + ra[1]['clip/high_frac'] > 0, ra[1]


def test_reference_sync_moves_the_kl_anchor_and_resumes_exactly(tmp_path):
    """ref_sync_every=2, alpha 1: after steps 2 and 4 the reference becomes the policy, so the next
    step's KL starts from 0; a run killed (SIGKILL) right after step 5's optimizer step (before its
    checkpoint; the sync at 4 written, the reference then step 4's) and rerun ends as the run that
    was not. Only the references a checkpoint on disk can resume to stay. Each sync also resets
    the optimizer (ref_sync_reset_optimizer), which the resumed run takes from its checkpoint."""
    args = ['--max_steps=6', '--beta=0.1', '--ref_sync_every=2', '--save_every=1',
            '--keep_last=2', '--lr=3e-2', '--ref_sync_reset_optimizer=True']
    kills = (5,)
    # NaN at steps 4-6 (no update: the policy stays step 3's; the sync at 4 makes the reference
    # that too), a rollback at 6 to step 2's checkpoint (step 3's weights started the streak),
    # whose reference is step 2's sync
    nan = [*args[1:], '--max_steps=7', '--fault_nan_steps=[4,5,6]', '--keep_last=10']
    # and a reference left by a run that saved no checkpoint: a fresh start removes it
    (tmp_path / 'nan').mkdir()
    (tmp_path / 'nan' / 'ref_0000009.pt').write_bytes(b'stale')
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        straight = pool.submit(run, tmp_path / 'straight', *args)
        rolled = pool.submit(run, tmp_path / 'nan', *nan)
        killed = [pool.submit(run, tmp_path / f'kill{n}', *args, f'--fault_kill_opt_step={n}',
                              check=False) for n in kills]
        for n, k in zip(kills, killed):
            assert k.result().returncode == -signal.SIGKILL, f"kill {n}: the run was not killed"
        assert (tmp_path / 'kill5' / 'ref_0000004.pt').exists()
        resumed = [pool.submit(run, tmp_path / f'kill{n}', *args) for n in kills]
        [f.result() for f in [straight, rolled, *resumed]]
    assert 'rolled back to' in rolled.result().stdout
    rows = metrics(tmp_path / 'nan')
    # back to step 2's weights, and with them step 2's sync: the reference is the policy again
    assert rows[-1]['step'] == 7 and rows[-1]['kl'] < 1e-6, rows[-1]
    assert not (tmp_path / 'nan' / 'ref_0000004.pt').exists(), "a reference of an undone step stayed"
    assert not (tmp_path / 'nan' / 'ref_0000009.pt').exists()
    ra = metrics(tmp_path / 'straight')
    kl = [r['kl'] for r in ra[1:]]
    assert kl[2] < 1e-6 < kl[1] and kl[4] < 1e-6 < kl[3], kl  # steps 3 and 5 start at the policy
    for n in kills:
        rb = metrics(tmp_path / f'kill{n}')
        assert [r['step'] for r in rb] == list(range(7)), rb
        for x, y in zip(ra, rb):
            assert stable(x) == stable(y), f"kill {n}: step {x['step']} differs after resume"
    refs = sorted(p.name for p in (tmp_path / 'straight').glob('ref*.pt'))
    assert refs == ['ref.pt', 'ref_0000004.pt', 'ref_0000006.pt'], refs
    # ref_sync_reset_optimizer: step 6's checkpoint, written after its sync, holds AdamW as new
    for st, synced in ((5, False), (6, True)):
        opt = torch.load(tmp_path / 'straight' / f'ckpt_{st:07d}.pt', weights_only=False)
        values = [t for s in opt['optimizer']['state'].values() for t in s.values()]
        assert values and all(t.count_nonzero() == 0 for t in values) == synced, st


def test_drop_easy_stops_drawing_solved_problems_and_resumes_exactly(tmp_path):
    """drop_easy=1.0, a reward of 1 for every completion of the problems (of 16) whose answer is
    even: after the first epoch (4 steps of 4) only the odd ones are drawn. A run killed
    (SIGKILL) after its 5th optimizer step and rerun logs what one that was not logs; a reward of 1
    for all drops every problem by the epoch's end, where the run stops with a checkpoint."""
    args = ['--arith_n_train=16', '--max_steps=8', '--drop_easy=1.0', '--save_every=1',
            '--keep_last=10', "--rewards=[{'name': 'grpo_test_rewards:even_answer'}]"]
    always = [*args[:-1], '--max_steps=10', "--rewards=[{'name': 'grpo_test_rewards:always_one'}]"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        straight = pool.submit(run, tmp_path / 'straight', *args)
        solved = pool.submit(run, tmp_path / 'solved', *always)
        k = run(tmp_path / 'killed', *args, '--fault_kill_opt_step=5', check=False)
        assert k.returncode == -signal.SIGKILL, "the run was not killed"
        resumed = pool.submit(run, tmp_path / 'killed', *args)
        straight.result(), resumed.result()
    assert 'drop_easy: all 16 training problems' in solved.result().stdout
    assert metrics(tmp_path / 'solved')[-1]['step'] == 4
    assert newest_ckpt(tmp_path / 'solved')[0] == 4
    # resumed for more steps: one line, not a traceback from the empty draw
    p = run(tmp_path / 'solved', *always[:-2], '--max_steps=12', always[-1],
            '--resume_changed=True', check=False)
    assert p.returncode == 2 and 'nothing is left to train on' in p.stderr, p.stderr[-2000:]
    even = sum(int(ex['answer']) % 2 == 0 for ex in tiny_examples(arith_n_train=16)[0][0])
    rows = metrics(tmp_path / 'straight')[1:]
    assert 0 < even < 16 and [r['data/dropped'] for r in rows[4:]] == [even] * 4, rows
    assert all(r['reward/mean'] < 0.5 for r in rows[4:]), "a dropped problem was drawn again"
    for x, y in zip(metrics(tmp_path / 'straight'), metrics(tmp_path / 'killed')):
        assert stable(x) == stable(y), f"step {x['step']} differs after resume"


@pytest.mark.slow
def test_compiled_training_reruns_and_resumes_bit_for_bit(tmp_path, monkeypatch):
    """compile=True: a run killed (SIGKILL) right after step 2's optimizer step, before its
    checkpoint, and rerun from step 1's ends with the metrics and weights of a run that was not;
    step 2 compiles nothing new.
    Inductor's compiled embedding backward adds with atomics from every thread: without
    deterministic algorithms (the CPU's default) two runs of the same command did not agree."""
    monkeypatch.setenv('OMP_NUM_THREADS', '2')  # threads that race (one per run in the suite)
    args = ['--compile=True', '--max_steps=2', '--save_every=1', '--keep_last=10', '--lr=3e-2']
    a, b = tmp_path / 'straight', tmp_path / 'killed'
    # one after the other: the next two runs find the first one's graphs (a cold compile, about a
    # minute of CPU) in Inductor's cache; side by side, two runs would each compile them
    run(a, *args, timeout=300)
    killed = run(b, *args, '--fault_kill_opt_step=2', check=False, timeout=300)
    assert killed.returncode == -signal.SIGKILL and newest_ckpt(b)[0] == 1, killed.returncode
    p = run(b, *args, timeout=300)
    assert 'resume:' in p.stdout
    ra, rb = metrics(a), metrics(b)
    assert [r['step'] for r in rb] == [0, 1, 2] and ra[1]['compile/graphs'] > 0, ra
    # dynamic shapes from the first graph: step 2's other row lengths reuse step 1's graphs
    assert ra[2]['compile/graphs'] == 0, ra[2]['compile/graphs']
    # Inductor's compile (forward and backward), most of step 1's update, is in its compile time
    assert ra[1]['timing_s/compile'] > 0.5 * ra[1]['timing_s/update'], ra[1]
    for x, y in zip(ra, rb):  # the rerun compiles again: its compile/ keys differ
        x, y = ({k: v for k, v in stable(r).items() if not k.startswith('compile/')} for r in (x, y))
        assert x == y, f"step {x['step']} differs after resume:\n{x}\n{y}"
    wa, wb = weights(a, 2), weights(b, 2)
    assert [k for k in wa if not torch.equal(wa[k], wb[k])] == [], "weights differ after resume"


def newest_ckpt(out_dir, pid=None):
    """Step of the newest complete checkpoint in out_dir (-1: none), and whether process pid is
    writing one now (its temporary file exists: a checkpoint is written under a temporary name and
    renamed when whole)."""
    names = os.listdir(out_dir) if os.path.isdir(out_dir) else []
    done = [int(n[5:12]) for n in names if n.startswith('ckpt_') and n.endswith('.pt')]
    writing = any(n.startswith('ckpt_') and n.endswith(f'.tmp.{pid}') for n in names)
    return max(done, default=-1), writing


def median(xs, default):
    """The middle value of xs (the upper one of an even count), default when xs is empty."""
    return sorted(xs)[len(xs) // 2] if xs else default


@pytest.mark.slow
def test_kill_at_random_instants(tmp_path):
    """9 SIGKILLs at moments chosen from the run's observed progress, not from wall time, so that
    on a fast machine or a slow one they spread over start-up, generation and the update, and
    checkpoint writing: every checkpoint on disk loads, no restart resumes from an older checkpoint
    than the last, and the finished run has every step once.

    A kill lands in one of three places, drawn at random: in start-up (a random fraction of the
    shortest start-up seen, timed from launch to the run's first new checkpoint); in a step (after
    1-3 new checkpoints, save_every=1 writes one per step, plus a random fraction of the median
    step); or in a checkpoint write (once the temporary file of the 1st-3rd new checkpoint appears,
    or the checkpoint itself if its temporary file came and went between two looks, plus a random
    fraction of the median write)."""
    rng = random.Random(0)
    # max_steps long enough that no kill comes after the end
    args = ['--max_steps=100000', '--save_every=1', '--keep_last=2']
    startup_s = []
    step_s = []
    write_s = []
    positions = []  # (where, newest checkpoint before the run, newest after its kill)
    kills = 9
    for i in range(kills):
        before = newest_ckpt(tmp_path)[0]
        proc = start(tmp_path, *args)
        t0 = time.time()
        if i == 0:
            where = 'measure'  # the first run only measures
        else:
            where = rng.choice(['startup', 'step', 'write'])
        if where == 'startup':
            time.sleep(rng.uniform(0, 1) * min(startup_s))
        else:
            want = 4 if i == 0 else rng.randint(1, 3)
            seen = before
            t_done = None
            t_tmp = None
            deadline = t0 + 120
            while True:
                assert time.time() < deadline and proc.poll() is None, \
                    f"kill {i}: no progress past step {seen}"
                now, writing = newest_ckpt(tmp_path, proc.pid)
                t = time.time()
                if writing and t_tmp is None:
                    t_tmp = t
                    if where == 'write' and seen == before + want - 1:
                        where = 'write(tmp)'  # mid-write
                        break
                if now > seen:
                    if seen == before:
                        startup_s.append(t - t0)
                    elif now == seen + 1 and now > before + 2:
                        # (a run's first step warms up: not typical)
                        step_s.append(t - t_done)
                    if t_tmp is not None and now == seen + 1:
                        write_s.append(t - t_tmp)
                    seen = now
                    t_done = t
                    t_tmp = None
                    if seen >= before + want:
                        if where == 'write':
                            where = 'write(renamed)'  # pruning old ones, fsync of the dir
                        break
                time.sleep(0.001)
            frac = rng.uniform(0, 1)
            if where.startswith('write'):
                pause = median(write_s, 0.005)
            else:
                pause = median(step_s, 0.05)
            time.sleep(frac * pause)
            where = f'{where} {want} +{frac:.2f}'
        assert proc.poll() is None, "the run ended by itself before its kill"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # every checkpoint on disk loads: none is ever half-written
        for ck in tmp_path.glob('ckpt_*.pt'):
            state = torch.load(ck, weights_only=False)
            assert state['step'] == int(ck.stem.split('_')[1])
        positions.append((where, before, newest_ckpt(tmp_path)[0]))
    print(f"\nkills (where, newest checkpoint before the run, after the kill): {positions}\n"
          f"start-up {min(startup_s):.2f}-{max(startup_s):.2f}s, "
          f"step {min(step_s):.3f}-{max(step_s):.3f}s, "
          f"checkpoint write {min(write_s, default=0):.4f}-{max(write_s, default=0):.4f}s")
    resumed_from = [a for _, _, a in positions]
    assert resumed_from == sorted(resumed_from), f"a restart went backwards: {positions}"
    # kills after the run had written a checkpoint of its own
    after = sum(a > b for _, b, a in positions)
    assert after >= kills // 3, (f"only {after}/{kills} kills landed after a checkpoint: "
                                 f"the test covered start-up only: {positions}")
    for place in ('startup', 'step', 'write'):
        assert any(w.startswith(place) for w, _, _ in positions), (place, positions)
    # finish a few steps past the last checkpoint (max_steps only shapes the LR schedule)
    last = resumed_from[-1] + 3
    p = run(tmp_path, *args[1:], f'--max_steps={last}', '--resume_changed=True', timeout=300)
    assert "resume: " in p.stdout
    steps = [r['step'] for r in metrics(tmp_path)]
    assert steps == list(range(last + 1)), f"steps lost or duplicated across {kills} kills: {steps}"


def test_sigterm_saves_and_exits(tmp_path):
    proc = start(tmp_path, '--max_steps=1000', '--save_every=1000')
    deadline = time.time() + 60
    while not (tmp_path / 'metrics.jsonl').exists() or len(metrics(tmp_path)) < 3:
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    saved = sorted(tmp_path.glob('ckpt_*.pt'))[-1]
    assert int(saved.stem.split('_')[1]) >= 2, "SIGTERM must checkpoint the step it stopped at"


def test_nan_at_one_step_is_skipped(tmp_path):
    run(tmp_path, '--max_steps=3', '--save_every=1', '--keep_last=10', '--fault_nan_steps=[2]')
    rows = metrics(tmp_path)
    skipped = [r['guard/skipped_update'] for r in rows[1:4]]
    assert skipped == [0, 1, 0]
    assert not (tmp_path / 'ckpt_0000002.pt').exists(), "no checkpoint inside a non-finite streak"
    w1 = weights(tmp_path, 1)
    w3 = weights(tmp_path, 3)
    assert not all(torch.equal(w1[k], w3[k]) for k in w1), "training must go on after the NaN step"
    all_finite_on_disk(tmp_path)


def test_persistent_nan_rolls_back_then_stops(tmp_path):
    nan_steps = str(list(range(3, 21)))
    p = run(tmp_path, '--max_steps=20', '--save_every=1', '--fault_nan_steps=' + nan_steps,
            '--nan_patience=2', '--max_rollbacks=1', check=False)
    assert p.returncode == 3, p.stdout[-2000:] + p.stderr[-2000:]
    assert 'rolled back to' in p.stdout and 'STOPPED' in p.stderr and 'non-finite' in p.stderr
    rows = metrics(tmp_path)
    # NaN from step 3: steps 3,4 -> rollback 1; steps 5,6 -> over max_rollbacks -> stop at step 6
    assert rows[-1]['step'] == 6, f"stopped at step {rows[-1]['step']}, expected 6"
    all_finite_on_disk(tmp_path)


def test_zero_reward_stops_after_patience(tmp_path):
    p = run(tmp_path, '--max_steps=20', "--rewards=[{'name': 'grpo_test_rewards:always_zero'}]",
            '--zero_reward_patience=3', check=False)
    assert p.returncode == 3
    assert 'reward mean has been 0' in p.stderr and 'Recent completions' in p.stderr
    assert metrics(tmp_path)[-1]['step'] == 3, "must stop at the step the patience runs out"


def test_raising_reward_is_counted_and_stops(tmp_path):
    p = run(tmp_path, '--max_steps=20', "--rewards=[{'name': 'grpo_test_rewards:always_raise'}]",
            '--zero_reward_patience=2', '--save_every=1', '--keep_last=10', check=False)
    assert p.returncode == 3 and 'reward server unreachable' in p.stderr, p.stderr[-2000:]
    rows = metrics(tmp_path)
    assert rows[1]['reward/always_raise/errors'] == 16 and rows[-1]['step'] == 2
    assert rows[1]['guard/skipped_update'] == 1, "no update from a batch whose rewards all failed"
    w0 = weights(tmp_path, 0)
    w1 = weights(tmp_path, 1)
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


@pytest.mark.parametrize('mode', ['stop', 'rollback'])
def test_kl_above_max(tmp_path, mode):
    p = run(tmp_path, '--max_steps=10', '--beta=0.1', '--kl_max=1e-9', '--kl_warn=1e-10',
            f'--on_kl_max={mode}', '--max_rollbacks=1', '--lr=1e-2', check=False)
    assert p.returncode == 3 and 'kl_max' in p.stderr, p.stderr[-2000:]
    rows = metrics(tmp_path)
    # KL to the reference is 0 at step 1 (policy == reference) and > 0 at step 2. 'stop' ends there.
    # 'rollback' goes back to the step-0 weights (== reference), so step 3 has KL 0 again and step 4
    # breaches once more: over max_rollbacks=1, it stops
    assert rows[-1]['step'] == (2 if mode == 'stop' else 4), [r['step'] for r in rows]
    assert rows[2]['kl'] > 1e-9 and rows[1]['kl'] == 0.0
    if mode == 'rollback':
        assert 'rolled back to' in p.stdout
    assert 'WARNING [kl]' in p.stdout
    all_finite_on_disk(tmp_path)


def test_watchdog_dumps_the_stalled_stack(tmp_path):
    # watchdog_s well above any real step's quiet stretch (a first update on a slow, loaded machine
    # takes seconds), far below the stall: only the stall can trip it
    p = run(tmp_path, '--max_steps=3', '--watchdog_s=8.0', '--fault_stall_step=1',
            '--fault_stall_s=120', '--watchdog_exit=True', check=False, timeout=200)
    assert p.returncode == 4, p.stderr[-2000:]
    assert 'watchdog: no progress' in p.stderr and 'injected_stall' in p.stderr, p.stderr[-3000:]
    assert 'injected_stall' in (tmp_path / 'watchdog_stacks.txt').read_text()
    assert 'injected_stall' in (tmp_path / 'console.log').read_text()  # faulthandler's write, below Python


def test_profile_step_writes_the_steps_operators(tmp_path):
    p = run(tmp_path, '--max_steps=2', '--profile_step=2')
    table = (tmp_path / 'profile_step2.txt').read_text()
    assert 'aten::' in table and 'Self CPU' in table and 'profile of step 2' in p.stdout
    assert not (tmp_path / 'profile_step1.txt').exists()
    assert not (tmp_path / 'profile_step2.json').exists(), 'a trace only with profile_trace'


def test_bad_config_is_one_line_and_exit_2(tmp_path):
    """Each bad value: exit 2 and one line on stderr naming it, no traceback (two runs at a
    time). One value per place a run checks its knobs: the rest of safety.bad_knob's table is
    test_configurator's, in-process."""
    (tmp_path / 'a_file').write_text('')
    bad = {  # the arguments -> what the line says
        ('--loss_agg=mean',): '--loss_agg',
        (f"--out_dir={tmp_path / 'a_file' / 'run'}",): '--out_dir',
        ('--max_new_tokens=160',): '--max_new_tokens',  # the model's max_seq_len: no room left
        ('--eval_tasks=[3]',): 'eval_tasks', ("--eval_tasks=['nope']",): 'nope',
        ("--eval_tasks=['arith', ('arith', '')]",): 'eval_tasks',  # two sets under one name
        ("--rewards=[{'name': 'correct', 'kwargs': {'corect': 2.0}}]",): 'corect',
        ('--task=arith_tools', '--decode_graphs=True'): '--decode_graphs',
        ('--task=arith_tools', "--stop_strings=['</answer>']"): '--stop_strings'}
    if not torch.cuda.is_available():
        bad[('--device=cuda',)] = '--device'
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = [pool.submit(run, tmp_path / f'run{i}', *args, check=False)
                for i, args in enumerate(bad)]
        for (args, says), p in zip(bad.items(), done):
            p = p.result()
            assert p.returncode == 2 and says in p.stderr, (args, p.stderr)
            assert 'Traceback' not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def tiny_examples(**knobs):
    """TINY's arith train and test problems (other task knobs: knobs), and the task."""
    import tasks
    task = tasks.resolve('arith')
    defaults = tasks.knobs(task)
    tasks.set_knobs(task, {**defaults, 'arith_n_train': 200, 'arith_n_test': 8, **knobs})
    try:  # the task's knobs are its module's globals: restored for the tests after this one
        return [task.load(split, seed=1337) for split in ('train', 'test')], task
    finally:
        tasks.set_knobs(task, defaults)


def tiny_prompt_lengths():
    """The lengths in tokens of TINY's train and eval prompts (arith, byte tokenizer, ChatML)."""
    from sample import encode_prompts
    from tokenizer import byte_tokenizer
    splits, task = tiny_examples()
    return [[len(p) for p in encode_prompts(byte_tokenizer(), task, examples, '', '')]
            for examples in splits]


def test_prompts_too_long_for_the_completion_budget_are_left_out_at_load(tmp_path):
    """A prompt that leaves less than max_new_tokens of the model's positions was a traceback at the
    first step that drew it; now such problems leave the train and eval sets when they load, counted
    in one line each, and the run trains on the rest."""
    train, test = tiny_prompt_lengths()
    limit = sorted(train)[len(train) // 2]
    long_train = sum(n > limit for n in train)
    long_eval = sum(n > limit for n in test[:4])
    assert 0 < long_train < len(train) and long_eval < 4
    # the budget too large for some prompts; the same limit as a knob, the budget as it was
    p, q = run_together([tmp_path / 'a', f'--max_new_tokens={160 - limit}', '--max_steps=3',
                         '--eval_every=3', '--batch_prompts=8'],
                        [tmp_path / 'b', f'--max_prompt_len={limit}', '--max_steps=1'])
    assert (f"train: left out {long_train} of 200 problems whose prompt is longer than {limit} "
            "tokens") in p.stdout, p.stdout[-2000:]
    assert ('eval: left out' in p.stdout) == (long_eval > 0)
    assert f"on {4 - long_eval} problems" in p.stdout and metrics(tmp_path / 'a')[-1]['step'] == 3
    assert f"train: left out {long_train} of 200" in q.stdout
    bad = {'raise --max_prompt_len': [f'--max_prompt_len={min(train) - 1}'],
           'raise max_seq_len': [f'--max_new_tokens={161 - min(train)}'],
           '--max_prompt_len=150': ['--max_prompt_len=150', '--max_new_tokens=20']}
    done = run_together(*[[tmp_path / f'c{i}', *args] for i, args in enumerate(bad.values())],
                        check=False)
    for says, p in zip(bad, done):
        assert p.returncode == 2 and says in p.stderr, (says, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def tiny_qwen2_snapshot(path, max_positions):
    """A random one-layer Qwen2 saved by transformers with the byte tokenizer: a real config's run in
    seconds."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from tokenizer import byte_tokenizer
    cfg = Qwen2Config(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=max_positions, tie_word_embeddings=True)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    byte_tokenizer().save(str(path))
    return path


@pytest.mark.skipif(not (GSM8K / 'train.jsonl').exists(), reason='../shared/gsm8k not present')
def test_gsm8k_config_runs_on_a_tiny_qwen2_snapshot(tmp_path):
    snap = tiny_qwen2_snapshot(tmp_path / 'tiny-qwen2', 1024)
    env = {**os.environ, 'PYTHONUNBUFFERED': '1'}
    cmd = [sys.executable, 'train_grpo.py', 'config/gsm8k.py', f'--init_from={snap}',
           f'--data_dir={GSM8K}', f'--out_dir={tmp_path / "out"}', '--max_steps=2',
           '--batch_prompts=2', '--group_size=2', '--max_new_tokens=8', '--eval_examples=2',
           '--eval_every=2', '--device=cpu', '--dtype=float32', '--save_every=2']
    p = warm.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = metrics(tmp_path / 'out')
    assert [r['step'] for r in rows] == [0, 1, 2] and 'eval/pass@1' in rows[-1]


def test_the_warm_starts_learning_rate_ends_at_a_tenth_whatever_min_lr_ratio(tmp_path):
    """sft_steps=11 (1 of warmup): the last step's rate is sft_lr (0.1 + 0.9 (1 + cos 0.9 pi) / 2),
    with --min_lr_ratio=0.0 too (GRPO's floor, not the warm start's)."""
    p = run(tmp_path / 'a', '--max_steps=0', '--sft_steps=11', '--sft_lr=1e-2', '--sft_batch_size=4',
            '--min_lr_ratio=0.0')
    last = [ln for ln in p.stdout.splitlines() if ln.startswith('sft   10 |')]
    lr = float(last[0].split('| lr ')[1].split()[0])
    assert abs(lr - 1e-2 * (0.1 + 0.9 * 0.5 * (1 + math.cos(0.9 * math.pi)))) < 1e-6, last


def test_arith_probe_reads_an_arith_export(tmp_path):
    """scripts/arith_probe.py (the README's forced-count figures) on a tiny arith run's export; any
    other is refused."""
    run(tmp_path / 'a', '--export_hf=True', '--max_steps=0', '--sft_steps=2',
        '--arith_difficulty=starter', '--arith_count_on=0.5', '--arith_slips=1.0')
    probe = [sys.executable, str(ROOT / 'scripts' / 'arith_probe.py')]
    p = warm.run([*probe, str(tmp_path / 'a' / 'hf')], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert set(got) == {'greedy_pass@1', 'forced_count_pass@1', 'sampled_count_share',
                        'sampled_count_right'}
    assert all(0.0 <= v <= 1.0 for v in got.values())
    p = warm.run([*probe, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert p.stderr.strip().startswith('error:') and len(p.stderr.strip().splitlines()) == 1
