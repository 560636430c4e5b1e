"""The C heap a CPU benchmark times its steps on.

glibc's ``malloc`` hands a block over its mmap threshold (128 KiB, raised as such blocks are
freed, up to 32 MiB) to ``mmap`` and gives it back to the system when it is freed, and it
trims the top of its heap when more than twice that threshold is free there. A training step
on CPU frees most of what it allocated, so the next step touches fresh pages again: the
kernel zeroes each one on a page fault. That cost grows with the memory a step allocates
and returns, not with its arithmetic, so a plan that lowers the peak also saves page faults,
by an amount no cost model of the ops sees. Measured with :mod:`benchmarks.peers_compile`
on a GPT-2 (4 layers, d=128; torch 2.13, 2-core EPYC, one thread), planned at 71.80 MiB:
the plan's step measured -0.03% and +5.22% over keeping every value under glibc's defaults
(two runs; +6.80% and +6.38% planned), and +6.93% and +7.33% with the heap below (+6.44%
and +6.90% planned), where keeping every value also ran 285 ms a step instead of 290-319.

:data:`FIXED` sets the threshold above any tensor and turns trimming off: every block comes
from the heap and stays there, and a step's time is its ops'. glibc reads its tunables
when the process starts, so :func:`reexec_fixed` starts the benchmark again with them.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Sequence

__all__ = ["FIXED", "describe", "is_fixed", "reexec_fixed"]

#: glibc tunables: no block over the mmap threshold (4 GiB), no trimming (16 GiB)
FIXED = "glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=17179869184"


def _glibc() -> bool:
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def is_fixed() -> bool:
    """Whether this process started with :data:`FIXED` among its glibc tunables."""
    have = os.environ.get("GLIBC_TUNABLES", "").split(":")
    return all(t in have for t in FIXED.split(":"))


def describe() -> str:
    """The heap in a few words, for a report's machine line."""
    if not _glibc():
        return f"{platform.libc_ver()[0] or 'system'} malloc"
    if is_fixed():
        return "glibc malloc with no mmap and no trim (`GLIBC_TUNABLES=" + FIXED + "`)"
    return "glibc malloc defaults (mmap and trim thresholds)"


def reexec_fixed(module: str, argv: Sequence[str]) -> None:
    """Start ``python -m module *argv`` again with :data:`FIXED` set, in place of this
    process; returns only where that is not needed (already set) or not possible (no glibc)."""
    if not _glibc() or is_fixed():
        return
    env = dict(os.environ)
    env["GLIBC_TUNABLES"] = ":".join(t for t in (env.get("GLIBC_TUNABLES", ""), FIXED) if t)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)
