"""bench/bench_tools.py at toy sizes: ours and re-prefilling each turn produce the very same ids for
every row, and the last line printed is the JSON record with its keys."""
import json
import os
import sys
import warm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = ('bench', 'ours_s', 'reprefill_s', 'speedup', 'prefill_tokens_ours',
        'prefill_tokens_reprefill', 'ids_equal', 'config', 'machine', 'torch')


def test_bench_tools_runs_and_both_sides_write_the_same_ids():
    p = warm.run([sys.executable, 'bench/bench_tools.py', '--n_layer=1', '--n_embd=32',
                        '--prompts=2', '--group_size=2', '--max_new_tokens=150',
                        '--prompt_len=8', '--reps=1', '--threads=1', '--device=cpu'],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rec = json.loads(p.stdout.strip().splitlines()[-1])
    assert all(k in rec for k in KEYS), sorted(set(KEYS) - set(rec))
    assert rec['bench'] == 'tools' and rec['ids_equal'] is True and rec['mismatches'] == 0
    assert rec['rows_on_script'] == 4 and rec['calls_per_completion'] == 3
    assert rec['ours_s'] > 0 and rec['reprefill_s'] > 0 and rec['speedup'] > 0
    # ours prefills each prompt once and each answer once; the reference prefills every row's
    # conversation again at each of its three later turns
    assert rec['turns'] == 4
    assert rec['prefill_tokens_reprefill'] > 2 * rec['prefill_tokens_ours']
    assert rec['config']['group_size'] == 2 and rec['config']['prompts'] == 2
