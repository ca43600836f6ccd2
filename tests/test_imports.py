"""`rlgraph.imports`: transformers' import table remembered on disk, the same as a scan's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from rlgraph import imports
from rlgraph.imports import ImportStructures, remembering

STRUCTURE = {
    "qwen2": {frozenset({"torch"}): {"modeling_qwen2": {"Qwen2Model", "Qwen2ForCausalLM"}},
              frozenset(): {"configuration_qwen2": {"Qwen2Config"}}},
    frozenset({"tokenizers"}): {"tokenization_x": {"XTokenizer"}},
}


def _package(root):
    (root / "qwen2").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "qwen2" / "modeling_qwen2.py").write_text("__all__ = ['Qwen2Model']\n")
    return root


class _Define:
    """A stand-in for transformers' scan: counts its calls and returns a fresh copy each time."""

    def __init__(self):
        self.calls = 0

    def __call__(self, module_path, prefix=None):
        self.calls += 1
        return imports._decode(imports._encode(STRUCTURE))


def test_the_structure_round_trips_through_json():
    encoded = json.loads(json.dumps(imports._encode(STRUCTURE)))
    assert imports._decode(encoded) == STRUCTURE
    with pytest.raises(TypeError, match="cannot remember a int"):
        imports._encode({"x": 1})
    with pytest.raises(ValueError, match="not an encoded import structure"):
        imports._decode({"q": []})


def test_a_second_process_reads_the_table_back_and_a_changed_file_scans_again(tmp_path):
    pkg, cache = _package(tmp_path / "models"), tmp_path / "cache"
    define = _Define()
    first = remembering(define, ImportStructures("5.0", cache))
    got = first(str(pkg / "__init__.py"))  # a file names its directory, as transformers passes it
    assert got == STRUCTURE and define.calls == 1
    got["qwen2"].clear()  # transformers changes the table it gets: what was remembered is not changed
    again = remembering(define, ImportStructures("5.0", cache))  # another process: a fresh store
    assert again(pkg) == STRUCTURE and define.calls == 1
    assert again(pkg, "models") == STRUCTURE and define.calls == 2  # another prefix is another entry
    other_version = remembering(define, ImportStructures("5.1", cache))
    assert other_version(pkg) == STRUCTURE and define.calls == 3
    source = pkg / "qwen2" / "modeling_qwen2.py"
    source.write_text("__all__ = ['Qwen2Model', 'Qwen2ForCausalLM']\n")
    os.utime(source, ns=(time.time_ns(), time.time_ns() + 10**9))
    changed = remembering(define, ImportStructures("5.0", cache))
    assert changed(pkg) == STRUCTURE and define.calls == 4  # a file changed: scanned again
    assert remembering(define, ImportStructures("5.0", cache))(pkg) == STRUCTURE and define.calls == 4


def test_the_map_of_distributions_is_read_back_per_import_path_until_a_folder_changes(tmp_path, monkeypatch):
    cache, calls = tmp_path / "cache", []

    def compute():
        calls.append(1)
        return {"yaml": ["PyYAML"], "torch": ["torch"]}

    assert ImportStructures("5.0", cache).distributions(compute) == compute() and len(calls) == 2
    assert ImportStructures("5.0", cache).distributions(compute) == {"yaml": ["PyYAML"], "torch": ["torch"]}
    assert len(calls) == 2  # another process, the same import path: read back
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setattr(sys, "path", [str(site), *sys.path])
    ImportStructures("5.0", cache).distributions(compute)
    assert len(calls) == 3  # another import path: its own map
    ImportStructures("5.0", cache).distributions(compute)
    assert len(calls) == 3
    (site / "new_package-1.0.dist-info").mkdir()  # a package installed there
    os.utime(site, ns=(time.time_ns(), time.time_ns() + 10**9))
    ImportStructures("5.0", cache).distributions(compute)
    assert len(calls) == 4
    for i in range(ImportStructures.KEEP + 2):  # import paths come and go: the newest few are kept
        monkeypatch.setattr(sys, "path", [str(tmp_path / f"p{i}"), *sys.path])
        ImportStructures("5.0", cache).distributions(compute)
    kept = [k for k in json.loads((cache / "transformers_imports-5.0.json").read_text())
            if k.startswith("packages_distributions|")]
    assert len(kept) == ImportStructures.KEEP


def test_threads_remembering_at_once_all_get_their_tables(tmp_path):
    """transformers' model packages import on several threads at once; one store per process."""
    import threading

    store, errors = ImportStructures("5.0", tmp_path / "cache"), []
    dirs = [_package(tmp_path / f"models{i}") for i in range(8)]

    def put_and_get(d):
        try:
            for _ in range(5):
                store.put(d.resolve(), None, STRUCTURE)
                assert store.get(d.resolve(), None) == STRUCTURE
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=put_and_get, args=(d,)) for d in dirs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(json.loads((tmp_path / "cache" / "transformers_imports-5.0.json").read_text())) == len(dirs)


def test_a_broken_or_unwritable_cache_means_a_scan_every_time(tmp_path):
    pkg = _package(tmp_path / "models")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "transformers_imports-5.0.json").write_text("{not json")
    define = _Define()
    assert remembering(define, ImportStructures("5.0", cache))(pkg) == STRUCTURE and define.calls == 1
    entries = json.loads((cache / "transformers_imports-5.0.json").read_text())  # rewritten whole
    assert list(entries) == [f"{pkg.resolve()}|None"]
    blocked = tmp_path / "file"
    blocked.write_text("")  # a cache "directory" that is a file: nothing can be written under it
    for _ in range(2):
        assert remembering(define, ImportStructures("5.0", blocked))(pkg) == STRUCTURE
    assert define.calls == 3
    assert remembering(define, ImportStructures("5.0", None))(pkg) == STRUCTURE  # no cache directory at all
    (cache / "transformers_imports-5.0.json").write_text(json.dumps(
        {f"{pkg.resolve()}|None": {"fingerprint": ImportStructures("5.0", cache).fingerprint(pkg.resolve()),
                                    "structure": {"q": 1}}}))
    assert remembering(define, ImportStructures("5.0", cache))(pkg) == STRUCTURE and define.calls == 5  # damaged


PROBE = """
import hashlib, importlib.metadata, json, sys
import rlgraph
import transformers, transformers.models
import transformers.utils.import_utils as iu
from transformers import PreTrainedTokenizerFast

def digest(m):
    return hashlib.sha256(json.dumps(sorted((k, str(v)) for k, v in m._class_to_module.items())).encode()).hexdigest()

print(json.dumps({"top": digest(transformers), "models": digest(transformers.models),
                  "scans": iu.create_import_structure_from_path.cache_info().misses,
                  "remembered": hasattr(iu.define_import_structure, "remembered"),
                  "hook_left": any(type(f).__name__ == "_Hook" for f in sys.meta_path),
                  "dists": iu.PACKAGE_DISTRIBUTION_MAPPING == importlib.metadata.packages_distributions(),
                  "restored": importlib.metadata.packages_distributions.__module__ == "importlib.metadata"}))
"""


def _probe(tmp_path, switch: str) -> dict:
    env = {**os.environ, "RLGRAPH_CACHE": str(tmp_path / "cache"), imports.SWITCH: switch}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_transformers_builds_the_same_table_from_the_cache_without_scanning(tmp_path):
    alone = _probe(tmp_path, "0")  # transformers as it is: its own scans
    assert not alone["remembered"] and alone["scans"] > 100
    cold, warm = _probe(tmp_path, "1"), _probe(tmp_path, "1")
    assert cold["remembered"] and warm["remembered"] and not cold["hook_left"] and not warm["hook_left"]
    assert cold["scans"] == alone["scans"]  # the first process scans and writes the table down
    assert warm["scans"] == 0  # the next reads it back
    assert alone["top"] == cold["top"] == warm["top"] and alone["models"] == cold["models"] == warm["models"]
    assert alone["dists"] and cold["dists"] and warm["dists"]  # the distributions' map read back is the real one
    assert cold["restored"] and warm["restored"]  # importlib's own function again once transformers has its map
    written = json.loads(next((tmp_path / "cache").glob("transformers_imports-*.json")).read_text())
    assert any(k.startswith("packages_distributions|") for k in written)
    assert list((tmp_path / "cache").glob("transformers_imports-*.json"))


def test_installed_after_transformers_it_still_remembers_the_models_table(tmp_path):
    # rlgraph's own import installs it first thing; here transformers is imported before rlgraph is
    code = ("import sys, transformers, transformers.utils.import_utils as iu\n"
            "import rlgraph\n"
            "print(hasattr(iu.define_import_structure, 'remembered'), 'transformers.models' in sys.modules,\n"
            "      any(type(f).__name__ == '_Hook' for f in sys.meta_path))")
    env = {**os.environ, "RLGRAPH_CACHE": str(tmp_path / "cache"), imports.SWITCH: "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "False"]


def test_the_hook_never_changes_the_finder_list_another_thread_may_be_walking():
    """An import on another thread walks the list `sys.meta_path` was when it began; installing or
    removing the hook in place would shift it under that walk, and the walk would skip a finder (an
    existing module "not found": a run failed so, importing tensordict beside the preflight's
    transformers). Both make a new list."""
    code = ("import sys\n"
            "from rlgraph import imports\n"
            "sys.meta_path = [f for f in sys.meta_path if not isinstance(f, imports._Hook)]\n"
            "before = sys.meta_path; kept = list(before)\n"
            "imports.install()\n"
            "assert sys.meta_path is not before and before == kept, 'install changed the list in place'\n"
            "assert isinstance(sys.meta_path[0], imports._Hook)\n"
            "walking = sys.meta_path; kept = list(walking)\n"
            "import transformers.utils.import_utils as iu\n"
            "assert walking == kept, 'the hook removed itself in place'\n"
            "assert not any(isinstance(f, imports._Hook) for f in sys.meta_path)\n"
            "print(hasattr(iu.define_import_structure, 'remembered'))\n")
    env = {**os.environ, imports.SWITCH: "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True"]
