"""Resident memory of the current process."""

from __future__ import annotations

import resource
from pathlib import Path

_STATUS = Path("/proc/self/status")


def rss_kib() -> int:
    """Current resident set size in KiB (/proc), else the peak so far (getrusage)."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return peak_rss_kib()


def peak_rss_kib() -> int:
    """Peak resident set size in KiB (Linux reports ru_maxrss in KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
