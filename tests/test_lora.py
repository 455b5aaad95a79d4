"""LoRA (lora.py) on tiny random Qwen2 / Qwen3 / Llama 3 / GPT-2 snapshots written here by
transformers: identity at init, adapters off = the base exactly, merged export = the adapter
forward, peft loads out_dir/lora on the base snapshot, and GRPO runs with LoRA that learn, touch
only the adapters and resume exactly."""
import json
import math
import re

import pytest
import torch

import hf as H
import lora as L
from sample import sampler_model
from test_model import HF_CONFIGS as MODEL_CONFIGS, perturbed_hf
from test_model_families import HF_CONFIGS as FAMILY_CONFIGS
from test_train import metrics, run, run_together, stable, weights

transformers = pytest.importorskip('transformers')
peft = pytest.importorskip('peft')

V = 300
CONFIGS = {'qwen2': MODEL_CONFIGS['qwen2_gqa_tied'], 'qwen3': FAMILY_CONFIGS['qwen3'],
           'llama3': FAMILY_CONFIGS['llama3'], 'olmo2': FAMILY_CONFIGS['olmo2'],
           'phi3': FAMILY_CONFIGS['phi3'], 'gemma3': FAMILY_CONFIGS['gemma3'], 'gpt2': MODEL_CONFIGS['gpt2']}
RANK = 4
ALPHA = 8.0  # scale 2: a wrong scale shows


@pytest.fixture(scope='module', params=list(CONFIGS))
def snapshot(request, tmp_path_factory):
    """(snapshot dir written by transformers, the transformers model)"""
    hf = perturbed_hf(*CONFIGS[request.param])
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return path, hf


def ids(seed=1, shape=(2, 24)):
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


def with_lora(path, targets='all-linear', perturb=True):
    """Our model from the snapshot with adapters; perturb: B (and A) moved off their init, so the
    adapters matter."""
    model, _ = H.from_pretrained(path)
    L.apply(model.eval(), RANK, ALPHA, 0.0, targets, seed=0)
    if perturb:
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if '.lora_' in n:
                    p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def maxdiff(a, b):
    return (a.float() - b.float()).abs().max().item()


@torch.no_grad()
def test_identity_at_init(snapshot):
    path, _ = snapshot
    base, _ = H.from_pretrained(path)
    model = with_lora(path, perturb=False)
    x = ids()
    assert torch.equal(model(x), base.eval()(x)), \
        "a fresh adapter (B = 0) must not change the logits"
    A = [p for n, p in model.named_parameters() if '.lora_A.' in n]
    B = [p for n, p in model.named_parameters() if '.lora_B.' in n]
    assert A and all(a.abs().sum() > 0 for a in A)
    assert all(torch.equal(b, torch.zeros_like(b)) for b in B)
    # kaiming-uniform with a = sqrt(5): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    bound = 1 / math.sqrt(A[0].shape[1])
    assert all(a.abs().max() <= bound for a in A) and A[0].abs().max() > 0.8 * bound


@torch.no_grad()
def test_adapters_disabled_is_the_base_exactly(snapshot):
    path, _ = snapshot
    base, _ = H.from_pretrained(path)
    model = with_lora(path)
    x = ids()
    on = model(x)
    assert maxdiff(on, base.eval()(x)) > 1e-3, "the perturbed adapters must change the logits"
    with L.disabled(model):
        assert torch.equal(model(x), base(x)), "adapters off must be the base model, bit for bit"
    assert torch.equal(model(x), on), "leaving disabled() must turn the adapters back on"
    with pytest.raises(RuntimeError):
        with L.disabled(model):
            raise RuntimeError
    assert torch.equal(model(x), on), \
        "an exception inside disabled() must still turn the adapters back on"


@torch.no_grad()
def test_merged_export_equals_the_adapter_forward(snapshot, tmp_path):
    path, _ = snapshot
    model = with_lora(path)
    x = ids()
    merged_sd = L.merged_state(model, model.state_dict())
    H.save_pretrained(model, None, tmp_path / 'hf', state_dict=merged_sd)
    merged, _ = H.from_pretrained(tmp_path / 'hf')
    d = maxdiff(merged.eval()(x), model(x))
    print(f'{model.config.arch}: merged export vs adapter forward max |diff| {d:.2e}')
    assert d <= 1e-5, f"merged export differs from the adapter forward by {d:.2e}"


@torch.no_grad()
def test_peft_loads_the_adapter_directory(snapshot, tmp_path):
    """peft.PeftModel.from_pretrained(the base snapshot in transformers, out/lora) computes our
    merged model's logits."""
    path, _ = snapshot
    model = with_lora(path)
    x = ids()
    sd = model.state_dict()
    L.save_peft(model, L.adapter_state(model, sd), tmp_path / 'lora', str(path))
    H.save_pretrained(model, None, tmp_path / 'hf', state_dict=L.merged_state(model, sd))
    base = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    pm = peft.PeftModel.from_pretrained(base, tmp_path / 'lora').eval()
    n_pairs = sum(len(m.lora_A) for _, m in L.adapters(model))
    loaded = {k: v for k, v in peft.get_peft_model_state_dict(pm).items()}
    assert len(loaded) == 2 * n_pairs, \
        f"peft holds {len(loaded)} adapter tensors, we wrote {2 * n_pairs}"
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'hf').eval()
    d = maxdiff(pm(x).logits, merged(x).logits)
    print(f'{model.config.arch}: peft on the base vs our merged export max |diff| {d:.2e}')
    assert d <= 1e-4, f"peft's adapter model differs from our merged export by {d:.2e}"
    assert maxdiff(pm(x).logits, model(x)) <= 1e-4
    cfg = json.load(open(tmp_path / 'lora' / 'adapter_config.json'))
    assert cfg['r'] == RANK and cfg['lora_alpha'] == ALPHA
    assert cfg['base_model_name_or_path'] == str(path)


@torch.no_grad()
def test_some_targets_only(tmp_path):
    """q_proj and v_proj only: k's rows of the fused c_attn get no adapter, and export and peft stay
    exact."""
    path = tmp_path / 'snap'
    perturbed_hf(*CONFIGS['qwen3']).save_pretrained(path)
    model = with_lora(path, 'q_proj,v_proj')
    x = ids()
    adapted = [k.rsplit('.', 1)[1] for k in L.adapter_state(model, model.state_dict())]
    assert sorted(adapted) == sorted(['q_proj', 'v_proj'] * 4)
    sd = model.state_dict()
    L.save_peft(model, L.adapter_state(model, sd), tmp_path / 'lora', str(path))
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(path)
    pm = peft.PeftModel.from_pretrained(hf_base, tmp_path / 'lora')
    assert maxdiff(pm.eval()(x).logits, model(x)) <= 1e-4
    with pytest.raises(ValueError, match='c_attn'):
        L.apply(H.from_pretrained(path)[0], RANK, ALPHA, 0.0, 'q_proj,c_attn', seed=0)


def test_only_adapters_train_and_the_sampler_copy_is_merged(tmp_path):
    """Backward reaches the adapters only; AdamW holds them alone; an update leaves every base
    weight bit-identical; the low-precision sampler copy then holds the merged weights."""
    path = tmp_path / 'snap'
    perturbed_hf(*CONFIGS['llama3']).save_pretrained(path)
    model = with_lora(path, perturb=False).train()
    base = {k: v.clone() for k, v in model.state_dict().items() if '.lora_' not in k}
    opt = torch.optim.AdamW(L.param_groups(model, 0.1), lr=1e-2)
    assert {id(p) for g in opt.param_groups for p in g['params']} == \
        {id(p) for n, p in model.named_parameters() if '.lora_' in n}
    gen, sync = sampler_model(model, torch.bfloat16, fsdp=False)
    assert not L.adapters(gen) and gen is not model
    for _ in range(2):
        model(ids()).logsumexp(-1).mean().backward()
        assert all((p.grad is not None) == ('.lora_' in n) for n, p in model.named_parameters())
        opt.step()
        opt.zero_grad()
    sd = model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in base.items()), "a base weight changed"
    Bs = [v for k, v in sd.items() if '.lora_B.' in k]
    assert any(not torch.equal(v, torch.zeros_like(v)) for v in Bs), "nothing trained"
    sync()
    want = {k: v.to(torch.bfloat16) for k, v in L.merged_state(model, sd).items()}
    assert all(torch.equal(gen.state_dict()[k], v) for k, v in want.items()), \
        "the sampler is not the merged model"


@torch.no_grad()
def bf16_snapshot(name, path):
    """A snapshot stored in bf16, as Qwen and Llama publish theirs."""
    perturbed_hf(*CONFIGS[name]).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.mark.parametrize('name', list(CONFIGS))
def test_a_bf16_base_computes_as_the_fp32_one(name, tmp_path):
    """lora_base_dtype='bfloat16' on a bf16 snapshot: the frozen matrices stored in bf16 (norms,
    biases, adapters fp32), and under bf16 autocast the logits, the fused head's log-probs and
    entropies, and every adapter's gradient equal the fp32 base's bit for bit; the merged export is
    fp32 and equal too."""
    from batch import completion_logprobs
    path = bf16_snapshot(name, tmp_path)
    models = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, _ = H.from_pretrained(path)
        L.apply(model.train(), RANK, ALPHA, 0.0, 'all-linear', seed=0, base_dtype=dtype)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if '.lora_' in n:
                    p.add_(torch.randn(p.shape, generator=g) * 0.1)
        models[dtype] = model
    low = models[torch.bfloat16]
    for n, p in low.named_parameters():
        want = torch.bfloat16 if p.dim() >= 2 and '.lora_' not in n else torch.float32
        assert p.dtype == want, f"{n} stored in {p.dtype}, expected {want}"
    x = ids()
    rows = [{'prompt': x[0, :10].tolist(), 'ids': x[0, 10:].tolist()},
            {'prompt': x[1, :6].tolist(), 'ids': x[1, 6:].tolist()}]
    got = {}
    for dtype, model in models.items():
        with torch.autocast('cpu', dtype=torch.bfloat16):
            logits = model(x)
        lp, ent = completion_logprobs(model, rows, 0, 0.7, share_prompt=False, dtype=torch.bfloat16)
        (logits.float().logsumexp(-1).mean() + lp.sum() + ent.sum()).backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        got[dtype] = (logits, lp, ent, grads)
    (l32, lp32, e32, g32), (l16, lp16, e16, g16) = got[torch.float32], got[torch.bfloat16]
    assert torch.equal(l32, l16), f"logits differ by {maxdiff(l32, l16):.2e}"
    assert torch.equal(lp32, lp16) and torch.equal(e32, e16), \
        f"head log-probs differ by {maxdiff(lp32, lp16):.2e}, entropies by {maxdiff(e32, e16):.2e}"
    assert g32.keys() == g16.keys() and all('.lora_' in n for n in g16)
    bad = [n for n in g32 if not torch.equal(g32[n], g16[n])]
    assert not bad, f"adapter gradients differ: {bad[:3]}"
    m32 = L.merged_state(models[torch.float32], models[torch.float32].state_dict())
    m16 = L.merged_state(low, low.state_dict())
    merged = [n for n, _ in L.adapters(low)]
    assert all(m16[n + '.weight'].dtype == torch.float32 for n in merged), "merged weights rounded to bf16"
    assert all(torch.equal(m32[k], m16[k].to(m32[k].dtype)) for k in m32)


# ------------------------------------------------------ GRPO runs (test_train.py's tiny runs)
LORA = ['--lora_rank=4', '--lora_alpha=8']
TINY_QWEN2 = ('Qwen2Config', dict(vocab_size=260, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                  max_position_embeddings=256, tie_word_embeddings=True))


def write_base(path, seed=0, dtype=torch.float32):
    """A tiny Qwen2 snapshot with the byte tokenizer for test_train's runs, its weights stored in
    dtype. Its embeddings are scaled up 4x: the frozen tied head of a random model with N(0, 0.05)
    embeddings spans logits of about +-0.6, so no adapter on the blocks could make digits likely; 4x
    gives the adapters room (20x: a peaked model that never samples a digit)."""
    from tokenizer import byte_tokenizer
    hf = perturbed_hf(*TINY_QWEN2, seed)
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(4)
    hf.to(dtype).save_pretrained(path)
    byte_tokenizer().save(str(path))
    return f'--init_from={path}'


@pytest.fixture(scope='module')
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp('tiny_qwen2')
    return path, write_base(path)


def test_grpo_learns_with_lora_and_touches_only_the_adapters(base, tmp_path):
    # seed 2: seeds 1, 2, 3 rise by 0.43-0.55 in 12 steps; 1337 starts slowly (+0.09 in 12, +0.71 in 16)
    run(tmp_path, base[1], *LORA, '--max_steps=12', '--lr=5e-2', '--group_size=8', '--seed=2',
        '--batch_prompts=8', '--micro_batch_size=64', '--max_new_tokens=12', '--save_every=100',
        '--export_hf=True', '--lora_dropout=0.05', timeout=300)
    r = [m['reward/mean'] for m in metrics(tmp_path) if 'reward/mean' in m]
    first = sum(r[:3]) / 3
    last = sum(r[-3:]) / 3
    assert last > first + 0.2, \
        f"mean reward did not rise with LoRA: first 3 steps {first:.3f}, last 3 {last:.3f}: {r}"
    ckpt = torch.load(tmp_path / 'ckpt_0000012.pt', weights_only=False)
    # the run's model at its start
    model = L.apply(H.from_pretrained(base[0])[0], rank=4, alpha=8.0, dropout=0.0,
                    targets='all-linear', seed=1337)
    assert set(ckpt['model']) == set(L.adapter_state(model, model.state_dict())), \
        "a checkpoint holds adapters only"
    assert len(ckpt['optimizer']['state']) == len(ckpt['model']), \
        "AdamW state for the adapters only"
    # out/hf == the snapshot's weights + the checkpoint's adapters, bit for bit: the base never
    # moved
    model.load_state_dict(ckpt['model'], strict=False)
    merged = L.merged_state(model, model.state_dict())
    exported = H.from_pretrained(tmp_path / 'hf')[0].state_dict()
    assert exported.keys() == merged.keys()
    assert all(torch.equal(exported[k], merged[k]) for k in merged), \
        "the export is not base + adapters"
    assert (tmp_path / 'lora' / 'adapter_model.safetensors').exists()
    # sample.py --init_from=OUT/ckpt_N.pt: base + the checkpoint's adapters
    from sample import load_run_checkpoint
    x = torch.randint(0, 260, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        from_ckpt = load_run_checkpoint(tmp_path / 'ckpt_0000012.pt')[0].eval()(x)
        from_export = H.from_pretrained(tmp_path / 'hf')[0].eval()(x)
        d = maxdiff(from_ckpt, from_export)
    assert d <= 1e-4, f"the checkpoint evaluated by sample.py differs from the export by {d:.2e}"


def test_exact_resume_with_lora(base, tmp_path):
    """2 steps, then a third from the step-2 checkpoint (base reloaded from init_from, adapters and
    AdamW state from the checkpoint, KL reference = adapters off) == 3 steps straight, bit for bit.
    No dropout here: it would make the KL to the reference positive even if the reference were the
    policy itself."""
    args = [base[1], *LORA, '--save_every=1', '--keep_last=10', '--beta=0.05', '--lr=5e-2']
    run_together([tmp_path / 'a', *args, '--max_steps=3'], [tmp_path / 'b', *args, '--max_steps=2'])
    # resume_changed: the same LR at every step here
    p = run(tmp_path / 'b', *args, '--max_steps=3', '--resume_changed=True')
    assert 'resume:' in p.stdout
    ra = metrics(tmp_path / 'a')
    rb = metrics(tmp_path / 'b')
    assert [r['step'] for r in rb] == [0, 1, 2, 3]
    assert ra[1]['kl'] == 0.0 and ra[3]['kl'] > 1e-6, \
        "step 1's policy is the reference (B = 0); it moves after"
    for x, y in zip(ra, rb):
        assert stable(x) == stable(y), \
            f"step {x['step']} differs after resume:\n{stable(x)}\n{stable(y)}"
    wa = weights(tmp_path / 'a', 3)
    wb = weights(tmp_path / 'b', 3)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), \
        "adapters differ after resume"
    key = 'h.0.attn.c_attn.lora_B.q_proj'
    assert not torch.equal(wa[key], weights(tmp_path / 'a', 2)[key]), "step 3 trained nothing"


def test_grpo_with_a_bf16_base_equals_the_fp32_base(tmp_path):
    """Three steps with dtype=bfloat16 and the frozen base stored in fp32 vs in bf16 (lora_base_dtype's
    default, 'auto', on a bf16 snapshot), with a KL reference (the base, adapters off) and eval: the
    same metrics, adapters, AdamW state and export, bit for bit; the bf16 run holds less memory."""
    snap = write_base(tmp_path / 'snap', dtype=torch.bfloat16)
    args = [snap, *LORA, '--dtype=bfloat16', '--max_steps=3', '--save_every=3', '--beta=0.05',
            '--lr=5e-2', '--eval_every=3', '--export_hf=True']
    pa, pb = run_together([tmp_path / 'a', *args, '--lora_base_dtype=float32'], [tmp_path / 'b', *args])
    ra, rb = metrics(tmp_path / 'a'), metrics(tmp_path / 'b')
    assert len(ra) == len(rb) == 4 and ra[3]['kl'] > 0, "the runs did not train"
    for x, y in zip(ra, rb):
        assert stable(x) == stable(y), f"step {x['step']} differs:\n{stable(x)}\n{stable(y)}"
    ca = torch.load(tmp_path / 'a' / 'ckpt_0000003.pt', weights_only=False)
    cb = torch.load(tmp_path / 'b' / 'ckpt_0000003.pt', weights_only=False)
    assert ca['model'].keys() == cb['model'].keys()
    assert all(torch.equal(ca['model'][k], cb['model'][k]) for k in ca['model']), "adapters differ"
    ea = H.from_pretrained(tmp_path / 'a' / 'hf')[0].state_dict()
    eb = H.from_pretrained(tmp_path / 'b' / 'hf')[0].state_dict()
    assert all(torch.equal(ea[k], eb[k]) for k in ea), "the merged exports differ"
    size = [float(re.search(r'parameters \(([\d.e-]+) GiB\)', p.stdout)[1]) for p in (pa, pb)]
    assert size[1] < 0.6 * size[0], f"weights {size[0]} GiB with the fp32 base, {size[1]} GiB with bf16"
    assert 'the base frozen in bfloat16' in pb.stdout and 'the base frozen in' not in pa.stdout


def test_auto_keeps_the_base_in_bf16_only_where_no_number_changes(tmp_path):
    """lora_base_dtype='auto': bf16 for a snapshot stored in bf16 under bf16 compute; fp32 for one
    stored in fp32 (rounding it would change the embedding and the fp32 head), under fp32 compute,
    and for a model from scratch."""
    for stored in (torch.bfloat16, torch.float32):
        path = tmp_path / str(stored)
        perturbed_hf(*CONFIGS['qwen2']).to(stored).save_pretrained(path)
        model = H.from_pretrained(path)[0]
        assert model.snapshot_dtypes == ['BF16' if stored == torch.bfloat16 else 'F32']
        assert L.base_dtype('auto', 'bfloat16', model.snapshot_dtypes) == stored
        assert L.base_dtype('auto', 'float32', model.snapshot_dtypes) == torch.float32
    assert L.base_dtype('auto', 'bfloat16', None) == torch.float32
    assert L.base_dtype('bfloat16', 'bfloat16', ['F32']) == torch.bfloat16


def test_resume_refuses_another_base(base, tmp_path):
    """The base is not in the checkpoint: resuming on other base weights (another snapshot) is
    refused, and so is a LoRA checkpoint resumed as a full fine-tune."""
    run(tmp_path, base[1], *LORA, '--max_steps=1')
    other = write_base(tmp_path / 'other', seed=1)
    p = run(tmp_path, other, *LORA, '--max_steps=2', '--resume_changed=True', check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    assert 'base weights' in p.stderr and 'init_from' in p.stderr, p.stderr[-2000:]
    p = run(tmp_path, base[1], '--max_steps=2', '--resume_changed=True', check=False)
    assert p.returncode == 2 and 'LoRA checkpoint and a full one' in p.stderr, p.stderr[-2000:]


def test_bad_lora_knobs():
    """(train_grpo.py prints these as one line and exits 2; an unknown target:
    test_some_targets_only)"""
    ok = dict(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, sft_steps=0, beta=0.1)
    assert L.bad_knob(ok) is None and L.bad_knob({**ok, 'lora_rank': 0, 'lora_alpha': -1}) is None
    assert '--lora_rank=-1' in L.bad_knob({**ok, 'lora_rank': -1})
    assert '--lora_dropout=1' in L.bad_knob({**ok, 'lora_dropout': 1})
    assert '--lora_alpha=0' in L.bad_knob({**ok, 'lora_alpha': 0})
    assert 'warm start' in L.bad_knob({**ok, 'sft_steps': 10})
    bf16 = {**ok, 'lora_base_dtype': 'bfloat16', 'dtype': 'bfloat16'}
    assert L.bad_knob(bf16) is None
    assert '--dtype=float32' in L.bad_knob({**bf16, 'dtype': 'float32'})
    assert L.bad_knob({**bf16, 'fsdp': True}) is None
    assert 'without --lora_rank' in L.bad_knob({**bf16, 'lora_rank': 0})
    assert "'auto', 'float32' or 'bfloat16'" in L.bad_knob({**bf16, 'lora_base_dtype': 'float16'})
    assert L.bad_knob({**ok, 'lora_rank': 0, 'lora_base_dtype': 'auto', 'dtype': 'float32'}) is None
