# The offline demo: a ~1M-parameter model from scratch (byte tokenizer) on the built-in arithmetic word problems,
# on a CPU in minutes:  python train_grpo.py config/arith.py
# The reference solutions show two ways to get "46+7": 70% state the sum at once ("46+7=53"), 30% count on one at a
# time ("46+7: 47(1) 48(2) ... 53(7)"). The supervised warm start imitates both: its greedy answer always states
# the sum (about 57% right: a tiny model's arithmetic is shaky), while counting on, which it picks in about a
# quarter of its samples, is about 95% right. GRPO, rewarded for the right answer only, finds that counting pays.
# Measured on 2 CPU cores: greedy pass@1 0.570 after the warm start, 0.96 after 20 GRPO steps (README, Offline demo).
out_dir = 'out/arith'
init_from = 'scratch'
task = 'arith'  # tasks/arith.py: its knobs below
arith_difficulty = 'starter'  # "Liz has 80 books and sells 7. ..." -> "80-7=73\n#### 73"
arith_count_on = 0.3  # share of training solutions worked by counting on: "80-7: 79(1) 78(2) ... 73(7)\n#### 73"
n_layer = 4
n_embd = 128
n_head = 4
n_kv_head = 2
max_seq_len = 256
sft_steps = 1600  # copying the numbers emerges around step 500, counting on and some arithmetic after
sft_lr = 3e-3
sft_batch_size = 32
group_size = 8
batch_prompts = 64  # 512 completions per step
micro_batch_size = 256  # whole groups: each prompt runs once per forward, its 8 completions packed after it
max_new_tokens = 80  # counting on 9 steps from 95 takes about 70 bytes
temperature = 1.0
lr = 2e-4  # RL wants a far smaller step than the warm start's 3e-3
warmup_steps = 5
max_steps = 50
rewards = [{'name': 'correct', 'weight': 1.0}]
eval_every = 10
eval_examples = 200
save_every = 25
plot_every = 10
device = 'cpu'
dtype = 'float32'
