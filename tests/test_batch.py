"""batch.py: which completions become training rows, with dynamic sampling's kept groups; the
packed-or-rows cost rule."""
import torch

from batch import (choose_share_prompt, keep_groups, layout_flops, pack_groups, sampled_tokens,
                   train_rows)
from loss import group_advantages
from model import ModelConfig, packed_mask, qwen25_05b_config


def comps_of(rewards):
    comps = []
    for p, row in enumerate(rewards):
        for s in range(len(row)):
            comps.append({'prompt_idx': p, 'sample_idx': s, 'ids': [1] * (p + 1),
                          'truncated': False, 'logprobs': [0.0] * (p + 1)})
    return comps


def test_kept_groups_map_to_their_own_advantages():
    r = torch.tensor([[1.0, 1.0], [0.0, 1.0], [2.0, 2.0], [3.0, 0.0], [1.0, 0.0]])
    zero = group_advantages(r)[1]
    kept = keep_groups(zero, 2)
    assert kept == [1, 3], "the first two groups with a spread, in the order drawn"
    adv, zero_k = group_advantages(r[kept], 'none')
    comps = comps_of(r.tolist())
    prompts = list('abcde')
    rows, n_tok, n_seq, (n_rows, n_toks, n_spread) = train_rows(comps, adv, zero_k, prompts,
                                                                {1, 3, 4}, kept)
    assert [(rw['prompt'], rw['adv']) for rw in rows] == \
        [('b', -0.5), ('b', 0.5), ('d', 1.5), ('d', -1.5)]
    assert (n_tok, n_seq, n_rows, n_toks, n_spread) == (2 * 2 + 2 * 4, 4, 4, 12, 4), \
        "normalisers over the kept groups only"
    rows = train_rows(comps_of(r.tolist()), adv, zero_k, list('abcde'), {3}, kept)[0]
    assert [rw['prompt'] for rw in rows] == ['d', 'd'], \
        "a rank trains only the kept groups it sampled"


def layout(P, C, G, group=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 200, (P,), generator=g).tolist()
    lens = [C] * G if isinstance(C, int) else C
    rows = []
    for c in lens:
        ids = torch.randint(0, 200, (c,), generator=g).tolist()
        rows.append({'prompt': prompt, 'ids': ids, 'group': group})
    return rows


def test_share_prompt_auto_packs_short_completions_and_not_long_ones_under_sdpa():
    """The cost rule at Qwen2.5-0.5B's shape: GSM8K-like prompts with short completions pack (the
    prompt's tokens are most of the work); with the dense SDPA mask, G=16 x 512-token completions
    after a 100-token prompt go one row per completion (the packed row's 8k x 8k scores cost more
    than the 15 prompt copies), as the block-sparse FlexAttention layout does not (it computes only
    the kept blocks, so packing is never more work)."""
    cfg = qwen25_05b_config()
    short = layout(380, 64, 8) + layout(350, 40, 8, group=1)
    long = layout(100, 512, 16)
    assert choose_share_prompt(short, cfg, 'sdpa') and choose_share_prompt(short, cfg, 'flex')
    assert not choose_share_prompt(long, cfg, 'sdpa'), \
        'dense-mask packing of 8k-token rows should lose'
    assert choose_share_prompt(long, cfg, 'flex')
    packed, rows = layout_flops(long, cfg, 'sdpa')
    assert 1.3 < packed / rows < 2.0, \
        f'packed / rows = {packed / rows:.2f}: the estimate is about 1.6'
    # where the rule flips under sdpa, for 100-token prompts and G=16: between 128 and 512-token
    # completions
    assert choose_share_prompt(layout(100, 128, 16), cfg, 'sdpa')
    ungrouped = [{k: v for k, v in r.items() if k != 'group'} for r in short]
    assert not choose_share_prompt(ungrouped, cfg, 'sdpa')


def test_flex_cost_counts_the_blocks_the_block_mask_keeps():
    """layout_flops' FlexAttention pairs are the BlockMask's own block count (model.packed_mask on
    pack_groups' ids)."""
    cfg = ModelConfig(n_layer=1, n_head=1, n_kv_head=1, n_embd=8, intermediate_size=8)
    per_pair = 4 * 8
    per_token = 2 * (8 * 3 * 8 + 8 * 8 + 3 * 8 * 8)
    for P, C in [(100, [300, 7, 129, 1, 60]), (300, [5] * 40), (1, [200, 200])]:
        rows = layout(P, C, len(C))
        x, pos, seg, pred, targets = pack_groups(rows, pad_id=0)
        blocks = int(packed_mask(seg, 'flex').to_dense().sum())
        packed, _ = layout_flops(rows, cfg, 'flex')
        assert packed == x.shape[1] * per_token + blocks * 128 * 128 * per_pair, (P, C)


def test_mini_batch_groups_deal_whole_groups_round_robin():
    """7 groups into 3 mini-batches: group k to mini-batch k % 3, disjoint, every group once."""
    from batch import mini_batch_groups
    assert mini_batch_groups(7, 3) == [[0, 3, 6], [1, 4], [2, 5]]
    assert mini_batch_groups(4, 1) == [[0, 1, 2, 3]]


def test_sampled_tokens_mark_what_the_policy_sampled():
    """1 on sampled tokens, 0 on those a tool's response inserted, flat and row-major as the
    log-probs come; rows without a tool_mask are all sampled; None without any tool_mask."""
    rows = [{'ids': [5, 6, 7], 'tool_mask': [0, 1, 0]}, {'ids': [8, 9]},
            {'ids': [1, 2], 'tool_mask': [1, 1]}]
    assert sampled_tokens(rows, 'cpu').tolist() == [1, 0, 1, 1, 1, 0, 0]
    assert sampled_tokens(rows[1:2], 'cpu') is None


def test_update_flops_count_what_the_layouts_run_and_attend():
    """metrics.update_flops' positions, scored tokens and attended pairs: by hand, and as the
    layouts lay them out (pack: each row its prompt and completion less the last token, causal;
    pack_groups: the non-padding positions, and the pairs its mask lets attend)."""
    from batch import pack
    from metrics import update_flops, update_positions
    from model import from_scratch
    rows = layout(10, [6, 4], 2) + layout(3, [5], 1, group=1)
    assert update_positions([rows], share=False) == (15 + 13 + 7, 15, 120 + 91 + 28)
    assert update_positions([rows[:2], rows[2:]], share=True) == (18 + 7, 15, 156 + 28)
    x, _ = pack(rows, pad_id=-1)
    assert int((x != -1).sum()) - len(rows) == 35  # a row's last token is input to nothing
    _, _, seg, _, _ = pack_groups(rows, pad_id=0)
    assert int((seg >= 0).sum()) == 25
    real = (seg >= 0)[:, :, None] & (seg >= 0)[:, None, :]
    assert int((packed_mask(seg, 'sdpa')[:, 0] & real).sum()) == 184
    cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=96, vocab_size=300,
                      max_seq_len=64, tie_word_embeddings=False)
    model = from_scratch(cfg)
    body = 2 * (64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 96)  # q/k/v, o, gate/up/down per layer
    assert model.matmul_weights() == (body, 300 * 64) and model.attention_width() == 64
    assert update_flops(model, [rows], False) == 6 * body * 35 + 6 * 300 * 64 * 15 + 12 * 2 * 64 * 239


def test_decode_bytes_read_the_weights_each_step_and_each_rows_cache_so_far():
    from metrics import decode_bytes
    from model import KVCache, from_scratch
    cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=96, vocab_size=300,
                      max_seq_len=64)
    sampler = from_scratch(cfg, dtype=torch.bfloat16)
    cache = KVCache(cfg, 1, 10, torch.bfloat16, 'cpu')
    per_position = sum(t.numel() * t.element_size() for t in cache.k + cache.v) // 10
    weights = sum(sampler.matmul_weights()) * 2
    # 5 decode steps; token t of a row reads its prompt and t tokens: 3 x 4 + 3, 5 x 2 + 10
    got = decode_bytes(sampler, [{'ids': [7] * 3}, {'ids': [7] * 5}], [4, 2])
    assert got == 5 * weights + per_position * (15 + 20)


def test_a_compiled_trunk_gets_the_same_head_object_every_call():
    """compiled=True: the LM head passed into the torch.compile'd model is one function object
    across calls (each call's targets reach it outside the graph). Dynamo guards on a function
    argument's identity: before torch 2.11, the new closure of each call invalidated the graph and
    every micro-batch of a --compile=True run compiled again (13 s a step on this test's model)."""
    from batch import completion_logprobs
    from model import from_scratch
    cfg = ModelConfig(arch='qwen2', vocab_size=40, n_layer=1, n_head=2, n_kv_head=1, n_embd=16,
                      intermediate_size=32, max_seq_len=64)
    model = from_scratch(cfg, dtype=torch.float32, device='cpu', seed=0)
    heads = []

    def net(x, head, **kw):  # the compiled model's place: records the head, runs the forward
        heads.append(head)
        return model(x, head=head, **kw)
    net.parameters = model.parameters
    runs = []
    for ids in ([5, 6, 7], [8, 9, 10, 11]):
        rows = [{'prompt': [1, 2, 3], 'ids': ids}]
        runs.append(completion_logprobs(net, rows, 0, 1.0, share_prompt=False, compiled=True))
        eager = completion_logprobs(model, rows, 0, 1.0, share_prompt=False)
        assert torch.equal(runs[-1][0], eager[0]) and torch.equal(runs[-1][1], eager[1])
    assert len(heads) == 2 and heads[0] is heads[1], "a new head function each call"
