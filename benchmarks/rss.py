"""Peak resident memory of this process, for the memory benchmarks."""

from __future__ import annotations


def peak_rss_kib() -> int:
    """Peak resident memory of this process, in KiB.

    Linux's ``VmHWM`` (``/proc/self/status``), the high-water mark of this process's own memory
    map. ``ru_maxrss`` is only the fallback: Linux carries it across ``exec``, so a process
    started by a parent with a large resident set (a long test session) reports the parent's
    size as its own peak until it outgrows it, and a step's growth reads as zero.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
