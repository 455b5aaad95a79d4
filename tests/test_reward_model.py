"""Rewards from models (reward_model.py, model.py's sequence classifier, reward.py's batched
contract): parity with transformers on tiny random snapshots built here, the chat template rendered
as transformers renders it, a judge whose P(yes) is known by construction, GRPO raising a reward
model's score, and one-line start-up errors for bad input."""
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

import hf as H
import model as M
import reward_model as RM
from reward import check_reward_config, resolve_rewards, score
from test_chat_template import QWEN25 as QWEN25_TEMPLATE
from tokenizer import byte_tokenizer
import warm

transformers = pytest.importorskip('transformers')

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4  # fp32 parity with transformers (max abs difference)
V = 300  # vocab of the tiny configs (the byte tokenizer's 260 tokens fit)
PAD = 259  # the byte tokenizer's <|pad|>, the classifiers' pad_token_id
CLASSIFIERS = {  # name -> (config class, kwargs)
    'qwen2_1label': ('Qwen2Config', dict(vocab_size=V, hidden_size=64, intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=128,
                                         pad_token_id=PAD, num_labels=1,
                                         tie_word_embeddings=False)),
    'gpt2_2labels': ('GPT2Config', dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4,
                                        n_positions=256, pad_token_id=PAD, num_labels=2)),
    'olmo2_1label': ('Olmo2Config', dict(vocab_size=V, hidden_size=64, intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=128,
                                         pad_token_id=PAD, num_labels=1)),
    'gemma3_1label': ('Gemma3TextConfig', dict(vocab_size=V, hidden_size=64, intermediate_size=96,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               head_dim=16, sliding_window=128, max_position_embeddings=128,
                                               layer_types=['sliding_attention', 'full_attention'],
                                               pad_token_id=PAD, num_labels=1)),
}
EX = [{'question': 'Tom has 12 apples and gets 7 more. How many?', 'answer': '19'},
      {'question': 'What is 3 + 4?', 'answer': '7'}]
COMPLETIONS = ['12+7=19\n#### 19', 'I think it is 8.', '3+4=7 so \\boxed{7}', '']


def perturbed(hf, seed=0):
    """Every parameter random (HF zeroes biases and sets norms to one, which would hide a misplaced
    tensor)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return hf.eval()


def write_snapshot(hf, path, template=None):
    """hf saved by transformers, with the byte tokenizer's files (and optionally another chat
    template)."""
    hf.save_pretrained(path)
    byte_tokenizer().save(path)
    if template is not None:
        conf = json.loads(Path(path, 'tokenizer_config.json').read_text())
        conf = {**conf, 'chat_template': template}
        Path(path, 'tokenizer_config.json').write_text(json.dumps(conf))
    return str(path)


@pytest.fixture(scope='module', params=list(CLASSIFIERS))
def classifier(request, tmp_path_factory):
    """(snapshot dir, the transformers classifier, our model loaded from the dir)"""
    cls, kw = CLASSIFIERS[request.param]
    config = getattr(transformers, cls)(**kw)
    hf = perturbed(transformers.AutoModelForSequenceClassification.from_config(config))
    path = write_snapshot(hf, tmp_path_factory.mktemp(request.param), QWEN25_TEMPLATE)
    return path, hf, H.from_pretrained(path)[0].eval()


def right_padded(rows):
    idx = torch.full((len(rows), max(map(len, rows))), PAD)
    for r, s in enumerate(rows):
        idx[r, :len(s)] = torch.tensor(s)
    return idx


@torch.no_grad()
def test_sequence_scores_match_transformers_on_a_right_padded_batch(classifier):
    _, hf, ours = classifier
    torch.manual_seed(1)
    rows = [torch.randint(0, 256, (n,)).tolist() for n in (11, 4, 7)]
    # real tokens equal to the pad id: last, inside
    rows += [rows[0][:5] + [PAD], rows[1][:2] + [PAD] + rows[1][2:]]
    idx = right_padded(rows)
    want = hf(idx).logits  # transformers pools at the rightmost non-pad token, whatever the padding
    got = ours.sequence_scores(idx)
    assert got.shape == want.shape == (5, ours.config.num_labels)
    d = (got - want).abs().max().item()
    assert d <= TOL, f'sequence_scores differ from transformers by {d:.2e}'
    def last_real(r):
        return max(i for i, t in enumerate(r) if t != PAD)
    alone = torch.cat([ours.sequence_scores(torch.tensor([r[:last_real(r) + 1]])) for r in rows])
    d = (got - alone).abs().max().item()
    assert d <= TOL, f'a row scored in a padded batch differs from the row alone by {d:.2e}'


@torch.no_grad()
def test_export_round_trip_loads_in_transformers_with_equal_logits(classifier, tmp_path):
    _, hf, ours = classifier
    out = H.save_pretrained(ours, None, tmp_path / 'rm')
    cfg = json.loads(Path(out, 'config.json').read_text())
    assert cfg['architectures'][0].endswith('ForSequenceClassification')
    assert cfg['pad_token_id'] == PAD
    back = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    idx = right_padded([[5, 9, 200, 31], [7, 8]])
    assert back.config.num_labels == ours.config.num_labels
    d = (back(idx).logits - hf(idx).logits).abs().max().item()
    assert d <= TOL, f'the exported snapshot scores differently in transformers ({d:.2e})'
    assert H.from_pretrained(out)[0].config.num_labels == ours.config.num_labels


def test_chat_template_renders_as_transformers_renders_it(classifier):
    path = classifier[0]
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    convs = [([{'role': 'user', 'content': 'Q?'},
               {'role': 'assistant', 'content': 'A <b>'}], False),
             ([{'role': 'system', 'content': 'Be brief.'},
               {'role': 'user', 'content': 'Q?'}], True)]
    for msgs, gen in convs:
        want = hf_tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True)
        assert RM.render(RM.snapshot(path), msgs, gen) == want['input_ids'], (
            f'{msgs}: rendered unlike apply_chat_template')


def task_messages(ex):  # what train_grpo passes: the task's prompt messages for an example
    return [{'role': 'system', 'content': 'Reason step by step.'},
            {'role': 'user', 'content': ex['question']}]


def test_reward_model_scores_as_transformers_with_scale_shift_and_clip(classifier):
    """The whole path: task messages + completion through the RM's template, batches sorted and
    padded, the label's logit (one label) or probability (two), then scale/shift/clip; against
    transformers row by row."""
    path, hf, _ = classifier
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    exs = [EX[i % 2] for i in range(len(COMPLETIONS))]
    want = []
    for c, ex in zip(COMPLETIONS, exs):
        ids = hf_tok.apply_chat_template(task_messages(ex) + [{'role': 'assistant', 'content': c}],
                                         tokenize=True)['input_ids']
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0]
        want.append((logits[0] if len(logits) == 1 else logits.softmax(-1)[-1]).item())
    got = RM.reward_model(COMPLETIONS, exs, path, batch_size=3, messages=task_messages)
    assert max(abs(a - b) for a, b in zip(got, want)) <= TOL, f'scores {got} != transformers {want}'
    got = RM.reward_model(COMPLETIONS, exs, path, batch_size=2, scale=3.0, shift=-1.0, clip=0.5,
                          messages=task_messages)
    want = [min(0.5, max(-0.5, 3.0 * w - 1.0)) for w in want]
    assert max(abs(a - b) for a, b in zip(got, want)) <= TOL, f'scale/shift/clip: {got} != {want}'


# -----------------------------------------------------------------------------
# the batched reward contract (reward.py)

def test_a_batched_fn_is_called_once_per_step_with_facts_as_lists():
    calls = []

    def scorer(completions, examples, bonus=0.0, n_tokens=None):
        calls.append((list(completions), n_tokens))
        return [len(c) + bonus for c in completions]
    scorer.batched = True
    fns = [(scorer, 2.0, {'bonus': 1.0}), ('length', 1.0, {'max_len': 100})]
    out = score(['a', 'bbb', ''], [EX[0]] * 3, fns,
                extra_kwargs=[{'n_tokens': n} for n in (1, 3, 0)])
    assert calls == [(['a', 'bbb', ''], [1, 3, 0])], (
        f'one call with every completion and its facts: {calls}')
    assert out['per_fn']['scorer'] == [2.0, 4.0, 1.0] and out['total'] == [4.0, 8.0, 2.0]


def test_a_failing_batched_fn_fails_every_sample_with_one_message():
    def down(completions, examples):
        raise RuntimeError('reward server unreachable')
    down.batched = True

    def short(completions, examples):
        return [1.0]
    short.batched = True
    out = score(['a', 'b', 'c'], [EX[0]] * 3, [(down, 1.0), (short, 1.0)], failure_reward=-1.0)
    assert out['per_fn'] == {'down': [-1.0] * 3, 'short': [-1.0] * 3} and out['all_failed']
    assert out['errors'] == {'down': 3, 'short': 3}
    msgs = out['error_msgs']
    assert len(msgs) == 2 and 'unreachable' in msgs[0] and '1 values for 3' in msgs[1], msgs


def test_run_facts_reach_the_model_rewards_and_user_kwargs_win(classifier):
    path = classifier[0]

    def msgs(ex):
        return [{'role': 'user', 'content': ex['question']}]
    entries = [('reward_model', 1.0, {'path': path, 'dtype': 'float64'}), ('correct', 0.5)]
    out = resolve_rewards(entries, device='cpu', dtype='float32', messages=msgs)
    assert out[0] == {'name': 'reward_model', 'weight': 1.0,
                      'kwargs': {'path': path, 'device': 'cpu', 'dtype': 'float64',
                                 'messages': msgs}}
    assert out[1] == {'name': 'correct', 'weight': 0.5, 'kwargs': {}}, (
        'a fn that does not ask gets no run facts')


# -----------------------------------------------------------------------------
# the judge

def constant_judge(path, p_yes):
    """A causal model whose next-token distribution is the same after any input, with P('Y') /
    (P('Y') + P('N')) = p_yes: every token embeds to e_0, attention and MLP add nothing, the final
    norm maps e_0 to e_0, and the head's column 0 holds log-odds log(p / (1 - p)) on 'Y' and 0 on
    'N' (and 5 on 'x': the verdict is renormalised over the two words, whatever else is likely)."""
    tok = byte_tokenizer()
    cfg = M.ModelConfig(arch='qwen2', vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=1,
                        n_embd=8, intermediate_size=8, tie_word_embeddings=False)
    model = M.from_scratch(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.wte.weight[:, 0] = 1.0
        # RMSNorm of e_0 is sqrt(8) e_0 (less eps)
        model.ln_f.weight[0] = math.sqrt(1 / 8 + cfg.norm_eps)
        model.lm_head.weight[ord('Y'), 0] = math.log(p_yes / (1 - p_yes))
        model.lm_head.weight[ord('x'), 0] = 5.0
    return H.save_pretrained(model, tok, path)


def test_judge_pays_p_yes_over_p_yes_plus_p_no(tmp_path):
    path = constant_judge(tmp_path / 'judge', 0.8)
    got = RM.judge(COMPLETIONS, [EX[0]] * len(COMPLETIONS), path, yes='Y', no='N', batch_size=3)
    assert all(abs(g - 0.8) < 1e-5 for g in got), f'P(yes) by construction 0.8, judged {got}'


def test_judge_matches_transformers_on_a_random_model(tmp_path):
    """The question filled in, rendered by the judge's template, next-token logits at its last
    token: against transformers' apply_chat_template and forward, one prompt at a time."""
    kw = {k: v for k, v in CLASSIFIERS['qwen2_1label'][1].items() if k != 'num_labels'}
    cfg = transformers.Qwen2Config(**kw)
    hf = perturbed(transformers.AutoModelForCausalLM.from_config(cfg), seed=3)
    path = write_snapshot(hf, tmp_path / 'judge', QWEN25_TEMPLATE)
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    template = 'Problem: {question}\nAnswer given: {completion}\nReference: {answer}\nCorrect?'
    want = []
    for c in COMPLETIONS:
        text = template.format(question=EX[0]['question'], completion=c, answer=EX[0]['answer'])
        conv = [{'role': 'system', 'content': 'Judge.'}, {'role': 'user', 'content': text}]
        ids = hf_tok.apply_chat_template(conv, add_generation_prompt=True,
                                         tokenize=True)['input_ids']
        with torch.no_grad():
            p = hf(torch.tensor([ids])).logits[0, -1].softmax(-1)
        want.append((p[ord('Y')] / (p[ord('Y')] + p[ord('N')])).item())
    got = RM.judge(COMPLETIONS, [EX[0]] * len(COMPLETIONS), path, template=template, yes='Y',
                   no='N', system='Judge.', batch_size=3)
    assert max(abs(a - b) for a, b in zip(got, want)) <= TOL, f'judge {got} != transformers {want}'


# -----------------------------------------------------------------------------
# GRPO on a reward model's score

def digit_counter(path):
    """A Qwen2 reward model (one label) whose score rises with the share of digits among the tokens
    it reads: embeddings e_1 for every token plus e_0 for digits; q = k = 0, so attention averages
    the values, which copy the digit indicator into e_2; MLP off; the head reads e_2 after the final
    norm (increasing in the average)."""
    tok = byte_tokenizer()
    cfg = M.ModelConfig(arch='qwen2', vocab_size=tok.vocab_size, n_layer=1, n_head=1, n_kv_head=1,
                        n_embd=8, intermediate_size=8, tie_word_embeddings=False, num_labels=1,
                        pad_token_id=tok.pad_id)
    model = M.from_scratch(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith('ln_1.weight') and not name.endswith('ln_f.weight'):
                p.zero_()
        model.wte.weight[:, 1] = 1.0
        model.wte.weight[ord('0'):ord('9') + 1, 0] = 1.0
        model.h[0].attn.c_attn.weight[16, 0] = 1.0  # v (rows 16-23) = the normed digit indicator
        model.h[0].attn.c_proj.weight[2, 0] = 1.0
        model.score.weight[0, 2] = 1.0
    return H.save_pretrained(model, tok, path)


def test_digit_counter_scores_more_digits_higher(tmp_path):
    path = digit_counter(tmp_path / 'rm')
    got = RM.reward_model(['abc', 'a1c', '123', '12345'], [EX[1]] * 4, path)
    assert got == sorted(got) and len(set(got)) == 4, f'more digits should score higher: {got}'


def test_grpo_rewarded_by_a_reward_model_raises_its_score(tmp_path):
    rm = digit_counter(tmp_path / 'rm')
    from test_train import TINY, env
    args = [a for a in TINY if not a.startswith('--rewards=')] + [
        f"--rewards=[{{'name': 'reward_model', 'kwargs': {{'path': '{rm}', 'batch_size': 64}}}}]",
        f'--out_dir={tmp_path / "run"}', '--max_steps=8', '--lr=3e-2', '--group_size=8',
        '--batch_prompts=8', '--micro_batch_size=64', '--max_new_tokens=8', '--save_every=100']
    p = warm.run([sys.executable, str(ROOT / 'train_grpo.py'), *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env=env())
    assert p.returncode == 0, (
        f"train_grpo.py exited {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    rows = [json.loads(line) for line in open(tmp_path / 'run' / 'metrics.jsonl')][1:]
    r = [m['reward/reward_model/mean'] for m in rows]
    assert all('timing_s/reward' in m for m in rows)
    first, last = sum(r[:3]) / 3, sum(r[-3:]) / 3
    assert last > first + 0.04, (f"the reward model's mean score did not rise: first 3 steps "
                                 f"{first:.3f}, last 3 {last:.3f}: {r}")


# -----------------------------------------------------------------------------
# bad input: one line at start-up naming the file and the field

def edit_config(path, **changes):
    cfg = json.loads(Path(path, 'config.json').read_text())
    cfg.update(changes)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    Path(path, 'config.json').write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture
def rm_dir(tmp_path):
    return digit_counter(tmp_path / 'rm')


@pytest.mark.parametrize('case', ['causal_lm', 'no_pad', 'no_score_tensor', 'tokenizer_mismatch',
                                  'template'])
def test_bad_reward_model_is_one_line_naming_file_and_field(case, rm_dir, tmp_path):
    RM.snapshot.cache_clear()
    if case == 'causal_lm':
        path = constant_judge(tmp_path / 'lm', 0.5)
        needle = r"config\.json: field 'architectures'"
    elif case == 'no_pad':
        path = edit_config(rm_dir, pad_token_id=None)
        needle = r"config\.json: missing field 'pad_token_id'"
    elif case == 'no_score_tensor':
        from safetensors.torch import load_file, save_file
        f = os.path.join(rm_dir, 'model.safetensors')
        save_file({k: v for k, v in load_file(f).items() if k != 'score.weight'}, f)
        path, needle = rm_dir, r"model\.safetensors: missing tensor 'score\.weight'"
    elif case == 'tokenizer_mismatch':
        from safetensors.torch import load_file, save_file
        f = os.path.join(rm_dir, 'model.safetensors')
        tensors = load_file(f)
        save_file({k: v[:200] if k == 'model.embed_tokens.weight' else v
                   for k, v in tensors.items()}, f)
        path = edit_config(rm_dir, vocab_size=200)
        needle = r"tokenizer\.json: the tokenizer has 260 tokens.*vocab_size"
    else:  # a template that drops the assistant turn
        conf = json.loads(Path(rm_dir, 'tokenizer_config.json').read_text())
        conf['chat_template'] = ("{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}"
                                 "{% endif %}{% endfor %}")
        Path(rm_dir, 'tokenizer_config.json').write_text(json.dumps(conf))
        path, needle = rm_dir, r"tokenizer_config\.json: field 'chat_template' leaves out"
    with pytest.raises(ValueError, match=needle) as e:
        check_reward_config([{'name': 'reward_model', 'kwargs': {'path': path}}])
    assert '\n' not in str(e.value), 'the error should be one line'


@pytest.mark.parametrize('kwargs, needle', [
    ({'template': 'Is this right? {question}'}, 'needs {completion}'),
    ({'template': 'Judge {problem}: {completion}'}, "KeyError: 'problem'"),
    ({'yes': 'Yes'}, "yes='Yes' is 3 tokens"),
    ({'yes': 'N'}, 'the same token'),
])
def test_bad_judge_config_is_one_line(kwargs, needle, tmp_path):
    path = constant_judge(tmp_path / 'judge', 0.5)
    with pytest.raises(ValueError, match=needle.replace('{', r'\{').replace('}', r'\}')):
        kw = {'path': path, 'yes': 'Y', 'no': 'N', **kwargs}
        check_reward_config([{'name': 'judge', 'kwargs': kw}])


def test_train_grpo_exits_2_naming_the_file(rm_dir):
    edit_config(rm_dir, pad_token_id=None)
    from test_train import TINY, env
    args = [a for a in TINY if not a.startswith('--rewards=')] + [
        f"--rewards=[{{'name': 'reward_model', 'kwargs': {{'path': '{rm_dir}'}}}}]",
        f'--out_dir={rm_dir}/run']
    p = warm.run([sys.executable, str(ROOT / 'train_grpo.py'), *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env=env())
    assert p.returncode == 2, f'exit {p.returncode}: {p.stderr[-1000:]}'
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and 'config.json' in lines[0] and 'pad_token_id' in lines[0], lines


# -----------------------------------------------------------------------------
# when a model reward gives no signal (metrics.reward_spread, safety.warn)

def test_reward_spread_per_function_by_hand():
    import metrics
    sc = {'per_fn': {'judge': [0.8] * 4 + [0.3] * 4 + [0.1, 0.9, 0.5, 0.5],
                     'correct': [0.0, 1.0, 0.0, 0.0] + [1.0] * 4 + [0.0, 0.0, 1.0, 0.0]}}
    got = metrics.reward_spread(sc, G=4)
    assert math.isclose(got['reward/judge/frac_zero_std'], 2 / 3), got
    assert math.isclose(got['reward/correct/frac_zero_std'], 1 / 3), got
    want = torch.tensor(sc['per_fn']['judge']).std().item()
    assert math.isclose(got['reward/judge/std'], want, rel_tol=1e-6)


def test_zero_spread_warning_names_the_model_reward_and_what_to_check(capsys):
    import safety
    m = {'frac_zero_std': 0.9, 'logprob/mean': -2.0, 'loss': 0.1, 'grad_norm': 1.0,
         'tokens_trained': 10, 'response_len/clip_frac': 0.6, 'kl': 0.0,
         'reward/judge/frac_zero_std': 0.9, 'reward/judge/mean': 1.0,
         'reward/correct/frac_zero_std': 1.0}
    counts = safety.warn(safety.new_guards(), m, skipped=False, max_new_tokens=8)
    out = capsys.readouterr().out
    line = next((x for x in out.splitlines() if 'judge_zero_spread' in x), '')
    assert counts.get('warn/judge_zero_spread') == 1, counts
    assert 'warn/correct_zero_spread' not in counts, counts
    for needle in ('90% of groups', "'path'", 'template', '60% truncated', 'saturated'):
        assert needle in line, f'the warning should mention {needle!r}: {line}'
    m['reward/judge/frac_zero_std'] = 0.4
    counts = safety.warn(safety.new_guards(), m, skipped=False, max_new_tokens=8)
    assert 'warn/judge_zero_spread' not in counts, (
        'a reward with a spread in most groups is not warned about')


def test_off_policy_warnings_name_the_share_and_the_fixes(capsys):
    """More than half of the tokens masked by off_policy_mask, and VESPO's weight near 0, each a
    warning that names the figure and what to lower; neither below its line."""
    import safety
    m = {'frac_zero_std': 0.5, 'logprob/mean': -2.0, 'loss': 0.1, 'grad_norm': 1.0,
         'tokens_trained': 10, 'response_len/clip_frac': 0.0, 'kl': 0.0,
         'off_policy/masked_frac': 0.75, 'vespo/phi_mean': 0.02}
    counts = safety.warn(safety.new_guards(), m, skipped=False, max_new_tokens=8)
    out = capsys.readouterr().out
    assert counts.get('warn/off_policy_masked') == 1 and counts.get('warn/vespo_phi_low') == 1
    assert '75% of the trained tokens' in out and 'averaged 0.020' in out and 'num_iterations' in out
    m.update({'off_policy/masked_frac': 0.2, 'vespo/phi_mean': 0.6})
    assert safety.warn(safety.new_guards(), m, skipped=False, max_new_tokens=8) == {}


def test_train_grpo_warns_when_a_judge_ties_every_group(tmp_path):
    """A judge that answers the same whatever it reads (P(yes) = 0.8 by construction): train_grpo
    logs its per-function spread and warns, naming the judge and what to check."""
    judge = constant_judge(tmp_path / 'judge', 0.8)
    from test_train import TINY, env
    args = [a for a in TINY if not a.startswith('--rewards=')] + [
        f"--rewards=[{{'name': 'judge', 'kwargs': {{'path': '{judge}', 'yes': 'Y', 'no': 'N'}}}}]",
        f'--out_dir={tmp_path / "run"}', '--max_steps=2']
    p = warm.run([sys.executable, str(ROOT / 'train_grpo.py'), *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env=env())
    assert p.returncode == 0, (
        f"train_grpo.py exited {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    rows = [json.loads(line) for line in open(tmp_path / 'run' / 'metrics.jsonl')][1:]
    assert all(m['reward/judge/frac_zero_std'] == 1.0 for m in rows), rows
    assert all(m['reward/judge/std'] == 0.0 for m in rows), rows
    assert all(abs(m['reward/judge/mean'] - 0.8) < 1e-5 for m in rows), rows
    warning = 'WARNING [judge_zero_spread]: judge gave all completions of a group the same score'
    assert p.stdout.count(warning) == 2
