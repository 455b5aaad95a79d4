"""The GRPO objective against hand-computed values on tiny tensors."""
import math

import pytest
import torch

from batch import micro_batches
from loss import (adapt_entropy_coef, advantages, cov_selection, entropy_cut, gdpo_advantages, group_advantages,
                  kl_estimate, off_policy_keep, policy_loss, reverse_cumsum, segment_sum,
                  tis_weights, token_weights, zero_spread)

CLIP = dict(eps_low=0.2, eps_high=0.28)  # DAPO's clip-higher: the project's defaults
SYMMETRIC = dict(eps_low=0.2, eps_high=0.2)


def test_advantages_grpo_and_dr_grpo():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    adv, zero = group_advantages(r, scale='none')
    assert torch.equal(adv, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]])), adv
    assert zero.tolist() == [False, True], "a group with identical rewards has zero std"
    adv, _ = group_advantages(r, scale='group', eps=0.0)
    std = math.sqrt((4 * 0.25) / 3)  # unbiased std of [1,0,0,1]
    assert torch.allclose(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / std), adv
    assert torch.equal(adv[1], torch.zeros(4)), "zero-std groups get zero advantage, not NaN"
    # one std for the whole batch: that of all 8 rewards
    adv, _ = group_advantages(r, scale='batch', eps=0.0)
    batch_std = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]).std().item()
    assert torch.allclose(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / batch_std), adv
    assert torch.equal(adv[1], torch.zeros(4)), "zero-std groups get zero advantage, not NaN"
    with pytest.raises(ValueError, match='scale_rewards'):
        group_advantages(r, scale='std')


def test_token_weights_each_mode():
    # one micro-batch of 2 sequences; the step has n_tok=10 tokens in n_seq=4 sequences
    lens = torch.tensor([2, 3])
    assert torch.allclose(token_weights(lens, 'token_mean', 10, 4, 8), torch.full((5,), 0.1))
    assert torch.allclose(token_weights(lens, 'seq_mean_token_mean', 10, 4, 8),
                          torch.tensor([1 / 8, 1 / 8, 1 / 12, 1 / 12, 1 / 12]))
    assert torch.allclose(token_weights(lens, 'seq_sum_const', 10, 4, 8), torch.full((5,), 1 / 32))
    assert torch.equal(token_weights(lens, 'token_sum', 10, 4, 8), torch.ones(5))
    assert torch.allclose(token_weights(lens, 'seq_mean_token_sum', 10, 4, 8), torch.full((5,), 0.25))
    with pytest.raises(ValueError, match='loss_agg'):
        token_weights(lens, 'mean', 10, 4, 8)


def test_clipping_both_sides():
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5]))  # ratios 1.5, 1.5, 0.5, 0.5
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    w = torch.ones(4)
    loss, st = policy_loss(logp, old, adv, w, torch.ones(4, dtype=torch.long), **CLIP)
    # per token: max(-A r, -A clip(r, 0.8, 1.28))
    # A=+1, r=1.5: max(-1.5, -1.28) = -1.28 (clipped: no incentive to raise r further)
    # A=-1, r=1.5: max(1.5, 1.28)   = 1.5   (not clipped: the pessimistic bound keeps the gradient)
    # A=+1, r=0.5: max(-0.5, -0.8)  = -0.5  (not clipped)
    # A=-1, r=0.5: max(0.5, 0.8)    = 0.8   (clipped below)
    assert torch.allclose(st['pg'], torch.tensor([-1.28, 1.5, -0.5, 0.8])), st['pg']
    assert st['clip_high'].tolist() == [True, False, False, False], st['clip_high']
    assert st['clip_low'].tolist() == [False, False, False, True], st['clip_low']
    assert abs(loss.item() - (-1.28 + 1.5 - 0.5 + 0.8)) < 1e-6
    # a clipped token passes no gradient; an unclipped one passes -A * r
    logp = logp.clone().requires_grad_(True)
    policy_loss(logp, old, adv, w, torch.ones(4, dtype=torch.long), **CLIP)[0].backward()
    assert torch.allclose(logp.grad, torch.tensor([0.0, 1.5, -0.5, 0.0])), logp.grad


def test_cov_selection_picks_by_the_covariance_of_advantage_and_log_prob():
    """A [1, 1, -1, -1], log pi [0, -2, -1, -4] (mean -1.75): covariances 1.75, -0.25, -0.75, 2.25.
    KL-Cov takes the largest; Clip-Cov draws (the smallest uniforms) from those inside its bounds."""
    adv, logp = torch.tensor([1.0, 1.0, -1.0, -1.0]), torch.tensor([0.0, -2.0, -1.0, -4.0])
    assert cov_selection(adv, logp, 1, 'kl_cov').tolist() == [False, False, False, True]
    assert cov_selection(adv, logp, 2, 'kl_cov').tolist() == [True, False, False, True]
    u = torch.tensor([0.9, 0.1, 0.5, 0.2])
    assert cov_selection(adv, logp, 1, 'clip_cov', bounds=(0.0, 3.0), u=u).tolist() == [False, False, False, True]
    # only 1.75 lies inside (1, 2): fewer than asked for
    assert cov_selection(adv, logp, 2, 'clip_cov', bounds=(1.0, 2.0), u=u).tolist() == [True, False, False, False]


def test_clip_cov_stops_the_picked_tokens_gradient_and_kl_cov_penalises_their_move():
    """Ratios 1.5 and 0.5 (A = +1, -1), the first token picked. Clip-Cov: the PPO loss, the picked
    token's gradient 0. KL-Cov: -A r unclipped, plus coef |log r| on the picked token."""
    old = torch.zeros(2)
    adv, w, lens = torch.tensor([1.0, -1.0]), torch.ones(2), torch.ones(2, dtype=torch.long)
    picked = torch.tensor([1.0, 0.0])
    logp = torch.log(torch.tensor([1.5, 0.5])).requires_grad_(True)
    loss, st = policy_loss(logp, old, adv, w, lens, loss_type='clip_cov', cov_mask=picked, **CLIP)
    loss.backward()
    assert torch.allclose(st['pg'], torch.tensor([0.0, 0.8])) and torch.allclose(logp.grad, torch.zeros(2))
    logp.grad = None
    loss, st = policy_loss(logp, old, adv, w, lens, loss_type='kl_cov', cov_mask=picked, kl_cov_coef=2.0,
                           **CLIP)
    loss.backward()
    assert torch.allclose(st['pg'], torch.tensor([-1.5 + 2 * math.log(1.5), 0.5]))
    # d/dlogp: -A r + 2 |logp| -> -1.5 + 2 (the picked); +0.5 (A = -1, r = 0.5, unclipped)
    assert torch.allclose(logp.grad, torch.tensor([0.5, 0.5])), logp.grad


def test_gmpo_takes_the_geometric_mean_of_the_clipped_token_ratios():
    """One sequence, A = +1, log ratios 0.5 and -0.1, bounds 0.2: the first clipped to 0.2 (A > 0
    pushes it up), the mean 0.05, so each token's loss is -e^0.05 and only the unclipped token
    passes a gradient, -e^0.05 (2 tokens x 1/2). A = -1 clips the other side: -0.1 stays, 0.5 stays
    (moving it up is what A < 0 pays against)."""
    lr = torch.tensor([0.5, -0.1], requires_grad=True)
    kw = dict(lens=torch.tensor([2]), eps_low=0.2, eps_high=0.2, loss_type='gmpo')
    loss, st = policy_loss(lr, torch.zeros(2), torch.tensor([1.0, 1.0]), torch.ones(2), **kw)
    loss.backward()
    e = math.exp(0.05)
    assert torch.allclose(st['pg'], torch.tensor([-e, -e])) and torch.allclose(lr.grad, torch.tensor([0.0, -e]))
    assert st['clip_high'].tolist() == [True, False]
    loss, st = policy_loss(lr, torch.zeros(2), torch.tensor([-1.0, -1.0]), torch.ones(2), **kw)
    assert torch.allclose(st['pg'], torch.tensor([math.exp(0.2)] * 2)), st['pg']  # mean of 0.5, -0.1


def test_on_policy_gradient_is_minus_advantage():
    """num_iterations = 1: ratio is 1, the loss is sum(-A w) and d loss / d logp = -A w."""
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    adv = torch.tensor([2.0, -1.0, 0.5])
    w = torch.tensor([0.25, 0.25, 0.5])
    loss, _ = policy_loss(logp, logp.detach(), adv, w, torch.ones(3, dtype=torch.long), **CLIP)
    loss.backward()
    assert abs(loss.item() - (-(2 * 0.25) + 0.25 - 0.25)) < 1e-6
    assert torch.allclose(logp.grad, -adv * w)


@pytest.mark.parametrize('loss_type', ['grpo', 'gspo', 'cispo'])
def test_teacher_adds_minus_its_per_token_reverse_kl_to_the_advantage(loss_type):
    """On-policy distillation: each token's advantage gains coef (log p_teacher - log p_old), detached,
    that token's alone (no sum to the sequence's end, unlike the k1 KL penalty); off-policy too."""
    torch.manual_seed(0)
    lens = torch.tensor([3, 2])
    old = -torch.rand(5) * 3
    logp = (old + 0.1 * torch.randn(5)).requires_grad_()
    teacher = -torch.rand(5) * 3
    adv = torch.repeat_interleave(torch.tensor([0.5, -1.0]), lens)
    w = torch.full((5,), 0.2)
    loss, st = policy_loss(logp, old, adv, w, lens, **CLIP, loss_type=loss_type, teacher_logp=teacher,
                           teacher_coef=0.3)
    (grad,) = torch.autograd.grad(loss, logp)
    want, _ = policy_loss(logp, old, adv + 0.3 * (teacher - old), w, lens, **CLIP, loss_type=loss_type)
    (want_grad,) = torch.autograd.grad(want, logp)
    assert torch.allclose(loss, want) and torch.allclose(grad, want_grad)
    assert torch.allclose(st['teacher_kl'], old - teacher)
    assert not st['teacher_kl'].requires_grad
    # on-policy with advantage 'none': d loss / d logp = -coef (log p_teacher - log p) w
    on = logp.detach().clone().requires_grad_()
    loss, _ = policy_loss(on, on.detach(), torch.zeros(5), w, lens, **CLIP, teacher_logp=teacher,
                          teacher_coef=0.3)
    loss.backward()
    assert torch.allclose(on.grad, -0.3 * (teacher - on.detach()) * w)


def test_kl_estimators():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert torch.allclose(kl_estimate(logp, ref, 'k1'), torch.tensor([0.5, -1.0]))
    lr = torch.tensor([-0.5, 1.0])  # ref - logp
    assert torch.allclose(kl_estimate(logp, ref, 'k3'), torch.exp(lr) - lr - 1)
    assert torch.allclose(kl_estimate(logp, ref, 'k2'), 0.5 * lr ** 2)
    k3 = kl_estimate(torch.randn(100), torch.randn(100), 'k3')
    assert (k3 >= 0).all(), "k3 is never negative"
    big = kl_estimate(torch.tensor([0.0]), torch.tensor([-100.0]), 'k3', clamp=10.0)
    want = torch.exp(torch.tensor(-10.0)) + 10 - 1
    assert torch.allclose(big, want), "log ratios are clamped before exp"


def test_kl_and_entropy_terms_enter_the_loss():
    logp, ref, ent = torch.tensor([-1.0]), torch.tensor([-1.5]), torch.tensor([2.0])
    adv, w, one = torch.zeros(1), torch.ones(1), torch.ones(1, dtype=torch.long)
    base, _ = policy_loss(logp, logp, adv, w, one, **SYMMETRIC)
    for est, kl in (('k2', 0.5 * 0.5 ** 2), ('k3', math.exp(-0.5) + 0.5 - 1)):
        with_kl, st = policy_loss(logp, logp, adv, w, one, **SYMMETRIC, ref_logp=ref, beta=0.1,
                                  kl_estimator=est)
        assert abs(with_kl.item() - (base.item() + 0.1 * kl)) < 1e-6, est
        assert abs(st['kl'].item() - kl) < 1e-6, est
    # k1 is a detached penalty in the advantage: A' = 0 - 0.1 * 0.5,
    # so the loss is -A' * ratio = +0.05
    with_k1, st = policy_loss(logp, logp, adv, w, one, **SYMMETRIC, ref_logp=ref, beta=0.1,
                              kl_estimator='k1')
    assert abs(with_k1.item() - 0.05) < 1e-6
    assert abs(st['kl'].item() - 0.5) < 1e-6
    with_ent, _ = policy_loss(logp, logp, adv, w, one, **SYMMETRIC, entropy=ent, entropy_coef=0.01)
    assert abs(with_ent.item() - (base.item() - 0.02)) < 1e-6


def test_sum_aggregations_match_verl_and_trl_definitions():
    """token_sum and seq_mean_token_sum against hand-worked numbers and the anchors' definitions on
    a padded (sequences, tokens) loss matrix: verl's agg_loss 'token-sum' (masked sum, no
    normaliser) and 'seq-mean-token-sum' (each sequence's masked sum, mean over the sequences),
    TRL 1.16's loss_type='luspo' ((per_token_loss * mask).sum(-1).mean()). Per-token losses
    [1, 2] and [3, 4, 5]: token_sum 15, seq_mean_token_sum (3 + 12) / 2 = 7.5, also summed over
    micro-batches of one sequence each (the normaliser counts the whole step)."""
    lens = torch.tensor([2, 3])
    flat = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    mat = torch.tensor([[1.0, 2.0, 0.0], [3.0, 4.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    anchors = {'token_sum': (15.0, (mat * mask).sum()),
               'seq_mean_token_sum': (7.5, (mat * mask).sum(-1).mean())}
    for agg, (hand, anchor) in anchors.items():
        whole = (flat * token_weights(lens, agg, 5, 2, 8)).sum()
        split = sum((flat[a:b] * token_weights(lens[i:i + 1], agg, 5, 2, 8)).sum()
                    for i, (a, b) in enumerate([(0, 2), (2, 5)]))
        assert whole.item() == hand == anchor.item() == split.item(), (agg, whole, anchor, split)
    # a tool's inserted token (the second of the first sequence) weighs 0 and counts nowhere
    sampled = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0])
    assert (flat * token_weights(lens, 'token_sum', 4, 2, 8, sampled=sampled)).sum().item() == 13.0
    assert (flat * token_weights(lens, 'seq_mean_token_sum', 4, 2, 8, sampled=sampled)).sum().item() \
        == 6.5


@pytest.mark.parametrize('loss_agg', ['token_mean', 'seq_mean_token_mean', 'seq_sum_const', 'token_sum',
                                      'seq_mean_token_sum'])
def test_gradient_does_not_depend_on_micro_batching(loss_agg):
    """Summing micro-batch losses with step-level denominators gives the same gradient for
    micro-batch 1 and all."""
    torch.manual_seed(0)
    lens = torch.tensor([3, 1, 5, 2, 4])
    # stands in for the parameters behind logp
    theta = torch.randn(int(lens.sum()), requires_grad=True)
    adv_seq = torch.randn(5)
    n_tok, n_seq = int(lens.sum()), len(lens)

    def grad_with(mb_size):
        theta.grad = None
        starts = torch.cumsum(lens, 0) - lens
        total = 0.0
        for i in range(0, n_seq, mb_size):
            mb = slice(i, min(i + mb_size, n_seq))
            idx = torch.cat([torch.arange(int(s), int(s + n))
                             for s, n in zip(starts[mb], lens[mb])])
            logp = torch.log_softmax(theta, 0)[idx]
            A = torch.repeat_interleave(adv_seq[mb], lens[mb])
            w = token_weights(lens[mb], loss_agg, n_tok, n_seq, 8)
            loss = policy_loss(logp, logp.detach(), A, w, lens[mb], **CLIP)[0]
            loss.backward()
            total += loss.item()
        return theta.grad.clone(), total

    (g1, loss1), (g2, loss2), (gall, loss_all) = grad_with(1), grad_with(2), grad_with(n_seq)
    for g, loss, size in ((g1, loss1, 1), (g2, loss2, 2)):
        assert torch.allclose(g, gall, atol=1e-7), \
            f"{loss_agg}: micro-batch {size} vs all differ by {(g - gall).abs().max()}"
        assert math.isclose(loss, loss_all, rel_tol=1e-6, abs_tol=1e-7), (loss_agg, size, loss, loss_all)


@pytest.mark.parametrize('estimator, direction',
                         [('k1', 'forward'), ('k2', 'forward'), ('k3', 'reverse'),
                          ('k3_is', 'forward'), ('k3+', 'forward')])
def test_kl_estimators_expected_gradient_is_the_kl_gradient(estimator, direction):
    """On a categorical policy softmax(theta) over 6 tokens, each token a one-token completion: the
    exact expected gradient of the penalty (sum over tokens of pi(a) * grad loss(a), pi(a) a fixed
    sampling weight) equals the gradient of KL(pi || ref) (k1 through the advantage, k2, k3 times
    the ratio, k3+) or of KL(ref || pi) (k3). The old k1 in the loss has expected gradient 0 and
    fails here."""
    torch.manual_seed(1)
    theta = torch.randn(6, dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.randn(6, dtype=torch.float64), 0)
    logp = torch.log_softmax(theta, 0)
    pi = logp.exp().detach()
    ones = torch.ones(6, dtype=torch.long)
    adv = torch.zeros(6, dtype=torch.float64)
    loss, _ = policy_loss(logp, logp.detach(), adv, pi, ones, **CLIP,
                          ref_logp=ref, beta=1.0, kl_estimator=estimator, kl_clamp=100.0)
    got, = torch.autograd.grad(loss, theta)
    p = torch.softmax(theta, 0)
    kl = (p * (torch.log_softmax(theta, 0) - ref)).sum() if direction == 'forward' else \
        (ref.exp() * (ref - torch.log_softmax(theta, 0))).sum()
    want, = torch.autograd.grad(kl, theta)
    assert torch.allclose(got, want, atol=1e-10), \
        f"{estimator}: {got} vs grad KL ({direction}) {want}"


def test_k1_penalty_is_the_kl_still_to_come_in_its_sequence():
    """Two sequences of lengths 2 and 1: token t's advantage loses beta * (k1 of tokens t..end of
    its sequence)."""
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.5, -1.0, -0.5])  # k1 = logp - ref = 0.5, -1.0, 0.0
    assert torch.allclose(reverse_cumsum(torch.tensor([0.5, -1.0, 0.0]), torch.tensor([2, 1])),
                          torch.tensor([-0.5, -1.0, 0.0]))
    _, st = policy_loss(logp, logp, torch.zeros(3), torch.ones(3), torch.tensor([2, 1]), **CLIP,
                        ref_logp=ref, beta=0.1, kl_estimator='k1')
    # -A' with A' = -0.1 * to-come
    assert torch.allclose(st['pg'], torch.tensor([-0.05, -0.1, 0.0])), st['pg']
    sums = segment_sum(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([2, 1]))
    assert torch.allclose(sums, torch.tensor([3.0, 4.0]))


def test_gspo_ratio_is_the_sequences_geometric_mean_clipped_per_sequence():
    """Sequence 1: token ratios 2 and 0.5 -> geometric mean 1, nothing clips although both tokens
    are far from 1. Sequence 2: ratios 1.5 and 1.5 -> 1.5, clipped at 1.28 for A > 0: the whole
    sequence passes no gradient."""
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([2.0, 0.5, 1.5, 1.5])).requires_grad_(True)
    adv, lens = torch.tensor([1.0, 1.0, 1.0, 1.0]), torch.tensor([2, 2])
    loss, st = policy_loss(logp, old, adv, torch.ones(4), lens, **CLIP, loss_type='gspo')
    assert torch.allclose(st['ratio'], torch.tensor([1.0, 1.0, 1.5, 1.5]))
    assert st['clip_high'].tolist() == [False, False, True, True]
    loss.backward()
    # each of the sequence's 2 tokens (weight 1) carries -A s, and ds/dlogp_t = s / |y|:
    # 2 * (-1 * 1/2) = -1
    assert torch.allclose(logp.grad, torch.tensor([-1.0, -1.0, 0.0, 0.0])), logp.grad
    tok, _ = policy_loss(logp.detach(), old, adv, torch.ones(4), lens, **CLIP, loss_type='grpo')
    assert tok.item() != loss.item(), "token-level clipping treats these tokens differently"


def test_cispo_clips_the_weight_not_the_gradient():
    """CISPO: -min(r, 1 + eps_high) (detached) * A * log pi. A token with r = 1.5 > 1.28 keeps a
    gradient, scaled by 1.28, where the PPO clip would pass none; on-policy (r = 1) the gradient is
    -A, as GRPO's."""
    old = torch.zeros(2)
    logp = torch.log(torch.tensor([1.5, 1.0])).requires_grad_(True)
    adv = torch.tensor([1.0, -2.0])
    lens = torch.ones(2, dtype=torch.long)
    loss, st = policy_loss(logp, old, adv, torch.ones(2), lens, **CLIP, loss_type='cispo')
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([-1.28, 2.0])), logp.grad
    assert st['clip_high'].tolist() == [True, False]
    with pytest.raises(ValueError, match='loss_type'):
        policy_loss(logp, old, adv, torch.ones(2), lens, **CLIP, loss_type='ppo')


def test_sapo_gates_the_ratio_softly_as_trl_and_verl_do():
    """SAPO: -A (4 / tau) sigmoid(tau (r - 1)), tau_pos where A > 0, tau_neg elsewhere. Its gradient
    in log pi is -A 4 s (1 - s) r (s the sigmoid): -A on-policy (s = 1/2, r = 1), as GRPO's, and
    fading as r leaves 1 on either side, where the PPO clip would cut it off at once (one side) or
    not at all (the other). Worked by hand for r = 1, 2 and 0.5."""
    old = torch.zeros(4)
    r = torch.tensor([1.0, 2.0, 0.5, 2.0])
    logp = torch.log(r).requires_grad_(True)
    adv, lens = torch.tensor([1.0, 1.0, -2.0, -2.0]), torch.ones(4, dtype=torch.long)
    loss, st = policy_loss(logp, old, adv, torch.ones(4), lens, **CLIP, loss_type='sapo',
                           sapo_tau=(1.0, 2.0))
    loss.backward()
    sig = torch.sigmoid
    tau = torch.tensor([1.0, 1.0, 2.0, 2.0])
    want_pg = -adv * 4 / tau * sig(tau * (r - 1))
    assert torch.allclose(st['pg'], want_pg), st['pg']
    s = sig(tau * (r - 1))
    assert torch.allclose(logp.grad, -adv * 4 * s * (1 - s) * r), logp.grad
    assert math.isclose(logp.grad[0].item(), -1.0, rel_tol=1e-6), "on-policy: GRPO's -A"
    # by hand, r = 2, A = 1, tau = 1: -4 s(1) (1 - s(1)) 2 = -8 * 0.7311 * 0.2689
    assert math.isclose(logp.grad[1].item(), -8 * 0.7310586 * 0.2689414, rel_tol=1e-5)
    assert not st['clip_low'].any() and not st['clip_high'].any()
    # TRL's sapo branch and verl's compute_policy_loss_sapo compute this same per-token loss
    trl = -(torch.sigmoid(tau * (r - 1)) * 4 / tau) * adv
    assert torch.allclose(st['pg'], trl)
    # a ratio far off 1 (log ratio 100: exp overflows float32) is bounded as verl bounds it: a
    # finite gradient, not nan
    far = torch.tensor([100.0, -100.0], requires_grad=True)
    loss, _ = policy_loss(far, torch.zeros(2), torch.tensor([1.0, -1.0]), torch.ones(2),
                          torch.ones(2, dtype=torch.long), **CLIP, loss_type='sapo')
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(far.grad).all(), far.grad


def test_off_policy_mask_drops_negative_sequences_far_from_the_sampler():
    """DeepSeek-V3.2's masking, threshold 0.5, three sequences of two tokens each; log(pi_sampler /
    pi) per token: seq 0 (A < 0) 0.4 and 0.8, mean 0.6 > 0.5: masked; seq 1 (A > 0) the same
    gap: kept, a good sample is never masked; seq 2 (A < 0) 0.4 and 0.4: under it, kept. As TRL's
    get_off_policy_mask computes it. With tools, an inserted token (not sampled) does not count."""
    gen = torch.zeros(6)
    logp = -torch.tensor([0.4, 0.8, 0.4, 0.8, 0.4, 0.4])
    seq_adv, lens = torch.tensor([-1.0, 1.0, -1.0]), torch.tensor([2, 2, 2])
    kept = off_policy_keep(logp, gen, seq_adv, lens, 0.5)
    assert kept.tolist() == [0, 0, 1, 1, 1, 1], kept
    trl_kl = ((gen - logp).view(3, 2)).mean(1)  # TRL: (kl * mask).sum(1) / mask.sum(1)
    trl_keep = (seq_adv >= 0) | (trl_kl <= 0.5)
    assert torch.equal(kept.view(3, 2)[:, 0].bool(), trl_keep)
    # seq 0's second token inserted by a tool: its mean over sampled tokens is 0.4, kept
    sampled = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    assert off_policy_keep(logp, gen, seq_adv, lens, 0.5, sampled=sampled).tolist() == [1] * 6
    # in the loss it multiplies the policy-gradient term: the masked sequence passes no gradient
    logp = logp.clone().requires_grad_(True)
    policy_loss(logp, logp.detach(), torch.repeat_interleave(seq_adv, lens), torch.ones(6), lens,
                **CLIP, is_weight=kept)[0].backward()
    assert logp.grad.tolist() == [0.0, 0.0, -1.0, -1.0, 1.0, 1.0], logp.grad


def trl_gamma_weights(adv, log_ratio, mask, is_ratio, shape=(2.0, 3.0, 3.0, 2.0)):
    """TRL 1.x's GRPOTrainer.get_gamma_weights (loss_type='vespo'), restated from its source on
    padded (B, T) rows: adv (B, 1), mask 1 on each completion token; its defaults (k_pos, lambda_pos,
    k_neg, lambda_neg)."""
    k_pos, lam_pos, k_neg, lam_neg = shape
    lo = math.log(1e-8)
    seq = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)
    if is_ratio is not None:
        seq = seq + torch.log(is_ratio).clamp(lo, 20.0).sum(-1, keepdim=True)
    log_w = seq.clamp(lo, 20.0)
    k = torch.where(adv >= 0, k_pos, k_neg)
    lam = torch.where(adv >= 0, lam_pos, lam_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(0.0, 0.0, 0.0)


def test_vespo_weighs_each_sequence_by_its_whole_ratio_as_trl_does():
    """VESPO: -phi(w) A log pi, phi(w) = e^(lam + k log w - lam w) detached, w the sequence's
    whole pi / pi_old. Equal to TRL's gamma weights on the same rows (three sequences of 2, 3 and
    1 tokens, one advantage negative, with per-token importance weights from the sampler); phi(1)
    = 1, so on-policy the gradient is GRPO's, -A grad log pi; by hand, w = 2 with A > 0 (k 2,
    lam 3): phi = e^3 4 e^-6 = 4 / e^3; the loss's gradient is -phi A per token, nothing
    through phi."""
    lens = torch.tensor([2, 3, 1])
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(6, generator=g)
    log_ratio = 0.3 * torch.randn(6, generator=g)
    logp = (old + log_ratio).requires_grad_(True)
    seq_adv = torch.tensor([1.0, -0.5, 2.0])
    adv = torch.repeat_interleave(seq_adv, lens)
    is_w = torch.tensor([1.0, 0.9, 1.1, 1.0, 0.8, 1.2])
    loss, st = policy_loss(logp, old, adv, torch.ones(6), lens, **CLIP, loss_type='vespo',
                           is_weight=is_w)
    loss.backward()
    pad = torch.zeros(3, 3)
    mask = torch.arange(3) < lens[:, None]
    rows, isr = pad.clone(), torch.ones(3, 3)
    rows[mask], isr[mask] = log_ratio, is_w
    phi = trl_gamma_weights(seq_adv[:, None], rows, mask.float(), isr)
    want = torch.repeat_interleave(phi[:, 0], lens)
    assert torch.allclose(logp.grad, -want * adv, rtol=1e-5), (logp.grad, -want * adv)
    assert torch.allclose(st['pg'], -want * adv * logp.detach(), rtol=1e-5)
    assert not st['clip_low'].any() and not st['clip_high'].any()
    # on-policy: phi(1) = 1, the gradient of every other loss type
    same = old.clone().requires_grad_(True)
    policy_loss(same, old, adv, torch.ones(6), lens, **CLIP, loss_type='vespo')[0].backward()
    assert torch.allclose(same.grad, -adv), same.grad
    # w = 2 (log ratio log 2 over one token), A = 1: phi = e^3 * 2^2 * e^-6
    two = torch.tensor([math.log(2.0)], requires_grad=True)
    policy_loss(two, torch.zeros(1), torch.ones(1), torch.ones(1), torch.ones(1, dtype=torch.long),
                **CLIP, loss_type='vespo')[0].backward()
    assert math.isclose(two.grad.item(), -4 * math.exp(-3.0), rel_tol=1e-5), two.grad


def test_sequence_ratios_count_only_the_tokens_the_sampler_drew():
    """A tool rollout's inserted tokens are no sample of the policy: GSPO's sequence ratio (the
    mean log ratio) and VESPO's (the sum) are taken over the sampled tokens only, as TRL and verl
    mask tool responses out. Sequence 0: log ratios 0.1 (sampled), 5.0 (inserted), 0.3
    (sampled): GSPO's ratio e^0.2, VESPO's w = e^0.4. The mask (pg_mask) zeroes the policy
    gradient of a sequence and nothing else."""
    lens = torch.tensor([3, 1])
    log_ratio = torch.tensor([0.1, 5.0, 0.3, 0.0])
    sampled = torch.tensor([1.0, 0.0, 1.0, 1.0])
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0])
    _, st = policy_loss(log_ratio, torch.zeros(4), adv, torch.ones(4), lens, **CLIP,
                        loss_type='gspo', sampled=sampled)
    assert torch.allclose(st['ratio'][:3], torch.full((3,), math.exp(0.2))), st['ratio']
    logp = log_ratio.clone().requires_grad_(True)
    policy_loss(logp, torch.zeros(4), adv, torch.ones(4), lens, **CLIP, loss_type='vespo',
                sampled=sampled)[0].backward()
    w = math.exp(0.4)
    phi = math.exp(3.0 + 2.0 * 0.4 - 3.0 * w)
    assert torch.allclose(logp.grad[:3], torch.full((3,), -phi)), logp.grad
    logp.grad = None
    policy_loss(logp, torch.zeros(4), adv, torch.ones(4), lens, **CLIP, loss_type='vespo',
                sampled=sampled, pg_mask=torch.tensor([0.0, 0.0, 0.0, 1.0]))[0].backward()
    assert logp.grad[:3].abs().sum() == 0 and logp.grad[3] == 1.0, logp.grad


def trl_normalize_then_sum(per_fn, weights, eps=1e-4):
    """TRL 1.x's multi_objective_aggregation='normalize_then_sum', restated from its source
    (GRPOTrainer._generate_and_score_completions) for one process: rows (N, K), groups of G."""
    def nanstd(x, dim=None, keepdim=False):  # trl.trainer.utils.nanstd: unbiased, nan ignored
        mean = torch.nanmean(x, dim=dim, keepdim=True)
        var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=keepdim)
        count = torch.sum(~torch.isnan(x), dim=dim, keepdim=keepdim)
        return torch.sqrt(var * count / (count - 1))
    P, G, K = per_fn.shape
    grouped = per_fn
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True)
    reward_k = ((grouped - mean_k) / (std_k + eps)).view(-1, K)
    rewards = (reward_k * weights.unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(per_fn.view(-1, K)).all(dim=1)] = torch.nan
    adv = (rewards - torch.nanmean(rewards)) / (nanstd(rewards) + eps)
    return torch.nan_to_num(adv, nan=0.0).view(P, G)


def test_gdpo_normalises_each_reward_in_its_group_then_the_sum_over_the_step():
    """Two groups of 4, rewards (correct, format) with weights (1, 0.5). Group 0: correct 1, 1,
    0, 0 and format 1, 0, 1, 0: normalised each (std 0.5774) to +-0.866, weighted sums 1.299,
    0.433, -0.433, -1.299 (GRPO on the totals 1.5, 1, 0.5, 0 orders them the same). Group 1:
    correct all 0 (no spread: 0), format 1, 0, 0, 0: the format alone decides. Then
    (x - mean) / (std + eps) over the 8 sums. Equal to TRL's normalize_then_sum, and to verl's
    gdpo up to its last step (token-weighted whitening)."""
    per_fn = torch.tensor([[[1.0, 1.0], [1.0, 0.0], [0.0, 1.0], [0.0, 0.0]],
                           [[0.0, 1.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]])
    w = torch.tensor([1.0, 0.5])
    adv, zero = gdpo_advantages(per_fn, w)
    s0 = 0.5 / (math.sqrt(1 / 3) + 1e-4)  # a 1/0/1/0 group's value above its mean, normalised
    s1 = 0.75 / (math.sqrt(0.25) + 1e-4)  # 1/0/0/0: std sqrt(0.25), the 1 is 0.75 above
    sums = torch.tensor([s0 + 0.5 * s0, s0 - 0.5 * s0, -s0 + 0.5 * s0, -s0 - 0.5 * s0,
                         0.5 * s1, -0.5 * s1 / 3, -0.5 * s1 / 3, -0.5 * s1 / 3])
    want = ((sums - sums.mean()) / (sums.std() + 1e-4)).view(2, 4)
    assert torch.allclose(adv, want, atol=1e-6), adv
    assert zero.tolist() == [False, False]
    assert torch.allclose(adv, trl_normalize_then_sum(per_fn, w), atol=1e-6)
    # the same totals by other means: completions 1 and 2 of a group with correct 1, 0 and format
    # 0, 2 both score 1 (weights 1, 0.5): GRPO gives them one advantage, GDPO two
    per_fn = torch.tensor([[[1.0, 0.0], [0.0, 2.0], [0.0, 0.0], [1.0, 2.0]]])
    adv, _ = gdpo_advantages(per_fn, w)
    assert adv[0, 0] != adv[0, 1]
    # a group whose totals are all equal but whose functions spread has a gradient: not zero_std
    # (for filter_zero_std and dynamic_sampling), where GRPO's totals would skip it
    assert torch.allclose(adv, trl_normalize_then_sum(per_fn, w), atol=1e-6)
    tie, zero = gdpo_advantages(torch.tensor([[[1.0, 0.0], [0.0, 2.0]]]), w)
    assert zero.tolist() == [False] and (tie != 0).all() and zero_spread(torch.ones(1, 2)).all()
    # a group where no function spreads: 0 and zero_std; a function that did not apply (nan) to
    # some completions is left out of its group's statistics, as TRL's nanmean/nanstd leave it
    per_fn = torch.tensor([[[1.0, 0.5], [1.0, 0.5]], [[1.0, math.nan], [0.0, 1.0]],
                           [[0.0, 0.0], [1.0, 1.0]]])
    adv, zero = gdpo_advantages(per_fn, w)
    assert zero.tolist() == [True, False, False] and adv[0].tolist() == [0.0, 0.0]
    assert torch.allclose(adv, trl_normalize_then_sum(per_fn, w), atol=1e-6), adv
    adv2, zero2 = advantages(torch.zeros(3, 2), 'gdpo', per_fn=per_fn, weights=w)
    assert torch.equal(adv2, adv) and torch.equal(zero2, zero)


def test_tis_weights_each_mode():
    """rho = pi_train / pi_sampler: tokens 4, 0.5 (sequence 1: product 2) and 1 (sequence 2),
    cap 3."""
    train, gen = torch.log(torch.tensor([4.0, 0.5, 1.0])), torch.zeros(3)
    lens = torch.tensor([2, 1])
    cases = {'token_truncate': ([3.0, 0.5, 1.0], [True, False, False]),
             'token_mask': ([0.0, 0.5, 1.0], [True, False, False]),
             'sequence_truncate': ([2.0, 2.0, 1.0], [False] * 3),
             'sequence_mask': ([2.0, 2.0, 1.0], [False] * 3)}
    for mode, (want, above) in cases.items():
        w, capped = tis_weights(train, gen, lens, mode, 3.0)
        assert torch.allclose(w, torch.tensor(want)), (mode, w, capped)
        assert capped.tolist() == above, (mode, w, capped)
    # sequence 1's product 2 > 1.5: all of it masked
    w, capped = tis_weights(train, gen, lens, 'sequence_mask', 1.5)
    assert w.tolist() == [0.0, 0.0, 1.0] and capped.tolist() == [True, True, False]
    with pytest.raises(ValueError, match='tis'):
        tis_weights(train, gen, lens, 'token', 3.0)


def test_is_weight_scales_the_policy_gradient_only():
    logp, ref = torch.tensor([-1.0, -2.0], requires_grad=True), torch.tensor([-1.5, -1.0])
    adv, w, lens = torch.tensor([1.0, -1.0]), torch.ones(2), torch.ones(2, dtype=torch.long)
    isw = torch.tensor([0.5, 2.0])
    loss, st = policy_loss(logp, logp.detach(), adv, w, lens, **CLIP, ref_logp=ref, beta=0.1,
                           is_weight=isw)
    loss.backward()
    k3_grad = 1 - torch.exp(ref - logp.detach())  # d k3 / d logp
    assert torch.allclose(logp.grad, -adv * isw + 0.1 * k3_grad), logp.grad


def test_micro_batches_sizes_and_whole_groups():
    # group g has 3 rows; its total length grows with g, row lengths differ inside a group
    rows = [{'prompt': [0] * 5, 'ids': [0] * (10 * g + k), 'group': g}
            for g in (2, 0, 1) for k in range(3)]
    plain = micro_batches(rows, 4, whole_groups=False)
    assert [len(mb) for mb in plain] == [4, 4, 1], "at most `size` rows per micro-batch"
    flat = [len(r['ids']) for mb in plain for r in mb]
    assert flat == sorted(flat), "rows of similar length share a micro-batch"
    grouped = micro_batches(rows, 4, whole_groups=True)
    assert [[r['group'] for r in mb] for mb in grouped] == [[0] * 3, [1] * 3, [2] * 3], \
        "a group's rows stay together; one group of 3 fills a micro-batch of 4"
    assert [len(r['ids']) for r in grouped[0]] == [0, 1, 2], "a group's rows keep their order"
    assert [len(mb) for mb in micro_batches(rows, 2, whole_groups=True)] == [3, 3, 3], \
        "a group larger than `size` still gets a micro-batch of its own"
    assert [len(mb) for mb in micro_batches(rows, 6, whole_groups=True)] == [6, 3]


def test_micro_batches_by_tokens():
    """max_tokens: a micro-batch takes rows while (rows + 1) x the longest fits; a row longer than
    the budget gets a pass of its own; size still caps the rows. Packed groups count as one sequence
    each, of their prompt and every completion."""
    lens = [3, 5, 5, 6, 10, 10, 30, 8]  # + a 2-token prompt each
    rows = [{'prompt': [0] * 2, 'ids': [0] * n, 'group': i // 2} for i, n in enumerate(lens)]
    cut = micro_batches(rows, 16, whole_groups=False, max_tokens=24)
    # sorted 5 7 7 8 10 12 12 32: 3 x 7 = 21; 4 x 8 = 32 > 24: cut; 8, 10 (2 x 10 = 20); 12, 12;
    # 32 alone
    assert [[len(r['prompt']) + len(r['ids']) for r in mb] for mb in cut] == \
        [[5, 7, 7], [8, 10], [12, 12], [32]], cut
    assert [len(mb) for mb in micro_batches(rows, 2, whole_groups=False, max_tokens=24)] == \
        [2, 2, 2, 1, 1], "size still caps the rows"
    assert micro_batches(rows, 16, whole_groups=False, max_tokens=0) == [sorted(
        rows, key=lambda r: len(r['ids']))], "0: rows alone"
    # packed groups of 2: lengths 2 + 3 + 5 = 10, 2 + 11 = 13, 22, 40; 2 x 13 = 26 <= 30
    grouped = micro_batches(rows, 16, whole_groups=True, max_tokens=30)
    assert [[r['group'] for r in mb] for mb in grouped] == [[0, 0, 1, 1], [2, 2], [3, 3]], grouped


def test_token_mean_weights_every_token_equally():
    """DAPO: a token in a long completion counts as much as one in a short completion."""
    lens = torch.tensor([1, 9])
    w = token_weights(lens, 'token_mean', 10, 2, 16)
    assert torch.allclose(w, torch.full((10,), 0.1))
    w = token_weights(lens, 'seq_mean_token_mean', 10, 2, 16)
    assert abs(w[0].item() - 0.5) < 1e-7, "GRPO: sequences count equally instead"
    assert abs(w[1].item() - 0.5 / 9) < 1e-7, "GRPO: sequences count equally instead"


@pytest.mark.parametrize('arch', ['qwen2', 'olmo2', 'gemma3_text', 'gpt2'])
def test_packed_groups_give_the_same_logprobs_and_gradient_as_separate_rows(arch):
    """pack_groups() (each prompt once, its completions after it) must be exactly pack() (prompt +
    completion per row) for the model: the same log-prob for every completion token, in the same
    order, and the same gradient."""
    from batch import pack, pack_groups
    from model import GPT, ModelConfig
    from test_flex import GEMMA
    cfg = ModelConfig(arch=arch, vocab_size=50, n_layer=2, n_head=4,
                      n_kv_head=2 if arch == 'qwen2' else 4, n_embd=32, intermediate_size=64,
                      max_seq_len=64, tie_word_embeddings=arch == 'gpt2', **(GEMMA if arch == 'gemma3_text' else {}))
    torch.manual_seed(0)
    model = GPT(cfg).double()
    # every weight and bias nonzero, so a misplaced position or mask shows
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    g = torch.Generator().manual_seed(1)
    rows = []
    for group, plen in enumerate([5, 9, 1, 7]):  # a one-token prompt too
        prompt = torch.randint(0, 50, (plen,), generator=g).tolist()
        for _ in range(3):
            n = int(torch.randint(1, 7, (1,), generator=g))  # completions of 1 to 6 tokens
            ids = torch.randint(0, 50, (n,), generator=g).tolist()
            rows.append({'prompt': prompt, 'ids': ids, 'group': group})

    def logprobs(x, targets, **kw):
        h = model(x, **kw)
        return torch.log_softmax(h, -1).gather(-1, targets[:, None])[:, 0]

    x, sel = pack(rows, pad_id=0)
    ref = logprobs(x[:, :-1], x[:, 1:][sel], select=sel)
    x, pos, mask, pred, targets = pack_groups(rows, pad_id=0)
    assert targets.tolist() == [t for r in rows for t in r['ids']], \
        'targets must be the completions, row-major'
    separate = sum(len(r['prompt']) + len(r['ids']) for r in rows[:3])
    assert x.shape[1] < separate, 'a group packs shorter than its rows'
    got = logprobs(x, targets, pos=pos, attn_mask=mask, select=pred)
    assert torch.allclose(got, ref, atol=1e-10, rtol=0), f'max diff {(got - ref).abs().max():.2e}'
    w = torch.rand(len(ref), generator=g, dtype=torch.float64)
    grad_ref = torch.autograd.grad((ref * w).sum(), list(model.parameters()))
    grad_got = torch.autograd.grad((got * w).sum(), list(model.parameters()))
    for (name, _), a, b in zip(model.named_parameters(), grad_ref, grad_got):
        # the norms compute in fp32 even here, so summation order shows at ~1e-8;
        # a mask or position error is ~1e-2
        assert torch.allclose(a, b, atol=1e-6, rtol=0), \
            f"{name}: gradients differ by {(a - b).abs().max():.2e}"


def kl_gradients_off_policy(estimator):
    """The exact expected gradient of the penalty over tokens drawn from an old policy pi_old that
    is not pi (sampling weight pi_old(a)), and grad KL(pi || ref), on a categorical over 6
    tokens."""
    torch.manual_seed(2)
    theta = torch.randn(6, dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.randn(6, dtype=torch.float64), 0)
    logp = torch.log_softmax(theta, 0)
    # pi_old a little off pi: ratios within the clip range, so the clip does not interfere
    old = torch.log_softmax(theta.detach() + 0.1 * torch.randn(6, dtype=torch.float64), 0)
    ones = torch.ones(6, dtype=torch.long)
    adv = torch.zeros(6, dtype=torch.float64)
    loss, _ = policy_loss(logp, old, adv, old.exp(), ones, eps_low=0.5, eps_high=0.5,
                          ref_logp=ref, beta=1.0, kl_estimator=estimator, kl_clamp=100.0)
    got, = torch.autograd.grad(loss, theta)
    p = torch.softmax(theta, 0)
    want, = torch.autograd.grad((p * (torch.log_softmax(theta, 0) - ref)).sum(), theta)
    return got, want


@pytest.mark.parametrize('estimator', ['k1', 'k3_is'])
def test_kl_gradient_stays_exact_off_policy(estimator):
    """num_iterations > 1: tokens come from pi_old. k3 times the differentiable ratio pi / pi_old
    (TRL's use_bias_correction_kl) and k1 through the advantage (times the ratio) keep the exact
    gradient of KL(pi || ref)."""
    got, want = kl_gradients_off_policy(estimator)
    assert torch.allclose(got, want, atol=1e-10), f"{estimator}: {got} vs grad KL {want}"


@pytest.mark.parametrize('estimator', ['k2', 'k3+'])
def test_k2_gradient_is_not_exact_off_policy(estimator):
    """k2 and k3+ (k2's gradient) have no ratio: off-policy they follow pi_old's weights, not pi's.
    The check above would catch an estimator that lost its ratio."""
    got, want = kl_gradients_off_policy(estimator)
    assert not torch.allclose(got, want, atol=1e-4), f"{estimator}: unexpectedly exact"


def test_k3_is_and_k3_plus_values():
    """k3_is: k3 times the ratio; k3+: k3's value with k2's gradient (1/2 (log r)^2 -> -log r)."""
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref, old = torch.tensor([-1.5, -1.0]), torch.tensor([-1.2, -2.0])
    lr = torch.tensor([-0.5, 1.0])  # ref - logp
    k3 = torch.exp(lr) - lr - 1
    got = kl_estimate(logp, ref, 'k3_is', log_ratio=logp - old)
    assert torch.allclose(got, k3 * torch.exp(torch.tensor([0.2, 0.0]))), got
    plus = kl_estimate(logp, ref, 'k3+')
    assert torch.allclose(plus, k3), plus
    plus.sum().backward()
    assert torch.allclose(logp.grad, -lr), f"k3+ passes k2's gradient, logp - ref: {logp.grad}"
    with pytest.raises(ValueError, match='kl_estimator'):
        kl_estimate(logp, ref, 'k4')


def test_dual_clip_caps_the_loss_of_negative_advantages():
    """clip_ratio_c = 3 (verl's default): A = -1, ratio 4: the PPO loss max(4, 1.28) = 4 is capped
    at -A c = 3 and passes no gradient; ratio 2 < 3 keeps max(2, 1.28) = 2 and its gradient; A > 0
    and ratios below the clip are as without it."""
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([4.0, 2.0, 4.0, 0.5])).requires_grad_(True)
    adv = torch.tensor([-1.0, -1.0, 1.0, -2.0])
    lens = torch.ones(4, dtype=torch.long)
    loss, st = policy_loss(logp, old, adv, torch.ones(4), lens, **CLIP, clip_ratio_c=3.0)
    # A=-2, r=0.5: max(1, 1.6) = 1.6 < 6
    assert torch.allclose(st['pg'], torch.tensor([3.0, 2.0, -1.28, 1.6])), st['pg']
    assert st['clip_dual'].tolist() == [True, False, False, False], st['clip_dual']
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([0.0, 2.0, 0.0, 0.0])), logp.grad
    plain, st = policy_loss(logp.detach(), old, adv, torch.ones(4), lens, **CLIP)
    assert abs(plain.item() - (4.0 + 2.0 - 1.28 + 1.6)) < 1e-6 and 'clip_dual' not in st


def test_dual_clip_is_trl_delta_when_delta_exceeds_one_plus_eps_high():
    """TRL's two-sided clip (delta, INTELLECT-2): -min(min(r, delta) A, clip(r) A), the same loss
    as the dual clip for delta > 1 + eps_high, on ratios and advantages of either sign."""
    g = torch.Generator().manual_seed(0)
    ratio = torch.exp(torch.randn(200, generator=g) * 1.5)
    adv = torch.randn(200, generator=g)
    delta = 2.5
    clipped = ratio.clamp(1 - CLIP['eps_low'], 1 + CLIP['eps_high'])
    trl = -torch.minimum(ratio.clamp(max=delta) * adv, clipped * adv)
    _, st = policy_loss(ratio.log(), torch.zeros(200), adv, torch.ones(200),
                        torch.ones(200, dtype=torch.long), **CLIP, clip_ratio_c=delta)
    assert torch.allclose(st['pg'], trl, atol=1e-6), (st['pg'] - trl).abs().max()


def test_cispo_both_bounds_clamps_the_weight_below_too():
    """cispo_bounds='both' (verl): the weight is clip(r, 0.8, 1.28), so r = 0.5 weighs 0.8 where
    MiniMax's upper bound alone leaves 0.5."""
    old = torch.zeros(3)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.0])).requires_grad_(True)
    adv, lens = torch.tensor([1.0, 1.0, -2.0]), torch.ones(3, dtype=torch.long)
    loss, st = policy_loss(logp, old, adv, torch.ones(3), lens, **CLIP, loss_type='cispo',
                           cispo_bounds='both')
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([-1.28, -0.8, 2.0])), logp.grad
    assert st['clip_low'].tolist() == [False, True, False]
    assert st['clip_high'].tolist() == [True, False, False]
    logp.grad = None
    policy_loss(logp, old, adv, torch.ones(3), lens, **CLIP, loss_type='cispo')[0].backward()
    assert torch.allclose(logp.grad, torch.tensor([-1.28, -0.5, 2.0])), logp.grad


def test_tis_lower_bound():
    """floor 0.6, cap 3; rho per token 4, 0.5, 1 (sequences of 2 and 1: products 2 and 1).
    truncate clamps into [0.6, 3], mask zeroes what is outside (TRL's clip_min, verl's 'lo_hi')."""
    train, gen = torch.log(torch.tensor([4.0, 0.5, 1.0])), torch.zeros(3)
    lens = torch.tensor([2, 1])
    cases = {('token_truncate', 0.6): ([3.0, 0.6, 1.0], [True, True, False]),
             ('token_mask', 0.6): ([0.0, 0.0, 1.0], [True, True, False]),
             ('sequence_truncate', 1.5): ([2.0, 2.0, 1.5], [False, False, True]),
             ('sequence_mask', 1.5): ([2.0, 2.0, 0.0], [False, False, True])}
    for (mode, floor), (want, outside) in cases.items():
        w, out = tis_weights(train, gen, lens, mode, 3.0, floor=floor)
        assert torch.allclose(w, torch.tensor(want)), (mode, w)
        assert out.tolist() == outside, (mode, out)


R = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [1.0, 0.0, 0.0, 0.0],
                  [0.0, 0.0, 0.0, 0.0], [0.5, 0.2, 0.9, 0.1]])


def test_rloo_is_r_minus_the_mean_of_the_others():
    adv, zero = advantages(R, 'rloo')
    want = [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [0.0] * 4, [1.0, -1 / 3, -1 / 3, -1 / 3], [0.0] * 4,
            [0.5 - 1.2 / 3, 0.2 - 1.5 / 3, 0.9 - 0.8 / 3, 0.1 - 1.6 / 3]]
    assert torch.allclose(adv, torch.tensor(want)), adv
    assert zero.tolist() == [False, True, False, True, False]


def test_maxrl_divides_by_the_group_mean():
    """(r - mean) / mean: group 3 (mean 1/4) gives 3 and -1; a group of mean <= 0 gives 0, even
    with a spread (prime-rl: no signal)."""
    adv, _ = advantages(R, 'maxrl')
    want = [[1.0, -1.0, -1.0, 1.0], [0.0] * 4, [3.0, -1.0, -1.0, -1.0], [0.0] * 4,
            [v / 0.425 - 1 for v in (0.5, 0.2, 0.9, 0.1)]]
    assert torch.allclose(adv, torch.tensor(want)), adv
    adv, zero = advantages(torch.tensor([[-1.0, 1.0, 0.0, 0.0], [-1.0, 0.0, 0.0, 0.0]]), 'maxrl')
    assert torch.equal(adv, torch.zeros(2, 4)) and zero.tolist() == [False, False], adv


def test_passk_rewards_only_the_best_by_its_margin():
    """Group 1 ties for the best (1, 1): margin 0. Group 3: 1 - 0 on the first; group 5: 0.9 - 0.5
    on the third, divided by the group's std with scale 'group'."""
    adv, _ = advantages(R, 'passk', scale='none')
    want = torch.zeros(5, 4)
    want[2, 0], want[4, 2] = 1.0, 0.4
    assert torch.allclose(adv, want), adv
    adv, _ = advantages(R, 'passk', scale='group', eps=1e-4)
    assert abs(adv[4, 2].item() - 0.4 / (R[4].std().item() + 1e-4)) < 1e-6, adv
    assert abs(adv[2, 0].item() - 1.0 / (R[2].std().item() + 1e-4)) < 1e-6, adv
    assert adv.count_nonzero() == 2


def test_reinforce_pp_whitens_over_tokens():
    """Rewards [1, 0] and [0, 0] with lengths [1, 3] and [2, 2]: centred 0.5, -0.5, 0, 0. Over the
    8 tokens: mean -1/8, unbiased variance (0.625^2 + 3 * 0.375^2 + 4 * 0.125^2) / 7 = 1/8, so the
    advantages are 0.625, -0.375 and 0.125 times sqrt(8); the equal group gets 0.125 sqrt(8),
    not 0."""
    r = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    lens = torch.tensor([[1, 3], [2, 2]])
    adv, zero = advantages(r, 'reinforce_pp', lens=lens)
    s8 = math.sqrt(8)
    want = torch.tensor([[0.625 * s8, -0.375 * s8], [0.125 * s8, 0.125 * s8]])
    assert torch.allclose(adv, want, atol=1e-6), adv
    assert zero.tolist() == [False, True]


def test_reinforce_whitens_the_rewards_over_tokens_with_no_baseline():
    """Rewards [1, 0] and [0, 0] with lengths [1, 3] and [2, 2]: over the 8 tokens mean 1/8,
    unbiased variance ((7/8)^2 + 7 (1/8)^2) / 7 = 1/8: advantages 7/8 and -1/8 times sqrt(8)."""
    r, lens = torch.tensor([[1.0, 0.0], [0.0, 0.0]]), torch.tensor([[1, 3], [2, 2]])
    adv, zero = advantages(r, 'reinforce', lens=lens)
    s8 = math.sqrt(8)
    assert torch.allclose(adv, torch.tensor([[7 / 8, -1 / 8], [-1 / 8, -1 / 8]]) * s8, atol=1e-6), adv
    assert zero.tolist() == [False, True]


def test_opo_subtracts_the_length_weighted_mean_reward():
    """Rewards [1, 0, 0, 1] with lengths [1, 3, 2, 2]: baseline (1 + 2) / 8 = 3/8, so 5/8, -3/8,
    -3/8, 5/8 (the plain mean, 1/2, would give +-1/2); an equal group gets 0."""
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    lens = torch.tensor([[1, 3, 2, 2], [5, 1, 7, 3]])
    adv, zero = advantages(r, 'opo', lens=lens)
    assert torch.allclose(adv, torch.tensor([[5 / 8, -3 / 8, -3 / 8, 5 / 8], [0.0] * 4])), adv
    assert zero.tolist() == [False, True]


def test_grpo_advantage_is_group_advantages():
    for scale in ('group', 'batch', 'none'):
        a, za = advantages(R, 'grpo', scale=scale)
        b, zb = group_advantages(R, scale=scale)
        assert torch.equal(a, b) and torch.equal(za, zb), scale
    with pytest.raises(ValueError, match='advantage'):
        advantages(R, 'ppo')


def test_zero_spread_is_every_estimators_zero_std():
    """The groups of all-equal rewards, flagged before any advantage is computed (dynamic sampling
    counts the groups with a spread this way): the flags each estimator returns."""
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.5 + 1e-3]])
    assert zero_spread(r).tolist() == [True, False, False]
    for estimator in ('grpo', 'rloo', 'reinforce_pp', 'reinforce', 'maxrl', 'passk', 'opo', 'none'):
        _, zero = advantages(r, estimator, lens=torch.ones_like(r))
        assert torch.equal(zero, zero_spread(r)), estimator
    assert torch.equal(advantages(r, 'none')[0], torch.zeros_like(r))  # a teacher alone trains


def test_objective_knobs_that_do_not_fit_together_are_refused():
    from safety import bad_objective_knob
    ok = {'clip_ratio_c': 0.0, 'loss_type': 'grpo', 'tis_min': 0.0, 'tis_cap': 3.0,
          'advantage': 'grpo', 'scale_rewards': 'group', 'top_entropy_quantile': 1.0,
          'adaptive_entropy': False, 'entropy_coef_min': 0.0, 'entropy_coef_max': 1.0,
          'ref_sync_every': 0, 'beta': 0.0, 'lora_rank': 0, 'ref_sync_reset_optimizer': False,
          'tis': '', 'clip_cov_bounds': (1.0, 5.0)}
    assert bad_objective_knob(ok) is None
    assert 'low < high' in bad_objective_knob({**ok, 'clip_cov_bounds': (5.0, 1.0)})
    assert 'KL-Cov' in bad_objective_knob({**ok, 'clip_ratio_c': 3.0, 'loss_type': 'kl_cov'})
    assert 'beta = 0' in bad_objective_knob({**ok, 'ref_sync_every': 10})
    assert 'moves none' in bad_objective_knob({**ok, 'ref_sync_reset_optimizer': True})
    assert bad_objective_knob({**ok, 'ref_sync_every': 10, 'beta': 0.01}) is None
    assert 'LoRA' in bad_objective_knob({**ok, 'ref_sync_every': 10, 'beta': 0.01, 'lora_rank': 8})
    assert bad_objective_knob({**ok, 'clip_ratio_c': 3.0}) is None
    assert '--clip_ratio_c=0.5' in bad_objective_knob({**ok, 'clip_ratio_c': 0.5})
    assert 'CISPO' in bad_objective_knob({**ok, 'clip_ratio_c': 3.0, 'loss_type': 'cispo'})
    assert 'SAPO' in bad_objective_knob({**ok, 'clip_ratio_c': 3.0, 'loss_type': 'sapo'})
    assert 'VESPO' in bad_objective_knob({**ok, 'clip_ratio_c': 3.0, 'loss_type': 'vespo'})
    assert "'token_truncate'" in bad_objective_knob({**ok, 'loss_type': 'vespo', 'tis': 'sequence_mask'})
    assert bad_objective_knob({**ok, 'loss_type': 'vespo', 'tis': 'token_mask'}) is None
    assert '--tis_min=3.0' in bad_objective_knob({**ok, 'tis_min': 3.0})
    assert bad_objective_knob({**ok, 'advantage': 'rloo'}) is None
    assert "'gdpo' has its own" in bad_objective_knob({**ok, 'advantage': 'gdpo',
                                                       'scale_rewards': 'batch'})
    assert "'rloo' has its own" in bad_objective_knob({**ok, 'advantage': 'rloo',
                                                       'scale_rewards': 'none'})
    assert bad_objective_knob({**ok, 'advantage': 'passk', 'scale_rewards': 'none'}) is None
    assert '--top_entropy_quantile=1.5' in bad_objective_knob({**ok, 'top_entropy_quantile': 1.5})
    assert '--teacher' in bad_objective_knob({**ok, 'advantage': 'none', 'teacher': ''})
    assert bad_objective_knob({**ok, 'advantage': 'none', 'teacher': 'Qwen/Qwen2.5-7B-Instruct'}) is None
    assert 'min <= max' in bad_objective_knob({**ok, 'adaptive_entropy': True,
                                               'entropy_coef_min': 0.5, 'entropy_coef_max': 0.1})


def test_entropy_cut_keeps_the_top_share():
    """Entropies 0.1 ... 0.9, top 40%: the 0.6 quantile, 0.5 + 0.4 * 0.2 = 0.58, keeps 0.7 and
    0.9; quantile 0 keeps the highest only (TRL's top_entropy_quantile)."""
    ent = torch.tensor([0.1, 0.5, 0.9, 0.3, 0.7])
    cut = entropy_cut(ent, 0.4)
    assert abs(cut - 0.58) < 1e-6 and (ent >= cut).tolist() == [False, False, True, False, True]
    assert (ent >= entropy_cut(ent, 0.0)).tolist() == [False, False, True, False, False]
    assert (ent >= entropy_cut(ent, 1.0)).all()
    many = torch.arange(2**24 + 1, dtype=torch.float32)  # past torch.quantile's limit: a big step's tokens
    assert entropy_cut(many, 0.25) == 0.75 * 2**24


def test_token_mask_drops_the_policy_gradient_and_entropy_terms_of_masked_tokens():
    """Masked tokens pass neither the policy-gradient nor the entropy gradient; the KL acts on
    every token (TRL masks per_token_loss before adding beta * KL)."""
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref, ent = torch.tensor([-1.5, -1.0]), torch.tensor([2.0, 3.0], requires_grad=True)
    adv, lens = torch.tensor([1.0, -1.0]), torch.ones(2, dtype=torch.long)
    loss, _ = policy_loss(logp, logp.detach(), adv, torch.ones(2), lens, **CLIP, ref_logp=ref,
                          beta=0.1, entropy=ent, entropy_coef=0.01,
                          token_mask=torch.tensor([1.0, 0.0]))
    loss.backward()
    k3_grad = 1 - torch.exp(ref - logp.detach())  # d k3 / d logp
    assert torch.allclose(logp.grad, torch.tensor([-1.0, 0.0]) + 0.1 * k3_grad), logp.grad
    assert torch.allclose(ent.grad, torch.tensor([-0.01, 0.0])), ent.grad


def test_adaptive_entropy_coefficient_steps_toward_the_target():
    """Skywork-OR1 / TRL: +delta at or below the target, -delta above, within [lo, hi]."""
    kw = dict(target=0.2, delta=0.005, lo=0.0, hi=0.012)
    assert abs(adapt_entropy_coef(0.001, 0.1, **kw) - 0.006) < 1e-12
    assert abs(adapt_entropy_coef(0.001, 0.2, **kw) - 0.006) < 1e-12, "at the target: up"
    assert adapt_entropy_coef(0.001, 0.3, **kw) == 0.0, "down, not below lo"
    assert adapt_entropy_coef(0.01, 0.1, **kw) == 0.012, "up, not above hi"
