"""Architecture tests: the package's one-way import layering, no import cycles, no mutable
module-level state in custom_ops/.

Everything here is static: each file under autodeploy_mla/ is parsed with `ast`, nothing of the
package is imported, so a violation is reported even on code paths no other test runs
(function-local imports, `try: import ...`, `if TYPE_CHECKING:` blocks).

Layers, lowest first. A module may import its own layer or any lower one, never a higher one:

    0 config      autodeploy_mla/config/**
    1 models      autodeploy_mla/models/**
    2 custom_ops  autodeploy_mla/custom_ops/**
    3 runtime     autodeploy_mla/runtime/**
    4 transforms  autodeploy_mla/transforms/**
    5 distributed autodeploy_mla/distributed/**   (imported only by api, cli, testing and itself)
    6 api         autodeploy_mla/api.py, autodeploy_mla/verify.py, autodeploy_mla/__init__.py
    7 serving     autodeploy_mla/serving/**       (HTTP server, engine thread, workloads, bench)
    8 cli         autodeploy_mla/cli/**
    9 testing     autodeploy_mla/testing/**       (test support; no product module imports it)

Inside custom_ops/, code is grouped by library (issue 43): the shared attention layer
(`attention/`: contract, registry, router, step context) and helpers (`triton_helpers`,
`tp_all_reduce`) import no backend; a backend library (`triton_mla/`, `flashinfer/`,
`torch_backend`, `moe/`) imports no other backend library (they meet through the registry);
no pass (transforms/) imports a concrete attention backend. Across packages nothing imports a
private (`_name`) name.
"""

from __future__ import annotations

import ast
import functools
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional

import networkx as nx
import pytest

PKG = "autodeploy_mla"
PKG_DIR = Path(__file__).resolve().parents[1] / PKG
REPO_ROOT = PKG_DIR.parent

LAYER_NAMES = ("config", "models", "custom_ops", "runtime", "transforms", "distributed", "api", "serving", "cli",
               "testing")
LAYER = {name: i for i, name in enumerate(LAYER_NAMES)}
# Top-level modules (not subpackages) that form the api layer; the package root is api too.
API_MODULES = {PKG, f"{PKG}.api", f"{PKG}.verify"}
# Who may import `distributed` (besides distributed itself).
DISTRIBUTED_IMPORTERS = {"api", "cli", "testing"}
PRODUCT_LAYERS = set(LAYER_NAMES) - {"testing"}


# ----------------------------------------------------------------------------- module discovery
def module_name(path: Path) -> str:
    """Dotted module name of a file under the package: `pkg/__init__.py` -> `pkg`."""
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.lru_cache(maxsize=None)
def package_files() -> dict[str, Path]:
    """Every module of the package, name -> file (tests/ and benchmarks/ live outside PKG_DIR)."""
    return {module_name(p): p for p in sorted(PKG_DIR.rglob("*.py"))}


def layer_of(module: str) -> Optional[str]:
    """Layer name of a package module, None if it fits no layer (a new top-level file, say)."""
    if module in API_MODULES:
        return "api"
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in LAYER:
        return parts[1]
    return None


# ----------------------------------------------------------------------------- import collection
@dataclass(frozen=True)
class Import:
    """One package-internal import: `source` imports `target` at `file:line`."""

    source: str
    target: str
    file: str  # path relative to the repo root
    line: int
    statement: str  # the import as written (ast.unparse)
    type_checking: bool  # inside `if TYPE_CHECKING:`: checked for layers, not executed (no cycle)

    def where(self) -> str:
        return f"{self.file}:{self.line}"


def _is_type_checking_test(test: ast.expr) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def resolve_from(module: str, is_package: bool, level: int, target: Optional[str]) -> str:
    """Absolute name of the `from <level dots><target> import ...` base, seen from `module`.

    Level 1 is the module's own package (the module itself when it is a package's __init__)."""
    if level == 0:
        return target or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    if level - 1 > len(package) - 1:
        raise ValueError(f"{module}: relative import beyond the top-level package (level {level})")
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _in_package(name: str) -> bool:
    return name == PKG or name.startswith(PKG + ".")


class _ImportCollector(ast.NodeVisitor):
    """Collects every import of one file: module level, function-local, try/except, TYPE_CHECKING.

    `importlib.import_module("autodeploy_mla....")` / `__import__(...)` with a literal name count
    too, so a dynamic import cannot dodge the rules."""

    def __init__(self, module: str, is_package: bool, file: str, known_modules: Iterable[str]):
        self.module, self.is_package, self.file = module, is_package, file
        self.known = set(known_modules)
        self.imports: list[Import] = []
        self._type_checking = 0

    def _add(self, node: ast.AST, target: str) -> None:
        if _in_package(target):
            self.imports.append(Import(self.module, target, self.file, node.lineno, ast.unparse(node),
                                       self._type_checking > 0))

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking_test(node.test):
            return self.generic_visit(node)
        self.visit(node.test)
        self._type_checking += 1
        for stmt in node.body:
            self.visit(stmt)
        self._type_checking -= 1
        for stmt in node.orelse:  # the else branch of `if TYPE_CHECKING:` does run
            self.visit(stmt)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = resolve_from(self.module, self.is_package, node.level, node.module)
        for alias in node.names:
            # `from pkg import name`: the submodule pkg.name if there is one, else pkg itself.
            sub = f"{base}.{alias.name}"
            self._add(node, sub if alias.name != "*" and sub in self.known else base)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if (name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)):
            self._add(node, node.args[0].value)
        self.generic_visit(node)


def collect_imports(source: str, module: str, is_package: bool, file: str,
                    known_modules: Iterable[str]) -> list[Import]:
    """All package-internal imports of one source file."""
    collector = _ImportCollector(module, is_package, file, known_modules)
    collector.visit(ast.parse(source, filename=file))
    return collector.imports


@functools.lru_cache(maxsize=None)
def package_imports() -> tuple[Import, ...]:
    """All package-internal imports of every module of the package (parsed once per session)."""
    files = package_files()
    out: list[Import] = []
    for mod, path in files.items():
        rel = str(path.relative_to(REPO_ROOT))
        out += collect_imports(path.read_text(), mod, path.name == "__init__.py", rel, files)
    return tuple(out)


# ----------------------------------------------------------------------------- rules
def layer_violation(imp: Import) -> Optional[str]:
    """Why `imp` breaks the layering, or None. Lists the most specific rule first."""
    src, dst = layer_of(imp.source), layer_of(imp.target)
    if src is None or dst is None:
        return f"unmapped module ({imp.source if src is None else imp.target} is in no layer)"
    if dst == "testing" and src in PRODUCT_LAYERS:
        return "product code must not import autodeploy_mla.testing"
    if dst == "distributed" and src != "distributed" and src not in DISTRIBUTED_IMPORTERS:
        return "distributed may be imported only by api, cli, testing"
    if LAYER[dst] > LAYER[src]:
        return "upward import (a module may import only its own or a lower layer)"
    return None


def format_import(imp: Import, rule: str) -> str:
    src, dst = layer_of(imp.source), layer_of(imp.target)
    layers = f"layer {LAYER.get(src, '?')} {src} -> layer {LAYER.get(dst, '?')} {dst}"
    tc = ", in TYPE_CHECKING" if imp.type_checking else ""
    return f"{imp.where()}: {imp.source} -> {imp.target} ({layers}{tc}) [{rule}]  `{imp.statement}`"


def layer_violations(imports: Iterable[Import]) -> list[str]:
    return [format_import(i, why) for i in imports if (why := layer_violation(i))]


def import_graph(imports: Iterable[Import]) -> nx.DiGraph:
    """File-level graph of the imports that execute (TYPE_CHECKING blocks never run).

    Function-local imports stay in: a cycle through them is still a cycle between the modules,
    merely hidden from import time."""
    g = nx.DiGraph()
    for imp in imports:
        if not imp.type_checking and imp.source != imp.target:
            g.add_edge(imp.source, imp.target)
            g.edges[imp.source, imp.target].setdefault("at", imp.where())
    return g


def import_cycles(g: nx.DiGraph, limit: int = 50) -> list[list[str]]:
    """Simple cycles of `g`, shortest first (each rotated to start at its smallest module), at most `limit`."""
    nontrivial = (g.subgraph(scc) for scc in nx.strongly_connected_components(g) if len(scc) > 1)
    found = itertools.islice((c for sub in nontrivial for c in nx.simple_cycles(sub)), limit)
    cycles = [c[c.index(min(c)):] + c[:c.index(min(c))] for c in found]
    return sorted(cycles, key=lambda c: (len(c), c))


def format_cycle(g: nx.DiGraph, cyc: list[str]) -> str:
    hops = [f"{a} -> {b} ({g.edges[a, b]['at']})" for a, b in zip(cyc, cyc[1:] + cyc[:1])]
    return "cycle [" + ", ".join(cyc) + "]:\n      " + "\n      ".join(hops)


# ----------------------------------------------------------------------------- mutable state
# Calls that build a mutable container (qualified through the module's own imports).
MUTABLE_CONSTRUCTORS = {
    "dict", "list", "set", "bytearray", "dict.fromkeys",
    "collections.defaultdict", "collections.OrderedDict", "collections.Counter", "collections.deque",
    "collections.ChainMap",
    "weakref.WeakSet", "weakref.WeakValueDictionary", "weakref.WeakKeyDictionary",
}
# (file under autodeploy_mla/, name) allowed to be mutable, each with the reason.
MUTABLE_STATE_ALLOWED = {
    # The backend registration table: filled by @register_backend while custom_ops/ is imported,
    # never changed afterwards, holds stateless backend descriptors.
    ("custom_ops/attention/registry.py", "_REGISTRY"),
    # The prefill-kernel table: filled by register_prefill_kernel while custom_ops/ is imported
    # (flashinfer/fa3_prefill.py), never changed afterwards, holds stateless kernel descriptors.
    ("custom_ops/attention/prefill_kernels.py", "_PREFILL_KERNELS"),
}
# Names exempt everywhere: `__all__` is export metadata for `import *` and tools, not state.
MUTABLE_STATE_EXEMPT_NAMES = {"__all__"}


def module_level_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements that run at import time: the module body plus the bodies of module-level
    if/try/with/for/while blocks (but not function or class bodies)."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for field in ("body", "orelse", "finalbody"):
            yield from module_level_statements(getattr(stmt, field, []) or [])
        for handler in getattr(stmt, "handlers", []) or []:
            yield from module_level_statements(handler.body)


def _import_aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> qualified name for every import of the file (`OD` -> `collections.OrderedDict`)."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    return aliases


def _qualified(expr: ast.expr, aliases: dict[str, str]) -> Optional[str]:
    """`collections.OrderedDict` for `c.OrderedDict` after `import collections as c`; None if not a name."""
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    return ".".join([aliases.get(expr.id, expr.id)] + parts[::-1])


def _is_immutable_class(cls: ast.ClassDef, aliases: dict[str, str]) -> bool:
    """`@dataclass(frozen=True)` classes and NamedTuples: their instances are constants, so e.g.
    `DEFAULT_POLICY = TritonPolicy()` (a frozen dataclass of str/int/bool) is not mutable state."""
    for dec in cls.decorator_list:
        if (isinstance(dec, ast.Call) and _qualified(dec.func, aliases) in ("dataclass", "dataclasses.dataclass")
                and any(k.arg == "frozen" and isinstance(k.value, ast.Constant) and k.value.value is True
                        for k in dec.keywords)):
            return True
    return any(_qualified(b, aliases) in ("NamedTuple", "typing.NamedTuple") for b in cls.bases)


def mutable_value_reason(value: ast.expr, aliases: dict[str, str], local_classes: set[str]) -> Optional[str]:
    """Why assigning `value` at module level creates mutable state, or None if it does not."""
    for kind, display, comprehension in (("dict", ast.Dict, ast.DictComp), ("set", ast.Set, ast.SetComp),
                                         ("list", ast.List, ast.ListComp)):
        if isinstance(value, display):
            return f"{kind} display"
        if isinstance(value, comprehension):  # a comprehension builds the same mutable container
            return f"{kind} comprehension"
    if isinstance(value, ast.Tuple):  # a tuple holding a list is still mutable state
        return next(filter(None, (mutable_value_reason(e, aliases, local_classes) for e in value.elts)), None)
    if isinstance(value, ast.IfExp):
        return mutable_value_reason(value.body, aliases, local_classes) or mutable_value_reason(
            value.orelse, aliases, local_classes)
    if isinstance(value, ast.BoolOp):
        return next(filter(None, (mutable_value_reason(v, aliases, local_classes) for v in value.values)), None)
    if isinstance(value, ast.Call):
        name = _qualified(value.func, aliases)
        if name in MUTABLE_CONSTRUCTORS:
            return f"{name}(...)"
        if isinstance(value.func, ast.Name) and value.func.id in local_classes:
            return f"instance of {value.func.id}, a class defined in this module"
    return None


def _assigned_names(stmt: ast.stmt) -> list[str]:
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


def mutable_state_violations(source: str, file: str) -> list[str]:
    """`global` statements and module-level assignments of mutable values in one file.

    `file` is relative to autodeploy_mla/ (e.g. `custom_ops/attention/handoff.py`), as in the allow-list."""
    tree = ast.parse(source, filename=file)
    aliases = _import_aliases(tree)
    stmts = list(module_level_statements(tree.body))
    local_classes = {s.name for s in stmts if isinstance(s, ast.ClassDef) and not _is_immutable_class(s, aliases)}
    out = [f"{PKG}/{file}:{n.lineno}: `global {', '.join(n.names)}` (rebinds module state)"
           for n in ast.walk(tree) if isinstance(n, ast.Global)]
    for stmt in stmts:
        if not isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)) or stmt.value is None:
            continue
        names = [n for n in _assigned_names(stmt)
                 if (file, n) not in MUTABLE_STATE_ALLOWED and n not in MUTABLE_STATE_EXEMPT_NAMES]
        reason = mutable_value_reason(stmt.value, aliases, local_classes) if names else None
        if reason:
            out.append(f"{PKG}/{file}:{stmt.lineno}: {', '.join(names)} = {reason}  `{ast.unparse(stmt)[:100]}`")
    return out


# ----------------------------------------------------------------------------- custom_ops by library
CUSTOM_OPS = f"{PKG}.custom_ops"
#: libraries of custom_ops/ whose modules are (or serve) one backend family: never import each other
BACKEND_LIBRARIES = frozenset({"triton_mla", "flashinfer", "torch_backend", "moe"})
#: what every backend builds on: imports no backend library
SHARED_LIBRARIES = frozenset({"attention", "triton_helpers", "tp_all_reduce"})
#: the concrete attention backends a pass must reach only through the registry
ATTENTION_BACKENDS = frozenset({"triton_mla", "flashinfer", "torch_backend"})


def library_of(module: str) -> Optional[str]:
    """custom_ops library of a module (`autodeploy_mla.custom_ops.flashinfer.mla` -> `flashinfer`);
    "" for the custom_ops package itself (the registrar that imports every backend); None outside."""
    if module == CUSTOM_OPS:
        return ""
    if not module.startswith(CUSTOM_OPS + "."):
        return None
    return module[len(CUSTOM_OPS) + 1:].split(".")[0]


def library_violation(imp: Import) -> Optional[str]:
    """Why `imp` breaks the by-library rules of custom_ops/ and passes, or None."""
    src, dst = library_of(imp.source), library_of(imp.target)
    if dst is None:
        return None
    if src in BACKEND_LIBRARIES and dst in BACKEND_LIBRARIES and src != dst:
        return f"backend library {src} imports backend library {dst} (meet through the registry instead)"
    if src in SHARED_LIBRARIES and dst in BACKEND_LIBRARIES:
        return f"shared {src} imports backend library {dst}"
    if src is None and layer_of(imp.source) == "transforms" and dst in ATTENTION_BACKENDS:
        return f"pass imports concrete attention backend {dst} (use the descriptor / registry)"
    return None


def package_of(module: str) -> str:
    """The package a module belongs to (a package's __init__ belongs to the package itself)."""
    files = package_files()
    path = files.get(module)
    return module if path is not None and path.name == "__init__.py" else module.rpartition(".")[0]


def private_imports(source: str, module: str, is_package: bool, file: str) -> list[str]:
    """`from X import _name` where X is in another package than `module` (dunder names excepted)."""
    out = []
    for node in ast.walk(ast.parse(source, filename=file)):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = resolve_from(module, is_package, node.level, node.module)
        if not _in_package(base):
            continue
        here = module if is_package else module.rpartition(".")[0]
        for alias in node.names:
            private = alias.name.startswith("_") and not alias.name.startswith("__")
            if private and package_of(base) != here:
                out.append(f"{file}:{node.lineno}: {module} imports {base}.{alias.name}  `{ast.unparse(node)}`")
    return out


# ----------------------------------------------------------------------------- tests
def _check(lines: list[str], title: str, hint: str) -> None:
    """Fail listing every offending line (no assert-rewrite repr of the list, just the report)."""
    if lines:
        pytest.fail(f"{title} ({len(lines)}):\n  " + "\n  ".join(lines) + f"\n{hint}", pytrace=False)


def test_walker_sees_the_package():
    """Guard against a checker that silently parses nothing."""
    mods, imports = package_files(), package_imports()
    assert len(mods) > 40, f"found only {len(mods)} modules under {PKG_DIR}"
    assert len(imports) > 100, f"found only {len(imports)} package-internal imports"
    assert any(i.type_checking for i in imports), "no TYPE_CHECKING import found (the package has some)"


def test_every_module_is_in_a_layer():
    unmapped = sorted(m for m in package_files() if layer_of(m) is None)
    assert not unmapped, f"modules in no layer (add them to the table in {__name__}): {unmapped}"


def test_checker_detects_hidden_upward_imports():
    """Self-test: function-local, try/except and TYPE_CHECKING imports, relative forms."""
    known = {f"{PKG}.cli", f"{PKG}.config", f"{PKG}.config.schema", f"{PKG}.runtime", f"{PKG}.runtime.engine",
             f"{PKG}.runtime.page_allocator", f"{PKG}.transforms.context", f"{PKG}.distributed.env"}
    source = (
        "from typing import TYPE_CHECKING\n"
        "import os\n"
        "from ..config import schema\n"                        # 3: down, fine
        "if TYPE_CHECKING:\n"
        "    from ..transforms.context import Ctx\n"           # 5: up, type-checking only
        "def f():\n"
        "    from .. import cli\n"                             # 7: up, function-local, a subpackage
        "    try:\n"
        "        import autodeploy_mla.distributed.env\n"      # 9: up, distributed
        "    except ImportError:\n"
        "        pass\n"
        "from . import page_allocator, NotAModule\n"           # 12: own layer
        "import importlib\n"
        "importlib.import_module('autodeploy_mla.testing')\n"  # 14: testing from product
    )
    imps = collect_imports(source, f"{PKG}.runtime.engine", False, "engine.py", known)
    got = {(i.line, i.target, i.type_checking) for i in imps}
    assert got == {
        (3, f"{PKG}.config.schema", False), (5, f"{PKG}.transforms.context", True), (7, f"{PKG}.cli", False),
        (9, f"{PKG}.distributed.env", False), (12, f"{PKG}.runtime.page_allocator", False),
        (12, f"{PKG}.runtime", False), (14, f"{PKG}.testing", False),
    }, got
    bad = {i.line: layer_violation(i) for i in imps if layer_violation(i)}
    assert set(bad) == {5, 7, 9, 14}, bad
    assert "distributed" in bad[9] and "testing" in bad[14]
    # The TYPE_CHECKING edge is a layer violation but no executed edge, so it forms no cycle.
    back = Import(f"{PKG}.transforms.context", f"{PKG}.runtime.engine", "context.py", 1, "", False)
    assert not import_cycles(import_graph([*imps, back]))
    assert import_cycles(import_graph([*imps, Import(f"{PKG}.cli", f"{PKG}.runtime.engine", "c.py", 1, "", False)]))
    # Relative imports from a package __init__ resolve against the package itself.
    assert resolve_from(f"{PKG}.runtime", True, 1, None) == f"{PKG}.runtime"
    assert resolve_from(f"{PKG}.runtime", True, 2, "cli") == f"{PKG}.cli"
    assert resolve_from(f"{PKG}.runtime.engine", False, 2, "config.schema") == f"{PKG}.config.schema"


def test_layering_is_one_way():
    """No import (of any kind) from a lower layer to a higher one; distributed only from api/cli/testing."""
    bad = layer_violations(package_imports())
    _check(bad, "layering violations",
           "Move the code down a layer, pass the object in from the caller, or invert the "
           "dependency with a registry in the lower layer.")


def test_distributed_is_imported_only_by_api_cli_testing():
    bad = [format_import(i, "distributed may be imported only by api, cli, testing")
           for i in package_imports()
           if layer_of(i.target) == "distributed" and layer_of(i.source) not in DISTRIBUTED_IMPORTERS | {"distributed"}]
    _check(bad, "imports of autodeploy_mla.distributed outside api/cli/testing",
           "runtime/transforms/... must stay single-process; let the api/cli layer launch ranks.")


def test_product_code_never_imports_testing():
    bad = [format_import(i, "product code must not import autodeploy_mla.testing")
           for i in package_imports() if layer_of(i.target) == "testing" and layer_of(i.source) in PRODUCT_LAYERS]
    _check(bad, "product modules importing autodeploy_mla.testing",
           "autodeploy_mla.testing is test support; product code must run without it.")


def test_no_import_cycles():
    """No cycle in the module graph of executed imports (TYPE_CHECKING imports excluded)."""
    g = import_graph(package_imports())
    cycles = import_cycles(g)
    _check([format_cycle(g, c) for c in cycles], "import cycles",
           "Break each cycle by moving the shared piece into the lower module.")


def test_checker_detects_mutable_state():
    """Self-test of the custom_ops/ mutable-state rule."""
    source = (
        "import collections as c\n"
        "from dataclasses import dataclass\n"
        "from types import MappingProxyType\n"
        "A = {}\n"                                        # 4
        "if True:\n"
        "    B: list[int] = []\n"                         # 6
        "try:\n"
        "    C = c.OrderedDict()\n"                       # 8
        "except ImportError:\n"
        "    C = None\n"
        "class K: pass\n"
        "@dataclass(frozen=True)\n"
        "class F: x: int = 0\n"
        "D = K()\n"                                       # 14
        "E = F()\n"
        "G = (1, frozenset({2}), MappingProxyType({'a': 1}))\n"
        "H = ([],)\n"                                     # 17
        "_REGISTRY = {}\n"                                # allow-listed in this file
        "def f():\n"
        "    global A\n"                                  # 20
        "    local = {}\n"
    )
    lines = {int(v.split(":")[1]) for v in mutable_state_violations(source, "custom_ops/attention/registry.py")}
    assert lines == {4, 6, 8, 14, 17, 20}, lines
    assert len(mutable_state_violations("_REGISTRY = {}\n", "custom_ops/other.py")) == 1


def test_no_mutable_module_state_in_custom_ops():
    """custom_ops/ is shared by every compiled model: state lives in per-model sessions, never in
    module globals (which would leak between models, threads and tests)."""
    files = sorted((PKG_DIR / "custom_ops").rglob("*.py"))
    assert len(files) > 5
    bad = [v for p in files for v in mutable_state_violations(p.read_text(), str(p.relative_to(PKG_DIR)))]
    _check(bad, "mutable module-level state in custom_ops/",
           "Use a tuple / frozenset / MappingProxyType, or keep the state in a BackendSession.")


def test_checker_detects_library_violations():
    """Self-test of the by-library rules on made-up imports."""
    def imp(src, dst):
        return Import(f"{CUSTOM_OPS}.{src}" if src else f"{PKG}.transforms.x", f"{CUSTOM_OPS}.{dst}", "f.py", 1, "",
                      False)
    assert "imports backend library flashinfer" in library_violation(imp("triton_mla.session", "flashinfer.fa3_prefill"))
    assert "shared attention" in library_violation(imp("attention.router", "triton_mla.op"))
    assert "pass imports concrete" in library_violation(imp(None, "flashinfer.sparse"))
    assert library_violation(imp("triton_mla.op", "attention.registry")) is None
    assert library_violation(imp("triton_mla.op", "triton_helpers")) is None
    assert library_violation(imp(None, "attention.registry")) is None
    assert library_violation(Import(CUSTOM_OPS, f"{CUSTOM_OPS}.flashinfer.mla", "f.py", 1, "", False)) is None
    src = "from ..attention.sparse_mla import _check, ok\nfrom .launch import _spec\nfrom .x import __version__\n"
    got = private_imports(src, f"{CUSTOM_OPS}.triton_mla.sparse", False, "s.py")
    assert len(got) == 1 and "_check" in got[0]


def test_no_backend_imports_another_backend_and_no_pass_imports_a_backend():
    bad = [format_import(i, why) for i in package_imports() if (why := library_violation(i))]
    _check(bad, "custom_ops library violations",
           "Declare the fact on the descriptor (or register the kernel) and look it up by name through "
           "custom_ops.attention.registry; passes reach backends only through their descriptors.")


def test_nothing_imports_a_private_name_across_packages():
    bad = []
    for mod, path in package_files().items():
        bad += private_imports(path.read_text(), mod, path.name == "__init__.py", str(path.relative_to(REPO_ROOT)))
    _check(bad, "private names imported across packages",
           "Make the name public (it is part of the package's surface) or move the caller into the package.")

