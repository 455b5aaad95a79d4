"""The task seam (tasks/): the built-in tasks expose the interface; a task from outside the project
plugs in by --task=module:attr or a path, trains and is evaluated with its own grade; sample.py on a
run's export reproduces the run's last eval/pass@1; a broken task fails at start-up in one line."""
import contextlib
import json
import string
import sys

import pytest
import torch

import tasks
import test_train
from test_train import ROOT, TINY, env, metrics, run
import warm


@contextlib.contextmanager
def other_task():
    """test_train's tiny runs with their arith knobs left out: they are unknown keys under any
    other task."""
    test_train.TINY = [a for a in TINY if not a.startswith(('--task=', '--arith_'))]
    try:
        yield
    finally:
        test_train.TINY = TINY


def run_task(out_dir, *args, **kw):
    with other_task():
        return run(out_dir, *args, **kw)

GSM8K = ROOT.parent / 'shared' / 'gsm8k'


@pytest.mark.parametrize('name', ['gsm8k', 'arith'])
def test_builtin_tasks_expose_the_interface(name):
    t = tasks.resolve(name)
    for attr in ('load', 'messages', 'grade', 'solution', 'rewards'):
        assert hasattr(t, attr), f"tasks/{name}.py lacks {attr}"
    ex = {'question': 'Tom has 12 apples and gets 7 more. How many apples does Tom have?',
          'answer': '19', 'solution': '12+7=19\n#### 19'}
    msgs = t.messages(ex)
    assert msgs[-1]['role'] == 'user' and msgs[-1]['content'].startswith(ex['question'])
    assert t.grade('so 12+7=19\n#### 19', ex) and t.grade('The answer is \\boxed{19}.', ex)
    assert not t.grade('#### 18', ex) and not t.grade('', ex)
    assert t.grade(t.solution(ex), ex), "the warm start's target must grade as correct"
    msgs = tasks.messages(t, ex, system_prompt='S', instruction='I')
    assert msgs[:1] == [{'role': 'system', 'content': 'S'}]


def test_task_defaults_own_the_prompt():
    """gsm8k asks for steps and a box under a system turn; arith (byte models) has neither, every
    byte being a token."""
    ex = {'question': 'q?', 'answer': '1', 'solution': '#### 1'}
    g = tasks.resolve('gsm8k').messages(ex)
    assert [m['role'] for m in g] == ['system', 'user'] and '\\boxed{}' in g[1]['content']
    assert tasks.resolve('arith').messages(ex) == [{'role': 'user', 'content': 'q?'}]


def test_arith_knobs_are_the_tasks_and_shape_its_data():
    t = tasks.resolve('arith')
    knobs = tasks.knobs(t)
    assert knobs['arith_difficulty'] == 'easy' and knobs['arith_n_test'] == 200
    assert 'rewards' not in knobs
    before = t.load('test', seed=0)
    try:
        tasks.set_knobs(t, {'arith_n_test': 5, 'arith_difficulty': 'starter'})
        small = t.load('test', seed=0)
        assert len(small) == 5 and small != before[:5]
    finally:
        tasks.set_knobs(t, knobs)
    assert t.load('test', seed=0) == before


@pytest.mark.skipif(not (GSM8K / 'test.jsonl').exists(), reason='../shared/gsm8k not present')
def test_gsm8k_loads_through_the_task():
    test = tasks.resolve('gsm8k').load('test', data_dir=str(GSM8K))
    assert len(test) == 1319
    assert all(tasks.resolve('gsm8k').grade(ex['solution'], ex) for ex in test[:50])


def test_resolve_errors_name_the_task_and_what_is_missing():
    with pytest.raises(ValueError, match=r"task 'grpo_test_task:no_grade' has no grade\(\)"):
        tasks.resolve('grpo_test_task:no_grade')
    with pytest.raises(ValueError, match="unknown task 'gsm9k'"):
        tasks.resolve('gsm9k')
    with pytest.raises(ValueError, match="no such file"):
        tasks.resolve('nowhere/task.py')


def test_task_missing_a_name_stops_at_start_up_in_one_line(tmp_path):
    p = run_task(tmp_path, '--task=grpo_test_task:no_grade', check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "'grpo_test_task:no_grade' has no grade()" in lines[0], p.stderr
    assert not (tmp_path / 'metrics.jsonl').exists()


def sample_py(*args):
    p = warm.run([sys.executable, str(ROOT / 'sample.py'), *args], cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return p, json.loads(p.stdout.strip().splitlines()[-1])


def test_plugged_in_task_trains_and_is_evaluated_with_its_own_grade(tmp_path):
    """--task=module:attr: 2 steps, eval at the end; the 'correct' reward and eval/pass@1 both pay
    the task's grade (the parity of the completion's bytes), which the numeric checker would almost
    never agree with. sample.py on the export, with no other argument, gets the same pass@1 from the
    same completions."""
    out = tmp_path / 'run'
    run_task(out, '--task=grpo_test_task:parity', '--max_steps=2', '--eval_every=2',
             '--eval_examples=16', '--export_hf=True', "--rewards=None")
    rows = metrics(out)
    assert 'reward/correct/mean' in rows[1], (
        "the task's default reward is 'correct', paying its grade")
    p, s = sample_py(f'--init_from={out / "hf"}', f'--out_dir={tmp_path / "eval"}')
    assert s['n'] == 16 and s['pass@1'] == rows[-1]['eval/pass@1'], (s, rows[-1])
    from grpo_test_task import grade
    evals = [json.loads(line) for line in open(tmp_path / 'eval' / 'eval.jsonl')]
    by_grade = sum(grade(r['completions'][0], {'answer': r['reference']}) for r in evals)
    by_grade /= len(evals)
    assert by_grade == s['pass@1'] and 0 < s['pass@1'] < 1, (
        f"pass@1 {s['pass@1']} must be the parity grade's")


def test_export_best_keeps_the_best_evaluation_through_a_resume(tmp_path):
    """export_best='eval/pass@1', an evaluation every step of 6 (the parity task's pass@1 moves
    with the weights): out_dir/hf_best holds the weights of the first step with the highest value,
    its grpo_run.json says which. A run killed right after step 6's update (resumed from step 5's
    checkpoint, whose best was step 5's) ends with the same hf_best: without the best carried in
    the checkpoint, step 6's lower value became the 'best'. With export_best_mode='min', the lowest
    value's step. A metric the evaluation does not log is one line, exit 2."""
    args = ['--task=grpo_test_task:parity', '--max_steps=6', '--eval_every=1', '--save_every=1',
            '--export_best=eval/pass@1', '--keep_last=10', '--lr=3e-2', '--eval_examples=16',
            '--rewards=None']
    jobs = [(tmp_path / 'straight', []), (tmp_path / 'killed', ['--fault_kill_opt_step=6']),
            (tmp_path / 'typo', ['--export_best=eval/pass@l', '--max_steps=1']),
            (tmp_path / 'lowest', ['--export_best_mode=min'])]
    with other_task():
        straight, killed, typo, lowest = test_train.run_together(
            *[[out, *args, *more] for out, more in jobs], check=False)
    assert typo.returncode == 2 and "--export_best='eval/pass@l'" in typo.stderr, typo.stderr
    assert len(typo.stderr.strip().splitlines()) == 1 and 'eval/pass@1' in typo.stderr
    assert straight.returncode == 0 and killed.returncode < 0, (straight.stderr, killed.returncode)
    run_task(tmp_path / 'killed', *args)
    evals = [(r['eval/pass@1'], -r['step']) for r in metrics(tmp_path / 'straight')]
    value, step = max(evals)
    step = -step
    assert 0 < step < 6, f"the best must come after the start and before step 6: {evals}"
    from hf import from_pretrained
    for out in ('straight', 'killed'):
        saved = json.load(open(tmp_path / out / 'hf_best' / 'grpo_run.json'))
        assert (saved['step'], saved['best']) == (step, {'eval/pass@1': value}), (out, saved)
    model, _ = from_pretrained(str(tmp_path / 'killed' / 'hf_best'))
    sd = test_train.weights(tmp_path / 'straight', step)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in sd.items())
    # export_best_mode='min' (the same training): the first step with the lowest value
    low, low_step = min((v, -s) for v, s in evals)
    saved = json.load(open(tmp_path / 'lowest' / 'hf_best' / 'grpo_run.json'))
    assert lowest.returncode == 0 and low_step != step, (lowest.stderr[-2000:], evals)
    assert (saved['step'], saved['best']) == (low_step, {'eval/pass@1': low}), (saved, evals)


def test_task_from_a_path_trains_and_takes_its_knobs(tmp_path):
    path = ROOT / 'tests' / 'grpo_test_task.py'
    p = run_task(tmp_path, f"--task={path}", '--max_steps=1', '--rewards=None',
                 '--parity_n_train=24')
    assert metrics(tmp_path)[-1]['step'] == 1, p.stdout[-2000:]
    assert '24 train / 4 eval problems' in p.stdout, p.stdout[-2000:]
    saved = json.load(open(tmp_path / 'config.json'))
    assert saved['task'] == str(path) and saved['parity_n_train'] == 24, (
        "the task's knob is a knob, saved with the run")


def test_sample_py_reproduces_the_runs_eval_on_arith(tmp_path):
    """The built-in task, its knobs (a 12-problem test split) and the run's prompts ('' system
    prompt and instruction), eval size, budget and stop strings all come from the export's
    grpo_run.json, its chat template from the export's tokenizer files (a checkpoint's, from its run:
    both evaluate alike). The stop strings (every letter and digit: most of a random model's
    completions write one) end training samples and evaluated completions alike, each text cut
    right after its first. A base model's layout: a plain-text template and stop strings."""
    out = tmp_path / 'run'
    stops = list(string.ascii_letters + string.digits)
    run(out, '--max_steps=2', '--eval_every=1', '--eval_examples=10', '--arith_n_test=12',
        '--export_hf=True', '--eval_max_new_tokens=12', '--arith_difficulty=starter',
        f'--stop_strings={stops}', '--log_samples_every=1',
        "--chat_template=Q: {{ messages[-1].content }}{{ '\\n' }}A:")
    rows = metrics(out)
    prompts = [json.loads(x)['prompt'] for x in (out / 'samples.jsonl').read_text().splitlines()]
    assert all(x.startswith('Q: ') and x.endswith('?\nA:') for x in prompts), prompts
    # 4 sampled completions a problem too (the greedy ones of a random model repeat one byte)
    p, s = sample_py(f'--init_from={out / "hf"}', f'--out_dir={tmp_path / "eval"}', '--n_samples=4')
    assert s['n'] == 10 and s['pass@1'] == rows[-1]['eval/pass@1'], (s, rows[-1])
    assert 'evaluating as the run evaluated at step 2' in p.stdout
    samples = [json.loads(x)['completion'] for x in (out / 'samples.jsonl').read_text().splitlines()]
    evaluated = [c for x in (tmp_path / 'eval' / 'eval.jsonl').read_text().splitlines()
                 for c in json.loads(x)['completions']]
    for texts in (samples, evaluated):
        cut = [t for t in texts if any(x in t for x in stops)]
        assert len(cut) >= len(texts) // 2, texts
        assert all(sum(t.count(x) for x in stops) == 1 and t[-1] in stops for t in cut), cut
    _, s12 = sample_py(f'--init_from={out / "hf"}', f'--out_dir={tmp_path / "eval12"}',
                       '--num_examples=0')
    assert s12['n'] == 12, "an explicit --key=value overrides the run's value"
    sample_py(f'--init_from={out / "ckpt_0000002.pt"}', f'--out_dir={tmp_path / "ckpt"}', '--n_samples=4')
    assert (tmp_path / 'ckpt' / 'eval.jsonl').read_text() == (tmp_path / 'eval' / 'eval.jsonl').read_text()


def test_readme_add_a_task_example_trains_and_evaluates(tmp_path):
    """The README's example task, as printed there, plugs in by its path: a step, an eval, its own
    reward names."""
    readme = (ROOT / 'README.md').read_text()
    section = readme[readme.index('## Add a task'):]
    start = section.index('```python\n') + 10
    code = section[start:section.index('```\n', start)]
    (tmp_path / 'my_task.py').write_text(code)
    out = tmp_path / 'run'
    run_task(out, f"--task={tmp_path / 'my_task.py'}", '--max_steps=1', '--eval_every=1',
             '--reverse_n_train=40', '--rewards=None', '--max_new_tokens=8')
    rows = metrics(out)
    assert 'reward/letters_in_place/mean' in rows[1] and 'reward/correct/mean' in rows[1]
    assert 'eval/pass@1' in rows[1]


def test_a_task_file_runs_once_however_often_it_is_resolved(tmp_path):
    """configure() resolves --task to find its knobs, train_grpo.py resolves it again: a task file
    with side effects (a download, a cache) must run once, and both must see the same module (its
    knobs set once)."""
    log = tmp_path / 'ran.txt'
    src = (ROOT / 'tests' / 'grpo_test_task.py').read_text()
    (tmp_path / 'once.py').write_text(f"open({str(log)!r}, 'a').write('ran\\n')\n" + src)
    a, b = tasks.resolve(str(tmp_path / 'once.py')), tasks.resolve(str(tmp_path / 'once.py'))
    assert a is b and log.read_text() == 'ran\n'


MATH = ROOT.parent / 'shared' / 'math'


def test_a_mixture_prompts_grades_and_rewards_each_problem_by_its_own_task():
    """mix_tasks: GSM8K with a seeded 1% of MATH. Each MATH problem is prompted by math's own
    system prompt (the override reaches GSM8K's only), graded by math-verify and rewarded by
    math's default rewards: GSM8K's `format` does not apply to it (None)."""
    from reward import resolve_rewards, score
    gsm8k, math_task = tasks.resolve('gsm8k'), tasks.resolve('math')
    mixed = tasks.mixture(gsm8k, 'gsm8k', [('math', math_task, str(MATH), 0.01)])
    train = mixed.load('train', data_dir=str(GSM8K), seed=1)
    math_train = math_task.load('train', data_dir=str(MATH), seed=1)
    assert len(train) == 7473 + round(0.01 * len(math_train))
    assert mixed.load('test', data_dir=str(GSM8K), seed=1) == gsm8k.load('test', str(GSM8K))
    g, m = train[0], next(ex for ex in train if ex.get(tasks.MIX_KEY) == 'math')
    assert tasks.MIX_KEY not in g and m == {**m, tasks.MIX_KEY: 'math'}
    assert tasks.messages(mixed, m, 'S', 'I') == math_task.messages(m), "math's own prompt"
    assert tasks.messages(mixed, g, 'S', 'I') == gsm8k.messages(g, 'S', 'I')
    # GSM8K's checker reads 'the answer is 72'; MATH's wants the last \\boxed{}
    assert mixed.grade('The answer is 72.', {**g, 'answer': '72'})
    assert not mixed.grade('The answer is 72.', {**m, 'answer': '72'})
    assert mixed.grade('\\boxed{72}', {**m, 'answer': '72'})
    fns = resolve_rewards(mixed.rewards, grade=mixed.grade)
    assert [f['name'] if isinstance(f['name'], str) else f['name'].__name__ for f in fns] == [
        'correct', 'format']
    right = [f"\\boxed{{{g['answer']}}}", f"\\boxed{{{m['answer']}}}", 'no answer', 'no answer']
    sc = score(right, [g, m, g, m], fns)
    assert sc['per_fn'] == {'correct': [1.0, 1.0, 0.0, 0.0], 'format': [1.0, None, 0.0, None]}
    assert sc['total'] == [1.1, 1.0, 0.0, 0.0]
    assert not hasattr(mixed, 'solution'), "math has no warm-start solution: the mixture has none"
    arith = tasks.resolve('arith')
    both = tasks.mixture(arith, 'arith', [('gsm8k', gsm8k, str(GSM8K), 0.001)])
    a, s = next(iter(arith.load('train', seed=1))), both.load('train', seed=1)[-1]
    assert both.solution(a) == arith.solution(a) and both.solution(s) == gsm8k.solution(s)


def test_a_mixtures_shares_and_what_it_refuses():
    """times: a seeded share of a task's train split, all of it once per whole time; the same for
    the same seed. A task with tools, two tasks of one name, default rewards that disagree and
    malformed entries are each one ValueError naming the cause."""
    xs = [{'i': i} for i in range(10)]
    half, twice = tasks.times_over(xs, 0.5, 's'), tasks.times_over(xs, 2.5, 's')
    assert len(half) == 5 and len({x['i'] for x in half}) == 5 and half == tasks.times_over(xs, 0.5, 's')
    assert half != tasks.times_over(xs, 0.5, 'other seed')
    assert len(twice) == 25 and all(sum(x is y for y in twice) >= 2 for x in xs)
    arith = tasks.resolve('arith')
    with pytest.raises(ValueError, match="'arith_tools' calls tools"):
        tasks.mixture(arith, 'arith', [('arith_tools', tasks.resolve('arith_tools'), '', 1.0)])
    with pytest.raises(ValueError, match="two tasks named 'arith'"):
        tasks.mixture(arith, 'arith', [('arith', arith, 'elsewhere', 1.0)])
    import types
    heavier = types.SimpleNamespace(load=arith.load, messages=arith.messages, grade=arith.grade,
                                    rewards=[{'name': 'correct', 'weight': 2.0}])
    with pytest.raises(ValueError, match="'correct' has weight 2.0.*set --rewards"):
        tasks.mixture(arith, 'arith', [('heavier', heavier, '', 1.0)])

    def scores(completions, examples):  # a batched reward, as a reward model is
        return [0.0] * len(completions)
    scores.batched = True
    judged = types.SimpleNamespace(load=arith.load, messages=arith.messages, grade=arith.grade,
                                   rewards=[{'name': scores, 'weight': 1.0}])
    with pytest.raises(ValueError, match="'scores' scores batches, and not every task lists it"):
        tasks.mixture(arith, 'arith', [('judged', judged, '', 1.0)])
    assert tasks.mixture(judged, 'a', [('b', judged, '', 1.0)]).rewards == judged.rewards, 'alike'
    for bad in [3, ('math', 2), ('math', '', 0), ('math', '', True), ('math', '', 1.0, 'x')]:
        with pytest.raises(ValueError, match='mix_tasks'):
            tasks.mix_entry(bad)
    assert tasks.mix_entry(('math', 'd', 2)) == ('math', 'd', 2.0, 'math')
    assert tasks.eval_entries([('math', 'd')], [('math', 'd', 0.5), 'tests/t.py']) == [
        ('math', 'd', 'math'), ('tests/t.py', '', 't')], 'each set once'


def test_a_mixture_trains_each_task_with_its_own_grade_and_evaluates_each(tmp_path):
    """arith with half of the parity task mixed in (whose grade the numeric checker never shares):
    default rewards pay each problem its own grade, each step logs both tasks' prompts and
    rewards, the parity test split is evaluated as eval/grpo_test_task/, the doctor knows every
    name, samples.jsonl names each sample's task, sample.py on the export evaluates both test splits
    as the run did, and a resume with another mixture is refused."""
    args = ["--mix_tasks=[('tests/grpo_test_task.py', '', 0.5)]", '--rewards=None', '--max_steps=2',
            '--eval_every=2', '--batch_prompts=8', '--micro_batch_size=32', '--arith_n_train=40',
            '--log_samples_every=1', '--export_hf=True']
    p = run(tmp_path, *args)
    assert 'train: arith 40 (67%), grpo_test_task 20 (33%)' in p.stdout, p.stdout[-2000:]
    rows = metrics(tmp_path)
    assert 0 <= rows[2]['eval/grpo_test_task/pass@1'] <= 1 and 'eval/pass@1' in rows[2], rows[2]
    for r in rows[1:]:
        assert r['mix/arith/prompts'] + r.get('mix/grpo_test_task/prompts', 0) == 8, r
    parity = [r['mix/grpo_test_task/reward'] for r in rows[1:] if 'mix/grpo_test_task/reward' in r]
    assert parity and all(x > 0 for x in parity), ("the parity problems' own grade pays about half",
                                                   parity)
    from doctor.read import load
    assert not load(str(tmp_path))['unknown']
    samples = [json.loads(line) for line in (tmp_path / 'samples.jsonl').read_text().splitlines()]
    assert len(samples) == 8 and {s['task'] for s in samples} <= {'arith', 'grpo_test_task'}
    # sample.py on the export evaluates both held-out sets as the run did
    e = warm.run([sys.executable, 'sample.py', f"--init_from={tmp_path / 'hf'}",
                        f"--out_dir={tmp_path / 'eval'}"], cwd=ROOT, env=env(), capture_output=True,
                       text=True, timeout=120)
    assert e.returncode == 0, e.stderr[-2000:]
    summary = json.loads(e.stdout.strip().splitlines()[-1])
    assert (summary['pass@1'], summary['grpo_test_task/pass@1']) == (
        rows[2]['eval/pass@1'], rows[2]['eval/grpo_test_task/pass@1']), (summary, rows[2])
    assert (tmp_path / 'eval' / 'eval_grpo_test_task.jsonl').exists()
    # a set that cannot load stops it before anything is evaluated: one line, exit 2
    e = warm.run([sys.executable, 'sample.py', f"--init_from={tmp_path / 'hf'}", "--eval_tasks=['qa']",
                        f"--out_dir={tmp_path / 'eval2'}"], cwd=ROOT, env=env(), capture_output=True,
                       text=True, timeout=120)
    assert e.returncode == 2 and 'eval_tasks' in e.stderr and '--data_dir=DIR' in e.stderr, e.stderr
    assert not (tmp_path / 'eval2' / 'eval.jsonl').exists(), 'evaluated before the sets loaded'
    p = run(tmp_path, *args[1:], '--max_steps=3', check=False)
    assert p.returncode == 2 and 'mix_tasks: ' in p.stdout and 'changes the run' in p.stderr, p.stdout


@contextlib.contextmanager
def qa_knobs(**knobs):
    """tasks/qa.py with these knobs set (its module globals), restored after."""
    qa = tasks.resolve('qa')
    defaults = tasks.knobs(qa)
    tasks.set_knobs(qa, {**defaults, **knobs})
    try:
        yield qa
    finally:
        tasks.set_knobs(qa, defaults)


def test_qa_reads_verl_parquet_and_question_answer_jsonl(tmp_path):
    """--task=qa on a user's files: verl's preprocessed parquet (chat-message prompts, answers in
    reward_model.ground_truth, data_source) and a question/answer .jsonl (numbers, lists of
    answers); each grader; other columns by name; bad rows and a missing data_dir in one line."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    verl = [{'data_source': ['openai/gsm8k', 'lighteval/MATH'][i % 2], 'ability': 'math',
             'prompt': [{'role': 'user', 'content': f'{i} + {i}? Output the final answer after "####".'}],
             'reward_model': {'style': 'rule', 'ground_truth': str(2 * i)}} for i in range(4)]
    (tmp_path / 'verl').mkdir()
    pq.write_table(pa.Table.from_pylist(verl), tmp_path / 'verl' / 'train-00000-of-00001.parquet')
    rows = [{'question': 'Half of 1?', 'answer': '\\frac{1}{2}'}, {'question': 'A or B?', 'answer': ['A', 'B']},
            {'problem': 'Seven?', 'answer': 7, 'extra': {'ans': '7.0'}}]
    (tmp_path / 'mine').mkdir()
    (tmp_path / 'mine' / 'train.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    with qa_knobs() as qa:
        ex = qa.load('train', str(tmp_path / 'verl'))
        assert ex[1] == {'answer': ['2'], 'ground_truth': '2', 'source': 'lighteval/MATH',
                         'messages': verl[1]['prompt']}
        assert tasks.messages(qa, ex[1]) == verl[1]['prompt'], 'the prompt as it stands'
        assert tasks.messages(qa, ex[1], 'S', 'I') == [
            {'role': 'system', 'content': 'S'}, {'role': 'user', 'content': verl[1]['prompt'][0]['content'] + '\nI'}]
        assert qa.grade('so #### 2', ex[1]) and not qa.grade('#### 3', ex[1])
        assert qa.metrics(['#### 0', '#### 2', '#### 4', '#### 7'], ex) == {
            'openai/gsm8k/pass@1': 1.0, 'lighteval/MATH/pass@1': 0.5}
        mine = qa.load('train', str(tmp_path / 'mine'))
        assert [e['answer'] for e in mine] == [['\\frac{1}{2}'], ['A', 'B'], ['7']]
        assert tasks.messages(qa, mine[2]) == [{'role': 'user', 'content': f"Seven?\n{qa.INSTRUCTION}"}]
        assert qa.grade('\\boxed{1/2}', mine[0]) and qa.grade('\\boxed{B}', mine[1])  # any of them
    with qa_knobs(qa_grader='math') as qa:  # LaTeX by math-verify, on the last \boxed{}
        assert qa.grade('\\boxed{0.5}', mine[0]) and not qa.grade('0.5', mine[0])
    with qa_knobs(qa_grader='exact') as qa:
        assert qa.grade(' B\n', mine[1]) and not qa.grade('B.', mine[1])
    with qa_knobs(qa_answer_key='extra.ans') as qa:
        with pytest.raises(ValueError, match=r"train.jsonl:1: malformed qa row: no answer column.*"
                                             r"\['extra.ans'\].*set qa_answer_key"):
            qa.load('train', str(tmp_path / 'mine'))
    with qa_knobs(qa_answer_key='extra.ans', skip_bad_rows=True) as qa:
        assert [e['answer'] for e in qa.load('train', str(tmp_path / 'mine'))] == [['7.0']]
    with qa_knobs() as qa, pytest.raises(ValueError, match="--data_dir=DIR"):
        qa.load('train', '')


def test_qa_float_answers_are_written_without_an_exponent():
    """A float answer column (parquet, JSON 5e-05) is the number written out: str() gave '5e-05',
    which the 'number' grader read as -5, and '2e+16', read as 16."""
    with qa_knobs() as qa:
        ex = qa.parse_row({'question': 'q', 'answer': [0.00005, 2e16, 1.5, 7.0]})
        assert ex['answer'] == ['0.00005', '20000000000000000', '1.5', '7.0']
        assert qa.grade('\\boxed{0.00005}', ex) and not qa.grade('\\boxed{-5}', ex)
        assert not qa.grade('\\boxed{16}', ex) and qa.grade('\\boxed{7}', ex)


def test_a_verl_reward_function_scores_as_verl_calls_it(tmp_path):
    """rewards=[{'name': 'verl_score', 'kwargs': {'fn': ...}}]: a verl compute_score, from a module
    or a file, gets the problem's data_source, ground truth and extra_info by keyword; a dict it
    returns pays its 'score'. A function that does not load is one ValueError at start-up."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from reward import resolve_rewards, score
    rows = [{'data_source': src, 'prompt': [{'role': 'user', 'content': 'q'}],
             'reward_model': {'ground_truth': '4'}, 'extra_info': {'bonus': bonus}}
            for src, bonus in (('openai/gsm8k', 0.0), ('lighteval/MATH', 0.5))]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / 'train.parquet')
    with qa_knobs() as qa:
        examples = qa.load('train', str(tmp_path))
    for fn in ('grpo_test_rewards:verl_compute_score',
               f"{ROOT / 'tests' / 'grpo_test_rewards.py'}:verl_compute_score"):
        fns = resolve_rewards([{'name': 'verl_score', 'kwargs': {'fn': fn}}])
        sc = score(['#### 4', '#### 4', '#### 5'], [examples[0], examples[1], examples[0]], fns)
        assert sc['total'] == [1.0, 1.5, 0.0] and sc['errors'] == {'verl_score': 0}, (fn, sc)
    for bad in ('grpo_test_rewards:no_such_fn', 'no/such/file.py:compute_score', ''):
        with pytest.raises(ValueError, match="verl_score: cannot load"):
            resolve_rewards([{'name': 'verl_score', 'kwargs': {'fn': bad}}])


def test_a_trl_reward_function_scores_as_grpo_trainer_calls_it():
    """rewards=[{'name': 'trl_reward', 'kwargs': {'fn': ...}}]: a TRL reward function gets the
    step's prompts and completions (conversational: assistant turns; or plain text), each example
    field as a keyword column, trainer_state.global_step and the logging hooks; its None does not
    apply. A function that does not load is one ValueError at start-up."""
    from reward import resolve_rewards, score
    examples = [{'question': 'Two and two?', 'answer': '4'}, {'question': 'One and one?', 'answer': '2'}]

    def messages(ex):  # the run's prompt of an example, as train_grpo passes it
        return [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': ex['question']}]
    fns = resolve_rewards([{'name': 'trl_reward', 'kwargs': {'fn': 'grpo_test_rewards:trl_accuracy'}}],
                          messages=messages)
    sc = score(['#### 4', '#### 3', '#### 2'], [examples[0], examples[0], examples[1]], fns, step=5)
    assert sc['total'] == [1.0, 0.0, 1.0] and sc['errors'] == {'trl_reward': 0}, sc
    fns = resolve_rewards([('trl_reward', 1.0, {'fn': 'grpo_test_rewards:trl_state_and_prompts',
                                                'conversational': False})], messages=messages)
    sc = score(['a', 'skip'], examples, fns, step=5)
    assert sc['per_fn']['trl_reward'] == [5.0 + len('Two and two?'), None], sc
    with pytest.raises(ValueError, match="trl_reward: cannot load 'grpo_test_rewards:nope'"):
        resolve_rewards([{'name': 'trl_reward', 'kwargs': {'fn': 'grpo_test_rewards:nope'}}])
    fns = resolve_rewards([{'name': 'trl_reward', 'kwargs': {'fn': 'grpo_test_rewards:trl_async_accuracy'}}],
                          messages=messages)
    sc = score(['#### 4', '#### 3', '#### 2'], [examples[0], examples[0], examples[1]], fns, step=5)
    assert sc['total'] == [1.0, 0.0, 1.0] and sc['errors'] == {'trl_reward': 0}, "an async TRL function: " + str(sc)


def test_qa_trains_on_a_users_jsonl_and_sample_py_reproduces_its_eval(tmp_path):
    data = tmp_path / 'data'
    data.mkdir()
    for split, offset in (('train', 0), ('test', 100)):
        rows = [{'question': f'{i} + 1?', 'answer': i + 1} for i in range(offset, offset + 20)]
        (data / f'{split}.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    run_task(tmp_path / 'run', '--task=qa', f'--data_dir={data}', '--max_steps=1', '--eval_every=1',
             '--export_hf=True', '--rewards=None', '--max_seq_len=256', '--eval_examples=6')
    last = metrics(tmp_path / 'run')[-1]
    p = warm.run([sys.executable, 'sample.py', f"--init_from={tmp_path / 'run' / 'hf'}",
                        f"--out_dir={tmp_path / 'eval'}"], cwd=ROOT, env=env(), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout.strip().splitlines()[-1])['pass@1'] == last['eval/pass@1']
