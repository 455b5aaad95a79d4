"""
Tools a model calls in the middle of a rollout, with no torch: what the tools are, how a call is
recognised and parsed in the model's text, how it runs under a time limit, and what text goes back.

Two ways of writing a call (STYLES):
- 'hermes', what Qwen2.5/Qwen3 chat templates teach:
  <tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>. The answers go
  back as tool messages (tool_messages) that the chat template renders.
- 'json', what Llama 3.1+ chat templates teach: a turn that is one JSON object,
  {"name": "calculator", "parameters": {"expression": "6*7"}} (or "arguments"), answered by tool
  messages as for hermes.
- 'fenced', markdown blocks named after the tool, as in tool-integrated math reasoning:
  ```python\\nprint(6*7)\\n``` answered by ```output\\n42\\n``` (response_text).

A call's life: the sampler asks call_closed(turn_text, style) as a row writes, and pauses the row
when it is True; parse_calls reads the turn's calls; start_calls runs them on a thread pool
(run_call: never raises, never waits past the time limit); response_text or tool_messages make the
answer that is prefilled before the row decodes on. A tool is any function with type hints and a
Google-style docstring (json_schema describes it to the model); DEFAULT_TOOLS has two.

The python tool runs each program in a fresh interpreter under these guards:
- a new process (sys.executable -I: no user site, no PYTHON* variables), never a fork of the
  trainer, so none of its memory or open files; its environment is only PATH, LANG, HOME and TMPDIR
  (the temp dir) and one-thread settings for BLAS and OpenMP; stdin is /dev/null; the working
  directory is a fresh temp dir, deleted afterwards;
- rlimits set in the child before the program runs: CPU seconds (the time limit + 1), address space
  (PYTHON_MEMORY_BYTES), processes (PYTHON_PROCESSES), file size (PYTHON_FILE_BYTES), no core files;
- a wall clock: at the time limit the process group is killed (SIGKILL), and what the program had
  printed comes back with the error; stdout and stderr are read as they come and only the head and
  tail are kept (MAX_OUTPUT_CHARS, the middle cut), so a program printing gigabytes costs nothing;
- where `unshare` works (root, or unprivileged user namespaces allowed), new network, pid and mount
  namespaces: no network at all (the new namespace's loopback is down, 127.0.0.1 included), a /proc
  that shows only the program's own processes, and everything in the pid namespace dies with it
  (the program is its pid 1, which ignores signals it sends itself: a real crash still kills it);
- an audit hook (sys.addaudithook, installed before the program runs; Python code cannot remove it)
  that refuses: socket connect, bind, sendto, sendmsg and name lookups; opening for writing,
  creating, deleting, renaming, linking or changing modes of paths outside the temp dir (/dev/null
  excepted); fork, exec, spawn, system, subprocess, sending signals; ctypes beyond its own import;
  setrlimit (root could raise its hard limits); opening /proc/PID of another process.
These are guards against accidents and naive attempts, not a security boundary. What they do not
protect against, so that untrusted code still wants a container or a VM:
- reading: the program reads whatever the user running the trainer can read (keys, tokens under
  ~/.cache/huggingface, checkpoints); run training as a user that owns nothing secret;
- a program written to escape: the audit hook is a Python-level guard, not a syscall filter.
  Compiled code (a C extension, _posixsubprocess.fork_exec) is not audited, introspection can
  reach the hook's state, and os.open(..., dir_fd=...) does not report its dir_fd (relative writes
  through os.open are refused for that reason, but that is one hole of many);
- without namespaces (no unshare, or no privilege to use it, as in Docker's default profile):
  sockets are refused only by the hook, /proc shows every process (the hook still refuses other
  processes' /proc/PID), and a process that calls setsid leaves the group and survives the kill;
- as root RLIMIT_NPROC does nothing (the kernel exempts root), so only the hook stops a fork bomb;
  for other users it counts all their processes and threads, the trainer's included, so the program
  may be unable to start even one thread;
- disk: RLIMIT_FSIZE caps each file, not how many: the temp dir's filesystem can fill until the
  time limit; memory: each call may use PYTHON_MEMORY_BYTES, as many at once as the pool runs;
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
  interpreter is fresh, the environment scrubbed, and the refusals are audit-hook checks, which
  `import posix` cannot undo as it undoes a None assigned in os.
- verifiers, PrimeIntellect-ai/verifiers 099e025, verifiers/envs/python_env.py (PythonEnv): a
  persistent REPL in a remote container, the last expression shown as Out[n]. Here every call is a
  new process (define again what a previous call defined) and nothing is shown but what the
  program prints.
"""
import ast
import functools
import inspect
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
import types
import typing

STYLES = ('hermes', 'json', 'fenced')
MAX_OUTPUT_CHARS = 2000  # what the model reads of one call's output, the middle cut beyond
TIMEOUT_SLACK_S = 1.0  # extra wait for a tool that keeps the time limit itself (python kills its
# processes at the limit, then cleans up)
RESPONSE_FENCE = 'output'  # the fence of a fenced answer, never a tool's name
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
# new network, pid and mount namespaces whose processes die with the unshare process
UNSHARE_FLAGS = ('--net', '--pid', '--fork', '--kill-child', '--mount-proc')
SANDBOX_ENV = {'PATH': '/usr/bin:/bin', 'LANG': 'C.UTF-8', 'OMP_NUM_THREADS': '1',
               'OPENBLAS_NUM_THREADS': '1', 'MKL_NUM_THREADS': '1'}
UTF8_CONTINUATION = bytes(range(0x80, 0xC0))  # bytes that do not start a character


# ----------------------------------------------------------------------------- schemas

JSON_TYPES = {str: 'string', int: 'integer', float: 'number', bool: 'boolean',
              type(None): 'null', list: 'array', dict: 'object'}
SECTIONS = ('Args:', 'Returns:', 'Raises:')


def _type_schema(hint, where):
    """The JSON schema of a type hint, by transformers' rules (basic types, list[...],
    dict[str, ...], Optional/Union, Literal, Any)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return {}
    if origin is None and hint in JSON_TYPES:
        return {'type': JSON_TYPES[hint]}
    if origin is typing.Union or origin is types.UnionType:
        subs = [_type_schema(a, where) for a in args if a is not type(None)]
        if len(subs) == 1:
            out = subs[0]
        elif all(s.keys() == {'type'} and isinstance(s['type'], str) for s in subs):
            names = sorted({s['type'] for s in subs})
            out = {'type': names[0] if len(names) == 1 else names}
        else:
            out = {'anyOf': subs}
        if type(None) in args:
            out['nullable'] = True
        return out
    if origin is typing.Literal and all(type(a) in JSON_TYPES for a in args):
        kinds = list(dict.fromkeys(JSON_TYPES[type(a)] for a in args))
        return {'type': kinds[0] if len(kinds) == 1 else kinds, 'enum': list(args)}
    if origin is list and args:
        return {'type': 'array', 'items': _type_schema(args[0], where)}
    if origin is dict and args:
        return {'type': 'object', 'additionalProperties': _type_schema(args[1], where)}
    if origin in (list, dict):
        return {'type': JSON_TYPES[origin]}
    raise ValueError(f"{where}: no JSON schema for the type hint {hint!r}")


def _docstring_parts(doc):
    """(description, {argument: description}, returns description or None) of a Google-style
    docstring: an argument's continuation lines are joined by single spaces."""
    description, args, returns = [], {}, []
    section, arg, indent = None, None, None
    for line in doc.splitlines():
        if line.strip() in SECTIONS:
            section = line.strip()
            continue
        if section is None:
            description.append(line)
        elif section == 'Args:':
            m = re.match(r'([ \t]*)(\w+)(?:[ \t]*\([^()\n]*\))?:\s*(.*)', line)
            if m and (indent is None or len(m.group(1)) <= indent):
                arg, indent = m.group(2), len(m.group(1))
                args[arg] = [m.group(3).strip()]
            elif arg is not None and line.strip():
                args[arg].append(line.strip())
        elif section == 'Returns:':
            returns.append(line)
    args = {k: ' '.join(p for p in parts if p) for k, parts in args.items()}
    return '\n'.join(description).strip(), args, ('\n'.join(returns).strip() or None)


def json_schema(fn):
    """The tool description a chat template shows the model, from fn's type hints and Google-style
    docstring, as transformers.utils.get_json_schema writes it: {'type': 'function', 'function':
    {'name', 'description', 'parameters': {'type': 'object', 'properties', 'required'}, 'return'}}.
    Keyword-only parameters are left out: they are the tool's settings (python's timeout), which
    run_call passes and the model never sets."""
    name = getattr(fn, '__name__', 'operation')
    doc = inspect.getdoc(fn)
    if not doc:
        raise ValueError(f"tool {name}: no docstring to describe it to the model")
    description, arg_docs, returns = _docstring_parts(doc)
    hints = typing.get_type_hints(fn)
    properties, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.KEYWORD_ONLY:
            continue
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ValueError(f"tool {name}: *{p.name} cannot be described to the model")
        if p.name not in hints:
            raise ValueError(f"tool {name}: argument {p.name} has no type hint")
        if p.name not in arg_docs:
            raise ValueError(f"tool {name}: the docstring's Args: do not describe {p.name}")
        prop = _type_schema(hints[p.name], f"tool {name}, argument {p.name}")
        text = arg_docs[p.name]
        choices = re.search(r'\(choices:\s*(.*?)\)\s*$', text, flags=re.IGNORECASE)
        if choices:
            prop['enum'] = json.loads(choices.group(1))
            text = text[:choices.start()].strip()
        prop['description'] = text
        properties[p.name] = prop
        if p.default is p.empty:
            required.append(p.name)
    parameters = {'type': 'object', 'properties': properties}
    if required:
        parameters['required'] = required
    function = {'name': name, 'description': description, 'parameters': parameters}
    if 'return' in hints:
        try:
            function['return'] = _type_schema(hints['return'], f"tool {name}, return")
        except ValueError:
            pass  # the model never writes the return value: no schema is better than a wrong one
        else:
            if returns is not None:
                function['return']['description'] = returns
    return {'type': 'function', 'function': function}


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

# The child's first code: limits, then the audit hook, then the program (main.py in its working
# directory), with tracebacks that start at the program. argv: root cpu_s memory processes fsize.
CHILD = r'''
import os, resource, sys, traceback
root = os.path.realpath(sys.argv[1])
cpu, memory, processes, file_size = map(int, sys.argv[2:6])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
own_proc = os.path.realpath('/proc/self')
WRITE = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
REFUSED = {'socket.connect', 'socket.bind', 'socket.sendto', 'socket.sendmsg',
           'socket.getaddrinfo', 'socket.gethostbyname', 'socket.gethostbyaddr',
           'socket.getnameinfo', 'os.fork', 'os.forkpty', 'os.system', 'os.exec', 'os.spawn',
           'os.posix_spawn', 'subprocess.Popen', 'pty.spawn', 'os.kill', 'os.killpg',
           'signal.pthread_kill', 'resource.setrlimit', 'resource.prlimit'}
# event -> (position of a path argument, position of its dir_fd argument or None), ...
PATH_EVENTS = {'os.remove': ((0, 1),), 'os.rmdir': ((0, 1),), 'os.mkdir': ((0, 2),),
               'os.chmod': ((0, 2),), 'os.chown': ((0, 3),), 'os.utime': ((0, 3),),
               'os.truncate': ((0, None),), 'os.chflags': ((0, None),),
               'os.setxattr': ((0, None),), 'os.removexattr': ((0, None),),
               'shutil.rmtree': ((0, None),), 'os.symlink': ((1, 2),),
               'os.rename': ((0, 2), (1, 3)), 'os.link': ((0, 2), (1, 3))}

def where(path, dir_fd=None):
    path = os.fsdecode(path)
    if isinstance(dir_fd, int) and not os.path.isabs(path):
        path = os.path.join(os.readlink(f'/proc/self/fd/{dir_fd}'), path)
    return os.path.realpath(path)

def inside(path, top):
    return path == top or path.startswith(top + os.sep)

def refuse(what):
    raise PermissionError(f'sandbox: {what} is not allowed')

def audit(event, args):
    if event in REFUSED:
        refuse(event)
    if event.startswith('ctypes.') and not (event == 'ctypes.dlopen' and args[0] is None):
        refuse(event)
    if event == 'open' and not isinstance(args[0], int) and args[0] is not None:
        path, mode, flags = args
        real = where(path)
        writing = flags & WRITE
        if writing and mode is None and not os.path.isabs(os.fsdecode(path)):
            refuse('os.open for writing with a relative path')
        if writing and not inside(real, root) and real != '/dev/null':
            refuse(f'writing {os.fsdecode(path)!r} (outside the working directory)')
        other_process = real.startswith('/proc/') and real.split('/')[2].isdigit()
        if other_process and not inside(real, own_proc):
            refuse(f'reading {os.fsdecode(path)!r} (another process)')
    for path_at, dir_fd_at in PATH_EVENTS.get(event, ()):
        path = args[path_at] if path_at < len(args) else None
        dir_fd = args[dir_fd_at] if dir_fd_at is not None and dir_fd_at < len(args) else None
        if isinstance(path, (str, bytes, os.PathLike)) and not inside(where(path, dir_fd), root):
            refuse(f'{event} on {os.fsdecode(path)!r} (outside the working directory)')

def print_traceback(e):
    """The traceback without this file's frames (the hook's, the exec's): from the program on."""
    shown = traceback.TracebackException(type(e), e, e.__traceback__)
    link = shown
    while link is not None:
        link.stack = traceback.StackSummary.from_list(
            [f for f in link.stack if f.filename != '<string>'])
        link = link.__cause__ or link.__context__
    sys.stderr.write(''.join(shown.format()))

sys.addaudithook(audit)
sys.argv = ['main.py']
try:
    with open('main.py', encoding='utf-8') as f:
        program = compile(f.read(), 'main.py', 'exec')
    exec(program, {'__name__': '__main__', '__builtins__': __builtins__})
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


def _read_output(proc, deadline, limit):
    """What the child printed, its middle cut to limit characters, and whether the deadline
    passed. Only the first and last 4*limit bytes are kept (each holds at least limit characters);
    at the deadline the process group is killed and what is left in the pipe read. The group is
    killed before the child is reaped, so its id cannot belong to anyone else yet."""
    fd, keep = proc.stdout.fileno(), 4 * limit
    head, tail, hidden, timed_out = bytearray(), bytearray(), 0, False
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0 and timed_out:
            break
        if left <= 0:
            timed_out = True
            _kill_group(proc)
            deadline = time.monotonic() + PYTHON_DRAIN_S
            continue
        if not poller.poll(left * 1000):
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
    while not timed_out and not _exited(proc):
        if time.monotonic() > deadline:
            timed_out = True
            break
        time.sleep(0.005)
    _kill_group(proc)
    if hidden:
        text = head.decode('utf-8', 'replace') + tail.decode('utf-8', 'replace')
    else:
        text = (head + tail).decode('utf-8', 'replace')
    return cut_middle(text, limit, hidden=hidden), timed_out


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
    _check_text(code, 'code', PYTHON_MAX_CODE_CHARS)
    root = tempfile.mkdtemp(prefix='tool-python-')
    try:
        with open(os.path.join(root, 'main.py'), 'w', encoding='utf-8') as f:
            f.write(code)
        limits = [math.ceil(timeout) + 1, PYTHON_MEMORY_BYTES, PYTHON_PROCESSES, PYTHON_FILE_BYTES]
        argv = [*_unshare_prefix(), sys.executable, '-I', '-B', '-u', '-X', 'utf8', '-c', CHILD,
                root, *map(str, limits)]
        env = {**SANDBOX_ENV, 'HOME': root, 'TMPDIR': root}
        deadline = time.monotonic() + timeout
        proc = subprocess.Popen(argv, cwd=root, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            # room for the status line below, so that run_call's cap cuts nothing more
            text, timed_out = _read_output(proc, deadline, limit=MAX_OUTPUT_CHARS - 80)
        finally:
            _kill_group(proc)
            status = proc.wait()
            proc.stdout.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    end = '' if text.endswith('\n') or not text else '\n'
    if timed_out:
        raise TimeoutError(f"{text}{end}error: timed out after {timeout:g} s")
    if status < 0:
        return f"{text}{end}error: killed by {_signal_name(-status)}"
    if status > 0 and not text:
        return f"error: exit status {status}"
    return text


DEFAULT_TOOLS = {'calculator': calculator, 'python': python}


# ----------------------------------------------------------------------------- finding calls

HERMES_OPEN, HERMES_CLOSE = '<tool_call>', '</tool_call>'
PYTHON_TAG = '<|python_tag|>'  # Llama 3.1+: may open a json call
# a call is the text between an opening and the next closing with no other opening between them
HERMES_CALL = re.compile(r'<tool_call>((?:(?!<tool_call>).)*?)</tool_call>', re.DOTALL)
# a fenced block: ``` and a word at a line's start, the body, then a line of ``` alone
FENCED_BLOCK = re.compile(r'^```(\w+)[ \t]*\n(.*?)^```[ \t]*$', re.MULTILINE | re.DOTALL)


def _check_style(style):
    if style not in STYLES:
        raise ValueError(f"unknown tool call style {style!r} (styles: {', '.join(STYLES)})")


def _is_tool_name(name, names):
    if names is None:
        return name != RESPONSE_FENCE
    return name in names


def call_closed(turn_text, style, *, names=None):
    """Whether turn_text (what the model wrote since the prompt or the last tool response) ends,
    trailing whitespace aside, with a call it has just closed: hermes, a '</tool_call>' closing the
    last '<tool_call>'; fenced, the closing fence of a ```name block. names: for fenced, the tool
    names that count (None: any word but 'output'); pass the tools so that a ```json block in an
    answer is not taken for a call."""
    _check_style(style)
    text = turn_text.rstrip()
    if style == 'json':
        return bool(parse_calls(text, style))
    if style == 'hermes':
        if not text.endswith(HERMES_CLOSE):
            return False
        before = text[:-len(HERMES_CLOSE)]
        return before.rfind(HERMES_OPEN) > before.rfind(HERMES_CLOSE)
    if not text.endswith('```'):
        return False
    blocks = list(FENCED_BLOCK.finditer(text))
    return bool(blocks) and blocks[-1].end() == len(text) and _is_tool_name(blocks[-1][1], names)


def _parse_error(message):
    return {'error': 'parse', 'message': f"error: cannot read the tool call: {message}"}


def _json_turn(turn_text):
    """json: the turn's one call, or [] when the turn is not a call (it does not start with '{',
    after an optional <|python_tag|>, or is a JSON object without a "name": an answer)."""
    text = turn_text.strip()
    if text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG):].lstrip()
    if not text.startswith('{'):
        return []
    try:
        call = json.loads(text, strict=False)
    except json.JSONDecodeError as e:
        return [_parse_error(f"not JSON ({e})")] if text.startswith('{"name"') else []
    if not isinstance(call, dict) or 'name' not in call:
        return []
    if 'parameters' in call and 'arguments' not in call:
        call = {'name': call['name'], 'arguments': call['parameters']}
    return [_hermes_call(json.dumps(call))]


def _hermes_call(body):
    try:
        # strict=False: a literal newline inside a string (code written across lines) is accepted
        call = json.loads(body, strict=False)
    except json.JSONDecodeError as e:
        return _parse_error(f"not JSON ({e})")
    if not isinstance(call, dict):
        return _parse_error('it must be a JSON object with "name" and "arguments"')
    name, arguments = call.get('name'), call.get('arguments', {})
    if not isinstance(name, str) or not name:
        return _parse_error('it has no "name"')
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments, strict=False)
        except json.JSONDecodeError as e:
            return _parse_error(f'"arguments" of {name} is a string that is not JSON ({e})')
    if not isinstance(arguments, dict):
        return _parse_error(f'"arguments" of {name} must be a JSON object')
    return {'name': name, 'arguments': arguments}


def parse_calls(turn_text, style, *, names=None):
    """Every call in turn_text, in order: {'name', 'arguments': dict}, or {'error': 'parse',
    'message'} for one that cannot be read (bad JSON, no name, arguments not an object).
    hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, arguments also as a JSON
    string holding an object, missing arguments as {}; an opening never closed is not a call.
    fenced: ```name\\nBODY\\n``` gives {'name': name, 'arguments': {'_body': BODY}}, which run_call
    hands to the tool's one required parameter. names: as in call_closed."""
    _check_style(style)
    if style == 'hermes':
        return [_hermes_call(m[1]) for m in HERMES_CALL.finditer(turn_text)]
    if style == 'json':
        return _json_turn(turn_text)
    calls = []
    for m in FENCED_BLOCK.finditer(turn_text):
        if _is_tool_name(m[1], names):
            body = m[2][:-1] if m[2].endswith('\n') else m[2]
            calls.append({'name': m[1], 'arguments': {'_body': body}})
    return calls


# ----------------------------------------------------------------------------- running calls

def _one_line(text):
    return ' '.join(str(text).split())


def _result(name, arguments, output, error, start):
    return {'name': name, 'arguments': arguments, 'output': cut_middle(output), 'error': error,
            'seconds': time.monotonic() - start}


def _call_into(fn, kwargs, box):
    """The worker thread's body: the tool's value as text, or what it raised."""
    try:
        box['output'] = str(fn(**kwargs))
    except BaseException as e:
        box['raised'] = e


def run_call(call, tools, timeout):
    """Run one parsed call: {'name', 'arguments', 'output', 'error', 'seconds'}. error is None, or
    'parse' (unreadable call or arguments), 'unknown' (no such tool), 'raised' (the tool raised;
    output 'error: ValueError: ...') or 'timeout'. output is what the model reads, str()-ed and
    cut to MAX_OUTPUT_CHARS. Never raises, and returns within timeout (+ TIMEOUT_SLACK_S for a
    tool with a keyword-only timeout, which gets the limit and keeps it: python kills its
    processes). A tool that raises TimeoutError is a 'timeout' with its message as the output
    (python's holds what the program printed). The tool runs in a thread of its own, and a thread
    cannot be killed: a tool that overruns is abandoned, still running, and its thread ends when
    the tool returns."""
    start = time.monotonic()
    name, arguments = call.get('name', ''), call.get('arguments', {})
    if call.get('error'):
        return _result(name, arguments, call.get('message', 'error: cannot read the tool call'),
                       'parse', start)
    if not isinstance(arguments, dict):
        return _result(name, arguments, 'error: the arguments must be a JSON object', 'parse',
                       start)
    fn = tools.get(name)
    if fn is None:
        message = f"error: unknown tool {name!r} (tools: {', '.join(tools)})"
        return _result(name, arguments, message, 'unknown', start)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}  # a builtin without a signature: called as it is
    settings = {k for k, p in params.items() if p.kind is p.KEYWORD_ONLY}
    if '_body' in arguments:
        needed = [k for k, p in params.items()
                  if p.kind is not p.KEYWORD_ONLY and p.default is p.empty]
        if len(needed) != 1:
            message = (f"error: tool {name!r} takes {len(needed)} required arguments, "
                       "and a fenced block gives it one")
            return _result(name, arguments, message, 'parse', start)
        arguments = {needed[0]: arguments['_body']}
    for key in arguments:
        if key in settings:
            message = f"error: TypeError: {name}() got an unexpected keyword argument {key!r}"
            return _result(name, arguments, message, 'raised', start)
    kwargs, wait = dict(arguments), timeout
    if 'timeout' in settings:
        kwargs['timeout'], wait = timeout, timeout + TIMEOUT_SLACK_S
    box = {}
    worker = threading.Thread(target=_call_into, args=(fn, kwargs, box), name=f'tool {name}',
                              daemon=True)
    worker.start()
    worker.join(wait)
    if worker.is_alive():
        return _result(name, arguments, f"error: timed out after {timeout:g} s", 'timeout', start)
    if 'output' in box:
        return _result(name, arguments, box['output'], None, start)
    e = box['raised']
    if isinstance(e, TimeoutError):
        message = str(e) or f"error: timed out after {timeout:g} s"
        return _result(name, arguments, message, 'timeout', start)
    message = f"error: {type(e).__name__}"
    if _one_line(e):
        message += f": {_one_line(e)}"
    return _result(name, arguments, message, 'raised', start)


def start_calls(calls, tools, timeout, pool):
    """Start every call on pool (a concurrent.futures executor): one future per call, each
    resolving to run_call's dict."""
    return [pool.submit(run_call, call, tools, timeout) for call in calls]


def tool_messages(results):
    """hermes: the chat messages that answer the calls, for the chat template to render."""
    return [{'role': 'tool', 'name': r['name'], 'content': r['output']} for r in results]


def response_text(results, style):
    """fenced: the text that answers the calls, a ```output block for each. It starts a line: put
    '\\n' before it if the model's text does not end with one. hermes answers are tool messages
    (tool_messages), which the chat template renders."""
    _check_style(style)
    if style == 'hermes':
        raise ValueError("hermes answers are tool messages for the chat template: use "
                         "tool_messages(results)")
    blocks = []
    for r in results:
        output = r['output'].rstrip('\n')
        blocks.append(f"```{RESPONSE_FENCE}\n{output}\n```\n")
    return ''.join(blocks)


# ----------------------------------------------------------------------------- template answers

TURN_STYLES = ('hermes', 'json')  # calls that end the turn, answered by the chat template
PROBE_RESULT = 'probe result 7'  # what the start-up check's tool returns


def schemas(tools):
    """The JSON schemas of tools ({name: function}), as a chat template's `tools` variable takes
    them."""
    return [json_schema(fn) for fn in tools.values()]


def template_variables(tools, style):
    """What render_chat takes to show tools to the model: hermes and json tools are shown by the
    chat template (its `tools` variable); fenced ones, and none, by the task's own prompt."""
    return {'tools': schemas(tools)} if style in TURN_STYLES else {}


def _probe(name, content, n_calls, system=None):
    """A conversation that ends with an assistant turn making n_calls calls of name."""
    call = {'type': 'function', 'function': {'name': name, 'arguments': {'x': content}}}
    messages = [{'role': 'user', 'content': f'question {content}'}]
    if system is not None:
        messages.insert(0, {'role': 'system', 'content': system})
    return messages + [{'role': 'assistant', 'content': content, 'tool_calls': [call] * n_calls}]


def _stop_positions(ids, stops):
    return [i for i, t in enumerate(ids) if t in stops]


def template_answers(tok, tools, style='hermes'):
    """hermes and json: checks once that tok's chat template can answer calls token in, token
    out, and returns answer(results) -> the token ids to insert after the stop token that ended a
    turn of calls: the rest of that turn as the template writes it, the tool messages, and the
    next assistant turn's generation prompt. They are the template's own delta, cut from one
    rendering of a short conversation (its user turn, an assistant turn of calls, the tool
    messages) after the stop token that ends the assistant turn, and tokenized whole (a result's
    newlines merge with the template's; special-token text in a result stays text, as in every
    message content).

    The model's own turn is never rendered again: what it sampled is kept as sampled. So what this
    needs is only that the delta does not depend on the conversation before it, which is checked
    here on conversations that differ in system turn, user text, assistant text and number of calls
    (a template that fails gets one ValueError naming its file). Qwen2.5's template passes and is
    also prefix-preserving (the turn renders the same whether or not a tool message follows).
    Qwen3's is not prefix-preserving (a last assistant turn gets an empty <think> block that
    vanishes once a tool message follows), which matters to a trainer that renders the whole
    conversation again after each turn (TRL swaps in a patched template for it); here it does not
    matter, since earlier turns are never rendered again, and Qwen3's delta passes the check."""
    where = getattr(tok, 'template_file', None) or 'the tokenizer'
    if getattr(tok, 'template', None) is None:
        raise ValueError(f"tool_style {style!r} answers calls through the snapshot's chat "
                         f"template, and {where} has none: use tool_style='fenced'")
    listed = schemas(tools)
    stops = set(tok.stop_ids)
    name = next(iter(tools))

    turn_ends = {}  # probe -> stop tokens before its assistant turn (rendered once per probe)

    def delta(results, probe=('probe', 1, None)):
        content, n_calls, system = probe
        before = _probe(name, content, n_calls, system)
        if probe not in turn_ends:
            turn_ends[probe] = len(_stop_positions(tok.render_chat(
                before[:-1], add_generation_prompt=False, tools=listed), stops))
        k = turn_ends[probe]
        ids = tok.render_chat(before + tool_messages(results), add_generation_prompt=True,
                              tools=listed)
        ends = _stop_positions(ids, stops)
        if len(ends) <= k:
            raise ValueError(f"{where}: the chat template does not end an assistant turn of tool "
                             "calls with a stop token, so tool answers cannot be inserted")
        return ids[ends[k] + 1:]

    prompt = tok.decode(tok.render_chat(_probe(name, 'probe', 1)[:-1], tools=listed))
    if name not in prompt:
        raise ValueError(f"{where}: the chat template does not show the tools (no {name!r} in a "
                         "prompt rendered with tools=...): the model cannot know them")
    results = [{'name': name, 'output': PROBE_RESULT}]
    want = delta(results)
    if PROBE_RESULT not in tok.decode(want):
        raise ValueError(f"{where}: the chat template does not render tool messages' contents")
    most = 3 if style == 'hermes' else 1  # a json turn is one call
    for probe in (('other text', 1, None), ('', most, 'a system turn'), ('x\n\n', 2, '')):
        probe = probe[:1] + (min(probe[1], most),) + probe[2:]
        if delta(results, probe) != want:
            raise ValueError(f"{where}: the chat template's tool answer depends on the turns "
                             "before it, so it cannot be inserted token in, token out: use "
                             "tool_style='fenced' or a template whose tool turns do not")

    def answer(results):
        return delta([{'name': r['name'], 'output': r['output']} for r in results])
    return answer
