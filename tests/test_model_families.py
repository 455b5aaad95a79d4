"""Qwen3 and Llama 3.x against transformers on tiny random checkpoints built here: logits of a full
forward and of prefill + cached decode, export round trip, and one-line errors for the variants we
refuse."""
import json

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
    assert cfg.arch == hf.config.model_type and cfg.head_dim == hf.config.head_dim
    assert cfg.rope_scaling == (None if cfg.arch == 'qwen3' else (8.0, 1.0, 8.0, 64))
    assert (ours.h[0].attn.q_norm is not None) == (cfg.arch == 'qwen3')
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
def test_llama3_scaling_changes_the_logits():
    """The scaled frequencies matter at the tested positions: the same weights with plain RoPE
    differ clearly."""
    hf = make_hf_model('llama3')
    plain = transformers.LlamaConfig(**{**HF_CONFIGS['llama3'][1], 'rope_scaling': None})
    hf_plain = transformers.AutoModelForCausalLM.from_config(plain).eval()
    hf_plain.load_state_dict(hf.state_dict())
    idx = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(4))
    assert maxdiff(hf(idx).logits, hf_plain(idx).logits) > 100 * TOL


def write_config(path, **changes):
    """A valid tiny Qwen3 snapshot at path with config.json fields changed (None deletes one)."""
    make_hf_model('qwen3_tied').save_pretrained(path)
    with open(path / 'config.json') as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path / 'config.json', 'w') as f:
        json.dump({k: v for k, v in cfg.items() if v is not None}, f)


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


def test_llama_with_mlp_bias_is_refused(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2, mlp_bias=True)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    hf.save_pretrained(tmp_path)
    with pytest.raises(H.ModelLoadError, match=r'config\.json: mlp_bias=True is not supported'):
        H.from_pretrained(tmp_path)
