"""One module per stage, each a typed config plus ``run(config)``: ``inspect``, ``plan``, ``prompts``, ``regenerate``,
``prepare``, ``vocab``, ``extract``, ``train``, ``evaluate`` (``eyas eval``), ``export``. Stages meet only through
files on disk: no stage imports another.

:data:`STAGES` is the one list of them, read by the ``eyas`` command (a subcommand each) and by ``eyas run``
(a TOML section each, in this order). It names modules as strings, so reading it imports no stage.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    """A stage: its command name, its config class as ``"module:Class"`` (the module's ``run(config)`` runs
    it), the one-line help ``eyas --help`` shows, and whether ``eyas run`` takes it as a section."""

    name: str
    config: str
    help: str
    pipeline: bool = False

    @property
    def runner(self) -> str:
        """``"module:run"``: the function that runs a checked config of this stage."""
        return self.config.partition(":")[0] + ":run"


STAGES: tuple[Stage, ...] = (
    Stage("inspect", "eyas.stages.inspect:InspectConfig",
          "describe a verifier checkpoint (dir, GGUF or 'smollm2') without loading it"),
    Stage("plan", "eyas.stages.plan:PlanConfig",
          "from a verifier's config alone: its memory packed and in bf16, GPUs, feature bytes, offline or online, "
          "GPU-hours"),
    Stage("prompts", "eyas.stages.prompts:PromptsConfig",
          "have the verifier write user prompts itself (Magpie), filtered and deduplicated, for regenerate "
          "(resumable)", pipeline=True),
    Stage("regenerate", "eyas.stages.regenerate:RegenerateConfig",
          "answer a dataset's prompts with the verifier itself, for prepare (resumable)", pipeline=True),
    Stage("prepare", "eyas.stages.prepare:PrepareConfig",
          "tokenize conversations with the verifier's chat template and mask the assistant's tokens", pipeline=True),
    Stage("vocab", "eyas.stages.vocab:VocabConfig",
          "choose the draft vocabulary from prepared rows (d2t.npy, t2d.npy)", pipeline=True),
    Stage("extract", "eyas.stages.extract:ExtractConfig",
          "store the verifier's aux and last hidden states for offline training (resumable, torchrun-ready, "
          "--verify DIR checks a result)", pipeline=True),
    Stage("train", "eyas.stages.train:TrainConfig",
          "train the EAGLE-3 draft with training-time test, offline or --online (resumable, torchrun-ready: DDP "
          "or FSDP2)", pipeline=True),
    Stage("export", "eyas.stages.export:ExportConfig",
          "write a draft in the vLLM (speculators) or SGLang (EAGLE) layout, or import an EAGLE/SpecForge/"
          "speculators draft", pipeline=True),
    Stage("eval", "eyas.stages.evaluate:EvalConfig",
          "measure a draft by real speculative decoding: tau, acceptance, lossless, speedup", pipeline=True),
)  # fmt: skip

#: The stages ``eyas run`` chains, in order.
PIPELINE: tuple[Stage, ...] = tuple(s for s in STAGES if s.pipeline)
