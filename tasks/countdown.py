"""
Countdown, the task TinyZero showed R1-Zero on: reach a target with the numbers given, each used
once, and + - * / ("Using the numbers [44, 19, 35], create an equation that equals 98." ->
"<answer> 44 + 19 + 35 </answer>"). Built in: the problems are generated, each solvable by
construction, no download; --data_dir reads TinyZero's instead (rows with `nums` and `target`, as
Jiayi-Pan/Countdown-Tasks-3to4 has them, in DIR/train and DIR/test .jsonl or .parquet).

Graded exactly: the completion's last <answer>...</answer> must hold an expression of integers,
+ - * / and parentheses (optionally followed by '= target') that uses each given number exactly
once and equals the target, in exact fractions. It is parsed with Python's ast and evaluated by
walking the tree: nothing of the completion is ever run.
"""
import ast
import random
import re
from fractions import Fraction
from functools import lru_cache

from data import parse_rows, question_messages, read_rows

countdown_n_train = 20000  # training problems (generated)
countdown_n_test = 500  # held-out problems (generated first, so the split is fixed; none in train)
countdown_min_numbers = 3  # numbers a problem gives: the fewest
countdown_max_numbers = 4  # and the most
countdown_max_number = 99  # each drawn from 1 to this
countdown_max_target = 100  # targets from 1 to this
SYSTEM_PROMPT = ''
INSTRUCTION = ('Show your work in <think> </think> tags, then give the equation in <answer> </answer> '
               'tags, for example <answer> (1 + 2) / 3 </answer>.')
# TinyZero's: 1 for a right equation, 0.1 for one in the tags that is wrong (here 1.1 and 0.1)
rewards = [{'name': 'correct', 'weight': 1.0},
           {'name': 'format', 'weight': 0.1, 'kwargs': {'regex': r'<answer>.*?</answer>'}}]

_ANSWER = re.compile(r'<answer>(.*?)</answer>', re.DOTALL)
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b}


def load(split, data_dir='', seed=0):
    """The generated split for the knobs above and the run's seed, or data_dir's rows."""
    if data_dir:
        return parse_rows(read_rows(data_dir, split), _parse_row, what=f'countdown {split}')
    shape = (countdown_min_numbers, countdown_max_numbers, countdown_max_number, countdown_max_target)
    train, test = _splits(countdown_n_train, countdown_n_test, seed, shape)
    return list(train if split == 'train' else test)


def messages(example, system_prompt=SYSTEM_PROMPT, instruction=INSTRUCTION):
    return question_messages(example['question'], system_prompt, instruction)


def grade(completion, example):
    return check(equation(completion), example['nums']) == example['target']


def answer(completion):
    """What maj@k votes on: the equation, spaces dropped."""
    eq = equation(completion)
    return None if eq is None else re.sub(r'\s+', '', eq)


def solution(example):
    """The warm start's target: the problem's own expression, or for a row read from data_dir, one
    found by search (solve)."""
    expr = example.get('solution') or solve(tuple(example['nums']), example['target'])
    if expr is None:
        raise ValueError(f"countdown: no equation reaches {example['target']} from {example['nums']}")
    return f"<answer> {expr} </answer>"


@lru_cache(maxsize=None)
def solve(nums, target):
    """An expression of the numbers (a tuple), each used once, + - * / and exact fractions, equal to
    target, or None: every way of combining two values into one, depth first (4 numbers: about
    9,000 leaves)."""
    def search(terms):
        if len(terms) == 1:
            return terms[0][1] if terms[0][0] == target else None
        for i, (a, ea) in enumerate(terms):
            for j, (b, eb) in enumerate(terms):
                if i == j:
                    continue
                rest = [t for k, t in enumerate(terms) if k not in (i, j)]
                for value, expr in ((a + b, f"({ea} + {eb})"), (a - b, f"({ea} - {eb})"),
                                    (a * b, f"({ea} * {eb})"), (a / b if b else None, f"({ea} / {eb})")):
                    if value is not None:
                        found = search(rest + [(value, expr)])
                        if found:
                            return found
        return None
    found = search([(Fraction(x), str(x)) for x in nums])
    return found[1:-1] if found and len(nums) > 1 else found


def metrics(completions, examples):
    """answered: the share of completions with an <answer> tag; numbers_ok: the share whose
    equation uses exactly the numbers given (right or not)."""
    eqs = [equation(c) for c in completions]
    n = max(len(completions), 1)
    return {'answered': sum(e is not None for e in eqs) / n,
            'numbers_ok': sum(check(e, ex['nums']) is not None for e, ex in zip(eqs, examples)) / n}


def equation(completion):
    """The last <answer>...</answer>'s text, stripped, or None."""
    found = _ANSWER.findall(completion)
    return found[-1].strip() if found else None


def check(expr, nums):
    """The exact value (a Fraction) of expr if it is an expression of integers, + - * / and
    parentheses using each of nums exactly once (a trailing '= n' must equal it), else None."""
    if expr is None or len(expr) > 300 or not re.fullmatch(r'[\d\s+\-*/()=]*', expr):
        return None
    expr, *rest = expr.split('=')
    try:
        tree = ast.parse(expr.strip(), mode='eval').body
        used = []
        value = _value(tree, used)
        claimed = [int(r) for r in rest]
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
        return None
    if sorted(used) != sorted(nums) or any(c != value for c in claimed):
        return None
    return value


def _value(node, used):
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left, used), _value(node.right, used))
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        if len(used) > 8:  # more numbers than any problem gives: no need to go on
            raise ValueError('too many numbers')
        return Fraction(node.value)
    raise ValueError(f'not allowed: {type(node).__name__}')


def _parse_row(row):
    nums, target = [int(x) for x in row['nums']], int(row['target'])
    return {'question': question(nums, target), 'nums': nums, 'target': target,
            'answer': str(target), 'solution': None}


def question(nums, target):
    return (f"Using the numbers {nums}, create an equation that equals {target}. You can use basic "
            "arithmetic operations (+, -, *, /) and each number can only be used once.")


def problem(rng, n, top, max_target):
    """A solvable problem: n numbers from 1..top combined in a random order by random operations,
    each step a positive integer (a - b > 0, b divides a), until one value in 1..max_target is
    left: the target, its expression the solution. Retried until one works."""
    while True:
        terms = [(x, str(x)) for x in (rng.randint(1, top) for _ in range(n))]
        nums = [x for x, _ in terms]
        while len(terms) > 1:
            (a, ea), (b, eb) = terms.pop(rng.randrange(len(terms))), terms.pop(rng.randrange(len(terms)))
            op = rng.choice('+-*/')
            if (op == '-' and a <= b) or (op == '/' and a % b):
                op = '+'
            value = {'+': a + b, '-': a - b, '*': a * b, '/': a // b}[op]
            terms.append((value, f"({ea} {op} {eb})"))
        target, expr = terms[0]
        if 1 <= target <= max_target:
            rng.shuffle(nums)
            return {'question': question(nums, target), 'nums': nums, 'target': target,
                    'answer': str(target), 'solution': expr[1:-1] if n > 1 else expr}


@lru_cache(maxsize=2)
def _splits(n_train, n_test, seed, shape):
    """shape: (fewest numbers, most numbers, largest number, largest target)."""
    lo, hi, top, max_target = shape
    if not 1 <= lo <= hi <= 8 or top < 1 or max_target < 1:
        raise ValueError(f"countdown: numbers per problem {lo}..{hi} (1 to 8), countdown_max_number "
                         f"{top} and countdown_max_target {max_target} (>= 1)")
    rng = random.Random(f'countdown {seed}')
    test, seen = [], set()
    while len(test) < n_test:
        p = problem(rng, rng.randint(lo, hi), top, max_target)
        key = (tuple(sorted(p['nums'])), p['target'])
        if key not in seen:
            seen.add(key)
            test.append(p)
    train = []
    while len(train) < n_train:
        p = problem(rng, rng.randint(lo, hi), top, max_target)
        if (tuple(sorted(p['nums'])), p['target']) not in seen:
            train.append(p)
    return tuple(train), tuple(test)
