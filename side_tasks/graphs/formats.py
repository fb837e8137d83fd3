"""Graph loading: SNAP edge lists, Matrix Market files and the CSR form the kernels use.

Loaders parse with numpy's C reader (fast enough for graphs of hundreds of millions of edges);
when that fails, a second, line-by-line pass finds the first bad line so that the user gets
``graph.txt:17: expected two vertex ids ...`` instead of a numpy traceback. Both formats may be
gzip-compressed (``.gz``), as SNAP distributes them.

Vertex ids in SNAP files are arbitrary non-negative integers (often sparse); they are relabelled
to ``0..n-1`` and the original ids are kept in :attr:`CSRGraph.node_ids` so results can be
reported in the user's ids.
"""

from __future__ import annotations

import gzip
import io
import logging
import os
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from side_tasks.errors import DataFormatError

log = logging.getLogger(__name__)

_MM_HEADER_RE = re.compile(r"^%%MatrixMarket\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s*$", re.IGNORECASE)
_MM_FIELDS = ("real", "integer", "pattern", "double")
_MM_SYMMETRIES = ("general", "symmetric")


@dataclass(frozen=True)
class CSRGraph:
    """A graph in compressed sparse row form (out-edges of vertex v are
    ``indices[indptr[v]:indptr[v+1]]``), sorted and without duplicate edges.

    Attributes:
        indptr: int64 array of length n+1.
        indices: int64 array of length m, the edge targets.
        node_ids: int64 array of length n, the original id of each vertex.
        directed: False when each undirected edge is stored in both directions.
    """

    indptr: np.ndarray
    indices: np.ndarray
    node_ids: np.ndarray
    directed: bool = True

    @property
    def num_vertices(self) -> int:
        return int(self.indptr.shape[0] - 1)

    @property
    def num_edges(self) -> int:
        return int(self.indices.shape[0])

    def sources(self) -> np.ndarray:
        """The source vertex of every edge (the COO row array)."""
        return np.repeat(np.arange(self.num_vertices, dtype=np.int64), np.diff(self.indptr))

    def index_of(self, node_id: int) -> int:
        """The internal index of an original vertex id; ConfigError-derived error if absent."""
        pos = int(np.searchsorted(self.node_ids, node_id))
        if pos >= self.num_vertices or int(self.node_ids[pos]) != node_id:
            raise DataFormatError("graph", f"vertex {node_id} is not in the graph")
        return pos

    @classmethod
    def from_edges(
        cls,
        src: np.ndarray,
        dst: np.ndarray,
        num_vertices: int | None = None,
        *,
        directed: bool = True,
        node_ids: np.ndarray | None = None,
    ) -> CSRGraph:
        """Build from edge arrays of internal indices; duplicates are removed, self-loops kept.

        ``directed=False`` stores each edge in both directions.
        """
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        n = int(num_vertices) if num_vertices is not None else int(max(src.max(initial=-1), dst.max(initial=-1)) + 1)
        if not directed:
            src, dst = np.concatenate([src, dst]), np.concatenate([dst, src])
        # One sort of a combined key both orders the edges by (src, dst) and finds duplicates.
        keys = sorted_unique(src * n + dst)
        src_sorted, indices = np.divmod(keys, n)
        indptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(src_sorted, minlength=n), out=indptr[1:])
        ids = np.arange(n, dtype=np.int64) if node_ids is None else np.asarray(node_ids, dtype=np.int64)
        return cls(indptr=indptr, indices=indices.astype(np.int64), node_ids=ids, directed=directed)

    @classmethod
    def from_id_edges(cls, src_ids: np.ndarray, dst_ids: np.ndarray, *, directed: bool = True) -> CSRGraph:
        """Build from edges given in arbitrary original ids, relabelling them to ``0..n-1``."""
        node_ids, inverse = np.unique(np.concatenate([src_ids, dst_ids]), return_inverse=True)
        m = src_ids.shape[0]
        return cls.from_edges(inverse[:m], inverse[m:], node_ids.shape[0], directed=directed, node_ids=node_ids)


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)`` by one sort and a mask of where the sorted values change.

    NumPy 2.4's ``np.unique`` took 33 s on 16M random int64 keys (the edges of an R-MAT graph of 2^20
    vertices: most of a graph task's setup), where this takes 0.4 s; the result is the same sorted array.
    """
    ordered = np.sort(np.asarray(values), kind="quicksort")
    if ordered.size == 0:
        return ordered
    changes = np.empty(ordered.shape, dtype=bool)
    changes[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=changes[1:])
    return ordered[changes]


def _open_text(path: Path) -> IO[str]:
    if not path.exists():
        raise DataFormatError(path, "graph file not found")
    if path.is_dir():
        raise DataFormatError(path, "is a directory, expected a graph file")
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def _numbered_data_lines(handle: IO[str], comments: tuple[str, ...]) -> Iterator[tuple[int, list[str]]]:
    for number, line in enumerate(handle, start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith(comments):
            continue
        yield number, stripped.split()


def _parse_int(token: str) -> int | None:
    try:
        return int(token)
    except ValueError:
        return None


def load_edge_list(path: str | Path, *, directed: bool = True) -> CSRGraph:
    """Load a SNAP-style edge list: one ``FromNodeId ToNodeId [weight]`` per line, whitespace
    separated, ``#`` or ``%`` comment lines. Weights are ignored."""
    path = Path(path)
    with _open_text(path) as handle:
        try:
            with warnings.catch_warnings():
                # An empty file is reported below as a DataFormatError, not as numpy's warning.
                warnings.simplefilter("ignore", UserWarning)
                data = np.loadtxt(handle, dtype=np.int64, comments=("#", "%"), usecols=(0, 1), ndmin=2)
        except (ValueError, IndexError) as exc:
            numpy_error = str(exc)
        else:
            numpy_error = ""
    if numpy_error:
        with _open_text(path) as handle:
            _diagnose_edge_list(path, handle)
        raise DataFormatError(path, f"cannot parse edge list: {numpy_error}")
    if data.shape[0] == 0:
        raise DataFormatError(path, "no edges found (expected lines of 'FromNodeId ToNodeId')")
    if (data < 0).any():
        with _open_text(path) as handle:
            _diagnose_edge_list(path, handle)
    graph = CSRGraph.from_id_edges(data[:, 0], data[:, 1], directed=directed)
    log.info("loaded %s: %d vertices, %d edges", path, graph.num_vertices, graph.num_edges)
    return graph


def _diagnose_edge_list(path: Path, handle: IO[str]) -> None:
    for number, tokens in _numbered_data_lines(handle, ("#", "%")):
        if len(tokens) < 2:
            raise DataFormatError(
                path, f"expected two vertex ids 'FromNodeId ToNodeId', got {' '.join(tokens)!r}", number
            )
        for token in tokens[:2]:
            value = _parse_int(token)
            if value is None or value < 0:
                raise DataFormatError(path, f"vertex id {token!r} is not a non-negative integer", number)


def load_matrix_market(path: str | Path, *, directed: bool = True) -> CSRGraph:
    """Load a Matrix Market ``coordinate`` file as a graph: entry (i, j) is an edge i -> j.

    ``symmetric`` files store each undirected edge once; it is mirrored here. Values are ignored
    (``pattern``, ``integer`` and ``real`` fields are accepted). ``directed=False`` also mirrors a
    ``general`` file's edges.
    """
    path = Path(path)
    with _open_text(path) as handle:
        header = handle.readline()
        match = _MM_HEADER_RE.match(header.strip())
        if match is None:
            raise DataFormatError(
                path,
                "not a Matrix Market file: expected a first line like "
                f"'%%MatrixMarket matrix coordinate real general', got {header.strip()[:80]!r}",
                1,
            )
        obj, fmt, field, symmetry = (g.lower() for g in match.groups())
        if obj != "matrix" or fmt != "coordinate":
            raise DataFormatError(path, f"only 'matrix coordinate' files hold a graph, this one is '{obj} {fmt}'", 1)
        if field not in _MM_FIELDS:
            raise DataFormatError(path, f"unsupported field {field!r} (use real, integer or pattern)", 1)
        if symmetry not in _MM_SYMMETRIES:
            raise DataFormatError(path, f"unsupported symmetry {symmetry!r} (use general or symmetric)", 1)
        line_number = 1
        size_tokens: list[str] = []
        for line in handle:
            line_number += 1
            stripped = line.strip()
            if stripped and not stripped.startswith("%"):
                size_tokens = stripped.split()
                break
        sizes = [_parse_int(t) for t in size_tokens]
        if len(sizes) != 3 or any(s is None or s < 0 for s in sizes):
            raise DataFormatError(
                path, f"expected the size line 'rows cols entries', got {' '.join(size_tokens)!r}", line_number
            )
        rows, cols, nnz = (int(s) for s in sizes if s is not None)
        if rows != cols:
            raise DataFormatError(path, f"matrix is {rows}x{cols}; an adjacency matrix must be square", line_number)
        body_start = line_number
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                data = np.loadtxt(handle, dtype=np.int64, comments="%", usecols=(0, 1), ndmin=2)
            numpy_error = ""
        except (ValueError, IndexError) as exc:
            numpy_error = str(exc)
    if numpy_error or data.shape[0] != nnz or (data.size and (data.min() < 1 or data.max() > rows)):
        with _open_text(path) as handle:
            for _ in range(body_start):
                handle.readline()
            _diagnose_matrix_market(path, handle, body_start, rows, nnz)
        raise DataFormatError(path, f"cannot parse entries: {numpy_error or 'malformed'}")
    src, dst = data[:, 0] - 1, data[:, 1] - 1
    if symmetry == "symmetric":
        off = src != dst
        src, dst = np.concatenate([src, dst[off]]), np.concatenate([dst, src[off]])
    graph = CSRGraph.from_edges(src, dst, rows, directed=directed)
    log.info("loaded %s: %d vertices, %d edges", path, graph.num_vertices, graph.num_edges)
    return graph


def _diagnose_matrix_market(path: Path, handle: IO[str], offset: int, n: int, nnz: int) -> None:
    count = 0
    for number, tokens in _numbered_data_lines(handle, ("%",)):
        line = number + offset
        if len(tokens) < 2:
            raise DataFormatError(path, f"expected an entry 'row col [value]', got {' '.join(tokens)!r}", line)
        for token in tokens[:2]:
            value = _parse_int(token)
            if value is None:
                raise DataFormatError(path, f"index {token!r} is not an integer", line)
            if not 1 <= value <= n:
                raise DataFormatError(path, f"index {value} is outside 1..{n}", line)
        count += 1
    if count != nnz:
        raise DataFormatError(path, f"the size line announces {nnz} entries but the file has {count}")


def detect_format(path: str | Path) -> str:
    """``"mtx"`` for Matrix Market files (by extension or header), else ``"snap"``."""
    path = Path(path)
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    if name.endswith(".mtx"):
        return "mtx"
    if path.is_file():
        with _open_text(path) as handle:
            if handle.readline().startswith("%%MatrixMarket"):
                return "mtx"
    return "snap"


def load_graph(path: str | Path, *, format: str = "auto", directed: bool = True) -> CSRGraph:
    """Load a graph file; ``format`` is ``"auto"``, ``"snap"`` (edge list) or ``"mtx"``."""
    path = Path(path)
    if format == "auto":
        if not path.exists():
            raise DataFormatError(path, "graph file not found")
        format = detect_format(path)
    if format == "snap":
        return load_edge_list(path, directed=directed)
    if format == "mtx":
        return load_matrix_market(path, directed=directed)
    raise DataFormatError(path, f"unknown graph format {format!r} (use auto, snap or mtx)")


_CACHE_VERSION = 1


def load_graph_cached(path: str | Path, cache_dir: Path, *, format: str = "auto", directed: bool = True) -> CSRGraph:
    """:func:`load_graph`, with the CSR arrays cached as ``.npz`` in ``cache_dir``.

    A side task is set up again after every restart or eviction; parsing a text file of a
    hundred million edges takes minutes, loading the binary arrays takes seconds. The cache is
    keyed by the source's resolved path, size and modification time and the load options
    (:func:`cached_graph`).
    """
    source = Path(path)
    try:
        stat = source.stat()
    except OSError:
        return load_graph(source, format=format, directed=directed)  # reports the missing file
    key = f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{format}|{directed}"
    return cached_graph(key, cache_dir, lambda: load_graph(source, format=format, directed=directed), str(source))


def cached_graph(key: str, cache_dir: Path, build: Callable[[], CSRGraph], what: str) -> CSRGraph:
    """The graph cached under ``key`` in ``cache_dir`` (one ``graph-cache.npz``: a task has one graph), or
    ``build()``'s, then cached. Written atomically (a crash leaves no half-written cache behind); a cache
    that cannot be read or written is logged and ignored, never the task's failure."""
    key = f"{_CACHE_VERSION}|{key}"
    cache = Path(cache_dir) / "graph-cache.npz"
    if cache.exists():
        try:
            with np.load(cache, allow_pickle=False) as archive:
                if str(archive["key"]) == key:
                    log.info("loaded %s from cache %s", what, cache)
                    return CSRGraph(
                        indptr=archive["indptr"],
                        indices=archive["indices"],
                        node_ids=archive["node_ids"],
                        directed=bool(archive["directed"]),
                    )
        except (OSError, ValueError, KeyError) as exc:
            log.warning("ignoring unreadable graph cache %s: %s", cache, exc)
    graph = build()
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp.npz")
        with open(tmp, "wb") as handle:
            np.savez(handle, key=np.array(key), indptr=graph.indptr, indices=graph.indices,
                     node_ids=graph.node_ids, directed=np.array(graph.directed))  # fmt: skip
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, cache)
    except OSError as exc:  # a cache is an optimisation: never fail the task for it
        log.warning("cannot write graph cache %s: %s", cache, exc)
    return graph
