"""Thread defaults: busy cores are measured now, not read from the load average."""

import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from specdecode import runtime


def _fake_times(monkeypatch, cores: int, **percent: float) -> None:
    fields = dict(user=0.0, nice=0.0, system=0.0, idle=0.0, iowait=0.0, irq=0.0, softirq=0.0, steal=0.0)
    fields.update(percent)
    monkeypatch.setattr(runtime.psutil, "cpu_times_percent", lambda interval, percpu: SimpleNamespace(**fields))
    monkeypatch.setattr(runtime.psutil, "cpu_count", lambda: cores)
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)


@pytest.mark.parametrize(
    "percent,free",
    [
        (dict(idle=100.0), 2),  # an idle machine: every core
        (dict(user=50.0), 1),  # one core busy of two
        (dict(user=48.0, system=2.0), 1),
        (dict(user=100.0), 1),  # never below one
        (dict(steal=15.0, iowait=20.0, idle=65.0), 2),  # stolen and waiting time is not a neighbour
        (dict(user=10.0, idle=90.0), 2),  # a little background noise keeps both
    ],
)
def test_free_cores_counts_busy_time(monkeypatch, percent, free):
    _fake_times(monkeypatch, 2, **percent)
    assert runtime.free_cores() == free


def test_load_average_is_not_consulted(monkeypatch):
    """A process that just exited still weighs on the 1-minute load average; it must not count."""
    _fake_times(monkeypatch, 2, idle=100.0)
    monkeypatch.setattr(runtime.os, "getloadavg", lambda: (2.0, 2.0, 2.0), raising=False)
    assert runtime.free_cores() == 2


def test_a_spinning_neighbour_is_seen():
    code = "import time\nt = time.time()\nwhile time.time() - t < 5: pass\n"
    before = runtime.busy_cores(0.3)
    spinner = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(0.3)  # let it start
        during = runtime.busy_cores(0.5)
    finally:
        spinner.kill()
        spinner.wait()
    assert during >= before + 0.5, (before, during)
