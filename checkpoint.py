"""
Checkpoints that a kill at any instant cannot corrupt, and resume that picks the newest one that loads.

A checkpoint is one torch.save file, ckpt_{step:07d}.pt, written to a temporary name, fsync'd, then renamed over:
a reader sees the old file or the new one, never half of one. The directory is fsync'd after the rename so the
rename itself survives a power cut.
"""
import copy
import glob
import json
import os
import random
import time

import numpy as np
import torch


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path, write_fn):
    """write_fn(file object) writes the content; the file appears at path only once complete and on disk."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, 'wb') as f:
            write_fn(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def rng_state():
    state = {'python': random.getstate(), 'numpy': np.random.get_state(), 'torch': torch.get_rng_state()}
    if torch.cuda.is_available():
        state['cuda'] = torch.cuda.get_rng_state()  # this rank's device only: touching every GPU from every rank
        # would create a CUDA context on each of them
    return state


def set_rng_state(state):
    random.setstate(state['python'])
    np.random.set_state(state['numpy'])
    torch.set_rng_state(state['torch'])
    if 'cuda' in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state['cuda'])


def list_checkpoints(out_dir):
    """Newest first."""
    return sorted(glob.glob(os.path.join(out_dir, 'ckpt_*.pt')), reverse=True)


def save_checkpoint(out_dir, step, state, keep_last):
    path = os.path.join(out_dir, f'ckpt_{step:07d}.pt')
    atomic_write(path, lambda f: torch.save(state, f))
    for old in list_checkpoints(out_dir)[max(keep_last, 1):]:
        os.remove(old)
    return path


def load_newest_everywhere(out_dir, master=True):
    """load_newest on every rank of a run; rank 0 looks first, as it also deletes half-written files."""
    from parallel import barrier
    found = load_newest(out_dir) if master else None
    barrier()
    return found if master else load_newest(out_dir)


def load_newest(out_dir, map_location='cpu'):
    """(path, state) of the newest checkpoint that loads; a broken one is reported and the next older one tried."""
    for tmp in glob.glob(os.path.join(out_dir, '*.tmp.*')):  # left by a write that was killed: never complete
        os.remove(tmp)
    for path in list_checkpoints(out_dir):
        try:
            state = torch.load(path, map_location=map_location, weights_only=False)
            if 'step' not in state or 'model' not in state:
                raise ValueError("missing 'step' or 'model'")
            return path, state
        except Exception as e:
            print(f"resume: {path} does not load ({type(e).__name__}: {str(e).splitlines()[0][:200]}); trying an older one")
    return None, None


def trim_metrics(path, last_step):
    """Drop metric rows after last_step (written after the checkpoint we resume from) and any torn last line,
    so a resumed run appends without duplicate steps."""
    if not os.path.exists(path):
        return
    keep = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line torn by the kill
            if row.get('step', 0) <= last_step:
                keep.append(json.dumps(row) + '\n')
    atomic_write(path, lambda f: f.write(''.join(keep).encode()))


# ----------------------------------------------------------------------------- a run's checkpoints

def resume_run(out_dir, resume, master, model, optimizer, fsdp):
    """resume='auto': load the newest checkpoint in out_dir that loads into model and optimizer, restore the RNG
    state, trim metrics.jsonl back to its step, and return its state dict; None to start fresh (then a metrics.jsonl
    already there is renamed aside, never overwritten). resume='never' refuses an out_dir that holds checkpoints."""
    from parallel import barrier, die
    path, state = load_newest_everywhere(out_dir, master) if resume == 'auto' else (None, None)
    if resume == 'never' and list_checkpoints(out_dir):
        die(f"resume='never' but {out_dir} holds checkpoints; pick a new --out_dir (nothing is overwritten)", 2)
    barrier()  # every rank has chosen before rank 0 writes anything
    metrics = os.path.join(out_dir, 'metrics.jsonl')
    if state is not None:
        load_state(model, optimizer, state['model'], state['optimizer'], fsdp)
        set_rng_state(state['rng'])
        if master:
            trim_metrics(metrics, state['step'])
        print(f"resume: {path} (step {state['step']}, data cursor {state['cursor']}, lr scale {state['lr_scale']})")
    elif master and os.path.exists(metrics):
        os.replace(metrics, metrics + f'.old.{int(time.time())}')
    return state


def save_run(out_dir, step, model, optimizer, fsdp, master, keep_last, run_state, tok=None, config=None):
    """Checkpoint step (with run_state: cursor, lr_scale, guards, ...) and, given tok, the HF export out_dir/hf with the
    run's config beside it (grpo_run.json, which sample.py reads), only from finite weights: a bad model is never
    written over a good one. Rank 0 writes (FSDP first gathers the weights onto it); the others wait, so no rank reads
    a checkpoint still being written. Every rank restores the one RNG state saved: they all seed alike."""
    from parallel import barrier
    from model import save_pretrained
    msd, osd = full_state(model, optimizer, fsdp)
    ok = all(torch.isfinite(t).all() for t in msd.values())
    if master and not ok:
        print(f"guard: weights are not finite at step {step}; NOT saving (the last good checkpoint stays)", flush=True)
    elif master:
        save_checkpoint(out_dir, step, {'model': msd, 'optimizer': osd, 'step': step, 'rng': rng_state(),
                                        'config': config, **run_state}, keep_last)
        if tok is not None:
            save_pretrained(model, tok, os.path.join(out_dir, 'hf'), state_dict=msd)
            run = json.dumps({**config, 'step': step}, indent=2, sort_keys=True, default=str)
            atomic_write(os.path.join(out_dir, 'hf', 'grpo_run.json'), lambda f: f.write(run.encode()))
    barrier()
    return ok


# ----------------------------------------------------------------------------- whole state under FSDP
# Checkpoints always hold whole tensors in the one-process format, so any checkpoint resumes on any number of ranks,
# FSDP or not. Under FSDP the weights and Adam moments live as shards and are gathered (DCP's state_dict helpers).

def reference_model(policy, dtype, path, resumed, master, device):
    """The frozen KL reference: a copy of the policy GRPO starts from (after the warm start, if any) in the compute
    dtype, written to path at the start and read back on resume (init_from alone cannot rebuild it after SFT)."""
    ref = copy.deepcopy(policy).to(dtype).eval().requires_grad_(False)
    if resumed:
        ref.load_state_dict(torch.load(path, map_location=device))
    elif master:
        atomic_write(path, lambda f: torch.save(ref.state_dict(), f))
    return ref


def full_state(model, optimizer, fsdp):
    """(model, optimizer) state dicts of whole tensors. FSDP gathers them onto rank 0, in CPU memory; the other
    ranks get {}."""
    osd = optimizer.state_dict()
    if not fsdp:
        return model.state_dict(), osd
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if osd['state']:  # (an empty state is already whole; the DCP call would fill it with a dummy AdamW step)
        pos = {n: i for i, n in enumerate(param_names(model, optimizer))}
        osd = get_optimizer_state_dict(model, optimizer, options=opts)
        osd = osd and {'state': {pos[n]: s for n, s in osd['state'].items()},
                       'param_groups': [{**g, 'params': [pos[n] for n in g['params']]} for g in osd['param_groups']]}
    return get_model_state_dict(model, options=opts), osd


def load_state(model, optimizer, msd, osd, fsdp):
    """Every rank loads the same whole state dicts (FSDP keeps its shard of each)."""
    if not fsdp:
        model.load_state_dict(msd)
        optimizer.load_state_dict(osd)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict
    set_model_state_dict(model, msd, options=StateDictOptions(full_state_dict=True))
    if not osd['state']:
        optimizer.load_state_dict(osd)
        return
    names = param_names(model, optimizer)
    set_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True), optim_state_dict={
        'state': {names[i]: s for i, s in osd['state'].items()},
        'param_groups': [{**g, 'params': [names[i] for i in g['params']]} for g in osd['param_groups']]})


def param_names(model, optimizer):
    """The optimizer's parameters in its own order (what optimizer.state_dict() numbers), by name (what DCP uses)."""
    name = {id(p): n for n, p in model.named_parameters()}
    return [name[id(p)] for g in optimizer.param_groups for p in g['params']]
