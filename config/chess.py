# GRPO on a RookWorld-LM-style model (GPT-2 124M trained from scratch on chess text: 50257 tokens,
# 1024 positions, 768/12/12), one GPU:
#   python train_grpo.py config/chess.py --init_from=PATH_OR_HUB_ID
# The prompts are raw text, as the model was trained ('P: <fen>', 'A: <fen>+<move>+<history>+'), no
# chat template; its snapshot's old tokenizer layout (vocab.json + merges.txt) stops at
# <|endoftext|>. Rewards are python-chess oracles (tasks/chess.py): legality, mate in one, the
# environment's exact next state with partial credit per FEN field. The reference GRPO run on this
# model died on its KL limit: a KL summed over the sequence, and dropout on in the policy only; here
# the KL is per token (k3), policy and reference score the same ids with no dropout (it is exactly 0
# at the first step, tests/test_chess.py), and crossing kl_max rolls back at half the learning rate
# instead of stopping.
out_dir = 'out/chess'
# the published weights' hub id (unchecked here: offline); or a snapshot dir
init_from = 'jrahn/RookWorld-LM-124M'
task = 'chess'
chess_subtask = 'policy,mate,environment'  # interleaved, so eval_examples=600 is 200 of each
# per sub-task; mate positions are slow to find by random play (about 20/s): a minute or two
chess_n_train = 2000
chess_n_test = 200
# the environment also sees illegal moves: -1.0 and truncated, state unchanged
chess_illegal_frac = 0.05
group_size = 8
batch_prompts = 32  # 256 completions per step
micro_batch_size = 64
# policy completions run 86-124 GPT-2 tokens (about half of them padding spaces), env 32-62
max_new_tokens = 144
temperature = 1.0
lr = 2e-6
warmup_steps = 10
max_steps = 300
# per-token KL to the frozen start: keeps the world model (A:) from drifting while the policy (P:)
# moves
beta = 0.04
kl_estimator = 'k3'
kl_max = 1.0  # per-token KL; crossing it rolls back to the last checkpoint at half the lr ...
on_kl_max = 'rollback'  # ... rather than ending the run
max_rollbacks = 3
eval_every = 25
eval_examples = 600  # pass@1 is each sub-task's grade: B: legal, B: mates, the exact next state
save_every = 25
