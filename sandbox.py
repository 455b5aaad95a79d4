"""
The tools a model may call, with no torch: the calculator (arithmetic on a syntax tree walked by
hand, nothing evaluated), python (a program run in a sandboxed fresh interpreter) and
python_repl (the same, after the rollout's earlier programs run again quietly: a REPL).
DEFAULT_TOOLS names them for tasks; tool_calls.py finds, runs and answers the calls.

The python tool runs each program in a fresh interpreter under these guards:
- a new process (sys.executable -I: no user site, no PYTHON* variables), never a fork of the
  trainer, so none of its memory or open files; its environment is only PATH, LANG, HOME and TMPDIR
  (the temp dir) and one-thread settings for BLAS and OpenMP; stdin is /dev/null; the working
  directory is a fresh temp dir, deleted afterwards; the temp dirs of a trainer lie in one
  tool-python-NS-PID-* dir, removed at its exit, or by the next trainer's first call if it was
  killed (with the programs it left running, when they ran as uids of their own);
- rlimits set in the child before the program runs: CPU seconds (the time limit + 1), address space
  (PYTHON_MEMORY_BYTES), processes (PYTHON_PROCESSES), file size (PYTHON_FILE_BYTES), no core files;
- a trainer running as root runs each call as a uid of its own (PYTHON_UID_BASE + (pid << 9) +
  slot, no account's), with no groups, no_new_privs and one capability, CAP_DAC_READ_SEARCH (it
  reads what root reads, so the interpreter imports from a 0700 home): it cannot write the
  trainer's files, signal or trace its processes, or read their /proc/PID/environ, and
  RLIMIT_NPROC counts its own processes and threads only; when the call returns, kill(-1) sent as
  that uid kills every process it started, daemons (setsid) included, namespaces or not;
- disk: the working dir holds at most PYTHON_DISK_BYTES, as a tmpfs of that size mounted over it
  in the call's mount namespace (writes then fail with ENOSPC), else the call is killed once the
  files under it pass that size (summed every PYTHON_DISK_CHECK_S);
- a wall clock: at the time limit the process group is killed (SIGKILL), and what the program had
  printed comes back with the error; stdout and stderr are read as they come and only the head and
  tail are kept (MAX_OUTPUT_CHARS, the middle cut), so a program printing gigabytes costs nothing;
- where `unshare` works (root, or unprivileged user namespaces allowed), new network, pid and mount
  namespaces: no network at all (the new namespace's loopback is down, 127.0.0.1 included), a /proc
  that shows only the program's own processes, and everything in the pid namespace dies with it
  (the program is its pid 1, which ignores signals it sends itself: a real crash still kills it);
- functions that raise no audit event are replaced before the program runs, in the modules
  themselves (so `import posix` finds the replacement): os.pidfd_open, signal.pidfd_send_signal
  and _posixsubprocess.fork_exec are refused, and os.open checks the path that its dir_fd
  resolves (the 'open' event does not carry dir_fd); importing those modules again, or making a
  fresh one with _imp.create_builtin, is refused;
- an audit hook (sys.addaudithook, installed before the program runs; Python code cannot remove it)
  that refuses: socket connect, bind, sendto, sendmsg and name lookups; opening for writing,
  creating, deleting, renaming, linking or changing modes of paths outside the temp dir (/dev/null
  excepted); fork, exec, spawn, system, subprocess, sending signals; ctypes beyond its own import;
  setrlimit (root could raise its hard limits); sys.settrace and sys.setprofile; opening /proc/PID
  of another process; importing subinterpreters (their hooks are their own) and CPython's test
  modules.
These are guards against accidents and naive attempts, not a security boundary. What they do not
protect against, so that untrusted code still wants a container or a VM:
- reading: the program reads whatever the user running the trainer can read (keys, tokens under
  ~/.cache/huggingface, checkpoints; as root, everything, CAP_DAC_READ_SEARCH); run training as a
  user that owns nothing secret;
- a program written to escape: the hook and the replacements are Python-level guards, not a
  syscall filter. Compiled code (a C extension) is not audited, and introspection (a traceback's
  frames, gc) can reach the hook's state and the functions replaced. Past the hook, as a uid of
  its own, such code may still write world-writable dirs (/tmp, /dev/shm: not capped) and files
  the trainer made world-writable, and, without namespaces, open sockets;
- a trainer not running as root (or where the uids are not mapped, as in a user namespace that
  maps a few): the program runs as the trainer's user, so RLIMIT_NPROC counts all of that user's
  processes and threads, the trainer's included (the program may be unable to start even one
  thread), and only the hook keeps it from the trainer's files, signals and /proc/PID; without a
  pid namespace too, a process that calls setsid leaves the group and survives the call;
- without namespaces (no unshare, or no privilege to use it, as in Docker's default profile):
  sockets are refused only by the hook, /proc shows every process (the hook still refuses other
  processes' /proc/PID); disk is watched, not capped: a call may pass PYTHON_DISK_BYTES by what it
  writes between two looks, and files deleted while still open are not seen;
- temp dirs: a trainer's dir is removed only by one in the same pid namespace (pids elsewhere
  mean other processes), and only once its pid is gone; memory: each call may use
  PYTHON_MEMORY_BYTES, as many at once as the pool runs;
- kernel bugs and side channels.

How this differs from the projects it was compared with (source read at the commit named):
- TRL, huggingface/trl f2cd577, trl/trainer/grpo_trainer.py (_tool_call_loop) and grpo_config.py
  (max_tool_calling_iterations, unbounded by default): the whole batch decodes a turn, then the
  calls run in the trainer process (sync tools one after another, async ones gathered), with no
  time limit and no sandbox (an exception becomes {"error": str(e)}), then the rows that called
  decode again together. Here a row pauses alone while the others decode, calls run in a pool
  under a time limit, and code runs in another process. Schemas follow the same rules
  (json_schema equals transformers' get_json_schema, but leaves out keyword-only parameters,
  the tool's own settings such as python's timeout).
- verl, volcengine/verl b178a3c, verl/experimental/agent_loop/{tool_agent_loop,tool_parser}.py:
  an async state machine per trajectory, the hermes parser drops a malformed call with a log line
  (here the model is told: a 'parse' error), responses cut at max_tool_response_length (left,
  right or middle; here the middle, with the count of what was cut). Its sandbox fusion tool
  (verl/tools/sandbox_fusion_tools.py) posts code to a separate sandbox service over HTTP, whose
  isolation is real; here there is no service to run, and the isolation is what is listed above.
- nanochat, karpathy/nanochat 1c301a3, nanochat/execution.py (which says it is not a security
  sandbox): a multiprocessing child of the trainer (inheriting its memory and environment) that
  sets os.system, os.fork, ... to None and limits memory, with no network blocking. Here the
  interpreter is fresh, the environment scrubbed, and the refusals are audit-hook checks, or
  functions replaced in posix itself with importing it again refused, which `import posix` cannot
  undo as it undoes a None assigned in os.
- verifiers, PrimeIntellect-ai/verifiers 099e025, verifiers/envs/python_env.py (PythonEnv): a
  persistent REPL in a remote container, the last expression shown as Out[n]. Here every call is a
  new process (define again what a previous call defined) and nothing is shown but what the
  program prints.
"""
import ast
import atexit
import functools
import json
import math
import operator
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

MAX_OUTPUT_CHARS = 2000  # what the model reads of one call's output, the middle cut beyond
CALC_MAX_CHARS = 200  # the longest expression the calculator reads
CALC_MAX_EXPONENT = 1000  # larger exponents are refused before anything is computed
CALC_MAX_ABS = 10 ** 100  # larger values are refused, as a calculator's display would
CALC_MAX_DIGITS = 101  # a power sure to have more digits than that is refused before computing it
PYTHON_TIMEOUT_S = 10.0  # python's time limit when called directly; run_call passes its own
PYTHON_MAX_CODE_CHARS = 50_000  # the longest program python runs
PYTHON_MEMORY_BYTES = 1 << 30  # RLIMIT_AS: numpy and sympy import well within it
PYTHON_PROCESSES = 64  # RLIMIT_NPROC (all of the user's processes and threads; root is exempt)
PYTHON_FILE_BYTES = 16 << 20  # RLIMIT_FSIZE: the largest file the program may write
PYTHON_DRAIN_S = 0.2  # after the kill, how long to read what the program had already printed
PYTHON_DISK_BYTES = 64 << 20  # all the working dir holds: a tmpfs that size, else killed past it
PYTHON_DISK_CHECK_S = 0.01  # without the tmpfs, how often the working dir's size is summed
PYTHON_UID_BASE = 1 << 31  # as root, call `slot` of process `pid` has uid BASE + (pid << 9) + slot
PYTHON_UID_SLOTS = 511  # calls of one process at once (pids < 2**22: the uids stay below 2**32 - 1)
# new network, pid and mount namespaces whose processes die with the unshare process
UNSHARE_FLAGS = ('--net', '--pid', '--fork', '--kill-child', '--mount-proc')
SANDBOX_ENV = {'PATH': '/usr/bin:/bin', 'LANG': 'C.UTF-8', 'OMP_NUM_THREADS': '1',
               'OPENBLAS_NUM_THREADS': '1', 'MKL_NUM_THREADS': '1'}
UTF8_CONTINUATION = bytes(range(0x80, 0xC0))  # bytes that do not start a character


# ----------------------------------------------------------------------------- calculator

def _divide(a, b):
    """True division that keeps integers exact: 8/2 is 4, 7/2 is 3.5."""
    if isinstance(a, int) and isinstance(b, int) and b != 0 and a % b == 0:
        return a // b
    return a / b


def _power(base, exponent):
    if abs(exponent) > CALC_MAX_EXPONENT:
        raise ValueError(f"exponent {exponent} is larger than {CALC_MAX_EXPONENT}")
    if exponent > 0 and abs(base) > 1 and exponent * math.log10(abs(base)) > CALC_MAX_DIGITS:
        raise ValueError(f"result too large (over {CALC_MAX_ABS:.0e})")
    return base ** exponent


CALC_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
               ast.Div: _divide, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
               ast.Pow: _power}
CALC_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
CALC_REFUSED = {ast.Name: 'a name', ast.Call: 'a function call', ast.Attribute: 'attribute access',
                ast.Subscript: 'indexing', ast.Lambda: 'a lambda', ast.Compare: 'a comparison'}


def _checked(value):
    if isinstance(value, complex):
        raise ValueError("the result is not a real number")
    if (isinstance(value, float) and not math.isfinite(value)) or abs(value) > CALC_MAX_ABS:
        raise ValueError(f"result too large (over {CALC_MAX_ABS:.0e})")
    return value


def _arithmetic(node):
    """The value of an expression's syntax tree: numbers and arithmetic only, walked by hand."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in CALC_UNARY:
        return _checked(CALC_UNARY[type(node.op)](_arithmetic(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in CALC_BINARY:
        left, right = _arithmetic(node.left), _arithmetic(node.right)
        try:
            return _checked(CALC_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError(f"result too large (over {CALC_MAX_ABS:.0e})") from None
    what = CALC_REFUSED.get(type(node), type(node).__name__)
    if isinstance(node, ast.Name):
        what = f"the name {node.id!r}"
    if isinstance(node, ast.Constant):
        what = f"the constant {node.value!r}"
    raise ValueError(f"{what} is not allowed: only numbers, + - * / // % ** and parentheses")


def _check_text(value, name, limit):
    """A tool's text argument, as the model sent it: a string of at most limit characters."""
    if not isinstance(value, str):
        raise ValueError(f"the {name} must be a string, not {type(value).__name__}")
    if len(value) > limit:
        raise ValueError(f"the {name} is longer than {limit} characters")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: The expression, e.g. "(17 + 4) * 3 / 2".
    """
    # Integers stay exact (7/2 is 3.5 but 8/2 is 4); a float anywhere makes the result a float,
    # printed in Python's shortest round-trip form (2.5*2 is 5.0, 0.1+0.2 is 0.30000000000000004).
    _check_text(expression, 'expression', CALC_MAX_CHARS)
    try:
        tree = ast.parse(expression.strip(), mode='eval')
    except SyntaxError as e:
        raise ValueError(f"not an expression: {e.msg}") from None
    except (RecursionError, MemoryError):
        raise ValueError("the expression is nested too deeply") from None
    value = _arithmetic(tree.body)
    return repr(value) if isinstance(value, float) else str(value)

# ----------------------------------------------------------------------------- python

# The child's first code, run as root where the trainer is: the tmpfs, limits, its own uid, then
# the functions no audit event covers replaced, the audit hook, and the program (main.py in its
# working directory), with tracebacks that start at the program.
# argv: root cpu_s memory processes fsize disk uid (disk 0: no tmpfs; uid -1: keep the trainer's).
CHILD = r'''
import os, resource, sys, traceback
root = os.path.realpath(sys.argv[1])
cells = []  # python_repl: the rollout's earlier programs, run again first with their output dropped
if os.path.exists('cells.json'):
    import json
    with open('cells.json', encoding='utf-8') as f:
        cells = json.load(f)
cpu, memory, processes, file_size, disk, uid = map(int, sys.argv[2:8])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if disk or uid >= 0:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
if disk:  # a mount namespace of its own: a tmpfs of disk bytes over the working directory
    with open('main.py', encoding='utf-8') as f:
        source = f.read()
    owner = f',uid={uid},gid={uid}' if uid >= 0 else ''
    options = f'size={disk},mode=0700{owner}'.encode()
    if libc.mount(b'tmpfs', os.fsencode(root), b'tmpfs', 2 | 4, options) == 0:  # nosuid, nodev
        os.chdir(root)
        with open('main.py', 'w', encoding='utf-8') as f:
            f.write(source)
if uid >= 0:  # its own uid, keeping CAP_DAC_READ_SEARCH only: it reads what root reads (Python
    # may be installed under a 0700 home), and writes, signals and counts processes as that uid
    # PR_SET_NO_NEW_PRIVS, PR_SET_KEEPCAPS
    ok = libc.prctl(38, 1, 0, 0, 0) == 0 and libc.prctl(8, 1, 0, 0, 0) == 0
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    caps = (ctypes.c_uint32 * 6)(1 << 2, 1 << 2, 0, 0, 0, 0)  # effective, permitted, inheritable
    if not (ok and libc.capset(header, caps) == 0 and os.getuid() == uid):
        sys.exit('sandbox: dropping root failed')
if disk or uid >= 0:
    del libc
own_proc = os.path.realpath('/proc/self')
WRITE = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
REFUSED = {'socket.connect', 'socket.bind', 'socket.sendto', 'socket.sendmsg',
           'socket.getaddrinfo', 'socket.gethostbyname', 'socket.gethostbyaddr',
           'socket.getnameinfo', 'os.fork', 'os.forkpty', 'os.system', 'os.exec', 'os.spawn',
           'os.posix_spawn', 'subprocess.Popen', 'pty.spawn', 'os.kill', 'os.killpg',
           'signal.pthread_kill', 'resource.setrlimit', 'resource.prlimit', 'sys.settrace',
           'sys.setprofile'}
# event -> (position of a path argument, position of its dir_fd argument or None), ...
PATH_EVENTS = {'os.remove': ((0, 1),), 'os.rmdir': ((0, 1),), 'os.mkdir': ((0, 2),),
               'os.chmod': ((0, 2),), 'os.chown': ((0, 3),), 'os.utime': ((0, 3),),
               'os.truncate': ((0, None),), 'os.chflags': ((0, None),),
               'os.setxattr': ((0, None),), 'os.removexattr': ((0, None),),
               'shutil.rmtree': ((0, None),), 'os.symlink': ((1, 2),),
               'os.rename': ((0, 2), (1, 3)), 'os.link': ((0, 2), (1, 3))}
# modules whose functions are replaced below: imported again, or made afresh, they would be whole
PINNED = {'os', 'posix', 'signal', '_signal', '_posixsubprocess', '_imp'}
# modules that reach past the hook: subinterpreters (hooks are per interpreter), test internals
UNSAFE = {'_xxsubinterpreters', '_xxinterpchannels', '_interpreters', '_testcapi',
          '_testinternalcapi', '_testmultiphase', '_testsinglephase', '_testbuffer'}

def where(path, dir_fd=None):
    path = os.fsdecode(path)
    if isinstance(dir_fd, int) and not os.path.isabs(path):
        path = os.path.join(os.readlink(f'/proc/self/fd/{dir_fd}'), path)
    return os.path.realpath(path)

def inside(path, top):
    return path == top or path.startswith(top + os.sep)

def refuse(what):
    raise PermissionError(f'sandbox: {what} is not allowed')

def check_open(path, real, flags):
    if flags & WRITE and not inside(real, root) and real != '/dev/null':
        refuse(f'writing {os.fsdecode(path)!r} (outside the working directory)')
    other_process = real.startswith('/proc/') and real.split('/')[2].isdigit()
    if other_process and not inside(real, own_proc):
        refuse(f'reading {os.fsdecode(path)!r} (another process)')

def audit(event, args):
    if event in REFUSED:
        refuse(event)
    if event.startswith('ctypes.') and not (event == 'ctypes.dlopen' and args[0] is None):
        refuse(event)
    if event == 'import' and (args[0] in PINNED or args[0] in UNSAFE):
        refuse(f'import {args[0]}')
    if event == 'open' and not isinstance(args[0], int) and args[0] is not None:
        path, mode, flags = args
        if flags & WRITE and mode is None and not os.path.isabs(os.fsdecode(path)):
            refuse('os.open for writing with a relative path')
        check_open(path, where(path), flags)
    for path_at, dir_fd_at in PATH_EVENTS.get(event, ()):
        path = args[path_at] if path_at < len(args) else None
        dir_fd = args[dir_fd_at] if dir_fd_at is not None and dir_fd_at < len(args) else None
        if isinstance(path, (str, bytes, os.PathLike)) and not inside(where(path, dir_fd), root):
            refuse(f'{event} on {os.fsdecode(path)!r} (outside the working directory)')

def refused(name):
    def stub(*args, **kwargs):
        refuse(name)
    return stub

def print_traceback(e):
    """The traceback without this file's frames (the hook's, the exec's): from the program on."""
    shown = traceback.TracebackException(type(e), e, e.__traceback__)
    link = shown
    while link is not None:
        link.stack = traceback.StackSummary.from_list(
            [f for f in link.stack if f.filename != '<string>'])
        link = link.__cause__ or link.__context__
    sys.stderr.write(''.join(shown.format()))

# What raises no audit event goes from the modules themselves (os re-exports posix, signal
# _signal), before the hook refuses importing them again; a fresh module from _imp is refused too.
import _imp, _posixsubprocess, _signal, posix, signal
for module, name, shown in ((posix, 'pidfd_open', 'os.pidfd_open'),
                            (_signal, 'pidfd_send_signal', 'signal.pidfd_send_signal'),
                            (_posixsubprocess, 'fork_exec', '_posixsubprocess.fork_exec')):
    for m in {module, os, signal} if module is not _posixsubprocess else {module}:
        if hasattr(m, name):
            setattr(m, name, refused(shown))
create_builtin, posix_open = _imp.create_builtin, posix.open

def fresh_builtin(spec):
    if spec.name in PINNED:
        refuse(f'a second {spec.name} module')
    return create_builtin(spec)

def open_at(path, flags, mode=0o777, *, dir_fd=None):
    """os.open, with the path checked where dir_fd puts it (the 'open' event does not carry it)."""
    if dir_fd is not None and not os.path.isabs(os.fsdecode(path)):
        check_open(path, where(path, dir_fd), flags)
    return posix_open(path, flags, mode, dir_fd=dir_fd)

_imp.create_builtin = fresh_builtin
posix.open = os.open = open_at
os.supports_dir_fd.add(open_at)
sys.addaudithook(audit)
sys.argv = ['main.py']
scope = {'__name__': '__main__', '__builtins__': __builtins__}
out, err = sys.stdout, sys.stderr
for i, cell in enumerate(cells):
    sink = sys.stdout = sys.stderr = open(os.devnull, 'w')
    try:
        exec(compile(cell, f'<cell {i}>', 'exec'), scope)
    except BaseException:
        pass  # as in a REPL: what ran before the error stays
    finally:
        sys.stdout, sys.stderr = out, err
        sink.close()
try:
    with open('main.py', encoding='utf-8') as f:
        program = compile(f.read(), 'main.py', 'exec')
    exec(program, scope)
except SystemExit:
    raise
except BaseException as e:
    print_traceback(e)
    sys.exit(1)
'''


@functools.cache
def _unshare_prefix():
    """The unshare command that gives the child its own network, pid and mount namespaces, as root
    or through a user namespace; () where neither works here."""
    exe = shutil.which('unshare')
    if exe is None:
        return ()
    for user in ((), ('--map-root-user',)):
        command = (exe, *user, *UNSHARE_FLAGS)
        try:
            probe = subprocess.run([*command, sys.executable, '-I', '-c', ''], env=SANDBOX_ENV,
                                   stdin=subprocess.DEVNULL, capture_output=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            return command
    return ()


@functools.cache
def _own_uids():
    """Whether each call can run as a uid of its own: the trainer is root and the uids from
    PYTHON_UID_BASE up exist here (a user namespace may map only a few)."""
    if os.geteuid() != 0:
        return False
    for table in ('/proc/self/uid_map', '/proc/self/gid_map'):
        with open(table) as f:
            ranges = [tuple(map(int, line.split())) for line in f if line.strip()]
        if not any(first <= PYTHON_UID_BASE and first + count >= 2**32 - 1
                   for first, _, count in ranges):
            return False
    return True


_lock = threading.Lock()
_slots = set()  # the uid slots of this process's calls now running
_run_dirs = {}  # pid -> that process's directory of working directories


def _take_uid():
    """A uid that nothing else uses while the call runs (its pid is this process's), or None."""
    if not _own_uids():
        return None
    with _lock:
        slot = min(set(range(PYTHON_UID_SLOTS)) - _slots, default=None)
        if slot is None:
            raise RuntimeError(f"more than {PYTHON_UID_SLOTS} python calls at once")
        _slots.add(slot)
    return PYTHON_UID_BASE + (os.getpid() << 9) + slot


def _give_uid(uid):
    with _lock:
        _slots.discard((uid - PYTHON_UID_BASE) % (1 << 9))


def _kill_uid(uid):
    """SIGKILL every process of uid, in every pid namespace below ours, daemons included: kill(-1)
    sent as uid reaches exactly the processes of uid, and a fork cannot slip past it."""
    subprocess.run(['/bin/sh', '-c', 'kill -9 -1'], user=uid, group=uid, extra_groups=[],
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _remove_run_dir(path, pid):
    """path and what it holds, once no process of pid runs; the programs of its calls killed."""
    if os.getpid() != pid and _alive(pid):
        return
    try:
        with os.scandir(path) as calls:
            uids = {c.stat(follow_symlinks=False).st_uid for c in calls}
    except OSError:
        return  # removed meanwhile
    for uid in uids if _own_uids() else ():
        if uid >= PYTHON_UID_BASE:
            _kill_uid(uid)
    shutil.rmtree(path, ignore_errors=True)


def _run_dir():
    """This process's directory of working directories, tool-python-NS-PID-* (NS its pid
    namespace), made on its first call, which removes those of processes of the namespace no
    longer running (a trainer killed before its atexit)."""
    pid = os.getpid()
    with _lock:
        if pid not in _run_dirs:
            top, ns = tempfile.gettempdir(), os.stat('/proc/self/ns/pid').st_ino
            for name in os.listdir(top):
                owner = re.fullmatch(rf'tool-python-{ns}-(\d+)-\w+', name)  # pids of our namespace
                if owner and not _alive(int(owner[1])):
                    _remove_run_dir(os.path.join(top, name), int(owner[1]))
            _run_dirs[pid] = tempfile.mkdtemp(prefix=f'tool-python-{ns}-{pid}-')
            os.chmod(_run_dirs[pid], 0o711)  # the calls' uids pass through to their own dirs
            atexit.register(_remove_run_dir, _run_dirs[pid], pid)
        return _run_dirs[pid]


def _disk_used(top):
    """The bytes the files under top take on disk (blocks: a sparse file counts what it holds)."""
    total = 0
    for path, dirs, files in os.walk(top):
        for name in dirs + files:
            try:
                total += os.lstat(os.path.join(path, name)).st_blocks * 512
            except OSError:
                pass  # deleted meanwhile
    return total


def cut_middle(text, limit=MAX_OUTPUT_CHARS, *, hidden=0):
    """text in at most limit characters: its head and tail around '... [N characters cut] ...'.
    hidden: characters already dropped from text's middle (text is then the head and tail of a
    longer output, each at least limit characters long)."""
    if len(text) <= limit and not hidden:
        return text
    total = len(text) + hidden
    keep = max(limit - len(f"\n... [{total} characters cut] ...\n"), 0)
    head, tail = keep - keep // 2, keep // 2
    return f"{text[:head]}\n... [{total - keep} characters cut] ...\n{text[len(text) - tail:]}"


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def _exited(proc):
    """Whether the child has exited, without reaping it."""
    return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _read_output(proc, deadline, limit, root=None):
    """What the child printed, its middle cut to limit characters, and why it was stopped: None,
    'timeout' at the deadline, 'disk' once the files under root (when given) pass
    PYTHON_DISK_BYTES. Only the first and last 4*limit bytes are kept (each holds at least limit
    characters); when stopped the process group is killed and what is left in the pipe read. The
    group is killed before the child is reaped, so its id cannot belong to anyone else yet."""
    fd, keep = proc.stdout.fileno(), 4 * limit
    head, tail, hidden, stop = bytearray(), bytearray(), 0, None
    check = time.monotonic() if root else math.inf
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        now = time.monotonic()
        if stop is None and now >= check:
            check = now + PYTHON_DISK_CHECK_S
            if _disk_used(root) > PYTHON_DISK_BYTES:
                stop, deadline = 'disk', now + PYTHON_DRAIN_S
                _kill_group(proc)
        left = deadline - now
        if left <= 0 and stop:
            break
        if left <= 0:
            stop = 'timeout'
            _kill_group(proc)
            deadline = time.monotonic() + PYTHON_DRAIN_S
            continue
        wait = left if stop else min(left, check - now)  # the watcher's next look
        if not poller.poll(max(wait, 0) * 1000):
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        room = max(keep - len(head), 0)
        head += chunk[:room]
        tail += chunk[room:]
        if len(tail) > keep:
            hidden += len(bytes(tail[:-keep]).translate(None, UTF8_CONTINUATION))
            del tail[:-keep]
    # the pipe closed: wait for the exit without reaping, then kill whatever the program left
    while stop is None and not _exited(proc):
        if time.monotonic() > deadline:
            stop = 'timeout'
            break
        time.sleep(0.005)
    _kill_group(proc)
    if hidden:
        text = head.decode('utf-8', 'replace') + tail.decode('utf-8', 'replace')
    else:
        text = (head + tail).decode('utf-8', 'replace')
    return cut_middle(text, limit, hidden=hidden), stop


def _signal_name(number):
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def python(code: str, *, timeout: float = PYTHON_TIMEOUT_S) -> str:
    """Run a Python program in a fresh process and return what it prints (stdout and stderr).
    Nothing is kept from one call to the next, and only what the program prints is shown.

    Args:
        code: The program, e.g. "print(sum(range(101)))".
    """
    # Returns the output; a program that overruns the time limit raises TimeoutError carrying what
    # it had printed and one line saying so (run_call reports it as a 'timeout').
    return _run_python(code, timeout)


def python_repl(code: str, *, state, timeout: float = PYTHON_TIMEOUT_S) -> str:
    """Run a Python program and return what it prints (stdout and stderr), as in a REPL: what
    earlier programs of this conversation defined, imported or wrote is there again.

    Args:
        code: The program, e.g. "x = 6 * 7", then in a later call "print(x + 1)".
    """
    # The REPL is replayed, not kept alive (as ToRA runs the programs so far, joined): each call
    # is a fresh sandboxed process that first runs the rollout's earlier programs with their output
    # dropped, all within the time limit; a program that timed out is not kept.
    cells = state.setdefault('python_cells', [])
    out = _run_python(code, timeout, cells)
    cells.append(code)
    return out


def _run_python(code, timeout, cells=()):
    """python's body; cells: the earlier programs the child runs first (python_repl's), which take
    their share of PYTHON_MAX_CODE_CHARS."""
    _check_text(code, 'code', PYTHON_MAX_CODE_CHARS - sum(map(len, cells)))
    prefix, uid, root = _unshare_prefix(), _take_uid(), None
    try:
        root = tempfile.mkdtemp(prefix='call-', dir=_run_dir())
        with open(os.path.join(root, 'main.py'), 'w', encoding='utf-8') as f:
            f.write(code)
        if cells:
            with open(os.path.join(root, 'cells.json'), 'w', encoding='utf-8') as f:
                json.dump(list(cells), f)
        if uid is not None:
            os.chown(root, uid, uid)
        # the tmpfs where there is a mount namespace (its size is then the cap); the watcher always
        limits = [math.ceil(timeout) + 1, PYTHON_MEMORY_BYTES, PYTHON_PROCESSES, PYTHON_FILE_BYTES,
                  PYTHON_DISK_BYTES if prefix else 0, -1 if uid is None else uid]
        argv = [*prefix, sys.executable, '-I', '-B', '-u', '-X', 'utf8', '-c', CHILD,
                root, *map(str, limits)]
        env = {**SANDBOX_ENV, 'HOME': root, 'TMPDIR': root}
        deadline = time.monotonic() + timeout
        proc = subprocess.Popen(argv, cwd=root, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            # room for the status line below, so that run_call's cap cuts nothing more
            text, stop = _read_output(proc, deadline, limit=MAX_OUTPUT_CHARS - 80, root=root)
        finally:
            _kill_group(proc)
            if uid is not None:
                _kill_uid(uid)  # what left the group (setsid) or the pid namespace is dying
            status = proc.wait()
            proc.stdout.close()
    finally:
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
        if uid is not None:
            _give_uid(uid)
    end = '' if text.endswith('\n') or not text else '\n'
    if stop == 'timeout':
        raise TimeoutError(f"{text}{end}error: timed out after {timeout:g} s")
    if stop == 'disk':
        cap = PYTHON_DISK_BYTES >> 20
        return f"{text}{end}error: killed: its files passed the {cap} MiB disk cap"
    if status < 0:
        return f"{text}{end}error: killed by {_signal_name(-status)}"
    if status > 0 and not text:
        return f"error: exit status {status}"
    return text


DEFAULT_TOOLS = {'calculator': calculator, 'python': python, 'python_repl': python_repl}
