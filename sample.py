"""
Batched KV-cache generation for groups of samples, and evaluation on GSM8K / the arithmetic task.

    python sample.py --init_from=DIR_OR_HUB_ID --prompt="What is 12*7?"
    python sample.py config/eval_gsm8k.py --init_from=out/gsm8k/hf --num_examples=200 --n_samples=8

generate() prefills each prompt once, shares its KV cache with its G samples, drops finished rows
from the decode batch (compaction), and draws every token from a seed that depends only on (seed,
prompt index, sample index, step): a completion is the same whichever prompts share its batch, so 1
GPU and N GPUs sample alike.
"""
import concurrent.futures
import copy
import functools
import json
import math
import os
import sys
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch

from sample_kernels import sample_tokens

GRAPH_BUCKETS = 4  # generate(graphs=True): decode batch sizes n, n/2, n/4, n/8 (a compile each)
# generate(graphs=True): the static cache's length rounded up to a multiple of this, so that calls
# whose longest prompt differs (a training step's new prompts) reuse the same graphs
GRAPH_LENGTH = 256


def row_seeds(seed, prompt_index, group_size):
    """One 63-bit seed per (prompt, sample): the only source of randomness for that completion."""
    return torch.tensor([((seed * 0x9E3779B97F4A7C15) + p * 1_000_003 + s) & 0x7FFFFFFFFFFFFFFF
                         for p in prompt_index for s in range(group_size)], dtype=torch.int64)


# model -> its torch.compile'd forward, compiled once per process
_compiled = weakref.WeakKeyDictionary()
_graphed = weakref.WeakKeyDictionary()  # model -> its static-shape decode step (graphs=True)
# model -> (the shape they were made for, {batch size: KVCache}) kept across calls (graphs)
_static = weakref.WeakKeyDictionary()


def decode_forward(model, compile):
    """The forward that generate calls, for the prefill and every decode step: the model itself, or
    (compile=True) torch.compile of it with dynamic shapes, so other prompt lengths, the batch
    shrinking under compaction and the cache growing each step do not recompile it (two graphs:
    prefill and decode; generate and generate_with_tools then keep batches of two rows or more,
    as Dynamo compiles a size of 1 apart). Eager decode of a small model is bound by per-op
    overhead (a dispatch per op on CPU, a kernel launch per op on GPU); compiled, each layer's
    norm/rope/cache-write/attention/SwiGLU pointwise work is a few fused kernels."""
    if not compile:
        return model
    if model not in _compiled:
        _compiled[model] = torch.compile(model, dynamic=True)
    return _compiled[model]


def graph_forward(model):
    """The decode step at a fixed shape (a static KV cache, a fixed batch): torch.compile with
    fullgraph and no dynamic shapes, and on CUDA mode='reduce-overhead', which captures the step's
    several hundred kernels as a CUDA graph and replays it with one launch. Each batch size
    compiles (and captures) once: generate(graphs=True) shrinks the batch only to a few sizes."""
    if model not in _graphed:
        mode = 'reduce-overhead' if next(model.parameters()).is_cuda else None
        _graphed[model] = torch.compile(model, mode=mode, fullgraph=True, dynamic=False)
    return _graphed[model]


def buckets(n, count=GRAPH_BUCKETS):
    """The decode batch sizes generate(graphs=True) uses for n rows: n, then halves, count sizes
    at most (one compile each), none below 1."""
    sizes = [n]
    while len(sizes) < count and sizes[-1] > 1:
        sizes.append(-(-sizes[-1] // 2))
    return sizes


def static_caches(model, like, sizes):
    """graphs=True: a static cache for each batch size in sizes, shaped like the cache like and
    kept from call to call (while the sizes and the shape stay), so that each size's graph reads and
    writes the same addresses in every call: captured once a run, not once a call (a CUDA graph
    replays at the addresses it was captured at, and re-records when they move). They stay
    allocated between calls: about 1.9x one cache at the full batch."""
    from model import KVCache
    t = like.k[0]
    shape = (tuple(sizes), like.max_len, t.dtype, t.device)
    kept = _static.get(model)
    if kept is None or kept[0] != shape:
        _static.pop(model, None)  # the old ones go before the new ones are allocated
        kept = shape, {b: KVCache(model.config, b, like.max_len, t.dtype, t.device).make_static()
                       for b in sizes}
        _static[model] = kept
    return kept[1]


def no_refresh():  # the sampler is the trained model itself
    pass


def sampler_model(model, dtype, fsdp):
    """(the sampler, what refreshes it after an update). In fp32 on one process the sampler is the
    model itself (with LoRA its adapters apply unmerged: the very numbers the update computes, no
    second copy) and needs no refresh; otherwise a copy in dtype, its weights cast once per update
    rather than once per decode step (with FSDP always a copy: the trained model holds only this
    rank's shard); with LoRA a plain model of the merged weights (lora.merged_copy)."""
    import lora
    from model import copy_weights
    if dtype == torch.float32 and not fsdp:
        return model, no_refresh
    if lora.adapters(model):
        gen = lora.merged_copy(model, dtype)
        return gen, functools.partial(lora.copy_merged, gen, model)
    gen = copy.deepcopy(model).to(dtype).eval()
    return gen, functools.partial(copy_weights, gen, model)


def prefill(model, tok, prompts, group_size, max_new_tokens, *, compile=False, spare=0,
            round_to=1, repeat=True):
    """Checks the prompts fit, prefills every prompt once (right-padded, per-row lengths) and copies
    its cache for its group_size samples (repeat=False: one row a prompt, for the caller to copy).
    Returns (cache with room for max_new_tokens + spare more positions, its length rounded up to a
    multiple of round_to within the model's max_seq_len, the next-token logits of each sample's
    row, the forward decode steps use)."""
    from model import KVCache
    device = next(model.parameters()).device
    P, G = len(prompts), group_size
    lens = torch.tensor([len(p) for p in prompts], device=device)
    max_len = int(lens.max()) + max_new_tokens
    if max_len > model.config.max_seq_len:
        raise ValueError(f"prompt ({int(lens.max())} tokens) + max_new_tokens ({max_new_tokens}) "
                         f"exceeds the model's max_seq_len {model.config.max_seq_len}{model.config.context_note}")
    if int(lens.min()) == 0:
        raise ValueError("empty prompt: every prompt needs at least one token")
    idx = torch.full((P, int(lens.max())), tok.pad_id, dtype=torch.int64, device=device)
    for i, p in enumerate(prompts):
        idx[i, :len(p)] = torch.tensor(p, device=device)
    length = max(max_len + spare, min(-(-max_len // round_to) * round_to, model.config.max_seq_len))
    cache = KVCache(model.config, P, length, next(model.parameters()).dtype, device)
    forward = decode_forward(model, compile)
    logits = forward(idx, kv_cache=cache, input_lengths=lens, last_only=True)[:, -1]
    if repeat:
        cache = cache.repeat_interleave(G)
    logits = logits.repeat_interleave(G, dim=0)
    return cache, logits, forward


def sampled_count(completion):
    """The tokens the policy sampled in a completion: its ids less any a tool's response inserted
    (generate_with_tools' tool_mask)."""
    return len(completion['ids']) - sum(completion.get('tool_mask', ()))


@torch.no_grad()
def generate(model, tok, prompts, group_size=1, max_new_tokens=256, *, temperature=1.0, top_k=0,
             top_p=1.0, min_p=0.0, seed=0, stop_ids=None, stop_strings=(), prompt_index=None,
             compact=True, compile=False, graphs=False, check_every=0, progress=False,
             on_step=None):
    """prompts: list of token-id lists. Returns len(prompts) * group_size dicts, prompt-major, each
    with ids (completion ids, stop token included), text, logprobs (of each sampled id under the
    full softmax at this temperature), finished (hit a stop) and truncated (hit max_new_tokens).
    compile: the prefill and decode steps run through torch.compile (see decode_forward; the first
    call compiles, seconds to a minute). graphs: decode steps at a fixed shape through graph_forward
    (a CUDA graph on a GPU): the cache attends over all its positions, and compaction shrinks the
    batch only to the sizes of buckets(). check_every: the host reads how many rows are still
    going (a device sync) every check_every steps (0: 8 on CUDA, where a sync stalls the launch
    queue, else 1), and stops or compacts only then; the rows that stopped in between decode on
    unseen (their ends are kept on the device). stop_strings: a completion also ends at the token
    that completes one of these strings, its text cut right after the string (the host reads each
    step's tokens for this). The tokens are the same for any of these settings (each row's draws
    depend on its seed, its step and its logits only). on_step() is called after every decode step
    (the training loop's watchdog heartbeat)."""
    device = next(model.parameters()).device
    if stop_ids is None:
        stop_ids = tok.stop_ids
    stop_ids = torch.tensor(stop_ids, dtype=torch.int64, device=device)
    if prompt_index is None:
        prompt_index = range(len(prompts))
    prompt_index = list(prompt_index)
    P, G = len(prompts), group_size
    cache, logits, forward = prefill(model, tok, prompts, G, max_new_tokens, compile=compile,
                                     round_to=GRAPH_LENGTH if graphs else 1, repeat=not graphs)
    N = P * G
    if graphs:
        # each prompt's row copied straight into its samples' rows of the kept full-batch cache
        sizes = buckets(N)
        forward = graph_forward(model)
        static = static_caches(model, cache, sizes)
        cache = static[N].load_(cache, torch.arange(P, device=device).repeat_interleave(G))
    seeds = row_seeds(seed, prompt_index, G).to(device)
    # every completion's tokens and log-probs, by step. Rows that stopped but are still in the
    # decode batch (before compaction drops them, or with compact=False) keep writing here past
    # their end; n_gen says where each ends.
    out_ids = torch.full((N, max_new_tokens), tok.pad_id, dtype=torch.int64, device=device)
    out_lp = torch.zeros((N, max_new_tokens), dtype=torch.float32, device=device)
    # tokens per completion
    n_gen = torch.full((N,), max_new_tokens, dtype=torch.int64, device=device)
    finished = torch.zeros(N, dtype=torch.bool, device=device)
    # the decode batch: rows[i] is the completion that row i generates (None: the identity, before
    # any compaction); live: still generating; ends: its n_gen so far. Written back to
    # n_gen/finished when rows are dropped and at the end
    rows, row_seed = None, seeds
    live = torch.ones(N, dtype=torch.bool, device=device)
    ends = n_gen.clone()
    check_stops = len(stop_ids) > 0 or bool(stop_strings)
    if stop_strings or not check_every:
        check_every = 8 if device.type == 'cuda' and not stop_strings else 1
    string_stop = stop_string_watch(tok, stop_strings, N)
    n_live, n_tokens, t0, last_print = N, 0, time.time(), time.time()

    def write_back():
        at = slice(None) if rows is None else rows
        n_gen[at], finished[at] = ends, ~live

    for t in range(max_new_tokens):
        ids, lp = sample_tokens(logits, row_seed, t, temperature=temperature, top_k=top_k,
                                top_p=top_p, min_p=min_p)
        if rows is None:
            out_ids[:, t], out_lp[:, t] = ids, lp
        else:
            out_ids[rows, t], out_lp[rows, t] = ids, lp
        n_tokens += n_live
        if check_stops:
            stop = live & torch.isin(ids, stop_ids)
            if stop_strings:
                stop |= live & string_stop(ids, rows)
            ends = torch.where(stop, t + 1, ends)
            live = live & ~stop
            if (t + 1) % check_every == 0:
                n_live = int(live.sum())  # the loop's one read from the device
        if n_live == 0 or t == max_new_tokens - 1:
            break
        # compaction: copying the cache costs, so it is done when a quarter of the rows have
        # finished; with graphs, to the smallest bucket that holds the rows still going (finished
        # rows fill the rest)
        target = n_live if n_live <= 0.75 * len(live) else None
        if graphs:
            target = min((b for b in sizes if n_live <= b < len(live)), default=None)
        elif compile and target is not None:  # never to one row: Dynamo compiles a size of 1
            target = max(target, 2) if len(live) > 2 else None  # apart (a graph more to build)
        if compact and target is not None:
            write_back()
            keep = live.nonzero().flatten()
            if graphs or compile:
                keep = torch.cat([keep, (~live).nonzero().flatten()])[:target]
            rows = keep if rows is None else rows[keep]
            cache = static[target].load_(cache, keep) if graphs else cache.select(keep)
            ids, live, ends = ids[keep], live[keep], ends[keep]
            row_seed = seeds[rows]
        if graphs and device.type == 'cuda':
            # a new replay: the last one's logits (read above) may now be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        logits = forward(ids[:, None], kv_cache=cache)[:, -1]
        if on_step is not None:
            on_step()
        if progress and time.time() - last_print > 5:
            last_print = time.time()
            print(f"  gen: step {t + 1}/{max_new_tokens}, rows alive {n_live}/{N}, "
                  f"{n_tokens / (last_print - t0):.0f} tok/s", file=sys.stderr, flush=True)
    write_back()
    results, stop_set = [], set(stop_ids.tolist())
    columns = zip(out_ids.tolist(), out_lp.tolist(), n_gen.tolist(), finished.tolist())
    for r, (ids, lps, n, fin) in enumerate(columns):
        ids = ids[:n]
        text_ids = ids[:-1] if fin and ids and ids[-1] in stop_set else ids
        text = tok.decode(text_ids)
        # the text ends with the first stop string in it; the ids keep the token that completed it
        ends_at = [text.find(s) + len(s) for s in stop_strings if s in text]
        text = text[:min(ends_at)] if ends_at else text
        results.append(dict(prompt_idx=prompt_index[r // G], sample_idx=r % G, ids=ids, text=text,
                            logprobs=lps[:n], finished=fin, truncated=not fin))
    return results


def stop_string_watch(tok, stop_strings, n):
    """For generate's n completions: a function (ids (B,) of this step's tokens, rows: the completion
    each of the B decode rows holds, None: row i holds completion i) -> (B,) bool, the rows whose
    text now contains one of stop_strings for the first time. Each completion keeps the last bytes
    it wrote (one byte fewer than the longest string), so a string that spans tokens is seen."""
    wanted = [s.encode() for s in stop_strings]
    keep = max(map(len, wanted), default=1) - 1
    tails = [b''] * n
    piece = {}  # token id -> its bytes

    def hits(ids, rows):
        out = []
        owners = range(len(ids)) if rows is None else rows.tolist()
        for r, i in zip(owners, ids.tolist()):
            if i not in piece:
                piece[i] = tok.token_bytes(i)
            tail = tails[r] + piece[i]
            out.append(any(w in tail for w in wanted))
            tails[r] = tail[-keep:] if keep else b''
        return torch.tensor(out, dtype=torch.bool, device=ids.device)
    return hits


def tool_settings(task, max_tool_calls=None, tool_timeout=5.0, tool_delay_steps=1):
    """How rollouts of task call its tools, as the one value sample_batch and evaluate take: the
    tools and their style (the task's), the calls per completion (max_tool_calls, None: the
    task's), the time limit and the delay (generate_with_tools), and the task's respond hook with
    its max_turns; None for a task without tools or respond."""
    import tasks
    tools, style = tasks.tools_of(task)
    respond = getattr(task, 'respond', None)
    if not tools and respond is None:
        return None
    return dict(tools=tools or {}, tool_style=style or 'fenced', tool_timeout=tool_timeout,
                max_tool_calls=tasks.tool_call_limit(task, max_tool_calls),
                tool_delay_steps=tool_delay_steps, respond=respond,
                max_turns=getattr(task, 'max_turns', 4))


def sample_batch(model, tok, prompts, group_size, max_new_tokens, *, tools=None, graphs=False,
                 check_every=0, progress=False, states=None, **sampling):
    """The one way to roll out: group_size completions of each prompt through generate, or, given
    tools (tool_settings' value), through generate_with_tools (with states, its rollouts' states:
    tasks.rollout_states). graphs, check_every and progress are generate's: a rollout with tools
    pauses rows for their calls in a loop of its own."""
    if states is not None and tools is None:
        raise ValueError("rollout states are for the tools of a task's rollouts; this rollout has none")
    if tools is None:
        return generate(model, tok, prompts, group_size, max_new_tokens, graphs=graphs,
                        check_every=check_every, progress=progress, **sampling)
    if graphs or sampling.pop('stop_strings', None):
        raise ValueError(f"{'graphs=True' if graphs else 'stop_strings'}: rollouts without tools only")
    return generate_with_tools(model, tok, prompts, group_size, max_new_tokens, **tools, states=states,
                               **sampling)


@dataclass
class ToolRow:
    """A completion of a rollout with tools, on the host: its ids so far (sampled and inserted),
    their log-probs, which were inserted (mask 1), where its current turn began, how many tokens
    it sampled, its calls' results, and how it stands."""
    ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    mask: list = field(default_factory=list)
    turn_start: int = 0
    n_sampled: int = 0
    calls: list = field(default_factory=list)
    turns: int = 0  # user turns the task's respond added
    done: bool = False
    finished: bool = False
    turn_limit: bool = False

    def add(self, ids, logprobs, inserted):
        self.ids += ids
        self.logprobs += logprobs
        self.mask += [int(inserted)] * len(ids)


def closed_turn(row, token, tok, tools, tool_style, stop_set):
    """The text of row's turn if token (just appended) closes a call in it, else None: a turn
    style's stop token after a parsable call, or a fenced ```name block's closing fence."""
    import tool_calls
    if tool_style in tool_calls.TURN_STYLES:
        if token not in stop_set:
            return None
        turn = tok.decode(row.ids[row.turn_start:-1])
        return turn if tool_calls.parse_calls(turn, tool_style) else None
    if '`' not in tok.decode([token]):
        return None
    turn = tok.decode(row.ids[row.turn_start:])
    return turn if tool_calls.call_closed(turn, 'fenced', names=tools) else None


def answer_ids(row, results, tok, answer, tool_style):
    """The ids inserted after row's call: the chat template's answer (answer, turn styles), or the
    results' fenced text on a line of its own."""
    import tool_calls
    if answer is not None:
        return answer(results)
    text = tool_calls.response_text(results, tool_style)
    if not tok.decode(row.ids[-1:]).endswith('\n'):
        text = '\n' + text
    return tok.encode(text, 'inside')  # (it continues the row: no sentencepiece space before it)


def prefill_rows(forward, cache, chunks, where, extent, pad_id, *, min_rows=1):
    """One right-padded forward of chunks {row: ids} through a window of their rows' caches of
    extent positions (their own lengths bound what each attends to; a pad may run past the cache's
    end), copied back. where: row -> its index in the cache. min_rows: a lone row goes through
    twice, as two rows (a compiled forward: Dynamo compiles a batch of 1 apart); both write the
    same values back. Returns {row: next-token logits}."""
    rows = list(chunks)
    rows += rows[:1] * (min_rows - len(rows))
    device = cache.lengths.device
    at = torch.tensor([where[r] for r in rows], device=device)
    lens = torch.tensor([len(chunks[r]) for r in rows], device=device)
    feed = torch.full((len(rows), int(lens.max())), pad_id, dtype=torch.int64, device=device)
    for i, r in enumerate(rows):
        feed[i, :len(chunks[r])] = torch.tensor(chunks[r], device=device)
    sub = cache.window(at, extent + feed.shape[1])
    sub.extent = extent
    new = forward(feed, kv_cache=sub, input_lengths=lens, last_only=True)[:, -1]
    cache.put_window(at, sub)
    return dict(zip(rows, new))


def wait_for(futures, on_step):
    """Wait for a call's futures (on_step every second meanwhile); returns the seconds waited."""
    import concurrent.futures
    t0 = time.time()
    while not all(f.done() for f in futures):
        concurrent.futures.wait(futures, timeout=1.0)
        if on_step is not None:
            on_step()
    return time.time() - t0


@torch.no_grad()
def generate_with_tools(model, tok, prompts, group_size=1, max_new_tokens=256, *, tools,
                        tool_style='fenced', max_tool_calls=4, tool_timeout=5.0, temperature=1.0,
                        top_k=0, top_p=1.0, min_p=0.0, seed=0, stop_ids=None, prompt_index=None,
                        tool_delay_steps=1, compact=True, compile=False, on_step=None, states=None,
                        respond=None, max_turns=4):
    """generate() for rollouts that call tools (tools: {name: function}, tool_calls.py). A row whose
    turn closes a call pauses: tool_style 'fenced', at the closing fence of a ```name block starting
    a line; 'hermes' and 'json', at the stop token ending a turn of calls. Its calls run in a thread
    pool while the other rows keep decoding. tool_delay_steps decode steps after the call closed,
    the response's tokens (fenced: tool_calls.response_text encoded on its own; hermes and json: the
    chat template's delta, tool_calls.template_answers; sampled tokens are never encoded again) are
    prefilled into that row's own KV cache as one chunk, with the token that closed the call in
    front, in one batched forward with the other rows due at that step, and the row goes on. A tool
    still running then is waited for (tool_wait_s adds up those waits): so which rows are prefilled
    together, and with them every float, does not depend on how long tools took, and a rollout with
    deterministic tools reproduces exactly (raise tool_delay_steps for slow tools). Token in, token
    out: a completion's ids are its sampled ids and the inserted ids, in order; tool_mask marks the
    inserted ones (1), whose logprobs are 0. max_new_tokens counts both; a response that leaves no
    room for a sampled token after it ends the row (truncated), not inserted; a call past
    max_tool_calls is not run and ends the row (turn_limit). Each row draws its k-th sampled token
    with step k of its own seed. A paused row stays in the decode batch, fed no token; finished
    rows are dropped from it when a quarter of it has finished (compact, as in generate()).
    states: a state per row (row i*G + g: prompt i's g-th) for tools that take one, back as
    'state'. respond(turn, state), on the pool when a turn ends with a stop and no call: a str goes
    in as a user turn (tool_calls.user_turns), None ends the row, as does a stop after max_turns
    user turns."""
    import tool_calls
    answer = None  # hermes, json: results -> the chat template's ids answering them
    user_turn = respond and tool_calls.user_turns(tok)  # text -> the ids of a user turn
    if tool_style in tool_calls.TURN_STYLES:
        answer = tool_calls.template_answers(tok, tools, tool_style)
    elif tool_style != 'fenced':
        raise ValueError(f"unknown tool_style {tool_style!r} (styles: {tool_calls.STYLES})")
    device = next(model.parameters()).device
    stop_set = set(tok.stop_ids if stop_ids is None else stop_ids)
    prompt_index = list(range(len(prompts)) if prompt_index is None else prompt_index)
    G, N = group_size, len(prompts) * group_size
    # one spare position: a row that has used its whole budget is still fed a pad (length 0)
    cache, logits, forward = prefill(model, tok, prompts, G, max_new_tokens, compile=compile,
                                     spare=1)
    seeds = row_seeds(seed, prompt_index, G).to(device)
    prompt_len = [len(prompts[r // G]) for r in range(N)]
    rows = [ToolRow() for _ in range(N)]
    paused = {}  # row -> (the token that closed its call, the futures of its calls, due step)
    responding = set()  # the paused rows whose future is respond's, not calls'
    # a thread per call that may run at once: N rows whose tools all hang wait one tool_timeout together
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, N * (max_tool_calls + 1)))
    step, waited = 0, 0.0  # decode steps so far; seconds spent waiting for late tools

    def after_sampling(r, token, turn):
        """Where row r goes after sampling token: paused for its calls, done, or on (True)."""
        row, state = rows[r], None if states is None else states[r]
        if turn is not None and len(row.ids) >= max_new_tokens:
            row.done = True  # no room left for the answer: the calls are not run
        elif turn is not None:
            parsed = tool_calls.parse_calls(turn, tool_style, names=tools)
            if len(row.calls) + len(parsed) > max_tool_calls:
                row.done = row.turn_limit = True
            else:
                futures = tool_calls.start_calls(parsed, tools, tool_timeout, pool, state=state)
                paused[r] = (token, futures, step + tool_delay_steps)
        elif token in stop_set and respond is not None and row.turns < max_turns:
            turn = tok.decode(row.ids[row.turn_start:-1])
            paused[r] = (token, [pool.submit(respond, turn, state)], step + tool_delay_steps)
            responding.add(r)
        elif token in stop_set:
            row.done = row.finished = True
        elif len(row.ids) >= max_new_tokens:
            row.done = True
        else:
            return True
        return False

    def resume(due):
        """Insert the answers of the due rows' calls after the token that closed each one's call,
        in one batched forward. Returns {row: next-token logits}."""
        nonlocal waited
        chunks = {}
        for r in due:
            token, futures, _ = paused.pop(r)
            waited += wait_for(futures, on_step)
            results = [f.result() for f in futures]
            inserted = turn_answer(rows[r], results, r in responding, tok, answer=answer,
                                   user_turn=user_turn, tool_style=tool_style)
            responding.discard(r)
            if inserted is None:  # the task's respond ended the rollout
                rows[r].done = rows[r].finished = True
            elif len(rows[r].ids) + len(inserted) >= max_new_tokens:
                rows[r].done = True  # no room for the response and a token after it: truncated
            else:
                rows[r].add(inserted, [0.0] * len(inserted), inserted=True)
                rows[r].turn_start = len(rows[r].ids)
                chunks[r] = [token] + inserted
        if not chunks:
            return {}
        extent = max(prompt_len[r] + len(rows[r].ids) - len(chunks[r]) for r in chunks)
        return prefill_rows(forward, cache, chunks, where, extent, tok.pad_id, min_rows=1 + compile)

    # the decode batch: batch[i] is the completion that the cache's and logits' row i holds, and
    # where[r] that row for completion r
    batch = list(range(N))
    where = {r: r for r in batch}
    try:
        while not all(row.done for row in rows):
            active = [r for r in batch if not rows[r].done and r not in paused]
            feed = torch.full((len(batch), 1), tok.pad_id, dtype=torch.int64, device=device)
            fed = torch.zeros(len(batch), dtype=torch.long, device=device)
            if active:
                at = torch.tensor([where[r] for r in active], device=device)
                steps = torch.tensor([rows[r].n_sampled for r in active], device=device)
                ids, lp = sample_tokens(logits[at], seeds[active], steps, temperature=temperature,
                                        top_k=top_k, top_p=top_p, min_p=min_p)
                for r, token, logp in zip(active, ids.tolist(), lp.tolist()):
                    rows[r].add([token], [logp], inserted=False)
                    rows[r].n_sampled += 1
                    turn = closed_turn(rows[r], token, tok, tools, tool_style, stop_set)
                    if after_sampling(r, token, turn):
                        feed[where[r], 0] = token
                        fed[where[r]] = 1
            if not bool(fed.any()) and paused:  # nothing to decode: on to the next answers due
                step = max(step, min(due for _, _, due in paused.values()))
            resumed = resume(sorted(r for r, (_, _, due) in paused.items() if due <= step))
            if bool(fed.any()):
                new = forward(feed, kv_cache=cache, input_lengths=fed)[:, -1]
                logits = torch.where(fed[:, None].bool(), new, logits)
            for r, row_logits in resumed.items():
                logits[where[r]] = row_logits
            cache.extent = int(cache.lengths.max())
            step += 1
            alive = [r for r in batch if not rows[r].done]
            if compile and len(alive) == 1:  # Dynamo compiles a batch of 1 apart: keep two rows
                alive += [r for r in batch if r != alive[0]][:1]
            if compact and alive and len(alive) <= 0.75 * len(batch):  # copying the cache costs
                keep = torch.tensor([where[r] for r in alive], device=device)
                cache, logits, batch = cache.select(keep), logits[keep], alive
                where = {r: i for i, r in enumerate(batch)}
            if on_step is not None:
                on_step()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)

    out = [tool_completion(row, prompt_index[r // G], r % G, tok, stop_set=stop_set, waited=waited,
                           answered=respond is not None) for r, row in enumerate(rows)]
    for c, state in zip(out, states or ()):
        c['state'] = state
    return out


def tool_completion(row, prompt_idx, sample_idx, tok, *, stop_set, waited, answered):
    """generate_with_tools' completion dict of a ToolRow (answered: its task has respond, whose
    user turns it counts)."""
    text_ids = row.ids[:-1] if row.finished and row.ids and row.ids[-1] in stop_set else row.ids
    c = dict(prompt_idx=prompt_idx, sample_idx=sample_idx, ids=row.ids, text=tok.decode(text_ids),
             logprobs=row.logprobs, tool_mask=row.mask, tool_calls=row.calls, tool_wait_s=waited,
             finished=row.finished, truncated=not row.finished, turn_limit=row.turn_limit)
    if answered:
        c['user_turns'] = row.turns
    return c


def turn_answer(row, results, responded, tok, *, answer, user_turn, tool_style):
    """The ids to insert after a paused row's turn: its calls' answers (results), or the user turn
    the task's respond returned (responded; None: respond ended the rollout)."""
    if not responded:
        row.calls += results
        return answer_ids(row, results, tok, answer, tool_style)
    if results[0] is None:
        return None
    row.turns += 1
    return user_turn(str(results[0]))


def encode_prompts(tok, task, examples, system_prompt=None, instruction=None):
    """Token ids of the task's prompt for each example: its chat messages through the tokenizer's
    chat template, or a raw-text prompt as it is. system_prompt/instruction: None = the task's
    default (tasks.messages)."""
    import tasks
    import tool_calls
    shown = tool_calls.template_variables(*tasks.tools_of(task))
    out = []
    for ex in examples:
        msgs = tasks.messages(task, ex, system_prompt, instruction)
        out.append(tok.encode(msgs) if isinstance(msgs, str) else tok.render_chat(msgs, **shown))
    return out


def fit_prompts(tok, task, examples, limit, system_prompt=None, instruction=None):
    """The examples whose prompt is at most limit tokens (a prompt and its completion budget must
    fit the model's positions; verl's filter_overlong_prompts), and the lengths of those that are
    not."""
    lens = [len(p) for p in encode_prompts(tok, task, examples, system_prompt, instruction)]
    return [ex for ex, n in zip(examples, lens) if n <= limit], [n for n in lens if n > limit]


def prompt_limit(max_prompt_len, max_seq_len, max_new_tokens):
    """The longest prompt a run takes: max_prompt_len, or with 0 what the model's max_seq_len leaves
    after max_new_tokens. Raises ValueError when the two do not fit the model together."""
    room = max_seq_len - max_new_tokens
    if max_prompt_len > room:
        raise ValueError(f"--max_prompt_len={max_prompt_len} + max_new_tokens {max_new_tokens} "
                         f"exceed the model's {max_seq_len} positions (max_seq_len)")
    return max_prompt_len or room


@torch.no_grad()
def evaluate(model, tok, task, examples, system_prompt=None, instruction=None, *, n_samples=1,
             temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, max_new_tokens=512, batch_size=32,
             seed=0, out_path=None, progress=True, compile=False, first=0, tools=None, stop_strings=()):
    """Greedy pass@1 on every example, graded by the task's grade(); with n_samples > 1 also sampled
    pass@k, maj@k (votes on the task's answer(), default reward.extract_answer) and mean@k (the
    unbiased pass@1 estimate). A task with tools is evaluated through generate_with_tools, as it
    trains, with tools = tool_settings' value (None: the task's defaults). Writes one JSON row per
    problem to out_path when given (stop_strings: generate's). Returns the summary dict. first: the
    index of examples[0] among all problems evaluated (a rank's share under torchrun), so that a
    problem's samples do not depend on how the problems were shared."""
    import tasks
    answer = tasks.answer_fn(task)
    tools = tools or tool_settings(task)

    def sample(chunk, n, **kw):
        return sample_batch(model, tok, [prompts[i] for i in chunk], n, max_new_tokens, tools=tools,
                            compile=compile, stop_strings=stop_strings,
                            states=tasks.rollout_states(task, [examples[i] for i in chunk], n), **kw)

    was_training = model.training
    model.eval()
    prompts = encode_prompts(tok, task, examples, system_prompt, instruction)
    rows, t0 = [], time.time()
    for start in range(0, len(examples), batch_size):
        chunk = range(start, min(start + batch_size, len(examples)))
        index = range(first + chunk.start, first + chunk.stop)
        greedy = sample(chunk, 1, temperature=0.0, prompt_index=index)
        sampled = []
        if n_samples > 1:
            sampled = sample(chunk, n_samples, temperature=temperature, top_k=top_k,
                             top_p=top_p, min_p=min_p, seed=seed, prompt_index=index)
        for j, i in enumerate(chunk):
            ex = examples[i]
            comps = [greedy[j]] + sampled[j * n_samples:(j + 1) * n_samples]
            answers = [answer(c['text']) for c in comps]
            correct = [bool(tasks.grade(task, c['text'], ex, c.get('state'))) for c in comps]
            rows.append(dict(question=ex.get('question'), reference=ex.get('answer'),
                             completions=[c['text'] for c in comps], answers=answers,
                             correct=correct, truncated=[c['truncated'] for c in comps]))
        done = len(rows)
        if progress:
            eta = (time.time() - t0) / done * (len(examples) - done)
            acc = sum(r['correct'][0] for r in rows) / done
            print(f"  eval: {done}/{len(examples)} problems, greedy pass@1 {acc:.3f}, "
                  f"ETA {eta:.0f}s", file=sys.stderr, flush=True)
    n = max(len(rows), 1)
    summary = {'n': len(rows), 'pass@1': sum(r['correct'][0] for r in rows) / n,
               'truncated': sum(r['truncated'][0] for r in rows) / n,
               'seconds': round(time.time() - t0, 2)}
    # the task's own metrics, on the greedy completions
    summary.update(tasks.eval_metrics(task, [r['completions'][0] for r in rows], examples))
    if n_samples > 1:
        for k in pass_ks(n_samples):  # pass@2, pass@4, ... and pass@n (any of the n right)
            summary[f'pass@{k}'] = sum(pass_at_k(n_samples, sum(r['correct'][1:]), k) for r in rows) / n
        summary[f'mean@{n_samples}'] = sum(sum(r['correct'][1:]) / n_samples for r in rows) / n
        summary[f'maj@{n_samples}'] = sum(majority_correct(r) for r in rows) / n
    if out_path:
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, 'w') as f:
            for r in rows:
                f.write(json.dumps(r) + '\n')
    model.train(was_training)
    return summary


def pass_ks(n):
    """The k of the pass@k an evaluation of n samples a problem reports: 2, 4, 8, ... below n, and n."""
    return [2 ** i for i in range(1, n.bit_length()) if 2 ** i < n] + [n]


def pass_at_k(n, c, k):
    """The unbiased estimate of pass@k from n samples of which c are right (Chen et al. 2021, the
    Codex paper): 1 - C(n - c, k) / C(n, k), the chance that k of the n drawn without replacement
    hold a right one; at k = n, whether any is."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_correct(row):
    """maj@k: the most common extracted answer among the samples (ties: first seen) is the
    prediction."""
    votes = Counter(a for a in row['answers'][1:] if a is not None)
    if not votes:
        return False
    best = votes.most_common(1)[0][0]
    return row['correct'][1:][row['answers'][1:].index(best)]


def load_run_checkpoint(path, dtype=torch.float32, device='cpu'):
    """(model, tokenizer) of a train_grpo.py checkpoint (OUT_DIR/ckpt_*.pt): the model built as its
    run built it (init_from and shape from the config saved in it), with its weights. Loads no code
    from the file."""
    from checkpoint import load_checkpoint
    from hf import load_model
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such checkpoint file")
    state = load_checkpoint(path)
    run = state.get('config') or {}
    if 'init_from' not in run or 'model' not in state:
        raise ValueError(f"{path}: not a train_grpo.py checkpoint "
                         "(no 'model' or no config.init_from)")
    shape_keys = ('n_layer', 'n_head', 'n_kv_head', 'n_embd', 'max_seq_len')
    shape = {k: run[k] for k in shape_keys if k in run}
    model, tok = load_model(run['init_from'], dtype, device, run.get('seed', 0), **shape)
    if 'lora' not in state:
        model.load_state_dict(state['model'])
        return model, tok
    # a LoRA run's checkpoint holds its adapters only: they go on the base from init_from
    import lora
    spec = state['lora']
    targets = ','.join(spec['targets'])
    lora.apply(model, rank=spec['rank'], alpha=spec['alpha'], dropout=0.0, targets=targets, seed=0)
    model.load_state_dict({**model.state_dict(), **state['model']})
    return model, tok


def run_config(init_from):
    """The training run's config saved beside an hf/ export (grpo_run.json) or in a checkpoint
    (OUT_DIR/ckpt_*.pt), or {} for any other model."""
    if init_from.endswith('.pt') and os.path.isfile(init_from):
        from checkpoint import load_checkpoint
        state = load_checkpoint(init_from)
        return {**(state.get('config') or {}), 'step': state.get('step')}
    path = os.path.join(init_from, 'grpo_run.json')
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        run = json.load(f)
    if 'task' not in run and 'data' in run:  # runs from before tasks/ named it 'data'
        run['task'] = run['data']
    return run


if __name__ == '__main__':
    # -----------------------------------------------------------------------------
    # None: the training run's value when init_from is a train_grpo.py export (OUT_DIR/hf holds
    # the run's config, grpo_run.json), so `python sample.py --init_from=OUT_DIR/hf` evaluates
    # exactly as the run did; else the fallback
    # HF snapshot dir, hub id, or a checkpoint OUT_DIR/ckpt_*.pt; 'scratch' = tiny random model
    init_from = 'scratch'
    prompt = ''  # if set: print completions for this prompt (chat-formatted) and exit
    # None: the run's, else 'gsm8k'; 'arith', 'module:attr' or 'path/to/task.py' (tasks/)
    task = None
    data_dir = None  # None: the run's, else '' (the task's default source, e.g. the hub for gsm8k)
    split = 'test'  # which split to evaluate
    num_examples = None  # the first N problems; None: the run's eval_examples, else 0 = all
    n_samples = 1  # 1 = greedy pass@1 only; k > 1 adds sampled pass@k, maj@k, mean@k
    num_completions = 1  # completions printed for --prompt
    # per completion; None: the run's eval budget (eval_max_new_tokens or max_new_tokens), else 512
    max_new_tokens = None
    # problems whose prompt is longer are left out, counted; None: the run's, else 0 = all that
    # the model's max_seq_len leaves after max_new_tokens
    max_prompt_len = None
    temperature = 1.0  # for sampled completions (greedy pass@1 always uses 0)
    top_k = 0  # 0 = off
    top_p = 1.0  # 1.0 = off
    min_p = 0.0  # 0.0 = off: tokens less likely than min_p x the most likely one are not drawn
    stop_strings = None  # a completion also ends at these strings (kept in its text); None: the run's
    batch_size = None  # problems per generate() call; None: the run's eval_batch_size, else 64
    compile = False  # torch.compile the prefill and decode steps (the first call compiles: seconds)
    seed = None  # sampling seed (and the arith task's split); None: the run's, else 1337
    system_prompt = None  # system turn; None: the run's, else the task's default; '' = none
    # appended to each question; None: the run's, else the task's default; '' = none
    instruction = None
    # a chat template (jinja, or a .jinja file) instead of the snapshot's; None: a checkpoint's run's (an
    # export carries its run's), else ''
    chat_template = None
    # variables every chat-template render gets, e.g. {'enable_thinking': False}; None: the run's,
    # else {}
    chat_template_kwargs = None
    # the day a chat template prints as today (Llama 3.2's "Today Date"), 'YYYY-MM-DD'; None: the
    # run's (its export carries it), else today's
    chat_date = None
    # a task with tools: None = the run's, else the task's calls (or 4), 5.0 s, 1 step
    max_tool_calls = None
    tool_timeout = None
    tool_delay_steps = None
    # other held-out sets, each with its own task's prompts, grade and knobs (summary keys
    # <name>/pass@1, ...; rows in eval_<name>.jsonl): entries 'task' or ('task', data_dir). None: the
    # run's eval_tasks and the tasks its mix_tasks mixed in, as it evaluated them (none when --task
    # names another task than the run's); [] = none
    eval_tasks = None
    out_dir = 'out/eval'  # eval.jsonl goes here
    device = 'cuda' if torch.cuda.is_available() else 'cpu'  # 'cpu', 'cuda', 'cuda:1'
    # 'float32', 'bfloat16', 'float16'
    dtype = 'bfloat16' if torch.cuda.is_available() else 'float32'
    # -----------------------------------------------------------------------------
    import tasks
    from configurator import configure, save_config
    from data import question_messages
    from hf import load_model
    from tokenizer import pin_template_date, set_chat_template, set_chat_template_kwargs

    def task_knobs(s):  # the task's knobs, their defaults the run's values
        run = run_config(s['init_from'])
        task_mod = tasks.resolve(s['task'] or run.get('task') or 'gsm8k')
        return {k: run.get(k, v) for k, v in tasks.knobs(task_mod).items()}

    config = configure(globals(), more_knobs=task_knobs)
    run = run_config(init_from)
    from_run = {'task': run.get('task'), 'data_dir': run.get('data_dir'),
                'num_examples': run.get('eval_examples'),
                'max_new_tokens': run.get('eval_max_new_tokens') or run.get('max_new_tokens'),
                'batch_size': run.get('eval_batch_size'), 'seed': run.get('seed'),
                'max_prompt_len': run.get('max_prompt_len'),
                'system_prompt': run.get('system_prompt'), 'instruction': run.get('instruction'),
                'chat_template_kwargs': run.get('chat_template_kwargs'),
                'chat_date': run.get('chat_date'), 'stop_strings': run.get('stop_strings'),
                'chat_template': run.get('chat_template') if init_from.endswith('.pt') else None,
                **{k: run.get(k) for k in ('max_tool_calls', 'tool_timeout', 'tool_delay_steps')}}
    fallback = {'task': 'gsm8k', 'data_dir': '', 'num_examples': 0, 'max_new_tokens': 512,
                'max_prompt_len': 0, 'batch_size': 64, 'seed': 1337, 'max_tool_calls': None,
                'tool_timeout': 5.0, 'tool_delay_steps': 1, 'chat_template_kwargs': {}, 'stop_strings': [],
                'chat_template': '', 'chat_date': ''}
    try:  # (task spec, data_dir, name) of each other held-out set
        if config['eval_tasks'] is not None:
            extra_sets = tasks.eval_entries(config['eval_tasks'], [])
        elif config['task'] in (None, run.get('task')):  # the run's, as it evaluated them
            extra_sets = tasks.eval_entries(run.get('eval_tasks') or [], run.get('mix_tasks') or [])
        else:
            extra_sets = []
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    for k, v in from_run.items():
        if config[k] is None:  # not set by a config file or --key=value
            config[k] = v if v is not None else fallback.get(k)
    globals().update(config)
    from safety import RANGES, bad_device, bad_range
    ranges = {'temperature': RANGES['eval_temperature'], 'top_p': RANGES['top_p'],
              'top_k': RANGES['top_k'], 'min_p': RANGES['min_p'], 'stop_strings': RANGES['stop_strings'],
              'n_samples': (lambda v: v >= 1, "completions per problem, >= 1"),
              'num_completions': (lambda v: v >= 1, "completions printed for --prompt, >= 1"),
              'max_new_tokens': (lambda v: v >= 1, "tokens per completion, >= 1"),
              'batch_size': (lambda v: v >= 1, "problems per generate() call, >= 1"),
              'num_examples': (lambda v: v >= 0, "problems evaluated, >= 0; 0 = all"),
              'max_prompt_len': RANGES['max_prompt_len']}
    error = bad_device(device) or bad_range(config, ranges)
    if error is None and not isinstance(getattr(torch, dtype, None), torch.dtype):
        error = f"--dtype={dtype!r}: a torch dtype, such as 'bfloat16' or 'float32'"
    if error is None and chat_date:
        try:
            pin_template_date(chat_date, '--chat_date')
        except ValueError as e:
            error = str(e)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    if device.startswith('cuda'):
        torch.cuda.set_device(device)  # 'cuda:1': CUDA graphs and Triton's launches use the current device
    try:
        task_mod = tasks.resolve(task)
        tasks.set_knobs(task_mod, config)
        if stop_strings and tool_settings(task_mod):
            print(f"error: --stop_strings end rollouts without tools only; task {task!r} calls tools "
                  "or answers turns", file=sys.stderr)
            sys.exit(2)
        if prompt and getattr(task_mod, 'rollout_state', None):
            print(f"error: --prompt: task {task!r} makes each rollout's state from one of its problems "
                  "(rollout_state); a free prompt has none: evaluate on its problems instead", file=sys.stderr)
            sys.exit(2)
        if init_from.endswith('.pt'):  # a checkpoint: its run's model with its weights
            model, tok = load_run_checkpoint(init_from, getattr(torch, dtype), device)
        else:
            model, tok = load_model(init_from, getattr(torch, dtype), device, seed)
        set_chat_template(tok, chat_template)
        set_chat_template_kwargs(tok, chat_template_kwargs)
    except Exception as e:  # loading errors are written to be read: one line, no library stack
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    model.eval()
    if prompt:
        import tool_calls
        # the task's tools, called as in training
        tools = tool_settings(task_mod, max_tool_calls, tool_timeout, tool_delay_steps)
        shown = tool_calls.template_variables(*tasks.tools_of(task_mod))
        ids = [tok.render_chat(question_messages(prompt, system_prompt or '', ''), **shown)]
        if len(ids[0]) + max_new_tokens > model.config.max_seq_len:
            print(f"error: --prompt ({len(ids[0])} tokens) + --max_new_tokens={max_new_tokens} "
                  f"exceed the model's {model.config.max_seq_len} positions", file=sys.stderr)
            sys.exit(2)
        completions = sample_batch(model, tok, ids, num_completions, max_new_tokens, tools=tools,
                                   temperature=temperature, top_k=top_k, top_p=top_p,
                                   min_p=min_p, seed=seed, compile=compile, stop_strings=stop_strings,
                                   states=tasks.rollout_states(task_mod, [{}], num_completions))
        for c in completions:
            ending = 'finished' if c['finished'] else 'truncated'
            calls = f", {len(c['tool_calls'])} tool calls" if tools else ''
            print(f"--- sample {c['sample_idx']} ({len(c['ids'])} tokens, {ending}{calls})")
            print(c['text'])
        sys.exit(0)
    save_config(config, out_dir)
    if run:
        print(f"evaluating as the run evaluated at step {run.get('step')}: task {task}, "
              f"{num_examples or 'all'} {split} problems, max_new_tokens {max_new_tokens}")
    examples = task_mod.load(split, data_dir=data_dir, seed=seed)
    examples = examples[:num_examples] if num_examples > 0 else examples
    try:
        limit = prompt_limit(max_prompt_len, model.config.max_seq_len, max_new_tokens)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    examples, long = fit_prompts(tok, task_mod, examples, limit, system_prompt, instruction)
    if long and not examples:
        print(f"error: every prompt is longer than the {limit} tokens a prompt may take (the "
              f"shortest is {min(long)}); "
              f"{'raise --max_prompt_len' if max_prompt_len else 'lower --max_new_tokens'}",
              file=sys.stderr)
        sys.exit(2)
    if long:
        print(f"left out {len(long)} problems whose prompt is longer than {limit} tokens (the "
              f"longest is {max(long)}); {len(examples)} evaluated")
    others = []  # the other held-out sets (name, task, problems), loaded before any is evaluated
    for spec, ddir, name in extra_sets:  # each as the run evaluated it: its own task's prompts
        try:
            mod = tasks.resolve(spec)
            tasks.set_knobs(mod, {**run, **config})  # its knobs as the run had them
            more = mod.load(split, data_dir=ddir, seed=seed)
        except (ValueError, RuntimeError, FileNotFoundError) as e:
            print(f"error: eval_tasks: {e}", file=sys.stderr)
            sys.exit(2)
        more = more[:num_examples] if num_examples > 0 else more
        if stop_strings and tool_settings(mod):
            print(f"error: eval_tasks: {spec!r} calls tools or answers turns, and --stop_strings end "
                  "rollouts without tools only", file=sys.stderr)
            sys.exit(2)
        others.append((name, mod, fit_prompts(tok, mod, more, limit)[0]))
    sampling = dict(n_samples=n_samples, temperature=temperature, top_k=top_k, top_p=top_p,
                    min_p=min_p, max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed,
                    compile=compile, stop_strings=stop_strings)
    summary = evaluate(model, tok, task_mod, examples, system_prompt, instruction,
                       out_path=os.path.join(out_dir, 'eval.jsonl'),
                       tools=tool_settings(task_mod, max_tool_calls, tool_timeout,
                                           tool_delay_steps), **sampling)
    for name, mod, more in others:
        s = evaluate(model, tok, mod, more, out_path=os.path.join(out_dir, f'eval_{name}.jsonl'),
                     tools=tool_settings(mod, max_tool_calls, tool_timeout, tool_delay_steps),
                     **sampling)
        print(f"{name}: greedy pass@1 {s['pass@1']:.3f} on {s['n']} problems")
        summary.update({f'{name}/{k}': v for k, v in s.items()})
    print(json.dumps(summary))
