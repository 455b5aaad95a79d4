"""generate(): cached = uncached, per-row randomness, stops, limits, batching and compaction change
nothing."""
import json
import string

import pytest
import torch

import sample
from model import ModelConfig, from_scratch
from sample import evaluate, generate, majority_correct
from tasks import arith
from tokenizer import byte_tokenizer

TOK = byte_tokenizer()


def tiny(arch='qwen2', seed=0):
    from test_flex import GEMMA
    cfg = ModelConfig(arch=arch, vocab_size=TOK.vocab_size, n_layer=2, n_head=4,
                      n_kv_head=2 if arch == 'qwen2' else 4, n_embd=64, intermediate_size=128,
                      max_seq_len=256, tie_word_embeddings=True, **(GEMMA if arch == 'gemma3_text' else {}))
    m = from_scratch(cfg, dtype=torch.float32, device='cpu', seed=seed)
    # sharper logits than init's, so greedy paths are not decided by float noise
    with torch.no_grad():
        m.lm_head_weight.mul_(8)
    return m.eval()


PROMPTS = [TOK.encode("Tom has 12 apples."), TOK.encode("Hi"),
           TOK.encode("What is 3+4? Think step by step.")]


@torch.no_grad()
def naive_greedy(model, prompt, n):
    """No cache: the whole sequence again every step, argmax of the last position."""
    ids = list(prompt)
    lps = []
    for _ in range(n):
        logits = model(torch.tensor([ids]))[0, -1].float()
        nxt = int(logits.argmax())
        lps.append(float(torch.log_softmax(logits, -1)[nxt]))
        ids.append(nxt)
        if nxt in TOK.stop_ids:
            break
    return ids[len(prompt):], lps


@pytest.mark.parametrize('arch', ['qwen2', 'olmo2', 'gemma3_text', 'gpt2'])
def test_greedy_cached_equals_uncached(arch):
    model = tiny(arch)
    out = generate(model, TOK, PROMPTS, 1, 20, temperature=0.0, stop_ids=[])
    for p, o in zip(PROMPTS, out):
        ids, lps = naive_greedy(model, p, 20)
        assert o['ids'] == ids, f"cached greedy diverged from uncached for prompt {TOK.decode(p)!r}"
        assert torch.allclose(torch.tensor(o['logprobs']), torch.tensor(lps), atol=1e-4), \
            "log-probs differ"


def test_batched_prompts_of_different_lengths_equal_alone():
    model = tiny()
    together = generate(model, TOK, PROMPTS, 1, 16, temperature=0.0)
    for i, p in enumerate(PROMPTS):
        alone = generate(model, TOK, [p], 1, 16, temperature=0.0)
        assert alone[0]['ids'] == together[i]['ids'], f"prompt {i}: batched with others != alone"


def test_same_seed_same_completions_different_seed_different():
    model = tiny()
    a = generate(model, TOK, PROMPTS, 4, 16, temperature=1.0, seed=1)
    b = generate(model, TOK, PROMPTS, 4, 16, temperature=1.0, seed=1)
    c = generate(model, TOK, PROMPTS, 4, 16, temperature=1.0, seed=2)
    assert [x['ids'] for x in a] == [x['ids'] for x in b], \
        "same seed must give the same completions"
    assert [x['ids'] for x in a] != [x['ids'] for x in c], \
        "different seeds must give different completions"
    assert len({tuple(x['ids']) for x in a[:4]}) > 1, \
        "the G samples of one prompt must differ from each other"


def test_randomness_is_per_row():
    """A completion depends on (seed, prompt index, sample index) only: not on its batch-mates."""
    model = tiny()
    full = generate(model, TOK, PROMPTS, 3, 16, temperature=1.0, seed=7)
    alone = generate(model, TOK, [PROMPTS[2]], 3, 16, temperature=1.0, seed=7, prompt_index=[2])
    assert [x['ids'] for x in alone] == [x['ids'] for x in full[6:9]], \
        "prompt 2's samples changed with its batch"
    sub = generate(model, TOK, PROMPTS[1:], 3, 16, temperature=1.0, seed=7, prompt_index=[1, 2])
    assert [x['ids'] for x in sub] == [x['ids'] for x in full[3:]]


def test_compaction_changes_nothing():
    model = tiny()
    # stop on a few common bytes so rows finish at different times and compaction really happens
    stops = [ord(c) for c in 'aeiou ']
    a = generate(model, TOK, PROMPTS, 4, 24, temperature=1.0, seed=3, stop_ids=stops, compact=True)
    b = generate(model, TOK, PROMPTS, 4, 24, temperature=1.0, seed=3, stop_ids=stops, compact=False)
    assert sum(x['finished'] for x in a) >= 3, "test needs rows finishing early"
    assert [x['ids'] for x in a] == [x['ids'] for x in b], "compaction changed the completions"
    for x, y in zip(a, b):
        assert x['logprobs'] == pytest.approx(y['logprobs'], abs=1e-5), \
            "compaction changed the log-probs"


@pytest.mark.slow
def test_compiled_decode_generates_as_eager():
    """compile=True (torch.compile of the prefill and decode steps, dynamic shapes): the same tokens
    as eager, through rows finishing at different times and compaction shrinking the batch; and no
    recompile per batch size or prompt length: calls with other batches and prompt lengths,
    compacted or not, down to one row still going, reuse the two compiled graphs."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()  # graphs another test compiled would be reused, not counted
    counters.clear()
    model = tiny()
    # first, a call without compaction: its cache is the prefill's, shared with the samples; then
    # calls that compact
    greedy = generate(model, TOK, PROMPTS, 1, 20, temperature=0.0, stop_ids=[], compile=True)
    assert [x['ids'] for x in greedy] == [naive_greedy(model, p, 20)[0] for p in PROMPTS]
    longer = PROMPTS[:2] + [TOK.encode("A much longer prompt than the others, by far.")]
    # and one whose rows all stop but one (this model repeats the prompt's last character): the
    # batch is compacted to two rows, not one, which Dynamo would compile as a graph of its own
    lone = [TOK.encode(text) for text in ("Tom has 12 apples.", "What is 7+5?", "Sam", "12")]
    for prompts, g, stop_chars in ((PROMPTS, 4, 'aeiou '), (longer, 3, 'aeiou '), (lone, 1, '.?m')):
        stops = [ord(c) for c in stop_chars]
        a = generate(model, TOK, prompts, g, 24, temperature=1.0, seed=3, stop_ids=stops)
        b = generate(model, TOK, prompts, g, 24, temperature=1.0, seed=3, stop_ids=stops,
                     compile=True)
        assert sum(x['finished'] for x in a) >= 3, "test needs rows finishing early"
        assert [x['ids'] for x in a] == [x['ids'] for x in b], \
            "the compiled forward changed the completions"
        for x, y in zip(a, b):
            assert x['logprobs'] == pytest.approx(y['logprobs'], abs=1e-4)
    assert model in sample._compiled, "compile=True did not go through torch.compile"
    graphs = counters['stats']['unique_graphs']
    assert graphs == 2, f"{graphs} graphs compiled: expected two, the prefill and the decode step"


def test_graph_decode_and_sparse_checks_generate_as_eager():
    """graphs=True (fixed-shape decode steps: a static cache attended over all its positions,
    torch.compile with fullgraph, the batch shrunk only to buckets) and check_every=k (the host
    reads the rows still going every k steps): the same tokens and log-probs as eager with a read
    every step, through rows stopping at different steps and compaction; fullgraph means no graph
    break, and the graphs compiled are at most one per bucket, a second call reusing them."""
    from torch._dynamo.utils import counters
    model = tiny()
    stops = [ord(c) for c in 'aeiou ']
    base = generate(model, TOK, PROMPTS, 4, 24, temperature=1.0, seed=3, stop_ids=stops,
                    check_every=1)
    assert sum(x['finished'] for x in base) >= 3, "test needs rows finishing early"
    torch._dynamo.reset()  # graphs another test compiled would be reused, not counted
    counters.clear()
    for kw in (dict(check_every=8), dict(graphs=True), dict(graphs=True, check_every=5)):
        out = generate(model, TOK, PROMPTS, 4, 24, temperature=1.0, seed=3, stop_ids=stops, **kw)
        assert [x['ids'] for x in out] == [x['ids'] for x in base], kw
        assert [x['finished'] for x in out] == [x['finished'] for x in base], kw
        for x, y in zip(base, out):
            assert x['logprobs'] == pytest.approx(y['logprobs'], abs=1e-4), kw
    assert model in sample._graphed
    used = counters['stats']['unique_graphs']
    # the decode step once per bucket used (12 rows: 12, 6, 3, 2), the second call none more
    assert 1 <= used <= len(sample.buckets(12)), f'{used} graphs compiled'


@pytest.mark.slow
def test_graph_decode_keeps_its_graphs_and_their_addresses_from_call_to_call(monkeypatch):
    """Training calls generate once a step with new prompts. With graphs=True (a CUDA graph replays
    at the addresses it was captured at): the static cache's length is rounded up
    (sample.GRAPH_LENGTH), so prompts of other lengths compile no new graphs (6 for these calls
    before, 4 batch sizes now), and each batch size gets the same cache tensors in every step and
    call (sample.static_caches; rows copied into them at compaction), so it is captured once a
    run, not re-recorded each call. The tokens stay eager decoding's."""
    from torch._dynamo.utils import counters
    model = tiny()
    real = sample.graph_forward(model)
    seen = {}  # batch size -> the cache tensors' addresses

    def forward(idx, kv_cache):
        ptrs = tuple(t.data_ptr() for t in (*kv_cache.k, *kv_cache.v, kv_cache.lengths))
        seen.setdefault(len(idx), set()).add(ptrs)
        return real(idx, kv_cache=kv_cache)
    monkeypatch.setattr(sample, 'graph_forward', lambda m: forward)
    stops = list(range(97, 123)) + list(range(128, 256))  # 9 of 12 rows stop, 3 to 44 tokens in
    longer = PROMPTS[:2] + [TOK.encode("A much longer prompt than the others, by far.")]
    torch._dynamo.reset()  # graphs another test compiled would be reused, not counted
    counters.clear()
    for prompts, seed in ((PROMPTS, 5), (longer, 5), (PROMPTS, 7)):  # longest prompt 32, 44, 32
        out = generate(model, TOK, prompts, 4, 48, temperature=1.0, seed=seed, stop_ids=stops,
                       graphs=True)
    base = generate(model, TOK, PROMPTS, 4, 48, temperature=1.0, seed=7, stop_ids=stops)
    assert [x['ids'] for x in out] == [x['ids'] for x in base]
    used = counters['stats']['unique_graphs']
    assert used <= len(sample.buckets(12)), f'{used} graphs for 4 batch sizes'
    assert len(seen) >= 3, f'too little compaction to test: {sorted(seen)}'
    moved = {b: len(p) for b, p in seen.items() if len(p) > 1}
    assert not moved, f'batch sizes whose cache moved between steps or calls: {moved}'


def test_the_decode_loop_reads_the_device_once_every_check_every_steps(monkeypatch):
    """Host-device syncs in generate's loop: the count of rows still going is read once every
    check_every steps, not every step (counted through Tensor.__int__, the loop's one read; no
    compaction here, whose row selection reads the device too)."""
    model = tiny()
    reads = []
    real = torch.Tensor.__int__
    monkeypatch.setattr(torch.Tensor, '__int__', lambda t: reads.append(1) or real(t))

    def count(k, n):  # reads in a generation of n tokens
        reads.clear()
        out = generate(model, TOK, PROMPTS, 2, n, temperature=1.0, seed=3, stop_ids=[1],
                       compact=False, check_every=k)
        assert not any(x['finished'] for x in out)
        return len(reads)
    # the 16 steps that 24 tokens take more than 8: a read each, or one every 8
    assert count(1, 24) - count(1, 8) == 16
    assert count(8, 24) - count(8, 8) == 2


def test_stop_tokens_and_max_tokens():
    model = tiny()
    ref, _ = naive_greedy(model, PROMPTS[0], 12)
    stop = ref[5]
    first = ref.index(stop)
    out = generate(model, TOK, [PROMPTS[0]], 1, 12, temperature=0.0, stop_ids=[stop])[0]
    assert out['ids'] == ref[:first + 1] and out['finished'] and not out['truncated'], \
        "must stop at the stop token"
    long = generate(model, TOK, [PROMPTS[0]], 2, 7, temperature=1.0, stop_ids=[])
    assert all(len(x['ids']) == 7 and x['truncated'] and not x['finished'] for x in long), \
        "max_new_tokens ignored"


def test_stop_strings_cut_the_text():
    model = tiny()
    ref, _ = naive_greedy(model, PROMPTS[1], 12)
    text = TOK.decode(ref)
    s = text[4:6]
    out = generate(model, TOK, [PROMPTS[1]], 1, 12, temperature=0.0, stop_ids=[],
                   stop_strings=[s])[0]
    assert out['finished'] and out['text'].endswith(s) and text.startswith(out['text']), \
        (text, out['text'])
    assert out['text'].count(s) == 1 and len(out['ids']) <= 6
    # the decode rows keep the token that completed the string
    assert TOK.decode(out['ids']).endswith(s)


@pytest.mark.parametrize('graphs', [False, True])
def test_stop_strings_end_each_completion_where_its_text_first_holds_one(graphs):
    """Sampled completions of three prompts, 4 each, with compaction (rows move as others stop):
    with stop strings, each completion is the one drawn without them (same seeds, same draws) cut at
    the first token after which its text holds a string, its text cut right after that string."""
    model = tiny()
    prompts = PROMPTS[:3]
    kw = dict(temperature=2.0, seed=5, stop_ids=[], graphs=graphs)
    free = generate(model, TOK, prompts, 4, 40, **kw)
    texts = [c['text'] for c in free]
    # a letter some completions write and others do not, and two bytes (two tokens) of one without it
    letter = next(x for x in string.ascii_letters if 3 <= sum(x in t for t in texts) <= 9)
    pair = next(t[i:i + 2] for t in texts if letter not in t for i in range(5, 38)
                if t[i:i + 2].isascii() and t[i:i + 2].isprintable())
    stops = [letter, pair]
    cut = generate(model, TOK, prompts, 4, 40, stop_strings=stops, **kw)
    n_stopped = 0
    for a, b in zip(free, cut):
        first = next((n for n in range(1, 41) if any(x in TOK.decode(a['ids'][:n]) for x in stops)),
                     None)
        if first is None:
            assert b['ids'] == a['ids'] and not b['finished'] and b['text'] == a['text']
            continue
        n_stopped += 1
        assert b['ids'] == a['ids'][:first] and b['finished'] and not b['truncated']
        # (other batch shapes after compaction: the same draws, log-probs to float rounding)
        assert torch.allclose(torch.tensor(b['logprobs']), torch.tensor(a['logprobs'][:first]), atol=1e-5)
        end = min(a['text'].find(x) + len(x) for x in stops if x in a['text'])
        assert b['text'] == a['text'][:end], (a['text'], b['text'])
    assert 2 <= n_stopped < len(free), n_stopped  # the test saw both kinds


def test_eos_is_kept_in_ids_but_not_text():
    model = tiny()
    ref, _ = naive_greedy(model, PROMPTS[0], 10)
    out = generate(model, TOK, [PROMPTS[0]], 1, 10, temperature=0.0, stop_ids=[ref[3]])[0]
    assert out['ids'][-1] == ref[3] and out['text'] == TOK.decode(ref[:ref.index(ref[3])])


def test_prompt_too_long_is_a_clear_error():
    with pytest.raises(ValueError, match='max_seq_len'):
        generate(tiny(), TOK, [[1] * 250], 1, 10)


def test_majority_vote():
    row = {'answers': ['x', '3', '4', '3', None], 'correct': [False, True, False, True, False]}
    assert majority_correct(row)
    row = {'answers': ['x', '4', '4', '3'], 'correct': [True, False, False, True]}
    assert not majority_correct(row)


def test_evaluate_writes_rows_and_summary(tmp_path):
    model = tiny()
    examples = [{'question': 'What is 1+1?', 'answer': '2', 'solution': '1+1=2\n#### 2'},
                {'question': 'What is 2+2?', 'answer': '4', 'solution': '2+2=4\n#### 4'}]
    s = evaluate(model, TOK, arith, examples, '', '', n_samples=3, max_new_tokens=8, batch_size=1,
                 out_path=str(tmp_path / 'eval.jsonl'), progress=False)
    assert s['n'] == 2 and 0 <= s['pass@1'] <= 1 and {'pass@3', 'maj@3', 'mean@3'} <= set(s)
    rows = (tmp_path / 'eval.jsonl').read_text().splitlines()
    assert len(rows) == 2 and '"completions"' in rows[0]


def even_first_byte(completion, example):
    """A grade a random model passes about half the time."""
    return len(completion) > 0 and ord(completion[0]) % 2 == 0


def test_pass_at_k_is_the_unbiased_estimate():
    assert sample.pass_ks(2) == [2] and sample.pass_ks(5) == [2, 4, 5] and sample.pass_ks(16) == [2, 4, 8, 16]
    assert sample.pass_at_k(5, 0, 2) == 0 and sample.pass_at_k(5, 4, 2) == 1 and sample.pass_at_k(5, 5, 5) == 1
    # 2 right of 4: a pair drawn from the 4 misses both with chance C(2, 2) / C(4, 2) = 1/6
    assert abs(sample.pass_at_k(4, 2, 2) - 5 / 6) < 1e-12 and sample.pass_at_k(4, 1, 4) == 1


def test_sampled_pass_at_k_and_mean_at_k_from_the_rows(tmp_path):
    """pass@k: a problem counts when any of its k samples is right; mean@k: the share of right
    samples; both averaged over problems, from the rows written (greedy completion first). A rank's
    share evaluated with `first` gets the same samples as the whole list."""
    from types import SimpleNamespace
    task = SimpleNamespace(messages=arith.messages, grade=even_first_byte)
    examples = [{'question': f'What is {i}+{i}?', 'answer': str(2 * i)} for i in range(4)]
    s = evaluate(tiny(), TOK, task, examples, '', '', n_samples=5, max_new_tokens=6,
                 batch_size=3, out_path=str(tmp_path / 'all.jsonl'), progress=False, seed=22)
    rows = [json.loads(x) for x in (tmp_path / 'all.jsonl').read_text().splitlines()]
    right = [r['correct'][1:] for r in rows]
    assert s['pass@5'] == sum(any(c) for c in right) / 4, (s, right)
    # below k = n, the unbiased estimate from the 5: 1 - C(5 - c, k) / C(5, k)
    want = {2: [0, 0.4, 0.7, 0.9, 1, 1], 4: [0, 0.8, 1, 1, 1, 1]}
    for k in (2, 4):
        assert abs(s[f'pass@{k}'] - sum(want[k][sum(c)] for c in right) / 4) < 1e-12, (k, s, right)
    assert set(s) >= {'pass@2', 'pass@4', 'pass@5'} and 'pass@3' not in s and 'pass@8' not in s
    assert s['mean@5'] == sum(sum(c) / 5 for c in right) / 4, (s, right)
    assert 0 < s['mean@5'] < s['pass@5'], f"the test needs a mix of right and wrong: {right}"
    evaluate(tiny(), TOK, task, examples[2:], '', '', n_samples=5, max_new_tokens=6, batch_size=3,
             out_path=str(tmp_path / 'share.jsonl'), progress=False, seed=22, first=2)
    share = [json.loads(x) for x in (tmp_path / 'share.jsonl').read_text().splitlines()]
    assert [r['completions'] for r in share] == [r['completions'] for r in rows[2:]], \
        "a problem's samples depend on its index among all problems, not on its rank's share"
