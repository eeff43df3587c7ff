"""The package's import graph has no cycle: every import counts, those inside functions too
(a lazy import only hides a cycle), except the ones under ``if TYPE_CHECKING:``, which never run."""
import ast
from pathlib import Path
from typing import Dict, List, Set

REPO = Path(__file__).resolve().parents[1]


def _modules(root: Path) -> Dict[str, Path]:
    """Module name -> file, for every .py under ``root`` (a package folder named as the package)."""
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imported(path: Path, name: str, modules: Dict[str, Path]) -> Set[str]:
    """Modules of ``modules`` that ``path`` (module ``name``) imports, at any depth outside
    ``TYPE_CHECKING`` blocks. ``from pkg import sub`` imports the submodule ``pkg.sub``; any other
    ``from m import x`` imports ``m``; a name not in ``modules`` counts as its nearest parent that is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: Set[str] = set()

    def nearest(mod: str) -> None:
        while mod and mod not in modules:
            mod = mod.rpartition(".")[0]
        if mod and mod != name:
            found.add(mod)

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                for sub in child.orelse:
                    walk(sub)
                continue
            if isinstance(child, ast.Import):
                for a in child.names:
                    nearest(a.name)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - child.level + 1] + ([base] if base else []))
                subs = [f"{base}.{a.name}" for a in child.names if f"{base}.{a.name}" in modules]
                for mod in subs if len(subs) == len(child.names) else [base, *subs]:
                    nearest(mod)
            walk(child)

    walk(ast.parse(path.read_text(), str(path)))
    return found


def _cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def _graph(root: Path) -> Dict[str, Set[str]]:
    modules = _modules(root)
    return {name: _imported(path, name, modules) for name, path in modules.items()}


def test_the_package_has_no_import_cycle():
    edges = _graph(REPO / "zeroinf")
    assert len(edges) > 100 and "zeroinf.runtime.stage3.manager" in edges["zeroinf.runtime.stage3.engine_glue"]
    assert _cycles(edges) == []


def test_a_lazy_import_cycle_is_found_and_a_type_checking_one_is_not(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import y\n")
    (pkg / "d.py").write_text("from . import c\n")
    assert _cycles(_graph(pkg)) == [["pkg.a", "pkg.sub.b"]]
