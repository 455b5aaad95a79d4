"""
The doctor's series detectors: each function in SERIES_DETECTORS reads a run's series
(doctor/read.py) and returns findings (name, severity, steps, evidence, likely causes in order,
fix). The thresholds are the named constants below. A console log's crashes: crash.py;
doctor.diagnose runs both, most severe first.
"""
import math
import statistics

from doctor.read import OUTSIDE_WORK, PHASES, SERIES

# ------------------------------------------------------------------------------------ thresholds
MIN_FLAT_STEPS = 3  # steps in a row of one exact value (with no reward spread) before it counts
LONG_FLAT_STEPS = 10  # a stretch this long counts even when the reward was low before it
MIN_FLAT_STEPS_NO_STD = 5  # the same when the reward's spread is not logged (ties by chance)
FIRST_STEP_MAX = 1  # the first update is step 1 (or 0): KL there is before the policy moved
KL_START_MAX = 0.01  # per-token KL at the first step above this: the reference is not the policy
KL_SPIKE_FLOOR = 0.1  # a KL spike must also exceed this (KL grows from 0 by large factors early)
KL_HIGH = 0.5  # KL to the reference above this over the last quarter of the run: drifted far
GRAD_SPIKE_FLOOR = 1.0  # a grad-norm spike must also exceed this (tiny norms jump by large factors)
SPIKE_FACTOR = 5.0  # a value this many times the median of the steps before it is a spike
SPIKE_WINDOW = 10  # steps before a point whose median it is compared with
WARMUP_FACTOR = 3.0  # first step this many times the median of the rest: compilation, warm-up
SLOWDOWN_FACTOR = 2.0  # later steps' median this many times the first step: recompilation
SLOW_STEP_FACTOR = 3.0  # one step this many times the median step: a stall
REWARD_WINDOW = 4  # steps averaged when comparing the reward's best stretch with its last
REWARD_FALL_FRAC = 0.5  # the last stretch below this share of the best ...
REWARD_FALL_ABS = 0.1  # ... and this much below it (rewards on a 0-1 scale): the policy got worse
ENTROPY_COLLAPSE_FRAC = 0.1  # entropy falling below this share of its start: collapsed
ENTROPY_MIN_START = 0.05  # nats; an entropy already below this at the start cannot collapse further
TRUNC_WARN = 0.5  # more than half the completions at the length limit (safety.py warns the same)
MEM_NEAR = 0.9  # device memory in use above this share of the device
HACK_REWARD_RISE = 0.05  # reward up by this much while ...
HACK_HELDOUT_DROP = 0.05  # ... held-out accuracy falls this much from its best: reward hacking
ZERO_SPREAD_WARN = 0.9  # median share of zero-spread groups above this: most of the batch is idle
CLIP_WARN = 0.2  # median share of clipped tokens above this: the policy moves too far per batch
TEACHER_KL_RISE = 3.0  # KL to a distillation teacher this many times its first step's ...
TEACHER_KL_FLOOR = 0.05  # ... and this much above it: the policy is moving away from its teacher
LAUNCH_BOUND = 0.1  # generation moving less than this share of the memory bandwidth it could ...
GEN_MOST = 0.5  # ... while taking at least this share of the step: launch-bound decoding
SEVERITIES = ['info', 'warning', 'error']


# ------------------------------------------------------------------------------------ detectors
def points(run, name):
    """[(step, value)] of a series, by step; NaN and inf included."""
    return sorted(run['series'].get(name, {}).items())


def finite(pts):
    return [(s, v) for s, v in pts if math.isfinite(v)]


def median(xs):
    return statistics.median(xs) if xs else float('nan')


def runs_of(run, steps):
    """Stretches of steps with no other logged step between them: [3, 4, 5, 9] -> [(3, 5), (9, 9)];
    logged every 10 steps, [60, 70, 80] -> [(60, 80)]."""
    pos = {s: i for i, s in enumerate(run['steps'])}
    out = []
    for s in sorted(steps):
        if out and pos.get(s, s) == pos.get(out[-1][1], out[-1][1]) + 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


def span_text(run, steps):
    """[3, 4, 5, 9] -> '3-5, 9'."""
    return ', '.join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs_of(run, steps))


def g(x):
    return f"{x:.3g}"


def found(name, severity, steps, *, evidence, causes, fix, series):
    return {'name': name, 'severity': severity, 'steps': sorted(set(steps)), 'evidence': evidence,
            'causes': causes, 'fix': fix, 'series': series}


def flat_stretches(pts, min_len):
    """Maximal stretches of consecutive points with exactly one value: [(first i, last i)]."""
    out, i = [], 0
    while i < len(pts):
        j = i
        while j + 1 < len(pts) and pts[j + 1][1] == pts[i][1]:
            j += 1
        if j - i + 1 >= min_len and math.isfinite(pts[i][1]):
            out.append((i, j))
        i = j + 1
    return out


def detect_flat_reward(run):
    """Reward exactly one value for several steps: after progress (a dead reward service, every
    call failing), from the start (reward wiring), or at its top (nothing left to learn)."""
    pts = points(run, 'reward')
    std = dict(points(run, 'reward_std'))
    tied = dict(points(run, 'zero_std_frac'))
    width = reward_range(run)
    has_spread = bool(std or tied or width)
    out = []
    for i, j in flat_stretches(pts, MIN_FLAT_STEPS if has_spread else MIN_FLAT_STEPS_NO_STD):
        steps = [s for s, _ in pts[i:j + 1]]
        if has_spread and not all(std.get(s, 0.0) == 0 and tied.get(s, 1.0) == 1
                                  and width.get(s, 0.0) == 0 for s in steps):
            continue  # the mean ties by chance while rewards differ
        c = pts[i][1]
        where = f"reward exactly {g(c)} on steps {span_text(run, steps)} ({len(steps)} steps)"
        if std or tied:
            where += ", every group's rewards tied (reward std 0)"
        elif width:
            where += ", every completion scored alike (the reward's max and min equal)"
        before = [v for _, v in finite(pts[:i])]
        drop = sum(before) / len(before) - c if before else 0.0
        if before and 0 < drop < REWARD_FALL_ABS and len(steps) < LONG_FLAT_STEPS:
            continue  # a low reward touching its floor for a few steps: chance, not a failure
        if drop > 0:
            out.append(reward_collapse(run, steps, c, before, where))
        elif before:
            out.append(found('reward_saturated', 'info', steps, series=['reward'],
                             evidence=f"{where}, at or above its earlier mean "
                                      f"{g(sum(before) / len(before))}",
                             causes=['every completion earns the top score: the prompts are solved',
                                     'a reward that cannot tell completions apart at the top'],
                             fix='harder prompts (or stop: there is nothing left to learn)'))
        else:
            out.append(reward_from_start(run, steps, c, where))
    return out


def reward_collapse(run, steps, c, before, where):
    first = steps[0]
    ev = (f"{where}, after a mean of {g(sum(before) / len(before))} (max {g(max(before))}) on the "
          f"{len(before)} steps before")
    ev += context(run, steps, ['grad_norm', 'resp_len', 'mem_frac', 'trunc_frac'])
    ev += sample_quote(run, steps)
    causes = ["the reward or rollout service died and its client returns a default score; "
              "nothing raised, so training went on",
              "every reward call fails and the failure is scored as a constant (ours: "
              "failure_reward, counted in reward/<fn>/errors)",
              "generation broke: empty or garbage completions score alike"]
    verdict, note = validation_verdict(run, first)
    if verdict != 'unknown':
        ev += note
    if length_jump(run, first) or verdict == 'fell':
        causes.insert(0, causes.pop(2))
    later = [s for s, v in finite(points(run, 'reward')) if s > steps[-1]]
    if later:
        causes.insert(0, f"a passing outage, or a policy that degenerated for a while (lr too "
                         f"high): the reward moves again from step {later[0]}")
    return found('reward_collapse', 'error', steps, evidence=ev, causes=causes,
                 series=['reward', 'reward_std', 'grad_norm', 'resp_len', 'mem_frac'],
                 fix=f"check the reward/rollout server's log around step {first}; score a few "
                     f"completions of step {first} by hand; restart from the last checkpoint "
                     "before it. Make a dead reward loud: ours stops after zero_reward_patience "
                     "steps of reward exactly 0; in TRL or verl let the reward function raise.")


def reward_from_start(run, steps, c, where):
    ev = where + ", from the first logged step"
    ev += context(run, steps, ['resp_len', 'trunc_frac'])
    ev += sample_quote(run, steps)
    if c == 0:
        causes = ["the reward function is wired wrong: its keyword arguments do not get the "
                  "fields it expects (TRL passes dataset columns by name: a column 'answer' and a "
                  "parameter 'solution=None'), so it never matches",
                  "it parses an answer format the model does not write (it looks for \\boxed{} "
                  "and the model writes '#### 42')",
                  "completions are cut before the answer",
                  "the prompts are far beyond the model (a few groups would then still score)"]
        inside = set(steps)
        trunc = [v for s, v in points(run, 'trunc_frac') if s in inside]
        if trunc and median(trunc) > TRUNC_WARN:
            causes.insert(0, causes.pop(2))
        name = 'reward_zero_from_start'
    else:
        causes = ["a judge or reward model gives every completion the same score (saturated, "
                  "wrong template, input cut off)",
                  "the reward function ignores the completion (a wrong argument, a constant "
                  "return)"]
        name = 'reward_constant_from_start'
    return found(name, 'error', steps, evidence=ev, causes=causes, series=['reward', 'reward_std'],
                 fix="call the reward function by hand on one logged completion and its example, "
                     "outside the trainer, print the arguments it receives, and check that a "
                     "right answer scores above a wrong one")


def context(run, steps, names):
    """', grad norm median 0.3 (0.32 before)' for each named series logged: the other numbers
    around a stretch of steps."""
    out = ''
    first, steps = min(steps), set(steps)
    labels = {'grad_norm': 'grad norm', 'resp_len': 'completion length',
              'mem_frac': 'device memory', 'trunc_frac': 'truncated share'}
    for name in names:
        pts = finite(points(run, name))
        during = [v for s, v in pts if s in steps]
        before = [v for s, v in pts if s < first]
        if not during:
            continue
        fmt = '.0%' if name in ('mem_frac', 'trunc_frac') else '.3g'
        out += f"; {labels[name]} median {median(during):{fmt}}"
        if before:
            out += f" ({median(before):{fmt}} before)"
    return out


def sample_quote(run, steps):
    """A logged completion from one of the steps (samples.jsonl), with its reward and grade."""
    steps = set(steps)
    for row in run['samples']:
        if row.get('step') in steps:
            text = str(row.get('completion', ''))[:80].replace('\n', '\\n')
            grade = ''
            if 'correct' in row:
                grade = ", graded correct by the task" if row['correct'] else ", graded wrong"
            return f"; a completion logged at step {row['step']}: '{text}' (reward " \
                   f"{row.get('reward')}{grade})"
    return ''


def length_jump(run, step):
    """Did the completion length change by more than half at this step?"""
    pts = finite(points(run, 'resp_len'))
    before = [v for s, v in pts if s < step]
    after = [v for s, v in pts if s >= step]
    if not before or not after:
        return False
    b, a = median(before), median(after)
    return abs(a - b) > 0.5 * max(b, 1e-9)


def detect_reward_fall(run):
    """Reward falling far below its best and staying there, not at one exact value: the policy got
    worse."""
    pts = finite(points(run, 'reward'))
    w = REWARD_WINDOW
    if len(pts) < 2 * w or len({v for _, v in pts[-w:]}) == 1:
        return []  # one exact value at the end is detect_flat_reward's
    means = [sum(v for _, v in pts[i - w:i]) / w for i in range(w, len(pts) + 1)]
    best_i = means.index(max(means))
    best, last = means[best_i], means[-1]
    if best - last < REWARD_FALL_ABS or last > REWARD_FALL_FRAC * best:
        return []
    best_steps = [s for s, _ in pts[best_i:best_i + w]]
    steps = [s for s, v in pts if s > best_steps[-1] and v < REWARD_FALL_FRAC * best]
    ev = (f"reward {g(best)} (mean over steps {span_text(run, best_steps)}), then {g(last)} over "
          f"the last {w} steps; below half its best from step {steps[0]}")
    ev += context(run, steps, ['grad_norm', 'resp_len', 'trunc_frac'])
    verdict, note = validation_verdict(run, steps[0])
    ev += note
    if verdict == 'held':
        return [found('reward_fell_validation_held', 'warning', steps, evidence=ev,
                      series=['reward', 'heldout', 'resp_len'],
                      causes=["the training prompts got harder (data order, a curriculum, a new "
                              "shard or epoch)",
                              "the reward changed mid-run (a schedule, a length or format "
                              "penalty switched on, a KL penalty inside the reward)",
                              "the reward scores part of each batch wrong (timeouts or failures "
                              "scored 0)"],
                      fix=f"read the low-reward completions after step {steps[0]} beside their "
                          "prompts and rescore a few by hand; compare the reward's code and "
                          "settings before and after; the policy itself holds on held-out "
                          "prompts, so keep its checkpoints")]
    return [found('reward_fell', 'warning', steps, evidence=ev,
                  series=['reward', 'heldout', 'grad_norm', 'kl', 'entropy', 'resp_len'],
                  causes=["the learning rate is too high: an update broke the policy (look for "
                          f"grad-norm or KL spikes just before step {steps[0]})",
                          "the policy slid into a degenerate mode (repetition, empty or endless "
                          "answers: see the completion length)",
                          "the data got harder, or the reward changed, mid-run"],
                  fix=f"restart from the checkpoint before step {steps[0]} with a lower lr "
                      "(3-10x), keep grad clipping, or anchor the policy with beta > 0")]


def validation_verdict(run, first):
    """('held' | 'fell' | 'unknown', evidence) for held-out scores from step `first` on against
    their best before it: tells a policy that got worse from a reward or batch that changed."""
    held = finite(points(run, 'heldout'))
    before = [(s, v) for s, v in held if s < first]
    after = [(s, v) for s, v in held if s >= first]
    if not before or not after:
        return 'unknown', "; no validation score on both sides of it to tell a worse policy apart"
    best = max(v for _, v in before)
    best_step = min(s for s, v in before if v == best)
    last_step, last = after[-1]
    scores = f"validation {g(best)} at step {best_step}, {g(last)} at step {last_step}"
    if best - last >= HACK_HELDOUT_DROP:
        return 'fell', f"; {scores}: it fell too, so the policy got worse"
    return 'held', f"; {scores}: it held, so the policy did not get worse on held-out prompts"


def detect_zero_loss(run):
    """Loss exactly 0 for several steps with no gradient: identical rewards in every group (zero
    advantages), or, with a reward spread, advantages that never reach the loss."""
    pts = points(run, 'loss')
    grad = dict(points(run, 'grad_norm'))
    out = []
    for i, j in flat_stretches(pts, MIN_FLAT_STEPS):
        if pts[i][1] != 0:
            continue
        steps = [s for s, _ in pts[i:j + 1]]
        grads = [grad[s] for s in steps if s in grad]
        if grads and median(grads) > 0:
            continue  # GRPO's loss value is about 0 by construction while its gradient is not
        ev = f"loss exactly 0 on steps {span_text(run, steps)} ({len(steps)} steps)"
        if grads:
            ev += ", grad norm 0"
        spread = reward_spread(run, steps)
        same = ["identical rewards in every group: all advantages are 0, so the loss is 0 by "
                "construction (a judge or reward scoring every completion alike, or a constant "
                "reward)",
                "groups whose completions are all the same (temperature too low, entropy "
                "collapsed)"]
        masked = ["the advantages never reach the loss: a completion mask of zeros (padding "
                  "side, a prompt/completion off-by-one, every completion masked as truncated)",
                  "the loss's policy term is scaled by 0 (a coefficient, or a log-prob ratio "
                  "detached on both sides)"]
        if spread == 'none':
            ev += "; the rewards tie in every group (reward std 0)"
            causes, fix = same, ("score one group's completions by hand: if they differ, the "
                                 "reward is broken; if they are identical, raise temperature "
                                 "or group_size")
        elif spread == 'some':
            ev += "; the rewards differ within groups"
            causes, fix = masked, ("print one micro-batch's loss parts: the mask's sum, the "
                                   "advantages, the per-token log-probs")
        else:
            ev += "; the reward's spread is not logged"
            causes = same + masked
            fix = ("log the reward's std per step; score one group's completions by hand; if "
                   "they differ, print one micro-batch's mask sum and advantages")
        ev += step_time_note(run, steps)
        out.append(found('zero_loss', 'error', steps, evidence=ev, causes=causes, fix=fix,
                         series=['loss', 'reward_std', 'zero_std_frac', 'grad_norm']))
    return out


def reward_spread(run, steps):
    """'none' (every group tied on every step), 'some', or 'unknown' (not logged)."""
    steps = set(steps)
    std = [v for s, v in points(run, 'reward_std') if s in steps]
    tied = [v for s, v in points(run, 'zero_std_frac') if s in steps]
    width = [v for s, v in reward_range(run).items() if s in steps]
    if not std and not tied and not width:
        return 'unknown'
    if all(v == 0 for v in std + width) and all(v == 1 for v in tied):
        return 'none'
    return 'some'


def reward_range(run):
    """{step: highest - lowest reward} where both are logged (verl logs no std)."""
    high, low = dict(points(run, 'reward_max')), dict(points(run, 'reward_min'))
    return {k: high[k] - low[k] for k in high if k in low}


def step_time_note(run, steps):
    t = dict(finite(points(run, 'step_time')))
    during = [t[s] for s in steps if s in t]
    return f"; {g(median(during))} s a step" if during else ''


def detect_step_time(run):
    """The first steps slow, then fast (compilation: info); every step after the first slower than
    it (recompilation, shape churn); single slow steps later on (stalls). A step's validation and
    checkpoint time (inside verl's step) is left out: those steps are slow by design."""
    pts = [(s, v) for s, v in work_time(run) if v > 0]
    if len(pts) < 3:
        return []
    lead = 0  # the leading slow steps: the first compile, and a second when shapes first change
    while lead < len(pts) - 1 and pts[lead][1] > WARMUP_FACTOR * median([v for _, v in pts]):
        lead += 1
    med = median([v for _, v in pts[max(lead, 1):]])
    out = []
    if lead:
        steps = [s for s, _ in pts[:lead]]
        took = ', '.join(g(v) for _, v in pts[:lead])
        out.append(found('first_steps_slow', 'info', steps, series=['step_time'],
                         evidence=f"step(s) {span_text(run, steps)} took {took} s, the rest "
                                  f"{g(med)} s (median)" + phase_note(run, steps),
                         causes=['compilation and warm-up (torch.compile, kernel autotuning, the '
                                 'allocator, CUDA graphs), and one more compile when shapes first '
                                 'change: expected'],
                         fix='nothing; it is paid once'))
    first_step, first = pts[0]
    if not lead and med > SLOWDOWN_FACTOR * first:
        steps = [s for s, v in pts[1:] if v > SLOWDOWN_FACTOR * first]
        causes = ["recompilation at every step: torch.compile meets new shapes (completion "
                  "lengths change every step); TORCH_LOGS=recompiles shows it",
                  "memory pressure: the allocator at its limit frees and retries, or the host "
                  "swaps",
                  "the machine is shared: other processes on the same GPU or CPU cores"]
        causes = by_compile_time(run, steps, causes, 0)
        lens = finite(points(run, 'resp_len'))
        later = median([v for _, v in lens[1:]]) if len(lens) > 1 else 0
        if lens and lens[0][1] > 0 and later / lens[0][1] > med / first / 2:
            causes.insert(0, f"longer completions: length {g(lens[0][1])} at the first step, "
                             f"{g(later)} later")
        out.append(found('steps_slower_than_first', 'warning', steps, series=['step_time'],
                         evidence=f"steps after the first take {g(med)} s (median), "
                                  f"{med / first:.1f}x the first step's {g(first)} s; they do "
                                  "finish, so this is not a deadlock" + phase_note(run, steps),
                         causes=causes,
                         fix="find what changes between steps: compile with dynamic=True or pad "
                             "to a few fixed lengths, check memory headroom, run alone"))
        return out
    slow = [s for s, v in pts[max(lead, 1):] if v > SLOW_STEP_FACTOR * med]
    if slow:
        out.append(found('slow_steps', 'warning', slow, series=['step_time'],
                         evidence=f"steps {span_text(run, slow)} took up to "
                                  f"{g(max(v for s, v in pts if s in slow))} s against a median "
                                  f"of {g(med)} s" + phase_note(run, slow),
                         causes=by_compile_time(run, slow, [
                             'a stall: a reward or rollout service answering slowly, a checkpoint or '
                             'evaluation inside the step, a straggler rank',
                             'a recompilation for a new shape (TORCH_LOGS=recompiles names the guard '
                             'that failed)'],
                             1),
                         fix='look at what those steps did differently (the phase that grew)'))
    return out


def compiled_on(run, steps):
    """(graphs, seconds) torch.compile built on these steps where the log says (ours: compile/graphs
    and timing_s/compile, or the step line's 'compile S for N graphs'), None where it does not."""
    graphs, seconds = (dict(finite(points(run, name)))
                       for name in ('compile_graphs', 'time_compile'))
    if not any(s in graphs or s in seconds for s in steps):
        return None
    return sum(graphs.get(s, 0) for s in steps), sum(seconds.get(s, 0.0) for s in steps)


def compile_note(run, steps):
    """'; torch.compile built 3 graphs in 41 s of them', or '' where the log does not say."""
    built = compiled_on(run, steps)
    if built is None:
        return ''
    n, seconds = built
    if not n and not seconds:
        return "; torch.compile built no graph on them"
    return (f"; torch.compile built {g(n) + ' ' if n else ''}graph{'s' if n != 1 else ''} "
            f"in {g(seconds)} s of them")


def by_compile_time(run, steps, causes, recompile):
    """causes with causes[recompile] (a recompilation) first where the log says torch.compile built
    graphs on these steps, and left out where it says it built none; as they were otherwise."""
    built = compiled_on(run, steps)
    if built is None:
        return causes
    rest = causes[:recompile] + causes[recompile + 1:]
    return [causes[recompile]] + rest if any(built) else rest


def work_time(run):
    """[(step, seconds)]: the step's time less its validation and checkpoint phases."""
    outside = [dict(points(run, name)) for name in OUTSIDE_WORK]
    return [(s, v - sum(phase.get(s, 0.0) for phase in outside))
            for s, v in finite(points(run, 'step_time'))]


def phase_note(run, steps):
    """'; the time went to time_gen (40 s vs 8 s)': the phase that grew most on these steps, then
    what torch.compile built on them where the log says (compile_note)."""
    best, steps = None, set(steps)
    for name in PHASES:
        if name in OUTSIDE_WORK:
            continue
        pts = finite(points(run, name))
        on = [v for s, v in pts if s in steps]
        off = [v for s, v in pts if s not in steps]
        if on and off and (best is None or median(on) - median(off) > best[1] - best[2]):
            best = (name, median(on), median(off))
    grew = '' if best is None else (f"; the time went to {SERIES[best[0]]} ({g(best[1])} s vs "
                                    f"{g(best[2])} s on other steps)")
    return grew + compile_note(run, steps)


def detect_kl_at_start(run):
    """KL high at the first step, before any update: the reference is not the starting policy."""
    pts = finite(points(run, 'kl'))
    if not pts or pts[0][0] > FIRST_STEP_MAX or pts[0][1] <= KL_START_MAX:
        return []
    s, v = pts[0]
    return [found('kl_at_start', 'error', [s], series=['kl'],
                  evidence=f"KL to the reference {g(v)} at step {s}, before the policy moved "
                           f"from its starting weights, where it should be about 0 (under "
                           f"{KL_START_MAX})",
                  causes=["the reference is not the policy's starting weights (a base model "
                          "against an SFT policy, an adapter merged in one and not the other)",
                          "dropout on in one forward and off in the other (train() vs eval(), "
                          "dropout in the model config)",
                          "different numerics or inputs between the two log-prob passes: dtype, "
                          "attention kernel, temperature applied to one side only, different "
                          "tokens"],
                  fix="before training, compute the policy's and the reference's log-probs on "
                      "one batch: they must agree to about 1e-3 per token. Load the reference "
                      "from the very weights the policy starts from, eval() both, same dtype; "
                      "raising the KL threshold hides it")]


def detect_spikes(run):
    """Grad-norm and KL spikes against the median of the steps before; KL staying high."""
    out = []
    for name, floor in (('grad_norm', GRAD_SPIKE_FLOOR), ('kl', KL_SPIKE_FLOOR)):
        pts = finite(points(run, name))
        spikes = []
        for i in range(2, len(pts)):
            ref = median([v for _, v in pts[max(0, i - SPIKE_WINDOW):i]])
            if pts[i][1] > floor and pts[i][1] > SPIKE_FACTOR * ref:
                spikes.append((pts[i][0], pts[i][1], ref))
        if not spikes:
            continue
        ev = '; '.join(f"{g(v)} at step {s} (median before {g(r)})" for s, v, r in spikes[:5])
        if name == 'grad_norm':
            causes = ['the learning rate is too high for the model (or the warmup too short)',
                      'a batch of outliers: very long or degenerate completions',
                      'off-policy tokens: the sampler and trainer disagree (top_k/top_p, '
                      'different numerics), so importance ratios explode',
                      'fp16 overflow']
            fix = ('lower lr or lengthen warmup, keep grad clipping (1.0), read those steps\' '
                   'completions')
        else:
            causes = ['the learning rate is too high or beta too small',
                      'the policy found a degenerate mode (repetition) the reference finds '
                      'unlikely: check entropy and length',
                      'KL estimator outliers (k3 on tokens with a huge log-ratio)']
            fix = 'lower lr, raise beta, clamp the log-ratio in the KL estimate'
        out.append(found(f'{name}_spike', 'warning', [s for s, _, _ in spikes],
                         evidence=f"{name} spikes: {ev}", causes=causes, fix=fix,
                         series=[name]))
    kl = finite(points(run, 'kl'))
    tail = [v for _, v in kl[len(kl) * 3 // 4:]]
    if len(kl) >= 4 and median(tail) > KL_HIGH:
        steps = [s for s, v in kl if v > KL_HIGH]
        out.append(found('kl_high', 'warning', steps, series=['kl'],
                         evidence=f"KL to the reference {g(median(tail))} (median of the last "
                                  f"quarter), above {KL_HIGH} on steps {span_text(run, steps)}",
                         causes=['the policy drifted far from the reference: lr too high or '
                                 'beta too small'],
                         fix='lower lr or raise beta; check the completions still read well'))
    return out


def detect_nonfinite(run):
    """NaN or inf in the loss, gradient, KL, reward or entropy."""
    bad = {}
    for name in ('loss', 'grad_norm', 'kl', 'reward', 'entropy'):
        steps = [s for s, v in points(run, name) if not math.isfinite(v)]
        if steps:
            bad[name] = steps
    if not bad:
        return []
    steps = sorted({s for v in bad.values() for s in v})
    ev = '; '.join(f"{k} NaN/inf at steps {span_text(run, v)}" for k, v in bad.items())
    last = max(s for name in bad for s, _ in points(run, name))
    if last in steps:
        ev += f"; still non-finite at the last step ({last}): the weights may be NaN"
    return [found('nonfinite', 'error', steps, series=list(bad), evidence=ev,
                  causes=['fp16 overflow, or a log-prob of -inf (a token the model gives '
                          'probability 0) making a ratio or the KL infinite',
                          'the learning rate too high: check the grad norm before '
                          f'step {steps[0]}',
                          'a 0/0: advantages divided by a zero std with no epsilon, or a mean '
                          'over an empty mask',
                          'a reward returning NaN'],
                  fix=f"start from step {steps[0]}: bf16 or fp32 instead of fp16, lower lr, keep "
                      "grad clipping, an epsilon in the advantage's std; ours skips the update "
                      "and rolls back after nan_patience steps")]


def detect_entropy_collapse(run):
    """Entropy falling to a small share of where it started."""
    # exactly 0 is no measurement (ours logs 0 on a step with no tokens to train on)
    pts = [(s, v) for s, v in finite(points(run, 'entropy')) if v != 0]
    if len(pts) < 4:
        return []
    start = median([v for _, v in pts[:3]])
    end = median([v for _, v in pts[-3:]])
    if start < ENTROPY_MIN_START or end >= ENTROPY_COLLAPSE_FRAC * start:
        return []
    steps = [s for s, v in pts if v < ENTROPY_COLLAPSE_FRAC * start]
    ev = (f"entropy {g(start)} at the start, {g(end)} at the end; below "
          f"{ENTROPY_COLLAPSE_FRAC:.0%} of the start from step {steps[0]}")
    tied = finite(points(run, 'zero_std_frac'))
    if tied:
        ev += f"; groups with tied rewards {tied[0][1]:.0%} -> {tied[-1][1]:.0%}"
    return [found('entropy_collapse', 'warning', steps, series=['entropy', 'zero_std_frac'],
                  evidence=ev,
                  causes=['the learning rate is too high: the policy sharpens onto one answer '
                          'per prompt',
                          'nothing holds it: no KL (beta 0) or entropy term',
                          'no clip-higher: low-probability tokens cannot grow (DAPO)',
                          'sampling below temperature 1 reinforces the mode'],
                  fix="lower lr, eps_high=0.28 (clip-higher), beta > 0 or entropy_coef, "
                      "temperature 1.0; once collapsed, groups stop differing and learning "
                      "stops")]


def detect_teacher_kl_rise(run):
    """On-policy distillation moving the policy away from its teacher: the per-token KL to it,
    measured before each update, well above the first step's (before the policy moved)."""
    pts = finite(points(run, 'teacher_kl'))
    if len(pts) < 3:
        return []
    s0, first = pts[0]
    bar = max(TEACHER_KL_RISE * first, first + TEACHER_KL_FLOOR)
    steps = [s for s, v in pts[1:] if v > bar]
    if len(steps) < 2:
        return []
    peak_s, peak = max(pts, key=lambda p: p[1])
    ev = (f"KL to the teacher {g(first)} at step {s0}, {g(peak)} at step {peak_s}, {g(pts[-1][1])} at the "
          f"end; above {g(bar)} on steps {span_text(run, steps)}")
    rew = finite(points(run, 'reward'))
    if rew:
        ev += f"; reward {g(rew[0][1])} -> {g(rew[-1][1])}"
    return [found('teacher_kl_rose', 'warning', steps, series=['teacher_kl', 'reward'], evidence=ev,
                  causes=['the learning rate is too high: each update moves the policy further than '
                          "the teacher's per-token signal pulls it back",
                          "the reward advantage pulls elsewhere than the teacher (a reward the teacher "
                          "does not share)",
                          'several updates per batch (num_iterations, mini_batches) carry the policy '
                          'far from the one the teacher scored'],
                  fix="lower lr (the offline demo distils at GRPO's 2e-4 and broke at 5e-3), "
                      "advantage='none' to see whether the reward pulls away, or a larger teacher_coef")]


def detect_truncation(run):
    """Completions hitting the length limit."""
    pts = finite(points(run, 'trunc_frac'))
    steps = [s for s, v in pts if v > TRUNC_WARN]
    if len(steps) < MIN_FLAT_STEPS:
        return []
    worst = max(v for _, v in pts)
    ev = (f"{worst:.0%} of completions at the length limit at worst; above {TRUNC_WARN:.0%} on "
          f"steps {span_text(run, steps)}")
    causes = ['the limit (max_new_tokens, max_completion_length, response_length) is too '
              'short for the answers',
              'the model rambles or repeats',
              'generation never stops: the stop/EOS token is not set']
    lens = finite(points(run, 'resp_len'))
    if lens:
        ev += f"; mean length {g(lens[0][1])} -> {g(lens[-1][1])}"
        if lens[0][1] > 0 and lens[-1][1] > 1.5 * lens[0][1]:
            causes.insert(0, causes.pop(1))
    return [found('truncated', 'warning', steps, evidence=ev, causes=causes,
                  series=['trunc_frac', 'resp_len'],
                  fix="raise the limit; add an overlong penalty (ours: {'name': 'length'}); "
                      "mask truncated completions; check the stop ids")]


def detect_memory(run):
    """Device memory near the device's limit."""
    pts = finite(points(run, 'mem_frac'))
    steps = [s for s, v in pts if v > MEM_NEAR]
    if not steps:
        return []
    first, last = pts[0][1], pts[-1][1]
    causes = ['an inference engine that reserves memory up front (vLLM\'s '
              'gpu_memory_utilization): expected then, but nothing is left for a longer batch',
              'the batch only just fits: a longer one runs out of memory, or the allocator frees '
              'and retries (slow steps)',
              'fragmentation or a leak, if it rises over the run']
    if last > first + 0.1:
        causes.insert(0, causes.pop())
    return [found('memory_near_limit', 'warning', steps, series=['mem_frac'], causes=causes,
                  evidence=f"device memory up to {max(v for _, v in pts):.0%} of the device, "
                           f"above {MEM_NEAR:.0%} on steps {span_text(run, steps)} "
                           f"({first:.0%} at the first logged step, {last:.0%} at the last)",
                  fix="fewer rows per micro-batch, gradient checkpointing, a shorter limit, "
                      "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; with a colocated "
                      "vLLM, a lower gpu_memory_utilization")]


def detect_launch_bound(run):
    """Generation most of the step, yet far below the memory bandwidth decoding needs: each decode
    step waits on the host (this trainer's perf/gen_hbm_frac). The first step (warm-up) is left
    out."""
    frac = finite(points(run, 'gen_hbm_frac'))[1:]
    gen, step = dict(finite(points(run, 'time_gen'))), dict(finite(points(run, 'step_time')))
    share = {s: gen[s] / step[s] for s, _ in frac if s in gen and step.get(s, 0) > 0}
    steps = [s for s, v in frac if v < LAUNCH_BOUND and share.get(s, 0) >= GEN_MOST]
    if len(steps) < 2:
        return []
    used = median([v for s, v in frac if s in steps])
    return [found('generation_launch_bound', 'info', steps, series=['gen_hbm_frac', 'time_gen'],
                  evidence=f"on steps {span_text(run, steps)} generation took "
                           f"{median([share[s] for s in steps]):.0%} of the step (median) and moved "
                           f"{used:.1%} of the memory traffic the device allows: decoding is "
                           "memory-bound, so the GPU waited on something else",
                  causes=['eager decoding: each decode step launches hundreds of small kernels '
                          'from Python, and the GPU waits for the host to issue them',
                          'a read back to the host every decode step (stop_strings, '
                          'decode_check_every=1)',
                          'a slow or shared CPU'],
                  fix="decode_graphs=True replays each decode step as one CUDA graph "
                      "(docs/performance.md), compile_decode=True fuses some of it; compare "
                      "timing_s/gen")]


def detect_reward_hacking(run):
    """Reward rising while held-out accuracy falls from its best."""
    held = finite(points(run, 'heldout'))
    rew = finite(points(run, 'reward'))
    if len(held) < 2 or len(rew) < 4:
        return []
    best = max(v for _, v in held[:-1])
    best_step = min(s for s, v in held if v == best)
    last_step, last = held[-1]
    before = [v for s, v in rew if s <= best_step] or [rew[0][1]]
    after = [v for s, v in rew if s > best_step]
    if not after or best - last < HACK_HELDOUT_DROP:
        return []
    rise = sum(after) / len(after) - sum(before) / len(before)
    if rise < HACK_REWARD_RISE:
        return []
    steps = [s for s, _ in rew if best_step < s <= last_step]
    mean_before, mean_after = sum(before) / len(before), sum(after) / len(after)
    return [found('reward_hacking', 'warning', steps, series=['reward', 'heldout'],
                  evidence=f"reward up {g(rise)} after step {best_step} (mean {g(mean_before)} "
                           f"-> {g(mean_after)}) while held-out accuracy fell from {g(best)} "
                           f"at step {best_step} to {g(last)} at step {last_step}",
                  causes=['the reward pays something other than being right (format, length, '
                          'a judge\'s taste) and the policy found it',
                          'the answer parser can be gamed (it takes any number, the first '
                          'boxed answer)',
                          'the training prompts differ from the held-out ones'],
                  fix="read the highest-reward completions of the late steps; weight "
                      "correctness higher, tighten the parser, evaluate more often")]


def detect_zero_spread(run):
    """Most groups with tied rewards: most of each batch teaches nothing (unless a distillation
    teacher's per-token signal trains them)."""
    if any(v != 0 for _, v in finite(points(run, 'teacher_kl'))):
        return []
    pts = [(s, v) for s, v in finite(points(run, 'zero_std_frac')) if v < 1]
    if len(pts) < MIN_FLAT_STEPS:
        return []  # steps with every group tied are the flat-reward and zero-loss findings' case
    m = median([v for _, v in pts])
    if m <= ZERO_SPREAD_WARN:
        return []
    steps = [s for s, v in pts if v > ZERO_SPREAD_WARN]
    rew = finite(points(run, 'reward'))
    level = f"; reward mean {g(median([v for _, v in rew]))}" if rew else ''
    return [found('few_groups_learn', 'warning', steps, series=['zero_std_frac', 'reward'],
                  evidence=f"{m:.0%} of groups (median over steps) had identical rewards and "
                           f"no advantage{level}",
                  causes=['the prompts are too easy or too hard for the policy',
                          'too few samples per group, or sampling too cold',
                          'a coarse reward (0/1) on a hard task'],
                  fix="data nearer the policy's level, dynamic sampling (DAPO), a larger "
                      "group_size or temperature")]


def detect_clipping(run):
    """The PPO clip cutting a large share of tokens: the policy moves too far per batch."""
    pts = finite(points(run, 'clip_frac'))
    tail = [v for _, v in pts[len(pts) // 2:]]
    if len(pts) < MIN_FLAT_STEPS or median(tail) <= CLIP_WARN:
        return []
    steps = [s for s, v in pts if v > CLIP_WARN]
    return [found('clipped', 'warning', steps, series=['clip_frac'],
                  evidence=f"the clip cut {median(tail):.0%} of tokens (median, second half of "
                           f"the run); above {CLIP_WARN:.0%} on steps {span_text(run, steps)}",
                  causes=['the learning rate is too high',
                          'too many updates per batch (num_iterations, ppo_epochs)',
                          'stale or off-policy samples (asynchronous rollouts, a sampler that '
                          'disagrees with the trainer)'],
                  fix='lower lr, fewer iterations per batch, check the sampler/trainer '
                      'log-prob gap')]


SERIES_DETECTORS = [detect_flat_reward, detect_reward_fall, detect_zero_loss, detect_nonfinite, detect_kl_at_start,
                    detect_spikes, detect_entropy_collapse, detect_teacher_kl_rise, detect_reward_hacking,
                    detect_truncation, detect_memory, detect_launch_bound, detect_clipping, detect_zero_spread,
                    detect_step_time]
