"""The shipped device profiles parse and hold plausible numbers (torch-free)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from checkmate.profile import (
    PROFILE_FORMAT,
    DeviceProfile,
    ProfileError,
    available_profiles,
    load_profile,
    profiles_dir,
)

REPO = Path(__file__).resolve().parents[2]
FILES = sorted((REPO / "profiles").glob("*.json"))


def test_the_shipped_profiles_are_found() -> None:
    assert profiles_dir() == REPO / "profiles"
    assert {"cpu", "a100", "h100"} <= set(available_profiles())
    assert [p.stem for p in FILES] == available_profiles()


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_every_profile_parses_with_sane_numbers(path: Path) -> None:
    doc = json.loads(path.read_text())
    assert doc["format"] == PROFILE_FORMAT and doc["version"] == 1
    prof = load_profile(path)
    assert prof.name == path.stem
    for dtype, flops in prof.peak_flops.items():
        assert 1e9 <= flops <= 1e16, (dtype, flops)  # a laptop core .. a next-gen accelerator
    assert 1e9 <= prof.memory_bandwidth <= 1e14
    assert 0 <= prof.launch_overhead <= 1e-3
    assert 1e8 <= prof.host_bandwidth <= prof.memory_bandwidth
    assert 0 <= prof.host_latency <= 1e-3
    assert all(t >= 0 for t in prof.ops.values())
    assert DeviceProfile.from_dict(prof.to_dict(), where=str(path)) == prof


def test_gpu_profiles_order_as_the_hardware_does() -> None:
    h100, a100, cpu = load_profile("h100"), load_profile("a100"), load_profile("cpu")
    for gpu in (h100, a100):
        assert gpu.peak_flops["bfloat16"] > 10 * gpu.peak_flops["float32"] / 2  # tensor cores
    for dtype in ("float32", "bfloat16", "float16"):
        assert h100.peak_flops[dtype] > a100.peak_flops[dtype] > cpu.peak_flops[dtype]
    assert h100.memory_bandwidth > a100.memory_bandwidth > cpu.memory_bandwidth
    assert h100.peak_flops["bfloat16"] == pytest.approx(989e12, rel=0.01)
    assert h100.memory_bandwidth == pytest.approx(3.35e12, rel=0.01)
    assert a100.peak_flops["bfloat16"] == pytest.approx(312e12, rel=0.01)


REQUIRED = ["format", "version", "name", "device", "peak_flops", "memory_bandwidth", "launch_overhead"]
REQUIRED += ["host_bandwidth", "host_latency"]


@pytest.mark.parametrize("field", REQUIRED)
def test_a_missing_field_is_named(field: str) -> None:
    doc = load_profile("cpu").to_dict()
    del doc[field]
    with pytest.raises(ProfileError, match=f"field '{field}'"):
        DeviceProfile.from_dict(doc, where="x.json")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("launch_overhead", -1e-6),
        ("memory_bandwidth", float("inf")),
        ("memory_bandwidth", "fast"),
        ("host_latency", True),
        ("peak_flops", {"bfloat16": 1e12}),
        ("ops", {"aten.mm.default()": -1.0}),
        ("version", 0),
    ],
)
def test_a_malformed_field_is_named(field: str, value: object) -> None:
    doc = load_profile("cpu").to_dict()
    doc[field] = value
    with pytest.raises(ProfileError, match=f"x.json: field '{field}"):
        DeviceProfile.from_dict(doc, where="x.json")


def test_a_newer_version_is_refused_with_advice() -> None:
    doc = {**load_profile("cpu").to_dict(), "version": 2}
    with pytest.raises(ProfileError, match=r"newer than this checkmate reads.*upgrade"):
        DeviceProfile.from_dict(doc)


def test_unknown_name_lists_the_available_profiles() -> None:
    with pytest.raises(ProfileError, match=r"available profiles: .*a100.*cpu.*h100"):
        load_profile("tpu")


def test_loading_profiles_does_not_import_torch() -> None:
    code = "import sys, checkmate.profile as p; p.load_profile('h100'); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
