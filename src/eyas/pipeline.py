"""Chaining the stages: ``eyas run CONFIG`` (``eyas demo``, SmolLM2 at CPU scale, is :mod:`eyas.demo`).

Stages meet only through files; this module calls them in order and each one
skips itself (or resumes) when its output already matches, so a rerun resumes.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

from eyas.core.config import StageConfig, changed, option, stage_function
from eyas.core.errors import EyasError, terminate_as_interrupt
from eyas.core.validate import check_arguments
from eyas.stages import PIPELINE


def _wiring(stage: str, root: Path, sections: dict[str, Any], *, label: str | None = None) -> dict[str, Any]:
    """Default arguments that connect a stage to the ones before it (each overridable in the config); ``label``
    names the report of one ``[[eval]]`` entry."""
    online = bool(sections.get("train", {}).get("online"))
    return {
        "prompts": {"out": root / "prompts"},
        "regenerate": {"out": root / "regenerated"},
        "prepare": {"out": root / "prepared", **({"data": root / "regenerated"} if "regenerate" in sections else {})},
        "vocab": {"data": root / "prepared", "out": root / "vocab"},
        "extract": {"data": root / "prepared", "out": root / "features"},
        "train": {
            "data": root / ("prepared" if online else "features"),
            "out": root / "draft",
            **({"vocab": root / "vocab"} if "vocab" in sections else {}),
        },  # fmt: skip
        "export": {
            "draft": root / "draft",
            "out": root / f"draft-{sections.get('export', {}).get('format', 'speculators')}",
        },  # fmt: skip
        "eval": {
            "draft": root / "draft",
            "out": root / "eval" / f"{label}.json" if label else root / "eval",
            **({"offline": root / "features"} if "extract" in sections else {}),
        },  # fmt: skip
    }[stage]


@dataclass(kw_only=True, frozen=True)
class RunConfig(StageConfig):
    """Run the pipeline a TOML config describes: every stage it has a section for, in pipeline order.

    Top-level keys: ``out`` (the root every stage writes under, default ``runs/<config name>``) and
    ``verifier`` (given to every stage that takes one). Each ``[stage]`` section (``regenerate``, ``prepare``,
    ``vocab``, ``extract``, ``train``, ``export``, ``eval``) holds that stage's own arguments, by their Python
    names; inputs and outputs are wired under ``out`` (``regenerated/``, ``prepared/``, ``vocab/``,
    ``features/``, ``draft/``, ...) unless the section sets them (with a ``[regenerate]`` section, prepare reads
    the verifier's answers; with a ``[prompts]`` section, the verifier's self-written prompts join regenerate's
    data). ``[[eval]]`` (an array of tables) measures on several prompt sets, one report each under
    ``eval/``. Finished stages skip themselves (an eval whose report matches too), so rerunning the command
    resumes: a run killed by a time limit continues where it stopped."""

    stage: ClassVar[str] = "run"

    config: str = option(positional=True, help="a TOML file (see configs/ for examples).")
    verifier: str | None = option(
        None,
        help="the verifier, instead of the config's top-level verifier (the same "
        "recipe on a local copy of the checkpoint).",
    )
    out: str | None = option(None, help="the root every stage writes under, instead of the config's out.")
    until: str | None = option(
        None,
        help="run the config's stages up to and including this one only (e.g. train: "
        "everything but export and eval), as a time-limited job's first part.",
    )
    overrides: list[str] = option(
        [],
        aliases=("--set",),
        help="SECTION.KEY=VALUE pairs, comma-separated, each "
        "replacing one key of the config (VALUE in TOML: "
        "2, 1.5e-3, true, a string; [[eval]] entries are "
        "eval.N.KEY).",
    )


def run_pipeline(c: RunConfig) -> dict[str, Any]:
    """Run `eyas run` as ``c`` describes (see :class:`RunConfig`)."""
    from eyas.verifier.load import gguf_weights_cache

    path, root, plan = check(c.config, verifier=c.verifier, out=c.out, overrides=c.overrides)
    if c.until is not None:
        names = [n for n, _, _ in plan]
        if c.until not in names:
            raise EyasError(f"--until {c.until}: {path} runs {', '.join(dict.fromkeys(names))}")
        plan = plan[: len(names) - names[::-1].index(c.until)]
    _check_inputs(path, plan, [Path(c.out).resolve() for _, _, c in plan if getattr(c, "out", None)])
    results: dict[str, Any] = {}
    root.mkdir(parents=True, exist_ok=True)
    # a time limit's SIGTERM (`timeout`, a batch scheduler) ends the stage as Ctrl-C does: its journal and
    # checkpoints are closed properly and the rerun resumes; the seconds it ran are logged all the same
    with terminate_as_interrupt():
        # every stage loads the verifier: a GGUF one is dequantized once, its weights kept in the run folder
        with gguf_weights_cache(root / ".verifier-weights"):
            for name, stage, args in plan:
                print(f"\n== eyas {name}: " + ", ".join(f"{k}={v}" for k, v in changed(args).items()))
                t0, finished = time.perf_counter(), False
                try:
                    result = stage(args)
                    finished = True
                finally:
                    _log_stage(root, name, args, time.perf_counter() - t0, finished)
                    _release()
                if name == "eval" and name in results:  # [[eval]]: every entry's report, by its out
                    results[name] = results[name] if isinstance(results[name], list) else [results[name]]
                    results[name].append(result)
                else:
                    results[name] = result
    print(f"\n== {path}: {', '.join(n for n, _, _ in plan)} done under {root}{os.sep}")
    return results


#: one line per stage run by `eyas run` (finished or stopped), for the minutes each stage took over all calls
RUN_LOG = "run_log.jsonl"


def _release() -> None:
    """What a finished stage leaves behind, given back before the next one runs in this process: its GPU memory
    (the next stage sizes its decoding budget by the free memory) and its compiled code (each stage compiles
    its own model; compiled frames of earlier stages would count against dynamo's recompile limit)."""
    import gc
    import sys

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is None:
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if hasattr(torch, "_dynamo"):
        torch._dynamo.reset()


def _log_stage(root: Path, name: str, args: StageConfig, seconds: float, finished: bool) -> None:
    with open(root / RUN_LOG, "a", encoding="utf-8") as f:
        f.write(
            json.dumps(
                {
                    "stage": name,
                    "out": str(getattr(args, "out", None)),
                    "seconds": round(seconds, 2),
                    "finished": finished,
                    "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                }
            )
            + "\n"
        )


run = stage_function(RunConfig, run_pipeline, "run")


def _label(prompts: Any, i: int) -> str:
    """A report name for an ``[[eval]]`` entry: its prompt set's name (``mt-bench``), file stem, or position."""
    if isinstance(prompts, str):
        name = Path(prompts).name
        for suffix in (".gz", ".jsonl", ".json", ".parquet"):
            name = name.removesuffix(suffix)
        return name or f"eval{i}"
    return f"eval{i}"


def _apply_overrides(path: Path, cfg: dict[str, Any], overrides: list[str]) -> None:
    """``SECTION.KEY=VALUE`` (``eval.N.KEY`` for an ``[[eval]]`` entry) into ``cfg``, VALUE read as TOML (a bare
    word that is not TOML is taken as a string: a path)."""
    for item in overrides:
        where, eq, raw = item.partition("=")
        keys = where.strip().split(".")
        if not eq or len(keys) < 2 or not all(keys):
            raise EyasError(f"--set {item!r}: give SECTION.KEY=VALUE (eval.N.KEY for an [[eval]] entry)")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        node: Any = cfg.setdefault(keys[0], {})
        for k in keys[1:-1]:
            if isinstance(node, list) and k.isdigit() and int(k) < len(node):
                node = node[int(k)]
            elif isinstance(node, dict):
                node = node.setdefault(k, {})
            else:
                raise EyasError(f"--set {item!r}: {path} has no {'.'.join(keys[:-1])}")
        if not isinstance(node, dict):
            raise EyasError(f"--set {item!r}: {'.'.join(keys[:-1])} of {path} is a list; name an entry (eval.0.KEY)")
        node[keys[-1]] = value


def check(config: str, *, verifier: str | None = None, out: str | None = None, overrides: list[str] = ()
          ) -> tuple[Path, Path, list[tuple[str, Callable[[Any], Any], StageConfig]]]:  # fmt: skip
    """Read and check a config without running anything: ``(path, out root, [(stage, run, stage config)])``
    in pipeline order. Every section is made into its stage's config as the command line's flags are
    (:func:`eyas.core.validate.check_arguments`: names, types, ranges, places), so a bad key or value is an error
    naming it before the first stage runs."""
    path = Path(config)
    try:
        cfg = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise EyasError(f"config not found: {path}") from None
    except IsADirectoryError:
        raise EyasError(f"{path} is a folder: give `eyas run` a TOML file (see configs/ for examples)") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise EyasError(f"{path} is not valid TOML: {e}") from e
    _apply_overrides(path, cfg, list(overrides))
    cfg.update({k: v for k, v in (("verifier", verifier), ("out", out)) if v is not None})
    names = [s.name for s in PIPELINE]
    table = lambda v: isinstance(v, dict) or (isinstance(v, list) and v and all(isinstance(x, dict) for x in v))  # noqa: E731
    unknown = [k for k, v in cfg.items() if table(v) and k not in names]
    unknown += [k for k, v in cfg.items() if not table(v) and k not in ("out", "verifier")]
    unknown += [k for k, v in cfg.items() if isinstance(v, list) and table(v) and k != "eval"]
    if unknown:
        raise EyasError(f"{path}: unknown key(s) {unknown}; top level takes out, verifier and the sections {names}")
    bad = [k for k in ("out", "verifier") if k in cfg and not isinstance(cfg[k], str)]
    if bad:
        raise EyasError(f"{path}: {bad[0]} must be a string (a path or a name), got {cfg[bad[0]]!r}")
    sections = {k: v for k, v in cfg.items() if table(v)}
    if not sections:
        raise EyasError(f"{path} has no stage section; add one or more of {names}")
    root = Path(cfg.get("out") or Path("runs") / path.stem)
    plan = []
    for s in PIPELINE:  # check every section before the first stage runs
        name = s.name
        if name not in sections:
            continue
        mod, _, cls = s.config.partition(":")
        module = importlib.import_module(mod)
        stage = getattr(module, cls)
        params = {f.name for f in dataclasses.fields(stage)}
        entries = sections[name] if isinstance(sections[name], list) else [sections[name]]
        for i, entry in enumerate(entries):
            # [[eval]]: one report per entry, named by its prompts
            label = _label(entry.get("prompts"), i) if isinstance(sections[name], list) else None
            args: dict[str, Any] = {k: str(v) for k, v in _wiring(name, root, sections, label=label).items()
                                    if k in params}  # fmt: skip
            if "verifier" in params and "verifier" in cfg:
                args["verifier"] = cfg["verifier"]
            args.update(entry)
            if name == "regenerate" and "prompts" in sections:  # the self-written prompts join the data mix
                mix = [x.strip() for x in str(args.get("data") or "").split(",") if x.strip()]
                args["data"] = ",".join(mix + [str(root / "prompts")] if str(root / "prompts") not in mix else mix)
            where = f"[{name}]" if len(entries) == 1 else f"[[{name}]] {i}"
            checked = check_arguments(stage, args, label=lambda k, s=where: f"{s} {k}", where=str(path))
            plan.append((name, module.run, checked))
    # what each section writes: a stage's folder; eval's report, whose folder it does not own
    outs = [(Path(c.out).resolve(), n) for n, _, c in plan if getattr(c, "out", None)]
    for i, (out, n) in enumerate(outs):
        other = next((m for o, m in outs[:i] if o == out), None)
        if other:
            raise EyasError(f"{path}: [{other}] and [{n}] both write {out}; give each stage its own out")
        inside = next(((o, m) for o, m in outs if m != n and o in out.parents), None)
        if inside:
            raise EyasError(f"{path}: [{n}] out {out} is inside {inside[0]}, the folder [{inside[1]}] writes; give "
                            f"[{n}] an out of its own, outside it")  # fmt: skip
    return path, root, plan


#: The arguments that name something a stage reads, and the names that are not paths (named sets, a random draft).
_INPUTS = ("data", "prompts", "vocab", "draft", "offline", "chat_template")


def _check_inputs(path: Path, plan: list, outs: list[Path]) -> None:
    """Every input a section names exists, or is the output of a section: checked before the first stage, so a
    missing ``[eval] prompts`` file is not found only after hours of training."""
    for name, _, c in plan:
        for key in _INPUTS:
            value = getattr(c, key, None)
            if not isinstance(value, str) or not value:
                continue
            # a data mix, "sharegpt,runs/x/prompts" (eyas.data.datasets.resolve_source): each source in turn
            mix = key == "data" and "," in value and not Path(value).exists()
            for source in [x.strip() for x in value.split(",") if x.strip()] if mix else [value]:
                _check_input(path, name, key, source, outs)


def _check_input(path: Path, name: str, key: str, value: str, outs: list[Path]) -> None:
    """One input of ``[name] key``: a named set, a path that exists, or one a section writes."""
    from eyas.data.named_sets import NAMED_SETS

    if value in NAMED_SETS or (key == "draft" and value == "random"):
        return
    if key == "chat_template" and not value.endswith((".jinja", ".j2", ".gguf")) and value.count("/") == 1:
        return  # a hub id whose template to use
    p = Path(value).expanduser()
    made = any(p.resolve() == o or o in p.resolve().parents for o in outs)
    if not made and not p.exists():
        raise EyasError(f"{path}: [{name}] {key} {value} not found (and no section writes it): fix the path "
                        "before any stage runs")  # fmt: skip
