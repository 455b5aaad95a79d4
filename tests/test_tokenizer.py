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
