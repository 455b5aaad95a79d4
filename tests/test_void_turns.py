"""SimpleTIR's void turns in rollouts with tools: which completions end on one (metrics.void_turn,
on completions generate_with_tools wrote), tools/void_frac, and void_turn_filter: with it on a void
completion weighs nothing in the loss, with it off it counts; train_grpo.py leaves void completions
out of the rows and the normalisers, in every mini-batch, and only with the knob on."""
import pytest
import torch

import metrics
import tasks
from batch import completion_logprobs, train_rows
from loss import policy_loss, token_weights
from model import ModelConfig, from_scratch
from sample import generate_with_tools
from test_tool_rollout import PROMPT, TOK, TOOLS, Scripted, script_of, scripted_completion
import test_train

ANSWER = tasks.answer_fn(tasks.resolve('arith_tools'))  # reward.extract_answer: '####', last number
# name: (what the script writes, max_new_tokens, max_tool_calls, void)
CASES = {
    'void': (["Let me see.\n"], 200, 4, True),
    'answered': (["#### 85"], 200, 4, False),
    'called then answered': ([('call', '12*7'), "#### 84"], 200, 4, False),
    # its text holds the calculator's 84: only its last turn says it gave no answer
    'called then void': ([('call', '12*7'), "done.\n"], 200, 4, True),
    'truncated': (["Let me see, then.\n"], 8, 4, False),  # no answer, but cut by the budget
    # the second call is past max_tool_calls: its turn holds no number, but it did not finish
    'turn limit': ([('call', '12*7'), "again\n", ('call', 'x+y')], 200, 1, False),
}


def rollout(name):
    pieces, max_new_tokens, max_calls, _ = CASES[name]
    want, _ = scripted_completion(pieces)
    model = Scripted(script_of(want), strength=60.0)
    return generate_with_tools(model, TOK, [PROMPT], 1, max_new_tokens, tools=TOOLS,
                               max_tool_calls=max_calls, seed=1)[0]


def test_void_turns_on_completions_the_sampler_wrote():
    comps = {name: rollout(name) for name in CASES}
    c = comps['called then void']
    assert len(c['tool_calls']) == 1 and c['finished'] and ANSWER(c['text']) == '84'
    assert metrics.last_turn(c, TOK) == "done.\n"
    assert metrics.last_turn(comps['called then answered'], TOK) == "#### 84"
    assert metrics.last_turn(comps['void'], TOK) == "Let me see.\n", "the stop token left out"
    assert comps['truncated']['truncated'] and not comps['truncated']['finished']
    assert comps['turn limit']['turn_limit'] and not comps['turn limit']['finished']
    assert ANSWER(metrics.last_turn(comps['turn limit'], TOK)) is None
    for name, c in comps.items():
        assert metrics.void_turn(c, TOK, ANSWER) is CASES[name][3], name
        c['void'] = metrics.void_turn(c, TOK, ANSWER)
    m = metrics.tool_metrics(list(comps.values()))
    assert m['tools/void_frac'] == 2 / 6
    del c['void']  # a completion no one judged: no figure rather than a wrong one
    assert 'tools/void_frac' not in metrics.tool_metrics(list(comps.values()))


def step_loss(model, comps, adv, filter_on, agg):
    """One step's loss and gradient over one group, as train_grpo.py computes them: the filter,
    train_rows, the inserted tokens' mask, token_weights and policy_loss with KL and entropy."""
    trainable = [c for c in comps if not c.get('void')] if filter_on else comps
    rows, n_tok, n_seq, _ = train_rows(trainable, adv, torch.tensor([False]), [PROMPT], {0}, [0],
                                       filter_zero_std=False)
    model.zero_grad()
    logp, ent = completion_logprobs(model, rows, TOK.pad_id, 1.0, share_prompt=False)
    lens = torch.tensor([len(r['ids']) for r in rows])
    A = torch.repeat_interleave(torch.tensor([r['adv'] for r in rows]), lens)
    sampled = 1.0 - torch.tensor([m for r in rows for m in r['tool_mask']], dtype=torch.float32)
    w = token_weights(lens, agg, n_tok, n_seq, 200, sampled=sampled)
    ref = logp.detach() + 0.1 * torch.randn(len(logp), generator=torch.Generator().manual_seed(0))
    loss, _ = policy_loss(logp, logp.detach(), A, w, lens, eps_low=0.2, eps_high=0.28,
                          ref_logp=ref, beta=0.1, entropy=ent, entropy_coef=0.01)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()], rows, n_tok


def test_a_void_completion_weighs_nothing_with_the_filter_and_counts_without():
    """One group of four: its void completions' advantages times 1e6 change neither the loss nor
    its gradient with the filter on; with it off they do. Void completions stay in the group's
    rewards (the advantages are given), only their tokens leave the loss and its normalisers."""
    names = ['called then answered', 'called then void', 'answered', 'void']
    comps = []
    for k, name in enumerate(names):
        c = {**rollout(name), 'prompt_idx': 0, 'sample_idx': k}
        c['void'] = metrics.void_turn(c, TOK, ANSWER)
        comps.append(c)
    void = torch.tensor([[c['void'] for c in comps]])
    assert void.tolist() == [[False, True, False, True]]
    adv = torch.tensor([[1.0, -0.5, 0.5, -1.0]])
    bumped = torch.where(void, adv * 1e6, adv)
    cfg = ModelConfig(arch='qwen2', vocab_size=TOK.vocab_size, n_layer=1, n_head=2, n_kv_head=1,
                      n_embd=32, intermediate_size=64, max_seq_len=256, tie_word_embeddings=True)
    model = from_scratch(cfg, dtype=torch.float32, device='cpu', seed=0)
    for agg in ('token_mean', 'seq_mean_token_mean', 'seq_sum_const'):
        loss, grads, rows, n_tok = step_loss(model, comps, adv, True, agg)
        loss2, grads2, _, _ = step_loss(model, comps, bumped, True, agg)
        assert loss == loss2 and all(torch.equal(a, b) for a, b in zip(grads, grads2)), agg
        assert [r['ids'] for r in rows] == [comps[0]['ids'], comps[2]['ids']]
        assert n_tok == sum(len(c['ids']) - sum(c['tool_mask']) for c in (comps[0], comps[2]))
        off, grads_off, _, _ = step_loss(model, comps, adv, False, agg)
        off2, grads_off2, _, _ = step_loss(model, comps, bumped, False, agg)
        assert abs(off2 - off) > 1e3 * abs(off), (agg, off, off2)
        assert not torch.equal(grads_off[0], grads_off2[0]), agg


VOID_TASK = '''"""Half the warm start's solutions stop at once, half run past the budget;
answer() never finds one, so every completion that finishes is void."""
from data import question_messages

tools = ['calculator']
tool_style = 'fenced'


def load(split, data_dir='', seed=0):
    n = 64 if split == 'train' else 4
    return [{'question': f"Q{i}", 'solution': '' if i % 2 else 'x' * 12} for i in range(n)]


def messages(example, system_prompt='', instruction=''):
    return question_messages(example['question'], system_prompt, instruction)


def grade(completion, example):  # void completions are empty: a spread in every mixed group
    return len(completion) > 0


def solution(example):
    return example['solution']


def answer(completion):
    return None
'''


def test_train_grpo_leaves_void_completions_out_only_with_the_knob(tmp_path, monkeypatch):
    """One step of train_grpo.py on a task whose finished completions are all void: the same
    rollouts either way; with the knob on, the void ones are not trained on (every group trained:
    filter_zero_std off), in one mini-batch or two (lr 0: the second mini-batch sees the same
    weights, so the step's entropy is the same as in one)."""
    (tmp_path / 'void_task.py').write_text(VOID_TASK)
    tiny = [a for a in test_train.TINY if not a.startswith(('--task=', '--arith_', '--rewards='))]
    monkeypatch.setattr(test_train, 'TINY', tiny)  # the task's own reward: 'correct'
    args = [f'--task={tmp_path / "void_task.py"}', '--max_steps=1', '--filter_zero_std=False',
            '--sft_steps=30', '--sft_lr=1e-2', '--sft_batch_size=16', '--lr=0.0']
    jobs = {'off': [], 'on': ['--void_turn_filter=True'],
            'on2': ['--void_turn_filter=True', '--mini_batches=2']}
    test_train.run_together(*[[tmp_path / name, *args, *more] for name, more in jobs.items()])
    m = {name: test_train.metrics(tmp_path / name)[-1] for name in jobs}
    n = 16  # batch_prompts x group_size in TINY
    n_void = round(m['off']['tools/void_frac'] * n)
    assert 0 < n_void < n, "no void completion, or nothing else: the test checks nothing"
    for name in jobs:
        assert m[name]['tools/void_frac'] == m['off']['tools/void_frac']
        assert m[name]['reward/mean'] == m['off']['reward/mean'], "the same rollouts"
    assert m['off']['rows_trained'] == n
    assert m['on']['rows_trained'] == m['on2']['rows_trained'] == n - n_void
    assert m['on']['tokens_trained'] < m['off']['tokens_trained']
    assert m['on2']['entropy'] == pytest.approx(m['on']['entropy'], rel=1e-5)
    assert m['on']['entropy'] != pytest.approx(m['off']['entropy'], rel=1e-3)

