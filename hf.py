"""
Hugging Face snapshot directories <-> model.py's GPT: config.json <-> ModelConfig, tensor names <->
ours (fused q/k/v and gate/up split back into HF's sub-projections), safetensors loading (single
file or sharded index) with one clear error per problem, hub download through huggingface_hub when
it is installed, and atomic saving.
"""
import contextlib
import json
import math
import os
import re
import shutil

import torch

from model import GPT, ModelConfig, from_scratch


class ModelLoadError(ValueError):
    """A snapshot could not be loaded. The message is one line naming the file and the field or
    tensor."""


# -----------------------------------------------------------------------------
# the network


def hf_layout(cfg, prefix):
    """Our parameter name -> (HF tensor names, concatenated in this order along dim 0, and their row
    counts, and whether HF stores it transposed: GPT-2's Conv1D keeps weights as (in, out))."""
    lay = {}
    if cfg.arch != 'gpt2':
        hd = cfg.head_dim
        fused = cfg.arch == 'phi3'  # q/k/v and gate/up stored as one tensor each, as ours are
        qkv, gate_up = (['qkv'], ['gate_up']) if fused else (['q', 'k', 'v'], ['gate', 'up'])
        qkv_rows = None if fused else [cfg.n_head * hd, cfg.n_kv_head * hd, cfg.n_kv_head * hd]
        gate_up_rows = None if fused else [cfg.intermediate_size] * 2
        # only qwen2 has q/k/v biases, only qwen3, olmo2 and gemma3_text q/k norms
        qkv_tensors = ('weight', 'bias') if cfg.arch == 'qwen2' else ('weight',)
        norms = ('q_norm', 'k_norm') if cfg.arch in ('qwen3', 'olmo2', 'gemma3_text') else ()
        # ln_1, ln_2: the pre-norms of attention and MLP; olmo2's norms of their outputs;
        # gemma3_text has both (ln_1a, ln_2a: the outputs')
        ln = {'olmo2': ('post_attention_layernorm', 'post_feedforward_layernorm'),
              'gemma3_text': ('input_layernorm', 'pre_feedforward_layernorm')}.get(
                  cfg.arch, ('input_layernorm', 'post_attention_layernorm'))
        lay['wte.weight'] = ([prefix + 'embed_tokens.weight'], None, False)
        for i in range(cfg.n_layer):
            a = f'{prefix}layers.{i}.'
            p = f'h.{i}.'
            lay[p + 'ln_1.weight'] = ([a + ln[0] + '.weight'], None, False)
            for s in qkv_tensors:
                qkv_names = [a + f'self_attn.{n}_proj.{s}' for n in qkv]
                lay[p + f'attn.c_attn.{s}'] = (qkv_names, qkv_rows, False)
            lay[p + 'attn.c_proj.weight'] = ([a + 'self_attn.o_proj.weight'], None, False)
            for n in norms:
                lay[p + f'attn.{n}.weight'] = ([a + f'self_attn.{n}.weight'], None, False)
            lay[p + 'ln_2.weight'] = ([a + ln[1] + '.weight'], None, False)
            if cfg.arch == 'gemma3_text':
                lay[p + 'ln_1a.weight'] = ([a + 'post_attention_layernorm.weight'], None, False)
                lay[p + 'ln_2a.weight'] = ([a + 'post_feedforward_layernorm.weight'], None, False)
            gate_up_names = [a + f'mlp.{n}_proj.weight' for n in gate_up]
            lay[p + 'mlp.c_fc.weight'] = (gate_up_names, gate_up_rows, False)
            lay[p + 'mlp.c_proj.weight'] = ([a + 'mlp.down_proj.weight'], None, False)
        lay['ln_f.weight'] = ([prefix + 'norm.weight'], None, False)
    else:
        names = ['wte.weight', 'wpe.weight', 'ln_f.weight', 'ln_f.bias']
        modules = ('ln_1', 'attn.c_attn', 'attn.c_proj', 'ln_2', 'mlp.c_fc', 'mlp.c_proj')
        for i in range(cfg.n_layer):
            for m in modules:
                names += [f'h.{i}.{m}.weight', f'h.{i}.{m}.bias']
        for n in names:
            lay[n] = ([prefix + n], None, n.endswith('weight') and ('.c_' in n))
    if cfg.num_labels:
        lay['score.weight'] = (['score.weight'], None, False)
    elif not cfg.tie_word_embeddings:
        lay['lm_head.weight'] = (['lm_head.weight'], None, False)
    return lay


def to_hf(state_dict, cfg, prefix=None):
    """Our state dict -> HF-named tensors (views where possible; a tied head is left out, as HF
    does)."""
    if prefix is None:
        prefix = 'model.' if cfg.arch != 'gpt2' else 'transformer.'
    out = {}
    for ours, (names, rows, transpose) in hf_layout(cfg, prefix).items():
        t = state_dict[ours].t() if transpose else state_dict[ours]
        out.update(zip(names, t.split(rows, dim=0) if rows else [t]))
    return out


# ModelConfig field -> (config.json key, default; ... = required)
HF_KEYS = {
    'qwen2': dict(vocab_size=('vocab_size', ...),
                  n_layer=('num_hidden_layers', ...),
                  n_head=('num_attention_heads', ...),
                  n_kv_head=('num_key_value_heads', ...),
                  n_embd=('hidden_size', ...),
                  intermediate_size=('intermediate_size', ...),
                  max_seq_len=('max_position_embeddings', 32768),
                  rope_theta=('rope_theta', 10000.0),
                  norm_eps=('rms_norm_eps', 1e-6),
                  tie_word_embeddings=('tie_word_embeddings', False)),
    'gpt2': dict(vocab_size=('vocab_size', ...),
                 n_layer=('n_layer', ...),
                 n_head=('n_head', ...),
                 n_embd=('n_embd', ...),
                 intermediate_size=('n_inner', None),
                 max_seq_len=('n_positions', 1024),
                 norm_eps=('layer_norm_epsilon', 1e-5),
                 tie_word_embeddings=('tie_word_embeddings', True)),
}
# same fields; head_dim and rope_scaling read apart
HF_KEYS.update(dict.fromkeys(('qwen3', 'llama', 'mistral', 'olmo2', 'smollm3', 'phi3', 'gemma3_text'),
                             HF_KEYS['qwen2']))
HF_ARCH = {'qwen2': dict(architectures=['Qwen2ForCausalLM'], model_type='qwen2'),
           'qwen3': dict(architectures=['Qwen3ForCausalLM'], model_type='qwen3'),
           'llama': dict(architectures=['LlamaForCausalLM'], model_type='llama'),
           'mistral': dict(architectures=['MistralForCausalLM'], model_type='mistral'),
           'olmo2': dict(architectures=['Olmo2ForCausalLM'], model_type='olmo2'),
           'smollm3': dict(architectures=['SmolLM3ForCausalLM'], model_type='smollm3'),
           'phi3': dict(architectures=['Phi3ForCausalLM'], model_type='phi3'),
           'gemma3_text': dict(architectures=['Gemma3ForCausalLM'], model_type='gemma3_text'),
           'gpt2': dict(architectures=['GPT2LMHeadModel'], model_type='gpt2')}
CLASSIFIER = {'qwen2': 'Qwen2ForSequenceClassification',
              'qwen3': 'Qwen3ForSequenceClassification',
              'llama': 'LlamaForSequenceClassification',
              'mistral': 'MistralForSequenceClassification',
              'olmo2': 'Olmo2ForSequenceClassification',
              'smollm3': 'SmolLM3ForSequenceClassification',
              'phi3': 'Phi3ForSequenceClassification',
              'gemma3_text': 'Gemma3TextForSequenceClassification',
              'gpt2': 'GPT2ForSequenceClassification'}
# the architectures with an explicit head_dim in config.json (else n_embd // n_head)
HEAD_DIM = ('qwen3', 'llama', 'mistral', 'olmo2', 'smollm3', 'phi3', 'gemma3_text')
LLAMA3_ROPE = ('factor', 'low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings')
# config.json settings that change the math: the values we implement (save writes the first)
SUPPORTED = {
    'qwen2': dict(hidden_act=['silu'], use_sliding_window=[False]),
    'qwen3': dict(hidden_act=['silu'], use_sliding_window=[False], attention_bias=[False]),
    'llama': dict(hidden_act=['silu'], attention_bias=[False], mlp_bias=[False],
                  pretraining_tp=[1]),
    # no sliding window: every position attends to all earlier ones
    'mistral': dict(hidden_act=['silu'], sliding_window=[None]),
    'olmo2': dict(hidden_act=['silu'], attention_bias=[False]),
    'smollm3': dict(hidden_act=['silu'], use_sliding_window=[False], attention_bias=[False],
                    mlp_bias=[False]),
    'phi3': dict(hidden_act=['silu'], sliding_window=[None]),
    'gemma3_text': dict(hidden_activation=['gelu_pytorch_tanh'], attention_bias=[False],
                        final_logit_softcapping=[None], attn_logit_softcapping=[None],
                        use_bidirectional_attention=[False]),
    'gpt2': dict(activation_function=['gelu_new', 'gelu_pytorch_tanh'], scale_attn_weights=[True],
                 scale_attn_by_inverse_layer_idx=[False]),
}


def config_from_hf(hf, file):
    """HF config.json dict -> ModelConfig; refuses variants this model does not implement."""
    arch = hf.get('model_type')
    if arch not in HF_KEYS:
        raise ModelLoadError(f"{file}: model_type {arch!r} is not supported (qwen2, qwen3, llama, "
                             "mistral, olmo2, smollm3, phi3, gemma3_text or gpt2; no mixture-of-experts)")
    kw = {}
    if arch == 'gemma3_text':
        hf = read_gemma3(hf, kw, file)
    if arch != 'gpt2' and hf.get('rope_theta') is None:
        # transformers>=5 writes it inside rope_parameters
        hf = {**hf, **(hf.get('rope_parameters') or {})}
    kw.update(arch=arch, bos_token_id=hf.get('bos_token_id'), eos_token_id=hf.get('eos_token_id'))
    if type(hf.get('pad_token_id')) is int:  # kept for the export (transformers' embedding reads it)
        kw['pad_token_id'] = hf['pad_token_id']
    if CLASSIFIER[arch] in (hf.get('architectures') or []):
        if not isinstance(hf.get('pad_token_id'), int):
            raise ModelLoadError(f"{file}: missing field 'pad_token_id' (a classifier reads each "
                                 "row's last token that is not this id: set it to the tokenizer's "
                                 "pad token, e.g. 151643 for Qwen2.5)")
        # num_labels as transformers reads it (2 if no id2label)
        kw.update(num_labels=len(hf.get('id2label') or '01'), pad_token_id=hf['pad_token_id'])
    for ours, (key, default) in HF_KEYS[arch].items():
        v = default if hf.get(key) is None else hf[key]
        if v is ...:
            raise ModelLoadError(f"{file}: missing field '{key}'")
        kind = type(getattr(ModelConfig, ours))
        if v is not None and not (type(v) is kind or kind is float and type(v) is int):
            raise ModelLoadError(f"{file}: field '{key}' should be {kind.__name__}, got {v!r}")
        kw[ours] = v if v is None else kind(v)
    if arch == 'gpt2':
        kw['n_kv_head'] = kw['n_head']
        kw['intermediate_size'] = kw['intermediate_size'] or 4 * kw['n_embd']
    if arch in ('mistral', 'phi3'):
        # transformers' default: Mistral a 4,096-token window (7B v0.1's), Phi-3 none (Phi-3-mini-4k
        # has 2,047); one as long as the model's context is none; a shorter one: every layer sees
        # the last sliding_window positions
        window = hf.get('sliding_window', 4096 if arch == 'mistral' else None)
        if window is not None and not (type(window) is int and window >= 1):
            raise ModelLoadError(f"{file}: sliding_window={window!r} is not supported (null or a positive int)")
        if window is not None and window < kw['max_seq_len']:
            kw.update(sliding_layers=(1,) * kw['n_layer'], sliding_window=window)
        hf = {**hf, 'sliding_window': None}
    for key, ok in SUPPORTED[arch].items():
        if key in hf and hf[key] not in ok:
            raise ModelLoadError(f"{file}: {key}={hf[key]!r} is not supported")
    field = 'rope_scaling' if hf.get('rope_scaling') else 'rope_parameters'
    rope = hf.get(field) or {}
    kind = rope.get('rope_type', rope.get('type', 'default'))
    if arch == 'phi3':
        kind = read_phi3_rope(hf, rope, kind, kw, f"{file}: field '{field}'")
    if kind == 'llama3' and arch != 'gpt2':
        if any(not isinstance(rope.get(k), (int, float)) for k in LLAMA3_ROPE):
            raise ModelLoadError(f"{file}: field '{field}' of rope_type 'llama3' needs numbers "
                                 + ', '.join(LLAMA3_ROPE))
        kw['rope_scaling'] = tuple(rope[k] for k in LLAMA3_ROPE)
    elif kind != 'default':
        raise ModelLoadError(f"{file}: field '{field}' has rope_type {kind!r}, not supported "
                             "(default or llama3)")
    if arch == 'smollm3':
        kw['no_rope_layers'] = no_rope_layers(hf, kw['n_layer'], file)
    hd = hf.get('head_dim')
    if arch in HEAD_DIM and type(hd) is int and hd != kw['n_embd'] // kw['n_head']:
        # kept only where it differs, so a config saved and loaded back compares equal
        kw['head_size'] = hd
    cfg = ModelConfig(**kw)
    uneven = not cfg.head_size and cfg.n_embd % cfg.n_head
    if uneven or cfg.n_head % cfg.n_kv_head or hf.get('head_dim', cfg.head_dim) != cfg.head_dim:
        raise ModelLoadError(f"{file}: inconsistent head sizes (hidden {cfg.n_embd}, heads "
                             f"{cfg.n_head}, kv heads {cfg.n_kv_head}, "
                             f"head_dim {hf.get('head_dim')})")
    return cfg


def read_phi3_rope(hf, rope, kind, kw, where):
    """Phi-3's partial rotary (partial_rotary_factor, at the top or among the RoPE parameters) and
    'longrope' (legacy names 'su', 'yarn') into kw; returns the kind left to read ('default')."""
    head = hf.get('head_dim') or kw['n_embd'] // kw['n_head']
    part = rope.get('partial_rotary_factor', hf.get('partial_rotary_factor', 1.0))
    rotated = int(head * part) if isinstance(part, (int, float)) and 0 < part <= 1 else 0
    if not rotated or rotated % 2:  # (none would read as rotary_dim 0: all of them)
        raise ModelLoadError(f"{where}: partial_rotary_factor={part!r} does not give a positive even "
                             f"number of the head's {head} channels")
    kw['rotary_dim'] = 0 if rotated == head else rotated
    if kind not in ('longrope', 'su', 'yarn'):
        return kind
    orig = rope.get('original_max_position_embeddings', hf.get('original_max_position_embeddings'))
    short, long = rope.get('short_factor'), rope.get('long_factor')
    n = rotated // 2
    if type(orig) is not int or any(not (isinstance(f, list) and len(f) == n) for f in (short, long)):
        raise ModelLoadError(f"{where} of rope_type 'longrope' needs original_max_position_embeddings "
                             f"and short_factor and long_factor of {n} numbers each")
    factor = rope.get('factor') or kw['max_seq_len'] / orig
    attention = rope.get('attention_factor') or (
        1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig)))
    # positions past orig would switch transformers to long_factor: max_seq_len stops them
    kw['longrope'] = (kw['max_seq_len'], float(attention), tuple(map(float, short)),
                      tuple(map(float, long)))
    kw['max_seq_len'] = orig
    return 'default'


def read_gemma3(hf, kw, file):
    """Gemma 3's own fields into kw (its sliding-window layers from layer_types, or every
    sliding_window_pattern-th layer global as transformers fills them in; the window; each kind's
    RoPE base from rope_parameters by layer type, or rope_theta and rope_local_base_freq;
    query_pre_attn_scalar); returns hf with the global layers' RoPE settings where the others
    are read."""
    n = hf.get('num_hidden_layers')
    types = hf.get('layer_types')
    if types is None and type(n) is int:
        every = hf.get('sliding_window_pattern', 6)
        types = ['sliding_attention' if (i + 1) % every else 'full_attention' for i in range(n)]
    if not (isinstance(types, list) and len(types) == n and set(types) <= {'sliding_attention', 'full_attention'}):
        raise ModelLoadError(f"{file}: field 'layer_types' should be {n} of 'sliding_attention' and "
                             f"'full_attention', got {types!r}")
    window = hf.get('sliding_window', 4096)
    if type(window) is not int or window < 1:
        raise ModelLoadError(f"{file}: field 'sliding_window' should be a positive int, got {window!r}")
    scalar = hf.get('query_pre_attn_scalar', 256)
    if not isinstance(scalar, (int, float)) or scalar <= 0:
        raise ModelLoadError(f"{file}: field 'query_pre_attn_scalar' should be a positive number, got {scalar!r}")
    rope = hf.get('rope_parameters') or {}
    full, local = rope.get('full_attention') or {}, rope.get('sliding_attention') or {}
    if local.get('rope_type', 'default') != 'default':
        raise ModelLoadError(f"{file}: field 'rope_parameters' has rope_type {local.get('rope_type')!r} for "
                             "sliding_attention, not supported (default)")
    kw.update(sliding_layers=tuple(int(t == 'sliding_attention') for t in types), sliding_window=window,
              query_pre_attn_scalar=float(scalar),
              local_rope_theta=float(local.get('rope_theta', hf.get('rope_local_base_freq', 10000.0))))
    hf = {k: v for k, v in hf.items() if k != 'rope_parameters'}
    hf.setdefault('rope_theta', full.get('rope_theta', 1e6))
    if full.get('rope_type', 'default') != 'default':
        hf['rope_scaling'] = full
    return hf


def no_rope_layers(hf, n_layer, file):
    """SmolLM3's RoPE layers: config.json's no_rope_layers (1 RoPE, 0 none, one per layer), else
    every no_rope_layer_interval-th layer without, as transformers fills it in."""
    flags = hf.get('no_rope_layers')
    if flags is None:
        every = hf.get('no_rope_layer_interval', 4)
        if type(every) is not int or every < 1:
            raise ModelLoadError(f"{file}: field 'no_rope_layer_interval' should be an int >= 1, "
                                 f"got {every!r}")
        flags = [int((i + 1) % every != 0) for i in range(n_layer)]
    if not (isinstance(flags, list) and len(flags) == n_layer and set(flags) <= {0, 1}):
        raise ModelLoadError(f"{file}: field 'no_rope_layers' should be {n_layer} zeros and ones "
                             f"(one per layer), got {flags!r}")
    return tuple(flags)


def config_to_hf(cfg, dtype):
    """ModelConfig -> the HF config.json dict save_pretrained writes."""
    out = dict(HF_ARCH[cfg.arch])
    out.update({k: ok[0] for k, ok in SUPPORTED[cfg.arch].items()})
    out.update({key: getattr(cfg, ours) for ours, (key, _) in HF_KEYS[cfg.arch].items()})
    out['bos_token_id'] = cfg.bos_token_id
    out['eos_token_id'] = cfg.eos_token_id
    # null where the snapshot had none: not the class's default (SmolLM3's 128,004 may lie outside a
    # small vocabulary)
    out['pad_token_id'] = cfg.pad_token_id
    if cfg.arch in HEAD_DIM:
        out['head_dim'] = cfg.head_dim
    if cfg.no_rope_layers is not None:
        out['no_rope_layers'] = list(cfg.no_rope_layers)
    if cfg.arch == 'phi3':
        out['partial_rotary_factor'] = (cfg.rotary_dim or cfg.head_dim) / cfg.head_dim
    if cfg.arch in ('mistral', 'phi3') and cfg.sliding_window:
        out['sliding_window'] = cfg.sliding_window
    if cfg.arch == 'gemma3_text':
        out.update(sliding_window=cfg.sliding_window,
                   query_pre_attn_scalar=int(cfg.query_pre_attn_scalar) if cfg.query_pre_attn_scalar.is_integer()
                   else cfg.query_pre_attn_scalar, rope_local_base_freq=cfg.local_rope_theta,
                   layer_types=['sliding_attention' if s else 'full_attention' for s in cfg.sliding_layers])
    if cfg.longrope:
        out['max_position_embeddings'], attention, short, long = cfg.longrope
        out['original_max_position_embeddings'] = cfg.max_seq_len
        out['rope_scaling'] = dict(rope_type='longrope', short_factor=list(short),
                                   long_factor=list(long), attention_factor=attention,
                                   original_max_position_embeddings=cfg.max_seq_len)
    if cfg.rope_scaling:
        out['rope_scaling'] = dict(rope_type='llama3', **dict(zip(LLAMA3_ROPE, cfg.rope_scaling)))
    out['torch_dtype'] = str(dtype).removeprefix('torch.')
    if cfg.num_labels:  # a classifier: its class and labels (architectures keeps its place)
        out['architectures'] = [CLASSIFIER[cfg.arch]]
        out['id2label'] = {i: f'LABEL_{i}' for i in range(cfg.num_labels)}
    return out


def _one_line(e):
    lines = str(e).strip().splitlines()
    return f'{type(e).__name__}: {lines[0] if lines else ""}'


def resolve_snapshot(name_or_path):
    """A local snapshot directory, or a hub id downloaded with huggingface_hub (its cache is reused
    offline)."""
    path = os.path.expanduser(str(name_or_path))
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise ModelLoadError(f'{path}: not a directory (pass an HF snapshot directory or a hub id)')
    if path.startswith(('/', '.', '~')) or not re.fullmatch(r'[\w.-]+(/[\w.-]+)?', path):
        raise ModelLoadError(f'{path}: no such directory')
    try:
        from huggingface_hub import snapshot_download
        files = ['config.json', '*.safetensors', 'model.safetensors.index.json',
                 'generation_config.json', 'tokenizer.json', 'tokenizer_config.json', 'vocab.json',
                 'merges.txt', 'special_tokens_map.json']
        return snapshot_download(path, allow_patterns=files)
    except Exception as e:
        raise ModelLoadError(f"'{path}' is not a local directory and could not be downloaded from "
                             f"the Hugging Face hub ({_one_line(e)}); pass a local snapshot "
                             "directory instead") from None


def _open_checkpoint(path):
    """(HF tensor name -> open safetensors file holding it, the file or index to name when one is
    missing)"""
    from safetensors import safe_open
    index = os.path.join(path, 'model.safetensors.index.json')
    single = os.path.join(path, 'model.safetensors')
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)['weight_map']
            files = sorted({os.path.join(path, v) for v in weight_map.values()})
        except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
            msg = f'{index}: not a valid safetensors index ({_one_line(e)})'
            raise ModelLoadError(msg) from None
    elif os.path.exists(single):
        index, files = single, [single]
    else:
        raise ModelLoadError(f'{path}: no model.safetensors or model.safetensors.index.json')
    where = {}
    for file in files:
        try:
            f = safe_open(file, framework='pt', device='cpu')
        except Exception as e:
            raise ModelLoadError(f'{file}: cannot read as safetensors ({_one_line(e)})') from None
        where.update({k: (f, file) for k in f.keys()})
    return where, index


def from_pretrained(name_or_path, dtype=torch.float32, device='cpu'):
    """Load an HF Qwen2/GPT-2 snapshot -> (GPT, Tokenizer or None when the snapshot has no tokenizer
    files). Every problem with the input raises ModelLoadError with a one-line message."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    path = resolve_snapshot(name_or_path)
    cfile = os.path.join(path, 'config.json')
    if not os.path.isfile(cfile):
        raise ModelLoadError(f"{path}: not a Hugging Face model snapshot (no config.json there)")
    try:
        with open(cfile) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f'{cfile}: cannot read ({_one_line(e)})') from None
    if not isinstance(hf, dict):
        raise ModelLoadError(f'{cfile}: not a JSON object')
    cfg = config_from_hf(hf, cfile)
    with torch.device('meta'):
        model = GPT(cfg)
    where, ckpt = _open_checkpoint(path)
    # GPT-2 checkpoints come with or without the 'transformer.' prefix
    if cfg.arch != 'gpt2':
        prefix = 'model.'
    elif any(k.startswith('transformer.') for k in where):
        prefix = 'transformer.'
    else:
        prefix = ''
    expected = to_hf(model.state_dict(), cfg, prefix)  # meta tensors: the names and shapes we need
    missing = [k for k in expected if k not in where]
    if missing:
        more = f' (and {len(missing) - 1} more)' * (len(missing) > 1)
        raise ModelLoadError(f"{ckpt}: missing tensor '{missing[0]}'{more}")
    # checkpoints may also carry buffers (GPT-2's causal mask, old rotary inv_freq) or a copy of a
    # tied head
    ignorable = re.compile(r'.*(\.attn\.bias|\.attn\.masked_bias|\.rotary_emb\.inv_freq)$'
                           r'|lm_head\.weight$')
    extra = [k for k in where if k not in expected and not ignorable.match(k)]
    if extra:
        named = ', '.join(map(repr, extra[:5]))
        more = f' (and {len(extra) - 5} more)' * (len(extra) > 5)
        raise ModelLoadError(f"{where[extra[0]][1]}: unexpected tensors {named}{more}")
    stored = set()  # the matrices' dtypes on disk ('BF16', ...): lora_base_dtype='auto' reads them
    for k, meta in expected.items():
        f, file = where[k]
        header = f.get_slice(k)  # the tensor's shape and dtype, its data not read
        shape = tuple(header.get_shape())
        if shape != meta.shape:
            raise ModelLoadError(f"{file}: tensor '{k}' has shape {shape}, "
                                 f"expected {tuple(meta.shape)}")
        if len(shape) >= 2:
            stored.add(header.get_dtype())
    model.snapshot_dtypes = sorted(stored)
    # device 'meta': every name and shape checked, no weight read (a config check)
    if torch.device(device).type != 'meta':
        sd = {}
        for ours, (names, rows, transpose) in hf_layout(cfg, prefix).items():
            t = torch.cat([where[n][0].get_tensor(n).to(device=device, dtype=dtype) for n in names])
            sd[ours] = (t.t() if transpose else t).contiguous()
        model.load_state_dict(sd, assign=True)
    tok = None
    if any(os.path.exists(os.path.join(path, f)) for f in ('tokenizer.json', 'vocab.json')):
        from tokenizer import load_tokenizer  # imported here: the model alone needs no tokenizer
        tok = load_tokenizer(path)
    return model, tok


def load_model(init_from, dtype=torch.float32, device='cpu', seed=0, *, n_layer=4, n_head=4,
               n_kv_head=2, n_embd=128, max_seq_len=1024):
    """(model, tokenizer) from an HF snapshot directory or hub id, or for init_from='scratch' a
    random Qwen2-shaped model of the given shape (MLP 4 x n_embd, tied head) with the byte
    tokenizer: the offline demo, smoke tests. A snapshot without tokenizer files is a
    ModelLoadError, as is every problem with the files."""
    if init_from == 'scratch':
        from tokenizer import byte_tokenizer
        tok = byte_tokenizer()
        cfg = ModelConfig(arch='qwen2', vocab_size=tok.vocab_size, n_layer=n_layer, n_head=n_head,
                          n_kv_head=n_kv_head, n_embd=n_embd, intermediate_size=4 * n_embd,
                          max_seq_len=max_seq_len, tie_word_embeddings=True)
        return from_scratch(cfg, dtype=dtype, device=device, seed=seed), tok
    model, tok = from_pretrained(init_from, dtype=dtype, device=device)
    if tok is None:
        raise ModelLoadError(f"{init_from}: the snapshot has no tokenizer files")
    return model, tok


def save_pretrained(model, tokenizer, out_dir, state_dict=None, dtype=None):
    """Write an HF snapshot (config.json + model.safetensors in dtype, default the weights' own +
    tokenizer files + generation_config.json naming the stop ids, so transformers and vLLM stop
    where we stop) that from_pretrained and transformers both load. Written beside out_dir, then
    renamed into place, so a crash never leaves a half-written snapshot where an old one was.
    state_dict: the weights to write instead of model's own (e.g. gathered whole from FSDP
    shards)."""
    from safetensors.torch import save_file
    cfg = model.config
    state_dict = model.state_dict() if state_dict is None else state_dict
    dtype = dtype or state_dict['wte.weight'].dtype
    with atomic_dir(out_dir) as tmp:
        with open(os.path.join(tmp, 'config.json'), 'w') as f:
            json.dump(config_to_hf(cfg, dtype), f, indent=2)
        # own, dense copies: safetensors refuses views that share storage (our fused q/k/v split
        # apart)
        tensors = {}
        for k, v in to_hf(state_dict, cfg).items():
            v = v.detach().to('cpu', dtype if v.is_floating_point() else v.dtype)
            tensors[k] = v.clone(memory_format=torch.contiguous_format)
        save_file(tensors, os.path.join(tmp, 'model.safetensors'), metadata={'format': 'pt'})
        if tokenizer is not None:
            tokenizer.save(tmp)
            with open(os.path.join(tmp, 'generation_config.json'), 'w') as f:
                stops = {'eos_token_id': tokenizer.stop_ids, 'pad_token_id': tokenizer.pad_id}
                json.dump(stops, f, indent=2)
    return os.path.abspath(out_dir)


@contextlib.contextmanager
def atomic_dir(out_dir):
    """A fresh folder beside out_dir to write into, renamed into place when the block ends without
    an error, so a crash never leaves a half-written directory where an old one was (the old one
    goes only after the rename)."""
    out_dir = os.path.abspath(out_dir)
    tmp = out_dir + f'.tmp{os.getpid()}'
    old = out_dir + f'.old{os.getpid()}'
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
        if os.path.exists(out_dir):
            os.rename(out_dir, old)
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
