"""The CPU suites' specifications on a CUDA device: the Triton kernels compiled for real (not the
interpreter) against the fp64 oracles of test_kernels.py / test_lmhead.py, the model and sampler on
CUDA in bf16 and fp32, the compiled decode. Skipped without CUDA; bench/gpu_check.py runs them (with
TRITON_INTERPRET=0). Data are built on the CPU by the CPU suites' own functions (same seeds) and
moved over, so both suites check the same cases.
"""
import os

import pytest
import torch

# GRPO_CUDA_TESTS_DEVICE=cpu: a dry run of these tests' own code on the CPU (kernels then take their
# torch paths)
DEV = os.environ.get('GRPO_CUDA_TESTS_DEVICE', 'cuda')
pytestmark = [pytest.mark.skipif(DEV == 'cuda' and not torch.cuda.is_available(),
                                 reason='no CUDA device'),
              pytest.mark.filterwarnings('ignore::RuntimeWarning')]


def cuda(*xs):
    return [x.to(DEV) if isinstance(x, torch.Tensor) else x for x in xs]


@pytest.fixture(autouse=True)
def compiled_triton():
    """These tests mean the compiled kernels: refuse to run them under the interpreter."""
    if DEV == 'cuda' and os.environ.get('TRITON_INTERPRET', '0') not in ('0', ''):
        pytest.skip('TRITON_INTERPRET is on: run with TRITON_INTERPRET=0 (bench/gpu_check.py does)')


# ------------------------------------------------------------------------- fused log-prob + entropy


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('temperature', [1.0, 0.7])
def test_token_logprobs_kernel_matches_fp64(dtype, temperature):
    from logprob_kernels import token_logprobs
    from test_kernels import close, data, grads, oracle
    logits, targets, a, b = cuda(*data(shape=(4, 33), dtype=dtype))
    lp, ent = token_logprobs(logits, targets, temperature)  # CUDA: Triton by default
    ref_lp, ref_ent = oracle(logits, targets, temperature)
    close(lp, ref_lp, 'log p(target)')
    close(ent, ref_ent, 'entropy')
    g = grads(token_logprobs, logits, targets, a, b, temperature)
    ref = grads(lambda x, t, T: oracle(x, t, T), logits.double(), targets, a, b, temperature)
    assert g.dtype == dtype
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-4)
    torch.testing.assert_close(g.double(), ref, **tol)


def test_token_logprobs_at_qwen_vocabulary():
    """151,936 columns: many blocks per row, a ragged last one."""
    from logprob_kernels import token_logprobs
    from test_kernels import oracle
    g = torch.Generator(device=DEV).manual_seed(0)
    logits = (3 * torch.randn(64, 151_936, device=DEV, generator=g)).bfloat16()
    targets = torch.randint(0, 151_936, (64,), device=DEV, generator=g)
    lp, ent = token_logprobs(logits, targets, 1.0)
    ref_lp, ref_ent = oracle(logits, targets)
    # fp32 sums over 151,936 terms: about 1e-4 relative (the CPU torch path is as far from fp64)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=3e-4, atol=1e-3)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=3e-4, atol=1e-3)


# ----------------------------------------------------------------------------- tiled LM head


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_lm_head_kernel_matches_fp64(dtype):
    from logprob_kernels import lm_head_logprobs
    from test_lmhead import TILES, close, data, oracle, run
    hidden, weight, targets, mask, a, b = cuda(*data(dtype))
    got = run(lm_head_logprobs, hidden, weight, targets, 0.9, mask, a=a, b=b, tiles=TILES,
              head_fp32=True)
    ref = run(oracle, hidden.double(), weight.double(), targets, 0.9, mask, a=a, b=b)
    close(got[0], ref[0], 'log p(target)')
    close(got[1], ref[1], 'entropy')
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, x, y in zip(('dhidden', 'dweight'), got[2:], ref[2:]):
        torch.testing.assert_close(x.double(), y, rtol=tol, atol=tol, msg=lambda m: f'{name}: {m}')


def test_lm_head_default_tiles_at_qwen_shape():
    """The CUDA default tiles (4,096 tokens x 16,384 vocabulary) at Qwen2.5-0.5B's head, bf16 under
    autocast, fp32 head: against log_softmax of the full fp32 logits."""
    from logprob_kernels import lm_head_logprobs
    g = torch.Generator(device=DEV).manual_seed(0)
    h = torch.randn(5000, 896, device=DEV, generator=g).bfloat16()
    w = (torch.randn(151_936, 896, device=DEV, generator=g) * 0.05).bfloat16()
    t = torch.randint(0, 151_936, (5000,), device=DEV, generator=g)
    lp, ent = lm_head_logprobs(h, w, t, 1.0, head_fp32=True)
    logq = torch.log_softmax(h.float() @ w.float().t(), -1)
    torch.testing.assert_close(lp, logq.gather(-1, t[:, None])[:, 0], rtol=0, atol=2e-4)
    torch.testing.assert_close(ent, -(logq.exp() * logq).sum(-1), rtol=0, atol=2e-4)


# ----------------------------------------------------------------------------- sampler


@pytest.mark.parametrize('cfg', [dict(temperature=1.0), dict(top_p=0.7),
                                 dict(top_k=10, top_p=0.8, temperature=0.8), dict(min_p=0.2),
                                 dict(temperature=0.0)], ids=str)
def test_sampler_kernel_draws_the_torch_reference_ids(cfg):
    from sample_kernels import sample_tokens, sample_tokens_ref
    from test_kernels import close, random_rows
    logits, seeds = random_rows()
    ref_ids, ref_lp = sample_tokens_ref(logits, seeds, 3, **cfg)
    ids, lp = sample_tokens(logits.to(DEV), seeds.to(DEV), 3, **cfg)
    assert torch.equal(ids.cpu(), ref_ids), \
        f'{(ids.cpu() != ref_ids).sum()} of {len(ids)} ids differ'
    close(lp.cpu(), ref_lp, 'sampled log p')


# ------------------------------------------------------------------------------------- objectives


OBJECTIVES = [dict(loss_type='grpo', clip_ratio_c=3.0), dict(loss_type='gspo'),
              dict(loss_type='cispo', cispo_bounds='both'), dict(loss_type='sapo'),
              dict(loss_type='grpo', tis='sequence_mask', off_policy_mask=0.05),
              dict(loss_type='vespo', tis='token_truncate', off_policy_mask=0.05)]


@pytest.mark.parametrize('cfg', OBJECTIVES, ids=str)
def test_objectives_on_cuda_equal_the_cpu(cfg):
    """Each objective variant, with the KL and entropy terms, truncated importance sampling and the
    off-policy mask, computes on CUDA the loss and gradient it computes on the CPU (fp32, the
    same inputs): no tensor of the loss is left on the CPU, none differs."""
    from loss import off_policy_keep, policy_loss, tis_weights
    g = torch.Generator().manual_seed(4)
    lens = torch.tensor([3, 5, 1, 4])
    n = int(lens.sum())
    gen = -torch.rand(n, generator=g) * 3  # the sampler's log-probs
    logp = gen + 0.3 * torch.randn(n, generator=g)  # the policy's now: off-policy by ~0.3
    old, ref = gen + 0.1 * torch.randn(n, generator=g), gen + 0.2 * torch.randn(n, generator=g)
    seq_adv = torch.tensor([1.0, -1.5, 0.5, -0.5])
    ent = torch.rand(n, generator=g) * 2
    knobs = {k: v for k, v in cfg.items() if k not in ('tis', 'off_policy_mask')}

    def loss_and_grad(dev):
        lp = logp.to(dev).requires_grad_()
        ln = lens.to(dev)
        is_w = keep = None
        if 'tis' in cfg:
            is_w = tis_weights(old.to(dev), gen.to(dev), ln, cfg['tis'], 2.0, floor=0.9)[0]
        if 'off_policy_mask' in cfg:
            keep = off_policy_keep(lp, gen.to(dev), seq_adv.to(dev), ln, cfg['off_policy_mask'])
        adv = torch.repeat_interleave(seq_adv, lens).to(dev)
        w = torch.full((n,), 1.0 / n, device=dev)
        loss, _ = policy_loss(lp, old.to(dev), adv, w, ln, eps_low=0.2, eps_high=0.28,
                              ref_logp=ref.to(dev), beta=0.05, entropy=ent.to(dev),
                              entropy_coef=0.01, is_weight=is_w, pg_mask=keep, **knobs)
        loss.backward()
        return loss.detach().cpu(), lp.grad.cpu()

    loss_cpu, grad_cpu = loss_and_grad('cpu')
    loss_dev, grad_dev = loss_and_grad(DEV)
    assert grad_cpu.abs().sum() > 0, 'no gradient: the case tests nothing'
    torch.testing.assert_close(loss_dev, loss_cpu, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_dev, grad_cpu, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------ model and sampler on CUDA


def test_model_bf16_on_cuda_is_close_to_fp32_and_cached_decode_agrees():
    from model import KVCache
    from test_sample import tiny
    ref_model = tiny()
    low = tiny().to(device=DEV, dtype=torch.bfloat16)
    idx = torch.randint(0, 256, (3, 21), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ref = ref_model(idx).float()
        out = low(idx.to(DEV)).float().cpu()
        scale = ref.abs().max().item()
        assert (out - ref).abs().max() <= 0.05 * scale, 'bf16 CUDA logits far from fp32 CPU'
        cache = KVCache(low.config, 3, 21, torch.bfloat16, DEV)
        steps = [low(idx[:, :13].to(DEV), kv_cache=cache)]
        steps += [low(idx[:, t:t + 1].to(DEV), kv_cache=cache) for t in range(13, 21)]
        cached = torch.cat(steps, 1).float().cpu()
        assert (cached - ref).abs().max() <= 0.05 * scale, 'bf16 cached decode differs'


def test_greedy_generation_on_cuda_equals_uncached_fp32():
    from sample import generate
    from test_sample import PROMPTS, TOK, naive_greedy, tiny
    out = generate(tiny().to(DEV), TOK, PROMPTS, 1, 20, temperature=0.0, stop_ids=[])
    cpu_model = tiny()  # the same seed: the same weights
    for p, o in zip(PROMPTS, out):
        assert o['ids'] == naive_greedy(cpu_model, p, 20)[0], \
            'CUDA cached greedy differs from CPU uncached'


def test_compiled_decode_on_cuda_generates_as_eager():
    from sample import generate
    from test_sample import PROMPTS, TOK, tiny
    model = tiny().to(DEV)
    stops = [ord(c) for c in 'aeiou ']
    a = generate(model, TOK, PROMPTS, 4, 24, temperature=1.0, seed=3, stop_ids=stops)
    b = generate(model, TOK, PROMPTS, 4, 24, temperature=1.0, seed=3, stop_ids=stops, compile=True)
    assert [x['ids'] for x in a] == [x['ids'] for x in b], \
        'the compiled forward changed the completions on CUDA'


def test_graph_decode_on_cuda_generates_as_eager():
    """graphs=True on CUDA: decode steps captured as CUDA graphs (mode='reduce-overhead') draw the
    same tokens as eager through compaction to smaller buckets, checking every 8 steps, in three
    calls that reuse the graphs and the static caches of the first. And really captured: torch
    falls back to running a compiled graph without a CUDA graph (a warning, a counter) when it
    mutates an input that has no static address, or holds a CPU tensor."""
    from torch._dynamo.utils import counters

    from sample import generate
    from test_sample import PROMPTS, TOK, tiny
    torch._dynamo.reset()  # graphs another test compiled would be reused, not counted
    counters.clear()
    model = tiny().to(DEV)
    stops = list(range(97, 123)) + list(range(128, 256))  # on the CPU: 9 of 12 rows stop early
    for seed in (5, 7, 5):  # the later calls replay the graphs (and caches) the first captured
        a = generate(model, TOK, PROMPTS, 4, 48, temperature=1.0, seed=seed, stop_ids=stops,
                     check_every=1)
        b = generate(model, TOK, PROMPTS, 4, 48, temperature=1.0, seed=seed, stop_ids=stops,
                     graphs=True, check_every=8)
        assert [x['ids'] for x in a] == [x['ids'] for x in b], \
            'the captured decode step changed the completions on CUDA'
    assert counters['inductor']['cudagraph_skips'] == 0, 'decode steps ran without a CUDA graph'


def test_bf16_generation_on_cuda_runs_and_stops():
    from sample import generate
    from test_sample import PROMPTS, TOK, tiny
    model = tiny().to(device=DEV, dtype=torch.bfloat16)
    out = generate(model, TOK, PROMPTS, 2, 16, temperature=1.0, seed=1)
    assert len(out) == 6 and all(1 <= len(o['ids']) <= 16 for o in out)
    assert all(torch.isfinite(torch.tensor(o['logprobs'])).all() for o in out)


def test_compiled_update_on_cuda_equals_eager():
    """compile=True's training forward (parallel.wrap: torch.compile, dynamic shapes) on packed
    groups through FlexAttention, the LM head kernel outside the graph: log-probs, entropies and
    every gradient as eager's (fp32), and groups of other lengths build no new graph. Last in the
    file: bench/gpu_check.py's tests part, cut at its share, loses only this one. (The CPU dry run
    traces with Dynamo alone, over SDPA: an Inductor compile there costs a minute.)"""
    from torch._dynamo.utils import counters

    import parallel
    from batch import completion_logprobs
    from test_flex import group_rows, tiny
    model = tiny('qwen2').to(DEV)
    model.packed_attention = 'flex' if DEV == 'cuda' else 'sdpa'
    net = (parallel.wrap(model, DEV, False, True) if DEV == 'cuda'
           else torch.compile(model, backend='eager', dynamic=True))

    def run(net, rows, compiled):
        model.zero_grad(set_to_none=True)
        lp, ent = completion_logprobs(net, rows, 0, 0.9, share_prompt=True, compiled=compiled)
        w = torch.randn(len(lp), generator=torch.Generator().manual_seed(2)).to(DEV)
        (w * lp + 0.1 * ent).sum().backward()
        return [lp.detach(), ent.detach()] + [p.grad.clone() for p in model.parameters()]

    rows = group_rows()
    for a, b in zip(run(model, rows, False), run(net, rows, True)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    graphs = counters['stats']['unique_graphs']
    run(net, group_rows(plens=(41, 12, 3), G=(6, 5, 4), seed=3), True)
    assert counters['stats']['unique_graphs'] == graphs, 'other lengths compiled a new graph'
