"""
One whole GRPO step of ours (train_grpo.py) next to one of TRL's GRPOTrainer: the same random Qwen2
snapshot, the same prompts, batch, lengths, temperature, learning rate and reward function, in one
run of this script.

  ours  train_grpo.py itself, launched as a subprocess with matching --key=value overrides; its
        per-step timing_s/* come from its metrics.jsonl. That measures the real loop, not a copy of
        it.
  TRL   GRPOTrainer in this process, default transformers generation (no vLLM); each optimizer step
        is timed from on_step_begin to on_step_end by a TrainerCallback, and its generation /
        reward / scoring calls by wrapping those methods on the trainer instance.

The first --warmup steps of each (allocator, kernel and lazy-init costs) are run and excluded from
the figures.

Prompts: GSM8K training questions (--data_dir, default ../shared/gsm8k) with the project's default
system prompt and instruction in the chat template, as config/gsm8k.py trains on; only questions of
200-260 characters, so both sides see prompts of the same length whichever ones their samplers draw
(about 400 byte tokens; the bench checks that transformers' chat template gives the same ids as
ours). --task=arith uses the short arithmetic prompts instead.

  CPU (default without a GPU): Qwen2 with hidden 128, 4 layers, 4 heads / 2 kv heads, the byte
       tokenizer (vocab 260), fp32, 2 threads; 8 prompts x 8 samples x 64 new tokens.
  GPU (default with one, or --preset=gpu): Qwen2.5-0.5B's exact shape from random weights (vocab
       151936, the byte tokenizer's ids a subset), bf16 compute over fp32 weights on both sides;
       64 prompts x 8 samples x 256 new tokens, micro-batches of 32 rows; adds generated tokens/s
       and peak memory.

The CPU model's head rows for the special tokens are pushed far down, so neither side ever samples a
stop token and every completion is exactly max_new_tokens long: both do the same work (mean
completion lengths are printed). --natural_stops keeps plain random weights instead (4 of 260 ids
are specials, so most rows then stop early). The reward is digit_fraction below, called per
completion by both (TRL through a thin batch adapter).

TRL's side needs trl and datasets (requirements-bench.txt); without them (--trl=auto) ours runs
alone after a one-line skip notice. --config=FILE runs ours alone at a train_grpo.py config's shape
(bench/gpu_check.py: 20 steps of config/gsm8k.py from random weights, per-phase times and peak
memory per step). The last line printed is JSON.
    # CPU: 2 warm-up + 5 measured steps each, ~30 s idle
    python bench/bench_step.py
    # quicker
    python bench/bench_step.py --steps=3 --warmup=1
    # ours at GSM8K's shape
    python bench/bench_step.py --preset=gpu --config=config/gsm8k.py --steps=20 --warmup=0
    # the pipeline at toy size, seconds
    python bench/bench_step.py --preset=smoke --task=arith --trl=0
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PRESETS = {  # the workload per optimizer step
    'cpu': dict(prompts=8, group=8, new_tokens=64, micro=64, dtype='float32', threads=2, steps=5,
                warmup=2),
    'gpu': dict(prompts=64, group=8, new_tokens=256, micro=32, dtype='bfloat16', threads=0,
                steps=3, warmup=1),
    # the CPU pipeline at toy size (bench/gpu_check.py --cpu-smoke): the tiny CPU model, seconds per
    # side
    'smoke': dict(prompts=2, group=2, new_tokens=8, micro=4, dtype='float32', threads=2, steps=1,
                  warmup=0),
}


def digit_fraction(completion, example, **kwargs):
    """The shared reward: fraction of digit characters. Cheap, and it varies within a group even for
    a random model, so no group has zero advantage and every row reaches the update on both
    sides."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def trl_digit_fraction(prompts, completions, answer, **kwargs):
    """TRL's batch signature around the same function (conversational completions are [{'role',
    'content'}])."""
    texts = [c[-1]['content'] if isinstance(c, list) else c for c in completions]
    return [digit_fraction(t, {'answer': a}) for t, a in zip(texts, answer)]


def build_snapshot(path, preset, natural_stops, seed):
    """A random Qwen2 saved as an HF snapshot (config.json + model.safetensors + byte tokenizer
    files) that our from_pretrained and transformers both load."""
    from model import ModelConfig, from_scratch, qwen25_05b_config
    from hf import save_pretrained
    from tokenizer import byte_tokenizer
    tok = byte_tokenizer()
    if preset == 'gpu':
        cfg = qwen25_05b_config()  # vocab stays 151936: the byte tokenizer's 260 ids are a subset
    else:
        # untied head, so the special tokens' head rows can be set apart from their input embeddings
        cfg = ModelConfig(arch='qwen2', vocab_size=tok.vocab_size, n_layer=4, n_head=4, n_kv_head=2,
                          n_embd=128, intermediate_size=512, max_seq_len=1024,
                          tie_word_embeddings=False)
    # both loops stop on the same ids
    cfg.bos_token_id, cfg.eos_token_id = None, list(tok.stop_ids)
    model = from_scratch(cfg, dtype=torch.float32, device='cpu', seed=seed)
    specials = sorted(tok.special.values())
    if preset == 'cpu' and not natural_stops:
        with torch.no_grad():
            # residual channel 0 is a constant 1 for every token, so the final norm always carries a
            # large positive component there; head rows with -3 in that channel then give the
            # specials logits far below the rest
            model.wte.weight[:, 0] = 1.0
            model.lm_head.weight[specials, 0] = -3.0
    save_pretrained(model, tok, path)
    if preset == 'gpu':
        return None
    # the largest probability of a special token at any position of a few sampled texts
    with torch.no_grad():
        x = torch.randint(0, 256, (8, 160), generator=torch.Generator().manual_seed(0))
        p = torch.softmax(model(x).float(), -1)[..., specials]
    return p.max().item()


def run_ours(snap, work, pre, *, lr, steps, warmup, seed, device, data_args, config='', extra=(),
             profile=False):
    """train_grpo.py as a subprocess with every knob that changes the work set to match TRL's run;
    returns the measured steps' metrics rows. config: a train_grpo.py config file instead, whose
    shape (prompts, group, lengths, micro-batches, lr, rewards...) is kept; only the model, data,
    step count and run plumbing are set here. profile: one more step, after the measured ones and
    not among them, under torch.profiler (train_grpo's profile_step); its table is printed."""
    out = os.path.join(work, 'ours')
    plumbing = dict(init_from=snap, out_dir=out, resume='never', **data_args,
                    max_steps=warmup + steps + profile, eval_every=0, export_best='',
                    save_every=10**9, keep_last=1,
                    profile_step=(warmup + steps + 1) * profile,
                    export_hf=False, plot_every=0, log_samples_every=0, watchdog_s=0,
                    device=device, seed=seed)
    rewards = [{'name': 'bench_step:digit_fraction'}]
    if config:
        # the shared reward: from random weights a task's correctness is always 0, every group's
        # spread is 0 and no update would run
        args = dict(plumbing, warmup_steps=0, rewards=rewards)
    else:
        args = dict(plumbing, group_size=pre['group'], batch_prompts=pre['prompts'],
                    micro_batch_size=pre['micro'], max_new_tokens=pre['new_tokens'],
                    temperature=1.0, top_k=0, top_p=1.0, beta=0.0, num_iterations=1,
                    loss_agg='token_mean', eps_low=0.2, eps_high=0.28, filter_zero_std=False,
                    mask_truncated=False, lr=lr, warmup_steps=0, min_lr_ratio=1.0,
                    adam_betas=(0.9, 0.99), weight_decay=0.0, grad_clip=1.0, dtype=pre['dtype'],
                    rewards=rewards)
    overrides = [f'--{k}={v!r}' if not isinstance(v, str) else f'--{k}={v}'
                 for k, v in args.items()]
    argv = [config] * bool(config) + overrides + list(extra)
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(filter(None, [here, os.environ.get('PYTHONPATH')]))
    # so the reward 'bench_step:...' imports
    env = {**os.environ, 'PYTHONPATH': path, 'PYTHONUNBUFFERED': '1'}
    if pre['threads']:
        env['OMP_NUM_THREADS'] = env['MKL_NUM_THREADS'] = str(pre['threads'])
    log = os.path.join(work, 'ours.log')
    # its output goes to the log and, line by line, here: a run killed from outside still shows
    # how far it got and each finished step's line
    with open(log, 'w') as f, subprocess.Popen(
            [sys.executable, os.path.join(ROOT, 'train_grpo.py'), *argv], cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        for line in p.stdout:
            f.write(line)
            print(f'  | {line}', end='', flush=True)
    if p.returncode != 0:
        sys.exit(f"train_grpo.py exited {p.returncode}; its output:\n{open(log).read()[-4000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out, 'metrics.jsonl'))]
    rows = [r for r in rows if 'timing_s/step' in r]
    assert len(rows) == warmup + steps + profile, (
        f"expected {warmup + steps + profile} step rows in metrics.jsonl, got {len(rows)}")
    if profile:
        table = os.path.join(out, f'profile_step{warmup + steps + 1}.txt')
        print(f"profile of one more step (not measured), operators by their own time:\n"
              f"{open(table).read()}", flush=True)
    return rows[warmup:warmup + steps]


def run_trl(snap, work, pre, *, lr, steps, warmup, seed, gpu, dataset_rows):
    """GRPOTrainer on the same snapshot, one generation of prompts x group completions per optimizer
    step."""
    import transformers
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    # transformers' renames, not ours to act on
    warnings.filterwarnings('ignore', category=FutureWarning)
    rows = pre['prompts'] * pre['group']

    def sync():
        if gpu:
            torch.cuda.synchronize()

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.steps, self.cur, self.lens, self.t0 = [], defaultdict(float), [], 0.0

        def on_step_begin(self, args, state, control, **kw):
            sync()
            self.cur, self.t0 = defaultdict(float), time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync()
            self.steps.append({'step': time.perf_counter() - self.t0, **self.cur})

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and 'completions/mean_length' in logs:
                self.lens.append(logs['completions/mean_length'])

    timer = StepTimer()
    config = GRPOConfig(
        output_dir=os.path.join(work, 'trl'), report_to='none', save_strategy='no', logging_steps=1,
        disable_tqdm=True, seed=seed, max_steps=warmup + steps, use_cpu=not gpu, bf16=gpu,
        fp16=False,
        gradient_checkpointing=False,  # GRPOConfig turns it on by default; ours runs without it
        # one optimizer step = one generation of prompts x group completions, cut into micro-batches
        per_device_train_batch_size=pre['micro'],
        gradient_accumulation_steps=rows // pre['micro'],
        num_generations=pre['group'], max_completion_length=pre['new_tokens'], temperature=1.0,
        top_p=1.0, top_k=0, beta=0.0, num_iterations=1, loss_type='dapo', epsilon=0.2,
        epsilon_high=0.28, scale_rewards='group', mask_truncated_completions=False,
        learning_rate=lr, lr_scheduler_type='constant', warmup_steps=0, adam_beta2=0.99,
        weight_decay=0.0, max_grad_norm=1.0, use_vllm=False,
        model_init_kwargs={'dtype': torch.float32}, log_completions=False,
        dataloader_num_workers=0)
    tok = AutoTokenizer.from_pretrained(snap, padding_side='left')
    trainer = GRPOTrainer(model=snap, reward_funcs=trl_digit_fraction, args=config,
                          train_dataset=Dataset.from_list(dataset_rows), processing_class=tok,
                          callbacks=[timer])
    trainer.remove_callback(PrinterCallback)  # its per-step dicts would bury the summary
    for name, phase in [('_generate', 'gen'), ('_calculate_rewards', 'reward'),
                        ('_generate_and_score_completions', 'rollout')]:
        fn = getattr(trainer, name)

        def timed(*a, _fn=fn, _phase=phase, **k):
            sync()
            t = time.perf_counter()
            out = _fn(*a, **k)
            sync()
            timer.cur[_phase] += time.perf_counter() - t
            return out
        setattr(trainer, name, timed)
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    assert len(timer.steps) == warmup + steps, (
        f"TRL ran {len(timer.steps)} optimizer steps, expected {warmup + steps}")
    peak = torch.cuda.max_memory_allocated() / 2**30 if gpu else None
    return timer.steps[warmup:], timer.lens[warmup:], peak


def mean(xs):
    return sum(xs) / len(xs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    # auto: gpu with CUDA
    ap.add_argument('--preset', default='auto', choices=['auto', 'cpu', 'gpu', 'smoke'])
    # auto: TRL's side when trl and datasets import, else a skip line and ours alone; 1: required;
    # 0: ours alone
    ap.add_argument('--trl', default='auto', choices=['auto', '1', '0'])
    # a train_grpo.py config file: ours alone at that config's shape (e.g. config/gsm8k.py: 32
    # prompts x 8 x 512 tokens), on the preset's model (gpu: Qwen2.5-0.5B shape), random weights
    ap.add_argument('--config', default='')
    # more train_grpo.py --key=value overrides, space-separated, applied last (e.g. a toy shape for
    # a config: '--batch_prompts=2 --group_size=2 --max_new_tokens=8')
    ap.add_argument('--ours_args', default='')
    # measured optimizer steps, each side; 0 = the preset's (5 cpu, 3 gpu)
    ap.add_argument('--steps', type=int, default=0)
    # steps run first and excluded, each side; -1 = preset's (2, 1)
    ap.add_argument('--warmup', type=int, default=-1)
    ap.add_argument('--lr', type=float, default=1e-5)  # the same for both
    ap.add_argument('--seed', type=int, default=1337)
    # CPU threads for both sides; 0 = the preset's (2 on CPU)
    ap.add_argument('--threads', type=int, default=0)
    # CPU: leave the specials samplable (lengths then vary)
    ap.add_argument('--natural_stops', action='store_true')
    # snapshot, our out_dir and logs; '' = a temp dir removed at the end
    ap.add_argument('--work_dir', default='')
    # ours only: one more step after the measured ones under torch.profiler, its table printed
    ap.add_argument('--profile', type=int, default=0)
    # the prompts (see the docstring)
    ap.add_argument('--task', default='gsm8k', choices=['gsm8k', 'arith'])
    # GSM8K jsonl
    ap.add_argument('--data_dir', default=os.path.join(os.path.dirname(ROOT), 'shared', 'gsm8k'))
    args = ap.parse_args()
    gpu = torch.cuda.is_available() if args.preset == 'auto' else args.preset == 'gpu'
    if gpu and not torch.cuda.is_available():
        sys.exit("--preset=gpu: no CUDA device")
    if gpu:
        preset = 'gpu'
    elif args.preset == 'smoke':
        preset = 'smoke'
    else:
        preset = 'cpu'
    pre = {**PRESETS[preset], **({'threads': args.threads} if args.threads else {})}
    args.steps = args.steps or pre['steps']
    args.warmup = pre['warmup'] if args.warmup < 0 else args.warmup
    if pre['threads']:
        torch.set_num_threads(pre['threads'])
    trl = trl_missing = None
    # only when TRL's side may run: the GPU check's machine has neither package, and ours alone
    # never needs them
    if args.trl != '0' and not args.config:
        try:
            import datasets  # noqa: F401  (TRL's trainer takes a datasets.Dataset)
            import trl
        except ImportError as e:
            trl, trl_missing = None, f'{type(e).__name__}: {e}'
    run_trl_side = args.trl == '1' or (args.trl == 'auto' and not trl_missing and not args.config)
    why = None
    if args.trl == '1' and trl_missing:
        sys.exit(f"--trl=1 but TRL cannot be imported ({trl_missing}); "
                 "pip install -r requirements-bench.txt")
    if not run_trl_side:
        if args.trl == '0':
            why = '--trl=0'
        elif args.config:
            why = f'--config={args.config} runs ours alone'
        else:
            why = (f'trl/datasets not importable ({trl_missing}); bring them as wheels '
                   '(requirements-bench.txt)')
        print(f"TRL: skipped ({why})", flush=True)

    from data import question_messages
    from tasks import arith, gsm8k
    # same-length questions: whichever ones each side's sampler draws, the work is equal
    if args.task == 'gsm8k':
        if not os.path.isdir(args.data_dir):
            sys.exit(f"--data_dir={args.data_dir}: no such directory with GSM8K's train.jsonl "
                     "(or use --task=arith)")
        train = [ex for ex in gsm8k.load('train', args.data_dir)
                 if 200 <= len(ex['question']) < 260]
        system_prompt, instruction = gsm8k.SYSTEM_PROMPT, gsm8k.INSTRUCTION
    else:
        train = arith.load('train', seed=args.seed)  # its default knobs: the 'easy' preset
        system_prompt = instruction = ''
    work = args.work_dir or tempfile.mkdtemp(prefix='bench_step_')
    os.makedirs(work, exist_ok=True)
    try:
        snap = os.path.join(work, 'snapshot')
        p_special = build_snapshot(snap, 'gpu' if gpu else 'cpu', args.natural_stops, args.seed)
        device = torch.cuda.get_device_name(0) if gpu else f"CPU, {pre['threads']} threads"
        setting = (f"{pre['prompts']} prompts x {pre['group']} samples x {pre['new_tokens']} new "
                   f"tokens, temperature 1, beta 0, num_iterations 1, lr {args.lr:g}, micro-batch "
                   f"{pre['micro']} rows, {pre['dtype']}, reward digit_fraction, task {args.task}")
        if args.config:
            setting = (f"{args.config}'s knobs (its shape, lr), reward digit_fraction, "
                       f"task {args.task}, {args.warmup + args.steps} steps")
        shape = 'Qwen2.5-0.5B shape' if gpu else 'hidden 128, 4 layers, 4/2 heads, vocab 260'
        print(f"device: {device}\nsetting: {setting}\nmodel: random Qwen2 {shape}, snapshot {snap}")
        if p_special is not None:
            print(f"largest probability of a special (stop) token on random text: {p_special:.2e}")
        print(f"each side: {args.warmup} warm-up step(s) run and excluded, then {args.steps} "
              "measured", flush=True)
        load = os.getloadavg()[0]
        if not gpu and load > 0.5:
            print(f"note: load average {load:.1f} before starting: other processes share these "
                  "cores. With 2 threads a step that loses a core can take 10-30x longer, on "
                  "either side; rerun on an idle machine (load_avg_1min_at_end in the JSON shows "
                  "contention during the run)", flush=True)

        # the same prompts for both: ours reads them from a jsonl copy, TRL gets them in its
        # conversational format
        data_args = dict(task='arith', system_prompt='', instruction='', arith_difficulty='easy')
        if args.task == 'gsm8k':
            os.makedirs(os.path.join(work, 'data'))
            for split in ('train', 'test'):
                with open(os.path.join(work, 'data', f'{split}.jsonl'), 'w') as f:
                    for ex in train:
                        row = {'question': ex['question'], 'answer': ex['solution']}
                        f.write(json.dumps(row) + '\n')
            data_args = dict(task='gsm8k', data_dir=os.path.join(work, 'data'),
                             system_prompt=system_prompt, instruction=instruction)
        dataset = [{'prompt': question_messages(ex['question'], system_prompt, instruction),
                    'answer': ex['answer']} for ex in train]
        from tokenizer import load_tokenizer
        ours_tok, lens = load_tokenizer(snap), []
        hf_tok = None
        if run_trl_side:
            from transformers import AutoTokenizer
            hf_tok = AutoTokenizer.from_pretrained(snap)
        for row in dataset[:20]:
            ids = ours_tok.render_chat(row['prompt'])
            if hf_tok is not None:
                hf_ids = hf_tok.apply_chat_template(row['prompt'], add_generation_prompt=True,
                                                    tokenize=True)
                # a BatchEncoding in newer versions
                hf_ids = hf_ids['input_ids'] if hasattr(hf_ids, 'keys') else hf_ids
                assert list(hf_ids) == ids, (
                    "transformers' chat template and ours give different prompt ids")
            lens.append(len(ids))
        same = " (the same ids through transformers' template)" if hf_tok is not None else ''
        print(f"prompts: {len(dataset)} {args.task} questions, {min(lens)}-{max(lens)} tokens with "
              f"the chat template{same}", flush=True)

        t = time.time()
        ours = run_ours(snap, work, pre, lr=args.lr, steps=args.steps, warmup=args.warmup,
                        seed=args.seed, device='cuda' if gpu else 'cpu', data_args=data_args,
                        config=args.config, extra=args.ours_args.split(), profile=bool(args.profile))
        ours_wall = time.time() - t
        print(f"ours: train_grpo.py subprocess done in {ours_wall:.1f}s (incl. start-up, warm-up, "
              "checkpoints)", flush=True)
        trl_steps = trl_lens = trl_peak = None
        if run_trl_side:
            t = time.time()
            trl_steps, trl_lens, trl_peak = run_trl(snap, work, pre, lr=args.lr, steps=args.steps,
                                                    warmup=args.warmup, seed=args.seed, gpu=gpu,
                                                    dataset_rows=dataset)
            print(f"TRL: GRPOTrainer done in {time.time() - t:.1f}s (incl. loading, warm-up)",
                  flush=True)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)

    # medians over the measured steps: on a shared 2-core machine one step in a few can be slowed
    # many times over by another process, and a mean would report that process rather than the loop
    ours_each = [{'gen': r['timing_s/gen'], 'reward': r['timing_s/reward'],
                  'logprob': r['timing_s/old_logprob'] + r['timing_s/ref'],
                  'update': r['timing_s/update'], 'step': r['timing_s/step']} for r in ours]
    for e in ours_each:
        e['other'] = e['step'] - e['gen'] - e['reward'] - e['logprob'] - e['update']
    ours_phases = {k: statistics.median(e[k] for e in ours_each)
                   for k in ('gen', 'reward', 'logprob', 'update', 'other')}
    ours_step = statistics.median(e['step'] for e in ours_each)
    ours_len = mean([r['response_len/mean'] for r in ours])

    print("\nours (train_grpo.py), median over measured steps:")
    print(f"  generation {ours_phases['gen']:8.3f} s")
    print(f"  reward     {ours_phases['reward']:8.3f} s")
    print(f"  log-probs  {ours_phases['logprob']:8.3f} s  (old/ref passes; none at "
          "num_iterations=1, beta=0: the policy's log-probs come from the update's own forward)")
    print(f"  update     {ours_phases['update']:8.3f} s  "
          "(forward + log-probs + loss + backward + clip + AdamW)")
    print(f"  other      {ours_phases['other']:8.3f} s  (prompts, advantages, packing)")
    print(f"  step       {ours_step:8.3f} s  each: {[round(e['step'], 3) for e in ours_each]}")
    compiles = [round(r.get('timing_s/compile', 0.0), 3) for r in ours]
    if any(compiles):
        print(f"  of which torch.compile building graphs, each step: {compiles} s")
    # frac_zero_std 1: no update ran that step
    ours_steps = [{k: round(v, 4) for k, v in e.items()}
                  | {'peak_mem_gb': round(r['mem/peak_gb'], 3), 'frac_zero_std': r['frac_zero_std'],
                     'compile_s': round(r.get('timing_s/compile', 0.0), 3)}
                  for e, r in zip(ours_each, ours)]
    gen_tokens_per_s = statistics.median(r['perf/gen_tokens_per_s'] for r in ours)
    result = {'device': device, 'setting': setting, 'warmup_steps_excluded': args.warmup,
              'measured_steps': args.steps,
              'statistic': 'median over measured steps', 'ours_step_s': round(ours_step, 4),
              'ours_step_min_s': round(min(e['step'] for e in ours_each), 4),
              'ours_phases': {k: round(v, 4) for k, v in ours_phases.items()},
              'ours_steps': ours_steps,
              'ours_completion_len': round(ours_len, 2),
              'ours_gen_tokens_per_s': round(gen_tokens_per_s, 1),
              # CUDA: torch.cuda.max_memory_allocated; CPU: the process's peak resident set
              # (safety.memory)
              'ours_peak_mem_gb': round(max(r['mem/peak_gb'] for r in ours), 3),
              'ours_run': ('train_grpo.py as a subprocess of this script; timings from its '
                           'metrics.jsonl'),
              'load_avg_1min_at_start': round(load, 2), 'torch_version': torch.__version__,
              'trl': 'compared' if trl_steps is not None else f'skipped: {why}'}
    if trl_steps is not None:
        trl_each = []
        for s in trl_steps:
            gen, reward, rollout = s.get('gen', 0.0), s.get('reward', 0.0), s.get('rollout', 0.0)
            trl_each.append({'gen': gen, 'reward': reward, 'score_other': rollout - gen - reward,
                             'update': s['step'] - rollout, 'step': s['step']})
        trl_phases = {k: statistics.median(e[k] for e in trl_each)
                      for k in ('gen', 'reward', 'score_other', 'update')}
        trl_step = statistics.median(e['step'] for e in trl_each)
        trl_len = mean(trl_lens) if trl_lens else None
        n_rows = pre['prompts'] * pre['group']
        print("TRL GRPOTrainer, median over measured steps:")
        print(f"  generation {trl_phases['gen']:8.3f} s  (tokenize + model.generate + decode)")
        print(f"  reward     {trl_phases['reward']:8.3f} s")
        print(f"  scoring    {trl_phases['score_other']:8.3f} s  (padding, advantages, metrics)")
        print(f"  update     {trl_phases['update']:8.3f} s  "
              "(forward + log-probs + loss + backward + clip + AdamW)")
        print(f"  step       {trl_step:8.3f} s  each: {[round(e['step'], 3) for e in trl_each]}")
        trl_len_shown = trl_len if trl_len is None else round(trl_len, 1)
        print(f"mean completion length: ours {ours_len:.1f}, TRL {trl_len_shown} "
              f"tokens (max {pre['new_tokens']})")
        result.update({
            'trl_step_s': round(trl_step, 4), 'ratio': round(trl_step / ours_step, 2),
            # fastest step of each: what is left when other processes slow some steps (contention
            # only adds time)
            'trl_step_min_s': round(min(e['step'] for e in trl_each), 4),
            'ratio_min': round(min(e['step'] for e in trl_each)
                               / min(e['step'] for e in ours_each), 2),
            'trl_phases': {k: round(v, 4) for k, v in trl_phases.items()},
            'trl_completion_len': trl_len and round(trl_len, 2),
            'trl_gen_tokens_per_s': (round(trl_len * n_rows / trl_phases['gen'], 1) if trl_len
                                     else None),
            'trl_version': trl.__version__})
        if gpu:
            result['trl_peak_mem_gb'] = round(trl_peak, 2)
        print(f"ratio (TRL step / our step): {result['ratio']}x")
    else:
        print(f"mean completion length: ours {ours_len:.1f} tokens; TRL skipped ({why})")
    result['load_avg_1min_at_end'] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))


if __name__ == '__main__':
    main()
