"""The per-device measurement tables (op times, scratch) and their files."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from checkmate.devcache import DeviceTable


class _Warn(UserWarning):
    pass


def _table() -> DeviceTable[int]:
    return DeviceTable("scratch", "checkmate-scratch", 3, int, "scratch-space cache", _Warn)


def test_a_table_of_an_older_version_is_measured_again_with_one_warning_and_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHECKMATE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CHECKMATE_CACHE", raising=False)
    path = tmp_path / "scratch" / "tag-cpu.json"
    path.parent.mkdir()
    old = {"format": "checkmate-scratch", "version": 2, "device_tag": "tag-cpu", "ops": {"op": 4096}}
    path.write_text(json.dumps(old))
    table = _table()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert table.table("tag-cpu") == {}  # the old entry is not read
        table.add("tag-cpu", "op", 8192)
        table.flush()
    said = [str(w.message) for w in got if issubclass(w.category, _Warn)]
    assert len(said) == 1, said  # reading it warns; replacing it does not warn again
    assert "version 2" in said[0] and "version 3" in said[0] and "measured again" in said[0]
    doc = json.loads(path.read_text())
    assert (doc["version"], doc["ops"]) == (3, {"op": 8192})
    table.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert table.table("tag-cpu") == {"op": 8192}  # the new file reads back, silently


def test_cpus_of_one_name_with_other_features_keep_their_measurements_apart() -> None:
    from checkmate.timing import _cpu_model

    def cpuinfo(flags: str) -> str:
        core = "processor\t: {}\nmodel name\t: AMD EPYC\nflags\t\t: {}\n"
        return core.format(0, flags) + "\n" + core.format(1, flags)

    zen3, zen4 = cpuinfo("fpu avx2 avx512f"), cpuinfo("fpu avx2 avx512f avx512_bf16")
    assert _cpu_model(zen3) != _cpu_model(zen4)  # a shared cache folder keeps them apart
    assert _cpu_model(zen3) == _cpu_model(cpuinfo("avx512f fpu avx2"))  # the flags' order is not a CPU
    assert _cpu_model(zen4).startswith("AMD EPYC:")
    assert _cpu_model("model name\t: AMD EPYC\n") == "AMD EPYC"  # no flags listed: the name alone
