"""tests/warm.py, which most of the suite's script runs go through, against subprocess: the same
exit codes, output, argv, working directory, environment, __name__ and atexit handlers."""
import os
import signal
import sys

import warm

SCRIPT = '''import atexit, os, sys
atexit.register(lambda: print('atexit ran'))
print('argv', sys.argv[1:], 'name', __name__, 'cwd', os.path.basename(os.getcwd()))
print('env', os.environ.get('WARM_PROBE'), 'path', os.environ['PYTHONPATH'] in sys.path)
print('preloaded', 'torch' in sys.modules, file=sys.stderr)
how = sys.argv[1]
if how == 'raise':
    raise ValueError('boom')
if how == 'kill':
    os.kill(os.getpid(), 9)
sys.exit(int(how))
'''


def test_a_forked_run_is_a_fresh_processs_run(tmp_path):
    script = tmp_path / 'probe.py'
    script.write_text(SCRIPT)
    env = {**os.environ, 'WARM_PROBE': 'here', 'PYTHONPATH': str(tmp_path / 'lib')}
    for how in ('0', '3', 'raise', 'kill'):
        cmd = [sys.executable, str(script), how]
        forked = warm.run(cmd, cwd=tmp_path, env=env, timeout=60)
        fresh = warm.run(cmd, cwd=tmp_path, env=env, timeout=60, fresh=True)
        assert forked.stderr.startswith('preloaded True') and fresh.stderr.startswith('preloaded False')
        assert forked.returncode == fresh.returncode, (how, forked, fresh)
        assert forked.stdout == fresh.stdout, (how, forked.stdout, fresh.stdout)
        if how == 'raise':
            assert forked.returncode == 1 and forked.stderr.rstrip().endswith('ValueError: boom'), forked
    assert forked.returncode == -signal.SIGKILL
    ok = warm.run([sys.executable, str(script), '3'], cwd=tmp_path, env=env, timeout=60)
    assert ok.returncode == 3
    assert ok.stdout == f"argv ['3'] name __main__ cwd {tmp_path.name}\nenv here path True\natexit ran\n", ok.stdout
