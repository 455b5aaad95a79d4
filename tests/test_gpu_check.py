"""bench/gpu_check.py --cpu-smoke: the GPU run's whole pipeline (every part a subprocess, one
JSON per part with a `device` field, a summary) runs end to end on the CPU at toy sizes, so GPU time
goes to measuring, not debugging. Here without its one slow piece (the CPU FlexAttention compile,
--smoke_no_flex; tests/test_flex.py covers that) and without TRL's side (--trl=0; bench_step's TRL
path is what `python bench/bench_step.py` measures)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cpu_smoke_writes_one_json_per_part(tmp_path):
    out = tmp_path / 'results'
    p = subprocess.run([sys.executable, 'bench/gpu_check.py', '--cpu-smoke', '--smoke_no_flex',
                        '--trl=0', f'--out={out}'], cwd=ROOT, capture_output=True, text=True,
                       timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    files = sorted(f for f in os.listdir(out) if f.endswith('.json'))
    assert files == ['kernels.json', 'sample.json', 'step_gsm8k_shape.json', 'step_vs_trl.json',
                     'summary.json', 'tests.json'], files
    for word in ('kernel', 'sample', 'step'):
        assert any(word in f for f in files), f'no result file named with {word!r}'
    summary = json.loads((out / 'summary.json').read_text())
    assert summary['all_ok'], {k: (v['status'], v['file']) for k, v in summary['parts'].items()}
    for name in files:
        rec = json.loads((out / name).read_text())
        assert rec['device'].startswith('cpu-smoke'), f'{name}: device {rec.get("device")!r}'
        if name == 'summary.json':
            continue
        assert rec['status'] == 'ok' and rec['result'], (
            f"{name}: {rec['status']}\n{rec.get('log_tail', '')}")
        assert (out / rec['log']).exists()
    k = json.loads((out / 'kernels.json').read_text())['result']
    assert k['logprob']['ours_fwd']['ms'] > 0 and k['sampler']['speedup_vs_sort'] > 0
    assert k['packed_attention'] is None, '--smoke_no_flex leaves the attention timing out'
    s = json.loads((out / 'sample.json').read_text())['result']
    assert s['group_size'] == 2 and s['ours_tok_s'] > 0 and s['hf_tok_s'] > 0
    step = json.loads((out / 'step_vs_trl.json').read_text())['result']
    assert step['trl'].startswith('skipped') and step['ours_step_s'] > 0
    g = json.loads((out / 'step_gsm8k_shape.json').read_text())['result']
    assert len(g['ours_steps']) == 2 and all(st['peak_mem_gb'] > 0 for st in g['ours_steps'])
    assert any(st['frac_zero_std'] < 1 for st in g['ours_steps']), (
        'no update ran: rewards without a spread')
    t = json.loads((out / 'tests.json').read_text())['result']
    assert t['failed'] == 0 and t['passed'] >= 1
