"""batch.py: which completions become training rows, with dynamic sampling's kept groups."""
import torch

from batch import keep_groups, train_rows
from loss import group_advantages


def comps_of(rewards):
    return [{'prompt_idx': p, 'sample_idx': s, 'ids': [1] * (p + 1), 'truncated': False, 'logprobs': [0.0] * (p + 1)}
            for p, row in enumerate(rewards) for s in range(len(row))]


def test_kept_groups_map_to_their_own_advantages():
    r = torch.tensor([[1.0, 1.0], [0.0, 1.0], [2.0, 2.0], [3.0, 0.0], [1.0, 0.0]])
    zero = group_advantages(r)[1]
    kept = keep_groups(zero, 2)
    assert kept == [1, 3], "the first two groups with a spread, in the order drawn"
    adv, zero_k = group_advantages(r[kept], 'none')
    rows, n_tok, n_seq, (n_rows, n_toks) = train_rows(comps_of(r.tolist()), adv, zero_k, list('abcde'), {1, 3, 4}, kept)
    assert [(rw['prompt'], rw['adv']) for rw in rows] == [('b', -0.5), ('b', 0.5), ('d', 1.5), ('d', -1.5)]
    assert (n_tok, n_seq, n_rows, n_toks) == (2 * 2 + 2 * 4, 4, 4, 12), "normalisers over the kept groups only"
    rows = train_rows(comps_of(r.tolist()), adv, zero_k, list('abcde'), {3}, kept)[0]
    assert [rw['prompt'] for rw in rows] == ['d', 'd'], "a rank trains only the kept groups it sampled"
