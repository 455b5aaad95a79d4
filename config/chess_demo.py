# The chess demo: a ~1M-parameter model from scratch (byte tokenizer) learns to name a legal move,
# on a CPU in minutes:
#     python train_grpo.py config/chess_demo.py
# 'P: <fen> B:' -> ' <uci move>', graded by python-chess: right when the move is legal in the
# position (tasks/chess.py, the 'move' sub-task; eval/pass@1 = eval/legal_rate, greedy, 200
# held-out positions from the first 10 plies of random games, both sides to move). The supervised
# warm start is deliberately short (60 steps on uniformly drawn legal moves): enough to write one
# well-formed UCI move and stop, not enough to tie the squares to the position, so its greedy move
# is legal almost nowhere and about 1% of its samples at T=1 are legal. GRPO, rewarded for legality
# only, moves the probability to the samples that were legal: a pawn push that is legal in many
# positions.
# Measured (README, "Chess demo (CPU)"), 2-core CPU shared with other jobs (load average 5-6),
# OMP_NUM_THREADS=1, three seeds run at once: eval/pass@1 0.005 -> 0.355 (seed 1337, the default),
# 0.000 -> 0.380 (--seed=1), 0.030 -> 0.405 (--seed=2), the rise complete by step 10; about 308 s
# wall each, warm start (~107 s) included.
# What GRPO finds is ONE move played everywhere (a7a6, b2b3, g2g3 for the three seeds): legal
# wherever that side is to move and the pawn is free, ~0.36-0.40; it does not yet read whose move
# it is (the best such single move per side is legal in ~0.8 of these positions).
out_dir = 'out/chess_demo'
init_from = 'scratch'
task = 'chess'  # tasks/chess.py: its knobs below
chess_subtask = 'move'
chess_max_plies = 10  # positions from the first 10 plies of random games (both sides to move)
chess_n_train = 5000
n_layer = 4
n_embd = 128
n_head = 4
n_kv_head = 2
max_seq_len = 96  # prompts run to about 75 bytes here, completions 6 (' e2e4' and the stop)
sft_steps = 60  # format only: one UCI move after 'B:', then stop
sft_lr = 3e-3
sft_batch_size = 32
group_size = 8
batch_prompts = 64  # 512 completions per step
micro_batch_size = 512
max_new_tokens = 8
temperature = 1.0
# far above the arithmetic demo's 2e-4: 5-token completions, about 1% of samples legal at first
lr = 1e-3
warmup_steps = 3
max_steps = 60
rewards = [{'name': 'correct', 'weight': 1.0}]  # legality, the grade
eval_every = 10
eval_examples = 200
save_every = 20
plot_every = 20
device = 'cpu'
dtype = 'float32'
