"""Packed groups' attention: the mask built on the device from segment ids, through FlexAttention (a
block mask) and through SDPA (a dense mask), give the same log-probs and gradients
(model.packed_mask, model.flex, batch.pack_groups).

On the CPU torch has FlexAttention's compiled forward but no backward: the forward is compared
through the compiled kernel (block-sparse, the real thing), the gradients through flex_attention's
eager reference path (every score, the same mask_mod), its CPU refusal bypassed here only.
GRPO_TEST_DEVICE=cuda (bench/gpu_check.py) runs both through the compiled CUDA kernels.
"""
import os

import pytest
import torch

import model as M
from batch import completion_logprobs, pack_groups
from model import ModelConfig, packed_backend, packed_mask

DEVICE = torch.device(os.environ.get('GRPO_TEST_DEVICE', 'cpu'))
pytestmark = pytest.mark.skipif(M.flex_attention is None,
                                reason=f'torch {torch.__version__} has no FlexAttention')


# gemma3_text's own parts: a sliding-window layer (its RoPE base; a window of 8 positions, shorter
# than the prompts and completions here) and query_pre_attn_scalar
GEMMA = dict(sliding_layers=(1, 0), local_rope_theta=100.0, sliding_window=8, query_pre_attn_scalar=20.0)


def tiny(arch='qwen2', seed=0):
    cfg = ModelConfig(arch=arch, vocab_size=97, n_layer=2, n_head=4,
                      n_kv_head=2 if arch == 'qwen2' else 4, n_embd=64, intermediate_size=96,
                      max_seq_len=512, tie_word_embeddings=arch == 'gpt2',
                      **(GEMMA if arch == 'gemma3_text' else {}))
    torch.manual_seed(seed)
    m = M.GPT(cfg)
    # every weight and bias nonzero, so a misplaced position or mask shows
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.15)
    return m.to(DEVICE)


def group_rows(plens=(60, 9, 1), G=(8, 5, 3), seed=1):
    """Groups with different prompt lengths and numbers of completions (1 to 60 tokens): the first
    packs to more than two 128-token blocks, so the block mask has full, partial and empty blocks;
    the shorter ones are padded."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for group, (plen, n) in enumerate(zip(plens, G)):
        prompt = torch.randint(0, 97, (plen,), generator=g).tolist()
        for _ in range(n):
            k = int(torch.randint(1, 61, (1,), generator=g))
            ids = torch.randint(0, 97, (k,), generator=g).tolist()
            rows.append({'prompt': prompt, 'ids': ids, 'group': group})
    return rows


def oracle_mask(rows, T):
    """Who sees whom, from the rows alone: per group the prompt, then each completion less its last
    token."""
    groups = {}
    for r in rows:
        groups.setdefault(r['group'], []).append(r)
    mask = torch.zeros(len(groups), T, T, dtype=torch.bool)
    for b, g in enumerate(groups.values()):
        n = len(g[0]['prompt'])
        mask[b, :n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
        at = n
        for r in g:
            k = len(r['ids']) - 1
            mask[b, at:at + k, :n] = True
            mask[b, at:at + k, at:at + k] = torch.ones(k, k, dtype=torch.bool).tril()
            at += k
        mask[b, at:, at:] = torch.eye(T - at, dtype=torch.bool)  # padding: itself only
    return mask


def test_masks_from_segments_are_the_layout():
    rows = group_rows()
    x, pos, seg, pred, targets = pack_groups(rows, pad_id=0, device=DEVICE)
    assert seg.shape == x.shape and seg.dtype == torch.int64, \
        'pack_groups hands over (B, T) segment ids, not T x T'
    T = x.shape[1]
    want = oracle_mask(rows, T).to(DEVICE)
    dense = packed_mask(seg, 'sdpa')
    assert dense.shape == (3, 1, T, T) and dense.device.type == DEVICE.type
    assert torch.equal(dense[:, 0], want), 'the SDPA mask is not the packed layout'
    bm = packed_mask(seg, 'flex')
    assert isinstance(bm, M.BlockMask) and bm.kv_indices.device.type == DEVICE.type, \
        'a BlockMask, on the device'
    head = torch.tensor(0, device=DEVICE)
    q_idx = torch.arange(T, device=DEVICE)[:, None]
    kv_idx = torch.arange(T, device=DEVICE)[None]
    per_row = [bm.mask_mod(torch.tensor(b, device=DEVICE), head, q_idx, kv_idx) for b in range(3)]
    flex_dense = torch.stack(per_row)
    assert torch.equal(flex_dense, want), "the block mask's mask_mod is not the packed layout"
    blocks = bm.to_dense()  # (B, 1, T/128, T/128): which blocks the kernel computes at all
    assert blocks.shape[-1] >= 3 and (blocks == 0).any(), \
        'the test layout should leave whole blocks out'


def test_backend_choice():
    assert packed_backend('auto', 'cuda') == 'flex' and packed_backend('auto', 'cpu') == 'sdpa'
    assert packed_backend('sdpa', 'cuda') == 'sdpa' and packed_backend('flex', 'cpu') == 'flex'
    with pytest.raises(ValueError, match='packed_attention'):
        packed_backend('flash', 'cpu')


def eager_flex_with_grad(monkeypatch):
    """CPU only: flex_attention's eager (reference) path with its 'no backward on CPU' check off."""
    import torch.nn.attention.flex_attention as FA
    monkeypatch.setattr(FA, '_validate_device', lambda *a: None)
    monkeypatch.setattr(FA, '_warn_once', lambda *a, **k: None, raising=False)

    def flex(q, k, v, bm, gqa, scale=None):
        return FA.flex_attention(q, k, v, block_mask=bm, enable_gqa=gqa, scale=scale)

    monkeypatch.setattr(M, 'flex', flex)


def logprobs(net, rows, backend, grad):
    net.packed_attention = backend
    with torch.set_grad_enabled(grad):
        return completion_logprobs(net, rows, 0, temperature=0.9, share_prompt=True)


@pytest.mark.parametrize('arch', ['qwen2', 'olmo2', 'gemma3_text', 'gpt2'])
def test_flex_logprobs_and_gradients_equal_sdpa(arch, monkeypatch):
    """fp32, GQA (qwen2: 4 query heads on 2 kv heads) and plain heads (gpt2), three groups of
    different prompt lengths and sizes, completions of 1-60 tokens, padding: log-probs, entropies
    and every parameter's gradient <= 1e-5."""
    net = tiny(arch)
    rows = group_rows()
    ref_lp, ref_ent = logprobs(net, rows, 'sdpa', grad=False)
    # the compiled kernel (CPU: static shapes, one compile)
    lp, ent = logprobs(net, rows, 'flex', grad=False)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-5)
    if DEVICE.type == 'cpu':
        eager_flex_with_grad(monkeypatch)
    w = torch.randn(len(ref_lp), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    grads = {}
    for backend in ('sdpa', 'flex'):
        net.zero_grad(set_to_none=True)
        lp, ent = logprobs(net, rows, backend, grad=True)
        (w * lp + 0.1 * ent).sum().backward()
        grads[backend] = {n: p.grad.clone() for n, p in net.named_parameters()}
    for n, g in grads['sdpa'].items():
        # gemma3_text scales its embedding's output by sqrt(64) = 8, and with it the rounding of
        # the embedding's gradient
        atol = 8e-5 if arch == 'gemma3_text' and n == 'wte.weight' else 1e-5
        torch.testing.assert_close(grads['flex'][n], g, rtol=0, atol=atol, msg=lambda m: f'{n}: {m}')


@pytest.mark.parametrize('T', [1, 127, 128, 129, 300, 520])
def test_block_mask_equals_create_block_mask(T):
    """model.block_mask (chunked, never compiled) keeps the same tiles, full and partial, in the
    same order, as torch's create_block_mask evaluating the same mask_mod over every pair; with a
    chunk of one query tile at a time too."""
    from torch.nn.attention.flex_attention import create_block_mask
    g = torch.Generator().manual_seed(T)
    seg = torch.full((3, T), -1, dtype=torch.int64)
    for b in range(3):  # a prompt, then completions of random lengths, then padding
        at = int(torch.randint(0, T + 1, (1,), generator=g))
        seg[b, :at] = 0
        s = 1
        while at < T and torch.rand(1, generator=g) < 0.9:
            k = int(torch.randint(1, 90, (1,), generator=g))
            seg[b, at:at + k] = s
            at, s = at + k, s + 1
    seg = seg.to(DEVICE)
    ours = packed_mask(seg, 'flex')
    for chunk in (1 << 26, 1):
        if chunk == 1:
            ours = M.block_mask(ours.mask_mod, 3, T, DEVICE, chunk=1)
        ref = create_block_mask(ours.mask_mod, 3, None, T, T, device=DEVICE)
        for name in ('kv_num_blocks', 'full_kv_num_blocks', 'q_num_blocks', 'full_q_num_blocks'):
            assert torch.equal(getattr(ours, name), getattr(ref, name)), (name, chunk)
        for name, count in (('kv_indices', 'kv_num_blocks'), ('full_kv_indices', 'full_kv_num_blocks')):
            n = getattr(ref, count)
            keep = torch.arange(getattr(ref, name).shape[-1], device=DEVICE) < n[..., None]
            assert torch.equal(getattr(ours, name)[keep], getattr(ref, name)[keep]), (name, chunk)
        assert torch.equal(ours.to_dense(), ref.to_dense())
        assert ours.seq_lengths == ref.seq_lengths == (T, T)
