"""Exact s-t minimum cut (Dinic) and binary-energy minimisation on top of it.

Written here in plain Python rather than taken from networkx: it avoids a
dependency for one algorithm, and a flat-array Dinic without per-edge objects
plans a 200-conv graph in a few milliseconds (networkx's generic graphs are
several times slower to build alone).

`BinaryEnergy` minimises  sum_i U_i(x_i) + sum_ij E_ij(x_i, x_j)  over x in {0,1}^n.
Pairwise terms must be submodular (E00 + E11 <= E01 + E10) *up to relabelling*:
a term that prefers its variables to differ is made submodular by flipping one
variable ("polarity"), found by 2-colouring.  Only if the polarities conflict
(an odd cycle of such terms) is a term truncated, and the result is flagged
inexact.  Layout-only graphs (no label-swapping permutes) never conflict.
"""
from __future__ import annotations

import itertools
from collections import deque
from typing import Dict, List, Optional, Sequence, Tuple

INF = float("inf")
_EPS = 1e-9

__all__ = ["MaxFlow", "BinaryEnergy", "INF"]


class MaxFlow:
    """Dinic's algorithm on an adjacency list of edge indices; edge e^1 is e's reverse."""

    def __init__(self, n: int):
        self.n = n
        self.head: List[List[int]] = [[] for _ in range(n)]
        self.to: List[int] = []
        self.cap: List[float] = []

    def add_edge(self, u: int, v: int, c: float, rc: float = 0.0) -> None:
        if u == v or (c <= 0 and rc <= 0):
            return
        self.head[u].append(len(self.to)); self.to.append(v); self.cap.append(c)
        self.head[v].append(len(self.to)); self.to.append(u); self.cap.append(rc)

    def _levels(self, s: int, t: int) -> Optional[List[int]]:
        level = [-1] * self.n
        level[s] = 0
        q = deque([s])
        head, to, cap = self.head, self.to, self.cap
        while q:
            u = q.popleft()
            lu = level[u] + 1
            for e in head[u]:
                v = to[e]
                if level[v] < 0 and cap[e] > 1e-12:
                    level[v] = lu
                    q.append(v)
        return level if level[t] >= 0 else None

    def max_flow(self, s: int, t: int) -> float:
        total = 0.0
        head, to, cap = self.head, self.to, self.cap
        while True:
            level = self._levels(s, t)
            if level is None:
                return total
            it = [0] * self.n
            # Iterative DFS (graphs are long chains: recursion would hit Python's limit).
            # After an augmentation it resumes at the first saturated edge, not at s.
            path: List[int] = []  # edge indices from s
            u = s
            while True:
                if u == t:
                    f = min(cap[e] for e in path)
                    cut_at = len(path)
                    for k, e in enumerate(path):
                        cap[e] -= f
                        cap[e ^ 1] += f
                        if k < cut_at and cap[e] <= 1e-12:
                            cut_at = k
                    total += f
                    del path[cut_at:]
                    u = to[path[-1]] if path else s
                    continue
                hu = head[u]
                i = it[u]
                lu = level[u] + 1
                n_hu = len(hu)
                while i < n_hu:
                    e = hu[i]
                    if cap[e] > 1e-12 and level[to[e]] == lu:
                        break
                    i += 1
                it[u] = i
                if i < n_hu:
                    path.append(hu[i])
                    u = to[hu[i]]
                    continue
                # dead end: retreat
                if not path:
                    break
                level[u] = -1
                e = path.pop()
                u = to[e ^ 1]
                it[u] += 1

    def source_side(self, s: int) -> List[bool]:
        """After max_flow: nodes reachable from s in the residual graph."""
        seen = [False] * self.n
        seen[s] = True
        q = deque([s])
        while q:
            u = q.popleft()
            for e in self.head[u]:
                v = self.to[e]
                if not seen[v] and self.cap[e] > 1e-12:
                    seen[v] = True
                    q.append(v)
        return seen


class BinaryEnergy:
    def __init__(self):
        self.n = 0
        self.unary: List[List[float]] = []
        self.pair: List[Tuple[int, int, Tuple[float, float, float, float]]] = []
        self.const = 0.0
        self.fixed_pol: Dict[int, int] = {}

    def var(self) -> int:
        self.unary.append([0.0, 0.0])
        self.n += 1
        return self.n - 1

    def add_unary(self, i: int, c0: float, c1: float) -> None:
        self.unary[i][0] += c0
        self.unary[i][1] += c1

    def add_pairwise(self, i: int, j: int, e00: float, e01: float, e10: float, e11: float) -> None:
        if i == j:
            self.add_unary(i, e00, e11)
        else:
            self.pair.append((i, j, (e00, e01, e10, e11)))

    def value(self, x: Sequence[int]) -> float:
        v = self.const + sum(self.unary[i][x[i]] for i in range(self.n))
        for i, j, t in self.pair:
            v += t[2 * x[i] + x[j]]
        return v

    # ---- polarity ---------------------------------------------------------------
    @staticmethod
    def _kind(t) -> int:
        """+1: submodular as is, -1: submodular after flipping one side, 0: modular (either)."""
        a, b, c, d = t
        lhs, rhs = a + d, b + c
        if lhs == rhs:
            return 0
        if lhs != INF and rhs != INF and abs(lhs - rhs) <= _EPS * (1.0 + abs(lhs) + abs(rhs)):
            return 0  # rounding noise must not impose a polarity
        return 1 if lhs < rhs else -1

    def polarities(self, extra: Sequence[Tuple[int, int, int]] = ()) -> List[int]:
        """A 2-colouring making every term submodular where possible; `fixed_pol` seeds it.
        `extra` are (i, j, +1 same / -1 opposite) relations of terms not added yet."""
        adj: List[List[Tuple[int, int]]] = [[] for _ in range(self.n)]
        for i, j, k in itertools.chain(((i, j, self._kind(t)) for i, j, t in self.pair), extra):
            if k:
                adj[i].append((j, k))
                adj[j].append((i, k))
        pol = [-1] * self.n
        for v, p in self.fixed_pol.items():
            pol[v] = p
        q = deque(self.fixed_pol)
        for root in [None] + list(range(self.n)):
            if root is not None:
                if pol[root] >= 0:
                    continue
                pol[root] = 0
                q = deque([root])
            while q:
                u = q.popleft()
                for v, k in adj[u]:
                    if pol[v] < 0:
                        pol[v] = pol[u] if k > 0 else 1 - pol[u]
                        q.append(v)
        return pol

    # ---- solve -------------------------------------------------------------------
    def minimize(self) -> Tuple[List[int], float, bool]:
        """Returns (labels, energy, exact)."""
        n = self.n
        pol = self.polarities()
        lin = [[0.0, 0.0] for _ in range(n)]  # unary in flipped ("raw") space
        for i in range(n):
            u0, u1 = self.unary[i]
            lin[i][0] += u1 if pol[i] else u0
            lin[i][1] += u0 if pol[i] else u1
        cap: List[Dict[int, float]] = [dict() for _ in range(n)]  # cap[i][j]: edge i->j, cut iff i=0, j=1

        def edge(i, j, w):
            if w > 0:
                cap[i][j] = cap[i].get(j, 0.0) + w
                cap[j].setdefault(i, 0.0)

        exact = True
        for i, j, tab in self.pair:
            # raw table R[a][b] = E[a ^ pol_i][b ^ pol_j]
            if pol[i] == pol[j]:
                a, b, c, d = tab if not pol[i] else (tab[3], tab[2], tab[1], tab[0])
            else:
                a, b, c, d = (tab[1], tab[0], tab[3], tab[2]) if not pol[i] else (tab[2], tab[3], tab[0], tab[1])
            if a + d > b + c:  # polarity conflict: truncate to submodular (approximate)
                exact = exact and self._kind((a, b, c, d)) == 0  # rounding noise is not a conflict
                if a == INF or d == INF:  # callers only build hard terms inside one polarity class
                    raise ValueError("hard constraint on the diagonal cannot be represented")
                d = b + c - a
            # E = A + alpha*x + beta*y + B'[x=0,y=1] + C'[x=1,y=0] with B', C' >= 0.
            if c == INF:    # hard term: all of it on the one directed edge y->x
                alpha, beta = d - b, b - a
            elif b == INF:  # hard term on x->y
                alpha, beta = c - a, d - c
            else:           # split the slack evenly: Potts terms stay symmetric (reducible below)
                half = ((b + c) - (a + d)) / 2
                alpha, beta = c - a - half, b - a - half
            lin[i][1] += alpha
            lin[j][1] += beta
            edge(i, j, b - a - beta)
            edge(j, i, c - a - alpha)
        src = [0.0] * n  # capacity s->i (cost of x_i = 1)
        snk = [0.0] * n  # capacity i->t (cost of x_i = 0)
        for i in range(n):  # constants drop out: the energy is re-evaluated on the labels
            c0, c1 = lin[i]
            m = min(c0, c1)
            src[i], snk[i] = c1 - m, c0 - m
        elim, gone = self._reduce(cap, src, snk)
        raw = self._cut([i for i in range(n) if i not in gone], cap, src, snk, n)
        for v, u, x, w1, w2 in reversed(elim):  # back-substitute eliminated variables
            if u is None:
                raw[v] = 0
            elif x is None or raw[u] == raw[x] or w2 <= w1:
                raw[v] = raw[u]
            else:
                raw[v] = raw[x]
        labels = [raw[i] ^ pol[i] for i in range(n)]
        return labels, self.value(labels), exact

    @staticmethod
    def _reduce(cap, src, snk):
        """Exact series reduction: a variable with no unary cost and at most two symmetric
        neighbours u, x contributes min(w1, w2)[x_u != x_x]; chains of pointwise / batch-norm
        nodes between convs collapse into one edge, which keeps Dinic's phases few."""
        elim, gone = [], set()
        stack = list(range(len(cap)))
        while stack:
            v = stack.pop()
            if v in gone or src[v] > 0 or snk[v] > 0:
                continue
            nb = cap[v]
            if len(nb) > 2 or any(nb[u] != cap[u][v] for u in nb):
                continue
            ends = list(nb)
            for u in ends:
                del cap[u][v]
            gone.add(v)
            if not ends:
                elim.append((v, None, None, 0.0, 0.0))
            elif len(ends) == 1:
                elim.append((v, ends[0], None, 0.0, 0.0))
            else:
                u, x = ends
                w1, w2 = nb[u], nb[x]
                w = min(w1, w2)
                if w > 0:
                    cap[u][x] = cap[u].get(x, 0.0) + w
                    cap[x][u] = cap[x].get(u, 0.0) + w
                elim.append((v, u, x, w1, w2))
            cap[v] = {}
            stack.extend(ends)
        return elim, gone

    @staticmethod
    def _cut(alive, cap, src, snk, n) -> List[int]:
        idx = {v: k for k, v in enumerate(alive)}
        s, t = len(alive), len(alive) + 1
        g = MaxFlow(len(alive) + 2)
        for v in alive:
            k = idx[v]
            for u, w in cap[v].items():
                if u in idx and (v < u or v not in cap[u]):
                    g.add_edge(k, idx[u], w, cap[u].get(v, 0.0))
            if src[v] > 0:
                g.add_edge(s, k, src[v])
            if snk[v] > 0:
                g.add_edge(k, t, snk[v])
        g.max_flow(s, t)
        side = g.source_side(s)
        raw = [0] * n
        for v in alive:
            raw[v] = 0 if side[idx[v]] else 1
        return raw
