"""Process start-up without rereading transformers' source: its import structure, remembered.

``import transformers`` and the first import of anything under ``transformers.models`` (a tokenizer
class, a model class) each build transformers' lazy import table by reading every Python file of
its ``models`` package and scanning it for ``__all__`` and backend markers
(``transformers.utils.import_utils.define_import_structure``): about 2,400 files, 0.2-0.4 s of
CPU each time, twice in every process that loads a tokenizer or a model (the driver's preflight,
the data source, each worker). The table depends only on those files, so this module remembers
it on disk, in rlgraph's cache (`cache_dir`), and later processes read it back (a few ms) after
checking that no file of the package changed: an entry holds a fingerprint of the directory's
tree (each ``.py`` file's path, size and modification time) and the transformers version, and
a mismatch scans again. Likewise the map of import names to installed distributions
(``importlib.metadata.packages_distributions()``, which reads the file list of every installed
package, ~24,000 paths, 0.3-0.5 s of CPU) that ``transformers.utils.import_utils`` builds when it
is imported: remembered per import path, with a fingerprint of the distributions' records on it
(`path_fingerprint`: the ``*.dist-info`` names, which installing, upgrading or removing a package
changes). Measured in docs/performance.md (start-up).

`install` (called when rlgraph is imported) puts a one-shot import hook in ``sys.meta_path``
that wraps ``define_import_structure`` as soon as transformers defines it, before transformers
uses it; it does nothing if transformers already built its table in this process. Anything that
fails here (an unreadable or read-only cache, a transformers without that function) means
"nothing remembered": transformers scans, as it does without rlgraph. ``RLGRAPH_IMPORT_CACHE=0``
turns it off.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

__all__ = ["SWITCH", "ImportStructures", "cache_dir", "install", "write_json"]

SWITCH = "RLGRAPH_IMPORT_CACHE"  # "0": transformers scans its sources in every process, as it does alone
TARGET = "transformers.utils.import_utils"


def cache_dir() -> Path | None:
    """rlgraph's cache: ``$RLGRAPH_CACHE``, else ``$XDG_CACHE_HOME/rlgraph``, else
    ``~/.cache/rlgraph`` (None without a home directory to expand ``~`` into)."""
    try:
        base = os.environ.get("RLGRAPH_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "rlgraph"
        return Path(base).expanduser()
    except RuntimeError:
        return None


def write_json(path: Path, data: Any, indent: int | None = None) -> bool:
    """Write `data` to `path` as JSON atomically (a temp file beside it, then a rename: processes that
    start at once read the old file or the new one, never half of one). False if it could not be
    written (a read-only cache): the caller's cache then stays as it was."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=indent)
        os.replace(tmp, path)
        return True
    except OSError:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        return False


class ImportStructures:
    """The results of ``define_import_structure(path, prefix)`` on disk, one JSON file per
    transformers version (``transformers_imports-<version>.json`` in `cache_dir`), each entry
    checked against its directory's fingerprint when read, and the maps of import names to
    distributions, one per import path (`distributions`). Writes are atomic (several processes
    start at once); a lost write costs one scan."""

    KEEP = 8  # maps of distributions kept, one per import path, the newest

    def __init__(self, version: str, directory: Path | None = None) -> None:
        directory = directory or cache_dir()
        safe = "".join(c if c.isalnum() or c in ".-+" else "_" for c in version)
        self.path = directory / f"transformers_imports-{safe}.json" if directory is not None else None
        self._prints: dict[str, str] = {}  # directory -> its fingerprint, computed once per process
        self._entries: dict[str, Any] | None = None
        self._lock = threading.RLock()  # threads import transformers' packages side by side

    def fingerprint(self, directory: Path) -> str:
        """A hash of every ``.py`` file under `directory`: its path, size and modification time."""
        key = str(directory)
        if key not in self._prints:
            h = hashlib.sha256()
            for root, dirs, files in os.walk(directory):
                dirs[:] = sorted(d for d in dirs if d != "__pycache__")
                for name in sorted(files):
                    if name.endswith(".py"):
                        st = os.stat(os.path.join(root, name))
                        h.update(f"{os.path.relpath(root, directory)}/{name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
            self._prints[key] = h.hexdigest()
        return self._prints[key]

    def _read(self) -> dict[str, Any]:
        if self._entries is None:
            try:
                raw = json.loads(self.path.read_text()) if self.path is not None else {}
                self._entries = dict(raw) if isinstance(raw, dict) else {}
            except (OSError, ValueError, TypeError):
                self._entries = {}
        return self._entries

    def distributions(self, compute: Callable[[], Any]) -> Any:
        """``importlib.metadata.packages_distributions()`` (`compute`), remembered for this import
        path (`path_fingerprint`)."""
        try:
            key = f"packages_distributions|{path_fingerprint()}"  # the driver's and Ray workers' paths differ
            with self._lock:
                entry = self._read().get(key)
            if isinstance(entry, dict) and isinstance(entry.get("map"), dict):
                found = entry["map"]
                if all(isinstance(k, str) and isinstance(v, list) for k, v in found.items()):
                    return {k: list(v) for k, v in found.items()}
        except Exception:  # noqa: BLE001 - only a shortcut: compute it
            return compute()
        result = compute()
        try:
            self._write(key, {"map": {str(k): list(v) for k, v in dict(result).items()}}, "packages_distributions|")
        except Exception:  # noqa: BLE001 - not remembered: the next process computes it
            pass
        return result

    def get(self, directory: Path, prefix: str | None) -> Any:
        """The remembered structure, decoded into fresh objects, or None."""
        with self._lock:
            entry = self._read().get(f"{directory}|{prefix}")
        if not isinstance(entry, dict) or entry.get("fingerprint") != self.fingerprint(directory):
            return None
        try:
            return _decode(entry["structure"])
        except (KeyError, TypeError, ValueError):
            return None

    def put(self, directory: Path, prefix: str | None, structure: Any) -> None:
        entry = {"fingerprint": self.fingerprint(directory), "structure": _encode(structure)}
        self._write(f"{directory}|{prefix}", entry)

    def _write(self, key: str, entry: dict[str, Any], kind: str = "") -> None:
        """Add `entry` as the newest; of the entries whose keys start with `kind`, keep `KEEP` (import
        paths come and go)."""
        if self.path is None:
            return
        with self._lock:  # one writer at a time: json.dump walks the entries another put would change
            entries = self._read()
            entries.pop(key, None)
            entries[key] = entry
            if kind:
                same = [k for k in entries if k.startswith(kind)]
                for old in same[:-self.KEEP]:
                    del entries[old]
            write_json(self.path, entries)  # not written (a read-only cache): every process scans


def path_fingerprint() -> str:
    """A hash of the import path: each ``sys.path`` folder and the installed distributions' records in
    it (the names of its ``*.dist-info`` and ``*.egg-info`` entries, which carry the version, and its
    ``.pth`` files with their times): installing, upgrading or removing a package changes them, a
    file written into the working folder (on the path as '') does not."""
    h = hashlib.sha256(sys.version.encode())
    for entry in sys.path:
        if not isinstance(entry, str):
            continue
        try:
            with os.scandir(entry or ".") as it:
                names = sorted(e.name for e in it if e.name.endswith((".dist-info", ".egg-info", ".pth", ".egg-link")))
            stamp = ",".join(f"{n}:{os.stat(os.path.join(entry or '.', n)).st_mtime_ns}" if n.endswith(".pth") else n
                             for n in names)
        except OSError:  # not a folder (a zip), or gone
            stamp = "-"
        h.update(f"{entry}:{stamp}\n".encode())
    return h.hexdigest()


def _encode(x: Any) -> Any:
    """JSON for the structure's types: dicts (str or frozenset keys), sets, frozensets, strings."""
    if isinstance(x, dict):
        return {"d": [[_encode(k), _encode(v)] for k, v in x.items()]}
    if isinstance(x, frozenset):
        return {"f": sorted(_encode(v) for v in x)}
    if isinstance(x, set):
        return {"s": sorted(_encode(v) for v in x)}
    if isinstance(x, str):
        return x
    raise TypeError(f"cannot remember a {type(x).__name__} in transformers' import structure")


def _decode(x: Any) -> Any:
    if isinstance(x, str):
        return x
    if isinstance(x, dict) and len(x) == 1:
        (tag, value), = x.items()
        if tag == "d":
            return {_decode(k): _decode(v) for k, v in value}
        if tag == "f":
            return frozenset(_decode(v) for v in value)
        if tag == "s":
            return {_decode(v) for v in value}
    raise ValueError(f"not an encoded import structure: {str(x)[:80]}")


def remembering(define: Callable[..., Any], store: ImportStructures) -> Callable[..., Any]:
    """`define` (transformers' ``define_import_structure``) answered from `store` where it can.
    A result is encoded before it is returned: transformers changes the table it gets."""

    def define_import_structure(module_path: Any, prefix: str | None = None) -> Any:
        try:
            path = Path(module_path)
            directory = (path if path.is_dir() else path.parent).resolve()
            found = store.get(directory, prefix)
        except Exception:  # noqa: BLE001 - only a shortcut: transformers scans
            return define(module_path, prefix)
        if found is not None:
            return found
        result = define(module_path, prefix)
        try:
            store.put(directory, prefix, result)
        except Exception:  # noqa: BLE001 - not remembered: the next process scans
            pass
        return result

    define_import_structure.remembered = define  # type: ignore[attr-defined]
    return define_import_structure


def _store() -> ImportStructures | None:
    try:
        from importlib.metadata import version

        return ImportStructures(version("transformers"))
    except Exception:  # no metadata (a source tree on the path): transformers scans
        return None


def _patch(module: Any, store: ImportStructures | None = None) -> None:
    define = getattr(module, "define_import_structure", None)
    if define is None or hasattr(define, "remembered"):
        return
    store = store or _store()
    if store is not None:
        module.define_import_structure = remembering(define, store)


class _Hook:
    """A one-shot ``sys.meta_path`` finder: finds `TARGET` with the other finders and patches the
    module right after it runs, before the package that imported it goes on."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != TARGET:
            return None
        _remove_hook()
        from importlib.util import find_spec

        spec = find_spec(fullname)
        loader = getattr(spec, "loader", None)
        run = getattr(loader, "exec_module", None)
        if run is None:
            return spec

        def exec_module(module: Any) -> None:
            store = _store()
            if store is None:
                run(module)
                return
            import importlib.metadata as metadata

            compute = metadata.packages_distributions
            metadata.packages_distributions = lambda: store.distributions(compute)  # type: ignore[assignment]
            try:
                run(module)  # it maps import names to distributions as it runs
            finally:
                metadata.packages_distributions = compute  # type: ignore[assignment]
            _patch(module, store)

        loader.exec_module = exec_module  # type: ignore[union-attr]
        return spec


def _remove_hook() -> None:
    # a new list, never the old one changed in place: another thread may be importing, walking the
    # old list, and would skip a finder (an import of an existing module failing) if it shifted
    sys.meta_path = [f for f in sys.meta_path if not isinstance(f, _Hook)]


def install() -> None:
    """Remember transformers' import structure in this process (see the module's docstring)."""
    if os.environ.get(SWITCH, "1") == "0":
        return
    module = sys.modules.get(TARGET)
    if module is not None:  # transformers is imported: its models' table may still be built
        _patch(module)
    elif not any(isinstance(f, _Hook) for f in sys.meta_path):
        sys.meta_path = [_Hook(), *sys.meta_path]  # a new list, as `_remove_hook` makes
