"""
The run doctor: reads a GRPO run's logs after the fact (ours, TRL, verl, a W&B history CSV,
TensorBoard event files as OpenRLHF, TRL and verl write them, a nanoGPT-style console log) and says
what went wrong, at which steps, with the numbers, the likely causes in order, and the fix
(docs/doctor.md).

    python -m doctor RUN [--json] [--device_gb=80] [--fail_on=warning] [--out PNG] [--no_plot]

read.py finds and reads each source's log into one set of series (the name tables are there;
tfevents.py reads TensorBoard's files); detect.py turns the series into findings, crash.py a
console log's tracebacks and fatal errors; __main__.py is the command line, the text and JSON
report and the plot. From a program:

    import doctor
    run = doctor.load('out/arith')  # the run, or a one-line reason it cannot be read
    findings = doctor.diagnose(run)

The command line is not imported here (`from doctor.__main__ import main`): `python -m doctor`
would otherwise import it twice.
"""
from doctor.crash import CRASH_DETECTORS
from doctor.detect import SERIES_DETECTORS, SEVERITIES
from doctor.read import SERIES, TABLES, load

DETECTORS = CRASH_DETECTORS + SERIES_DETECTORS


def diagnose(run):
    """Every detector's findings, most severe first (detector order within a severity)."""
    findings = [f for detect in DETECTORS for f in detect(run)]
    return [f for severity in reversed(SEVERITIES) for f in findings if f['severity'] == severity]


__all__ = ['DETECTORS', 'SERIES', 'TABLES', 'diagnose', 'load']
