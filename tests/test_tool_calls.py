"""Specification of the tools a rollout calls (tool_calls.py, sandbox.py): schemas equal transformers', the
calculator computes without eval, the python tool's guards hold against each thing a program might
do to the machine, calls are found and read in awkward text, and run_call never raises or hangs."""
import builtins
import concurrent.futures
import inspect
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from typing import Literal, Optional

import pytest

import sandbox
from sandbox import (DEFAULT_TOOLS, MAX_OUTPUT_CHARS, PYTHON_FILE_BYTES, PYTHON_MEMORY_BYTES, PYTHON_PROCESSES,
                     calculator, cut_middle, python)
from tokenizer import compile_chat_template
from tool_calls import (STYLES, call_closed, json_schema, parse_calls, response_text, run_call, start_calls,
                        tool_messages)

TIMEOUT = 2.0  # the time limit the sandbox tests run under
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code, timeout=TIMEOUT):
    return run_call({'name': 'python', 'arguments': {'code': code}}, DEFAULT_TOOLS, timeout)


def no_namespaces():
    return ()


# ----------------------------------------------------------------------------- schemas

def get_weather(city: str, days: int = 3) -> str:
    """Get the weather forecast for a city.

    Args:
        city: The city's name, e.g. "Paris".
        days: How many days ahead.

    Returns:
        The forecast, one line a day.
    """


def scale(values: list[int], factor: float, clip: bool = False, limit: Optional[float] = None):
    """Scale numbers by a factor,
    clipping them if asked.

    Args:
        values: The numbers
            to scale (continued on a deeper line).
        factor (float): What to multiply by.
        clip: Whether to clip.
        limit: The largest value kept when clipping.
    """


def lookup(key: str | int, table: dict[str, float], unit: Literal['m', 'km'] = 'm') -> float:
    """Look a key up in a table.

    Args:
        key: The key.
        table: The table.
        unit: The unit of the answer.
    """


def pick(tags: Optional[list[str]], mode: str = 'any') -> None:
    """Pick items by tags.

    Args:
        tags: Tags to match, or null for all.
        mode: How to match (choices: ["any", "all"])
    """


@pytest.mark.parametrize('fn', [get_weather, scale, lookup, pick, calculator])
def test_json_schema_equals_transformers(fn):
    utils = pytest.importorskip('transformers.utils')
    if not hasattr(utils, 'get_json_schema'):
        pytest.skip('this transformers has no get_json_schema')
    assert json_schema(fn) == utils.get_json_schema(fn)


def test_json_schema_leaves_out_keyword_only_settings():
    """python's timeout is run_call's to set: the model is shown only the code."""
    schema = json_schema(python)['function']
    assert schema['name'] == 'python'
    assert schema['parameters']['properties'].keys() == {'code'}
    assert schema['parameters']['required'] == ['code']


def test_json_schema_refuses_an_undocumented_argument():
    def f(x: int) -> int:
        """Nothing about x."""
    with pytest.raises(ValueError, match='do not describe x'):
        json_schema(f)


# ----------------------------------------------------------------------------- calculator

@pytest.mark.parametrize('expression, expected', [
    ('2 + 3 * 4', '14'),
    ('(2 + 3) * 4', '20'),
    ('7 / 2', '3.5'),            # inexact division gives a float
    ('8 / 2', '4'),              # exact division of integers stays an integer
    ('-8 / 2', '-4'),
    ('7 // 2', '3'),
    ('-7 // 2', '-4'),           # floor, as Python
    ('7 % 3', '1'),
    ('2 ** 10', '1024'),
    ('-3 ** 2', '-9'),           # ** binds tighter than unary minus
    ('2 ** -1', '0.5'),
    ('2.5 * 2', '5.0'),          # a float anywhere: a float
    ('0.1 + 0.2', '0.30000000000000004'),
    ('1e3', '1000.0'),
    ('1_000 * 3', '3000'),
    ('  12*(3+4) - 5 ', '79'),
    ('10 ** 100', '1' + '0' * 100),
    ('123456789 * 987654321', '121932631112635269'),
])
def test_calculator_answers(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize('expression, says', [
    ('x + 1', "name 'x'"),
    ('abs(-1)', 'function call'),
    ("__import__('os').system('true')", 'function call'),
    ('(1).real', 'attribute'),
    ('[1, 2][0]', 'not allowed'),
    ('lambda: 1', 'lambda'),
    ('1 if 1 else 2', 'not allowed'),
    ('True + 1', 'constant True'),
    ('1j * 2', 'constant 1j'),
    ("'a' * 3", "constant 'a'"),
    ('9**9**9', 'exponent'),
    ('2 ** 5000', 'exponent'),
    ('10 ** 101', 'too large'),
    ('10**60 * 10**60', 'too large'),
    ('1e308 * 10', 'too large'),
    ('(-8) ** 0.5', 'not a real number'),
    ('1 / 0', 'division by zero'),
    ('5 % 0', 'division by zero'),
    ('1 +', 'not an expression'),
    ('1' * 201, 'longer than'),
])
def test_calculator_refuses(expression, says):
    with pytest.raises(ValueError) as e:
        calculator(expression)
    assert says in str(e.value), str(e.value)
    assert '\n' not in str(e.value), 'the message the model reads is one line'


def test_calculator_never_evals(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError('calculator called eval or exec')
    monkeypatch.setattr(builtins, 'eval', refuse)
    monkeypatch.setattr(builtins, 'exec', refuse)
    assert calculator('6 * 7') == '42'
    with pytest.raises(ValueError):
        calculator("__import__('os').getcwd()")


# ----------------------------------------------------------------------------- the python tool

def test_python_prints():
    r = run_python("print(sum(range(101)))\nx = 5\nx")
    assert (r['error'], r['output']) == (None, '5050\n'), 'the last expression is not printed'


def test_python_repl_keeps_what_earlier_programs_of_the_rollout_did():
    """python_repl: a later call sees an earlier one's names, imports and files, and what ran
    before an error, but not its output; a program that timed out is not kept; another rollout's
    state starts empty, and plain python keeps nothing."""
    tools, state, other = {'python_repl': sandbox.python_repl}, {}, {}

    def call(code, st, timeout=TIMEOUT):
        return run_call({"name": "python_repl", "arguments": {"code": code}}, tools,
                        timeout, state=st)
    assert call("import math\nx = 6 * 7\nprint('once')", state)['output'] == 'once\n'
    assert call("open('f.txt', 'w').write(str(x))\ny = 1\n1 / 0\nz = 2", state)['error'] is None
    r = call("print(x + 1, round(math.pi, 2), open('f.txt').read(), y, 'z' in dir())", state)
    assert r['output'] == '43 3.14 42 1 False\n', r['output']
    assert call("w = 0\nwhile True:\n    pass", state, timeout=1.0)['error'] == 'timeout'
    assert "NameError: name 'w' is not defined" in call("print(w)", state)['output']
    assert len(state['python_cells']) == 4  # the timed-out one left out
    assert "NameError: name 'x' is not defined" in call("print(x)", other)['output']
    assert "NameError" in run_python("print(x)")['output']


def test_python_infinite_loop_is_killed_and_keeps_what_it_printed():
    r = run_python("print('started')\nwhile True:\n    pass")
    assert r['error'] == 'timeout', r
    assert r['output'].startswith('started\n'), r['output']
    assert r['output'].endswith(f'error: timed out after {TIMEOUT:g} s'), r['output']
    assert r['seconds'] < 1.5 * TIMEOUT


def test_python_memory_is_limited():
    r = run_python('x = bytearray(10**10)\nprint("allocated")')
    assert 'MemoryError' in r['output'] and 'allocated' not in r['output'], r['output']
    assert r['seconds'] < 1.5 * TIMEOUT


def test_python_limits_are_set():
    """Each rlimit, read from inside the program (RLIMIT_NPROC holds for users other than root)."""
    code = ('import resource as r\n'
            'print([r.getrlimit(k)[0] for k in (r.RLIMIT_CPU, r.RLIMIT_AS, r.RLIMIT_NPROC, '
            'r.RLIMIT_FSIZE, r.RLIMIT_CORE)])')
    r = run_python(code)
    expected = [int(TIMEOUT) + 1, PYTHON_MEMORY_BYTES, PYTHON_PROCESSES, PYTHON_FILE_BYTES, 0]
    assert r['output'] == f'{expected}\n', r['output']


def test_python_fork_bomb_fails_fast():
    # First a single fork, harmless if it went through: the bomb runs only if forking is refused,
    # so a broken guard fails this test without starting a fork bomb on the machine.
    probe = run_python("import os\nif os.fork() == 0:\n    os._exit(0)\nprint('forked')")
    assert 'forked' not in probe['output'], 'fork is not refused: the bomb is not started'
    assert 'PermissionError' in probe['output'], probe['output']
    r = run_python('import os\nwhile True:\n    os.fork()', timeout=1.0)
    assert r['error'] is None and 'os.fork is not allowed' in r['output'], r
    assert r['seconds'] < 1.0


def test_python_ctypes_is_refused_beyond_its_import():
    r = run_python('import ctypes\nlibc = ctypes.CDLL(None)\nprint(libc.getpid())')
    assert 'sandbox: ctypes.dlsym is not allowed' in r['output'], r['output']


def test_python_crash_is_reported():
    """A C stack overflow (repr of a list nested 100000 deep) kills the interpreter."""
    r = run_python("print('before')\nimport sys\nsys.setrecursionlimit(10**7)\nx = []\n"
                   "for _ in range(10**5):\n    x = [x]\nrepr(x)", timeout=10.0)
    assert (r['error'], r['output']) == (None, 'before\nerror: killed by SIGSEGV'), r


def test_python_output_is_capped_in_the_middle():
    r = run_python("print('a' + 'é' * 10**6 + 'z')")
    out = r['output']
    assert len(out) <= MAX_OUTPUT_CHARS
    assert out.startswith('aé') and out.endswith('éz\n'), (out[:20], out[-20:])
    head, rest = out.split('\n... [')
    cut, tail = rest.split(' characters cut] ...\n')
    assert len(head) + int(cut) + len(tail) == 10**6 + 3, 'what was cut is counted in characters'


def test_python_writes_only_in_its_working_directory(tmp_path):
    # /etc/passwd opened for appending, which changes nothing were it allowed; truncation is
    # tried on a file of the test's own
    victim = tmp_path / 'victim.txt'
    victim.write_text('intact')
    code = (f"open('ok.txt', 'w').write('hi')\nprint(open('ok.txt').read())\n"
            f"for path, mode in (('/etc/passwd', 'a'), ({str(victim)!r}, 'w')):\n"
            "    try:\n"
            "        open(path, mode)\n"
            "        print('opened', path)\n"
            "    except PermissionError as e:\n"
            "        print(e)\n"
            f"import os\nos.remove({str(victim)!r})")
    r = run_python(code)
    lines = r['output'].splitlines()
    assert lines[0] == 'hi', r['output']
    assert 'opened' not in r['output'], r['output']
    assert lines[1].startswith("sandbox: writing '/etc/passwd'"), r['output']
    assert 'os.remove' in r['output'] and 'PermissionError' in r['output'], r['output']
    assert victim.read_text() == 'intact'


def test_python_working_directory_is_deleted():
    r = run_python('import os\nprint(os.getcwd())')
    path = r['output'].strip()
    assert os.path.basename(path).startswith('call-'), path
    assert os.path.basename(os.path.dirname(path)).startswith('tool-python-'), path
    assert not os.path.exists(path)


@pytest.mark.parametrize('namespaces', [True, False])
def test_python_sees_none_of_our_environment(monkeypatch, namespaces):
    """Neither its own environment nor, through /proc/PID/environ, that of a process of ours
    started with a secret in it (as a trainer is started with its tokens)."""
    if not namespaces:
        monkeypatch.setattr(sandbox, '_unshare_prefix', no_namespaces)
    secret = 'hunter2-tool-calls-test'
    monkeypatch.setenv('GRPO_TOOL_SECRET', secret)
    ours = subprocess.Popen(['sleep', '30'])
    try:
        code = ("import os\nprint(dict(os.environ))\n"
                f"try:\n    print(open('/proc/{ours.pid}/environ').read())\n"
                "except OSError as e:\n    print(type(e).__name__)")
        r = run_python(code)
    finally:
        ours.kill()
        ours.wait()
    assert 'PATH' in r['output'], r['output']
    assert secret not in r['output'], 'the program read our environment'


@pytest.mark.parametrize('namespaces', [True, False])
def test_python_cannot_connect(monkeypatch, namespaces):
    if not namespaces:
        monkeypatch.setattr(sandbox, '_unshare_prefix', no_namespaces)
    with socket.socket() as listener:
        listener.bind(('127.0.0.1', 0))
        listener.listen()
        listener.settimeout(0.2)
        port = listener.getsockname()[1]
        r = run_python(f"import socket\nsocket.socket().connect(('127.0.0.1', {port}))\n"
                       "print('connected')")
        assert 'connected' not in r['output'], r['output']
        assert 'socket.connect is not allowed' in r['output'], r['output']
        with pytest.raises(socket.timeout):
            listener.accept()


def test_python_namespaces_where_unshare_works():
    """The second layer, under the audit hook: no network namespace of ours, no process of ours."""
    if not sandbox._unshare_prefix():
        pytest.skip('unshare does not work here: the audit hook is the only guard')
    r = run_python("import os\nprint(os.readlink('/proc/self/ns/net'))\n"
                   "print([p for p in os.listdir('/proc') if p.isdigit()])")
    net, pids = r['output'].splitlines()
    assert net != os.readlink('/proc/self/ns/net')
    assert pids == "['1']", 'the program sees processes other than its own'


def test_python_stdin_is_closed():
    """Our stdin holds a line while the program runs: the program reads nothing of it."""
    read_end, write_end = os.pipe()
    os.write(write_end, b'typed by us\n')
    os.close(write_end)
    saved = os.dup(0)
    os.dup2(read_end, 0)
    try:
        r = run_python('print(input())')
    finally:
        os.dup2(saved, 0)
        os.close(saved)
        os.close(read_end)
    assert 'EOFError' in r['output'] and 'typed' not in r['output'], r['output']


def test_python_numpy_works_within_the_limits():
    pytest.importorskip('numpy')
    r = run_python('import numpy as np\nx = np.arange(9.0).reshape(3, 3)\nprint((x @ x).sum())')
    assert r['output'] == '486.0\n', r['output']  # rows of x @ x sum to 54, 162 and 270


# ----------------------------------------------------------------------------- concurrency

def sleepy(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return 'awake'


def test_calls_run_side_by_side_and_time_out_together():
    calls = [{'name': 'sleepy', 'arguments': {'seconds': 10}}] * 16
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = [f.result() for f in start_calls(calls, {'sleepy': sleepy}, TIMEOUT, pool)]
    elapsed = time.monotonic() - start
    assert [r['error'] for r in results] == ['timeout'] * 16
    assert results[0]['output'] == f'error: timed out after {TIMEOUT:g} s'
    assert elapsed < 2 * TIMEOUT, f'16 calls of {TIMEOUT} s took {elapsed:.1f} s'


def test_python_calls_run_side_by_side():
    calls = [{'name': 'python', 'arguments': {'code': 'while True: pass'}}] * 8
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = [f.result() for f in start_calls(calls, DEFAULT_TOOLS, TIMEOUT, pool)]
    elapsed = time.monotonic() - start
    assert [r['error'] for r in results] == ['timeout'] * 8
    assert elapsed < 2 * TIMEOUT, f'8 programs of {TIMEOUT} s took {elapsed:.1f} s'


# ----------------------------------------------------------------------------- finding calls

# What Qwen2.5's chat template writes for an assistant message's tool calls (its assistant branch,
# with Qwen3's "arguments is string" case), rendered as transformers renders templates.
QWEN_TOOL_CALLS = (
    "{%- for message in messages %}{{- message.content }}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{%- endfor %}")


def test_hermes_reads_what_qwens_template_writes():
    awkward = {'flag': False, 'on': True, 'none': None, 'quote': 'say "hi" \\ \'x\'',
               'unicode': 'é 😀 \u2028', 'code': 'for i in range(3):\n    print(i)',
               'nested': {'list': [1, 2.5, {'deep': []}]}}
    calls = [{'type': 'function', 'function': {'name': 'python', 'arguments': awkward}},
             {'type': 'function', 'function': {'name': 'calculator',
                                               'arguments': json.dumps({'expression': '6*7'})}}]
    template = compile_chat_template(QWEN_TOOL_CALLS, 'test')
    text = template.render(messages=[{'role': 'assistant', 'content': 'Let me check.',
                                      'tool_calls': calls}])
    assert call_closed(text, 'hermes')
    assert parse_calls(text, 'hermes') == [{'name': 'python', 'arguments': awkward},
                                           {'name': 'calculator',
                                            'arguments': {'expression': '6*7'}}]


HERMES_CASES = [
    # (turn text, closed, calls)
    ('<tool_call>{"name": "f", "arguments": {"a": false, "b": true, "c": null}}</tool_call>',
     True, [{'name': 'f', 'arguments': {'a': False, 'b': True, 'c': None}}]),
    ('<tool_call>{"name": "f", "arguments": {"s": "\\"quoted\\" \\u00e9\\ud83d\\ude00"}}'
     '</tool_call>\n\n  ', True, [{'name': 'f', 'arguments': {'s': '"quoted" é😀'}}]),
    ('<tool_call>\n\t {"name":"f",\n"arguments":{"code":"x = 1\nprint(x)"}}  \n</tool_call>',
     True, [{'name': 'f', 'arguments': {'code': 'x = 1\nprint(x)'}}]),  # a raw newline in a string
    ('<tool_call>{"name": "f", "arguments": "{\\"n\\": 3}"}</tool_call>',
     True, [{'name': 'f', 'arguments': {'n': 3}}]),  # arguments as a JSON string
    ('<tool_call>{"name": "f"}</tool_call>', True, [{'name': 'f', 'arguments': {}}]),
    ('a <tool_call>{"name": "f", "arguments": {}}</tool_call> b '
     '<tool_call>{"name": "g", "arguments": {"x": 1}}</tool_call>',
     True, [{'name': 'f', 'arguments': {}}, {'name': 'g', 'arguments': {'x': 1}}]),
    ('<tool_call>{"name": "f", "arguments": {"x": 1}', False, []),  # not closed yet
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call> and then text', False,
     [{'name': 'f', 'arguments': {}}]),
    ('an answer with </tool_call>', False, []),
    ('<tool_call>{"name": "f", "arg <tool_call>{"name": "g", "arguments": {}}</tool_call>',
     True, [{'name': 'g', 'arguments': {}}]),  # an opening never closed is not a call
]


@pytest.mark.parametrize('text, closed, calls', HERMES_CASES)
def test_hermes_calls(text, closed, calls):
    assert call_closed(text, 'hermes') is closed
    assert parse_calls(text, 'hermes') == calls


@pytest.mark.parametrize('body, says', [
    ('{"name": "f", "arguments": {"x": 1,}}', 'not JSON'),
    ("{'name': 'f', 'arguments': {}}", 'not JSON'),
    ('{"name": "f", "arguments": {}} extra', 'not JSON'),
    ('["f", {}]', 'JSON object'),
    ('{"arguments": {"x": 1}}', 'no "name"'),
    ('{"name": "", "arguments": {}}', 'no "name"'),
    ('{"name": "f", "arguments": [1, 2]}', 'must be a JSON object'),
    ('{"name": "f", "arguments": "{oops"}', 'string that is not JSON'),
    ('{"name": "f", "arguments": "[1]"}', 'must be a JSON object'),
])
def test_hermes_malformed_call_is_a_parse_error(body, says):
    text = f'<tool_call>{body}</tool_call>'
    assert call_closed(text, 'hermes')
    [call] = parse_calls(text, 'hermes')
    assert call['error'] == 'parse' and says in call['message'], call
    r = run_call(call, DEFAULT_TOOLS, TIMEOUT)
    assert (r['error'], r['output']) == ('parse', call['message'])


FENCED_CASES = [
    # (turn text, names, closed, calls)
    ("Let me compute.\n```python\nprint(6*7)\n```", None, True,
     [{'name': 'python', 'arguments': {'_body': 'print(6*7)'}}]),
    ("```python\nprint(1)\n```\n \n", DEFAULT_TOOLS, True,
     [{'name': 'python', 'arguments': {'_body': 'print(1)'}}]),
    ("```python\nprint(1)\n", DEFAULT_TOOLS, False, []),  # not closed yet
    ("```python\nprint(1)\n```\nSo the answer is 1.", DEFAULT_TOOLS, False,
     [{'name': 'python', 'arguments': {'_body': 'print(1)'}}]),
    ("Here is JSON:\n```json\n{\"a\": 1}\n```", DEFAULT_TOOLS, False, []),  # not a tool
    ("Here is JSON:\n```json\n{\"a\": 1}\n```", None, True,
     [{'name': 'json', 'arguments': {'_body': '{"a": 1}'}}]),
    ("```output\n42\n```", None, False, []),  # the answer's fence is never a call
    ("Inline ```python print(1)``` is no fence.\n```calculator\n2**10\n```", None, True,
     [{'name': 'calculator', 'arguments': {'_body': '2**10'}}]),
    ("```python\n```", None, True, [{'name': 'python', 'arguments': {'_body': ''}}]),
    ("```python\ns = '''\na\n'''\nprint(s)\n```\ntext\n```calculator\n1+1\n```", None, True,
     [{'name': 'python', 'arguments': {'_body': "s = '''\na\n'''\nprint(s)"}},
      {'name': 'calculator', 'arguments': {'_body': '1+1'}}]),
    ("```python\nprint(1)\n```python", None, False, []),  # a fence with a word opens, never closes
]


@pytest.mark.parametrize('text, names, closed, calls', FENCED_CASES)
def test_fenced_calls(text, names, closed, calls):
    assert call_closed(text, 'fenced', names=names) is closed
    assert parse_calls(text, 'fenced', names=names) == calls


def test_unknown_style_is_refused():
    assert STYLES == ('hermes', 'json', 'fenced')
    with pytest.raises(ValueError, match='unknown tool call style'):
        call_closed('x', 'xml')


# ----------------------------------------------------------------------------- running calls

def add(a: int, b: int) -> int:
    """Add.

    Args:
        a: A number.
        b: Another.
    """
    return a + b


def broken(x: str) -> str:
    """Fail.

    Args:
        x: Anything.
    """
    raise ValueError(f'bad input\n{x}')


def as_dict(x: str) -> dict:
    """Return a dict.

    Args:
        x: A value.
    """
    return {'x': x}


def chatty(n: int) -> str:
    """Talk a lot.

    Args:
        n: How much.
    """
    return 'ab' * n


TOOLS = {'add': add, 'broken': broken, 'as_dict': as_dict, 'chatty': chatty, **DEFAULT_TOOLS}


def test_run_call_unknown_tool():
    r = run_call({'name': 'search', 'arguments': {'q': 'x'}}, DEFAULT_TOOLS, TIMEOUT)
    assert r['error'] == 'unknown'
    assert r["output"] == "error: unknown tool 'search' (tools: calculator, python, python_repl)"


def test_run_call_tool_that_raises():
    r = run_call({'name': 'broken', 'arguments': {'x': 'y'}}, TOOLS, TIMEOUT)
    assert (r['error'], r['output']) == ('raised', 'error: ValueError: bad input y')


def test_run_call_calculator_error_reaches_the_model():
    r = run_call({'name': 'calculator', 'arguments': {'expression': 'x'}}, TOOLS, TIMEOUT)
    assert r['error'] == 'raised' and r['output'].startswith("error: ValueError: the name 'x'")


def test_run_call_wrong_arguments():
    r = run_call({'name': 'add', 'arguments': {'a': 1, 'c': 2}}, TOOLS, TIMEOUT)
    assert r['error'] == 'raised' and 'TypeError' in r['output'] and "'c'" in r['output'], r
    r = run_call({'name': 'python', 'arguments': {'code': 'print(1)', 'timeout': 999}}, TOOLS,
                 TIMEOUT)
    assert r['error'] == 'raised' and "argument 'timeout'" in r['output'], r
    r = run_call({'name': 'add', 'arguments': [1, 2]}, TOOLS, TIMEOUT)
    assert r['error'] == 'parse' and 'JSON object' in r['output'], r


async def lookup(word: str) -> str:
    """Look a word up (an async tool: an HTTP API's shape).

    Args:
        word: the word
    """
    import asyncio
    await asyncio.sleep(0)
    if word == 'slow':
        await asyncio.sleep(30)
    if word == 'bad':
        raise KeyError(word)
    return word.upper()


def test_an_async_tool_is_awaited_raises_and_times_out_like_any_tool():
    from tool_calls import json_schema
    tools = {'lookup': lookup}
    assert run_call({'name': 'lookup', 'arguments': {'word': 'abc'}}, tools, TIMEOUT)['output'] == 'ABC'
    r = run_call({'name': 'lookup', 'arguments': {'word': 'bad'}}, tools, TIMEOUT)
    assert (r['error'], r['output']) == ('raised', "error: KeyError: 'bad'"), r
    r = run_call({'name': 'lookup', 'arguments': {'word': 'slow'}}, tools, 0.5)
    assert r['error'] == 'timeout' and r['seconds'] < 5, r
    assert json_schema(lookup)["function"]["parameters"]["properties"]["word"]["type"] == "string"


def test_run_call_output_is_str_and_capped():
    r = run_call({'name': 'as_dict', 'arguments': {'x': 'y'}}, TOOLS, TIMEOUT)
    assert (r['error'], r['output']) == (None, "{'x': 'y'}")
    r = run_call({'name': 'add', 'arguments': {'a': 40, 'b': 2}}, TOOLS, TIMEOUT)
    assert r['output'] == '42'
    r = run_call({'name': 'chatty', 'arguments': {'n': 10**5}}, TOOLS, TIMEOUT)
    assert len(r['output']) <= MAX_OUTPUT_CHARS and '[198' in r['output'], r['output'][:50]
    assert r['output'].startswith('abab') and r['output'].endswith('abab')
    assert isinstance(r['seconds'], float)


def test_run_call_fenced_body_fills_the_one_required_parameter():
    text = "```calculator\n2 ** 10\n```\n```python\nprint('hi')\n```\n```add\n1\n```"
    results = [run_call(c, TOOLS, TIMEOUT) for c in parse_calls(text, 'fenced', names=TOOLS)]
    assert [(r['error'], r['output']) for r in results[:2]] == [(None, '1024'), (None, 'hi\n')]
    assert results[0]['arguments'] == {'expression': '2 ** 10'}
    assert results[2]['error'] == 'parse' and 'takes 2 required arguments' in results[2]['output']


def test_answers():
    results = [{'name': 'python', 'arguments': {}, 'output': '42\n', 'error': None, 'seconds': 0},
               {'name': 'calculator', 'arguments': {}, 'output': 'error: ValueError: x',
                'error': 'raised', 'seconds': 0}]
    assert response_text(results, 'fenced') == ("```output\n42\n```\n"
                                                "```output\nerror: ValueError: x\n```\n")
    assert tool_messages(results) == [
        {'role': 'tool', 'name': 'python', 'content': '42\n'},
        {'role': 'tool', 'name': 'calculator', 'content': 'error: ValueError: x'}]
    with pytest.raises(ValueError, match='tool_messages'):
        response_text(results, 'hermes')


@pytest.mark.parametrize('n', [0, MAX_OUTPUT_CHARS, MAX_OUTPUT_CHARS + 1, 10**5])
def test_cut_middle(n):
    text = ''.join(chr(ord('a') + i % 26) for i in range(n))
    out = cut_middle(text)
    if n <= MAX_OUTPUT_CHARS:
        assert out == text
        return
    assert len(out) <= MAX_OUTPUT_CHARS
    head, rest = out.split('\n... [')
    cut, tail = rest.split(' characters cut] ...\n')
    assert text.startswith(head) and text.endswith(tail)
    assert len(head) + int(cut) + len(tail) == n


# ----------------------------------------------------------------------------- attacks

# Each attack runs in a trainer of its own (this driver, calling python() once), started in a pid
# namespace of its own, so that a guard that fails kills or leaves behind nothing of the test run.
# setup runs before the call and may define after(), whose value comes back with the output.
ATTACK_DRIVER = r'''
import json, os, sys, time
import sandbox
code, namespaces, setup, timeout = sys.argv[1], sys.argv[2] == '1', sys.argv[3], float(sys.argv[4])
if not namespaces:
    sandbox._unshare_prefix = lambda: ()
exec(setup)
start = time.monotonic()
try:
    out = sandbox.python(code.replace('TRAINER', str(os.getpid())), timeout=timeout)
except TimeoutError as e:
    out = str(e)
seconds = time.monotonic() - start
print(json.dumps({'output': out, 'seconds': seconds, 'after': after() if 'after' in dir() else None}))
'''
# pid 1 of a pid namespace ignores the signals it is sent from inside it: the driver runs as pid 2
PID_1 = 'import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))'
# what a program that escapes the audit hook (compiled code) could run: it goes in before the hook
HOOK_LINE = 'sys.addaudithook(audit)\n'


def attacks_can_run():
    unshare = shutil.which('unshare')
    if os.geteuid() != 0 or unshare is None:
        pytest.skip('the attacks run as root in pid namespaces of their own (unshare)')
    probe = subprocess.run([unshare, '--pid', '--fork', '--kill-child', '--mount-proc', 'true'],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f'unshare --pid does not work here: {probe.stderr.decode()[-200:]}')
    return unshare


def attack(code, namespaces, *, setup='', timeout=TIMEOUT, env=None):
    """What python(code) returned to a trainer of its own, as root in a fresh pid namespace, with
    the tool's namespaces as shipped or forced off; TRAINER in code is the trainer's pid."""
    unshare = attacks_can_run()
    argv = [unshare, '--pid', '--fork', '--kill-child', '--mount-proc', sys.executable, '-c', PID_1,
            sys.executable, '-c', ATTACK_DRIVER, code, str(int(namespaces)), setup, str(timeout)]
    r = subprocess.run(argv, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True,
                       timeout=timeout + 60)
    assert r.returncode == 0, f'the trainer died ({r.returncode}): {r.stderr.decode()[-3000:]}'
    return json.loads(r.stdout.decode().splitlines()[-1])


def marked_processes(mark, wait=0.0):
    """The live processes whose command line holds mark, but for this one and its parent, after
    waiting up to wait seconds for them to go."""
    found = []
    for pid in set(filter(str.isdigit, os.listdir('/proc'))) - {str(os.getpid()), str(os.getppid())}:
        try:
            with open(f'/proc/{pid}/cmdline', 'rb') as f:
                cmdline = f.read().replace(b'\0', b' ').decode(errors='replace')
            with open(f'/proc/{pid}/stat') as f:
                state = f.read().rsplit(')', 1)[1].split()[0]
        except OSError:
            continue
        if mark in cmdline and state != 'Z':
            found.append(cmdline)
    if found and wait > 0:
        time.sleep(0.01)
        return marked_processes(mark, wait - 0.01)
    return found


@pytest.mark.parametrize('namespaces', [True, False])
def test_attack_pidfd_cannot_signal_the_trainer(namespaces):
    """signal.pidfd_send_signal on os.pidfd_open (no audit event for either): refused, as are the
    ways back to the real functions (posix imported again, a fresh posix module)."""
    code = ("import importlib.util, os, signal, sys\n"
            "def attempt(what, f):\n"
            "    try:\n"
            "        f()\n"
            "        print(what, 'went through')\n"
            "    except Exception as e:\n"
            "        print(what, e)\n"
            "attempt('pidfd', lambda: signal.pidfd_send_signal(os.pidfd_open(TRAINER), 9))\n"
            "spec = importlib.util.find_spec('posix')\n"
            "attempt('fresh', lambda: importlib.util.module_from_spec(spec).pidfd_open(TRAINER))\n"
            "def again():\n"
            "    del sys.modules['posix']\n"
            "    import posix\n"
            "    posix.pidfd_open(TRAINER)\n"
            "attempt('again', again)\n")
    out = attack(code, namespaces)['output']
    assert 'went through' not in out, out
    assert 'pidfd sandbox: os.pidfd_open is not allowed' in out, out
    assert 'fresh sandbox:' in out and 'again sandbox:' in out, out


@pytest.mark.parametrize('namespaces', [True, False])
def test_attack_dir_fd_cannot_read_another_process(namespaces):
    """os.open(relative, dir_fd=...) of the trainer's /proc/PID/environ, through /proc, / and the
    /dev/fd link: the 'open' audit event does not carry dir_fd, so os.open checks it itself."""
    secret = 'hunter2-dir-fd-attack'
    code = ("import os\n"
            "for top, path in (('/proc', 'TRAINER/environ'), ('/', 'proc/TRAINER/environ'),\n"
            "                  ('/dev', 'fd/../../TRAINER/environ')):\n"
            "    try:\n"
            "        fd = os.open(top, os.O_RDONLY)\n"
            "        print(os.read(os.open(path, os.O_RDONLY, dir_fd=fd), 10**6))\n"
            "    except OSError as e:\n"
            "        print(top, e)\n")
    out = attack(code, namespaces, env={'GRPO_TOOL_SECRET': secret})['output']
    assert secret not in out, 'the program read the trainer\'s environment'
    assert out.count('(another process) is not allowed') == 3, out


@pytest.mark.parametrize('namespaces', [True, False])
def test_attack_fork_exec_is_refused(tmp_path, namespaces):
    """_posixsubprocess.fork_exec (no audit event) starting a shell that appends to a file of the
    trainer's and leaves a daemon."""
    victim = tmp_path / 'victim.txt'
    victim.write_text('intact')
    mark = f'{time.time_ns() % 10**9}'
    code = ("import _posixsubprocess, os, time\n"
            "r, w = os.pipe()\n"
            f"args = [b'/bin/sh', b'-c', b'echo pwned >> {victim}; setsid sleep 30.{mark} &']\n"
            "try:\n"
            "    _posixsubprocess.fork_exec(args, [args[0]], True, (w,), None, None, -1, -1, -1, -1,\n"
            "                               -1, -1, r, w, True, False, -1, None, None, None, -1,\n"
            "                               None, False)\n"
            "    time.sleep(0.5)\n"
            "    print('started')\n"
            "except Exception as e:\n"
            "    print(e)\n")
    setup = f'def after():\n    return marked_processes({mark!r}, wait=0.5)\n'
    r = attack(code, namespaces, setup=MARKED + setup)
    assert victim.read_text() == 'intact'
    assert 'sandbox: _posixsubprocess.fork_exec is not allowed' in r['output'], r['output']
    assert r['after'] == [], 'a process of the program outlived the call'


# marked_processes, for a driver's after()
MARKED = 'import os, time\n' + inspect.getsource(marked_processes) + '\n'


@pytest.mark.parametrize('namespaces', [True, False])
def test_attack_past_the_hook_runs_unprivileged_and_dies_with_the_call(tmp_path, namespaces):
    """What compiled code could do past the audit hook (put in before the hook here): as a uid of
    its own, it cannot write a file of the trainer's, RLIMIT_NPROC holds, and a daemon it started
    with setsid is gone when the call returns."""
    victim = tmp_path / 'victim.txt'
    victim.write_text('intact')
    mark = f'{time.time_ns() % 10**9}'
    inject = ("import threading\n"
              "print(os.getuid(), os.geteuid(), os.getgid(), os.getgroups())\n"
              "try:\n"
              f"    open({str(victim)!r}, 'a').write('pwned')\n"
              "except OSError as e:\n"
              "    print(e)\n"
              "if os.fork() == 0:\n"
              "    os.setsid()\n"
              f"    os.execv('/bin/sleep', ['sleep', '30.{mark}'])\n"
              "threading.stack_size(1 << 18)\n"
              "stop, started = threading.Event(), 0\n"
              "try:\n"
              "    for _ in range(200):\n"
              "        threading.Thread(target=stop.wait).start()\n"
              "        started += 1\n"
              "except RuntimeError as e:\n"
              "    print(e)\n"
              "stop.set()\n"
              "print('threads', started)\n")
    setup = (f"assert {HOOK_LINE!r} in sandbox.CHILD\n"
             f"sandbox.CHILD = sandbox.CHILD.replace({HOOK_LINE!r}, {inject!r} + {HOOK_LINE!r})\n"
             f"def after():\n    return marked_processes({mark!r}, wait=0.5)\n")
    r = attack('print("done")', namespaces, setup=MARKED + setup)
    out = r['output']
    ids = [int(x) for x in out.splitlines()[0].split()[:3]]
    assert 0 not in ids and out.splitlines()[0].endswith('[]'), out
    assert victim.read_text() == 'intact' and 'Permission denied' in out, out
    started = int(out.split('threads ')[1].split()[0])
    assert started < sandbox.PYTHON_PROCESSES, out
    assert r['after'] == [], 'a daemon of the program outlived the call'


@pytest.mark.parametrize('namespaces', [True, False])
def test_attack_disk_is_capped(namespaces):
    """48 files of 15 MiB (720 MiB): the working directory holds at most PYTHON_DISK_BYTES, a tmpfs
    that size in the mount namespace, else the call is killed once its files pass it."""
    code = ("n, block = 0, b'x' * (15 << 20)\n"
            "for i in range(48):\n"
            "    with open(f'f{i}', 'wb') as f:\n"
            "        f.write(block)\n"
            "    n += len(block)\n"
            "    print(n, flush=True)\n")
    r = attack(code, namespaces, timeout=10.0)
    cap = getattr(sandbox, 'PYTHON_DISK_BYTES', 64 << 20)
    written = [int(line) for line in r['output'].splitlines() if line.isdigit()]
    assert max(written, default=0) <= cap + (32 << 20), r['output']
    assert 'No space left on device' in r['output'] or 'disk cap' in r['output'], r['output']
    assert r['seconds'] < 5.0, r


@pytest.mark.parametrize('namespaces', [True, False])
def test_attack_a_killed_trainers_files_and_processes_go(tmp_path, namespaces):
    """A trainer killed in the middle of a call leaves its working directory (and, without a pid
    namespace, its program): the next trainer's first call removes both, and a trainer that exits
    leaves nothing in the temp dir."""
    tmp = tmp_path / 'tmp'
    tmp.mkdir()
    setup = ("import glob, subprocess\n"
             "first = subprocess.Popen([sys.executable, '-c', 'import sandbox, sys\\n'\n"
             "    'if sys.argv[1] != \"1\":\\n    sandbox._unshare_prefix = lambda: ()\\n'\n"
             "    'sandbox.python(\"import time\\\\ntime.sleep(60)\", timeout=60)', sys.argv[2]])\n"
             "while not glob.glob(os.environ['TMPDIR'] + '/**/main.py', recursive=True):\n"
             "    time.sleep(0.05)\n"
             "time.sleep(0.3)\n"
             "first.kill()\n"
             "first.wait()\n"
             "firsts = set(os.listdir(os.environ['TMPDIR']))\n"
             "def after():\n"
             "    left = sorted(firsts & set(os.listdir(os.environ['TMPDIR'])))\n"
             "    return left, marked_processes(os.environ['TMPDIR'])\n")
    r = attack('print("hi")', namespaces, setup=MARKED + setup, env={'TMPDIR': str(tmp)})
    left, programs = r['after']
    assert r['output'] == 'hi\n'
    assert left == [], 'the killed trainer\'s working directory is still there'
    assert programs == [], 'the killed trainer\'s program still runs'
    assert os.listdir(tmp) == [], 'the second trainer left its files'
