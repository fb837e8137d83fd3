"""Graph loaders: correct CSR from SNAP / Matrix Market files, clear errors on bad input."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import scipy.io
import scipy.sparse

from freeride.errors import ConfigError
from side_tasks.errors import DataFormatError
from side_tasks.graphs import CSRGraph, load_graph, load_graph_cached, rmat_edges
from side_tasks.graphs.formats import sorted_unique


def _dense(graph: CSRGraph) -> np.ndarray:
    n = graph.num_vertices
    return scipy.sparse.csr_matrix((np.ones(graph.num_edges), graph.indices, graph.indptr), shape=(n, n)).toarray()


def test_snap_edge_list_relabels_sparse_ids_and_drops_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "g.txt"
    path.write_text("# Directed graph\n# FromNodeId\tToNodeId\n10\t20\n20\t30\n10\t20\n30 10 0.5\n\n")
    graph = load_graph(path)
    assert graph.node_ids.tolist() == [10, 20, 30]
    assert graph.num_edges == 3
    assert _dense(graph).tolist() == [[0, 1, 0], [0, 0, 1], [1, 0, 0]]


def test_gzipped_edge_list_loads_like_plain(tmp_path: Path) -> None:
    path = tmp_path / "g.txt.gz"
    with gzip.open(path, "wt") as handle:
        handle.write("0 1\n1 2\n")
    assert load_graph(path).num_edges == 2


def test_matrix_market_matches_scipy_reader(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    dense = (rng.random((12, 12)) < 0.3).astype(float)
    path = tmp_path / "g.mtx"
    scipy.io.mmwrite(str(path), scipy.sparse.coo_matrix(dense))
    graph = load_graph(path)
    expected = (scipy.io.mmread(str(path)).toarray() != 0).astype(float)
    assert np.array_equal(_dense(graph), expected)


def test_symmetric_matrix_market_is_mirrored(tmp_path: Path) -> None:
    path = tmp_path / "s.mtx"
    path.write_text("%%MatrixMarket matrix coordinate pattern symmetric\n% c\n3 3 2\n2 1\n3 3\n")
    assert _dense(load_graph(path)).tolist() == [[0, 1, 0], [1, 0, 0], [0, 0, 1]]


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(DataFormatError, match=r"nope\.txt: graph file not found"):
        load_graph(tmp_path / "nope.txt")


def test_edge_list_bad_line_reports_its_line_number(tmp_path: Path) -> None:
    path = tmp_path / "bad.txt"
    path.write_text("# header\n0 1\n1 2\n2 x\n3 4\n")
    with pytest.raises(DataFormatError, match=r"bad\.txt:4: vertex id 'x'"):
        load_graph(path)


def test_edge_list_line_with_one_id_reports_its_line_number(tmp_path: Path) -> None:
    path = tmp_path / "short.txt"
    path.write_text("0 1\n7\n")
    with pytest.raises(DataFormatError, match=r"short\.txt:2: expected two vertex ids"):
        load_graph(path, format="snap")


def test_edge_list_negative_id_is_rejected_with_line_number(tmp_path: Path) -> None:
    path = tmp_path / "neg.txt"
    path.write_text("0 1\n1 -2\n")
    with pytest.raises(DataFormatError, match=r"neg\.txt:2: vertex id '-2'"):
        load_graph(path)


def test_empty_edge_list_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "empty.txt"
    path.write_text("# nothing\n")
    with pytest.raises(DataFormatError, match="no edges"):
        load_graph(path)


def test_matrix_market_wrong_header_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "bad.mtx"
    path.write_text("%%MatrixMarket matrix array real general\n2 2\n1\n2\n3\n4\n")
    with pytest.raises(DataFormatError, match=r"bad\.mtx:1: only 'matrix coordinate'"):
        load_graph(path)
    path.write_text("hello\n2 2 1\n1 1\n")
    with pytest.raises(DataFormatError, match=r"bad\.mtx:1: not a Matrix Market file"):
        load_graph(path, format="mtx")


def test_matrix_market_bad_entry_reports_its_line_number(tmp_path: Path) -> None:
    path = tmp_path / "bad.mtx"
    path.write_text("%%MatrixMarket matrix coordinate real general\n%c\n3 3 3\n1 2 1.0\n2 q 1.0\n3 1 1.0\n")
    with pytest.raises(DataFormatError, match=r"bad\.mtx:5: index 'q'"):
        load_graph(path)


def test_matrix_market_index_out_of_range_reports_its_line_number(tmp_path: Path) -> None:
    path = tmp_path / "bad.mtx"
    path.write_text("%%MatrixMarket matrix coordinate pattern general\n3 3 2\n1 2\n4 1\n")
    with pytest.raises(DataFormatError, match=r"bad\.mtx:4: index 4 is outside 1\.\.3"):
        load_graph(path)


def test_matrix_market_entry_count_mismatch_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "bad.mtx"
    path.write_text("%%MatrixMarket matrix coordinate pattern general\n3 3 3\n1 2\n2 1\n")
    with pytest.raises(DataFormatError, match="announces 3 entries but the file has 2"):
        load_graph(path)


def test_matrix_market_non_square_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "bad.mtx"
    path.write_text("%%MatrixMarket matrix coordinate pattern general\n3 4 1\n1 2\n")
    with pytest.raises(DataFormatError, match=r"bad\.mtx:2: matrix is 3x4"):
        load_graph(path)


def test_loader_errors_are_config_errors_for_the_cli(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_graph(tmp_path / "missing.mtx")


def test_rmat_is_deterministic_and_skewed_like_graph500() -> None:
    src, dst = rmat_edges(10, 16, seed=3)
    again_src, again_dst = rmat_edges(10, 16, seed=3)
    assert np.array_equal(src, again_src) and np.array_equal(dst, again_dst)
    assert src.shape == (16 * 1024,) and src.max() < 1024 and dst.min() >= 0
    degree = np.bincount(src, minlength=1024)
    # a=0.57 concentrates edges: the busiest 1% of vertices hold far more than 1% of the edges.
    assert np.sort(degree)[-10:].sum() > 0.05 * src.shape[0]


def test_rmat_rejects_bad_parameters() -> None:
    with pytest.raises(ConfigError, match="scale"):
        rmat_edges(0)
    with pytest.raises(ConfigError, match="probabilities"):
        rmat_edges(4, a=0.6, b=0.3, c=0.2)


def test_graph_cache_is_reused_and_invalidated_when_the_source_changes(tmp_path: Path) -> None:
    source = tmp_path / "g.txt"
    source.write_text("0 1\n1 2\n")
    first = load_graph_cached(source, tmp_path / "cache")
    assert (tmp_path / "cache" / "graph-cache.npz").exists()
    again = load_graph_cached(source, tmp_path / "cache")
    assert np.array_equal(again.indices, first.indices) and np.array_equal(again.indptr, first.indptr)
    source.write_text("0 1\n1 2\n2 0\n5 0\n")
    changed = load_graph_cached(source, tmp_path / "cache")
    assert changed.num_edges == 4 and changed.node_ids.tolist() == [0, 1, 2, 5]
    with pytest.raises(DataFormatError, match="graph file not found"):
        load_graph_cached(tmp_path / "gone.txt", tmp_path / "cache")


@pytest.mark.parametrize("values", [
    np.array([], dtype=np.int64),
    np.array([7], dtype=np.int64),
    np.array([3, 1, 3, 3, 0, 1, 2**40, -5], dtype=np.int64),
    np.random.default_rng(1).integers(0, 50, 1000),
])
def test_sorted_unique_gives_what_np_unique_gives(values: np.ndarray) -> None:
    got = sorted_unique(values)
    assert got.dtype == values.dtype
    np.testing.assert_array_equal(got, np.unique(values))
