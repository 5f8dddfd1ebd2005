"""The package import graph runs one way, with no circles (tests/import_graph.py prints it)."""

from tests import import_graph as ig


def test_the_tree_follows_the_one_way_rules_without_circles() -> None:
    g = ig.graph()
    assert len(g) > 100  # the whole tree was read, not an empty folder
    assert ig.violations(g) == []


def test_an_upward_import_and_a_circle_are_reported() -> None:
    g = {
        "tokenmill.engine.worker.sampler": {"tokenmill.engine.core.scheduler"},  # worker reaching up into core
        "tokenmill.engine.core.scheduler": {"tokenmill.engine.core.kv_cache_manager"},
        "tokenmill.engine.core.kv_cache_manager": {"tokenmill.engine.core.scheduler"},
        "tokenmill.kernels.ops": {"tokenmill.engine.layers.attention"},  # kernels import nothing of ours
        "tokenmill.operator.plan.sizing": {"tokenmill.engine.kv_memory", "tokenmill.engine.worker.device"},
        "tokenmill.engine.layers.linear": {"tokenmill.operator.plan.sizing"},
    }
    found = ig.violations(g)
    assert "tokenmill.engine.worker.sampler imports tokenmill.engine.core.scheduler: against the one-way order" in found
    assert "tokenmill.kernels.ops imports tokenmill.engine.layers.attention: against the one-way order" in found
    assert "tokenmill.operator.plan.sizing imports tokenmill.engine.worker.device: against the one-way order" in found
    assert "tokenmill.engine.layers.linear imports tokenmill.operator.plan.sizing: against the one-way order" in found
    assert not any("kv_memory" in line for line in found)  # a leaf the operator may import
    assert "circle: tokenmill.engine.core.kv_cache_manager -> tokenmill.engine.core.scheduler" in found
    assert len(found) == 5


def test_downward_imports_and_leaves_are_allowed() -> None:
    for src, dst in [
        ("tokenmill.engine.server.app", "tokenmill.engine.frontend.async_llm"),
        ("tokenmill.engine.core.engine_core", "tokenmill.engine.executor.executor"),
        ("tokenmill.engine.executor.executor", "tokenmill.engine.worker.worker"),
        ("tokenmill.engine.worker.model_runner", "tokenmill.engine.layers.attention"),
        ("tokenmill.engine.layers.linear", "tokenmill.kernels.cpu"),
        ("tokenmill.engine.distributed.parallel_state", "tokenmill.engine.kv_memory"),
    ]:
        assert ig.allowed(src, dst), (src, dst)
    for src, dst in [
        ("tokenmill.engine.frontend.async_llm", "tokenmill.engine.server.state"),
        ("tokenmill.engine.kv_memory", "tokenmill.engine.worker.device"),  # a leaf imports only leaves
        ("tokenmill.engine.layers.linear", "tokenmill.engine.models.llama"),
    ]:
        assert not ig.allowed(src, dst), (src, dst)
