"""Facts about local processes, for code that must not load torch (``pdqueue up``,
``submit``, ``status``) as well as for the transfer side; and ``die_with_parent``, the one
way pdqueue's supervisors (``pdqueue up``, the benches, the embedded Redis server) tie a
child's life to theirs.

Imports the standard library only.
"""

from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1   # <linux/prctl.h>


def _load_prctl():
    """libc's ``prctl``, looked up once here, in the parent: a ``preexec_fn`` runs between
    fork and exec, where loading a library (or importing ctypes) is best avoided."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_prctl = _load_prctl()


def die_with_parent() -> None:
    """A ``subprocess.Popen(preexec_fn=...)`` (between fork and exec, in the child): the child
    gets SIGTERM when the thread that started it ends (Linux's PR_SET_PDEATHSIG, which
    survives exec), so a supervisor that is SIGKILLed, or crashes, leaves no child behind. A
    pdqueue worker takes that SIGTERM as a warm stop. Should the parent have died already,
    between the fork and the prctl (the signal would then never come), the child ends here
    before exec. Elsewhere than Linux: nothing (stop children explicitly, as every
    supervisor here also does)."""
    if _prctl is None:
        return
    parent = os.getppid()
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:   # adopted meanwhile: the parent is gone (a supervisor may be pid 1 itself)
        os._exit(128 + signal.SIGTERM)


def pid_alive(pid: int) -> bool:
    """A process with this pid exists on this host (one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
