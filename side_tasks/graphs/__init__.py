"""Graph analytics side tasks on CSR graphs (see :mod:`side_tasks.graphs.tasks`).

Submit as ``side_tasks.graphs:PageRank`` (or ``BFS``, ``ConnectedComponents``) with
``{"graph": "path/to/edges.txt"}`` or ``{"graph": "rmat:20"}``.
"""

from side_tasks.graphs.formats import (
    CSRGraph,
    load_edge_list,
    load_graph,
    load_graph_cached,
    load_matrix_market,
)
from side_tasks.graphs.rmat import rmat_edges
from side_tasks.graphs.tasks import BFS, ConnectedComponents, GraphTask, PageRank

__all__ = [
    "BFS",
    "CSRGraph",
    "ConnectedComponents",
    "GraphTask",
    "PageRank",
    "load_edge_list",
    "load_graph",
    "load_graph_cached",
    "load_matrix_market",
    "rmat_edges",
]
