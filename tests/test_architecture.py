"""The import graph of src/isoloco: no cycles, and no arrow from a lower layer to a higher one
(docs/architecture.md draws the layers)."""

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src" / "isoloco"

#: Lowest first; a module may import from its own layer or below. `pkg.*` is a subpackage.
LAYERS = [
    ("base", {"isoloco", "isoloco.errors", "isoloco.logs", "isoloco.configbase", "isoloco.fileutil",
              "isoloco.rundir", "isoloco.methods", "isoloco.stop", "isoloco.cliargs", "isoloco.metrics",
              "isoloco.launch"}),
    ("numerics, data, state", {"isoloco.svd", "isoloco.newton_schulz", "isoloco.ortho", "isoloco.factors",
                               "isoloco.model", "isoloco.inner", "isoloco.data.*", "isoloco.watchdog",
                               "isoloco.checkpoint"}),
    ("sync layer", {"isoloco.comm", "isoloco.sync.*"}),
    ("merge rules", {"isoloco.rules", "isoloco.merge_config", "isoloco.merge", "isoloco.merge_functions"}),
    ("outer step", {"isoloco.outer", "isoloco.spectra"}),
    ("processes and run config", {"isoloco.layout", "isoloco.torch_comm", "isoloco.distributed",
                                  "isoloco.sharded_checkpoint", "isoloco.train_config", "isoloco.config_checks",
                                  "isoloco.config"}),
    ("training loop", {"isoloco.algorithms", "isoloco.trainer"}),
    ("tools on runs", {"isoloco.report.*", "isoloco.export", "isoloco.bench.*", "isoloco.torchft.*",
                       "isoloco.torchtitan.*"}),
    ("commands", {"isoloco.sweep", "isoloco.tuned", "isoloco.cli", "isoloco.__main__"}),
]


def module_name(path: Path) -> str:
    parts = ("isoloco",) + path.relative_to(SOURCE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in SOURCE.rglob("*.py")}


def layer_of(module: str) -> int:
    for index, (_, members) in enumerate(LAYERS):
        for member in members:
            if module == member or (member.endswith(".*") and module.startswith(member[:-2])):
                return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and to docs/architecture.md")


def imports_of(path: Path) -> set[str]:
    """isoloco modules `path` imports at run time (imports under `if TYPE_CHECKING:` excluded),
    at module level or inside functions."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
               and getattr(node.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module
                      for alias in node.names}
    return {name for name in found if name in MODULES}


GRAPH = {module: imports_of(path) - {module} for module, path in MODULES.items()}


def test_every_module_has_a_layer_and_imports_only_its_layer_or_below():
    upward = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
              for m, targets in GRAPH.items() for t in sorted(targets) if layer_of(t) > layer_of(m)]
    assert not upward, "\n".join(upward)


def test_the_import_graph_has_no_cycle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
