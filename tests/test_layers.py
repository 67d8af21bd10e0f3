"""The packages run one way: each imports only packages below it (docs/design.md, "Layers").

Every import statement is walked, function-local and TYPE_CHECKING ones included, so a cycle cannot hide behind
an import inside a function. Packages on the same floor never import each other (sim and exec, the two
interpreters, are the case that matters)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "megatrain"

# floor of each top-level part of the package, bottom first
FLOORS: dict[str, int] = {
    "settings": 0, "tomlfile": 0, "units": 0,  # the --set grammar, TOML reading, byte units: no megatrain imports
    "model": 1,                            # families: shapes, layouts, HF names, FLOPs, init
    "ir": 2,                               # the contract: tasks, DAG, placement, Program, Timeline columns
    "plan": 3, "analysis": 3, "data": 3,   # memory planner; summaries and plots; tokenizers and batches
    "compile": 4,                          # knobs -> resolve -> passes -> lower
    "sim": 5, "exec": 5,                   # the two interpreters
    "parallel": 6,                         # data parallelism: registers with exec and sim
    "tune": 7,                             # schedule search by simulation, auto
    "io": 8,                               # safetensors, HF, checkpoints
    "engine": 9,                           # StreamedTrainer
    "profiling": 10,                       # measure a machine, calibrate, compare
    "train": 11,                           # a training run
    "cli": 12,                             # the commands
    "__main__": 13, "__init__": 13,        # `python -m megatrain` and the public facade (lazy names)
}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports() -> list[tuple[str, str, int]]:
    """(importing file, imported megatrain module, line) for every import statement in the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        here = list(rel.parts)
        package = here[:-1] if here[-1] != "__init__" else here[:-1]
        if here[-1] == "__init__":
            here = here[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - (node.level - 1)]
                    names = [".".join(base + ([node.module] if node.module else []))]
                else:
                    names = [node.module or ""]
                if names[0] == "megatrain":  # from megatrain import x: x is a part, or a name of the facade
                    names = [f"megatrain.{a.name}" if a.name == "__version__" or (PACKAGE / a.name).exists()
                             or (PACKAGE / f"{a.name}.py").exists() else "megatrain" for a in node.names]
            else:
                continue
            found += [(".".join(here), n, node.lineno) for n in names if n.startswith("megatrain")]
    return found


def test_every_part_of_the_package_has_a_floor():
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.is_file() and p.suffix == ".py") or (p / "__init__.py").exists()}
    assert parts <= set(FLOORS), f"give these a floor in FLOORS: {sorted(parts - set(FLOORS))}"


def test_imports_run_downward_only():
    wrong = []
    for importer, imported, line in _imports():
        a, b = _part(importer), _part(imported)
        if a == b or imported == "megatrain.__version__":  # the package root holds the version
            continue
        if FLOORS[b] >= FLOORS[a]:
            wrong.append(f"{importer}:{line} imports {imported} ({a} floor {FLOORS[a]} -> {b} floor {FLOORS[b]})")
    assert not wrong, "imports that run upward or sideways:\n" + "\n".join(wrong)


def _loaded_by(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(m for m in sys.modules if m.startswith('megatrain')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent).stdout
    return set(out.split())


def test_the_simulator_loads_no_compiler_or_planner():
    loaded = _loaded_by("megatrain.sim")
    assert not {m for m in loaded if _part(m) in ("compile", "plan", "exec", "parallel")}, sorted(loaded)


def test_the_executor_loads_no_compiler_or_planner():
    loaded = _loaded_by("megatrain.exec.runtime")
    assert not {m for m in loaded if _part(m) in ("compile", "plan", "sim", "parallel")}, sorted(loaded)


def _unexplained_local_imports() -> list[str]:
    """Imports inside a function with no comment saying why: on the line, or above it in the block of imports and
    comments it belongs to."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().split("\n")
        for func in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                said = any("#" in lines[i] for i in range(node.lineno - 1, node.end_lineno))
                i = node.lineno - 2
                while not said and i >= func.lineno and (lines[i].strip().startswith(("#", "import ", "from "))
                                                         or not lines[i].strip()):
                    said = lines[i].strip().startswith("#")
                    i -= 1
                if not said:
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return found


def test_imports_inside_functions_say_why():
    """With the floors one-way, an import inside a function is no longer needed to dodge a cycle; one stays only
    where a comment says why (the torch-free CLI, an optional dependency, a heavy module few paths need)."""
    found = sorted(set(_unexplained_local_imports()))
    assert not found, "move these to the top of their module, or say why they are local:\n" + "\n".join(found)
