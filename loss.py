"""
The GRPO objective, as small functions of flat per-token tensors so each piece can be checked by hand.

Each micro-batch's loss (batch.py cuts and lays out the micro-batches) is sum(token_loss * w) with the weights w of
token_weights(), whose denominators count the whole step (every micro-batch, every rank): the sum of the
micro-batch losses is the step's loss, and its gradient does not depend on how the step was cut.
"""
import torch


def group_advantages(rewards, std_scale=True, eps=1e-4):
    """rewards (P, G) -> advantages (P, G), zero_std (P,) bool. GRPO: (r - mean) / (std + eps);
    Dr. GRPO (std_scale=False): r - mean, which does not up-weight groups that are nearly all equal."""
    std = rewards.std(dim=1, keepdim=True)  # unbiased, as in the GRPO paper's implementations
    zero = std < 1e-6
    adv = rewards - rewards.mean(dim=1, keepdim=True)
    if std_scale:
        adv = adv / (std + eps)
    return torch.where(zero, 0.0, adv), zero.squeeze(1)  # all-equal groups: exactly 0, even with eps = 0


def token_weights(lens, loss_agg, n_tok, n_seq, max_new_tokens):
    """Per-token weight for the micro-batch whose sequences have these completion lengths (a LongTensor).
    token_mean (DAPO): every token of the step counts the same, 1 / n_tok.
    seq_mean_token_mean (GRPO): mean over each sequence's tokens, then over the step's sequences.
    seq_sum_const (Dr. GRPO): sum over tokens / (n_seq * max_new_tokens), a constant: no length bias."""
    if loss_agg == 'token_mean':
        return torch.full((int(lens.sum()),), 1.0 / n_tok, device=lens.device)
    if loss_agg == 'seq_mean_token_mean':
        return torch.repeat_interleave(1.0 / (lens.float() * n_seq), lens)
    if loss_agg == 'seq_sum_const':
        return torch.full((int(lens.sum()),), 1.0 / (n_seq * max_new_tokens), device=lens.device)
    raise ValueError(f"loss_agg={loss_agg!r}: expected token_mean, seq_mean_token_mean or seq_sum_const")


def kl_estimate(logp, ref_logp, estimator='k3', clamp=10.0):
    """Per-token estimate of KL(policy || reference) from samples of the policy.
    k1 = log pi - log ref (unbiased, can be negative); k3 = r - log r - 1 with r = ref / pi (unbiased, >= 0)."""
    log_r = (ref_logp - logp).clamp(-clamp, clamp)
    if estimator == 'k1':
        return -log_r
    if estimator == 'k3':
        return torch.exp(log_r) - log_r - 1
    raise ValueError(f"kl_estimator={estimator!r}: expected 'k1' or 'k3'")


def policy_loss(logp, old_logp, adv, w, eps_low, eps_high, ref_logp=None, beta=0.0, kl_estimator='k3', kl_clamp=10.0,
                entropy=None, entropy_coef=0.0):
    """Clipped surrogate (PPO with clip-higher) + beta * KL - entropy_coef * entropy, aggregated with weights w.
    All inputs are flat per-token tensors; adv is the sequence's advantage repeated over its tokens.
    Returns (loss, stats) where stats holds per-token tensors for logging: pg, kl, clipped."""
    ratio = torch.exp(logp - old_logp)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps_low, 1 + eps_high))
    tok_loss = pg
    kl = torch.zeros_like(logp)
    if ref_logp is not None:
        kl = kl_estimate(logp, ref_logp, kl_estimator, kl_clamp)
        tok_loss = tok_loss + beta * kl
    if entropy is not None and entropy_coef != 0.0:
        tok_loss = tok_loss - entropy_coef * entropy
    clipped = ((ratio < 1 - eps_low) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))
    return (tok_loss * w).sum(), {'pg': pg.detach(), 'kl': kl.detach(), 'clipped': clipped}
