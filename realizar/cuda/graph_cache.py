"""GraphCache: the one eager -> capture -> replay cache of CUDA graphs, keyed by what shapes a step.

    graphs = GraphCache(stream, pdl=True)                 # decode steps: capture right after the first
    step_values.upload(stream)
    graphs.run(("decode", rows), lambda: issue_step(rows))

The first run of a key issues the launches eagerly, so every kernel is loaded and every lazily sized
buffer allocated before a capture (a module load inside a capture would invalidate it). Then:

* ``capture_on="first"`` captures the same launches right after that eager run (the graph is not
  launched: the eager run did the work) and replays the graph from the second run on, for steps that
  recur (decode);
* ``capture_on="repeat"`` runs a key only eagerly the first time and captures (and launches) it when
  it comes back, so a key that never recurs costs no capture (prefill chunks at one position).

``mode``: "capture" (stream capture), "manual" (the graph built node by node from the launches of the
eager run, :func:`realizar.cuda.record_graph`, where stream capture is not available) or "eager"
(never a graph). ``lanes``: one stream, or several ``(device, stream)`` pairs captured together (the
ranks of a tensor-parallel model: one graph a stream, each on its device). At most ``capacity``
graphs are kept; the least recently used is closed first.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Hashable, Sequence

from realizar.cuda.graph import GraphError, GraphExec, capture, record_graph
from realizar.cuda.launch import programmatic_dependent_launch

__all__ = ["GRAPH_MODES", "GraphCache"]

GRAPH_MODES = ("capture", "manual", "eager")
_CAPTURE_ON = ("first", "repeat")


class GraphCache:
    """Graphs of recurring launch sequences by key (see the module docstring)."""

    def __init__(self, lanes: Any, *, mode: str = "capture", capture_on: str = "first", capacity: int = 16,
                 pdl: bool = False, capture_mode: str = "global"):
        if mode not in GRAPH_MODES:
            raise GraphError(f"graph mode must be one of {GRAPH_MODES}, got {mode!r}")
        if capture_on not in _CAPTURE_ON:
            raise GraphError(f"capture_on must be one of {_CAPTURE_ON}, got {capture_on!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise GraphError(f"capacity must be a positive integer, got {capacity!r}")
        pairs: Sequence = lanes if isinstance(lanes, (list, tuple)) else [(lanes.device, lanes)]
        if mode == "manual" and len(pairs) != 1:
            raise GraphError("a manually built graph records one stream's launches")
        self.lanes = [(dev, s) for dev, s in pairs]
        self.mode, self.capture_on, self.capacity = mode, capture_on, capacity
        self.pdl, self.capture_mode = bool(pdl), capture_mode
        self._graphs: dict[Hashable, list[GraphExec]] = {}  # least recently used first
        self._seen: dict[Hashable, None] = {}  # keys run eagerly, not captured yet (capture_on="repeat")

    def __len__(self) -> int:
        return len(self._graphs)

    def keys(self) -> list:
        """The keys with a graph, least recently used first."""
        return list(self._graphs)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._graphs

    def graph(self, key: Hashable, lane: int = 0) -> GraphExec | None:
        """The executable graph of ``key`` on lane ``lane`` (None: not captured)."""
        exes = self._graphs.get(key)
        return None if exes is None else exes[lane]

    def run(self, key: Hashable, issue: Callable[[], None]) -> None:
        """Run ``issue`` (the launches of one step, capturable: no synchronisation or allocation once
        warm) for ``key``: eagerly, by capture, or as a replay of its graph."""
        exes = self._graphs.pop(key, None)
        if exes is not None:
            self._graphs[key] = exes  # most recently used last
            self._launch(exes)
            return
        with programmatic_dependent_launch(self.pdl):
            if self.mode == "eager":
                issue()
            elif self.mode == "manual" and (self.capture_on == "first" or key in self._seen):
                self._seen.pop(key, None)
                with record_graph() as rec:  # runs the launches while recording them
                    issue()
                self._keep(key, [rec.graph.instantiate()])
            elif self.capture_on == "first":
                issue()
                self._keep(key, self._capture(issue))
            elif key in self._seen:
                del self._seen[key]
                exes = self._capture(issue)
                self._keep(key, exes)
                self._launch(exes)
            else:
                issue()
                self._seen[key] = None
                while len(self._seen) > 4 * self.capacity:
                    self._seen.pop(next(iter(self._seen)))

    def _launch(self, exes: list[GraphExec]) -> None:
        for (dev, s), exe in zip(self.lanes, exes):
            dev.make_current()
            exe.launch(s)

    def _capture(self, issue: Callable[[], None]) -> list[GraphExec]:
        with contextlib.ExitStack() as stack:
            caps = []
            for dev, s in self.lanes:
                dev.make_current()
                caps.append(stack.enter_context(capture(s, mode=self.capture_mode)))
            issue()
        exes = []
        for (dev, _), cap in zip(self.lanes, caps):
            dev.make_current()
            exes.append(cap.graph.instantiate())
        return exes

    def _keep(self, key: Hashable, exes: list[GraphExec]) -> None:
        self._graphs[key] = exes
        while len(self._graphs) > self.capacity:
            for exe in self._graphs.pop(next(iter(self._graphs))):
                exe.close()

    def clear(self) -> None:
        """Close every graph (their buffers may be freed afterwards)."""
        for exes in self._graphs.values():
            for exe in exes:
                exe.close()
        self._graphs.clear()
        self._seen.clear()

    close = clear
