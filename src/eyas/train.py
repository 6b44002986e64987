"""``eyas train``: train the EAGLE-3 draft with training-time test, offline (feature shards) or online (verifier
in the loop), resumable, under ``torchrun`` with DDP or FSDP2.

What it optimises is what inference runs: :meth:`eyas.model.Eagle3Draft.ttt`
calls the same ``step`` function ``eyas eval`` drafts with, and the loss
(:mod:`eyas.loss`) scores step ``k`` at index ``t`` against the verifier's
distribution at ``t+1+k`` over the draft vocab.

Data (:mod:`eyas.batches`). Rows are packed into sequences of at most ``--max-seq-len`` tokens with document
ids (attention never crosses rows), ``--batch-tokens`` per micro-batch, ``--grad-accum`` micro-batches per rank
and optimizer step; the loss is normalised by the loss-masked positions of the whole step over all ranks.

Safety. Checkpoints (``checkpoints/step-N``: a loadable speculators checkpoint
plus ``trainer_state.pt`` with the fp32 weights, optimizer state, RNG and data
position) are written atomically every ``--save-every`` steps and at each
epoch's end; a rerun of the same command resumes from the newest, and on CPU
the result is bit-identical to an uninterrupted run. A non-finite loss or
gradient stops the run before anything is saved from it.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal

import numpy as np
import torch
from torch import nn

from eyas.batches import FeatureRows, PreparedRows, Step, StepData, load_vocab, plan_epoch, row_counts
from eyas.errors import EyasError
from eyas.loss import CHUNK_TOKENS, STAT_COLUMNS, TargetHead, Targets, step_masks, summarize, ttt_loss
from eyas.precision import FusedAdamW, begin_deferred_wgrad, refresh_working_weights, use_working_weights

STAGE = "train"
CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.pt"
STATE_FORMAT = "eyas-train-state/1"
METRICS = "metrics.jsonl"
PLOT = "training_curves.png"


# --------------------------------------------------------------------------- the objective


class TTTObjective(nn.Module):
    """The draft plus its loss in one module, so DDP and FSDP2 see every use of ``lm_head`` inside ``forward``."""

    def __init__(self, draft, *, steps: int, step_weights: list[float], drop_out_of_vocab: bool,
                 compute_dtype: torch.dtype, compiled: bool, chunk_tokens: int = CHUNK_TOKENS,
                 deferred_wgrad: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.draft = draft
        self.steps, self.drop, self.compute_dtype = steps, drop_out_of_vocab, compute_dtype
        self.compiled, self.chunk_tokens, self.deferred_wgrad = compiled, chunk_tokens, deferred_wgrad
        self.register_buffer("step_weights", torch.tensor(step_weights, dtype=torch.float64), persistent=False)

    def forward(self, input_ids, doc_ids, position_ids, aux, loss_mask, target_logits, target_argmax, in_vocab,
                denom, inputs_embeds=None, scored_rows=None):  # fmt: skip
        refresh_working_weights(self.draft)  # the optimizer moved the masters; compiled regions cannot check
        if self.deferred_wgrad and torch.is_grad_enabled():  # each layer weight is used once per TTT step
            begin_deferred_wgrad(self.draft, uses=self.steps, lead_shape=tuple(input_ids.shape))
        normed = self.draft.ttt(input_ids, aux, steps=self.steps, doc_ids=doc_ids, position_ids=position_ids,
                                inputs_embeds=inputs_embeds)  # fmt: skip
        valid = step_masks(loss_mask, doc_ids, self.steps).flatten(1)  # [S, B*T]
        scale = (self.step_weights / denom.clamp(min=1)).float()  # [S]
        targets = Targets(target_logits, target_argmax, in_vocab)
        return ttt_loss([h.flatten(0, 1) for h in normed], self.draft.lm_head.weight, targets, valid, scale,
                        drop_out_of_vocab=self.drop, compute_dtype=self.compute_dtype,
                        chunk_tokens=self.chunk_tokens, compiled=self.compiled, rows=scored_rows)  # fmt: skip


def compile_draft(draft) -> None:
    """Compile the draft for training in place (state-dict keys unchanged): each TTT step's layer, attention
    included, and final norm as one region (:meth:`eyas.model.Eagle3Draft.ttt_block`). Each region costs the
    host a guard check and an autograd wrapper per call, forward and backward, and the step is host-bound at
    2048 tokens: one region per TTT step (the fifth session had four: the layer's halves around an eager
    attention call that ran its own compiled flex kernel, and the norm)."""
    draft.ttt_block = torch.compile(draft.ttt_block, dynamic=False)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)


def lr_factor(step: int, *, total: int, warmup: int, schedule: str) -> float:
    """Linear warmup to 1 over ``warmup`` steps, then ``cosine`` / ``linear`` decay to 0 at ``total``, or ``constant``."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1 + math.cos(math.pi * frac)) if schedule == "cosine" else 1.0 - frac


def build_optimizers(model: nn.Module, *, name: str, lr: float, weight_decay: float, fused: bool) -> list:
    """AdamW over every trainable parameter (no decay on norms), or speculators' default: Muon on the
    2-D weights of the layer and fc, AdamW on the rest (norms, lm_head)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in params if p.ndim >= 2]
    no_decay = [p for n, p in params if p.ndim < 2]
    adamw = dict(lr=lr, betas=(0.9, 0.95), eps=1e-8)
    # fused: torch's fused AdamW on CPU, one Triton kernel per weight on CUDA that also writes its working copy
    AdamW = FusedAdamW if fused else torch.optim.AdamW
    if name == "adamw":
        return [AdamW([{"params": decay, "weight_decay": weight_decay},
                       {"params": no_decay, "weight_decay": 0.0}], **adamw)]  # fmt: skip
    if not hasattr(torch.optim, "Muon"):
        raise EyasError(f"--optimizer muon needs torch.optim.Muon (torch >= 2.9); this is torch {torch.__version__}")
    muon = [p for n, p in params if p.ndim == 2 and "lm_head" not in n]
    rest = [p for n, p in params if not (p.ndim == 2 and "lm_head" not in n)]
    # speculators 0.9's Muon defaults (train/config/schema.py): momentum 0.95, decay 0.1, lr adjusted to AdamW's RMS.
    return [torch.optim.Muon(muon, lr=lr, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw"),
            AdamW([{"params": [p for p in rest if p.ndim >= 2], "weight_decay": weight_decay},
                   {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0}], **adamw)]  # fmt: skip


def clip_gradients(params: list[torch.Tensor], optimizers: list, max_norm: float) -> torch.Tensor:
    """Clip the gradients' total norm to ``max_norm`` for the coming optimizer step; returns the norm before.

    With one fused AdamW the gradients are not rescaled in a pass of their own: the fused kernel divides each
    gradient by the optimizer's ``grad_scale`` as it reads it (the hook ``torch.amp.GradScaler`` unscales
    through), so clipping costs one read of the gradients (the norm) instead of three (norm, then a read and
    a write to scale). ``max(1, (norm + 1e-6) / max_norm)`` is ``clip_grad_norm_``'s factor
    ``min(1, max_norm / (norm + 1e-6))`` inverted."""
    if len(optimizers) == 1 and isinstance(optimizers[0], torch.optim.AdamW) and optimizers[0].defaults.get("fused"):
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        optimizers[0].grad_scale = ((norm + 1e-6) / max_norm).clamp(min=1.0)
        return norm
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


# --------------------------------------------------------------------------- metrics and logs


class Meter:
    """Device-side sums since the last log (no host sync in the hot loop); :meth:`collect` reduces over ranks."""

    def __init__(self, steps: int, device: torch.device) -> None:
        self.steps, self.device = steps, device
        self.reset()

    def reset(self) -> None:
        self.stats = torch.zeros(self.steps, len(STAT_COLUMNS), dtype=torch.float64, device=self.device)
        # summed loss and gradient norm: both are >= 0, so a sum is finite exactly when every term was (a NaN or
        # inf loss is found at the next log without a check per micro-batch)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.grad_norm_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.n, self.tokens = 0, 0

    def add(self, loss: torch.Tensor, stats: torch.Tensor) -> None:
        self.stats += stats
        self.loss_sum += loss.detach()

    def add_step(self, grad_norm: torch.Tensor | None, tokens: int) -> None:
        if grad_norm is not None:
            self.grad_norm_sum += grad_norm
        self.n += 1
        self.tokens += tokens

    def collect(self, d) -> dict[str, Any]:
        packed = torch.cat([self.stats.flatten(), self.loss_sum[None], self.grad_norm_sum[None]])
        if d.active:
            torch.distributed.all_reduce(packed)
        stats = packed[: self.stats.numel()].view_as(self.stats)
        loss, gnorm = packed[self.stats.numel() :].tolist()
        out = summarize(stats)
        out.update(loss_total=loss / max(self.n, 1), grad_norm=gnorm / max(self.n * d.world_size, 1),
                   finite=math.isfinite(loss) and math.isfinite(gnorm), steps=self.n, tokens=self.tokens)  # fmt: skip
        self.reset()
        return out


def flat_metrics(m: dict[str, Any]) -> dict[str, float]:
    """``loss_k``/``acc_k``/``cond_acc_k`` keys for JSONL and TensorBoard."""
    out = {"loss": m["loss_total"], "tau": m["tau"]} if "loss_total" in m else {"tau": m["tau"]}
    for name in ("loss", "acc", "cond_acc"):
        for k, v in enumerate(m[name]):
            out[f"{name}_{k}"] = v
    return out


class RunLog:
    """Rank 0's view: a tqdm bar (tokens/s, ETA), ``metrics.jsonl`` and TensorBoard. Other ranks get a silent one."""

    def __init__(self, out: Path, *, enabled: bool, total: int, start: int) -> None:
        self.enabled = enabled
        self.path = out / METRICS
        self.bar = self.tb = None
        if not enabled:
            return
        from tqdm.auto import tqdm

        if self.path.exists():  # drop records a killed run wrote after its last checkpoint
            keep = [ln for ln in self.path.read_text().splitlines() if ln and json.loads(ln)["step"] <= start]
            self.path.write_text("".join(ln + "\n" for ln in keep))
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(str(out / "tensorboard"), purge_step=start + 1)
        self.bar = tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True, smoothing=0.05)

    def record(self, rec: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        for k, v in rec.items():
            if isinstance(v, (int, float)) and k not in ("step",) and math.isfinite(v):
                self.tb.add_scalar(f"{rec['split']}/{k}", v, rec["step"])

    def advance(self, postfix: dict[str, str] | None = None) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)

    def status(self, what: str | None = None) -> None:
        """Say on the bar what runs between steps (validation, a checkpoint being written), or clear it."""
        if self.bar is not None:
            self.bar.set_description(f"train ({what})" if what else "train")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()


def accuracy_measure(full_vocab: bool) -> str:
    """What the logged accuracy compares, for the plot, the summary and the manifest."""
    if full_vocab:
        return "draft argmax == verifier full-vocab argmax"
    return "draft argmax == verifier argmax within the draft vocab; overstates tau (--no-full-vocab-accuracy)"


def plot_curves(out: Path, steps: int, *, accuracy: str) -> None:
    """``training_curves.png``: loss and accuracy per TTT step over training (lines) and validation (dots);
    ``accuracy`` (:func:`accuracy_measure`) titles the accuracy panel."""
    try:
        import matplotlib
    except ImportError:  # a dependency of eyas, but a bare GPU box running from source may lack it
        print(f"matplotlib is not installed: no {PLOT} (the metrics are in {METRICS})")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from eyas.manifest import atomic_path

    recs = [json.loads(ln) for ln in (out / METRICS).read_text().splitlines() if ln]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for k in range(steps):
        for split, style in (("train", "-"), ("val", "o")):
            pts = [(r["step"], r[f"loss_{k}"], r[f"acc_{k}"]) for r in recs if r["split"] == split]
            if pts:
                x, loss, acc = zip(*pts)
                axes[0].plot(x, loss, style, color=f"C{k}", label=f"{split} step {k}")
                axes[1].plot(x, acc, style, color=f"C{k}", label=f"{split} step {k}")
    for ax, title in zip(axes, ("KL(verifier || draft)", f"accuracy ({accuracy})")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(out / PLOT) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


def print_summary(m: dict[str, Any], *, label: str, accuracy: str) -> None:
    print(f"\n{label}: per TTT step (k drafts token t+2+k; acc: {accuracy})")
    print(f"  {'k':>2}  {'loss':>8}  {'acc':>6}  {'cond acc':>8}")
    for k, (loss, acc, cond) in enumerate(zip(m["loss"], m["acc"], m["cond_acc"])):
        print(f"  {k:>2}  {loss:8.4f}  {acc:6.3f}  {cond:8.3f}")
    print(f"  implied acceptance length tau = 1 + sum_k prod_(j<=k) cond_acc_j = {m['tau']:.3f}")


# --------------------------------------------------------------------------- checkpoints


def checkpoint_dirs(out: Path) -> list[Path]:
    """Finished checkpoints, oldest first (a directory is finished once renamed into place)."""
    root = out / CHECKPOINTS
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and (p / STATE_FILE).is_file()]
    return sorted(dirs, key=lambda p: int(p.name.removeprefix("step-")))


def _draft_state(model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("draft."): v for k, v in model_state.items() if k.startswith("draft.")}


def save_output(path: Path, cfg, state: dict[str, torch.Tensor], *, verifier_name: str, architectures: list[str],
                steps: int) -> None:  # fmt: skip
    """A speculators-format checkpoint (config.json + bf16 model.safetensors) from a draft state dict."""
    from eyas.checkpoint import save_draft
    from eyas.model import Eagle3Draft

    with torch.device("meta"):
        skeleton = Eagle3Draft(cfg)
    skeleton.load_state_dict(state, strict=False, assign=True)
    save_draft(path, skeleton, verifier_name_or_path=verifier_name, verifier_architectures=architectures,
               speculative_tokens=steps)  # fmt: skip


# --------------------------------------------------------------------------- the trainer


@dataclass
class Options:
    """Hyperparameters and run controls (the stage function's flags, resolved)."""

    epochs: int
    lr: float
    max_seq_len: int
    seqs_per_micro_batch: int
    grad_accum: int
    ttt_steps: int
    step_weights: list[float]
    warmup_steps: int | None
    schedule: str
    weight_decay: float
    clip: float
    seed: int
    optimizer: str
    drop_out_of_vocab: bool
    num_workers: int
    save_every: int
    keep_checkpoints: int
    log_every: int
    max_steps: int | None
    profile_every: int
    deferred_wgrad: bool = False
    loss_chunk_tokens: int = CHUNK_TOKENS


class _Timer:
    """Step-phase timings with a device sync at each mark, only on profiled steps (a sync stalls the queue)."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.device, self.enabled = device, enabled
        self.ms: dict[str, float] = {}
        if enabled and device.type == "cuda":
            torch.cuda.synchronize(device)  # start with an idle device: the previous step's tail is not "data"
        self._t = time.perf_counter()

    def mark(self, name: str) -> None:
        if not self.enabled:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.ms[name] = self.ms.get(name, 0.0) + (now - self._t) * 1e3
        self._t = now


class Trainer:
    """Runs the epochs: one instance per process, every rank the same code (rank 0 also writes)."""

    def __init__(self, *, d, device: torch.device, cfg, draft, head: TargetHead, source, verifier_model,
                 layer_ids: list[int], o: Options, out: Path, rows_train: np.ndarray, rows_val: np.ndarray,
                 lengths: np.ndarray, counts: np.ndarray, dist_mode: str, compiled: bool, fingerprint: str,
                 save_meta: dict[str, Any], loader_embed: torch.Tensor | None = None) -> None:  # fmt: skip
        self.d, self.device, self.cfg, self.o, self.out = d, device, cfg, o, out
        self.head, self.source, self.verifier, self.layer_ids = head, source, verifier_model, layer_ids
        self.lengths, self.fingerprint, self.save_meta = lengths, fingerprint, save_meta
        self.loader_embed = loader_embed  # the frozen embedding in host memory, looked up by the loader
        self.cuda = device.type == "cuda"
        self.compute_dtype = torch.bfloat16 if self.cuda else torch.float32
        W, G = d.world_size, o.grad_accum
        plan = dict(max_len=o.max_seq_len, seqs_per_micro_batch=o.seqs_per_micro_batch, seed=o.seed)
        self.plans = [plan_epoch(rows_train, lengths, counts, epoch=e, shuffle=True, micro_batches_per_step=G * W,
                                 **plan) for e in range(o.epochs)]  # fmt: skip
        self.val_plan = plan_epoch(rows_val, lengths, counts, epoch=0, shuffle=False, micro_batches_per_step=W,
                                   **plan) if len(rows_val) else []  # fmt: skip
        self.total = sum(len(p) for p in self.plans)
        if o.max_steps is not None:
            self.total = min(self.total, o.max_steps)
        self.warmup = o.warmup_steps if o.warmup_steps is not None else max(1, round(0.03 * self.total))
        self.draft = draft
        objective = TTTObjective(draft, steps=o.ttt_steps, step_weights=o.step_weights,
                                 drop_out_of_vocab=o.drop_out_of_vocab, compute_dtype=self.compute_dtype,
                                 compiled=compiled, deferred_wgrad=o.deferred_wgrad,
                                 chunk_tokens=o.loss_chunk_tokens)  # fmt: skip
        # train() has placed the draft; a blanket .to(device) here would also copy the embedding that
        # --loader-embeddings keeps in host memory onto the device (as it did until the seventh session)
        objective.step_weights = objective.step_weights.to(device)
        self.model, self.loss_factor = self._parallelize(objective, dist_mode)
        self.optimizers = build_optimizers(self.model, name=o.optimizer, lr=o.lr, weight_decay=o.weight_decay,
                                           fused=not (self.d.active and dist_mode == "fsdp"))  # fmt: skip
        for opt in self.optimizers:
            if isinstance(opt, FusedAdamW):
                opt.attach_working(draft)
        self.base_lrs = [[g["lr"] for g in opt.param_groups] for opt in self.optimizers]
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.meter = Meter(o.ttt_steps, device)
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.cuda else contextlib.nullcontext()
        self.global_step, self.epoch, self.step_in_epoch = 0, 0, 0
        self.saved_step = -1
        self.rates: list[tuple[int, float]] = []
        self.timings: list[dict[str, float]] = []
        self.last_train: dict[str, Any] | None = None
        self.last_val: dict[str, Any] | None = None

    # ------------------------------------------------------------------ setup

    def _parallelize(self, objective: nn.Module, mode: str) -> tuple[nn.Module, float]:
        """DDP averages gradients over ranks, so the loss (already a share of the global sum) is scaled by the
        world size. FSDP2 is told to sum (divide factor 1, SUM-only collectives): its default averages on NCCL but
        not on gloo (pytorch #162338), and its divide-factor path uses PREMUL_SUM, which gloo lacks."""
        if not self.d.active:
            return objective, 1.0
        if mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [self.device.index] if self.cuda else None
            # frozen and the same on every rank (the verifier's): neither broadcast at start nor reduced; it may
            # also live in host memory (--loader-embeddings), which DDP's one-device check would refuse
            DDP._set_params_and_buffers_to_ignore_for_model(objective, ["draft.embed_tokens.weight"])
            return DDP(objective, device_ids=ids, broadcast_buffers=False, gradient_as_bucket_view=True), float(
                self.d.world_size
            )
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False) \
            if self.cuda else MixedPrecisionPolicy()  # fmt: skip
        ignored = {objective.draft.embed_tokens.weight}  # frozen and used by lookup only: replicated, never gathered
        # One FSDP unit: the layer runs once per TTT step, and a separately sharded module called several times in
        # one forward would be reduce-scattered after its first backward. Weights, gradients and optimizer state
        # are still sharded; only the forward holds the whole (single-layer) draft.
        fully_shard(objective, mp_policy=mp, ignored_params=ignored)
        objective.set_gradient_divide_factor(1.0)
        objective.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM (and NCCL is zero-copy)
        return objective, 1.0

    @contextlib.contextmanager
    def _sync(self, sync: bool) -> Iterator[None]:
        """Gradient sync only on a step's last micro-batch."""
        if not self.d.active or sync:
            if hasattr(self.model, "set_requires_gradient_sync"):
                self.model.set_requires_gradient_sync(True)
            yield
        elif hasattr(self.model, "no_sync"):
            with self.model.no_sync():
                yield
        else:
            self.model.set_requires_gradient_sync(False)
            yield

    def _loader(self, steps: list[Step], grad_accum: int):
        ds = StepData(self.source, steps, rank=self.d.rank, grad_accum=grad_accum, max_len=self.o.max_seq_len,
                      seqs=self.o.seqs_per_micro_batch, lengths=self.lengths, embed=self.loader_embed,
                      ttt_steps=self.o.ttt_steps, chunk=self.o.loss_chunk_tokens)  # fmt: skip
        w = self.o.num_workers
        return torch.utils.data.DataLoader(ds, batch_size=None, shuffle=False, num_workers=w, pin_memory=self.cuda,
                                           prefetch_factor=4 if w else None, worker_init_fn=_worker_init if w else None)  # fmt: skip

    # ------------------------------------------------------------------ one step

    def _features(self, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if "aux" in mb:
            return mb["aux"], mb["last"]
        from eyas.verifier import forward_hidden_states

        B, S = mb["input_ids"].shape
        H = self.cfg.target_hidden_size or self.cfg.hidden_size
        aux = torch.zeros(B * S, 3 * H, dtype=self.compute_dtype, device=self.device)
        last = torch.zeros(B * S, H, dtype=self.compute_dtype, device=self.device)
        if mb["row_ids"].shape[0]:
            a, h = forward_hidden_states(self.verifier, mb["row_ids"], layer_ids=self.layer_ids,
                                         attention_mask=mb["row_attn"])  # fmt: skip
            aux[mb["dst"]] = a.reshape(-1, 3 * H)[mb["src"]].to(self.compute_dtype)
            last[mb["dst"]] = h.reshape(-1, H)[mb["src"]].to(self.compute_dtype)
        return aux.view(B, S, 3 * H), last.view(B, S, H)

    def _forward(self, mb: dict[str, torch.Tensor], denom: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        aux, last = self._features(mb)
        targets = self.head(last.flatten(0, 1), pad=self.o.ttt_steps, rows=mb.get("target_rows"))
        with self.autocast:
            return self.model(mb["input_ids"], mb["doc_ids"], mb["position_ids"], aux, mb["loss_mask"],
                              targets.logits, targets.argmax, targets.in_vocab, denom,
                              inputs_embeds=mb.get("inputs_embeds"), scored_rows=mb.get("scored_rows"))  # fmt: skip

    def _to_device(self, item: dict[str, Any]) -> dict[str, Any]:
        """A loader item with its tensors (``denom`` and every micro-batch's) moved to the device."""
        return dict(item, denom=item["denom"].to(self.device, non_blocking=True),
                    micro_batches=[{k: v.to(self.device, non_blocking=True) for k, v in mb.items()}
                                   for mb in item["micro_batches"]])  # fmt: skip

    def _prefetch(self, items: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """The loader's items with their tensors already on the device: on CUDA the next item's host-to-device
        copies run on a side stream while the current step computes (a step's features are 16 bytes per
        token and hidden unit, about 1 ms of copy per step at Llama-8B dims that the compute stream would wait
        for)."""
        if not self.cuda:
            yield from map(self._to_device, items)
            return
        side = torch.cuda.Stream(self.device)

        def load(item: dict[str, Any]) -> tuple[dict[str, Any], torch.cuda.Event]:
            side.wait_stream(torch.cuda.current_stream(self.device))  # its memory may be reused from this stream
            with torch.cuda.stream(side):
                moved = self._to_device(item)
                ready = torch.cuda.Event()
                ready.record(side)
            return moved, ready

        nxt = next(items, None)
        pending = load(nxt) if nxt is not None else None
        while pending is not None:
            item, ready = pending
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(ready)
            for t in [item["denom"], *(v for mb in item["micro_batches"] for v in mb.values())]:
                t.record_stream(compute)  # allocated on the side stream, used (and freed) on this one
            nxt = next(items, None)
            pending = load(nxt) if nxt is not None else None
            yield item

    def train_step(self, item: dict[str, Any], timer: _Timer) -> None:
        """One optimizer step on an item from :meth:`_prefetch` (its tensors on the device)."""
        denom, mbs = item["denom"], item["micro_batches"]
        for i, mb in enumerate(mbs):
            with self._sync(i == len(mbs) - 1):
                loss, stats = self._forward(mb, denom)
                timer.mark("forward")
                (loss * self.loss_factor).backward()
                timer.mark("backward")
            self.meter.add(loss, stats)
        gnorm = clip_gradients(self.params, self.optimizers, self.o.clip) if self.o.clip > 0 else None
        f = lr_factor(self.global_step, total=self.total, warmup=self.warmup, schedule=self.o.schedule)
        for opt, lrs in zip(self.optimizers, self.base_lrs):
            for g, lr in zip(opt.param_groups, lrs):
                g["lr"] = lr * f
            opt.step()
            opt.zero_grad(set_to_none=True)
        timer.mark("optimizer")
        self.meter.add_step(gnorm, item["tokens"])

    @torch.no_grad()
    def validate(self) -> dict[str, Any] | None:
        if not self.val_plan:
            return None
        from tqdm.auto import tqdm

        meter = Meter(self.o.ttt_steps, self.device)
        items = self._prefetch(iter(self._loader(self.val_plan, 1)))
        for item in tqdm(items, total=len(self.val_plan), desc="validate", unit="step", leave=False,
                         disable=not self.d.is_main, dynamic_ncols=True):  # fmt: skip
            for mb in item["micro_batches"]:
                loss, stats = self._forward(mb, item["denom"])
                meter.add(loss, stats)
        return meter.collect(self.d)

    # ------------------------------------------------------------------ checkpoints

    def _state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        msd, osd = get_state_dict(self.model, self.optimizers,
                                  options=StateDictOptions(full_state_dict=True, cpu_offload=True))  # fmt: skip
        msd.pop("draft.embed_tokens.weight", None)  # frozen: the verifier's, restored from it
        return msd, osd

    def save(self, *, final: bool = False) -> None:
        """A checkpoint (every rank gathers, rank 0 writes), atomically; older ones beyond the newest
        ``keep_checkpoints`` are removed."""
        from eyas.manifest import atomic_path

        local = [p.to_local() if hasattr(p, "to_local") else p for p in self.params]
        finite = torch.stack([torch.isfinite(p).all() for p in local]).all().float()
        if self.d.active:
            torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
        self._check({"finite": bool(finite)})
        msd, osd = self._state()
        if not self.d.is_main:
            self.saved_step = self.global_step
            self.d.barrier("checkpoint")
            return
        state = {
            "format": STATE_FORMAT,
            "fingerprint": self.fingerprint,
            "model": msd,
            "optimizer": osd,
            "global_step": self.global_step,
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(self.device) if self.cuda else torch.zeros(0, dtype=torch.uint8),
            # what the manifest reports: a run killed after its last checkpoint resumes with nothing left to do
            "metrics": json.dumps({"train": self.last_train, "val": self.last_val, "rates": self.rates}),
        }
        self.saved_step = self.global_step
        path = self.out / CHECKPOINTS / f"step-{self.global_step:08d}"
        try:
            with atomic_path(path, is_dir=True) as tmp:
                save_output(tmp, self.cfg, _draft_state(msd), **self.save_meta)
                torch.save(state, tmp / STATE_FILE)
        except (OSError, RuntimeError) as e:  # a full disk reaches torch.save as a RuntimeError from its zip writer
            free = shutil.disk_usage(self.out).free / 2**30
            kept = checkpoint_dirs(self.out)
            raise EyasError(f"writing checkpoint {path} failed ({type(e).__name__}: {e}); {free:.1f} GiB free on its "
                            "disk. Nothing half-written was left; "
                            + (f"the newest complete checkpoint, {kept[-1].name}, is kept: " if kept else "")
                            + "free space (or lower --keep-checkpoints) and rerun the same command to resume"
                            ) from e  # fmt: skip
        for old in checkpoint_dirs(self.out)[: -max(1, self.o.keep_checkpoints)]:
            shutil.rmtree(old)
        self.d.barrier("checkpoint")

    def resume(self) -> Path | None:
        """Load the newest checkpoint, if any (every rank reads it)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        found = checkpoint_dirs(self.out)
        if not found:
            return None
        path = found[-1]
        try:
            state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
        except Exception as e:
            raise EyasError(f"{path / STATE_FILE} cannot be read ({type(e).__name__}: {e}); remove {path} to resume "
                            "from the checkpoint before it") from e  # fmt: skip
        if state.get("format") != STATE_FORMAT:
            raise EyasError(f"{path / STATE_FILE} has format {state.get('format')!r}, not {STATE_FORMAT!r}")
        if state["fingerprint"] != self.fingerprint:
            raise EyasError(f"{self.out} holds checkpoints of a run with other inputs or settings ({path.name}); "
                            "rerun with the same flags to resume it, or choose another --out")  # fmt: skip
        set_state_dict(self.model, self.optimizers, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=StateDictOptions(full_state_dict=True, strict=False))  # fmt: skip
        self.global_step, self.epoch, self.step_in_epoch = state["global_step"], state["epoch"], state["step_in_epoch"]
        self.saved_step = self.global_step
        metrics = json.loads(state.get("metrics") or "{}")  # (checkpoints from before it was kept: none)
        self.last_train, self.last_val = metrics.get("train"), metrics.get("val")
        self.rates = [tuple(r) for r in metrics.get("rates", [])]
        torch.set_rng_state(state["rng"])
        if self.cuda and state["cuda_rng"].numel():
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        return path

    def final_state(self) -> dict[str, torch.Tensor]:
        return _draft_state(self._state()[0])

    # ------------------------------------------------------------------ the loop

    def _check(self, m: dict[str, Any]) -> None:
        if not m["finite"]:
            good = checkpoint_dirs(self.out)
            raise EyasError(
                f"the loss or gradient became nan/inf by step {self.global_step}; stopping. The last good checkpoint "
                f"is {good[-1] if good else 'none (nothing was saved)'}. Lower --lr, raise --warmup-steps or check "
                "the features (`eyas extract --verify`), then rerun the same command to resume from it"
            )

    def _log_train(self, log: RunLog, window_start: float) -> None:
        m = self.meter.collect(self.d)
        self._check(m)
        seconds = time.perf_counter() - window_start
        self.rates.append((m["tokens"], seconds))
        rec = {"split": "train", "step": self.global_step, "epoch": self.epoch, "lr": self.optimizers[-1].param_groups[0]["lr"],
               "grad_norm": m["grad_norm"], "tokens_per_s": m["tokens"] / max(seconds, 1e-9), **flat_metrics(m)}  # fmt: skip
        if self.timings:
            for name in ("data", "forward", "backward", "optimizer"):
                rec[f"ms_{name}"] = sum(t.get(name, 0.0) for t in self.timings) / len(self.timings)
        log.record(rec)
        self.last_train = m

    def _validate(self, log: RunLog) -> None:
        log.status("validating")
        self.last_val = self.validate()
        log.status()
        if self.last_val is not None:
            log.record({"split": "val", "step": self.global_step, "epoch": self.epoch, **flat_metrics(self.last_val)})

    def _save(self, log: RunLog) -> None:
        log.status("writing checkpoint")  # seconds at real dims: fp32 weights and optimizer state, fsynced
        self.save()
        log.status()

    def run(self) -> dict[str, Any]:
        o = self.o
        resumed = self.resume()
        if resumed and self.d.is_main:
            print(f"resuming from {resumed} (step {self.global_step}, epoch {self.epoch + 1})")
        log = RunLog(self.out, enabled=self.d.is_main, total=self.total, start=self.global_step)
        try:
            while self.epoch < o.epochs and self.global_step < self.total:
                steps = self.plans[self.epoch]
                it = self._prefetch(iter(self._loader(steps[self.step_in_epoch :], o.grad_accum)))
                window = time.perf_counter()
                while self.step_in_epoch < len(steps) and self.global_step < self.total:
                    timer = _Timer(self.device, bool(o.profile_every) and self.global_step % o.profile_every == 0)
                    item = next(it)
                    timer.mark("data")
                    self.train_step(item, timer)
                    if timer.enabled:
                        self.timings.append(timer.ms)
                    self.global_step += 1
                    self.step_in_epoch += 1
                    end = self.step_in_epoch == len(steps) or self.global_step == self.total
                    save = not end and o.save_every > 0 and self.global_step % o.save_every == 0
                    if save or end or self.global_step % o.log_every == 0:
                        self._log_train(log, window)
                        m = self.last_train
                        log.advance({"loss": f"{m['loss_total']:.3f}", "acc0": f"{m['acc'][0]:.3f}",
                                     "tau": f"{m['tau']:.2f}", "tok/s": f"{self.rates[-1][0] / max(self.rates[-1][1], 1e-9):,.0f}"})  # fmt: skip
                        if save:
                            self._save(log)
                        window = time.perf_counter()
                    else:
                        log.advance()
                del it
                if self.step_in_epoch == len(steps):
                    self._validate(log)
                    self.epoch, self.step_in_epoch = self.epoch + 1, 0
                    self._save(log)
            if self.saved_step != self.global_step:  # stopped by --max-steps mid-epoch: validate and save once more
                self._validate(log)
                self._save(log)
        finally:
            log.close()
        return self._result()

    def _result(self) -> dict[str, Any]:
        rates = self.rates[1:] if len(self.rates) > 1 else self.rates  # the first window pays for compilation
        out: dict[str, Any] = {
            "steps": self.global_step,
            "tokens_per_s": sum(t for t, _ in rates) / max(sum(s for _, s in rates), 1e-9),
            "train": self.last_train,
            "val": self.last_val,
        }
        if self.timings:
            out["ms_per_step"] = {k: float(np.median([t.get(k, 0.0) for t in self.timings]))
                                  for k in ("data", "forward", "backward", "optimizer")}  # fmt: skip
        if self.cuda:
            out["peak_memory_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return out


def _worker_init(_worker_id: int) -> None:
    torch.set_num_threads(1)  # loaders slice and copy; the compute threads belong to the trainer


# --------------------------------------------------------------------------- the stage


def train(
    *,
    verifier: str,
    data: str,
    out: str,
    vocab: str | None = None,
    online: bool = False,
    layers: list[int] | None = None,
    epochs: int = 10,
    lr: float = 1e-4,
    max_seq_len: int = 2048,
    batch_tokens: int | None = None,
    grad_accum: int = 1,
    ttt_steps: int = 3,
    step_loss_decay: float = 1.0,
    val_ratio: float = 0.02,
    num_workers: int = 2,
    warmup_steps: int | None = None,
    schedule: Literal["cosine", "linear", "constant"] = "cosine",
    weight_decay: float = 0.0,
    clip: float = 0.5,
    seed: int = 0,
    save_every: int = 1000,
    keep_checkpoints: int = 2,
    log_every: int = 10,
    optimizer: Literal["adamw", "muon"] = "adamw",
    freeze_lm_head: bool = False,
    drop_out_of_vocab: bool = False,
    full_vocab_accuracy: bool = True,
    dist: Literal["ddp", "fsdp"] = "ddp",
    device: str | None = None,
    device_map: str | None = None,
    compile: bool | None = None,
    gradient_checkpointing: bool = False,
    working_weights: bool | None = None,
    deferred_wgrad: bool | None = None,
    loader_embeddings: bool | None = None,
    norm_before_residual: bool = False,
    norm_before_fc: bool = False,
    fc_norm: bool = False,
    norm_output: bool = False,
    draft_arch: Literal["llama", "qwen3"] = "llama",
    num_layers: int = 1,
    intermediate_size: int | None = None,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    head_dim: int | None = None,
    verifier_name: str | None = None,
    max_steps: int | None = None,
    profile_every: int = 0,
    loss_chunk_tokens: int = CHUNK_TOKENS,
) -> dict[str, Any]:
    """Train an EAGLE-3 draft for a verifier with training-time test; the output dir is a speculators checkpoint.

    Offline, --data is an `eyas extract` output; with --online it is an `eyas prepare` output and the verifier
    computes the features per batch. Rerun the same command to resume from the newest checkpoint. Distributed:
    ``torchrun --nproc-per-node N -m eyas.cli train ...`` (DDP, or --dist fsdp for FSDP2).

    Args:
        verifier: the verifier checkpoint (dir, .gguf, 'smollm2').
        data: features from `eyas extract` (offline), or prepared rows from `eyas prepare` with --online.
        out: output directory: the draft (config.json + model.safetensors), checkpoints/, metrics.jsonl, tensorboard/.
        vocab: an `eyas vocab` directory (d2t.npy, t2d.npy); default: the whole verifier vocab.
        online: run the verifier in the loop on prepared rows (nothing written to disk but the draft).
        layers: three aux layer ids (online only; offline they come from the features); default [2, L//2, L-3].
        epochs: passes over the training rows.
        lr: peak learning rate.
        max_seq_len: tokens per packed sequence; longer rows are truncated (and counted).
        batch_tokens: tokens per micro-batch and rank, a multiple of --max-seq-len (default: one sequence).
        grad_accum: micro-batches per rank and optimizer step.
        ttt_steps: training-time-test steps (tokens drafted per position); also the draft's speculative_tokens.
        step_loss_decay: weight of TTT step k is decay**k (1: every step equally).
        val_ratio: share of rows held out for validation at each epoch's end.
        num_workers: DataLoader worker processes.
        warmup_steps: linear warmup steps (default: 3% of all steps).
        schedule: learning-rate decay after warmup.
        weight_decay: AdamW weight decay on matrices (norms never decay).
        clip: gradient-norm clip (0: off).
        seed: seeds the draft's init, the validation split and each epoch's packing order.
        save_every: checkpoint every N optimizer steps (and at each epoch's end; 0: only there).
        keep_checkpoints: how many checkpoints to keep.
        log_every: log metrics (and sync the device) every N steps.
        optimizer: adamw, or muon (speculators' default: Muon on matrices, AdamW on norms and lm_head).
        freeze_lm_head: keep lm_head at the verifier's rows (speculators 0.9 does; EAGLE trains it).
        drop_out_of_vocab: no loss where the verifier's full-vocab argmax is outside the draft vocab (EAGLE's choice;
            needs --full-vocab-accuracy).
        full_vocab_accuracy: score accuracy against the verifier's full-vocab argmax (costs one pass over the head);
            without it accuracy is within the draft vocab and overstates tau.
        dist: under torchrun: ddp (replicated) or fsdp (FSDP2 fully_shard).
        device: cpu, cuda or cuda:N (default: cuda when there is one).
        device_map: with --online, spread the verifier over the GPUs and host memory as transformers places it
            ('auto'; a dict in Python) while the draft trains on --device; one process only.
        compile: torch.compile the draft layer and the loss (default: on CUDA).
        gradient_checkpointing: recompute each TTT step's layer in backward: far less activation memory (long
            sequences, big drafts) for about a third more layer compute.
        working_weights: compute with working copies of the weights cast once per optimizer step, the weight
            gradients coming out of their matmuls in fp32 (default: on, except under --dist fsdp, which casts
            its gathered shards itself).
        deferred_wgrad: with working weights, accumulate each layer weight's gradient over the TTT steps in one
            fp32 buffer by its matmuls, handing autograd the sum once instead of forming one gradient per step and
            adding them (2 GiB less peak at Kimi-K2.5 dims; default: on with working weights and without
            --gradient-checkpointing, whose recomputed layer would use each weight again).
        loader_embeddings: keep the frozen embedding in host memory and let the data loader look each batch's rows
            up, instead of holding the table on the device (1 GiB at Llama-3.1-8B's vocab, 2.2 GiB at
            Kimi-K2.5's; default: on for offline training on CUDA with loader workers and without --dist fsdp).
        norm_before_residual: layout variant: residual = hidden_norm(h) (speculators' default; served by vLLM, by no
            SGLang release).
        norm_before_fc: layout variant: one RMSNorm over the three concatenated aux states before fc (gpt-oss
            drafts; served by vLLM >= 0.19.0 and SGLang >= 0.5.17).
        fc_norm: layout variant (the EAGLE-3.1 paper's): an RMSNorm over each aux state before fc; excludes
            --norm-before-fc (served by vLLM >= 0.25.0 and SGLang >= 0.5.12).
        norm_output: layout variant (EAGLE-3.1): the next step reads the normed output instead of the pre-norm
            one (served by vLLM >= 0.25.0 and SGLang >= 0.5.12).
        draft_arch: the draft's decoder layer: llama (EAGLE-3), or qwen3 (an RMSNorm over each query and key head
            before RoPE, speculators' default draft layer; served by vLLM >= 0.24.0, by no SGLang release).
        num_layers: draft decoder layers: the first reads the token embedding and the hidden state, each later one
            the previous layer's output (served by vLLM >= 0.11.1 and SGLang >= 0.5.12).
        intermediate_size: draft MLP width (default: the verifier's).
        num_attention_heads: draft query heads (default: the verifier's; MLA verifiers: as many).
        num_key_value_heads: draft KV heads (default: the verifier's; MLA verifiers: 8).
        head_dim: draft head dim (default: the verifier's, or hidden / heads).
        verifier_name: verifier name_or_path written into config.json for vLLM (default: the --verifier path).
        max_steps: stop after N optimizer steps (smoke runs and benchmarks).
        profile_every: every N steps, sync at phase boundaries and log data/forward/backward/optimizer times.
        loss_chunk_tokens: positions per chunk of the fused loss (its logits buffer is this x the draft vocab);
            positions no TTT step scores (prompts, packing padding) are skipped in whole chunks of this size.
    """
    from eyas import dist as _dist

    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    args = {k: v for k, v in locals().items() if k not in ("_dist", "kind")}
    with _dist.init(device_type="cuda" if kind.startswith("cuda") else "cpu") as d:
        return _train(d, **args)


def _check_layers(layer_ids: list[int], num_layers: int, *, what: str = "--layers") -> list[int]:
    ids = sorted(int(i) for i in layer_ids)
    if len(ids) != 3 or len(set(ids)) != 3 or not all(1 <= i < num_layers for i in ids):
        raise EyasError(f"{what} must be three distinct ids in 1..{num_layers - 1}, got {layer_ids}")
    return ids


def _train(d, **a: Any) -> dict[str, Any]:
    from eyas.manifest import MANIFEST, OutputLock, manifest_matches, read_json, sha256_json, write_manifest
    from eyas.model import DraftConfig, Eagle3Draft, default_attn_implementation
    from eyas.verifier import build_text_model, load_head_tensors
    from eyas.verifier_info import fingerprint, resolve

    out = Path(a["out"])
    info = resolve(a["verifier"])
    where = d.device(a["device"])
    cuda = where.type == "cuda"
    if cuda:
        torch.cuda.set_device(where)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    compute_dtype = torch.bfloat16 if cuda else torch.float32
    fp = fingerprint(info)
    steps, max_len = int(a["ttt_steps"]), int(a["max_seq_len"])
    if steps < 1 or max_len < steps + 2:
        raise EyasError(f"--ttt-steps must be >= 1 and --max-seq-len >= ttt_steps + 2 (got {steps}, {max_len})")
    batch_tokens = a["batch_tokens"] or max_len
    if batch_tokens % max_len:
        raise EyasError(f"--batch-tokens {batch_tokens} must be a multiple of --max-seq-len {max_len}")
    if a["drop_out_of_vocab"] and not a["full_vocab_accuracy"]:
        raise EyasError("--drop-out-of-vocab needs the verifier's full-vocab argmax (to know which positions fall "
                        "outside the draft vocab), which --no-full-vocab-accuracy skips computing: drop one of them")  # fmt: skip
    if a["loss_chunk_tokens"] < 1:
        raise EyasError(f"--loss-chunk-tokens must be >= 1 (got {a['loss_chunk_tokens']}); the default is {CHUNK_TOKENS}")

    # ---- inputs, all checked before anything runs
    if a["device_map"] is not None and (not a["online"] or d.active):
        raise EyasError("--device-map spreads the verifier of an --online run over the GPUs of one process; it "
                        "needs --online and no torchrun")  # fmt: skip
    if a["online"]:
        from eyas.datasets import prepared_verifier

        source = PreparedRows(a["data"])
        if prepared_verifier(source.manifest) != fp:
            raise EyasError(f"the prepared rows in {a['data']} were tokenized for another verifier "
                            f"({source.manifest.get('verifier_path', 'unknown')}), not {info.path}; run `eyas prepare` "
                            "with this --verifier")  # fmt: skip
        layer_ids = _check_layers(a["layers"] or info.aux_layer_ids, info.num_hidden_layers)
    else:
        from eyas.features import read_features_manifest

        fm = read_features_manifest(a["data"])
        if int(fm["hidden_size"]) != info.hidden_size:
            raise EyasError(f"the features in {a['data']} have hidden size {fm['hidden_size']} but {info.path} has "
                            f"{info.hidden_size}")  # fmt: skip
        if fm.get("inputs", {}).get("verifier") != fp:
            raise EyasError(f"the features in {a['data']} were extracted from another verifier "
                            f"({fm.get('verifier_path', 'unknown')}), not {info.path}: train with the verifier they "
                            "came from, or run `eyas extract` with this one")  # fmt: skip
        layer_ids = _check_layers(fm["layer_ids"], info.num_hidden_layers,  # a damaged or hand-made manifest
                                  what=f"the layer_ids of {Path(a['data']) / MANIFEST}")  # fmt: skip
        if a["layers"] is not None and sorted(a["layers"]) != layer_ids:
            raise EyasError(f"--layers {a['layers']} differs from the layers the features hold ({layer_ids}); "
                            "drop --layers or extract those layers")  # fmt: skip
        source = FeatureRows(a["data"], dtype=compute_dtype)
    d2t, t2d, vocab_id = load_vocab(a["vocab"], vocab_size=info.vocab_size)
    overrides = {k: a[k] for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
                 if a[k] is not None}  # fmt: skip
    try:
        cfg = DraftConfig.from_verifier(info.text_config, draft_vocab_size=len(d2t), aux_layer_ids=layer_ids,
                                        norm_before_residual=a["norm_before_residual"],
                                        norm_before_fc=a["norm_before_fc"], fc_norm=a["fc_norm"],
                                        norm_output=a["norm_output"], draft_arch=a["draft_arch"],
                                        num_hidden_layers=a["num_layers"], **overrides)  # fmt: skip
    except (ValueError, KeyError) as e:
        raise EyasError(f"cannot shape a draft for {info.path}: {e}") from e
    if a["dist"] == "fsdp" and a["optimizer"] == "muon" and d.active:
        raise EyasError("--optimizer muon needs whole matrices; use --dist ddp with it")

    flat, offsets = source.masks()
    lengths, counts = row_counts(flat, offsets, max_len=max_len, steps=steps)
    truncated = int((np.diff(offsets) > max_len).sum())
    perm = np.random.default_rng(a["seed"]).permutation(len(lengths))
    n_val = int(round(len(lengths) * a["val_ratio"])) if a["val_ratio"] > 0 else 0
    n_val = min(max(n_val, 1 if a["val_ratio"] > 0 and len(lengths) > 1 else 0), len(lengths) - 1)
    rows_val = np.sort(perm[:n_val])
    rows_train = np.sort(perm[n_val:])
    empty = int((counts[rows_train, 0] == 0).sum())
    rows_train = rows_train[counts[rows_train, 0] > 0]  # no scored position: nothing to learn from
    if not len(rows_train):
        raise EyasError(f"{a['data']} has no training row with a loss-masked token past position 1")

    keys = ("online", "epochs", "lr", "max_seq_len", "grad_accum", "ttt_steps", "step_loss_decay", "val_ratio",
            "warmup_steps", "schedule", "weight_decay", "clip", "seed", "optimizer", "freeze_lm_head",
            "drop_out_of_vocab", "full_vocab_accuracy", "max_steps")  # fmt: skip
    settings = {k: a[k] for k in keys}
    settings.update(batch_tokens=batch_tokens, world_size=d.world_size, dist=a["dist"] if d.active else None,
                    draft=cfg.to_dict(), compute_dtype=str(compute_dtype).removeprefix("torch."))  # fmt: skip
    inputs = {"verifier": fp, "data": source.identity(), "vocab": vocab_id,
              # the template the rows were rendered with, for `eyas eval` to compare (offline: through extract)
              "chat_template_sha256": source.manifest.get("inputs", {}).get("chat_template_sha256")}  # fmt: skip
    run_id = sha256_json({"inputs": inputs, "settings": settings})

    def open_out() -> bool:
        if manifest_matches(out, stage=STAGE, inputs=inputs, settings=settings):
            return True
        if (out / MANIFEST).exists():
            raise EyasError(f"{out} holds a draft trained from other inputs or settings; choose another --out or "
                            "remove it")  # fmt: skip
        return False

    if d.run_on_main(open_out):
        m = read_json(out / MANIFEST, what="train manifest")
        if d.is_main:
            print(f"{out}: already trained ({m['outputs']['steps']} steps); nothing to do")
        return m["outputs"]
    with contextlib.ExitStack() as stack:
        if d.is_main:
            stack.enter_context(OutputLock(out))
            for tmp in (out / CHECKPOINTS).glob(".step-*"):  # left by a killed run; the lock says none is alive
                shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
        d.barrier("output directory")

        # ---- the draft, its targets, the verifier (online)
        torch.manual_seed(a["seed"])
        draft = Eagle3Draft(cfg, attn_implementation=default_attn_implementation(where))
        heads = load_head_tensors(info)
        target_ids = torch.arange(len(d2t)) + d2t
        draft.init_from_verifier(embed=heads.embed, lm_head_rows=heads.lm_head[target_ids])
        draft.set_vocab(d2t=d2t, t2d=t2d)
        draft.lm_head.weight.requires_grad_(not a["freeze_lm_head"])
        draft.gradient_checkpointing = a["gradient_checkpointing"]
        fsdp = d.active and a["dist"] == "fsdp"
        # by default only with loader workers: the main process, which launches the GPU's work, gathers nothing
        on_host = a["loader_embeddings"] if a["loader_embeddings"] is not None else \
            cuda and not a["online"] and not fsdp and a["num_workers"] > 0  # fmt: skip
        if on_host and (a["online"] or fsdp):
            raise EyasError("--loader-embeddings needs offline features and no --dist fsdp (online, the verifier's "
                            "own embedding runs on the device anyway); drop the flag")  # fmt: skip
        if on_host:  # every module but the frozen embedding goes to the device; the loader looks rows up
            for name, child in draft.named_children():
                if name != "embed_tokens":
                    child.to(where)
            for name, buf in list(draft.named_buffers(recurse=False)):
                setattr(draft, name, buf.to(where))
        else:
            draft.to(where)
        draft.embed_tokens.to(compute_dtype)  # frozen: bf16 on GPU as the verifier serves it, no master copy
        if a["freeze_lm_head"] and not fsdp:  # (an FSDP2 unit wants one dtype)
            draft.lm_head.to(compute_dtype)  # frozen too: no fp32 master copy either
        rest_ids = torch.from_numpy(np.flatnonzero(~t2d.numpy()))
        use_rest = a["full_vocab_accuracy"] and len(rest_ids) > 0
        accuracy = accuracy_measure(use_rest or len(rest_ids) == 0)
        head_w = draft.lm_head.weight
        # a frozen lm_head holds exactly the verifier's draft-vocab rows: the targets share its memory
        rows = head_w.detach() if a["freeze_lm_head"] and head_w.dtype == compute_dtype else \
            heads.lm_head[target_ids].to(where, compute_dtype)  # fmt: skip
        head = TargetHead.for_verifier(info, rows=rows, draft_target_ids=target_ids.to(where),
                                       rest=heads.lm_head[rest_ids].to(where, compute_dtype) if use_rest else None,
                                       rest_ids=rest_ids.to(where) if use_rest else None, dtype=compute_dtype,
                                       device=where)  # fmt: skip
        del heads
        working = a["working_weights"] if a["working_weights"] is not None else not fsdp
        if working and fsdp:
            raise EyasError("--working-weights does not combine with --dist fsdp (FSDP2 casts its gathered shards "
                            "itself); drop the flag")  # fmt: skip
        deferred = a["deferred_wgrad"] if a["deferred_wgrad"] is not None else \
            working and not a["gradient_checkpointing"]  # fmt: skip
        if deferred and (not working or a["gradient_checkpointing"]):
            raise EyasError("--deferred-wgrad needs working weights and no --gradient-checkpointing (a recomputed "
                            "layer would use each weight again); drop one of them")  # fmt: skip
        if working:
            # lm_head: the fused loss casts it once per micro-batch; fc runs once per forward, so a copy kept
            # between steps would only hold memory (0.3 GiB at Kimi-K2.5 dims)
            use_working_weights(draft, compute_dtype, skip=(draft.lm_head,), cast_per_call=(draft.fc,))
        compiled = a["compile"] if a["compile"] is not None else cuda
        if compiled:
            compile_draft(draft)
        verifier_model = build_text_model(info, dtype=compute_dtype, device=None if a["device_map"] else where,
                                          device_map=a["device_map"]) if a["online"] else None  # fmt: skip
        archs = [] if info.gguf_file else \
            read_json(info.checkpoint_dir / "config.json", what="verifier config").get("architectures") or []
        if not archs:  # a GGUF file has no config.json: name transformers' class for its model type
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

            archs = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[info.text_model_type]] \
                if info.text_model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else []  # fmt: skip
        save_meta = {"verifier_name": a["verifier_name"] or info.path, "architectures": archs, "steps": steps}
        o = Options(epochs=a["epochs"], lr=a["lr"], max_seq_len=max_len, seqs_per_micro_batch=batch_tokens // max_len,
                    grad_accum=a["grad_accum"], ttt_steps=steps,
                    step_weights=[a["step_loss_decay"] ** k for k in range(steps)], warmup_steps=a["warmup_steps"],
                    schedule=a["schedule"], weight_decay=a["weight_decay"], clip=a["clip"], seed=a["seed"],
                    optimizer=a["optimizer"], drop_out_of_vocab=a["drop_out_of_vocab"], num_workers=a["num_workers"],
                    save_every=a["save_every"], keep_checkpoints=a["keep_checkpoints"], log_every=a["log_every"],
                    max_steps=a["max_steps"], profile_every=a["profile_every"],
                    deferred_wgrad=deferred, loss_chunk_tokens=a["loss_chunk_tokens"])  # fmt: skip
        trainer = Trainer(d=d, device=where, cfg=cfg, draft=draft, head=head, source=source,
                          verifier_model=verifier_model, layer_ids=layer_ids, o=o, out=out, rows_train=rows_train,
                          rows_val=rows_val, lengths=lengths, counts=counts, dist_mode=a["dist"], compiled=compiled,
                          fingerprint=run_id, save_meta=save_meta,
                          loader_embed=draft.embed_tokens.weight.detach() if on_host else None)  # fmt: skip
        if d.is_main:
            trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
            print(f"eyas train: {len(rows_train)} rows ({int(lengths[rows_train].sum()):,} tokens) for training, "
                  f"{len(rows_val)} for validation; {trainer.total} steps over {a['epochs']} epoch(s), "
                  f"{d.world_size} rank(s) x {a['grad_accum']} x {batch_tokens} tokens; draft {trainable / 1e6:.1f}M "
                  f"trainable parameters, vocab {len(d2t)}/{info.vocab_size}, layers {layer_ids}, "
                  f"{'online' if a['online'] else 'offline'}, {where}"
                  + (f"; {truncated} row(s) truncated to {max_len}" if truncated else "")
                  + (f"; {empty} row(s) without loss tokens skipped" if empty else ""))  # fmt: skip
        result = trainer.run()
        # what the defaults resolved to on this machine (the settings record what was asked for)
        result.update(working_weights=working, deferred_wgrad=deferred, loader_embeddings=on_host)
        state = trainer.final_state()
        if d.is_main:
            save_output(out, cfg, state, **save_meta)
            plot_curves(out, steps, accuracy=accuracy)
            summary = {k: v for k, v in result.items() if k not in ("train", "val")}
            # val_rows: indices into --data's rows, which `eyas eval --offline` reads
            summary.update(train=result["train"], val=result["val"], accuracy=accuracy, truncated_rows=truncated,
                           skipped_rows=empty, val_rows=rows_val.tolist())  # fmt: skip
            write_manifest(out, stage=STAGE, inputs=inputs, settings=settings, outputs=summary,
                           verifier_path=info.path, data_path=str(a["data"]))  # fmt: skip
            if result["train"]:
                print_summary(result["train"], label=f"training (last {a['log_every']} steps)", accuracy=accuracy)
            if result["val"]:
                print_summary(result["val"], label="validation", accuracy=accuracy)
            print(f"\ndraft written to {out} (speculators format: config.json + model.safetensors); "
                  f"curves in {out / PLOT}, metrics in {out / METRICS}")  # fmt: skip
        d.barrier("end of training")
        return result
