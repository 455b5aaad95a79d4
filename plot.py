"""Training curves: out_dir/metrics.jsonl -> out_dir/curves.png.

    python plot.py OUT_DIR        # or the path of a metrics.jsonl; writes curves.png beside it

train_grpo.py calls plot_metrics every plot_every steps, at the end, and for --plot=OUT_DIR; its
metrics rows go out through metrics_log (metrics.jsonl, and Weights & Biases when wandb_log is on).
"""
import json
import math
import os
import sys
import tempfile

# timing_s/<phase>, stacked bottom to top
PHASES = ['gen', 'reward', 'ref', 'old_logprob', 'update']


def read_metrics(path):
    """-> (rows sorted by step, bad lines skipped, duplicate steps replaced)."""
    by_step = {}
    bad = 0
    dup = 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)  # a line cut short by a crash mid-write fails here
                step = int(row['step'])
            except (ValueError, KeyError, TypeError):
                bad += 1
                continue
            # a resumed run rewrites the steps after its checkpoint: the last row wins
            dup += step in by_step
            by_step[step] = row
    return [by_step[s] for s in sorted(by_step)], bad, dup


def num(v):
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def lines(ax, rows, keys, nonfinite, **kw):
    """Plot each key's finite values; NaN/inf become a red x on the panel's top edge. -> drew
    anything."""
    drew = False
    for k in keys:
        pts = [(r['step'], r[k]) for r in rows if isinstance(r.get(k), (int, float))]
        good = [(s, v) for s, v in pts if math.isfinite(v)]
        bad = [s for s, v in pts if not math.isfinite(v)]
        if good:
            ax.plot(*zip(*good), label=k, **kw)
        if bad:  # exactly what a user is looking for, so make it loud
            ax.plot(bad, [0.95] * len(bad), 'x', color='red', ms=8, mew=2, label=f'{k} NaN/inf',
                    transform=ax.get_xaxis_transform(), clip_on=False)
            nonfinite[k] = bad
        drew |= bool(pts)
    return drew


def twin(ax, rows, left, right, nonfinite):
    """Left keys on ax, one right key (different scale) dashed on a twin axis; one legend for
    both."""
    drew = lines(ax, rows, left, nonfinite)
    if any(num(r.get(right)) is not None for r in rows):
        tw = ax.twinx()
        lines(tw, rows, [right], nonfinite, color='tab:red', ls='--', lw=1)
        tw.tick_params(labelsize=7, colors='tab:red')
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = tw.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=6)
        drew = True
    return drew


def eval_keys(keys):
    """The eval panel's lines: the run's task's pass@1, pass@8, pass@16, then maj@k, then each
    eval_tasks set's (eval/<name>/pass@1, ...) in the same order."""
    evals = [k for k in keys if k.startswith('eval/') and
             k.rpartition('/')[2].startswith(('pass@', 'maj@'))]
    return sorted(evals, key=lambda k: (k.count('/'), k.rpartition('/')[0], 'maj@' in k, len(k), k))


def plot_metrics(metrics_path, out_png=None):
    """Draw the curves of a metrics.jsonl (or of the run directory holding one) into out_png
    atomically. -> dict(rows, bad_lines, duplicates, empty=[panel titles with no data],
    nonfinite={key: steps}, out)."""
    if os.path.isdir(metrics_path):
        metrics_path = os.path.join(metrics_path, 'metrics.jsonl')
    run_dir = os.path.dirname(os.path.abspath(metrics_path))
    out_png = out_png or os.path.join(run_dir, 'curves.png')
    rows, bad, dup = read_metrics(metrics_path)
    keys = sorted({k for r in rows for k in r})
    nonfinite = {}
    empty = []
    # matplotlib is imported here, not at the top: it is 0.5 s of every run's start-up, and
    # plot_every=0 never draws. No pyplot: no global figure list to leak from a long run, no
    # display needed.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(18, 10), layout='constrained')
    axs = fig.subplots(3, 4, sharex=True).ravel()  # sharex: only the bottom row carries step labels
    fired = [k for k in keys if k.startswith(('guard/', 'warn/')) and any(r.get(k) for r in rows)]
    simple = [  # (title, keys, unit): plain line panels, in grid order after reward and eval
        ('loss', ['loss', 'pg_loss'], None),
        ('KL to reference', ['kl'], None),
        ('entropy', ['entropy'], 'nats/token'),
        ('clipped (last iteration, num_iterations > 1)', ['clip/low_frac', 'clip/high_frac'], None),
        ('frac_zero_std (groups with no signal)', ['frac_zero_std'], None),
        ('memory', ['mem/peak_gb', 'mem/allocated_gb', 'mem/reserved_gb'], 'GB')]

    def panel(ax, title, drew, unit=None, none='no data'):
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if unit:
            ax.set_ylabel(unit, fontsize=7)
        if not drew:
            empty.append(title)
            ax.text(0.5, 0.5, none, ha='center', va='center', color='gray', transform=ax.transAxes)
            ax.set_yticks([])
        elif ax.get_legend() is None and len(ax.get_legend_handles_labels()[0]) > 1:
            ax.legend(fontsize=6)

    ax = axs[0]  # reward: mean with a ±std band, each reward function's mean (and mix task's)
    band = [(r['step'], num(r.get('reward/mean')), num(r.get('reward/std'))) for r in rows]
    band = [(s, m - sd, m + sd) for s, m, sd in band if m is not None and sd is not None]
    if band:
        ax.fill_between(*zip(*band), alpha=0.2, label='± reward/std')
    fns = [k for k in keys if k.startswith('reward/') and k.endswith('/mean') and k.count('/') == 2]
    fns += [k for k in keys if k.startswith('mix/') and k.endswith('/reward')]  # a mixture's tasks
    panel(ax, 'reward', lines(ax, rows, ['reward/mean'] + fns, nonfinite))
    # only eval steps carry these
    evals = eval_keys(keys)
    panel(axs[1], 'eval', lines(axs[1], rows, evals, nonfinite, marker='o', ms=3))
    for ax, (title, ks, unit) in zip(axs[2:8], simple):
        panel(ax, title, lines(ax, rows, ks, nonfinite), unit)
    drew = twin(axs[8], rows, left=['grad_norm'], right='lr', nonfinite=nonfinite)
    panel(axs[8], 'grad norm (lr dashed, right)', drew)
    drew = twin(axs[9], rows, left=['response_len/mean'], right='response_len/clip_frac',
                nonfinite=nonfinite)
    panel(axs[9], 'response length (truncated frac dashed, right)', drew, 'tokens')
    ax = axs[10]  # where the step's seconds go; a phase missing from a row counts as 0 there
    trows = [r for r in rows if any(num(r.get(f'timing_s/{p}')) is not None for p in PHASES)]
    if trows:
        steps = [r['step'] for r in trows]
        seconds = [[num(r.get(f'timing_s/{p}')) or 0.0 for r in trows] for p in PHASES]
        ax.stackplot(steps, *seconds, labels=PHASES, alpha=0.7)
    drew = lines(ax, rows, ['timing_s/step'], nonfinite, color='black', lw=1) or bool(trows)
    panel(ax, 'time per phase (stacked; step = line)', drew, 's')
    drew = lines(axs[11], rows, fired, nonfinite, drawstyle='steps-post')
    panel(axs[11], 'guard / warn counts', drew, none='none fired')
    for ax in axs[8:]:
        ax.set_xlabel('step', fontsize=7)
    # shared by all panels: whole steps only
    axs[0].xaxis.set_major_locator(MaxNLocator(integer=True))
    last = rows[-1]['step'] if rows else 'none'
    fig.suptitle(f'{os.path.basename(run_dir)} - step {last}   ({len(rows)} rows, '
                 f'{bad} bad lines skipped, {dup} duplicate steps replaced)', fontsize=11)

    # write beside the target, then rename: a reader never sees a half-written PNG
    out_dir = os.path.dirname(os.path.abspath(out_png))
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix='.curves-', suffix='.png')
    try:
        with os.fdopen(fd, 'wb') as f:
            fig.savefig(f, format='png', dpi=100)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, out_png)
    except BaseException:
        os.unlink(tmp)
        raise
    return dict(rows=len(rows), bad_lines=bad, duplicates=dup, empty=empty, nonfinite=nonfinite,
                out=out_png)


if __name__ == '__main__':
    if len(sys.argv) != 2:
        sys.exit('usage: python plot.py OUT_DIR  (or path/to/metrics.jsonl)')
    try:
        info = plot_metrics(sys.argv[1])
    except OSError as e:  # no such run: one line, not a traceback
        print(f"plot.py: {e.filename}: {e.strerror}", file=sys.stderr)
        sys.exit(2)
    no_data = f", no data: {info['empty']}" if info['empty'] else ''
    print(f"wrote {info['out']}: {info['rows']} rows, {info['bad_lines']} bad lines skipped, "
          f"{info['duplicates']} duplicate steps replaced{no_data}")
