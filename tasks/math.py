"""
MATH competition mathematics (Hendrycks et al. 2021, MIT): 7,500 train / 5,000 test problems whose
answers are LaTeX ('\\dfrac{9}{7}', '(3, -1)', 'x \\in [-2,7]'). From the hub
(DigitalLearningGmbH/MATH-lighteval, the answer being its solution's last \\boxed{}) or a local
directory of train/test .jsonl or .parquet rows {'problem', 'answer', 'level', 'type'} (such as
../shared/math). An example is {'question', 'answer', 'level' (1-5; None for 'Level ?' or none),
'type'}. Rows with an empty answer (two in the train split) are left out: nothing to grade against.

math_levels and math_types choose the training problems. The evaluation subset is the test problems
in the order of the sha256 of their text, the first math_test_size of them: a uniform pseudo-random
subset that depends on no library version, file order, data source or training choice, so
eval/pass@1 compares run to run. It is not MATH-500 (Lightman et al.'s list), which holds other
problems.

Grading: the last non-empty \\boxed{} of the completion against the reference, both parsed and
compared by Hugging Face's math-verify (numerically and symbolically: \\dfrac{9}{7} = 9/7,
(3, -1) = \\left(3,-1\\right), 30^\\circ = 30). A completion without a \\boxed{} is wrong: the prompt
asks for one, and a fallback to the last expression in the text would pay for an intermediate value.
math-verify runs in worker processes, and each call gets math_grade_timeout_s: a worker past it is
killed and the answer counts as wrong, so a pathological expression (9^{9^{9^{9}}}) costs at most
that, from any thread. docs/math.md has the details and where verl's math_dapo judges otherwise.
"""
import atexit
import hashlib
import importlib.util
import json
import os
import re
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from data import parse_rows, question_messages, read_rows
from reward import last_boxed

# training problems' levels, e.g. [3, 4, 5]; [] = all (the 'Level ?' rows only then)
math_levels = []
math_types = []  # training problems' subjects, e.g. ['Algebra', 'Number Theory']; [] = all seven
# the evaluation subset: this many test problems (all levels and types) in sha256 order of their
# text; 0 = all 5,000
math_test_size = 500
# wall-clock seconds one grade() may take: a worker past it is killed and the answer counts wrong
math_grade_timeout_s = 5.0
skip_bad_rows = False  # malformed rows: False = stop with file:line, True = skip and count them
# Qwen2.5-Math's chain-of-thought system prompt; the problem is the user turn as it stands
SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
INSTRUCTION = ''
rewards = [{'name': 'correct', 'weight': 1.0}]

HUB = 'DigitalLearningGmbH/MATH-lighteval'
ROOT = Path(__file__).resolve().parents[1]
WORKER_START_S = 120  # a worker's import of sympy and math-verify; not counted in a call's bound
# a worker's address space: a pathological expression fails with MemoryError before it
# swaps the machine
WORKER_MEMORY = 4 << 30


def parse_row(row):
    """MATH row -> our example dict. The hub's rows have a 'solution' instead of an 'answer': its
    last \\boxed{}. Raises ValueError(reason)."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    problem = row.get('problem')
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError("missing or empty field 'problem'")
    answer = row.get('answer')
    if answer is None and isinstance(row.get('solution'), str):
        answer = last_boxed(row['solution']) or ''
    if not isinstance(answer, str):
        raise ValueError("missing field 'answer' (or a 'solution' ending in a \\boxed{} answer)")
    level = row.get('level')
    if isinstance(level, str) and re.fullmatch(r'Level [1-5]', level.strip()):
        level = int(level.strip()[-1])
    elif level is None or level == 'Level ?':
        level = None
    else:
        raise ValueError(f"field 'level' is {level!r}: expected 'Level 1' .. 'Level 5' or 'Level ?'")
    kind = row.get('type')
    if kind is not None and not isinstance(kind, str):
        raise ValueError(f"field 'type' is {kind!r}: expected a string such as 'Algebra'")
    return {'question': problem.strip(), 'answer': answer.strip(), 'level': level, 'type': kind}


def _hub_rows(split):
    try:
        import datasets
        ds = datasets.load_dataset(HUB, split=split)
    except Exception as e:  # offline, no `datasets`, hub down: all end the same way for the user
        raise RuntimeError(f"could not load {HUB} ({type(e).__name__}: {e}). Offline? Point at a "
                           "local copy of train.jsonl/test.jsonl with --data_dir=../shared/math") from e
    for i, row in enumerate(ds):
        yield f'{HUB}[{split}]:row {i}', row


def text_digest(example):
    """The evaluation subset's order: sha256 of the problem text (UTF-8, stripped), in hex."""
    return hashlib.sha256(example['question'].encode('utf-8')).hexdigest()


def choose(examples, split):
    """'train': the examples of the chosen levels and types. 'test': the first math_test_size in
    text_digest order, whatever the levels and types trained on, so that runs compare. Raises
    ValueError naming the knob with an unknown value or that chose nothing."""
    if split == 'test':
        if math_test_size < 0:
            raise ValueError(f"math_test_size={math_test_size}: expected 0 (all) or a count")
        ordered = sorted(examples, key=text_digest)
        return ordered[:math_test_size] if math_test_size else ordered
    bad = [v for v in math_levels if v not in (1, 2, 3, 4, 5)]
    if bad:
        raise ValueError(f"math_levels={math_levels!r}: levels are 1 to 5, not {bad}")
    present = sorted({ex['type'] for ex in examples if ex['type'] is not None})
    unknown = [t for t in math_types if t not in present]
    if unknown:
        raise ValueError(f"math_types={math_types!r}: no {split} problems of type {unknown}; "
                         f"types present: {present}")
    kept = [ex for ex in examples
            if (not math_levels or ex['level'] in math_levels)
            and (not math_types or ex['type'] in math_types)]
    if not kept:
        raise ValueError(f"math_levels={math_levels!r} with math_types={math_types!r}: "
                         f"no {split} problems left")
    return kept


def load(split, data_dir='', seed=0, stats=None):
    """MATH `split` ('train' | 'test', as choose() picks them). data_dir '' downloads the hub
    copy. A malformed row raises one ValueError naming file and line; with skip_bad_rows it is
    skipped and counted in stats['skipped'] (a dict you pass). seed is not used: the evaluation
    subset is fixed."""
    if importlib.util.find_spec('math_verify') is None:  # at start-up, not at the first reward
        raise RuntimeError("tasks/math.py grades with math-verify, which is not installed: "
                           "pip install math-verify (requirements.txt)")
    if not math_grade_timeout_s > 0:
        raise ValueError(f"math_grade_timeout_s={math_grade_timeout_s}: expected seconds > 0")
    rows = read_rows(data_dir, split) if data_dir else _hub_rows(split)
    examples = parse_rows(rows, parse_row, skip_bad_rows, 'MATH', stats)
    answered = [ex for ex in examples if ex['answer']]
    if len(answered) < len(examples):
        print(f"MATH {split}: left out {len(examples) - len(answered)} problems with an empty "
              "answer (nothing to grade against)")
    return choose(answered, split)


def messages(example, system_prompt=SYSTEM_PROMPT, instruction=INSTRUCTION):
    return question_messages(example['question'], system_prompt, instruction)


def answer(completion):
    """What maj@k votes on: the last \\boxed{} with its blanks removed (equivalent forms written
    differently, 0.5 and \\frac{1}{2}, are different votes)."""
    boxed = last_boxed(completion)
    return None if boxed is None else ''.join(boxed.split())


def metrics(completions, examples):
    """boxed: the share of completions that box an answer (the rest are wrong by rule)."""
    return {'boxed': sum(last_boxed(c) is not None for c in completions) / max(len(completions), 1)}


def grade(completion, example):
    """The last \\boxed{} equals the reference by math-verify, within math_grade_timeout_s (past it,
    wrong). No \\boxed{}: wrong."""
    boxed = last_boxed(completion)
    if boxed is None:
        return False
    return verify(example['answer'], boxed, timeout_s=math_grade_timeout_s)


# --------------------------------------------------------------------------------------------------
# math-verify in worker processes. Its own timeout is signal.alarm: it works only in the main thread
# (in any other thread every call raises), counts whole seconds and cannot stop a long C call. A
# process can always be killed, from any thread, so each call runs in a worker and the caller waits
# at most timeout_s for its verdict. One worker per thread grading at once; idle ones are kept.

_idle = []  # workers waiting for a call
_idle_lock = threading.Lock()
_timed_out = []  # the first timeout is said once per process; the rest count as wrong quietly


def serve():
    """A worker's loop: one JSON [reference, answer] per line on stdin, 'true' or 'false' per line
    on stdout. math-verify's alarms are off: the caller's deadline is the bound."""
    import logging
    import resource
    from math_verify import LatexExtractionConfig, parse
    from math_verify import verify as mv_verify
    logging.getLogger('math_verify').setLevel(logging.ERROR)  # it warns that its alarms are off
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY, WORKER_MEMORY))
    config = [LatexExtractionConfig(boxed_match_priority=0)]
    print('ready', flush=True)
    for line in sys.stdin:
        try:
            reference, given = json.loads(line)
            gold = parse(f'\\boxed{{{reference}}}', extraction_config=config, parsing_timeout=None)
            pred = parse(f'\\boxed{{{given}}}', extraction_config=config, parsing_timeout=None)
            ok = bool(gold) and bool(pred) and mv_verify(gold, pred, timeout_seconds=None)
        except Exception:  # MemoryError and sympy's own failures included: not equal
            ok = False
        print('true' if ok else 'false', flush=True)


def _read_line(proc, deadline):
    """The worker's next line, or None once the deadline passes or the worker has exited."""
    fd = proc.stdout.fileno()
    got = b''
    while not got.endswith(b'\n'):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            return None
        got += chunk
    return got


def _stop(proc):
    proc.kill()
    proc.wait()


def _start_worker():
    code = 'import sys; sys.path.insert(0, sys.argv[1]); from tasks.math import serve; serve()'
    # one thread each: numpy's BLAS would start one per core, each reserving address space
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'OPENBLAS_NUM_THREADS': '1', 'MKL_NUM_THREADS': '1'}
    proc = subprocess.Popen([sys.executable, '-c', code, str(ROOT)], cwd=ROOT, env=env, bufsize=0,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    if _read_line(proc, time.monotonic() + WORKER_START_S) != b'ready\n':
        _stop(proc)
        raise RuntimeError(f"tasks/math.py: the math-verify worker did not start (exit code "
                           f"{proc.returncode}; its error is printed above)")
    return proc


def _checkout():
    with _idle_lock:
        while _idle:
            proc = _idle.pop()
            if proc.poll() is None:
                return proc
    return _start_worker()


def verify(reference, given, timeout_s=5.0):
    """math-verify's verdict on the LaTeX answer `given` against `reference` (each read as the
    contents of a \\boxed{}), False when it takes more than timeout_s seconds (a worker's start not
    counted). Safe to call from any thread."""
    proc = _checkout()
    proc.stdin.write(json.dumps([reference, given]).encode('utf-8') + b'\n')
    line = _read_line(proc, time.monotonic() + timeout_s)
    if line is None:  # past the deadline (or dead): a fresh worker takes the next call
        _stop(proc)
        if not _timed_out:
            _timed_out.append(given)
            print(f"tasks/math.py: grading {given[:60]!r} took over {timeout_s} s "
                  "(math_grade_timeout_s): wrong; later timeouts are not printed", file=sys.stderr)
        return False
    with _idle_lock:
        _idle.append(proc)
    return line == b'true\n'


@atexit.register
def _stop_idle():
    with _idle_lock:
        while _idle:
            _stop(_idle.pop())
