"""
The doctor's crash detectors: a console log's tracebacks and fatal errors (doctor/read.py finds
them: run['crashes']) -> which phase ran out of device memory and what to change there, for our
trainer, TRL and verl; what an NCCL timeout, a device-side assert, a segfault or a SIGKILL says
and which rank or frame it names. Series detectors: detect.py.
"""
import re

from doctor.detect import found

# a stack's function names -> the phase it died in; the update's names first (its backward runs
# through the log-prob functions), then the reward's (it runs inside our sample_step), generation's,
# the log-probs', evaluation's. Ours, TRL's (training_step: _generate_and_score_completions, then
# compute_loss), verl's workers
PHASE_NAMES = [
    ('update', ('micro_loss', 'update', 'compute_loss', 'update_policy', 'update_actor', 'backward')),
    ('reward', ('score', '_calculate_rewards', 'compute_score', 'compute_reward')),
    ('generation', ('rollout', 'sample_step', 'generate', 'generate_with_tools', 'generate_sequences',
                    '_generate', '_generate_single_turn')),
    ('old/reference log-probs', ('side_logprobs', 'compute_log_prob', 'compute_ref_log_prob',
                                 '_get_per_token_logps', '_get_per_token_logps_and_entropies')),
    ('evaluation', ('run_eval', 'evaluate', '_validate')),
]
FRAME = re.compile(r'File "[^"]*", line \d+, in (\w+)')
RAY_METHOD = re.compile(r'ray::\w+\.(\w+)\(')
OURS_OOM = re.compile(r'CUDA ran out of memory during ([\w/ -]+?)[:.]')  # safety.oom_report's first line
OOM_NUMBERS = [('asked', r'Tried to allocate ([\d.]+ [KMG]iB)'), ('total', r'total capacity of ([\d.]+ [KMG]iB)'),
               ('free', r'of which ([\d.]+ [KMG]iB) is free'),
               ('spare', r'([\d.]+ [KMG]iB) is reserved by PyTorch but unallocated')]
OOM_FIX = {  # (trainer, phase) -> what to change there; (trainer, None): any phase
    ('ours', 'generation'): "fewer rows per GPU (batch_prompts, or torchrun over more GPUs) or a lower max_new_tokens",
    ('ours', 'update'): "a lower micro_batch_size or micro_batch_tokens, grad_checkpoint=True",
    ('ours', 'old/reference log-probs'): "a lower micro_batch_size or micro_batch_tokens",
    ('ours', 'evaluation'): "a lower eval_batch_size",
    ('ours', None): "the phase's batch (micro_batch_size, batch_prompts, eval_batch_size), grad_checkpoint, LoRA",
    ('trl', 'generation'): "a lower per_device_train_batch_size (the completions generated at once) or "
                           "max_completion_length; with vLLM colocated, a lower vllm_gpu_memory_utilization",
    ('trl', 'update'): "a lower per_device_train_batch_size with a higher gradient_accumulation_steps, "
                       "gradient_checkpointing=True",
    ('trl', None): "a lower per_device_train_batch_size with a higher gradient_accumulation_steps, "
                   "gradient_checkpointing=True, a lower max_completion_length",
    ('verl', 'generation'): "a lower actor_rollout_ref.rollout.gpu_memory_utilization (the KV cache vLLM/SGLang "
                            "reserves) or a shorter data.max_response_length",
    ('verl', 'old/reference log-probs'): "a lower actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu and "
                                         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    ('verl', 'update'): "a lower actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (or use_dynamic_bsz with a "
                        "lower ppo_max_token_len_per_gpu), actor_rollout_ref.model.enable_gradient_checkpointing=True, "
                        "fsdp_config.param_offload / optimizer_offload",
    ('verl', None): "the micro-batch sizes per GPU (ppo_micro_batch_size_per_gpu, log_prob_micro_batch_size_per_gpu), "
                    "rollout.gpu_memory_utilization, gradient checkpointing",
    (None, None): "a smaller batch per GPU, gradient checkpointing, shorter sequences",
}
# where a traceback's files say which trainer ran
OOM_TRAINERS = [('verl', '/verl/'), ('trl', '/trl/'), ('ours', 'train_grpo.py')]


def oom_phase(crash):
    """The phase an out-of-memory error stopped: named by our own report after it, else read from
    its traceback's function names (PHASE_NAMES); None when neither says."""
    for line in crash['after']:
        m = OURS_OOM.search(line)
        if m:
            return m.group(1)
    names = {m.group(1) for line in crash['before'] for m in FRAME.finditer(line)}
    # Ray's 'ray::WorkerDict.actor_rollout_ref_update_actor()': verl's worker method, role-prefixed
    methods = {m.group(1) for line in crash['before'] + [crash['text']] for m in RAY_METHOD.finditer(line)}
    return phase_of(names, methods)


def phase_of(names, methods=()):
    """The phase a stack's function names (and Ray worker methods) run in (PHASE_NAMES), or None."""
    for phase, marks in PHASE_NAMES:
        if names & set(marks) or any(m == k or m.endswith('_' + k) for m in methods for k in marks):
            return phase
    return None


def gib(size):
    """'312.44 MiB' -> GiB (0.0 for None)."""
    if not size:
        return 0.0
    value, unit = size.split()
    return float(value) * {'KiB': 2**-20, 'MiB': 2**-10, 'GiB': 1.0}[unit]


def oom_trainer(run, crash):
    """'ours', 'trl', 'verl' or None: the trainer whose files the traceback runs through (or whose
    console the log is)."""
    if 'verl' in run['source']:
        return 'verl'
    text = '\n'.join(crash['before'] + crash['after'][:40])
    for trainer, mark in OOM_TRAINERS:
        if mark in text:
            return trainer
    return 'ours' if OURS_OOM.search(text) else None


def detect_out_of_memory(run):
    """The log ends in (or holds) a device out-of-memory error: which phase, how large the request
    and the card, and what to change there. Console logs only (the others hold no tracebacks)."""
    crashes = [c for c in run['crashes'] if c['kind'] == 'out_of_memory']
    if not crashes:
        return []
    crash = next((c for c in crashes if 'Tried to allocate' in c['text']), crashes[0])
    phase = oom_phase(crash)
    numbers = {}
    for key, pattern in OOM_NUMBERS:
        m = re.search(pattern, crash['text'])
        if m:
            numbers[key] = m.group(1)
    said = ', '.join(f"{k} {v}" for k, v in (('asked for', numbers.get('asked')), ('of', numbers.get('total')),
                                             ('free', numbers.get('free'))) if v)
    after = crash['after_step']
    where = f"after step {after}" if after is not None else "before any step was logged"
    trainer = oom_trainer(run, crash)
    fix = OOM_FIX.get((trainer, phase)) or OOM_FIX[(trainer, None)]
    causes = ['a batch larger than the others (longer completions): the step that fits most of the time does '
              'not fit this one', 'the micro-batch or the KV cache sized for another card or model',
              'memory held by another process on the same GPU (a colocated inference engine)']
    if after is None:  # the very first batch did not fit
        causes.insert(0, causes.pop(1))
    if gib(numbers.get('spare')) >= gib(numbers.get('asked')) > 0:  # it would have fit, had it been contiguous
        causes.insert(0, f"fragmentation: {numbers['spare']} reserved by PyTorch but unallocated, more than the "
                         f"{numbers['asked']} asked for (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)")
    steps = [after] if after is not None else []
    told = sum('Tried to allocate' in c['text'] for c in crashes)  # PyTorch's message, once per error
    more = f" ({told} such errors: several ranks or retries)" if told > 1 else ''
    severity, went_on = crash_severity(run, after)
    return [found('out_of_memory', severity, steps, series=['mem_frac'] if 'mem_frac' in run['series'] else [],
                  evidence=f"the device ran out of memory {where}, in {phase or 'a phase the traceback does not name'}"
                           f"{': ' + said if said else ''} (line {crash['line']}: {crash['text'][:160]!r}){more}"
                           f"{went_on}",
                  causes=causes,
                  fix=f"{fix}; then resume from the last checkpoint" if after is not None else fix)]


def crash_severity(run, after):
    """('error', '') for a crash that ended the run; ('warning', what followed) when it resumed and
    logged steps after it."""
    later = [s for s in run['steps'] if after is not None and s > after]
    if not later:
        return 'error', ''
    return 'warning', f"; the run resumed and went on to step {max(later)}"


# a fatal error of a console log (doctor/read.py's FATAL) other than the device's memory -> (what
# happened, likely causes in order, fix)
FATAL_TELLS = {
    'host_out_of_memory': (
        "the host (CPU) ran out of memory and a process was killed (the kernel's OOM killer, Ray's memory monitor)",
        ["host memory that grows with the run: rollouts kept in memory, a dataset read whole, weights or optimizer "
         "state offloaded to the CPU (verl's fsdp_config param_offload/optimizer_offload, DeepSpeed's offload)",
         "several processes on the node each holding a copy of the model (Ray workers, dataloader workers)",
         "a leak: host memory rising every step"],
        "fewer processes or dataloader workers per node, no CPU offload, smaller rollout batches; `dmesg -T | grep -i "
        "kill` names what was killed"),
    'killed': (
        "a process was killed by SIGKILL (signal 9), which it cannot catch: nothing was saved then",
        ["the kernel's OOM killer: host memory ran out (`dmesg -T` says 'Out of memory: Killed process')",
         "a scheduler's limit: Slurm's time or memory limit, Kubernetes' OOMKilled",
         "someone's `kill -9`"],
        "find the pid in `dmesg -T` and the scheduler's log"),
    'collective_timeout': (
        "a collective (all-reduce, broadcast, ...) waited past the process group's timeout: some rank never joined it",
        ["one rank far slower in a phase the others wait for: rank 0 alone saving a checkpoint or evaluating, a reward "
         "call that hangs on one rank, one rank's much longer generations",
         "a rank that died or hung before (its own error is earlier in the log)",
         "ranks running different collectives: a code path only some ranks take"],
        "find the rank that did not arrive (the ranks that report the timeout are the ones that waited; `py-spy dump` "
        "of the other's pid shows where it is); for slow rank-0-only work raise the timeout "
        "(init_process_group(timeout=...); transformers/TRL: ddp_timeout)"),
    'nonfinite_probabilities': (
        "sampling met NaN or inf probabilities (torch.multinomial): the policy's logits were not finite",
        ["fp16 overflow (bf16 has fp32's range)", "weights already NaN after an update (look for a loss or "
         "grad-norm spike in the steps before)", "a temperature of 0 divided into the logits"],
        "bf16 instead of fp16, a lower learning rate, gradient clipping"),
    'cuda_error': (
        "a CUDA kernel failed (device-side assert, illegal memory access): the process cannot use the GPU after it",
        ["a token id past the model's embedding: a tokenizer with more tokens than the model's vocab_size (special "
         "tokens added without resizing the embeddings)",
         "an index out of range in a gather or an embedding (a pad or label id of -100 used as an index)",
         "a kernel or driver bug"],
        "rerun with CUDA_LAUNCH_BLOCKING=1 for the true stack; compare len(tokenizer) with the model's vocab_size"),
    'native_crash': (
        "the process died in native code (a segmentation fault, an abort): no Python exception, no traceback, nothing "
        "saved then",
        ["a compiled extension built for another torch, CUDA or Python (flash-attn, apex, bitsandbytes, a custom "
         "kernel): the stack's innermost frame names the call into it",
         "a C++ exception nothing caught (`terminate called after throwing`): its what() line says what",
         "a library's or the driver's bug, memory corruption (a ctypes call, a kernel writing out of bounds)"],
        "read the Python stack faulthandler printed (ours enables it; elsewhere `python -X faulthandler`): it names "
        "the line that called into native code; reinstall an extension against this torch, or rerun that step alone"),
}
# faulthandler's report: the crashing thread's header, then its frames, innermost first
CURRENT_THREAD = re.compile(r'^Current thread 0x[0-9a-f]+ \(most recent call first\):')
NATIVE_FRAME = re.compile(r'^\s+File "([^"]*)", line (\d+) in (\S+)')
WHAT = re.compile(r'^\s*what\(\):\s*(.+)')  # a C++ exception's message after `terminate called`

NCCL_WORK = re.compile(r'\[Rank (\d+)\] Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(\d+), '
                       r'OpType=(\w+).*?Timeout\(ms\)=(\d+)\)')
TORCHRUN_RANK = re.compile(r'^\s*rank\s*: (\d+) \(local_rank')  # torchrun's failure summary, one per rank
ASSERTION = re.compile(r'Assertion `(.+?)` failed')


def fatal_detail(kind, crash, crashes):
    """What the lines around a fatal error add: the ranks that timed out waiting and in what, the
    ranks torchrun reports, the assertion that failed."""
    lines = [c['text'] for c in crashes] + crash['before'] + crash['after']
    if kind == 'collective_timeout':
        works = [m.groups() for line in lines for m in NCCL_WORK.finditer(line)]
        if works:
            ranks = sorted({int(w[0]) for w in works})
            _, seq, op, ms = works[0]
            return (f"; rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} waited in {op} #{seq} for "
                    f"{int(ms) / 1000:g} s (a rank not listed is one they waited for)")
    if kind == 'killed':
        ranks = sorted({int(m.group(1)) for line in crash['after'] for m in [TORCHRUN_RANK.match(line)] if m})
        if ranks:
            return f"; torchrun reports rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    if kind == 'cuda_error':
        failed = next((m.group(1) for line in lines for m in [ASSERTION.search(line)] if m), None)
        if failed:
            return f"; the assertion: `{failed}`"
    if kind == 'native_crash':
        what = next((m.group(1).strip() for line in crash['after'] for m in [WHAT.match(line)] if m), None)
        frames = native_stack(crash['after'])
        phase = phase_of({fn for _, _, fn in frames})
        return ''.join([f"; the C++ exception: `{what[:120]}`" if what else '',
                        f", in {phase}" if phase else '',
                        "; the crashing thread's stack, innermost first: " + ', '.join(
                            f"{fn} ({'/'.join(path.split('/')[-2:])}:{n})" for path, n, fn in frames[:3])
                        if frames else ''])
    return ''


def native_stack(lines):
    """The crashing thread's frames in faulthandler's report, (file, line, function) innermost
    first; [] when the log has none."""
    frames, inside = [], False
    for line in lines:
        if CURRENT_THREAD.match(line):
            inside = True
        elif inside:
            m = NATIVE_FRAME.match(line)
            if not m:
                break
            frames.append((m.group(1), int(m.group(2)), m.group(3)))
    return frames


def detect_fatal(run):
    """A console log that holds a fatal error other than the device's memory (detect_out_of_memory):
    one finding per kind, at the last step logged before it. A SIGKILL that the host's memory
    explains is that finding alone."""
    out = []
    kinds = {c['kind'] for c in run['crashes']}
    for kind, (what, causes, fix) in FATAL_TELLS.items():
        if kind not in kinds or (kind == 'killed' and 'host_out_of_memory' in kinds):
            continue
        crashes = [c for c in run['crashes'] if c['kind'] == kind]
        if kind == 'native_crash':  # the abort an error of another kind ended in (NCCL's watchdog, CUDA's) is that
            told = {c['after_step'] for c in run['crashes'] if c['kind'] != kind}
            crashes = [c for c in crashes if c['after_step'] not in told]
            if not crashes:
                continue
        crash, after = crashes[0], crashes[0]['after_step']
        where = f"after step {after}" if after is not None else "before any step was logged"
        resume = "; then resume from the last checkpoint" if after is not None else ''
        severity, went_on = crash_severity(run, after)
        out.append(found(kind, severity, [after] if after is not None else [], series=[], causes=causes,
                         evidence=f"{what}, {where}{fatal_detail(kind, crash, crashes)} (line {crash['line']}: "
                                  f"{crash['text'][:160]!r}){went_on}",
                         fix=fix + resume))
    return out


CRASH_DETECTORS = [detect_out_of_memory, detect_fatal]
