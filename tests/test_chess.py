"""tasks/chess.py: its labels are python-chess's, its prompts tokenize as prefixes of RookWorld's
training lines, its rewards judge crafted completions as worked out by hand and never raise; a
RookWorld-shaped GPT-2 snapshot (the old vocab.json + merges.txt layout) stops at <|endoftext|>;
GRPO on it starts at KL 0 and ratio 1."""
import json
import math
import os
import random
import sys
from pathlib import Path

import chess
import pytest
from hypothesis import given, settings, strategies as st

import tasks
import tasks.chess as C
from hf import load_model
from sample import encode_prompts
import warm

ROOT = Path(__file__).resolve().parents[1]
START = chess.STARTING_FEN
FOOL = 'rnbqkbnr/pppp1ppp/8/4p3/6P1/5P2/PPPPP2P/RNBQKBNR b KQkq - 0 2'  # 1. f3 e5 2. g4: Qh4 mates
STALE = 'k7/8/1Q6/8/8/8/8/7K w - - 0 1'  # Qc7 stalemates the lone king
# O-O is 'e1g1'; python-chess also accepts 'e1h1'
CASTLE = 'r3k2r/pppppppp/8/8/8/8/PPPPPPPP/R3K2R w KQkq - 0 1'


def examples(subtask, n_train=30, n_test=10, seed=0, **knobs):
    """The task's examples for these knobs, set and restored around the call."""
    old = {k: getattr(C, k) for k in ('chess_subtask', 'chess_n_train', 'chess_n_test', *knobs)}
    new = {'chess_subtask': subtask, 'chess_n_train': n_train, 'chess_n_test': n_test, **knobs}
    for k, v in new.items():
        setattr(C, k, v)
    try:
        return C.load('train', seed=seed), C.load('test', seed=seed)
    finally:
        for k, v in old.items():
            setattr(C, k, v)


def policy_line(ex, moves, evals, best):
    """A RookWorld policy training line, as its generator writes it."""
    evals = ' '.join(map(str, evals))
    return ('P: ' + ex['fen'].ljust(90) + 'M: ' + ' '.join(moves).ljust(30)
            + 'E: ' + evals.ljust(40) + 'B: ' + best)


# ----------------------------------------------------------------------------- labels and data

def test_generator_is_deterministic_and_splits_apart():
    C._splits.cache_clear()
    a = examples('environment', seed=3)
    C._splits.cache_clear()  # made again from scratch, not the cached tuple
    assert examples('environment', seed=3) == a, "same seed, different examples"
    assert examples('environment', seed=4)[1] != a[1], "another seed gave the same test split"
    train, test = a
    assert not {e['question'] for e in train} & {e['question'] for e in test}, (
        "a test prompt is also in train")
    assert examples('environment', n_train=5, seed=3)[1] == test, (
        "the test split must not depend on n_train")


@pytest.mark.parametrize('subtask', ['policy', 'mate', 'environment', 'move'])
def test_labels_agree_with_python_chess(subtask):
    """Every label recomputed independently: all legal moves pushed one by one (no gives_check
    shortcut)."""
    train, test = examples(subtask, n_train=20, n_test=5, chess_illegal_frac=0.3)
    assert len(train) == 20 and len(test) == 5
    for ex in train + test:
        board = chess.Board(ex['fen'])
        assert board.is_valid() and not board.is_game_over()
        legal = sorted(m.uci() for m in board.legal_moves)
        mates = sorted(m.uci() for m in board.legal_moves if _mates(board, m))
        if subtask == 'environment':
            assert ex['question'] == f"A: {ex['fen']}+{ex['move']}+{ex['question'].split('+')[2]}+"
            assert ex['question'].split('+')[2].split()[-1] == ex['move'], (
                "history must end with the move")
            after = board.copy()
            if ex['move'] in legal:
                after.push_uci(ex['move'])
                end = (after.is_checkmate() or after.is_stalemate()
                       or after.is_insufficient_material() or after.is_seventyfive_moves()
                       or after.is_fivefold_repetition())
                if after.is_checkmate():
                    reward = '1.0'
                elif end:
                    reward = '0.5'
                else:
                    reward = '0.001'
                assert ex['solution'] == f"{after.fen()}+{reward}+{int(end)}+0", ex
            else:
                assert ex['solution'] == f"{board.fen()}+-1.0+{int(board.is_game_over())}+1", ex
        elif subtask == 'move':
            assert ex['question'] == 'P: ' + ex['fen'] + ' B:' and ex['legal'] == legal
            assert sorted(ex['mates']) == mates, ex['fen']
            assert C.solution(ex) == ' ' + ex['solution'].strip(), ex
            assert ex['solution'].strip() in legal, (
                "chess_move_illegal_frac=0: every warm-start move is legal")
        else:
            assert ex['question'] == 'P: ' + ex['fen'] and ex['legal'] == legal
            assert sorted(ex['mates']) == mates, ex['fen']
            assert subtask == 'policy' or mates, "a mate example without a mate in one"
    if subtask == 'environment':
        assert any(e['solution'].endswith('+1') for e in train + test), (
            "chess_illegal_frac=0.3 made no illegal move")


def _mates(board, move):
    b = board.copy()
    b.push(move)
    return b.is_checkmate()


@pytest.mark.parametrize('fen, move, want', [
    # ep '-': no capture
    (START, 'e2e4', 'rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq - 0 1+0.001+0+0'),
    (FOOL, 'd8h4', 'rnb1kbnr/pppp1ppp/8/4p3/6Pq/5P2/PPPPP2P/RNBQKBNR w KQkq - 1 3+1.0+1+0'),
    (STALE, 'b6c7', 'k7/2Q5/8/8/8/8/8/7K b - - 1 1+0.5+1+0'),
    (START, 'e2e5', START + '+-1.0+0+1'),  # illegal: the state is unchanged, truncated
    # python-chess accepts king-takes-rook; the environment does not
    (CASTLE, 'e1h1', CASTLE + '+-1.0+0+1'),
])
def test_environment_transitions_by_hand(fen, move, want):
    ex = C.environment_example(fen, move, ['a2a3'] * 12)
    assert ex['solution'] == want
    history = ' '.join(['a2a3'] * 9 + [move])
    assert ex['question'] == f"A: {fen}+{move}+{history}+", "history: the last 10, move last"


# ----------------------------------------------------------------------------- rewards

def test_environment_rewards_on_crafted_completions():
    ex = C.environment_example(START, 'e2e4', [])
    right = ex['solution']
    # the pawn on the wrong file: 7 of 8 ranks right, the rest exact
    one_rank = right.replace('4P3', '3P4')
    wrong_flag = right[:-1] + '1'
    cases = {right: (True, 1.0, 1.0), one_rank: (False, 0.8 * (7 / 8 + 5) / 6 + 0.2, 1.0),
             wrong_flag: (False, 0.8 + 0.2 * 2 / 3, 1.0), ' ' + right + '\n': (True, 1.0, 1.0),
             'rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq - 0 1': (False, 0.0, 1 / 5),
             '': (False, 0.0, 0.0), 'B: e2e4': (False, 0.0, 0.0),
             '+++': (False, 0.8 * 0 + 0.0, 1 / 5)}
    for text, (grade, transition, fmt) in cases.items():
        assert C.grade(text, ex) is grade, text
        got = C.chess_transition(text, ex)
        assert math.isclose(got, transition), (text, got, transition)
        got = C.chess_format(text, ex)
        assert math.isclose(got, fmt), (text, got, fmt)
        assert C.chess_legal(text, ex) == C.chess_mate(text, ex) == C.chess_best(text, ex) == 0.0
    assert C.metrics([right, one_rank], [ex, ex]) == {'next_state_acc': 0.5, 'format_rate': 1.0}


def test_policy_rewards_on_crafted_completions():
    fool, castle = C.policy_example(FOOL, 'mate'), C.policy_example(CASTLE)
    assert fool['mates'] == ['d8h4']
    pad = ' ' * (90 - len(FOOL))

    def line(best, moves='d8h4 e8e7', evals='1000.0 -3.1'):
        return f"{pad}M: {moves.ljust(30)}E: {evals.ljust(40)}B: {best}"
    assert C.grade(line('d8h4'), fool)
    assert C.chess_mate(line('d8h4'), fool) == 1.0 == C.chess_legal(line('d8h4'), fool)
    assert not C.grade(line('e8e7'), fool) and C.chess_mate(line('e8e7'), fool) == 0.0
    assert C.chess_legal(line('e8e7'), fool) == 1.0 and C.chess_legal(line('e8e6'), fool) == 0.0
    assert C.chess_format(line('d8h4'), fool) == 1.0
    assert C.chess_format(line('d8h4', evals='1000.0'), fool) == 2 / 3, "one eval for two moves"
    assert C.chess_format(line('queen'), fool) == 2 / 3
    assert C.parse_policy(line('queen'))['best'] is None
    assert C.chess_legal('B: e1g1', castle) == 1.0, "e1h1 is not UCI O-O"
    assert C.chess_legal('B: e1h1', castle) == 0.0, "e1h1 is not UCI O-O"
    assert C.grade('B: e1g1', castle) and not C.grade('B: e1h1', castle), (
        "unlabelled policy: grade = legal")
    for garbage in ('', 'M: E: B:', 'B:', '\x00' * 50, FOOL):
        assert C.chess_format(garbage, fool) < 1
        assert C.chess_legal(garbage, fool) == C.chess_mate(garbage, fool) == 0
    assert C.chess_transition(line('d8h4'), fool) == 0.0
    assert C.metrics([line('d8h4'), line('e8e6')], [fool, fool]) == {
        'legal_rate': 0.5, 'mate_rate': 0.5, 'format_rate': 1.0}


def test_best_move_reward_uses_engine_labels():
    row = {'fen': START, 'moves': ['e2e4', 'd2d4', 'g1f3'], 'evals': [0.3, 0.25, 0.2],
           'best': 'e2e4'}
    ex = C.from_row(row, 'policy')
    paid = [C.chess_best(f'B: {m}', ex) for m in ('e2e4', 'g1f3', 'a2a3', 'e2e5')]
    assert paid == [1.0, 0.5, 0.0, 0.0]
    assert C.grade('B: e2e4', ex) and not C.grade('B: a2a3', ex), (
        "labelled policy: grade = the engine's best")
    assert C.chess_best('B: e2e4', C.policy_example(START)) == 0.0, "no labels, no best-move reward"
    assert ex['question'] + C.solution(ex) == policy_line(ex, ex['moves'], ex['evals'], 'e2e4')
    with pytest.raises(ValueError, match="no engine labels"):
        C.solution(C.policy_example(START))
    with pytest.raises(ValueError, match="need 'best' among 'moves'"):
        C.from_row({'fen': START, 'moves': ['e2e4'], 'evals': [0.3], 'best': 'd2d4'}, 'policy')


def test_move_rewards_on_crafted_completions():
    """The move sub-task: one UCI move, legal as python-chess writes it; anything else is wrong."""
    start, fool, castle = (C.from_row({'fen': f}, 'move') for f in (START, FOOL, CASTLE))
    assert start['question'] == 'P: ' + START + ' B:'
    assert C.solution(start).strip() in start['legal']
    cases = {' e2e4': (True, 1.0), 'g1f3': (True, 1.0), ' b1c3\n': (True, 1.0),
             ' a2a3 ': (True, 1.0),
             # a pawn too far, Black's, no
             ' e2e5': (False, 1.0), ' e7e5': (False, 1.0), ' g1g3': (False, 1.0),
             ' e2e4 e7e5': (False, 0.0), 'B: e2e4': (False, 0.0), ' E2E4': (False, 0.0),
             ' Nf3': (False, 0.0), '': (False, 0.0), ' e2': (False, 0.0), '\x00' * 50: (False, 0.0),
             START: (False, 0.0)}
    for text, (grade, fmt) in cases.items():
        assert C.grade(text, start) is grade, text
        assert C.chess_legal(text, start) == float(grade), text
        assert C.chess_format(text, start) == fmt, text
        assert C.chess_mate(text, start) == C.chess_best(text, start) == 0.0, text
        assert C.chess_transition(text, start) == 0.0, text
        assert C.answer(text) == text.strip() or not fmt, "maj@k votes on the move"
    assert C.grade(' d8h4', fool) and C.chess_mate(' d8h4', fool) == 1.0
    assert C.chess_mate(' e8e7', fool) == 0.0
    assert C.grade(' e1g1', castle) and not C.grade(' e1h1', castle), "e1h1 is not UCI O-O"
    assert C.metrics([' e2e4', ' e2e5', ' d8h4', 'junk'], [start, start, fool, fool]) == {
        'legal_rate': 0.5, 'mate_rate': 0.5, 'format_rate': 0.75}
    row = {'fen': START, 'moves': ['d2d4', 'e2e4'], 'evals': [0.3, 0.2], 'best': 'd2d4'}
    labelled = C.from_row(row, 'move')
    assert C.solution(labelled) == ' d2d4' and C.grade(' e2e4', labelled), (
        "the engine's best is only the target")


def test_move_examples_are_deterministic_and_their_targets_legal():
    """The move sub-task's warm-start moves are drawn from their own stream: the same seed gives the
    same moves, and every one is legal."""
    C._splits.cache_clear()
    train, test = examples('move', n_train=200, n_test=20, chess_max_plies=10)
    C._splits.cache_clear()
    assert examples('move', n_train=200, n_test=20, chess_max_plies=10) == (train, test)
    assert all(e['solution'][0] == ' ' and e['solution'][1:] in e['legal'] for e in train + test)
    assert len({e['solution'] for e in train}) > 50, (
        "the warm start's moves must vary, not one move for all")


REWARDS = [C.chess_format, C.chess_legal, C.chess_mate, C.chess_best, C.chess_transition]
FRAGMENTS = ['P: ', 'A: ', 'M: ', 'E: ', 'B: ', '+', ' ', '/', 'e2e4', 'e1h1', 'd8h4', 'a7a8q',
             '1000.0', '-nan', 'inf', '0.001', '1', '0', '8', 'rnbqkbnr', 'w', 'KQkq', '-', '\n',
             '<|endoftext|>', 'é', '🤖', START, FOOL]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.one_of(st.text(max_size=300),
                 st.lists(st.sampled_from(FRAGMENTS), max_size=40).map(''.join)))
def test_fuzz_rewards_never_raise(text):
    exs = [C.environment_example(START, 'e2e4', []), C.environment_example(START, 'e2e5', []),
           C.policy_example(FOOL, 'mate'),
           C.from_row({'fen': START, 'moves': ['e2e4', 'd2d4'], 'evals': [0.3, 0.2],
                       'best': 'e2e4'}, 'policy'),
           C.from_row({'fen': START}, 'move'), C.from_row({'fen': FOOL}, 'move')]
    for ex in exs:
        for fn in REWARDS:
            v = fn(text, ex)
            assert isinstance(v, float) and 0.0 <= v <= 1.0, (fn.__name__, text, v)
        assert isinstance(C.grade(text, ex), bool)
        C.answer(text)
    assert all(0 <= v <= 1 for v in C.metrics([text] * len(exs), exs).values())


# ----------------------------------------------------------------------------- a RookWorld snapshot

def chess_corpus():
    """Lines in both formats, for training the test's BPE."""
    env = examples('environment', n_train=150, n_test=0)[0]
    pol = examples('policy', n_train=150, n_test=0)[0]
    lines = [e['question'] + e['solution'] for e in env]
    rng = random.Random(0)
    for e in pol:
        moves = rng.sample(e['legal'], min(5, len(e['legal'])))
        lines.append(policy_line(e, moves, [round(rng.uniform(-3, 3), 2) for _ in moves], moves[0]))
    return lines


@pytest.fixture(scope='module')
def rookworld_snapshot(tmp_path_factory):
    """A tiny random GPT-2 in RookWorld-LM's layout: vocab.json + merges.txt + tokenizer_config.json
    naming <|endoftext|> only as bos/eos/unk (no tokenizer.json, no added_tokens_decoder)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel
    path = tmp_path_factory.mktemp('rookworld')
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(chess_corpus(), trainers.BpeTrainer(
        vocab_size=600, special_tokens=['<|endoftext|>'],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.model.save(str(path))  # vocab.json + merges.txt only
    (path / 'tokenizer_config.json').write_text(json.dumps({
        'tokenizer_class': 'GPT2Tokenizer', 'model_max_length': 256, 'add_prefix_space': False,
        'bos_token': '<|endoftext|>',
        'eos_token': {'__type': 'AddedToken', 'content': '<|endoftext|>', 'lstrip': False,
                      'normalized': True, 'rstrip': False, 'single_word': False},
        'unk_token': '<|endoftext|>'}))
    cfg = GPT2Config(vocab_size=bpe.get_vocab_size(), n_positions=256, n_embd=32, n_layer=2,
                     n_head=2, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(cfg).save_pretrained(str(path))
    assert not (path / 'tokenizer.json').exists()
    return path


def test_old_gpt2_layout_stops_at_endoftext(rookworld_snapshot):
    model, tok = load_model(str(rookworld_snapshot))
    eot = json.loads((rookworld_snapshot / 'vocab.json').read_text())['<|endoftext|>']
    assert tok.special == {'<|endoftext|>': eot}, (
        f"<|endoftext|> must be registered as special, got {tok.special}")
    assert tok.eos_id == eot and tok.stop_ids == [eot], "generation would never stop"
    assert tok.encode('<|endoftext|>') != [eot]
    assert tok.encode_with_special('a<|endoftext|>')[-1] == eot
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(rookworld_snapshot))
    assert hf.eos_token_id == eot
    for line in chess_corpus()[::25] + ['P: ' + FOOL, 'A: ' + START + '+e2e4+e2e4+']:
        assert tok.encode(line) == hf.encode(line), line


def test_prompts_are_token_prefixes_of_the_training_line(rookworld_snapshot):
    """RookWorld-LM saw whole lines; a prompt whose tokens are not a prefix of the line's asks for a
    token the model never saw at that point (a padded 'P: <fen> ' would end in a space token the
    line spells ' M')."""
    _, tok = load_model(str(rookworld_snapshot))
    env = examples('environment', n_train=0, n_test=20, chess_illegal_frac=0.2)[1]
    pol = examples('policy', n_train=0, n_test=20)[1]
    assert encode_prompts(tok, C, env[:3]) == [tok.encode(e['question']) for e in env[:3]], (
        "raw prompt, no template")
    for ex in env:
        prompt, line = C.messages(ex), ex['question'] + ex['solution']
        assert tok.encode(line)[:len(tok.encode(prompt))] == tok.encode(prompt), line
    for ex in pol:
        line = policy_line(ex, ex['legal'][:5], [0.1] * len(ex['legal'][:5]), ex['legal'][0])
        for prompt in (C.messages(ex), 'P: ' + ex['fen'].ljust(90) + 'M:'):
            assert line.startswith(prompt), prompt
            assert tok.encode(line)[:len(tok.encode(prompt))] == tok.encode(prompt), prompt
        padded = 'P: ' + ex['fen'].ljust(90)
        assert tok.encode(line)[:len(tok.encode(padded))] != tok.encode(padded), (
            "the padded prompt is no prefix")


def test_grpo_on_gpt2_starts_at_kl_zero_and_ratio_one(rookworld_snapshot, tmp_path):
    """beta > 0: the policy and the reference score the same ids with the same weights and no
    dropout, so at the first step KL is exactly 0; with lr 0 the second iteration's ratio is exactly
    1. The warm start's rows end in the snapshot's <|endoftext|> (not None)."""
    env = {**os.environ, 'PYTHONUNBUFFERED': '1'}
    argv = [f'--init_from={rookworld_snapshot}', '--task=chess', '--chess_n_train=16',
            '--chess_n_test=4', '--chess_max_plies=6', '--sft_steps=2', '--sft_batch_size=4',
            '--beta=0.1', '--num_iterations=2', '--lr=0.0', '--group_size=4', '--batch_prompts=2',
            '--micro_batch_size=8', '--max_new_tokens=8', '--eval_every=1', '--eval_examples=4',
            '--max_steps=1', '--device=cpu', '--dtype=float32', '--plot_every=0',
            '--export_hf=False', '--watchdog_s=0', f'--out_dir={tmp_path}']
    p = warm.run([sys.executable, str(ROOT / 'train_grpo.py'), *argv],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
    assert {'eval/next_state_acc', 'eval/format_rate'} <= set(rows[0]), (
        f"task metrics missing from eval: {rows[0]}")
    step = rows[1]
    assert step['kl'] == 0.0, (
        f"KL to the reference at the first step: {step['kl']} (dropout? a different model?)")
    assert step['ratio/min'] == step['ratio/max'] == 1.0 and step['kl_old_new'] == 0.0, step


def test_chess_is_a_builtin_task():
    assert tasks.resolve('chess') is C
    assert {'chess_subtask', 'chess_n_train', 'chess_illegal_frac'} <= set(tasks.knobs(C))
    assert 'metrics' not in tasks.knobs(C) and tasks.eval_metrics(C, [], []) == {}
    with pytest.raises(ValueError, match='chess_subtask'):
        examples('openings')


def test_data_dir_rows_and_bad_rows(tmp_path):
    """--data_dir rows (as scripts/chess_labels.py writes them) are relabelled by python-chess; a bad
    row is one error naming file and line."""
    rows = [{'fen': START, 'moves': ['e2e4', 'd2d4'], 'evals': [0.3, 0.2], 'best': 'e2e4'},
            {'fen': FOOL}]
    (tmp_path / 'test.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    old = C.chess_subtask
    try:
        C.chess_subtask = 'policy'
        got = C.load('test', data_dir=str(tmp_path))
        assert [e['best'] if 'best' in e else None for e in got] == ['e2e4', None]
        assert got[1]['mates'] == ['d8h4']
        (tmp_path / 'test.jsonl').write_text(json.dumps(rows[0]) + '\n' + '{"fen": "8/8/8 w"}\n')
        with pytest.raises(ValueError, match=r"test.jsonl:2: malformed chess row: invalid FEN"):
            C.load('test', data_dir=str(tmp_path))
    finally:
        C.chess_subtask = old


# ----------------------------------------------------------------------------- rows and completions
# as a user writes them

MATED = 'rnb1kbnr/pppp1ppp/8/4p3/6Pq/5P2/PPPPP2P/RNBQKBNR w KQkq - 1 3'  # FOOL after Qh4
STALEMATED = 'k7/2Q5/8/8/8/8/8/7K b - - 1 1'  # STALE after Qc7
BARE_KINGS = 'K7/8/8/8/8/8/8/7k w - - 0 1'  # over (insufficient material), moves still legal
# Black just played b7b5 and no white pawn can take: python-chess's fen() writes '-' there, a
# RookWorld P: line keeps 'b6' as its source wrote it (27 of RookWorld's 500 evaluation FENs)
DEAD_EP = '4k3/8/8/1p6/8/8/8/4K3 w - b6 0 32'


def load_rows(tmp_path, subtask, rows, **knobs):
    """tasks/chess.py's load of test.jsonl holding `rows`, with these knobs set for the call."""
    (tmp_path / 'test.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    new = {'chess_subtask': subtask, **knobs}
    old = {k: getattr(C, k) for k in new}
    for k, v in new.items():
        setattr(C, k, v)
    try:
        return C.load('test', data_dir=str(tmp_path))
    finally:
        for k, v in old.items():
            setattr(C, k, v)


@pytest.mark.parametrize('subtask', ['move', 'policy'])
def test_row_on_a_position_with_no_legal_move_is_a_bad_row(tmp_path, capsys, subtask):
    """Nothing to answer after mate or stalemate: the row stops the load with file:line, or is
    skipped and counted (it used to raise IndexError past skip_bad_rows on the move sub-task)."""
    rows = [{'fen': START}, {'fen': MATED}, {'fen': STALEMATED}]
    with pytest.raises(ValueError, match=r'test\.jsonl:2: malformed chess row: .*no legal move'):
        load_rows(tmp_path, subtask, rows)
    got = load_rows(tmp_path, subtask, rows, skip_bad_rows=True)
    assert [e['fen'] for e in got] == [START]
    assert 'chess: skipped 2 malformed rows, first: ' in capsys.readouterr().out


def test_row_fen_without_its_move_counters_is_a_bad_row(tmp_path):
    """python-chess fills in missing counters, but a prompt 'P: <four fields>' is no line RookWorld
    wrote: the row stops the load with file:line."""
    rows = [{'fen': START}, {'fen': START.rsplit(' ', 2)[0]}, {'fen': START.replace(' ', '  ')}]
    for bad in rows[1:]:
        with pytest.raises(ValueError, match=r'test\.jsonl:2: malformed chess row: .*six fields'):
            load_rows(tmp_path, 'move', [rows[0], bad])


@pytest.mark.parametrize('fen', [MATED, STALEMATED, BARE_KINGS])
def test_illegal_move_after_the_game_ended_is_terminated(tmp_path, fen):
    """RookWorld's environment rejects the move, then sets terminated from board.is_game_over():
    '-1.0+1+1' on a finished board, for examples made here and rows read from a file alike."""
    want = chess.Board(fen).fen() + '+-1.0+1+1'
    ex = C.environment_example(fen, 'e2e4', [])
    assert ex['solution'] == want
    row = load_rows(tmp_path, 'environment', [{'fen': fen, 'move': 'e2e4'}])[0]
    assert row['solution'] == want
    assert C.grade(want, row) and C.chess_transition(want, row) == 1.0
    assert not C.grade(want[:-3] + '0+1', row)


def test_legal_move_on_a_board_already_over_ends_the_game_again():
    ex = C.environment_example(BARE_KINGS, 'a8a7', [])
    assert ex['solution'] == '8/K7/8/8/8/8/8/7k b - - 1 1+0.5+1+0'


@pytest.mark.parametrize('subtask', ['policy', 'move'])
def test_policy_prompt_keeps_the_fen_as_written(subtask):
    """A RookWorld P: line holds its source's FEN as written (generate_lichess.py: f"P: {fen:90}"),
    so the prompt does too, dead en passant square included: then it is a prefix of the line."""
    ex = C.from_row({'fen': ' ' + DEAD_EP + '\n'}, subtask)
    assert ex['question'] == 'P: ' + DEAD_EP + ' B:' * (subtask == 'move')
    assert ex['fen'] == DEAD_EP
    assert ex['legal'] == sorted(m.uci() for m in chess.Board(DEAD_EP).legal_moves)
    row = {'fen': DEAD_EP, 'moves': ['e1d2', 'e1f2'], 'evals': [0.1, -0.2], 'best': 'e1d2'}
    ex = C.from_row(row, 'policy')
    assert ex['question'] + C.solution(ex) == policy_line(ex, row['moves'], row['evals'], 'e1d2')
    assert (ex['question'] + C.solution(ex)).startswith('P: ' + DEAD_EP.ljust(90) + 'M: ')


def test_environment_prompt_is_the_fen_python_chess_writes():
    """RookWorld's environment writes board.fen() on both sides of its A: line, so a dead en
    passant square is '-' there."""
    ex = C.environment_example(DEAD_EP, 'e1d1', [])
    assert ex['question'].startswith('A: 4k3/8/8/1p6/8/8/8/4K3 w - - 0 32+e1d1+')


@pytest.mark.parametrize('completion', [None, b'e2e4', b'B: e2e4', 42, 1.5, ['B: e2e4'], {}])
def test_rewards_never_raise_on_completions_that_are_not_text(completion):
    exs = [C.environment_example(START, 'e2e4', []), C.policy_example(FOOL, 'mate'),
           C.from_row({'fen': START}, 'move')]
    for ex in exs:
        for fn in REWARDS:
            assert fn(completion, ex) == 0.0, fn.__name__
        assert C.grade(completion, ex) is False
    assert C.answer(completion) is None
    assert C.metrics([completion] * 3, exs) == {'legal_rate': 0.0, 'mate_rate': 0.0,
                                                'next_state_acc': 0.0, 'format_rate': 0.0}


def test_environment_format_is_as_strict_as_rookworld_writes_it():
    """board.fen() writes six fields on single spaces, and the line has no blanks around '+': a FEN
    without its move counters, blanks around '+' or a double space are not the format."""
    ex = C.environment_example(START, 'e2e4', [])
    right = ex['solution']
    fen = right.split('+')[0]
    assert C.chess_format(right, ex) == 1.0
    no_counters = fen.rsplit(' ', 2)[0] + right[len(fen):]
    assert math.isclose(C.chess_format(no_counters, ex), 4 / 5)
    spaced = right.replace('+', ' + ')
    assert C.chess_format(spaced, ex) < 1 and not C.grade(spaced, ex)
    assert C.chess_transition(spaced, ex) < 1
    double = right.replace(' b ', ' b  ')
    assert math.isclose(C.chess_format(double, ex), 4 / 5) and not C.grade(double, ex)


def test_transition_credit_does_not_depend_on_where_a_double_space_falls():
    """A FEN that is not six single-spaced fields earns its board and the flags only, wherever the
    extra blank is (split on single spaces, it used to shift every field after it)."""
    ex = C.environment_example(START, 'e2e4', [])
    fen, rest = ex['solution'].split('+', 1)
    fields = fen.split(' ')
    got = set()
    for i in range(1, 6):
        double = ' '.join(fields[:i]) + '  ' + ' '.join(fields[i:])
        got.add(round(C.chess_transition(double + '+' + rest, ex), 9))
    assert got == {round(0.8 / 6 + 0.2, 9)}, got


def test_policy_fields_count_only_in_rookworld_order():
    """M:, E:, B:, each once, after padding only: a B: before E: is not the format."""
    pol = C.policy_example(FOOL, 'mate')
    good = '  M: d8h4 e8e7    E: 1000.0 -3.1    B: d8h4'
    assert C.chess_format(good, pol) == 1.0 and C.grade(good, pol)
    swapped = '  M: d8h4 e8e7    B: d8h4    E: 1000.0 -3.1'
    assert C.chess_format(swapped, pol) < 1
    twice = good + ' B: e8e7'
    assert C.chess_format(twice, pol) < 1 and not C.grade(twice, pol)
    assert C.chess_format('junk ' + good, pol) == 0.0


@pytest.mark.parametrize('number', ['1_000.0', '0.0_01', '١.٥', '1e3', 'inf', 'nan', '.5', '1',
                                    '1.', '0x1p0'])
def test_numbers_are_written_as_python_writes_a_float(number):
    """RookWorld writes str(float): '-2.07', '1000.0', '0.001'. float() also takes '1_000',
    Unicode digits, exponents and 'inf', none of which RookWorld writes."""
    pol = C.policy_example(FOOL, 'mate')
    line = f'  M: d8h4 e8e7    E: 1000.0 {number}    B: d8h4'
    assert math.isclose(C.chess_format(line, pol), 2 / 3), line
    ex = C.environment_example(START, 'e2e4', [])
    fen = ex['solution'].split('+')[0]
    text = f'{fen}+{number}+0+0'
    assert math.isclose(C.chess_format(text, ex), 4 / 5), text
    assert math.isclose(C.chess_transition(text, ex), 0.8 + 0.2 * 2 / 3), text
    for ok in ('-2.07', '1000.0', '0.001', '-1.0'):
        assert C.chess_format(f'  M: d8h4 e8e7    E: 1000.0 {ok}    B: d8h4', pol) == 1.0, ok
