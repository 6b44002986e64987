"""CUDA graphs for decoding: fixed-shape forwards recorded once and replayed, their decoder layers compiled, so
the host does not dispatch hundreds of kernels a token (at batch size 1 a decoding step is launch-bound)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from eyas.core.memory import free_memory
from eyas.core.errors import brief
from eyas.verifier.compile import compiled_layers


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
    (:func:`eyas.verifier.compile.compiled_layers`): the graph then replays fused kernels. At batch size 1 a decoding step is
    launch-bound (about 50 small kernels a layer eagerly), so fusing them is what makes a step fast. With
    ``freeze`` as well, the layers are compiled with their weights as constants (``compiled_layers``' ``freeze``),
    which fuses the matmuls that share an input.
    """

    def __init__(self, device: torch.device, *, enabled: bool = True, compile_model=None,
                 dynamic: bool | None = False, freeze: bool = False) -> None:  # fmt: skip
        self.enabled = enabled and device.type == "cuda"
        self.compile_model = compile_model if self.enabled else None
        self.dynamic = dynamic
        self.freeze = freeze and self.compile_model is not None
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
                stack.enter_context(compiled_layers(self.compile_model, dynamic=self.dynamic, freeze=self.freeze))
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


def freeze_fits(layers: torch.nn.Module, *, shapes: int = 3, fraction: float = 0.1) -> bool:
    """Whether compiling ``layers`` frozen (:func:`eyas.verifier.compile.compile_frozen`) is cheap: every tensor of theirs a plain
    fp32/bf16/fp16 tensor (not packed int4, whose matmul is eyas' own, nor a quantized subclass) and every
    Linear a plain ``nn.Linear``, all on CUDA, and their bytes times ``shapes`` (the shapes compiled, each holding
    its own copy of the concatenated weights) below ``fraction`` of the free memory of each device they are on.
    An upper bound of the copies (only the matmuls that share an input are concatenated), kept modest so that
    the key/value cache and the graphs' memory do not feel it."""
    tensors = [*layers.parameters(), *layers.buffers()]
    if not tensors:
        return False
    if any(isinstance(m, torch.nn.Linear) and type(m) is not torch.nn.Linear for m in layers.modules()):
        return False
    per_device: dict[torch.device, int] = {}
    for t in tensors:
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.dtype not in _FREEZE_DTYPES:
            return False
        per_device[t.device] = per_device.get(t.device, 0) + t.numel() * t.element_size()
    for device, size in per_device.items():
        free = _free_bytes(device)
        if free is None or size * shapes >= fraction * free:
            return False
    return True


_FREEZE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _free_bytes(device: torch.device) -> int | None:
    """The free memory of a CUDA device; None elsewhere (nothing is compiled frozen there)."""
    return free_memory(device) if device.type == "cuda" else None
