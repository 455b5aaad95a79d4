"""tasks/math.py: MATH's LaTeX answers graded by math-verify on the last \\boxed{} (equivalent forms
right, wrong ones wrong, no box wrong), a pathological answer bounded in time from any thread, the
data and its knobs, and the task trained and evaluated end to end (--task=math, config/math.py)."""
import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time

import pytest

import tasks
from test_tasks import run_task, sample_py
from test_train import ROOT, metrics
import warm

MATH = ROOT.parent / 'shared' / 'math'  # beside the clone, as CI lays it out
needs_data = pytest.mark.skipif(not (MATH / 'test.jsonl').exists(),
                                reason=f'MATH not found at {MATH} (../shared/math beside the clone)')
task = tasks.resolve('math')

# (a reference answer of MATH's test split, an equivalent answer a model may box)
EQUIVALENT = [
    (r'\dfrac{9}{7}', r'\frac{9}{7}'),
    (r'\dfrac{9}{7}', r'9/7'),
    (r'\dfrac{9}{7}', r'\tfrac97'),
    (r'\dfrac{9}{7}', r'\frac{18}{14}'),
    (r'\frac{\sqrt{3}}{2}', r'\dfrac{\sqrt3}{2}'),
    (r'\frac{\sqrt{3}}{2}', r'\frac{1}{2}\sqrt{3}'),
    (r'2 \sqrt{5}', r'2\sqrt{5}'),
    (r'2 \sqrt{5}', r'\sqrt{20}'),
    (r'(3,-3,1)', r'(3, -3, 1)'),
    (r'(3,-3,1)', r'\left(3,-3,1\right)'),
    (r'\left( \frac{4}{3}, -\frac{1}{3} \right)', r'(4/3, -1/3)'),
    (r'x \in [-2,7]', r'[-2, 7]'),
    (r'\left[ \frac{3}{2}, 2 \right)', r'[1.5, 2)'),
    (r'[0,\infty)', r'[0, \infty)'),
    (r'\{-1\} \cup [0,7)', r'[0,7) \cup \{-1\}'),
    (r'120^\circ', r'120'),
    (r'120^\circ', r'120^{\circ}'),
    (r'69\text{ degrees}', r'69'),
    (r'5\text{ inches}', r'5 \text{ inches}'),
    (r'440\text{ cm}^2', r'440'),
    (r'\$15,\!000', r'15000'),
    (r'\$15,\!000', r'15,000'),
    (r'x = -1', r'-1'),
    (r'\text{(C)}', r'C'),
    (r'\text{odd}', r'odd'),
    (r'\mbox{Saturday}', r'\text{Saturday}'),
    (r'\frac{\pi}{3}', r'\pi/3'),
    (r'\frac{3 \pi}{4}', r'0.75\pi'),
    (r'x^2 + 10x + 25', r'(x+5)^2'),
    (r'7, -2, \text{ and } -5', r'-5, -2, 7'),
    (r'\begin{pmatrix} 6 \\ 3 \\ 0 \end{pmatrix}', r'\begin{pmatrix}6\\3\\0\end{pmatrix}'),
]
# (a reference answer of MATH's test split, a wrong answer close to it)
WRONG = [
    (r'\dfrac{9}{7}', r'\frac{7}{9}'),
    (r'\frac{\sqrt{3}}{2}', r'\frac{\sqrt{2}}{2}'),
    (r'(3,-3,1)', r'(3,1,-3)'),
    (r'\left( \frac{4}{3}, -\frac{1}{3} \right)', r'\left(-\frac{1}{3}, \frac{4}{3}\right)'),
    (r'x \in [-2,7]', r'(-2,7)'),
    (r'\left[ \frac{3}{2}, 2 \right)', r'[3/2, 2]'),
    (r'120^\circ', r'60^\circ'),
    (r'440\text{ cm}^2', r'44'),
    (r'x = -1', r'1'),
    (r'\text{(C)}', r'B'),
    (r'\text{odd}', r'\text{even}'),
    (r'\frac{\pi}{3}', r'60^\circ'),
    (r'x^2 + 10x + 25', r'x^2 + 10x + 24'),
    (r'7, -2, \text{ and } -5', r'7, -2'),
    (r'\begin{pmatrix} 6 \\ 3 \\ 0 \end{pmatrix}', r'\begin{pmatrix}6\\0\\3\end{pmatrix}'),
]
HANG = r"9^{9^{9^{9}}}"  # sympy does not finish comparing it with 2 (the test shows it)


def boxed(answer):
    return f"Let me work it out.\nSo the answer is $\\boxed{{{answer}}}$."


@pytest.mark.parametrize('reference, answer', EQUIVALENT)
def test_equivalent_forms_grade_right(reference, answer):
    assert task.grade(boxed(answer), {'answer': reference}), (
        f"\\boxed{{{answer}}} is {reference} written another way")


@pytest.mark.parametrize('reference, answer', WRONG)
def test_wrong_answers_grade_wrong(reference, answer):
    assert not task.grade(boxed(answer), {'answer': reference}), (
        f"\\boxed{{{answer}}} is not {reference}")


@needs_data
def test_the_cases_are_real_math_test_answers():
    answers = {json.loads(line)['answer'] for line in open(MATH / 'test.jsonl')}
    missing = {ref for ref, _ in EQUIVALENT + WRONG} - answers
    assert not missing, f"not answers of MATH's test split: {missing}"


def test_only_the_last_box_counts_and_no_box_is_wrong():
    ex = {'answer': r'\dfrac{9}{7}'}
    assert task.grade(r'first \boxed{2}, then \boxed{9/7}', ex)
    assert not task.grade(r'first \boxed{9/7}, then \boxed{2}', ex)
    assert not task.grade('The answer is 9/7.', ex), "no \\boxed{}: wrong, whatever the text says"
    assert not task.grade(r'The answer is $\frac{9}{7}$ (see \boxed{}).', ex), "an empty box is none"
    assert task.answer(r'so \boxed{ \frac{9}{7} }') == r'\frac{9}{7}'
    assert task.answer('no box') is None
    assert task.metrics([r'\boxed{1}', 'x', r'\boxed{2}', ''], [{}] * 4) == {'boxed': 0.5}


def test_a_pathological_answer_costs_at_most_the_timeout_from_any_thread(monkeypatch):
    """The answer really hangs sympy (a plain math-verify call is still busy after 3 s); grade()
    gives up after math_grade_timeout_s, from the main thread and from a thread pool (where
    math-verify's own signal-based timeout cannot run), and the next call grades normally."""
    plain = ['import sys; from math_verify import parse, verify; '
             'verify(parse("$2$"), parse(sys.argv[1]), timeout_seconds=None)', f'${HANG}$']
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, '-c', *plain], timeout=3, capture_output=True)
    monkeypatch.setattr(task, 'math_grade_timeout_s', 1.0)
    ex = {'answer': '2'}
    both = threading.Barrier(2)

    def warm_up(_):  # two calls at once: a worker for each thread (a start is not in the bound)
        both.wait()
        return task.grade(boxed('2'), ex)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        assert all(pool.map(warm_up, range(2)))
        t0 = time.monotonic()
        verdicts = list(pool.map(task.grade, [boxed(HANG), boxed('2')], [ex, ex]))
        pooled_s = time.monotonic() - t0
    assert verdicts == [False, True] and pooled_s < 3.0, (verdicts, pooled_s)
    t0 = time.monotonic()
    assert not task.grade(boxed(HANG), ex)
    main_s = time.monotonic() - t0
    assert main_s < 3.0, f"grade() took {main_s:.1f} s with math_grade_timeout_s=1"
    assert task.grade(boxed('2'), ex), "after a timeout a fresh worker grades the next call"


# --------------------------------------------------------------------------------------------------
# data

@needs_data
def test_the_evaluation_subset_is_fixed_and_the_knobs_choose_training_problems(monkeypatch):
    test = task.load('test', data_dir=str(MATH))
    assert len(test) == 500 and test == task.load('test', data_dir=str(MATH), seed=7)
    digests = [task.text_digest(ex) for ex in test]
    assert digests == sorted(digests)
    monkeypatch.setattr(task, 'math_test_size', 0)
    everything = task.load('test', data_dir=str(MATH))
    assert len(everything) == 5000 and everything[:500] == test
    monkeypatch.setattr(task, 'math_test_size', 500)
    monkeypatch.setattr(task, 'math_levels', [5])
    monkeypatch.setattr(task, 'math_types', ['Geometry', 'Precalculus'])
    train = task.load('train', data_dir=str(MATH))
    assert {(ex['level'], ex['type']) for ex in train} == {(5, 'Geometry'), (5, 'Precalculus')}
    assert task.load('test', data_dir=str(MATH)) == test, "the evaluation subset does not follow"


@needs_data
def test_train_leaves_out_the_two_problems_with_no_answer(capsys):
    train = task.load('train', data_dir=str(MATH))
    assert len(train) == 7498 and all(ex['answer'] for ex in train)
    assert 'left out 2 problems with an empty answer' in capsys.readouterr().out
    assert sum(ex['level'] is None for ex in train) == 2, "the two 'Level ?' rows stay, level None"


def write_split(path, rows):
    path.mkdir(exist_ok=True)
    (path / 'test.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    (path / 'train.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))


ROW = {'problem': 'What is $1+1$?', 'answer': '2', 'level': 'Level 1', 'type': 'Prealgebra'}


def test_bad_rows_and_knobs_name_what_is_wrong(tmp_path, monkeypatch):
    write_split(tmp_path, [ROW, {**ROW, 'level': 'hard'}])
    with pytest.raises(ValueError, match=r"test.jsonl:2: malformed MATH row: field 'level' is 'hard'"):
        task.load('test', data_dir=str(tmp_path))
    write_split(tmp_path, [ROW])
    monkeypatch.setattr(task, 'math_levels', [6])
    with pytest.raises(ValueError, match=r"math_levels=\[6\]: levels are 1 to 5"):
        task.load('train', data_dir=str(tmp_path))
    monkeypatch.setattr(task, 'math_levels', [])
    monkeypatch.setattr(task, 'math_types', ['Algebra'])
    with pytest.raises(ValueError, match=r"math_types=\['Algebra'\].*types present: \['Prealgebra'\]"):
        task.load('train', data_dir=str(tmp_path))
    monkeypatch.setattr(task, 'math_types', [])
    monkeypatch.setattr(task, 'math_test_size', -1)
    with pytest.raises(ValueError, match='math_test_size=-1'):
        task.load('test', data_dir=str(tmp_path))
    monkeypatch.setattr(task, 'math_test_size', 500)
    monkeypatch.setattr(task, 'math_grade_timeout_s', 0.0)
    with pytest.raises(ValueError, match='math_grade_timeout_s=0.0: expected seconds > 0'):
        task.load('test', data_dir=str(tmp_path))


def test_hub_rows_take_the_answer_from_the_solutions_last_box(monkeypatch):
    datasets = pytest.importorskip('datasets')
    hub = [{'problem': 'Find $x$.', 'level': 'Level 2', 'type': 'Algebra',
            'solution': r'Then $x=\boxed{3}$... no: $x = \boxed{\frac{1}{2}}$.'}]

    def from_hub(*args, **kwargs):
        return hub
    monkeypatch.setattr(datasets, 'load_dataset', from_hub)
    assert task.load('train') == [{'question': 'Find $x$.', 'answer': r'\frac{1}{2}', 'level': 2,
                                   'type': 'Algebra'}]

    def offline(*args, **kwargs):
        raise ConnectionError('no route to the hub')
    monkeypatch.setattr(datasets, 'load_dataset', offline)
    with pytest.raises(RuntimeError, match='--data_dir=../shared/math'):
        task.load('train')


# --------------------------------------------------------------------------------------------------
# end to end

@needs_data
def test_math_trains_a_step_and_sample_py_reproduces_its_eval(tmp_path):
    """--task=math on a tiny byte-level model with the real data and the task's own prompt: a step,
    an eval; sample.py on the export evaluates the same problems with the same grade (pass@1 and
    boxed equal to the run's, each problem's verdict the task's grade of its completion). A bad
    knob stops the run in one line naming it."""
    out = tmp_path / 'run'
    run_task(out, '--task=math', f'--data_dir={MATH}', '--system_prompt=None', '--instruction=None',
             '--max_seq_len=4608', '--max_steps=1', '--eval_every=1', '--eval_examples=4',
             '--math_test_size=6', '--rewards=None', '--export_hf=True')
    rows = metrics(out)
    assert rows[-1]['step'] == 1 and 'reward/correct/mean' in rows[1]
    assert 'eval/pass@1' in rows[-1] and 'eval/boxed' in rows[-1], rows[-1]
    _, s = sample_py(f'--init_from={out / "hf"}', f'--out_dir={tmp_path / "eval"}')
    assert s['n'] == 4 and s['pass@1'] == rows[-1]['eval/pass@1'], (s, rows[-1])
    assert s['boxed'] == rows[-1]['eval/boxed'], (s, rows[-1])
    test = task.load('test', data_dir=str(MATH))
    by_question = {ex['question']: ex for ex in test}
    evals = [json.loads(line) for line in open(tmp_path / 'eval' / 'eval.jsonl')]
    assert [r['question'] for r in evals] == [ex['question'] for ex in test[:4]]
    for r in evals:
        assert r['correct'][0] == task.grade(r['completions'][0], by_question[r['question']])
    p = run_task(tmp_path / 'bad', '--task=math', f'--data_dir={MATH}', '--math_levels=[0, 3]',
                 check=False)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode != 0 and len(lines) == 1 and 'math_levels=[0, 3]' in lines[0], p.stderr


@needs_data
def test_math_config_runs_on_a_tiny_qwen2_snapshot(tmp_path):
    """config/math.py as written (Qwen2.5-Math's prompt, levels 3-5, its rewards) on a tiny random
    Qwen2 with the real data: a step and an eval."""
    from test_train import tiny_qwen2_snapshot
    snap = tiny_qwen2_snapshot(tmp_path / 'tiny-qwen2', 4608)
    env = {**os.environ, 'PYTHONUNBUFFERED': '1'}
    cmd = [sys.executable, 'train_grpo.py', 'config/math.py', f'--init_from={snap}',
           f'--data_dir={MATH}', f'--out_dir={tmp_path / "out"}', '--max_steps=1',
           '--batch_prompts=2', '--group_size=2', '--max_new_tokens=8', '--eval_examples=2',
           '--eval_every=1', '--device=cpu', '--dtype=float32', '--save_every=1']
    p = warm.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert 'task: math, 5584 train / 2 eval problems' in p.stdout, p.stdout[-2000:]
    rows = metrics(tmp_path / 'out')
    assert [r['step'] for r in rows] == [0, 1] and 'eval/pass@1' in rows[-1]
