"""The run doctor (doctor/, python -m doctor RUN) diagnoses a run from its logs after the fact.
Each detector fires on a log with its failure and stays silent on healthy runs; every source
format is read from a file; malformed, truncated and mixed logs cost one line per unreadable row
and nothing else. The fixtures are logs of real runs (ours and TRL's) and three built by hand from
failures users reported: tests/fixtures/doctor/README.txt gives the command behind each."""
import json
import os
import random
import shutil

import pytest

import doctor
from doctor.__main__ import MAX_PROBLEM_LINES, main, report

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'fixtures', 'doctor')
HEALTHY = ['ours_healthy', 'ours_healthy/train.log', 'trl_healthy']


def run_of(name, device_gb=0.0):
    run = doctor.load(os.path.join(FIX, name), device_gb)
    assert isinstance(run, dict), run
    return run


def findings(name, device_gb=0.0):
    return {f['name']: f for f in doctor.diagnose(run_of(name, device_gb))}


def cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------------------------ detectors
# (fixture, --device_gb, finding, severity, its steps): each a log of that failure
FAILURES = [
    ('ours_reward_dies', 0, 'reward_collapse', 'error', range(6, 13)),
    ('trl_reward_dies', 0, 'reward_collapse', 'error', range(6, 13)),
    ('wandb_reward_dies.csv', 0, 'reward_collapse', 'error', range(188, 688)),
    ('ours_format_mismatch', 0, 'reward_zero_from_start', 'error', range(1, 9)),
    ('trl_wrong_kwargs', 0, 'reward_zero_from_start', 'error', range(1, 13)),
    ('ours_judge_constant', 0, 'reward_constant_from_start', 'error', range(1, 9)),
    ('ours_judge_constant', 0, 'zero_loss', 'error', range(1, 9)),
    ('nanogpt_zero_loss.log', 0, 'zero_loss', 'error', range(1, 8)),
    ('nanogpt_zero_loss.log', 0, 'steps_slower_than_first', 'warning', range(1, 8)),
    ('ours_compile_decode', 0, 'first_steps_slow', 'info', [1, 2]),
    ('verl_chess_kl.log', 0, 'kl_at_start', 'error', [1]),
    ('ours_kl_unstable', 0, 'kl_spike', 'warning', [3, 4, 6, 7, 9]),
    ('ours_kl_unstable', 0, 'grad_norm_spike', 'warning', [3]),
    ('ours_nan', 0, 'nonfinite', 'error', [4, 5, 6]),
    ('ours_entropy_collapse', 0, 'entropy_collapse', 'warning', range(17, 26)),
    ('ours_truncated', 0, 'truncated', 'warning', range(1, 9)),
    ('ours_entropy_collapse', 0, 'truncated', 'warning', range(1, 26)),
    ('wandb_reward_dies.csv', 0, 'memory_near_limit', 'warning', range(1, 688)),
    ('verl_chess_kl.log', 80, 'memory_near_limit', 'warning', [1]),
    ('ours_healthy', 1.0, 'memory_near_limit', 'warning', range(13, 31)),  # CPU: peak RSS
    ('ours_reward_hacking', 0, 'reward_hacking', 'warning', range(1, 17)),
    ('ours_lr_high', 0, 'reward_fell', 'warning', range(5, 17)),
    ('ours_lr_high', 0, 'few_groups_learn', 'warning', [6, 7, 9, 10, 11, 12, 13, 14, 15]),
    ('ours_launch_bound', 0, 'generation_launch_bound', 'info', range(2, 9)),
    ('ours_distill_lr_high', 0, 'teacher_kl_rose', 'warning', range(5, 17)),
    ('ours_oom/train.log', 0, 'out_of_memory', 'error', [3]),
    ('verl_oom.log', 0, 'out_of_memory', 'error', [6]),
    ('trl_oom.log', 0, 'out_of_memory', 'error', []),
    ('ours_killed/train.log', 0, 'killed', 'error', [3]),
    ('verl_host_oom.log', 0, 'host_out_of_memory', 'error', [3]),
    ('nccl_timeout.log', 0, 'collective_timeout', 'error', [4]),
    ('cuda_assert.log', 0, 'cuda_error', 'error', []),
    ('nanochat_rl_dies.log', 0, 'reward_collapse', 'error', range(64, 80)),
    ('nanochat_rl_dies.log', 0, 'zero_loss', 'error', range(64, 80)),
]


@pytest.mark.parametrize('name, device_gb, finding, severity, steps', FAILURES,
                         ids=[f"{f[2]}-{f[0]}" for f in FAILURES])
def test_each_detector_fires_on_its_failure(name, device_gb, finding, severity, steps):
    got = findings(name, device_gb)
    assert finding in got, f"{name}: expected {finding}, got {sorted(got)}"
    assert got[finding]['severity'] == severity
    assert got[finding]['steps'] == list(steps), got[finding]['evidence']


@pytest.mark.parametrize('name', HEALTHY)
def test_healthy_runs_are_not_flagged(name):
    flagged = [f for f in doctor.diagnose(run_of(name)) if f['severity'] != 'info']
    assert not flagged, '\n'.join(f"{f['name']}: {f['evidence']}" for f in flagged)


def test_every_detector_has_a_failing_log_and_stays_silent_on_healthy_runs():
    """The table above covers every detector at least once; each returns nothing on the healthy
    runs (ours 30 steps, its console log, TRL 12 steps)."""
    covered = set()
    for name, device_gb, finding, _, _ in FAILURES:
        run = run_of(name, device_gb)
        covered |= {d.__name__ for d in doctor.DETECTORS if finding in [f['name'] for f in d(run)]}
    assert covered == {d.__name__ for d in doctor.DETECTORS} - {'detect_clipping'}
    for name in HEALTHY:
        run = run_of(name)
        for detect in doctor.DETECTORS:
            assert [f for f in detect(run) if f['severity'] != 'info'] == [], detect.__name__


def test_an_out_of_memory_error_names_its_phase_and_the_trainers_knobs(capsys):
    """The phase from our own report, from verl's Ray worker method, from TRL's frames; the fix in
    that trainer's knobs; fragmentation first when the reserved-but-unallocated memory would have
    held the allocation. A log of nothing but the error is still read (no plot: nothing to draw)."""
    ours = findings('ours_oom/train.log')['out_of_memory']
    assert 'after step 3, in update' in ours['evidence'] and 'micro_batch_size' in ours['fix'], ours
    verl = findings('verl_oom.log')['out_of_memory']
    assert 'in update: asked for 4.64 GiB, of 79.19 GiB' in verl['evidence'], verl['evidence']
    assert 'ppo_micro_batch_size_per_gpu' in verl['fix'] and verl['causes'][0].startswith('fragmentation')
    assert 'such errors' not in verl['evidence'], "Ray's line and PyTorch's counted as two errors"
    trl = findings('trl_oom.log')['out_of_memory']
    assert 'before any step was logged, in generation' in trl['evidence'], trl['evidence']
    assert 'per_device_train_batch_size' in trl['fix'] and 'resume' not in trl['fix'], trl['fix']
    assert not any(c.startswith('fragmentation') for c in trl['causes']), "0.98 GiB spare < 1.16 GiB asked"
    code, out, err = cli(capsys, os.path.join(FIX, 'trl_oom.log'), '--out', os.devnull)
    assert code == 1 and 'no step logged' in out and 'ERROR out_of_memory (no step)' in out, out + err


def test_trl_console_rows_take_the_training_bars_step(tmp_path):
    """transformers' printed log dicts: '%.4g' strings under the progress bar, raw floats without;
    each row's step is the training bar's last count (an evaluation bar, of another total, is not
    the step), else the row's number; the closing summary is no row."""
    bar = "{:3d}%|##        | {}/40 [00:{:02d}<01:10,  1.8s/it]"
    lines = ["Loading weights: 100%|##########| 50/50 [00:00<00:00, 15764.50it/s]", bar.format(5, 2, 4),
             "{'loss': '0.0123', 'grad_norm': '0.45', 'learning_rate': '1e-06', "
             "'reward': '0.5', 'reward_std': '0.3', 'frac_reward_zero_std': '0.25', 'epoch': '0.01'}",
             bar.format(10, 4, 8), " 40%|####      | 2/5 [00:01<00:01,  2.0it/s]",
             "{'eval_loss': '0.01', 'eval_reward': '0.61', 'epoch': '0.02'}",
             "{'loss': '0.02', 'reward': '0.55', 'epoch': '0.02'}",
             "{'train_runtime': '80.1', 'train_loss': '0.01', 'epoch': '0.02'}"]
    (tmp_path / 'bar.log').write_text('\n'.join(lines) + '\n')
    run = run_of(tmp_path / 'bar.log')
    assert run['source'] == 'trl' and run['rows'] == 3, run
    assert run['series']['reward'] == {2: 0.5, 4: 0.55} and run['series']['heldout'] == {4: 0.61}
    assert run['series']['zero_std_frac'] == {2: 0.25}
    raw = ["{'loss': 0.0123, 'grad_norm': 0.45, 'reward': 0.5, 'epoch': 0.01}",
           "{'loss': 0.02, 'grad_norm': 0.4, 'reward': 0.75, 'epoch': 0.02}"]
    (tmp_path / 'raw.log').write_text('\n'.join(raw) + '\n')
    assert run_of(tmp_path / 'raw.log')['series']['reward'] == {1: 0.5, 2: 0.75}


def test_a_trl_console_log_reads_as_its_trainer_state():
    """trl_console.log is trl_healthy's run again with the progress bar on (the same numbers: TRL on
    a CPU is deterministic): every series at every step equals the trainer_state.json's to the
    console's 4 significant digits (but the wall-clock step_time)."""
    console, state = run_of('trl_console.log'), run_of('trl_healthy')
    assert console['source'] == 'trl' and console['steps'] == state['steps'] == list(range(1, 13))
    assert set(console['series']) == set(state['series']), set(console['series']) ^ set(state['series'])
    for name, series in state['series'].items():
        if name == 'step_time':
            continue
        for step, want in series.items():
            got = console['series'][name][step]
            assert abs(got - want) <= 5e-4 * abs(want) + 1e-9, (name, step, got, want)
    assert not [f for f in doctor.diagnose(console) if f['severity'] != 'info']


def test_a_fatal_error_says_what_the_lines_around_it_add(tmp_path):
    """The ranks that waited in a timed-out collective (the one not listed is the straggler), the
    ranks torchrun reports killed, the device assertion that failed; Ray's OutOfMemoryError is the
    host's memory, not the device's; a SIGKILL that the host's memory explains is one finding."""
    nccl = findings('nccl_timeout.log')['collective_timeout']
    assert 'ranks 0, 1, 3 waited in ALLREDUCE #1580 for 600 s' in nccl['evidence'], nccl['evidence']
    killed = findings('ours_killed/train.log')['killed']
    assert 'torchrun reports ranks 0, 1' in killed['evidence'] and 'resume' in killed['fix'], killed
    cuda = findings('cuda_assert.log')['cuda_error']
    assert 'srcIndex < srcSelectDimSize' in cuda['evidence'] and 'vocab_size' in cuda['fix'], cuda
    host = findings('verl_host_oom.log')
    assert 'host_out_of_memory' in host and 'out_of_memory' not in host, sorted(host)
    shutil.copy(os.path.join(FIX, 'ours_killed', 'train.log'), tmp_path / 'train.log')
    with open(tmp_path / 'train.log', 'a') as f:
        f.write("bash: line 1: 12660 Killed                  python train_grpo.py config/arith.py\n")
    both = findings(tmp_path / 'train.log')
    assert 'host_out_of_memory' in both and 'killed' not in both, sorted(both)
    (tmp_path / 'nan.log').write_text("RuntimeError: probability tensor contains either `inf`, `nan` or element < 0\n")
    assert 'fp16' in findings(tmp_path / 'nan.log')['nonfinite_probabilities']['causes'][0]


def test_an_abort_is_named_by_the_error_that_caused_it(tmp_path):
    """NCCL's watchdog ends the process with an uncaught C++ exception and an abort: that is the
    collective's timeout, not a second finding; an abort alone is a native crash, with the C++
    exception's message, the phase and the stack faulthandler printed."""
    abort = ("terminate called after throwing an instance of '{}'\n  what():  {}\nFatal Python error: Aborted\n\n"
             "Current thread 0x00007f5e2a1b7740 (most recent call first):\n"
             '  File "/opt/venv/lib/python3.11/site-packages/torch/autograd/graph.py", line 825 in '
             '_engine_run_backward\n  File "/work/train_grpo.py", line 1010 in update\n'
             '  File "/work/train_grpo.py", line 1290 in <module>\n\n')
    shutil.copy(os.path.join(FIX, 'nccl_timeout.log'), tmp_path / 'nccl.log')
    with open(tmp_path / 'nccl.log', 'a') as f:
        f.write(abort.format('c10::DistBackendError', '[PG ID 0 PG GUID 0(default_pg) Rank 0] Process group watchdog '
                             'thread terminated with exception: [Rank 0] Watchdog caught collective operation timeout'))
    nccl = findings(tmp_path / 'nccl.log')
    assert 'collective_timeout' in nccl and 'native_crash' not in nccl, sorted(nccl)
    (tmp_path / 'abort.log').write_text(open(os.path.join(FIX, 'ours_healthy', 'train.log')).read()
                                        + abort.format('std::runtime_error', 'a custom kernel: bad launch'))
    crash = findings(tmp_path / 'abort.log')['native_crash']
    assert crash['severity'] == 'error' and 'the C++ exception: `a custom kernel: bad launch`, in update' in \
        crash['evidence'], crash['evidence']
    assert ("stack, innermost first: _engine_run_backward (autograd/graph.py:825), update (work/train_grpo.py:1010), "
            "<module> (work/train_grpo.py:1290)") in crash['evidence'], crash['evidence']


def test_rays_worker_method_alone_names_the_phase():
    """verl's error as Ray's driver prints it when the worker's frames are cut off: the worker method
    (role prefix and all) says which phase."""
    from doctor.crash import oom_phase
    line = ('ray.exceptions.RayTaskError(OutOfMemoryError): ray::WorkerDict.{}() (pid=1, ip=10.0.0.1, '
            'actor_id=ab)')
    for method, phase in (('actor_rollout_ref_update_actor', 'update'),
                          ('actor_rollout_generate_sequences', 'generation'),
                          ('actor_rollout_compute_ref_log_prob', 'old/reference log-probs')):
        crash = {'text': line.format(method), 'before': [], 'after': []}
        assert oom_phase(crash) == phase, method


def test_the_reward_collapse_says_what_the_numbers_were():
    f = findings('wandb_reward_dies.csv')['reward_collapse']
    assert 'reward exactly 0 on steps 188-687 (500 steps)' in f['evidence']
    assert 'after a mean of 0.64' in f['evidence'] and 'device memory median 95%' in f['evidence']
    assert 'grad norm median 0.308 (0.301 before)' in f['evidence']  # the grad norms looked normal
    assert f['causes'][0].startswith('the reward or rollout service died')
    f = findings('ours_reward_dies')['reward_collapse']
    # samples.jsonl: a right answer scored 0, so the reward is broken, not the model
    assert "'69-3=66\\n#### 66' (reward 0.0, graded correct by the task)" in f['evidence']


def test_zero_loss_tells_identical_rewards_from_a_masking_bug(tmp_path):
    """Zero spread: identical rewards first. Rewards that differ while the loss and gradient are
    exactly 0 (the healthy log with loss and grad norm zeroed on steps 5-10): a masking bug first.
    Unknown spread (the nanoGPT log): both, identical rewards first."""
    f = findings('ours_judge_constant')['zero_loss']
    assert f['causes'][0].startswith('identical rewards') and len(f['causes']) == 2
    rows = [json.loads(line) for line in open(os.path.join(FIX, 'ours_healthy', 'metrics.jsonl'))]
    for r in rows:
        if 5 <= r['step'] <= 10:
            r['loss'] = r['grad_norm'] = 0.0
    path = tmp_path / 'metrics.jsonl'
    path.write_text(''.join(json.dumps(r) + '\n' for r in rows))
    f = {f['name']: f for f in doctor.diagnose(doctor.load(str(path)))}['zero_loss']
    assert f['steps'] == list(range(5, 11)) and 'the rewards differ within groups' in f['evidence']
    assert f['causes'][0].startswith('the advantages never reach the loss')
    f = findings('nanogpt_zero_loss.log')['zero_loss']
    assert f['causes'][0].startswith('identical rewards') and len(f['causes']) == 4


def test_a_loss_printed_as_zero_while_gradients_flow_is_not_flagged(tmp_path):
    rows = [json.loads(line) for line in open(os.path.join(FIX, 'ours_healthy', 'metrics.jsonl'))]
    for r in rows:
        if 'loss' in r:
            r['loss'] = 0.0  # GRPO's loss value is about 0 by construction; its gradient is not
    (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    assert 'zero_loss' not in {f['name'] for f in doctor.diagnose(doctor.load(str(tmp_path)))}


def test_a_slow_step_and_the_clip_fraction(tmp_path):
    """Two detectors no run here produced a log for: a stall at step 15 (10x its time) and a PPO
    clip cutting 30% of tokens, both written into the healthy log."""
    rows = [json.loads(line) for line in open(os.path.join(FIX, 'ours_healthy', 'metrics.jsonl'))]
    for r in rows:
        if r['step'] == 15:
            r['timing_s/step'] *= 10
            r['timing_s/reward'] = r['timing_s/step'] * 0.9
        if r['step'] >= 1:
            r['clip/low_frac'], r['clip/high_frac'] = 0.1, 0.2
    (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    got = {f['name']: f for f in doctor.diagnose(doctor.load(str(tmp_path)))}
    assert got['slow_steps']['steps'] == [15]
    assert 'the time went to reward' in got['slow_steps']['evidence']
    assert got['clipped']['steps'] == list(range(1, 31)) and '30% of tokens' in got['clipped'][
        'evidence']


def test_step_time_findings_say_what_torch_compile_built(tmp_path):
    """Where our log says what torch.compile built each step (compile/graphs, timing_s/compile):
    the healthy log with a compiled first step (30 s, 28 of them compiling 2 graphs) and a step 15
    that recompiled (10x its time): that slow step names the recompile first; the same step with
    nothing compiled (a stall) does not name it at all."""
    rows = [json.loads(line) for line in open(os.path.join(FIX, 'ours_healthy', 'metrics.jsonl'))]
    for r in rows:
        if r['step'] >= 1:
            r['compile/graphs'], r['timing_s/compile'] = 0, 0.0
        if r['step'] == 1:
            r['timing_s/step'], r['timing_s/update'] = 30.0, 29.0
            r['compile/graphs'], r['timing_s/compile'] = 2, 28.0
        if r['step'] == 15:
            r['timing_s/step'] *= 10
            r['compile/graphs'], r['timing_s/compile'] = 1, r['timing_s/step'] * 0.8
    (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    got = {f['name']: f for f in doctor.diagnose(doctor.load(str(tmp_path)))}
    assert 'torch.compile built 2 graphs in 28 s of them' in got['first_steps_slow']['evidence']
    assert got['slow_steps']['steps'] == [15], got['slow_steps']
    assert 'torch.compile built 1 graph in' in got['slow_steps']['evidence']
    assert got['slow_steps']['causes'][0].startswith('a recompilation'), got['slow_steps']['causes']
    for r in rows:  # the same slow step, nothing compiled: a stall, no recompilation
        if r['step'] == 15:
            r['compile/graphs'], r['timing_s/compile'] = 0, 0.0
    (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    slow = {f['name']: f for f in doctor.diagnose(doctor.load(str(tmp_path)))}['slow_steps']
    assert 'torch.compile built no graph on them' in slow['evidence']
    assert not any('recompil' in c for c in slow['causes']), slow['causes']


def test_our_step_line_with_a_compile_keeps_its_phases(tmp_path):
    """A step line that compiled ends its phases with '; compile S for N graphs)': the update's
    seconds before the ';' and the compile's after it are both read (console.log alone)."""
    lines = []
    for step in range(1, 9):
        t = {1: 70.9, 6: 30.0}.get(step, 1.0)
        built = f"; compile {t - 0.2:.1f} for 2 graphs" if step in (1, 6) else ''
        lines.append(f"step {step:5d} | reward 0.041±0.063 | zero_std 0.25 | loss -0.1409 | kl 0.0000 | "
                     f"ent 5.553 | gnorm 0.565 | len 7 | {t}s (gen 0.1 rew 0.0 ref 0.0 old 0.0 "
                     f"upd {t - 0.1:.1f}{built}) | mem 0.51GB")
    (tmp_path / 'console.log').write_text('\n'.join(lines) + '\n')
    run = doctor.load(str(tmp_path / 'console.log'))
    assert run['series']['time_update'][6] == 29.9 and run['series']['time_compile'] == {1: 70.7, 6: 29.8}
    assert run['series']['compile_graphs'] == {1: 2, 6: 2}
    slow = {f['name']: f for f in doctor.diagnose(run)}['slow_steps']
    assert 'the time went to update' in slow['evidence'], slow['evidence']
    assert 'torch.compile built 2 graphs in 29.8 s of them' in slow['evidence'], slow['evidence']


def test_an_entropy_of_exactly_0_is_no_measurement(tmp_path):
    """Ours logs entropy 0 on a step with no tokens to train on (every group tied): the first 16
    steps of the entropy-collapse run (5.54 -> 0.67, not yet collapsed) with steps 14-16 so."""
    rows = [json.loads(line) for line in
            open(os.path.join(FIX, 'ours_entropy_collapse', 'metrics.jsonl'))][:17]
    for r in rows[14:]:
        r['entropy'] = r['tokens_trained'] = 0
    (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    assert doctor.detect.detect_entropy_collapse(doctor.load(str(tmp_path))) == []


def test_tied_groups_that_learn_from_a_teacher_are_not_called_idle(tmp_path):
    """A distillation run (teacher/reverse_kl logged, not 0) trains its tied groups through the
    teacher: the few_groups_learn warning of the lr-too-high run stays silent on the same rows."""
    rows = [json.loads(line) for line in open(os.path.join(FIX, 'ours_lr_high', 'metrics.jsonl'))]
    for r in rows:
        r['teacher/reverse_kl'] = 0.3
    (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    run = doctor.load(str(tmp_path))
    assert not run['unknown'] and doctor.detect.detect_zero_spread(run) == []
    assert doctor.detect.detect_zero_spread(run_of('ours_lr_high'))


def test_a_distillation_that_closes_on_its_teacher_is_not_flagged():
    """The demo's distillation (docs/objective.md): KL to the teacher 0.0084 -> 0.0002, tied groups
    trained by the teacher; its one grad-norm spike (step 22) is another detector's."""
    run = run_of('ours_distill')
    assert doctor.detect.detect_teacher_kl_rise(run) == [] and doctor.detect.detect_zero_spread(run) == []


def test_a_recovering_reward_is_not_called_a_dead_service(tmp_path):
    rows = [json.loads(line) for line in open(os.path.join(FIX, 'ours_healthy', 'metrics.jsonl'))]
    for r in rows:
        if 10 <= r['step'] <= 13:
            r['reward/mean'] = r['reward/std'] = 0.0
            r['frac_zero_std'] = 1.0
    (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    f = {f['name']: f for f in doctor.diagnose(doctor.load(str(tmp_path)))}['reward_collapse']
    assert f['steps'] == [10, 11, 12, 13] and 'moves again from step 14' in f['causes'][0]


# ------------------------------------------------------------------------------------ sources
def test_ours_metrics_and_console_agree():
    """Our metrics.jsonl and the same run's console step lines give the same series, to the
    console's print precision."""
    a, b = run_of('ours_healthy'), run_of('ours_healthy/train.log')
    assert a['source'] == 'ours' and b['source'] == 'console' and not b['unknown']
    precision = {'reward': 5e-4, 'reward_std': 5e-4, 'zero_std_frac': 5e-3, 'loss': 5e-5,
                 'grad_norm': 5e-4, 'entropy': 5e-4, 'resp_len': 0.5, 'step_time': 0.05,
                 'time_gen': 0.05, 'time_update': 0.05, 'mem_gb': 5e-3}
    for name, tol in precision.items():
        for step in range(1, 31):
            assert abs(a['series'][name][step] - b['series'][name][step]) <= tol * 1.001, (name,
                                                                                           step)
    assert a['series']['heldout'] == {0: 0.54, 10: 0.795, 20: 0.965, 30: 0.96}
    assert not a['unknown'], a['unknown']


def test_trl_reads_the_newest_checkpoint_and_knows_every_name(tmp_path):
    shutil.copytree(os.path.join(FIX, 'trl_healthy'), tmp_path / 'out')
    shutil.copytree(tmp_path / 'out' / 'checkpoint-12', tmp_path / 'out' / 'checkpoint-4')
    state = tmp_path / 'out' / 'checkpoint-4' / 'trainer_state.json'
    d = json.loads(state.read_text())
    d['log_history'] = d['log_history'][:4]
    state.write_text(json.dumps(d))
    run = doctor.load(str(tmp_path / 'out'))
    assert run['path'].endswith(os.path.join('checkpoint-12', 'trainer_state.json'))
    history = json.load(open(os.path.join(FIX, 'trl_healthy', 'checkpoint-12',
                                          'trainer_state.json')))['log_history']
    assert run['series']['reward'] == {r['step']: r['reward'] for r in history}
    assert run['series']['zero_std_frac'][1] == history[0]['frac_reward_zero_std']
    assert run['series']['trunc_frac'][1] == history[0]['completions/clipped_ratio']
    assert run['series']['kl'][1] == 0.0 and not run['unknown']
    assert doctor.load(str(state))['rows'] == 4  # a trainer_state.json named directly


def test_steps_logged_every_10_read_as_one_stretch(tmp_path):
    """TRL logs every logging_steps (10 by default): the dead reward of trl_reward_dies, logged
    at steps 10-120, is one stretch of steps 60-120."""
    d = json.load(open(os.path.join(FIX, 'trl_reward_dies', 'checkpoint-12', 'trainer_state.json')))
    for r in d['log_history']:
        r['step'] *= 10
    (tmp_path / 'trainer_state.json').write_text(json.dumps(d))
    run = doctor.load(str(tmp_path))
    f = {f['name']: f for f in doctor.diagnose(run)}['reward_collapse']
    assert f['steps'] == list(range(60, 130, 10))
    assert 'reward_collapse (steps 60-120)' in report(run, [f])


def test_console_key_value_tokens(tmp_path):
    path = tmp_path / 'train.log'
    path.write_text('iter 3: loss=0.25, lr:3e-4, reward 0.5, time 2.5s\n')
    run = doctor.load(str(path))
    s = run['series']
    assert (s['loss'], s['reward'], s['step_time']) == ({3: 0.25}, {3: 0.5}, {3: 2.5})


def test_verl_console_through_rays_prefix():
    run = run_of('verl_chess_kl.log')
    assert run['source'] == 'verl' and run['rows'] == 2 and not run['problems']
    s = run['series']
    assert s['kl'] == {1: 0.853} and s['heldout'] == {0: 0.117} and s['mem_gb'] == {1: 74.1}
    assert s['time_update'] == {1: 9.876} and s['reward'] == {1: 0.121}


def test_verl_full_precision_values(tmp_path):
    """Newer verl prints values with pprint: numpy scalars as np.float64(...)."""
    path = tmp_path / 'verl.log'
    path.write_text("step:3 - critic/score/mean:np.float64(0.4375) - actor/pg_loss:-0.0123 - "
                    "my/metric:1.0\n")
    run = doctor.load(str(path))
    assert run['series']['reward'] == {3: 0.4375} and run['series']['loss'] == {3: -0.0123}
    assert run['unknown'] == {'my/metric'}


def test_wandb_csv_strips_trl_prefix_and_scales_memory():
    run = run_of('wandb_reward_dies.csv')
    s = run['series']
    assert run['source'] == 'wandb' and len(s['reward']) == 687 and s['reward'][188] == 0.0
    assert 0.94 < s['mem_frac'][1] < 0.96  # W&B's percentage
    assert not run['unknown'] and not run['problems']  # eval/reward's empty cells are no problem


def test_wandb_panel_export_columns(tmp_path):
    path = tmp_path / 'panel.csv'
    path.write_text("Step,run-7 - train/reward,run-7 - train/reward__MIN,"
                    "run-7 - train/reward__MAX\n1,0.5,0.4,0.6\n2,0.25,0.2,0.3\n")
    run = doctor.load(str(path))
    assert run['series']['reward'] == {1: 0.5, 2: 0.25} and not run['unknown']


# verl's console in each release's layout (tests/fixtures/doctor/make_by_hand.py names the tag and
# source file behind each): which series come out, and no name left unmapped
VERL_SERIES = {
    'verl_v0.1_gsm8k.log': {'reward', 'reward_max', 'reward_min', 'loss', 'grad_norm', 'kl',
                            'entropy', 'resp_len', 'clip_frac', 'step_time', 'time_gen', 'time_ref',
                            'time_values', 'time_adv', 'time_update', 'time_critic', 'time_eval',
                            'heldout'},
    'verl_v0.2_gsm8k.log': {'reward', 'reward_max', 'reward_min', 'loss', 'grad_norm', 'kl',
                            'entropy', 'resp_len', 'trunc_frac', 'clip_frac', 'step_time',
                            'time_gen', 'time_ref', 'time_old', 'time_adv', 'time_update',
                            'time_eval', 'heldout'},
    'verl_v0.5_gsm8k.log': {'reward', 'reward_max', 'reward_min', 'loss', 'grad_norm', 'kl',
                            'entropy', 'resp_len', 'trunc_frac', 'clip_frac', 'step_time',
                            'time_gen', 'time_reward', 'time_ref', 'time_old', 'time_adv',
                            'time_update', 'time_eval', 'throughput', 'mem_gb', 'heldout'},
}


@pytest.mark.parametrize('name', sorted(VERL_SERIES))
def test_verl_console_of_each_release(name):
    run = run_of(name)
    assert run['source'] == 'verl' and not run['problems'] and not run['unknown'], run['unknown']
    assert {k for k, v in run['series'].items() if v} == VERL_SERIES[name]


def test_verl_old_spellings():
    """0.1: timing/<phase> with no step total (the step's time is their sum), steps from 0,
    actor/entropy_loss, critic/kl, val/test_score/<source> at (step + 1) % 5 == 0."""
    s = run_of('verl_v0.1_gsm8k.log')['series']
    assert s['heldout'] == {4: 0.256, 9: 0.356, 14: 0.456, 19: 0.556}
    assert s['entropy'][0] == 0.62 and s['kl'][0] == 0.0 and s['time_eval'].keys() == s['heldout'].keys()
    phases = ['time_gen', 'time_ref', 'time_values', 'time_adv', 'time_critic', 'time_update',
              'time_eval']
    assert s['step_time'][4] == pytest.approx(sum(s[p].get(4, 0.0) for p in phases))
    s = run_of('verl_v0.2_gsm8k.log')['series']  # the first validation, logged as step 0
    assert s['heldout'][0] == 0.412 and sorted(s['heldout']) == [0, 5, 10, 15, 20]


def test_verl_new_spellings_through_pprint():
    """0.5: numpy scalars as np.float64(...); val-core/<source>/reward/mean@1 is the held-out score;
    actor/pg_clipfrac_lower (dual-clip's share) is not the clip's lower side."""
    run = run_of('verl_v0.5_gsm8k.log')
    s = run['series']
    assert s['heldout'][0] == 0.412 and sorted(s['heldout']) == [0, 5, 10, 15, 20]
    assert s['entropy'][1] == 0.516 and s['mem_gb'][1] == 61.374832
    assert 'clip_low' not in s and s['clip_frac'][1] == 0.003294


def test_validation_scores_of_several_sources_are_averaged(tmp_path):
    """val-core's mean@N of each source (best@N, maj@N and val-aux beside it are not scores)."""
    path = tmp_path / 'verl.log'
    path.write_text("step:0 - val-core/openai/gsm8k/reward/mean@4:0.5 - val-core/openai/gsm8k/reward/"
                    "best@4/mean:0.9 - val-core/openai/gsm8k/reward/best@4/std:0.01 - "
                    "val-core/math/acc/mean@4:0.3 - val-aux/math/reward/mean@4:0.2\n")
    run = doctor.load(str(path))
    assert run['series']['heldout'] == {0: pytest.approx(0.4)} and not run['unknown']


def test_a_slow_verl_step_names_its_phase():
    """A generation stall in 0.1 (no step total: the phases' sum), a reward service stalling in 0.5;
    the validation steps of 0.2 (90 s of testing inside the step) are no stall."""
    f = findings('verl_v0.1_gsm8k.log')['slow_steps']
    assert f['steps'] == [12] and 'the time went to generation (136 s vs 18 s' in f['evidence']
    f = findings('verl_v0.5_gsm8k.log')['slow_steps']
    assert f['steps'] == [7] and 'the time went to reward (80 s' in f['evidence']
    assert 'slow_steps' not in findings('verl_v0.2_gsm8k.log')


def test_a_reward_that_fell_is_told_apart_by_validation():
    """0.2: the reward falls while validation holds (the batch or the reward changed); 0.5: both
    fall (the policy got worse); ours_lr_high logs no validation and says so."""
    got = findings('verl_v0.2_gsm8k.log')
    assert 'reward_fell' not in got
    f = got['reward_fell_validation_held']
    assert f['steps'] == list(range(13, 21)) and 'it held, so the policy did not get worse' in f['evidence']
    assert f['causes'][0].startswith('the training prompts got harder')
    f = findings('verl_v0.5_gsm8k.log')['reward_fell']
    assert 'validation 0.704 at step 10, 0.387 at step 20: it fell too' in f['evidence']
    assert f['causes'][0].startswith('the learning rate is too high')
    assert 'no validation score' in findings('ours_lr_high')['reward_fell']['evidence']


def test_trl_0x_names_and_evaluation_rows():
    """TRL 0.16: completion_length, rewards/<fn>, clip_ratio; eval_reward (evaluation rows) is the
    held-out score, so reward hacking is seen on TRL as on ours."""
    run = run_of('trl_0.16_eval')
    assert not run['unknown'] and not run['problems'] and run['rows'] == 24
    assert {k for k, v in run['series'].items() if v} == {'reward', 'reward_std', 'loss', 'grad_norm',
                                                          'kl', 'resp_len', 'clip_frac', 'heldout'}
    assert run['series']['heldout'] == pytest.approx({5: 0.42, 10: 0.22, 15: 0.12, 20: 0.02})
    f = findings('trl_0.16_eval')['reward_hacking']
    assert f['steps'] == list(range(6, 21))


def test_wandb_run_history_saved_by_pandas():
    """run.history().to_csv(): the unnamed index column is skipped; the same run's console log
    (verl 0.5) gives the same series."""
    a, b = run_of('wandb_history_verl.csv'), run_of('verl_v0.5_gsm8k.log')
    assert not a['unknown'] and not a['problems'] and a['series'].keys() == b['series'].keys()
    for name, pts in b['series'].items():
        assert a['series'][name] == pytest.approx(pts, rel=1e-5), name


def test_wandb_panel_export_of_verl_score_range():
    """A chart of score mean, max and min: max == min is every completion scored alike, so three
    steps suffice (five when no spread is logged)."""
    run = run_of('wandb_panel_verl.csv')
    assert {k for k, v in run['series'].items() if v} == {'reward', 'reward_max', 'reward_min'}
    f = {f['name']: f for f in doctor.diagnose(run)}['reward_collapse']
    assert f['steps'] == list(range(31, 41))
    assert "every completion scored alike (the reward's max and min equal)" in f['evidence']


def test_a_panel_export_of_several_runs_is_refused(tmp_path, capsys):
    lines = open(os.path.join(FIX, 'wandb_panel_verl.csv')).read().splitlines()
    other = [c.replace('qwen2.5-0.5b-grpo-gsm8k', 'run-b') for c in lines[0].split(',')[1:]]
    rows = [lines[0] + ',' + ','.join(other)] + [r + ',' + ','.join(r.split(',')[1:]) for r in lines[1:]]
    path = tmp_path / 'panel.csv'
    path.write_text('\n'.join(rows) + '\n')
    code, out, err = cli(capsys, str(path))
    assert code == 2 and out == ''
    assert err == (f"doctor: {path}: a chart export of 2 runs (qwen2.5-0.5b-grpo-gsm8k, run-b): the "
                   "doctor reads one run; hide the others in the chart and export again\n")


def test_nanochat_console():
    """nanochat's chat_rl.py: a step's loss is the sum of its micro-batches' (each printed on its
    own line, with that micro-batch's reward, which is not the step's); the step's line gives the
    reward and the sequence length; pass@1 of an evaluation is held-out accuracy."""
    run = run_of('nanochat_rl_dies.log')
    assert run['source'] == 'nanochat' and run['rows'] == 82 and not run['unknown'], run['unknown']
    assert run['series']['loss'][0] == pytest.approx(0.032892 + 0.030665 + 0.004764 - 0.019975)
    assert run['series']['reward'][0] == 0.30859375 and run['series']['resp_len'][0] == 268.61
    assert run['series']['heldout'] == {0: 0.08, 60: 0.1}


def test_nanogpt_console():
    run = run_of('nanogpt_zero_loss.log')
    assert run['series']['loss'][0] == 0.6931 and run['series']['loss'][1] == 0.0
    assert run['series']['step_time'][1] == pytest.approx(103.6342)  # ms -> s
    assert run['unknown'] == {'main', 'critic'}


def test_unknown_names_are_one_line_after_the_findings(tmp_path, capsys):
    """Counted, the first few shown, all in --json; not a wall before the findings."""
    code, out, _ = cli(capsys, os.path.join(FIX, 'nanogpt_zero_loss.log'), '--no_plot')
    assert out.splitlines()[-1] == ('not mapped: 2 names (critic, main); a table in doctor/read.py '
                                    'can map them')
    lines = open(os.path.join(FIX, 'verl_v0.5_gsm8k.log')).read().splitlines()
    lines[3] += ''.join(f" - my/metric_{i}:1.0" for i in range(7))
    path = tmp_path / 'verl.log'
    path.write_text('\n'.join(lines) + '\n')
    code, out, _ = cli(capsys, str(path), '--no_plot')
    out = out.splitlines()
    assert [n for n, line in enumerate(out) if 'my/metric' in line] == [len(out) - 1]
    assert out[-1] == ('not mapped: 7 names (first my/metric_0, my/metric_1, my/metric_2, my/metric_3, '
                       'my/metric_4; --json lists all); a table in doctor/read.py can map them')
    code, out, _ = cli(capsys, str(path), '--no_plot', '--json')
    assert json.loads(out)['unknown'] == [f"my/metric_{i}" for i in range(7)]


def test_a_table_entry_reads_another_trainers_names(tmp_path, monkeypatch):
    path = tmp_path / 'mine.jsonl'
    path.write_text(''.join(json.dumps({'global_step': s, 'my/score': 0.0 if s > 3 else 0.6})
                            + '\n' for s in range(1, 10)))
    monkeypatch.setitem(doctor.TABLES, 'mine', {'my/score': 'reward'})
    run = doctor.load(str(path))
    assert run['series']['reward'][9] == 0.0 and not run['unknown']
    assert 'reward_collapse' in {f['name'] for f in doctor.diagnose(run)}


# ------------------------------------------------------------------------------------ bad input
def test_malformed_jsonl_rows_are_one_line_each_and_the_rest_is_diagnosed(tmp_path, capsys):
    lines = open(os.path.join(FIX, 'ours_reward_dies', 'metrics.jsonl')).read().splitlines()
    lines.insert(3, 'this is not json')
    lines.insert(5, '{"loss": 0.5}')  # no step
    lines[7] = lines[7].replace('"loss": ', '"loss": "n/a", "x": ', 1)
    lines[-1] = lines[-1][:40]  # a crash mid-write
    path = tmp_path / 'metrics.jsonl'
    path.write_text('\n'.join(lines))
    code, out, err = cli(capsys, str(path), '--no_plot')
    err = err.splitlines()
    assert [e.split(': ', 2)[1] for e in err] == [f"{path}:{n}" for n in (4, 6, 8, 15)], err
    assert "not a number: loss='n/a'" in err[2] and 'cut short' in err[3]
    assert code == 1 and f"unreadable rows: 4 (first: {path}:4: unreadable row" in out
    f = {f['name']: f for f in doctor.diagnose(doctor.load(str(path)))}['reward_collapse']
    assert f['steps'] == list(range(6, 12))  # step 12's row was the one cut short


def test_a_truncated_trainer_state_is_read_up_to_its_last_whole_entry(tmp_path):
    text = open(os.path.join(FIX, 'trl_reward_dies', 'checkpoint-12', 'trainer_state.json')).read()
    cut = text.find('"step": 10')
    path = tmp_path / 'trainer_state.json'
    path.write_text(text[:cut])
    run = doctor.load(str(path))
    assert len(run['problems']) == 1
    assert 'cut short or malformed after log_history entry 9' in run['problems'][0]
    assert sorted(run['series']['reward']) == list(range(1, 10))
    assert {f['name']: f for f in doctor.diagnose(run)}['reward_collapse']['steps'] == [6, 7, 8, 9]


def test_bad_csv_rows(tmp_path):
    lines = open(os.path.join(FIX, 'wandb_reward_dies.csv')).read().splitlines()
    lines[10] = lines[10] + ',extra'
    lines[20] = lines[20].replace(lines[20].split(',')[2], 'abc', 1)
    path = tmp_path / 'h.csv'
    path.write_text('\n'.join(lines[:400]))
    run = doctor.load(str(path))
    assert run['problems'] == [f"{path}:11: 12 cells for 11 columns; skipped",
                               f"{path}:21: not a number: train/reward='abc'; the row's other "
                               "values kept"]
    assert {f['name'] for f in doctor.diagnose(run)} >= {'reward_collapse', 'memory_near_limit'}


def test_a_mixed_console_log(tmp_path):
    """nanoGPT lines among prints and a traceback, one line cut before its value, and verl lines:
    each kind read by its own table; each bad line is one problem."""
    lines = open(os.path.join(FIX, 'nanogpt_zero_loss.log')).read().splitlines()
    lines[5:5] = ['Traceback (most recent call last):', 'iter 9: loss', 'step:12 - bad']
    path = tmp_path / 'train.log'
    path.write_text('\n'.join(lines) + '\nstep:13 - actor/kl_loss:0.001 - cut\n')
    run = doctor.load(str(path))
    assert run['problems'] == [f"{path}:7: a step line with no readable value: 'iter 9: loss'",
                               f"{path}:8: a step line with no readable value: 'step:12 - bad'",
                               f"{path}:14: not key:value: 'cut'; the line's other values kept"]
    assert run['source'] == 'console + verl' and run['series']['kl'] == {13: 0.001}
    assert 'zero_loss' in {f['name'] for f in doctor.diagnose(run)}


def test_many_bad_rows_print_a_bounded_number_of_lines(tmp_path, capsys):
    path = tmp_path / 'metrics.jsonl'
    path.write_text('garbage\n' * 50 + '{"step": 1, "reward/mean": 0.5}\n')
    code, out, err = cli(capsys, str(path), '--no_plot')
    assert len(err.splitlines()) == MAX_PROBLEM_LINES + 1
    assert err.splitlines()[-1] == 'doctor: ... 30 more unreadable rows'
    assert code == 0 and 'unreadable rows: 50' in out


def test_a_file_of_nothing_but_bad_rows_is_one_line(tmp_path, capsys):
    path = tmp_path / 'metrics.jsonl'
    path.write_text('garbage\n' * 50)
    code, out, err = cli(capsys, str(path))
    assert code == 2 and out == ''
    assert err == f"doctor: {path}: no metric rows could be read (50 unreadable)\n"


@pytest.mark.parametrize('name', ['ours_reward_dies/metrics.jsonl', 'ours_nan/metrics.jsonl',
                                  'trl_reward_dies/checkpoint-12/trainer_state.json',
                                  'wandb_reward_dies.csv', 'verl_chess_kl.log',
                                  'nanogpt_zero_loss.log', 'ours_healthy/train.log'])
def test_nothing_raises_on_a_log_cut_anywhere(name, tmp_path):
    data = open(os.path.join(FIX, name), 'rb').read()
    rng = random.Random(0)
    for i, cut in enumerate([1, 7] + [rng.randrange(len(data)) for _ in range(8)]):
        path = tmp_path / f"{i}_{os.path.basename(name)}"
        path.write_bytes(data[:cut] + bytes([rng.randrange(256) for _ in range(5)]))
        run = doctor.load(str(path))
        if isinstance(run, dict):
            report(run, doctor.diagnose(run))
        else:
            assert run.startswith(str(path))


# ------------------------------------------------------------------------------------ the command
def test_exit_codes(tmp_path, capsys):
    assert cli(capsys, os.path.join(FIX, 'ours_healthy'), '--no_plot')[0] == 0
    assert cli(capsys, os.path.join(FIX, 'ours_compile_decode'), '--no_plot')[0] == 0  # info only
    assert cli(capsys, os.path.join(FIX, 'ours_reward_dies'), '--no_plot')[0] == 1
    code, out, err = cli(capsys, str(tmp_path / 'nope'))
    assert code == 2 and out == ''
    assert err == f"doctor: {tmp_path / 'nope'}: no such file or directory\n"
    code, _, err = cli(capsys, str(tmp_path))
    assert code == 2 and len(err.splitlines()) == 1 and 'no metrics.jsonl' in err
    (tmp_path / 'x.bin').write_bytes(bytes(range(256)) * 4)
    code, _, err = cli(capsys, str(tmp_path / 'x.bin'))
    assert code == 2 and err.endswith('no metric rows could be read (0 unreadable)\n')


def test_warnings_alone_exit_0_unless_fail_on_warning(capsys):
    """A CI step fails on errors; warnings (a vLLM run's memory at 90%, a slow step) are printed,
    and fail it only with --fail_on=warning. An error fails it either way; info never does."""
    warned = os.path.join(FIX, 'verl_v0.2_gsm8k.log')
    code, out, _ = cli(capsys, warned, '--no_plot')
    assert code == 0 and 'warnings only: exit code 0 (--fail_on=warning makes it 1).' in out
    assert cli(capsys, warned, '--no_plot', '--fail_on=warning')[0] == 1
    assert cli(capsys, os.path.join(FIX, 'ours_reward_dies'), '--no_plot', '--fail_on=warning')[0] == 1
    assert cli(capsys, os.path.join(FIX, 'ours_compile_decode'), '--no_plot', '--fail_on=warning')[0] == 0


def test_report_most_severe_first(capsys):
    code, out, _ = cli(capsys, os.path.join(FIX, 'wandb_reward_dies.csv'), '--no_plot')
    paragraphs = [p for p in out.split('\n\n') if p.startswith(('ERROR', 'WARNING', 'INFO'))]
    assert [p.split()[1] for p in paragraphs] == ['reward_collapse', 'memory_near_limit']
    assert 'Likely causes: (1) the reward or rollout service died' in paragraphs[0]
    assert 'Fix: check the reward/rollout server' in paragraphs[0]


def test_json_output(capsys):
    code, out, _ = cli(capsys, os.path.join(FIX, 'ours_nan'), '--json', '--no_plot')
    d = json.loads(out)
    assert code == 1 and d['source'] == 'ours' and d['problems'] == []
    f = d['findings'][0]
    assert (f['name'], f['severity'], f['steps']) == ('nonfinite', 'error', [4, 5, 6])
    assert f['series'] == ['loss', 'grad_norm'] and f['causes'] and f['fix']


def test_the_plot_is_written_beside_the_input_or_to_out(tmp_path, capsys):
    shutil.copytree(os.path.join(FIX, 'ours_reward_dies'), tmp_path / 'run')
    code, out, _ = cli(capsys, str(tmp_path / 'run'))
    png = tmp_path / 'run' / 'doctor.png'
    assert code == 1 and png.stat().st_size > 10_000 and f"plot: {png}" in out
    code, out, _ = cli(capsys, os.path.join(FIX, 'ours_healthy'), '--out', str(tmp_path / 'h.png'))
    assert code == 0 and (tmp_path / 'h.png').stat().st_size > 10_000


# ------------------------------------------------------------------------------------ TensorBoard
def openrlhf_tensorboard(folder, steps=60, dies_at=40):
    """A run as OpenRLHF's TensorboardLogger writes it (tensorboardX's SummaryWriter: the event
    format of torch's): its status as train/<name> scalars each step, a text sample, the
    evaluation as eval/eval_<data source>_pass1 every 10 steps; the reward exactly 0 from dies_at
    on (a dead reward service)."""
    from tensorboardX import SummaryWriter
    w = SummaryWriter(str(folder))
    for step in range(1, steps + 1):
        alive = step < dies_at
        for name, value in (('policy_loss', 0.01 * alive), ('reward', 0.5 + 0.004 * step * alive),
                            ('rollout/reward_std', 0.3 * alive), ('actor_grad_norm', 0.2),
                            ('kl', 0.001), ('response_length', 200.0), ('actor_lr', 1e-6),
                            ('timing/generation', 30.0), ('timing/step_total', 40.0)):
            w.add_scalar(f'train/{name}', value if name != 'reward' or alive else 0.0, step)
        w.add_text('train/generated_samples', 'Sample: 2 + 2 = 4', step)
        if step % 10 == 0:
            w.add_scalar('eval/eval_gsm8k_pass1', 0.4, step)
    w.close()


def test_tensorboard_event_files_of_openrlhf_are_read_as_its_trainer(tmp_path):
    """A folder of TensorBoard event files (OpenRLHF's <use_tensorboard>/<run name>/): the dead
    reward is found at its steps; OpenRLHF's policy_loss is its loss (TRL's policy_loss, a part of
    TRL's loss, is not: the table that knows most of the file's names decides); the evaluation is
    the held-out series; the text sample passes by; every name is known."""
    openrlhf_tensorboard(tmp_path / 'tb' / 'grpo_run')
    run = run_of(str(tmp_path / 'tb'))
    assert run['source'] == 'tensorboard' and run['steps'] == list(range(1, 61)), run['source']
    assert run['series']['loss'][40] == 0.0 and run['series']['loss'][1] == pytest.approx(0.01)
    assert run['series']['heldout'] == {s: pytest.approx(0.4) for s in range(10, 61, 10)}
    assert run['series']['step_time'][5] == 40.0 and not run['unknown'], run['unknown']
    found = {f['name']: f for f in doctor.diagnose(run)}
    assert found['reward_collapse']['steps'] == list(range(40, 61)), found.keys()


def test_tensorboard_tensor_scalars_damage_and_cuts(tmp_path, capsys):
    """TF2's scalars (a TensorProto: float_val, tensor_content, int64_val) read as add_scalar's;
    a string tensor passes by. A record whose data fails its checksum is one line and the rest is
    read; a file cut at any byte raises nothing. Two run folders under one path: one line, exit 2."""
    import struct

    from tensorboardX import SummaryWriter
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.proto.summary_pb2 import Summary
    from tensorboardX.proto.tensor_pb2 import TensorProto
    w = SummaryWriter(str(tmp_path / 'tf2'))
    for step in (1, 2, 3):
        for tag, tensor in (('reward', TensorProto(dtype=1, float_val=[0.25 * step])),
                            ('loss', TensorProto(dtype=2, tensor_content=struct.pack('<d', -1.5))),
                            ('num_tokens', TensorProto(dtype=9, int64_val=[-7])),
                            ('prompt', TensorProto(dtype=7, string_val=[b'2 + 2']))):
            value = Summary.Value(tag=tag, tensor=tensor)
            w._get_file_writer().add_event(Event(step=step, summary=Summary(value=[value])))
    w.close()
    (file,) = (tmp_path / 'tf2').iterdir()
    run = run_of(str(file))
    assert run['series']['reward'] == {1: 0.25, 2: 0.5, 3: 0.75} and run['series']['loss'][2] == -1.5
    data = bytearray(file.read_bytes())
    at = data.index(b'reward', data.index(b'reward') + 1)  # step 2's reward record
    data[at] ^= 0xFF
    damaged = tmp_path / 'damaged.tfevents'
    damaged.write_bytes(bytes(data))
    run = run_of(str(damaged))
    assert run['series']['reward'] == {1: 0.25, 3: 0.75} and run['series']['loss'][2] == -1.5
    assert [p.split(': ', 1)[1] for p in run['problems']] == ["record 6's data fails its checksum; skipped"]
    for cut in range(0, len(data), 7):
        (tmp_path / 'cut.tfevents').write_bytes(file.read_bytes()[:cut])
        got = doctor.load(str(tmp_path / 'cut.tfevents'))
        assert isinstance(got, str) or all('cut short' in p for p in got['problems']), got
    openrlhf_tensorboard(tmp_path / 'two' / 'a', steps=3)
    openrlhf_tensorboard(tmp_path / 'two' / 'b', steps=3)
    code, out, err = cli(capsys, str(tmp_path / 'two'), '--no_plot')
    assert code == 2 and err == (f"doctor: {tmp_path / 'two'}: 2 TensorBoard runs under it (a, b, ...): "
                                 "the doctor reads one run; point at its folder\n"), err


def test_a_wandb_csv_of_openrlhf_reads_its_names_as_openrlhf_means_them(tmp_path):
    """OpenRLHF's W&B names ('train/<name>', its global step): policy_loss is the loss, as in its
    TensorBoard files (TRL's table, which lists policy_loss as a part of the loss, comes later)."""
    rows = ['train/global_step,train/policy_loss,train/reward,train/actor_grad_norm,train/actor_lr']
    rows += [f'{s},{0.1 * s},0.5,0.2,1e-6' for s in range(1, 6)]
    (tmp_path / 'openrlhf.csv').write_text('\n'.join(rows) + '\n')
    run = run_of(str(tmp_path / 'openrlhf.csv'))
    assert run['series']['loss'] == {s: pytest.approx(0.1 * s) for s in range(1, 6)}
    assert run['series']['grad_norm'][3] == 0.2 and not run['unknown'], run['unknown']


def test_a_prime_rl_wandb_history_is_read(tmp_path):
    """prime-rl's W&B names (built by hand from orchestrator/metrics.py and trainer/rl/train.py at
    559b447): the orchestrator's train/agg/all/<agent>/... rollout statistics and the trainer's
    loss/mean, entropy/all/mean, optim/grad_norm, perf/peak_memory, on-policy distillation's
    ref_kl/mean; its reward dying at step 6 is found; every name is known."""
    agent = 'train/agg/all/default'
    header = ['_step', f'{agent}/reward/mean', f'{agent}/reward/max', f'{agent}/reward/min',
              f'{agent}/num_output_tokens/mean', f'{agent}/is_truncated/mean', f'{agent}/solved_all',
              'train/gsm8k/all/default/reward/mean', 'progress/total_tokens', 'time/step', 'loss/mean',
              'entropy/all/mean', 'optim/grad_norm', 'optim/lr', 'perf/peak_memory',
              'mismatch_kl/all/mean', 'off_policy/mean', 'ref_kl/mean', 'ref_kl/max']
    rows = [','.join(header)]
    for step in range(1, 13):
        r = 0.4 + 0.02 * step if step < 6 else 0.0
        rows.append(','.join(str(v) for v in (step, r, r and 1.0, 0.0, 300, 0.05, 0.1, r, 1000 * step, 30.0,
                                              0.01, 0.5, 0.2, 1e-6, 40.0, 1e-3, 0.0, -0.01 * step, 0.5)))
    (tmp_path / 'prime.csv').write_text('\n'.join(rows) + '\n')
    run = run_of(str(tmp_path / 'prime.csv'))
    assert not run['unknown'], run['unknown']
    assert run['series']['reward'][3] == pytest.approx(0.46) and run['series']['mem_gb'][2] == 40.0
    # opd's ref_kl (log p_teacher - log p_policy, loss.py's ref_kl_loss_fn) read as our KL to the teacher
    assert run['series']['teacher_kl'][4] == pytest.approx(0.04)
    assert {'loss', 'entropy', 'grad_norm', 'resp_len', 'trunc_frac', 'step_time'} <= set(run['series'])
    assert findings(str(tmp_path / 'prime.csv'))['reward_collapse']['steps'] == list(range(6, 13))


def test_a_damaged_event_record_is_a_value_error_and_nothing_else(tmp_path):
    """Event records (add_scalar's and a TF2 tensor's, written by tensorboardX) changed byte by byte
    20,000 ways (seeded): tfevents.scalars reads them or raises ValueError, which the reader turns
    into one line; never another exception (a fixed-width number of the wrong width once raised
    struct.error, a varint-typed float TypeError)."""
    import random

    from tensorboardX import SummaryWriter
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.proto.summary_pb2 import Summary
    from tensorboardX.proto.tensor_pb2 import TensorProto

    from doctor import tfevents
    w = SummaryWriter(str(tmp_path))
    w.add_scalar('a', 1.5, 3)
    tensor = TensorProto(dtype=2, double_val=[2.5], tensor_shape={'dim': [{'size': 1}]})
    w._get_file_writer().add_event(Event(step=2, summary=Summary(value=[Summary.Value(tag='t', tensor=tensor)])))
    w.close()
    (file,) = tmp_path.iterdir()
    records = [r for r, _ in tfevents.records(file.read_bytes()) if r]
    assert [x for r in records for x in tfevents.scalars(r)] == [(3, 'a', 1.5), (2, 't', 2.5)]
    rng = random.Random(0)
    for _ in range(20000):
        r = bytearray(rng.choice(records))
        for _ in range(rng.randint(1, 4)):
            at, op = rng.randrange(len(r) + 1), rng.random()
            if op < 0.5 and at < len(r):
                r[at] = rng.randrange(256)
            elif op < 0.75 and at < len(r):
                del r[at]
            else:
                r.insert(at, rng.randrange(256))
        try:
            list(tfevents.scalars(bytes(r)))
        except ValueError:
            pass
