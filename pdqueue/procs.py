"""Facts about local processes, for code that must not load torch (``pdqueue up``,
``submit``, ``status``) as well as for the transfer side.

Imports the standard library only.
"""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """A process with this pid exists on this host (one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
