"""
What every task shares: rows read from a local .jsonl / .parquet split with where each came from,
parsed under one malformed-row policy, and the deterministic example order that lets a resumed run
see the same batches. The tasks themselves (their data, prompts and grading) are in tasks/.
"""
import json
from functools import lru_cache
from pathlib import Path

import numpy as np


def read_rows(data_dir, split):
    """Yield (where, row-or-exception) from data_dir/{split}.jsonl, else the split's parquet
    file(s): {split}.parquet or its shards {split}-*.parquet, in data_dir or in the one folder below
    it that holds them (the hub's main/ or data/). Several such folders (a dataset's configs) raise
    ValueError naming them."""
    path = Path(data_dir) / f'{split}.jsonl'
    if path.exists():
        with open(path, encoding='utf-8') as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():  # a blank line (e.g. trailing) is not a row
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    row = ValueError(f'bad JSON ({e.msg} at column {e.colno})')
                yield f'{path}:{lineno}', row
        return
    # {split}.parquet or the hub's {split}-00000-of-00001.parquet shards: in data_dir, else in the one
    # folder below it that holds them. A hub copy of a dataset with several configs keeps each in its
    # folder (openai/gsm8k: main/ and socratic/), and reading them all would serve each problem twice.
    files = sorted(Path(data_dir).glob(f'{split}[-.]*parquet'))
    if not files:
        files = sorted(Path(data_dir).glob(f'**/{split}[-.]*parquet'))
        folders = sorted({str(file.parent.relative_to(data_dir)) for file in files})
        if len(folders) > 1:
            raise ValueError(f"{data_dir}: {split} parquet files in {len(folders)} folders, one per "
                             f"config of the dataset ({', '.join(folders)}); point --data_dir at the "
                             f"one to read, e.g. --data_dir={Path(data_dir) / folders[0]}")
    if not files:
        raise FileNotFoundError(f"no {split}.jsonl or {split}*.parquet in {data_dir}")
    import pyarrow.parquet as pq  # a dependency of `datasets`; only needed for parquet
    for file in files:
        for i, row in enumerate(pq.read_table(file).to_pylist()):
            yield f'{file}:row {i}', row


def parse_rows(rows, parse, skip_bad_rows=False, what='row', stats=None):
    """[parse(row)] for (where, row) in rows. A malformed row (parse raises ValueError, or trips on
    the row with an IndexError, KeyError or TypeError it did not foresee, named in the reason)
    raises one ValueError naming file and line; with skip_bad_rows it is skipped, printed and added
    to stats['skipped'] (pass a dict to receive it; stats['first_bad'] holds the first reason)."""
    out = []
    bad = []
    for where, row in rows:
        try:
            if isinstance(row, Exception):
                raise row
            out.append(parse(row))
        except (ValueError, IndexError, KeyError, TypeError) as e:
            reason = e if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            if not skip_bad_rows:
                raise ValueError(f"{where}: malformed {what} row: {reason} "
                                 "(skip_bad_rows skips such rows)") from None
            bad.append(f"{where}: {reason}")
    if bad:
        print(f"{what}: skipped {len(bad)} malformed rows, first: {bad[0]}")
    if stats is not None:  # accumulates, so one dict can collect train and test
        stats['skipped'] = stats.get('skipped', 0) + len(bad)
        stats['first_bad'] = stats.get('first_bad') or (bad[0] if bad else None)
    return out


def question_messages(question, system_prompt='', instruction=''):
    """[system turn,] user turn = the question [+ newline + instruction]; '' or None leaves a part
    out."""
    user = f"{question}\n{instruction}" if instruction else question
    system = [{'role': 'system', 'content': system_prompt}] if system_prompt else []
    return system + [{'role': 'user', 'content': user}]


# --------------------------------------------------------------------------------------------------
# order: one permutation per (seed, epoch), so resuming at a cursor reproduces the batches exactly

@lru_cache(maxsize=4)
def _perm(n, seed, epoch):
    return tuple(np.random.default_rng([seed, epoch]).permutation(n).tolist())


def epoch_order(n, seed, epoch):
    """Deterministic permutation of range(n) for this epoch; different epochs give different
    orders."""
    return list(_perm(n, seed, epoch))


def batch_at(examples, seed, cursor, batch_size):
    """Examples cursor..cursor+batch_size-1 of the endless stream epoch 0, epoch 1, ... (cursor
    counts examples served so far, so it is all a checkpoint needs). Returns (batch, next_cursor);
    batches may span epochs."""
    index, cursor = indices_at(len(examples), seed, cursor, batch_size)
    return [examples[i] for i in index], cursor


def indices_at(n, seed, cursor, batch_size, skip=frozenset(), shuffle=True):
    """The indices (into n examples) of batch_at's batch, and the cursor after it; indices in skip
    (examples no longer drawn) are passed over, the cursor moving past them too, so (cursor, skip)
    is all a checkpoint needs. shuffle=False: the examples in their own order, epoch after epoch (a
    curriculum). Raises ValueError when skip holds every example."""
    if len(skip) >= n:
        raise ValueError(f"all {n} training examples are left out (drop_easy): nothing to draw")
    index = []
    while len(index) < batch_size:
        i = _perm(n, seed, cursor // n)[cursor % n] if shuffle else cursor % n
        cursor += 1
        if i not in skip:
            index.append(i)
    return index, cursor
