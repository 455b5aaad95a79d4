"""The sampler's randomness at a real vocabulary size (Qwen2.5's 151,936 ids), in the torch path
and the Triton kernel (interpreter) alike: the noise of every possible 32-bit hash is finite and its
uniform strictly inside (0, 1); a token of probability ~1 is drawn every time; the draws follow the
softmax under top-p, top-k and min-p. The rest of the sampler's specification: test_kernels.py."""
import math

import pytest
import torch
import triton
import triton.language as tl

import sample_kernels as S
from sample_kernels import sample_tokens, sample_tokens_ref
from test_kernels import exact_probs

pytestmark = pytest.mark.filterwarnings('ignore::RuntimeWarning:triton.runtime.interpreter')

QWEN_VOCAB = 151_936
BIG_BLOCK = dict(use_triton=True, n_split=1, block_size=32768)  # few interpreted blocks per row


def every_hash_float():
    """One hash h for each distinct float32 that h.float() can be, so 84M values stand for all 2^32:
    the integers below 2^24 (exact), the floats of each binade [2^k, 2^(k+1)), k = 24..31 (2^(k-23)
    apart), and 2^32 - 1 (which rounds up to 2^32)."""
    yield torch.arange(2 ** 24)
    for k in range(24, 32):
        yield 2 ** k + torch.arange(2 ** 23) * 2 ** (k - 23)
    yield torch.tensor([2 ** 32 - 1])


@triton.jit
def _noise_kernel(h_ptr, g_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    h = tl.load(h_ptr + offs, mask=offs < n, other=0).to(tl.uint32)
    tl.store(g_ptr + offs, S._gumbel(h), mask=offs < n)


@pytest.mark.slow
def test_every_hash_gives_a_uniform_inside_0_1_and_finite_noise_in_both_paths():
    """Exhaustive. The old ((h >> 8) + 0.5) * 2^-24 gave u == 1.0 and noise +inf for h >> 8 =
    2^24 - 1."""
    lo, hi = math.inf, -math.inf
    for h in every_hash_float():
        u = S._uniform_torch(h)
        assert (u > 0).all() and (u < 1).all(), f'u outside (0, 1) for h = {h[(u <= 0) | (u >= 1)][:5]}'
        g = S._gumbel_torch(h)
        assert torch.isfinite(g).all(), f'noise not finite for h = {h[~torch.isfinite(g)][:5]}'
        gt = torch.empty_like(g)
        block = 2 ** 20
        _noise_kernel[(triton.cdiv(len(h), block),)](h, gt, len(h), BLOCK=block)
        assert torch.isfinite(gt).all(), f'triton noise not finite for h = {h[~torch.isfinite(gt)][:5]}'
        # the same fp32 arithmetic; the logs (numpy's in the interpreter, torch's SLEEF) may differ
        # in the last bits
        torch.testing.assert_close(gt, g, rtol=1e-6, atol=1e-6)
        lo, hi = min(lo, g.min().item()), max(hi, g.max().item())
    # the range the comment in sample_kernels.py states
    assert -2.82 < lo < -2.81 and 22.87 < hi < 22.88, (lo, hi)


def certain_row(vocab=QWEN_VOCAB, winner=123_457):
    row = torch.zeros(vocab)
    row[winner] = 100.0  # probability 1 - 151,935 e^-100 = 1 - 6e-39
    return row, winner


def hard_rows(seeds, step, vocab):
    """The rows whose 32-bit hashes include one of the 256 largest values: where the old noise,
    ((h >> 8) + 0.5) * 2^-24 rounded to 1.0, was +inf. (The composition of sample_kernels._noise_torch.)"""
    r1, r2 = S._row_keys(seeds, step)
    j = torch.arange(vocab)
    hit = [(S._mix32_(S._mix32_(j ^ a[:, None]).bitwise_xor_(b[:, None])) >= 2 ** 32 - 256).any(-1)
           for a, b in zip(r1.split(8), r2.split(8))]
    return torch.cat(hit).nonzero().squeeze(1)


@pytest.mark.slow
def test_a_token_of_probability_one_is_drawn_every_time_at_a_real_vocabulary():
    """1,000 draws at temperature 1, no top-k / top-p (torch path); through the kernel, the first
    25 of them and every one whose hashes include a value the old noise made +inf (about V / 2^24
    of the draws, 0.9%: each drew another token, with a log-prob near -100)."""
    row, winner = certain_row()
    seeds = torch.arange(1000) * 7919 + 11
    for chunk in seeds.split(250):
        ids, logp = sample_tokens_ref(row.expand(len(chunk), -1), chunk, 3)
        wrong = ids != winner
        assert not wrong.any(), (f'torch path drew {ids[wrong].tolist()} (log p '
                                 f'{logp[wrong].tolist()}) instead of the certain token')
    hard = hard_rows(seeds, 3, len(row))
    assert len(hard) >= 5, 'the seeds no longer reach the hashes the old noise got wrong'
    picked = torch.cat([seeds[:25], seeds[hard]])
    for chunk in picked.split(100):
        ids, logp = sample_tokens(row.expand(len(chunk), -1), chunk, 3, **BIG_BLOCK)
        wrong = ids != winner
        assert not wrong.any(), (f'triton drew {ids[wrong].tolist()} (log p '
                                 f'{logp[wrong].tolist()}) instead of the certain token')


def peaked_row(vocab=QWEN_VOCAB):
    """Eight tokens hold ~99.96% of the mass, scattered over the vocabulary (first and last ids
    among them); the other 151,928 share ~0.04% at random logits around -17."""
    g = torch.Generator().manual_seed(3)
    row = torch.randn(vocab, generator=g) - 17.0
    top = torch.tensor([0, 17, 4096, 50_000, 77_777, 100_003, 151_000, vocab - 1])
    row[top] = torch.linspace(0.0, 2.1, 8)
    return row


def chi_square_p_value(counts, p, n):
    """Pearson chi-square over the tokens expected >= 5 times and one bin for all the others
    (when that bin is expected < 5 times, its count gets a Poisson upper-tail p-value instead).
    Returns the smaller p-value."""
    expected = n * p
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    p_rest = 1.0
    if exp[-1] < 5:  # P(Poisson(exp) >= obs)
        p_rest = torch.special.gammainc(obs[-1], exp[-1]).item() if obs[-1] > 0 else 1.0
        obs, exp = obs[:-1] * n / obs[:-1].sum(), exp[:-1] * n / exp[:-1].sum()
    chi2 = ((obs - exp) ** 2 / exp).sum()
    dof = len(obs) - 1
    return min(p_rest, torch.special.gammaincc(torch.tensor(dof / 2.0), chi2 / 2).item())


# (config, torch draws, kernel draws): the kernel's threshold search (top-k, top-p) costs ~3 s a row
# at this vocabulary in the interpreter; rows differ only in their seeds, so a few rows test it
CASES = [(dict(), 1000, 25), (dict(top_p=0.9), 500, 2), (dict(top_k=50), 500, 2),
         (dict(min_p=0.05), 500, 25)]


@pytest.mark.slow
@pytest.mark.parametrize('cfg,n,n_triton', CASES, ids=[str(c[0]) for c in CASES])
def test_draws_follow_the_softmax_at_a_real_vocabulary(cfg, n, n_triton):
    """n draws of one peaked row (torch path): chi-square against the exact distribution
    (test_kernels.exact_probs); a correct sampler fails with probability 1e-6. Tokens outside the
    kept set: never. The kernel draws the same ids as the torch path (the first n_triton draws).
    With the old noise only cfg {} fails: about 9 of its 1,000 draws went to tokens of probability
    ~1e-11 (expected 0.4 in all); under top-p, top-k and min-p the +inf token lies outside the
    kept set."""
    row = peaked_row()
    seeds = torch.arange(n) + 10_000
    ids = torch.cat([sample_tokens_ref(row.expand(len(c), -1), c, 5, **cfg)[0]
                     for c in seeds.split(250)])
    p = exact_probs(row, **cfg)
    counts = torch.bincount(ids, minlength=len(row)).double()
    assert counts[p == 0].sum() == 0, f'drew tokens outside the kept set: {ids[p[ids] == 0]}'
    p_value = chi_square_p_value(counts, p, n)
    assert p_value > 1e-6, f'draws do not follow the exact distribution: p = {p_value:.2e}'
    tri = torch.cat([sample_tokens(row.expand(len(c), -1), c, 5, **cfg, **BIG_BLOCK)[0]
                     for c in seeds[:n_triton].split(50)])
    assert torch.equal(tri, ids[:n_triton]), f'{(tri != ids[:n_triton]).sum()} triton draws differ'
