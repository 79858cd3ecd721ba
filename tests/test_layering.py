"""The library does not depend on its applications: no module of ``pstore`` outside
``pstore/apps`` imports ``pstore.apps``, and ``import pstore`` loads neither the applications nor
torch nor onnx. ``pstore demo`` reaches the application through the ``pstore.commands`` entry
points."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from pstore import cli

SOURCE = Path(__file__).resolve().parent.parent / "pstore"
APPS = "pstore.apps"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(module: str | None, level: int, importer: str, is_package: bool) -> str:
    """The absolute module of ``from <level dots><module> import ...`` in ``importer``."""
    if level == 0:
        return module or ""
    package = importer.split(".")
    if not is_package:
        package = package[:-1]
    base = package[: len(package) - (level - 1)]
    return ".".join([*base, module] if module else base)


def _is_apps(name: str) -> bool:
    return name == APPS or name.startswith(APPS + ".")


def _imports(tree: ast.AST, importer: str, is_package: bool) -> list[tuple[int, str]]:
    """Every module ``tree`` imports, with its line: import statements, from-imports (each name
    too, as it may be a submodule) and ``importlib.import_module`` / ``__import__`` calls with a
    constant name."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module, node.level, importer, is_package)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name not in ("import_module", "__import__") or not node.args:
                continue
            first = node.args[0]
            if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
                continue
            target = first.value
            if target.startswith("."):
                package = next(
                    (
                        a.value
                        for a in [*node.args[1:2], *(k.value for k in node.keywords)]
                        if isinstance(a, ast.Constant) and isinstance(a.value, str)
                    ),
                    importer,
                )
                level = len(target) - len(target.lstrip("."))
                target = _absolute(target.lstrip(".") or None, level, package, True)
            found.append((node.lineno, target))
    return found


def _library_modules() -> list[Path]:
    return sorted(p for p in SOURCE.rglob("*.py") if not _is_apps(_module_name(p)))


def test_the_checker_sees_every_form_of_import() -> None:
    code = (
        "import pstore.apps.demo as d\n"
        "from pstore.apps import datasets\n"
        "from pstore import apps\n"
        "from .apps.ctr import train_deepfm\n"
        "from . import apps\n"
        "import importlib\n"
        "importlib.import_module('pstore.apps.mf_onnx')\n"
        "importlib.import_module('.apps', 'pstore')\n"
        "__import__('pstore.apps')\n"
        "import pstore.serving\n"
    )
    found = _imports(ast.parse(code), "pstore.cli", is_package=False)
    assert sorted({line for line, name in found if _is_apps(name)}) == [1, 2, 3, 4, 5, 7, 8, 9]
    found = _imports(ast.parse("from ..apps import demo\n"), "pstore.serving", is_package=True)
    assert any(_is_apps(name) for _, name in found)


def test_no_library_module_imports_the_applications() -> None:
    modules = _library_modules()
    assert SOURCE.joinpath("cli.py") in modules and SOURCE.joinpath("apps").is_dir()
    offending = []
    for path in modules:
        importer = _module_name(path)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, name in _imports(tree, importer, path.name == "__init__.py"):
            if _is_apps(name):
                offending.append(f"{path.relative_to(SOURCE.parent)}:{line} imports {name}")
    assert not offending, "the library imports an application:\n" + "\n".join(offending)


def test_importing_pstore_loads_no_application_torch_or_onnx() -> None:
    code = (
        "import sys, pstore\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'onnx', "
        "'onnxruntime') or m == 'pstore.apps' or m.startswith('pstore.apps.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_pstore_demo_comes_from_the_entry_point() -> None:
    from pstore.apps import demo

    parser = cli.build_parser()
    args = parser.parse_args(["demo", "--data", "synthetic", "--epochs", "3"])
    assert args.func is demo.main
    assert (args.data, args.epochs) == ("synthetic", 3)


def _fake_entry_points(monkeypatch: pytest.MonkeyPatch, *entries: EntryPoint) -> None:
    def entry_points(*, group: str) -> tuple[EntryPoint, ...]:
        assert group == cli.COMMANDS_GROUP
        return entries

    monkeypatch.setattr(cli, "entry_points", entry_points)


def _hello(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sub.add_parser("hello", help="say hello").set_defaults(func=lambda _: 7)


def test_a_command_entry_point_adds_a_command(monkeypatch, capsys) -> None:
    _fake_entry_points(
        monkeypatch,
        EntryPoint("hello", f"{__name__}:_hello", cli.COMMANDS_GROUP),
        # A name the library has already: the library's command stays.
        EntryPoint("version", f"{__name__}:_hello", cli.COMMANDS_GROUP),
    )
    assert cli.main(["hello"]) == 7
    assert cli.main(["version"]) == 0
    assert capsys.readouterr().out.startswith("pstore ")


def test_a_broken_command_entry_point_leaves_the_others(monkeypatch, capsys) -> None:
    _fake_entry_points(
        monkeypatch, EntryPoint("broken", "pstore_no_such_module:register", cli.COMMANDS_GROUP)
    )
    assert cli.main(["version"]) == 0
    err = capsys.readouterr().err
    assert "command 'broken'" in err and "failed to load" in err


def _is_ray(name: str) -> bool:
    return name == "ray" or name.startswith("ray.")


def test_only_pstore_ray_names_ray() -> None:
    """Ray is an extra (``pstore[ray]``): only the package ``pstore.ray`` imports it; the CLI's
    ``pstore ray`` commands reach it through ``pstore.ray``, inside the commands."""
    offending = []
    for path in sorted(SOURCE.rglob("*.py")):
        importer = _module_name(path)
        if importer == "pstore.ray" or importer.startswith("pstore.ray."):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, name in _imports(tree, importer, path.name == "__init__.py"):
            if _is_ray(name):
                offending.append(f"{path.relative_to(SOURCE.parent)}:{line} imports {name}")
    assert not offending, "only pstore.ray may import ray:\n" + "\n".join(offending)
    # The checker sees it.
    found = _imports(ast.parse("from ray.util import x\nimport ray\n"), "pstore.cli", False)
    assert sorted({line for line, name in found if _is_ray(name)}) == [1, 2]


def test_importing_pstore_or_its_cli_loads_no_ray() -> None:
    code = (
        "import sys, pstore, pstore.cli\n"
        "pstore.cli.build_parser()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'ray' or m == 'pstore.ray'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
