"""plot.py: curves.png from a metrics.jsonl that looks like a real (and partly broken) run."""
import json
import math
import os
import struct
import subprocess
import sys

import pytest

import plot
import warm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAN_STEP = 17
DUP_STEP = 25


def fake_row(step):
    """Plausible values for one GRPO step: reward climbs, KL grows, the response length settles."""
    r = min(0.9, 0.1 + 0.02 * step)
    row = {'step': step, 'lr': 1e-6 * min(1.0, step / 5), 'reward/mean': r,
           'reward/std': 0.3 - 0.002 * step, 'reward/correct/mean': r * 0.9,
           'reward/format/mean': min(1.0, 0.5 + 0.03 * step), 'frac_zero_std': 0.4 - 0.005 * step,
           'loss': 0.01 * math.sin(step), 'pg_loss': 0.008 * math.sin(step), 'kl': 1e-3 * step,
           'entropy': 1.2 - 0.01 * step, 'clip/high_frac': 0.02 + 0.001 * (step % 7),
           'grad_norm': 0.5 + 0.1 * math.cos(step), 'response_len/mean': 220 - 2 * step,
           'response_len/clip_frac': max(0.0, 0.2 - 0.006 * step),
           'timing_s/gen': 6.0, 'timing_s/reward': 0.2, 'timing_s/ref': 0.8,
           'timing_s/old_logprob': 0.7, 'timing_s/update': 2.5,
           'timing_s/step': 10.4 + 0.1 * (step % 3),
           'mem/allocated_gb': 3.1, 'mem/reserved_gb': 4.0, 'mem/peak_gb': 3.8,
           'warn/all_zero_std': int(step in (3, 4)), 'guard/nonfinite_skips': 0}
    if step == NAN_STEP:
        row['loss'] = float('nan')  # json.dumps writes NaN, json.loads reads it back
        row['guard/nonfinite_skips'] = 1
    if step % 10 == 0:
        row.update({'eval/pass@1': 0.2 + 0.01 * step, 'eval/pass@8': 0.5 + 0.01 * step,
                    'eval/maj@8': 0.3 + 0.01 * step})
    return row


def write_run(run_dir, n_steps=40):
    """40 steps, eval every 10, a NaN loss, step 25 written twice (a resume), a last line cut
    mid-write."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, 'metrics.jsonl')
    with open(path, 'w') as f:
        for step in range(1, n_steps + 1):
            if step == DUP_STEP:  # the row a resume replaced
                f.write(json.dumps({**fake_row(step), 'kl': 99.0}) + '\n')
            f.write(json.dumps(fake_row(step)) + '\n')
        # crash mid-write: no closing brace, no newline
        f.write(json.dumps(fake_row(n_steps + 1))[:37])
    return path


def png_size(path):
    with open(path, 'rb') as f:
        head = f.read(24)
    assert head[:8] == b'\x89PNG\r\n\x1a\n', f'{path} does not start with the PNG signature'
    return struct.unpack('>II', head[16:24])  # IHDR width, height


def test_read_metrics_keeps_last_duplicate_and_skips_truncated_line(tmp_path):
    rows, bad, dup = plot.read_metrics(write_run(str(tmp_path)))
    assert [r['step'] for r in rows] == list(range(1, 41)), \
        'rows should be steps 1..40, each once, in order'
    assert (bad, dup) == (1, 1), f'expected 1 truncated line and 1 duplicate step, got {bad}, {dup}'
    assert rows[DUP_STEP - 1]['kl'] == pytest.approx(1e-3 * DUP_STEP), \
        'a duplicate step must keep its LAST row'


def test_plot_metrics_draws_every_panel_and_marks_nan_loss(tmp_path):
    run_dir = str(tmp_path / 'run_a')
    info = plot.plot_metrics(write_run(run_dir))
    out = os.path.join(run_dir, 'curves.png')
    assert info['out'] == out and os.path.exists(out)
    assert (info['rows'], info['bad_lines'], info['duplicates']) == (40, 1, 1), info
    assert info['empty'] == [], \
        f'every panel has data in this run, but these say "no data": {info["empty"]}'
    assert info['nonfinite'] == {'loss': [NAN_STEP]}, \
        f'only the NaN loss at step {NAN_STEP} should be marked'
    assert png_size(out) == (1800, 1000), 'figure is 18x10 inches at 100 dpi'
    assert os.path.getsize(out) > 50_000, 'a 12-panel PNG this small is probably blank'
    assert sorted(os.listdir(run_dir)) == ['curves.png', 'metrics.jsonl'], \
        f'temp file left: {os.listdir(run_dir)}'


def test_eval_panel_draws_every_held_out_set():
    keys = ['eval/math/maj@8', 'eval/truncated', 'eval/maj@8', 'eval/gsm8k/pass@1', 'eval/pass@16',
            'eval/math/pass@1', 'eval/pass@1', 'eval/pass@8', 'eval/math/boxed', 'loss']
    assert plot.eval_keys(keys) == ['eval/pass@1', 'eval/pass@8', 'eval/pass@16', 'eval/maj@8',
                                    'eval/gsm8k/pass@1', 'eval/math/pass@1', 'eval/math/maj@8']


def test_missing_keys_give_no_data_panels_not_a_crash(tmp_path):
    path = tmp_path / 'metrics.jsonl'
    path.write_text(''.join(json.dumps({'step': s, 'loss': 0.1 * s}) + '\n' for s in range(1, 4)))
    info = plot.plot_metrics(str(path), str(tmp_path / 'c.png'))
    png_size(tmp_path / 'c.png')
    assert 'loss' not in info['empty'] and len(info['empty']) == 11, \
        f'only loss has data: {info["empty"]}'


def test_failed_save_leaves_previous_png_and_no_temp_file(tmp_path, monkeypatch):
    run_dir = str(tmp_path)
    plot.plot_metrics(write_run(run_dir))
    before = open(os.path.join(run_dir, 'curves.png'), 'rb').read()

    def half_write(self, f, **kw):  # a crash partway through writing the image
        f.write(b'\x89PNG half')
        raise RuntimeError('killed mid-save')
    from matplotlib.figure import Figure
    monkeypatch.setattr(Figure, 'savefig', half_write)
    with pytest.raises(RuntimeError):
        plot.plot_metrics(run_dir)
    assert open(os.path.join(run_dir, 'curves.png'), 'rb').read() == before, \
        'old curves.png was overwritten'
    assert sorted(os.listdir(run_dir)) == ['curves.png', 'metrics.jsonl'], \
        'temporary file left behind'


def test_cli_redraws_curves_in_run_dir(tmp_path):
    run_dir = str(tmp_path / 'run_b')
    write_run(run_dir)
    res = warm.run([sys.executable, os.path.join(REPO, 'plot.py'), run_dir],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert '40 rows, 1 bad lines skipped, 1 duplicate steps replaced' in res.stdout, res.stdout
    png_size(os.path.join(run_dir, 'curves.png'))
    for missing in (tmp_path / 'nowhere', tmp_path / 'run_b' / 'metrics.jsonl' / 'x'):
        res = warm.run([sys.executable, os.path.join(REPO, 'plot.py'), str(missing)],
                             capture_output=True, text=True)
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert res.stderr.startswith(f'plot.py: {missing}: '), res.stderr


def test_importing_plot_leaves_matplotlib_unloaded():
    """Every train_grpo.py start imports plot.py; matplotlib (0.5 s) loads only when a curve is
    drawn."""
    code = "import sys, plot; print('matplotlib' in sys.modules)"
    p = subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == 'False', p.stdout + p.stderr
