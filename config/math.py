# GRPO on MATH (competition mathematics) from Qwen2.5-Math-1.5B, the base model, on one GPU
# (H100-class): RL straight from a math base model, as SimpleRL-Zoo and Dr. GRPO do.
#   python train_grpo.py config/math.py --data_dir=../shared/math
# The base model already reasons in LaTeX; with Qwen2.5-Math's system prompt ("... put your final
# answer within \boxed{}") GRPO mostly teaches it to finish and box one answer. Watch reward/mean,
# eval/pass@1 (the 500-problem subset), eval/boxed and trunc_frac, not loss. docs/math.md: grading.
out_dir = 'out/math'
init_from = 'Qwen/Qwen2.5-Math-1.5B'  # or a local snapshot directory; -Instruct starts near its ceiling
task = 'math'  # tasks/math.py: Qwen2.5-Math's \boxed{} system prompt, math-verify grading
data_dir = ''  # '' downloads DigitalLearningGmbH/MATH-lighteval; offline --data_dir=../shared/math
math_levels = [3, 4, 5]  # the training problems (5,584), as SimpleRL-Zoo and Dr. GRPO train
math_types = []  # all seven subjects
math_test_size = 500  # eval: 500 test problems of every level, in sha256 order (tasks/math.py)
math_grade_timeout_s = 5.0  # a pathological answer costs at most this, then counts as wrong
group_size = 8
batch_prompts = 32  # 256 completions per step
micro_batch_size = 8  # long rows: fewer per forward/backward
# Qwen2.5-Math has 4,096 positions. The longest MATH problems (~4,300 characters, Asymptote
# figures) are ~1,500 tokens at ~3 characters a token, so 2,560 new tokens leave them room; most
# solutions are far shorter, and trunc_frac says when they are not
max_new_tokens = 2560
grad_checkpoint = True  # long completions: trade recompute for activation memory
temperature = 1.0
lr = 1e-6
warmup_steps = 10
max_steps = 350  # 2 epochs of the level 3-5 problems at 32 per step
beta = 0.0  # no reference model: saves its memory and a forward pass (Dr. GRPO, DAPO)
rewards = [{'name': 'correct', 'weight': 1.0}]  # 1 when math-verify agrees, else 0; no format term
eval_every = 50
eval_examples = 500
export_best = 'eval/pass@1'  # out_dir/hf_best/: the weights of the best evaluation so far
save_every = 50
