"""
What a step reports: the metrics row (rewards, lengths, timing, memory, the update's statistics),
the one line it prints, samples.jsonl, and the metrics log (metrics.jsonl, and Weights & Biases
when wandb_log is on). curves.png is drawn from metrics.jsonl by plot.py.
"""
import atexit
import io
import json
import math
import os
import resource
import secrets
import socket
import subprocess
import sys
import time

import torch

import tasks
from parallel import BEFORE_EXIT
from sample import sampled_count


def compile_totals():
    """(graphs torch.compile has built in this process, seconds it spent building them): Dynamo's
    tracing with Inductor's forward compiles, and the backward compiles AOTAutograd runs at a
    graph's first backward. A step's share is the difference. torch's own bookkeeping
    (torch._dynamo.utils, private: the same names in 2.11 and 2.13; (0, 0.0) if they go)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics as times, counters
    except ImportError:
        return 0, 0.0
    seconds = sum(times.get('_compile.compile_inner', ())) + sum(
        times.get('backward._backward_impl', ()))
    return counters['stats']['unique_graphs'], seconds


def mem_stats(device):
    """Memory in GiB: CUDA's allocator on a GPU; on a CPU the resident set and its peak."""
    if device.startswith('cuda'):
        return {'mem/allocated_gb': torch.cuda.memory_allocated(device) / 2**30,
                'mem/reserved_gb': torch.cuda.memory_reserved(device) / 2**30,
                'mem/peak_gb': torch.cuda.max_memory_allocated(device) / 2**30}
    with open('/proc/self/statm') as f:
        resident_pages = int(f.read().split()[1])
    rss = os.sysconf('SC_PAGE_SIZE') * resident_pages / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return {'mem/allocated_gb': rss, 'mem/reserved_gb': rss, 'mem/peak_gb': peak}


def stage_marker(step, t_step, last_progress, verbose, device):
    """mark(name) after each stage of a step: refreshes the watchdog's heartbeat; verbose: prints a
    numbered stage line with the time since the step began and the memory in use."""
    n = [0]

    def mark(name):
        last_progress[0] = time.time()
        if verbose:
            n[0] += 1
            mg = mem_stats(device)
            print(f"  [{step}.{n[0]}] {name}: {time.time() - t_step:.2f}s, "
                  f"mem {mg['mem/allocated_gb']:.2f} GB (peak {mg['mem/peak_gb']:.2f})", flush=True)
    return mark


def profile_start(device):
    """torch.profiler from here to profile_stop (train_grpo's profile_step: one whole step): the
    host's operators and, on CUDA, the device's kernels."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU]
    if torch.device(device).type == 'cuda':
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities)
    prof.start()
    return prof


def profile_stop(prof, step, out_dir, device, trace=False):
    """Writes OUT/profile_step{step}.txt (the operators by their own time: on the device on CUDA,
    else on the host) and, with trace, .json (a Chrome trace for ui.perfetto.dev: every operator of
    the step, tens of MB on a CPU demo, far more for a GPU step); returns the table's path."""
    prof.stop()
    cuda = torch.device(device).type == 'cuda'
    key = 'self_device_time_total' if cuda else 'self_cpu_time_total'
    path = os.path.join(out_dir, f'profile_step{step}')
    with open(path + '.txt', 'w') as f:
        f.write(prof.key_averages().table(sort_by=key, row_limit=40) + '\n')
    if trace:
        prof.export_chrome_trace(path + '.json')
    return path + '.txt'


def workload_line(P, G, max_new_tokens, num_iterations, micro_batch_size, compile_decode, *,
                  micro_batch_tokens=0):
    """Printed before the first step, which may take long enough to look like a hang: what it is
    about to do."""
    tokens = f" and <= {micro_batch_tokens:,} tokens" if micro_batch_tokens else ''
    compiling = ''
    if compile_decode:
        compiling = ' and compiles the sampler (compile_decode: seconds to minutes)'
    return (f"workload per step: {P} prompts x {G} samples x <= {max_new_tokens} new tokens "
            f"= <= {P * G * max_new_tokens:,} generated tokens, then {num_iterations} update(s) in "
            f"micro-batches of <= {micro_batch_size} rows{tokens}. The first step also warms up "
            f"kernels/allocator{compiling}; a progress line shows during generation.")


def rollout_metrics(r, zero_std, sc, comps, prompts, timing):
    """The step's rewards (r: (groups, G), every group drawn; per function: reward_spread),
    completion lengths, timing and throughput."""
    G = r.shape[1]
    lens = [sampled_count(c) for c in comps]  # sampled tokens: tool responses left out
    m = {'reward/mean': r.mean().item(), 'reward/std': r.std().item()}
    for k, v in sc['per_fn'].items():
        v = applicable(v)
        if v:
            m[f'reward/{k}/mean'] = sum(v) / len(v)
    m.update(reward_spread(sc, G))
    for k, v in sc['errors'].items():
        m[f'reward/{k}/errors'] = v
    m['frac_zero_std'] = zero_std.float().mean().item()
    m['response_len/mean'] = sum(lens) / len(lens)
    m['response_len/max'] = max(lens)
    m['response_len/clip_frac'] = sum(c['truncated'] for c in comps) / len(comps)
    if any('tool_calls' in c for c in comps):
        m.update(tool_metrics(comps))
    for k, v in timing.items():
        m[f'timing_s/{k}'] = v
    m['perf/gen_tokens_per_s'] = sum(lens) / max(timing['gen'], 1e-9)
    tokens = sum(len(p) for p in prompts) * G + sum(lens)
    m['perf/tokens_per_s'] = tokens / max(timing['step'], 1e-9)
    return m


# dense bf16 FLOP/s and HBM bytes/s by GPU name: the first entry whose name the device's contains
DEVICE_PEAKS = [('H200', 989e12, 4.8e12), ('H100 PCIe', 756e12, 2.0e12), ('H100', 989e12, 3.35e12),
                ('A100-SXM4-80GB', 312e12, 2.039e12), ('A100', 312e12, 1.555e12)]


def device_peaks(device, flops=0.0, bandwidth=0.0):
    """(peak FLOP/s, peak bytes/s) of device: the given ones where > 0, else DEVICE_PEAKS' for a
    CUDA device it names; None for either that is unknown (a CPU, another GPU)."""
    known = (None, None)
    if torch.device(device).type == 'cuda':
        name = torch.cuda.get_device_name(device)
        known = next(((f, b) for n, f, b in DEVICE_PEAKS if n in name), known)
    return flops or known[0], bandwidth or known[1]


def update_flops(model, micro, share):
    """Model FLOPs of one pass (forward and backward) over the micro-batches' rows (nanoGPT's and
    PaLM's count: backward twice the forward, no recompute): 6 x the body's matmul weights per
    position, 6 x the LM head's per scored token, 12 x layers x attention width per position
    attended (causal: a position attends itself and those before; share: a group's prompt once,
    its completions after it)."""
    body, head = model.matmul_weights()
    positions, scored, attended = update_positions(micro, share)
    attention = 12 * model.config.n_layer * model.attention_width()
    return 6 * body * positions + 6 * head * scored + attention * attended


def update_positions(micro, share):
    """(positions the model runs over, tokens the LM head scores, positions attended in all) in the
    micro-batches as batch.py lays them out: a row is its prompt and its completion less the last
    token (which predicts nothing), each position attending itself and those before it; share: a
    group's prompt once, each completion after it seeing the prompt and itself."""
    positions = scored = attended = 0
    for mb in micro:
        units = {}
        for i, r in enumerate(mb):
            units.setdefault(r['group'] if share else i, []).append(r)
        for unit in units.values():
            p, ks = len(unit[0]['prompt']), [len(r['ids']) - 1 for r in unit]
            positions += p + sum(ks)
            scored += sum(k + 1 for k in ks)
            attended += p * (p + 1) // 2 + sum(k * p + k * (k + 1) // 2 for k in ks)
    return positions, scored, attended


def decode_bytes(sampler, comps, prompt_lens):
    """The bytes a generation of these completions reads at least: at each decode step the
    sampler's matmul weights once (the embedding reads only its rows), and at each generated token
    its row's KV cache so far (prompt_lens: each completion's prompt length)."""
    body, head = sampler.matmul_weights()
    cfg = sampler.config
    size = next(sampler.parameters()).element_size()
    kv = 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * size  # bytes a position holds
    steps = max((sampled_count(c) for c in comps), default=0)  # a tool's answer is not decoded
    read = steps * (body + head) * size
    for c, p in zip(comps, prompt_lens):
        n = sampled_count(c)
        read += kv * (n * p + n * (n - 1) // 2)  # token t reads p + t positions
    return read


def perf_metrics(model, sampler, timing, *, micro, share, passes, comps, prompt_lens, world, peaks):
    """How hard the step drove the hardware: the update's model FLOP/s (this rank's micro-batches,
    passes over them) and the generation's memory traffic per GPU (every rank's completions over
    world), and with the device's peaks known, as shares of them: perf/update_mfu and
    perf/gen_hbm_frac (a share far below 1 in generation: each decode step waits on the host
    launching its kernels, not on memory)."""
    m = {}
    flops, bandwidth = peaks
    if timing.get('update', 0) > 0 and micro:
        rate = update_flops(model, micro, share) * passes / timing['update']
        m['perf/update_tflops'] = rate / 1e12
        if flops:
            m['perf/update_mfu'] = rate / flops
    if timing.get('gen', 0) > 0 and comps:
        rate = decode_bytes(sampler, comps, prompt_lens) / world / timing['gen']
        m['perf/gen_gb_s'] = rate / 1e9
        if bandwidth:
            m['perf/gen_hbm_frac'] = rate / bandwidth
    return m


def mix_metrics(batch, rewards, task):
    """mix_tasks: per task of the mixture (task, tasks.mixture's), the prompts the step drew (batch:
    its problems, rewards: their groups' rows) and their mean reward (left out for a task none was
    drawn from)."""
    m = {}
    names = [task.task_name(ex) for ex in batch]
    for name in dict.fromkeys(names):
        mine = torch.tensor([n == name for n in names])
        m[f'mix/{name}/prompts'] = int(mine.sum())
        m[f'mix/{name}/reward'] = rewards[mine].mean().item()
    return m


def mix_line(train_set, task):
    """The training problems of a mixture (task) by task, one line: 'gsm8k 7473 (67%), math 3749
    (33%)'."""
    names = [task.task_name(ex) for ex in train_set]
    counts = {n: names.count(n) for n in dict.fromkeys(names)}
    return ', '.join(f"{n} {c} ({c / len(names):.0%})" for n, c in counts.items())


def tool_metrics(comps):
    """Rollouts with tools or a task's respond: calls per completion, failed calls by kind, call
    latency, the share of completion tokens that tool responses inserted, the share of completions
    that hit max_tool_calls, the user turns respond added per completion, and tools/void_frac, the
    share that ended in a void turn (c['void'], set by void_turn where the rollouts are made;
    whether or not void_turn_filter is on)."""
    calls = [call for c in comps for call in c['tool_calls']]
    m = {'tools/calls_per_completion': len(calls) / len(comps)}
    for kind in ('parse', 'unknown', 'raised', 'timeout'):
        m[f'tools/errors/{kind}'] = sum(call.get('error') == kind for call in calls)
    seconds = sorted(call.get('seconds', 0.0) for call in calls)
    if seconds:
        m['tools/latency_p50'] = seconds[len(seconds) // 2]
        m['tools/latency_p95'] = seconds[min(len(seconds) - 1, int(0.95 * len(seconds)))]
    inserted = sum(sum(c['tool_mask']) for c in comps)
    m['tools/token_frac'] = inserted / max(sum(len(c['ids']) for c in comps), 1)
    m['tools/turn_limit_frac'] = sum(bool(c.get('turn_limit')) for c in comps) / len(comps)
    if any('user_turns' in c for c in comps):  # turns the task's respond answered
        m['tools/user_turns_per_completion'] = sum(c.get('user_turns', 0) for c in comps) / len(comps)
    # seconds a rollout waited for tools later than tool_delay_steps (the longest of the step's)
    m['tools/wait_s'] = max(c.get('tool_wait_s', 0.0) for c in comps)
    if all('void' in c for c in comps):
        m['tools/void_frac'] = sum(c['void'] for c in comps) / len(comps)
    return m


def last_turn(c, tok):
    """The text of a completion's last turn: its ids after the last one a tool's response inserted
    (tool_mask), or all of them when it made no call, less the stop token that finished it. Decoded
    from those ids, as the sampler decodes the turn it is writing (generate_with_tools' turn_start),
    rather than cut out of c['text']: the ids say exactly where the response ends, and a response
    ends a line, so the cut never splits a character."""
    mask = c.get('tool_mask', ())
    start = max((i + 1 for i, inserted in enumerate(mask) if inserted), default=0)
    end = len(c['ids']) - 1 if c.get('finished') else len(c['ids'])
    return tok.decode(c['ids'][start:end])


def void_turn(c, tok, answer):
    """SimpleTIR's void turn (arXiv 2509.02479): the completion finished (its stop token, not
    max_new_tokens nor max_tool_calls) on a turn that neither calls a tool nor answers: answer
    (the task's, tasks.answer_fn) finds nothing in its last turn. Every earlier turn ended with a
    call (generate_with_tools pauses a row there), so only the last can be void."""
    return bool(c.get('finished')) and answer(last_turn(c, tok)) is None


def applicable(values):
    """A reward function's values less its Nones (the samples it does not apply to)."""
    return [x for x in values if x is not None]


def flat(group):
    """A group that a reward function gives no signal to: its applicable scores all equal."""
    group = applicable(group)
    return not group or max(group) == min(group)


def reward_spread(sc, G):
    """Per reward function: the std of its scores and the share of groups (G consecutive samples)
    whose G scores are all equal, i.e. groups that function gives no signal to (samples it does not
    apply to left out)."""
    out = {}
    for k, v in sc['per_fn'].items():
        groups = [v[i:i + G] for i in range(0, len(v), G)]
        v = applicable(v)
        if not v:
            continue
        mean = sum(v) / len(v)
        out[f'reward/{k}/std'] = math.sqrt(sum((x - mean) ** 2 for x in v) / max(len(v) - 1, 1))
        n_flat = sum(flat(g) for g in groups)
        out[f'reward/{k}/frac_zero_std'] = n_flat / max(len(groups), 1)
    return out


# ------------------------------------------------------------------------ the update's statistics
# Two accumulators a step fills micro-batch by micro-batch: the rollout's (iteration 0, as the
# policy first saw the batch) and, with num_iterations > 1, the last iteration's (how far the policy
# moved). Every key is there from the start, so every rank all-reduces the same list
# (reduce_metrics).

def rollout_sums(tis=False, masked=False, vespo=False, teacher=False):
    keys = ['loss', 'pg_loss', 'kl', 'entropy', 'logprob/mean', 'logprob_gen_vs_train']
    if teacher:  # on-policy distillation
        keys += ['teacher/reverse_kl']
    if tis:
        keys += ['tis/weight_mean', 'tis/capped_frac']
    if masked:  # off_policy_mask > 0
        keys += ['off_policy/masked_frac']
    if vespo:  # loss_type='vespo'
        keys += ['vespo/phi_mean']
    return {'sum': dict.fromkeys(keys, 0.0), 'max': {}}


def moved_sums(dual=False, masked=False, vespo=False):
    keys = ('clip/low_frac', 'clip/high_frac', 'ratio/mean', 'kl_old_new')
    if dual:  # clip_ratio_c > 0
        keys += ('clip/dual_frac',)
    if masked:  # off_policy_mask > 0: the last iteration's share replaces the first's
        keys += ('off_policy/masked_frac',)
    if vespo:  # and VESPO's mean weight
        keys += ('vespo/phi_mean',)
    maxima = {'ratio/max': -math.inf, 'ratio/min': -math.inf}
    return {'sum': dict.fromkeys(keys, 0.0), 'max': maxima}


def add_rollout(acc, loss, st, w, logp, entropy, *, gen_logp, is_weight, n_tokens, sampled=None):
    """Add one micro-batch's share of iteration 0: the loss, its policy-gradient part, and means
    over the tokens trained on of the KL to the reference, entropy, log-prob, |sampler - trainer|
    log-prob and, with tis, the importance weight and the share of tokens whose ratio was above the
    cap (is_weight: tis_weights' pair), with off_policy_mask the share of tokens whose completion
    it masked, with VESPO its weight's mean, with a teacher the per-token estimate of the reverse KL
    to it, log pi - log pi_teacher (k1). Means divide by n_tokens, the step's trained
    tokens over every rank. sampled (0/1, rollouts with tools): the tokens that count; tool
    responses do not."""
    s = acc['sum']
    s['loss'] += loss.item()
    s['pg_loss'] += (st['pg'] * w).sum().item()
    per_token = [('kl', st['kl']), ('entropy', entropy), ('logprob/mean', logp),
                 ('logprob_gen_vs_train', (gen_logp - logp.detach()).abs())]
    if is_weight is not None:
        per_token += [('tis/weight_mean', is_weight[0]), ('tis/capped_frac', is_weight[1].float())]
    if 'masked' in st:
        per_token.append(('off_policy/masked_frac', st['masked'].float()))
    if 'phi' in st:
        per_token.append(('vespo/phi_mean', st['phi']))
    if 'teacher_kl' in st:
        per_token.append(('teacher/reverse_kl', st['teacher_kl']))
    for k, v in per_token:
        if sampled is not None:
            v = v * sampled
        s[k] += v.sum().item() * (1.0 / n_tokens)


def add_moved(acc, st, logp, old_logp, n_tokens, sampled=None):
    """Add one micro-batch's share of the last iteration (num_iterations > 1): the clipped fractions
    on each side (and the dual clip's, with clip_ratio_c), the ratio's mean and range, and
    KL(old || new) by k3 on the tokens drawn from old."""
    s, mx = acc['sum'], acc['max']
    r = st['ratio']
    d = (logp.detach() - old_logp).exp()
    per_token = [('clip/low_frac', st['clip_low'].float()),
                 ('clip/high_frac', st['clip_high'].float()),
                 ('ratio/mean', r), ('kl_old_new', d - 1 - d.log())]
    if 'clip_dual' in st:
        per_token.append(('clip/dual_frac', st['clip_dual'].float()))
    if 'masked' in st:
        per_token.append(('off_policy/masked_frac', st['masked'].float()))
    if 'phi' in st:
        per_token.append(('vespo/phi_mean', st['phi']))
    for k, v in per_token:
        if sampled is not None:
            v = v * sampled
        s[k] += v.sum().item() / n_tokens
    if sampled is not None:  # the ratio's range over sampled tokens (inserted ones: ratio 1)
        r = torch.where(sampled.bool(), r, torch.ones_like(r))
    mx['ratio/max'] = max(mx['ratio/max'], r.max().item())
    mx['ratio/min'] = max(mx['ratio/min'], -r.min().item())  # kept negated: every entry is a max


def reduce_metrics(acc, all_reduce):
    """torchrun: each rank's sums summed, maxima maxed. all_reduce(values, op) -> values."""
    for part, op in (('sum', 'sum'), ('max', 'max')):
        if acc[part]:
            acc[part] = dict(zip(acc[part], all_reduce(list(acc[part].values()), op)))


def metrics_of(acc):
    out = dict(acc['sum'])
    for k, v in acc['max'].items():
        out[k] = -v if k == 'ratio/min' else v
    return out


def step_line(m):
    """The one line each step prints: the numbers to watch and where the time went."""
    clip = ''
    if 'clip/low_frac' in m:
        clip = f"clip {m['clip/low_frac']:.3f}/{m['clip/high_frac']:.3f} | "
    timing = (f"{m['timing_s/step']:.1f}s (gen {m['timing_s/gen']:.1f} "
              f"rew {m['timing_s/reward']:.1f} ref {m['timing_s/ref']:.1f} "
              f"old {m['timing_s/old_logprob']:.1f} upd {m['timing_s/update']:.1f}")
    if 'timing_s/teacher' in m:  # on-policy distillation: the teacher's pass and its KL
        timing += f" tch {m['timing_s/teacher']:.1f}"
        clip += f"tkl {m['teacher/reverse_kl']:.4f} | "
    if m.get('compile/graphs'):  # of those, torch.compile building graphs (first steps, new shapes)
        n = m['compile/graphs']
        timing += f"; compile {m['timing_s/compile']:.1f} for {n} graph{'s' * (n != 1)}"
    timing += ")"
    if 'tools/calls_per_completion' in m:
        clip += f"calls {m['tools/calls_per_completion']:.2f} | "
    return (f"step {m['step']:5d} | reward {m['reward/mean']:.3f}±{m['reward/std']:.3f} | "
            f"zero_std {m['frac_zero_std']:.2f} | loss {m['loss']:.4f} | kl {m['kl']:.4f} | {clip}"
            f"ent {m['entropy']:.3f} | gnorm {m['grad_norm']:.3f} | "
            f"len {m['response_len/mean']:.0f} | "
            f"{timing} | mem {m['mem/peak_gb']:.2f}GB")


def shown_state(state, limit=2000):
    """A rollout's state as samples.jsonl keeps it: itself when it is JSON of at most limit
    characters, else its JSON (or repr) cut in the middle to that."""
    try:
        text = json.dumps(state)
    except (TypeError, ValueError):
        text = repr(state)
    else:
        if len(text) <= limit:
            return state
    from sandbox import cut_middle
    return cut_middle(text, limit)


def log_samples(path, step, comps, batch, prompts, totals, *, tok, task):
    """Four of the step's completions, spread over its groups, with their prompt, the task's answer
    and grade, the reference and the reward (in a mixture, the task's name; with rollout states,
    the state), appended to path (samples.jsonl): what the model actually writes. Returns the rows."""
    rows = []
    with open(path, 'a') as f:
        for i in range(0, len(comps), max(1, len(comps) // 4))[:4]:
            c = comps[i]
            ex, text = batch[c['prompt_idx']], c['text']
            mixed = hasattr(task, 'task_of')  # a mixture: the problem's own task extracts
            own = task.task_of(ex) if mixed else task
            row = {'step': step, 'prompt': tok.decode(prompts[c['prompt_idx']]), 'completion': text,
                   'answer': tasks.answer_fn(own)(text), 'reference': ex.get('answer'),
                   'correct': bool(tasks.grade(task, text, ex, c.get('state'))), 'reward': totals[i]}
            if mixed:
                row['task'] = task.task_name(ex)
            if 'state' in c:  # what the rollout's tools and respond saw (tasks.rollout_states)
                row['state'] = shown_state(c['state'])
            f.write(json.dumps(row) + '\n')
            rows.append(row)
    return rows


# the process that copies what is written to file descriptors 1 and 2 (console_log) to where they
# pointed and to the log: argv is the log's fd, then (pipe's read end, destination fd) pairs
COPIER = r"""
import os, select, signal, sys
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)  # the run decides when it ends; this ends when its pipes close
log, fds = int(sys.argv[1]), [int(a) for a in sys.argv[2:]]
route = dict(zip(fds[::2], fds[1::2]))
while route:
    for r in select.select(list(route), [], [])[0]:
        data = os.read(r, 1 << 16)
        for fd in (route[r], log) if data else ():
            view = memoryview(data)
            while view:
                try:
                    view = view[os.write(fd, view):]
                except OSError:  # a terminal gone: the other one still gets it
                    break
        if not data:
            del route[r]
"""


def console_log(out_dir):
    """From here on, what this process prints also goes to out_dir/console.log, appended (a resumed
    run adds to it), so the run doctor finds what ended a crashed run beside its metrics. Python's
    own output (sys.stdout, sys.stderr: step lines, tracebacks, the out-of-memory report) is written
    to both by Tee. What is written to file descriptors 1 and 2 below Python (a C++ library: NCCL's
    watchdog, a CUDA device-side assert; faulthandler's stacks; child processes) goes through a pipe
    to a small process, COPIER, that writes it to where it went before and to the log: it outlives
    this one, so a segfault, an abort or a SIGKILL loses nothing written before it. Without that
    process (it cannot start), the Python output alone is copied."""
    path = os.path.join(out_dir, 'console.log')
    log = open(path, 'a', buffering=1, encoding='utf-8', errors='replace')
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    ends, kept = {}, {}  # fd: the pipe's (read, write) ends; fd: a copy of where fd pointed
    try:
        for fd in (1, 2):
            ends[fd], kept[fd] = os.pipe(), os.dup(fd)
        route = [n for fd in (1, 2) for n in (ends[fd][0], kept[fd])]
        copier = subprocess.Popen([sys.executable, '-I', '-S', '-c', COPIER, *map(str, [log.fileno(), *route])],
                                  stdin=subprocess.DEVNULL, pass_fds=(log.fileno(), *route))
    except OSError as e:
        for n in [n for pair in ends.values() for n in pair] + list(kept.values()):
            os.close(n)
        sys.stdout, sys.stderr = Tee(sys.stdout, log), Tee(sys.stderr, log)
        print(f"console.log: copying file descriptors 1 and 2 failed ({e}); Python's output only", file=sys.stderr)
        return
    for fd in (1, 2):
        os.dup2(ends[fd][1], fd)
        os.close(ends[fd][0])
        os.close(ends[fd][1])

    def stream_to(fd, like):  # a text stream like the old one, to where fd pointed
        return io.TextIOWrapper(open(kept[fd], 'wb', closefd=False), encoding=like.encoding, errors=like.errors,
                                line_buffering=True)
    sys.stdout = Tee(stream_to(1, sys.stdout), log, fileno=1)
    sys.stderr = Tee(stream_to(2, sys.stderr), log, fileno=2)

    closed = []

    def close():  # at exit: 1 and 2 point where they did, the copier reads the end of its pipes and exits
        if closed:
            return
        closed.append(True)
        for fd in (1, 2):
            try:
                getattr(sys, ('stdout', 'stderr')[fd - 1]).flush()
            except (OSError, RuntimeError):  # (in a signal handler, a write it interrupted)
                pass
            os.dup2(kept[fd], fd)
        try:
            copier.wait(timeout=2)  # (longer: a child process of the run still holds a pipe)
        except subprocess.TimeoutExpired:
            pass
    atexit.register(close)
    BEFORE_EXIT.append(close)  # the exits that skip atexit (parallel.hard_exit)


class Tee:
    """A text stream that writes to stream and to log (console_log); its fileno is fileno, if given
    (a pipe console_log's copier reads: faulthandler's stacks go to both), else the stream's."""

    def __init__(self, stream, log, fileno=None):
        self.stream, self.log, self._fileno = stream, log, fileno

    def write(self, text):
        self.log.write(text)
        return self.stream.write(text)

    def flush(self):
        self.log.flush()
        self.stream.flush()

    def fileno(self):
        return self.stream.fileno() if self._fileno is None else self._fileno

    def __getattr__(self, name):  # isatty, encoding, ...: the stream's own
        return getattr(self.stream, name)


def tensorboard_row(events, row):
    """A metrics row's numbers as one TensorBoard event, appended to the file events (its first:
    the format version and SessionLog START at the row's step)."""
    from doctor.tfevents import scalar_event, start_events
    values = {k: float(v) for k, v in row.items()
              if k != 'step' and isinstance(v, (int, float)) and not isinstance(v, bool)}
    with open(events, 'ab') as f:
        if f.tell() == 0:
            f.write(start_events(time.time(), row['step']))
        f.write(scalar_event(time.time(), row['step'], values))


def metrics_log(path, master, *, out_dir, wandb_log=False, project='grpo', run_name='',
                config=None, tensorboard_log=False):
    """The function that records a step's metrics row: appended to metrics.jsonl (rank 0 only) and,
    with wandb_log, sent to Weights & Biases with the same keys at step=row['step']. wandb is
    imported only then. Its run id is kept in out_dir/wandb_id, so a resumed run continues the same
    wandb run; rows of steps that run already has (redone after a resume, equal to the first ones by
    exact resume) are not sent again. samples (log_samples' rows) go to wandb as a table, 'samples',
    in the same row (TRL's log_completions). tensorboard_log: every numeric value of the row also
    goes to a TensorBoard event file in out_dir/tb/ (one per process, opened with SummaryWriter's
    purge_step at its first row, so a resumed run's redone steps replace the old ones there)."""
    def no_log(row, samples=None):  # ranks other than 0
        pass

    if not master:
        return no_log
    run = None
    if wandb_log:
        import wandb
        id_path = os.path.join(out_dir, 'wandb_id')
        if os.path.exists(id_path):
            with open(id_path) as f:
                run_id = f.read().strip()
        else:
            run_id = secrets.token_hex(4)  # not torch's or random's: they hold the run's RNG state
        with open(id_path, 'w') as f:
            f.write(run_id)
        run = wandb.init(project=project, name=run_name or None, id=run_id, resume='allow',
                         config=config, dir=out_dir)
        print(f"wandb: run {run_id} in project {project} (out_dir/wandb_id)")

    events = None
    if tensorboard_log:
        os.makedirs(os.path.join(out_dir, 'tb'), exist_ok=True)
        events = os.path.join(out_dir, 'tb', f"events.out.tfevents.{time.time():.0f}.{socket.gethostname()}")

    def log(row, samples=None):
        with open(path, 'a') as f:
            f.write(json.dumps(row) + '\n')
        if events is not None:
            tensorboard_row(events, row)
        if run is not None and row['step'] >= run.step:
            table = {}
            if samples:
                cols = list(samples[0])
                table['samples'] = wandb.Table(columns=cols,
                                               data=[[r[c] for c in cols] for r in samples])
            run.log({**row, **table}, step=row['step'])
    return log
