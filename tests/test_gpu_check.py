"""bench/gpu_check.py: the GPU run's whole plan (every part a subprocess in priority order, one JSON
per part with a `device` field, a summary rewritten after each part) runs end to end on the CPU at
toy sizes (--cpu-smoke), without the packages the GPU machine lacks, so GPU time goes to measuring,
not debugging; and its deadline holds: a part that outruns its share is killed and recorded, the
parts after it still run and write their JSON, and what no longer fits is skipped with the reason.
The smoke here leaves out its one slow piece (the CPU FlexAttention compile, --smoke_no_flex;
tests/test_flex.py covers that)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'bench'))
import gpu_check  # noqa: E402

# not on the GPU machine: the plan must run without them
ABSENT = 'chess,datasets,trl,peft,wandb'
QUESTION = ("A baker puts {n} trays of rolls in the oven each morning, and every tray holds twelve "
            "rolls. On Saturday she bakes twice as many trays as on a weekday and sells all but "
            "nine of the rolls. How many rolls did she sell on Saturday in all?")


def gsm8k_dir(path):
    """A small GSM8K-format folder: questions of 200-260 characters, as bench_step picks."""
    path.mkdir()
    rows = []
    for n in range(3, 11):
        question = QUESTION.format(n=n)
        assert 200 <= len(question) < 260
        rows.append(json.dumps({'question': question,
                                'answer': f"2 x {n} x 12 - 9 = {24 * n - 9}\n#### {24 * n - 9}"}))
    (path / 'train.jsonl').write_text('\n'.join(rows) + '\n')
    (path / 'test.jsonl').write_text('\n'.join(rows[:2]) + '\n')
    return path


def gpu_check_run(*args, timeout=600):
    # every Python the run starts finds the ABSENT packages missing
    blocker = os.path.join(ROOT, 'tests', 'fixtures', 'absent')
    path = os.pathsep.join(filter(None, [blocker, os.environ.get('PYTHONPATH')]))
    env = {**os.environ, 'GRPO_ABSENT': ABSENT, 'PYTHONPATH': path}
    return subprocess.run([sys.executable, 'bench/gpu_check.py', *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def read(out, name):
    return json.loads((out / name).read_text())


@pytest.mark.slow
def test_cpu_smoke_runs_the_default_plan_without_the_packages_the_gpu_machine_lacks(tmp_path):
    out = tmp_path / 'results'
    p = gpu_check_run('--cpu-smoke', '--smoke_no_flex', f'--out={out}',
                      f"--data_dir={gsm8k_dir(tmp_path / 'gsm8k')}")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sorted(os.listdir(out)) == ['gpu_check.log', 'kernels.json', 'sample.json',
                                       'step_gsm8k_shape.json', 'summary.json', 'tests.json']
    summary = read(out, 'summary.json')
    assert list(summary['parts']) == ['tests', 'kernel', 'step_gsm8k', 'sample'], 'priority order'
    assert summary['all_ok'], {k: (v['status'], v['reason']) for k, v in summary['parts'].items()}
    assert summary['step_prompts_problem'] is None
    for name in ('tests.json', 'kernels.json', 'step_gsm8k_shape.json', 'sample.json'):
        rec = read(out, name)
        assert rec['device'].startswith('cpu-smoke'), f'{name}: device {rec.get("device")!r}'
        assert rec['status'] == 'ok' and rec['result'], (
            f"{name}: {rec['status']}\n{rec.get('log_tail', '')}")
        assert 0 < rec['wall_s'] <= rec['limit_s']
    k = read(out, 'kernels.json')['result']
    assert k['logprob']['ours_fwd']['ms'] > 0 and k['sampler']['speedup_vs_sort'] > 0
    assert k['packed_attention'] is None, '--smoke_no_flex leaves the attention timing out'
    s = read(out, 'sample.json')['result']
    assert s['group_size'] == 2 and s['ours_tok_s'] > 0 and s['hf_tok_s'] > 0
    g = read(out, 'step_gsm8k_shape.json')
    assert g['step_prompts'] == str(tmp_path / 'gsm8k') and 'task gsm8k' in g['result']['setting']
    steps = g['result']['ours_steps']
    assert len(steps) == 2 and all(st['peak_mem_gb'] > 0 for st in steps)
    assert any(st['frac_zero_std'] < 1 for st in steps), (
        'no update ran: rewards without a spread')
    t = read(out, 'tests.json')['result']
    assert t['failed'] == 0 and t['passed'] >= 10, t


def test_a_part_that_outruns_its_share_is_killed_and_the_next_still_runs(tmp_path):
    out = tmp_path / 'results'
    # one second is less than the sampling bench's interpreter start and torch import alone
    p = gpu_check_run('--cpu-smoke', '--smoke_no_flex', '--parts=sample,kernel', '--share=sample=1',
                      f'--out={out}')
    assert p.returncode == 1, 'not every part was ok: the exit status says so'
    sample = read(out, 'sample.json')
    assert sample['status'] == 'timeout' and sample['limit_s'] == 1, sample
    assert 'outran its limit of 1 s' in sample['reason'] and sample['wall_s'] < 10
    kernel = read(out, 'kernels.json')
    assert kernel['status'] == 'ok' and kernel['result']['logprob'], kernel.get('log_tail')
    parts = read(out, 'summary.json')['parts']
    assert {k: v['status'] for k, v in parts.items()} == {'sample': 'timeout', 'kernel': 'ok'}


def test_what_no_longer_fits_the_deadline_is_skipped_with_the_reason(tmp_path):
    out = tmp_path / 'results'
    # less than the reserve kept for the summary: nothing fits
    p = gpu_check_run('--cpu-smoke', '--deadline=2', f'--out={out}')
    assert p.returncode == 1
    parts = read(out, 'summary.json')['parts']
    assert list(parts) == list(gpu_check.PLAN)
    for part, rec in parts.items():
        assert rec['status'] == 'skipped' and 'no longer fits' in rec['reason'], (part, rec)
        assert 'deadline' in read(out, rec['file'])['reason']


def test_the_step_part_without_gsm8k_prompts_is_skipped_saying_so(tmp_path):
    out, empty = tmp_path / 'results', tmp_path / 'empty'
    empty.mkdir()
    p = gpu_check_run('--cpu-smoke', '--parts=step_gsm8k', f'--data_dir={empty}', f'--out={out}')
    assert p.returncode == 1
    assert 'no GSM8K prompts' in p.stdout
    rec = read(out, 'step_gsm8k_shape.json')
    assert rec['status'] == 'skipped' and 'no GSM8K prompts' in rec['reason']
    assert rec['result'] is None
    summary = read(out, 'summary.json')
    assert 'no GSM8K prompts' in summary['parts']['step_gsm8k']['reason']
    assert 'train.jsonl' in summary['step_prompts_problem']


@pytest.mark.parametrize('flag,says', [('--deadline=0', '--deadline=0: must be a number of seconds above 0'),
                                       ('--deadline=-5', '--deadline=-5: must be'),
                                       ('--share=kernel=abc', '--share=kernel=abc: SECONDS must be'),
                                       ('--share=nope=3', '--share=nope=3: expected PART=SECONDS'),
                                       ('--parts=kernel,kernel', '--parts: expected some of')])
def test_a_bad_flag_gets_one_clear_error(flag, says):
    p = subprocess.run([sys.executable, 'bench/gpu_check.py', '--cpu-smoke', flag], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert says in p.stderr and 'Traceback' not in p.stderr, p.stderr


def test_the_default_plan_fits_the_default_deadline_by_its_estimates():
    estimates = sum(gpu_check.GPU_BUDGET[p][0] for p in gpu_check.PLAN)
    shares = sum(gpu_check.GPU_BUDGET[p][1] for p in gpu_check.PLAN)
    for part in gpu_check.PLAN:
        estimate, share = gpu_check.GPU_BUDGET[part]
        assert estimate <= share, f'{part}: its share is below its estimate'
    assert estimates < shares <= gpu_check.DEFAULT_DEADLINE_S - gpu_check.RESERVE_S
    assert gpu_check.DEFAULT_DEADLINE_S <= 480


def test_the_results_name_their_commit(tmp_path, monkeypatch):
    """From git where there is one, else from .gsm8k/COMMIT (a GPU machine receives the files
    without .git; bench/device_prep.sh writes it), else 'unknown'."""
    head = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=gpu_check.ROOT, text=True,
                          capture_output=True).stdout.strip()
    assert gpu_check.versions()['commit'] == head
    monkeypatch.setattr(gpu_check, 'ROOT', str(tmp_path))  # no .git above a pytest tmp dir
    assert gpu_check.commit() == 'unknown'
    (tmp_path / '.gsm8k').mkdir()
    (tmp_path / '.gsm8k' / 'COMMIT').write_text('abc1234 with uncommitted changes\n')
    assert gpu_check.commit() == 'abc1234 with uncommitted changes'
