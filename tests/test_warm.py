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


def test_a_server_first_needed_under_a_changed_variable_starts_with_the_suites(tmp_path):
    """The first run, inside a test that set an import-time variable for itself, starts the
    server: it starts with the suite's environment, so runs after that test are forked still."""
    script = tmp_path / 'probe.py'
    script.write_text(SCRIPT)
    driver = tmp_path / 'driver.py'
    driver.write_text(f"""import os, sys
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
os.environ['OMP_NUM_THREADS'] = '1'
import warm
if __name__ == '__main__':  # (the forkserver imports the main module again)
    cmd = [sys.executable, {str(script)!r}, '0']
    probe = {{'WARM_PROBE': 'x', 'PYTHONPATH': {str(tmp_path / 'lib')!r}}}
    os.environ['OMP_NUM_THREADS'] = '2'  # a test's own, while the server starts
    inside = warm.run(cmd, env={{**os.environ, **probe}})
    os.environ['OMP_NUM_THREADS'] = '1'  # the test ends
    after = warm.run(cmd, env={{**os.environ, **probe}})
    print(inside.stderr, after.stderr)
""")
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
    p = warm.run([sys.executable, str(driver)], cwd=tmp_path, env=env, timeout=120, fresh=True)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ['preloaded', 'False', 'preloaded', 'True'], p.stdout  # new process; forked
