"""Specification of data loading and ordering (data.py), and of the two built-in tasks' data and
prompts (tasks/gsm8k.py, tasks/arith.py)."""
import json
import re
from pathlib import Path

import pytest

from data import batch_at, epoch_order, indices_at, parse_rows
from reward import is_correct
from tasks import gsm8k
from tasks.arith import DIFFICULTY, arith_splits, count_on, make_arith, slip

build_messages = gsm8k.messages


def load_gsm8k(split, data_dir=None, skip_bad_rows=False, stats=None):
    """The task's load with its skip_bad_rows knob set for this call (as --skip_bad_rows=True sets
    it)."""
    gsm8k.skip_bad_rows = skip_bad_rows
    try:
        return gsm8k.load(split, data_dir=data_dir or '', stats=stats)
    finally:
        gsm8k.skip_bad_rows = False

GSM8K = Path(__file__).resolve().parents[1].parent / 'shared' / 'gsm8k'
needs_gsm8k = pytest.mark.skipif(not (GSM8K / 'train.jsonl').exists(),
                                 reason=f'GSM8K not found at {GSM8K} '
                                        '(CI keeps it beside the clone)')
GOOD = {'question': 'Tom has 2 apples and gets 3 more. How many?',
        'answer': 'Tom has 2+3=<<2+3=5>>5.\n#### 5'}


@needs_gsm8k
@pytest.mark.parametrize('split, n', [('train', 7473), ('test', 1319)])
def test_load_local_gsm8k(split, n):
    rows = load_gsm8k(split, data_dir=GSM8K)
    assert len(rows) == n
    raw = [json.loads(line) for line in open(GSM8K / f'{split}.jsonl')]
    for row, r in zip(rows, raw):
        assert set(row) == {'question', 'answer', 'solution'}
        assert row['solution'] == r['answer'].strip() and row['question'] == r['question'].strip()
        assert re.fullmatch(r'-?[0-9]+', row['answer']), \
            f'final answer {row["answer"]!r} is not a plain integer'
    if split == 'train':  # the first row, read by hand: "... #### 72"
        assert rows[0]['answer'] == '72'


def _write(tmp_path, lines):
    path = tmp_path / 'train.jsonl'
    path.write_text('\n'.join(lines) + '\n')
    return path


@pytest.mark.parametrize('bad, reason', [
    ('{"question": "q?"}', "'answer'"),
    ('{"answer": "#### 5"}', "'question'"),
    ('{"question": "q?", "answer": "reasoning #### "}', 'empty final answer'),
    ('{"question": "q?", "answer": "reasoning, no marker 5"}', "no '####'"),
    ('{"question": "q?", "answer": ', 'bad JSON'),
    ('[1, 2]', 'JSON object'),
])
def test_malformed_row_names_file_and_line(tmp_path, bad, reason):
    path = _write(tmp_path, [json.dumps(GOOD), '', bad, json.dumps(GOOD)])   # bad row on line 3
    with pytest.raises(ValueError) as err:
        load_gsm8k('train', data_dir=tmp_path)
    assert f'{path}:3' in str(err.value) and reason in str(err.value), str(err.value)


def test_skip_bad_rows_skips_and_counts(tmp_path, capsys):
    _write(tmp_path, [json.dumps(GOOD), '{"question": "q?"}', 'not json', json.dumps(GOOD)])
    stats = {}
    rows = load_gsm8k('train', data_dir=tmp_path, skip_bad_rows=True, stats=stats)
    assert len(rows) == 2 and stats['skipped'] == 2 and ':2:' in stats['first_bad']
    assert 'skipped 2 malformed rows' in capsys.readouterr().out
    load_gsm8k('train', data_dir=tmp_path, skip_bad_rows=True, stats=stats)
    assert stats['skipped'] == 4, 'one stats dict must add up the counts of several loads'


def test_a_row_its_parser_trips_on_is_a_bad_row_too(capsys):
    """A parser raises ValueError on the rows it knows are bad; one that trips on a row it did not
    foresee (IndexError, KeyError, TypeError) still makes that row one bad row: file:line, or
    skipped and counted, never a traceback past skip_bad_rows."""
    rows = [('f.jsonl:1', {'xs': [1]}), ('f.jsonl:2', {'xs': []}), ('f.jsonl:3', {}),
            ('f.jsonl:4', {'xs': None}), ('f.jsonl:5', {'xs': [2]})]

    def first(row):
        return row['xs'][0]
    with pytest.raises(ValueError, match=r"^f\.jsonl:2: malformed thing row: IndexError: list"):
        parse_rows(rows, first, what='thing')
    stats = {}
    assert parse_rows(rows, first, True, 'thing', stats) == [1, 2]
    assert stats['skipped'] == 3 and stats['first_bad'].startswith('f.jsonl:2: IndexError: ')
    assert 'thing: skipped 3 malformed rows' in capsys.readouterr().out


def test_answer_is_the_text_after_the_marker_without_commas(tmp_path):
    _write(tmp_path, [json.dumps({'question': ' q? ', 'answer': 'It is 1,000+234.\n####  1,234 '})])
    assert load_gsm8k('train', data_dir=tmp_path) == [
        {'question': 'q?', 'answer': '1234', 'solution': 'It is 1,000+234.\n####  1,234'}]


def test_parquet_directory_reads_like_jsonl(tmp_path):
    pa, pq = pytest.importorskip('pyarrow'), pytest.importorskip('pyarrow.parquet')
    (tmp_path / 'main').mkdir()
    table = pa.Table.from_pylist([GOOD, GOOD])
    pq.write_table(table, tmp_path / 'main' / 'test-00000-of-00001.parquet')
    rows = load_gsm8k('test', data_dir=tmp_path)
    assert rows == [{'question': GOOD['question'], 'answer': '5', 'solution': GOOD['answer']}] * 2


def test_parquet_hub_copy_with_several_configs_is_read_once(tmp_path):
    """openai/gsm8k as the hub stores it: main/ and socratic/, one folder per config. Reading both
    would serve every problem twice; the split's files in data_dir itself, or in one folder below
    it, are read, and several folders are one error naming them."""
    pa, pq = pytest.importorskip('pyarrow'), pytest.importorskip('pyarrow.parquet')
    for config in ('main', 'socratic'):
        (tmp_path / config).mkdir()
        pq.write_table(pa.Table.from_pylist([GOOD]), tmp_path / config / 'test-00000-of-00001.parquet')
    with pytest.raises(ValueError, match=r"2 folders.*\(main, socratic\).*--data_dir=.*main"):
        load_gsm8k('test', data_dir=tmp_path)
    assert len(load_gsm8k('test', data_dir=tmp_path / 'main')) == 1
    pq.write_table(pa.Table.from_pylist([GOOD] * 2), tmp_path / 'test.parquet')  # beside the configs
    assert len(load_gsm8k('test', data_dir=tmp_path)) == 2, 'the files in data_dir come first'


def test_missing_local_split_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match='test.jsonl'):
        load_gsm8k('test', data_dir=tmp_path)


def test_offline_hub_failure_says_to_pass_data_dir(monkeypatch):
    datasets = pytest.importorskip('datasets')
    def offline(*args, **kwargs):
        raise ConnectionError('no route to huggingface.co')
    monkeypatch.setattr(datasets, 'load_dataset', offline)
    with pytest.raises(RuntimeError, match='--data_dir=../shared/gsm8k'):
        load_gsm8k('train')


# --------------------------------------------------------------------------------------------------
# order

def test_epoch_order_is_a_deterministic_permutation():
    a = epoch_order(1000, seed=1, epoch=0)
    assert sorted(a) == list(range(1000)) and a != list(range(1000))
    assert a == epoch_order(1000, seed=1, epoch=0), 'same seed and epoch must give the same order'
    assert a != epoch_order(1000, seed=1, epoch=1), 'a new epoch must reshuffle'
    assert a != epoch_order(1000, seed=2, epoch=0), 'a new seed must reshuffle'


def test_batch_at_resumes_mid_stream_across_epochs():
    examples = [{'i': i} for i in range(10)]
    # independent reference
    stream = [examples[i] for e in range(3) for i in epoch_order(10, 7, e)]
    cursor = 0
    served = []
    for _ in range(7):   # batches of 4 straddle the epoch boundaries at 10 and 20
        batch, cursor = batch_at(examples, 7, cursor, 4)
        served += batch
    assert served == stream[:28] and cursor == 28
    assert batch_at(examples, 7, 12, 4)[0] == stream[12:16], \
        'resuming from a cursor must give the same batch'


def test_indices_at_passes_over_the_skipped_and_its_cursor_moves_past_them():
    stream = [i for e in range(4) for i in epoch_order(10, 7, e)]
    skip = {stream[1], stream[5]}  # two examples no longer drawn
    index, cursor = indices_at(10, 7, 0, 6, skip=skip)
    want = [i for i in stream if i not in skip][:6]
    assert index == want and cursor == stream.index(want[-1], 0) + 1, (index, cursor)
    assert cursor == 8  # the first 8 of the stream held those 6 and the 2 skipped
    # a cursor mid-stream reproduces the rest, across epochs; no repeats of the skipped
    more, _ = indices_at(10, 7, cursor, 20, skip=skip)
    assert more == [i for i in stream[cursor:] if i not in skip][:20]
    with pytest.raises(ValueError, match='all 3 training examples'):
        indices_at(3, 7, 0, 1, skip={0, 1, 2})
    # shuffle=False: the examples' own order, epoch after epoch, the skipped passed over
    assert indices_at(5, 7, 0, 7, shuffle=False) == ([0, 1, 2, 3, 4, 0, 1], 7)
    assert indices_at(5, 7, 3, 4, skip={4}, shuffle=False) == ([3, 0, 1, 2], 8)


# --------------------------------------------------------------------------------------------------
# prompts

EX = {'question': 'Tom has 12 apples and gets 7 more. How many apples does Tom have?',
      'answer': '19', 'solution': '12+7=19\n#### 19'}


def test_default_prompt_asks_for_steps_and_a_box():
    msgs = build_messages(EX)
    assert [m['role'] for m in msgs] == ['system', 'user']
    assert msgs[1]['content'].startswith(EX['question']) and '\\boxed{}' in msgs[1]['content']
    assert 'step by step' in msgs[1]['content']


def test_prompt_parts_are_configurable_and_omittable():
    msgs = build_messages(EX, system_prompt='Be terse.', instruction='End with #### n.')
    assert msgs == [{'role': 'system', 'content': 'Be terse.'},
                    {'role': 'user', 'content': EX['question'] + '\nEnd with #### n.'}]
    assert build_messages(EX, system_prompt=None, instruction='') == \
        [{'role': 'user', 'content': EX['question']}]


def test_few_shot_turns_come_first_in_the_asked_format():
    shot = {'question': 'Ann has 5 pens and loses 2. How many pens does Ann have?', 'answer': '3',
            'solution': '5-2=3\n#### 3'}
    msgs = build_messages(EX, few_shot=[shot])
    assert [m['role'] for m in msgs] == ['system', 'user', 'assistant', 'user']
    assert msgs[2]['content'] == '5-2=3\nThe final answer is \\boxed{3}.'
    plain = build_messages(EX, system_prompt=None, instruction='', few_shot=[shot])
    assert plain[1] == {'role': 'assistant', 'content': '5-2=3\n#### 3'}


# --------------------------------------------------------------------------------------------------
# synthetic arithmetic

def _check_solution(ex):
    """Recompute the chain of equations independently of the generator."""
    lines = ex['solution'].split('\n')
    assert lines[-1] == f"#### {ex['answer']}"
    value = None
    operands = []
    for line in lines[:-1]:
        a, op, b, c = re.fullmatch(r'(\d+)([-+*/])(\d+)=(\d+)', line).groups()
        operands += [a, b] if value is None else [b]
        assert value is None or int(a) == value, f'step does not continue the chain: {ex}'
        results = {'+': int(a) + int(b), '-': int(a) - int(b), '*': int(a) * int(b),
                   '/': int(a) / int(b)}
        value = results[op]
        assert value == int(c) and value > 0, f'wrong or non-positive step {line!r} in {ex}'
    assert value == int(ex['answer'])
    assert re.findall(r'\d+', ex['question']) == operands, \
        f'question and solution use different numbers: {ex}'


@pytest.mark.parametrize('difficulty', sorted(DIFFICULTY))
def test_arith_solutions_are_right_and_grade_correct(difficulty):
    for ex in make_arith(300, seed=3, difficulty=difficulty):
        _check_solution(ex)
        assert is_correct(ex['solution'], ex['answer'])
        assert is_correct(f"\\boxed{{{ex['answer']}}}", ex['answer'])


def test_arith_is_deterministic_from_its_seed():
    assert make_arith(50, seed=5) == make_arith(50, seed=5)
    assert make_arith(50, seed=5) != make_arith(50, seed=6)
    assert make_arith(20, seed=5) == make_arith(50, seed=5)[:20], \
        'asking for more must not change the first ones'


def test_easy_arith_is_short_enough_for_a_byte_model():
    for ex in make_arith(200, seed=0, difficulty='easy'):
        assert len(ex['question']) <= 80 and len(ex['solution']) <= 20, ex
        assert re.fullmatch(r'\d{1,2}[-+]\d{1,2}=\d+\n#### \d+', ex['solution']), ex


@pytest.mark.parametrize('knobs, check', [
    (dict(digits=1), lambda ex: all(int(n) < 10 for n in re.findall(r'\d+', ex['question']))),
    (dict(digits=3, steps=1), lambda ex: True),
    (dict(ops='+'), lambda ex: '-' not in ex['solution'] and '+' in ex['solution']),
    (dict(ops='*', steps=2), lambda ex: ex['solution'].count('*') == 2),
    # '+' when no divisor
    (dict(ops='/', digits=3), lambda ex: '/' in ex['solution'] or '+' in ex['solution']),
    (dict(steps=3), lambda ex: ex['solution'].count('\n') == 3),
])
def test_difficulty_knobs_shape_the_problems(knobs, check):
    exs = make_arith(200, seed=1, **knobs)
    for ex in exs:
        _check_solution(ex)
        assert check(ex), f'{knobs}: {ex}'
    if knobs.get('digits') == 3:
        numbers = [n for ex in exs for n in re.findall(r'\d+', ex['question'])]
        assert any(len(n) == 3 for n in numbers), 'digits=3 never drew a 3-digit number'


def test_bad_difficulty_is_an_error():
    with pytest.raises(ValueError):
        make_arith(1, difficulty='impossible')
    with pytest.raises(ValueError):
        make_arith(1, ops='^')


def test_arith_splits_are_disjoint_and_the_test_split_is_fixed():
    train, test = arith_splits(2000, 200, seed=0)
    assert len(train) == 2000 and len(test) == 200
    leaked = {ex['solution'] for ex in test} & {ex['solution'] for ex in train}
    assert not leaked, f'test arithmetic leaked into train: {sorted(leaked)[:3]}'
    assert len({ex['solution'] for ex in test}) == 200, 'test problems repeat'
    assert arith_splits(500, 200, seed=0)[1] == test, 'the test split must not depend on n_train'
    assert arith_splits(500, 200, seed=0, steps=2)[1] != test


def test_arith_splits_too_small_a_space_is_an_error():
    with pytest.raises(ValueError, match='too small'):
        arith_splits(10, 200, seed=0, digits=1, ops='+')   # 9 * 9 = 81 distinct problems


def test_count_on_works_the_sum_one_step_at_a_time():
    assert count_on('46+7=53\n#### 53') == \
        '46+7: 47(1) 48(2) 49(3) 50(4) 51(5) 52(6) 53(7)\n#### 53'
    assert count_on('12-3=9\n#### 9') == '12-3: 11(1) 10(2) 9(3)\n#### 9'
    assert count_on('12+30=42\n#### 42') == '12+30=42\n#### 42', \
        'two-digit amounts are left as they were'
    assert count_on('6*3=18\n#### 18') == '6*3=18\n#### 18'
    for ex in make_arith(300, seed=4, difficulty='starter'):
        worked = count_on(ex['solution'])
        assert is_correct(worked, ex['answer']), worked
        steps = re.findall(r'(\d+)\((\d)\)', worked)
        a, op, b = re.match(r'(\d+)([+-])(\d)', worked).groups()
        sign = 1 if op == '+' else -1
        assert [int(n) for n, _ in steps] == [int(a) + sign * k for k in range(1, int(b) + 1)]
        assert [int(k) for _, k in steps] == list(range(1, int(b) + 1)), worked


def test_count_on_frac_rewrites_that_share_of_training_solutions_only():
    plain_train, plain_test = arith_splits(2000, 200, seed=0, difficulty='starter')
    train, test = arith_splits(2000, 200, seed=0, difficulty='starter', count_on_frac=0.3)
    assert test == plain_test, 'the held-out split must not change'
    assert [ex['question'] for ex in train] == [ex['question'] for ex in plain_train], \
        'the same problems'
    worked = sum(ex['solution'] != p['solution'] for ex, p in zip(train, plain_train))
    assert 0.25 < worked / len(train) < 0.35, worked
    pairs = zip(train, plain_train)
    assert all(ex['solution'] in (p['solution'], count_on(p['solution'])) for ex, p in pairs)


def test_slip_drops_the_carry_and_is_right_exactly_without_one():
    """The offline demo's hurried teacher: tens kept, ones digit wrapped, the #### answer following
    the line."""
    assert slip('46+7=53\n#### 53') == '46+7=43\n#### 43'
    assert slip('80-7=73\n#### 73') == '80-7=83\n#### 83'
    assert slip('95+7=102\n#### 102') == '95+7=92\n#### 92'
    assert slip('42+5=47\n#### 47') == '42+5=47\n#### 47', 'no carry: already right'
    assert slip('12+30=42\n#### 42') == '12+30=42\n#### 42', \
        'two-digit amounts are left as they were'
    for ex in make_arith(300, seed=5, difficulty='starter'):
        a, op, b = re.match(r'(\d+)([+-])(\d)', ex['solution']).groups()
        carries = int(a) % 10 + int(b) > 9 if op == '+' else int(a) % 10 < int(b)
        assert is_correct(slip(ex['solution']), ex['answer']) == (not carries), ex['solution']


def test_slip_frac_rewrites_direct_training_solutions_only():
    knobs = dict(seed=0, difficulty='starter', count_on_frac=0.4)
    plain_train, plain_test = arith_splits(2000, 200, **knobs)
    train, test = arith_splits(2000, 200, **knobs, slip_frac=1.0)
    assert test == plain_test, 'the held-out split (and its answers) must not change'
    assert [ex['question'] for ex in train] == [ex['question'] for ex in plain_train]
    assert [':' in ex['solution'] for ex in train] == [':' in p['solution'] for p in plain_train], \
        'counting kept'
    direct = [(ex, p) for ex, p in zip(train, plain_train) if ':' not in p['solution']]
    assert all(ex['solution'] == slip(p['solution']) for ex, p in direct)
    right = sum(is_correct(ex['solution'], ex['answer']) for ex, _ in direct) / len(direct)
    assert 0.4 < right < 0.6, right  # about half the starter problems need a carry or a borrow
