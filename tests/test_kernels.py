"""Specification of the fused log-prob/entropy kernel (logprob_kernels.py) and the sampler
(sample_kernels.py); the LM head: test_lmhead.py.

Every log-prob test runs twice: through the Triton kernels (forced, under TRITON_INTERPRET=1) and
through the torch path that CPU training uses. The oracle is an fp64 log_softmax written here,
independent of logprob_kernels.py.
"""
import os
import subprocess
import sys

import pytest
import torch

from logprob_kernels import token_logprobs
from sample_kernels import sample_tokens, sample_tokens_ref

# padding rows and -inf lanes compute inf/nan in branches that tl.where then discards; numpy (the
# interpreter) warns about them, the GPU does not
pytestmark = pytest.mark.filterwarnings('ignore::RuntimeWarning:triton.runtime.interpreter')

# block 128 with V = 300: three blocks per row, the last one ragged
IMPLS = [pytest.param(dict(use_triton=True, block_size=128), id='triton'),
         pytest.param(dict(use_triton=False), id='torch')]
V = 300


def oracle(logits, targets, temperature=1.0):
    """fp64 log p(target) and entropy; p = 0 entries (logit -inf) contribute 0 to the entropy."""
    logq = torch.log_softmax(logits.double() / temperature, -1)
    p = logq.exp()
    entropy = -(p * logq.masked_fill(p == 0, 0.0)).sum(-1)
    return logq.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


def grads(fn, logits, targets, a, b, temperature=1.0, **kw):
    """Gradient w.r.t. logits of sum(a * logp + b * entropy): both outputs get a gradient."""
    x = logits.detach().clone().requires_grad_()
    lp, ent = fn(x, targets, temperature, **kw)
    (a * lp + b * ent).sum().backward()
    return x.grad


def data(shape=(3, 5), dtype=torch.float32, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(*shape, V, generator=g, dtype=torch.float64)).to(dtype)
    targets = torch.randint(0, V, shape, generator=g)
    a, b = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    return logits, targets, a, b


def close(actual, expected, what, tol=1e-5):
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol,
                               msg=lambda m: f'{what}: {m}')


# ----------------------------------------------------------------------------- log-prob + entropy

@pytest.mark.parametrize('kw', IMPLS)
@pytest.mark.parametrize('temperature', [1.0, 0.7])
def test_logprob_and_entropy_match_fp64(kw, temperature):
    logits, targets, a, b = data()
    lp, ent = token_logprobs(logits, targets, temperature, **kw)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == targets.shape
    ref_lp, ref_ent = oracle(logits, targets, temperature)
    close(lp, ref_lp, 'log p(target)')
    close(ent, ref_ent, 'entropy')


@pytest.mark.parametrize('kw', IMPLS)
@pytest.mark.parametrize('temperature', [1.0, 0.7])
def test_gradients_of_both_outputs_match_fp64(kw, temperature):
    logits, targets, a, b = data()
    g = grads(token_logprobs, logits, targets, a, b, temperature, **kw)
    ref = grads(oracle, logits.double(), targets, a, b, temperature)
    assert g.dtype == logits.dtype
    close(g, ref, 'd(a*logp + b*entropy)/dlogits')
    g_lp = grads(token_logprobs, logits, targets, a, 0 * b, temperature, **kw)  # one output only
    close(g_lp, grads(oracle, logits.double(), targets, a, 0 * b, temperature), 'dlogp alone')


@pytest.mark.parametrize('kw', IMPLS)
def test_bf16_input(kw):
    """Upcast inside: outputs are as exact as for fp32 input; the gradient comes back in bf16."""
    logits, targets, a, b = data(dtype=torch.bfloat16)
    lp, ent = token_logprobs(logits, targets, 0.8, **kw)
    ref_lp, ref_ent = oracle(logits, targets, 0.8)
    close(lp, ref_lp, 'bf16 log p(target)')
    close(ent, ref_ent, 'bf16 entropy')
    g = grads(token_logprobs, logits, targets, a, b, 0.8, **kw)
    assert g.dtype == torch.bfloat16, 'dlogits must be written in the input dtype'
    ref = grads(oracle, logits.double(), targets, a, b, 0.8)
    torch.testing.assert_close(g.double(), ref, rtol=2e-2, atol=1e-4,
                               msg=lambda m: f'bf16 dlogits: {m}')


@pytest.mark.parametrize('kw', IMPLS)
def test_minus_inf_logits(kw):
    """Banned tokens (logit -inf) have p = 0: entropy stays finite and they get exactly zero
    gradient."""
    logits, targets, a, b = data()
    banned = torch.rand(logits.shape, generator=torch.Generator().manual_seed(1)) < 0.3
    banned.scatter_(-1, targets.unsqueeze(-1), False)
    banned[0, 0, :128] = True  # a whole block of -inf: the online max must survive it
    banned[0, 0, targets[0, 0]] = False
    logits = logits.masked_fill(banned, float('-inf'))
    lp, ent = token_logprobs(logits, targets, 1.0, **kw)
    ref_lp, ref_ent = oracle(logits, targets)
    close(lp, ref_lp, 'log p with -inf logits')
    close(ent, ref_ent, 'entropy with -inf logits')
    g = grads(token_logprobs, logits, targets, a, b, **kw)
    assert torch.isfinite(g).all(), 'gradient has NaN/inf where logits are -inf'
    assert (g[banned] == 0).all(), 'tokens with logit -inf must get zero gradient'
    close(g, grads(oracle, logits.double(), targets, a, b), 'dlogits with -inf logits')


@pytest.mark.parametrize('kw', IMPLS)
def test_logits_of_1e4(kw):
    """Logits of +-1e4 with near-ties at the top: fp32 needs the max subtracted before anything
    else."""
    logits, targets, a, b = data(scale=1.0)
    coin = torch.rand(logits.shape, generator=torch.Generator().manual_seed(2))
    sign = torch.where(coin < 0.5, -1.0, 1.0)
    logits = (1e4 * sign + logits).float()
    lp, ent = token_logprobs(logits, targets, 1.0, **kw)
    ref_lp, ref_ent = oracle(logits, targets)
    close(lp, ref_lp, 'log p at +-1e4')
    close(ent, ref_ent, 'entropy at +-1e4')
    close(grads(token_logprobs, logits, targets, a, b, **kw),
          grads(oracle, logits.double(), targets, a, b), 'dlogits at +-1e4')


@pytest.mark.parametrize('kw', IMPLS)
def test_single_row(kw):
    logits, targets, a, b = data(shape=(1,))
    lp, ent = token_logprobs(logits[0], targets[0], 1.3, **kw)  # (V,) logits, scalar target
    assert lp.shape == ent.shape == ()
    ref_lp, ref_ent = oracle(logits[0], targets[0], 1.3)
    close(lp, ref_lp, 'single-row log p')
    close(ent, ref_ent, 'single-row entropy')
    close(grads(token_logprobs, logits, targets, a, b, 1.3, **kw),
          grads(oracle, logits.double(), targets, a, b, 1.3), 'single-row dlogits')


@pytest.mark.parametrize('kw', IMPLS)
def test_masked_rows_are_zero_and_get_zero_gradient(kw):
    logits, targets, a, b = data()
    mask = torch.rand(targets.shape, generator=torch.Generator().manual_seed(3)) < 0.6
    mask[0, 0], mask[0, 1] = True, False
    targets = targets.masked_fill(~mask, -100)  # padding ids may be anything, even out of range
    lp, ent = token_logprobs(logits, targets, 0.9, mask, **kw)
    assert (lp[~mask] == 0).all() and (ent[~mask] == 0).all(), 'masked rows must output 0'
    ref_lp, ref_ent = oracle(logits[mask], targets[mask], 0.9)
    close(lp[mask], ref_lp, 'unmasked log p')
    close(ent[mask], ref_ent, 'unmasked entropy')
    g = grads(token_logprobs, logits, targets, a, b, 0.9, mask=mask, **kw)
    assert (g[~mask] == 0).all(), 'masked rows must get exactly zero gradient'
    ref = grads(oracle, logits[mask].double(), targets[mask], a[mask], b[mask], 0.9)
    close(g[mask], ref, 'unmasked dlogits')


def test_sliced_logits_are_read_in_place():
    """logits[:, :-1] (the usual next-token shift) is a strided view; the kernel reads it without a
    copy."""
    logits, targets, a, b = data(shape=(2, 6))
    full = logits.clone().requires_grad_()
    lp, ent = token_logprobs(full[:, :-1], targets[:, :-1], 1.0, use_triton=True, block_size=128)
    ref_lp, ref_ent = oracle(logits[:, :-1], targets[:, :-1])
    close(lp, ref_lp, 'sliced log p')
    close(ent, ref_ent, 'sliced entropy')
    (a[:, :-1] * lp + b[:, :-1] * ent).sum().backward()
    ref = grads(oracle, logits[:, :-1].double(), targets[:, :-1], a[:, :-1], b[:, :-1])
    close(full.grad[:, :-1], ref, 'sliced dlogits')
    assert (full.grad[:, -1] == 0).all()


# ----------------------------------------------------------------------------- sampler

def exact_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """fp64 sampling distribution of one row, written out the textbook way: top-k, then top-p on
    the renormalised top-k distribution (a token is kept if the mass before it is < top_p), then
    min-p."""
    p = torch.softmax(logits.double() / (temperature or 1.0), -1)
    order = torch.argsort(p, descending=True).tolist()
    keep = torch.ones_like(p, dtype=torch.bool)
    if top_k:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        q, before = p * keep / (p * keep).sum(), 0.0
        for i in order:
            if keep[i]:
                keep[i] = before < top_p
                before += q[i].item()
    keep &= p >= min_p * p.max()
    return p * keep / (p * keep).sum()


SAMPLER_CONFIGS = [dict(temperature=1.0), dict(temperature=0.6), dict(top_k=5, temperature=1.3),
                   dict(top_p=0.7), dict(top_k=10, top_p=0.8, temperature=0.8), dict(min_p=0.2)]


@pytest.mark.parametrize('cfg', SAMPLER_CONFIGS, ids=str)
def test_sampler_distribution_matches_exact(cfg):
    """20,000 draws (one row per draw, each with its own seed) from the torch sampler against the
    exact renormalised distribution: Pearson chi-square. A correct sampler fails with probability
    1e-6 over the choice of seeds (the seeds are fixed, so the test is deterministic). Tokens
    outside the kept set: never."""
    n, vocab = 20_000, 16
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(5))
    row = torch.linspace(-1.5, 1.5, vocab)[order]
    ids, _ = sample_tokens_ref(row.expand(n, vocab), torch.arange(n) + 1000, 7, **cfg)
    counts = torch.bincount(ids, minlength=vocab).double()
    p = exact_probs(row, **cfg)
    assert counts[p == 0].sum() == 0, f'drew tokens outside the kept set: {counts[p == 0].tolist()}'
    expected = n * p[p > 0]
    chi2 = ((counts[p > 0] - expected) ** 2 / expected).sum()
    dof = (p > 0).sum() - 1
    p_value = torch.special.gammaincc(dof / 2, chi2 / 2).item() if dof > 0 else 1.0
    assert p_value > 1e-6, (f'draws do not follow the exact distribution: chi2={chi2:.1f}, '
                            f'dof={dof}, p={p_value:.2e}')


def random_rows(B=32, vocab=37, seed=6):
    g = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(B, vocab, generator=g)
    # banned tokens must never be drawn
    logits[torch.rand(B, vocab, generator=g) < 0.1] = float('-inf')
    logits[:, 0] = logits[:, 0].clamp(min=0)  # every row keeps at least one finite logit
    return logits, torch.randint(0, 2 ** 40, (B,), generator=g)


@pytest.mark.slow
@pytest.mark.parametrize('cfg', SAMPLER_CONFIGS + [dict(temperature=0.0)], ids=str)
def test_triton_sampler_draws_the_same_ids_as_torch(cfg):
    """Same counter-based hash in both: the kernel (vocab split in 1 or 2 tiles) equals the torch
    reference id for id, so the 20,000-draw distribution test above transfers to it. Ids lie in the
    kept set, and logp is the log-prob under the full softmax at that temperature (1 for greedy)."""
    logits, seeds = random_rows()
    ref_ids, ref_lp = sample_tokens_ref(logits, seeds, 3, **cfg)
    for n_split in (1, 2):
        ids, lp = sample_tokens(logits, seeds, 3, **cfg, use_triton=True, n_split=n_split,
                                block_size=32)
        assert ids.dtype == torch.int64 and lp.dtype == torch.float32
        n_diff = (ids != ref_ids).sum()
        assert torch.equal(ids, ref_ids), f'n_split={n_split}: {n_diff} of {len(ids)} ids differ'
        close(lp, ref_lp, 'sampled log p (triton vs torch)')
    for row, i in zip(logits, ids):
        assert exact_probs(row, **cfg)[i] > 0, 'drew a token outside the kept set'
    full = torch.log_softmax(logits.double() / (cfg.get('temperature') or 1.0), -1)
    close(lp, full.gather(1, ids[:, None]).squeeze(1), 'sampled log p (vs fp64 full softmax)')


def test_threshold_search_split_over_tiles_draws_as_torch():
    """The top-k / top-p threshold search runs on (rows, tiles) programs, the last program of a row
    to finish each pass adding the tiles up: 3 and 4 tiles of a 200-token vocabulary (blocks of 32)
    draw the ids of the torch reference, whose threshold comes from a sort."""
    cfg = dict(top_k=60, top_p=0.5)
    logits, seeds = random_rows(B=6, vocab=200, seed=9)
    ref_ids, _ = sample_tokens_ref(logits, seeds, 1, **cfg)
    for n_split in (3, 5):
        ids, _ = sample_tokens(logits, seeds, 1, **cfg, use_triton=True, n_split=n_split,
                               block_size=32)
        assert torch.equal(ids, ref_ids), f'{n_split} tiles: {(ids != ref_ids).sum()} ids differ'


@pytest.mark.parametrize('use_triton', [True, False])
@pytest.mark.parametrize('cfg', [dict(temperature=0.0), dict(top_k=1, temperature=0.7)], ids=str)
def test_greedy_is_argmax(use_triton, cfg):
    logits, seeds = random_rows(B=8)
    ids, _ = sample_tokens(logits, seeds, 0, **cfg, use_triton=use_triton, block_size=32)
    assert torch.equal(ids, logits.argmax(-1)), 'greedy decoding must return the argmax'


@pytest.mark.parametrize('use_triton', [True, False])
def test_same_seed_same_draws_new_step_new_draws(use_triton):
    logits, seeds = random_rows(B=16)

    def draw(step):
        ids, _ = sample_tokens(logits, seeds, step, top_p=0.95, use_triton=use_triton,
                               block_size=32)
        return ids

    assert torch.equal(draw(4), draw(4)), 'same (seed, step) must give the same ids'
    assert not torch.equal(draw(4), draw(5)), 'a new step must give new draws'


@pytest.mark.parametrize('use_triton', [True, False])
def test_row_draw_does_not_depend_on_batch(use_triton):
    logits, seeds = random_rows(B=8)
    cfg = dict(top_k=6, top_p=0.9, temperature=1.1, use_triton=use_triton, block_size=32)
    batch_ids, _ = sample_tokens(logits, seeds, 2, **cfg)
    # step as a tensor
    flipped, _ = sample_tokens(logits.flip(0), seeds.flip(0), torch.full((8,), 2), **cfg)
    assert torch.equal(flipped.flip(0), batch_ids), 'reordering the batch changed some rows\' draws'
    for b in (0, 5):
        alone, _ = sample_tokens(logits[b:b + 1], seeds[b:b + 1], 2, **cfg)
        assert alone.item() == batch_ids[b].item(), (
            f'row {b} drew differently alone than inside the batch')


# ---------------------------------------------------------------- GPU lowering, without a GPU

def test_kernels_compile_for_hopper_and_ampere():
    """The kernels compile for GPUs without a GPU: tests/compile_kernels.py, in a process without
    TRITON_INTERPRET (.ci/run runs it under older Tritons too)."""
    env = {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'}
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, os.path.join(here, 'compile_kernels.py')], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (
        f'a kernel does not compile for sm_90a / sm_80:\n{out.stderr[-3000:]}')
