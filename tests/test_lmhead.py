"""Specification of the tiled LM head, logprob_kernels.lm_head_logprobs: log p(target) and entropy of
softmax(hidden @ weight.T / T) and their gradients, without ever holding [tokens x vocabulary].

Every numeric test runs twice: the torch tile fold (the CPU training path) and the Triton fold
(forced, under TRITON_INTERPRET=1). The oracle is fp64 log_softmax of the whole logits, written
here, independent of logprob_kernels.py. Sizes are small and ragged: 27 tokens in tiles of 8, vocabulary 133
in tiles of 48.
"""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from logprob_kernels import lm_head_logprobs, token_logprobs

pytestmark = pytest.mark.filterwarnings('ignore::RuntimeWarning:triton.runtime.interpreter')

TILES = (8, 48)
IMPLS = [pytest.param(True, id='triton'), pytest.param(False, id='torch')]


def data(dtype=torch.float32, seed=0, masked=True, V=133, D=16):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 9, D, generator=g, dtype=torch.float64).to(dtype)
    # logits of std ~2
    weight = (torch.randn(V, D, generator=g, dtype=torch.float64) / 2).to(dtype)
    targets = torch.randint(0, V, (3, 9), generator=g)
    mask = torch.rand(3, 9, generator=g) < 0.7 if masked else None
    if masked:
        mask[0, 0], mask[0, 1] = True, False
        targets = targets.masked_fill(~mask, -100)  # padding ids may be anything, even out of range
    a = torch.randn(3, 9, generator=g, dtype=torch.float64)
    b = torch.randn(3, 9, generator=g, dtype=torch.float64)
    return hidden, weight, targets, mask, a, b


def oracle(hidden, weight, targets, temperature=1.0, mask=None):
    """fp64 log p(target) and entropy from the whole logits; masked tokens give 0."""
    logq = torch.log_softmax(hidden.double() @ weight.double().t() / temperature, -1)
    logp = logq.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    entropy = -(logq.exp() * logq).sum(-1)
    if mask is not None:
        logp, entropy = logp * mask, entropy * mask
    return logp, entropy


def run(fn, hidden, weight, targets, temperature, mask, *, a, b, **kw):
    """Outputs and the gradients of sum(a * logp + b * entropy) w.r.t. hidden and weight."""
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    logp, ent = fn(h, w, targets, temperature, mask, **kw)
    (a * logp + b * ent).sum().backward()
    return logp, ent, h.grad, w.grad


def close(actual, expected, what, tol=1e-5):
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol,
                               msg=lambda m: f'{what}: {m}')


@pytest.mark.parametrize('use_triton', IMPLS)
@pytest.mark.parametrize('temperature', [1.0, 0.7])
def test_outputs_and_gradients_match_fp64(use_triton, temperature):
    hidden, weight, targets, mask, a, b = data()
    got = run(lm_head_logprobs, hidden, weight, targets, temperature, mask, a=a, b=b, tiles=TILES,
              use_triton=use_triton)
    ref = run(oracle, hidden, weight, targets, temperature, mask, a=a, b=b)
    assert got[0].dtype == got[1].dtype == torch.float32 and got[0].shape == targets.shape
    for name, x, y in zip(('log p(target)', 'entropy', 'dhidden', 'dweight'), got, ref):
        close(x, y, f'T={temperature} {name}')
    assert (got[0][~mask] == 0).all() and (got[1][~mask] == 0).all(), 'masked tokens must output 0'
    assert (got[2][~mask] == 0).all(), 'masked tokens must get exactly zero gradient'


@pytest.mark.parametrize('use_triton', IMPLS)
def test_one_output_alone(use_triton):
    """Only log-probs, or only the entropy, in the loss: the other output's missing gradient counts
    as zero."""
    hidden, weight, targets, mask, a, b = data(masked=False)
    for wa, wb, what in ((a, 0 * b, 'log p alone'), (0 * a, b, 'entropy alone')):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp, ent = lm_head_logprobs(h, w, targets, 0.9, tiles=TILES, use_triton=use_triton)
        ((wa * logp).sum() if what == 'log p alone' else (wb * ent).sum()).backward()
        ref = run(oracle, hidden, weight, targets, 0.9, None, a=wa, b=wb)
        close(h.grad, ref[2], f'{what}: dhidden')
        close(w.grad, ref[3], f'{what}: dweight')


@pytest.mark.parametrize('use_triton', IMPLS)
def test_bf16_projection(use_triton):
    """bf16 hidden and weight, head_fp32=False: the projection runs in bf16, so the oracle is fp64
    softmax of the logits rounded to bf16; the softmax math itself is fp32. Gradients come back in
    bf16."""
    hidden, weight, targets, mask, a, b = data(torch.bfloat16)
    got = run(lm_head_logprobs, hidden, weight, targets, 0.8, mask, a=a, b=b, tiles=TILES,
              use_triton=use_triton)
    logits = (hidden.float() @ weight.float().t()).bfloat16().double().requires_grad_()
    logq = torch.log_softmax(logits / 0.8, -1)
    lp = logq.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask
    ent = -(logq.exp() * logq).sum(-1) * mask
    close(got[0], lp, 'bf16 log p(target)', tol=1e-4)
    close(got[1], ent, 'bf16 entropy', tol=1e-4)
    assert got[2].dtype == got[3].dtype == torch.bfloat16, (
        'gradients must come back in the inputs\' dtype')
    ref = run(oracle, hidden.double(), weight.double(), targets, 0.8, mask, a=a, b=b)
    torch.testing.assert_close(got[2].double(), ref[2], rtol=3e-2, atol=3e-2,
                               msg=lambda m: f'bf16 dhidden: {m}')
    torch.testing.assert_close(got[3].double(), ref[3], rtol=3e-2, atol=3e-2,
                               msg=lambda m: f'bf16 dweight: {m}')


@pytest.mark.parametrize('use_triton', IMPLS)
def test_bf16_inputs_with_fp32_head(use_triton):
    """head_fp32: bf16 inputs, projection and softmax in fp32, so the outputs are as exact as for
    fp32 inputs (against the fp64 oracle of the bf16 values), under bf16 autocast too."""
    hidden, weight, targets, mask, a, b = data(torch.bfloat16)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        got = run(lm_head_logprobs, hidden, weight, targets, 1.3, mask, a=a, b=b, tiles=TILES,
                  use_triton=use_triton, head_fp32=True)
    ref = run(oracle, hidden.double(), weight.double(), targets, 1.3, mask, a=a, b=b)
    close(got[0], ref[0], 'fp32 head log p(target)')
    close(got[1], ref[1], 'fp32 head entropy')
    torch.testing.assert_close(got[2].double(), ref[2], rtol=1e-2, atol=1e-2,
                               msg=lambda m: f'dhidden: {m}')
    torch.testing.assert_close(got[3].double(), ref[3], rtol=1e-2, atol=1e-2,
                               msg=lambda m: f'dweight: {m}')


class MaxNumel(TorchDispatchMode):
    """Records the largest tensor any op creates (forward and, on CPU, backward run in this
    thread)."""
    def __init__(self):
        super().__init__()
        self.max = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.max = max(self.max, t.numel())
        return out


def test_never_holds_tokens_by_vocabulary():
    """No tensor as large as the logits: only tiles, the weight and its gradient (vocabulary 400 x
    hidden 8 here, smaller than 27 tokens x 400)."""
    hidden, weight, targets, mask, a, b = data(masked=False, V=400, D=8)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with MaxNumel() as mode:
        logp, ent = lm_head_logprobs(h, w, targets, 1.0, tiles=TILES)
        (logp + ent).sum().backward()
    assert mode.max >= TILES[0] * TILES[1], (
        'the op tracker saw no tile: it is not observing the computation')
    assert mode.max < targets.numel() * weight.shape[0], (
        f'a tensor of {mode.max} elements: logits-sized')


class BigTensors(TorchDispatchMode):
    """The distinct storages of at least `nbytes` bytes that ops create (views and detach() share
    one; the Triton interpreter's byte copies of the tile count by their bytes too)."""
    def __init__(self, nbytes):
        super().__init__()
        self.nbytes, self.storages = nbytes, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor) and t.nbytes >= self.nbytes:
                self.storages.add(t.untyped_storage().data_ptr())
        return out


@pytest.mark.parametrize('use_triton', IMPLS)
def test_accumulates_into_existing_grad(use_triton):
    """A later micro-batch adds its weight gradient straight into weight.grad: backward creates no
    second tensor of the weight's size; the first creates exactly one, which becomes .grad. With a
    tied embedding adding its own share, two micro-batches sum to the fp64 gradient."""
    hidden, weight, targets, mask, a, b = data(V=400, D=8)
    w = weight.clone().requires_grad_()
    for i in range(2):
        logp, ent = lm_head_logprobs(hidden, w, targets, 0.8, mask, tiles=(16, 128),
                                     use_triton=use_triton)
        with BigTensors(w.nbytes) as mode:
            (a * logp + b * ent).sum().backward()
        assert len(mode.storages) == (1 if i == 0 else 0), (
            f'micro-batch {i}: backward made {len(mode.storages)} weight-sized buffers '
            '(a second one beside .grad)')
    ids = torch.randint(0, weight.shape[0], (3, 9), generator=torch.Generator().manual_seed(9))
    w = weight.clone().requires_grad_()
    wd = weight.double().requires_grad_()
    # hidden depends on the tied weight through an embedding lookup, as in the model
    for hid in (hidden, 2 * hidden):
        logp, ent = lm_head_logprobs(hid + F.embedding(ids, w), w, targets, 0.8, mask,
                                     tiles=(16, 128), use_triton=use_triton)
        (a * logp + b * ent).sum().backward()
        lp, ent = oracle(hid.double() + F.embedding(ids, wd), wd, targets, 0.8, mask)
        (a * lp + b * ent).sum().backward()
    close(w.grad, wd.grad, 'two micro-batches, tied weight: accumulated dweight')


def test_leaves_grad_alone_under_autograd_grad_and_hooks():
    """torch.autograd.grad must not touch .grad, and a tensor hook on the weight must see the whole
    gradient: both rule out adding into .grad directly."""
    hidden, weight, targets, mask, a, b = data()
    ref = run(oracle, hidden, weight, targets, 1.0, mask, a=a, b=b)[3]
    w = weight.clone().requires_grad_()
    w.grad = torch.ones_like(w)
    logp, ent = lm_head_logprobs(hidden, w, targets, 1.0, mask, tiles=TILES)
    (dw,) = torch.autograd.grad((a * logp + b * ent).sum(), [w])
    assert (w.grad == 1).all(), 'autograd.grad changed weight.grad'
    close(dw, ref, 'autograd.grad dweight')
    w.register_hook(lambda g: 2 * g)
    logp, ent = lm_head_logprobs(hidden, w, targets, 1.0, mask, tiles=TILES)
    (a * logp + b * ent).sum().backward()
    close(w.grad, 1 + 2 * ref, 'dweight through a hook that doubles it')


def test_grpo_step_gradient_equals_full_logits_path(monkeypatch):
    """Through batch.completion_logprobs, in two micro-batches of packed groups (tied embedding,
    temperature 0.7): the policy gradient of a GRPO-like loss (advantage-weighted log-probs plus an
    entropy bonus) equals the old path's (whole logits, then token_logprobs) to 1e-6 relative, and
    so do the no-grad log-probs."""
    import batch
    from model import GPT, ModelConfig
    cfg = ModelConfig(vocab_size=300, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                      intermediate_size=64, max_seq_len=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(1)
    micro = []
    for mb in range(2):
        rows = []
        for group in range(2):
            n_prompt = int(torch.randint(2, 8, (1,), generator=g))
            prompt = torch.randint(0, 300, (n_prompt,), generator=g).tolist()
            for _ in range(3):
                n = int(torch.randint(1, 9, (1,), generator=g))
                ids = torch.randint(0, 300, (n,), generator=g).tolist()
                rows.append({'prompt': prompt, 'ids': ids, 'group': 2 * mb + group,
                             'adv': float(torch.randn(1, generator=g))})
        micro.append(rows)

    current = {}  # the micro-batch being scored, for the reference head

    def grads_and_logps():
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            nograd = []
            for rows in micro:
                current['rows'] = rows
                nograd.append(batch.completion_logprobs(model, rows, 0, 0.7, tiles=(8, 64))[0])
        for rows in micro:
            current['rows'] = rows
            logp, ent = batch.completion_logprobs(model, rows, 0, 0.7, tiles=(8, 64))
            adv = torch.tensor([r['adv'] for r in rows for _ in r['ids']])
            (-(adv * logp).sum() / len(adv) - 0.01 * ent.mean()).backward()
        return [p.grad.clone() for p in model.parameters()], nograd

    # the old path; its own targets (row-major) and temperature
    def full_logits_head(h, w, *args, **kwargs):
        targets = torch.tensor([t for r in current['rows'] for t in r['ids']])
        return token_logprobs(F.linear(h.float(), w.float()), targets, 0.7)

    got, got_lp = grads_and_logps()
    monkeypatch.setattr(batch, 'lm_head_logprobs', full_logits_head)
    ref, ref_lp = grads_and_logps()
    for (name, _), x, y in zip(model.named_parameters(), got, ref):
        rel = ((x - y).norm() / y.norm()).item()
        assert rel <= 1e-6, (
            f'{name}: gradient differs from the full-logits path by {rel:.1e} (relative)')
    for x, y in zip(got_lp, ref_lp):
        close(x, y, 'no-grad log-probs vs the full-logits path', tol=1e-6)
