"""The layout stays true: import contracts (import-linter), no private module imported from
another package, a pure model layer, no test helpers in the wheel's code paths."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "chatctx"


def _package(path: Path, top: Path) -> str:
    parts = list(path.relative_to(top).with_suffix("").parts)
    module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _imported(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """Every module (and ``module.name``) an import statement names, absolute."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def private_imports_across_packages(top: Path = ROOT) -> list[str]:
    """``file:line imports chatctx.x._private``, where the importer is outside ``chatctx.x``
    (``top`` holds the ``chatctx`` folder)."""
    out = []
    for path in sorted((top / "chatctx").rglob("*.py")):
        package = _package(path, top)
        for line, name in _imported(ast.parse(path.read_text(encoding="utf-8")), package):
            parts = name.split(".")
            if parts[0] != "chatctx":
                continue
            for i, part in enumerate(parts):
                if part.startswith("_") and not part.startswith("__"):
                    owner, private = ".".join(parts[:i]), ".".join(parts[: i + 1])
                    where = top / Path(*private.split("."))
                    is_module = where.with_suffix(".py").is_file() or where.is_dir()
                    found = f"{path.relative_to(top)}:{line} imports {private}"
                    inside = package == owner or package.startswith(owner + ".")
                    if is_module and not inside and found not in out:
                        out.append(found)
                    break
    return out


def test_the_finder_sees_a_private_import_across_packages(tmp_path: Path) -> None:
    # The checker's own oracle: a planted offender is found, an import inside the package is not.
    fake = tmp_path / "chatctx"
    (fake / "a").mkdir(parents=True)
    (fake / "b").mkdir()
    for path in (fake / "__init__.py", fake / "a" / "__init__.py", fake / "b" / "__init__.py"):
        path.write_text("")
    (fake / "a" / "_inner.py").write_text("X = 1\n")
    (fake / "a" / "ok.py").write_text("from chatctx.a._inner import X\n")
    (fake / "b" / "bad.py").write_text("from chatctx.a._inner import X\nfrom chatctx.a import ok\n")
    assert private_imports_across_packages(tmp_path) == [
        "chatctx/b/bad.py:1 imports chatctx.a._inner"
    ]


def test_no_private_module_is_imported_from_another_package() -> None:
    assert private_imports_across_packages() == []


def test_private_modules_declare_no_public_surface() -> None:
    declaring = [
        str(path.relative_to(ROOT))
        for path in PACKAGE.rglob("_*.py")
        if path.name != "__init__.py"
        and any(
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
            for node in ast.parse(path.read_text(encoding="utf-8")).body
        )
    ]
    assert declaring == []


def test_the_import_contracts_hold() -> None:
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint, "import-linter is a dev dependency: pip install -e '.[dev]'"
    done = subprocess.run(
        [lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_the_model_layer_loads_neither_llama_cpp_nor_httpx() -> None:
    code = (
        "import sys, pkgutil, importlib, chatctx.model as m\n"
        "for info in pkgutil.iter_modules(m.__path__):\n"
        "    importlib.import_module(f'chatctx.model.{info.name}')\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in "
        "('llama_cpp', 'httpx', 'sqlalchemy', 'fastapi')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def environment_reads(top: Path = PACKAGE) -> list[str]:
    """``file:line name`` for each ``os.environ`` / ``os.getenv`` read of a ``CHATCTX_*``
    string outside chatctx/environment.py, and each ``variable(...)`` of an undeclared name."""
    from chatctx.environment import VARIABLES

    found = []
    for path in sorted(top.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                first = node.args[:1]
            elif isinstance(node, ast.Subscript):
                first = [node.slice]
            else:
                continue
            names = [
                arg.value
                for arg in first
                if isinstance(arg, ast.Constant) and str(arg.value).startswith("CHATCTX_")
            ]
            if not names:
                continue
            text = ast.unparse(node)
            where = f"{path.relative_to(top.parent)}:{node.lineno}"
            if ("environ" in text or "getenv" in text) and path.name != "environment.py":
                found += [f"{where} {name}" for name in names]
            elif text.startswith("variable(") and names[0] not in VARIABLES:
                found.append(f"{where} {names[0]} (undeclared)")
    return found


def test_chatctx_variables_are_read_in_one_module(tmp_path: Path) -> None:
    assert environment_reads() == []
    # The finder finds: a planted read and an undeclared name.
    planted = tmp_path / "chatctx" / "x"
    planted.mkdir(parents=True)
    (planted / "a.py").write_text(
        'import os\nA = os.environ.get("CHATCTX_HOME")\nB = os.environ["CHATCTX_DB"]\n'
        'C = os.getenv("CHATCTX_MODEL")\nD = variable("CHATCTX_NOPE")\n'
    )
    assert len(environment_reads(tmp_path / "chatctx")) == 4


def test_chat_session_is_one_class_with_collaborators() -> None:
    """No mixins: ChatSession's bases are only the shared close() protocol, and the engine's
    slot pool reads no private attribute of the engine."""
    from chatctx._resource import Closeable
    from chatctx.session import ChatSession

    assert ChatSession.__mro__ == (ChatSession, Closeable, object)
    pool = (PACKAGE / "backends" / "engine" / "_pool.py").read_text(encoding="utf-8")
    reached = [
        node.attr
        for node in ast.walk(ast.parse(pool))
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and ast.unparse(node.value) in ("engine", "self._engine")
    ]
    assert reached == []
