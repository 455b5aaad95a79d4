"""
LoRA (Hu et al. 2021) on model.py's GPT: low-rank adapters on the blocks' linear layers, the base
weights frozen.

A targeted layer computes x W^T + b + scale * dropout(x) A^T B^T, scale = alpha / rank, A (rank, in)
initialised as peft does (kaiming-uniform, a = sqrt(5)), B (out, rank) zeros, so a fresh adapter
changes nothing. Our fused layers (q/k/v in attn.c_attn, gate/up in mlp.c_fc) keep one A/B pair per
Hugging Face sub-projection (q_proj, k_proj, v_proj; gate_proj, up_proj), each adding to its own
rows of the fused output: the pairs are exactly peft's, and export needs no approximation. Names are
HF's (hf.hf_layout says which HF tensors and rows each of our weights fuses).

What the rest of the run uses: apply (at load), param_groups (the optimizer: adapters only),
disabled (the KL reference is the model with its adapters off, no second copy), merged_copy
(the sampler: merged weights), adapter_state / merged_state / save_peft (checkpoints hold adapters
only; exports: merged HF snapshot and a peft adapter directory). Every function is the identity or a
no-op on a model without adapters.
"""
import contextlib
import copy
import json
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from hf import atomic_dir, hf_layout

# lora_targets='all-linear': every linear layer of the blocks (not the LM head), by HF module name,
# as peft's 'all-linear'. GPT-2's c_proj: attention's and the MLP's (peft matches both too).
ALL_LINEAR = {
    'gpt2': ('c_attn', 'c_proj', 'c_fc'),
    'phi3': ('qkv_proj', 'o_proj', 'gate_up_proj', 'down_proj'),
    'other': ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj'),
}


class LoRALinear(nn.Module):
    """A linear layer (the base's own weight and bias Parameters, so state-dict names do not change)
    plus one A/B pair per targeted HF sub-projection: parts = [(HF module path, its first row, rows,
    targeted)] in output order."""

    def __init__(self, base, parts, rank, alpha, dropout):
        super().__init__()
        self.weight = base.weight
        self.bias = base.bias
        self.parts = parts
        self.rank = rank
        self.scale = alpha / rank
        self.dropout = dropout
        self.enabled = True
        device = base.weight.device
        targeted = [(short(p), n) for p, _, n, on in parts if on]
        # every A, then every B: the allocation order the CPU's float results were measured with
        A = {name: nn.Parameter(torch.zeros(rank, base.in_features, device=device))
             for name, _ in targeted}
        self.lora_A = nn.ParameterDict(A)
        B = {name: nn.Parameter(torch.zeros(n, rank, device=device)) for name, n in targeted}
        self.lora_B = nn.ParameterDict(B)

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        if not self.enabled:
            return y
        # dropout in the gradient forward only (see README)
        if self.dropout and self.training and torch.is_grad_enabled():
            x = F.dropout(x, self.dropout)
        names = list(self.lora_A)
        if len(names) == 1:
            A = self.lora_A[names[0]]
        else:
            A = torch.cat([self.lora_A[n] for n in names])
        xa = F.linear(x, A)
        xa = dict(zip(names, xa.split(self.rank, dim=-1)))
        deltas = []
        for p, _, n, on in self.parts:
            if on:
                deltas.append(F.linear(xa[short(p)], self.lora_B[short(p)]))
            else:
                deltas.append(y.new_zeros(*y.shape[:-1], n))
        out = deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=-1)
        return y + out * self.scale

    def extra_repr(self):
        return (f"rank={self.rank}, scale={self.scale:g}, dropout={self.dropout}, "
                f"adapters={list(self.lora_A)}")


def short(path):
    """'model.layers.0.self_attn.q_proj' -> 'q_proj'"""
    return path.rsplit('.', 1)[-1]


def targets_of(cfg, targets):
    """lora_targets ('all-linear' or comma-separated HF module names) -> the tuple of names;
    ValueError names a bad one."""
    known = ALL_LINEAR.get(cfg.arch, ALL_LINEAR['other'])
    if targets == 'all-linear':
        names = known
    else:
        names = tuple(t.strip() for t in targets.split(',') if t.strip())
    bad = [t for t in names if t not in known]
    if bad or not names:
        what = bad[0] if bad else 'no names'
        raise ValueError(f"--lora_targets={targets!r}: {what} is not a linear layer of a "
                         f"{cfg.arch} block ({', '.join(known)} or 'all-linear')")
    return names


def adapters(model):
    """[(module name, LoRALinear)] in model order; [] without LoRA."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


def apply(model, rank, alpha, dropout, targets, seed, *, base_dtype=torch.float32):
    """Freeze model and give the targeted linear layers of its blocks adapters (rank 0: nothing,
    model untouched). A is drawn from a generator of its own (seed), so the init does not depend on
    what ran before. model.lora records the settings and a fingerprint of the base weights (resume
    checks it: the base is reloaded from init_from). base_dtype: the frozen matrices' storage
    (store_base)."""
    if not rank:
        return model
    cfg = model.config
    names = targets_of(cfg, targets)
    g = torch.Generator().manual_seed(seed + 7919)
    model.lora = dict(rank=rank, alpha=alpha, dropout=dropout, targets=list(names),
                      base=fingerprint(model))
    model.requires_grad_(False)
    prefix = 'model.' if cfg.arch != 'gpt2' else 'transformer.'
    for ours, (hf_names, rows, _) in hf_layout(cfg, prefix).items():
        if not ours.startswith('h.') or not ours.endswith('.weight'):
            continue
        base = model.get_submodule(ours.removesuffix('.weight'))
        if not isinstance(base, nn.Linear):
            continue
        owner, _, leaf = ours.removesuffix('.weight').rpartition('.')
        rows = rows or [base.out_features]
        starts = [sum(rows[:i]) for i in range(len(rows))]
        parts = [(n.removesuffix('.weight'), s, r, short(n.removesuffix('.weight')) in names)
                 for n, s, r in zip(hf_names, starts, rows)]
        if any(on for *_, on in parts):
            layer = LoRALinear(base, parts, rank=rank, alpha=alpha, dropout=dropout)
            with torch.no_grad():
                for a in layer.lora_A.values():
                    a.copy_(init_A(a.shape, g))
            setattr(model.get_submodule(owner), leaf, layer)
    store_base(model, base_dtype)
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    kept = '' if base_dtype == torch.float32 else f' in {str(base_dtype).removeprefix("torch.")}'
    print(f"lora: rank {rank}, alpha {alpha:g} on {','.join(names)}: {n:,} adapter parameters "
          f"trained ({100 * n / total:.2f}% of {total:,}), the base frozen{kept}")
    return model


def base_dtype(knob, compute, stored):
    """lora_base_dtype's torch dtype: 'float32' and 'bfloat16' as named; 'auto' bfloat16 when the
    compute dtype is bfloat16 and every matrix of the snapshot is stored in bf16 (stored: their
    dtypes on disk, hf.from_pretrained's snapshot_dtypes; None for a model from scratch), where
    keeping the base in bf16 changes no number, else float32."""
    if knob == 'auto':
        knob = 'bfloat16' if compute == 'bfloat16' and stored == ['BF16'] else 'float32'
    return getattr(torch, knob)


def store_base(model, dtype):
    """The frozen matrices (the blocks' linear weights, the embedding, the LM head) kept in dtype:
    bfloat16 halves the base's memory. Under bf16 autocast every matmul reads them in bf16 anyway,
    so a base whose snapshot is bf16 (every Qwen and Llama release) computes bit for bit as the fp32
    copy did; the norms, biases and adapters stay fp32, and model.hidden adds the residual stream in
    the norms' dtype. (peft on a bf16 transformers model keeps its adapters fp32 too.)"""
    for p in model.parameters():
        if not p.requires_grad and p.dim() >= 2 and p.dtype != dtype:
            p.data = p.data.to(dtype)


@torch.no_grad()
def init_A(shape, g):
    """peft's A: kaiming-uniform with a = sqrt(5) (nn.Linear's own init), drawn on the CPU in
    fp32."""
    return nn.init.kaiming_uniform_(torch.empty(shape), a=math.sqrt(5), generator=g)


@torch.no_grad()
def fingerprint(model):
    """Two float64 sums over every base weight: equal for the same weights loaded the same way,
    different if the snapshot at init_from changed since the adapters were trained on it."""
    if any(p.is_meta for p in model.parameters()):
        return None  # (a model with no weights yet: bench/lora_memory.py)
    s = [0.0, 0.0]
    for i, p in enumerate(model.parameters()):
        d = p.detach().double()
        s[0] += d.sum().item() * (i + 1)
        s[1] += d.square().sum().item()
    return s


def param_groups(model, weight_decay):
    """AdamW's groups: the trainable parameters (with LoRA the adapters only: the base has
    requires_grad False), decay on matrices only."""
    ps = [p for p in model.parameters() if p.requires_grad]
    return [{'params': [p for p in ps if p.dim() >= 2], 'weight_decay': weight_decay},
            {'params': [p for p in ps if p.dim() < 2], 'weight_decay': 0.0}]


@contextlib.contextmanager
def disabled(model):
    """Inside: the model computes with its base weights alone, exactly (the KL reference). Restored
    on the way out, exceptions included. A no-op without adapters."""
    layers = [m for _, m in adapters(model)]
    was = [m.enabled for m in layers]
    for m in layers:
        m.enabled = False
    try:
        yield model
    finally:
        for m, w in zip(layers, was):
            m.enabled = w


def _full(t):
    # an FSDP2 shard -> the whole tensor (collective)
    return t.full_tensor() if hasattr(t, 'full_tensor') else t


def delta(layer, A, B):
    """The weight update of one layer, (out, in), from its adapters' tensors A[name], B[name] (zero
    rows where a sub-projection has none), computed in fp32."""
    first = A[next(iter(A))]
    rows = sum(n for _, _, n, _ in layer.parts)
    W = torch.zeros(rows, first.shape[1], device=first.device)
    for p, s, n, on in layer.parts:
        if on:
            W[s:s + n] = B[short(p)].float() @ A[short(p)].float()
    return W * layer.scale


def merged_state(model, sd):
    """A whole state dict of model (base + adapters, e.g. full_state's) -> the plain model's: each
    targeted weight W + scale * B @ A, adapter entries dropped. The identity without LoRA."""
    out = {k: v for k, v in sd.items() if '.lora_A.' not in k and '.lora_B.' not in k}
    for name, layer in adapters(model):
        W = sd[name + '.weight']
        A = {k: sd[f'{name}.lora_A.{k}'] for k in layer.lora_A}
        B = {k: sd[f'{name}.lora_B.{k}'] for k in A}
        keep = torch.promote_types(W.dtype, torch.float32)  # a bf16 base: merged in fp32, not rounded back
        out[name + '.weight'] = (W.float() + delta(layer, A, B)).to(keep)
    return out


def adapter_state(model, sd):
    """Only the adapters' entries of a state dict (what a LoRA checkpoint holds); None without
    LoRA."""
    if not adapters(model):
        return None
    return {k: v for k, v in sd.items() if '.lora_A.' in k or '.lora_B.' in k}


def merged_copy(model, dtype):
    """A plain model (no adapters) in dtype holding model's merged weights: the sampler of a LoRA
    run (sample.sampler_model), so decoding runs no adapter matmuls; copy_merged refreshes it."""
    with disabled(model):
        gen = copy.deepcopy(model)
    for name, layer in adapters(gen):  # back to plain linear layers
        owner, _, leaf = name.rpartition('.')
        out_features, in_features = layer.weight.shape
        plain = nn.Linear(in_features, out_features, bias=layer.bias is not None, device='meta')
        plain.weight, plain.bias = layer.weight, layer.bias
        setattr(gen.get_submodule(owner), leaf, plain)
    gen.__dict__.pop('lora', None)
    gen = gen.to(dtype).eval()
    copy_merged(gen, model)
    return gen


@torch.no_grad()
def copy_merged(dst, src):
    """dst's weights set to src's merged ones, W + scale * B @ A (fp32, then dst's dtype), without
    touching src's base: no merge-then-unmerge rounding. An FSDP-sharded src is gathered tensor by
    tensor (every rank takes part)."""
    layers = dict(adapters(src))
    params = dict(src.named_parameters())
    for name, p in dst.named_parameters():
        q = _full(params[name])
        owner = name.removesuffix('.weight')
        if name.endswith('.weight') and owner in layers:
            layer = layers[owner]
            A = {k: _full(v) for k, v in layer.lora_A.items()}
            B = {k: _full(layer.lora_B[k]) for k in A}
            q = q.float() + delta(layer, A, B)
        p.copy_(q)


# ------------------------------------------------------------------------- peft's adapter directory

def peft_tensors(model, sd):
    """Adapter tensors under peft's names: base_model.model.<HF module>.lora_A.weight /
    .lora_B.weight."""
    out = {}
    for name, layer in adapters(model):
        for p, _, _, on in layer.parts:
            if not on:
                continue
            for ab in ('A', 'B'):
                out[f'base_model.model.{p}.lora_{ab}.weight'] = sd[f'{name}.lora_{ab}.{short(p)}']
    return out


def peft_config(model, base_name):
    """adapter_config.json as peft's LoraConfig writes it (the fields that matter for loading; peft
    fills in the rest with its defaults). GPT-2's HF layers are Conv1D, stored (in, out):
    fan_in_fan_out."""
    lc = model.lora
    return dict(peft_type='LORA', task_type='CAUSAL_LM', base_model_name_or_path=base_name,
                r=lc['rank'], lora_alpha=lc['alpha'], lora_dropout=lc['dropout'],
                target_modules=sorted(lc['targets']), bias='none',
                fan_in_fan_out=model.config.arch == 'gpt2', use_rslora=False,
                init_lora_weights=True, modules_to_save=None, inference_mode=True)


def save_peft(model, sd, out_dir, base_name):
    """Write out_dir as a peft adapter directory (adapter_config.json + adapter_model.safetensors)
    that peft.PeftModel.from_pretrained(<the base snapshot in transformers>, out_dir) loads. sd: a
    state dict holding the adapters (adapter_state's). Written beside out_dir and renamed into
    place, as hf.save_pretrained does."""
    from safetensors.torch import save_file
    with atomic_dir(out_dir) as tmp:
        with open(os.path.join(tmp, 'adapter_config.json'), 'w') as f:
            json.dump(peft_config(model, base_name), f, indent=2)
        tensors = {k: v.detach().to('cpu').clone(memory_format=torch.contiguous_format)
                   for k, v in peft_tensors(model, sd).items()}
        path = os.path.join(tmp, 'adapter_model.safetensors')
        save_file(tensors, path, metadata={'format': 'pt'})
    return os.path.abspath(out_dir)


def bad_knob(config):
    """A one-line error for LoRA knobs that cannot work, else None (lora_targets is checked against
    the model)."""
    if config.get('lora_rank', 0) < 0:
        return f"--lora_rank={config['lora_rank']}: a rank is >= 0 (0 = off)"
    base = config.get('lora_base_dtype', 'auto')
    if base not in ('auto', 'float32', 'bfloat16'):
        return f"--lora_base_dtype={base}: 'auto', 'float32' or 'bfloat16'"
    if not config.get('lora_rank'):
        if base == 'bfloat16':
            return ("--lora_base_dtype=bfloat16 without --lora_rank: only a frozen LoRA base is kept in "
                    "another dtype (full fine-tuning trains fp32 weights)")
        return None
    if not 0 <= config['lora_dropout'] < 1:
        return f"--lora_dropout={config['lora_dropout']}: must be in [0, 1)"
    if config['lora_alpha'] <= 0:
        return f"--lora_alpha={config['lora_alpha']}: must be > 0 (scale = lora_alpha / lora_rank)"
    if base == 'bfloat16' and config.get('dtype') != 'bfloat16':
        return (f"--lora_base_dtype=bfloat16 with --dtype={config.get('dtype')}: the matmuls would read a bf16 "
                f"base in another dtype; use --dtype=bfloat16 (or keep the base in float32)")
    if config.get('sft_steps') and config.get('beta'):
        return ("--lora_rank with --sft_steps and --beta > 0: the LoRA KL reference is the base "
                "with adapters off, which would be the model before the warm start; warm start "
                "without LoRA, or use beta = 0")
    return None
