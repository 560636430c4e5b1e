"""``benchmarks.heap``: the C heap the CPU benchmarks time their steps on."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks import heap

ROOT = Path(__file__).resolve().parents[2]
GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def test_is_fixed_needs_every_tunable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLIBC_TUNABLES", heap.FIXED)
    assert heap.is_fixed()
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2:" + heap.FIXED)
    assert heap.is_fixed()
    monkeypatch.setenv("GLIBC_TUNABLES", heap.FIXED.split(":")[0])  # mmap, still trimmed
    assert not heap.is_fixed()
    monkeypatch.delenv("GLIBC_TUNABLES")
    assert not heap.is_fixed()


@pytest.mark.skipif(not GLIBC, reason="glibc's tunables")
def test_reexec_keeps_the_callers_tunables_and_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, list[str], dict[str, str]]] = []
    monkeypatch.setattr(os, "execve", lambda path, args, env: calls.append((path, list(args), dict(env))))
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    heap.reexec_fixed("benchmarks.peers_compile", ["--device", "cpu"])
    assert len(calls) == 1
    path, args, env = calls[0]
    assert path == sys.executable
    assert args == [sys.executable, "-m", "benchmarks.peers_compile", "--device", "cpu"]
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:" + heap.FIXED
    assert "no mmap" not in heap.describe()  # this process still runs on the defaults

    calls.clear()
    monkeypatch.setenv("GLIBC_TUNABLES", heap.FIXED)
    heap.reexec_fixed("benchmarks.peers_compile", [])
    assert calls == []  # already on the fixed heap: no second start
    assert "no mmap and no trim" in heap.describe()


PROBE = textwrap.dedent(
    """
    import ctypes
    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Info
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    block = libc.malloc(48 << 20)
    print(libc.mallinfo2().hblkhd)
    libc.free(block)
    """
)


@pytest.mark.skipif(not GLIBC, reason="glibc's tunables")
def test_the_tunables_take_effect_here() -> None:
    """Under :data:`FIXED` a 48 MiB block comes from the heap; under the defaults from mmap
    (the difference the benchmarks' step times depend on)."""
    if not hasattr(__import__("ctypes").CDLL("libc.so.6"), "mallinfo2"):
        pytest.skip("glibc before 2.33 has no mallinfo2")

    def mapped(tunables: str | None) -> int:
        # neither the tunables nor their MALLOC_*_ aliases of the environment this runs in
        env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}
        if tunables is not None:
            env["GLIBC_TUNABLES"] = tunables
        out = subprocess.run(
            [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
        )
        return int(out.stdout.strip())

    assert mapped(None) >= 48 << 20
    assert mapped(heap.FIXED) == 0
