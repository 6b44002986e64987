"""Regional compilation of a verifier's decoder layers (PyTorch's "regional compilation" recipe): every layer's
forward through one ``torch.compile``'d function, with fixed or symbolic shapes, optionally with its weights as
constants. Decoding (eyas.engine), prompts' and prefills' forwards, and the online trainer's verifier forwards
(eyas.training) use it."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from eyas.core.errors import brief
from eyas.verifier.merged import SAME_MATMUL_ONCE
from eyas.verifier.norm_ahead import norm_ahead


def raise_recompile_limit(limit: int = 64) -> None:
    """Let dynamo keep ``limit`` compiled versions of one function: decoding compiles a few shapes (one per
    decoding length) of each compiled function, where its default is 8 (and 256 over all of them)."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), limit))


#: inductor's settings for every compile of eyas' decoding and verifier forwards: a matmul that repeats an earlier
#: one on the same operands is computed once (how merged q/k/v and gate/up run as one matmul each,
#: :mod:`eyas.verifier.merged`)
COMPILE_OPTIONS = {"post_grad_custom_pre_pass": SAME_MATMUL_ONCE}

#: inductor's settings for a compile at fixed shapes (batch-1 decoding: the verifier's layers and outer modules,
#: the draft's forward, the step's sampling): :data:`COMPILE_OPTIONS` and inductor's combo kernels, which launch
#: independent kernels of a graph (a layer's k and v cache writes, the rotary table's cos and sin) as one.
#: Why: a batch-1 step is bound by its launches, not by its bytes (docs/BENCHMARKS.md); on one H100 they took a
#: plain SmolLM2 step from 1.20 to 1.12 ms and a K=3 round from 1.70 to 1.64 ms (bench/gpu/generate.sh
#: autotune). Not for symbolic shapes (a batched step, a prompt), where a launch is a small part of the step.
FIXED_SHAPE_OPTIONS = {**COMPILE_OPTIONS, "combo_kernels": True}

#: inductor's settings for a frozen compile (:func:`compiled_layers`' ``freeze``): parameters become constants of
#: the compiled graph, and on CPU matmuls sharing an input may be concatenated too (on CUDA they always may).
FREEZE_OPTIONS = {"freezing": True, "cpp.enable_concat_linear": True, **COMPILE_OPTIONS}


def compile_options(dynamic: bool | None) -> dict:
    """Inductor's settings for a compile of ``torch.compile``'s ``dynamic``: :data:`FIXED_SHAPE_OPTIONS` at fixed
    shapes (``False``), else :data:`COMPILE_OPTIONS`."""
    return dict(FIXED_SHAPE_OPTIONS if dynamic is False else COMPILE_OPTIONS)


def compile_frozen(fn: Callable[..., Any], *, dynamic: bool | None = False) -> Callable[..., Any]:
    """``torch.compile(fn)`` with inductor's freezing: the parameters ``fn`` reads through modules become constants
    of each compiled graph (when it runs with gradients off; with them on it compiles as usual).

    Why: under freezing, inductor's pattern pass over the frozen graph concatenates matmuls that share one input
    into one (``addmm_patterns_init`` in torch/_inductor/fx_passes/freezing_patterns.py: ``matmul_fuse_pattern``
    for three, ``matmul_fuse_pattern_two`` for two), so a Llama layer's gate/up are one matmul, and its q/k/v
    another where their weights have one shape (``check_concat_weights``: not under grouped-query attention,
    whose k/v are narrower than q): 4 matmul kernels a layer instead of 7 at most, 6 for a GQA layer (measured on
    an H100), which at batch size 1 (launch-bound) is time.

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


@contextlib.contextmanager
def compiled_layers(model, *, dynamic: bool | None = False, freeze: bool = False) -> Iterator[None]:
    """Inside the block, every decoder layer of ``model`` runs its forward through ``torch.compile``
    (regional compilation: the layers share one compiled function, so compiling costs one layer, not the whole
    model; PyTorch's "regional compilation" recipe), and at fixed shapes (``dynamic=False``) so do the modules
    outside the layers that :data:`OUTER_MODULES` names (the rotary table, the final norm), each on its own. A
    decoding forward through FlexAttention compiles with its slot attention inside (the cache writes and the
    attention fused with the layer; its code does not depend on the position, :func:`eyas.engine.slots._attention`);
    every other slot attention (SDPA over a key-length bucket, prompts) stays eager, a graph break, so the
    compiled code does not depend on key lengths and a shape compiles once. Forward hooks (hidden-state capture)
    run outside the compiled code.

    ``dynamic`` is ``torch.compile``'s: ``False`` specialises every shape (batch size 1 compiles two: one new
    token and the verification's K + 1); ``None`` compiles the first shape as it is and the next ones once
    with the dimensions that changed symbolic, which is how a batched step's graphs of many row counts share
    one compiled layer instead of a compile each.

    ``freeze`` compiles the layers with their weights as constants (:func:`compile_frozen`, under
    ``torch.no_grad()`` only): gate/up become one matmul (q/k/v another where they have one shape), 1 to 3
    kernels a layer fewer. The price:
    a compile per layer and shape instead of one per shape (the compiled code holds that layer's weights), and
    the concatenated weights once more per shape compiled (:func:`freeze_fits` says when that is cheap). Only for
    weights that no longer change."""
    layers = model.base_model.layers
    # frozen: a compiled version per layer and shape (a few shapes at batch size 1)
    raise_recompile_limit(max(64, 8 * len(layers)) if freeze else 64)
    with contextlib.ExitStack() as stack:
        ahead: list[torch.nn.Module] = []
        if dynamic is False and not freeze and NORM_AHEAD:
            # at fixed shapes (launch-bound), each layer's closing add with the next norm (eyas.verifier.norm_ahead)
            ahead = stack.enter_context(norm_ahead(model, compile_options(False), mlp_rows=DECODE_MLP_ROWS))
        with _compiled_forwards(model, [m for m in layers if m not in ahead], dynamic=dynamic, freeze=freeze,
                                ahead=ahead):  # fmt: skip
            yield


#: whether :func:`compiled_layers` at fixed shapes hands each layer's closing residual add to the next layer's
#: norm (:mod:`eyas.verifier.norm_ahead`); bench/decode_profile.py turns it off to measure what it saves
NORM_AHEAD = True

#: with the norm handed ahead, the most rows (tokens) of a forward whose layers run their MLP block as eyas' two
#: Triton kernels where they fit (:mod:`eyas.verifier.decode_mlp`: five kernels a layer become two); 0: never.
#: One row, a plain step: on one H100 with SmolLM2-135M-Instruct's weights a plain step took 1.041 ms with them
#: against 1.091 ms without (961 against 916 tokens/s), while a K=3 round whose verification (4 rows) ran them
#: took 2.315 against 2.089 ms (docs/BENCHMARKS.md, "The MLP block's kernels on one row"; bench/decode_profile.py
#: --decode-mlp off,on,all). Those four rows ran ``tl.dot`` tiles of 16; they are summed as products since, as one
#: row is (:data:`eyas.verifier.decode_mlp.FEW_ROWS`), not yet timed: ``--decode-mlp all`` measures it
DECODE_MLP_ROWS = 1


@contextlib.contextmanager
def _compiled_forwards(model, layers, *, dynamic: bool | None, freeze: bool,
                       ahead: list[torch.nn.Module]) -> Iterator[None]:  # fmt: skip
    """``layers`` and (at fixed shapes) the outer modules not in ``ahead`` run compiled inside the block."""
    name = f"_eyas_compiled_{dynamic}" + ("_frozen" if freeze else "")
    # the outer modules at fixed shapes only (batch-1 decoding's few graphs, replayed for every token): a forward
    # of symbolic shapes (a prompt, a batched step) runs them once among many more kernels, where compiles of
    # their own would buy back less than they cost
    modules = [*layers, *(m for m in (outer_modules(model) if dynamic is False else []) if m not in ahead)]
    # a forward already set on the instance (accelerate's device-map hooks put theirs there) is compiled, then
    # put back after the block
    before = [m.__dict__.get("forward") for m in modules]
    for m in modules:
        if name not in m.__dict__:
            m.__dict__[name] = compile_frozen(m.forward, dynamic=dynamic) if freeze else \
                torch.compile(m.forward, dynamic=dynamic, options=compile_options(dynamic))  # fmt: skip
        m.forward = m.__dict__[name]  # an instance attribute: shadows the class's forward
    try:
        yield
    finally:
        for m, forward in zip(modules, before):
            if forward is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = forward


#: The modules of a decoder stack outside its layers that :func:`compiled_layers` compiles as well, each on its
#: own: the rotary table (a position's cos and sin, shared by every layer) and the final norm. Why: eagerly they
#: are about 17 small kernels of a batch-1 decoding step (the table's product, concatenation, cos, sin, scalings
#: and casts; the norm's square, mean, rsqrt, products and casts), each a launch in a step bound by its launches
#: (docs/BENCHMARKS.md); compiled, one or two each.
OUTER_MODULES = ("rotary_emb", "norm")


def outer_modules(model) -> list[torch.nn.Module]:
    """The modules of :data:`OUTER_MODULES` that ``model``'s base model has (their hooks still run: they wrap
    ``forward``)."""
    base = model.base_model
    found = [getattr(base, n, None) for n in OUTER_MODULES]
    return [m for m in found if isinstance(m, torch.nn.Module)]


class CompiledOrEager:
    """``fn`` through ``compiled`` (its ``torch.compile``, or None for eager only) until compiling fails once, then
    ``fn`` itself, after one note naming ``what``: a compiler error on some machine costs speed, not the run. Under
    CUDA graphs the graphs run a function twice eagerly before recording it, so a failure comes before a capture."""

    def __init__(self, fn: Callable[..., Any], compiled: Callable[..., Any] | None, what: str) -> None:
        self.fn, self.compiled, self.what = fn, compiled, what

    def __call__(self, *args: Any) -> Any:
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except Exception as e:  # a compiler error
                import sys

                self.compiled = None
                print(f"eyas: {self.what} without torch.compile ({brief(e)})", file=sys.stderr)
        return self.fn(*args)


def compile_work() -> tuple[int, float]:
    """How many times dynamo compiled in this process so far, and the seconds it took (its own
    ``compilation_time_metrics``; ``(0, 0.0)`` where a torch version keeps none). A stage reports the difference
    over its run: a shape that recompiles at every call shows as many compiles, not just a slow stage."""
    times = getattr(torch._dynamo.utils, "compilation_time_metrics", {}).get("_compile.compile_inner", [])
    return len(times), float(sum(times))


def run_dynamic(model, fn: Callable[[], Any], *, compile: bool, what: str = "prompts' forwards") -> tuple[Any, bool]:
    """``fn()`` (a forward of ``model`` over a prompt of any length) with ``model``'s decoder layers compiled
    with symbolic shapes where ``compile`` (one compile for every length), else eagerly -> (its result, whether
    to compile the next one). Why: eagerly, a prompt's forward is bound by dispatching each layer's few dozen
    kernels from Python (a prefill of SmolLM2-135M about 35 ms on an H100, whatever its length up to thousands
    of tokens). A compiler error runs it eagerly, after one note naming ``what``, and says not to compile again;
    the keys and values the failed forward wrote (decoding's) are written again, the same."""
    if compile:
        try:
            with compiled_layers(model, dynamic=True):
                return fn(), True
        except Exception as e:  # a compiler error
            import sys

            print(f"eyas: {what} without torch.compile ({brief(e)})", file=sys.stderr)
    return fn(), False
