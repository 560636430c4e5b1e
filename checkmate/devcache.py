"""Per-device tables of op measurements, in memory and in a versioned JSON file.

Op times (:mod:`checkmate.timing`) and scratch-space sizes (:mod:`checkmate.scratch`) are
measured once per op signature and device, and kept in ``<cache dir>/<folder>/<device
tag>.json`` (cache dir: see :func:`checkmate.cache.cache_dir`)::

    {"format": "checkmate-op-times", "version": 1, "device_tag": "...", "ops": {key: value}}

A file of another format or version, or one that cannot be read, is ignored with a
warning (its entries are measured again). New entries are merged with what other processes
wrote meanwhile and the file is replaced atomically. ``CHECKMATE_CACHE=0`` keeps the
tables in memory only.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Generic, TypeVar

from checkmate.cache import cache_dir, cache_enabled
from solvers.plan import atomic_write_text

__all__ = ["DeviceTable"]

V = TypeVar("V", int, float)


class DeviceTable(Generic[V]):
    """One kind of per-op measurement (op times, scratch bytes) for every device.

    Args:
        folder: the subfolder of the cache dir holding one file per device tag.
        fmt: the ``format`` field of its files.
        version: the ``version`` field; files of another version are ignored.
        kind: ``int`` or ``float``: the type of the values (negative ones are dropped).
        what: names the table in warnings (``"op-time cache"``).
        warning: the warning category for unreadable or unwritable files.
    """

    def __init__(
        self, folder: str, fmt: str, version: int, kind: type[V], what: str, warning: type[Warning]
    ) -> None:
        self.folder, self.fmt, self.version, self.what = folder, fmt, version, what
        self.kind: type[V] = kind
        self.warning = warning
        #: file (or device tag, with the cache disabled) -> key -> value
        self._tables: dict[str, dict[str, V]] = {}
        #: file -> (device tag, entries added since the last flush)
        self._new: dict[str, tuple[str, dict[str, V]]] = {}

    def table(self, tag: str) -> dict[str, V]:
        """The table of device ``tag`` (read from its file on first use); callers read it
        and add to it only with :meth:`add`."""
        path = self._path(tag)
        key = path or tag
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = self._read(Path(path)) if path is not None else {}
        return table

    def add(self, tag: str, key: str, value: V) -> None:
        """Record a new measurement (written by the next :meth:`flush`)."""
        self.table(tag)[key] = value
        path = self._path(tag)
        if path is not None:
            self._new.setdefault(path, (tag, {}))[1][key] = value

    def flush(self) -> None:
        """Write the entries added since the last flush (merged with what other processes
        wrote meanwhile; atomic replace); a file that cannot be written is warned about."""
        while self._new:
            path, (tag, new) = self._new.popitem()
            merged = self._read(Path(path), quiet=True)  # its reader warned already
            merged.update(new)
            doc = {"format": self.fmt, "version": self.version, "device_tag": tag, "ops": merged}
            try:
                atomic_write_text(Path(path), json.dumps(doc, indent=0, sort_keys=True))
            except OSError as exc:
                warnings.warn(f"cannot write {self.what} {path}: {exc}", self.warning, stacklevel=3)

    def clear(self) -> None:
        """Forget the tables held in memory (the files stay): as a new process starts."""
        self._tables.clear()

    def _path(self, tag: str) -> str | None:
        return str(cache_dir() / self.folder / f"{tag}.json") if cache_enabled() else None

    def _read(self, path: Path, *, quiet: bool = False) -> dict[str, V]:
        """The entries of ``path``; none (with a warning, unless ``quiet``) from a file that
        cannot be read or holds another format or version, which the next flush replaces."""
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            if not quiet:
                warnings.warn(f"ignoring unreadable {self.what} {path}: {exc}", self.warning, stacklevel=4)
            return {}
        if not isinstance(doc, dict) or doc.get("format") != self.fmt or doc.get("version") != self.version:
            if not quiet:
                found = (doc.get("format"), doc.get("version")) if isinstance(doc, dict) else (None, None)
                warnings.warn(
                    f"ignoring {self.what} {path}: written as {found[0]!r} version {found[1]}, this "
                    f"checkmate reads {self.fmt!r} version {self.version}; its ops are measured again "
                    "and the file replaced",
                    self.warning,
                    stacklevel=4,
                )
            return {}
        ops = doc.get("ops", {})
        if not isinstance(ops, dict):
            return {}
        ok = (int, float) if self.kind is float else (int,)
        return {
            str(k): self.kind(v)
            for k, v in ops.items()
            if isinstance(v, ok) and not isinstance(v, bool) and v >= 0
        }
