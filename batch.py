"""
The batch layout: a step's completions cut into micro-batches, each laid out for one forward pass
(one row per completion, or one packed row per group), and the per-token log-probs and entropies
that pass gives.
"""
import torch

from logprob_kernels import lm_head_logprobs
from sample import sampled_count


def micro_batches(rows, size, whole_groups, max_tokens=0):
    """Cut a step's rows into micro-batches of at most `size` rows, similar lengths together (less
    padding). whole_groups (for pack_groups): a group's rows stay together and in order, at least
    one group per micro-batch. max_tokens > 0: also at most that many tokens as padded (sequences x
    the longest; a packed group is one sequence), so short rows share a pass and long ones get
    fewer, one sequence at least."""
    def length(unit):  # a row, or a group packed: its prompt once, then every completion
        return len(unit[0]['prompt']) + sum(len(r['ids']) for r in unit)

    units = [[r] for r in rows]
    if whole_groups:
        groups = {}
        for r in rows:
            groups.setdefault(r['group'], []).append(r)
        units = list(groups.values())
    micro, n_seq = [], 0  # n_seq: the last micro-batch's sequences
    for unit in sorted(units, key=length):  # each unit at least as long as those before it
        too_long = max_tokens and (n_seq + 1) * length(unit) > max_tokens
        if not micro or len(micro[-1]) + len(unit) > size or too_long:
            micro.append([])
            n_seq = 0
        micro[-1] += unit
        n_seq += 1
    return micro


def pack(rows, pad_id, device='cpu'):
    """Right-padded (prompt + completion) ids for a micro-batch, and the positions whose next token
    is a completion token: the only positions that get logits (prompt positions never reach the LM
    head)."""
    T = max(len(r['prompt']) + len(r['ids']) for r in rows)
    x = torch.full((len(rows), T), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(rows), T - 1), dtype=torch.bool)
    for i, r in enumerate(rows):
        p, c = len(r['prompt']), len(r['ids'])
        x[i, :p + c] = torch.tensor(r['prompt'] + r['ids'])
        mask[i, p - 1:p + c - 1] = True
    return x.to(device), mask.to(device)


def pack_groups(rows, pad_id, device='cpu'):
    """One packed row per group (consecutive rows with the same 'group'): the prompt once, then each
    completion less its last token (which predicts nothing), at positions that restart after the
    prompt, each completion seeing the prompt and its own earlier tokens only. The same log-probs as
    pack(), but a prompt's layers run once instead of G times: the update's cost when prompts are
    long next to completions. Returns ids, positions, the segment ids (B, T) that say who sees whom
    (0 the prompt, s the s-th completion, -1 padding: GPT.forward's attn_mask, which builds the mask
    from them on the device, model.packed_mask), the flat position that predicts each completion
    token, and the targets (both row-major). All small (B, T) or (N,) tensors: nothing T x T leaves
    the CPU."""
    groups = []
    for r in rows:
        if groups and groups[-1][0]['group'] == r['group']:
            groups[-1].append(r)
        else:
            groups.append([r])
    T = max(len(g[0]['prompt']) + sum(len(r['ids']) - 1 for r in g) for g in groups)
    x = torch.full((len(groups), T), pad_id, dtype=torch.int64)
    pos = torch.zeros((len(groups), T), dtype=torch.int64)
    # 0 prompt, s the s-th completion, -1 pad
    seg = torch.full((len(groups), T), -1, dtype=torch.int64)
    pred, targets = [], []
    for b, g in enumerate(groups):
        n = len(g[0]['prompt'])
        x[b, :n], pos[b, :n], seg[b, :n] = torch.tensor(g[0]['prompt']), torch.arange(n), 0
        at = n
        for s, r in enumerate(g, 1):
            k = len(r['ids']) - 1
            x[b, at:at + k] = torch.tensor(r['ids'][:-1], dtype=torch.int64)
            pos[b, at:at + k], seg[b, at:at + k] = torch.arange(n, n + k), s
            # the prompt's last token predicts the first completion token, each completion token the
            # next
            pred += [b * T + n - 1] + list(range(b * T + at, b * T + at + k))
            targets += r['ids']
            at += k
    return (x.to(device), pos.to(device), seg.to(device), torch.tensor(pred, device=device),
            torch.tensor(targets, device=device))


def layout_flops(rows, cfg, backend, block=128):
    """Forward FLOPs of the update's trunk for a step's rows in each layout: (packed, one row per
    completion). The LM head (completion tokens only) is the same in both and left out; backward is
    about twice forward in both.
      per token  2 x the block weights (q/k/v/o and MLP matmuls, all layers);
      per pair   4 x n_layer x n_head x head_dim (q.k and the weighted sum of v) for each query-key
                 pair computed:
        rows (pack: prompt + completion less its last token, causal SDPA): the causal blocks of
          each row;
        packed (pack_groups: the prompt once, then each completion less its last token), 'sdpa':
          every pair of the packed row (a dense mask computes all T x T scores); 'flex': the blocks
          the block mask keeps (the prompt's causal blocks, and for each query block the prompt's
          blocks and those from its first completion's start).
    Blocks of `block` x `block` pairs (FlexAttention's and flash attention's tiles)."""
    hd, nh, nkv, d = cfg.head_dim, cfg.n_head, cfg.n_kv_head, cfg.n_embd
    mlp = (3 if cfg.arch != 'gpt2' else 2) * d * cfg.intermediate_size
    per_token = 2 * cfg.n_layer * (d * (nh + 2 * nkv) * hd + nh * hd * d + mlp)
    per_pair = 4 * cfg.n_layer * nh * hd
    nb = block

    def causal_blocks(n):
        k = -(-n // nb)
        return k * (k + 1) // 2

    groups = {}
    for r in rows:
        groups.setdefault(r.get('group'), []).append(r)
    tok_rows = pairs_rows = tok_packed = pairs_packed = 0
    for g in groups.values():
        P, ks = len(g[0]['prompt']), [len(r['ids']) - 1 for r in g]
        tok_rows += sum(P + k for k in ks)
        pairs_rows += sum(causal_blocks(P + k) for k in ks) * nb * nb
        T = P + sum(ks)
        tok_packed += T
        if backend == 'sdpa':
            pairs_packed += T * T
            continue
        starts, at = [], P  # each completion's first position
        for k in ks:
            starts.append(at)
            at += k
        pb = -(-P // nb)  # blocks holding prompt keys
        n = 0
        for qb in range(-(-T // nb)):
            a = qb * nb  # the block's first query
            if a < P:  # holds prompt queries: causal from key 0
                n += qb + 1
                continue
            # the completion holding query a starts at `first`: the prompt's blocks, then first's
            # block up to this one
            first = max((s for s in starts if s <= a), default=P)
            n += pb + (qb - max(first // nb, pb) + 1)
        pairs_packed += n * nb * nb
    packed = tok_packed * per_token + pairs_packed * per_pair
    separate = tok_rows * per_token + pairs_rows * per_pair
    return packed, separate


def choose_share_prompt(rows, cfg, backend):
    """share_prompt='auto': pack this step's groups (pack_groups) when layout_flops says packing is
    no more work than one row per completion for the packed attention `backend` ('flex' or 'sdpa',
    model.packed_backend). With flex, packing has fewer tokens and fewer computed pairs, so it
    always packs (up to block rounding); with sdpa a packed group's dense (P + G*C)^2 scores outgrow
    what the prompt saves once completions are long (e.g. Qwen2.5-0.5B, G=16, 100-token prompts,
    512-token completions: rows)."""
    if not rows or 'group' not in rows[0]:
        return False
    packed, separate = layout_flops(rows, cfg, backend)
    return packed <= separate


# the LM head a compiled trunk calls: one function object for every call, which runs the call's
# head (_HEAD[0]) outside the graph. Dynamo guards on the identity of a function passed in, and
# before torch 2.11 a new closure each call invalidated the graph: every micro-batch compiled anew
_HEAD = [None]


@torch.compiler.disable
def _head_outside_graph(h, weight):
    return _HEAD[0](h, weight)


def completion_logprobs(net, rows, pad_id, temperature, *, share_prompt=True, dtype=torch.float32,
                        compiled=False, head_fp32=True, tiles=(0, 0)):
    """Per-token log p(token) and entropy of every completion token in rows (flat, row-major) at
    `temperature`, through the fused LM head (logprob_kernels.lm_head_logprobs: never more logits than one
    tile of `tiles` = (tokens, vocabulary), 0 = its default). rows: {'prompt', 'ids'[, 'group']}
    dicts; with share_prompt and groups, each group's prompt runs once (pack_groups). The trunk runs
    under autocast to dtype; the head does its own fp32 math. head_fp32: the LM head's matmul in
    fp32 too (under bf16 autocast its logits would be rounded to bf16; in fp32 they are the
    full-precision logits of the policy being trained). compiled: net is a torch.compile'd model,
    whose graph must not take in the head."""
    device = next(net.parameters()).device
    if share_prompt and 'group' in rows[0]:
        x, pos, seg, select, targets = pack_groups(rows, pad_id, device)
        kw = dict(pos=pos, attn_mask=seg, select=select)
    else:
        x, select = pack(rows, pad_id, device)
        targets, x, kw = x[:, 1:][select], x[:, :-1], dict(select=select)

    # head runs inside net's forward: a DDP/FSDP wrapper sees (FSDP has gathered) the LM head weight
    def head(h, weight):
        return lm_head_logprobs(h, weight, targets, temperature, head_fp32=head_fp32, tiles=tiles)

    if compiled:  # torch.compile the trunk only; the kernels run as they are
        _HEAD[0], head = head, _head_outside_graph
    try:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            return net(x, head=head, **kw)
    finally:
        _HEAD[0] = None  # so that this call's targets are not kept alive


def sampled_tokens(rows, device):
    """Rollouts with tools: 1 on each completion token the policy sampled, 0 on those a tool's
    response inserted (flat, row-major, as completion_logprobs' tokens); None when no row has a
    tool_mask."""
    if not any('tool_mask' in rw for rw in rows):
        return None
    inserted = [m for rw in rows for m in rw.get('tool_mask', [0] * len(rw['ids']))]
    return 1.0 - torch.tensor(inserted, dtype=torch.float32, device=device)


def train_rows(comps, adv, zero_std, prompts, mine, groups, *, filter_zero_std=True,
               mask_truncated=False):
    """The step's completions that enter the loss, as rows {'prompt', 'ids', 'adv', 'gen_logp',
    'group', 'sample'[, 'tool_mask']} (tool_mask: 1 for the tokens a tool's response inserted): those of the
    kept `groups` (the step's prompt indices; row k of adv and zero_std is groups[k]'s, so dynamic
    sampling can drop groups) that this rank generated (`mine`: it holds their sampler log-probs),
    less truncated completions (mask_truncated) and empty ones. Returns (rows, n_tok, n_seq,
    (rows_trained, tokens_trained, rows_spread)): the loss normalisers (sampled tokens only),
    counted over every rank's rows of the kept groups, how many of those rows and tokens are
    trained on (0 rows: nothing to update), and how many are of groups with a reward spread, with
    the filter or without (the rows whose advantage can move the policy). filter_zero_std leaves
    out the rows of groups whose rewards were all equal after counting them, so it only saves
    compute: their advantage is 0, and with the normalisers unchanged the step's gradient is the
    same with the filter on or off (only true when nothing but the advantage gives them a gradient:
    no KL or entropy term; the caller checks)."""
    at = {g: k for k, g in enumerate(groups)}
    rows, n_tok, n_seq, n_trained, t_trained, n_spread = [], 0, 0, 0, 0, 0
    for c in comps:
        k = at.get(c['prompt_idx'])
        if k is None or (mask_truncated and c['truncated']) or not c['ids']:
            continue
        n_sampled = sampled_count(c)  # tool responses are not actions
        n_tok += n_sampled
        n_seq += 1
        n_spread += int(not zero_std[k])
        if filter_zero_std and zero_std[k]:
            continue
        n_trained += 1
        t_trained += n_sampled
        if c['prompt_idx'] in mine:
            row = {'prompt': prompts[c['prompt_idx']], 'ids': c['ids'],
                   'adv': float(adv[k, c['sample_idx']]), 'gen_logp': c['logprobs'],
                   'group': c['prompt_idx'], 'sample': c['sample_idx']}
            if 'tool_mask' in c:
                row['tool_mask'] = c['tool_mask']
            rows.append(row)
    return rows, n_tok, n_seq, (n_trained, t_trained, n_spread)


def zero_std_rows(comps, adv, zero_std, prompts, mine, groups, *, mask_truncated=False):
    """The rows that train_rows leaves out with filter_zero_std: those of the groups whose rewards
    were all equal (what the step trains on without the filter, less what it trains on with it)."""
    every = train_rows(comps, adv, zero_std, prompts, mine, groups, filter_zero_std=False,
                       mask_truncated=mask_truncated)[0]
    at = {g: k for k, g in enumerate(groups)}
    return [rw for rw in every if zero_std[at[rw['group']]]]


def sampled_entropies(entropies_of, passes):
    """The entropies of the tokens the policy sampled (not those a tool's response inserted), flat
    on the CPU, over passes: (micro-batch, real) pairs, entropies_of(micro-batch) giving its
    per-token entropies. Every pass runs (under torchrun the ranks' passes pair up: FSDP's
    gathers); a padding pass (real False) adds nothing."""
    out = []
    for mb, real in passes:
        e = entropies_of(mb)
        sampled = sampled_tokens(mb, e.device)
        if real:
            out.append(e if sampled is None else e[sampled.bool()])
    return torch.cat([e.float().cpu() for e in out] or [torch.zeros(0)])


def mini_batch_groups(n_groups, n):
    """PPO mini-batches: the step's groups (by their row in the advantages) dealt into n disjoint
    sets, group k into set k % n, so that each set draws on every rank's share of the prompts (a
    rank holds consecutive ones). Groups stay whole: a group's rows share one optimizer step."""
    return [list(range(b, n_groups, n)) for b in range(n)]


def keep_groups(zero_std, n_groups):
    """Dynamic sampling (DAPO): the indices of the first n_groups groups whose rewards differ, in
    the order drawn."""
    return [i for i, z in enumerate(zero_std.tolist()) if not z][:n_groups]


def pad_micro_batches(micro, pad_id, device):
    """Under torchrun every rank must run as many forward/backward passes, so that their collectives
    pair up: pad with one-token rows (their loss weight is 0) up to the most any rank has. Unchanged
    in one process."""
    from parallel import all_reduce
    pad = {'prompt': [pad_id], 'ids': [pad_id], 'adv': 0.0, 'gen_logp': [0.0], 'group': -1}
    most = int(all_reduce([len(micro)], device, 'max')[0])
    return micro + [[pad]] * (most - len(micro))
