"""
Stockfish labels for tasks/chess.py's policy and mate sub-tasks: each position's top candidate moves
(multipv), their evaluations in pawns from the side to move (a mate = +-1000, RookWorld's
convention) and the engine's best move, written as the rows `--data_dir` reads. Optional: nothing
else in the project needs an engine (apt install stockfish).

    # random-play positions, as the task makes them
    python scripts/chess_labels.py --out_dir=data/chess
    # your positions: rows {"fen": ...}
    python scripts/chess_labels.py --out_dir=data/chess --input_file=my.jsonl
    python train_grpo.py config/chess.py --data_dir=data/chess --chess_subtask=policy

Unlike RookWorld's published data, B: is always the engine's best move (there, Black's B: is the
fifth-ranked).
"""
import json
import os
import sys

import chess
import chess.engine

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tasks.chess as task  # noqa: E402
from configurator import configure  # noqa: E402

# writes train.jsonl and test.jsonl here (with --input_file: that file's name)
out_dir = 'data/chess'
input_file = ''  # a JSONL of {"fen"} rows to label instead of random-play positions
n_train = 2000  # random-play positions (policy sub-task, the task's knobs otherwise)
n_test = 200
seed = 1337  # the same positions as train_grpo.py --seed=1337 makes
engine = 'stockfish'  # the UCI engine's command (Debian's package puts it in /usr/games)
depth = 12  # search depth per position
multipv = 5  # candidates per position (RookWorld: 5)


def label(board, eng):
    """(moves, evals, best) for one position: the engine's candidates in its order, best first."""
    infos = eng.analyse(board, chess.engine.Limit(depth=depth), multipv=multipv)
    moves = [board.uci(i['pv'][0]) for i in infos if i.get('pv')]
    evals = [round(i['score'].pov(board.turn).score(mate_score=100_000) / 100, 2)
             for i in infos if i.get('pv')]
    evals = [max(-1000.0, min(1000.0, e)) for e in evals]  # a mate found is +-1000 pawns
    return moves, evals, moves[0]


def main():
    configure(globals())  # --key=value for the knobs above, type-checked as train_grpo.py's
    if input_file:
        with open(input_file) as f:
            name = os.path.splitext(os.path.basename(input_file))[0]
            splits = {name: [json.loads(line)['fen'] for line in f if line.strip()]}
    else:
        task.chess_n_train, task.chess_n_test = n_train, n_test
        task.chess_subtask = 'policy'
        splits = {s: [e['fen'] for e in task.load(s, seed=seed)] for s in ('train', 'test')}
    os.makedirs(out_dir, exist_ok=True)
    with chess.engine.SimpleEngine.popen_uci(engine) as eng:
        for split, fens in splits.items():
            with open(os.path.join(out_dir, f'{split}.jsonl'), 'w') as f:
                for i, fen in enumerate(fens):
                    moves, evals, best = label(chess.Board(fen), eng)
                    row = {'fen': fen, 'moves': moves, 'evals': evals, 'best': best}
                    f.write(json.dumps(row) + '\n')
                    if i % 500 == 0:
                        print(f"{split}: {i}/{len(fens)}", flush=True)
    print(json.dumps({'out_dir': out_dir, **{s: len(f) for s, f in splits.items()}}))


if __name__ == '__main__':
    main()
