"""The import graph: no circles, and every import goes down the layers (issue 14).

Read from the source with ``ast`` (imports inside functions count; ``if TYPE_CHECKING:`` blocks do
not, as they never run). A new module must be placed in a layer below; a module may import its
own layer or lower ones only, and only the CLI reaches into the kernels and calibration packages.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"sim": "servesim.sim", "kernels": "servesim.kernels", "calibration": "servesim.calibration"}

# Lowest first. A name covers the module and everything under it.
LAYERS: list[tuple[str, list[str]]] = [
    ("core types", ["sim", "sim.request", "sim.prefix_keys", "sim.errors", "sim.outputs", "sim.hints", "sim.hf_config", "sim.hardware_file", "sim.presets", "sim.config_model", "sim.host_memory", "kernels", "calibration"]),
    ("KV cache, batch, workload", ["sim.kv_cache", "sim.batch", "sim.workload", "sim.sessions", "sim.mooncake",
                                   "sim.disagg_config"]),
    ("policies, cost model, metrics, kernels", ["sim.schedulers", "sim.allreduce", "sim.cost_model", "sim.varlen_attention",
                                                "sim.layer_cost_model", "sim.metrics",
                                                "sim.iteration_bins",
                                                "kernels.attention", "kernels.model", "kernels.graphs", "kernels.runner",
                                                "kernels.host"]),
    ("engine presets, plots", ["sim.engine_presets", "sim.plots"]),
    ("engine, cluster", ["sim.engine", "sim.compiled_engine", "sim.compiled_price", "sim.compiled_profile", "sim.router", "sim.cluster", "sim.disagg"]),
    ("scenario, simulate, live", ["sim.scenario", "sim.pools", "sim.simulate", "kernels.live"]),
    ("verbs", ["sim.verbs", "calibration.grid", "calibration.fit", "calibration.profile", "calibration.validate",
               "calibration.commands", "calibration.replay", "calibration.measured_run", "calibration.validate_against",
               "calibration.importers", "calibration.allreduce_fit", "calibration.gpu_profile", "calibration.gpu_import", "calibration.gpu_composite",
               "calibration.source_checks", "calibration.run_files", "calibration.run_llmservingsim",
               "calibration.run_vllm_bench"]),
    ("CLI", ["sim.cli"]),
]


def _modules() -> dict[str, tuple[Path, bool]]:
    mods = {}
    for folder, pkg in PACKAGES.items():
        for f in (ROOT / folder).rglob("*.py"):
            parts = list(f.relative_to(ROOT / folder).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            mods[".".join([pkg] + (parts[:-1] if is_pkg else parts))] = (f, is_pkg)
    return mods


def _runtime_nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    """servesim module -> the servesim modules it imports."""
    mods = _modules()
    graph = {}
    for name, (path, is_pkg) in mods.items():
        out = set()
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                names = [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            out.update(n for n in names if n in mods and n != name)
        graph[name] = out
    return graph


def layer_of(module: str) -> int:
    short = module.removeprefix("servesim.")
    best, depth = -1, -1
    for i, (_, names) in enumerate(LAYERS):
        for n in names:
            if (short == n or short.startswith(n + ".")) and len(n) > depth:
                best, depth = i, len(n)
    return best


def test_every_module_has_a_layer():
    assert [m for m in import_graph() if layer_of(m) < 0] == []


def test_imports_go_only_downward():
    upward = [f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
              for a, targets in import_graph().items() for b in targets if layer_of(b) > layer_of(a)]
    assert upward == []


def test_the_import_graph_has_no_circles():
    graph = import_graph()
    state: dict[str, int] = {}
    circles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert circles == []


def test_only_the_cli_imports_kernels_and_calibration():
    reach = sorted(a for a, targets in import_graph().items() if a.startswith("servesim.sim")
                   for b in targets if b.startswith(("servesim.kernels", "servesim.calibration")))
    assert set(reach) <= {"servesim.sim.cli"}
