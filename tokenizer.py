"""
Tokenizers on tiktoken: a byte-level BPE read from an HF snapshot's tokenizer files (or a
sentencepiece-style one: SentencePieceBPE), and a byte encoding for scratch models. A snapshot's own
chat template (tokenizer_config.json's 'chat_template' or chat_template.jinja) is rendered with
jinja2 in its immutable sandbox, as transformers renders it; without one, ChatML is plain code here.

tiktoken's ranks are its token ids and it merges the pair whose joined bytes have the lowest rank.
An HF byte-level BPE gives the same tokens when each merge creates a token whose id grows with the
merge's position in `merges`, which holds for GPT-2, Qwen2 and anything `tokenizers` trains;
load_tokenizer checks it instead of assuming.
"""
import datetime
import itertools
import json
import os
import re
import unicodedata

import tiktoken

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
                 r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
CHATML = ("{% for message in messages %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}")


class TokenizerError(ValueError):
    pass


class SentencePieceBPE:
    """A sentencepiece-style BPE as transformers runs it (Llama 2's, Mistral 7B's to v0.3, Phi-3's, Gemma 3's:
    pieces with '▁' for a space, a character the vocabulary lacks as the <0xXX> tokens of its bytes,
    no split before the BPE), with the methods Tokenizer uses of a tiktoken Encoding. tiktoken merges
    bytes where HF's BPE merges characters, so tiktoken's ranks here are not the ids: every byte,
    then the leading bytes of each multi-byte character of the vocabulary, then the characters (so
    characters form before any merge), then each merge's token in merge order; encode maps ranks to
    ids, the leading bytes of a character the vocabulary lacks to their <0xXX> ids. prefix: where a
    space goes before the text, as HF's Metaspace prepend_scheme: 'first' (at the start of the
    input), 'always' (also after each special token), not before text that starts with one;
    'prepend' (Llama 2's legacy normalizer: as 'always', even then); 'never'. decode drops that
    space from the start, as HF's decoder does."""

    def __init__(self, name, vocab, merges, specials, prefix, src):
        self.prefix, self._special_tokens = prefix, dict(specials)
        self.special_text = {i: t.encode() for t, i in specials.items()}
        self.byte_id, self.id_bytes, id_of = {}, {}, {}  # byte -> its <0xXX> id; id -> bytes; bytes -> id
        for piece, i in vocab.items():
            fallback = re.fullmatch(r'<0x([0-9A-Fa-f]{2})>', piece)
            if piece in specials:
                continue
            if fallback:
                self.byte_id[int(fallback.group(1), 16)] = i
                self.id_bytes[i] = bytes([int(fallback.group(1), 16)])
            else:
                self.id_bytes[i] = piece.replace('▁', ' ').encode()
                id_of[self.id_bytes[i]] = i
        self.fallback_ids = set(self.byte_id.values())
        missing = [b for b in range(256) if b not in self.byte_id]
        if missing:
            raise TokenizerError(f"{src}: byte_fallback without the <0x{missing[0]:02X}> token "
                                 f"({len(missing)} of the 256 byte tokens missing)")
        ranks = {}
        chars = [p.replace('▁', ' ').encode() for p in vocab if len(p) == 1 and p not in specials]
        for piece in ([bytes([b]) for b in range(256)] + [c[:k] for c in chars for k in range(2, len(c))]
                      + chars + [(a + b).replace('▁', ' ').encode() for a, b in merges]):
            ranks.setdefault(piece, len(ranks))  # a token's rank: its first place in this order
        for k, (a, b) in enumerate(merges):
            if (a + b) not in vocab:
                raise TokenizerError(f"{src}: merge #{k} ({a!r} {b!r}) makes no token of the vocabulary")
        self.rank_bytes = {r: t for t, r in ranks.items()}
        # rank -> id; None: leading bytes of a character, written as their <0xXX> ids
        self.to_id = [id_of.get(t, self.byte_id[t[0]] if len(t) == 1 else None) for t in self.rank_bytes.values()]
        self.n_vocab = max([*self.id_bytes, *specials.values()]) + 1
        self._mergeable_ranks = ranks
        self.bpe = tiktoken.Encoding(name=name, pat_str=r'[\s\S]+', mergeable_ranks=ranks, special_tokens={})
        longest_first = sorted(specials, key=len, reverse=True)
        self._special_re = re.compile('|'.join(map(re.escape, longest_first)) or r'(?!)')

    def encode_ordinary(self, text, where='start'):
        """HF's ids of text with no special tokens. where: 'start' (of the input), 'special' (after
        a special token) or 'inside' (continuing text: no space before it in any layout, as
        transformers' encoding of a sanitized chat piece)."""
        text = text.replace('▁', ' ')
        spaced = {'start': ('first', 'always', 'prepend'), 'special': ('always', 'prepend')}.get(where, ())
        if text and self.prefix in spaced and (self.prefix == 'prepend' or not text.startswith(' ')):
            text = ' ' + text
        ids = []
        for r in self.bpe.encode_ordinary(text):
            i = self.to_id[r]
            ids += [i] if i is not None else [self.byte_id[b] for b in self.rank_bytes[r]]
        return ids

    def encode(self, text, allowed_special='all'):
        """Special-token strings in text as their ids, the text between them as encode_ordinary."""
        ids, pos = [], 0
        for m in self._special_re.finditer(text):
            ids += self.encode_ordinary(text[pos:m.start()], 'start' if pos == 0 else 'special')
            ids.append(self._special_tokens[m.group()])
            pos = m.end()
        return ids + self.encode_ordinary(text[pos:], 'start' if pos == 0 else 'special')

    def decode_single_token_bytes(self, i):
        return self.special_text[i] if i in self.special_text else self.id_bytes.get(i, b'')

    def decode(self, ids, errors='replace'):
        """HF's text of ids: each run of <0xXX> tokens its UTF-8, or one U+FFFD per byte where that
        is not valid (HF's ByteFallback decoder); the space before the text taken off."""
        parts, run = [], []
        for i in [*ids, None]:
            if i is not None and i in self.fallback_ids:
                run.append(self.id_bytes[i])
                continue
            if run:
                try:
                    parts.append(b''.join(run).decode('utf-8'))
                except UnicodeDecodeError:
                    parts.append('\ufffd' * len(run))
                run = []
            if i is not None:
                parts.append(self.decode_single_token_bytes(i).decode('utf-8', errors=errors))
        text = ''.join(parts)
        return text[1:] if self.prefix != 'never' and text.startswith(' ') else text


def _alternation(strings):
    """A regex matching any of strings, longest first (leftmost-longest, as HF matches added
    tokens); one that never matches for none."""
    longest_first = sorted(strings, key=len, reverse=True)
    return re.compile('|'.join(map(re.escape, longest_first)) or r'(?!)')


def bytes_to_unicode():
    """GPT-2's reversible map from bytes to printable unicode characters, used by every byte-level
    BPE vocab file."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class Tokenizer:
    def __init__(self, enc, *, nfc=False, files=None, eos=None, template=None, template_file=None,
                 template_vars=None, stops=(), control=None, control_from_template=True):
        self.enc = enc
        self.nfc = nfc  # Qwen2's tokenizer.json normalises to NFC before splitting
        self.files = files or {}  # the snapshot's tokenizer files, written back verbatim by save()
        self.special = dict(enc._special_tokens)
        self.vocab_size = enc.n_vocab
        end = self.special.get('<|endoftext|>')
        # eos: the config's own, where it names one (a GPT-2 export may list ChatML tokens it never
        # learned)
        if eos in self.special:
            self.eos_id = self.special[eos]
        else:
            self.eos_id = self.special.get('<|im_end|>', end)
        # stops: the snapshot's other turn ends (Llama 3's <|eot_id|>: generation_config.json's
        # eos_token_id, tokenizer_config.json's eos_token), which transformers stops on too
        self.stop_ids = sorted({i for i in (self.eos_id, end, *stops) if i is not None})
        self.pad_id = self.special.get('<|pad|>', end if end is not None else 0)
        self.chat = '<|im_start|>' in self.special and '<|im_end|>' in self.special
        # the snapshot's compiled chat template, or None (hand-written ChatML below)
        self.template = template
        self.template_file = template_file  # where it came from, for error messages
        # bos_token, eos_token, ...: what transformers passes it
        self.template_vars = template_vars or {}
        # special-token strings, longest first (leftmost-longest, as HF matches added tokens)
        self._special_re = _alternation(self.special)
        # transformers' control tokens, which a message's text cannot produce: the added tokens it
        # marks special (None: every added token), and, control_from_template, those the chat
        # template's own text holds (False: the config's chat_control_tokens listed them instead)
        self.control, self.control_from_template = control, control_from_template
        self._control = (None, None)  # (template, its control tokens' regex), for _control_re

    def encode(self, text, where='start'):
        """Ordinary text: special-token strings in it are plain text, so user data cannot inject a
        turn end. where: 'start' (of the input), 'special' (after a special token) or 'inside' (it
        continues text): where a sentencepiece-style tokenizer puts a space before it
        (SentencePieceBPE)."""
        text = unicodedata.normalize('NFC', text) if self.nfc else text
        if isinstance(self.enc, SentencePieceBPE):
            return self.enc.encode_ordinary(text, where)
        return self.enc.encode_ordinary(text)

    def encode_with_special(self, text):
        text = unicodedata.normalize('NFC', text) if self.nfc else text
        return self.enc.encode(text, allowed_special='all')

    def decode(self, ids):
        ids = [int(i) for i in ids]
        # a model's vocab is often padded past the tokenizer's
        ids = [i for i in ids if i < self.vocab_size]
        return self.enc.decode(ids, errors='replace')

    def token_bytes(self, i):
        """The bytes one id decodes to (b'' past the tokenizer's vocab, as decode drops it)."""
        return self.enc.decode_single_token_bytes(i) if i < self.vocab_size else b''

    def render_chat(self, messages, add_generation_prompt=True, **kwargs):
        """Token ids of chat messages. With the snapshot's chat template: the ids of transformers'
        apply_chat_template(messages, add_generation_prompt=..., tokenize=True) (kwargs: the
        template's own variables, e.g. enable_thinking), except that control-token text inside a
        message's content (special tokens, added tokens the template writes) stays text (no injected
        turn end), as with sanitize_control_tokens=True. Without one: ChatML, as Qwen's template
        writes it (no default system turn is added: pass one if you want it); tokenizers without
        ChatML tokens (GPT-2) get plain 'role: content' lines."""
        if self.template is not None:
            return self._render_template(messages, add_generation_prompt, **kwargs)
        if not self.chat:
            text = ''.join(f"{m['role']}: {m['content']}\n" for m in messages)
            return self.encode(text + ('assistant:' if add_generation_prompt else ''))
        start, end, nl = self.special['<|im_start|>'], self.special['<|im_end|>'], self.encode('\n')
        ids = []
        for m in messages:
            ids += [start] + self.encode(f"{m['role']}\n{m['content']}") + [end] + nl
        if add_generation_prompt:
            ids += [start] + self.encode('assistant\n')
        return ids

    def _control_re(self):
        """The control tokens of the current template, as transformers' _get_control_tokens picks
        them: the special added tokens, and the added tokens in the template's literal text (not
        whitespace ones), or those the config's chat_control_tokens lists."""
        if self._control[0] is not self.template:
            text = getattr(self.template, 'literal_text', '') if self.control_from_template else ''
            self._control = (self.template, _alternation(
                t for t in self.special
                if self.control is None or t in self.control or (t in text and not t.isspace())))
        return self._control[1]

    def _render_template(self, messages, add_generation_prompt, **kwargs):
        """Control-token strings (_control_re: the special tokens, and added tokens the template
        writes) in message contents are swapped for private-use characters before rendering, so
        that the only control tokens in the rendered text are the template's; the text is then
        split at every added token, and each stretch between them is split again at the swapped
        strings: template text and contents are encoded as ordinary text, each swapped string on its
        own as ordinary text. That is transformers' apply_chat_template(..., tokenize=True,
        sanitize_control_tokens=True), which encodes each control-token string from an input as its
        own piece of text (so a tool's `<|im_end|>` is never the token, and its pieces never merge
        with the text around it), while an added token that is neither (Qwen2.5's <|file_sep|>)
        stays a token. Unlike it, strings in tools and documents are not swapped."""
        control_re = self._control_re()
        contents = [m.get('content') for m in messages if isinstance(m, dict)]
        used = set(''.join(c for c in contents if isinstance(c, str)))
        # the private-use characters: the BMP's 6,400, then planes 15 and 16 (131,068 more)
        pua = itertools.chain(range(0xE000, 0xF900), range(0xF0000, 0xFFFFE), range(0x100000, 0x10FFFE))
        free = (chr(c) for c in pua if chr(c) not in used)
        mark, back = {}, {}  # special string -> its placeholder character, and back

        def masked(text):
            def swap(m):
                if m.group() not in mark:
                    c = next(free, None)
                    if c is None:
                        raise TokenizerError("a message uses every private-use character: "
                                             "cannot render it safely")
                    mark[m.group()], back[ord(c)] = c, m.group()
                return mark[m.group()]
            return control_re.sub(swap, text)

        def masked_message(m):
            if isinstance(m, dict) and isinstance(m.get('content'), str):
                return {**m, 'content': masked(m['content'])}
            return m
        msgs = [masked_message(m) for m in messages]
        text = render_chat_template(self.template, msgs, add_generation_prompt, self.template_file,
                                    **{**self.template_vars, **kwargs})
        swapped = re.compile('([' + ''.join(map(re.escape, mark.values())) + '])') if mark else None

        def encode_stretch(stretch, where):  # (a swapped string and what follows it: inside the text)
            if swapped is None:
                return self.encode(stretch, where)
            pieces = [piece for piece in swapped.split(stretch) if piece]
            return [i for k, piece in enumerate(pieces)
                    for i in self.encode(piece.translate(back), where if k == 0 else 'inside')]
        ids, pos = [], 0
        for m in self._special_re.finditer(text):
            ids += encode_stretch(text[pos:m.start()], 'start' if pos == 0 else 'special') + [self.special[m.group()]]
            pos = m.end()
        return ids + encode_stretch(text[pos:], 'start' if pos == 0 else 'special')

    def save(self, out_dir):
        """Write HF tokenizer files: the originals when loaded from a snapshot, else a generated
        tokenizer.json."""
        os.makedirs(out_dir, exist_ok=True)
        files = self.files or byte_tokenizer_files(self)
        for name, data in files.items():
            with open(os.path.join(out_dir, name), 'wb') as f:
                f.write(data)


def _read(path, what):
    try:
        with open(path, 'rb') as f:
            raw = f.read()
        return raw, json.loads(raw) if path.endswith('.json') else raw.decode('utf-8')
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}: cannot read {what}: {e}") from None


def _raise(msg):  # what chat templates call to refuse a conversation
    raise ValueError(msg)


def _generation_tag():
    """The jinja2 extension for TRL's `{% generation %}` ... `{% endgeneration %}` markers, which
    transformers accepts (its AssistantTracker): they only mark an assistant span, so the body is
    rendered in place and the markers write nothing. (jinja2 takes extensions as classes only.)"""
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {'generation'}

        def parse(self, parser):
            next(parser.stream)  # the `generation` name
            return parser.parse_statements(('name:endgeneration',), drop_needle=True)
    return Generation


# the day every chat template's strftime_now prints (Llama 3.2's and SmolLM3's "Today Date"): a
# datetime.date pinned by pin_template_date, or None: today, by the clock
TEMPLATE_DATE = None


def pin_template_date(text, knob='--chat_date'):
    """From here on, in this process, chat templates print the day text ('YYYY-MM-DD') as today:
    a run's prompts stay the same from one day to the next (its resume, its export evaluated
    later). Returns the date; one ValueError naming the knob for anything but such a date."""
    global TEMPLATE_DATE
    if not (isinstance(text, str) and re.fullmatch(r'\d{4}-\d{2}-\d{2}', text)):
        raise TokenizerError(f"{knob}={text!r}: a day as 'YYYY-MM-DD', e.g. '2026-11-28'")
    try:
        TEMPLATE_DATE = datetime.date.fromisoformat(text)
    except ValueError:
        raise TokenizerError(f"{knob}={text!r}: no such day") from None
    return TEMPLATE_DATE


def prints_date(tok):
    """Whether tok's chat template prints the day (a user turn rendered on two days differs)."""
    global TEMPLATE_DATE
    if tok.template is None:
        return False
    kept, seen = TEMPLATE_DATE, set()
    try:
        for day in (datetime.date(2001, 2, 3), datetime.date(2002, 4, 5)):
            TEMPLATE_DATE = day
            seen.add(tuple(tok.render_chat([{'role': 'user', 'content': 'x'}])))
    except TokenizerError:  # a template that wants more than one user turn: not probed
        return False
    finally:
        TEMPLATE_DATE = kept
    return len(seen) > 1


def compile_chat_template(source, where):
    """A chat template compiled as transformers compiles it: jinja2's immutable sandbox (a template
    from a download cannot reach Python internals, the OS or mutate its arguments),
    trim_blocks/lstrip_blocks, loop controls, the `{% generation %}` markers, raise_exception,
    tojson and strftime_now. Its literal_text: the text in it, for Tokenizer._control_re."""
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # jinja2 comes with torch
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=['jinja2.ext.loopcontrols', _generation_tag()])

    def tojson(x, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=False, indent=indent, separators=separators,
                          sort_keys=sort_keys)
    env.filters['tojson'] = tojson
    env.globals['raise_exception'] = _raise

    def strftime_now(fmt):  # transformers': the clock's now; here the pinned day, if any
        day = TEMPLATE_DATE
        now = datetime.datetime.now() if day is None else datetime.datetime.combine(day, datetime.time())
        return now.strftime(fmt)
    env.globals['strftime_now'] = strftime_now
    try:
        template, tree = env.from_string(source), env.parse(source)
    except Exception as e:
        raise TokenizerError(f"{where}: field 'chat_template' does not compile "
                             f"({type(e).__name__}: {e})") from None
    # its literal text and string constants, where transformers looks for the added tokens it writes
    # (_get_template_literal_text), joined by NULs so that no token matches across two of them
    literals = {n.data for n in tree.find_all(nodes.TemplateData)}
    template.literal_text = '\0'.join(literals | {n.value for n in tree.find_all(nodes.Const)
                                                  if isinstance(n.value, str)})
    return template


def render_chat_template(template, messages, add_generation_prompt, where, **variables):
    """The text of messages through a compiled chat template, with transformers' variables
    (messages, add_generation_prompt, tools and documents (None unless given, as transformers
    always passes them: `tools is defined` holds and `tools is not none` does not fail), bos_token,
    eos_token, ... and any template kwargs such as enable_thinking). Anything the template raises,
    including the sandbox's SecurityError, becomes one ValueError naming the file."""
    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **{'tools': None, 'documents': None, **variables})
    except Exception as e:
        raise TokenizerError(f"{where}: field 'chat_template' fails to render "
                             f"({type(e).__name__}: {e})") from None


RENDER_ARGS = ('messages', 'add_generation_prompt', 'tools', 'documents')  # set per render


def set_chat_template(tok, source, knob='chat_template'):
    """Make tok render every prompt with another chat template than its snapshot's: source is the
    template (jinja, as transformers takes it) or the path of a file holding one; '' changes nothing.
    Its export (save) carries it as chat_template.jinja, the snapshot's own dropped from
    tokenizer_config.json, so transformers, vLLM and sample.py render as the run did. A template
    that does not compile, or a file that cannot be read, is one TokenizerError."""
    if not source:
        return tok
    if not isinstance(source, str):
        raise TokenizerError(f"{knob}: expected a jinja template or the path of a file holding one, "
                             f"got {type(source).__name__} {source!r}")
    where = knob
    if os.path.isfile(source) or source.endswith('.jinja'):
        where = source
        source = _read(source, 'a chat template')[1]
    tok.template, tok.template_file = compile_chat_template(source, where), where
    files = dict(tok.files or byte_tokenizer_files(tok))
    if 'tokenizer_config.json' in files:
        conf = json.loads(files['tokenizer_config.json'])
        conf.pop('chat_template', None)
        files['tokenizer_config.json'] = json.dumps(conf, indent=2, ensure_ascii=False).encode()
    files['chat_template.jinja'] = source.encode()
    tok.files = files
    return tok


def set_chat_template_kwargs(tok, kwargs, knob='chat_template_kwargs'):
    """Make every render of tok (prompts, tool probes, tool answers) pass kwargs to its chat
    template, as transformers' apply_chat_template(..., **kwargs) does: Qwen3's
    {'enable_thinking': False}, for one. They override the snapshot's bos_token, eos_token, ... as
    transformers' do. A non-dict, a key that is not a name or is set per render, or kwargs for a
    tokenizer without a template is one ValueError naming the knob."""
    if not isinstance(kwargs, dict):
        raise TokenizerError(f"{knob}: expected a dict of template variables, e.g. "
                             f"{{'enable_thinking': False}}, got {type(kwargs).__name__} {kwargs!r}")
    for k in kwargs:
        if not isinstance(k, str) or not k.isidentifier() or k in RENDER_ARGS:
            raise TokenizerError(f"{knob}: key {k!r} is not a template variable it can set "
                                 f"(a name, not one of {', '.join(RENDER_ARGS)})")
    if kwargs and tok.template is None:
        raise TokenizerError(f"{knob}={kwargs!r}: the tokenizer has no chat template to pass "
                             "them to")
    tok.template_vars = {**tok.template_vars, **kwargs}
    return tok


def vocabulary_mismatch(a, b):
    """Where two tokenizers' ids stop meaning the same text, in words (None: every id is the same
    bytes or the same special token in both): a teacher scores the policy's ids as its own. The
    split rules and templates may differ; the ids may not (Qwen2.5's 0.5B and 7B tokenizers
    agree, their models' padded vocabularies aside)."""
    if a.vocab_size != b.vocab_size:
        return f"{a.vocab_size} ids against {b.vocab_size}"
    if a.special != b.special:
        diff = sorted(set(a.special.items()) ^ set(b.special.items()), key=lambda kv: kv[1])
        return f"special tokens differ, first at id {diff[0][1]} ({diff[0][0]!r})"
    ids_a, ids_b = (getattr(x.enc, 'id_bytes', None) or {i: t for t, i in x.enc._mergeable_ranks.items()}
                    for x in (a, b))
    if ids_a != ids_b:
        bad = min(i for i in ids_a.keys() | ids_b.keys() if ids_a.get(i) != ids_b.get(i))
        return f"id {bad} is {ids_a.get(bad)!r} in one and {ids_b.get(bad)!r} in the other"
    return None


def _chat_template(path, files):
    """(compiled template or None, its file, its variables) as transformers finds them:
    chat_template.jinja, else tokenizer_config.json's 'chat_template' (a list of named templates:
    'default')."""
    conf = files.get('tokenizer_config.json', (None, {}))[1]
    named = {**files.get('special_tokens_map.json', (None, {}))[1], **conf}
    # bos_token, eos_token, ...
    variables = {k: v for k, v in _token_names(named).items() if isinstance(v, str)}
    if 'chat_template.jinja' in files:
        source, where = files['chat_template.jinja'][1], os.path.join(path, 'chat_template.jinja')
    else:
        source, where = conf.get('chat_template'), os.path.join(path, 'tokenizer_config.json')
    if isinstance(source, list):
        source = {t.get('name'): t.get('template') for t in source}.get('default')
    return (compile_chat_template(source, where) if source else None), where, variables


def _token_names(named):
    """The *_token entries of a tokenizer config, each a string (or a dict holding it as
    'content')."""
    names = {}
    for k, v in named.items():
        if k.endswith('_token'):
            names[k] = v.get('content') if isinstance(v, dict) else v
    return names


def load_tokenizer(path):
    """Build a tiktoken Encoding from tokenizer.json (a byte-level BPE, or a sentencepiece-style one:
    SentencePieceBPE), or from vocab.json + merges.txt (+ tokenizer_config.json), with the
    snapshot's chat template when it has one."""
    files = {}
    for name in ('tokenizer.json', 'tokenizer_config.json', 'vocab.json', 'merges.txt',
                 'special_tokens_map.json', 'added_tokens.json', 'chat_template.jinja'):
        if os.path.isfile(os.path.join(path, name)):
            files[name] = _read(os.path.join(path, name), name)
    if 'tokenizer.json' in files:
        spec = files['tokenizer.json'][1]
        src = os.path.join(path, 'tokenizer.json')
        model = spec.get('model') or {}
        if model.get('type') != 'BPE' or 'vocab' not in model:
            raise TokenizerError(f"{src}: only byte-level BPE tokenizers are supported "
                                 f"(model.type={model.get('type')!r})")
        vocab, merges = model['vocab'], model.get('merges', [])
        merges = [m.split(' ') if isinstance(m, str) else m for m in merges]
        added = {t['content']: t['id'] for t in spec.get('added_tokens', [])}
        conf = files.get('tokenizer_config.json', (None, {}))[1]
        prefix = sentencepiece_prefix(spec, conf, _model_type(path), src)
        if prefix is not None:
            enc = SentencePieceBPE(os.path.basename(os.path.abspath(path)), vocab, merges, added, prefix, src)
            return _tokenizer(path, files, enc, eos=None)
        pattern, nfc, eos = *_pattern_from_spec(spec, src), None
    elif 'vocab.json' in files and 'merges.txt' in files:
        src = os.path.join(path, 'vocab.json')
        vocab = files['vocab.json'][1]
        lines = files['merges.txt'][1].splitlines()
        merges = [line.split(' ') for line in lines if line and not line.startswith('#version')]
        conf = files.get('tokenizer_config.json', (None, {}))[1]
        added = {t['content']: int(i) for i, t in conf.get('added_tokens_decoder', {}).items()}
        added.update(files.get('added_tokens.json', (None, {}))[1])
        # the old GPT-2 layout names its specials only as bos/eos/unk (here or in
        # special_tokens_map.json), and they sit in vocab.json: without this, '<|endoftext|>' is
        # ordinary text and generation never stops
        named = {**files.get('special_tokens_map.json', (None, {}))[1], **conf}
        names = _token_names(named)
        added.update({t: vocab[t] for t in names.values()
                      if isinstance(t, str) and t in vocab and t not in added})
        qwen = 'qwen' in str(conf.get('tokenizer_class', '')).lower()
        pattern, nfc = (QWEN2_PATTERN, True) if qwen else (GPT2_PATTERN, False)
        # Qwen2's eos stays its ChatML turn end, as for tokenizer.json
        eos = None if qwen else names.get('eos_token')
    else:
        raise TokenizerError(f"{path}: no tokenizer files "
                             "(expected tokenizer.json, or vocab.json and merges.txt)")
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    try:
        ranks = {bytes(byte_of[c] for c in tok): i for tok, i in vocab.items() if tok not in added}
    except KeyError as e:
        raise TokenizerError(f"{src}: vocab entry uses character {e} outside the byte-level "
                             "alphabet") from None
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"{src}: vocab lacks {len(missing)} of the 256 single bytes "
                             f"(e.g. byte {missing[0]}); not a byte-level BPE")
    last = -1
    # tiktoken applies merges in rank order: ranks must follow merge order
    for k, (a, b) in enumerate(merges):
        rank = vocab.get(a + b)
        if rank is None or rank <= last:
            raise TokenizerError(f"{src}: merge #{k} ({a!r} {b!r}) does not create tokens in "
                                 "increasing id order; tiktoken cannot reproduce this BPE")
        last = rank
    enc = tiktoken.Encoding(name=os.path.basename(os.path.abspath(path)), pat_str=pattern,
                            mergeable_ranks=ranks, special_tokens=dict(added))
    return _tokenizer(path, files, enc, eos, nfc)


def _model_type(path):
    """config.json's model_type beside the tokenizer files (AutoTokenizer picks its class by it), or
    None."""
    config = os.path.join(path, 'config.json')
    return _read(config, 'config.json')[1].get('model_type') if os.path.isfile(config) else None


def _tokenizer(path, files, enc, eos, nfc=False):
    """The Tokenizer of a snapshot's encoding, with its chat template, turn end and stops."""
    specials = enc._special_tokens
    template, where, variables = _chat_template(path, files)
    raw_files = {n: raw for n, (raw, _) in files.items()}
    named_eos = variables.get('eos_token')  # tokenizer_config.json's (special_tokens_map.json's)
    if eos is None and not {'<|im_end|>', '<|endoftext|>'} & set(specials):
        eos = named_eos  # neither ChatML's turn end nor GPT-2's text end (Llama 3, Llama 2)
    control, from_template = _control_tokens(files, specials)
    return Tokenizer(enc, nfc=nfc, files=raw_files, eos=eos, template=template,
                     template_file=where, template_vars=variables,
                     stops=_stop_ids(path, named_eos, specials), control=control,
                     control_from_template=from_template)


def _control_tokens(files, specials):
    """(the added tokens transformers marks special, whether the chat template's text adds its own):
    those flagged special in tokenizer.json or tokenizer_config.json, those the config names
    (eos_token, additional_special_tokens, ...: transformers makes them special) and any without a
    flag; with the config's chat_control_tokens, those too, and not the template's."""
    conf = files.get('tokenizer_config.json', (None, {}))[1]
    flagged = [t for t in [*files.get('tokenizer.json', (None, {}))[1].get('added_tokens', []),
                           *conf.get('added_tokens_decoder', {}).values()] if isinstance(t, dict)]
    special = {t.get('content') for t in flagged if t.get('special')}
    plain = {t.get('content') for t in flagged if t.get('special') is False}
    named = {**files.get('special_tokens_map.json', (None, {}))[1], **conf}
    names = set(_token_names(named).values())
    for key in ('additional_special_tokens', 'extra_special_tokens'):
        extra = named.get(key) or []
        for v in (extra.values() if isinstance(extra, dict) else extra):
            names.add(v.get('content') if isinstance(v, dict) else v)
    control = {t for t in specials if t in special or t in names or t not in plain}
    listed = conf.get('chat_control_tokens')
    if isinstance(listed, list):
        return control | {t for t in listed if isinstance(t, str)}, False
    return control, True


# transformers 5's LlamaTokenizer builds a sentencepiece-style BPE's steps itself, from the config's
# legacy and add_prefix_space, for the snapshots that name it (Llama 2, TinyLlama, Vicuna, ...) except
# where the model's type sends AutoTokenizer to the file's own steps (TokenizersBackend): Mistral's
# (its MistralCommonBackend when mistral_common is installed, which is not read here) and Phi-3's.
# Its GemmaTokenizer (Gemma 3) puts no space before the text (its Split at ' ' comes after the
# normalizer has replaced every space: it never splits)
SENTENCEPIECE_CLASS, GEMMA_CLASS = 'LlamaTokenizer', 'GemmaTokenizer'
FILE_STEPS_TYPES = ('mistral', 'phi3')
LEGACY_NORMALIZER = [{'type': 'Prepend', 'prepend': '▁'}, {'type': 'Replace', 'pattern': {'String': ' '},
                                                             'content': '▁'}]


def sentencepiece_prefix(spec, conf, model_type, src):
    """None for a byte-level BPE; for a sentencepiece-style one (byte_fallback, '▁' pieces), where
    transformers' AutoTokenizer puts a space before the text (SentencePieceBPE's prefix).
    GemmaTokenizer's: 'never'. LlamaTokenizer's (SENTENCEPIECE_CLASS, model_type not in
    FILE_STEPS_TYPES): 'never' when add_prefix_space is false, else 'always' when legacy is true,
    else 'first'. Else the file's steps: a Metaspace pre-tokenizer with split false gives its
    prepend_scheme, Llama 2's legacy normalizer (Prepend '▁', Replace ' ') 'prepend', a Replace
    alone 'never'. Anything else: one TokenizerError."""
    model = spec.get('model') or {}
    if not model.get('byte_fallback') or not any('▁' in p for p in model.get('vocab', {})):
        return None
    named = str(conf.get('tokenizer_class')).removesuffix('Fast')
    if named == GEMMA_CLASS:
        return 'never'
    if named == SENTENCEPIECE_CLASS and model_type not in FILE_STEPS_TYPES:
        if conf.get('add_prefix_space') is False:
            return 'never'
        return 'always' if conf.get('legacy') else 'first'
    norm, pre = spec.get('normalizer') or {}, spec.get('pre_tokenizer') or {}
    steps = norm.get('normalizers', [norm]) if norm.get('type') == 'Sequence' else [norm] if norm else []
    if not norm and pre.get('type') == 'Metaspace' and pre.get('split') is False:
        return pre.get('prepend_scheme', 'always')
    if not pre and steps in (LEGACY_NORMALIZER, LEGACY_NORMALIZER[1:]):
        return 'prepend' if len(steps) == 2 else 'never'
    split = f" split {pre.get('split')!r}" if pre else ''
    raise TokenizerError(f"{src}: this sentencepiece-style tokenizer's steps are not supported (normalizer "
                         f"{norm.get('type')!r}, pre_tokenizer {pre.get('type')!r}{split}): read are a Metaspace "
                         "pre-tokenizer with split false, Llama 2's normalizer (Prepend, Replace), or "
                         "LlamaTokenizer's own (tokenizer_config.json's tokenizer_class)")


def _stop_ids(path, named_eos, specials):
    """The turn ends a snapshot names beside its tokenizer's own: generation_config.json's
    eos_token_id (an id or a list) and the tokenizer config's eos_token (named_eos), where they
    are specials."""
    ids = set()
    gen = os.path.join(path, 'generation_config.json')
    if os.path.isfile(gen):
        named = _read(gen, 'generation_config.json')[1].get('eos_token_id')
        ids.update(i for i in (named if isinstance(named, list) else [named])
                   if isinstance(i, int))
    if named_eos in specials:
        ids.add(specials[named_eos])
    return ids & set(specials.values())


def _pattern_from_spec(spec, src):
    """The split regex (and NFC flag) from tokenizer.json's pre_tokenizer/normalizer."""
    norm = spec.get('normalizer') or {}
    nested = norm.get('normalizers', [])
    nfc = norm.get('type') == 'NFC' or any(n.get('type') == 'NFC' for n in nested)
    pre = spec.get('pre_tokenizer') or {}
    steps = pre.get('pretokenizers', [pre]) if pre.get('type') == 'Sequence' else [pre]
    pattern = None
    splits = [step for step in steps if step.get('type') == 'Split']
    if len(splits) > 1:  # each splits the pieces of the one before: not one tiktoken pattern
        raise TokenizerError(f"{src}: {len(splits)} Split steps in pre_tokenizer are not supported "
                             "(tiktoken applies one split pattern)")
    for step in steps:
        if step.get('type') == 'Split':
            pattern = step['pattern'].get('Regex') or step['pattern'].get('String')
        elif step.get('type') == 'ByteLevel':
            if step.get('add_prefix_space'):
                raise TokenizerError(f"{src}: ByteLevel add_prefix_space=true is not supported")
            if step.get('use_regex', True) and pattern is None:
                pattern = GPT2_PATTERN
        elif step.get('type') == 'Metaspace':
            raise TokenizerError(f"{src}: pre_tokenizer Metaspace without byte_fallback is not supported "
                                 "(sentencepiece-style tokenizers fall back to <0xXX> byte tokens)")
        elif step:
            raise TokenizerError(f"{src}: unsupported pre_tokenizer step {step.get('type')!r}")
    if pattern is None:
        raise TokenizerError(f"{src}: no pre-tokenizer split pattern found")
    return pattern, nfc


BYTE_SPECIALS = ['<|endoftext|>', '<|im_start|>', '<|im_end|>', '<|pad|>']


def byte_tokenizer():
    """256 byte tokens (id = byte value) and four specials: for scratch models, no files needed."""
    enc = tiktoken.Encoding(name='bytes', pat_str=GPT2_PATTERN,
                            mergeable_ranks={bytes([b]): b for b in range(256)},
                            special_tokens={t: 256 + i for i, t in enumerate(BYTE_SPECIALS)})
    return Tokenizer(enc)


def byte_tokenizer_files(tok):
    """An HF tokenizer.json for a merge-free byte-level encoding, so exported snapshots load in
    transformers."""
    u = bytes_to_unicode()
    singles = ((t[0], r) for t, r in tok.enc._mergeable_ranks.items() if len(t) == 1)
    vocab = {u[b]: r for b, r in singles}
    if len(vocab) != len(tok.enc._mergeable_ranks):
        raise TokenizerError("cannot export a tokenizer with merges that was not loaded from HF "
                             "files")
    added = [{'id': i, 'content': t, 'single_word': False, 'lstrip': False, 'rstrip': False,
              'normalized': False, 'special': True}
             for t, i in sorted(tok.special.items(), key=lambda x: x[1])]
    byte_level = {'type': 'ByteLevel', 'add_prefix_space': False, 'trim_offsets': False,
                  'use_regex': True}
    spec = {
        'version': '1.0', 'truncation': None, 'padding': None,
        'added_tokens': added,
        'normalizer': None,
        'pre_tokenizer': dict(byte_level),
        'post_processor': None,
        'decoder': dict(byte_level),
        'model': {'type': 'BPE', 'dropout': None, 'unk_token': None,
                  'continuing_subword_prefix': None, 'end_of_word_suffix': None, 'fuse_unk': False,
                  'byte_fallback': False, 'ignore_merges': False, 'vocab': vocab, 'merges': []},
    }
    conf = {'tokenizer_class': 'PreTrainedTokenizerFast', 'chat_template': CHATML,
            'eos_token': '<|im_end|>', 'pad_token': '<|pad|>', 'model_max_length': 1 << 20}
    return {'tokenizer.json': json.dumps(spec, ensure_ascii=False).encode(),
            'tokenizer_config.json': json.dumps(conf, indent=2).encode()}
