"""The package import graph of tokenmill, checked against its one-way rules (docs/engine.md, "The packages").

    python tests/import_graph.py        # prints unit -> units it imports, then every violation; exit 1 on any

Every `import` / `from ... import` in engine/, kernels/ and operator/ counts, also those inside functions
(they run) and under TYPE_CHECKING (a typing dependency against the order is still one). A unit is a
subpackage (engine/core/, operator/plan/, ...) or a top-level module; the rules say which units each unit
may import. Violations: a unit importing one it may not, and any circle between modules.
"""

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
FOLDERS = {"engine": "tokenmill.engine", "kernels": "tokenmill.kernels", "operator": "tokenmill.operator"}

# The engine, top to bottom: a unit may import its own unit and any unit below it, never one above.
# Leaves are the torch-free shared types and math every unit may use (the operator imports some of them);
# they import only other leaves. `api` is the public `LLM` (and the package's lazy exports).
ENGINE_ORDER = [
    "cli", "bench", "server", "api", "frontend", "core", "structured_output", "executor", "worker", "lora",
    "model", "models", "layers", "distributed", "leaves",
]  # fmt: skip
ENGINE_LEAVES = {"config", "model_config", "sampling_params", "outputs", "request", "kv_memory", "metric_names",
                 "parallel_check", "load_memory", "lora_request", "lora_memory", "gguf_header",
                 "quant_memory", "hub_client"}  # fmt: skip
# The operator (operator/__init__.py): which units each unit may import besides itself.
OPERATOR_RULES = {
    "cli": {"handlers", "reconcile", "self_metrics", "children", "plan"},
    "handlers": {"reconcile", "kube", "leadership", "self_metrics", "children", "plan"},
    "reconcile": {"status", "apply", "observe", "children", "plan"},
    "status": {"apply", "observe", "kube", "children", "plan"},
    "apply": {"observe", "children", "plan"},
    "observe": {"kube", "children", "plan"},
    "kube": {"plan"},
    "children": {"plan"},
    "plan": set(),
    "leadership": set(),
    "self_metrics": set(),
    "__init__": set(),
}
# What of the engine the operator may import: the leaves its image can run without torch.
OPERATOR_ENGINE_LEAVES = {"kv_memory", "metric_names", "config", "parallel_check", "load_memory", "lora_memory",
                          "gguf_header", "quant_memory", "hub_client"}


def modules() -> dict[str, pathlib.Path]:
    """Module name -> file, for every module of the three packages."""
    out = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def imports_of(path: pathlib.Path, known: set[str]) -> set[str]:
    """The project modules a file imports (`from pkg import mod` counts as importing pkg.mod)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import mod` imports the module pkg.mod; `from pkg import name` imports pkg.
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]  # fmt: skip
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name.startswith("tokenmill."):
                found.add(name)
    return found


def unit(module: str) -> tuple[str, str]:
    """(top package, unit): ("engine", "core"), ("engine", "leaves"), ("operator", "plan"), ("kernels", "")."""
    parts = module.split(".")
    top, rest = parts[1], parts[2:]
    if top == "kernels":
        return top, ""
    if top == "engine":
        if not rest or rest[0] == "llm":
            return top, "api"
        if len(rest) == 1 and rest[0] in ENGINE_LEAVES:
            return top, "leaves"
        return top, rest[0]
    return top, rest[0] if rest else "__init__"


def allowed(src: str, dst: str) -> bool:
    (s_top, s_unit), (d_top, d_unit) = unit(src), unit(dst)
    if s_top == "kernels":
        return d_top == "kernels"
    if s_top == "operator":
        if d_top == "engine":
            return dst.split(".")[-1] in OPERATOR_ENGINE_LEAVES and dst.count(".") == 2
        if d_top != "operator":
            return False
        return d_unit == s_unit or d_unit in OPERATOR_RULES.get(s_unit, set()) or d_unit == "__init__"
    if d_top == "operator":
        return False
    if d_top == "kernels":
        return s_unit != "leaves"
    if s_unit not in ENGINE_ORDER or d_unit not in ENGINE_ORDER:
        return False  # a new unit must be placed in the order first
    if s_unit == "leaves":
        return d_unit == "leaves"
    return ENGINE_ORDER.index(d_unit) >= ENGINE_ORDER.index(s_unit)


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(path, known) - {name} for name, path in mods.items()}


def violations(g: dict[str, set[str]]) -> list[str]:
    out = []
    for src, dsts in sorted(g.items()):
        out += [f"{src} imports {dst}: against the one-way order" for dst in sorted(dsts) if not allowed(src, dst)]
    out += [f"circle: {' -> '.join(c)}" for c in circles(g)]
    return out


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """One path per strongly connected group of two or more modules (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(10_000)
    for v in sorted(g):
        if v not in index:
            visit(v)
    return groups


def unit_graph(g: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for src, dsts in g.items():
        s = "/".join(filter(None, unit(src)))
        out.setdefault(s, set()).update("/".join(filter(None, unit(d))) for d in dsts)
        out[s].discard(s)
    return out


def main() -> int:
    g = graph()
    for src, dsts in sorted(unit_graph(g).items()):
        print(f"{src:28} -> {', '.join(sorted(dsts)) or '-'}")
    bad = violations(g)
    for line in bad:
        print("VIOLATION:", line)
    print(f"{len(g)} modules, {sum(map(len, g.values()))} imports, {len(bad)} violations")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
