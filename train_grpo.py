"""
GRPO fine-tuning on one GPU (or a CPU, or several through torchrun), top to bottom: the knobs, the
setup, then a loop of named stages, each a function of this file:
  1-2 prompts, completions, rewards: sample_step (sample.py; the task's rewards, reward.py)
  3 group-relative advantages, rows, micro-batches: train_groups, layout (loss.py, batch.py)
  4 old and reference log-probs: side_logprobs (batch.py)
  5 clipped policy-gradient update: update, micro_loss (loss.py)
  6 metrics, warnings, guards: step_metrics, report, roll_back (metrics.py, safety.py)
  7 checkpoint: checkpoint (checkpoint.py)

    python train_grpo.py config/arith.py            # the offline demo: tiny model, CPU, minutes
    python train_grpo.py config/gsm8k.py            # Qwen2.5-0.5B-Instruct on GSM8K, one GPU
    python train_grpo.py config/gsm8k.py --lr=2e-6 --group_size=16
    python train_grpo.py --task=path/to/my_task.py --init_from=...   # your own task (README)
    python train_grpo.py --plot=out/gsm8k           # redraw curves.png from metrics.jsonl
"""
import contextlib
import faulthandler
import glob
import math
import os
import signal
import sys
import time
from datetime import date, datetime, timezone

import torch

# I/O
out_dir = 'out/grpo'  # metrics.jsonl, samples.jsonl, curves.png, checkpoints and hf/ go here
init_from = 'Qwen/Qwen2.5-0.5B-Instruct'  # HF snapshot dir or hub id; 'scratch': small, random
resume = 'auto'  # 'auto': continue from the newest checkpoint in out_dir that loads; 'never': fresh
resume_changed = False  # resume even though knobs that change the run differ from the checkpoint's
plot = ''  # --plot=OUT_DIR: redraw OUT_DIR/curves.png from its metrics.jsonl and exit
# task (tasks/): its data, prompts, grading and default rewards; its own knobs are in its file
# built in: 'gsm8k', 'math', 'arith' (offline), 'chess', 'qa' (your own question/answer files), ...; or
# 'mymodule:my_task', 'path/to/task.py'
task = 'gsm8k'
data_dir = ''  # local dir with the task's train/test .jsonl or .parquet; '' = the task's own source
system_prompt = None  # system turn; None = the task's default, '' = none
instruction = None  # appended to every question; None = the task's default, '' = none
# a jinja chat template (or a .jinja file) that renders every prompt instead of the snapshot's (verl's
# custom_chat_template), saved into the export: a base model's plain 'User: {q}\nAssistant:' layout
chat_template = ''
# variables every chat-template render gets (prompts, tool answers), as transformers'
# apply_chat_template(..., **kwargs) takes them: Qwen3's {'enable_thinking': False}
chat_template_kwargs = {}
# the day a chat template prints as today (strftime_now: Llama 3.2's and SmolLM3's "Today Date"),
# 'YYYY-MM-DD'; '' = the day (UTC) the run first started, kept by its resumes and its export
chat_date = ''
# more tasks whose training problems join task's (verl's several train_files by data_source): 'math',
# ('math', data_dir) or ('math', data_dir, times), times x its train split (0.5: a seeded half); each
# problem keeps its task's prompts, grade and default rewards; each test split evaluated as eval/<name>/
mix_tasks = []
# scratch model (init_from='scratch'): Qwen2-shaped, byte tokenizer
n_layer = 4  # transformer blocks
n_embd = 128  # width
n_head = 4  # attention heads
n_kv_head = 2  # key/value heads (GQA)
max_seq_len = 512  # positions
# supervised warm start on reference solutions, before GRPO (for scratch models; 0 = off)
sft_steps = 0  # optimizer steps of cross-entropy on (prompt, solution) pairs
sft_lr = 1e-3  # its peak learning rate (warmup 10%, cosine to 10%)
sft_batch_size = 32  # sequences per SFT step
# GRPO rollout
group_size = 8  # G: completions per prompt; advantages are relative within a group
batch_prompts = 16  # prompts per step (rows per step = batch_prompts * group_size)
micro_batch_size = 16  # rows per forward/backward pass (gradient accumulation)
# > 0: a pass also takes at most this many tokens as padded (rows x the longest), so short rows share
# a pass and long ones get fewer (verl's use_dynamic_bsz, ppo_max_token_len_per_gpu); 0 = rows only
micro_batch_tokens = 0
share_prompt = 'auto'  # True: a group's prompt once, its completions after it; 'auto': the cheaper
packed_attention = 'auto'  # packed rows: 'flex' (FlexAttention), 'sdpa'; 'auto': flex on CUDA
max_new_tokens = 512  # completion budget; hitting it counts as truncated
# prompts longer than this many tokens are left out of the train and eval sets when they load, with
# a line saying how many (verl's filter_overlong_prompts); 0: all that max_seq_len leaves
max_prompt_len = 0
# the training problems in a new seeded order each epoch; False: in the task's own order, epoch after
# epoch (a curriculum sorted by difficulty; verl's data.shuffle, TRL's shuffle_dataset)
shuffle = True
temperature = 1.0  # sampling temperature; the loss's log-probs use the same temperature
top_k = 0  # 0 = off. top_k/top_p/min_p make training off-policy (the loss uses the full softmax)
top_p = 1.0  # 1.0 = off
min_p = 0.0  # 0.0 = off: tokens less likely than min_p x the most likely one are not drawn
# a completion also ends at the token that completes one of these strings, its text (what rewards and
# graders read) cut right after it: a base model's '</answer>' or '\n\nQuestion:' (vLLM's stop)
stop_strings = []
# GRPO objective (loss.py)
# 'grpo' (r - group mean, scaled), 'rloo' (leave-one-out), 'reinforce_pp' (REINFORCE++-baseline:
# then whitened over the step), 'reinforce' (REINFORCE++: r whitened over the step, no baseline),
# 'maxrl' ((r - mean) / mean), 'passk' (only the best, its margin), 'gdpo' (each reward function
# normalised in its group, then weighted, summed, normalised), 'opo' (r - the group's
# length-weighted mean reward), 'none' (0: rewards are logged, a teacher alone trains)
advantage = 'grpo'
scale_rewards = 'group'  # advantage = (r - group mean) / 'group' std, 'batch' std or 'none'
adv_eps = 1e-4  # keeps the division finite for groups with tiny spread
# 'token_mean' (DAPO), 'seq_mean_token_mean' (GRPO), 'seq_sum_const' (Dr. GRPO), 'token_sum' (no
# normaliser), 'seq_mean_token_sum' (sum over a sequence, mean over sequences: LUSPO)
loss_agg = 'token_mean'
# 'grpo' (token ratio, PPO clip), 'gspo' (sequence ratio), 'cispo' (clipped IS weight), 'sapo'
# (a soft gate on the token ratio instead of the clip), 'vespo' (a soft weight of the sequence's),
# 'clip_cov', 'kl_cov' (below), 'gmpo' (the sequence's geometric-mean ratio, eps in log space)
loss_type = 'grpo'
eps_low = 0.2  # PPO clip below: ratio >= 1 - eps_low
eps_high = 0.28  # PPO clip above (clip-higher, DAPO): ratio <= 1 + eps_high
clip_ratio_c = 0.0  # dual-clip: A < 0 tokens' loss capped at -A * this (> 1; verl: 3.0); 0 = off
cispo_bounds = 'high'  # CISPO's weight: 'high' min(ratio, 1 + eps_high), 'both' also >= 1 - eps_low
sapo_tau_pos = 1.0  # SAPO's gate temperature for A > 0: higher, the gradient fades sooner off 1
sapo_tau_neg = 1.05  # and for A <= 0 (the paper: above tau_pos, negative updates are riskier)
# VESPO's weight of a sequence's importance ratio w, e^(lam + k log w - lam w), peaks at w = k / lam
# (TRL's defaults: at 2/3 for A >= 0, at 3/2 for A < 0: what the policy already moved towards weighs
# less)
vespo_k_pos = 2.0
vespo_lambda_pos = 3.0
vespo_k_neg = 3.0
vespo_lambda_neg = 2.0
# 'clip_cov': a random cov_ratio share of the step's tokens, of those whose covariance of advantage and
# log-prob lies within clip_cov_bounds, pass no policy gradient; 'kl_cov': no clip, the cov_ratio share
# with the largest covariance pay kl_cov_coef x |log ratio| (Clip-Cov, KL-Cov: arXiv 2505.22617, verl)
cov_ratio = 2e-4
clip_cov_bounds = (1.0, 5.0)
kl_cov_coef = 1.0
num_iterations = 1  # mu: optimizer steps per rollout batch (1 = on-policy: ratio 1, nothing clips)
# PPO mini-batches: the step's groups dealt into this many disjoint sets, one optimizer step each
# (per iteration), each normalised over its own rows; > 1: old log-probs are taken before the first
mini_batches = 1
beta = 0.0  # KL penalty weight to the frozen reference (0 = no reference model is loaded)
# 'k3': gradient of KL(ref||pi) (GRPO); 'k2': of KL(pi||ref); 'k1': in the advantage; 'k3_is': k3
# times the ratio, of KL(pi||ref) (TRL); 'k3+': k3's value, k2's gradient (verl)
kl_estimator = 'k3'
kl_clamp = 10.0  # log ratios are clamped to +-this before the KL estimate
kl_warmup_steps = 0  # beta ramps linearly from 0 over this many steps
# the reference moves to the policy every N steps (0 = never): ref = alpha * policy + (1 - alpha)
# * ref; alpha 1 resets it (ProRL), TRL's sync_ref_model mixes alpha 0.6 every 512 (TR-DPO)
ref_sync_every = 0
ref_sync_alpha = 1.0
ref_sync_reset_optimizer = False  # each move also resets AdamW's moments and step count (ProRL)
# on-policy distillation: a frozen teacher (HF snapshot dir or hub id, the policy's tokenizer ids)
# scores the sampled tokens; each token's advantage gains teacher_coef * (log p_teacher - log p_policy),
# minus its reverse KL to the teacher ('' = off). 'self': the policy as it sampled, shown the problem's
# reference solution (the task's solution()) in a system turn before the prompt (self-distillation,
# SDFT; prime-rl's opsd). advantage='none': the teacher is the only signal
teacher = ''
teacher_coef = 1.0
# teacher='self': that system turn; {demonstration} is the solution (prime-rl's wording)
teacher_hint = 'Here is an example of an expert response:\n<demonstration>\n{demonstration}\n</demonstration>'
filter_zero_std = True  # skip groups of equal rewards (their gradient is 0 without KL/entropy)
dynamic_sampling = 0  # DAPO: up to N more rounds of prompts until P groups have a reward spread
# a prompt whose group's mean reward reaches this is not drawn again (0 = off): 1.0 with the 0/1
# 'correct' reward drops the problems solved G/G (Polaris, Skywork-OR1; prime-rl's easy pool)
drop_easy = 0.0
mask_truncated = False  # exclude completions that hit max_new_tokens from the loss
entropy_coef = 0.0  # entropy bonus weight (0 = off)
# adaptive entropy (Skywork-OR1): entropy_coef is the start; each step it moves by
# entropy_coef_delta (up while the entropy is <= entropy_target, else down) within
# [entropy_coef_min, entropy_coef_max]
adaptive_entropy = False
entropy_target = 0.2  # nats per token; the bonus acts only while the entropy is at or below it
entropy_coef_delta = 0.005  # the coefficient's step
entropy_coef_min = 0.0  # its lower bound
entropy_coef_max = 1.0  # its upper bound
# train the policy-gradient (and entropy) term on the top share of tokens by entropy, the rest
# masked (Beyond the 80/20 rule: 0.2); 1.0 = every token
top_entropy_quantile = 1.0
lm_head_tiles = (0, 0)  # LM head's (tokens, vocab) tile: at most that many logits; 0: logprob_kernels.py
lm_head_fp32 = True  # the training LM head's matmul in fp32 (bf16 logits round every log-prob)
# truncated importance sampling vs the sampler: '' off, 'token_truncate', 'token_mask', 'sequence_*'
tis = ''
tis_cap = 3.0  # its cap C_max on pi_train / pi_sampler (TRL's default)
tis_min = 0.0  # its lower bound C_min (truncate: clamp up to it; mask: zero below it); 0 = none
# off-policy sequence masking (DeepSeek-V3.2): completions with A < 0 whose mean log(pi_sampler /
# pi) per token exceeds this pass no policy gradient; 0 = off (TRL's off_policy_mask_threshold)
off_policy_mask = 0.0
# rewards: reward.REWARD_FNS names, 'reward_model'/'judge' or 'module:function'; kwargs reach them
rewards = None  # None = the task's default rewards ('correct' pays the task's grade())
# tools (tool_calls.py): a task that defines `tools` gets rollouts that call them
# calls per completion; one more ends it (tools/turn_limit_frac). None: the task's, else 4
max_tool_calls = None
tool_timeout = 5.0  # seconds a call may take; past it the model reads a one-line error
# decode steps between a call and its answer's insertion; a tool later than that is waited for
# (tools/wait_s), so rollouts do not depend on tool latency. Raise it for slow tools (python)
tool_delay_steps = 1
# True: completions that finished on a void turn, one that neither calls a tool nor answers
# (SimpleTIR; metrics.void_turn, tools/void_frac), are left out of the loss, KL and entropy and of
# their normalisers; they still count in their group's reward baseline, as in SimpleTIR
void_turn_filter = False
failure_reward = 0.0  # reward of a sample whose reward function raised
# optimization
lr = 1e-6  # peak learning rate
# after warmup: 'cosine' or 'linear' down to lr * min_lr_ratio at max_steps, or 'constant' (TRL's
# default is linear to 0, verl's constant, OpenRLHF's cosine to 0.1 x lr)
lr_schedule = 'cosine'
min_lr_ratio = 0.1  # the decay's floor, as a share of lr
warmup_steps = 10  # linear warmup
max_steps = 200  # GRPO steps
# > 0: max_steps becomes ceil(epochs x training problems / batch_prompts), so many passes over the
# training set (verl's total_epochs, TRL's num_train_epochs); 0: max_steps as set
epochs = 0.0
weight_decay = 0.0  # AdamW decay on matrices
adam_betas = (0.9, 0.99)  # AdamW betas
grad_clip = 1.0  # max gradient norm (0 = off)
# evaluation and logging
eval_every = 50  # greedy pass@1 on held-out problems every N steps, at start and end (0 = never)
eval_examples = 200  # held-out problems per evaluation (0 = all)
eval_max_new_tokens = 0  # 0 = max_new_tokens
eval_batch_size = 64  # problems per generate() call during eval
eval_samples = 0  # k >= 2: also k sampled completions per problem: eval/pass@k (@2, @4, ..), mean@k, maj@k
eval_temperature = 1.0  # their temperature (the same seed at every eval; greedy pass@1 stays)
# more held-out sets evaluated beside the task's, each with its own prompts and grade, logged as
# eval/<name>/...: ['math'] (the task's own source) or [('math', 'path/to/MATH')] (a data_dir)
eval_tasks = []
log_samples_every = 10  # every N steps, a few completions with their rewards to samples.jsonl
verbose = False  # numbered per-stage lines with elapsed time and memory
profile_step = 0  # profile this step (torch.profiler): OUT/profile_stepN.txt, its ops by time
profile_trace = False  # also OUT/profile_stepN.json, a Chrome trace of every op (large)
# checkpoints and guards
save_every = 50  # checkpoint every N steps (also on SIGINT/SIGTERM and at the end; 0: only then)
keep_last = 2  # checkpoints kept on disk
export_hf = True  # also write out_dir/hf/ (HF snapshot of the latest weights) at each checkpoint
export_dtype = ''  # the HF snapshot's weights: '' = as trained (float32), or 'bfloat16'
export_every = 0  # also checkpoint and keep out_dir/hf_{step:07d}/ every N steps (0 = off)
# an eval metric, e.g. 'eval/pass@1' (any eval/ key the run logs): out_dir/hf_best/ holds the
# weights of its best evaluation so far (ties: the earliest); '' = off
export_best = ''
export_best_mode = 'max'  # 'max': the highest value is the best; 'min': the lowest (eval/truncated)
early_stop = 0  # with export_best: stop after this many evaluations in a row without a new best (0 = never)
wandb_log = False  # also send every metrics.jsonl row to Weights & Biases (pip install wandb)
wandb_project = 'grpo'  # its project
wandb_run_name = ''  # its run name ('' = wandb's); a resumed run continues the same wandb run
tensorboard_log = False  # also write out_dir/tb/: TensorBoard event files of every metrics row (no package needed)
nan_patience = 3  # non-finite loss/grad this many steps in a row -> roll back to a checkpoint
rollback_lr_scale = 0.5  # LR multiplier applied at each rollback
max_rollbacks = 2  # more rollbacks than this -> stop with a diagnosis
kl_warn = 0.5  # warn when the per-token KL to the reference exceeds this
kl_max = 2.0  # above this: roll back or stop (on_kl_max); only measured when beta > 0
on_kl_max = 'rollback'  # 'rollback' or 'stop'
zero_reward_patience = 20  # reward mean exactly 0 (or every reward failing) this many steps -> stop
watchdog_s = 1800.0  # no progress for this long -> dump every thread's stack (0 = off)
watchdog_exit = False  # after the dump: False = keep waiting, True = exit (code 4)
plot_every = 10  # redraw curves.png every N steps (and at the end)
fault_nan_steps = []  # testing: steps whose loss is made NaN
fault_oom_steps = []  # testing: steps whose update raises torch.OutOfMemoryError (the report)
fault_stall_step = -1  # testing: step that sleeps fault_stall_s before its update (the watchdog)
fault_stall_s = 0.0  # testing: length of that stall
fault_kill_opt_step = 0  # testing: SIGKILL this process right after its N-th GRPO optimizer step
# system
device = 'cuda' if torch.cuda.is_available() else 'cpu'  # 'cpu', 'cuda', 'cuda:1'
dtype = 'bfloat16' if torch.cuda.is_available() else 'float32'  # compute dtype (weights stay fp32)
compile = False  # torch.compile the training forward (dynamic shapes: packed rows vary in length)
compile_decode = False  # torch.compile the sampler's prefill and decode step (sample.py)
decode_graphs = False  # fixed-shape decode steps, a CUDA graph each on a GPU (rollouts without tools)
decode_check_every = 0  # decode steps between reads of how many rows still go; 0: 8 on CUDA, else 1
grad_checkpoint = False  # recompute activations in backward (long completions)
# the device's dense bf16 FLOP/s and memory bytes/s, for perf/update_mfu and perf/gen_hbm_frac; 0: by
# the GPU's name (H100, H200, A100; none on a CPU)
peak_flops = 0.0
peak_bandwidth = 0.0
lora_rank = 0  # LoRA adapter rank, base frozen (0 = off); 32 is a common start, with ~10x the lr
lora_alpha = 64.0  # adapter scale = lora_alpha / lora_rank (peft's convention)
lora_dropout = 0.0  # dropout on the adapters' input, in the gradient forward only
lora_targets = 'all-linear'  # all the blocks' linear layers, or HF names: 'q_proj,v_proj'
# the frozen base's matrices: 'bfloat16' halves them (needs dtype='bfloat16'); 'auto': bfloat16 exactly
# when that changes no number (dtype='bfloat16' and the snapshot stores them in bf16), else float32
lora_base_dtype = 'auto'
fsdp = False  # torchrun only: shard weights, grads and AdamW state across ranks (FSDP2)
seed = 1337  # data order, sampling and init: the whole run is a function of it
# torch.use_deterministic_algorithms: the same gradients bit for bit run to run, so reruns and
# resumes repeat exactly with compile=True too (Inductor's embedding backward adds with atomics
# otherwise); None: on the CPU, not on CUDA (slower kernels there; not yet tried on a GPU)
deterministic = None
# -----------------------------------------------------------------------------
import tasks  # noqa: E402
from configurator import configure, save_config  # noqa: E402
from plot import plot_metrics  # noqa: E402


def task_knobs(knobs):  # the knobs of the task (arith_difficulty, ...), eval and mixed-in tasks
    out = {}
    specs = [tasks.eval_entry(e)[0] for e in knobs['eval_tasks']]
    specs += [tasks.mix_entry(e)[0] for e in knobs['mix_tasks']]
    for spec in [knobs['task'], *specs]:
        out.update(tasks.knobs(tasks.resolve(spec)))
    return out


config = configure(globals(), more_knobs=task_knobs)
if plot:
    plot_metrics(os.path.join(plot, 'metrics.jsonl'), os.path.join(plot, 'curves.png'))
    sys.exit(0)

import lora  # noqa: E402
import metrics  # noqa: E402
import safety  # noqa: E402
import tool_calls  # noqa: E402
from batch import choose_share_prompt, completion_logprobs, keep_groups, micro_batches  # noqa: E402
from batch import mini_batch_groups, pad_micro_batches, sampled_entropies  # noqa: E402
from batch import sampled_tokens, train_rows, zero_std_rows  # noqa: E402
from checkpoint import load_checkpoint, load_state, roll_back_files  # noqa: E402
from checkpoint import reference_model, reference_path, resume_run, save_reference  # noqa: E402
from checkpoint import run_chat_date, save_export, save_run  # noqa: E402
from data import indices_at  # noqa: E402
from hf import load_model  # noqa: E402
from loss import advantages, gdpo_advantages, policy_loss, tis_weights, zero_spread  # noqa: E402
from loss import adapt_entropy_coef, cov_selection, entropy_cut, off_policy_keep  # noqa: E402
from loss import token_weights  # noqa: E402
from parallel import all_reduce, die, finish, gather_step, gather_tensor, setup, wrap  # noqa: E402
from parallel import clip_grad_norm  # noqa: E402
from reward import declared_facts, merge_scores, resolve_rewards, score  # noqa: E402
from sample import encode_prompts, evaluate, sample_batch, sampled_count, sampler_model  # noqa: E402
from sample import fit_prompts, prompt_limit, tool_settings  # noqa: E402
from sft import warm_start  # noqa: E402
from tokenizer import pin_template_date, prints_date, set_chat_template, set_chat_template_kwargs  # noqa: E402
from tokenizer import vocabulary_mismatch  # noqa: E402

# ------------------------------------------------------------------------- checks and setup
error = safety.bad_knob(config) or lora.bad_knob(config)  # a typo fails here, not in the loop
if error is not None:
    die(error, 2)
task_mod = tasks.resolve(task)
tasks.set_knobs(task_mod, config)
mixed_in = []  # mix_tasks: (name, task, data_dir, times)
for entry in mix_tasks:
    spec, ddir, times, name = tasks.mix_entry(entry)
    mod = tasks.resolve(spec)
    tasks.set_knobs(mod, config)
    mixed_in.append((name, mod, ddir, times))


def task_messages(example):  # what a reward model or judge is shown as the prompt
    return tasks.messages(task_mod, example, system_prompt, instruction)


try:
    tasks.check_prompt_overrides(task_mod, task, system_prompt, instruction)
    if mixed_in:  # one task: each problem prompted, graded and rewarded by its own
        task_mod = tasks.mixture(task_mod, tasks.name_of(task), mixed_in)
    reward_config = tasks.default_rewards(task_mod) if rewards is None else rewards
    reward_fns = resolve_rewards(reward_config, grade=task_mod.grade, device=device, dtype=dtype,
                                 messages=task_messages)
    reward_weights = torch.tensor([fn['weight'] for fn in reward_fns])  # advantage='gdpo'
    # the texts the model saw (openrlhf_reward's query and prompts), decoded only when asked for
    text_facts = {'query', 'prompt_text'} & declared_facts(reward_fns)
    task_tools, tool_style = tasks.tools_of(task_mod)  # (None, None): no tools
    task_answer = tasks.answer_fn(task_mod)  # what a void turn lacks (void_turn_filter)
    # the task's tools and how rollouts call them, one value (None: no tools)
    tooling = tool_settings(task_mod, max_tool_calls, tool_timeout, tool_delay_steps)
    if tooling and (decode_graphs or stop_strings):
        knob = '--decode_graphs=True decodes' if decode_graphs else '--stop_strings end'
        raise ValueError(f"{knob} rollouts without tools only; task {task!r} calls tools")
except ValueError as e:
    die(str(e), 2)
for knob, on, use in ((f'--sft_steps={sft_steps}', sft_steps > 0, 'warm start on'),
                      ("--teacher='self'", teacher == 'self', 'show the policy')):  # both need solution()
    if on and not callable(getattr(task_mod, 'solution', None)):
        also = ' (or a task mix_tasks mixes in)' if mixed_in else ''
        die(f"{knob}: task {task!r}{also} has no solution() to {use}", 2)
rank, world, device = setup(device, batch_prompts, fsdp)
ddp = world > 1 or rank > 0
master = rank == 0  # the one rank that prints, logs, plots and writes
if not chat_date:  # the day the run first started (config.json beside its checkpoints), or today
    chat_date = (run_chat_date(out_dir) if resume != 'never' else None) or str(
        datetime.now(timezone.utc).date())
try:
    day = pin_template_date(chat_date)
except ValueError as e:
    die(str(e), 2)
if ddp:  # every rank the same day (a start across midnight)
    day = pin_template_date(str(date.fromordinal(int(all_reduce([day.toordinal()], device, 'max')[0]))))
chat_date = config['chat_date'] = str(day)
if master:
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        die(f"--out_dir={out_dir}: cannot write there ({e})", 2)
    metrics.console_log(out_dir)  # what the run prints, also in out_dir/console.log (the doctor reads it)
    safety.startup_warnings(config)
faulthandler.enable(all_threads=True)  # a segfault or an abort prints the Python stacks (in console.log too)
torch.manual_seed(seed)
if deterministic or (deterministic is None and torch.device(device).type == 'cpu'):
    os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', ':4096:8')  # what cuBLAS needs to repeat
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # no NaN fill of each torch.empty
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
peaks = metrics.device_peaks(device, peak_flops, peak_bandwidth)  # (FLOP/s, bytes/s), None: unknown

# ------------------------------------------------------------------------- data
try:
    train_set = task_mod.load('train', data_dir=data_dir, seed=seed)
    test_set = task_mod.load('test', data_dir=data_dir, seed=seed)
except (ValueError, RuntimeError, FileNotFoundError) as e:
    die(f"task {task!r}: {e}")
eval_set = test_set[:eval_examples] if eval_examples > 0 else test_set
print(f"task: {task}, {len(train_set)} train / {len(eval_set)} eval problems")
extra_evals = {}  # eval_tasks and mix_tasks: name -> {'task', 'examples', 'tools'}
for spec, ddir, name in tasks.eval_entries(eval_tasks, mix_tasks):
    try:
        mod = tasks.resolve(spec)
        tasks.set_knobs(mod, config)
        examples = mod.load('test', data_dir=ddir, seed=seed)
        tools = tool_settings(mod, max_tool_calls, tool_timeout, tool_delay_steps)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        die(f"eval_tasks: {spec!r}: {e}")
    if name in extra_evals:
        die(f"eval_tasks: two entries are named {name!r} (their metrics would mix)", 2)
    if tools and stop_strings:
        die(f"eval_tasks: {spec!r} calls tools, and --stop_strings end rollouts without tools only", 2)
    examples = examples[:eval_examples] if eval_examples > 0 else examples
    extra_evals[name] = {'task': mod, 'examples': examples, 'tools': tools}
    print(f"eval task: {spec}, {len(examples)} problems (eval/{name}/...)")


def prompts_for(examples):  # token ids of each example's prompt (its messages, chat template)
    return encode_prompts(tok, task_mod, examples, system_prompt, instruction)


# ------------------------------------------------------------------------- model
shape = dict(n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head, n_embd=n_embd,
             max_seq_len=max_seq_len)
try:
    model, tok = load_model(init_from, torch.float32, device, seed, **shape)
    set_chat_template(tok, chat_template)
    set_chat_template_kwargs(tok, chat_template_kwargs)
    if prints_date(tok):  # Llama 3.2's, SmolLM3's "Today Date"
        print(f"chat template: prints today's date; {chat_date} throughout this run (chat_date)")
    # LoRA (lora_rank > 0): the base frozen, adapters added; otherwise nothing changes
    base_dtype = lora.base_dtype(lora_base_dtype, dtype, getattr(model, 'snapshot_dtypes', None))
    lora.apply(model, rank=lora_rank, alpha=lora_alpha, dropout=lora_dropout, targets=lora_targets,
               seed=seed, base_dtype=base_dtype)
    if tool_style in tool_calls.TURN_STYLES:  # calls answered through the chat template
        # refuses a template it cannot answer with
        tool_calls.template_answers(tok, task_tools, tool_style)
    if tooling and tooling['respond']:  # turns the task answers: a user turn added after the model's
        tool_calls.user_turns(tok)
except (ValueError, OSError) as e:
    die(str(e))
if max(max_new_tokens, eval_max_new_tokens) >= model.config.max_seq_len:
    die(f"--max_new_tokens={max_new_tokens} (eval_max_new_tokens={eval_max_new_tokens}): no room "
        f"left for a prompt in the model's {model.config.max_seq_len} positions (max_seq_len)"
        f"{model.config.context_note}", 2)


def fitting(examples, budget, what, task=None):  # those whose prompt leaves budget tokens' room
    try:
        limit = prompt_limit(max_prompt_len, model.config.max_seq_len, budget)
    except ValueError as e:
        die(str(e), 2)
    if task is None:  # the run's task, with its prompt knobs
        kept, long = fit_prompts(tok, task_mod, examples, limit, system_prompt, instruction)
    else:  # an eval task: its own prompts
        kept, long = fit_prompts(tok, task, examples, limit)
    fix = '--max_prompt_len' if max_prompt_len else 'max_seq_len, or lower max_new_tokens'
    if examples and not kept:
        die(f"{what}: every prompt is longer than the {limit} tokens a prompt may take (the "
            f"shortest is {min(long)}); raise {fix}", 2)
    if long:
        print(f"{what}: left out {len(long)} of {len(examples)} problems whose prompt is longer "
              f"than {limit} tokens (the longest is {max(long)}; raise {fix} to keep them)")
    return kept


train_set = fitting(train_set, max_new_tokens, 'train')


def hint_ids(example):  # teacher='self': the system turn that shows the policy the problem's solution
    text = teacher_hint.format(demonstration=task_mod.solution(example))
    return tok.render_chat([{'role': 'system', 'content': text}], add_generation_prompt=False)


if teacher == 'self':  # the problems whose solution, prompt and completion fit the model
    try:
        hinted = [len(hint_ids(ex)) + len(p) for ex, p in zip(train_set, prompts_for(train_set))]
    except (KeyError, IndexError, ValueError) as e:
        die(f"--teacher_hint={teacher_hint!r}: {e!r}; it takes one field, {{demonstration}}", 2)
    room = model.config.max_seq_len - max_new_tokens
    if not any(n <= room for n in hinted):
        die(f"--teacher='self': no problem's prompt and solution leave max_new_tokens={max_new_tokens} of "
            f"the model's {model.config.max_seq_len} positions (the shortest takes {min(hinted)})", 2)
    if max(hinted) > room:
        print(f"teacher='self': left out {sum(n > room for n in hinted)} of {len(train_set)} problems whose "
              f"prompt and solution leave fewer than max_new_tokens={max_new_tokens} positions")
        train_set = [ex for ex, n in zip(train_set, hinted) if n <= room]
if mixed_in:
    print(f"train: {metrics.mix_line(train_set, task_mod)}")
if epochs > 0:  # the run's length in passes over the training set
    max_steps = math.ceil(epochs * len(train_set) / batch_prompts)
    print(f"epochs: {epochs} x {len(train_set)} problems / {batch_prompts} a step = {max_steps} steps "
          "(max_steps)")
eval_set = fitting(eval_set, eval_max_new_tokens or max_new_tokens, 'eval')
for name, ev in extra_evals.items():
    ev['examples'] = fitting(ev['examples'], eval_max_new_tokens or max_new_tokens, f'eval/{name}',
                             task=ev['task'])
model.grad_checkpoint = grad_checkpoint
model.packed_attention = packed_attention
weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
print(f"model: {init_from} ({model.config.arch}), {model.num_params() / 1e6:.1f}M parameters "
      f"({weight_bytes / 2**30:.3g} GiB), compute {dtype} on {device}")
# the sampler: the model itself in fp32, else a low-precision copy (LoRA: of the merged weights),
# refreshed after every update
gen_model, sync_gen_model = sampler_model(model, ptdtype, fsdp)
train_model = wrap(model, device, fsdp, compile)  # DDP / FSDP / torch.compile as asked


def logprobs(net, rows, share, temp=None):
    """Per-token log-probs and entropies of rows' completions under net (batch.py), laid out with
    each group's prompt once before its completions if share (the step's layout)."""
    if temp is None:
        temp = temperature
    return completion_logprobs(net, rows, tok.pad_id, temp, share_prompt=share, dtype=ptdtype,
                               compiled=compile, head_fp32=lm_head_fp32, tiles=lm_head_tiles)


optimizer = torch.optim.AdamW(lora.param_groups(model, weight_decay), lr=lr, betas=adam_betas,
                              fused=device.startswith('cuda'))


def memory_sizes():  # GiB (and the KV cache's shape) for the out-of-memory report, when it is needed
    gib, cfg = 2**30, model.config
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    sampler = 0 if gen_model is model else sum(p.numel() * p.element_size() for p in gen_model.parameters())
    rows = batch_prompts * group_size // world
    positions = min(cfg.max_seq_len, max(map(len, prompts_for(train_set))) + max_new_tokens)
    per_position = 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * ptdtype.itemsize  # keys and values
    return {'weights': weight_bytes / gib, 'train_state': 3 * trained / gib / (world if fsdp else 1),
            'sampler': sampler / gib, 'kv_cache': rows * positions * per_position / gib, 'kv_rows': rows,
            'kv_positions': positions}


# a CUDA out-of-memory error that ends the run is followed by its phase, the sizes and what to change
safety.explain_out_of_memory(__file__, config, memory_sizes, device, rank)


def lr_at(step, peak, total, warmup, shape='cosine', floor=None):  # linear warmup, then shape's decay
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    left = {'cosine': 0.5 * (1 + math.cos(math.pi * progress)), 'linear': 1 - progress,
            'constant': 1.0}[shape]  # the share of the decay still ahead
    floor = min_lr_ratio if floor is None else floor  # the end's share of the peak
    return peak * (floor + (1 - floor) * left)


# ------------------------------------------------------------------------- resume or start fresh
step, cursor, lr_scale, rollbacks = 0, 0, 1.0, 0  # cursor: where the next step's prompts start
# adaptive_entropy: the coefficient and the last entropy measured (none yet: the bonus waits)
entropy_state = {'coef': entropy_coef, 'last': math.inf}
metrics_path = os.path.join(out_dir, 'metrics.jsonl')
guards = safety.new_guards()  # the guards' streaks, saved with checkpoints
dropped = set()  # drop_easy: indices of the training problems no longer drawn (in checkpoints)
# export_best: the best evaluation so far (in checkpoints; a resume with another metric or mode
# starts anew)
best = {'metric': export_best, 'mode': export_best_mode, 'value': None, 'step': None, 'since': 0}
# the knobs of tasks only evaluated (eval_tasks) change no training: a resume may change them
eval_only = {k for ev in extra_evals.values() for k in tasks.knobs(ev['task'])} - set(
    k for t in [task_mod, *(m[1] for m in mixed_in)] for k in tasks.knobs(t))
state = resume_run(out_dir, resume, master, model, optimizer, fsdp, config=config,
                   resume_changed=resume_changed, resume_safe=eval_only)
if master:  # the resolved config, beside the run's outputs once it goes on (a refused run writes nothing)
    try:
        save_config(config, out_dir)
    except OSError as e:
        die(f"--out_dir={out_dir}: cannot write there ({e})", 2)
if state is not None:  # None: a fresh start
    step, cursor = state['step'], state['cursor']
    lr_scale, rollbacks, guards = state['lr_scale'], state['rollbacks'], state['guards']
    entropy_state = state.get('entropy_state', entropy_state)
    dropped.update(state.get('dropped', ()))
    kept = state.get('best') or {}
    if (kept.get('metric'), kept.get('mode', 'max')) == (export_best, export_best_mode):
        best.update(kept)
    if dropped and len(dropped) >= len(train_set):
        die(f"drop_easy: all {len(train_set)} training problems were left out by step {step}: "
            "nothing is left to train on (a run with drop_easy=0 would draw them again)", 2)
    sync_gen_model()


def save(step_done, cursor, lr_scale, rollbacks, guards, entropy_state):
    """checkpoint.py: atomic, finite weights only, rank 0 writes; with the HF export."""
    run_state = {'cursor': cursor, 'lr_scale': lr_scale, 'rollbacks': rollbacks, 'guards': guards,
                 'entropy_state': entropy_state, 'dropped': sorted(dropped),
                 'ref_source': init_from, 'best': dict(best)}
    return save_run(out_dir, step_done, model, optimizer, fsdp, master, keep_last=keep_last,
                    run_state=run_state, tok=tok if export_hf else None, config=config,
                    export_dtype=getattr(torch, export_dtype or 'float32'),
                    keep_export=export_every > 0 and step_done % export_every == 0)


def keep_best(step_done, row):
    """export_best: out_dir/hf_best/ becomes these weights when row's value of that metric beats
    every evaluation before it (its grpo_run.json says which step and value)."""
    if export_best not in row:
        logged = ', '.join(sorted(k for k in row if k.startswith('eval/')))
        die(f"--export_best={export_best!r}: the evaluation logs no such metric (it logs {logged})", 2)
    sign = 1 if export_best_mode == 'max' else -1
    if best['value'] is not None and sign * row[export_best] <= sign * best['value']:
        best['since'] += 1  # early_stop: evaluations since the best
        return
    done = save_export(out_dir, 'hf_best', model, tok, fsdp, master, config={
        **config, 'step': step_done, 'best': {export_best: row[export_best]}},
        dtype=getattr(torch, export_dtype or 'float32'))
    best['since'] = 0 if done else best['since'] + 1
    if done:
        best.update(value=row[export_best], step=step_done)
        if master:
            print(f"export_best: {export_best} {row[export_best]:.4f} at step {step_done}, the best "
                  f"so far -> {os.path.join(out_dir, 'hf_best')}", flush=True)


log_metrics = metrics.metrics_log(metrics_path, master, out_dir=out_dir, wandb_log=wandb_log,
                                  project=wandb_project, run_name=wandb_run_name, config=config,
                                  tensorboard_log=tensorboard_log)


def run_eval(at_step):
    """Greedy pass@1 on the held-out problems (each rank its share), as metrics eval/*; with
    eval_samples = k, also pass@k, mean@k and maj@k of k samples at eval_temperature. Then the same
    on each of eval_tasks' sets, as eval/<name>/*."""
    t = time.time()
    main = {'task': task_mod, 'examples': eval_set, 'tools': tooling, 'system': system_prompt,
            'instruction': instruction}
    out = eval_set_metrics(at_step, '', main)
    for name, ev in extra_evals.items():
        out.update(eval_set_metrics(at_step, name, ev))
    out['timing_s/eval'] = time.time() - t
    return out


def eval_set_metrics(at_step, name, ev):
    """One held-out set's evaluation (run_eval): ev's task on its examples with its tools and
    prompt parts (none: the task's own), its metrics under eval/ (name '': the run's task) or
    eval/<name>/."""
    t = time.time()
    examples = ev['examples']
    lo = len(examples) * rank // world
    hi = len(examples) * (rank + 1) // world
    s = evaluate(gen_model, tok, ev['task'], examples[lo:hi], ev.get('system'),
                 ev.get('instruction'), max_new_tokens=eval_max_new_tokens or max_new_tokens,
                 batch_size=eval_batch_size, compile=compile_decode, progress=verbose and master,
                 n_samples=eval_samples or 1, temperature=eval_temperature, seed=seed, first=lo,
                 tools=ev['tools'], stop_strings=stop_strings)
    sampled = [key for key in s if key.startswith(('pass@', 'mean@', 'maj@')) and key != 'pass@1']
    if ddp:  # the task's own metrics are rank 0's share's
        counts = [s['n'], round(s['pass@1'] * s['n']), s['truncated'] * s['n']]
        counts += [s[key] * s['n'] for key in sampled]
        n, hits, trunc, *more = all_reduce(counts, device)
        s = {**s, 'n': int(n), 'pass@1': hits / max(n, 1), 'truncated': trunc / max(n, 1)}
        s.update({key: v / max(n, 1) for key, v in zip(sampled, more)})
    also = ''.join(f", {key} {s[key]:.3f}" for key in sampled)
    which = f" ({name})" if name else ''
    print(f"eval @ step {at_step}{which}: greedy pass@1 {s['pass@1']:.3f}{also} on {s['n']} "
          f"problems ({time.time() - t:.1f}s)", flush=True)
    prefix = f'eval/{name}/' if name else 'eval/'
    return {prefix + k: v for k, v in s.items() if k not in ('n', 'seconds')}


# ------------------------------------------------------------------------- supervised warm start
def sft_rows(examples):  # (prompt, reference solution) rows
    rows = []
    for prompt, ex in zip(prompts_for(examples), examples):
        rows.append({'prompt': prompt, 'ids': tok.encode(task_mod.solution(ex)) + [tok.eos_id]})
    return rows


def sft_logprobs(rows):
    return logprobs(train_model, rows, share_prompt is True, temp=1.0)


def sft_lr_at(it):
    return lr_at(it, sft_lr, sft_steps, max(1, sft_steps // 10), floor=0.1)  # not min_lr_ratio's


if state is None and sft_steps > 0:
    warm_start(model, sft_logprobs, optimizer, train_set, sft_rows, steps=sft_steps,
               batch_size=sft_batch_size, seed=seed + 1, lr_at=sft_lr_at)
    sync_gen_model()


# ------------------------------------------------------------------------- KL reference (beta > 0)
def initial_model():  # init_from's weights: a resumed run's reference when its start kept none
    return load_model(init_from, torch.float32, 'cpu', seed, **shape)[0]


# the frozen starting policy, kept as ref.pt beside the checkpoints (ref_sync_every: each sync's
# as ref_SSSSSSS.pt); with LoRA the model itself, its adapters off (no copy)
ref_model = None
policy = gen_model if fsdp else model  # FSDP: the sampler holds the whole weights
if state is None and master:  # a run that left no checkpoint: nothing resumes to its references
    for stale in glob.glob(os.path.join(out_dir, 'ref_[0-9]*.pt')) + glob.glob(os.path.join(out_dir, 'ref.pt')):
        os.remove(stale)
if beta != 0 and lora_rank:
    ref_model = train_model
elif beta != 0:
    initial = None if sft_steps else initial_model  # a warm start cannot be rebuilt from init_from
    ref_model = reference_model(policy, ptdtype, reference_path(out_dir, step),
                                resumed=state is not None, master=master, device=device,
                                initial=initial)


@torch.no_grad()
def sync_reference(step):
    """ref_sync_every: the reference moves to the policy, ref = alpha * policy + (1 - alpha) * ref
    (in fp32, then the reference's dtype), and is written where a resume at this step finds it."""
    for r, p in zip(ref_model.parameters(), policy.parameters()):
        r.copy_(torch.lerp(r.float(), p.float(), ref_sync_alpha))
    if ref_sync_reset_optimizer:  # AdamW's moments and step counts zeroed: a new run's, in place
        for st in optimizer.state.values():
            for t in st.values():
                t.zero_()
    if master:
        save_reference(out_dir, step, ref_model)


# ------------------------------------------------------------------------- teacher (on-policy distillation)
teacher_model = None  # frozen, in the compute dtype, whole on every rank; scores each step's completions
if teacher and teacher != 'self':
    try:
        teacher_model, teacher_tok = load_model(teacher, ptdtype, device, seed, **shape)
    except (ValueError, OSError) as e:
        die(f"--teacher={teacher!r}: {e}")
    mismatch = vocabulary_mismatch(tok, teacher_tok)
    if mismatch:
        die(f"--teacher={teacher!r}: its tokenizer's ids are not the policy's ({mismatch}); a teacher "
            "scores the policy's tokens as its own, so it needs the same tokenizer", 2)
    longest = prompt_limit(max_prompt_len, model.config.max_seq_len, max_new_tokens) + max_new_tokens
    if teacher_model.config.max_seq_len < longest:
        die(f"--teacher={teacher!r}: it takes {teacher_model.config.max_seq_len} positions and a "
            f"training row may be {longest} long; set --max_prompt_len to at most "
            f"{teacher_model.config.max_seq_len - max_new_tokens}", 2)
    teacher_model.requires_grad_(False).eval()
    teacher_model.packed_attention = packed_attention
    print(f"teacher: {teacher}, {teacher_model.num_params() / 1e6:.1f}M parameters")


if state is None:
    row = {'step': 0}
    if eval_every > 0:
        row.update(run_eval(0))
    if export_best:
        keep_best(0, row)
    log_metrics(row)
    save(0, cursor, lr_scale, rollbacks, guards, entropy_state)  # the first rollback target
last_progress = [time.time()]  # the watchdog's heartbeat: refreshed at every stage and decode step
safety.start_watchdog(last_progress, watchdog_s, out_dir, watchdog_exit)
stop_signal = safety.catch_signals()


def heartbeat():
    last_progress[0] = time.time()


def reduce_across_ranks(values, op):
    return all_reduce(values, device, op)


# ------------------------------------------------------------------------- GRPO
P, G = batch_prompts, group_size
# groups of equal rewards have a gradient only through a KL or entropy term (or, whitened over the
# step by reinforce_pp or reinforce, an advantage of their own; with kl_cov, its penalty; a teacher's)
inert = not (beta or entropy_coef or adaptive_entropy or advantage in ('reinforce_pp', 'reinforce')
             or loss_type == 'kl_cov' or (teacher and teacher_coef))
skip_zero_std = filter_zero_std and inert
moved = num_iterations > 1 or mini_batches > 1  # the policy moves within the step
if fault_kill_opt_step:  # testing: SIGKILL right after this process's N-th GRPO optimizer step
    optimizer.register_step_post_hook(safety.kill_after(fault_kill_opt_step))
print(metrics.workload_line(P, G, max_new_tokens, num_iterations, micro_batch_size, compile_decode,
                            micro_batch_tokens=micro_batch_tokens), flush=True)


def rollout(examples, first, step, timing):
    """This rank's share of examples sampled G times each and scored. Prompt i of examples is the
    step's prompt first + i, and its randomness depends on that index only. Returns the prompts, the
    indices this rank sampled, and every rank's completions and scores."""
    lo = first + rank * len(examples) // world
    hi = first + (rank + 1) * len(examples) // world
    mine = range(lo, hi)
    prompts = prompts_for(examples)
    t = time.time()
    show_progress = master and (step == 0 or verbose)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                    stop_strings=stop_strings, seed=seed * 100_003 + step, prompt_index=mine,
                    compile=compile_decode, on_step=heartbeat, graphs=decode_graphs,
                    check_every=decode_check_every)
    my_prompts = [prompts[i - first] for i in mine]
    states = tasks.rollout_states(task_mod, [examples[i - first] for i in mine], G)  # a task's own
    comps = sample_batch(gen_model, tok, my_prompts, G, max_new_tokens, tools=tooling, states=states,
                         progress=show_progress, **sampling)
    timing['gen'] = timing.get('gen', 0.0) + time.time() - t
    t = time.time()
    texts = [c['text'] for c in comps]
    graded = [examples[c['prompt_idx'] - first] for c in comps]
    extra = []  # facts a reward function may declare (reward.py)
    for c in comps:
        fact = {'n_tokens': sampled_count(c), 'truncated': c['truncated'],
                'max_new_tokens': max_new_tokens}
        if text_facts:  # special tokens as text, as OpenRLHF decodes them
            seen = prompts[c['prompt_idx'] - first]
            fact.update(query=tok.decode(seen + c['ids']), prompt_text=tok.decode(seen))
        if tooling:
            fact.update(tool_calls=c['tool_calls'], state=c.get('state'))
        if task_tools:
            c['void'] = metrics.void_turn(c, tok, task_answer)  # void_turn_filter
        extra.append(fact)
    sc = score(texts, graded, reward_fns, failure_reward=failure_reward, extra_kwargs=extra,
               step=step)
    timing['reward'] = timing.get('reward', 0.0) + time.time() - t
    comps, sc = gather_step(comps, sc)  # torchrun: every rank's completions and rewards on each
    return prompts, mine, comps, sc


def reward_values(scs):
    """Each reward function's unweighted values in score()'s results scs (per_fn: in the config's
    order), (groups, G, functions), nan where a function did not apply."""
    K = len(reward_fns)
    rows = [[math.nan if v is None else v for v in values]
            for s in scs for values in zip(*s['per_fn'].values())]  # a sample's K values
    return torch.tensor(rows, dtype=torch.float32).view(-1, G, K)


def sample_step(step, cursor, timing):
    """1-2. The step's prompts from cursor on, their completions and rewards. dynamic_sampling
    (DAPO): more rounds of prompts until P groups have a reward spread; a refill draws enough to
    fill the step at the rate seen so far. Problems drop_easy dropped are passed over. Also returns
    every group's rewards (rows of G), which groups have no spread, the rounds taken, the cursor
    after the last prompt drawn and the training problems drawn (indices)."""
    batch, index, prompts, comps, scs, owned = [], [], [], [], [], set()
    next_cursor = cursor
    n_spread = 0  # groups with a reward spread so far
    for rnd in range(1 + dynamic_sampling):
        if rnd == 0:
            n = P
        else:
            n = min(P, math.ceil((P - n_spread) * len(batch) / max(n_spread, 1)))
        drawn, next_cursor = indices_at(len(train_set), seed, next_cursor, n, skip=dropped,
                                        shuffle=shuffle)
        more = [train_set[i] for i in drawn]
        p, mine, c, sc = rollout(more, len(batch), step, timing)
        batch += more
        index += drawn
        prompts += p
        comps += c
        scs.append(sc)
        owned |= set(mine)
        rewards = torch.tensor([x for s in scs for x in s['total']], dtype=torch.float32).view(-1, G)
        per_fn = reward_values(scs)
        zero_std = zero_spread(rewards)
        if advantage == 'gdpo':  # a group has a spread if any one function's values spread
            zero_std = gdpo_advantages(per_fn, reward_weights, adv_eps)[1]
        n_spread = int((~zero_std).sum())
        if n_spread >= P:
            break
    return {'batch': batch, 'prompts': prompts, 'comps': comps, 'sc': merge_scores(scs),
            'owned': owned, 'rewards': rewards, 'per_fn': per_fn, 'zero_std': zero_std,
            'rounds': rnd + 1, 'cursor': next_cursor, 'index': index}


def train_groups(roll):
    """3. Group-relative advantages of the step's groups (dynamic sampling: the first P with a
    spread), and the rows to train on: the step's, and with mini_batches > 1 each mini-batch's
    (disjoint sets of groups, each with its own rows, loss normalisers and optimizer step)."""
    kept = keep_groups(roll['zero_std'], P) if dynamic_sampling else list(range(P))
    # completion lengths in sampled tokens (reinforce_pp, reinforce and opo weigh by them)
    lens = torch.tensor([sampled_count(c) for c in roll['comps']]).view(-1, G)[kept]
    adv, zero_std = advantages(roll['rewards'][kept], advantage, scale_rewards, adv_eps, lens=lens,
                               per_fn=roll['per_fn'][kept], weights=reward_weights)
    # void_turn_filter: completions that ended on a void turn enter no row and no normaliser (as
    # truncated ones do with mask_truncated); their rewards stayed in the advantages above
    trainable = roll['comps']
    if void_turn_filter:
        trainable = [c for c in trainable if not c.get('void')]
    prompts, owned = roll['prompts'], roll['owned']
    step_rows = train_rows(trainable, adv, zero_std, prompts, owned, kept,
                           filter_zero_std=skip_zero_std, mask_truncated=mask_truncated)
    parts = [step_rows]  # (rows, n_tok, n_seq, trained) of each mini-batch
    if mini_batches > 1:
        parts = [train_rows(trainable, adv[pos], zero_std[pos], prompts, owned,
                            [kept[k] for k in pos], filter_zero_std=skip_zero_std,
                            mask_truncated=mask_truncated)
                 for pos in mini_batch_groups(len(kept), mini_batches)]
    # trained: rows and tokens trained on over every rank, and rows of groups with a spread
    return {'kept': kept, 'adv': adv, 'zero_std': zero_std, 'trainable': trainable,
            'rows': step_rows[0], 'trained': step_rows[3], 'parts': parts}


def layout(groups):
    """The step's layout (share_prompt='auto': the cheaper for its rows) and its micro-batches,
    mini-batch after mini-batch: micro (the passes), plan (each mini-batch's end, end of its real
    passes, loss normalisers and rows that can move the policy), mini_of (each pass's mini-batch)."""
    share = share_prompt
    if share_prompt == 'auto':
        share = choose_share_prompt(groups['rows'], model.config, model.packed_kind())
    micro, plan, mini_of = [], [], []
    for part_rows, part_tok, part_seq, part_trained in groups['parts']:
        mbs = micro_batches(part_rows, micro_batch_size, share, micro_batch_tokens)  # share: groups
        n_real = len(mbs)
        if ddp:  # every rank runs as many passes: padded with passes of weight 0
            mbs = pad_micro_batches(mbs, tok.pad_id, device)
        # a mini-batch with no row that can move the policy takes no optimizer step, filter or not
        # (AdamW would move the weights on a zero gradient, by its momentum)
        moving = part_trained[2] if inert else part_trained[0]
        plan.append({'end': len(micro) + len(mbs), 'real_end': len(micro) + n_real,
                     'n_tok': part_tok, 'n_seq': part_seq, 'rows': moving})
        mini_of += [len(plan) - 1] * len(mbs)
        micro += mbs
    return {'share': share, 'micro': micro, 'plan': plan, 'mini_of': mini_of}


def real_micro(lay):
    """The layout's micro-batches less the padding passes torchrun needs (pad_micro_batches)."""
    return [mb for j, mb in enumerate(lay['micro']) if j < lay['plan'][lay['mini_of'][j]]['real_end']]


def side_logprobs(lay, groups, roll, timing, step):
    """4. Without grad: the old log-probs (when the policy moves within the step), the entropy cut
    (top_entropy_quantile < 1), the reference's log-probs (beta > 0), the teacher's (teacher); and
    the sampler's. Clip-Cov and KL-Cov's tokens are chosen here too (step_cov_select)."""
    share, micro = lay['share'], lay['micro']
    t = time.time()
    with torch.no_grad():
        old_lp = None
        if moved:
            old_lp = [logprobs(train_model, mb, share)[0] for mb in micro]
        cut = None
        if top_entropy_quantile < 1 and any(part['rows'] for part in lay['plan']):
            cut = step_entropy_cut(lay, groups, roll)
        if loss_type in ('clip_cov', 'kl_cov'):
            groups['cov_frac'] = step_cov_select(lay, groups, roll, step)
        timing['old_logprob'] = time.time() - t
        t = time.time()
        ref_lp = None
        if ref_model is not None:
            with lora.disabled(model):  # LoRA: the reference is the base; a no-op otherwise
                ref_lp = [logprobs(ref_model, mb, share)[0].float() for mb in micro]
        timing['ref'] = time.time() - t
        t = time.time()
        teacher_lp = None
        if teacher == 'self':  # the policy as it sampled, each row's prompt after its solution's turn
            hints = {g: hint_ids(roll['batch'][g]) for g in {rw['group'] for mb in micro for rw in mb} if g >= 0}
            hinted = [[{**rw, 'prompt': hints.get(rw['group'], []) + rw['prompt']} for rw in mb] for mb in micro]
            teacher_lp = [logprobs(train_model, mb, share)[0].float() for mb in hinted]
        elif teacher:
            teacher_lp = [logprobs(teacher_model, mb, share)[0].float() for mb in micro]
        if teacher:
            timing['teacher'] = time.time() - t
    # the sampler's log-probs of the same tokens
    gen_lp = [torch.tensor([x for rw in mb for x in rw['gen_logp']], device=device) for mb in micro]
    return {'old': old_lp, 'ref': ref_lp, 'teacher': teacher_lp, 'gen': gen_lp, 'cut': cut}


def skipped_rows(groups, roll):
    """This rank's rows of the zero-spread groups filter_zero_std leaves out of the update: the
    step-wide cuts (entropy, covariance) count their tokens all the same."""
    return zero_std_rows(groups['trainable'], groups['adv'], groups['zero_std'], roll['prompts'],
                         roll['owned'], groups['kept'], mask_truncated=mask_truncated)


def step_entropy_cut(lay, groups, roll):
    """top_entropy_quantile < 1: the entropy cut over the step's sampled tokens (not those a tool
    inserted), before the update, the zero-spread groups' too: filter_zero_std must not move it
    (their forward pass without grad is what the cut costs the filter)."""
    share, plan = lay['share'], lay['plan']
    passes = [(mb, j < plan[lay['mini_of'][j]]['real_end']) for j, mb in enumerate(lay['micro'])]
    if skip_zero_std:
        more = micro_batches(skipped_rows(groups, roll), micro_batch_size, share, micro_batch_tokens)
        n_real = len(more)
        if ddp:
            more = pad_micro_batches(more, tok.pad_id, device)
        passes += [(mb, k < n_real) for k, mb in enumerate(more)]
    ents = gather_tensor(sampled_entropies(lambda mb: logprobs(train_model, mb, share)[1], passes))
    return entropy_cut(ents, top_entropy_quantile)


def step_cov_select(lay, groups, roll, step):
    """loss_type 'clip_cov'/'kl_cov': the tokens loss.cov_selection picks over the step's sampled
    tokens, every rank's and the zero-spread groups' (their advantage 0) too, from the sampler's
    log-probs before the update, the same for every micro-batch, iteration and rank count (verl
    picks in each micro-batch from the current log-probs); each trained row gets its own as
    rw['cov_sel']. Clip-Cov's random draw is seeded by the run's seed, the step and the
    completion. Returns the share of tokens picked."""
    rows = [rw for mb in real_micro(lay) for rw in mb] + (skipped_rows(groups, roll) if skip_zero_std else [])
    if not rows:
        return 0.0
    acts = [sampled_tokens([rw], 'cpu') for rw in rows]  # None: every token was sampled
    picks = [torch.ones(len(rw['ids']), dtype=torch.bool) if a is None else a.bool()
             for rw, a in zip(rows, acts)]
    adv = torch.cat([torch.full((int(p.sum()),), rw['adv']) for rw, p in zip(rows, picks)])
    logp = torch.cat([torch.tensor(rw['gen_logp'])[p] for rw, p in zip(rows, picks)])
    u = torch.cat([torch.rand(int(p.sum()), generator=torch.Generator().manual_seed(
        hash((seed, step, rw['group'], rw['sample'])) % 2**62)) for rw, p in zip(rows, picks)])
    counts = gather_tensor(torch.tensor([len(adv)])).tolist()
    adv, logp, u = gather_tensor(adv), gather_tensor(logp), gather_tensor(u)
    chosen = cov_selection(adv, logp, max(1, int(cov_ratio * len(adv))), loss_type,
                           bounds=clip_cov_bounds, u=u)
    mine = chosen[sum(counts[:rank]):sum(counts[:rank + 1])].float()
    at = 0
    for rw, p in zip(rows, picks):
        sel = torch.zeros(len(rw['ids']))
        sel[p] = mine[at:at + int(p.sum())]
        rw['cov_sel'] = sel
        at += int(p.sum())
    return chosen.float().mean().item()


def schedule(step, lr_scale, entropy_state):
    """This step's learning rate, KL coefficient (ramped over kl_warmup_steps) and entropy bonus
    coefficient (adaptive_entropy: only while the last entropy was at or below the target)."""
    beta_now = beta
    if kl_warmup_steps > 0:
        beta_now = beta * min(1.0, (step + 1) / kl_warmup_steps)
    coef_now = entropy_coef
    if adaptive_entropy:
        coef_now = entropy_state['coef'] * (entropy_state['last'] <= entropy_target)
    lr_now = lr_at(step, lr, max_steps, warmup_steps, lr_schedule) * lr_scale
    return {'lr': lr_now, 'beta': beta_now, 'entropy_coef': coef_now}


def micro_loss(mb, j, part, side, share, now):
    """Pass j's loss: micro-batch mb adds its share of its mini-batch's (part's) loss, the token
    weights normalised over the whole mini-batch, so the gradient does not depend on how it is cut
    into micro-batches. Returns the loss with what the metrics read of the pass."""
    # DDP all-reduces the gradients once, in the mini-batch's last micro-batch's backward (FSDP
    # reduce-scatters each)
    no_sync = contextlib.nullcontext()
    if ddp and not fsdp and j < part['end'] - 1:
        no_sync = train_model.no_sync()
    with no_sync:
        logp, ent = logprobs(train_model, mb, share)
    lens = torch.tensor([len(rw['ids']) for rw in mb], device=logp.device)
    seq_adv = torch.tensor([rw['adv'] for rw in mb], device=logp.device)
    A = torch.repeat_interleave(seq_adv, lens)  # each token its sequence's advantage
    sampled = sampled_tokens(mb, logp.device)  # None: no tool inserted anything
    w = token_weights(lens, loss_agg, part['n_tok'], part['n_seq'], max_new_tokens, sampled=sampled)
    w = w * (j < part['real_end'])  # padding passes weigh 0
    old = side['old'][j] if side['old'] is not None else logp.detach()
    gen = side['gen'][j]
    if sampled is not None:  # the sampler drew no inserted token: ratio 1 there
        gen = torch.where(sampled.bool(), gen, old)
    isw = None  # tis: (weights, above the cap)
    if tis:
        isw = tis_weights(old, gen, lens, tis, tis_cap, floor=tis_min)
    unmasked = None  # off_policy_mask: 0 on the completions it masks, else 1
    if off_policy_mask > 0:
        unmasked = off_policy_keep(logp, gen, seq_adv, lens, off_policy_mask, sampled=sampled)
    ref = side['ref'][j] if side['ref'] is not None else None
    keep = None  # top_entropy_quantile: the tokens at or above the step's entropy cut
    if side['cut'] is not None:
        keep = (ent.detach() >= side['cut']).float()
    cov = None  # clip_cov/kl_cov: the tokens step_cov_select picked (padding rows: none)
    if loss_type in ('clip_cov', 'kl_cov'):
        cov = torch.cat([rw.get('cov_sel', torch.zeros(len(rw['ids']))) for rw in mb])
        cov = cov.to(logp.device)
    loss, st = policy_loss(logp, old, A, w, lens, eps_low=eps_low, eps_high=eps_high,
                           loss_type=loss_type, ref_logp=ref, beta=now['beta'],
                           kl_estimator=kl_estimator, kl_clamp=kl_clamp, entropy=ent,
                           entropy_coef=now['entropy_coef'], is_weight=isw[0] if isw else None,
                           clip_ratio_c=clip_ratio_c, cispo_bounds=cispo_bounds, token_mask=keep,
                           sapo_tau=(sapo_tau_pos, sapo_tau_neg), pg_mask=unmasked,
                           sampled=sampled, cov_mask=cov, kl_cov_coef=kl_cov_coef,
                           teacher_logp=None if side['teacher'] is None else side['teacher'][j],
                           teacher_coef=teacher_coef,
                           vespo_shape=(vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg))
    if unmasked is not None:
        st['masked'] = unmasked == 0
    return {'loss': loss, 'stats': st, 'w': w, 'logp': logp, 'ent': ent, 'old': old, 'gen': gen,
            'isw': isw, 'sampled': sampled}


def update(lay, side, now, n_tokens, *, skipped, fault):
    """5. The clipped policy-gradient update: num_iterations passes over the step's micro-batches,
    an optimizer step after each mini-batch's last (none if skipped, or for a mini-batch with no
    row that can move the policy; a non-finite loss or gradient ends the update). Returns the
    metrics' sums of the first iteration (the batch as the policy first saw it) and of the last
    (num_iterations > 1 or mini_batches > 1: how far the policy moved, each mini-batch's tokens
    measured at its own optimizer step), and the last gradient norm. n_tokens: the step's tokens
    trained on, over every rank."""
    for g in optimizer.param_groups:
        g['lr'] = now['lr']
    micro, plan = lay['micro'], lay['plan']
    first = metrics.rollout_sums(tis=bool(tis), masked=off_policy_mask > 0,
                                 vespo=loss_type == 'vespo', teacher=bool(teacher))
    last = metrics.moved_sums(dual=clip_ratio_c > 0, masked=off_policy_mask > 0,
                              vespo=loss_type == 'vespo')
    grad_norm, finite = 0.0, True
    for it in range(0 if skipped else num_iterations):
        for j, mb in enumerate(micro):
            part = plan[lay['mini_of'][j]]  # its mini-batch (mini_batches = 1: the whole step)
            out = micro_loss(mb, j, part, side, lay['share'], now)
            loss, w = out['loss'], out['w']
            if fault == 'nan':  # testing: fault_nan_steps
                loss = loss * float('nan')
            if fault == 'oom':  # testing: fault_oom_steps
                safety.injected_oom()
            # DDP/FSDP average the ranks' gradients; the step's gradient is their sum
            (loss * world).backward()
            if mini_batches > 1:  # the logged loss: the mean of the mini-batches' losses
                loss, w = loss / mini_batches, w / mini_batches
            real = j < part['real_end']
            if real and it == 0:
                metrics.add_rollout(first, loss, out['stats'], w, out['logp'], out['ent'],
                                    gen_logp=out['gen'], is_weight=out['isw'], n_tokens=n_tokens,
                                    sampled=out['sampled'])
            if real and it == num_iterations - 1 and moved:
                metrics.add_moved(last, out['stats'], out['logp'], out['old'], n_tokens,
                                  sampled=out['sampled'])
            if j < part['end'] - 1:  # the mini-batch's optimizer step follows its last micro-batch
                continue
            if ddp and j == len(micro) - 1 and it == 0:  # each rank summed its own tokens' shares
                metrics.reduce_metrics(first, reduce_across_ranks)
            if ddp and j == len(micro) - 1 and it == num_iterations - 1 and moved:
                metrics.reduce_metrics(last, reduce_across_ranks)
            if part['rows'] == 0:  # a mini-batch with nothing to train on takes no step
                continue
            max_norm = grad_clip if grad_clip > 0 else float('inf')
            grad_norm = clip_grad_norm(model.parameters(), max_norm)
            finite = math.isfinite(grad_norm) and math.isfinite(first['sum']['loss'])
            if not finite:
                break
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if not finite:
            break
    optimizer.zero_grad(set_to_none=True)  # a skipped (non-finite) update leaves no gradient behind
    sync_gen_model()
    return {'first': first, 'last': last, 'grad_norm': grad_norm}


def step_metrics(step, roll, groups, lay, cut, upd, *, now, timing, skipped, compiled):
    """6. The step's metrics row (metrics.py): rewards and rollouts, the update's sums, what was
    trained on and the coefficients applied; compiled: metrics.compile_totals() at the step's
    start."""
    graphs, seconds = metrics.compile_totals()
    timing['compile'] = seconds - compiled[1]  # torch.compile's share of the phases' seconds
    if ddp:  # the slowest rank's: the step waits for it
        timing = dict(zip(timing, all_reduce(list(timing.values()), device, 'max')))
    m = {'step': step, 'lr': now['lr'], 'compile/graphs': graphs - compiled[0]}
    m.update(metrics.rollout_metrics(roll['rewards'], roll['zero_std'], roll['sc'], roll['comps'],
                                     roll['prompts'], timing))
    if mixed_in:  # each task's prompts and mean reward
        m.update(metrics.mix_metrics(roll['batch'], roll['rewards'], task_mod))
    if drop_easy:  # the training problems no longer drawn when this step drew
        m['data/dropped'] = len(dropped)
    if dynamic_sampling:
        m['dynamic/prompts'] = len(roll['batch'])
        m['dynamic/rounds'] = roll['rounds']
        m['dynamic/groups_short'] = P - len(groups['kept'])
    prompt_lens = [len(roll['prompts'][c['prompt_idx']]) for c in roll['comps']]
    m.update(metrics.perf_metrics(model, gen_model, timing, micro=real_micro(lay), share=lay['share'],
                                  passes=num_iterations, comps=roll['comps'], prompt_lens=prompt_lens,
                                  world=world, peaks=peaks))
    m.update(metrics.metrics_of(upd['first']))
    m['grad_norm'] = upd['grad_norm']
    if moved and not skipped:
        m.update(metrics.metrics_of(upd['last']))
    n_trained, t_trained = groups['trained'][:2]
    m.update({'kl_coef': now['beta'], 'rows_trained': n_trained, 'tokens_trained': t_trained,
              'packed': int(lay['share']), 'micro_batches': len(lay['micro'])})
    if cut is not None:
        m['entropy_cut'] = cut
    if 'cov_frac' in groups:  # clip_cov/kl_cov: the share of the step's tokens picked
        m['cov/selected_frac'] = groups['cov_frac']
    if adaptive_entropy:  # the coefficient this step applied; the next step's from its entropy
        m['entropy_coef'] = now['entropy_coef']
    return m


def next_entropy_state(entropy_state, entropy):
    """adaptive_entropy: the coefficient moved by the entropy just measured, which it remembers."""
    coef = adapt_entropy_coef(entropy_state['coef'], entropy, target=entropy_target,
                              delta=entropy_coef_delta, lo=entropy_coef_min, hi=entropy_coef_max)
    return {'coef': coef, 'last': entropy}


def report(step, m, roll, guards, rollbacks, skipped):
    """6. Warnings, the evaluation when due, the guards (safety.py, their streaks in guards), the
    row logged and printed, a few samples; a stop on the KL (on_kl_max='stop') or on zero reward.
    Returns the guard's action: None, or (kind, why) to roll back."""
    m.update(metrics.mem_stats(device))
    has_kl = ref_model is not None  # the KL is only measured against a reference
    m.update(safety.warn(guards, m, skipped=skipped, max_new_tokens=max_new_tokens,
                         kl_warn=kl_warn if has_kl else None,
                         micro=(micro_batch_size, micro_batch_tokens, world)))
    evaluated = eval_every > 0 and (step % eval_every == 0 or step == max_steps)
    if evaluated:
        m.update(run_eval(step))
    sc, comps = roll['sc'], roll['comps']
    action, finite = safety.guard(guards, m, sc, [c['text'] for c in comps], skipped=skipped,
                                  nan_patience=nan_patience, kl_max=kl_max if has_kl else None)
    if action and action[0] == 'kl' and on_kl_max == 'stop':
        log_metrics({**m, 'guard/kl_stop': 1})
        safety.stop(action[1] + "; lower lr, raise beta, or raise kl_max if this KL is expected",
                    master)
    m['guard/nan_streak'] = guards['nan_streak']
    m['guard/zero_reward_streak'] = guards['zero_streak']
    m['guard/rollbacks'] = rollbacks
    m['guard/skipped_update'] = int(skipped or not finite)
    if export_best and evaluated and not action and finite:  # never weights a guard rejects
        keep_best(step, m)
    samples = None  # a few completions: samples.jsonl, and a wandb table with wandb_log
    if master and log_samples_every > 0 and step % log_samples_every == 0:
        samples_path = os.path.join(out_dir, 'samples.jsonl')
        samples = metrics.log_samples(samples_path, step, comps, roll['batch'], roll['prompts'],
                                      sc['total'], tok=tok, task=task_mod)
    log_metrics(m, samples=samples)
    print(metrics.step_line(m), flush=True)
    if guards['zero_streak'] >= zero_reward_patience and advantage != 'none':  # 'none': rewards train nothing
        safety.stop(safety.zero_reward_report(guards, sc, zero_reward_patience), master)
    return action


def roll_back(action, lr_scale, rollbacks, guards):
    """Back to the newest checkpoint older than the weights that tripped the guard (those that
    step `since` started from, saved at since - 1: the non-finite streak's first step, or the step
    whose KL was too high) at a lower learning rate, to go on with new data; past max_rollbacks, or
    with no such checkpoint on disk, a stop with a diagnosis. Returns the new lr_scale and rollbacks."""
    kind, why = action
    since = step - guards['nan_streak'] + 1 if kind == 'rollback' else step
    rollbacks += 1
    lr_scale *= rollback_lr_scale
    guards['nan_streak'] = 0
    if rollbacks > max_rollbacks:
        safety.stop(f"{why}; already rolled back {max_rollbacks} times (max_rollbacks). "
                    "Lower lr, check the data and the reward; the last good checkpoint is in "
                    "out_dir.", master)
    path, good = roll_back_files(out_dir, master, before=since - 1, step=step)
    if good is None:
        safety.stop(f"{why}; no checkpoint older than the weights step {since} started from is left "
                    f"to roll back to (keep_last={keep_last}, save_every={save_every}). Lower lr, "
                    "or keep more checkpoints", master)
    load_state(model, optimizer, good['model'], good['optimizer'], fsdp)
    sync_gen_model()
    dropped.clear()  # the problems left out as of that checkpoint
    dropped.update(good.get('dropped', ()))
    # best (export_best) stays: it describes the hf_best/ on disk, which a later evaluation must beat
    if ref_sync_every:  # the reference that checkpoint's step had
        ref_model.load_state_dict(load_checkpoint(reference_path(out_dir, good['step']), device))
    print(f"guard: {why} -> rolled back to {path} (step {good['step']}); lr scale now "
          f"{lr_scale} (rollback {rollbacks}/{max_rollbacks}); continuing with new data",
          flush=True)
    return lr_scale, rollbacks


def stopped_early():
    """early_stop: True (and says so) when export_best's metric has had no new best for that many
    evaluations in a row."""
    if not early_stop or best['since'] < early_stop:
        return False
    if master:
        print(f"early_stop: {export_best} has not beaten {best['value']:.4f} (step {best['step']}) in "
              f"{best['since']} evaluations; stopping at step {step}. hf_best/ holds step {best['step']}'s "
              "weights", flush=True)
    return True


def drop_solved(roll):
    """drop_easy: the step's problems whose group's mean reward reached it are not drawn again.
    Returns True when none is left."""
    means = roll['rewards'].mean(dim=1).tolist()
    dropped.update(i for i, m in zip(roll['index'], means) if m >= drop_easy)
    if len(dropped) < len(train_set):
        return False
    print(f"drop_easy: all {len(train_set)} training problems reached a mean reward of "
          f"{drop_easy}; nothing is left to train on, stopping at step {step}", flush=True)
    return True


def checkpoint(step, cursor, lr_scale, rollbacks, guards, entropy_state):
    """7. The KL reference moved every ref_sync_every steps (before the checkpoint, which resumes
    to it); a checkpoint every save_every steps, at the end, at export_every and when a signal asks
    to stop (then the exit); the curves every plot_every steps."""
    heartbeat()
    if ref_sync_every and step % ref_sync_every == 0:
        sync_reference(step)  # the KL anchor moves to the policy as it is now
    # a signal to any rank stops them all, here
    stopping = all_reduce([float(bool(stop_signal))], device, 'max')[0] > 0
    due = stopping or bool(save_every and step % save_every == 0) or step == max_steps
    due = due or bool(export_every and step % export_every == 0)  # export_every: kept exports
    # never inside a non-finite streak: a rollback must not return to the weights that caused it
    saved = due and guards['nan_streak'] == 0 and save(step, cursor, lr_scale, rollbacks, guards, entropy_state)
    if master and plot_every > 0 and (step % plot_every == 0 or step == max_steps):
        plot_metrics(metrics_path, os.path.join(out_dir, 'curves.png'))
    if stopping:
        sig = stop_signal[0] if stop_signal else int(signal.SIGTERM)
        what = f"checkpoint saved at step {step}" if saved else "no checkpoint of this step (see above)"
        print(f"signal {sig}: {what}; exiting. Rerun the same command to resume.")
        finish(128 + sig)


if state is not None and stopped_early():  # resumed after an early stop: nothing is left to do
    finish(0)
while step < max_steps:
    t_step, timing, compiled = time.time(), {}, metrics.compile_totals()
    mark = metrics.stage_marker(step + 1, t_step, last_progress, verbose, device)
    prof = metrics.profile_start(device) if step + 1 == profile_step and master else None
    # 1-2. prompts, completions, rewards (dynamic_sampling: until P groups have a reward spread)
    roll = sample_step(step, cursor, timing)
    mark(f"generated and scored {len(roll['comps'])} completions")
    # 3. group-relative advantages, the rows to train on and their micro-batches
    groups = train_groups(roll)
    lay = layout(groups)
    # 4. old (when the policy moves within the step) and reference (beta > 0) log-probs, no grad
    side = side_logprobs(lay, groups, roll, timing, step)
    mark("old/ref log-probs computed")
    # 5. policy-gradient update; none when no row can move the policy or every reward failed
    t = time.time()
    now = schedule(step, lr_scale, entropy_state)
    fault = safety.injected_faults(step + 1, fault_nan_steps, fault_stall_step, fault_stall_s, fault_oom_steps)
    skipped = not any(part['rows'] for part in lay['plan']) or (roll['sc']['all_failed'] and advantage != 'none')
    upd = update(lay, side, now, groups['trained'][1], skipped=skipped, fault=fault)
    timing['update'] = time.time() - t
    mark("update done")
    if prof is not None:
        table = metrics.profile_stop(prof, step + 1, out_dir, device, trace=profile_trace)
        print(f"profile of step {step + 1}: {table}")
    step, cursor = step + 1, roll['cursor']
    # 6. metrics, warnings, guards
    timing['step'] = time.time() - t_step
    m = step_metrics(step, roll, groups, lay, side['cut'], upd, now=now, timing=timing,
                     skipped=skipped, compiled=compiled)
    if adaptive_entropy and not skipped:  # the next step's coefficient, from this step's entropy
        entropy_state = next_entropy_state(entropy_state, m['entropy'])
    action = report(step, m, roll, guards, rollbacks, skipped)
    if action is not None:  # back to the newest checkpoint at a lower lr, on with new data
        lr_scale, rollbacks = roll_back(action, lr_scale, rollbacks, guards)
        continue
    if (drop_easy and drop_solved(roll)) or stopped_early():  # all solved, or no new best in early_stop evals
        save(step, cursor, lr_scale, rollbacks, guards, entropy_state)
        break
    # 7. reference moved (ref_sync_every), checkpoint (save_every, at the end, on a signal), curves
    checkpoint(step, cursor, lr_scale, rollbacks, guards, entropy_state)
print(f"done: {step} steps. metrics: {metrics_path}, curves: {os.path.join(out_dir, 'curves.png')}")
finish(0)
