"""The plan document's schema: reading a plan file's JSON and checking every field a reader
uses, so that a truncated, hand-edited or hostile file ends in a :class:`PlanError` that
names the field, never in a TypeError deep inside the runtime (:mod:`solvers.plan` reads
and writes the documents).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from solvers.errors import PlanError
from solvers.schedule import COMPUTE, FREE, PAGEIN, PAGEOUT

__all__ = ["PLAN_FORMAT", "PLAN_VERSION", "load_json", "check_document", "document_checksum", "short"]

PLAN_FORMAT = "checkmate-plan"
PLAN_VERSION = 1


def document_checksum(doc: Mapping[str, Any]) -> str:
    """``"sha256:<hex>"`` of the canonical JSON of ``doc`` without its ``checksum`` field.

    Canonical = sorted keys, no whitespace; JSON numbers round-trip exactly, so the checksum
    of a document read back equals the one computed before writing it.
    """
    body = {k: v for k, v in doc.items() if k != "checksum"}
    # Normalise through one JSON round trip so non-str keys and tuples hash as they are stored.
    text = json.dumps(json.loads(json.dumps(body)), sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def load_json(p: Path) -> Any:
    """The JSON of a plan file (:func:`solvers.io.read_json`; failures as PlanError)."""
    from solvers.io import read_json

    return read_json(p, PlanError, "plan")


#: The type of every field a reader uses: (kind, may be null). Kinds: "str", "bytes" (an
#: int >= 0), "int" (an int >= 0), "number" (an int or float; not a bool), "dict", "list".
#: Numbers must convert to a float (an int of 400 digits does not).
_FIELD_KINDS: dict[str, tuple[str, bool]] = {
    "strategy": ("str", False),
    "status": ("str", False),
    "budget_bytes": ("bytes", False),
    "schedule": ("list", False),
    "cost": ("number", True),
    "lower_bound": ("number", True),
    "peak_memory": ("bytes", True),
    "solve_seconds": ("number", True),
    "build_seconds": ("number", True),
    "total_cost": ("number", True),
    "overhead": ("number", True),
    "recomputes": ("int", True),
    "reference_peak": ("bytes", True),
    "graph_name": ("str", True),
    "n_nodes": ("int", True),
    "graph_fingerprint": ("str", True),
    "cost_fingerprint": ("str", True),
    "library_version": ("str", True),
    "info": ("dict", False),  # absent or an object: readers do doc.get("info", {})
    "decisions": ("list", True),
    "stages": ("dict", True),
    "profile_id": ("str", True),
    "time_limit": ("number", True),
    "cache_key": ("str", True),
    "key_parts": ("dict", True),
    "checksum": ("str", True),
}


def _kind_ok(value: Any, kind: str) -> bool:
    if kind == "str":
        return isinstance(value, str)
    if kind == "dict":
        return isinstance(value, dict)
    if kind == "list":
        return isinstance(value, list)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        float(value)
    except OverflowError:
        return False
    return kind == "number" or (isinstance(value, int) and value >= 0)


_KIND_WORDS = {
    "str": "a string",
    "bytes": "an integer number of bytes >= 0",
    "int": "an integer >= 0",
    "number": "a number",
    "dict": "a JSON object",
    "list": "a list",
}


def _node_ref_ok(value: Any) -> bool:
    return isinstance(value, (int, str)) and not isinstance(value, bool)


def check_document(doc: Any, where: str) -> None:
    try:
        _check_fields(doc, where)
    except RecursionError:
        raise PlanError(f"{where}plan nested too deeply to be read") from None


def _check_fields(doc: Any, where: str) -> None:
    if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
        raise PlanError(f'{where}not a checkmate plan (missing "format": "{PLAN_FORMAT}")')
    version = doc.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version > PLAN_VERSION or version < 1:
        raise PlanError(
            f"{where}plan format version {short(version)} is not supported (this checkmate reads {PLAN_VERSION})"
        )
    for key in ("strategy", "status", "budget_bytes", "schedule"):
        if key not in doc:
            raise PlanError(f"{where}plan lacks field {key!r}")
    checksum = doc.get("checksum")
    if checksum is not None and checksum != document_checksum(doc):
        raise PlanError(f"{where}plan file was modified after it was written (checksum mismatch); re-plan it")
    for key, (kind, nullable) in _FIELD_KINDS.items():
        value = doc.get(key)
        if value is None and (nullable or key not in doc):
            continue
        if not _kind_ok(value, kind):
            raise PlanError(
                f"{where}field {key!r} must be {_KIND_WORDS[kind]}{' or null' if nullable else ''}, "
                f"got {type(value).__name__} {short(value)}"
            )
    for k, step in enumerate(doc["schedule"]):
        if not (
            isinstance(step, list)
            and len(step) == 2
            and isinstance(step[0], str)
            and step[0] in (COMPUTE, FREE, PAGEIN, PAGEOUT)
            and _node_ref_ok(step[1])
        ):
            raise PlanError(f"{where}schedule step {k} is malformed: {short(step)}")
    for k, dec in enumerate(doc.get("decisions") or ()):
        if not (
            isinstance(dec, dict)
            and _node_ref_ok(dec.get("id"))
            and _kind_ok(dec.get("computes"), "int")
            and isinstance(dec.get("name", ""), str)
            and isinstance(dec.get("checkpoint", False), bool)
        ):
            raise PlanError(
                f"{where}decision {k} is malformed (expected id, name, computes, checkpoint): {short(dec)}"
            )


def short(value: Any) -> str:
    """``repr(value)`` cut to one short line (values in error messages come from files)."""
    try:
        text = repr(value)
    except (RecursionError, ValueError):
        text = f"a {type(value).__name__}"
    text = " ".join(text.split())
    return text if len(text) <= 60 else text[:57] + "..."
