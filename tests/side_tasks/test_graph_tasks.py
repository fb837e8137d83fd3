"""Graph tasks: results agree with networkx on both backends (torch; NumPy/SciPy, the logic CuPy runs on a
GPU), resume gives the same result (across backends too), memory is checked."""

from __future__ import annotations

import logging
from pathlib import Path

import networkx as nx
import numpy as np
import pytest
from side_task_helpers import make_ctx, run_interrupted, run_to_end

from side_tasks.errors import TaskTooLarge
from side_tasks.graphs import BFS, ConnectedComponents, PageRank, load_graph


def _write_edges(path: Path, edges: list[tuple[int, int]]) -> Path:
    path.write_text("# test graph\n" + "".join(f"{u}\t{v}\n" for u, v in edges))
    return path


def _random_digraph(seed: int, n: int = 60, p: float = 0.05) -> nx.DiGraph:
    graph = nx.gnp_random_graph(n, p, seed=seed, directed=True)
    # Sparse original ids and a few isolated-by-direction (dangling) vertices.
    return nx.relabel_nodes(graph, {v: 3 * v + 7 for v in graph.nodes})


@pytest.fixture(params=["torch", "array"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def graph_file(tmp_path: Path) -> tuple[Path, nx.DiGraph]:
    graph = _random_digraph(5)
    return _write_edges(tmp_path / "g.txt", list(graph.edges)), graph


def _result(task_dir: Path) -> dict[int, float]:
    data = np.load(task_dir / "result.npz")
    return dict(zip(data["node_ids"].tolist(), data["values"].tolist(), strict=True))


def test_pagerank_matches_networkx_including_dangling_vertices(
    tmp_path: Path, graph_file: tuple[Path, nx.DiGraph], backend: str
) -> None:
    path, reference = graph_file
    reference.remove_nodes_from(list(nx.isolates(reference)))  # a file cannot hold isolated vertices
    task = PageRank(str(path), tol=1e-10, max_iterations=500, backend=backend)
    task.setup(make_ctx(tmp_path / "w"))
    run_to_end(task)
    expected = nx.pagerank(reference, alpha=0.85, tol=1e-10, max_iter=500)
    ours = _result(tmp_path / "w")
    assert ours.keys() == expected.keys()
    for node, value in expected.items():
        assert ours[node] == pytest.approx(value, abs=1e-8)
    assert task.progress() == task.iteration > 1


def test_bfs_distances_match_networkx(tmp_path: Path, graph_file: tuple[Path, nx.DiGraph], backend: str) -> None:
    path, reference = graph_file
    source = next(iter(sorted(v for v in reference if reference.out_degree(v) > 0)))
    task = BFS(str(path), source=source, backend=backend)
    task.setup(make_ctx(tmp_path / "w"))
    run_to_end(task)
    expected = nx.single_source_shortest_path_length(reference, source)
    for node, dist in _result(tmp_path / "w").items():
        assert dist == expected.get(node, -1)
    assert task.progress() == max(expected.values()) + 1


def test_connected_components_match_networkx_weak_components(tmp_path: Path, backend: str) -> None:
    reference = nx.disjoint_union_all([_random_digraph(s, n=15, p=0.15) for s in range(4)])
    path = _write_edges(tmp_path / "g.txt", list(reference.edges))
    reference.remove_nodes_from(list(nx.isolates(reference)))
    task = ConnectedComponents(str(path), backend=backend)
    task.setup(make_ctx(tmp_path / "w"))
    run_to_end(task)
    labels = _result(tmp_path / "w")
    for component in nx.weakly_connected_components(reference):
        assert {labels[v] for v in component} == {min(component)}
    assert task.num_components() == nx.number_weakly_connected_components(reference)


def test_rmat_pagerank_matches_networkx_on_generated_graph(tmp_path: Path, backend: str) -> None:
    task = PageRank("rmat:7:4", tol=1e-10, max_iterations=300, seed=2, backend=backend)
    task.setup(make_ctx(tmp_path / "w"))
    run_to_end(task)
    assert task.graph is not None
    graph = task.graph
    reference = nx.DiGraph()
    reference.add_nodes_from(range(graph.num_vertices))
    reference.add_edges_from(zip(graph.sources().tolist(), graph.indices.tolist(), strict=True))
    expected = nx.pagerank(reference, tol=1e-10, max_iter=300)
    assert np.allclose(task.result(), [expected[v] for v in range(graph.num_vertices)], atol=1e-8)


FACTORIES = [
    (lambda g, b: PageRank(g, tol=1e-9, backend=b), 3),
    (lambda g, b: BFS(g, source=7, backend=b), 2),
    (lambda g, b: ConnectedComponents(g, directed=False, backend=b), 1),
]


@pytest.mark.parametrize(("factory", "stop_after"), FACTORIES, ids=["pagerank", "bfs", "components"])
def test_resumed_graph_task_gives_same_result_as_uninterrupted(
    tmp_path: Path, graph_file: tuple[Path, nx.DiGraph], factory, stop_after: int, backend: str
) -> None:
    path = str(graph_file[0])
    whole = factory(path, backend)
    whole.setup(make_ctx(tmp_path / "whole"))
    run_to_end(whole)
    resumed = run_interrupted(lambda: factory(path, backend), tmp_path / "resumed", stop_after)
    assert resumed.done()
    assert resumed.progress() == whole.progress()
    assert np.array_equal(resumed.result(), whole.result())
    assert (tmp_path / "resumed" / "result.npz").exists()


def test_setup_refuses_rmat_scale_that_cannot_fit_the_limit(tmp_path: Path) -> None:
    task = PageRank("rmat:20")
    with pytest.raises(TaskTooLarge, match=r"PageRank on rmat:20 needs about .* memory limit of 1\.0 MiB"):
        task.setup(make_ctx(tmp_path / "w", memory_limit_bytes=1 << 20))


def test_setup_refuses_loaded_graph_that_cannot_fit_the_limit(
    tmp_path: Path, graph_file: tuple[Path, nx.DiGraph]
) -> None:
    with pytest.raises(TaskTooLarge, match="smaller graph"):
        BFS(str(graph_file[0]), source=7).setup(make_ctx(tmp_path / "w", memory_limit_bytes=4096))


def test_memory_estimate_grows_with_rmat_scale() -> None:
    small = PageRank.estimate_memory(graph="rmat:16")
    large = PageRank.estimate_memory(graph="rmat:20")
    assert small is not None and large is not None and large > 8 * small
    assert PageRank.estimate_memory(graph="/no/such/file") == PageRank.memory_estimate_bytes


def test_checkpoint_for_another_graph_is_refused(tmp_path: Path, graph_file: tuple[Path, nx.DiGraph]) -> None:
    task = PageRank("rmat:5")
    task.setup(make_ctx(tmp_path / "a"))
    state = task.state_dict()
    other = PageRank(str(graph_file[0]))
    other.setup(make_ctx(tmp_path / "b"))
    with pytest.raises(ValueError, match="checkpoint is for graph 'rmat:5'"):
        other.load_state_dict(state)


def test_unknown_bfs_source_is_a_clear_error(tmp_path: Path, graph_file: tuple[Path, nx.DiGraph]) -> None:
    with pytest.raises(ValueError, match="vertex 1 is not in the graph"):
        BFS(str(graph_file[0]), source=1).setup(make_ctx(tmp_path / "w"))


def test_loaded_graph_round_trips_through_loader(graph_file: tuple[Path, nx.DiGraph]) -> None:
    graph = load_graph(graph_file[0])
    assert graph.num_edges == graph_file[1].number_of_edges()


@pytest.mark.parametrize(("factory", "stop_after"), FACTORIES, ids=["pagerank", "bfs", "components"])
def test_a_checkpoint_of_one_backend_resumes_on_the_other(
    tmp_path: Path, graph_file: tuple[Path, nx.DiGraph], factory, stop_after: int
) -> None:
    path = str(graph_file[0])
    first = factory(path, "torch")
    first.setup(make_ctx(tmp_path / "first"))
    for _ in range(stop_after):
        first.step()
    state = first.state_dict()
    second = factory(path, "array")
    second.setup(make_ctx(tmp_path / "second"))
    second.load_state_dict(state)
    run_to_end(second)
    whole = factory(path, "torch")
    whole.setup(make_ctx(tmp_path / "whole"))
    run_to_end(whole)
    assert second.progress() == whole.progress()
    assert np.allclose(second.result(), whole.result(), atol=1e-12)


def test_an_unknown_backend_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="backend must be one of torch, array"):
        PageRank("rmat:5", backend="jax")


@pytest.mark.parametrize("task", [PageRank, BFS, ConnectedComponents])
def test_a_graph_file_that_does_not_exist_is_refused_when_the_task_is_built(task: type, tmp_path: Path) -> None:
    # It was accepted at submit and failed at the first bubble; submit builds the task, so this refuses it.
    from side_tasks.errors import DataFormatError

    with pytest.raises(DataFormatError, match=r"nope\.mtx: graph file not found"):
        task(graph=str(tmp_path / "nope.mtx"))


@pytest.mark.parametrize("task, graph", [(PageRank, "rmat:14"), (BFS, "rmat:12"), (ConnectedComponents, "rmat:18")])
def test_a_bundled_graph_task_runs_under_its_own_estimate_as_its_memory_cap(task: type[PageRank | BFS |
                                                                                       ConnectedComponents],
                                                                             graph: str, tmp_path: Path) -> None:
    """``run-task`` without ``--memory`` caps the task at its estimate, as a submission without one does.
    Regression: every size ran 1-3 MiB over it (the README's own ``run-task`` example failed), and
    ConnectedComponents' step on rmat:18 over 100 MiB."""
    import json
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(repo))
    out = subprocess.run([sys.executable, "-m", "freeride.cli", "run-task", f"side_tasks.graphs:{task.__name__}",
                          "--arg", f"graph={graph}", "--device", "cpu:0", "--seconds", "2", "--work-dir",
                          str(tmp_path / "w"), "--json"], capture_output=True, text=True, timeout=300, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["steps"] >= 1
    assert report["memory_limit_bytes"] == task.estimate_memory(graph=graph)
    assert 0 < report["peak_memory_bytes"] <= report["memory_limit_bytes"]


def test_pagerank_warns_where_its_l1_test_would_pass_before_convergence(
    tmp_path: Path, backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    loose = PageRank("rmat:8", tol=1e-3, backend=backend)  # n * tol = 0.256
    with caplog.at_level(logging.WARNING):
        loose.setup(make_ctx(tmp_path / "loose"))
    assert "with tol 0.001 stops once the L1 change is under n * tol = 0.256" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        PageRank("rmat:8", backend=backend).setup(make_ctx(tmp_path / "default"))  # n * tol = 0.000256
    assert "PageRank on" not in caplog.text


def test_an_rmat_graph_is_cached_in_the_work_dir_and_reused_after_a_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    work = tmp_path / "w"
    first = PageRank("rmat:10")
    first.setup(make_ctx(work))
    assert (work / "graph-cache.npz").exists()
    with caplog.at_level(logging.INFO, logger="side_tasks.graphs.formats"):
        again = PageRank("rmat:10")  # the same task set up again, as after a restart
        again.setup(make_ctx(work))
    assert "loaded rmat:10 from cache" in caplog.text
    assert first.graph is not None and again.graph is not None
    np.testing.assert_array_equal(first.graph.indptr, again.graph.indptr)
    np.testing.assert_array_equal(first.graph.indices, again.graph.indices)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="side_tasks.graphs.formats"):
        other = PageRank("rmat:10", seed=1)  # another graph: generated, not the cached one
        other.setup(make_ctx(work))
    assert "from cache" not in caplog.text
    assert other.graph is not None and not np.array_equal(other.graph.indices, first.graph.indices)
