"""
The GRPO objective, as small functions of flat per-token tensors so each piece can be checked by
hand.

Each micro-batch's loss (batch.py cuts and lays out the micro-batches) is sum(token_loss * w) with
the weights w of token_weights(), whose denominators count the whole step (every micro-batch, every
rank): the sum of the micro-batch losses is the step's loss, and its gradient does not depend on how
the step was cut.
"""
import math

import numpy as np
import torch


def zero_spread(rewards):
    """rewards (P, G) -> (P,) bool: the groups whose G rewards are all equal (no advantage)."""
    return rewards.std(dim=1) < 1e-6  # unbiased, as in the GRPO paper's implementations


def group_advantages(rewards, scale='group', eps=1e-4):
    """rewards (P, G) -> advantages (P, G), zero_std (P,) bool: r minus its group's mean, divided by
    scale='group' (GRPO): the group's std + eps, so a group with a small spread is up-weighted;
    scale='batch': the std of all the step's rewards + eps, one scale for every group (TRL's
    scale_rewards='batch'); scale='none' (Dr. GRPO): nothing, so an advantage keeps the reward's own
    units."""
    zero = zero_spread(rewards).unsqueeze(1)
    adv = scaled(rewards - rewards.mean(dim=1, keepdim=True), rewards, scale, eps)
    # all-equal groups: exactly 0, even with eps = 0
    return torch.where(zero, 0.0, adv), zero.squeeze(1)


def scaled(x, rewards, scale, eps):
    """x (P, G) divided as scale_rewards says: by its group's reward std + eps ('group'), the
    step's ('batch'), or not at all ('none')."""
    if scale == 'group':
        return x / (rewards.std(dim=1, keepdim=True) + eps)
    if scale == 'batch':
        return x / (rewards.std() + eps)
    if scale != 'none':
        raise ValueError(f"scale_rewards={scale!r}: expected 'group', 'batch' or 'none'")
    return x


ADVANTAGES = ('grpo', 'rloo', 'reinforce_pp', 'reinforce', 'maxrl', 'passk', 'gdpo', 'opo', 'none')


def advantages(rewards, estimator='grpo', scale='group', eps=1e-4, *, lens=None, per_fn=None,
               weights=None):
    """rewards (P, G) -> advantages (P, G), zero_std (P,) bool, by one of ADVANTAGES:
    'grpo': group_advantages (r - group mean, scaled as `scale` says);
    'rloo': r minus the mean of the group's other G - 1 rewards, = G / (G - 1) * (r - group mean),
        not scaled (RLOO; verl 'rloo', OpenRLHF 'rloo', TRL's RLOOTrainer);
    'reinforce_pp': r - group mean, then whitened over the step's completion tokens: each
        completion's value counts once per token (lens (P, G): its length), unbiased variance,
        (x - mean) / sqrt(var + 1e-8) (REINFORCE++-baseline; verl 'reinforce_plus_plus_baseline').
        A group of equal rewards gets -mean / std, not 0;
    'reinforce': the rewards whitened over the step's completion tokens as 'reinforce_pp', with no
        group baseline first (REINFORCE++; verl 'reinforce_plus_plus', OpenRLHF 'reinforce');
    'maxrl': (r - group mean) / group mean, 0 where the mean is <= 0 (MaxRL; prime-rl max_rl);
    'passk': only the group's best completion gets an advantage, r_max - r_second_max, scaled as
        `scale` says (pass@k training; verl 'grpo_passk');
    'gdpo': from each reward function's own values, per_fn (P, G, K), and their weights (K,):
        gdpo_advantages;
    'opo': r minus the group's length-weighted mean reward, sum(lens * r) / sum(lens), not scaled
        (OPO's optimal baseline for a sequence-level reward; verl 'opo');
    'none': 0 for every completion: the rewards are scored and logged but train nothing (on-policy
        distillation from a teacher alone, policy_loss's teacher_logp).
    zero_std marks the groups whose G rewards are all equal, whatever the estimator ('gdpo': those
    where every function's are)."""
    if estimator == 'grpo':
        return group_advantages(rewards, scale, eps)
    if estimator == 'gdpo':
        return gdpo_advantages(per_fn, weights, eps)
    zero = zero_spread(rewards).unsqueeze(1)
    mean = rewards.mean(dim=1, keepdim=True)
    G = rewards.shape[1]
    if estimator == 'rloo':
        adv = (rewards - mean) * (G / (G - 1))
    elif estimator == 'reinforce_pp':
        adv = whiten(rewards - mean, lens)
    elif estimator == 'reinforce':
        adv = whiten(rewards, lens)
    elif estimator == 'maxrl':
        adv = torch.where(mean > 0, (rewards - mean) / mean.clamp(min=1e-30), 0.0)
    elif estimator == 'passk':
        adv = passk_advantages(rewards, scale, eps)
    elif estimator == 'opo':
        adv = rewards - (lens * rewards).sum(1, keepdim=True) / lens.sum(1, keepdim=True).clamp(min=1)
    elif estimator == 'none':
        adv = torch.zeros_like(rewards)
    else:
        raise ValueError(f"advantage={estimator!r}: expected one of {ADVANTAGES}")
    if estimator not in ('reinforce_pp', 'reinforce'):  # all-equal groups: exactly 0
        adv = torch.where(zero, 0.0, adv)
    return adv, zero.squeeze(1)


def gdpo_advantages(per_fn, weights, eps=1e-4):
    """GDPO (arXiv 2601.05242): each reward function's values normalised within their group,
    (r_k - group mean) / (group std + eps), then summed with the functions' weights, then the sums
    normalised over the step's completions, (x - mean) / (std + eps). A weak reward (format) is
    not drowned by a strong one (correctness) as in the sum GRPO normalises, and two completions
    that score the same total by different means keep different advantages. per_fn (P, G, K): the
    unweighted values, nan where a function did not apply (left out of its group's statistics, 0
    in the sum; a completion no function applied to: advantage 0, out of the step's statistics).
    Returns advantages (P, G) and zero_std (P,): the groups where no function's values spread."""
    have = ~torch.isnan(per_fn)
    n = have.sum(1, keepdim=True)
    mean = torch.where(have, per_fn, 0.0).sum(1, keepdim=True) / n.clamp(min=1)
    dev = torch.where(have, per_fn - mean, 0.0)
    std = (dev.pow(2).sum(1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()  # unbiased
    spread = std >= 1e-6  # as zero_spread
    summed = (torch.where(spread, dev / (std + eps), 0.0) * weights).sum(-1)
    scored = have.any(-1)
    x = summed[scored]
    adv = (summed - x.mean()) / (x.std() + eps) if x.numel() > 1 else torch.zeros_like(summed)
    zero = ~spread.any(-1).squeeze(1)
    return torch.where(zero.unsqueeze(1) | ~scored, 0.0, adv), zero


def whiten(x, lens):
    """x (P, G) whitened over tokens: each entry weighted by its completion's length lens (P, G),
    unbiased variance over the token count (verl's masked_whiten)."""
    n = lens.sum()
    mean = (x * lens).sum() / n
    var = ((x - mean) ** 2 * lens).sum() / n * (n / (n - 1))
    return (x - mean) * torch.rsqrt(var + 1e-8)


def passk_advantages(rewards, scale, eps):
    """Each group's best completion gets r_max - r_second_max (divided by the group's std + eps,
    or the step's, as `scale` says), the others 0. Ties for the best give 0, whichever is picked."""
    top, idx = torch.topk(rewards, 2, dim=1)
    gap = scaled(top[:, :1] - top[:, 1:], rewards, scale, eps)
    return torch.zeros_like(rewards).scatter(1, idx[:, :1], gap)


LOSS_AGGS = ('token_mean', 'seq_mean_token_mean', 'seq_sum_const', 'token_sum', 'seq_mean_token_sum')


def token_weights(lens, loss_agg, n_tok, n_seq, max_new_tokens, *, sampled=None):
    """Per-token weight for the micro-batch whose sequences have these completion lengths (a
    LongTensor), one of LOSS_AGGS. token_mean (DAPO): every token of the step counts the same,
    1 / n_tok. seq_mean_token_mean (GRPO): mean over each sequence's tokens, then over the step's
    sequences. seq_sum_const (Dr. GRPO): sum over tokens / (n_seq * max_new_tokens), a constant:
    no length bias. token_sum: the sum over the step's tokens, no normaliser (weight 1).
    seq_mean_token_sum: sum over each sequence's tokens, mean over the step's sequences, 1 / n_seq
    (LUSPO's aggregation). sampled (flat 0/1 float, rollouts with tools): only these tokens are the
    policy's actions; the inserted tool responses weigh 0 and do not count in a sequence's length
    (n_tok counts sampled tokens too)."""
    if sampled is not None:
        per_seq = segment_sum(sampled, lens)  # sampled tokens per sequence
        if loss_agg == 'seq_mean_token_mean':
            w = 1.0 / (per_seq.clamp(min=1.0) * n_seq)
            return torch.repeat_interleave(w, lens) * sampled
        return token_weights(lens, loss_agg, n_tok, n_seq, max_new_tokens) * sampled
    n = int(lens.sum())
    if loss_agg == 'token_mean':
        return torch.full((n,), 1.0 / n_tok, device=lens.device)
    if loss_agg == 'seq_mean_token_mean':
        return torch.repeat_interleave(1.0 / (lens.float() * n_seq), lens)
    if loss_agg == 'seq_sum_const':
        return torch.full((n,), 1.0 / (n_seq * max_new_tokens), device=lens.device)
    if loss_agg == 'token_sum':
        return torch.ones(n, device=lens.device)
    if loss_agg == 'seq_mean_token_sum':
        return torch.full((n,), 1.0 / n_seq, device=lens.device)
    raise ValueError(f"loss_agg={loss_agg!r}: expected one of {LOSS_AGGS}")


def segment_sum(x, lens):
    """Per-sequence sums of a flat per-token tensor whose sequences have these lengths."""
    seg = torch.repeat_interleave(torch.arange(len(lens), device=x.device), lens)
    return torch.zeros(len(lens), dtype=x.dtype, device=x.device).index_add(0, seg, x)


def reverse_cumsum(x, lens):
    """Within each sequence, x[t] + x[t+1] + ... to its end (the return-to-go of per-token
    rewards)."""
    # each token's sequence end (exclusive)
    ends = torch.repeat_interleave(torch.cumsum(lens, 0), lens)
    c = torch.cumsum(x, 0)
    return c[ends - 1] - c + x


KL_ESTIMATORS = ('k1', 'k2', 'k3', 'k3_is', 'k3+')


def kl_estimate(logp, ref_logp, estimator='k3', clamp=10.0, *, log_ratio=None):
    """Per-token estimates of KL(policy || reference) from tokens sampled from the policy,
    log r = log ref - log pi (Schulman, "Approximating KL divergence"). Their values all estimate
    KL(pi || ref); their gradients in a loss do not all follow it:
    k1 = -log r: unbiased value; as a loss its expected gradient is E[grad log pi] = 0 (no pull to
         the reference), so policy_loss uses it only as a detached per-token penalty folded into
         the advantage (OpenRLHF's KL-in-reward);
    k2 = (log r)^2 / 2: biased value (>= 0); its expected gradient is exactly grad KL(pi || ref);
    k3 = r - log r - 1: unbiased value (>= 0); its expected gradient is grad KL(ref || pi), the
         reverse direction (what GRPO's paper uses);
    k3_is = k3 * pi / pi_old, the ratio differentiable (log_ratio = log pi - log pi_old): its
         expected gradient over tokens drawn from pi_old is exactly grad KL(pi || ref), on-policy
         or not (TRL's use_bias_correction_kl, its default; DeepSeek-V3.2);
    k3+ = k3's value with k2's gradient, straight through (verl's 'k3+'): grad KL(pi || ref)
         on-policy."""
    log_r = (ref_logp - logp).clamp(-clamp, clamp)
    if estimator == 'k1':
        return -log_r
    if estimator == 'k2':
        return 0.5 * log_r ** 2
    if estimator == 'k3':
        return torch.exp(log_r) - log_r - 1
    if estimator == 'k3_is':
        return (torch.exp(log_r) - log_r - 1) * torch.exp(log_ratio)
    if estimator == 'k3+':
        k2 = 0.5 * log_r ** 2
        k3 = torch.exp(log_r) - log_r - 1
        return k2 - k2.detach() + k3.detach()
    raise ValueError(f"kl_estimator={estimator!r}: expected one of {KL_ESTIMATORS}")


def entropy_cut(entropies, quantile):
    """The entropy at or above which a token is among the top `quantile` share of entropies
    (top_entropy_quantile, "Beyond the 80/20 rule", arXiv 2506.01939; TRL's get_high_entropy_mask):
    the (1 - quantile) quantile, linear interpolation as torch.quantile's. 0 keeps the highest only.
    numpy's, since torch.quantile refuses more than 2**24 values (a step's tokens on all ranks can be)."""
    return float(np.quantile(entropies.detach().float().cpu().numpy(), 1 - quantile))


def adapt_entropy_coef(coef, entropy, *, target, delta, lo, hi):
    """Adaptive entropy control (Skywork-OR1, arXiv 2505.22312; TRL's use_adaptive_entropy): the
    coefficient rises by delta when the entropy is at or below target, else falls by delta, within
    [lo, hi]. The bonus is applied (at the new coefficient) only while the last entropy measured is
    at or below target."""
    if entropy <= target:
        return min(coef + delta, hi)
    return max(coef - delta, lo)


LOSS_TYPES = ('grpo', 'gspo', 'cispo', 'sapo', 'vespo', 'clip_cov', 'kl_cov', 'gmpo')
TIS_MODES = ('token_truncate', 'token_mask', 'sequence_truncate', 'sequence_mask')


def tis_weights(train_logp, gen_logp, lens, mode, cap, *, floor=0.0):
    """Truncated importance sampling against the sampler: rho = pi_train_old / pi_sampler per token
    (the two compute the same policy in different numerics: bf16 residual stream and head in the
    sampler, fp32 master weights in the trainer), or per sequence (the product over its tokens).
    'truncate': min(rho, cap); 'mask': rho, or 0 where rho > cap (TRL's
    vllm_importance_sampling_mode). floor > 0, a lower bound too (TRL's
    vllm_importance_sampling_clip_min; verl's rollout_is_threshold='lo_hi' for 'mask'):
    'truncate' clamps rho to [floor, cap], 'mask' zeroes it outside [floor, cap]. Returns detached
    per-token weights and where rho was outside the bounds (clamped or masked)."""
    log_rho = (train_logp - gen_logp).detach()
    if mode.startswith('sequence'):
        log_rho = torch.repeat_interleave(segment_sum(log_rho, lens), lens)
    rho = torch.exp(log_rho)
    outside = rho > cap
    if floor > 0:
        outside = outside | (rho < floor)
    if mode.endswith('truncate') and floor > 0:
        return rho.clamp(min=floor, max=cap), outside
    if mode.endswith('truncate'):
        return rho.clamp(max=cap), outside
    if mode.endswith('mask'):
        return torch.where(outside, 0.0, rho), outside
    raise ValueError(f"tis={mode!r}: expected one of {TIS_MODES}")


def off_policy_keep(logp, gen_logp, seq_adv, lens, threshold, *, sampled=None):
    """DeepSeek-V3.2's off-policy sequence masking: a sequence with a negative advantage whose mean
    log(pi_sampler / pi) over its sampled tokens (a KL(sampler || pi) estimate, pi the policy now)
    exceeds threshold passes no policy gradient: a bad sample the policy has already moved away
    from (mini-batches, num_iterations) or that the sampler's numerics drew, pushed down further,
    destabilises more than it teaches. sampled (0/1, tool rollouts): the tokens the sampler drew.
    Returns per-token weights, 0 on such sequences and 1 elsewhere (detached)."""
    d = (gen_logp - logp).detach()
    n = lens if sampled is None else segment_sum(sampled, lens)
    if sampled is not None:
        d = d * sampled
    kl = segment_sum(d, lens) / n.clamp(min=1)
    drop = (seq_adv < 0) & (kl > threshold)
    return torch.repeat_interleave((~drop).to(logp.dtype), lens)


def sequence_log_ratio(log_ratio, lens, sampled=None, mean=True):
    """Each sequence's log importance ratio over the tokens the sampler drew (sampled, 0/1: a tool
    rollout's inserted tokens are no sample of the policy; None: every token): the mean of its
    tokens' (GSPO's length-normalised ratio), or their sum (the ratio of the sequences' whole
    probabilities)."""
    if sampled is not None:
        log_ratio = log_ratio * sampled
    total = segment_sum(log_ratio, lens)
    if not mean:
        return total
    return total / (lens if sampled is None else segment_sum(sampled, lens).clamp(min=1))


def vespo_weights(log_ratio, adv, lens, shape, *, is_weight=None, sampled=None):
    """VESPO's detached per-sequence weight phi(w) = e^(lam + k log w - lam w) (so phi(1) = 1),
    w = pi / pi_old of the whole sequence (the product over its sampled tokens, times is_weight's
    per-token pi_old / pi_sampler, in log space, bounded as TRL bounds it), k and lam by the sign
    of the advantage: shape = (k_pos, lam_pos, k_neg, lam_neg). It rises as w^k from 0 and falls
    as e^(-lam w) past k / lam: a soft, asymmetric trust region on sequences far off-policy.
    Per token, its sequence's."""
    lo = math.log(1e-8)
    log_w = log_ratio.detach().clamp(-20.0, 20.0)
    if is_weight is not None:
        log_w = log_w + torch.log(is_weight).clamp(lo, 20.0)
    log_w = sequence_log_ratio(log_w, lens, sampled, mean=False).clamp(lo, 20.0)
    log_w = torch.repeat_interleave(log_w, lens)
    k = torch.where(adv >= 0, shape[0], shape[2])
    lam = torch.where(adv >= 0, shape[1], shape[3]).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(0.0, 0.0, 0.0)


def policy_loss(logp, old_logp, adv, w, lens, *, eps_low, eps_high, loss_type='grpo', ref_logp=None,
                beta=0.0, kl_estimator='k3', kl_clamp=10.0, entropy=None, entropy_coef=0.0,
                is_weight=None, clip_ratio_c=0.0, cispo_bounds='high', token_mask=None,
                sapo_tau=(1.0, 1.05), vespo_shape=(2.0, 3.0, 3.0, 2.0), pg_mask=None,
                sampled=None, cov_mask=None, kl_cov_coef=1.0, teacher_logp=None, teacher_coef=1.0):
    """Policy-gradient surrogate + beta * KL - entropy_coef * entropy, aggregated with weights w.
    Inputs are flat per-token tensors of sequences with lengths lens; adv is each sequence's
    advantage repeated over its tokens. loss_type, with ratio = pi / pi_old:
      'grpo':  per-token ratio, PPO clip with clip-higher:
               max(-A ratio, -A clip(ratio, 1 - eps_low, 1 + eps_high));
      'gspo':  one ratio per sequence, the geometric mean of its token ratios (length-normalised),
               clipped as above per sequence (GSPO, arXiv 2507.18071; its eps are ~1e-4, not 0.2);
      'cispo': -min(ratio, 1 + eps_high) (detached) * A * log pi: the importance weight is clipped,
               not the gradient, so every token keeps its gradient (CISPO, MiniMax-M1);
               cispo_bounds='both': the weight is clip(ratio, 1 - eps_low, 1 + eps_high) (verl);
      'sapo':  -A (4 / tau) sigmoid(tau (ratio - 1)), tau = sapo_tau[0] where A > 0, else
               sapo_tau[1]: a soft gate instead of the clip, whose gradient, A 4 s (1 - s) ratio
               grad log pi (s the sigmoid), fades smoothly as the ratio leaves 1 (SAPO, arXiv
               2511.20347). Nothing is clipped: clip_low/clip_high stay False.
      'vespo': -phi(w) * A * log pi, phi a detached weight per sequence (vespo_weights, shape
               vespo_shape) of the sequence's whole importance weight w: no clip, a smooth
               trust region (VESPO, arXiv 2602.10693; TRL's loss_type='vespo'). is_weight enters
               w instead of multiplying the loss, as in TRL;
      'clip_cov': 'grpo' with the tokens cov_mask selects (cov_selection) passing no
               policy gradient (Clip-Cov, arXiv 2505.22617);
      'gmpo':  -A times the sequence's geometric-mean ratio, exp of the mean over its tokens of
               each token's log ratio clipped to [-eps_low, eps_high] on the side A pushes it (the
               bounds are in log space here; GMPO, arXiv 2507.20673; verl's loss_mode 'geo_mean');
      'kl_cov': -A ratio, unclipped, plus kl_cov_coef |log ratio| on the tokens cov_mask selects
               (KL-Cov, same paper; verl's loss_mode 'kl_cov'): the penalty acts once the policy
               moves within the step (num_iterations or mini_batches > 1).
    clip_ratio_c > 1 (dual-clip, 'grpo'/'gspo'): where A < 0 the per-token loss is also capped at
    -A * clip_ratio_c, so a token whose ratio ran past clip_ratio_c passes no gradient (dual_clip).
    token_mask (top_entropy_quantile): 1 for the tokens the policy-gradient and entropy terms act
    on, 0 for the rest (the KL term acts on every token, as in TRL).
    On-policy (ratio 1) all five give the same gradient, -A grad log pi. kl_estimator 'k1' enters
    as a detached penalty in the advantage, A - beta * (k1 summed from this token to the sequence's
    end); 'k2'/'k3' as loss terms. is_weight (tis_weights): multiplies the policy-gradient term per
    token, as TRL does, not the KL/entropy terms; so does pg_mask (0/1, off_policy_keep).
    sampled (0/1, tool rollouts): the tokens the sampler drew, over which 'gspo' and 'vespo' take
    a sequence's ratio.
    teacher_logp (on-policy distillation): a teacher's log-probs of the same tokens; each token's
    advantage gains teacher_coef (log pi_teacher - log pi_old), minus that token's reverse KL
    estimate to the teacher, detached, per token with no sum to the sequence's end (discount 0, as
    Thinking Machines' on-policy distillation and prime-rl's 'opd' take it).
    Returns (loss, stats): per-token tensors for metrics (pg, kl, ratio, clip_low, clip_high; phi,
    VESPO's weight; teacher_kl, log pi_old - log pi_teacher)."""
    if teacher_logp is not None:
        teacher_kl = (old_logp - teacher_logp).detach()
        adv = adv - teacher_coef * teacher_kl
    log_ratio = logp - old_logp
    if ref_logp is None:
        kl = torch.zeros_like(logp)
    else:
        kl = kl_estimate(logp, ref_logp, kl_estimator, kl_clamp, log_ratio=log_ratio)
    if ref_logp is not None and kl_estimator == 'k1':  # over the sampled tokens: not a KL elsewhere
        pen = kl.detach() if sampled is None else kl.detach() * sampled
        adv = adv - beta * reverse_cumsum(pen, lens)
    if loss_type == 'gspo':  # the sequence's mean log ratio, on every one of its tokens
        log_ratio = torch.repeat_interleave(sequence_log_ratio(log_ratio, lens, sampled), lens)
    ratio = torch.exp(log_ratio)
    if loss_type in ('grpo', 'gspo', 'clip_cov'):
        pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps_low, 1 + eps_high))
        clip_low = (ratio < 1 - eps_low) & (adv < 0)
        clip_high = (ratio > 1 + eps_high) & (adv > 0)
        if clip_ratio_c > 0:
            pg, clip_dual = dual_clip(pg, adv, clip_ratio_c)
        if loss_type == 'clip_cov':
            pg = pg * (1 - cov_mask)
    elif loss_type == 'kl_cov':
        pg = -adv * ratio + kl_cov_coef * log_ratio.abs() * cov_mask
        clip_low = clip_high = torch.zeros_like(ratio, dtype=torch.bool)
    elif loss_type == 'gmpo':
        sign = torch.sign(adv)  # the clip keeps each token from moving further the way A pushes it
        clipped = sign * torch.minimum(sign * log_ratio, sign * log_ratio.clamp(-eps_low, eps_high))
        ratio = torch.exp(torch.repeat_interleave(sequence_log_ratio(clipped, lens, sampled), lens))
        pg = -adv * ratio
        clip_low = (log_ratio < -eps_low) & (adv < 0)
        clip_high = (log_ratio > eps_high) & (adv > 0)
    elif loss_type == 'cispo' and cispo_bounds == 'both':
        pg = -ratio.clamp(1 - eps_low, 1 + eps_high).detach() * adv * logp
        clip_low = ratio < 1 - eps_low
        clip_high = ratio > 1 + eps_high
    elif loss_type == 'cispo':
        pg = -ratio.clamp(max=1 + eps_high).detach() * adv * logp
        clip_low = torch.zeros_like(ratio, dtype=torch.bool)
        clip_high = ratio > 1 + eps_high
    elif loss_type == 'sapo':
        # the log ratio bounded as verl bounds it: exp(large) is inf, and the gate's gradient
        # there would be 0 * inf = nan
        ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
        tau = torch.where(adv > 0, sapo_tau[0], sapo_tau[1])
        pg = -adv * (4 / tau) * torch.sigmoid(tau * (ratio - 1))
        clip_low = clip_high = torch.zeros_like(ratio, dtype=torch.bool)
    elif loss_type == 'vespo':
        phi = vespo_weights(log_ratio, adv, lens, vespo_shape, is_weight=is_weight, sampled=sampled)
        pg = -phi * adv * logp
        clip_low = clip_high = torch.zeros_like(ratio, dtype=torch.bool)
        is_weight = None  # inside the weight
    else:
        raise ValueError(f"loss_type={loss_type!r}: expected one of {LOSS_TYPES}")
    if token_mask is not None:
        pg = pg * token_mask
        entropy = entropy * token_mask if entropy is not None else None
    tok_loss = pg if is_weight is None else pg * is_weight
    if pg_mask is not None:
        tok_loss = tok_loss * pg_mask
    if ref_logp is not None and kl_estimator != 'k1':
        tok_loss = tok_loss + beta * kl
    if entropy is not None and entropy_coef != 0.0:
        tok_loss = tok_loss - entropy_coef * entropy
    stats = {'pg': pg.detach(), 'kl': kl.detach(), 'ratio': ratio.detach(), 'clip_low': clip_low,
             'clip_high': clip_high}
    if clip_ratio_c > 0 and loss_type in ('grpo', 'gspo', 'clip_cov'):
        stats['clip_dual'] = clip_dual
    if loss_type == 'vespo':
        stats['phi'] = phi
    if teacher_logp is not None:
        stats['teacher_kl'] = teacher_kl
    return (tok_loss * w).sum(), stats


def cov_selection(adv, logp, k, loss_type, *, bounds=(1.0, 5.0), u=None):
    """The tokens Clip-Cov and KL-Cov act on (arXiv 2505.22617; verl's clip_cov and kl_cov), from
    flat per-token advantages and log-probs: each token's covariance term
    (A - mean A) (log pi - mean log pi), means over all the tokens given; 'kl_cov': the k with
    the largest; 'clip_cov': k at random (the smallest of the uniforms u) of those with
    bounds[0] < covariance < bounds[1]. Returns a bool mask (fewer than k where fewer qualify)."""
    cov = (adv - adv.mean()) * (logp - logp.mean())
    if loss_type == 'kl_cov':
        score, n = -cov, cov.numel()
    else:
        inside = (cov > bounds[0]) & (cov < bounds[1])
        score, n = torch.where(inside, u, math.inf), int(inside.sum())
    picked = torch.topk(score, min(k, n), largest=False).indices
    return torch.zeros_like(cov, dtype=torch.bool).index_fill_(0, picked, True)


def dual_clip(pg, adv, c):
    """Dual-clip PPO (Ye et al., arXiv 1912.09729; verl's clip_ratio_c, OpenRLHF's dual_clip): for
    A < 0 the clipped loss max(-A ratio, -A clip(ratio)) grows with the ratio without bound; cap it
    at -A c. Returns the loss and where the cap took effect. TRL's delta (INTELLECT-2) caps the
    ratio at delta on both sides of the min, which is the same loss when delta > 1 + eps_high."""
    cap = -adv * c
    return torch.where(adv < 0, torch.minimum(pg, cap), pg), (adv < 0) & (pg > cap)
