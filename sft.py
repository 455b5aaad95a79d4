"""
The supervised warm start: cross-entropy on a task's reference solutions before GRPO, for models
that cannot yet produce an answer RL could reward (the offline demo's model from scratch). Same
model, optimizer and batch layout as the GRPO update; the optimizer's moments are cleared after it,
so GRPO starts with fresh Adam statistics.
"""
import time

import torch

from data import batch_at


def warm_start(model, logprobs, optimizer, examples, to_rows, *, steps, batch_size, seed, lr_at):
    """steps of AdamW on -mean log p(solution tokens | prompt) at learning rate lr_at(step), grad
    clip 1. logprobs(rows) -> (per-token log-probs, entropies) at temperature 1; to_rows(examples)
    -> rows {'prompt', 'ids'} with the solution's ids; examples are drawn in their own deterministic
    order (seed)."""
    print(f"sft: {steps} steps of cross-entropy on reference solutions, batch {batch_size}")
    t0, cursor = time.time(), 0
    for it in range(steps):
        batch, cursor = batch_at(examples, seed, cursor, batch_size)
        loss = -logprobs(to_rows(batch))[0].mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for g in optimizer.param_groups:
            g['lr'] = lr_at(it)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if it % 50 == 0 or it == steps - 1:
            print(f"sft {it:4d} | loss {loss.item():.4f} | lr {lr_at(it):.3e} | {time.time() - t0:.1f}s",
                  flush=True)
    optimizer.state.clear()
