"""Specification of answer extraction, grading and the reward config (reward.py)."""
import json
import math
import re
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

from reward import (REWARD_FNS, check_reward_config, extract_answer, is_correct, length_penalty,
                    score)

GSM8K = Path(__file__).resolve().parents[1].parent / 'shared' / 'gsm8k'

# (completion, expected canonical answer): one row per format the grader must read.
FORMATS = [
    ('\\boxed{72}', '72'),
    ('\\boxed{\\frac{3}{4}}', '3/4'),
    ('\\boxed{\\dfrac{3}{4}}', '3/4'),
    ('\\boxed{\\tfrac34}', '3/4'),
    ('\\boxed{-\\frac{1}{2}}', '-1/2'),
    ('\\boxed{2\\frac{1}{2}}', '5/2'),                # a mixed number: 2 + 1/2
    ('\\boxed{-2\\dfrac{1}{2}}', '-5/2'),
    ('#### 3 \\tfrac13', '10/3'),
    ('\\boxed{\\$1,234.50}', '1234.5'),
    ('\\boxed{18 \\text{ dollars}}', '18'),
    ('\\boxed{\\text{18}}', '18'),
    ('\\boxed{x = -5}', '-5'),
    ('\\boxed{12+7=19}', '19'),
    ('\\boxed{{{42}}}', '42'),                       # nested braces
    ('\\boxed{50\\%}', '50'),
    ('\\boxed{1{,}000}', '1000'),
    ('\\fbox{9}', '9'),
    ('\\boxed{B}', 'B'),                             # non-numeric answers are kept as strings
    ('#### 72', '72'),
    ('#### $1,234', '1234'),
    ('#### -3', '-3'),
    ('The answer is 18.', '18'),
    ('The answer is $18.00 per day.', '18'),
    ('the answer is: 3/4 of a cup', '3/4'),
    ('So the answer is -0.5', '-0.5'),
    ('Final answer: 1,000,000', '1000000'),
    ('FINAL ANSWER: 25%', '25'),
    ('She has 5 apples', '5'),
    ('It costs $2.50.', '2.5'),
    ('It costs \\$7 in total.', '7'),
    ('The speed is 60km per hour', '60'),
    ('Temperature drops to −4 degrees', '-4'),       # unicode minus
    ('12-7=5', '5'),                                 # binary minus is not a sign
    ('007', '7'),
    ('-0', '0'),
    ('3.1400', '3.14'),
    ('\\boxed{.5}', '0.5'),                          # a leading point is a decimal point
    ('#### -.25', '-0.25'),
    ('The answer is $.75 each.', '0.75'),
    ('So...7', '7'),                                 # ... where a point is not one
    ('See v.5', '5'),
    ('1.2.3', '3'),
]
# numbers that are not the answer
PREFIX = 'Let me think. First 3 + 4 = 7, then 7 * 2 = 14 and 100/4 = 25.\n'
# trailing text without numbers
SUFFIX = ' That is all.'


@pytest.mark.parametrize('text, expected', FORMATS)
def test_extract_each_format_bare(text, expected):
    assert extract_answer(text) == expected, f'{text!r} should extract as {expected!r}'


@pytest.mark.parametrize('text, expected', FORMATS)
def test_extract_each_format_with_noise_around(text, expected):
    noisy = PREFIX + text + SUFFIX
    assert extract_answer(noisy) == expected, f'{noisy!r} should extract as {expected!r}'


MARKED = ('\\boxed', '\\fbox', '####', 'The answer', 'the answer', 'So the', 'Final', 'FINAL')


@pytest.mark.parametrize('text, expected', [(t, e) for t, e in FORMATS if t.startswith(MARKED)])
def test_marked_answers_survive_numbers_after_them(text, expected):
    # The trusted formats win over numbers that follow, e.g. a model checking its work after
    # answering.
    noisy = PREFIX + text + '\nCheck: 1 + 2 = 3, and 99 is not it.'
    assert extract_answer(noisy) == expected, f'{noisy!r} should extract as {expected!r}'


@pytest.mark.parametrize('text, expected', [
    # boxed beats everything
    ('#### 1 ... the answer is 2 ... \\boxed{3} final answer: 4. 5', '3'),
    # #### beats the phrases
    ('the answer is 2, final answer: 4 #### 1. Also 5', '1'),
    # "the answer is" beats "final answer"
    ('final answer: 4. So the answer is 2. Then 5', '2'),
    # "final answer" beats last number
    ('final answer: 4, then 5', '4'),
    # the last box
    ('\\boxed{1} and later \\boxed{2}', '2'),
    # truncated box is not an answer
    ('\\boxed{1} then an unclosed \\boxed{2', '1'),
    # echoed empty box is ignored
    ('Put it in \\boxed{}. I get 8.', '8'),
    # marker without number falls through
    ('#### no number here, but 6 later', '6'),
])
def test_order_of_trust(text, expected):
    assert extract_answer(text) == expected, f'{text!r} should extract as {expected!r}'


@pytest.mark.parametrize('text', ['', 'no digits at all', '\\boxed{}', None, 12])
def test_no_answer_is_none(text):
    assert extract_answer(text) is None


@pytest.mark.parametrize('completion, reference, want', [
    ('\\boxed{72}', '72', True),
    ('\\boxed{73}', '72', False),
    ('#### 1,234', '1234', True),
    ('The answer is 72.0', '72', True),
    ('\\boxed{\\frac{6}{8}}', '0.75', True),          # fractions are evaluated
    ('\\boxed{1/3}', '0.333333333', True),            # float tolerance
    ('\\boxed{1/3}', '0.33', False),                  # ... which is tight
    ('\\boxed{123456789012}', '123456789013', False),  # integers are exact, however large
    ('\\boxed{5/0}', '5/0', True),                    # undefined values: compared as strings
    ('\\boxed{.5}', '0.5', True),                     # .5 is 0.5, not 5
    ('\\boxed{.5}', '5', False),
    ('\\boxed{0.5}', '.5', True),
    ('\\boxed{2\\frac{1}{2}}', '2.5', True),          # a mixed number, not 21/2
    ('\\boxed{2\\frac{1}{2}}', '10.5', False),
    ('\\boxed{-2\\frac{1}{2}}', '-2.5', True),
    ('\\boxed{B}', 'B', True),
    ('\\boxed{b}', 'B', True),
    ('\\boxed{A}', 'B', False),
    ('I do not know', '0', False),
])
def test_is_correct(completion, reference, want):
    assert is_correct(completion, reference) is want, \
        f'is_correct({completion!r}, {reference!r}) should be {want}'


def _gsm8k_rows(split):
    path = GSM8K / f'{split}.jsonl'
    if not path.exists():
        pytest.skip(f'GSM8K not found at {path} (CI keeps it beside the clone in ../shared/gsm8k)')
    return [json.loads(line) for line in open(path)]


def _after_marker(solution):
    return solution.split('####')[-1].replace(',', '').strip()


@pytest.mark.parametrize('split, n', [('train', 7473), ('test', 1319)])
def test_gsm8k_reference_solutions_grade_correct(split, n):
    rows = _gsm8k_rows(split)
    assert len(rows) == n
    # The reference answer read independently: the text after '####', thousands commas dropped.
    wrong = [r['answer'] for r in rows if not is_correct(r['answer'], _after_marker(r['answer']))]
    assert not wrong, \
        f'{len(wrong)}/{n} {split} solutions fail against their own #### value, e.g. {wrong[:2]}'


@pytest.mark.parametrize('split', ['train', 'test'])
def test_gsm8k_solutions_do_not_grade_correct_against_a_wrong_answer(split):
    # The control for the test above: the grader is not simply saying yes.
    rows = _gsm8k_rows(split)
    fooled = []
    for r in rows:
        wrong_answer = str(int(_after_marker(r['answer'])) + 1)
        if is_correct(r['answer'], wrong_answer):
            fooled.append(r['answer'])
    assert not fooled, \
        f'{len(fooled)} {split} solutions graded correct against answer+1, e.g. {fooled[:2]}'


# --------------------------------------------------------------------------------------------------
# fuzz: no exception and no regex blow-up on random and adversarial strings

ADVERSARIAL = [
    '1' * 100_000,                                    # a huge number (int() refuses > 4,300 digits)
    '1,' * 50_000, '1,234' * 20_000, '1.' * 50_000, '1/' * 50_000, '-' * 100_000,
    '\\boxed{' * 14_000,                              # 100 kB of unclosed boxes
    '\\boxed{' * 5_000 + '7' + '}' * 5_000,           # deeply nested boxes
    '{' * 50_000 + '}' * 50_000,
    '\\frac{1' * 15_000, '\\frac{' + '1 ' * 50_000, '\\frac{' + ' ' * 100_000,
    '#### ' + '1 , ' * 25_000, '1 ' * 50_000, 'the answer is ' * 7_000, '#### ' * 20_000,
    '\u0663' * 100_000,                               # Arabic-Indic digits
    '\uff15' * 50_000 + ' \\boxed{\U0001d7d3}',       # fullwidth / mathematical digits
    ('word 12 \\boxed{ $ 3/4 , final answer: ' * 3_000)[:100_000],
]
PIECES = ['\\boxed{', '\\fbox{', '{', '}', '####', 'the answer is', 'Final Answer:', '\\frac{',
          '\\dfrac', '\\$', '$', '%', ',', '.', '/', '-', '\u2212', ' ', '\n', '=', '<<', '>>', 'x',
          '\u0663', '\uff15', '\U0001d7d3', '0', '7', '123', '1,234', '3.14', '9' * 5000, '{,}',
          '\\text{']


def _repeated(piece_and_count):
    """The piece repeated count times, cut at 100 kB."""
    piece, count = piece_and_count
    return (piece * count)[:100_000]


pieces = st.lists(st.sampled_from(PIECES) | st.text(max_size=8), max_size=40).map(''.join)
big = st.tuples(pieces, st.integers(1, 3000)).map(_repeated)
strings = st.one_of(st.text(max_size=200), pieces, pieces, big, st.sampled_from(ADVERSARIAL))


@contextmanager
def _time_limit(seconds):
    # hypothesis' deadline only judges an example after it returns; a catastrophically backtracking
    # regex never returns, so interrupt it (the re engine checks signals) and fail with a message
    # instead of hanging.
    main = threading.current_thread() is threading.main_thread()
    if not hasattr(signal, 'setitimer') or not main:
        yield
        return
    class Slow(BaseException):  # not an Exception, so extract_answer's catch-all cannot swallow it
        pass
    def interrupt(*_):
        raise Slow
    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except Slow:
        raise AssertionError(f'extraction ran over {seconds} s: regex blow-up?') from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _examples(cases):
    def decorate(f):
        for c in cases:
            f = example(c)(f)
        return f
    return decorate


@_examples(ADVERSARIAL)
@settings(max_examples=1_500, deadline=1000, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(strings)
def test_fuzz_extraction_never_raises_and_stays_fast(text):
    # deadline=1000 ms per example: linear-time extraction of 100 kB takes ~tens of ms, a
    # backtracking regex would take minutes.
    with _time_limit(5.0):
        ans = extract_answer(text)
        correct = is_correct(text, '5')
        formatted = REWARD_FNS['format'](text, {'answer': '5'})
    assert ans is None or (isinstance(ans, str) and ans), f'extract_answer returned {ans!r}'
    assert correct in (True, False) and formatted in (0.0, 1.0)


@settings(max_examples=2000, deadline=None, database=None)
@given(st.integers(-10**30, 10**30), st.sampled_from(PIECES[:12]) | st.text(max_size=30))
def test_fuzz_boxed_integer_round_trips(n, noise):
    # Whatever precedes it, a boxed integer is read back exactly.
    text = noise + f' \\boxed{{{n}}}'
    assert extract_answer(text) == str(n), f'{text!r}'
    assert is_correct(text, str(n)) and not is_correct(text, str(n + 1))


# --------------------------------------------------------------------------------------------------
# reward functions and the config

EX = {'question': 'q', 'answer': '19', 'solution': '12+7=19\n#### 19'}


def test_format_regex_needs_the_whole_layout():
    r1 = {'regex': r'\A<think>.*?</think>\s*<answer>.*?</answer>\Z'}
    fmt = REWARD_FNS['format']
    assert fmt('<think>a\nb</think>\n<answer>19</answer>', EX, **r1) == 1.0
    assert fmt('<think>a</think> 19', EX, **r1) == 0.0
    assert fmt('<answer>19</answer>', EX, **r1) == 0.0
    assert fmt('<think>a</think><answer>19</answer> and more', EX, **r1) == 0.0
    assert fmt('\\boxed{19}', EX, regex='<answer>') == 0.0  # the regex replaces the boxed test


@pytest.mark.parametrize('completion', [
    '#### 19', '####19', '#### **19**', '####\n19', '#### $19', '#### The total is 19.', 'so... \n####\n\n  -19'])
def test_format_hashes_pays_where_correct_reads_the_answer(completion):
    # what `correct` reads after the last '####' is what format(pattern='####') pays for
    assert extract_answer(completion) in ('19', '-19'), completion
    assert REWARD_FNS['format'](completion, EX, pattern='####') == 1.0, completion


def test_format_hashes_needs_a_number_after_the_last_marker():
    fmt = REWARD_FNS['format']
    assert fmt('#### no number', EX, pattern='####') == 0.0
    assert fmt('19 and then ####', EX, pattern='####') == 0.0
    assert fmt('#### ' + 'x' * 80 + ' 19', EX, pattern='####') == 0.0  # past the window
    assert fmt('\\boxed{19}', EX, pattern='####') == 0.0


def test_repetition_is_the_share_of_repeated_word_ngrams():
    rep = REWARD_FNS['repetition']
    assert rep('the cat sat on the mat', EX) == 0.0                    # 4 trigrams, all distinct
    # 'a b a b a b': trigrams aba bab aba bab -> 2 distinct of 4
    assert rep('A b a B a b', EX) == -0.5
    assert rep('a b a b a b', EX, ngram_size=2, max_penalty=-2.0) == -2.0 * (1 - 2 / 5)
    assert rep('one two', EX) == 0.0                                   # shorter than a trigram
    assert rep('x ' * 1000, EX, ngram_size=1) == -(1 - 1 / 1000)


def test_weighted_sum_by_hand():
    out = score(['\\boxed{19}', '#### 19', 'no idea'], [EX] * 3,
                [('correct', 2.0), ('format', 0.5, {'pattern': 'boxed'})])
    assert out['per_fn'] == {'correct': [1.0, 1.0, 0.0], 'format': [1.0, 0.0, 0.0]}
    assert out['total'] == [2.5, 2.0, 0.0]
    assert out['errors'] == {'correct': 0, 'format': 0} and not out['all_failed']


@pytest.mark.parametrize('reward, a, b, completion', [
    ('correct', {'correct': 1.0}, {'correct': 3.0}, '\\boxed{19}'),
    ('correct', {'incorrect': 0.0}, {'incorrect': -1.0}, '\\boxed{18}'),
    ('format', {'pattern': 'boxed'}, {'pattern': '####'}, '#### 19'),
    ('format', {'reward': 1.0}, {'reward': 0.2}, '\\boxed{19}'),
    ('format', {'missing': 0.0}, {'missing': -0.5}, '19'),
    ('format', {}, {'regex': r'\A<think>.*?</think>\s*<answer>.*?</answer>\Z'},
     '<think>7 more\nthan 12</think>\n<answer>19</answer>'),
    ('length', {'max_len': 100, 'cache_len': 20}, {'max_len': 40, 'cache_len': 20}, 'x' * 60),
    ('length', {'max_len': 40, 'cache_len': 20}, {'max_len': 40, 'cache_len': 20, 'penalty': 2.0},
     'x' * 60),
])
def test_every_config_kwarg_reaches_the_function(reward, a, b, completion):
    ra = score([completion], [EX], [{'name': reward, 'kwargs': a}])['total']
    rb = score([completion], [EX], [{'name': reward, 'kwargs': b}])['total']
    assert ra != rb, f'{reward}: changing kwargs {a} -> {b} left the reward at {ra}'


@pytest.mark.parametrize('n_tokens, want',
                         [(50, 0.0), (80, 0.0), (90, -0.5), (100, -1.0), (130, -1.0)])
def test_dapo_overlong_penalty_by_hand(n_tokens, want):
    # max_len 100, cache 20: free up to 80 tokens, then linear to -penalty at 100, clamped beyond.
    got = score(['short'], [EX], [('length', 1.0, {'max_len': 100, 'cache_len': 20})],
                extra_kwargs=[{'n_tokens': n_tokens, 'truncated': False}])['total'][0]
    assert math.isclose(got, want), f'n_tokens={n_tokens}: penalty {got}, want {want}'


def test_length_counts_characters_without_n_tokens():
    assert length_penalty('x' * 90, EX, max_len=100, cache_len=20) == -0.5


@pytest.mark.parametrize('rewards, needle', [
    ([('correct', 1.0, {'corect': 2.0})], 'corect'),            # typo in a kwarg
    ([('length', 1.0, {'max_tokens': 10})], 'max_tokens'),
    ([('nonsense', 1.0)], 'nonsense'),
    ([{'name': 'correct', 'wieght': 1.0}], 'wieght'),
    ([('correct', float('nan'))], 'weight'),
    ([('correct', 1.0), ('correct', 2.0)], 'twice'),
    ([('format', 1.0, {'pattern': 'boxd'})], 'boxd'),           # a bad value, caught by a dry run
    ([('format', 1.0, {'regex': '<answer>(.*'})], 'unterminated'),  # a regex that does not compile
    ([('repetition', 1.0, {'max_penalty': 1.0})], 'max_penalty must be <= 0'),
    ([('length', 1.0, {'max_len': '100'})], 'max_len'),
    ([('correct', 1.0, {}, 'extra')], 'expected'),
    ([{'weight': 1.0}], "no 'name'"),
    # a reward's argument beside 'name': the line shows the entry with it moved into 'kwargs'
    ([{'name': 'format', 'pattern': '####'}], re.escape("{'name': 'format', 'kwargs': {'pattern': '####'}}")),
])
def test_bad_reward_config_is_an_error_at_setup(rewards, needle):
    with pytest.raises(ValueError, match=needle):
        check_reward_config(rewards)


def test_config_forms_normalise_alike():
    a = check_reward_config([{'name': 'correct', 'weight': 1.0, 'kwargs': {}}, {'name': 'format'}])
    b = check_reward_config([('correct', 1.0), 'format'])
    assert a == b


def test_custom_fn_with_var_kwargs_receives_config_and_per_sample_kwargs():
    seen = []
    def spy(completion, example, **kw):
        seen.append(kw)
        return 0.0
    score(['a', 'b'], [EX, EX], [(spy, 1.0, {'alpha': 3})],
          extra_kwargs=[{'n_tokens': 1}, {'n_tokens': 2}])
    assert seen == [{'alpha': 3, 'n_tokens': 1}, {'alpha': 3, 'n_tokens': 2}]


def test_raising_fn_gets_failure_reward_and_is_counted():
    def flaky(completion, example):
        if completion == 'bad':
            raise RuntimeError('boom')
        return 1.0
    out = score(['ok', 'bad', 'ok'], [EX] * 3, [(flaky, 2.0), ('correct', 1.0)],
                failure_reward=-1.0)
    assert out['per_fn']['flaky'] == [1.0, -1.0, 1.0]
    assert out['total'] == [2.0, -2.0, 2.0]
    assert out['errors'] == {'flaky': 1, 'correct': 0}
    assert len(out['error_msgs']) == 1
    assert 'boom' in out['error_msgs'][0] and 'sample 1' in out['error_msgs'][0]
    assert out['all_failed'] is False


def test_all_failed_flags_a_batch_where_every_sample_errored():
    def nan(completion, example):
        return float('nan')  # a non-finite reward is an error too, not a number to train on
    out = score(['a'] * 7, [EX] * 7, [(nan, 1.0), ('correct', 1.0)], max_msgs=3)
    assert out['all_failed'] is True and out['errors']['nan'] == 7 and len(out['error_msgs']) == 3
    assert out['total'] == [0.0] * 7


def test_none_is_not_applicable_not_zero():
    """A batch mixing tasks: 'math_only' applies to the first two samples only. Its None adds
    nothing to the total and is left out of its mean and spread (TRL: None -> NaN, nansum,
    nanmean); a 0 there would pull the mean from 0.75 to 0.5."""
    from metrics import reward_spread, rollout_metrics

    def math_only(completion, example):
        return {'a': 1.0, 'b': 0.5}.get(completion)

    out = score(['a', 'b', 'c', 'd'], [EX] * 4, [(math_only, 2.0), ('correct', 1.0)])
    assert out['per_fn']['math_only'] == [1.0, 0.5, None, None]
    assert out['total'] == [2.0, 1.0, 0.0, 0.0] and out['errors']['math_only'] == 0
    sc = {**out, 'per_fn': {'math_only': out['per_fn']['math_only'], 'correct': [1.0, 0, 0, 0]}}
    comps = [{'ids': [1], 'truncated': False}] * 4
    m = rollout_metrics(torch.tensor([out['total']]).view(2, 2), torch.zeros(2, dtype=torch.bool),
                        sc, comps, [[0], [0]], {'gen': 1.0, 'step': 1.0})
    assert m['reward/math_only/mean'] == 0.75, m
    spread = reward_spread(sc, 2)
    assert math.isclose(spread['reward/math_only/std'], 0.125 ** 0.5), spread
    # group 1: scores 1.0 and 0.5 differ; group 2: nothing applies, so no signal
    assert spread['reward/math_only/frac_zero_std'] == 0.5, spread
    nothing = rollout_metrics(torch.zeros(1, 2), torch.ones(1, dtype=torch.bool),
                              {**sc, 'per_fn': {'math_only': [None, None]}},
                              comps[:2], [[0]], {'gen': 1.0, 'step': 1.0})
    assert 'reward/math_only/mean' not in nothing, "no applicable sample: no mean to log"


def test_a_reward_function_that_names_step_gets_it():
    """TRL's trainer_state: anneal a format reward over the steps. A plain and a batched fn get the
    step as one number; a fn that does not name it does not get it."""
    seen = []

    def annealed(completion, example, step):
        return max(0.0, 1.0 - step / 10)

    def batched(completions, examples, step):
        seen.append(step)
        return [float(step)] * len(completions)
    batched.batched = True

    def plain(completion, example):
        return 1.0

    out = score(['a', 'b'], [EX] * 2, [(annealed, 1.0), (batched, 1.0), (plain, 1.0)], step=4)
    assert out['per_fn'] == {'annealed': [0.6, 0.6], 'batched': [4.0, 4.0], 'plain': [1.0, 1.0]}
    assert seen == [4] and out['errors'] == {'annealed': 0, 'batched': 0, 'plain': 0}


# --------------------------------------------------------------------------------------------------
# OpenRLHF's reward protocol

@contextmanager
def reward_server(rule):
    """An OpenRLHF-style reward server on localhost: POST {'query', 'prompts', 'labels'} ->
    {'rewards': rule(query, prompt, label) each}. Yields (url, the bodies it got)."""
    import http.server
    got = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers['Content-Length'])))
            got.append(body)
            out = {'rewards': [rule(*x) for x in zip(body['query'], body['prompts'], body['labels'])],
                   'scores': [], 'extra_logs': {}}
            data = json.dumps(out).encode()
            self.send_response(200)
            self.send_header('Content-Type', 'application/json')
            self.send_header('Content-Length', str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):  # quiet
            pass
    server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f'http://127.0.0.1:{server.server_address[1]}/get_reward', got
    finally:
        server.shutdown()
        server.server_close()


def right_answer(query, prompt, label):
    return float(query.rstrip().endswith(str(label)))


def test_openrlhf_reward_posts_queries_prompts_and_labels_and_shares_them_over_servers(tmp_path):
    fn = REWARD_FNS['openrlhf_reward']
    exs = [{'answer': str(n)} for n in range(5)]
    comps = ['0', '7', '2', '3', 'x']
    queries = [f'<|im_start|>user\nq{n}<|im_end|>\n<|im_start|>assistant\n{c}' for n, c in enumerate(comps)]
    prompts = [q[:-len(c)] for q, c in zip(queries, comps)]
    with reward_server(right_answer) as (a, got_a), reward_server(right_answer) as (b, got_b):
        assert fn(comps, exs, url=a, query=queries, prompt_text=prompts) == [1.0, 0.0, 1.0, 1.0, 0.0]
        assert got_a == [{'query': queries, 'prompts': prompts, 'labels': ['0', '1', '2', '3', '4']}]
        assert fn(comps, exs, url=[a, b], query=queries, prompt_text=prompts) == [1.0, 0.0, 1.0, 1.0, 0.0]
        assert [len(x['query']) for x in got_a[1:] + got_b] == [3, 2], "shared over the two servers"
    # its reward_func file, as --remote_rm_url=path/to/reward_func.py takes it
    (tmp_path / 'rf.py').write_text("import torch\n\ndef reward_func(queries, prompts, labels):\n"
                                    "    return {'rewards': torch.tensor([float(len(q)) for q in queries])}\n")
    assert fn(['ab', 'c'], exs[:2], fn=f"{tmp_path / 'rf.py'}:reward_func") == [2.0, 1.0]


def test_a_dead_reward_server_fails_every_sample_after_its_retries():
    with reward_server(right_answer) as (url, _):
        pass  # shut down: nothing listens there now
    t = time.time()
    out = score(['1', '2'], [EX, EX], [('openrlhf_reward', 1.0, {'url': url, 'retries': 2, 'timeout': 5.0})])
    assert out['all_failed'] and out['errors'] == {'openrlhf_reward': 2}, out
    assert 'reward server' in out['error_msgs'][0] and '2 tries failed' in out['error_msgs'][0], out
    assert 1.0 <= time.time() - t < 10, "one retry, a second apart"
    for kwargs, says in [({}, 'one of them'), ({'url': url, 'fn': 'a:b'}, 'one of them'),
                         ({'url': 'localhost:8000/get_reward'}, 'http://')]:
        with pytest.raises(ValueError, match=says):
            check_reward_config([('openrlhf_reward', 1.0, kwargs)])


def test_an_async_reward_runs_every_sample_at_once_on_one_loop_for_the_run():
    """`async def` rewards: a step's calls all in flight together (each waits until all 12 have
    started: called one after another, the first would wait out its 5 s and raise), on the same
    event loop step after step (a client kept between calls stays usable); an async one that raises
    fails its sample alone; a batched async one is awaited too."""
    import asyncio
    started, loops = [], set()

    async def judge(completion, example):
        started.append(completion)
        loops.add(asyncio.get_running_loop())  # (the loop itself: an id could be reused)
        async def all_started():
            while len(started) % 12:
                await asyncio.sleep(0.001)
        await asyncio.wait_for(all_started(), 5)
        if completion == 'bad':
            raise RuntimeError('the judge refused')
        return len(completion)

    async def batched(completions, examples):
        return [1.0] * len(completions)
    batched.batched = True
    texts = ['x' * i for i in range(11)] + ['bad']
    for _ in range(2):
        sc = score(texts, [{}] * 12, [(judge, 1.0), (batched, 0.5)])
        assert sc['per_fn']['judge'] == [float(i) for i in range(11)] + [0.0], sc
        assert sc['errors'] == {'judge': 1, 'batched': 0} and 'the judge refused' in sc['error_msgs'][0], sc
        assert sc['total'][3] == 3.5
    assert len(loops) == 1, "a new event loop each step: clients made on the first would break"

