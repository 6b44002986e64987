"""CUDA graphs for decoding: fixed-shape forwards recorded once and replayed, their decoder layers compiled, so
the host does not dispatch hundreds of kernels a token (at batch size 1 a decoding step is launch-bound)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from eyas.core.errors import brief


class Graphs:
    """Fixed-shape forwards recorded once as CUDA graphs and replayed (on CUDA; elsewhere, or with
    ``enabled=False``, they run eagerly).

    ``run(key, fn)`` calls ``fn`` (which reads and writes only tensors that live as long as this object) the
    first time a key is seen: twice eagerly on a side stream (lazy initialisation must not happen inside a
    capture), then once under capture. ``fn`` must be idempotent for the state it is called in (it writes the
    same keys and values each time), which the decoders guarantee by updating their state outside ``fn``, or
    by naming in ``state`` the tensors ``fn`` advances (a whole decoding step, sampling and position included):
    they are put back after recording, so the replay that follows starts from where the caller left them.
    A model whose forward cannot be captured (host synchronisation inside, as MoE routing in some
    transformers versions does) is run eagerly from then on, after one note.

    With ``compile_model``, the warm-up and capture run that model's decoder layers compiled
    (:func:`compiled_layers`): the graph then replays fused kernels. At batch size 1 a decoding step is
    launch-bound (about 50 small kernels a layer eagerly), so fusing them is what makes a step fast.
    """

    def __init__(self, device: torch.device, *, enabled: bool = True, compile_model=None,
                 dynamic: bool | None = False) -> None:  # fmt: skip
        self.enabled = enabled and device.type == "cuda"
        self.compile_model = compile_model if self.enabled else None
        self.dynamic = dynamic
        self.graphs: dict[Any, tuple[Any, Any]] = {}
        self.record_seconds = 0.0  # host time spent recording (compiling included): what replays do not pay

    def run(self, key: Any, fn: Callable[[], Any], *, state: tuple[torch.Tensor, ...] = ()) -> Any:
        if not self.enabled:
            return fn()
        if key not in self.graphs:
            import time

            t0 = time.perf_counter()
            try:
                return self._record(key, fn, state)
            finally:
                self.record_seconds += time.perf_counter() - t0
        graph, out = self.graphs[key]
        graph.replay()
        return out

    def _record(self, key: Any, fn: Callable[[], Any], state: tuple[torch.Tensor, ...]) -> Any:
        saved = [t.clone() for t in state]
        with contextlib.ExitStack() as stack:
            stack.callback(lambda: [t.copy_(x) for t, x in zip(state, saved)])
            if self.compile_model is not None:
                stack.enter_context(compiled_layers(self.compile_model, dynamic=self.dynamic))
            try:
                self.graphs[key] = self._capture(fn)
            except Exception as e:  # e.g. "operation not permitted when stream is capturing", a compiler error
                import sys

                torch.cuda.synchronize()
                if self.compile_model is not None:
                    print(f"eyas: decoding without torch.compile ({brief(e)})", file=sys.stderr)
                    self.compile_model = None
                    stack.close()  # the state back first
                    return self._record(key, fn, state)
                print(f"eyas: decoding without CUDA graphs (the verifier's forward cannot be captured: "
                      f"{str(e).splitlines()[0][:160]})", file=sys.stderr)  # fmt: skip
                self.enabled = False
                stack.close()
                return fn()
        graph, out = self.graphs[key]
        graph.replay()
        return out

    @staticmethod
    def _capture(fn: Callable[[], Any]) -> tuple[Any, Any]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        return graph, out


def raise_recompile_limit(limit: int = 64) -> None:
    """Let dynamo keep ``limit`` compiled versions of one function: decoding compiles a few shapes (one per
    decoding length) of each compiled function, where its default is 8."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), limit))


@contextlib.contextmanager
def compiled_layers(model, *, dynamic: bool | None = False) -> Iterator[None]:
    """Inside the block, every decoder layer of ``model`` runs its forward through ``torch.compile``
    (regional compilation: the layers share one compiled function, so compiling costs one layer, not the whole
    model; PyTorch's "regional compilation" recipe). The slot attention stays eager (a graph break: it is
    registered through ``torch.compiler.disable``), so the compiled code does not depend on key lengths and
    a shape compiles once. Forward hooks (hidden-state capture) run outside the compiled code.

    ``dynamic`` is ``torch.compile``'s: ``False`` specialises every shape (batch size 1 compiles two: one new
    token and the verification's K + 1); ``None`` compiles the first shape as it is and the next ones once
    with the dimensions that changed symbolic, which is how a batched step's graphs of many row counts share
    one compiled layer instead of a compile each."""
    layers = model.base_model.layers
    raise_recompile_limit()
    name = f"_eyas_compiled_{dynamic}"
    for layer in layers:
        if name not in layer.__dict__:
            layer.__dict__[name] = torch.compile(layer.forward, dynamic=dynamic)
        layer.forward = layer.__dict__[name]  # an instance attribute: shadows the class's forward
    try:
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
