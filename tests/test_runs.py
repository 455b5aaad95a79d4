"""The everyday tools around a run: evaluating any checkpoint, exports, resume hygiene (knob
changes, samples.jsonl, a reference that was never kept, a second Ctrl-C), loading that runs no
code, wandb, and memory over a long run."""
import concurrent.futures
import glob
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from test_train import ROOT, command, env, metrics, run, run_together
import warm


def sample_py(*args):
    cmd = [sys.executable, str(ROOT / 'sample.py'), '--device=cpu', '--dtype=float32', *args]
    p = warm.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        return p, None
    return p, json.loads(p.stdout.strip().splitlines()[-1])


class Planted:
    """A pickle that runs a command when loaded: what a file planted in a shared out_dir could
    hold."""
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f'touch {self.marker}',))


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp('trained')
    run(out, '--max_steps=2', '--eval_every=2', '--eval_examples=6', '--save_every=1',
        '--keep_last=5', '--export_hf=True', '--export_every=1', '--export_dtype=bfloat16',
        '--arith_n_test=6', '--eval_max_new_tokens=10')
    return out


def test_sample_py_evaluates_a_checkpoint_as_it_evaluates_the_hf_export(trained, tmp_path):
    _, s_hf = sample_py(f'--init_from={trained / "hf_0000002"}', f'--out_dir={tmp_path / "hf"}',
                        '--dtype=float32')
    p, s_ck = sample_py(f'--init_from={trained / "ckpt_0000002.pt"}',
                        f'--out_dir={tmp_path / "ck"}')
    assert p.returncode == 0, p.stderr[-2000:]
    assert 'evaluating as the run evaluated at step 2' in p.stdout, \
        "the checkpoint's config sets task and prompts"
    last = metrics(trained)[-1]
    assert s_ck['n'] == 6 and s_ck['pass@1'] == last['eval/pass@1'], (s_ck, last)
    assert s_hf['n'] == 6, s_hf


def test_exports_have_a_generation_config_and_the_chosen_dtype(trained):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, GenerationConfig
    exports = sorted(os.path.basename(p) for p in glob.glob(str(trained / 'hf_*')))
    assert exports == ['hf_0000000', 'hf_0000001', 'hf_0000002']  # 0: the start
    with safe_open(str(trained / 'hf' / 'model.safetensors'), 'pt') as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    gen = GenerationConfig.from_pretrained(trained / 'hf')
    from tokenizer import byte_tokenizer
    stop_ids = byte_tokenizer().stop_ids
    assert gen.eos_token_id in (stop_ids, *stop_ids), gen.eos_token_id
    assert AutoModelForCausalLM.from_pretrained(trained / 'hf').dtype == torch.bfloat16


def test_a_checkpoint_that_would_run_code_is_refused(trained, tmp_path):
    marker = tmp_path / 'pwned'
    evil = tmp_path / 'ckpt_0000009.pt'
    torch.save({'model': Planted(marker), 'step': 9}, evil)
    p, _ = sample_py(f'--init_from={evil}', f'--out_dir={tmp_path / "e"}')
    assert p.returncode != 0 and not marker.exists(), p.stdout + p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert 'refused to load' in p.stderr and 'GLOBAL posix.system' in p.stderr, p.stderr
    # planted as the newest checkpoint of a run: resume skips it (saying why) and takes the newest
    # good one
    import shutil
    out = tmp_path / 'run'
    shutil.copytree(trained, out)
    shutil.copy(evil, out / 'ckpt_0000009.pt')
    p = run(out, '--max_steps=3', '--eval_every=2', '--eval_examples=6', '--save_every=1',
            '--keep_last=5', '--export_hf=True', '--export_every=1', '--export_dtype=bfloat16',
            '--arith_n_test=6', '--eval_max_new_tokens=10', '--resume_changed=True')
    assert not marker.exists(), p.stdout[-3000:]
    assert 'ckpt_0000009.pt does not load (ValueError' in p.stdout, p.stdout[-3000:]
    assert 'resume: ' + str(out / 'ckpt_0000002.pt') in p.stdout


def test_sample_py_names_a_bad_knob_value_in_one_line():
    """One value per check sample.py makes: dtype, device, a range it shares with train_grpo.py
    (safety.RANGES) and one of its own (the rest of both tables: the same bad_range call)."""
    bad = ['--dtype=fp8', '--device=gpu', '--top_p=2.0', '--n_samples=0']
    bad += [] if torch.cuda.is_available() else ['--device=cuda']
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two at a time, as test_train's
        done = list(pool.map(lambda arg: sample_py('--init_from=scratch', arg)[0], bad))
    for arg, p in zip(bad, done):
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, (arg, p.stderr)
        assert p.stderr.startswith(f"error: {arg.split('=')[0]}="), (arg, p.stderr)


def test_sample_py_leaves_out_prompts_that_do_not_fit_and_says_so(trained, tmp_path):
    """A problem whose prompt leaves less than max_new_tokens of the model's positions is left out
    and counted (it was a traceback from the prefill); none fitting, or a --prompt too long, is one
    line and exit 2."""
    from test_train import tiny_prompt_lengths
    test = tiny_prompt_lengths()[1][:6]
    limit = sorted(test)[2]
    p, s = sample_py(f'--init_from={trained / "hf"}', f'--out_dir={tmp_path}',
                     f'--max_new_tokens={160 - limit}')
    assert p.returncode == 0, p.stderr[-2000:]
    long = sum(n > limit for n in test)
    assert f"left out {long} problems whose prompt is longer than {limit} tokens" in p.stdout
    assert s['n'] == 6 - long, s
    bad = [f'--max_prompt_len={min(test) - 1}', f'--max_new_tokens={161 - min(test)}',
           '--max_prompt_len=155', '--prompt=hello --max_new_tokens=150']
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = pool.map(lambda arg: sample_py(f'--init_from={trained / "hf"}',
                                              f'--out_dir={tmp_path}', *arg.split())[0], bad)
        for arg, p in zip(bad, done):
            assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, (arg, p.stderr)
            assert 'Traceback' not in p.stderr


def test_resume_names_changed_knobs_and_refuses_those_that_change_the_run(tmp_path):
    run(tmp_path, '--max_steps=1')
    p = run(tmp_path, '--max_steps=1', '--group_size=8', '--eval_every=5', check=False)
    assert p.returncode == 2, p.stdout[-2000:]
    assert "group_size: 4 -> 8   (changes the run)" in p.stdout, p.stdout
    assert 'eval_every: 0 -> 5\n' in p.stdout, p.stdout
    assert '--resume_changed=True' in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    p = run(tmp_path, '--max_steps=2', '--eval_every=5', '--resume_changed=True')
    assert 'max_steps: 1 -> 2   (changes the run)' in p.stdout
    assert [r['step'] for r in metrics(tmp_path)] == [0, 1, 2]
    # only knobs that change nothing
    p = run(tmp_path, '--max_steps=2', '--eval_every=5', '--verbose=True')
    assert 'verbose: False -> True\n' in p.stdout and p.returncode == 0


def test_knobs_new_or_gone_since_the_checkpoint_are_named_but_do_not_block_resume():
    from checkpoint import config_changes
    lines, changes_run = config_changes({'group_size': 4, 'logprob_chunk': 0},
                                        {'group_size': 4, 'dynamic_sampling': 0})
    assert not changes_run and len(lines) == 2, lines
    assert 'new since that checkpoint' in lines[0] and 'no longer has' in lines[1], lines


def test_a_refused_rerun_writes_nothing_and_a_fresh_start_sets_the_old_run_aside(tmp_path):
    """A rerun that resume refuses (a knob that changes the run) writes nothing: config.json stays the
    run's. A fresh start in a used out_dir sets the earlier samples.jsonl aside and drops its
    ref.pt (a later resume with beta > 0 must not take another run's reference)."""
    run(tmp_path, '--max_steps=1', '--beta=0.1', '--log_samples_every=1')
    assert (tmp_path / 'ref.pt').exists()
    p = run(tmp_path, '--max_steps=1', '--beta=0.1', '--group_size=2', check=False)
    assert p.returncode == 2 and 'resume_changed' in p.stderr, p.stderr[-2000:]
    assert json.loads((tmp_path / 'config.json').read_text())['group_size'] == 4
    for c in tmp_path.glob('ckpt_*.pt'):
        c.unlink()
    run(tmp_path, '--max_steps=1', '--log_samples_every=1')
    assert not (tmp_path / 'ref.pt').exists(), "a fresh start kept an earlier run's KL reference"
    old, = tmp_path.glob('samples.jsonl.old.*')
    assert len(open(tmp_path / 'samples.jsonl').readlines()) == len(open(old).readlines()) > 0


def test_an_export_that_fails_leaves_no_checkpoint_of_its_step(tmp_path, monkeypatch):
    """save_run exports first: a checkpoint of a step whose export failed would make the rerun
    resume past it and never export that step."""
    import checkpoint
    from model import ModelConfig, from_scratch
    from tokenizer import byte_tokenizer
    tok = byte_tokenizer()
    model = from_scratch(ModelConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1,
                                     n_embd=16, max_seq_len=32), dtype=torch.float32, device='cpu')
    optimizer = torch.optim.AdamW(model.parameters())

    def disk_full(*args, **kw):
        raise OSError(28, 'No space left on device')

    monkeypatch.setattr(checkpoint, 'write_exports', disk_full)
    with pytest.raises(OSError):
        checkpoint.save_run(str(tmp_path), 2, model, optimizer, False, True, keep_last=2,
                            run_state={}, tok=tok, config={})
    assert not list(tmp_path.glob('ckpt_*.pt'))


def test_samples_jsonl_is_trimmed_to_the_resumed_step(tmp_path):
    run(tmp_path, '--max_steps=3', '--save_every=2', '--keep_last=5', '--log_samples_every=1')
    # as if killed after step 3 was logged but before it was saved
    os.remove(tmp_path / 'ckpt_0000003.pt')
    run(tmp_path, '--max_steps=3', '--save_every=2', '--keep_last=5', '--log_samples_every=1')
    steps = [json.loads(line)['step'] for line in open(tmp_path / 'samples.jsonl')]
    assert steps == sorted(steps) and sorted(set(steps)) == [1, 2, 3], steps
    assert steps.count(3) == steps.count(1), steps


def test_beta_turned_on_at_resume_gets_a_reference_or_one_clear_line(tmp_path):
    run_together([tmp_path / 'a', '--max_steps=1'],
                 [tmp_path / 'b', '--max_steps=1', '--sft_steps=2'])
    p = run(tmp_path / 'a', '--max_steps=2', '--beta=0.1', '--resume_changed=True')
    assert "no KL reference" in p.stdout and "using init_from's weights" in p.stdout
    assert metrics(tmp_path / 'a')[-1]['kl'] > 0 and (tmp_path / 'a' / 'ref.pt').exists()
    p = run(tmp_path / 'b', '--max_steps=2', '--sft_steps=2', '--beta=0.1', '--resume_changed=True',
            check=False)
    assert p.returncode == 2 and 'kept no KL reference' in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_second_ctrl_c_exits_at_once(tmp_path):
    cmd = command(tmp_path, '--max_steps=5', '--fault_stall_step=2', '--fault_stall_s=120')
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    # until step 1 is done: step 2 stalls
    while not (tmp_path / 'metrics.jsonl').exists() or len(metrics(tmp_path)) < 2:
        assert time.time() < deadline and proc.poll() is None, "the run never reached its stall"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    time.sleep(1.5)
    assert proc.poll() is None, "one Ctrl-C must wait for the end of the step"
    t = time.time()
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGINT and time.time() - t < 10, \
        (proc.returncode, out[-2000:])
    assert 'again: exiting now, no checkpoint' in out, out[-2000:]
    assert not (tmp_path / 'ckpt_0000002.pt').exists(), out[-2000:]


def wandb_history(out_dir):
    """History rows of the offline wandb runs under out_dir, read from their .wandb files (a
    leveldb-style log of protobuf records: 7-byte file header, then records of crc(4) length(2,
    little-endian) type(1) in 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2
    rows = []
    for path in sorted(glob.glob(str(out_dir / 'wandb' / 'offline-run-*' / 'run-*.wandb'))):
        data = open(path, 'rb').read()
        pos = 7
        buf = b''
        while pos + 7 <= len(data):
            if pos % 32768 + 7 > 32768 or data[pos + 6] == 0:  # block trailer or padding
                pos = (pos // 32768 + 1) * 32768
                continue
            length = int.from_bytes(data[pos + 4:pos + 6], 'little')
            kind = data[pos + 6]
            buf += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # a whole record, or the last piece of one
                rec = wandb_internal_pb2.Record()
                rec.ParseFromString(buf)
                buf = b''
                if rec.WhichOneof('record_type') != 'history':
                    continue
                row = {}
                for item in rec.history.item:
                    row[item.key or '/'.join(item.nested_key)] = json.loads(item.value_json)
                rows.append(row)
    return rows


def test_wandb_offline_rows_equal_metrics_jsonl(tmp_path, monkeypatch):
    pytest.importorskip('wandb')
    monkeypatch.setenv('WANDB_MODE', 'offline')
    monkeypatch.setenv('WANDB_SILENT', 'true')
    args = ['--wandb_log=True', '--wandb_run_name=t', '--eval_every=2', '--eval_examples=4',
            '--log_samples_every=2']
    run(tmp_path, '--max_steps=2', *args)
    mine = metrics(tmp_path)
    theirs = wandb_history(tmp_path)
    # step 2's four samples.jsonl rows, as a table in its row (step 1 logged none)
    assert 'samples/_type' not in theirs[1] and theirs[2]['samples/_type'] == 'table-file'
    assert theirs[2]['samples/nrows'] == 4 and theirs[2]['samples/ncols'] == 7, theirs[2]
    assert [r['_step'] for r in theirs] == [r['step'] for r in mine], (theirs, mine)
    for a, b in zip(mine, theirs):
        assert set(a) <= set(b), f"keys missing in wandb: {set(a) - set(b)}"
        for k, v in a.items():
            if isinstance(v, float):
                assert math.isclose(v, b[k], rel_tol=1e-12), (k, v, b[k])
            else:
                assert v == b[k], (k, v, b[k])
    run_id = (tmp_path / 'wandb_id').read_text()
    run(tmp_path, '--max_steps=3', *args, '--resume_changed=True')
    assert (tmp_path / 'wandb_id').read_text() == run_id, \
        "a resumed run continues the same wandb run"


def tensorboard_events(path):
    """The Events of a TensorBoard file, framing and checksums checked with tensorboardX's own
    CRC-32C and decoded by its protobuf classes (not the project's reader)."""
    import struct
    from tensorboardX import crc32c
    from tensorboardX.proto import event_pb2

    def masked(data):
        crc = crc32c.crc32c(data)
        return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
    data, i, events = path.read_bytes(), 0, []
    while i < len(data):
        (n,), (length_crc,) = struct.unpack('<Q', data[i:i + 8]), struct.unpack('<I', data[i + 8:i + 12])
        body, (body_crc,) = data[i + 12:i + 12 + n], struct.unpack('<I', data[i + 12 + n:i + 16 + n])
        assert masked(data[i:i + 8]) == length_crc and masked(body) == body_crc, f"a bad checksum at byte {i}"
        events.append(event_pb2.Event.FromString(body))
        i += 16 + n
    return events


def test_tensorboard_events_hold_every_metrics_row(tmp_path):
    """tensorboard_log: each metrics.jsonl row's numbers as float32 scalars at its step, in a file that
    begins as SummaryWriter(purge_step=first step) begins; a resumed run writes a file of its own
    whose SessionLog START is its first step. The run doctor reads out_dir/tb like any TensorBoard
    directory."""
    import struct
    pytest.importorskip('tensorboardX')
    run(tmp_path, '--max_steps=2', '--tensorboard_log=True', '--eval_every=2', '--save_every=1')
    time.sleep(1.1)  # (the next file's name has another second in it)
    run(tmp_path, '--max_steps=3', '--tensorboard_log=True', '--eval_every=2', '--save_every=1',
        '--resume_changed=True')
    files = sorted((tmp_path / 'tb').iterdir())
    assert len(files) == 2, files
    rows, seen = {r['step']: r for r in metrics(tmp_path)}, {}
    for path, first in zip(files, (0, 3)):
        events = tensorboard_events(path)
        assert events[0].file_version == 'brain.Event:2' and events[0].step == first
        assert events[1].session_log.status == events[1].session_log.START and events[1].step == first
        for e in events[2:]:
            seen[e.step] = {v.tag: v.simple_value for v in e.summary.value}
    assert sorted(seen) == sorted(rows) == [0, 1, 2, 3]
    for step, row in rows.items():
        numbers = {k: v for k, v in row.items() if k != 'step' and type(v) in (int, float)}
        assert set(seen[step]) == set(numbers), set(seen[step]) ^ set(numbers)
        for k, v in numbers.items():
            want = struct.unpack('<f', struct.pack('<f', v))[0]
            assert seen[step][k] == want or (math.isnan(want) and math.isnan(seen[step][k])), (step, k)
    import doctor
    tb = doctor.load(str(tmp_path / 'tb'))
    assert tb['series']['reward'] == {s: pytest.approx(r['reward/mean'], rel=1e-6) for s, r in rows.items()
                                      if 'reward/mean' in r}


def test_memory_does_not_grow_over_a_long_run(tmp_path):
    run(tmp_path, '--max_steps=60', '--save_every=20', '--log_samples_every=5', timeout=300)
    rows = {r['step']: r for r in metrics(tmp_path)}
    at20 = rows[20]['mem/allocated_gb']
    at60 = rows[60]['mem/allocated_gb']
    assert at60 <= 1.15 * at20, \
        f"RSS grew from {at20:.3f} GB at step 20 to {at60:.3f} GB at step 60"


def test_cpu_contention_is_named_only_when_other_jobs_hold_the_cores(monkeypatch, capsys):
    """Several torch threads on cores other jobs already keep busy wait on each other at every op
    (a demo step 3x slower with 2 threads than with 1 at load 4-8 on 2 cores): said once at start,
    with the fix."""
    from safety import cpu_contention, startup_warnings
    assert cpu_contention(load=0.3, cores=2, threads=2) is None  # idle machine: use every core
    assert cpu_contention(load=3.9, cores=2, threads=1) is None  # already one thread
    msg = cpu_contention(load=3.9, cores=2, threads=2)
    assert '3.9' in msg and 'OMP_NUM_THREADS=1' in msg
    knobs = dict(top_k=0, top_p=1.0, min_p=0.0, filter_zero_std=True, beta=0.0, entropy_coef=0.0)
    monkeypatch.setattr('os.getloadavg', lambda: (7.5, 7.0, 6.0))
    monkeypatch.setattr('os.cpu_count', lambda: 2)
    monkeypatch.setattr('torch.get_num_threads', lambda: 2)
    startup_warnings({**knobs, 'device': 'cpu'})
    startup_warnings({**knobs, 'device': 'cuda'})  # a GPU run's CPU threads do not carry the work
    said = 'WARNING [cpu_contention]: the load average is 7.5 on 2 CPU cores'
    assert capsys.readouterr().out.count(said) == 1


SCRIPT = """
import torch

def oom():
    raise torch.OutOfMemoryError('CUDA out of memory')

def rollout():
    oom()

def sample_step():
    rollout()

def run_eval():
    other['update']()  # a function of another file named like a stage does not count

def micro_loss():
    oom()

def update():
    micro_loss()
"""
OTHER = "def update():\n    oom()\n"


def phase_of(call, script='/x/train_grpo.py'):
    import safety
    scope = {}
    exec(compile(SCRIPT, script, 'exec'), scope)
    other = {'oom': scope['oom']}
    exec(compile(OTHER, '/x/my_reward.py', 'exec'), other)
    scope['other'] = other
    try:
        exec(compile(call, script, 'exec'), scope)  # the module level of the script
    except torch.OutOfMemoryError as e:
        return safety.oom_phase(e.__traceback__, script)


def test_the_out_of_memory_phase_is_the_innermost_stage_of_train_grpo_on_the_traceback():
    assert phase_of('sample_step()') == 'generation'
    assert phase_of('update()') == 'update'
    assert phase_of('run_eval()') == 'evaluation', "a stage's name in another file was taken"
    assert phase_of('oom()') == 'start-up'


def test_the_out_of_memory_report_says_what_to_change():
    import safety
    c = {'batch_prompts': 32, 'group_size': 8, 'max_new_tokens': 512, 'micro_batch_size': 32,
         'micro_batch_tokens': 0, 'grad_checkpoint': False, 'eval_batch_size': 64, 'eval_samples': 0,
         'sft_batch_size': 32, 'lora_rank': 0}
    sizes = {'weights': 1.84, 'train_state': 5.52, 'sampler': 0.92, 'kv_cache': 2.73, 'kv_rows': 256,
             'kv_positions': 912}
    mem = {'allocated': 70.0, 'reserved': 79.0, 'total': 79.6}
    gen = safety.oom_report('generation', c, sizes, mem)
    assert 'during generation: 70 GiB allocated, 79 GiB reserved, of 79.6 GiB' in gen, gen
    assert '256 rows' in gen and '912 positions: 2.73 GiB' in gen and 'batch_prompts=32' in gen, gen
    assert 'expandable_segments' in gen and '9 GiB is reserved' in gen, gen
    assert '--lora_rank' not in gen, "LoRA named where the training state is a small share"
    upd = safety.oom_report('update', c, {**sizes, 'train_state': 28.0}, {**mem, 'reserved': 71.0})
    assert 'micro_batch_size=32' in upd and 'grad_checkpoint=True' in upd and '--lora_rank=32' in upd, upd
    assert 'expandable_segments' not in upd and '--resume_changed=True' in upd, upd
    ev = safety.oom_report('evaluation', c, sizes, mem)
    assert 'eval_batch_size=64' in ev and '--resume_changed' not in ev, ev
    old = safety.oom_report('old/reference log-probs', {**c, 'micro_batch_tokens': 8192}, sizes, mem)
    assert 'micro_batch_tokens=8192' in old and 'grad_checkpoint' not in old, old


def test_a_completion_budget_below_one_token_is_a_knob_error(tmp_path):
    """--max_new_tokens=0 would warm up, then train on empty completions with every warning firing:
    one line and exit 2 before anything is spent, like --group_size=1; so for the other counts that
    must be positive, and a negative --eval_max_new_tokens (0 means max_new_tokens): the same check
    (safety.bad_knob) in-process for those."""
    import safety
    from configurator import configure
    from test_gsm8k_tools import train_grpo_globals
    p = run(tmp_path, '--max_new_tokens=0', check=False)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1 and err[0].startswith('error: --max_new_tokens=0'), p.stderr
    assert not (tmp_path / 'metrics.jsonl').exists()
    base = configure(train_grpo_globals(), [])
    for key, value in (('max_new_tokens', -3), ('eval_max_new_tokens', -1), ('batch_prompts', 0),
                       ('micro_batch_size', 0), ('num_iterations', 0)):
        error = safety.bad_knob({**base, key: value})
        assert error is not None and error.startswith(f'--{key}={value}:'), (key, error)


def test_a_steps_compile_time_is_counted_and_shown():
    """metrics.compile_totals counts the graphs torch.compile builds and the seconds it spends: a
    first call adds one graph and some seconds, a cached call nothing; the step line names them
    only when the step built a graph. (Dynamo's tracing alone here: a first Inductor compile in a
    process costs some 20 s of CPU; test_train's compiled run checks that Inductor's is counted.)"""
    import metrics
    g0, s0 = metrics.compile_totals()
    f = torch.compile(lambda x: x.sin() + 1, backend='eager', dynamic=False)
    f(torch.randn(3))
    g1, s1 = metrics.compile_totals()
    assert g1 == g0 + 1 and s1 > s0
    f(torch.randn(3))
    assert metrics.compile_totals() == (g1, s1), "a cached call compiled again"
    m = {'step': 1, 'reward/mean': 0.5, 'reward/std': 0.1, 'frac_zero_std': 0.0, 'loss': 0.0,
         'kl': 0.0, 'entropy': 1.0, 'grad_norm': 1.0, 'response_len/mean': 10, 'mem/peak_gb': 1.0,
         **{f'timing_s/{k}': 1.0 for k in ('step', 'gen', 'reward', 'ref', 'old_logprob',
                                            'update')},
         'timing_s/compile': s1 - s0, 'compile/graphs': g1 - g0}
    assert f"; compile {s1 - s0:.1f} for 1 graph)" in metrics.step_line(m)
    assert 'compile' not in metrics.step_line({**m, 'timing_s/compile': 0.0, 'compile/graphs': 0})


def test_an_openrlhf_reward_server_scores_the_run_and_its_death_stops_it(tmp_path):
    """openrlhf_reward against a reward server on localhost: it gets each completion with its
    prompt as the model saw it (special tokens as text) and the example's answer as label, and its
    rewards are the run's. A server that is not there fails every sample; after
    zero_reward_patience steps the run stops, saying why."""
    from test_reward import reward_server

    def digits(query, prompt, label):
        return sum(ch.isdigit() for ch in query[len(prompt):]) / 8
    with reward_server(digits) as (url, got):
        rewards = f"--rewards=[{{'name': 'openrlhf_reward', 'kwargs': {{'url': '{url}'}}}}]"
        run(tmp_path / 'up', '--max_steps=1', rewards)
    row = metrics(tmp_path / 'up')[1]
    sent = [(q, p) for body in got for q, p in zip(body['query'], body['prompts'])]
    assert len(sent) == 16 and all(q.startswith(p) and p.startswith('<|im_start|>user\n') for q, p in sent)
    assert all(body['labels'][0].isdigit() for body in got), got[0]['labels']
    want = sum(digits(q, p, None) for q, p in sent) / 16
    assert math.isclose(row['reward/openrlhf_reward/mean'], want, rel_tol=1e-6), (row, want)
    p = run(tmp_path / 'down', '--max_steps=5', '--zero_reward_patience=2', check=False,
            *[rewards.replace("'}}]", "', 'retries': 1}}]")])
    assert p.returncode == 3 and 'STOPPED' in p.stderr and 'reward server' in p.stderr, p.stderr[-3000:]
    assert [r['step'] for r in metrics(tmp_path / 'down')] == [0, 1, 2]
