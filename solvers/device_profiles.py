"""The shipped device profiles (``profiles/*.json``): where they are, and reading one (torch-free).

The one place that finds and reads profile files. :mod:`checkmate.profile` validates a
document into a ``DeviceProfile``; :mod:`solvers.hostlink` reads its host link numbers.

Where they are: ``solvers/_profiles``. In the source tree (and an editable install) that is a
symlink to the top-level ``profiles/`` folder, the documented place of the files; a built
wheel holds a copy of them there (``[tool.setuptools.package-data]`` follows the link), so a
non-editable ``pip install`` has them too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from solvers.errors import CheckmateError

__all__ = ["available", "load_document", "profiles_dir"]


def profiles_dir() -> Path:
    """The folder of the shipped profiles (the top-level ``profiles/`` in a source tree)."""
    return (Path(__file__).parent / "_profiles").resolve()


def available() -> list[str]:
    """Names of the shipped profiles (``"a100"``, ``"cpu"``, ``"h100"``, ...), sorted."""
    folder = profiles_dir()
    return sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []


def load_document(
    spec: str | Path, *, error: type[CheckmateError] = CheckmateError
) -> tuple[Path, dict[str, Any]]:
    """The path and JSON document of a profile: a shipped name (any case) or a file path.

    Args:
        spec: ``"h100"`` (see :func:`available`), or the path of a profile JSON file.
        error: the :class:`CheckmateError` subclass to raise (``checkmate.profile`` passes
            its ``ProfileError``).

    Raises:
        error: the name is unknown (the message lists the shipped ones), or the file does
            not exist, cannot be read, is not JSON, or is not a JSON object.
    """
    text = str(spec)
    path = Path(text).expanduser()
    if not (text.endswith(".json") or path.is_file()):
        shipped = profiles_dir() / f"{text.lower()}.json"
        if not shipped.is_file():
            names = ", ".join(available()) or "none found in " + str(profiles_dir())
            raise error(
                f"unknown device profile {text!r}; available profiles: {names} "
                "(or pass the path to a profile JSON file)"
            )
        path = shipped
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"device profile file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"device profile file {path} cannot be read: {exc}") from exc
    except (json.JSONDecodeError, RecursionError) as exc:
        raise error(f"device profile file {path} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise error(f"device profile file {path} holds a {type(doc).__name__}, not a JSON object")
    return path, doc
