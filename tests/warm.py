"""Run the project's scripts the way `python script.py ...` does, minus the imports: each run is a
process forked from a server that imported torch and the project once (multiprocessing's
forkserver). A tiny 2-step train_grpo.py run takes 4.4 s as a new process and 0.4 s forked on a
2-core Xeon (the rest is importing torch, Dynamo, Triton, matplotlib), and the suite starts about
190 runs: the suite took 6.4 minutes there, and without this had not finished after 15 (95% done).

What a run sees is what a new process would: its own argv, working directory, environment,
stdout and stderr (files read back at the end), `__name__ == '__main__'`, its exit code (the
script's sys.exit code, 1 for an uncaught exception, -N for signal N) and atexit handlers. What it
does not get anew: environment variables read when the preloaded modules were imported (the
server's, which the suite's worker set: TRITON_INTERPRET, OMP_NUM_THREADS): a run whose environment
differs from the server's in any variable of that kind (IMPORT_TIME) goes through `subprocess`, as
does one asked to (`fresh=True`) and any command that is not `python script.py` or `python -m`.
Forked runs also share the server's string hash seed, where new processes each draw one: the
exact-resume tests whose runs are killed start those runs as new processes (test_train.start), so
a result that hung on the order of a set of strings would still differ there."""
import atexit
import io
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import subprocess
import sys
import tempfile

# what a run imports anyway, imported once by the server
PRELOAD = ['torch', 'torch._dynamo', 'torch.optim', 'numpy', 'matplotlib', 'matplotlib.pyplot', 'jinja2',
           'safetensors.torch', 'tiktoken', 'triton', 'model', 'logprob_kernels', 'sample_kernels', 'hf', 'tokenizer',
           'sample', 'batch', 'loss', 'metrics', 'safety', 'checkpoint', 'reward', 'tasks', 'configurator',
           'plot', 'lora', 'parallel', 'sft', 'tool_calls', 'sandbox', 'data']
# variables that torch, OpenMP, Triton or Python read at start-up or import
IMPORT_TIME = ('OMP_', 'MKL_', 'OPENBLAS_', 'KMP_', 'GOMP_', 'TRITON_', 'TORCH', 'PYTORCH_', 'CUDA_', 'PYTHONHASHSEED',
               'PYTHONWARNINGS', 'PYTHONDONTWRITEBYTECODE', 'LD_')
_context = None


def _import_env(env):
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME)}


# the import-time variables as the suite set them (conftest.py, before any test): the server starts
# with these whichever run first needs it, also one inside a test that changed one for itself
# (monkeypatch.setenv('OMP_NUM_THREADS', '2')), whose server would send every later run to subprocess
_BASE_ENV = _import_env(os.environ)


def _forkserver():
    global _context
    if _context is None:
        _context = multiprocessing.get_context('forkserver')
        _context.set_forkserver_preload(PRELOAD)
        now = dict(os.environ)
        os.environ.clear()
        os.environ.update({k: v for k, v in now.items() if not k.startswith(IMPORT_TIME)}, **_BASE_ENV)
        try:
            multiprocessing.forkserver.ensure_running()  # now, with the suite's environment
        finally:
            os.environ.clear()
            os.environ.update(now)
    return _context


def _child(argv, cwd, env, out_path, err_path):
    """The forked process: become `python argv...` and run it."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, 'w', closefd=False), write_through=True, line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, 'w', closefd=False), write_through=True, line_buffering=True)
    extra = [p for p in env.get('PYTHONPATH', '').split(os.pathsep) if p]
    try:
        if argv[0] == '-m':
            sys.argv = [argv[1], *argv[2:]]
            sys.path[:0] = [cwd, *extra]
            runpy.run_module(argv[1], run_name='__main__', alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[:0] = [os.path.dirname(os.path.abspath(argv[0])), *extra]
            runpy.run_path(argv[0], run_name='__main__')
    except Exception:  # reported as the interpreter reports an uncaught one: through sys.excepthook
        sys.excepthook(*sys.exc_info())
        raise SystemExit(1) from None
    finally:
        atexit._run_exitfuncs()  # multiprocessing's children end in os._exit, which skips them


def warm(cmd):
    """Whether cmd is `sys.executable script.py ...` or `sys.executable -m module ...`."""
    return len(cmd) >= 2 and cmd[0] == sys.executable and (str(cmd[1]).endswith('.py') or cmd[1] == '-m')


def run(cmd, *, cwd=None, env=None, timeout=None, capture_output=True, text=True, fresh=False):
    """subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout),
    forked from the server when cmd runs a script or module (and not fresh)."""
    assert capture_output and text, "warm.run captures text output, as the suite's runs do"
    cmd, cwd, env = [str(c) for c in cmd], cwd or os.getcwd(), dict(os.environ if env is None else env)
    if not fresh and warm(cmd):
        _forkserver()
        fresh = _import_env(env) != _BASE_ENV or _shadows(env)
    if fresh or not warm(cmd):
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryDirectory(prefix='warm-') as tmp:
        out, err = os.path.join(tmp, 'stdout'), os.path.join(tmp, 'stderr')
        for path in (out, err):
            open(path, 'w').close()
        p = _forkserver().Process(target=_child, args=(cmd[1:], str(cwd), env, out, err))
        p.start()
        p.join(timeout)
        if p.exitcode is None:
            p.kill()
            p.join()
            raise subprocess.TimeoutExpired(cmd, timeout, output=_read(out), stderr=_read(err))
        return subprocess.CompletedProcess(cmd, p.exitcode, _read(out), _read(err))


def _shadows(env):
    """Whether env's PYTHONPATH holds a package or module the server preloaded (another torch or
    Triton, say): the run must import that one."""
    names = {m.split('.')[0] for m in PRELOAD}
    return any(os.path.exists(os.path.join(p, n)) or os.path.exists(os.path.join(p, n + '.py'))
               for p in env.get('PYTHONPATH', '').split(os.pathsep) if p for n in names)


def _read(path):
    with open(path, errors='replace') as f:
        return f.read()
