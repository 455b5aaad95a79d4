"""model.py against transformers on tiny random checkpoints built here (no download): logits,
KV-cache decoding, padded batches, cache row ops, export round trip, sharded loading, bf16, and
one-line errors for bad snapshots."""
import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf as H
import model as M

transformers = pytest.importorskip('transformers')

TOL = 1e-4  # fp32 logit parity with transformers (max abs difference)
V = 300  # vocab of the tiny configs

HF_CONFIGS = {  # name -> (config class, kwargs)
    'qwen2_gqa_tied': ('Qwen2Config', dict(vocab_size=V, hidden_size=64, intermediate_size=160,
                                           num_hidden_layers=2, num_attention_heads=4,
                                           num_key_value_heads=2, tie_word_embeddings=True,
                                           max_position_embeddings=256)),
    'qwen2_untied_theta': ('Qwen2Config', dict(vocab_size=V, hidden_size=64, intermediate_size=96,
                                               num_hidden_layers=3, num_attention_heads=8,
                                               num_key_value_heads=2, tie_word_embeddings=False,
                                               rope_theta=500.0, rms_norm_eps=1e-5,
                                               max_position_embeddings=256)),
    'gpt2': ('GPT2Config', dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                bos_token_id=0, eos_token_id=0)),
}


def make_hf_model(name, seed=0):
    """A transformers model of a tiny config with every parameter random (HF's init zeroes biases
    and sets norms to one, which would hide a bias or norm weight loaded into the wrong place)."""
    return perturbed_hf(*HF_CONFIGS[name], seed)


def perturbed_hf(cls_name, kw, seed=0):
    """transformers' causal LM of config class cls_name(**kw), every parameter moved by N(0,
    0.05^2)."""
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls_name)(**kw)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return hf


@pytest.fixture(scope='module', params=list(HF_CONFIGS))
def snapshot(request, tmp_path_factory):
    """(snapshot dir written by transformers, the transformers model, our model loaded from the
    dir)"""
    hf = make_hf_model(request.param)
    path = str(tmp_path_factory.mktemp(request.param))
    hf.save_pretrained(path)
    ours, tok = H.from_pretrained(path)
    assert tok is None  # no tokenizer files in these snapshots
    return path, hf, ours.eval()


@torch.no_grad()
def hf_logits(hf, idx):
    """transformers' logits for idx (B, T), or (T,) as a batch of one"""
    return hf(idx if idx.dim() == 2 else idx[None]).logits


def maxdiff(a, b):
    return (a.float() - b.float()).abs().max().item()


@torch.no_grad()
def test_full_forward_matches_transformers(snapshot):
    _, hf, ours = snapshot
    torch.manual_seed(1)
    idx = torch.randint(0, V, (3, 21))
    d = maxdiff(ours(idx), hf_logits(hf, idx))
    assert d <= TOL, f'full-forward logits differ from transformers by {d:.2e}'


@torch.no_grad()
def test_prefill_then_8_cached_steps_match_transformers(snapshot):
    _, hf, ours = snapshot
    torch.manual_seed(2)
    idx = torch.randint(0, V, (2, 13))
    ref = hf_logits(hf, idx)  # causal: position t's logits are those of the prefix idx[:, :t+1]
    cache = M.KVCache(ours.config, 2, 16, torch.float32, 'cpu')
    got = [ours(idx[:, :5], kv_cache=cache)]
    for t in range(5, 13):
        got.append(ours(idx[:, t:t + 1], kv_cache=cache))
    for t, d in enumerate((torch.cat(got, 1) - ref).abs().amax(dim=(0, 2)).tolist()):
        assert d <= TOL, f'position {t} (prefill 0-4, then one step at a time) differs by {d:.2e}'
    assert cache.lengths.tolist() == [13, 13]


@torch.no_grad()
def test_right_padded_batch_prefill_and_decode_equal_each_row_alone(snapshot):
    _, hf, ours = snapshot
    torch.manual_seed(3)
    lens = [3, 9, 6]
    seqs = [torch.randint(0, V, (n + 8,)) for n in lens]  # prompt, then 8 decoded tokens per row
    # padding is random junk: it must not leak into real positions
    idx = torch.randint(0, V, (3, 9))
    for b, n in enumerate(lens):
        idx[b, :n] = seqs[b][:n]
    cache = M.KVCache(ours.config, 3, 20, torch.float32, 'cpu')
    pre = ours(idx, kv_cache=cache, input_lengths=torch.tensor(lens))
    steps = []
    for t in range(8):
        tokens = torch.stack([s[n + t] for s, n in zip(seqs, lens)])
        steps.append(ours(tokens[:, None], kv_cache=cache))
    for b, n in enumerate(lens):
        ref = hf_logits(hf, seqs[b])[0]
        d = maxdiff(pre[b, :n], ref[:n])
        assert d <= TOL, \
            f'row {b} (prompt length {n} of 9): prefill logits differ from the row alone by {d:.2e}'
        d = maxdiff(torch.cat([s[b] for s in steps]), ref[n:n + 8])
        assert d <= TOL, \
            f'row {b} (prompt length {n} of 9): decode logits differ from the row alone by {d:.2e}'
    assert cache.lengths.tolist() == [n + 8 for n in lens]


@torch.no_grad()
def test_last_only_returns_each_rows_last_real_token(snapshot):
    _, _, ours = snapshot
    torch.manual_seed(4)
    idx = torch.randint(0, V, (3, 7))
    lens = torch.tensor([2, 7, 4])
    cache = M.KVCache(ours.config, 3, 8, torch.float32, 'cpu')
    full = ours(idx, kv_cache=cache, input_lengths=lens)
    cache = M.KVCache(ours.config, 3, 8, torch.float32, 'cpu')
    last = ours(idx, kv_cache=cache, input_lengths=lens, last_only=True)
    assert last.shape == (3, 1, V)
    assert torch.allclose(last[:, 0], full[torch.arange(3), lens - 1], atol=1e-6), \
        'last_only picked the wrong position'


@torch.no_grad()
def test_repeat_interleave_shares_a_prefill_between_samples(snapshot):
    _, hf, ours = snapshot
    torch.manual_seed(5)
    lens = [4, 6]
    G = 3
    prompts = [torch.randint(0, V, (n,)) for n in lens]
    idx = torch.zeros(2, 6, dtype=torch.long)
    for b, p in enumerate(prompts):
        idx[b, :len(p)] = p
    cache = M.KVCache(ours.config, 2, 12, torch.float32, 'cpu')
    ours(idx, kv_cache=cache, input_lengths=torch.tensor(lens))
    cache = cache.repeat_interleave(G)
    assert cache.lengths.tolist() == [4, 4, 4, 6, 6, 6]
    conts = torch.randint(0, V, (2 * G, 4))  # every copy continues differently
    got = torch.cat([ours(conts[:, t:t + 1], kv_cache=cache) for t in range(4)], 1)
    for r in range(2 * G):
        p = prompts[r // G]
        ref = hf_logits(hf, torch.cat([p, conts[r]]))[0, len(p):]
        d = maxdiff(got[r], ref)
        assert d <= TOL, \
            f'copy {r % G} of prompt {r // G}: decode after repeat_interleave differs by {d:.2e}'


@torch.no_grad()
def test_select_keeps_rows_decoding_as_without_it(snapshot):
    _, _, ours = snapshot
    torch.manual_seed(6)
    idx = torch.randint(0, V, (5, 6))
    lens = torch.tensor([6, 2, 5, 3, 4])
    conts = torch.randint(0, V, (5, 6))
    keep = torch.tensor([4, 1, 2])  # reordered, as compaction may do
    full = M.KVCache(ours.config, 5, 14, torch.float32, 'cpu')
    part = M.KVCache(ours.config, 5, 14, torch.float32, 'cpu')
    ours(idx, kv_cache=full, input_lengths=lens)
    ours(idx, kv_cache=part, input_lengths=lens)
    for t in range(3):
        ours(conts[:, t:t + 1], kv_cache=full)
        ours(conts[:, t:t + 1], kv_cache=part)
    part = part.select(keep)
    assert part.lengths.tolist() == (lens[keep] + 3).tolist()
    for t in range(3, 6):
        a = ours(conts[:, t:t + 1], kv_cache=full)[keep]
        b = ours(conts[keep, t:t + 1], kv_cache=part)
        d = maxdiff(a, b)
        assert d <= 1e-5, \
            f'step {t}: rows {keep.tolist()} decode differently after select ({d:.2e})'


def test_cache_overflow_is_an_error(snapshot):
    _, _, ours = snapshot
    cache = M.KVCache(ours.config, 1, 4, torch.float32, 'cpu')
    ours(torch.zeros(1, 3, dtype=torch.long), kv_cache=cache)
    with pytest.raises(ValueError, match='KV cache overflow'):
        ours(torch.zeros(1, 2, dtype=torch.long), kv_cache=cache)


# -----------------------------------------------------------------------------
# export, sharding, dtypes

SCRATCH = {
    'qwen2_gqa_tied': M.ModelConfig(arch='qwen2', vocab_size=V, n_layer=2, n_head=4, n_kv_head=2,
                                    n_embd=64, intermediate_size=160, max_seq_len=256,
                                    tie_word_embeddings=True),
    'qwen2_untied_theta': M.ModelConfig(arch='qwen2', vocab_size=V, n_layer=2, n_head=8,
                                        n_kv_head=2, n_embd=64, intermediate_size=96,
                                        max_seq_len=256, rope_theta=500.0, norm_eps=1e-5,
                                        tie_word_embeddings=False, bos_token_id=1,
                                        eos_token_id=[2, 3]),
    'gpt2': M.ModelConfig(arch='gpt2', vocab_size=V, n_layer=2, n_head=4, n_kv_head=4, n_embd=64,
                          intermediate_size=256, max_seq_len=64, norm_eps=1e-5,
                          tie_word_embeddings=True),
}


def random_model(cfg, seed=0, dtype=torch.float32):
    m = M.from_scratch(cfg, dtype=torch.float32, seed=seed)
    # from_scratch zeroes biases and sets norms to one; make every tensor count
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return m.to(dtype).eval()


@pytest.mark.parametrize('name', list(SCRATCH))
@torch.no_grad()
def test_export_loads_in_transformers_and_back(name, tmp_path):
    ours = random_model(SCRATCH[name])
    H.save_pretrained(ours, None, tmp_path / 'snap')
    with open(tmp_path / 'snap' / 'config.json') as f:
        assert json.load(f)['model_type'] == SCRATCH[name].arch
    names = load_file(tmp_path / 'snap' / 'model.safetensors').keys()
    assert ('lm_head.weight' in names) == (not SCRATCH[name].tie_word_embeddings), \
        'tied head must not be saved twice'
    check_export_round_trip(ours, tmp_path / 'snap', T=17, seed=7)


def check_export_round_trip(ours, snap, T, seed):
    """ours, saved at snap: transformers loads it with ours's logits (<= 1e-5) and from_pretrained
    gives back the same config and bit-identical weights. Returns transformers' model."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(snap).eval()
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, ours.config.vocab_size, (2, T), generator=g)
    d = maxdiff(hf(idx).logits, ours(idx))
    assert d <= 1e-5, f'transformers loads our export with logits {d:.2e} away from ours'
    back, _ = H.from_pretrained(snap)
    assert back.config == ours.config
    for (k, a), b in zip(ours.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), f'{k} changed in the save/load round trip'
    return hf


def test_export_keeps_the_model_dtype(tmp_path):
    ours = random_model(SCRATCH['qwen2_gqa_tied'], dtype=torch.bfloat16)
    H.save_pretrained(ours, None, tmp_path / 'snap')
    saved = load_file(tmp_path / 'snap' / 'model.safetensors')
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    back, _ = H.from_pretrained(tmp_path / 'snap', dtype=torch.bfloat16)
    pairs = zip(ours.state_dict().values(), back.state_dict().values())
    assert all(torch.equal(a, b) for a, b in pairs)


class _FailingTokenizer:
    def save(self, out_dir):
        open(os.path.join(out_dir, 'tokenizer.json'), 'w').write('{"trunc')
        raise OSError('disk full')


def test_failed_export_leaves_the_old_snapshot_in_place(tmp_path):
    old = random_model(SCRATCH['gpt2'], seed=1)
    new = random_model(SCRATCH['gpt2'], seed=2)
    H.save_pretrained(old, None, tmp_path / 'snap')
    with pytest.raises(OSError, match='disk full'):
        H.save_pretrained(new, _FailingTokenizer(), tmp_path / 'snap')
    assert os.listdir(tmp_path) == ['snap'], \
        f'leftovers after a failed save: {os.listdir(tmp_path)}'
    assert sorted(os.listdir(tmp_path / 'snap')) == ['config.json', 'model.safetensors']
    loaded, _ = H.from_pretrained(tmp_path / 'snap')
    assert torch.equal(loaded.wte.weight, old.wte.weight), \
        'the old snapshot was damaged by a failed save'
    H.save_pretrained(new, None, tmp_path / 'snap')  # and a good save replaces it
    loaded, _ = H.from_pretrained(tmp_path / 'snap')
    assert torch.equal(loaded.wte.weight, new.wte.weight) and os.listdir(tmp_path) == ['snap']


def test_export_writes_tokenizer_files_that_load_back(tmp_path):
    tokenizer = pytest.importorskip('tokenizer')
    tok = tokenizer.byte_tokenizer()
    cfg = M.ModelConfig(arch='qwen2', vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1,
                        n_embd=32, intermediate_size=64)
    H.save_pretrained(M.from_scratch(cfg), tok, tmp_path / 'snap')
    _, back = H.from_pretrained(tmp_path / 'snap')
    assert back is not None
    assert back.encode_with_special('hi<|im_end|>') == tok.encode_with_special('hi<|im_end|>')


@torch.no_grad()
def test_sharded_checkpoint_loads(tmp_path):
    hf = make_hf_model('qwen2_untied_theta')
    hf.save_pretrained(tmp_path, max_shard_size='100KB')
    shards = [f for f in os.listdir(tmp_path) if f.endswith('.safetensors')]
    assert os.path.exists(tmp_path / 'model.safetensors.index.json') and len(shards) > 1, shards
    ours, _ = H.from_pretrained(tmp_path)
    idx = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(8))
    d = maxdiff(ours(idx), hf(idx).logits)
    assert d <= TOL, f'model loaded from {len(shards)} shards differs from transformers by {d:.2e}'


@torch.no_grad()
def test_gpt2_checkpoint_in_the_original_layout_loads(tmp_path):
    """openai-community/gpt2's file has no 'transformer.' prefix and carries the causal-mask
    buffers."""
    hf = make_hf_model('gpt2')
    hf.save_pretrained(tmp_path)
    saved = load_file(tmp_path / 'model.safetensors')
    tensors = {k.removeprefix('transformer.'): v for k, v in saved.items()}
    tensors.update({f'h.{i}.attn.bias': torch.ones(1, 1, 64, 64).tril() for i in range(2)})
    save_file(tensors, tmp_path / 'model.safetensors', metadata={'format': 'pt'})
    ours, _ = H.from_pretrained(tmp_path)
    idx = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(10))
    d = maxdiff(ours(idx), hf(idx).logits)
    assert d <= TOL, f'unprefixed GPT-2 checkpoint loads with logits {d:.2e} off'


@torch.no_grad()
def test_bf16_forward_is_close_to_fp32(snapshot):
    path, _, ours = snapshot
    low, _ = H.from_pretrained(path, dtype=torch.bfloat16)
    idx = torch.randint(0, V, (2, 13), generator=torch.Generator().manual_seed(9))
    ref = ours(idx)
    out = low(idx)
    assert out.dtype == torch.bfloat16
    scale = ref.abs().max().item()
    d = maxdiff(out, ref)
    assert d <= 0.05 * scale, f'bf16 logits are {d:.3f} from fp32 (logit scale {scale:.2f})'
    # and the cached path agrees in bf16 too
    cache = M.KVCache(low.config, 2, 13, torch.bfloat16, 'cpu')
    steps = [low(idx[:, :9], kv_cache=cache)]
    steps += [low(idx[:, t:t + 1], kv_cache=cache) for t in range(9, 13)]
    steps = torch.cat(steps, 1)
    d = maxdiff(steps, ref)
    assert d <= 0.05 * scale, f'bf16 cached decoding is {d:.3f} from fp32 (logit scale {scale:.2f})'


def test_from_scratch_is_seeded():
    cfg = SCRATCH['qwen2_gqa_tied']
    a = M.from_scratch(cfg, seed=1)
    b = M.from_scratch(cfg, seed=1)
    c = M.from_scratch(cfg, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters())), \
        'same seed, different weights'
    assert not torch.equal(a.wte.weight, c.wte.weight), 'different seeds gave the same weights'
    assert abs(a.wte.weight.std().item() - 0.02) < 0.002 and not a.h[0].attn.c_attn.bias.any()


def test_qwen25_05b_shape_has_the_published_parameter_count():
    with torch.device('meta'):
        m = M.GPT(M.qwen25_05b_config())
    # Qwen2.5-0.5B's model card: 0.49B (tied embedding counted once)
    assert m.num_params() == 494_032_768



def test_a_decode_step_dispatches_few_operators_per_layer():
    """Eager decoding on a GPU is bound by the operators a step dispatches (each a launch or a
    host-side dispatch): one decode forward's aten operators per layer, views included, counted by
    bench/bench_decode_ops.py's decode_forward_counts (a layer's count: 3 layers' minus 2 layers').
    The layer works on 2-D rows (no reshape around each matmul), keeps (B, T, heads, hd) for RoPE
    and the cache write (no transposes), and gets its mask as a float bias built once a forward; 66
    a layer before that, 48 after (the CPU: its RMSNorm alone is 6 operators, 1 kernel on CUDA)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), 'bench'))
    from bench_decode_ops import decode_forward_counts

    def ops(n_layer):
        cfg = M.ModelConfig(arch='qwen2', vocab_size=64, n_layer=n_layer, n_head=4, n_kv_head=2,
                            n_embd=32, intermediate_size=48)
        counts = decode_forward_counts(M.GPT(cfg).eval(), 3, 5)
        assert 0 < counts['views'] < counts['ops'] and 'device_launches' not in counts
        return counts['ops']
    per_layer = ops(3) - ops(2)
    assert per_layer <= 50, f'{per_layer} operators a layer in a decode forward'


def test_the_cached_attention_gets_a_bias_sdpa_takes_as_it_is(monkeypatch):
    """The mask of a forward over a cache reaches SDPA as an additive bias in the query's dtype
    with its strides a multiple of 8 (else SDPA's memory-efficient CUDA kernel would turn a bool
    mask into a bias, or copy an unaligned one, in every layer); here over 13 positions, not a
    multiple of 8."""
    seen = []
    real = M.F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, **kw):
        seen.append(attn_mask)
        return real(q, k, v, attn_mask=attn_mask, **kw)
    monkeypatch.setattr(M.F, 'scaled_dot_product_attention', sdpa)
    cfg = SCRATCH['qwen2_gqa_tied']
    model = M.from_scratch(cfg, dtype=torch.bfloat16)
    cache = M.KVCache(cfg, 2, 16, torch.bfloat16, 'cpu')
    with torch.no_grad():
        model(torch.ones(2, 10, dtype=torch.long), kv_cache=cache)
        seen.clear()
        model(torch.ones(2, 3, dtype=torch.long), kv_cache=cache)  # T > 1: SDPA on the CPU too
    assert len(seen) == cfg.n_layer
    for mask in seen:
        assert mask.dtype == torch.bfloat16 and mask.shape[-1] == 13, (mask.dtype, mask.shape)
        assert all(st % 8 == 0 for st in mask.stride()[:-1]), mask.stride()


# -----------------------------------------------------------------------------
# bad input: one clear line naming the file and the field or tensor

def load_error(path):
    with pytest.raises(H.ModelLoadError) as e:
        H.from_pretrained(path)
    msg = str(e.value)
    assert '\n' not in msg, f'error message is not one line: {msg!r}'
    return msg


@pytest.fixture
def qwen_snapshot(tmp_path):
    H.save_pretrained(random_model(SCRATCH['qwen2_gqa_tied']), None, tmp_path / 'snap')
    return tmp_path / 'snap'


def test_missing_directory_is_named(tmp_path):
    msg = load_error(tmp_path / 'no_such_snapshot')
    assert 'no_such_snapshot' in msg and 'no such directory' in msg, msg


def test_a_directory_without_config_json_is_no_snapshot(tmp_path):
    (tmp_path / 'notes.txt').write_text('not a model')
    assert load_error(tmp_path) == f"{tmp_path}: not a Hugging Face model snapshot (no config.json there)"


def test_missing_checkpoint_file_is_named(tmp_path):
    """sample.py --init_from=OUT_DIR/ckpt_*.pt that is not there: its path and what it is, one line."""
    from sample import load_run_checkpoint
    path = str(tmp_path / 'ckpt_0000050.pt')
    with pytest.raises(FileNotFoundError) as e:
        load_run_checkpoint(path)
    assert str(e.value) == f'{path}: no such checkpoint file'


def test_unreachable_hub_id_says_to_pass_a_local_directory(monkeypatch):
    # fail fast, also where there is a network
    monkeypatch.setattr('huggingface_hub.constants.HF_HUB_OFFLINE', True)
    msg = load_error('no-such-org-xyz/no-such-model-xyz')
    assert 'no-such-org-xyz/no-such-model-xyz' in msg and 'local snapshot directory' in msg, msg


def test_config_missing_a_field_names_file_and_field(qwen_snapshot):
    cfg = json.loads((qwen_snapshot / 'config.json').read_text())
    del cfg['num_attention_heads']
    (qwen_snapshot / 'config.json').write_text(json.dumps(cfg))
    msg = load_error(qwen_snapshot)
    assert 'config.json' in msg and "'num_attention_heads'" in msg and 'missing' in msg, msg


def test_missing_config_is_named(qwen_snapshot):
    os.remove(qwen_snapshot / 'config.json')
    assert 'config.json' in load_error(qwen_snapshot)


def rewrite_weights(snap, edit):
    tensors = load_file(snap / 'model.safetensors')
    edit(tensors)
    save_file(tensors, snap / 'model.safetensors', metadata={'format': 'pt'})


def test_wrong_shaped_tensor_names_file_tensor_and_shapes(qwen_snapshot):
    name = 'model.layers.1.self_attn.k_proj.weight'

    def cut(tensors):
        tensors[name] = tensors[name][:16]

    rewrite_weights(qwen_snapshot, cut)
    msg = load_error(qwen_snapshot)
    assert 'model.safetensors' in msg and f"'{name}'" in msg, msg
    assert '(16, 64)' in msg and '(32, 64)' in msg, msg


def test_missing_tensor_names_file_and_tensor(qwen_snapshot):
    name = 'model.layers.0.mlp.up_proj.weight'
    rewrite_weights(qwen_snapshot, lambda t: t.pop(name))
    msg = load_error(qwen_snapshot)
    assert 'model.safetensors' in msg and f"'{name}'" in msg and 'missing' in msg, msg


def test_unexpected_tensor_is_named(qwen_snapshot):

    def add(tensors):
        tensors['model.layers.7.extra.weight'] = torch.zeros(2)

    rewrite_weights(qwen_snapshot, add)
    msg = load_error(qwen_snapshot)
    assert 'model.safetensors' in msg and 'unexpected' in msg, msg
    assert "'model.layers.7.extra.weight'" in msg, msg


def test_corrupt_safetensors_file_is_named(qwen_snapshot):
    header_size = b'\x10\x00\x00\x00\x00\x00\x00\x00'
    (qwen_snapshot / 'model.safetensors').write_bytes(header_size + b'{"a": truncated')
    msg = load_error(qwen_snapshot)
    assert 'model.safetensors' in msg, msg


def test_unsupported_model_type_is_named(qwen_snapshot):
    cfg = json.loads((qwen_snapshot / 'config.json').read_text())
    cfg['model_type'] = 'gemma3'
    (qwen_snapshot / 'config.json').write_text(json.dumps(cfg))
    msg = load_error(qwen_snapshot)
    assert 'config.json' in msg and "'gemma3'" in msg, msg


def test_grad_checkpoint_gives_the_same_gradients():
    from model import ModelConfig, from_scratch
    cfg = ModelConfig(arch='qwen2', vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                      intermediate_size=64, max_seq_len=32)
    x = torch.randint(0, 64, (2, 10))
    grads = []
    for ckpt in (False, True):
        m = from_scratch(cfg, seed=0).train()
        m.grad_checkpoint = ckpt
        m(x).float().logsumexp(-1).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6), \
        "activation checkpointing changed the gradients"


def test_atomic_dir_keeps_the_old_directory_when_writing_fails(tmp_path):
    """save_pretrained and the LoRA adapter export write through hf.atomic_dir: a crash mid-write
    leaves the old snapshot as it was and no half-written folder; a finished write replaces it
    whole."""
    out = tmp_path / 'hf'
    out.mkdir()
    (out / 'model.safetensors').write_text('old')
    with pytest.raises(RuntimeError):
        with H.atomic_dir(out) as tmp:
            open(os.path.join(tmp, 'model.safetensors'), 'w').write('half')
            raise RuntimeError('crash mid-write')
    assert (out / 'model.safetensors').read_text() == 'old'
    assert sorted(p.name for p in tmp_path.iterdir()) == ['hf']
    with H.atomic_dir(out) as tmp:
        open(os.path.join(tmp, 'config.json'), 'w').write('new')
    assert sorted(p.name for p in out.iterdir()) == ['config.json']
    assert [p.name for p in tmp_path.iterdir()] == ['hf']
