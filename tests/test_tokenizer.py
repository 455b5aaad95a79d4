"""Our tiktoken-based loader must tokenize exactly like the HF `tokenizers` library on the same
files."""
import json
import random
from pathlib import Path

import pytest
from tokenizers import (Regex, Tokenizer as HFTokenizer, decoders, models, normalizers,
                        pre_tokenizers, trainers)

from tokenizer import QWEN2_PATTERN, TokenizerError, byte_tokenizer, load_tokenizer, vocabulary_mismatch

GSM8K = Path(__file__).resolve().parents[1].parent / 'shared' / 'gsm8k' / 'train.jsonl'
SPECIALS = ['<|endoftext|>', '<|im_start|>', '<|im_end|>']
FALLBACK_TEXT = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May.",
    "Weng earns $12 an hour for babysitting. Yesterday, she did 50 minutes of babysitting. "
    "How much?",
    "Betty is saving money for a new wallet which costs $100. She has only half of the money she "
    "needs."]


def corpus():
    if GSM8K.exists():
        return [json.loads(line)['question'] for line in GSM8K.open()][:3000]
    return FALLBACK_TEXT * 200


def sample_strings():
    """>= 1,000 strings: GSM8K text, unicode, emoji, digits, runs of spaces/newlines, special
    tokens."""
    rng = random.Random(0)
    qs = corpus()
    out = qs[:700]
    out += ["héllo wörld ñ ç ø", "日本語のテキスト、中文字符。", "emoji 🤖🚀 and 👩‍👩‍👧 family",
            "Ünïcödé  \u00a0 nbsp", "12345678901234567890", "3.14159 -42 1,000,000 $5.00 50%",
            "   leading", "trailing   ", "a  b   c    d", "\n\n\nnewlines\n\n", "\t tabs\t\t",
            "\r\n windows\r\n", "", " ", "x", "I'm you're we'll it's DON'T",
            "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
            "end<|endoftext|>start"]
    alphabet = "abc XYZ 0123456789 .,;:!?'\"$%\n\t  é日🤖<|im_end|>"
    while len(out) < 1200:
        k = rng.randint(0, 60)
        if rng.random() < 0.5:
            out.append(''.join(rng.choice(alphabet) for _ in range(k)))
        else:
            tail = ['\n', '  ', '🤖', '<|im_end|>', '']
            out.append(rng.choice(qs)[:rng.randint(1, 120)] + rng.choice(tail))
    return out


def train_bpe(tmp_path, qwen_style):
    tok = HFTokenizer(models.BPE())
    # Qwen2's layout: NFC, a Split regex, then ByteLevel without its own regex
    if qwen_style:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior='isolated', invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:  # GPT-2's layout: ByteLevel with its built-in regex
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    d = tmp_path / ('qwen' if qwen_style else 'gpt2')
    d.mkdir()
    tok.save(str(d / 'tokenizer.json'))
    return tok, d


@pytest.mark.parametrize('qwen_style', [True, False],
                         ids=['qwen-split-regex', 'gpt2-bytelevel-regex'])
def test_ids_match_hf_tokenizers(tmp_path, qwen_style):
    hf, d = train_bpe(tmp_path, qwen_style)
    ours = load_tokenizer(str(d))
    strings = sample_strings()
    assert len(strings) >= 1000
    for s in strings:
        expected = hf.encode(s, add_special_tokens=False).ids
        got = ours.encode_with_special(s)
        assert got == expected, f"ids differ for {s!r}:\n ours {got}\n   hf {expected}"
        assert ours.decode(got) == hf.decode(expected, skip_special_tokens=False), (
            f"decode differs for {s!r}")


def test_decode_encode_roundtrip(tmp_path):
    _, d = train_bpe(tmp_path, qwen_style=True)
    tok = load_tokenizer(str(d))
    for s in sample_strings():
        assert tok.decode(tok.encode_with_special(s)) == s, f"round trip changed {s!r}"
        assert tok.decode(tok.encode(s)) == s


def test_ordinary_encode_does_not_parse_specials(tmp_path):
    _, d = train_bpe(tmp_path, qwen_style=True)
    tok = load_tokenizer(str(d))
    ids = tok.encode("a<|im_end|>b")
    assert tok.special['<|im_end|>'] not in ids, (
        "user text must not be able to inject a special token")
    assert tok.encode_with_special("<|im_end|>") == [tok.special['<|im_end|>']]


def test_vocabulary_mismatch_names_the_first_id_that_differs(tmp_path):
    """A teacher must read the policy's ids as its own: the same bytes or special token for every id
    (the split rules are not compared: only what each id means)."""
    hf, d = train_bpe(tmp_path, qwen_style=True)
    tok = load_tokenizer(str(d))
    assert vocabulary_mismatch(tok, load_tokenizer(str(d))) is None
    assert vocabulary_mismatch(byte_tokenizer(), byte_tokenizer()) is None
    assert vocabulary_mismatch(tok, byte_tokenizer()) == f"{tok.vocab_size} ids against 260"
    spec = json.loads((d / 'tokenizer.json').read_text())
    vocab = spec['model']['vocab']
    a, b = sorted(vocab, key=vocab.get)[10:12]  # two single bytes' ids swapped
    vocab[a], vocab[b] = vocab[b], vocab[a]
    swapped = tmp_path / 'swapped'
    swapped.mkdir()
    (swapped / 'tokenizer.json').write_text(json.dumps(spec))
    got = vocabulary_mismatch(tok, load_tokenizer(str(swapped)))
    assert got is not None and got.startswith('id 10 is '), got
    renamed = json.loads((d / 'tokenizer.json').read_text())
    renamed['added_tokens'][-1]['content'] = '<|renamed|>'
    (swapped / 'tokenizer.json').write_text(json.dumps(renamed))
    got = vocabulary_mismatch(tok, load_tokenizer(str(swapped)))
    assert got is not None and got.startswith('special tokens differ, first at id '), got


def test_vocab_merges_files(tmp_path):
    """vocab.json + merges.txt (no tokenizer.json) tokenize like the GPT-2-style tokenizer.json."""
    hf, d = train_bpe(tmp_path, qwen_style=False)
    alt = tmp_path / 'vm'
    alt.mkdir()
    hf.model.save(str(alt))
    tok = load_tokenizer(str(alt))
    for s in sample_strings()[:300]:
        s = s.replace('<|', '<')  # no added tokens without tokenizer.json/tokenizer_config.json
        assert tok.encode(s) == hf.encode(s, add_special_tokens=False).ids, f"ids differ for {s!r}"


def test_chat_template_matches_chatml():
    tok = byte_tokenizer()
    msgs = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'What is 2+2?'}]
    text = tok.decode(tok.render_chat(msgs))
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    no_gen = tok.decode(tok.render_chat(msgs, add_generation_prompt=False))
    assert no_gen.endswith("<|im_end|>\n"), no_gen


def test_byte_tokenizer():
    tok = byte_tokenizer()
    s = "héllo 🤖\n12+3=15"
    assert tok.encode(s) == list(s.encode('utf-8')), "byte tokenizer ids must be the utf-8 bytes"
    assert tok.decode(tok.encode(s)) == s
    assert tok.vocab_size == 260 and tok.eos_id == tok.special['<|im_end|>'] == 258
    assert set(tok.stop_ids) == {256, 258}


def test_byte_tokenizer_exports_for_transformers(tmp_path):
    from transformers import PreTrainedTokenizerFast
    tok = byte_tokenizer()
    tok.save(str(tmp_path))
    hf = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    s = "Tom has 12 apples 🍎.\n<|im_end|>"
    assert hf.encode(s, add_special_tokens=False) == tok.encode_with_special(s)
    again = load_tokenizer(str(tmp_path))
    assert again.encode_with_special(s) == tok.encode_with_special(s)
    msgs = [{'role': 'user', 'content': 'hi'}]
    rendered = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert rendered == tok.decode(tok.render_chat(msgs))


def test_bad_tokenizer_files(tmp_path):
    with pytest.raises(TokenizerError, match='no tokenizer files'):
        load_tokenizer(str(tmp_path))
    (tmp_path / 'tokenizer.json').write_text('{not json')
    with pytest.raises(TokenizerError, match='tokenizer.json'):
        load_tokenizer(str(tmp_path))
    unigram = {'model': {'type': 'Unigram', 'vocab': []}}
    (tmp_path / 'tokenizer.json').write_text(json.dumps(unigram))
    with pytest.raises(TokenizerError, match='byte-level BPE'):
        load_tokenizer(str(tmp_path))


# ---------------------------------------------------------------- sentencepiece-style BPE (Llama 2)
LLAMA2_TEMPLATE = (  # Llama-2-chat's tokenizer_config.json
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
    "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}"
    "{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
    "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}")
PHI3_TEMPLATE = (  # Phi-3-mini-instruct's
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'system') %}{{'<|system|>' + '\\n' + "
    "message['content'] + '<|end|>' + '\\n'}}{% elif (message['role'] == 'user') %}{{'<|user|>' + '\\n' + "
    "message['content'] + '<|end|>' + '\\n' + '<|assistant|>' + '\\n'}}{% elif message['role'] == 'assistant' %}"
    "{{message['content'] + '<|end|>' + '\\n'}}{% endif %}{% endfor %}")
MISTRAL_TEMPLATE = (  # Mistral 7B Instruct's, [INST] and [/INST] control tokens as in v0.3
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + '[/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}")


def sentencepiece_snapshot(path, config, specials=(), template=None, *, metaspace_file=False, vocab_size=700,
                           model_type=None, base=('<unk>', '<s>', '</s>')):
    """A sentencepiece-style BPE trained on GSM8K questions by `tokenizers`, written as transformers'
    converter writes Llama 2's, Mistral 7B's and Phi-3's tokenizer.json: <unk>, <s>, </s>, the 256
    <0xXX> byte tokens, the merged pieces by rank, the single characters last (sentencepiece's
    order); every split of a piece into two pieces a merge, ranked by the piece; byte fallback.
    config: tokenizer_config.json; metaspace_file: the steps written as a Metaspace pre-tokenizer
    (split false) rather than Llama 2's legacy normalizer; model_type: a config.json of that type
    (transformers' AutoTokenizer picks the class by it); base: the first ids (Gemma's: GEMMA_BASE)."""
    tok = HFTokenizer(models.BPE(unk_token='<unk>', byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement='\u2581', prepend_scheme='first', split=False)
    fallback = [f'<0x{b:02X}>' for b in range(256)]
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[*base, *fallback], show_progress=False))
    vocab = tok.get_vocab()
    fixed = [*base, *fallback]
    chars = sorted(p for p in vocab if len(p) == 1 and p not in fixed)
    pieces = sorted((p for p in vocab if p not in fixed and p not in chars), key=vocab.get)
    ids = {p: i for i, p in enumerate(fixed + pieces + chars + list(specials))}
    merges = sorted((ids[p], ids[p[:k]], ids[p[k:]], p[:k], p[k:]) for p in pieces for k in range(1, len(p))
                    if p[:k] in ids and p[k:] in ids)
    added = [{'id': ids[t], 'content': t, 'single_word': False, 'lstrip': False, 'rstrip': False,
              'normalized': False, 'special': True} for t in [*base, *specials]]
    steps = ({'normalizer': None, 'pre_tokenizer': {'type': 'Metaspace', 'replacement': '\u2581',
                                                     'prepend_scheme': 'first', 'split': False}}
             if metaspace_file else
             {'normalizer': {'type': 'Sequence', 'normalizers': [{'type': 'Prepend', 'prepend': '\u2581'}, {
                 'type': 'Replace', 'pattern': {'String': ' '}, 'content': '\u2581'}]}, 'pre_tokenizer': None})
    spec = {'version': '1.0', 'truncation': None, 'padding': None, 'added_tokens': added, **steps,
            'post_processor': None,
            'decoder': {'type': 'Sequence', 'decoders': [
                {'type': 'Replace', 'pattern': {'String': '\u2581'}, 'content': ' '}, {'type': 'ByteFallback'},
                {'type': 'Fuse'}, {'type': 'Strip', 'content': ' ', 'start': 1, 'stop': 0}]},
            'model': {'type': 'BPE', 'dropout': None, 'unk_token': '<unk>', 'continuing_subword_prefix': None,
                      'end_of_word_suffix': None, 'fuse_unk': True, 'byte_fallback': True, 'ignore_merges': False,
                      'vocab': ids, 'merges': [[a, b] for *_, a, b in merges]}}
    path.mkdir(parents=True, exist_ok=True)
    (path / 'tokenizer.json').write_text(json.dumps(spec, ensure_ascii=False))
    conf = {'bos_token': '<s>', 'eos_token': '</s>', 'unk_token': '<unk>', 'add_bos_token': True, **config}
    if template:
        conf['chat_template'] = template
    (path / 'tokenizer_config.json').write_text(json.dumps(conf))
    if model_type:
        (path / 'config.json').write_text(json.dumps({'model_type': model_type}))
    return path


GEMMA_BASE = ('<pad>', '<eos>', '<bos>', '<unk>', '<mask>')  # Gemma's first ids
GEMMA_CONFIG = {'tokenizer_class': 'GemmaTokenizer', 'bos_token': '<bos>', 'eos_token': '<eos>', 'unk_token': '<unk>',
                'pad_token': '<pad>'}
# layout -> (tokenizer_config.json, Metaspace file, config.json's model_type, the space's rule): transformers'
# LlamaTokenizer from the config (it rebuilds the steps), or the file's steps (another class; a Mistral, a Phi-3)
SENTENCEPIECE_LAYOUTS = {
    'llama2-legacy': ({'tokenizer_class': 'LlamaTokenizer', 'legacy': True}, False, 'llama', 'always'),
    'llama-first': ({'tokenizer_class': 'LlamaTokenizerFast', 'legacy': False}, False, None, 'first'),
    'llama-no-prefix': ({'tokenizer_class': 'LlamaTokenizer', 'add_prefix_space': False}, False, None, 'never'),
    'metaspace-file': ({'tokenizer_class': 'PreTrainedTokenizerFast'}, True, None, 'first'),
    'mistral-metaspace-file': ({'tokenizer_class': 'LlamaTokenizer', 'legacy': True}, True, 'mistral', 'first'),
    'phi3-legacy-file': ({'tokenizer_class': 'LlamaTokenizer', 'legacy': False}, False, 'phi3', 'prepend'),
    'gemma3': (GEMMA_CONFIG, False, 'gemma3_text', 'never'),
}


@pytest.mark.parametrize('layout', SENTENCEPIECE_LAYOUTS)
def test_a_sentencepiece_bpe_encodes_and_decodes_as_transformers(tmp_path, layout):
    """Llama 2's, Mistral 7B's and Phi-3's tokenizers: the ids and text of transformers'
    AutoTokenizer for every sample string (with <s>, </s> and control tokens among the text:
    transformers puts its space before the text where its layout says), unknown characters as
    their bytes, and decode with the space the encoder added taken off."""
    import transformers
    config, metaspace_file, model_type, prefix = SENTENCEPIECE_LAYOUTS[layout]
    path = sentencepiece_snapshot(tmp_path / layout, config, specials=['[INST]', '[/INST]'],
                                  metaspace_file=metaspace_file, model_type=model_type,
                                  base=GEMMA_BASE if layout == 'gemma3' else ('<unk>', '<s>', '</s>'))
    ours, hf = load_tokenizer(str(path)), transformers.AutoTokenizer.from_pretrained(path)
    assert ours.enc.prefix == prefix and ours.vocab_size == len(hf)
    rng = random.Random(1)
    strings = sample_strings() + ['\u2581x', ' \u2581', '[INST] Hi[/INST]', '<s>[INST] a</s>', 'x<s>y', '</s> z']
    strings += [''.join(rng.choice(['<s>', '[INST]', ' ', 'a b', '\n', '日', '🤖', 'é']) for _ in range(6))
                for _ in range(300)]
    for s in strings:
        want = hf.encode(s, add_special_tokens=False)
        assert ours.encode_with_special(s) == want, (s, hf.convert_ids_to_tokens(want))
        assert ours.decode(want) == hf.decode(want), s
    for _ in range(500):  # any ids, as a completion cut anywhere: byte tokens that are no character among them
        ids = rng.choices(range(len(hf)), k=rng.randint(1, 8))
        assert ours.decode(ids) == hf.decode(ids), hf.convert_ids_to_tokens(ids)
    assert ours.encode('[INST]') != [ours.special['[INST]']]  # ordinary text cannot inject a special
    # a teacher reads the policy's ids as its own: the same pieces for every id, or the first that differs
    assert vocabulary_mismatch(ours, load_tokenizer(str(path))) is None
    spec = json.loads((path / 'tokenizer.json').read_text())
    vocab = spec['model']['vocab']
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (path / 'tokenizer.json').write_text(json.dumps(spec))
    assert vocabulary_mismatch(ours, load_tokenizer(str(path))).startswith(f'id {min(vocab[a], vocab[b])} is ')


@pytest.mark.parametrize('name, template, specials', [
    ('llama', LLAMA2_TEMPLATE, []), ('mistral', MISTRAL_TEMPLATE, ['[INST]', '[/INST]']),
    ('phi3', PHI3_TEMPLATE, ['<|endoftext|>', '<|assistant|>', '<|system|>', '<|end|>', '<|user|>'])])
def test_a_sentencepiece_chat_template_prompts_as_transformers(tmp_path, name, template, specials):
    """A chat through Llama 2's, Mistral's and Phi-3's templates, each snapshot with its model's
    config.json: transformers' apply_chat_template(tokenize=True) ids for the legacy layout and the
    later one, LlamaTokenizer's steps or the file's (the space before the text at the start of the
    rendered prompt only, or after every special token)."""
    import transformers
    msgs = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Liz has 80 books. How many?'},
            {'role': 'assistant', 'content': '  80 books.'}, {'role': 'user', 'content': 'And\n now 日?'}]
    for legacy in (True, False):
        path = sentencepiece_snapshot(tmp_path / f'{name}-{legacy}', {'tokenizer_class': 'LlamaTokenizer',
                                                                       'legacy': legacy}, specials, template,
                                      metaspace_file=not legacy, model_type=name)
        ours, hf = load_tokenizer(str(path)), transformers.AutoTokenizer.from_pretrained(path)
        # a user's text holding the template's control strings: text, as transformers' sanitized encoding
        hostile = [{'role': 'user', 'content': f"Say {(specials or ['</s>'])[-1]} then</s>x{(specials or ['<s>'])[0]}"}]
        for m, sanitize in ((msgs, False), (msgs[1:], False), (msgs[1:2], False), (hostile, True)):
            if name == 'mistral' and m[0]['role'] == 'system':
                continue  # (this template drops a system turn)
            want = hf.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                          sanitize_control_tokens=sanitize)
            want = list(want['input_ids'] if hasattr(want, 'keys') else want)
            assert ours.render_chat(m) == want, (legacy, ours.decode(ours.render_chat(m)), hf.decode(want))


def test_a_sentencepiece_layout_it_does_not_reproduce_is_one_clear_error(tmp_path):
    """A Metaspace pre-tokenizer that splits at every space, or a normalizer other than Llama 2's,
    where transformers keeps the file's steps: one line naming the file, its steps and what is
    read."""
    path = sentencepiece_snapshot(tmp_path / 'split', {'tokenizer_class': 'PreTrainedTokenizerFast'},
                                  metaspace_file=True)
    spec = json.loads((path / 'tokenizer.json').read_text())
    spec['pre_tokenizer']['split'] = True
    (path / 'tokenizer.json').write_text(json.dumps(spec))
    nfkc = sentencepiece_snapshot(tmp_path / 'nfkc', {'tokenizer_class': 'LlamaTokenizer'}, model_type='phi3')
    spec = json.loads((nfkc / 'tokenizer.json').read_text())
    spec['normalizer']['normalizers'].insert(0, {'type': 'NFKC'})
    (nfkc / 'tokenizer.json').write_text(json.dumps(spec))
    for p, steps in ((path, "normalizer None, pre_tokenizer 'Metaspace' split True"),
                     (nfkc, "normalizer 'Sequence', pre_tokenizer None")):
        with pytest.raises(TokenizerError, match=r"tokenizer\.json: this sentencepiece-style tokenizer's steps are "
                           rf"not supported \({steps}\): read are a Metaspace") as e:
            load_tokenizer(str(p))
        assert '\n' not in str(e.value)
