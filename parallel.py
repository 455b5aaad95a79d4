"""
Several processes, one run (torchrun: one process per GPU): start-up, the collectives the loop
needs, and an exit that every rank takes cleanly. In a single process every function here is a no-op
or the identity.
"""
import os
import sys

import torch
import torch.distributed as dist

from reward import merge_scores


def setup(device, batch_prompts, fsdp):
    """(rank, world, device). torchrun sets RANK: join the process group; each rank samples and
    trains on its share of the prompts, rank 0 alone prints and writes. Errors exit with code 2
    through die()."""
    if int(os.environ.get('RANK', -1)) == -1:
        if fsdp:
            die("--fsdp=True shards the model across ranks: launch with torchrun (see README)", 2)
        if device.startswith('cuda'):  # 'cuda:1' the current device too: CUDA's RNG state, memory
            torch.cuda.set_device(device)  # statistics, CUDA graphs and Triton's launches use that one
        return 0, 1, device
    rank = int(os.environ['RANK'])
    world = int(os.environ['WORLD_SIZE'])
    if batch_prompts % world:
        die(f"--batch_prompts={batch_prompts} must be divisible by the number of ranks ({world}): "
            "each rank samples whole groups", 2)
    if device.startswith('cuda'):
        device = f"cuda:{os.environ['LOCAL_RANK']}"
        torch.cuda.set_device(device)
    dist.init_process_group('nccl' if device.startswith('cuda') else 'gloo')
    if rank != 0:
        # one voice: the other ranks' lines would repeat rank 0's
        sys.stdout = open(os.devnull, 'w')
    return rank, world, device


def wrap(model, device, fsdp, compile):
    """The module the update runs: FSDP2 shards each block (weights gathered for its forward and
    backward, then freed; gradients reduce-scattered), torch.compile'd if asked, DDP all-reduces
    gradients in backward."""
    if fsdp:
        from torch.distributed.fsdp import fully_shard
        for block in model.h:
            fully_shard(block)
        fully_shard(model)
    # dynamic=True: packed rows change length every micro-batch, so a first graph at fixed sizes
    # would be thrown away at the second shape (Dynamo recompiles with dynamic sizes then anyway)
    net = torch.compile(model, dynamic=True) if compile else model  # sampler, reference: eager
    if dist.is_initialized() and not fsdp:
        from torch.nn.parallel import DistributedDataParallel as DDP
        device_ids = [torch.device(device).index] if device.startswith('cuda') else None
        net = DDP(net, device_ids=device_ids, broadcast_buffers=False)
    return net


def clip_grad_norm(params, max_norm):
    """Clip the gradients to a total norm of max_norm (inf: no clip); the total norm, a float that
    is the same on every rank. Under FSDP2 the norm is a DTensor: before torch 2.11 its placement
    is a partial norm, whose .item() is this rank's shard's norm alone (rank 0 logged a wrong
    grad_norm, and ranks could disagree on whether it was finite); .full_tensor() reduces it."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return (norm.full_tensor() if hasattr(norm, 'full_tensor') else norm).item()


def all_reduce(values, device, op='sum'):
    """A list of floats summed (or maxed) over ranks; unchanged in one process."""
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, dist.ReduceOp.SUM if op == 'sum' else dist.ReduceOp.MAX)
    return t.tolist()


def barrier():
    if dist.is_initialized():
        dist.barrier()


def gather_step(comps, sc):
    """Every rank's completions (less their per-token log-probs, needed only where they are trained
    on) and reward scores, on every rank, in prompt order: the whole step as one process sees it."""
    if not dist.is_initialized():
        return comps, sc
    rank = dist.get_rank()
    parts = [None] * dist.get_world_size()
    light = [{k: v for k, v in c.items() if k != 'logprobs'} for c in comps]
    dist.all_gather_object(parts, (light, sc))
    parts[rank] = (comps, sc)
    all_comps = [c for cs, _ in parts for c in cs]
    return all_comps, merge_scores([s for _, s in parts])


def gather_tensor(x):
    """A 1-D tensor of each rank's values, joined in rank order on every rank (unchanged in one
    process)."""
    if not dist.is_initialized():
        return x
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, x.cpu())
    return torch.cat(parts).to(x.device)


# what must run before this process ends by os._exit, which skips atexit's functions (console.log's copy)
BEFORE_EXIT = []


def hard_exit(code):
    """os._exit(code), after BEFORE_EXIT's functions."""
    for fn in BEFORE_EXIT:
        fn()
    os._exit(code)


def finish(code=0, together=True):
    """Exit. Under torchrun: (when every rank gets here together) a barrier and the process group
    torn down, then os._exit, skipping interpreter teardown: gloo's worker threads may still be
    dropping finished work that holds tensors, need the GIL for it while Python finalizes, and abort
    the rank ("terminate called without an active exception", pytorch#179291; DDP keeps the group
    alive, so destroy_process_group does not join those threads)."""
    # wandb_log: flush its run before os._exit can skip that
    if getattr(sys.modules.get('wandb'), 'run', None) is not None:
        sys.modules['wandb'].run.finish(exit_code=code)
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        if together:
            dist.barrier()
            dist.destroy_process_group()
        hard_exit(code)
    sys.exit(code)


def die(msg, code=1):
    """One line on stderr and a non-zero exit, from any rank."""
    print(f"error: {msg}", file=sys.stderr, flush=True)
    finish(code, together=False)
