"""The package's shape, read from its source: imports only go down, no two modules import each other (directly or
round a circle), the model is used through its public methods, and no file or function outgrows what a reader
can hold.

The imports are read from the AST of every module under huginn_ray/ (a package's `__init__.py` counts as the
module named after the package), with imports inside functions and under `if TYPE_CHECKING:` included: a circle
of type hints is still a circle for whoever reads the code.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "huginn_ray"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 100
ABOVE_THE_MODEL = ("huginn_ray.train", "huginn_ray.serve", "huginn_ray.eval", "huginn_ray.generation")
"""What huginn_ray/model/ must never import: the model is what these are built on."""


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def in_type_checking(parents: list[ast.AST]) -> bool:
    return any(isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) for node in parents)


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported module of the package, line, under TYPE_CHECKING) for every import statement in the file."""
    is_package = path.name == "__init__.py"
    found = []

    def known(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    def visit(node: ast.AST, parents: list[ast.AST]) -> None:
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from package import submodule` imports the submodule; `from package import name`, the package
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                       for alias in node.names]
        for target in targets:
            if target.startswith("huginn_ray") and (module := known(target)) and module != name:
                found.append((module, node.lineno, in_type_checking(parents)))
        for child in ast.iter_child_nodes(node):
            visit(child, parents + [node])

    visit(ast.parse(path.read_text()), [])
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: {target for target, _, _ in imports_of(name, path, modules)} for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph.get(successor, ())))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_import_circle_between_modules():
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_a_circle_and_a_self_contained_package_passes():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_model_imports_nothing_built_on_it():
    modules = module_files()
    upward = [f"{path.relative_to(ROOT)}:{line} imports {target}"
              for name, path in modules.items() if name.startswith("huginn_ray.model")
              for target, line, type_checking in imports_of(name, path, modules)
              if not type_checking and target.startswith(ABOVE_THE_MODEL)]
    assert upward == []


def recurrent_gpt_private_names() -> set[str]:
    """Methods and attributes of RecurrentGPT whose names start with one underscore."""
    tree = ast.parse((PACKAGE / "model" / "model.py").read_text())
    names = set()
    for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == "RecurrentGPT"):
        for node in ast.walk(cls):
            if isinstance(node, ast.FunctionDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def outside_the_model() -> list[Path]:
    files = [path for path in PACKAGE.rglob("*.py") if PACKAGE / "model" not in path.parents]
    return sorted(files + list((ROOT / "jobs").glob("*.py")) + list((ROOT / "bench").glob("*.py")))


def test_nothing_outside_the_model_reads_or_sets_a_private_member_of_recurrent_gpt():
    private = recurrent_gpt_private_names()
    assert "_check_input_ids" in private  # the finder reads the class (a renamed file would make this test vacuous)
    uses = [f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}"
            for path in outside_the_model() for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and node.attr in private]
    assert uses == []


def test_nothing_outside_the_model_sets_an_attribute_on_a_model():
    """`model.x = ...` (or setattr(model, ...)) outside huginn_ray/model/: the model's options are its arguments."""
    def sets_model_attribute(node: ast.AST) -> bool:
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            return any(isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "model"
                       for t in targets)
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and isinstance(node.args[0], ast.Name) and node.args[0].id == "model")

    sets = [f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}"
            for path in outside_the_model() for node in ast.walk(ast.parse(path.read_text()))
            if sets_model_attribute(node)]
    assert sets == []


def test_no_file_over_600_lines_and_no_function_over_100():
    long_files, long_functions = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        if (lines := source.count("\n")) > MAX_FILE_LINES:
            long_files.append(f"{path.relative_to(ROOT)}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (length := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    assert long_files == []
    assert long_functions == []
