# The offline demo: a 0.3M-parameter model from scratch (byte tokenizer) on the built-in arithmetic
# word problems, on a CPU in minutes:  python train_grpo.py config/arith.py
# The warm start imitates two teachers of "46+7": a hurried one that states the sum at once and
# drops the carry ("46+7=43", right only when no carry or borrow is needed: about half the problems)
# and a careful one that counts on, one at a time ("46+7: 47(1) 48(2) ... 53(7)", always right).
# The first writes 60% of the solutions, so the warm start's greedy answer is the hurried one (about
# 0.5 right, however well it learned), while about 40% of its samples count on, nearly always
# right. GRPO, rewarded for the right answer only, finds that counting pays.
# Measured on 2 CPU cores, 5 seeds (README, Offline demo): greedy pass@1 0.47-0.54 after the warm
# start, 0.965-0.99 after 40 GRPO steps; about 3 minutes a run.
# `python scripts/arith_probe.py out/arith/hf` shows the styles learned.
out_dir = 'out/arith'
init_from = 'scratch'
task = 'arith'  # tasks/arith.py: its knobs below
arith_difficulty = 'starter'  # "Liz has 80 books and sells 7. ..." -> "80-7=73\n#### 73"
# share of training solutions worked by counting on: "80-7: 79(1) 78(2) ... 73(7)\n#### 73"
arith_count_on = 0.4
# share of the rest whose sum drops the carry or borrow: "80-7=83\n#### 83" (tasks/arith.py slip)
arith_slips = 1.0
n_layer = 4
# 0.3M parameters: learns both styles at a third of the 128-wide model's cost per step
n_embd = 64
n_head = 4
n_kv_head = 2
max_seq_len = 256
# counting on emerges between steps 1,600 and 2,400, and is reliable (0.96+ when forced) by 4,000
sft_steps = 4000
sft_lr = 2e-3
# learns more per example seen: 3,200 x 8 counts far better than 800 x 32 (README)
sft_batch_size = 8
group_size = 8
batch_prompts = 32  # 256 completions per step
# whole groups: each prompt runs once per forward, its 8 completions packed after it
micro_batch_size = 256
max_new_tokens = 80  # counting on 9 steps from 95 takes about 70 bytes
temperature = 1.0
lr = 2e-4  # RL wants a far smaller step than the warm start's 3e-3
warmup_steps = 5
max_steps = 40
rewards = [{'name': 'correct', 'weight': 1.0}]
eval_every = 10
eval_examples = 200
save_every = 20
plot_every = 10
device = 'cpu'
dtype = 'float32'
