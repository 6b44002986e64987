"""``eyas inspect``: describe a verifier from ``config.json`` and safetensors headers (or GGUF metadata), without
loading it: what :func:`eyas.verifier.info.resolve` learns, as a table or one JSON object."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from eyas.core import fields
from eyas.core.config import StageConfig, option, stage_function
from eyas.verifier.info import resolve


@dataclass(kw_only=True, frozen=True)
class InspectConfig(StageConfig):
    """Describe a verifier: its text model, where the embedding, head and final norm live, and whether eyas can run it.

    Reads ``config.json`` and safetensors headers only (or GGUF metadata); never imports checkpoint code."""

    stage: ClassVar[str] = "inspect"

    verifier: str = fields.verifier("; positional, or --verifier as in every other stage.", positional=True, aliases=())
    json_out: bool = option(False, help="print one JSON object instead of a table.")


def run(c: InspectConfig) -> dict[str, Any]:
    """Run `eyas inspect` as ``c`` describes (see :class:`InspectConfig`)."""
    info = resolve(c.verifier)
    summary = info.summary()
    if c.json_out:
        print(json.dumps(summary, indent=2))
        return summary
    rows = [
        ("path", info.path),
        (
            "model_type",
            info.model_type + (f"  (text model under '{info.text_config_key}')" if info.text_config_key else ""),
        ),
        ("text model_type", info.text_model_type),
        ("hidden_size", info.hidden_size),
        ("num_hidden_layers", info.num_hidden_layers),
        ("vocab_size", info.vocab_size),
    ]
    for name, ref in (("embedding", info.embed), ("output head", info.lm_head), ("final norm", info.norm)):
        if ref is None:
            rows.append((name, "tied to the embedding"))
        else:
            rows.append((name, f"{ref.key}  [{', '.join(map(str, ref.shape))}] {ref.dtype}  in {ref.file}"))
    rows += [
        ("quantization", info.quantization),
        ("aux layer ids", info.aux_layer_ids),
        ("remote code", "present, never imported" if info.has_remote_code else "none"),
        ("runnable", "yes" if info.runnable else "no: " + "; ".join(info.reasons)),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return summary


inspect = stage_function(InspectConfig, run, "inspect")
