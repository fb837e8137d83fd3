"""Graph analytics side tasks: PageRank, BFS and connected components, one iteration per step.

All three share :class:`GraphTask`: the graph is loaded (or generated) on the host in ``setup``,
checked against the memory limit, and moved to the device. Every kernel is a whole-graph sweep, so a
step costs O(n + m) and takes a steady time, which is what the worker runtime's step-time estimate
needs. Two backends compute the same results:

* ``backend="torch"`` (the default): two int64 edge arrays (sources and targets in CSR order) and
  torch scatter operations (``index_add_``, ``scatter_reduce_``), on CPU and CUDA alike;
* ``backend="array"``: NumPy and SciPy on a CPU, CuPy and ``cupyx.scipy`` on a GPU, one code path
  (:mod:`side_tasks.arrays`): PageRank and BFS are sparse matrix-vector products over the graph's
  adjacency matrix, connected components a scatter-min over the edge arrays.

Checkpoints hold host arrays, so a task resumes on either backend from a checkpoint of the other.

A graph file's parsed CSR arrays are cached in ``ctx.work_dir`` so that a task set up again after
a restart or eviction does not parse the text again. Results are written atomically to
``ctx.work_dir/result.npz`` (``node_ids`` and ``values`` in the
user's vertex ids) in the step that finishes the task.
"""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from freeride.errors import ConfigError
from freeride.task import SideTask, TaskContext
from side_tasks._io import atomic_write_bytes
from side_tasks.arrays import ArrayBackend, array_backend, check_backend
from side_tasks.errors import DataFormatError, check_fits
from side_tasks.graphs.formats import CSRGraph, cached_graph, load_graph_cached, sorted_unique
from side_tasks.graphs.rmat import GRAPH500_EDGE_FACTOR, RMAT_VERSION, rmat_edges

log = logging.getLogger(__name__)

#: Bytes per edge of a text edge list, a deliberately low guess so estimates err on the high side.
_TEXT_BYTES_PER_EDGE = 8


def parse_graph_spec(graph: str) -> tuple[int, int] | None:
    """``"rmat:SCALE"`` or ``"rmat:SCALE:EDGE_FACTOR"`` -> (scale, edge_factor); a path -> None."""
    if not graph.startswith("rmat:"):
        return None
    parts = graph.split(":")[1:]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) not in (1, 2):
        raise ConfigError(f"bad synthetic graph {graph!r}: use rmat:SCALE or rmat:SCALE:EDGE_FACTOR")
    return values[0], values[1] if len(values) == 2 else GRAPH500_EDGE_FACTOR


def graph_size_guess(graph: str) -> tuple[int, int] | None:
    """Upper-bound guess of (vertices, stored edges) without loading; None if unknown."""
    spec = parse_graph_spec(graph)
    if spec is not None:
        scale, factor = spec
        return 1 << scale, factor << scale
    try:
        size = os.path.getsize(graph)
    except OSError:
        return None
    # A file might be symmetric Matrix Market (mirrored on load): count each line twice.
    edges = 2 * max(1, size // _TEXT_BYTES_PER_EDGE)
    return edges, edges


class GraphTask(SideTask):
    """Common base: load or generate the graph, check memory, hold the edge arrays on device.

    Args:
        graph: a path to a SNAP edge list or Matrix Market file (optionally ``.gz``), or
            ``"rmat:SCALE[:EDGE_FACTOR]"`` for a Graph500 R-MAT graph of 2**SCALE vertices.
        format: ``"auto"``, ``"snap"`` or ``"mtx"``.
        directed: False treats every edge as undirected (stored in both directions).
        seed: the R-MAT generator's seed.
        backend: ``"torch"`` or ``"array"`` (NumPy/SciPy on CPU, CuPy on CUDA); see the module doc.
    """

    progress_unit: ClassVar[str] = "iterations"
    # Device arrays: torch tensors or NumPy/CuPy arrays, by backend.
    src: Any
    dst: Any
    #: Per-vertex float64/int64 device arrays each kernel keeps (state, next state, degree...).
    _vertex_arrays: ClassVar[int] = 4
    #: Per-edge 8-byte device arrays: source, target and one per-edge temporary.
    _edge_arrays: ClassVar[int] = 3
    #: What setup allocates beside the arrays (the libraries' first calls, the allocator's arenas), as the
    #: worker counts it (resident growth from the constructed task): 13-17 MiB for ``rmat:10`` on CPU, in an
    #: editable and an installed checkout. Headroom over it, so that the estimate holds as the default cap.
    _overhead_bytes: ClassVar[int] = 24 << 20

    def __init__(self, graph: str, format: str = "auto", directed: bool = True, seed: int = 0,
                 backend: str = "torch") -> None:
        if not isinstance(graph, str) or not graph:
            raise ConfigError("graph must be a file path or rmat:SCALE[:EDGE_FACTOR]")
        if parse_graph_spec(graph) is None and not os.path.isfile(graph):  # parsing validates rmat: specs
            raise DataFormatError(graph, "graph file not found (give a file path or rmat:SCALE[:EDGE_FACTOR])")
        self.backend = check_backend(backend)
        self.arrays: ArrayBackend | None = None
        self.graph_spec = graph
        self.format = format
        self.directed = bool(directed)
        self.seed = int(seed)
        self.iteration = 0
        self.finished = False
        self.graph: CSRGraph | None = None
        self.ctx: TaskContext | None = None

    @classmethod
    def working_set_bytes(cls, num_vertices: int, num_edges: int) -> int:
        """Device bytes of the kernel's arrays for a graph of this size."""
        return 8 * (cls._edge_arrays * num_edges + cls._vertex_arrays * num_vertices) + cls._overhead_bytes

    @classmethod
    def estimate_memory(cls, **kwargs: Any) -> int | None:
        """Peak memory: host-side loading (edge arrays, sort keys) plus the device working set."""
        guess = graph_size_guess(str(kwargs.get("graph", "")))
        if guess is None:
            return cls.memory_estimate_bytes
        n, m = guess
        if not kwargs.get("directed", True):
            m *= 2
        return 8 * 5 * m + cls.working_set_bytes(n, m)

    def setup(self, ctx: TaskContext) -> None:
        self.ctx = ctx
        spec = parse_graph_spec(self.graph_spec)
        if spec is not None:
            scale, factor = spec
            n, m = 1 << scale, factor << scale
            if not self.directed:
                m *= 2
            # Generating needs the edge arrays and sort keys on the host: check before building.
            check_fits(
                f"{type(self).__name__} on {self.graph_spec}",
                8 * 5 * m + self.working_set_bytes(n, m),
                ctx.memory_limit_bytes,
                "use a smaller scale or edge factor, or raise the task's memory limit",
            )

            def generate() -> CSRGraph:
                src, dst = rmat_edges(scale, factor, seed=self.seed)
                return CSRGraph.from_edges(src, dst, n, directed=self.directed)

            # Cached in the work dir as a file's CSR is: generating rmat:20 takes seconds (10 s on a 2-core VM),
            # and every restart or eviction sets the task up again. The key names the generator's version.
            key = f"rmat-v{RMAT_VERSION}|{scale}|{factor}|{self.seed}|{self.directed}"
            graph = cached_graph(key, Path(ctx.work_dir), generate, self.graph_spec)
        else:
            # Cached in the work dir (which survives restarts): a resumed task skips the parse.
            graph = load_graph_cached(self.graph_spec, Path(ctx.work_dir), format=self.format, directed=self.directed)
        self.graph = graph
        check_fits(
            f"{type(self).__name__} on {self.graph_spec} ({graph.num_vertices} vertices, {graph.num_edges} edges)",
            self.working_set_bytes(graph.num_vertices, graph.num_edges),
            ctx.memory_limit_bytes,
            "use a smaller graph or raise the task's memory limit",
        )
        self.n = graph.num_vertices
        self.device = torch.device(ctx.device)
        if self.backend == "torch":
            self.src = torch.from_numpy(graph.sources()).to(self.device)
            self.dst = torch.from_numpy(graph.indices).to(self.device)
            self._init_state()
        else:
            self.arrays = ab = array_backend(ctx.device)
            self.src = ab.asarray(graph.sources())
            self.dst = ab.asarray(graph.indices)
            self._init_state_array(ab)
        ctx.logger.info("%s: %d vertices, %d edges on %s (%s)", type(self).__name__, self.n, graph.num_edges,
                        ctx.device, self.backend if self.arrays is None else self.arrays.name)

    def _init_state(self) -> None:
        raise NotImplementedError

    def _init_state_array(self, ab: ArrayBackend) -> None:
        raise NotImplementedError

    def _adjacency(self, ab: ArrayBackend, dtype: Any) -> Any:
        """The sparse matrix A with A[v, u] = 1 for every edge u -> v (CSR): ``A @ x`` sums x over in-edges."""
        ones = ab.xp.ones(self.src.shape[0], dtype=dtype)
        return ab.sparse.coo_matrix((ones, (self.dst, self.src)), shape=(self.n, self.n)).tocsr()

    def _host(self, value: Any) -> np.ndarray:
        """A per-vertex array on the host, from either backend (checkpoints and results)."""
        if self.arrays is not None:
            return self.arrays.to_host(value)
        return value.cpu().numpy()

    def done(self) -> bool:
        return self.finished

    def progress(self) -> float:
        return float(self.iteration)

    def result(self) -> np.ndarray:
        """The per-vertex result, indexed like :attr:`CSRGraph.node_ids`."""
        raise NotImplementedError

    def _finish(self) -> None:
        self.finished = True
        if self.ctx is None or self.graph is None:
            return
        buffer = io.BytesIO()
        np.savez(buffer, node_ids=self.graph.node_ids, values=self.result())
        out = Path(self.ctx.work_dir) / "result.npz"
        atomic_write_bytes(out, buffer.getvalue())
        self.ctx.logger.info("%s finished after %d iterations: %s", type(self).__name__, self.iteration, out)

    def _base_state(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "finished": self.finished, "graph": self.graph_spec}

    def _load_base_state(self, state: dict[str, Any]) -> None:
        if state.get("graph") != self.graph_spec:
            raise ConfigError(f"checkpoint is for graph {state.get('graph')!r}, this task runs on {self.graph_spec!r}")
        self.iteration = int(state["iteration"])
        self.finished = bool(state["finished"])

    def _load_vector(self, value: Any) -> Any:
        """A checkpointed per-vertex array (a tensor or a NumPy array) on this task's backend."""
        if value.shape[0] != self.n:
            raise ConfigError(f"checkpoint holds {value.shape[0]} vertices, the graph has {self.n}")
        if self.arrays is not None:
            return self.arrays.asarray(value)
        return (value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))).to(self.device)


class PageRank(GraphTask):
    """PageRank by power iteration, one iteration per step, until the L1 change < n * tol.

    Dangling vertices (no out-edges) spread their rank uniformly, as in networkx's
    ``pagerank``, whose convergence test this also uses, so results agree within ``tol``.
    The rank vector is float64: float32 loses the ``tol`` on graphs of millions of vertices.

    Args (besides :class:`GraphTask`'s): damping (0.85), tol (1e-6), max_iterations (100).

    The test scales with n: on a graph of a million vertices the default tol makes n * tol = 1, and an L1
    change (at most 2) passes it within a step or two, as in networkx. Setup logs a warning where
    n * tol >= :data:`LOOSE_TOL` and the test may pass before the ranking has converged; pass a smaller tol.
    """

    memory_estimate_bytes: ClassVar[int | None] = 512 << 20
    #: n * tol from which setup warns that the L1 test may pass after a step or two (class doc).
    LOOSE_TOL: ClassVar[float] = 0.1

    def __init__(
        self,
        graph: str,
        damping: float = 0.85,
        tol: float = 1e-6,
        max_iterations: int = 100,
        format: str = "auto",
        directed: bool = True,
        seed: int = 0,
        backend: str = "torch",
    ) -> None:
        super().__init__(graph, format=format, directed=directed, seed=seed, backend=backend)
        if not 0.0 < damping < 1.0:
            raise ConfigError(f"damping must be in (0, 1), got {damping}")
        if max_iterations < 1:
            raise ConfigError(f"max_iterations must be >= 1, got {max_iterations}")
        self.damping = float(damping)
        self.tol = float(tol)
        self.max_iterations = int(max_iterations)

    def _init_state(self) -> None:
        out_degree = torch.zeros(self.n, dtype=torch.float64, device=self.device)
        out_degree.index_add_(0, self.src, torch.ones_like(self.src, dtype=torch.float64))
        self.dangling = out_degree == 0
        self.inv_out_degree = torch.where(self.dangling, 0.0, 1.0 / out_degree.clamp(min=1.0))
        self.rank = torch.full((self.n,), 1.0 / self.n, dtype=torch.float64, device=self.device)
        self.last_change = float("inf")
        self._warn_if_loose()

    def _warn_if_loose(self) -> None:
        bound = self.n * self.tol
        if bound >= self.LOOSE_TOL:
            (self.ctx.logger if self.ctx is not None else log).warning(
                "PageRank on %d vertices with tol %g stops once the L1 change is under n * tol = %.3g (it is "
                "at most 2): that can pass after a step or two, before the ranking converges; pass a smaller "
                "tol (e.g. --arg tol=%g) for a converged result", self.n, self.tol, bound, 1e-3 / self.n)

    def _init_state_array(self, ab: ArrayBackend) -> None:
        xp = ab.xp
        out_degree = xp.bincount(self.src, minlength=self.n).astype(xp.float64)
        self.dangling = out_degree == 0
        self.inv_out_degree = xp.where(self.dangling, 0.0, 1.0 / xp.maximum(out_degree, 1.0))
        self.matrix = self._adjacency(ab, xp.float64)
        self.rank = xp.full(self.n, 1.0 / self.n, dtype=xp.float64)
        self.last_change = float("inf")
        self._warn_if_loose()

    def step(self) -> None:
        if self.finished:
            return
        if self.arrays is None:
            contrib = (self.rank * self.inv_out_degree)[self.src]
            new = torch.zeros_like(self.rank).index_add_(0, self.dst, contrib)
            dangling_mass = self.rank[self.dangling].sum()
            new = self.damping * (new + dangling_mass / self.n) + (1.0 - self.damping) / self.n
            self.last_change = float((new - self.rank).abs().sum())
        else:
            xp = self.arrays.xp
            new = self.matrix @ (self.rank * self.inv_out_degree)
            dangling_mass = self.rank[self.dangling].sum()
            new = self.damping * (new + dangling_mass / self.n) + (1.0 - self.damping) / self.n
            self.last_change = float(xp.abs(new - self.rank).sum())
        self.rank = new
        self.iteration += 1
        if self.last_change < self.n * self.tol or self.iteration >= self.max_iterations:
            self._finish()

    def result(self) -> np.ndarray:
        return self._host(self.rank)

    def state_dict(self) -> dict[str, Any]:
        return {**self._base_state(), "rank": self._host(self.rank), "last_change": self.last_change}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_base_state(state)
        self.rank = self._load_vector(state["rank"])
        self.last_change = float(state["last_change"])


class BFS(GraphTask):
    """Breadth-first search from one source, one level per step (top-down, whole edge sweep).

    Follows edge direction (``directed=False`` for an undirected search). The result is the hop
    distance of every vertex, -1 where unreachable.

    Args (besides :class:`GraphTask`'s): source, the original id of the start vertex (0).
    """

    progress_unit: ClassVar[str] = "levels"
    memory_estimate_bytes: ClassVar[int | None] = 512 << 20
    distance: Any
    frontier: Any

    def __init__(self, graph: str, source: int = 0, format: str = "auto", directed: bool = True, seed: int = 0,
                 backend: str = "torch") -> None:
        super().__init__(graph, format=format, directed=directed, seed=seed, backend=backend)
        self.source = int(source)

    def _init_state(self) -> None:
        assert self.graph is not None
        start = self.graph.index_of(self.source)
        self.distance = torch.full((self.n,), -1, dtype=torch.int64, device=self.device)
        self.distance[start] = 0
        self.frontier = torch.zeros(self.n, dtype=torch.bool, device=self.device)
        self.frontier[start] = True

    def _init_state_array(self, ab: ArrayBackend) -> None:
        assert self.graph is not None
        xp = ab.xp
        start = self.graph.index_of(self.source)
        self.matrix = self._adjacency(ab, xp.float32)
        self.distance = xp.full(self.n, -1, dtype=xp.int64)
        self.distance[start] = 0
        self.frontier = xp.zeros(self.n, dtype=xp.bool_)
        self.frontier[start] = True

    def step(self) -> None:
        if self.finished:
            return
        if self.arrays is None:
            neighbours = self.dst[self.frontier[self.src]]
            fresh = neighbours[self.distance[neighbours] < 0]
            self.distance[fresh] = self.iteration + 1
            self.frontier = torch.zeros_like(self.frontier)
            self.frontier[fresh] = True
        else:
            # In-edges from the frontier: A @ f counts, per vertex, its frontier in-neighbours.
            reached = (self.matrix @ self.frontier.astype(self.arrays.xp.float32)) > 0
            self.frontier = reached & (self.distance < 0)
            self.distance[self.frontier] = self.iteration + 1
        self.iteration += 1
        if not bool(self.frontier.any()):
            self._finish()

    def result(self) -> np.ndarray:
        return self._host(self.distance)

    def state_dict(self) -> dict[str, Any]:
        return {**self._base_state(), "distance": self._host(self.distance), "frontier": self._host(self.frontier)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_base_state(state)
        self.distance = self._load_vector(state["distance"])
        self.frontier = self._load_vector(state["frontier"])


class ConnectedComponents(GraphTask):
    """Weakly connected components by min-label propagation with pointer jumping.

    Each step sends every vertex's label both ways along every edge (``scatter_reduce_`` with
    ``amin``), then shortcuts ``label = label[label]``. Labels are always vertices of the same
    component and only decrease, so at the fixed point every vertex carries the smallest vertex
    index of its component; the task ends with the first step that changes nothing. The result
    maps each vertex to that smallest vertex's original id.
    """

    memory_estimate_bytes: ClassVar[int | None] = 512 << 20
    #: Its step's peak: besides source and target, ``scatter_reduce_``'s ``amin`` on CPU holds per-edge
    #: temporaries (the whole step measured 373-405 MiB on ``rmat:18``, ~95 bytes an edge).
    _edge_arrays: ClassVar[int] = 9
    labels: Any

    def __init__(self, graph: str, format: str = "auto", directed: bool = True, seed: int = 0,
                 backend: str = "torch") -> None:
        super().__init__(graph, format=format, directed=directed, seed=seed, backend=backend)

    def _init_state(self) -> None:
        self.labels = torch.arange(self.n, dtype=torch.int64, device=self.device)

    def _init_state_array(self, ab: ArrayBackend) -> None:
        self.labels = ab.xp.arange(self.n, dtype=ab.xp.int64)

    def step(self) -> None:
        if self.finished:
            return
        if self.arrays is None:
            new = self.labels.clone()
            new.scatter_reduce_(0, self.dst, self.labels[self.src], reduce="amin")
            new.scatter_reduce_(0, self.src, self.labels[self.dst], reduce="amin")
        else:
            new = self.labels.copy()
            self.arrays.scatter_min(new, self.dst, self.labels[self.src])
            self.arrays.scatter_min(new, self.src, self.labels[self.dst])
        new = new[new]
        changed = bool((new != self.labels).any())
        self.labels = new
        self.iteration += 1
        if not changed:
            self._finish()

    def num_components(self) -> int:
        return int(sorted_unique(self._host(self.labels)).size)

    def result(self) -> np.ndarray:
        assert self.graph is not None
        return self.graph.node_ids[self._host(self.labels)]

    def state_dict(self) -> dict[str, Any]:
        return {**self._base_state(), "labels": self._host(self.labels)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_base_state(state)
        self.labels = self._load_vector(state["labels"])
