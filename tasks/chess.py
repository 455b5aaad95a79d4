"""
Chess in the RookWorld text formats (jorahn/RookWorld), on python-chess: no engine runs per sample.
Four sub-tasks:

    policy       prompt 'P: <fen>'
                 completion '<padding>M: <moves>  E: <evals>  B: <best move>'
    mate         the policy format, on positions with a mate in one: right when B: mates
    environment  prompt 'A: <fen>+<move>+<history>+'
                 completion '<new fen>+<reward>+<terminated>+<truncated>'
    move         prompt 'P: <fen> B:'
                 completion ' <move>': right when the move is legal (the policy line's B: field
                 alone, for small models from scratch: the CPU demo, config/chess_demo.py)

Positions come from random legal play, a pure function of the seed, and every label a reward needs
(legal moves, mating moves, next FEN, reward and flags) is computed into the example when it is
made, so the rewards are pure functions of (completion, example) that never raise. With --data_dir
(one sub-task), rows {'fen', ...} of DIR/{split}.jsonl are used instead (e.g. with Stockfish's
candidates and evals: 'moves', 'evals', 'best', written by scripts/chess_labels.py); their labels are
recomputed from the FEN the same way, and a row with nothing to answer (no legal move) is a bad row.
Prompts are raw text (no chat template), as RookWorld-LM was trained, each FEN written as RookWorld
writes it: a policy prompt keeps the FEN as its source wrote it (an en passant square no pawn can
take included), an environment prompt has python-chess's board.fen().

The rewards are as strict as RookWorld's generators are: the text they write is the format (fields
in their order, a FEN of six single-spaced fields, numbers as Python writes a float, no blanks
around '+'), and only blanks around the whole completion (padding, a trailing newline) are let go.
"""
import math
import random
import re
from functools import lru_cache

import chess

from data import parse_rows, read_rows

# 'policy', 'mate', 'environment', 'move', or several joined by ',' (interleaved)
chess_subtask = 'environment'
chess_n_train = 5000  # training positions per sub-task
# held-out positions per sub-task (made first from the stream, so n_train does not change them)
chess_n_test = 200
chess_min_plies = 0  # random plies played from the start position before a position is taken ...
chess_max_plies = 80  # ... up to this many (drawn uniformly; a game that ends earlier is cut there)
# environment: share of moves that are illegal (reward -1, truncated 1, state unchanged)
chess_illegal_frac = 0.0
# environment: moves in the history field, the current one included (RookWorld: 10)
chess_history = 10
# --data_dir rows that do not parse: False = stop with file:line, True = skip them
skip_bad_rows = False

SUBTASKS = ('policy', 'mate', 'environment', 'move')
# the reward the environment writes for the mover: RookWorld's values
LEGAL, WIN, DRAW, ILLEGAL = '0.001', '1.0', '0.5', '-1.0'
_UCI = re.compile(r'[a-h][1-8][a-h][1-8][qrbn]?')


def load(split, data_dir='', seed=0, stats=None):
    """The split's examples, sub-tasks interleaved; from random play (seed) or from data_dir's
    {split}.jsonl (a bad row stops the load with file:line; with skip_bad_rows it is skipped and
    counted in stats['skipped'], a dict you pass)."""
    subtasks = [s.strip() for s in chess_subtask.split(',') if s.strip()]
    bad = [s for s in subtasks if s not in SUBTASKS]
    if bad or not subtasks:
        raise ValueError(f"chess_subtask={chess_subtask!r}: expected one or more of {SUBTASKS} "
                         "joined by ','")
    if data_dir and len(subtasks) > 1:
        raise ValueError(f"chess_subtask={chess_subtask!r} with --data_dir={data_dir}: "
                         "one sub-task per data directory")
    if data_dir:
        def parse(row):
            return from_row(row, subtasks[0])
        parts = [parse_rows(read_rows(data_dir, split), parse, skip_bad_rows, 'chess', stats)]
    else:
        parts = []
        for s in subtasks:
            train, test = _splits(s, chess_n_train, chess_n_test, seed, min_plies=chess_min_plies,
                                  max_plies=chess_max_plies, illegal_frac=chess_illegal_frac,
                                  history=chess_history)
            parts.append(list(test if split == 'test' else train))
    return [p[i] for i in range(max(map(len, parts))) for p in parts if i < len(p)]  # round-robin


def messages(example):
    """The raw prompt: 'P: <fen>' with no trailing space (so its GPT-2 tokens are a prefix of the
    training line's), 'P: <fen> B:' (move) or 'A: <fen>+<move>+<history>+'."""
    return example['question']


def grade(completion, example):
    """environment: the whole next state exact; mate: B: mates; policy: B: is the engine's best when
    the example has engine labels, else B: is legal; move: the move is legal."""
    if example['subtask'] == 'environment':
        return _env_fields(completion) == _env_fields(example['solution'])
    best = _move_of(completion, example)
    if example['subtask'] == 'move':
        return best in example['legal']
    if example['subtask'] == 'mate':
        return best in example['mates']
    return best == example['best'] if example.get('best') else best in example['legal']


def solution(example):
    """The warm start's target: the environment's next state, the move sub-task's ' <move>' (a legal
    move drawn when the example is made), or the policy line's completion (engine labels needed:
    random play has no evaluations to write in E:)."""
    if example['subtask'] in ('environment', 'move'):
        return example['solution']
    if not example.get('moves'):
        raise ValueError(f"chess {example['subtask']} example {example['fen']!r} has no engine "
                         "labels ('moves', 'evals', 'best') to warm start on; use the environment "
                         "sub-task or labelled data")
    fen = example['fen']
    return (' ' * (90 - len(fen)) + 'M: ' + ' '.join(example['moves']).ljust(30) + 'E: '
            + ' '.join(map(str, example['evals'])).ljust(40) + 'B: ' + example['best'])


def answer(completion):
    """What maj@k votes on: the B: move, the move sub-task's move, or the predicted next state."""
    fields = _env_fields(completion)
    move = parse_policy(completion)['best'] or parse_move(completion)
    if move:
        return move
    return '+'.join(fields) if fields else None


# -----------------------------------------------------------------------------
# rewards: fn(completion, example) -> float in [0, 1], 0 on anything that does not parse; never
# raise


def chess_format(completion, example):
    """Share of the sub-task's fields that parse. Policy/mate (parse_policy): M: holds 1-5 UCI
    moves, E: as many numbers, B: one UCI move. Move: one UCI move and nothing else. Environment:
    four fields joined by '+' with no blanks around it, a valid FEN of six single-spaced fields
    (python-chess would fill in missing move counters; RookWorld's board.fen() always writes them),
    a number as Python writes a float, and 0/1 flags. Not text: 0."""
    if not isinstance(completion, str):
        return 0.0
    if example['subtask'] == 'move':
        return float(parse_move(completion) is not None)
    if example['subtask'] != 'environment':
        p = parse_policy(completion)
        evals_match = (p['evals'] is not None and p['moves'] is not None
                       and len(p['evals']) == len(p['moves']))
        ok = [bool(p['moves']) and len(p['moves']) <= 5, evals_match, p['best'] is not None]
        return sum(ok) / len(ok)
    parts = completion.strip().split('+')
    fen, rew, term, trunc = (parts + [''] * 4)[:4]
    ok = [len(parts) == 4, _six_fields(fen) and _board(fen) is not None,
          _number(rew) is not None, term in ('0', '1'), trunc in ('0', '1')]
    return sum(ok) / len(ok)


def chess_legal(completion, example):
    """1 when B: is a legal move in the position (as python-chess writes it: 'e1g1', never the
    'e1h1' it also accepts), else 0. Environment examples: 0."""
    if example['subtask'] == 'environment':
        return 0.0
    return float(_move_of(completion, example) in example['legal'])


def chess_mate(completion, example):
    """1 when B: gives mate at once, else 0 (also where the position has no mate in one)."""
    if example['subtask'] == 'environment':
        return 0.0
    return float(_move_of(completion, example) in example['mates'])


def chess_best(completion, example, best=1.0, candidate=0.5):
    """With engine labels: `best` for the engine's best move, `candidate` for another of its
    candidates; else 0. (RookWorld's own B: labels are the worst candidate when Black moves: label
    your data with an engine.)"""
    if example['subtask'] == 'environment' or not example.get('best'):
        return 0.0
    move = _move_of(completion, example)
    if move == example['best']:
        return best
    if move in (example.get('moves') or ()):
        return candidate
    return 0.0


def chess_transition(completion, example):
    """Environment: 1 for the exact next state; else partial credit, 0.8 x the FEN's fields (the
    board counted rank by rank) + 0.2 x the reward and flags, each exact as written. A FEN that is
    not six single-spaced fields earns its board only (field by field, one blank too many would
    shift every field after it). Policy/mate examples: 0."""
    if example['subtask'] != 'environment':
        return 0.0
    got, want = _env_fields(completion), _env_fields(example['solution'])
    if got is None:
        return 0.0
    if got == want:
        return 1.0
    fen, ref = got[0].split(' '), want[0].split(' ')
    if len(fen) != 6:
        fen = fen[:1]
    ranks, ref_ranks = fen[0].split('/'), ref[0].split('/')
    board = sum(a == b for a, b in zip(ranks, ref_ranks)) / 8 if len(ranks) == 8 else 0.0
    same = [float(a == b) for a, b in zip(fen[1:6], ref[1:6])]
    fields = [board] + same + [0.0] * (5 - len(fen[1:6]))
    flags = [got[1] == want[1], got[2] == want[2], got[3] == want[3]]
    return 0.8 * sum(fields) / 6 + 0.2 * sum(flags) / 3


# each pays only on its own sub-task's examples (and chess_best only with engine labels), so one
# list serves all
rewards = [{'name': 'correct', 'weight': 1.0}, {'name': chess_format, 'weight': 0.1},
           {'name': chess_legal, 'weight': 0.2}, {'name': chess_mate, 'weight': 0.5},
           {'name': chess_best, 'weight': 0.5}, {'name': chess_transition, 'weight': 0.5}]


def metrics(completions, examples):
    """Per-task eval numbers beside pass@1 (tasks/__init__.py): legal-move rate, mate-in-one
    accuracy (on the positions that have one), next-state accuracy, format rate; those with no
    example to count are left out."""
    def mean(pairs):
        pairs = list(pairs)
        return sum(pairs) / len(pairs) if pairs else None
    pol = [(c, e) for c, e in zip(completions, examples) if e['subtask'] != 'environment']
    out = {'legal_rate': mean(chess_legal(c, e) for c, e in pol),
           'mate_rate': mean(chess_mate(c, e) for c, e in pol if e['mates']),
           'next_state_acc': mean(float(grade(c, e)) for c, e in zip(completions, examples)
                                  if e['subtask'] == 'environment'),
           'format_rate': mean(chess_format(c, e) == 1.0 for c, e in zip(completions, examples))}
    return {k: v for k, v in out.items() if v is not None}


# -----------------------------------------------------------------------------
# parsing


def parse_policy(text):
    """{'moves', 'evals', 'best'} from a policy completion (each None when its field is missing or
    malformed), read as RookWorld writes the line: blanks (the FEN's padding), then M:, E: and B:
    in that order, each at most once. A label out of that order or repeated ends the fields there,
    and B: counts only as the last field: one UCI move with nothing but blanks after it (so two
    B: answers are none)."""
    out = {'moves': None, 'evals': None, 'best': None}
    if not isinstance(text, str):
        return out
    parts = re.split(r'([MEB]:)', text)
    if parts[0].strip():
        return out
    fields, last = {}, -1
    for label, body in zip(parts[1::2], parts[2::2]):
        rank = 'MEB'.index(label[0])
        if rank <= last:
            fields.pop('B', None)  # B: with a label after it is not the last field
            break
        fields[label[0]] = body
        last = rank
    moves = fields.get('M', '').split()
    if moves and all(_UCI.fullmatch(t) for t in moves):
        out['moves'] = moves
    vals = [_number(t) for t in fields.get('E', '').split()]
    if vals and None not in vals:
        out['evals'] = vals
    if _UCI.fullmatch(fields.get('B', '').strip()):
        out['best'] = fields['B'].strip()
    return out


def parse_move(text):
    """The move sub-task's completion: one UCI move, blanks around it allowed and nothing else, or
    None."""
    move = text.strip() if isinstance(text, str) else ''
    return move if _UCI.fullmatch(move) else None


def _move_of(completion, example):
    """The move a policy, mate or move completion names (None when it names none)."""
    if example['subtask'] == 'move':
        return parse_move(completion)
    return parse_policy(completion)['best']


def _env_fields(text):
    """(fen, reward, terminated, truncated) as written (blanks around the whole text dropped, none
    around '+'), or None unless the text is exactly four '+' fields."""
    parts = text.strip().split('+') if isinstance(text, str) else []
    return tuple(parts) if len(parts) == 4 else None


# a number as Python's str(float) writes RookWorld's rewards and evals: '0.001', '-2.07', '1000.0'
_FLOAT = re.compile(r'-?[0-9]+\.[0-9]+')


def _number(s):
    """The value of a number written like _FLOAT, else None: float() alone would also take '1_000',
    non-ASCII digits, '1e3', ' 1.0' and 'inf', none of which RookWorld writes."""
    if not isinstance(s, str) or not _FLOAT.fullmatch(s):
        return None
    v = float(s)
    return v if math.isfinite(v) else None


def _six_fields(fen):
    """True for six fields on single spaces, as board.fen() and RookWorld's lines write a FEN."""
    return len(fen.split(' ')) == 6


def _board(fen):
    """chess.Board for a valid FEN, else None."""
    try:
        board = chess.Board(fen.strip())
    except Exception:
        # python-chess raises ValueError on a bad FEN; a reward must not raise on anything
        return None
    return board if board.is_valid() else None


# -----------------------------------------------------------------------------
# examples: labels computed once, here


def mating_moves(board):
    """UCI moves that mate at once (only checking moves can)."""
    out = []
    for m in board.legal_moves:
        if board.gives_check(m):
            board.push(m)
            if board.is_checkmate():
                out.append(board.uci(m))
            board.pop()
    return out


def policy_example(fen, subtask='policy', moves=None, evals=None, best=None, target=None):
    """A policy, mate or move example; move: `target` is the warm start's move (default: the
    engine's best, else a legal move drawn by the FEN). The prompt keeps the FEN as written (blanks
    around it dropped), as RookWorld's P: lines do (dev/data/rook/generate_lichess.py writes the
    source's FEN, f"P: {fen:90}"): python-chess's fen() would drop an en passant square no pawn can
    take, and the prompt would then be no prefix of the line the model learned."""
    board = _board(fen)
    if board is None:
        raise ValueError(f"invalid FEN {fen!r}")
    fen = fen.strip()
    if not _six_fields(fen):
        raise ValueError(f"FEN {fen!r}: expected six fields on single spaces, as RookWorld's P: "
                         "lines write one")
    legal = sorted(board.uci(m) for m in board.legal_moves)
    if not legal:
        raise ValueError(f"FEN {fen!r}: no legal move (mate or stalemate), nothing to answer")
    question = 'P: ' + fen + ' B:' * (subtask == 'move')
    ex = {'subtask': subtask, 'fen': fen, 'question': question, 'legal': legal,
          'mates': mating_moves(board)}
    if moves:
        if best not in moves or not evals or len(evals) != len(moves):
            raise ValueError(f"engine labels of {fen!r}: need 'best' among 'moves' and one eval "
                             "per move")
        ex.update(moves=list(moves), evals=[float(v) for v in evals], best=best)
    ex['answer'] = ex.get('best') or ' '.join(ex['mates'] if subtask == 'mate' else legal)
    if subtask == 'move':
        ex['solution'] = ' ' + (target or ex.get('best') or random.Random(ex['fen']).choice(legal))
    return ex


def environment_example(fen, move, history):
    """The transition RookWorld's environment writes for `move` (UCI text) after `history` (earlier
    moves)."""
    board = _board(fen)
    if board is None:
        raise ValueError(f"invalid FEN {fen!r}")
    # 'legal' and 'mates': the policy labels, empty here
    ex = {'subtask': 'environment', 'fen': board.fen(), 'move': move, 'legal': [], 'mates': []}
    history = (list(history) + [move])[-chess_history:]
    legal = {board.uci(m): m for m in board.legal_moves}
    if move in legal:
        board.push(legal[move])
        # automatic ends only: no claimed threefold or fifty-move draw
        over = board.is_game_over()
        if board.is_checkmate():
            reward = WIN
        elif over:
            reward = DRAW
        else:
            reward = LEGAL
        state = (board.fen(), reward, str(int(over)), '0')
    else:
        # the state unchanged, and terminated from board.is_game_over() even so, as RookWorld's
        # environment writes it after rejecting a move (jorahn/RookWorld,
        # dev/data/arbiter/generate_rollouts.py, ChessEnvironment.step: `terminated =
        # self.board.is_game_over()` after the failed push): 1 on a board already over
        state = (board.fen(), ILLEGAL, str(int(board.is_game_over())), '1')
    ex['question'] = f"A: {ex['fen']}+{move}+{' '.join(history)}+"
    ex['solution'] = ex['answer'] = '+'.join(state)
    return ex


def from_row(row, subtask):
    """An example from a data_dir row {'fen', ['move', 'history'] | ['moves', 'evals', 'best']}."""
    if not isinstance(row, dict) or not isinstance(row.get('fen'), str):
        raise ValueError("expected a JSON object with a 'fen' string")
    if subtask == 'environment':
        if not isinstance(row.get('move'), str):
            raise ValueError("environment rows need a 'move' (UCI)")
        return environment_example(row['fen'], row['move'], row.get('history') or [])
    ex = policy_example(row['fen'], subtask, moves=row.get('moves'), evals=row.get('evals'),
                        best=row.get('best'))
    if subtask == 'mate' and not ex['mates']:
        raise ValueError(f"mate row {row['fen']!r} has no mate in one")
    return ex


def _illegal_move(board, rng):
    """A move that looks like one (a piece of the side to move, to another square) and is not
    legal."""
    legal = {board.uci(m) for m in board.legal_moves}
    own = list(chess.SquareSet(board.occupied_co[board.turn]))
    for _ in range(100):
        uci = chess.square_name(rng.choice(own)) + chess.square_name(rng.randrange(64))
        if uci[:2] != uci[2:] and uci not in legal:
            return uci
    return 'a1a1'  # unreachable in practice: some piece always has an illegal target


def chess_stream(subtask, seed, min_plies=0, max_plies=80, illegal_frac=0.0):
    """Endless examples of one sub-task from random legal play, a pure function of the arguments."""
    rng = random.Random(f'chess {subtask} {seed}')
    # the move sub-task's warm-start moves: their own stream
    targets = random.Random(f'chess move targets {seed}')
    while True:
        board, played = chess.Board(), []
        for _ in range(rng.randint(min_plies, max_plies)):
            if board.is_game_over():
                break
            played.append(board.uci(rng.choice(list(board.legal_moves))))
            board.push_uci(played[-1])
        if board.is_game_over():
            continue
        if subtask == 'environment':
            illegal = rng.random() < illegal_frac
            if illegal:
                move = _illegal_move(board, rng)
            else:
                move = board.uci(rng.choice(list(board.legal_moves)))
            yield environment_example(board.fen(), move, played)
        elif subtask == 'policy':
            yield policy_example(board.fen(), subtask)
        elif subtask == 'move':
            target = board.uci(targets.choice(list(board.legal_moves)))
            yield policy_example(board.fen(), subtask, target=target)
        else:
            # mate: play on to the first position with a mate in one (1 in ~60 random-play
            # positions has one)
            while (not board.is_game_over() and board.ply() < max_plies + 200
                   and not mating_moves(board)):
                board.push(rng.choice(list(board.legal_moves)))
            if not board.is_game_over() and mating_moves(board):
                yield policy_example(board.fen(), subtask)


@lru_cache(maxsize=4)
def _splits(subtask, n_train, n_test, seed, *, min_plies, max_plies, illegal_frac, history):
    """(train, test) with no position (environment: position and move) in both; test first from the
    stream."""
    if not (0 <= min_plies <= max_plies and n_train >= 0 and n_test >= 0
            and 0 <= illegal_frac <= 1 and history >= 1):
        raise ValueError("chess knobs: need 0 <= chess_min_plies <= chess_max_plies "
                         f"(got {min_plies}, {max_plies}), 0 <= chess_illegal_frac <= 1 "
                         f"(got {illegal_frac}), chess_history >= 1 (got {history})")
    stream = chess_stream(subtask, seed, min_plies, max_plies, illegal_frac)
    seen, test, train, tries = set(), [], [], 0
    while len(test) < n_test or len(train) < n_train:
        ex = next(stream)
        tries += 1
        # a space too small (max_plies=0) ends in an error, not a hang
        if tries > 50 * (n_train + n_test) + 1000:
            raise ValueError(f"chess {subtask}: too few distinct positions for {n_test} test + "
                             f"{n_train} train examples with plies {min_plies}..{max_plies}; "
                             "raise chess_max_plies")
        key = ex['question']
        if len(test) < n_test and key not in seen:
            seen.add(key)
            test.append(ex)
        elif len(test) >= n_test and key not in seen:
            train.append(ex)
    return tuple(train), tuple(test)
