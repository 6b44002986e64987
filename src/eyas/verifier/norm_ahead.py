"""Each decoder layer's closing residual add computed with the next layer's input norm, in one compiled function,
as vLLM's layers do (its ``RMSNorm(x, residual)`` adds and normalises in one kernel: ``fused_add_rms_norm``).

Why: under regional compilation (:func:`eyas.verifier.compile.compiled_layers`) a layer's compiled code ends at
its output, ``residual + mlp(...)``, and the next layer's begins with ``input_layernorm`` of it: two kernels, where
one reads the sum it writes. At batch size 1 a decoding step is bound by its launches, not its bytes
(docs/BENCHMARKS.md), so the add is a launch a layer for nothing: 30 of a SmolLM2 step's 379 kernels, and the final
norm's too. Here each layer's forward is one compiled function over the layer and the *next* norm
(``layers[i + 1].input_layernorm``, the final norm after the last layer) that returns the layer's output, as the
layer computes it, and that norm of it; the next layer reads the norm instead of computing it. The compiled code is
still one version shared by every layer (the modules are its inputs), plus the first layer's norm, compiled apart.

Only for a layer whose forward is the pre-norm pattern that Llama, Mistral, Qwen2/3, Qwen3-MoE, DeepSeek-V3 and
Gemma share, statement for statement (checked on its source: :func:`prenorm_signature`); any other runs its own
forward. The hand-off is by identity: a layer uses the norm computed ahead only when its input is the very tensor
the layer before returned (a forward hook that returns a new tensor in between gets its own norm computed)."""

from __future__ import annotations

import ast
import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from eyas.verifier.decode_mlp import decode_mlp, fits
from eyas.verifier.source import body, function_ast

#: the pre-norm decoder layer's forward, statement for statement (``...``: the attention's arguments, checked
#: apart); how transformers writes LlamaDecoderLayer.forward and the layers copied from it
_PRENORM = [
    "residual = hidden_states",
    "hidden_states = self.input_layernorm(hidden_states)",
    "hidden_states, _ = self.self_attn(...)",
    "hidden_states = residual + hidden_states",
    "residual = hidden_states",
    "hidden_states = self.post_attention_layernorm(hidden_states)",
    "hidden_states = self.mlp(hidden_states)",
    "hidden_states = residual + hidden_states",
    "return hidden_states",
]


@functools.cache
def prenorm_signature(cls: type) -> inspect.Signature | None:
    """The signature of ``cls.forward`` (``self`` left out) where its body is :data:`_PRENORM` (comments and a
    docstring aside) and its attention is called with ``hidden_states=hidden_states``, every other parameter
    passed on under its own name and ``**kwargs`` (which it must take); else None. Then ``self.self_attn(hidden_states=x,
    **bound)``, with the forward's arguments bound to it (defaults applied), is the call the layer makes."""
    f = function_ast(cls.forward)
    if f is None:
        return None
    stmts = body(f)
    if len(stmts) != len(_PRENORM):
        return None
    call = stmts[2].value if isinstance(stmts[2], ast.Assign) else None
    if not isinstance(call, ast.Call) or call.args:
        return None
    shown = [ast.unparse(s) for s in stmts]
    shown[2] = shown[2].split("(")[0] + "(...)"
    if shown != _PRENORM:
        return None
    sig = inspect.signature(inspect.unwrap(cls.forward))  # past a decorator that renames arguments (functools.wraps)
    params = list(sig.parameters.values())[1:]  # self
    if not params or params[0].name != "hidden_states":
        return None
    named = {k.arg: ast.unparse(k.value) for k in call.keywords if k.arg is not None}
    rest = [ast.unparse(k.value) for k in call.keywords if k.arg is None]
    passed = {p.name for p in params[1:] if p.kind is not p.VAR_KEYWORD}
    var = [p.name for p in params if p.kind is p.VAR_KEYWORD]
    if named != {"hidden_states": "hidden_states", **{n: n for n in passed}} or rest != var:
        return None
    if len(var) != 1 or any(p.kind in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY) for p in params):
        return None
    return sig.replace(parameters=params)


def _layer_and_next_norm(layer, next_norm, hidden_states, normed, mlp_kernels: bool, **attention_kwargs):
    """The pre-norm layer's forward from its input and that input's norm (``normed``) -> (the layer's output,
    ``next_norm`` of it): :data:`_PRENORM`'s statements, with the input norm given and the next one added. With
    ``mlp_kernels`` the second half (the residual add, the norm, the MLP, the closing add) runs as eyas' two
    kernels (:func:`eyas.verifier.decode_mlp.decode_mlp`)."""
    residual = hidden_states
    hidden_states, _ = layer.self_attn(hidden_states=normed, **attention_kwargs)
    if mlp_kernels:
        hidden_states = decode_mlp(layer.post_attention_layernorm, layer.mlp, residual, hidden_states)
    else:
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = layer.post_attention_layernorm(hidden_states)
        hidden_states = layer.mlp(hidden_states)
        hidden_states = residual + hidden_states
    return hidden_states, _norm(next_norm, hidden_states)


class NormAhead:
    """The forwards that :func:`norm_ahead` sets on a model's layers and final norm, and the norm handed from
    one layer to the next (``ahead``: the last layer output and its next norm)."""

    def __init__(self, options: dict, *, mlp_rows: int = 0) -> None:
        self.body = torch.compile(_layer_and_next_norm, dynamic=False, options=dict(options))
        self.norm = torch.compile(_norm, dynamic=False, options=dict(options))
        self.ahead: tuple[torch.Tensor, torch.Tensor] | None = None
        self.handed = 0  # norms read from the layer before (what a test checks)
        self.mlp_rows = mlp_rows
        self._fits: dict[tuple, bool] = {}

    def _mlp_kernels(self, layer, x: torch.Tensor) -> bool:
        """Whether ``layer``'s second half runs as eyas' MLP kernels for an input like ``x``: at most ``mlp_rows``
        rows, where they fit (decided once per layer, rows, dtype and device: the compiled body specialises on it)."""
        rows = x.numel() // x.shape[-1]
        if rows > self.mlp_rows:
            return False
        key = (id(layer), rows, x.dtype, x.device)
        if key not in self._fits:
            self._fits[key] = fits(layer.post_attention_layernorm, layer.mlp, x)
        return self._fits[key]

    def take(self, x: torch.Tensor) -> torch.Tensor | None:
        """The norm computed ahead for ``x``, where ``x`` is the tensor it was computed from."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[0] is x:
            self.handed += 1
            return ahead[1]
        return None

    def layer_forward(self, layer, next_norm, sig: inspect.Signature) -> Callable[..., torch.Tensor]:
        var = next(n for n, p in sig.parameters.items() if p.kind is p.VAR_KEYWORD)

        def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            kw = dict(bound.arguments)
            x = kw.pop("hidden_states")
            kw.update(kw.pop(var))  # what the layer passes on as **kwargs
            normed = self.take(x)
            if normed is None:  # the first layer, or an input that is not the layer before's output
                normed = self.norm(layer.input_layernorm, x)
            out, next_normed = self.body(layer, next_norm, x, normed, self._mlp_kernels(layer, x), **kw)
            self.ahead = (out, next_normed)
            return out

        return forward

    def final_forward(self, norm) -> Callable[[torch.Tensor], torch.Tensor]:
        def forward(x: torch.Tensor) -> torch.Tensor:
            normed = self.take(x)
            return normed if normed is not None else self.norm(norm, x)

        return forward


def _norm(norm, x):
    """``norm``'s own forward of ``x``: the class's, since the final norm's instance forward is
    :meth:`NormAhead.final_forward`'s while the block lasts (a norm has no hooks of eyas')."""
    return type(norm).forward(norm, x)


@contextmanager
def norm_ahead(model, options: dict, *, mlp_rows: int = 0) -> Iterator[list[torch.nn.Module]]:
    """Inside the block, when every decoder layer of ``model`` has the pre-norm pattern's forward
    (:func:`prenorm_signature`), each runs as :func:`_layer_and_next_norm` compiled at fixed shapes with
    inductor's ``options``, and the final norm reads what the last layer computed ahead; in a forward of at most
    ``mlp_rows`` rows, each layer's second half runs as eyas' MLP kernels where they fit
    (:func:`eyas.verifier.decode_mlp.fits`).
    Yields the modules whose forward it set: none where a layer is of another kind or a forward is already set
    on an instance (accelerate's hooks), which keeps the model as it is."""
    base = model.base_model
    layers = list(base.layers)
    final = getattr(base, "norm", None)
    sigs = [prenorm_signature(type(m)) for m in layers]
    if (not layers or final is None or any(s is None for s in sigs)
            or any("forward" in m.__dict__ for m in (*layers, final))):  # fmt: skip
        yield []
        return
    # one NormAhead (its compiled functions) per model and options: dynamo reuses a compiled version only for the
    # same compiled function, so a new one at every block would compile again
    kept = base.__dict__.setdefault("_eyas_norm_ahead", {})
    key = repr((sorted(options.items(), key=lambda kv: kv[0]), mlp_rows))
    if key not in kept:
        kept[key] = NormAhead(options, mlp_rows=mlp_rows)
    ahead = kept[key]
    nexts = [m.input_layernorm for m in layers[1:]] + [final]
    for m, nxt, sig in zip(layers, nexts, sigs):
        m.forward = ahead.layer_forward(m, nxt, sig)
    final.forward = ahead.final_forward(final)
    try:
        yield [*layers, final]
    finally:
        ahead.ahead = None
        for m in (*layers, final):
            m.__dict__.pop("forward", None)
