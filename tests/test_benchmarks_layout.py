"""The benchmarks as a library, and the results index as the one place numbers are kept.

Static checks (files are parsed, not run), so a violation shows on a CPU machine even in scripts
that only run on a GPU:

- scripts under `benchmarks/<topic>/` import only `benchmarks.lib` (plus the standard library and the
  third-party packages named here): not `autodeploy_mla`, not each other, no private `_name`, and
  nothing under `benchmarks/` edits `sys.path`;
- only `benchmarks/lib/product.py` names modules of `autodeploy_mla`, so a module the package moves
  is followed in one file; every name the surface exports resolves (that one does import);
- every script a document cites (`benchmarks/<path>.py|sh`, `python -m benchmarks.<module>`) exists,
  and no current document cites an uncommitted `.dev/` script;
- every file under `docs/benchmarks/` is named by an index: the current ones by
  `docs/benchmarks/README.md`, the archived ones by `docs/benchmarks/archive/README.md`.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
LIB = BENCH / "lib"
PRODUCT = LIB / "product.py"
RESULTS = ROOT / "docs" / "benchmarks"
ARCHIVE = RESULTS / "archive"
TOPICS = ("kernels", "e2e", "serving", "moe", "tp", "diagnostics")

#: third-party top-level modules the benchmarks may import (everything else: stdlib or benchmarks.lib)
THIRD_PARTY = {"torch", "triton", "numpy", "matplotlib", "transformers", "flashinfer", "httpx", "openai", "pytest",
               "yaml", "safetensors", "networkx", "pydantic"}


def python_files(where: Path) -> list[Path]:
    return sorted(p for p in where.rglob("*.py") if "__pycache__" not in p.parts)


def scripts() -> list[Path]:
    return [p for t in TOPICS for p in python_files(BENCH / t) if p.name != "__init__.py"]


def rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def imports(path: Path) -> list[tuple[int, str, list[str], int]]:
    """(line, module, imported names, relative level) of every import in the file, at any depth;
    `importlib.import_module("x")` / `__import__("x")` with a literal name count as `import x`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, [], 0) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.lineno, node.module or "", [a.name for a in node.names], node.level))
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if (name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)):
                out.append((node.lineno, node.args[0].value, [], 0))
    return sorted(out, key=lambda i: i[0])


def sys_path_edits(path: Path) -> list[int]:
    """Lines that change `sys.path` (insert/append/extend/remove/assignment)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            target = (node.targets[0] if isinstance(node, ast.Assign) else node.target)
            if isinstance(target, ast.Subscript):
                target = target.value
        if isinstance(target, ast.Attribute) and target.attr == "path" and getattr(target.value, "id", None) == "sys":
            lines.append(node.lineno)
    return sorted(lines)


def surface_names() -> set[str]:
    import benchmarks.lib

    return set(benchmarks.lib.__all__)


# ----------------------------------------------------------------------------- the checker itself
def test_checker_sees_the_scripts_and_what_they_import(tmp_path):
    assert len(scripts()) >= 30 and {p.parent.name for p in scripts()} == set(TOPICS)
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nsys.path.insert(0, 'x')\ndef f():\n    from autodeploy_mla.custom_ops import _x\n"
                   "    import importlib; importlib.import_module('e2e_decode')\nsys.path += ['y']\n")
    assert sys_path_edits(bad) == [2, 6]
    assert [(m, n) for _, m, n, _ in imports(bad)] == [("sys", []), ("autodeploy_mla.custom_ops", ["_x"]),
                                                       ("importlib", []), ("e2e_decode", [])]


# ----------------------------------------------------------------------------- scripts and the surface
def test_nothing_under_benchmarks_edits_sys_path():
    found = [f"{rel(p)}:{n}" for p in python_files(BENCH) for n in sys_path_edits(p)]
    assert not found, f"sys.path edited (run scripts as `python -m benchmarks.<topic>.<name>`): {found}"


def test_scripts_import_only_the_surface_stdlib_and_third_party():
    allowed = set(sys.stdlib_module_names) | THIRD_PARTY
    names = surface_names()
    bad = []
    for p in scripts():
        for line, module, imported, level in imports(p):
            where = f"{rel(p)}:{line}"
            top = module.split(".")[0]
            if level:
                bad.append(f"{where}: relative import")
            elif module == "benchmarks.lib":
                bad += [f"{where}: `{n}` is private" for n in imported if n.startswith("_")]
                bad += [f"{where}: `{n}` is not exported by benchmarks.lib" for n in imported
                        if not n.startswith("_") and n not in names]
            elif top not in allowed:
                bad.append(f"{where}: imports {module} (only benchmarks.lib, the stdlib and {sorted(THIRD_PARTY)})")
    assert not bad, "\n".join(bad)


def test_only_product_names_package_modules():
    bad = []
    for p in python_files(LIB):
        for line, module, imported, _ in imports(p):
            if p != PRODUCT and module.split(".")[0] == "autodeploy_mla":
                bad.append(f"{rel(p)}:{line}: imports {module} (only benchmarks/lib/product.py may)")
            if module.startswith("benchmarks.") and module.split(".")[1] in TOPICS:
                bad.append(f"{rel(p)}:{line}: the library imports a script ({module})")
            bad += [f"{rel(p)}:{line}: imports private {module}.{n}" for n in imported
                    if n.startswith("_") and n != "__future__"]
    assert not bad, "\n".join(bad)


def test_every_surface_name_resolves():
    """After the package moves a module, this names the entries of benchmarks/lib/product.py to fix."""
    import benchmarks.lib

    broken = []
    for name in benchmarks.lib.__all__:
        try:
            getattr(benchmarks.lib, name)
        except Exception as e:  # noqa: BLE001 - list them all
            broken.append(f"{name}: {type(e).__name__}: {e}")
    assert not broken, "\n".join(broken)


# ----------------------------------------------------------------------------- documents
DOCS = [ROOT / "README.md", BENCH / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SCRIPT_PATH = re.compile(r"(?<![\w.-])benchmarks/((?:[a-z_0-9]+/)*[a-z_0-9]+\.(?:py|sh))\b")
SCRIPT_MODULE = re.compile(r"python3? -m (benchmarks(?:\.[a-z_0-9]+)+)")
DEV = re.compile(r"\.dev/[\w./-]+")


def cited_scripts(text: str) -> set[str]:
    """Repo-relative files of the scripts a document cites, by path or by module."""
    paths = {f"benchmarks/{m}" for m in SCRIPT_PATH.findall(text)}
    return paths | {m.replace(".", "/") + ".py" for m in SCRIPT_MODULE.findall(text)}


def test_cited_scripts_exist():
    missing = sorted(f"{rel(d)}: {s}" for d in DOCS for s in cited_scripts(d.read_text()) if not (ROOT / s).exists())
    assert not missing, "cited but not in the repository:\n" + "\n".join(missing)


def test_no_current_document_cites_an_uncommitted_script():
    """`.dev/` scripts were never committed: a current document points at the committed script;
    an archived run that used one says `command not committed`."""
    bad = []
    for d in DOCS:
        text = d.read_text()
        if not DEV.search(text):
            continue
        if ARCHIVE in d.parents and "command not committed" in text:
            continue
        bad.append(f"{rel(d)}: {sorted(set(DEV.findall(text)))}")
    assert not bad, "\n".join(bad)


def indexed(index: Path, folder: Path) -> list[str]:
    """Files under `folder` the index does not name. A result's JSON / PNG / CSV is named with it when
    the index names its markdown table or its stem in backticks (same name); a folder named with a
    trailing slash covers its files (raw data of one run, e.g. `tp_profiles/`)."""
    text = index.read_text()
    missing = []
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        r = str(f.relative_to(folder))
        if f == index or (folder == RESULTS and ARCHIVE in f.parents):
            continue
        names = {r, str(Path(r).with_suffix(".md")), f"`{Path(r).with_suffix('')}`"}
        dirs = {str(parent) + "/" for parent in Path(r).parents if str(parent) != "."}
        if not any(n in text for n in names | dirs):
            missing.append(r)
    return missing


def test_every_current_result_is_in_the_index():
    missing = indexed(RESULTS / "README.md", RESULTS)
    assert not missing, f"not named by docs/benchmarks/README.md (index it or move it to archive/): {missing}"


def test_every_archived_result_is_in_the_archive_index():
    missing = indexed(ARCHIVE / "README.md", ARCHIVE)
    assert not missing, f"not named by docs/benchmarks/archive/README.md: {missing}"


@pytest.mark.parametrize("doc", ["README.md", *[str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").glob("*.md"))]])
def test_documents_link_their_figures_to_the_index(doc):
    """README and docs/*.md quote results with a link to the index (the one place numbers are kept)."""
    assert "benchmarks/README.md" in (ROOT / doc).read_text(), f"{doc} does not link docs/benchmarks/README.md"


@pytest.mark.parametrize("script", [p for p in python_files(BENCH) if LIB not in p.parents and p.name != "__init__.py"],
                         ids=lambda p: str(p.relative_to(BENCH)))
def test_every_script_prints_its_help(script, monkeypatch, capsys):
    """`--help` parses and formats on any machine (a stray `%` in a help string once broke one)."""
    import runpy

    module = ".".join(script.relative_to(ROOT).with_suffix("").parts)
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module(module, run_name="__main__")
    assert done.value.code == 0, capsys.readouterr()
    assert "usage:" in capsys.readouterr().out
