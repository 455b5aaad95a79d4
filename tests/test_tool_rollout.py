"""Rollouts that call tools (sample.generate_with_tools) and how they train: token in, token out;
the KV cache after each inserted tool response equals a fresh forward of the same ids; a row's
samples do not depend on how long its tools took; budgets and call limits; inserted tokens carry no
weight in the loss."""
import json
import math
import random
import re
import sys
import time
from pathlib import Path

import pytest
import torch

import sample
import tasks
import sandbox
import tool_calls
import warm
from loss import policy_loss, token_weights
from model import KVCache, ModelConfig, from_scratch
from reward import resolve_rewards, score
from sample import generate_with_tools
from tokenizer import byte_tokenizer

TOK = byte_tokenizer()
PROMPT = TOK.encode("Q: 12*7+1?")
TOOLS = {'calculator': sandbox.calculator}


class Scripted(torch.nn.Module):
    """A tiny random model whose next-token logits get `strength` added to the token a script
    wants at each absolute position: the same bias with or without a KV cache, so a cached rollout
    can be checked against a fresh forward of its ids."""

    def __init__(self, script, strength, seed=0):
        super().__init__()
        cfg = ModelConfig(arch='qwen2', vocab_size=TOK.vocab_size, n_layer=2, n_head=4, n_kv_head=2,
                          n_embd=64, intermediate_size=128, max_seq_len=512,
                          tie_word_embeddings=True)
        self.inner = from_scratch(cfg, dtype=torch.float32, device='cpu', seed=seed).eval()
        self.config = cfg
        # position -> the token the script wants next (-1: none)
        self.table = torch.full((cfg.max_seq_len + 1,), -1, dtype=torch.long)
        for position, token in script.items():
            self.table[position] = token
        self.strength = strength

    def forward(self, idx, kv_cache=None, input_lengths=None, *, last_only=False):
        B, T = idx.shape
        start = torch.zeros(B, dtype=torch.long)  # the absolute position of idx[:, 0]
        if kv_cache is not None:
            start = kv_cache.lengths.clone()
        logits = self.inner(idx, kv_cache, input_lengths).float()
        want = self.table[(start[:, None] + torch.arange(T)).clamp(max=len(self.table) - 1)]
        bias = torch.zeros_like(logits)
        bias.scatter_(-1, want.clamp(min=0)[..., None], self.strength)
        logits = logits + bias * (want >= 0)[..., None]
        if last_only:
            last = (input_lengths - 1) if input_lengths is not None else torch.full((B,), T - 1)
            logits = logits[torch.arange(B), last][:, None]
        return logits


def scripted_completion(pieces):
    """The completion a script writes: text pieces, and ('call', expression) pieces whose call and
    response (as generate_with_tools inserts it) follow. -> (ids, inserted mask)."""
    ids, mask = [], []
    for piece in pieces:
        if isinstance(piece, tuple):
            call = f"```calculator\n{piece[1]}\n```"
            ids += TOK.encode(call)
            mask += [0] * len(TOK.encode(call))
            result = tool_calls.run_call(tool_calls.parse_calls(call, 'fenced')[0], TOOLS, 5.0)
            response = TOK.encode('\n' + tool_calls.response_text([result], 'fenced'))
            ids += response
            mask += [1] * len(response)
        else:
            ids += TOK.encode(piece)
            mask += [0] * len(TOK.encode(piece))
    return ids + [TOK.eos_id], mask + [0]


def script_of(ids):
    return {len(PROMPT) - 1 + k: token for k, token in enumerate(ids)}


CALLS_3 = ["First\n", ('call', '12*7'), "then\n", ('call', '84+1'), "check\n", ('call', '85-0'),
           "#### 85"]


@pytest.mark.parametrize('n_calls', [1, 2, 3])
def test_token_in_token_out_and_cache_equals_fresh_forward(n_calls):
    pieces = CALLS_3[:2 * n_calls] + ["#### 85"]
    want, want_mask = scripted_completion(pieces)
    model = Scripted(script_of(want), strength=60.0)
    out = generate_with_tools(model, TOK, [PROMPT, PROMPT], 3, 400, tools=TOOLS, temperature=1.0,
                              seed=5)
    for c in out:
        assert c['ids'] == want and c['tool_mask'] == want_mask, TOK.decode(c['ids'])
        assert len(c['tool_calls']) == n_calls and c['finished'] and not c['truncated']
        assert [r['error'] for r in c['tool_calls']] == [None] * n_calls
    check_cache_equals_fresh_forward(model, out[::3])  # one row of each prompt's group
    # what went through the model as more than one token at a time: each prompt once, then per
    # call its closing token and the answer, no conversation again
    counted = []
    real = model.forward

    def counting(idx, *args, input_lengths=None, **kw):
        if idx.shape[1] > 1:
            counted.append(int(input_lengths.sum()) if input_lengths is not None else idx.numel())
        return real(idx, *args, input_lengths=input_lengths, **kw)

    model.forward = counting
    out = generate_with_tools(model, TOK, [PROMPT, PROMPT], 3, 400, tools=TOOLS, seed=5)
    assert sum(counted) == 2 * len(PROMPT) + sum(len(c['tool_calls']) + sum(c['tool_mask'])
                                                 for c in out)
    assert len(counted) == 1 + n_calls  # the prompts, then each wave of answers in one forward


def check_cache_equals_fresh_forward(model, completions, prompts=(PROMPT,)):
    """Every sampled token's log-prob equals a fresh full forward of prompt + the ids before it."""
    for c in completions:
        prompt = prompts[c['prompt_idx'] % len(prompts)]
        with torch.no_grad():  # one causal forward gives every position's next-token logits
            logits = model(torch.tensor([prompt + c['ids'][:-1]]))[0, len(prompt) - 1:]
        fresh = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c['ids'])[:, None])[:, 0]
        for i, inserted in enumerate(c['tool_mask']):
            if inserted:
                assert c['logprobs'][i] == 0.0
            else:
                assert abs(fresh[i].item() - c['logprobs'][i]) <= 1e-5, (i, fresh[i])


@pytest.mark.parametrize('delay', [0, 3])
def test_answers_go_in_tool_delay_steps_after_the_call(delay):
    """Rows that call at different steps (prompts of different lengths shift the script) are
    answered tool_delay_steps later, several in one batched forward; a tool later than that is
    waited for."""
    want, want_mask = scripted_completion(CALLS_3)
    model = Scripted(script_of(want), strength=60.0)
    prompts = [PROMPT, PROMPT[:-1] + TOK.encode(" ?"), PROMPT]

    def slow_calculator(expression: str) -> str:
        """Arithmetic, slowly.

        Args:
            expression: the arithmetic
        """
        time.sleep(0.1)
        return sandbox.calculator(expression)

    out = generate_with_tools(model, TOK, prompts, 2, 400, tools={'calculator': slow_calculator},
                              seed=3, tool_delay_steps=delay)
    same = [c for c in out if c['prompt_idx'] != 1]
    assert all(c['ids'] == want and c['tool_mask'] == want_mask for c in same)
    check_cache_equals_fresh_forward(model, same[:1])
    # 0.1 s is far longer than 3 decode steps of this model: every call was waited for
    assert out[0]['tool_wait_s'] >= 0.05
    assert len({c['tool_wait_s'] for c in out}) == 1


def test_rows_sample_alike_however_long_their_tools_take():
    """A moderate bias: rows wander off the script, some call, some do not. Tools that sleep a
    random while change neither what a row samples nor a bit of its log-probs: which rows are
    prefilled together does not depend on when their tools answered."""
    want, _ = scripted_completion(CALLS_3)
    rng = random.Random(0)

    def slow_calculator(expression: str) -> str:
        """Arithmetic, slowly.

        Args:
            expression: the arithmetic
        """
        time.sleep(rng.random() * 0.05)
        return sandbox.calculator(expression)

    runs = []
    for _ in range(2):  # the log-probs compared too: equal to the last bit
        model = Scripted(script_of(want), strength=8.0)
        out = generate_with_tools(model, TOK, [PROMPT] * 6, 4, 300,
                                  tools={'calculator': slow_calculator}, temperature=1.0, seed=11)
        runs.append([(c['ids'], c['tool_mask'], c['logprobs']) for c in out])
    assert runs[0] == runs[1]
    called = [sum(mask) > 0 for _, mask, _ in runs[0]]
    assert any(called) and not all(called), "every row alike: the test checks nothing"


def test_rows_that_finish_leave_the_decode_batch(monkeypatch):
    """Rows of a longer prompt start mid-script and finish first; the decode batch drops them
    (compaction) and the others go on as before, their cache still equal to a fresh forward."""
    want, want_mask = scripted_completion(CALLS_3)
    model = Scripted(script_of(want), strength=60.0)
    prompts = [PROMPT, PROMPT + TOK.encode(" " * 40)]
    selects = []
    select = KVCache.select
    monkeypatch.setattr(KVCache, 'select', lambda self, rows: selects.append(len(rows)) or
                        select(self, rows))
    out = generate_with_tools(model, TOK, prompts, 3, 400, tools=TOOLS, seed=3)
    assert 3 in selects, "the three rows of the first prompt were kept alone"
    assert all(c['ids'] == want and c['tool_mask'] == want_mask for c in out[:3])
    assert all(len(c['ids']) < len(want) for c in out[3:])
    check_cache_equals_fresh_forward(model, out, prompts)


def test_budget_and_call_limit_end_a_row():
    want, want_mask = scripted_completion(CALLS_3)
    model = Scripted(script_of(want), strength=60.0)
    first_call_ends = len(TOK.encode("First\n```calculator\n12*7\n```"))
    out = generate_with_tools(model, TOK, [PROMPT], 1, first_call_ends, tools=TOOLS, seed=1)[0]
    assert out['truncated'] and out['tool_calls'] == [] and len(out['ids']) == first_call_ends, \
        "a call that closes on the budget's last token is never run"
    response_ends = next(i for i in range(1, len(want_mask)) if want_mask[i - 1] and not want_mask[i])
    for budget in (response_ends, response_ends + 1):  # no room after the response / room for one
        out = generate_with_tools(model, TOK, [PROMPT], 1, budget, tools=TOOLS, seed=1)[0]
        assert out['truncated'] and len(out['ids']) <= budget, (budget, len(out['ids']))
    out = generate_with_tools(model, TOK, [PROMPT], 1, 300, tools=TOOLS, max_tool_calls=1,
                              seed=1)[0]
    assert out['turn_limit'] and len(out['tool_calls']) == 1 and out['truncated']
    assert 'calculator\n84+1' in TOK.decode(out['ids'])  # the second call was written, not run


def test_a_hung_tool_returns_an_error_in_time():
    """64 rollouts whose tool sleeps 10 s, with a 2 s limit: the rollout takes about 2 s more than
    with a tool that answers at once (the calls wait together), every call is a 'timeout' that the
    model reads."""
    want, _ = scripted_completion(CALLS_3[:2] + ["#### 85"])
    model = Scripted(script_of(want), strength=60.0)

    def calculator(expression: str) -> str:
        """Never answers.

        Args:
            expression: the arithmetic
        """
        time.sleep(10)
        return '0'

    run = dict(tool_timeout=2.0, max_tool_calls=1, seed=2)
    generate_with_tools(model, TOK, [PROMPT], 1, 120, tools=TOOLS, **run)  # warm-up
    t = time.time()
    generate_with_tools(model, TOK, [PROMPT] * 16, 4, 120, tools=TOOLS, **run)
    decoding = time.time() - t  # the same rollouts with a tool that answers at once
    t = time.time()
    out = generate_with_tools(model, TOK, [PROMPT] * 16, 4, 120, tools={'calculator': calculator},
                              **run)
    took = time.time() - t
    # the wait is what is checked, as the rollout counts it (tool_wait_s: the seconds it waited
    # for late tools): 64 waits of 2 s, together, not one after another (128 s); the wall time
    # only loosely, since under a loaded test run the decoding alone can take seconds more
    assert out[0]['tool_wait_s'] < 4.0, out[0]['tool_wait_s']
    assert took - decoding < 15.0, (took, decoding)
    assert all(c['tool_calls'][0]['error'] == 'timeout' for c in out)
    assert all(c['tool_calls'][0]['seconds'] < 3.0 for c in out)  # 1.5x the limit
    assert all('timed out' in TOK.decode(c['ids']) for c in out), "the model reads the error"


def test_inserted_tokens_carry_no_weight():
    """Advantages of the inserted tokens times 1e6 change neither the loss nor its gradient; the
    tokens of each turn, its closing token included, keep their weight."""
    torch.manual_seed(0)
    lens = torch.tensor([6, 5])
    inserted = torch.tensor([0, 0, 1, 1, 0, 0, 0, 1, 1, 0, 0], dtype=torch.float32)
    sampled = 1.0 - inserted
    logp = torch.randn(11, requires_grad=True)
    old = logp.detach() + 0.05 * torch.randn(11)
    adv = torch.repeat_interleave(torch.tensor([1.0, -0.5]), lens)
    for agg in ('token_mean', 'seq_mean_token_mean', 'seq_sum_const'):
        w = token_weights(lens, agg, 7, 2, 8, sampled=sampled)
        assert bool((w[inserted.bool()] == 0).all()) and bool((w[sampled.bool()] > 0).all())
        if agg == 'seq_mean_token_mean':  # a sequence's mean runs over its sampled tokens
            assert torch.allclose(w[:6].sum(), torch.tensor(0.5))
        grads = []
        for a in (adv, torch.where(inserted.bool(), adv * 1e6, adv)):
            logp.grad = None
            loss, _ = policy_loss(logp, old, a, w, lens, eps_low=0.2, eps_high=0.28)
            loss.backward()
            grads.append((loss.item(), logp.grad.clone()))
        assert grads[0][0] == grads[1][0] and torch.equal(grads[0][1], grads[1][1]), agg
    for est in ('k1', 'k2', 'k3'):  # the reference differing on inserted tokens only: no penalty moves
        w = token_weights(lens, 'token_mean', 7, 2, 8, sampled=sampled)
        grads = []
        for ref in (logp.detach(), torch.where(inserted.bool(), logp.detach() - 5.0, logp.detach())):
            logp.grad = None
            loss, _ = policy_loss(logp, old, adv, w, lens, eps_low=0.2, eps_high=0.28, ref_logp=ref,
                                  beta=0.1, kl_estimator=est, sampled=sampled)
            loss.backward()
            grads.append(logp.grad.clone())
        assert torch.equal(grads[0], grads[1]), est
    leak = token_weights(lens, 'token_mean', 7, 2, 8)  # without the mask: the test would see it
    a = torch.where(inserted.bool(), adv * 1e6, adv)
    assert policy_loss(logp, old, a, leak, lens, eps_low=0.2, eps_high=0.28)[0].abs().item() > 1e3


def completions_seen(monkeypatch):
    """A list that gathers every completion sample.generate_with_tools returns from now on."""
    seen = []
    real = sample.generate_with_tools

    def spy(*args, **kw):
        out = real(*args, **kw)
        seen.extend(out)
        return out

    monkeypatch.setattr(sample, 'generate_with_tools', spy)
    return seen


@pytest.mark.parametrize('page', ['README.md', 'docs/tools.md'])
def test_the_docs_task_with_a_tool_plugs_in(tmp_path, monkeypatch, page):
    """The example task with tools, as printed in the README and docs/tools.md: resolved by its
    path, its tools found and callable, and evaluate() runs it through generate_with_tools
    (tool_mask on every completion)."""
    doc = (Path(__file__).resolve().parents[1] / page).read_text()
    blocks = doc.split('```python\n')[1:]
    code = next(b for b in blocks if '\ntools = ' in b.split('\n```\n')[0]).split('\n```\n')[0]
    assert code == (Path(__file__).resolve().parents[1] / 'docs/tools.md').read_text().split(
        '```python\n')[1].split('\n```\n')[0], "the README and docs/tools.md show the same task"
    (tmp_path / 'calc_task.py').write_text(code + '\n')
    task = tasks.resolve(str(tmp_path / 'calc_task.py'))
    tools, style = tasks.tools_of(task)
    assert list(tools) == ['add', 'calculator'] and style == 'fenced'
    call, = tool_calls.parse_calls("```add\n12 7 100\n```", style, names=tools)
    assert tool_calls.run_call(call, tools, 5.0)['output'] == '119'
    seen = completions_seen(monkeypatch)
    model = Scripted({}, strength=0.0)
    summary = sample.evaluate(model, TOK, task, task.load('test')[:3], max_new_tokens=12,
                              progress=False)
    assert summary['n'] == 3 and len(seen) == 3 and all('tool_mask' in c for c in seen)


@pytest.mark.parametrize('task_limit, knob, want', [(None, None, 4), (1, None, 1), (1, 3, 3)])
def test_a_task_sets_its_call_limit_unless_the_config_does(monkeypatch, task_limit, knob, want):
    task = tasks.resolve('arith_tools')
    if task_limit is not None:
        monkeypatch.setattr(task, 'max_tool_calls', task_limit, raising=False)
    assert 'max_tool_calls' not in tasks.knobs(task)  # not a task knob: no clash with the script's
    limits = []
    real = sample.generate_with_tools

    def spy(*args, **kw):
        limits.append(kw['max_tool_calls'])
        return real(*args, **kw)

    monkeypatch.setattr(sample, 'generate_with_tools', spy)
    sample.evaluate(Scripted({}, strength=0.0), TOK, task, task.load('test')[:2], max_new_tokens=8,
                    progress=False, tools=sample.tool_settings(task, max_tool_calls=knob))
    assert limits == [want]


@pytest.mark.parametrize('arch', ['qwen2', 'gpt2'])
def test_a_window_may_run_past_the_cache_end(arch):
    """Answers prefilled together are right-padded to the longest: a row near its budget's end
    beside a long answer pads past the cache's last position. KVCache.window makes room for the
    pads; the rows' logits and cached positions equal those of each row prefilled alone. The
    pads also run past the model's max_seq_len (32), which GPT-2's position table ends at."""
    cfg = ModelConfig(arch=arch, vocab_size=64, n_layer=2, n_head=4, n_kv_head=2 if arch == 'qwen2' else 4,
                      n_embd=32, intermediate_size=64, max_seq_len=32, tie_word_embeddings=True)
    model = from_scratch(cfg, dtype=torch.float32, device='cpu', seed=0).eval()
    g = torch.Generator().manual_seed(0)
    lens, chunks = [30, 3], [torch.randint(64, (2,), generator=g), torch.randint(64, (20,),
                                                                               generator=g)]
    cache = KVCache(cfg, 2, 32, torch.float32, 'cpu')
    with torch.no_grad():
        prompts = torch.randint(64, (2, 30), generator=g)
        model(prompts, kv_cache=cache, input_lengths=torch.tensor(lens), last_only=True)
        alone = []
        for r in range(2):
            sub = cache.window(torch.tensor([r]), 32)
            sub.extent = lens[r]
            alone.append((model(chunks[r][None], kv_cache=sub, last_only=True)[0, -1], sub))
        feed = torch.zeros(2, 20, dtype=torch.long)
        for r in range(2):
            feed[r, :len(chunks[r])] = chunks[r]
        at = torch.tensor([0, 1])
        sub = cache.window(at, 30 + 20)  # past the cache's 32 positions
        sub.extent = 30
        logits = model(feed, kv_cache=sub, input_lengths=torch.tensor([2, 20]),
                       last_only=True)[:, -1]
        cache.put_window(at, sub)
    assert cache.lengths.tolist() == [32, 23]
    for r in range(2):
        assert torch.allclose(logits[r], alone[r][0], atol=1e-5)
        n = int(cache.lengths[r])
        assert torch.allclose(cache.k[0][r, :, :n], alone[r][1].k[0][0, :, :n], atol=1e-6)


def test_a_rows_samples_do_not_depend_on_the_rest_of_the_batch():
    """What torchrun's ranks do: each generates its share of the prompts, named by prompt_index.
    A prompt's rows draw the same tokens alone as beside the others (the seeds are the prompt's and
    the sample's; the floats of a batched forward may differ in the last bits, not enough here to
    change a draw)."""
    want, _ = scripted_completion(CALLS_3)
    model = Scripted(script_of(want), strength=8.0)
    prompts = [PROMPT, PROMPT[:-2] + TOK.encode("1?"), PROMPT[:-1] + TOK.encode("?")]
    together = generate_with_tools(model, TOK, prompts, 4, 300, tools=TOOLS, seed=7)
    alone = [c for i, p in enumerate(prompts)
             for c in generate_with_tools(model, TOK, [p], 4, 300, tools=TOOLS, seed=7,
                                          prompt_index=[i])]
    assert [c['ids'] for c in together] == [c['ids'] for c in alone]
    assert len({tuple(c['ids']) for c in together}) > 3, "rows alike: the test checks nothing"


def test_sample_py_prompts_a_task_with_tools_through_the_tool_path(tmp_path):
    """`python sample.py --task=... --prompt=...` samples as the task trains: through
    generate_with_tools when the task has tools (the header counts calls), plain generate else."""
    import sys
    root = Path(__file__).resolve().parents[1]
    for task, with_tools in (('arith_tools', True), ('arith', False)):
        out = warm.run([sys.executable, str(root / 'sample.py'), '--init_from=scratch',
                        f'--task={task}', '--prompt=Liz has 80 books and sells 7.',
                        '--max_new_tokens=8', f'--out_dir={tmp_path}'], timeout=120, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert ('tool calls)' in out.stdout) is with_tools, out.stdout


CALL_TASK = '''"""Every warm-start solution calls the calculator."""
from data import question_messages

tools = ['calculator']
tool_style = 'fenced'


def load(split, data_dir='', seed=0):
    return [{'question': f"Q{i}", 'answer': str(i % 7 + 1)} for i in range(64 if split == 'train'
                                                                         else 4)]


def messages(example, system_prompt='', instruction=''):
    return question_messages(example['question'], system_prompt, instruction)


def grade(completion, example):
    return completion.strip().endswith(example['answer'])


def solution(example):
    return f"```calculator\\n{example['answer']}+0\\n```"
'''


def test_a_training_step_with_calls_and_an_entropy_cut(tmp_path, monkeypatch):
    """One step of train_grpo.py whose rollouts call the calculator, with top_entropy_quantile
    (its cut taken over the sampled tokens only, batch.sampled_tokens), void_turn_filter and one
    call per completion: it runs, calls, and logs the cut and every tools/* metric; and
    filter_zero_std changes nothing but the rows it skips (the same loss, gradient norm and cut)."""
    import test_train
    (tmp_path / 'call_task.py').write_text(CALL_TASK)
    tiny = [a for a in test_train.TINY if not a.startswith(('--task=', '--arith_', '--rewards=',
                                                            '--max_new_tokens='))]
    monkeypatch.setattr(test_train, 'TINY', tiny)
    args = [f'--task={tmp_path / "call_task.py"}', '--max_new_tokens=40', '--max_steps=1',
            '--sft_steps=60', '--sft_lr=1e-2', '--sft_batch_size=16', '--top_entropy_quantile=0.5',
            '--void_turn_filter=True', '--max_tool_calls=1', '--group_size=2', '--batch_prompts=8',
            "--rewards=[{'name': 'grpo_test_rewards:length_even'}]"]
    test_train.run_together([tmp_path / 'on', *args],
                            [tmp_path / 'off', *args, '--filter_zero_std=False'])
    m, off = test_train.metrics(tmp_path / 'on')[-1], test_train.metrics(tmp_path / 'off')[-1]
    assert m['tools/calls_per_completion'] > 0 and m['tools/token_frac'] > 0
    assert 'entropy_cut' in m and {'tools/wait_s', 'tools/void_frac'} <= set(m)
    assert 0 < m['frac_zero_std'] < 1 and m['rows_trained'] < off['rows_trained'], \
        (m['frac_zero_std'], m['rows_trained'], off['rows_trained'])
    for key in ('grad_norm', 'loss', 'entropy_cut'):
        assert math.isclose(m[key], off[key], rel_tol=1e-5, abs_tol=1e-9), (key, m[key], off[key])


@pytest.mark.slow
def test_a_compiled_tool_rollout_samples_as_eager():
    """compile=True through generate_with_tools (the prefill and decode steps through
    torch.compile, dynamic shapes): rows that call tools, their responses prefilled into the cache
    mid-decode, rows finishing and the batch compacting, give the same ids, masks and calls as
    eager, and log-probs equal to float noise; three graphs in all (the prefill, the decode step,
    the responses' prefill): no batch of one row, which Dynamo would compile apart."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()  # graphs another test compiled would be reused, not counted
    counters.clear()
    want, _ = scripted_completion(CALLS_3)
    prompts = [PROMPT, PROMPT + TOK.encode(" " * 9)]
    runs = []
    for compile in (False, True):
        model = Scripted(script_of(want), strength=8.0)
        runs.append(generate_with_tools(model, TOK, prompts, 4, 160, tools=TOOLS,
                                        temperature=1.0, seed=11, compile=compile))
        if compile:
            assert model in sample._compiled, "compile=True did not go through torch.compile"
    eager, compiled = runs
    for key in ('ids', 'tool_mask', 'finished', 'truncated'):
        assert [c[key] for c in compiled] == [c[key] for c in eager], key
    calls = [[[{k: v for k, v in call.items() if k != 'seconds'} for call in c['tool_calls']]
              for c in run] for run in runs]
    assert calls[1] == calls[0], "the calls (names, arguments, outputs) differ"
    for a, b in zip(eager, compiled):
        assert b['logprobs'] == pytest.approx(a['logprobs'], abs=1e-4)
    called = [sum(c['tool_mask']) > 0 for c in eager]
    assert any(called) and not all(called), "every row alike: the test checks nothing"
    assert sum(c['finished'] for c in eager) >= 2, "no row finished early: nothing compacted"
    graphs = counters['stats']['unique_graphs']
    assert graphs == 3, f"{graphs} graphs compiled: expected the prefill, decode and responses'"


# --------------------------------------------------------------------------- a state per rollout

def guess_task(tmp_path):
    """The task docs/tools.md prints under "A state per rollout", as printed, from its file."""
    doc = (Path(__file__).resolve().parents[1] / 'docs' / 'tools.md').read_text()
    section = doc[doc.index('## A state per rollout'):]
    code = section.split('```python\n')[1].split('\n```\n')[0]
    (tmp_path / 'guess_task.py').write_text(code + '\n')
    return tmp_path / 'guess_task.py'


def test_each_rollout_has_its_own_state_which_grading_sees(tmp_path, monkeypatch):
    """The docs' guessing game, evaluated on a model scripted to guess 30, then 20: each of the
    3 x 3 completions keeps a state of its own across its two calls (both counted, the rows'
    states apart), grade() reads it (pass@1 counts the problems whose number was guessed, whatever
    the text says), and a completion's 'state' is the one its tools were given."""
    task = tasks.resolve(str(guess_task(tmp_path)))
    problems = [{'question': 'Find it.', 'answer': a} for a in ('20', '30', '10')]
    start = len(sample.encode_prompts(TOK, task, problems[:1])[0]) - 1  # every prompt's length
    # 'lower' and 'right' are the same length: the second call lands at one position in every row
    answer = '\n' + tool_calls.response_text([{'output': 'lower'}], 'fenced')
    script = TOK.encode("```guess\n30\n```" + answer + "```guess\n20\n```")
    model = Scripted({start + k: t for k, t in enumerate(script)}, strength=60.0)
    seen = completions_seen(monkeypatch)
    summary = sample.evaluate(model, TOK, task, problems, max_new_tokens=60, n_samples=2,
                              temperature=1.0, progress=False)
    assert len(seen) == 3 + 6 and summary['n'] == 3
    states = [c['state'] for c in seen]
    assert len({id(s) for s in states}) == len(states), "two completions shared a state"
    for c in seen:
        s, text = c['state'], TOK.decode(c['ids'])
        assert s['secret'] == int(problems[c['prompt_idx']]['answer']), (s, c['prompt_idx'])
        assert s['guesses'] == len(c['tool_calls']) == 2, (s, text)
        assert s['found'] == (s['secret'] in (20, 30)), (s, text)
    assert summary['pass@1'] == 2 / 3 and summary['pass@2'] == 2 / 3, summary
    # the 'correct' reward pays the same grade, given each completion's state as training gives it
    fns = resolve_rewards([{'name': 'correct'}], grade=task.grade)
    sc = score([c['text'] for c in seen], [problems[c['prompt_idx']] for c in seen], fns,
               extra_kwargs=[{'state': c['state']} for c in seen])
    assert sc['total'] == [float(c['state']['found']) for c in seen] and 0 < sum(sc['total']) < 9


def test_calls_to_a_stateful_tool_run_in_the_order_written():
    """Three calls in one turn: to a tool taking the rollout's state, one after another in order
    (each sleeps less than the one before, so at once they would finish backwards); to a tool
    without, at once. The model cannot set the state itself."""
    import concurrent.futures

    def note(n: str, *, state) -> str:
        """Note n.

        Args:
            n: a number
        """
        time.sleep(0.1 * (4 - int(n)))
        state.append(int(n))
        return str(len(state))

    def nap(n: str) -> str:
        """Sleep.

        Args:
            n: a number
        """
        time.sleep(0.1 * (4 - int(n)))
        return n

    tools = {'note': note, 'nap': nap}
    state = []
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        calls = [{'name': 'note', 'arguments': {'n': str(n)}} for n in (1, 2, 3)]
        got = [f.result()['output'] for f in tool_calls.start_calls(calls, tools, 5.0, pool, state=state)]
        assert state == [1, 2, 3] and got == ['1', '2', '3'], (state, got)
        t = time.monotonic()
        calls = [{'name': 'nap', 'arguments': {'n': str(n)}} for n in (1, 2, 3)]
        got = [f.result()['output'] for f in tool_calls.start_calls(calls, tools, 5.0, pool, state=state)]
        assert got == ['1', '2', '3'] and time.monotonic() - t < 0.5  # 0.3 s at once, 0.6 in turn
    forged = tool_calls.run_call({'name': 'note', 'arguments': {'n': '1', 'state': []}}, tools, 5.0,
                                 state=state)
    assert forged['error'] == 'raised' and "unexpected keyword argument 'state'" in forged['output']
    assert 'state' not in json.dumps(tool_calls.json_schema(note))


def test_rollout_state_needs_a_tool_that_takes_it_and_such_a_tool_needs_no_rollout_state(tmp_path):
    """rollout_state beside tools that take no state (and no respond) is refused at start-up; a
    tool that takes a state in a task without rollout_state gets a new {} per completion (the
    built-in python_repl's case)."""
    code = guess_task(tmp_path).read_text()
    (tmp_path / 'no_tool.py').write_text(code.replace('def guess(number: str, *, state) -> str:',
                                                      'def guess(number: str) -> str:'))
    with pytest.raises(ValueError, match=re.escape("rollout_state(), but neither respond() nor any of its tools")):
        tasks.resolve(str(tmp_path / 'no_tool.py'))
    (tmp_path / 'no_state.py').write_text(code.replace('def rollout_state(', 'def unused_state('))
    task = tasks.resolve(str(tmp_path / 'no_state.py'))
    states = tasks.rollout_states(task, task.load('test')[:2], 3)
    assert states == [{}] * 6 and len({id(s) for s in states}) == 6
    assert tasks.rollout_states(tasks.resolve('arith_tools'), [{}], 2) is None  # no tool takes one


def test_a_run_trains_on_rewards_read_from_rollout_states(tmp_path, monkeypatch):
    """train_grpo.py on the docs' guessing game with its default rewards ('correct' through a grade
    that takes the state, fewer_guesses indexing it: a state missing anywhere raises there): two
    steps and an evaluation, no reward error; sample.py refuses a free --prompt for it."""
    import test_train
    tiny = [a for a in test_train.TINY if not a.startswith(('--task=', '--arith_', '--rewards=',
                                                            '--max_new_tokens='))]
    monkeypatch.setattr(test_train, 'TINY', tiny)
    out = tmp_path / 'run'
    test_train.run(out, f'--task={guess_task(tmp_path)}', '--max_new_tokens=24', '--max_steps=2',
                   '--eval_every=2', '--eval_examples=4', '--export_hf=True', '--rewards=None',
                   '--log_samples_every=1')
    rows = test_train.metrics(out)
    for r in rows[1:]:
        assert r['reward/correct/errors'] == 0 and r['reward/fewer_guesses/errors'] == 0, r
    samples = [json.loads(line) for line in open(out / 'samples.jsonl')]
    assert samples and all(set(s['state']) == {'secret', 'guesses', 'found'} for s in samples), samples
    assert all(s['correct'] == s['state']['found'] for s in samples)
    assert 'eval/pass@1' in rows[-1]
    p = warm.run([sys.executable, 'sample.py', f"--init_from={out / 'hf'}", '--prompt=Find it.'],
                 cwd=Path(__file__).resolve().parents[1], env=test_train.env(), timeout=120)
    assert p.returncode == 2 and 'a free prompt has none' in p.stderr, p.stderr


# --------------------------------------------------------------------------- turns the task answers

RESPOND_TASK = '''"""The guessing game without a tool: the model says a number, the task answers its turn."""
from data import question_messages

max_turns = 2


def load(split, data_dir='', seed=0):
    return [{'question': 'Find it.', 'answer': str(n)} for n in (20, 30, 10, 40) * 8]


def messages(example, system_prompt='', instruction=''):
    return question_messages(example['question'], system_prompt, instruction)


def rollout_state(example):
    return {'secret': int(example['answer']), 'said': [], 'found': False}


def respond(turn, state):
    state['said'].append(turn)
    if turn.strip() == str(state['secret']):
        state['found'] = True
        return None
    return 'lower' if int(turn) > state['secret'] else 'higher'


def grade(completion, example, state=None):
    return state['found']
'''


def test_the_task_answers_a_turn_that_makes_no_call(tmp_path, monkeypatch):
    """respond: a model scripted to say 30, then 20, to numbers 20, 30 and 10 (max_turns 2): the
    task's answer goes in as a user turn after the model's stop token (the chat template's ids,
    inserted, weighing nothing), None ends the rollout, and after max_turns user turns the next stop
    ends it unasked; every sampled token's log-prob equals a fresh forward's."""
    (tmp_path / 'respond_task.py').write_text(RESPOND_TASK)
    task = tasks.resolve(str(tmp_path / 'respond_task.py'))
    problems = task.load('test')[:3]
    prompt = sample.encode_prompts(TOK, task, problems[:1])[0]
    end = TOK.special['<|im_end|>']
    user = tool_calls.user_turns(TOK)
    script = TOK.encode('30') + [end] + user('lower') + TOK.encode('20') + [end] + user('lower') + [end]
    model = Scripted({len(prompt) - 1 + k: t for k, t in enumerate(script)}, strength=60.0)
    seen = completions_seen(monkeypatch)
    summary = sample.evaluate(model, TOK, task, problems, max_new_tokens=60, progress=False)
    assert summary['pass@1'] == 2 / 3, summary  # 20 and 30 found, 10 not
    by_secret = {c['state']['secret']: c for c in seen}
    assert [by_secret[n]['user_turns'] for n in (30, 20, 10)] == [0, 1, 2]
    assert by_secret[30]['ids'] == TOK.encode('30') + [end] and by_secret[30]['finished']
    want = TOK.encode('30') + [end] + user('lower') + TOK.encode('20') + [end]
    assert by_secret[20]['ids'] == want, TOK.decode(by_secret[20]['ids'])
    assert by_secret[20]['tool_mask'] == [0] * 3 + [1] * len(user('lower')) + [0] * 3
    assert by_secret[10]['ids'] == script and by_secret[10]['finished'], TOK.decode(by_secret[10]['ids'])
    assert by_secret[10]['state']['said'] == ['30', '20']  # not asked after the second user turn
    check_cache_equals_fresh_forward(model, seen, prompts=[prompt])


def test_a_run_trains_a_task_that_answers_turns(tmp_path, monkeypatch):
    """train_grpo.py with the task above: two steps, its user turns counted in
    tools/user_turns_per_completion, its grade given each rollout's state (no reward error)."""
    import test_train
    (tmp_path / 'respond_task.py').write_text(RESPOND_TASK.replace("int(turn) >", "len(turn) >"))
    tiny = [a for a in test_train.TINY if not a.startswith(('--task=', '--arith_', '--rewards=',
                                                            '--max_new_tokens='))]
    monkeypatch.setattr(test_train, 'TINY', tiny)
    out = tmp_path / 'run'
    test_train.run(out, f'--task={tmp_path / "respond_task.py"}', '--max_new_tokens=24', '--max_steps=2',
                   '--rewards=None', '--temperature=3.0')
    rows = test_train.metrics(out)
    assert all(r['reward/correct/errors'] == 0 for r in rows[1:]), rows
    assert sum(r['tools/user_turns_per_completion'] for r in rows[1:]) > 0, rows
