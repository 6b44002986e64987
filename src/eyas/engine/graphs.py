"""CUDA graphs for decoding: fixed-shape forwards recorded once and replayed, their decoder layers compiled, so
the host does not dispatch hundreds of kernels a token (at batch size 1 a decoding step is launch-bound)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from eyas.core.memory import free_memory
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


def raise_recompile_limit(limit: int = 64) -> None:
    """Let dynamo keep ``limit`` compiled versions of one function: decoding compiles a few shapes (one per
    decoding length) of each compiled function, where its default is 8 (and 256 over all of them)."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), limit))


#: inductor's settings for a frozen compile (:func:`compiled_layers`' ``freeze``): parameters become constants of
#: the compiled graph, and on CPU matmuls sharing an input may be concatenated too (on CUDA they always may).
FREEZE_OPTIONS = {"freezing": True, "cpp.enable_concat_linear": True}


def compile_frozen(fn: Callable[..., Any], *, dynamic: bool | None = False) -> Callable[..., Any]:
    """``torch.compile(fn)`` with inductor's freezing: the parameters ``fn`` reads through modules become constants
    of each compiled graph (when it runs with gradients off; with them on it compiles as usual).

    Why: under freezing, inductor's pattern pass over the frozen graph concatenates matmuls that share one input
    into one (``addmm_patterns_init`` in torch/_inductor/fx_passes/freezing_patterns.py: ``matmul_fuse_pattern``
    for three, ``matmul_fuse_pattern_two`` for two), so a Llama layer's q/k/v are one matmul and its gate/up
    another: 4 matmul kernels a layer instead of 7, which at batch size 1 (launch-bound) is time.

    The setting must be on while dynamo traces, not only while inductor compiles: dynamo reads
    ``torch._inductor.config.freezing`` to decide whether a module's parameters enter the graph as constants or
    as inputs, and ``torch.compile(options=...)`` patches inductor's config only around inductor's part (with
    the options alone nothing is frozen). So every call runs inside ``torch._inductor.config.patch``, restored
    after it: a compile happens inside the call that needs it (a new shape, at any later call). The options are
    passed as well, which also keeps this function's compiled versions apart from unfrozen ones of the same
    code (dynamo reuses a version only for an equal backend).

    What it costs: the compiled graph holds the weights (guarded by identity: modules of other weights compile
    their own versions, so regional compilation's one version shared by every layer becomes one a layer), and
    the concatenated weights are new tensors folded into each compiled graph: those weights exist twice, and
    once more per shape compiled. Weights changed in place after compiling are not seen: only for weights that
    no longer change (inference)."""
    compiled = torch.compile(fn, dynamic=dynamic, options=dict(FREEZE_OPTIONS))

    @functools.wraps(fn)
    def frozen(*args: Any, **kwargs: Any) -> Any:
        with torch._inductor.config.patch(FREEZE_OPTIONS):
            return compiled(*args, **kwargs)

    return frozen


def freeze_fits(layers: torch.nn.Module, *, shapes: int = 3, fraction: float = 0.1) -> bool:
    """Whether compiling ``layers`` frozen (:func:`compile_frozen`) is cheap: every tensor of theirs a plain
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


@contextlib.contextmanager
def compiled_layers(model, *, dynamic: bool | None = False, freeze: bool = False) -> Iterator[None]:
    """Inside the block, every decoder layer of ``model`` runs its forward through ``torch.compile``
    (regional compilation: the layers share one compiled function, so compiling costs one layer, not the whole
    model; PyTorch's "regional compilation" recipe). A decoding forward through FlexAttention compiles with its
    slot attention inside (the cache writes and the attention fused with the layer; its code does not depend on
    the position, :func:`eyas.engine.slots._attention`); every other slot attention (SDPA over a key-length
    bucket, prompts) stays eager, a graph break, so the compiled code does not depend on key lengths and a shape
    compiles once. Forward hooks (hidden-state capture) run outside the compiled code.

    ``dynamic`` is ``torch.compile``'s: ``False`` specialises every shape (batch size 1 compiles two: one new
    token and the verification's K + 1); ``None`` compiles the first shape as it is and the next ones once
    with the dimensions that changed symbolic, which is how a batched step's graphs of many row counts share
    one compiled layer instead of a compile each.

    ``freeze`` compiles the layers with their weights as constants (:func:`compile_frozen`, under
    ``torch.no_grad()`` only): q/k/v become one matmul and gate/up another, 3 kernels a layer fewer. The price:
    a compile per layer and shape instead of one per shape (the compiled code holds that layer's weights), and
    the concatenated weights once more per shape compiled (:func:`freeze_fits` says when that is cheap). Only for
    weights that no longer change."""
    layers = model.base_model.layers
    # frozen: a compiled version per layer and shape (a few shapes at batch size 1)
    raise_recompile_limit(max(64, 8 * len(layers)) if freeze else 64)
    name = f"_eyas_compiled_{dynamic}" + ("_frozen" if freeze else "")
    # a forward already set on the instance (accelerate's device-map hooks put theirs there) is compiled, then
    # put back after the block
    before = [layer.__dict__.get("forward") for layer in layers]
    for layer in layers:
        if name not in layer.__dict__:
            layer.__dict__[name] = compile_frozen(layer.forward, dynamic=dynamic) if freeze else \
                torch.compile(layer.forward, dynamic=dynamic)  # fmt: skip
        layer.forward = layer.__dict__[name]  # an instance attribute: shadows the class's forward
    try:
        yield
    finally:
        for layer, forward in zip(layers, before):
            if forward is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = forward


def run_dynamic(model, fn: Callable[[], Any], *, compile: bool) -> tuple[Any, bool]:
    """``fn()`` (a forward of ``model`` over a prompt of any length) with ``model``'s decoder layers compiled
    with symbolic shapes where ``compile`` (one compile for every length), else eagerly -> (its result, whether
    to compile the next one). Why: eagerly, a prompt's forward is bound by dispatching each layer's few dozen
    kernels from Python (a prefill of SmolLM2-135M about 35 ms on an H100, whatever its length up to thousands
    of tokens). A compiler error runs it eagerly, after one note, and says not to compile again; the keys and
    values the failed forward wrote are written again, the same."""
    if compile:
        try:
            with compiled_layers(model, dynamic=True):
                return fn(), True
        except Exception as e:  # a compiler error
            import sys

            print(f"eyas: prompts' forwards without torch.compile ({brief(e)})", file=sys.stderr)
    return fn(), False
