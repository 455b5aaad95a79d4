"""Qwen3, Llama 3.x, Mistral, OLMo 2 and SmolLM3 against transformers on tiny random checkpoints
built here: logits of a full forward and of prefill + cached decode (fp32 and bf16), export round
trip, GRPO from an OLMo 2 Instruct-shaped snapshot, and one-line errors for the variants and
tokenizers we refuse."""
import json
import math

import pytest
import torch

import hf as H
import model as M
from test_model import check_export_round_trip, perturbed_hf

transformers = pytest.importorskip('transformers')

TOL = 1e-4  # fp32 logit parity with transformers (max abs difference)
V = 300
LLAMA3 = dict(rope_type='llama3', factor=8.0, low_freq_factor=1.0, high_freq_factor=8.0,
              # wavelengths: < 8 kept, 8..64 smoothed, > 64 divided by 8
              original_max_position_embeddings=64)

HF_CONFIGS = {  # name -> (config class, kwargs)
    # head_dim 24 != 64 / 4: an explicit head_dim; GQA 4 query heads on 2 kv heads; untied
    'qwen3': ('Qwen3Config', dict(vocab_size=V, hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=24, rope_theta=1000.0, tie_word_embeddings=False,
                                  max_position_embeddings=256, rms_norm_eps=1e-5)),
    'qwen3_tied': ('Qwen3Config', dict(vocab_size=V, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=1, num_attention_heads=2,
                                       num_key_value_heads=1, head_dim=8, tie_word_embeddings=True,
                                       max_position_embeddings=256)),
    # head_dim from hidden / heads = 16: RoPE wavelengths 6.3 (kept), 20 and 63 (smoothed), 200+
    # (scaled)
    'llama3': ('LlamaConfig', dict(vocab_size=V, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, tie_word_embeddings=False,
                                   max_position_embeddings=512, rope_scaling=LLAMA3)),
    'llama3_head_dim': ('LlamaConfig', dict(vocab_size=V, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4,
                                            num_key_value_heads=1, head_dim=12,
                                            tie_word_embeddings=False, rope_theta=500.0,
                                            rope_scaling=LLAMA3)),
    # Mistral: Llama's network without RoPE scaling; no sliding window; Nemo's explicit head_dim
    'mistral': ('MistralConfig', dict(vocab_size=V, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=24, sliding_window=None,
                                      tie_word_embeddings=False, max_position_embeddings=256,
                                      rope_theta=1000.0)),
    # OLMo 2: each sublayer's output normed (post-norm), q and k normed over all heads at once
    'olmo2': ('Olmo2Config', dict(vocab_size=V, hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, tie_word_embeddings=False,
                                  max_position_embeddings=256, rope_theta=500.0,
                                  rms_norm_eps=1e-6)),
    # SmolLM3: Llama's network, every no_rope_layer_interval-th layer without RoPE (here the 2nd
    # of 3), tied head
    'smollm3': ('SmolLM3Config', dict(vocab_size=V, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, no_rope_layer_interval=2,
                                      max_position_embeddings=256, rope_theta=5000.0,
                                      pad_token_id=None, bos_token_id=1, eos_token_id=2)),
    # Phi-3 / Phi-4-mini: q/k/v and gate/up stored fused, RoPE on half of each head (8 of 16
    # channels), 'longrope' short factors (positions up to 64 here) with its attention factor
    'phi3': ('Phi3Config', dict(vocab_size=V, hidden_size=64, intermediate_size=96,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                partial_rotary_factor=0.5, max_position_embeddings=256,
                                original_max_position_embeddings=64, tie_word_embeddings=True,
                                rope_scaling=dict(type='longrope', short_factor=[1.0, 1.5, 4.0, 9.0],
                                                  long_factor=[2.0, 3.0, 8.0, 20.0]),
                                pad_token_id=None, bos_token_id=1, eos_token_id=2)),
    # Gemma 3 (text): a sliding-window layer on each side of a global one, each kind its own RoPE
    # base; queries scaled by query_pre_attn_scalar (20, not head_dim 24); the window (96) is the
    # context; embeddings scaled by sqrt(64); tied head
    'gemma3': ('Gemma3TextConfig', dict(vocab_size=V, hidden_size=64, intermediate_size=96,
                                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=24, max_position_embeddings=512, sliding_window=96,
                                        query_pre_attn_scalar=20, layer_types=[
                                            'sliding_attention', 'full_attention', 'sliding_attention'],
                                        rope_parameters={
                                            'full_attention': dict(rope_type='default', rope_theta=1e5),
                                            'sliding_attention': dict(rope_type='default', rope_theta=1e3)})),
    'olmo2_tied_mha': ('Olmo2Config', dict(vocab_size=V, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=1, num_attention_heads=2,
                                           tie_word_embeddings=True,
                                           max_position_embeddings=256)),
}


def make_hf_model(name, seed=0):
    """Every parameter perturbed (HF's init sets norms, the q/k norms included, to one, which would
    hide a norm weight loaded into the wrong place or not applied)."""
    return perturbed_hf(*HF_CONFIGS[name], seed)


@pytest.fixture(scope='module', params=list(HF_CONFIGS))
def snapshot(request, tmp_path_factory):
    hf = make_hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ours, _ = H.from_pretrained(path)
    return path, hf, ours.eval()


def maxdiff(a, b):
    return (a.float() - b.float()).abs().max().item()


@torch.no_grad()
def test_config_is_read_as_intended(snapshot):
    _, hf, ours = snapshot
    cfg = ours.config
    head_dim = getattr(hf.config, 'head_dim', None) or hf.config.hidden_size // cfg.n_head
    assert cfg.arch == hf.config.model_type and cfg.head_dim == head_dim
    llama3 = cfg.arch == 'llama'
    assert cfg.rope_scaling == ((8.0, 1.0, 8.0, 64) if llama3 else None)
    assert (ours.h[0].attn.q_norm is not None) == (cfg.arch in ('qwen3', 'olmo2', 'gemma3_text'))
    assert ours.h[0].post_norm == (cfg.arch == 'olmo2')
    assert (ours.h[0].ln_1a is not None) == (cfg.arch == 'gemma3_text')
    if cfg.arch == 'gemma3_text':
        assert cfg.sliding_layers == (1, 0, 1) and cfg.sliding_window == 96 and cfg.max_seq_len == 512
        assert (cfg.rope_theta, cfg.local_rope_theta, cfg.attn_scale) == (1e5, 1e3, 20 ** -0.5)
    nope = getattr(hf.config, 'no_rope_layers', None)
    assert [b.rope for b in ours.h] == [bool(f) for f in nope or [1] * cfg.n_layer]
    if cfg.arch == 'smollm3':
        assert nope == [1, 0, 1], nope
    assert ours.h[0].attn.c_attn.bias is None


@torch.no_grad()
def test_full_forward_matches_transformers(snapshot):
    _, hf, ours = snapshot
    idx = torch.randint(0, V, (3, 40), generator=torch.Generator().manual_seed(1))
    d = maxdiff(ours(idx), hf(idx).logits)
    print(f'{ours.config.arch} full forward max |diff| {d:.2e}')
    assert d <= TOL, f'full-forward logits differ from transformers by {d:.2e}'


@torch.no_grad()
def test_prefill_then_cached_steps_match_transformers(snapshot):
    _, hf, ours = snapshot
    idx = torch.randint(0, V, (2, 30), generator=torch.Generator().manual_seed(2))
    ref = hf(idx).logits
    cache = M.KVCache(ours.config, 2, 32, torch.float32, 'cpu')
    got = [ours(idx[:, :7], kv_cache=cache)]
    got += [ours(idx[:, t:t + 1], kv_cache=cache) for t in range(7, 30)]
    per_pos = (torch.cat(got, 1) - ref).abs().amax(dim=(0, 2))
    print(f'{ours.config.arch} prefill + decode max |diff| {per_pos.max():.2e}')
    for t, d in enumerate(per_pos.tolist()):
        assert d <= TOL, f'position {t} (prefill 0-6, then one step at a time) differs by {d:.2e}'
    assert cache.lengths.tolist() == [30, 30]


@torch.no_grad()
def test_export_loads_in_transformers_and_back(snapshot, tmp_path):
    _, hf, ours = snapshot
    H.save_pretrained(ours, None, tmp_path / 'snap')
    with open(tmp_path / 'snap' / 'config.json') as f:
        assert json.load(f)['architectures'] == [type(hf).__name__]
    assert type(check_export_round_trip(ours, tmp_path / 'snap', T=33, seed=3)) is type(hf)


@torch.no_grad()
def test_bf16_forward_rounds_as_transformers_does(snapshot):
    """In bf16 each family rounds where transformers does (OLMo 2's norms apply their gain in fp32
    before rounding, the others after): the logits of the same bf16 weights stay within a few bf16
    steps of transformers' over two layers, far nearer than bf16 is to fp32."""
    path, hf, _ = snapshot
    ours, _ = H.from_pretrained(path, dtype=torch.bfloat16)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    idx = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(5))
    ref = hf(idx).logits
    d, gap = maxdiff(ours(idx), theirs(idx).logits), maxdiff(theirs(idx).logits, ref)
    print(f'{ours.config.arch} bf16: ours vs transformers {d:.3e}, bf16 vs fp32 {gap:.3e}')
    assert d <= gap / 4, f'bf16 logits {d:.3e} from transformers\' (bf16 vs fp32: {gap:.3e})'


@torch.no_grad()
def test_smollm3s_layers_without_rope_change_the_logits(tmp_path):
    """Applying RoPE in SmolLM3's NoPE layer too changes the logits clearly: the per-layer switch
    is what matches transformers above."""
    hf = make_hf_model('smollm3')
    hf.save_pretrained(tmp_path)
    ours, _ = H.from_pretrained(tmp_path)
    idx = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(4))
    want = ours.eval()(idx)
    ours.h[1].rope = True
    assert maxdiff(ours(idx), want) > 100 * TOL


@torch.no_grad()
def test_phi3s_partial_rotary_and_longrope_change_the_logits_and_bound_the_context(tmp_path):
    """Rotating every channel, or plain RoPE instead of longrope's short factors and attention
    factor, changes the logits clearly: what matches transformers above is each of them. Past
    original_max_position_embeddings transformers would switch to long_factor: generation there is
    refused, and a forward there (plain, packed by its positions, or one step of a cache)."""
    import dataclasses
    from sample import generate
    from tokenizer import byte_tokenizer
    hf = make_hf_model('phi3')
    hf.save_pretrained(tmp_path)
    ours, _ = H.from_pretrained(tmp_path)
    cfg = ours.config
    assert cfg.rotary_dim == 8 and cfg.max_seq_len == 64 and cfg.longrope[0] == 256
    assert cfg.longrope[1] == pytest.approx((1 + math.log(4) / math.log(64)) ** 0.5)
    idx = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(4))
    logits = []
    for change in ({}, dict(longrope=None), dict(longrope=None, rotary_dim=0)):
        ours.config = dataclasses.replace(cfg, **change)
        logits.append(ours.eval()(idx))
    ours.config = cfg
    assert maxdiff(logits[1], logits[0]) > 100 * TOL, 'longrope changed nothing'
    assert maxdiff(logits[2], logits[1]) > 100 * TOL, 'rotating all channels changed nothing'
    with pytest.raises(ValueError, match=r"exceeds the model's max_seq_len 64"):
        generate(ours, byte_tokenizer(), [[5] * 40], 1, 30)
    ours(torch.zeros(1, 64, dtype=torch.long))  # the original context, whole: fine
    far = r'sequence of 65 positions exceeds the model maximum 64'
    with pytest.raises(ValueError, match=far):  # a forward
        ours(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match=far):  # packed rows: their positions, not their length
        ours(torch.zeros(1, 70, dtype=torch.long), pos=torch.arange(70)[None] % 65)
    ours(torch.zeros(1, 70, dtype=torch.long), pos=torch.arange(70)[None] % 64)
    cache = M.KVCache(cfg, 1, 80, torch.float32, 'cpu')
    ours(torch.zeros(1, 64, dtype=torch.long), kv_cache=cache)
    with pytest.raises(ValueError, match=far):  # a cache: one step past it
        ours(torch.zeros(1, 1, dtype=torch.long), kv_cache=cache)


@torch.no_grad()
def test_gemma3s_own_parts_change_the_logits(tmp_path):
    """Gemma 3's sliding-window layers' own RoPE base, query_pre_attn_scalar and the embedding's
    scale each change the logits clearly: what matches transformers is each of them. Gemma 3's
    published layout (rope_theta, rope_local_base_freq, sliding_window_pattern) reads as
    transformers 5's."""
    import dataclasses
    hf = make_hf_model('gemma3')
    hf.save_pretrained(tmp_path)
    ours, _ = H.from_pretrained(tmp_path)
    ours.eval()
    cfg = ours.config
    idx = torch.randint(0, V, (2, 50), generator=torch.Generator().manual_seed(4))
    ref = hf(idx).logits
    logits = []
    for change in (dict(local_rope_theta=cfg.rope_theta), dict(query_pre_attn_scalar=0.0), dict(arch='mistral')):
        ours.config = dataclasses.replace(cfg, **change)
        for block in ours.h:
            block.attn.cfg = ours.config
        logits.append(ours(idx))
    ours.config = cfg
    for block in ours.h:
        block.attn.cfg = cfg
    for name, other in zip(('the local RoPE base', 'query_pre_attn_scalar', 'the embedding scale'), logits):
        assert maxdiff(other, ref) > 100 * TOL, f'{name} changed nothing'
    published = json.loads((tmp_path / 'config.json').read_text())
    published.pop('layer_types')
    rope = published.pop('rope_parameters')
    published.update(rope_theta=rope['full_attention']['rope_theta'], sliding_window_pattern=2,
                     rope_local_base_freq=rope['sliding_attention']['rope_theta'], rope_scaling=None)
    (tmp_path / 'config.json').write_text(json.dumps(published))
    again, _ = H.from_pretrained(tmp_path)
    assert again.config == cfg
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert maxdiff(again.eval()(idx), theirs(idx).logits) <= TOL


@torch.no_grad()
def test_phi4_minis_published_config_layout_reads_as_transformers_5s(tmp_path):
    """Phi-4-mini's config.json as published (transformers 4): partial_rotary_factor and
    original_max_position_embeddings at the top, rope_scaling {'type': 'longrope', ...}, a
    sliding_window longer than its context. It reads into the same model as the rope_parameters
    layout transformers 5 writes, with transformers' logits."""
    write_config(tmp_path / 'new', 'phi3')
    new, _ = H.from_pretrained(tmp_path / 'new')
    factors = {k: HF_CONFIGS['phi3'][1]['rope_scaling'][k] for k in ('short_factor', 'long_factor')}
    write_config(tmp_path, 'phi3', rope_parameters=None, rope_theta=1e4, partial_rotary_factor=0.5,
                 sliding_window=1024, original_max_position_embeddings=64,
                 rope_scaling={'type': 'longrope', **factors})
    old, _ = H.from_pretrained(tmp_path)
    assert old.config == new.config
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    idx = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(7))
    assert maxdiff(old.eval()(idx), theirs(idx).logits) <= TOL


@torch.no_grad()
def test_llama3_scaling_changes_the_logits():
    """The scaled frequencies matter at the tested positions: the same weights with plain RoPE
    differ clearly."""
    hf = make_hf_model('llama3')
    plain = transformers.LlamaConfig(**{**HF_CONFIGS['llama3'][1], 'rope_scaling': None})
    hf_plain = transformers.AutoModelForCausalLM.from_config(plain).eval()
    hf_plain.load_state_dict(hf.state_dict())
    idx = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(4))
    assert maxdiff(hf(idx).logits, hf_plain(idx).logits) > 100 * TOL


def write_config(path, name='qwen3_tied', **changes):
    """A valid tiny snapshot of HF_CONFIGS[name] at path with config.json fields changed (None
    deletes one)."""
    make_hf_model(name).save_pretrained(path)
    with open(path / 'config.json') as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path / 'config.json', 'w') as f:
        json.dump({k: v for k, v in cfg.items() if k not in changes or v is not None}, f)


@pytest.mark.parametrize('changes, message', [
    (dict(use_sliding_window=True), r'use_sliding_window=True is not supported'),
    (dict(model_type='qwen3_moe', architectures=['Qwen3MoeForCausalLM']),
     r"model_type 'qwen3_moe' is not supported"),
    (dict(attention_bias=True), r'attention_bias=True is not supported'),
    (dict(rope_parameters=dict(rope_type='yarn', factor=4.0, rope_theta=1e4)),
     r"field 'rope_parameters' has rope_type 'yarn', not supported"),
    (dict(rope_scaling=dict(type='dynamic', factor=2.0)),
     r"field 'rope_scaling' has rope_type 'dynamic'"),
    (dict(rope_scaling=dict(rope_type='llama3', factor=8.0)),
     r"field 'rope_scaling' of rope_type 'llama3' needs"),
])
def test_unsupported_configs_are_one_clear_error(tmp_path, changes, message):
    write_config(tmp_path, **changes)
    with pytest.raises(H.ModelLoadError, match=message) as e:
        H.from_pretrained(tmp_path)
    assert str(e.value).startswith(str(tmp_path / 'config.json')) and '\n' not in str(e.value)


@pytest.mark.parametrize('name, changes, message', [
    ('mistral', dict(sliding_window=0), r'sliding_window=0 is not supported \(null or a positive int\)'),
    ('olmo2', dict(attention_bias=True), r'attention_bias=True is not supported'),
    ('smollm3', dict(use_sliding_window=True, sliding_window=64),
     r'use_sliding_window=True is not supported'),
    ('phi3', dict(rope_scaling=dict(type='longrope', short_factor=[1.0], long_factor=[1.0])),
     r"field 'rope_scaling' of rope_type 'longrope' needs original_max_position_embeddings and "
     r"short_factor and long_factor of 4 numbers each"),
    # none of the head's 16 channels rotated (which rotary_dim 0 would read as all of them)
    ('phi3', dict(rope_parameters=None, rope_theta=1e4, partial_rotary_factor=0.01),
     r"partial_rotary_factor=0.01 does not give a positive even number of the head's 16 channels"),
    ('smollm3', dict(no_rope_layers=[1, 0]),
     r"field 'no_rope_layers' should be 3 zeros and ones \(one per layer\), got \[1, 0\]"),
    # Gemma 2's soft-capping; a layer kind Gemma 3 has not; scaled RoPE in the sliding-window layers
    ('gemma3', dict(final_logit_softcapping=30.0), r'final_logit_softcapping=30.0 is not supported'),
    ('gemma3', dict(layer_types=['sliding_attention', 'chunked_attention', 'full_attention']),
     r"field 'layer_types' should be 3 of 'sliding_attention' and 'full_attention'"),
    ('gemma3', dict(rope_parameters=dict(full_attention=dict(rope_type='default', rope_theta=1e4),
                                         sliding_attention=dict(rope_type='linear', factor=2.0, rope_theta=1e3))),
     r"field 'rope_parameters' has rope_type 'linear' for sliding_attention, not supported"),
    ('gemma3', dict(rope_parameters=dict(full_attention=dict(rope_type='linear', factor=8.0, rope_theta=1e6),
                                         sliding_attention=dict(rope_type='default', rope_theta=1e4))),
     r"field 'rope_scaling' has rope_type 'linear', not supported"),
])
def test_unsupported_mistral_olmo2_smollm3_and_phi3_configs(tmp_path, name, changes, message):
    write_config(tmp_path, name, **changes)
    with pytest.raises(H.ModelLoadError, match=message) as e:
        H.from_pretrained(tmp_path)
    assert str(e.value).startswith(str(tmp_path / 'config.json')) and '\n' not in str(e.value)


def test_a_window_as_long_as_the_context_is_no_window(tmp_path):
    write_config(tmp_path, 'mistral', sliding_window=HF_CONFIGS['mistral'][1]['max_position_embeddings'])
    ours, _ = H.from_pretrained(tmp_path)
    assert ours.config.sliding_layers is None
    H.save_pretrained(ours, None, tmp_path / 'export')
    with open(tmp_path / 'export' / 'config.json') as f:
        assert json.load(f)['sliding_window'] is None


@pytest.mark.parametrize('name, window', [('mistral', 12), ('phi3', 20), ('gemma3', 12)])
@torch.no_grad()
def test_a_sliding_window_matches_transformers_past_it(tmp_path, name, window):
    """Every layer of a Mistral 7B v0.1 (a window of 4,096; transformers' default when the field is
    absent) or a Phi-3-mini-4k (2,047), and Gemma 3's sliding-window layers, see only the last
    window positions: past it, logits equal transformers' for a plain forward of 50 tokens and a
    prefill of 20 then one step at a time, and the window changes them. The export writes it back."""
    import dataclasses
    hf = perturbed_hf(HF_CONFIGS[name][0], {**HF_CONFIGS[name][1], 'sliding_window': window})
    hf.save_pretrained(tmp_path)
    ours, _ = H.from_pretrained(tmp_path)
    ours.eval()
    cfg = ours.config
    assert cfg.sliding_window == window and len(cfg.sliding_layers) == cfg.n_layer
    idx = torch.randint(0, V, (2, 50), generator=torch.Generator().manual_seed(4))
    ref = hf(idx).logits
    assert maxdiff(ours(idx), ref) <= TOL
    cache = M.KVCache(cfg, 2, 64, torch.float32, 'cpu')
    got = [ours(idx[:, :20], kv_cache=cache)] + [ours(idx[:, t:t + 1], kv_cache=cache) for t in range(20, 50)]
    assert maxdiff(torch.cat(got, 1), ref) <= TOL
    ours.config = dataclasses.replace(cfg, sliding_window=0)
    assert maxdiff(ours(idx), ref) > 100 * TOL, 'the window changed nothing'
    ours.config = cfg
    H.save_pretrained(ours, None, tmp_path / 'export')
    assert json.loads((tmp_path / 'export' / 'config.json').read_text())['sliding_window'] == window
    assert type(check_export_round_trip(ours, tmp_path / 'export', T=40, seed=3)) is type(hf)


def test_llama_with_mlp_bias_is_refused(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2, mlp_bias=True)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    hf.save_pretrained(tmp_path)
    with pytest.raises(H.ModelLoadError, match=r'config\.json: mlp_bias=True is not supported'):
        H.from_pretrained(tmp_path)


# OLMo 2 Instruct's chat template (allenai/OLMo-2-1124-*-Instruct, tokenizer_config.json): plain-text
# role markers, <|endoftext|> as the bos written first and as the end of each assistant turn
OLMO2_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<|system|>\\n' + message['content'] + '\\n' }}{% elif message['role'] == 'user' %}"
    "{{ '<|user|>\\n' + message['content'] + '\\n' }}{% elif message['role'] == 'assistant' %}"
    "{% if not loop.last %}{{ '<|assistant|>\\n'  + message['content'] + eos_token + '\\n' }}"
    "{% else %}{{ '<|assistant|>\\n'  + message['content'] + eos_token }}{% endif %}{% endif %}"
    "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}{% endfor %}")
# GPT-4's split pattern, on which OLMo 2's tokenizer is built (digits in runs of up to three)
CL100K_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def olmo2_instruct_snapshot(path):
    """A tiny snapshot laid out as OLMo 2 Instruct's: transformers' Olmo2 weights (vocabulary 300),
    a byte-level BPE trained here on GPT-4's split pattern with <|endoftext|> and <|pad|>, the
    tokenizer config naming <|endoftext|> as bos and eos, and OLMo 2 Instruct's chat template."""
    from tokenizers import (Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers,
                            trainers)
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(CL100K_PATTERN), behavior='isolated', invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=290, special_tokens=['<|endoftext|>', '<|pad|>'],
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(['<|user|>\n<|assistant|>\nLiz has 80 books and sells 7. How many '
                             'books does Liz have?\n#### 73 12 + 7 = 19'] * 50, trainer)
    eos, pad = tok.token_to_id('<|endoftext|>'), tok.token_to_id('<|pad|>')
    kw = {**HF_CONFIGS['olmo2'][1], 'eos_token_id': eos, 'pad_token_id': pad, 'bos_token_id': None}
    perturbed_hf('Olmo2Config', kw).save_pretrained(path)
    tok.save(str(path / 'tokenizer.json'))
    (path / 'tokenizer_config.json').write_text(json.dumps({
        'tokenizer_class': 'GPT2Tokenizer', 'bos_token': '<|endoftext|>',
        'eos_token': '<|endoftext|>', 'pad_token': '<|pad|>', 'chat_template': OLMO2_TEMPLATE}))
    return eos


CHAT = [{'role': 'system', 'content': 'Be brief.'},
        {'role': 'user', 'content': 'Liz has 80 books and sells 7. How many?'}]


def prompts_as_transformers(snap, chats, starts):
    """Our tokenizer of snap, after checking that each chat's prompt ids equal transformers'
    apply_chat_template(tokenize=True) and that the first decodes to starts."""
    from tokenizer import load_tokenizer
    ours, hf = load_tokenizer(str(snap)), transformers.AutoTokenizer.from_pretrained(snap)
    assert ours.vocab_size == len(hf)
    for m in chats:
        want = hf.apply_chat_template(m, add_generation_prompt=True, tokenize=True)
        want = list(want['input_ids'] if hasattr(want, 'keys') else want)
        assert ours.render_chat(m) == want, (ours.decode(ours.render_chat(m)), hf.decode(want))
    assert ours.decode(ours.render_chat(chats[0])).startswith(starts)
    return ours


def trains_and_exports(snap, out, ours, arch, starts):
    """A 2-step GRPO run from snap: finite losses, samples.jsonl's prompts start with starts, and
    the export is the family transformers loads with equal logits, its tokenizer prompting as
    ours; returns our model loaded from the export."""
    from test_train import metrics, run
    run(out, f'--init_from={snap}', '--max_steps=2', '--export_hf=True', '--max_new_tokens=12',
        '--log_samples_every=1', timeout=300)
    rows = [m for m in metrics(out) if 'reward/mean' in m]
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(m['loss'])) for m in rows)
    with open(out / 'samples.jsonl') as f:
        assert json.loads(f.readline())['prompt'].startswith(starts)
    exported, _ = H.from_pretrained(out / 'hf')
    assert exported.config.arch == arch
    with torch.no_grad():
        check_export_round_trip(exported.eval(), out / 'hf', T=20, seed=6)
    assert prompts_as_transformers(out / 'hf', [CHAT[1:]], starts).render_chat(CHAT) == ours.render_chat(CHAT)
    return exported


def test_an_olmo2_instruct_snapshot_prompts_trains_and_exports(tmp_path):
    """Prompts through OLMo 2's template equal transformers' ids, generation stops at its
    <|endoftext|>, and a GRPO run from the snapshot exports an OLMo 2 that transformers loads."""
    snap = tmp_path / 'olmo2'
    eos = olmo2_instruct_snapshot(snap)
    ours = prompts_as_transformers(snap, [CHAT[1:], CHAT], '<|endoftext|><|user|>\n')
    assert eos in ours.stop_ids, 'OLMo 2 ends its turns with <|endoftext|>: generation must stop there'
    assert trains_and_exports(snap, tmp_path / 'run', ours, 'olmo2', '<|endoftext|><|user|>\n').h[0].post_norm


def test_a_mistral_instruct_snapshot_with_its_sentencepiece_tokenizer_trains_and_exports(tmp_path):
    """Mistral 7B Instruct to v0.3 ships a sentencepiece-style tokenizer (transformers'
    LlamaTokenizer, [INST] and [/INST] control tokens): prompts through its template equal
    transformers' ids, generation stops at </s>, and a GRPO run from the snapshot exports a Mistral
    whose tokenizer transformers loads with the same prompts."""
    from test_tokenizer import MISTRAL_TEMPLATE, sentencepiece_snapshot
    from tokenizer import load_tokenizer
    snap = sentencepiece_snapshot(tmp_path / 'mistral', {'tokenizer_class': 'LlamaTokenizer', 'legacy': False},
                                  ['[INST]', '[/INST]'], MISTRAL_TEMPLATE, vocab_size=500, metaspace_file=True)
    kw = {**HF_CONFIGS['mistral'][1], 'vocab_size': load_tokenizer(str(snap)).vocab_size, 'bos_token_id': 1,
          'eos_token_id': 2}
    perturbed_hf(HF_CONFIGS['mistral'][0], kw).save_pretrained(snap)  # (its config.json: AutoTokenizer reads it)
    ours = prompts_as_transformers(snap, [CHAT[1:]], '<s>[INST] Liz has')  # (this template drops a system turn)
    assert ours.stop_ids == [2]
    trains_and_exports(snap, tmp_path / 'run', ours, 'mistral', '<s>[INST] ')


GEMMA3_TEMPLATE = (  # Gemma 3's chat template, its branches for string contents
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + "
    "'\\n\\n' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = \"\" -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}{{ raise_exception(\"Conversation roles must "
    "alternate user/assistant/user/assistant/...\") }}{%- endif -%}{%- if (message['role'] == 'assistant') -%}"
    "{%- set role = \"model\" -%}{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{'<start_of_turn>model\\n'}}{%- endif -%}")


def test_a_gemma3_instruct_snapshot_prompts_trains_and_exports(tmp_path):
    """A Gemma 3 (text) Instruct-shaped snapshot: its sentencepiece tokenizer as transformers'
    GemmaTokenizer (no space before the text), its chat template (a system turn folded into the
    first user turn), <end_of_turn> a stop: prompts equal transformers' ids, a GRPO run trains and
    exports a Gemma 3 transformers loads with equal logits."""
    from test_tokenizer import GEMMA_BASE, GEMMA_CONFIG, sentencepiece_snapshot
    from tokenizer import load_tokenizer
    snap = sentencepiece_snapshot(tmp_path / 'gemma3', GEMMA_CONFIG, ['<start_of_turn>', '<end_of_turn>'],
                                  GEMMA3_TEMPLATE, vocab_size=500, base=GEMMA_BASE)
    tok = load_tokenizer(str(snap))
    turn_end = tok.special['<end_of_turn>']
    kw = {**HF_CONFIGS['gemma3'][1], 'vocab_size': tok.vocab_size, 'pad_token_id': 0, 'eos_token_id': [1, turn_end],
          'bos_token_id': 2}
    perturbed_hf(HF_CONFIGS['gemma3'][0], kw).save_pretrained(snap)  # with generation_config.json's stops
    ours = prompts_as_transformers(snap, [CHAT, CHAT[1:]], '<bos><start_of_turn>user\nBe brief.\n\nLiz')
    assert turn_end in ours.stop_ids and 1 in ours.stop_ids
    exported = trains_and_exports(snap, tmp_path / 'run', ours, 'gemma3_text', '<bos><start_of_turn>user\n')
    assert exported.config.sliding_window == 96


def test_a_tokenizer_that_splits_twice_is_one_clear_error(tmp_path):
    """DeepSeek V3's tokenizer splits digits, then CJK, then GPT-4's pattern over the pieces: one
    tiktoken pattern cannot reproduce that, and taking the last would encode differently from
    transformers without a word. Refused in one line."""
    from tokenizers import Regex, Tokenizer as HFTokenizer, models, pre_tokenizers, trainers
    from tokenizer import TokenizerError, load_tokenizer
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r'\p{N}{1,3}'), behavior='isolated', invert=False),
        pre_tokenizers.Split(Regex(CL100K_PATTERN), behavior='isolated', invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.train_from_iterator(['Liz has 80 books. 12345'] * 20, trainers.BpeTrainer(
        vocab_size=270, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / 'tokenizer.json'))
    with pytest.raises(TokenizerError, match=r'tokenizer\.json: 2 Split steps in pre_tokenizer '
                       'are not supported') as e:
        load_tokenizer(str(tmp_path))
    assert '\n' not in str(e.value)
