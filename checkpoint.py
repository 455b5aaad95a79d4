"""
Checkpoints that a kill at any instant cannot corrupt, and resume that picks the newest one that loads.

A checkpoint is one torch.save file, ckpt_{step:07d}.pt, written to a temporary name, fsync'd, then renamed over:
a reader sees the old file or the new one, never half of one. The directory is fsync'd after the rename so the
rename itself survives a power cut.
"""
import glob
import json
import os
import random

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


# ----------------------------------------------------------------------------- whole state under FSDP
# Checkpoints always hold whole tensors in the one-process format, so any checkpoint resumes on any number of ranks,
# FSDP or not. Under FSDP the weights and Adam moments live as shards and are gathered (DCP's state_dict helpers).

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
