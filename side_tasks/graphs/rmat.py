"""R-MAT synthetic graphs with the Graph500 parameters.

R-MAT (Chakrabarti, Zhan, Faloutsos 2004) places each edge by descending ``scale`` levels of the
adjacency matrix, choosing a quadrant with probabilities a, b, c, d at each level. Graph500 uses
a=0.57, b=0.19, c=0.19 (d=0.05) and 16 edges per vertex, and then permutes the vertex labels so
that high-degree vertices are not clustered at low ids; we do the same. Generation is vectorised
and done in chunks, so its temporary memory stays bounded by a few arrays of ``chunk`` edges.
"""

from __future__ import annotations

import numpy as np

from freeride.errors import ConfigError

GRAPH500_A = 0.57
GRAPH500_B = 0.19
GRAPH500_C = 0.19
GRAPH500_EDGE_FACTOR = 16
#: Bumped whenever :func:`rmat_edges` would give other edges for the same arguments: graph caches name it.
RMAT_VERSION = 1


def rmat_edges(
    scale: int,
    edge_factor: int = GRAPH500_EDGE_FACTOR,
    *,
    a: float = GRAPH500_A,
    b: float = GRAPH500_B,
    c: float = GRAPH500_C,
    seed: int = 0,
    permute: bool = True,
    chunk: int = 1 << 22,
) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(src, dst)`` int64 arrays of ``edge_factor * 2**scale`` R-MAT edges.

    Deterministic for a given ``seed``. Duplicates and self-loops are left in (as Graph500's
    generator does); :class:`~side_tasks.graphs.formats.CSRGraph` removes duplicates.
    """
    if not 1 <= scale <= 40:
        raise ConfigError(f"R-MAT scale must be in 1..40, got {scale}")
    if edge_factor < 1:
        raise ConfigError(f"R-MAT edge factor must be >= 1, got {edge_factor}")
    if min(a, b, c) < 0 or a + b + c >= 1:
        raise ConfigError(f"R-MAT probabilities need a, b, c >= 0 and a+b+c < 1, got {a}, {b}, {c}")
    rng = np.random.default_rng(seed)
    n = 1 << scale
    m = edge_factor * n
    src = np.empty(m, dtype=np.int64)
    dst = np.empty(m, dtype=np.int64)
    ab = a + b
    c_norm = c / (1.0 - ab)
    a_norm = a / ab
    for start in range(0, m, chunk):
        count = min(chunk, m - start)
        s = np.zeros(count, dtype=np.int64)
        d = np.zeros(count, dtype=np.int64)
        for level in range(scale):
            # Graph500's formulation: pick the row half first, then the column half given the row.
            row_bit = rng.random(count) > ab
            threshold = np.where(row_bit, c_norm, a_norm)
            col_bit = rng.random(count) > threshold
            s |= row_bit.astype(np.int64) << level
            d |= col_bit.astype(np.int64) << level
        src[start : start + count] = s
        dst[start : start + count] = d
    if permute:
        perm = rng.permutation(n)
        src = perm[src]
        dst = perm[dst]
    return src, dst
