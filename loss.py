"""
The GRPO objective, as small functions of flat per-token tensors so each piece can be checked by hand.

micro_batches() cuts a step's rows into micro-batches; pack() and pack_groups() lay a micro-batch out for the
model. Each micro-batch's loss is sum(token_loss * w) with the weights w of token_weights(), whose denominators
count the whole step (every micro-batch, every rank): the sum of the micro-batch losses is the step's loss, and its
gradient does not depend on how the step was cut.
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


def micro_batches(rows, size, whole_groups):
    """Cut a step's rows into micro-batches of at most `size` rows, similar lengths together (less padding).
    whole_groups (for pack_groups): a group's rows stay together and in order, at least one group per micro-batch."""
    if not whole_groups:
        rows = sorted(rows, key=lambda r: len(r['prompt']) + len(r['ids']))
        return [rows[i:i + size] for i in range(0, len(rows), size)]
    groups = {}
    for r in rows:
        groups.setdefault(r['group'], []).append(r)
    micro = []
    for g in sorted(groups.values(), key=lambda g: len(g[0]['prompt']) + sum(len(r['ids']) for r in g)):
        if not micro or len(micro[-1]) + len(g) > size:
            micro.append([])
        micro[-1] += g
    return micro


def pack(rows, pad_id, device='cpu'):
    """Right-padded (prompt + completion) ids for a micro-batch, and the positions whose next token is a completion
    token: the only positions that get logits (prompt positions never reach the LM head)."""
    T = max(len(r['prompt']) + len(r['ids']) for r in rows)
    x = torch.full((len(rows), T), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(rows), T - 1), dtype=torch.bool)
    for i, r in enumerate(rows):
        p, c = len(r['prompt']), len(r['ids'])
        x[i, :p + c] = torch.tensor(r['prompt'] + r['ids'])
        mask[i, p - 1:p + c - 1] = True
    return x.to(device), mask.to(device)


def pack_groups(rows, pad_id, device='cpu'):
    """One packed row per group (consecutive rows with the same 'group'): the prompt once, then each completion less
    its last token (which predicts nothing), at positions that restart after the prompt, each completion seeing the
    prompt and its own earlier tokens only. The same log-probs as pack(), but a prompt's layers run once instead of
    G times: the update's cost when prompts are long next to completions. Returns ids, positions, the attention mask
    (B, 1, T, T), the flat position that predicts each completion token, and the targets (both row-major)."""
    groups = []
    for r in rows:
        if groups and groups[-1][0]['group'] == r['group']:
            groups[-1].append(r)
        else:
            groups.append([r])
    T = max(len(g[0]['prompt']) + sum(len(r['ids']) - 1 for r in g) for g in groups)
    x = torch.full((len(groups), T), pad_id, dtype=torch.int64)
    pos = torch.zeros((len(groups), T), dtype=torch.int64)
    seg = torch.full((len(groups), T), -1, dtype=torch.int64)  # 0 prompt, s the s-th completion, -1 padding
    pred, targets = [], []
    for b, g in enumerate(groups):
        n = len(g[0]['prompt'])
        x[b, :n], pos[b, :n], seg[b, :n] = torch.tensor(g[0]['prompt']), torch.arange(n), 0
        at = n
        for s, r in enumerate(g, 1):
            k = len(r['ids']) - 1
            x[b, at:at + k] = torch.tensor(r['ids'][:-1], dtype=torch.int64)
            pos[b, at:at + k], seg[b, at:at + k] = torch.arange(n, n + k), s
            # the prompt's last token predicts the first completion token, each completion token the next
            pred += [b * T + n - 1] + list(range(b * T + at, b * T + at + k))
            targets += r['ids']
            at += k
    q, kk = seg[:, :, None], seg[:, None, :]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    mask = causal & ((kk == 0) | (kk == q) | (q == -1))  # padding sees what precedes it: finite, never read
    return (x.to(device), pos.to(device), mask[:, None].to(device), torch.tensor(pred, device=device),
            torch.tensor(targets, device=device))
