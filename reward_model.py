"""
Rewards computed by a model, colocated with training (reward.py's batched contract: called once per
step with every completion, scored batch_size at a time, no grad, in the run's compute dtype on its
device):
- reward_model: a sequence classifier (a Qwen2 or GPT-2 *ForSequenceClassification snapshot) scores
  the task's prompt messages plus the completion as the assistant turn, rendered by the reward
  model's own tokenizer and chat template;
- judge: any causal snapshot is asked a templated question about (question, completion) and pays
  P(yes) / (P(yes) + P(no)) for its next token, from one forward pass (deterministic).
A snapshot is checked at start-up without reading its weights (check_*: one-line errors naming the
file and the field), and its weights are loaded on the first call, once per process.
"""
import functools
import os
import time

import torch

from hf import ModelLoadError, from_pretrained, resolve_snapshot

JUDGE_TEMPLATE = ("Here is a problem and a proposed solution.\n\nProblem:\n{question}\n\n"
                  "Proposed solution:\n{completion}\n\n"
                  "Is the proposed solution correct? Answer Yes or No.")
# the start-up check's conversation
PROBE = ([{'role': 'user', 'content': 'What is 2 + 3?'}],
         'Adding them: 2 + 3 = 5. The answer is 5.')


@functools.lru_cache(maxsize=None)
def snapshot(path):
    """A snapshot's config (every tensor name and shape checked, no weight read), tokenizer and chat
    template (compiled by load_tokenizer), validated once per process: dict(path, cfg, tok,
    template: compiled Jinja or None, template_file)."""
    path = resolve_snapshot(path)
    meta, tok = from_pretrained(path, device='meta')
    cfg, tfile = meta.config, os.path.join(path, 'tokenizer.json')
    if tok is None:
        raise ModelLoadError(f"{path}: no tokenizer files (tokenizer.json, or vocab.json and "
                             "merges.txt): a reward model's input is rendered by its own tokenizer")
    if tok.vocab_size > cfg.vocab_size:
        where = tfile if os.path.exists(tfile) else path
        raise ModelLoadError(f"{where}: the tokenizer has {tok.vocab_size} tokens, config.json's "
                             f"'vocab_size' is {cfg.vocab_size}: not this model's tokenizer")
    if cfg.num_labels and not 0 <= cfg.pad_token_id < cfg.vocab_size:
        raise ModelLoadError(f"{path}/config.json: field 'pad_token_id' {cfg.pad_token_id} is "
                             "outside the vocabulary")
    # the chat template (chat_template.jinja, else tokenizer_config.json's field) is the
    # tokenizer's: tokenizer.py
    return dict(path=path, cfg=cfg, tok=tok, template=tok.template,
                template_file=tok.template_file)


def render(snap, messages, add_generation_prompt):
    """Token ids of chat messages through the snapshot's own chat template, as transformers'
    apply_chat_template renders and tokenizes it (special-token text inside a message stays text),
    or ChatML without one: tokenizer.render_chat, which compiles and renders templates for the
    policy's prompts too."""
    return snap['tok'].render_chat(messages, add_generation_prompt)


@functools.lru_cache(maxsize=None)
def weights(path, device, dtype):
    """The snapshot's model on device in dtype, eval mode, frozen: loaded on first use, once per
    process."""
    t = time.time()
    model = from_pretrained(path, dtype, device)[0].eval().requires_grad_(False)
    gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    size = f"{model.num_params() / 1e6:.1f}M parameters, {gb:.2f} GB, {dtype} on {device}"
    print(f"reward: loaded {path} ({size}) in {time.time() - t:.1f}s", flush=True)
    return model


def _messages(messages, example):
    """The task's prompt for example as chat messages (messages: the run's tasks.messages; default:
    the example's 'question' as the user turn). A raw-text prompt becomes the user turn."""
    if messages is not None:
        msgs = messages(example)
    else:
        msgs = [{'role': 'user', 'content': example['question']}]
    return [{'role': 'user', 'content': msgs}] if isinstance(msgs, str) else list(msgs)


@torch.inference_mode()
def _batched(seqs, batch_size, max_len, pad_id, fn):
    """fn(idx (B, T) right-padded with pad_id, lengths (B,)) -> (B,) per batch of seqs, longest
    first (least padding); the results in the order of seqs. max_len > 0: a longer sequence keeps
    its last max_len tokens (the scored end)."""
    out = [0.0] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    for lo in range(0, len(order), batch_size):
        rows = [seqs[i][-max_len:] if max_len else seqs[i] for i in order[lo:lo + batch_size]]
        idx = torch.full((len(rows), len(rows[0])), pad_id, dtype=torch.long)
        for r, s in enumerate(rows):
            idx[r, :len(s)] = torch.tensor(s)
        values = fn(idx, torch.tensor([len(s) for s in rows])).float().tolist()
        for i, v in zip(order[lo:lo + batch_size], values):
            out[i] = v
    return out


def _limit(model, max_len):  # RoPE has no hard limit; GPT-2's position table has
    return max_len or (model.config.max_seq_len if model.wpe is not None else 0)


def check_reward_model(path, label=-1, **_):
    """Start-up check of a reward_model config (no weights read); returns the snapshot."""
    snap = snapshot(path)
    cfg = snap['cfg']
    if not cfg.num_labels:
        raise ModelLoadError(f"{snap['path']}/config.json: field 'architectures' names no score "
                             "head: reward_model needs a Qwen2ForSequenceClassification or "
                             "GPT2ForSequenceClassification snapshot (a causal LM can be a judge)")
    if not -cfg.num_labels <= label < cfg.num_labels:
        raise ValueError(f"label={label}: {snap['path']} has {cfg.num_labels} label(s)")
    probe = PROBE[0] + [{'role': 'assistant', 'content': PROBE[1]}]
    text = snap['tok'].decode(render(snap, probe, False))
    if PROBE[1] not in text or 'What is 2 + 3?' not in text:
        raise ValueError(f"{snap['template_file']}: field 'chat_template' leaves out the prompt or "
                         f"the assistant turn (a probe conversation rendered as {text[:200]!r})")
    return snap


def reward_model(completions, examples, path, *, batch_size=16, scale=1.0, shift=0.0, clip=0.0,
                 label=-1, max_len=0, messages=None, device='cpu', dtype='float32'):
    """scale * score + shift, bounded to [-clip, clip] when clip > 0. score: the classifier's logit
    (one label), or the softmax probability of label (several). max_len > 0: score each sequence's
    last max_len tokens only (0: all; a GPT-2 snapshot's n_positions at most)."""
    snap, model = check_reward_model(path, label), weights(path, device, dtype)
    seqs = [render(snap, _messages(messages, ex) + [{'role': 'assistant', 'content': c}], False)
            for c, ex in zip(completions, examples)]

    def scores(idx, lengths):
        logits = model.sequence_scores(idx.to(device)).float()
        s = logits[:, label] if logits.size(1) == 1 else logits.softmax(-1)[:, label]
        s = scale * s + shift
        return s.clamp(-clip, clip) if clip > 0 else s
    return _batched(seqs, batch_size, _limit(model, max_len), model.config.pad_token_id, scores)


def _judge_prompt(snap, completion, example, *, template, system, chat, messages):
    """The judge's input: the template filled in, as a user turn through its chat template (chat),
    or as raw text."""
    msgs = _messages(messages, example)
    question = next((m['content'] for m in reversed(msgs) if m['role'] == 'user'), '')
    text = template.format(question=question, completion=completion,
                           answer=example.get('answer', ''))
    if not chat:
        return snap['tok'].encode(text)
    turns = [{'role': 'system', 'content': system}] if system else []
    return render(snap, turns + [{'role': 'user', 'content': text}], True)


def check_judge(path, template=JUDGE_TEMPLATE, yes='Yes', no='No', system='', chat=True, **_):
    """Start-up check of a judge config (no weights read); returns (snapshot, yes id, no id)."""
    snap = snapshot(path)
    if snap['cfg'].num_labels:
        raise ModelLoadError(f"{snap['path']}/config.json: field 'architectures' is a classifier; "
                             "a judge needs a causal LM (use the reward_model reward for a "
                             "classifier)")
    try:
        filled = template.format(question=PROBE[0][0]['content'], completion=PROBE[1],
                                 answer='5')
    except (KeyError, IndexError, ValueError, AttributeError) as e:
        raise ValueError(f"template: {type(e).__name__}: {e} (its fields: {{question}}, "
                         "{completion}, {answer})") from None
    if not filled.strip() or PROBE[1] not in filled:
        raise ValueError(f"template {template[:80]!r} renders nothing of the completion: "
                         "it needs {completion}")
    ids = [snap['tok'].encode(word) for word in (yes, no)]
    for field, word, t in (('yes', yes, ids[0]), ('no', no, ids[1])):
        if len(t) != 1:
            raise ValueError(f"{field}={word!r} is {len(t)} tokens for {snap['path']}'s "
                             "tokenizer: the verdict words must be one token each "
                             "(e.g. 'Yes' or ' Yes')")
    if ids[0] == ids[1]:
        raise ValueError(f"yes={yes!r} and no={no!r} are the same token")
    probe = {'question': PROBE[0][0]['content']}
    if not _judge_prompt(snap, PROBE[1], probe, template=template, system=system, chat=chat,
                         messages=None):
        raise ValueError(f"template {template[:80]!r} renders no tokens")
    return snap, ids[0][0], ids[1][0]


def judge(completions, examples, path, *, template=JUDGE_TEMPLATE, yes='Yes', no='No', system='',
          chat=True, batch_size=16, max_len=0, messages=None, device='cpu', dtype='float32'):
    """P(yes) / (P(yes) + P(no)) = sigmoid(logit_yes - logit_no) of the judge's next token after its
    question: in [0, 1], 0.5 when it cannot tell. template fields: {question} (the task prompt's
    last user turn), {completion}, {answer} (the example's reference answer, '' if none). system: a
    system turn for the judge; chat=False: the filled template is the raw prompt (base models)."""
    snap, y, n = check_judge(path, template=template, yes=yes, no=no, system=system, chat=chat)
    model = weights(path, device, dtype)
    seqs = [_judge_prompt(snap, c, ex, template=template, system=system, chat=chat,
                          messages=messages)
            for c, ex in zip(completions, examples)]

    def p_yes(idx, lengths):
        out = model(idx.to(device), input_lengths=lengths.to(device), last_only=True)
        logits = out[:, 0].float()
        return torch.sigmoid(logits[:, y] - logits[:, n])
    return _batched(seqs, batch_size, _limit(model, max_len), 0, p_yes)


for _fn, _check in ((reward_model, check_reward_model), (judge, check_judge)):
    # reward.py: called once per step with every completion; checked at start-up
    _fn.batched = True
    _fn.check = _check
