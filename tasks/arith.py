"""
Arithmetic word problems, built in: no download, written GSM8K-style ("Liz has 80 books and sells 7.
How many books does Liz have?" -> "80-7=73\n#### 73"). It is what a byte-level model of a few
million parameters learns in minutes on a CPU (the offline demo, config/arith.py), so the easy end
is genuinely easy and every problem is short (one byte = one token).
"""
import random
import re
from functools import lru_cache

from data import question_messages
from reward import is_correct

arith_difficulty = 'easy'  # preset: 'starter', 'easy', 'medium', 'hard' (DIFFICULTY)
arith_digits = 0  # max digits per number (0 = the preset's)
arith_ops = ''  # operations drawn from '+-*/' ('' = the preset's)
arith_steps = 0  # operations per problem (0 = the preset's)
arith_operand_digits = 0  # max digits of the amounts added/removed (0 = the preset's)
arith_n_train = 5000  # training problems
arith_n_test = 200  # held-out problems (a fixed split: it comes first from the stream)
# share of training solutions that count on, '46+7: 47(1) 48(2) ...' (count_on)
arith_count_on = 0.0
# share of the other training solutions whose one-digit sums drop the carry/borrow: '46+7=43'
# (slip)
arith_slips = 0.0
rewards = [{'name': 'correct', 'weight': 1.0}]


def load(split, data_dir='', seed=0):
    """The train or test split for the knobs above and the run's seed (data_dir is not used)."""
    train, test = _splits(arith_n_train, arith_n_test, seed, difficulty=arith_difficulty,
                          digits=arith_digits or None, ops=arith_ops or None,
                          steps=arith_steps or None, operand_digits=arith_operand_digits or None,
                          count_on_frac=arith_count_on, slip_frac=arith_slips)
    return list(train if split == 'train' else test)


def messages(example, system_prompt='', instruction=''):
    """No system turn or instruction by default: every prompt byte is a token for the byte models
    this task is for."""
    return question_messages(example['question'], system_prompt, instruction)


def grade(completion, example):
    return is_correct(completion, example['answer'])


def solution(example):
    return example['solution']


@lru_cache(maxsize=2)
def _splits(n_train, n_test, seed, **knobs):
    train, test = arith_splits(n_train, n_test, seed, **knobs)
    return tuple(train), tuple(test)


# operand_digits: digits of the amount added/removed (None = digits). starter: "Tom has 46 pens and
# gets 7 more." -> "46+7=53"; easy: "Tom has 12 apples and gets 79 more. ..."
DIFFICULTY = {
    'starter': dict(digits=2, ops='+-', steps=1, operand_digits=1),
    'easy': dict(digits=2, ops='+-', steps=1, operand_digits=None),
    'medium': dict(digits=2, ops='+-', steps=2, operand_digits=None),
    'hard': dict(digits=3, ops='+-*/', steps=3, operand_digits=None),
}
_NAMES = ['Tom', 'Ann', 'Bob', 'Mia', 'Sam', 'Liz', 'Max', 'Eva']
_THINGS = ['apples', 'coins', 'books', 'cards', 'pens', 'eggs', 'shells', 'stamps']
_PHRASES = {'+': ['gets {b} more', 'buys {b} more', 'finds {b} more'],
            '-': ['gives away {b}', 'loses {b}', 'sells {b}'],
            '*': ['gets {b} times as many'],
            '/': ['splits them into {b} equal piles and keeps one']}


def _arith_problem(rng, digits, ops, steps, operand_digits=None):
    top, top_b = 10 ** digits - 1, 10 ** (operand_digits or digits) - 1
    value = start = rng.randint(1, top)
    name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
    phrases, lines = [], []
    for _ in range(steps):
        # Only ops that keep the answer a positive integer: no subtracting past 1, only exact
        # division.
        divisors = [d for d in range(2, 10) if value % d == 0]
        allowed = [op for op in ops if (op != '-' or value > 1) and (op != '/' or divisors)]
        op = rng.choice(allowed or ['+'])
        if op == '+':
            b = rng.randint(1, top_b)
            new = value + b
        elif op == '-':
            b = rng.randint(1, min(top_b, value - 1))
            new = value - b
        elif op == '*':
            b = rng.randint(2, 9)
            new = value * b
        else:  # '/'
            b = rng.choice(divisors)
            new = value // b
        phrases.append(rng.choice(_PHRASES[op]).format(b=b))
        lines.append(f"{value}{op}{b}={new}")
        value = new
    # "Tom has 12 apples and gets 7 more." / "Tom has 12 apples, gets 7 more, then sells 5."
    later = [f"then {p}" for p in phrases[1:]]
    story = f" and {phrases[0]}" if steps == 1 else ', ' + ', '.join([phrases[0]] + later)
    question = f"{name} has {start} {thing}{story}. How many {thing} does {name} have?"
    solution = '\n'.join(lines) + f"\n#### {value}"
    return {'question': question, 'answer': str(value), 'solution': solution}


def _arith_stream(seed, difficulty='easy', digits=None, ops=None, steps=None, operand_digits=None):
    if difficulty not in DIFFICULTY:
        raise ValueError(f"difficulty must be one of {sorted(DIFFICULTY)}, got {difficulty!r}")
    given = dict(digits=digits, ops=ops, steps=steps, operand_digits=operand_digits)
    knobs = {**DIFFICULTY[difficulty], **{k: v for k, v in given.items() if v is not None}}
    if not (knobs['digits'] >= 1 and knobs['steps'] >= 1 and knobs['ops']
            and set(knobs['ops']) <= set('+-*/') and (knobs['operand_digits'] or 1) >= 1):
        raise ValueError(f"bad arithmetic difficulty {knobs}: need digits >= 1, "
                         "operand_digits >= 1, steps >= 1, ops from '+-*/'")
    rng = random.Random(seed)
    while True:
        yield _arith_problem(rng, knobs['digits'], knobs['ops'], knobs['steps'],
                             knobs['operand_digits'])


def make_arith(n, seed=0, *, difficulty='easy', digits=None, ops=None, steps=None,
               operand_digits=None):
    """n synthetic problems, a pure function of the arguments. digits: max digits of the numbers
    drawn; operand_digits: max digits of the amounts added/removed (default digits); ops: which of
    '+-*/' may appear; steps: operations per problem; None takes the `difficulty` preset."""
    stream = _arith_stream(seed, difficulty=difficulty, digits=digits, ops=ops, steps=steps,
                           operand_digits=operand_digits)
    return [next(stream) for _ in range(n)]


# a solution line adding or removing a one-digit amount
ONE_DIGIT_STEP = re.compile(r'(\d+)([+-])(\d)=\d+')


def count_on(solution):
    """The same solution with each '+' or '-' of a one-digit amount worked by counting on (or back)
    one at a time, the count in brackets: '46+7=53' -> '46+7: 47(1) 48(2) 49(3) 50(4) 51(5) 52(6)
    53(7)'. Longer, but every step is a +-1 and a count, which a tiny model gets right long before
    it can state 46+7 at once. Other lines stay."""
    def line(s):
        m = ONE_DIGIT_STEP.fullmatch(s)
        if not m:
            return s
        a, op, b = int(m[1]), m[2], int(m[3])
        counts = [f"{a + k if op == '+' else a - k}({k})" for k in range(1, b + 1)]
        return f"{a}{op}{b}: " + ' '.join(counts)
    return '\n'.join(line(s) for s in solution.split('\n'))


def slip(solution):
    """The same solution with each '+' or '-' of a one-digit amount worked the way a hurried pupil
    does it, the carry or borrow dropped: the tens stay, the ones digit wraps: '46+7=53' ->
    '46+7=43', '80-7=73' -> '80-7=83'. Right exactly when no carry or borrow is needed (about half
    the 'starter' problems), so a model that imitates it is wrong about half the time however well
    it learns, on every machine. Later lines are left as they were (a slip in a multi-step solution
    is not carried through). The '####' answer follows the last line it rewrote."""
    out, answer = [], None
    for s in solution.split('\n'):
        m = ONE_DIGIT_STEP.fullmatch(s)
        if m:
            a, op, b = int(m[1]), m[2], int(m[3])
            answer = a - a % 10 + (a % 10 + (b if op == '+' else -b)) % 10
            s = f"{a}{op}{b}={answer}"
        elif s.startswith('#### ') and answer is not None:
            s = f"#### {answer}"
        out.append(s)
    return '\n'.join(out)


def arith_splits(n_train, n_test, seed=0, *, difficulty='easy', digits=None, ops=None, steps=None,
                 operand_digits=None, count_on_frac=0.0, slip_frac=0.0):
    """(train, test) with no arithmetic shared between them (keyed by the solution, so renaming Tom
    to Ann does not leak a test problem). The test split comes first from the stream, so it does not
    depend on n_train. count_on_frac: this fraction of the training solutions (a fixed random
    choice) is written by count_on(); slip_frac: this fraction of the others (their own fixed
    choice) by slip(). The test split is never rewritten: grading compares the answer, which slip()
    gets wrong whenever a carry or borrow is needed."""
    stream = _arith_stream(seed, difficulty=difficulty, digits=digits, ops=ops, steps=steps,
                           operand_digits=operand_digits)
    tries = 0
    test, seen, train = [], set(), []
    # bounded, so a problem space too small for the request ends in an error rather than a hang
    max_tries = 100 * (n_train + n_test) + 1000
    while (len(test) < n_test or len(train) < n_train) and tries < max_tries:
        ex = next(stream)
        tries += 1
        if len(test) < n_test:
            if ex['solution'] not in seen:
                seen.add(ex['solution'])
                test.append(ex)
        elif ex['solution'] not in seen:
            train.append(ex)
    if len(test) < n_test or len(train) < n_train:
        raise ValueError(f"difficulty too small for {n_test} distinct test + {n_train} train "
                         f"problems; allow more digits, ops or steps")
    # its own stream: the problems do not depend on count_on_frac
    styles = random.Random(f'count_on {seed}')
    train = [{**ex, 'solution': count_on(ex['solution'])} if styles.random() < count_on_frac else ex
             for ex in train]
    # drawn for every problem, so the choice does not depend on count_on_frac
    slips = random.Random(f'slip {seed}')
    train = [{**ex, 'solution': slip(ex['solution'])}
             if slips.random() < slip_frac and ':' not in ex['solution'] else ex
             for ex in train]
    return train, test
