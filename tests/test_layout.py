"""The package's shape, as ARCHITECTURE.md ("Layout") describes it: no import circles, and
one door to the kernels (the contract in `llmlab/kernels/__init__.py`).

The import graph is read from the source (every `import`, also inside functions), so a
circle that only a lazy import closes counts too."""
import ast
import pathlib

import llmlab

PACKAGE = pathlib.Path(llmlab.__file__).parent


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ["llmlab", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: pathlib.Path, known: dict) -> set[str]:
    """The llmlab modules that module `name` imports (`from a import b` counts as a.b when
    that is a module, else as a)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                full = f"{source}.{alias.name}"
                targets.add(full if full in known else source)
    return {t for t in targets if t in known and t != name}


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_circle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_no_import_circles_in_llmlab():
    assert circles(import_graph()) == []


def test_only_the_contract_is_a_door_to_the_kernels():
    """Outside llmlab/kernels/ (benchmarks excepted: they time implementations one by one),
    code reaches kernels through `from llmlab import kernels` only, never an implementation
    module (reference, torch_backend, triton/, gluon/, dense/): so `backend=`, `override` and
    `time_kernels` see every call."""
    graph = import_graph()
    doors = {name: sorted(t for t in targets if t.startswith("llmlab.kernels."))
             for name, targets in graph.items()
             if not name.startswith(("llmlab.kernels", "llmlab.bench"))}
    assert {name: targets for name, targets in doors.items() if targets} == {}


def test_engine_config_holds_no_command_line():
    """argparse lives in cli_flags.py; config.py is the EngineConfig dataclass and its checks."""
    assert "llmlab.cli_flags" not in import_graph()["llmlab.config"]
    assert "argparse" not in (PACKAGE / "config.py").read_text()


def test_the_one_device_engine_does_not_import_the_ranks():
    """engine/ is the one-device loop; engine/parallel/ the multi-process ranks, which the
    runner imports only where it starts them (inside a function)."""
    tree = ast.parse((PACKAGE / "engine" / "model_runner.py").read_text())
    top_level = {node.module for node in tree.body if isinstance(node, ast.ImportFrom)}
    assert not any(module.startswith("llmlab.engine.parallel") for module in top_level)


def test_the_one_device_engine_stays_readable_in_one_sitting():
    """#29's sizes: engine/ without parallel/ (the loop a newcomer reads) at most 1,200 lines,
    engine.py at most 230, scheduler.py at most 300. CUDA graphs (cuda_graphs/) and the ranks
    (engine/parallel/) are layers around it."""
    def lines(path: pathlib.Path) -> int:
        return len(path.read_text().splitlines())

    engine = [path for path in (PACKAGE / "engine").rglob("*.py") if "parallel" not in path.parts]
    assert sum(map(lines, engine)) <= 1200, {path.name: lines(path) for path in engine}
    assert lines(PACKAGE / "engine" / "engine.py") <= 230
    assert lines(PACKAGE / "scheduler.py") <= 300
