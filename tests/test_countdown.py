"""tasks/countdown.py: generated problems that their own solutions solve, exact grading that runs
nothing of a completion, TinyZero's rows through --data_dir, and a training step on the task."""
import json
import time

import pytest
from hypothesis import given, settings, strategies as st

import tasks
from test_tasks import run_task
from test_train import metrics

CD = tasks.resolve('countdown')
EX = {'nums': [44, 19, 35], 'target': 98}


def test_generated_splits_are_fixed_disjoint_and_solved_by_their_solutions():
    train, test = CD._splits(300, 40, 7, (3, 4, 99, 100))
    again = CD._splits.__wrapped__(300, 40, 7, (3, 4, 99, 100))
    assert (train, test) == again, "the same seed, the same problems"
    assert CD._splits.__wrapped__(300, 40, 8, (3, 4, 99, 100))[1] != test, "another seed, others"
    keys = {(tuple(sorted(p['nums'])), p['target']) for p in test}
    assert len(keys) == 40 and not keys & {(tuple(sorted(p['nums'])), p['target']) for p in train}
    for p in train + test:
        assert 3 <= len(p['nums']) <= 4 and all(1 <= x <= 99 for x in p['nums'])
        assert 1 <= p['target'] <= 100 and p['answer'] == str(p['target'])
        assert CD.grade(CD.solution(p), p), p
        assert p['question'].startswith(f"Using the numbers {p['nums']}, create an equation that "
                                         f"equals {p['target']}.")
    assert {len(p['nums']) for p in train} == {3, 4}


@pytest.mark.parametrize('completion, right', [
    ('<think>44 + 19 = 63, 63 + 35 = 98</think>\n<answer> 44 + 19 + 35 </answer>', True),
    ('<answer>(35 + 19) + 44</answer>', True),
    ('<answer> 44 + 19 + 35 = 98 </answer>', True),             # the target written after it
    ('<answer> 44 + 19 + 35 = 97 </answer>', False),            # ... must be the target
    ('<answer> 44 + 19 + 35 </answer> or <answer> 44 </answer>', False),  # the last one counts
    ('44 + 19 + 35', False),                                    # no tags
    ('<answer> 44 + 19 + 35 + 0 </answer>', False),             # a number not given
    ('<answer> 44 + 54 </answer>', False),                      # not each number
    ('<answer> 44 + 19 + 35 + 35 - 35 </answer>', False),       # one used twice
    ('<answer> 44 - -19 + 35 </answer>', False),                # unary minus
    ('<answer> 2 ** 5 </answer>', False), ('<answer> 44 // 19 </answer>', False),
    ('<answer> __import__("os") </answer>', False),
    ('<answer> (44 + 19 + 35) / (35 - 35) </answer>', False),  # division by zero
])
def test_grade_is_the_target_from_each_number_once(completion, right):
    assert CD.grade(completion, EX) is right


def test_fractions_are_exact_and_the_metrics_say_what_went_wrong():
    ex = {'nums': [3, 3, 8, 8], 'target': 24}
    assert CD.grade('<answer> 8 / (3 - 8 / 3) </answer>', ex)  # 8 / (1/3): no float rounding
    done = ['<answer> 8 / (3 - 8 / 3) </answer>', '<answer> 8 + 8 + 3 + 3 </answer>',
            '<answer> 8 + 8 </answer>', 'no tags']
    assert CD.metrics(done, [ex] * 4) == {'answered': 0.75, 'numbers_ok': 0.5}
    assert CD.answer(done[0]) == '8/(3-8/3)' and CD.answer('none') is None


@settings(max_examples=1500, deadline=None, database=None)
@given(st.text(alphabet='0123456789+-*/()= .ae_', max_size=300))
def test_fuzz_grading_never_raises_and_stays_fast(expr):
    t = time.time()
    assert CD.grade(f'<answer>{expr}</answer>', {'nums': [1, 2, 3], 'target': 6}) in (True, False)
    assert time.time() - t < 0.5


def test_tinyzero_rows_load_from_data_dir(tmp_path):
    rows = [{'target': 98, 'nums': [44, 19, 35]}, {'target': 24, 'nums': [3, 3, 8, 8]}]
    for split in ('train', 'test'):
        (tmp_path / f'{split}.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    got = CD.load('test', data_dir=str(tmp_path))
    assert [(p['nums'], p['target']) for p in got] == [([44, 19, 35], 98), ([3, 3, 8, 8], 24)]
    assert CD.grade('<answer>44+19+35</answer>', got[0])
    # a row brings no solution: the warm start's is found by search, and grades as right
    assert all(CD.grade(CD.solution(p), p) for p in got)
    with pytest.raises(ValueError, match='no equation reaches 1000'):
        CD.solution({'nums': [1, 2, 3], 'target': 1000})
    (tmp_path / 'test.jsonl').write_text('{"target": 5}\n')
    with pytest.raises(ValueError, match=r"test\.jsonl:1: malformed countdown test row"):
        CD.load('test', data_dir=str(tmp_path))


def test_countdown_trains_a_step_with_its_rewards_and_metrics(tmp_path):
    run_task(tmp_path, '--task=countdown', '--countdown_n_train=40', '--countdown_n_test=6',
             '--max_steps=1', '--eval_every=1', '--max_new_tokens=8', '--rewards=None',
             '--max_seq_len=320')
    row = metrics(tmp_path)[-1]
    assert {'reward/correct/mean', 'reward/format/mean', 'eval/answered', 'eval/numbers_ok'} <= set(row)
