"""
The run doctor: reads a GRPO run's logs after the fact and says what went wrong, at which steps,
with the numbers, the likely causes in order, and the fix.

    python -m doctor out/arith                # ours: metrics.jsonl (+ samples.jsonl)
    python -m doctor trl_out/checkpoint-500   # TRL: trainer_state.json's log_history
    python -m doctor verl_console.log         # verl: 'step:N - key:value - ...' lines
    python -m doctor wandb_history.csv        # a Weights & Biases history export
    python -m doctor tb_logs/grpo_run         # TensorBoard event files (OpenRLHF, TRL, verl)
    python -m doctor train.log                # console: 'iter N: loss X, time Yms', our step lines
    python -m doctor RUN --device_gb=80       # also check memory against the device's 80 GB
    python -m doctor RUN --json               # the findings as JSON
    python -m doctor RUN --fail_on=warning    # exit 1 on warnings too (default: errors only)

Each source's metric names map onto a few series (SERIES) through a table (OURS, TRL, VERL, WANDB,
OPENRLHF, PRIME_RL, CONSOLE); names a table does not know are counted in the report and listed in
--json, never dropped unsaid. Each detector in DETECTORS reads the series and returns findings; the
report prints them most severe first and doctor.png (beside the input, or --out) draws the flagged
series with the findings' steps shaded. Exit code 0: nothing flagged at --fail_on or above (warnings
alone exit 0 by default: a CI step fails on a broken run, not on a vLLM run's memory at 90%); 1: a
finding at --fail_on or above; 2: PATH unreadable (or a bad argument).
"""
import argparse
import json
import math
import os
import sys

from doctor import DETECTORS, diagnose
from doctor.detect import SEVERITIES, finite, points, runs_of, span_text
from doctor.read import SERIES, load

MAX_PROBLEM_LINES = 20  # unreadable rows printed one line each, up to this many, then a count
UNKNOWN_SHOWN = 5  # names no table knows: the report counts them and shows this many (--json: all)


# ------------------------------------------------------------------------------------ output
def report(run, findings, png=None, fail_on='error'):
    """The plain-text report: what was read, one paragraph per finding, then one line each for the
    names no table knows, the exit code's reason and the plot."""
    steps = run['steps']
    span = f"steps {steps[0]}-{steps[-1]}" if steps else "no step logged"
    lines = [f"doctor: {run['path']} ({run['source']}, {run['rows']} rows, {span})",
             "series: " + (', '.join(k for k in SERIES if run['series'].get(k)) or 'none')]
    if run['problems']:
        lines.append(f"unreadable rows: {len(run['problems'])} (first: {run['problems'][0]})")
    lines.append('')
    for f in findings:
        causes = '; '.join(f"({i}) {c}" for i, c in enumerate(f['causes'], 1))
        at = f"steps {span_text(run, f['steps'])}" if f['steps'] else 'no step'
        lines.append(f"{f['severity'].upper()} {f['name']} ({at}): "
                     f"{f['evidence']}. Likely causes: {causes}. Fix: {f['fix'].rstrip('.')}.")
        lines.append('')
    if not findings:
        lines.append(f"nothing flagged ({len(DETECTORS)} detectors ran).")
    elif all(f['severity'] == 'info' for f in findings):
        lines.append("nothing flagged above info.")
    elif exit_code(findings, fail_on) == 0:
        lines.append("warnings only: exit code 0 (--fail_on=warning makes it 1).")
    unknown = sorted(run['unknown'])
    if unknown:
        first = ', '.join(unknown[:UNKNOWN_SHOWN])
        more = f"first {first}; --json lists all" if len(unknown) > UNKNOWN_SHOWN else first
        lines.append(f"not mapped: {len(unknown)} names ({more}); a table in doctor/read.py can "
                     "map them")
    if png:
        lines.append(f"plot: {png}")
    return '\n'.join(lines)


def plot(run, findings, out_png):
    """The flagged series, one panel each (reward first), with each finding's steps shaded."""
    from matplotlib.figure import Figure  # imported here: only a plot pays for matplotlib
    from matplotlib.ticker import MaxNLocator

    names = ['reward'] + [n for f in findings for n in f['series']]
    names = [n for n in dict.fromkeys(names) if run['series'].get(n)][:8]
    if not names:
        names = [n for n in SERIES if run['series'].get(n)][:4]
    fig = Figure(figsize=(10, 1.9 * len(names) + 0.6), layout='constrained')
    axs = fig.subplots(len(names), 1, sharex=True, squeeze=False)[:, 0]
    colors = {'error': 'tab:red', 'warning': 'tab:orange', 'info': 'tab:gray'}
    for ax, name in zip(axs, names):
        pts = points(run, name)
        good = finite(pts)
        if good:
            ax.plot(*zip(*good), lw=1.2, marker='.' if len(good) < 60 else None)
        bad = [s for s, v in pts if not math.isfinite(v)]
        if bad:
            ax.plot(bad, [0.95] * len(bad), 'x', color='red', transform=ax.get_xaxis_transform())
        shown = [f for f in findings if name in f['series']]
        for k, f in enumerate(shown):
            for a, b in runs_of(run, f['steps']):
                ax.axvspan(a - 0.5, b + 0.5, color=colors[f['severity']], alpha=0.2, lw=0)
            ax.text(0.01, 0.92 - 0.13 * k, f['name'], transform=ax.transAxes, fontsize=7,
                    va='top', color=colors[f['severity']])
        if name.endswith('_frac'):
            ax.set_ylim(-0.03, 1.05)  # a share: drawn against its whole range
        ax.set_ylabel(name, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axs[-1].set_xlabel('step', fontsize=8)
    axs[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(f"doctor: {run['path']}", fontsize=9)
    fig.savefig(out_png, dpi=90)


def exit_code(findings, fail_on):
    """1 when a finding is at least `fail_on` severe ('error', or 'warning'), else 0."""
    worst = max((SEVERITIES.index(f['severity']) for f in findings), default=-1)
    return 1 if worst >= SEVERITIES.index(fail_on) else 0


def main(argv=None):
    ap = argparse.ArgumentParser(prog='python -m doctor',
                                 description=__doc__.split('\n\n')[0].strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('path', help='an out_dir, a TRL output dir or checkpoint, a log, CSV or '
                    'TensorBoard event file (or its folder)')
    ap.add_argument('--out', default='', help='where to write the plot (default: beside PATH)')
    ap.add_argument('--json', action='store_true', help='print the findings as JSON')
    ap.add_argument('--no_plot', action='store_true', help='skip doctor.png')
    ap.add_argument('--device_gb', type=float, default=0.0,
                    help="the device's memory in GB, to check peak memory against")
    ap.add_argument('--fail_on', choices=['error', 'warning'], default='error',
                    help="exit 1 on a finding this severe or more (default: errors only; "
                         "warnings are printed and exit 0)")
    args = ap.parse_args(argv)
    run = load(args.path, args.device_gb)
    if isinstance(run, str):
        print(f"doctor: {run}", file=sys.stderr)
        return 2
    for line in run['problems'][:MAX_PROBLEM_LINES]:
        print(f"doctor: {line}", file=sys.stderr)
    if len(run['problems']) > MAX_PROBLEM_LINES:
        print(f"doctor: ... {len(run['problems']) - MAX_PROBLEM_LINES} more unreadable rows",
              file=sys.stderr)
    findings = diagnose(run)
    png = None
    if not args.no_plot and run['steps']:  # (a log of nothing but an error has no series to draw)
        beside = args.path if os.path.isdir(args.path) else os.path.dirname(args.path)
        png = args.out or os.path.join(beside, 'doctor.png')
        try:
            plot(run, findings, png)
        except OSError as e:
            print(f"doctor: cannot write {png}: {e}", file=sys.stderr)
            png = None
    if args.json:
        out = {'path': run['path'], 'source': run['source'], 'rows': run['rows'],
               'series': sorted(k for k, v in run['series'].items() if v),
               'unknown': sorted(run['unknown']), 'problems': run['problems'],
               'findings': findings, 'plot': png}
        print(json.dumps(out, indent=1))
    else:
        print(report(run, findings, png, fail_on=args.fail_on))
    return exit_code(findings, args.fail_on)


if __name__ == '__main__':
    sys.exit(main())
