"""CSV files of benchmark rows: one dataclass instance a line, its fields as columns.

Every benchmark writes its measurements as rows of a dataclass and reads them back (to
re-render tables without measuring again); the column types come from the dataclass's
annotations, so a file round-trips to equal rows.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["write_rows", "read_rows", "coerce"]

T = TypeVar("T")


def write_rows(rows: Sequence[Any], path: Path, cls: type, *, exclude: Iterable[str] = ()) -> Path:
    """Write ``rows`` (instances of the dataclass ``cls``) to ``path``, every field but
    ``exclude`` as a column, None as an empty cell; returns ``path``."""
    skip = set(exclude)
    names = [f.name for f in fields(cls) if f.name not in skip]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=names, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if v is None else v) for k, v in asdict(r).items() if k not in skip})
    return path


def coerce(record: Mapping[str, Any], cls: type[T]) -> T:
    """An instance of the dataclass ``cls`` from a mapping of strings (a CSV line) or of
    JSON values: each value converted to its field's annotated type; unknown keys are
    ignored; an empty value is None where the field allows it, ``""`` for a string, else the
    field's default."""
    kinds = {f.name: str(f.type) for f in fields(cls)}  # type: ignore[arg-type]
    kw: dict[str, Any] = {}
    for k, v in record.items():
        kind = kinds.get(k)
        if kind is None:
            continue
        if v is None or v == "":
            if "None" in kind:
                kw[k] = None
            elif kind.startswith("str"):
                kw[k] = ""
            continue
        if kind.startswith("float"):
            kw[k] = float(v)
        elif kind.startswith("int"):
            kw[k] = int(v)
        elif kind.startswith("bool"):
            kw[k] = v if isinstance(v, bool) else v == "True"
        else:
            kw[k] = v if kind.startswith(("tuple", "list", "dict")) else str(v)
    return cls(**kw)


def read_rows(path: Path, cls: type[T]) -> list[T]:
    """The rows :func:`write_rows` wrote to ``path``, as instances of ``cls``."""
    with path.open() as fh:
        return [coerce(rec, cls) for rec in csv.DictReader(fh)]
