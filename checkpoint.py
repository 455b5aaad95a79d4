"""
Checkpoints that a kill at any instant cannot corrupt, and resume that picks the newest one that
loads.

A checkpoint is one torch.save file, ckpt_{step:07d}.pt, written to a temporary name, fsync'd, then
renamed over: a reader sees the old file or the new one, never half of one. The directory is fsync'd
after the rename so the rename itself survives a power cut.
"""
import copy
import functools
import glob
import json
import math
import os
import pickle
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
    """write_fn(file object) writes the content; the file appears at path only once complete and on
    disk."""
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
    state = {'python': random.getstate(), 'numpy': np.random.get_state(),
             'torch': torch.get_rng_state()}
    if torch.cuda.is_available():
        # this rank's device only: touching every GPU from every rank would create a CUDA context
        # on each of them
        state['cuda'] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state):
    random.setstate(state['python'])
    np.random.set_state(state['numpy'])
    torch.set_rng_state(state['torch'])
    if 'cuda' in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state['cuda'])


def list_checkpoints(out_dir):
    """Newest first."""
    return sorted(glob.glob(os.path.join(out_dir, 'ckpt_[0-9]*.pt')), reverse=True)


def file_step(path):
    """The step in a checkpoint's or a KL reference's name: ckpt_0000050.pt, ref_0000050.pt -> 50."""
    return int(os.path.basename(path).split('_', 1)[1][:-3])


def run_chat_date(out_dir):
    """The chat_date of the run whose checkpoints out_dir holds, from its config.json (None: no
    checkpoint, or a run from before the knob)."""
    try:
        with open(os.path.join(out_dir, 'config.json')) as f:
            day = json.load(f).get('chat_date')
    except (OSError, ValueError):
        return None
    return day if list_checkpoints(out_dir) and day else None


def save_checkpoint(out_dir, step, state, keep_last):
    """ckpt_{step}.pt, then keep_last checkpoints of steps up to step (a file named after a later
    step, not this run's, never pushes this run's own out)."""
    path = os.path.join(out_dir, f'ckpt_{step:07d}.pt')
    atomic_write(path, lambda f: torch.save(state, f))
    for old in [p for p in list_checkpoints(out_dir) if file_step(p) <= step][max(keep_last, 1):]:
        os.remove(old)
    return path


def load_newest_everywhere(out_dir, master=True, before=None):
    """load_newest on every rank of a run; rank 0 looks first, as it also deletes half-written
    files."""
    from parallel import barrier
    found = load_newest(out_dir, before=before) if master else None
    barrier()
    return found if master else load_newest(out_dir, before=before)


def roll_back_files(out_dir, master, *, before, step):
    """A guard's rollback: (path, state) of the newest checkpoint of a step < before ((None, None):
    none loads), and the checkpoints and KL references of the steps it undoes (after it, up to step)
    deleted, so neither a later rollback nor a resume returns to them."""
    from parallel import barrier
    path, state = load_newest_everywhere(out_dir, master, before=before)
    barrier()  # every rank has loaded before rank 0 deletes
    if master and state is not None:
        for p in glob.glob(os.path.join(out_dir, 'ckpt_[0-9]*.pt')) + glob.glob(
                os.path.join(out_dir, 'ref_[0-9]*.pt')):
            if state['step'] < file_step(p) <= step:
                os.remove(p)
    return path, state


# what a checkpoint may hold beyond tensors and plain values: numpy's RNG state (an array of uint32)
SAFE_GLOBALS = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_checkpoint(path, map_location='cpu'):
    """torch.load that runs no code from the file: tensors, plain Python values and numpy's RNG
    state only (weights_only). A file that needs anything else (a pickle that would import or call
    something, e.g. planted in a shared out_dir) raises ValueError naming the file and the refused
    global."""
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(path, map_location=map_location, weights_only=True,
                              mmap=map_location == 'cpu')
    except pickle.UnpicklingError as e:
        what = next((ln.strip() for ln in str(e).splitlines() if 'GLOBAL' in ln),
                    'an object torch will not rebuild')
        raise ValueError(f"{path}: refused to load: it would run code, not only rebuild tensors "
                         f"and plain values ({what.rstrip('.')}); load such a file only if you "
                         "made it") from None


def load_newest(out_dir, map_location='cpu', before=None):
    """(path, state) of the newest checkpoint that loads (before: of a step < before); a broken one
    is reported and the next older one tried."""
    # left by a write that was killed: never complete
    for tmp in glob.glob(os.path.join(out_dir, '*.tmp.*')):
        os.remove(tmp)
    for path in list_checkpoints(out_dir):
        if before is not None and file_step(path) >= before:
            continue
        try:
            state = load_checkpoint(path, map_location)
            if 'step' not in state or 'model' not in state:
                raise ValueError("missing 'step' or 'model'")
            return path, state
        except Exception as e:
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:500]}"
            print(f"resume: {path} does not load ({why}); trying an older one")
    return None, None


def trim_metrics(path, last_step):
    """Drop rows (metrics.jsonl, samples.jsonl) after last_step (written after the checkpoint we
    resume from) and any torn last line, so a resumed run appends without duplicate steps."""
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

def reference_model(policy, dtype, path, *, resumed, master, device, initial=None):
    """The frozen KL reference: a copy of the policy GRPO starts from (after the warm start, if any)
    in the compute dtype, written to path at the start and read back on resume (init_from alone
    cannot rebuild it after SFT). A resumed run whose start had no reference (beta was 0) gets
    initial() (the init_from weights: only right without a warm start; None: the run stops with a
    line saying so)."""
    from parallel import die
    ref = copy.deepcopy(policy).to(dtype).eval().requires_grad_(False)
    if resumed and os.path.exists(path):
        ref.load_state_dict(load_checkpoint(path, device))
        return ref
    if resumed and initial is None:
        die(f"beta > 0, but this run started with beta = 0 and kept no KL reference ({path}); "
            "its warm start (sft_steps) cannot be rebuilt from init_from. Resume with --beta=0, "
            "or start a new --out_dir", 2)
    if resumed:
        print(f"resume: no KL reference at {path} (the run started with beta = 0): "
              "using init_from's weights")
        ref.load_state_dict(initial().state_dict())
    if master:
        atomic_write(path, lambda f: torch.save(ref.state_dict(), f))
    return ref


def reference_path(out_dir, step):
    """The KL reference a run has after step steps: ref.pt (its start), or with ref_sync_every the
    newest ref_SSSSSSS.pt of a sync at a step <= step."""
    synced = [p for p in glob.glob(os.path.join(out_dir, 'ref_[0-9]*.pt')) if file_step(p) <= step]
    return max(synced) if synced else os.path.join(out_dir, 'ref.pt')


def save_reference(out_dir, step, ref):
    """Write the reference synced at step as ref_SSSSSSS.pt and remove those no checkpoint left on
    disk can resume to (older than the one its oldest checkpoint uses; ref.pt stays)."""
    path = os.path.join(out_dir, f'ref_{step:07d}.pt')
    atomic_write(path, lambda f: torch.save(ref.state_dict(), f))
    ckpts = list_checkpoints(out_dir)
    oldest = file_step(ckpts[-1]) if ckpts else step
    needed = reference_path(out_dir, oldest)
    for p in glob.glob(os.path.join(out_dir, 'ref_[0-9]*.pt')):
        if p < needed:
            os.remove(p)


# knobs a resumed run may change without changing what it computes (what it logs, saves, prints or
# waits for)
RESUME_SAFE = ('out_dir', 'resume', 'resume_changed', 'eval_every', 'eval_examples',
               'eval_batch_size', 'verbose', 'log_samples_every', 'save_every', 'keep_last',
               'export_hf', 'export_every', 'export_dtype', 'plot', 'plot_every', 'watchdog_s',
               'watchdog_exit', 'wandb_log', 'wandb_project', 'wandb_run_name', 'fault_stall_step',
               'fault_stall_s', 'fault_kill_opt_step', 'fault_oom_steps', 'eval_samples', 'eval_temperature',
               'eval_tasks', 'export_best', 'export_best_mode', 'early_stop', 'tensorboard_log')


def config_changes(saved, config, safe=()):
    """Lines naming each knob whose value differs from the checkpoint's run, and whether any of them
    changes what the run computes (anything outside RESUME_SAFE and safe, e.g. the knobs of tasks
    only evaluated: its trajectory is then not the one a run without the stop had). A knob the
    checkpoint's code did not have (or this code no longer has) is named but does not count: its
    default is meant to keep the old behaviour."""
    unset = '(unset)'
    keys = sorted(k for k in set(saved) | set(config)
                  if saved.get(k, unset) != config.get(k, unset))
    known = [k for k in keys if k in saved and k in config]
    safe = set(RESUME_SAFE) | set(safe)
    lines = []
    for k in keys:
        if k in known and k not in safe:
            note = '   (changes the run)'
        elif k in known:
            note = ''
        elif k in config:
            note = '   (a knob new since that checkpoint)'
        else:
            note = '   (a knob this code no longer has)'
        lines.append(f"  {k}: {saved.get(k, unset)!r} -> {config.get(k, unset)!r}" + note)
    return lines, any(k not in safe for k in known)


def resume_run(out_dir, resume, master, model, optimizer, fsdp, *, config=None,
               resume_changed=False, resume_safe=()):
    """resume='auto': load the newest checkpoint in out_dir that loads into model and optimizer,
    restore the RNG state, trim metrics.jsonl and samples.jsonl back to its step, and return its
    state dict; None to start fresh (then a metrics.jsonl or samples.jsonl already there is renamed
    aside, never overwritten). resume='never' refuses an out_dir that holds checkpoints. Knobs that differ from
    the checkpoint's run are printed; one that changes what the run computes (config_changes; knobs
    in resume_safe do not) needs resume_changed=True, else the run stops before touching anything."""
    from parallel import barrier, die
    path, state = None, None
    if resume == 'auto':
        path, state = load_newest_everywhere(out_dir, master)
    if resume == 'never' and list_checkpoints(out_dir):
        die(f"resume='never' but {out_dir} holds checkpoints; pick a new --out_dir (nothing is "
            "overwritten)", 2)
    if state is not None and config is not None and state.get('config') is not None:
        lines, changes_run = config_changes(state['config'], config, resume_safe)
        if lines and master:
            print(f"resume: {path} was written with other knob values:\n" + '\n'.join(lines),
                  flush=True)
        if changes_run and not resume_changed:
            die(f"resume: knobs marked '(changes the run)' differ from {path}'s run, so it would "
                "not continue as it would have; pass --resume_changed=True to resume anyway, or "
                "use a new --out_dir", 2)
    barrier()  # every rank has chosen before rank 0 writes anything
    metrics = os.path.join(out_dir, 'metrics.jsonl')
    if state is not None:
        base = getattr(model, 'lora', {}).get('base')  # LoRA: the base weights' fingerprint
        was = state.get('lora', {}).get('base')
        same = (base is None or was is None
                or all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(base, was)))
        if not same:
            die(f"resume: the base weights loaded from init_from differ from those {path}'s "
                f"adapters were trained on (fingerprint {base} vs {state['lora']['base']}); "
                "point --init_from at that snapshot", 2)
        try:
            load_state(model, optimizer, state['model'], state['optimizer'], fsdp)
        except ValueError as e:
            die(f"resume: {path}: {e}", 2)
        set_rng_state(state['rng'])
        if master:
            for log in (metrics, os.path.join(out_dir, 'samples.jsonl')):
                trim_metrics(log, state['step'])
        print(f"resume: {path} (step {state['step']}, data cursor {state['cursor']}, "
              f"lr scale {state['lr_scale']})")
    elif master:  # an earlier run's logs, kept aside
        for log in (metrics, os.path.join(out_dir, 'samples.jsonl')):
            if os.path.exists(log):
                os.replace(log, log + f'.old.{int(time.time())}')
    return state


def save_run(out_dir, step, model, optimizer, fsdp, master, *, keep_last, run_state, tok=None,
             config=None, export_dtype=None, keep_export=False):
    """Checkpoint step (with run_state: cursor, lr_scale, guards, ...) and, given tok, the HF export
    out_dir/hf (in export_dtype, default the weights' fp32; keep_export: also out_dir/hf_{step:07d},
    kept) with the run's config beside it (grpo_run.json, which sample.py reads), only from finite
    weights: a bad model is never written over a good one. Rank 0 writes (FSDP first gathers the
    weights onto it); the others wait, so no rank reads a checkpoint still being written. Every rank
    restores the one RNG state saved: they all seed alike. LoRA (lora.py): the checkpoint holds the
    adapters only (and their AdamW state; the base is reloaded from init_from at resume, its
    fingerprint checked), out_dir/hf the merged weights and out_dir/lora peft's adapter
    directory."""
    from parallel import barrier
    import lora
    msd, osd = full_state(model, optimizer, fsdp)
    adapters = lora.adapter_state(model, msd) if master else None  # None: not LoRA (or not rank 0)
    weights = msd if adapters is None else adapters
    ok = all(torch.isfinite(t).all() for t in weights.values())
    if master and not ok:
        print(f"guard: weights are not finite at step {step}; NOT saving (the last good checkpoint "
              "stays)", flush=True)
    elif master:
        state = {'model': weights, 'optimizer': osd, 'step': step, 'rng': rng_state(),
                 'config': config}
        if adapters is not None:
            state['lora'] = model.lora
        if tok is not None:  # before the checkpoint: a rerun after a failed export redoes both
            write_exports(out_dir, ['hf'] + [f'hf_{step:07d}'] * keep_export, model, tok, msd,
                          adapters, config={**config, 'step': step}, dtype=export_dtype)
        save_checkpoint(out_dir, step, {**state, **run_state}, keep_last)
    barrier()
    return ok


def save_export(out_dir, name, model, tok, fsdp, master, *, config, dtype=None):
    """out_dir/name: an HF export of the weights as they are now (export_best), with config as its
    grpo_run.json; only from finite weights. Rank 0 writes (FSDP first gathers the weights onto
    it); the others wait. Returns whether the weights were finite, the same on every rank."""
    from parallel import all_reduce, barrier
    import lora
    msd = full_weights(model, fsdp)  # FSDP: {} but on rank 0
    adapters = lora.adapter_state(model, msd) if master else None
    ok = all(torch.isfinite(t).all() for t in (msd if adapters is None else adapters).values())
    device = next(model.parameters()).device
    ok = all_reduce([float(not ok)], device, 'max')[0] == 0  # rank 0's verdict, FSDP or not
    if master and ok:
        write_exports(out_dir, [name], model, tok, msd, adapters, config=config, dtype=dtype)
    barrier()
    return ok


def write_exports(out_dir, names, model, tok, msd, adapters, *, config, dtype):
    """out_dir/name for each of names (hf, hf_NNNNNNN, hf_best): save_pretrained of whole weights
    msd (LoRA: merged from the adapters once, peft's adapter directory beside each as lora,
    lora_NNNNNNN, lora_best) and config as grpo_run.json, which sample.py reads."""
    from hf import save_pretrained
    import lora
    merged = msd if adapters is None else lora.merged_state(model, msd)
    run = json.dumps(config, indent=2, sort_keys=True, default=str).encode()
    for name in names:
        save_pretrained(model, tok, os.path.join(out_dir, name), state_dict=merged, dtype=dtype)
        atomic_write(os.path.join(out_dir, name, 'grpo_run.json'),
                     functools.partial(write_bytes, run))
        if adapters is not None:
            lora.save_peft(model, adapters, os.path.join(out_dir, 'lora' + name[2:]),
                           (config or {}).get('init_from'))


def write_bytes(data, f):
    f.write(data)


# --------------------------------------------------------------------------- whole state under FSDP
# Checkpoints always hold whole tensors in the one-process format, so any checkpoint resumes on any
# number of ranks, FSDP or not. Under FSDP the weights and Adam moments live as shards and are
# gathered (DCP's state_dict functions).

def full_state(model, optimizer, fsdp):
    """(model, optimizer) state dicts of whole tensors. FSDP gathers them onto rank 0, in CPU
    memory; the other ranks get {}."""
    osd = optimizer.state_dict()
    if not fsdp:
        return model.state_dict(), osd
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # (an empty state is already whole; the DCP call would fill it with a dummy AdamW step)
    if osd['state']:
        pos = {n: i for i, n in enumerate(param_names(model, optimizer))}
        osd = get_optimizer_state_dict(model, optimizer, options=opts)
        osd = osd and {'state': {pos[n]: s for n, s in osd['state'].items()},
                       'param_groups': [{**g, 'params': [pos[n] for n in g['params']]}
                                        for g in osd['param_groups']]}
    return full_weights(model, fsdp), osd


def full_weights(model, fsdp):
    """The model's state dict of whole tensors (FSDP: gathered onto rank 0 in CPU memory, {} on
    the other ranks)."""
    if not fsdp:
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))


def load_state(model, optimizer, msd, osd, fsdp):
    """Every rank loads the same whole state dicts (FSDP keeps its shard of each). With LoRA msd
    holds the adapters only; a checkpoint of the other kind is a ValueError."""
    import lora
    # LoRA: adapters only (the base stays as loaded from init_from); else every tensor
    want = {k for k in model.state_dict() if '.lora_A.' in k or '.lora_B.' in k}
    if not want:
        want = set(model.state_dict())
    if set(msd) != want:
        what = 'adapters' if lora.adapters(model) else 'whole-model weights'
        raise ValueError(f"the checkpoint's weights are not this model's {what} (a LoRA checkpoint "
                         f"and a full one, or other lora_targets): "
                         f"e.g. {sorted(want ^ set(msd))[:2]}")
    if not fsdp:
        model.load_state_dict(msd, strict=not lora.adapters(model))
        optimizer.load_state_dict(osd)
        return
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)
    model_opts = StateDictOptions(full_state_dict=True, strict=not lora.adapters(model))
    set_model_state_dict(model, msd, options=model_opts)
    if not osd['state']:
        optimizer.load_state_dict(osd)
        return
    names = param_names(model, optimizer)
    optim_opts = StateDictOptions(full_state_dict=True)
    by_name = {'state': {names[i]: s for i, s in osd['state'].items()},
               'param_groups': [{**g, 'params': [names[i] for i in g['params']]}
                                for g in osd['param_groups']]}
    set_optimizer_state_dict(model, optimizer, options=optim_opts, optim_state_dict=by_name)


def param_names(model, optimizer):
    """The optimizer's parameters in its own order (what optimizer.state_dict() numbers), by name
    (what DCP uses)."""
    name = {id(p): n for n, p in model.named_parameters()}
    return [name[id(p)] for g in optimizer.param_groups for p in g['params']]
