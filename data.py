"""
The data GRPO trains on: GSM8K (hub or a local directory), the prompts, a built-in synthetic arithmetic task
that needs no download, and a deterministic example order so a resumed run sees the same batches.
Every example is a dict {'question', 'answer' (final answer string), 'solution' (full reference text)}.
"""
import json
import random
import re
from functools import lru_cache
from pathlib import Path

import numpy as np

# ----------------------------------------------------------------------------------------------------------
# GSM8K

def parse_gsm8k_row(row):
    """GSM8K row {'question', 'answer': 'reasoning ... #### 72'} -> our example dict. Raises ValueError(reason)."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    for key in ('question', 'answer'):
        if not isinstance(row.get(key), str) or not row[key].strip():
            raise ValueError(f"missing or empty field {key!r}")
    if '####' not in row['answer']:
        raise ValueError("no '####' before the final answer")
    final = row['answer'].rpartition('####')[2].strip().replace(',', '')
    if not final:
        raise ValueError("empty final answer after '####'")
    return {'question': row['question'].strip(), 'answer': final, 'solution': row['answer'].strip()}


def _read_rows(data_dir, split):
    """Yield (where, row-or-exception) from data_dir/{split}.jsonl, else the split's parquet file(s)."""
    path = Path(data_dir) / f'{split}.jsonl'
    if path.exists():
        with open(path, encoding='utf-8') as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():  # a blank line (e.g. trailing) is not a row
                    try:
                        yield f'{path}:{lineno}', json.loads(line)
                    except json.JSONDecodeError as e:
                        yield f'{path}:{lineno}', ValueError(f'bad JSON ({e.msg} at column {e.colno})')
        return
    files = sorted(Path(data_dir).glob(f'**/{split}[-.]*parquet'))  # {split}.parquet or HF's {split}-0000-of-0001
    if not files:
        raise FileNotFoundError(f"no {split}.jsonl or {split}*.parquet in {data_dir}")
    import pyarrow.parquet as pq  # a dependency of `datasets`; only needed for parquet
    for file in files:
        for i, row in enumerate(pq.read_table(file).to_pylist()):
            yield f'{file}:row {i}', row


def _hub_rows(split):
    try:
        import datasets
        ds = datasets.load_dataset('openai/gsm8k', 'main', split=split)
    except Exception as e:  # offline, no `datasets`, hub down: all end the same way for the user
        raise RuntimeError(f"could not load openai/gsm8k ({type(e).__name__}: {e}). Offline? Point at a local "
                           f"copy of train.jsonl/test.jsonl with --data_dir=../shared/gsm8k") from e
    for i, row in enumerate(ds):
        yield f'openai/gsm8k[{split}]:row {i}', row


def load_gsm8k(split, data_dir=None, skip_bad_rows=False, stats=None):
    """GSM8K `split` ('train' | 'test') as a list of example dicts.
    A malformed row raises one ValueError naming file and line; with skip_bad_rows it is skipped, printed and
    added to stats['skipped'] (pass a dict to receive it; stats['first_bad'] holds the first reason)."""
    rows = _hub_rows(split) if data_dir is None else _read_rows(data_dir, split)
    out, bad = [], []
    for where, row in rows:
        try:
            if isinstance(row, Exception):
                raise row
            out.append(parse_gsm8k_row(row))
        except ValueError as e:
            if not skip_bad_rows:
                raise ValueError(f"{where}: malformed GSM8K row: {e} (skip_bad_rows skips such rows)") from None
            bad.append(f"{where}: {e}")
    if bad:
        print(f"load_gsm8k({split!r}): skipped {len(bad)} malformed rows, first: {bad[0]}")
    if stats is not None:  # accumulates, so one dict can collect train and test
        stats['skipped'] = stats.get('skipped', 0) + len(bad)
        stats['first_bad'] = stats.get('first_bad') or (bad[0] if bad else None)
    return out


# ----------------------------------------------------------------------------------------------------------
# order: one permutation per (seed, epoch), so resuming at a cursor reproduces the batches exactly

@lru_cache(maxsize=4)
def _perm(n, seed, epoch):
    return tuple(np.random.default_rng([seed, epoch]).permutation(n).tolist())


def epoch_order(n, seed, epoch):
    """Deterministic permutation of range(n) for this epoch; different epochs give different orders."""
    return list(_perm(n, seed, epoch))


def batch_at(examples, seed, cursor, batch_size):
    """Examples cursor..cursor+batch_size-1 of the endless stream epoch 0, epoch 1, ... (cursor counts examples
    served so far, so it is all a checkpoint needs). Returns (batch, next_cursor); batches may span epochs."""
    n = len(examples)
    batch = [examples[_perm(n, seed, c // n)[c % n]] for c in range(cursor, cursor + batch_size)]
    return batch, cursor + batch_size


# ----------------------------------------------------------------------------------------------------------
# prompts (token ids come from the caller's tokenizer.render_chat)

SYSTEM_PROMPT = "You are a helpful assistant that solves math problems."
INSTRUCTION = "Reason step by step, then put the final answer in \\boxed{}."


def boxed_solution(solution):
    """A GSM8K-style solution with its '#### n' line rewritten as the \\boxed{} answer the default prompt wants."""
    if '####' not in solution:
        return solution
    body, _, final = solution.rpartition('####')
    return f"{body.rstrip()}\nThe final answer is \\boxed{{{final.strip()}}}.".lstrip()


def build_messages(example, system_prompt=SYSTEM_PROMPT, instruction=INSTRUCTION, few_shot=()):
    """Chat messages for one example. system_prompt/instruction: '' or None leaves them out. few_shot: examples
    shown as earlier user/assistant turns (for base models); their answers take the format the instruction asks
    for, since a demonstration in another format teaches that format instead."""
    def user(ex):
        return f"{ex['question']}\n{instruction}" if instruction else ex['question']
    messages = [{'role': 'system', 'content': system_prompt}] if system_prompt else []
    for shot in few_shot:
        answer = boxed_solution(shot['solution']) if instruction and '\\boxed' in instruction else shot['solution']
        messages += [{'role': 'user', 'content': user(shot)}, {'role': 'assistant', 'content': answer}]
    return messages + [{'role': 'user', 'content': user(example)}]


# ----------------------------------------------------------------------------------------------------------
# synthetic task: short arithmetic word problems, written GSM8K-style. It is what a byte-level model of a few
# million parameters learns in minutes on a CPU, so the easy end is genuinely easy and every character is
# short (one byte = one token).

DIFFICULTY = {  # operand_digits: digits of the amount added/removed (None = digits)
    'starter': dict(digits=2, ops='+-', steps=1, operand_digits=1),  # "Tom has 46 pens and gets 7 more." -> "46+7=53"
    'easy': dict(digits=2, ops='+-', steps=1, operand_digits=None),  # "Tom has 12 apples and gets 79 more. ..."
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
        # Only ops that keep the answer a positive integer: no subtracting past 1, only exact division.
        divisors = [d for d in range(2, 10) if value % d == 0]
        allowed = [op for op in ops if (op != '-' or value > 1) and (op != '/' or divisors)]
        op = rng.choice(allowed or ['+'])
        b = {'+': lambda: rng.randint(1, top_b), '-': lambda: rng.randint(1, min(top_b, value - 1)),
             '*': lambda: rng.randint(2, 9), '/': lambda: rng.choice(divisors)}[op]()
        new = {'+': value + b, '-': value - b, '*': value * b, '/': value // b}[op]
        phrases.append(rng.choice(_PHRASES[op]).format(b=b))
        lines.append(f"{value}{op}{b}={new}")
        value = new
    # "Tom has 12 apples and gets 7 more." / "Tom has 12 apples, gets 7 more, then sells 5."
    later = [f"then {p}" for p in phrases[1:]]
    story = f" and {phrases[0]}" if steps == 1 else ', ' + ', '.join([phrases[0]] + later)
    question = f"{name} has {start} {thing}{story}. How many {thing} does {name} have?"
    return {'question': question, 'answer': str(value), 'solution': '\n'.join(lines) + f"\n#### {value}"}


def _arith_stream(seed, difficulty='easy', digits=None, ops=None, steps=None, operand_digits=None):
    if difficulty not in DIFFICULTY:
        raise ValueError(f"difficulty must be one of {sorted(DIFFICULTY)}, got {difficulty!r}")
    given = dict(digits=digits, ops=ops, steps=steps, operand_digits=operand_digits)
    knobs = {**DIFFICULTY[difficulty], **{k: v for k, v in given.items() if v is not None}}
    if not (knobs['digits'] >= 1 and knobs['steps'] >= 1 and knobs['ops'] and set(knobs['ops']) <= set('+-*/')
            and (knobs['operand_digits'] or 1) >= 1):
        raise ValueError(f"bad arithmetic difficulty {knobs}: need digits >= 1, operand_digits >= 1, steps >= 1, "
                         "ops from '+-*/'")
    rng = random.Random(seed)
    while True:
        yield _arith_problem(rng, knobs['digits'], knobs['ops'], knobs['steps'], knobs['operand_digits'])


def make_arith(n, seed=0, difficulty='easy', digits=None, ops=None, steps=None, operand_digits=None):
    """n synthetic problems, a pure function of the arguments. digits: max digits of the numbers drawn;
    operand_digits: max digits of the amounts added/removed (default digits); ops: which of '+-*/' may appear;
    steps: operations per problem; None takes the `difficulty` preset."""
    stream = _arith_stream(seed, difficulty, digits, ops, steps, operand_digits)
    return [next(stream) for _ in range(n)]


def count_on(solution):
    """The same solution with each '+' or '-' of a one-digit amount worked by counting on (or back) one at a time,
    the count in brackets: '46+7=53' -> '46+7: 47(1) 48(2) 49(3) 50(4) 51(5) 52(6) 53(7)'. Longer, but every step
    is a +-1 and a count, which a tiny model gets right long before it can state 46+7 at once. Other lines stay."""
    def line(s):
        m = re.fullmatch(r'(\d+)([+-])(\d)=\d+', s)
        if not m:
            return s
        a, op, b = int(m[1]), m[2], int(m[3])
        return f"{a}{op}{b}: " + ' '.join(f"{a + k if op == '+' else a - k}({k})" for k in range(1, b + 1))
    return '\n'.join(line(s) for s in solution.split('\n'))


def arith_splits(n_train, n_test, seed=0, difficulty='easy', digits=None, ops=None, steps=None, operand_digits=None,
                 count_on_frac=0.0):
    """(train, test) with no arithmetic shared between them (keyed by the solution, so renaming Tom to Ann does
    not leak a test problem). The test split comes first from the stream, so it does not depend on n_train.
    count_on_frac: this fraction of the training solutions (a fixed random choice) is written by count_on()."""
    stream, tries = _arith_stream(seed, difficulty, digits, ops, steps, operand_digits), 0
    test, seen, train = [], set(), []
    # bounded, so a problem space too small for the request ends in an error rather than a hang
    while (len(test) < n_test or len(train) < n_train) and tries < 100 * (n_train + n_test) + 1000:
        ex, tries = next(stream), tries + 1
        if len(test) < n_test:
            if ex['solution'] not in seen:
                seen.add(ex['solution'])
                test.append(ex)
        elif ex['solution'] not in seen:
            train.append(ex)
    if len(test) < n_test or len(train) < n_train:
        raise ValueError(f"difficulty too small for {n_test} distinct test + {n_train} train problems; "
                         f"allow more digits, ops or steps")
    styles = random.Random(f'count_on {seed}')  # its own stream: the problems do not depend on count_on_frac
    train = [{**ex, 'solution': count_on(ex['solution'])} if styles.random() < count_on_frac else ex for ex in train]
    return train, test
