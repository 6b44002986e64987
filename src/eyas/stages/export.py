"""``eyas export``: ship a draft in the layout a serving engine loads, or bring a foreign draft in.

One set of weights, two layouts:

- ``speculators`` (native: what ``eyas train`` writes, see :mod:`eyas.draft.checkpoint`). vLLM serves it as is
  (``vllm/transformers_utils/configs/speculators/{base,algos}.py``); speculators 0.9 loads and fine-tunes it.
- ``eagle``: the EAGLE-3 layout SGLang serves, also written by SpecForge and the EAGLE repo (see
  :mod:`eyas.draft.eagle`): a plain Llama ``config.json`` with ``architectures: ["LlamaForCausalLMEagle3"]``,
  ``draft_vocab_size`` and ``eagle_config``; weights under ``midlayer.*`` instead of ``layers.0.*``.

Layout variants (:class:`eyas.draft.model.DraftConfig`) need engine releases that run them as trained; an older
release may refuse the checkpoint or, worse, load it and run other numerics. :data:`MIN_RELEASE` says which
release, the export's manifest records it (``outputs.requires``), and a variant no release of the target
engine runs is refused.

Aux layer ids. eyas, vLLM and speculators write id ``i`` for the hidden state *entering* verifier layer ``i``
(vLLM captures ``hidden_states + residual`` before layer ``i``: ``vllm/model_executor/models/llama.py``).
SGLang captures ``id + 1`` for every id in ``eagle_config.eagle_aux_hidden_state_layer_ids`` ("we plus 1
here because in sglang, for the ith layer, it takes the output of the (i-1)th layer as aux hidden state",
``sglang/srt/models/llama.py`` ``set_eagle3_layers_to_capture``), so the eagle layout stores ``i - 1`` and an
import adds 1 back. SpecForge reads the same key with the same meaning.

The other direction, ``--from eagle|speculators``, reads an EAGLE / SpecForge / SGLang checkpoint or one
saved by speculators itself, checks it, and writes it in the requested layout, so drafts users already
have can be evaluated or fine-tuned with eyas.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch

from eyas.draft.checkpoint import (
    CONFIG,
    WEIGHTS,
    Draft,
    check_tensors,
    draft_files,
    read_native,
    save_tensors,
    write_checkpoint,
)
from eyas.core import fields
from eyas.core.config import StageConfig, option, recorded_settings, stage_function
from eyas.draft.eagle import check_eagle_tensors, eagle_config_dict, eagle_tensors, read_eagle
from eyas.core.errors import EyasError
from eyas.core.validate import AT_LEAST_1
from eyas.core.files import human_bytes, read_json, sha256_file
from eyas.core.manifest import MANIFEST, StageOutput
from eyas.draft.model import DraftConfig
from eyas.verifier.info import check_aux_layer_ids

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEFAULT_SPECULATIVE_TOKENS = 3  # what speculators' Eagle3Converter writes for an EAGLE import

#: The first release of each engine that serves a layout variant with the numerics it was trained with (None:
#: no release does), read in the published wheels: vLLM's speculators path (transformers_utils/configs/
#: speculators/algos.py, model_executor/models/{llama,qwen3}_eagle3.py) and SGLang's
#: srt/models/llama_eagle3.py. A variant missing from an engine's table runs on every release that serves
#: EAGLE-3 there. Older releases are not all loud about it: vLLM 0.18 builds norm_before_fc's norm and
#: vLLM 0.22-0.24 norm_output's and fc_norm's, but their speculators parser drops the flags (vLLM #38111,
#: #46488); SGLang before 0.5.17 skips input_norm.weight, and before 0.5.12 fc_norm.*, without a word.
MIN_RELEASE: dict[str, dict[str, str | None]] = {
    "vLLM": {
        "norm_before_fc": "0.19.0",  # model code 0.18.0 (vLLM #36545), read from speculators configs 0.19.0
        "fc_norm": "0.25.0",  # model code 0.22.0 (vLLM #42764), read from speculators configs 0.25.0
        "norm_output": "0.25.0",
        "draft_arch=qwen3": "0.24.0",  # Eagle3Qwen3ForCausalLM, chosen by transformer_layer_config.model_type
        "num_hidden_layers>1": "0.11.1",  # vLLM #26164; 0.11.0 builds one layer
    },
    "SGLang": {
        "norm_before_residual": None,  # its first layer always takes the residual before hidden_norm
        "draft_arch=qwen3": None,  # LlamaForCausalLMEagle3 only: q_norm/k_norm would be skipped
        "norm_before_fc": "0.5.17",
        "fc_norm": "0.5.12",
        "norm_output": "0.5.12",
        "num_hidden_layers>1": "0.5.12",  # 0.5.11 and older raise "EAGLE3 currently only supports 1 layer"
    },
}


@dataclass(kw_only=True, frozen=True)
class ExportConfig(StageConfig):
    """Write a draft in the layout vLLM (speculators) or SGLang (EAGLE) loads as is, or import one.

    Every key and shape is checked against the config, the vocab maps against each other, and (with
    --verifier) the draft against the verifier's vocab, hidden size and layer count. Writes are atomic; a
    rerun with the same inputs is skipped; manifest.json records the conversion."""

    stage: ClassVar[str] = "export"

    draft: str = option(
        recorded=False,
        positional=True,
        aliases=(),
        help="the draft checkpoint directory to read (eyas/speculators layout unless --from says otherwise).",
    )
    out: str = fields.out()
    format: Literal["speculators", "eagle"] = option(
        "speculators", help="the layout to write: 'speculators' (vLLM) or 'eagle' (SGLang, SpecForge, EAGLE)."
    )
    from_format: Literal["speculators", "eagle"] | None = option(
        None,
        aliases=("--from",),
        help="read the draft as an 'eagle' checkpoint (EAGLE, SpecForge, SGLang: "
        "midlayer.* or layers.0.*, aux ids from eagle_config plus one) or a 'speculators' one (as speculators saves "
        "it); default: the native layout, which is speculators'.",
    )
    verifier: str | None = fields.verifier(
        "; the draft is checked against it, and it gives the default aux layers of an EAGLE draft whose config "
        "names none, and the embedding for --include-embeddings.",
        default=None,
    )
    verifier_name: str | None = option(
        None,
        help="the verifier's hub id to record in "
        "speculators_config.verifier.name_or_path (`vllm serve DRAFT` needs "
        "a hub id, not a local path); default: what the draft records, else "
        "--verifier.",
    )
    speculative_tokens: int | None = option(
        None,
        range=AT_LEAST_1,
        help="tokens to draft per step, recorded for vLLM; default: what the draft records, else 3.",
    )
    include_embeddings: bool = option(
        False,
        help="also write embed_tokens.weight (vLLM and SGLang use the "
        "verifier's; speculators 0.9 needs it to fine-tune reliably, see "
        "docs/FORMATS.md).",
    )
    dtype: Literal["bfloat16", "float16", "float32"] = option(
        "bfloat16", help="the dtype of the floating-point weights written."
    )


def run(c: ExportConfig) -> dict[str, Any]:
    """Run `eyas export` as ``c`` describes (see :class:`ExportConfig`)."""
    src, dst = Path(c.draft), Path(c.out)
    if not src.is_dir():
        raise EyasError(f"draft {src} is not a directory")
    if dst.resolve() == src.resolve():
        raise EyasError(f"--out {dst} is the draft itself; write the export to another directory")
    if c.format not in ("speculators", "eagle"):
        raise EyasError(f"unknown --format {c.format!r}: use 'speculators' (vLLM) or 'eagle' (SGLang)")
    if c.from_format not in (None, "speculators", "eagle"):
        raise EyasError(f"unknown --from {c.from_format!r}: use 'eagle' or 'speculators'")
    if c.dtype not in DTYPES:
        raise EyasError(f"unknown --dtype {c.dtype!r}: use one of {sorted(DTYPES)}")
    from eyas.verifier.info import fingerprint, resolve

    info = resolve(c.verifier) if c.verifier else None
    sources = draft_files(src, c.from_format)
    inputs = {"draft": {p.name: sha256_file(p) for p in sources}, "verifier": fingerprint(info) if info else None}
    settings = recorded_settings(c, from_format=c.from_format or "native")
    with StageOutput(dst, stage="export") as output:
        manifest = output.up_to_date(inputs=inputs, settings=settings, files=(CONFIG,))
        if manifest is not None:
            print(f"eyas export: {dst} is up to date (same draft and settings); nothing to do")
            return manifest
        d = read_eagle(src, verifier=info) if c.from_format == "eagle" else read_native(src)
        where = str(src / CONFIG)
        if info is not None:
            check_verifier(d.cfg, info, where=where)
        else:
            _check_recorded_verifier(d, src, where=where)
        _normalise_vocab_maps(d, where=str(sources[0]))
        tensors = _embeddings(d, info, include=c.include_embeddings)
        torch_dtype = DTYPES[c.dtype]
        if c.format == "eagle":
            _check_sglang_servable(d.cfg, info, where=where)
        else:
            name = c.verifier_name or d.verifier_name or (info.path if info else None)
            if not name:
                raise EyasError(f"{where} does not name its verifier; pass --verifier PATH or --verifier-name ORG/NAME")
            arch = d.verifier_architectures or (_verifier_architectures(info) if info else [])
            ttt_steps = int(c.speculative_tokens or d.ttt_steps or DEFAULT_SPECULATIVE_TOKENS)
        output.unfinish()  # checks passed: a re-export interrupted from here must not look finished
        (dst / CONFIG).unlink(missing_ok=True)
        if c.format == "eagle":
            write_checkpoint(dst, eagle_tensors(d.cfg, tensors, dtype=torch_dtype),
                             eagle_config_dict(d.cfg, dtype=c.dtype))  # fmt: skip
        else:
            save_tensors(dst, d.cfg, tensors, verifier_name_or_path=str(name), verifier_architectures=arch,
                         ttt_steps=ttt_steps, dtype=torch_dtype,
                         include_embeddings=c.include_embeddings)  # fmt: skip
        outputs = _describe(dst, d.cfg, format=c.format)
        manifest = output.finish(outputs=outputs, source=str(src.resolve()))
    _print_summary(dst, outputs, verifier=c.verifier_name or d.verifier_name or (info.path if info else "VERIFIER"))
    recorded = manifest["outputs"].get("verifier_name_or_path")
    if recorded and Path(recorded).exists():
        print(f"  note: the recorded verifier {recorded} is a local path; `vllm serve {dst}` needs a hub id "
              "(--verifier-name ORG/NAME), the command above works as is")  # fmt: skip
    return manifest


export = stage_function(ExportConfig, run, "export")

# --------------------------------------------------------------------------- checks


def check_verifier(cfg: DraftConfig, info: Any, *, where: str) -> None:
    """A draft made for another verifier fails here, naming the key that disagrees."""
    if cfg.vocab_size != info.vocab_size:
        raise EyasError(f"{where}: vocab_size {cfg.vocab_size} (the rows of t2d and embed_tokens) does not match "
                        f"the verifier {info.path}, whose vocab is {info.vocab_size}: this draft was made for "
                        "another verifier")  # fmt: skip
    target_hidden = cfg.target_hidden_size or cfg.hidden_size
    if target_hidden != info.hidden_size:
        raise EyasError(f"{where}: fc.weight reads aux states of hidden size {target_hidden} (hidden_size/"
                        f"target_hidden_size) but the verifier {info.path} has hidden size {info.hidden_size}: "
                        "this draft was made for another verifier")  # fmt: skip
    check_aux_layer_ids(
        cfg.aux_layer_ids,
        info.num_hidden_layers,
        final=True,
        what=f"{where}: eagle_aux_hidden_state_layer_ids (for the verifier {info.path})",
    )


def _check_recorded_verifier(d: Draft, src: Path, *, where: str) -> None:
    """Without --verifier, the aux layer ids are checked against the verifier the draft records: the layer count
    its training manifest holds, else the checkpoint its config names, where that is a folder here."""
    layers, of = None, None
    try:
        m = json.loads((src / MANIFEST).read_text())
        layers = int(m["inputs"]["verifier"]["num_hidden_layers"]) if m.get("stage") == "train" else None
        of = f"as {src / MANIFEST} records"
    except (OSError, ValueError, TypeError, KeyError, AttributeError):  # no manifest, or not a training one
        pass
    if layers is None and d.verifier_name and Path(d.verifier_name).is_dir():
        from eyas.verifier.info import resolve

        with contextlib.suppress(EyasError):
            layers, of = resolve(d.verifier_name).num_hidden_layers, f"{d.verifier_name}"
    if layers is None:
        return
    check_aux_layer_ids(d.cfg.aux_layer_ids, layers, final=True,
                        what=f"{where}: eagle_aux_hidden_state_layer_ids (for its verifier, {of})")  # fmt: skip


def _normalise_vocab_maps(d: Draft, *, where: str) -> None:
    """``d2t`` as int64 offsets and ``t2d`` as bool, and the two consistent with each other.

    vLLM and SGLang read only ``d2t`` (target id = draft id + d2t) and speculators only ``t2d`` (the verifier
    rows its targets use, in ascending order), so a pair that disagrees would train and serve different
    tokens: the draft ids must map to strictly ascending target ids, exactly the ids ``t2d`` marks.
    """
    if "d2t" not in d.tensors:
        return
    cfg = d.cfg
    d2t, t2d = d.tensors["d2t"], d.tensors["t2d"]
    if d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise EyasError(f"{where}: d2t has dtype {d2t.dtype}; it must hold integer offsets")
    if t2d.is_floating_point() or not bool(((t2d == 0) | (t2d == 1)).all()):
        raise EyasError(f"{where}: t2d must be a boolean mask over the verifier vocab")
    d2t, t2d = d2t.to(torch.long), t2d.to(torch.bool)
    target = torch.arange(cfg.draft_vocab_size) + d2t
    if int(target.min()) < 0 or int(target.max()) >= cfg.vocab_size:
        raise EyasError(f"{where}: d2t maps draft ids outside the verifier vocab of {cfg.vocab_size}")
    if bool((target[1:] <= target[:-1]).any()):
        raise EyasError(f"{where}: d2t does not map draft ids to strictly ascending target ids")
    if int(t2d.sum()) != cfg.draft_vocab_size or not bool(t2d[target].all()):
        raise EyasError(f"{where}: d2t and t2d disagree (t2d marks {int(t2d.sum())} ids, d2t maps "
                        f"{cfg.draft_vocab_size} draft ids to other ones)")  # fmt: skip
    d.tensors["d2t"], d.tensors["t2d"] = d2t, t2d


def _embeddings(d: Draft, info: Any, *, include: bool) -> dict[str, torch.Tensor]:
    """The tensors to write: embed_tokens only when asked for, from the draft or else the verifier."""
    tensors = {k: v for k, v in d.tensors.items() if k != "embed_tokens.weight"}
    if not include:
        return tensors
    if "embed_tokens.weight" in d.tensors:
        tensors["embed_tokens.weight"] = d.tensors["embed_tokens.weight"]
    elif info is not None:
        from eyas.verifier.load import load_head_tensors

        tensors["embed_tokens.weight"] = load_head_tensors(info).embed
    else:
        raise EyasError("--include-embeddings: the draft has no embed_tokens.weight; pass --verifier to copy the "
                        "verifier's")  # fmt: skip
    return tensors


def variants(cfg: DraftConfig) -> list[str]:
    """The layout variants a draft uses, as :data:`MIN_RELEASE` names them (empty: plain EAGLE-3)."""
    names = [k for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output") if getattr(cfg, k)]
    if cfg.draft_arch == "qwen3":
        names.append("draft_arch=qwen3")
    return names + (["num_hidden_layers>1"] if cfg.num_hidden_layers > 1 else [])


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def engine_requirement(cfg: DraftConfig, engine: str, *, where: str) -> dict[str, Any]:
    """The oldest ``engine`` release that serves this draft as trained (``min_version``; None: any release that
    serves EAGLE-3) and the first release of each variant that needs one; a variant no release runs is refused,
    naming it."""
    table = MIN_RELEASE[engine]
    used = [v for v in variants(cfg) if v in table]
    never = [v for v in used if table[v] is None]
    if never:
        why = {"norm_before_residual": "it always takes the residual from the un-normed hidden state",
               "draft_arch=qwen3": "its EAGLE-3 draft is a Llama layer, which would skip q_norm/k_norm"}  # fmt: skip
        said = ", ".join(v if "=" in v else f"{v}=true" for v in never)  # as config.json spells it
        raise EyasError(f"{where}: {said}, but no {engine} release runs this draft as trained "
                        f"({'; '.join(why[v] for v in never)}: sglang/srt/models/llama_eagle3.py), so it would "
                        f"serve it with other numerics. Serve it with vLLM (--format speculators), or train "
                        f"without {', '.join(never)} for {engine}")  # fmt: skip
    need = {v: table[v] for v in used}
    return {"engine": engine, "min_version": max(need.values(), key=_version, default=None), "variants": need}


def _check_sglang_servable(cfg: DraftConfig, info: Any, *, where: str) -> None:
    """Refuse what no SGLang release would run with the numerics the draft was trained with."""
    engine_requirement(cfg, "SGLang", where=where)
    if info is not None and max(cfg.aux_layer_ids) >= info.num_hidden_layers:
        # sglang/srt/models/llama.py: captures happen at the start of layers 0..L-1 (:485-494), so id + 1 = L
        # never fires and fc would get two aux states instead of three.
        raise EyasError(f"{where}: aux layer {max(cfg.aux_layer_ids)} is the verifier's final hidden state, which "
                        "SGLang never captures (it captures at the start of layers 0..L-1)")  # fmt: skip


# --------------------------------------------------------------------------- writing


def _verifier_architectures(info: Any) -> list[str]:
    """The verifier's ``architectures`` (speculators' VerifierConfig records them), from its config.json or,
    for a GGUF verifier, transformers' causal-LM class for its text model type."""
    cfg_path = info.checkpoint_dir / CONFIG
    if cfg_path.is_file():
        arch = read_json(cfg_path, what="verifier config").get("architectures")
        if arch:
            return list(arch)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(info.text_model_type)
    return [name] if name else []


def _without_default_width(cfg: DraftConfig) -> DraftConfig:
    """Both layouts omit a target hidden size equal to the draft's, so compare configs without it."""
    width = None if cfg.target_hidden_size == cfg.hidden_size else cfg.target_hidden_size
    return replace(cfg, target_hidden_size=width)


def _describe(dst: Path, cfg: DraftConfig, *, format: str) -> dict[str, Any]:
    """What was written, after reading it back: the written files must parse to the same draft."""
    from eyas.verifier.locate import read_safetensors_header

    header = read_safetensors_header(dst / WEIGHTS)  # names and shapes only: the data was just written
    if format == "eagle":
        back = Draft(read_eagle(dst, tensors=False).cfg, check_eagle_tensors(header, cfg, where=str(dst / WEIGHTS)))
    else:
        back = read_native(dst, tensors=False)
        check_tensors(header, cfg, where=str(dst / WEIGHTS))
    if _without_default_width(back.cfg) != _without_default_width(cfg):
        raise EyasError(f"{dst}: the written checkpoint reads back as {back.cfg}, not {cfg}; please report this")
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in (dst / WEIGHTS, dst / CONFIG)}
    return {
        "format": format,
        "serve_with": "vLLM" if format == "speculators" else "SGLang",
        "files": files,
        "aux_layer_ids": cfg.aux_layer_ids,  # id i = the state entering verifier layer i (vLLM, speculators)
        "aux_layer_ids_sglang": [i - 1 for i in cfg.aux_layer_ids],
        "draft_vocab_size": cfg.draft_vocab_size,
        "vocab_size": cfg.vocab_size,
        "speculative_tokens": back.ttt_steps,
        "verifier_name_or_path": back.verifier_name,
        "layout": {
            "norm_before_residual": cfg.norm_before_residual,
            "norm_before_fc": cfg.norm_before_fc,
            "fc_norm": cfg.fc_norm,
            "norm_output": cfg.norm_output,
            "draft_arch": cfg.draft_arch,
            "num_hidden_layers": cfg.num_hidden_layers,
        },  # fmt: skip
        # the oldest engine release that serves the draft as trained (an older one may run other numerics)
        "requires": engine_requirement(cfg, "vLLM" if format == "speculators" else "SGLang", where=str(dst)),
    }


def _print_summary(dst: Path, outputs: dict[str, Any], *, verifier: str) -> None:
    size = human_bytes(sum(f["bytes"] for f in outputs["files"].values()))
    aux = outputs["aux_layer_ids"]
    if outputs["format"] == "eagle":
        print(f"eyas export: {dst}: EAGLE-3 layout for SGLang ({size}); aux layers {aux} written as SGLang ids "
              f"{outputs['aux_layer_ids_sglang']}; draft vocab {outputs['draft_vocab_size']} of "
              f"{outputs['vocab_size']}")  # fmt: skip
        print(f"  serve: python -m sglang.launch_server --model-path {verifier} --speculative-algorithm EAGLE3 "
              f"--speculative-draft-model-path {dst}")  # fmt: skip
    else:
        print(f"eyas export: {dst}: speculators layout for vLLM ({size}); aux layers {aux}; draft vocab "
              f"{outputs['draft_vocab_size']} of {outputs['vocab_size']}")  # fmt: skip
        spec = {"model": str(dst), "method": "eagle3", "num_speculative_tokens": outputs["speculative_tokens"]}
        print(f"  serve: vllm serve {verifier} --speculative-config '{json.dumps(spec)}'")
    req = outputs["requires"]
    if req["min_version"]:
        since = ", ".join(f"{k} from {v}" for k, v in req["variants"].items())
        print(f"  needs {req['engine']} >= {req['min_version']} ({since}): an older release may load it and run "
              "other numerics (recorded in manifest.json)")  # fmt: skip
