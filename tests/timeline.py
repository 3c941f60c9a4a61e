"""Where a test run's wall time goes: each test's phases on each xdist worker, on a timeline.

``PDQ_TEST_TIMELINE=FILE bash scripts/test`` appends one line per test phase to FILE (tab
separated: worker, start, stop, phase, outcome, test id; the times are epoch seconds), written
by the process that hands out the tests (tests/conftest.py imports the hook below). Then

    python -m tests.timeline FILE

prints each worker's busy time and when it ran out of tests, the xdist groups by their total
time (a group runs whole on one worker, one test after another: the longest is a floor for the
run), the modules by their total time, and the longest tests. ``--durations`` gives the last of
these only: which worker ran what, and when, it does not say.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict

_PATH: str | None = None   # read at configure time: tests run with the PDQ_* variables removed


def configure() -> None:
    global _PATH
    _PATH = os.environ.get("PDQ_TEST_TIMELINE") or None


def pytest_runtest_logreport(report) -> None:
    if _PATH is None or os.environ.get("PYTEST_XDIST_WORKER"):
        return   # (an xdist worker's reports reach the controller, which writes them)
    node = getattr(report, "node", None)   # xdist's WorkerController, on the controller
    worker = node.gateway.id if node is not None else "main"
    with open(_PATH, "a") as out:
        out.write(f"{worker}\t{report.start:.3f}\t{report.stop:.3f}\t{report.when}\t{report.outcome}\t"
                  f"{report.nodeid}\n")


def main(path: str, top: int = 25) -> None:
    rows = []
    for line in open(path):
        worker, start, stop, when, outcome, nodeid = line.rstrip("\n").split("\t")
        rows.append((worker, float(start), float(stop), when, outcome, nodeid))
    if not rows:
        print("no tests recorded")
        return
    begin = min(r[1] for r in rows)
    end = max(r[2] for r in rows)
    print(f"{len({r[5] for r in rows})} tests, {end - begin:.0f} s from the first test's start to the last's end")
    busy, last = defaultdict(float), defaultdict(float)
    per_test, per_group, per_module = defaultdict(float), defaultdict(float), defaultdict(float)
    for worker, start, stop, _, _, nodeid in rows:
        busy[worker] += stop - start
        last[worker] = max(last[worker], stop - begin)
        per_test[nodeid] += stop - start
        test, _, group = nodeid.partition("@")
        per_module[test.split("::")[0]] += stop - start
        if group:
            per_group[group] += stop - start
    print("\nworkers: busy s, done at s")
    for worker in sorted(busy):
        print(f"  {worker:6} {busy[worker]:7.0f} {last[worker]:7.0f}")
    print("\nxdist groups (run whole on one worker): total s")
    for group, seconds in sorted(per_group.items(), key=lambda kv: -kv[1]):
        print(f"  {seconds:7.1f}  {group}")
    print(f"\nmodules, top {top}: total s")
    for module, seconds in sorted(per_module.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {seconds:7.1f}  {module}")
    print(f"\ntests, top {top}: s (setup + call + teardown)")
    for nodeid, seconds in sorted(per_test.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {seconds:7.1f}  {nodeid}")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
