"""The training loop: one :class:`Trainer` per process runs the epochs (every rank the same code, rank 0 also
writes), with the draft and its loss as one module (:class:`TTTObjective`) under DDP or FSDP2.

Each optimizer step runs ``--grad-accum`` micro-batches per rank from :mod:`eyas.training.batches` (their tensors copied
to the device on a side stream while the previous step computes), syncs gradients on the last, clips and steps
(:mod:`eyas.training.optim`). Metrics are summed on the device and reduced over ranks only when logged
(:mod:`eyas.training.log`). Checkpoints (``checkpoints/step-N``: a loadable speculators checkpoint plus
``trainer_state.pt`` with the fp32 weights, optimizer state, RNG and data position) are written atomically; a
rerun resumes from the newest. A non-finite loss or gradient stops the run before anything is saved from it.

(Over 500 lines: :class:`Trainer` is one object whose loop, device pipeline, checkpoints and logs read and write
the same state, the step counters, the optimizers and the last metrics; split, each part would take it all.)
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn

from eyas.training.batches import HOST_KEYS, Step, StepData, plan_epoch
from eyas.core.errors import EyasError
from eyas.training.loss import CHUNK_TOKENS, TargetHead, Targets, step_masks, ttt_loss
from eyas.training.optim import build_optimizers, clip_gradients, lr_factor
from eyas.training.precision import FusedAdamW, begin_deferred_wgrad, refresh_working_weights, stage_deferred_use
from eyas.training.log import Meter, RunLog, flat_metrics

CHECKPOINTS = "checkpoints"
#: the draft of the validation with the highest tau, beside the last one (the stage's output): peers' drafts peak
#: after a few epochs (one Qwen3-4B run: best at 4.6 epochs, lower by 10; DESIGN.md), speculators keeps its
#: `checkpoint_best` likewise. With the checkpoints: work a rerun resumes, not one of the files the stage's
#: manifest records (a rerun could not remake it once its checkpoint has been rotated out)
BEST = Path(CHECKPOINTS) / "best"
BEST_FILE = "best.json"
STATE_FILE = "trainer_state.pt"
STATE_FORMAT = "eyas-train-state/1"


# --------------------------------------------------------------------------- the objective


class TTTObjective(nn.Module):
    """The draft plus its loss in one module, so DDP and FSDP2 see every use of ``lm_head`` inside ``forward``."""

    def __init__(self, draft, *, ttt_steps: int, step_weights: list[float], drop_out_of_vocab: bool,
                 compute_dtype: torch.dtype, compiled: bool, chunk_tokens: int = CHUNK_TOKENS,
                 deferred_wgrad: bool = False, aligned: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.draft = draft
        self.ttt_steps, self.drop, self.compute_dtype = ttt_steps, drop_out_of_vocab, compute_dtype
        self.aligned = aligned  # ttt_loss' aligned (--aligned-loss)
        self.compiled, self.chunk_tokens, self.deferred_wgrad = compiled, chunk_tokens, deferred_wgrad
        self.register_buffer("step_weights", torch.tensor(step_weights, dtype=torch.float64), persistent=False)

    def forward(self, input_ids, doc_ids, position_ids, aux, loss_mask, target_logits, target_argmax, in_vocab,
                denom, inputs_embeds=None, scored_rows=None):  # fmt: skip
        refresh_working_weights(self.draft)  # the optimizer moved the masters; compiled regions cannot check
        before_step = None
        if self.deferred_wgrad and torch.is_grad_enabled():  # each layer weight is used once per TTT step
            # staged with fixed TTT shapes: every step's compiled code reads its sink from slot 0, one version
            staged = self.draft.ttt_fixed_shapes
            begin_deferred_wgrad(self.draft, uses=self.ttt_steps, lead_shape=tuple(input_ids.shape), staged=staged)
            before_step = functools.partial(stage_deferred_use, self.draft) if staged else None
        normed = self.draft.ttt(input_ids, aux, ttt_steps=self.ttt_steps, doc_ids=doc_ids, position_ids=position_ids,
                                inputs_embeds=inputs_embeds, before_step=before_step)  # fmt: skip
        valid = step_masks(loss_mask, doc_ids, self.ttt_steps).flatten(1)  # [S, B*T]
        scale = (self.step_weights / denom.clamp(min=1)).float()  # [S]
        targets = Targets(target_logits, target_argmax, in_vocab)
        return ttt_loss([h.flatten(0, 1) for h in normed], self.draft.lm_head.weight, targets, valid, scale,
                        drop_out_of_vocab=self.drop, compute_dtype=self.compute_dtype,
                        chunk_tokens=self.chunk_tokens, compiled=self.compiled, rows=scored_rows,
                        aligned=self.aligned)  # fmt: skip


def read_best(out: str | os.PathLike) -> dict[str, Any] | None:
    """What ``OUT/checkpoints/best/best.json`` says of the draft kept there (``step``, ``epochs``, validation
    ``tau``), or None where there is none (no held-out rows) or it cannot be read."""
    try:
        return json.loads((Path(out) / BEST / BEST_FILE).read_text())
    except (OSError, ValueError):
        return None


def compile_draft(draft) -> None:
    """Compile the draft for training in place (state-dict keys unchanged): each TTT step's layer, attention
    included, and final norm as one region (:meth:`eyas.draft.model.Eagle3Draft.ttt_block`). Each region costs the
    host a guard check and an autograd wrapper per call, forward and backward, and the step is host-bound at
    2048 tokens: one region per TTT step (before commit e2b6822 there were four: the layer's halves around an
    eager attention call that ran its own compiled flex kernel, and the norm). Every TTT step has the same shapes
    (the steps not yet run as zero keys no query sees: TTTContext's ``fixed_steps``), and the deferred weight
    gradients are staged through one slot, so the region compiles once with gradients and once without
    (validation) instead of once a step each way (6 compiles at 3 TTT steps, now 2)."""
    draft.ttt_fixed_shapes = True  # every TTT step one shape: one compile, not one a step (TTTContext)
    draft.ttt_block = torch.compile(draft.ttt_block, dynamic=False)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)


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
                ttt_steps: int) -> None:  # fmt: skip
    """A speculators-format checkpoint (config.json + bf16 model.safetensors) from a draft state dict."""
    from eyas.draft.checkpoint import save_draft
    from eyas.draft.model import Eagle3Draft

    with torch.device("meta"):
        skeleton = Eagle3Draft(cfg)
    skeleton.load_state_dict(state, strict=False, assign=True)
    save_draft(path, skeleton, verifier_name_or_path=verifier_name, verifier_architectures=architectures,
               ttt_steps=ttt_steps)  # fmt: skip


# --------------------------------------------------------------------------- the trainer


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


def loader_error(source: Any, e: RuntimeError) -> Exception:
    """The error to raise for a DataLoader that failed: a worker killed by SIGBUS (a memory-mapped shard cut short
    under it: torch blames shared memory, or says the worker exited unexpectedly) becomes one line naming the
    shard whose size no longer matches its manifest; anything else is ``e`` itself."""
    reader = getattr(source, "reader", None)
    if reader is None or not any(w in str(e) for w in ("Bus error", "killed by signal", "exited unexpectedly")):
        return e
    for s in reader.shards:
        p = reader.path / s["file"]
        size = p.stat().st_size if p.is_file() else None
        if size != s["bytes"]:
            return EyasError(f"feature shard {p} changed while training read it ({size if size is not None else 'no'} "
                             f"bytes, its manifest says {s['bytes']}): it was cut short or replaced under the run; "
                             f"extract it again (`eyas extract --verify {reader.path}` names every damaged shard), "
                             "then rerun the same train command to resume")  # fmt: skip
    return e


class Trainer:
    """Runs the epochs: one instance per process, every rank the same code (rank 0 also writes).

    ``c`` is the train stage's config (:class:`eyas.stages.train.TrainConfig`, a stage above this package): the
    trainer reads its hyperparameters and run controls from it (``epochs``, ``lr``, ``max_seq_len``,
    ``batch_tokens``, ``grad_accum``, ``ttt_steps``, ``step_loss_decay``, ``warmup_steps``, ``schedule``,
    ``weight_decay``, ``clip``, ``seed``, ``optimizer``, ``drop_out_of_vocab``, ``aligned_loss``, ``dist``,
    ``num_workers``, ``save_every``, ``keep_checkpoints``, ``log_every``, ``max_steps``, ``profile_every``,
    ``loss_chunk_tokens``, ``out``). What the stage resolved on this machine comes beside it: ``compiled`` and
    ``deferred_wgrad``."""

    def __init__(self, c, *, d, device: torch.device, cfg, draft, head: TargetHead, source, verifier_model,
                 layer_ids: list[int], rows_train: np.ndarray, rows_val: np.ndarray, lengths: np.ndarray,
                 counts: np.ndarray, compiled: bool, deferred_wgrad: bool, fingerprint: str, save_meta: dict[str, Any],
                 loader_embed: torch.Tensor | None = None) -> None:  # fmt: skip
        self.d, self.device, self.cfg, self.c, self.out = d, device, cfg, c, Path(c.out)
        self.seqs_per_micro_batch = (c.batch_tokens or c.max_seq_len) // c.max_seq_len
        self.head, self.source, self.verifier, self.layer_ids = head, source, verifier_model, layer_ids
        # the online verifier's layers compiled (until a compiler error says otherwise); not one spread over
        # devices, whose layers accelerate's hooks wrap to move tensors between them
        self.compile_verifier = (
            compiled and verifier_model is not None and not getattr(verifier_model, "hf_device_map", None)
        )
        # the online verifier over the packed sequences as they are (None: not yet checked against each row alone;
        # False: this verifier's attention does not keep packed rows apart, so rows run alone in groups)
        self.verifier_packed: bool | None = None
        self.lengths, self.fingerprint, self.save_meta = lengths, fingerprint, save_meta
        self.loader_embed = loader_embed  # the frozen embedding in host memory, looked up by the loader
        self.cuda = device.type == "cuda"
        self.compute_dtype = torch.bfloat16 if self.cuda else torch.float32
        W, G = d.world_size, c.grad_accum
        plan = dict(max_len=c.max_seq_len, seqs_per_micro_batch=self.seqs_per_micro_batch, seed=c.seed)
        self.plans = [plan_epoch(rows_train, lengths, counts, epoch=e, shuffle=True, micro_batches_per_step=G * W,
                                 **plan) for e in range(c.epochs)]  # fmt: skip
        self.val_plan = plan_epoch(rows_val, lengths, counts, epoch=0, shuffle=False, micro_batches_per_step=W,
                                   **plan) if len(rows_val) else []  # fmt: skip
        self.total = sum(len(p) for p in self.plans)
        if c.max_steps is not None:
            self.total = min(self.total, c.max_steps)
        self.warmup = c.warmup_steps if c.warmup_steps is not None else max(1, round(0.03 * self.total))
        self.draft = draft
        objective = TTTObjective(draft, ttt_steps=c.ttt_steps,
                                 step_weights=[c.step_loss_decay**k for k in range(c.ttt_steps)],
                                 drop_out_of_vocab=c.drop_out_of_vocab, compute_dtype=self.compute_dtype,
                                 compiled=compiled, deferred_wgrad=deferred_wgrad,
                                 chunk_tokens=c.loss_chunk_tokens, aligned=c.aligned_loss)  # fmt: skip
        # train() has placed the draft; a blanket .to(device) here would also copy the embedding that
        # --loader-embeddings keeps in host memory onto the device (as it did before commit 936a0af)
        objective.step_weights = objective.step_weights.to(device)
        self.model, self.loss_factor = self._parallelize(objective, c.dist)
        self.optimizers = build_optimizers(self.model, name=c.optimizer, lr=c.lr, weight_decay=c.weight_decay,
                                           fused=not (self.d.active and c.dist == "fsdp"))  # fmt: skip
        for opt in self.optimizers:
            if isinstance(opt, FusedAdamW):
                opt.attach_working(draft)
        self.base_lrs = [[g["lr"] for g in opt.param_groups] for opt in self.optimizers]
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.meter = Meter(c.ttt_steps, device)
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.cuda else contextlib.nullcontext()
        self.global_step, self.epoch, self.step_in_epoch = 0, 0, 0
        self.saved_step = -1
        self.rates: list[tuple[int, float]] = []
        self.timings: list[dict[str, float]] = []
        self.last_train: dict[str, Any] | None = None
        self.last_val: dict[str, Any] | None = None
        self.val_step = -1  # the step last validated at
        self.best: dict[str, Any] | None = None  # {"step", "epochs", "tau"} of the draft in OUT/checkpoints/best

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
        ds = StepData(self.source, steps, rank=self.d.rank, grad_accum=grad_accum, max_len=self.c.max_seq_len,
                      seqs=self.seqs_per_micro_batch, lengths=self.lengths, embed=self.loader_embed,
                      ttt_steps=self.c.ttt_steps, chunk=self.c.loss_chunk_tokens)  # fmt: skip
        w = self.c.num_workers
        return torch.utils.data.DataLoader(ds, batch_size=None, shuffle=False, num_workers=w, pin_memory=self.cuda,
                                           prefetch_factor=4 if w else None, worker_init_fn=_worker_init if w else None)  # fmt: skip

    # ------------------------------------------------------------------ one step

    def _features(self, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if "aux" in mb:
            return mb["aux"], mb["last"]
        B, S = mb["input_ids"].shape
        H = self.cfg.target_hidden_size or self.cfg.hidden_size
        if not mb["row_ids"].shape[0]:
            return (torch.zeros(B, S, 3 * H, dtype=self.compute_dtype, device=self.device),
                    torch.zeros(B, S, H, dtype=self.compute_dtype, device=self.device))  # fmt: skip
        if self.verifier_packed is not False:
            aux, last = self._verifier_forward(lambda: self._packed_states(mb))
            if self.verifier_packed is None:
                self.verifier_packed = self._packing_kept_rows_apart(mb, aux, last)
            if self.verifier_packed:
                return aux, last
        return self._verifier_forward(lambda: self._grouped_states(mb))

    def _verifier_forward(
        self, fn: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``fn()`` (a forward of the online verifier) with its layers compiled with symbolic shapes (one compile
        for every shape) until a compiler error says otherwise: a small verifier's eager forward is bound by its
        element-wise kernels, which the compiled layers fuse."""
        from eyas.verifier.compile import run_dynamic

        out, self.compile_verifier = run_dynamic(self.verifier, fn, compile=self.compile_verifier,
                                                 what="the online verifier's forwards")  # fmt: skip
        return out

    def _packed_states(self, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The verifier over the micro-batch's packed ``[B, S]`` sequences, each row's positions from 0 and no
        attention mask: transformers' masks then keep every row to itself (its packed-sequence detection from
        ``position_ids``, ``transformers.masking_utils.find_packed_sequence_indices``, as in padding-free
        training). Why: no padding and one forward, where rows alone in groups still computed on 1.9x the real
        tokens of SmolLM2's answers; 1.8x the tokens/s of the groups on an H100 (bench/online_verifier.py).
        The sequences' unused tails read id 0 at position 0, each its own one-token row; no loss reads them."""
        from eyas.verifier.load import forward_hidden_states

        aux, last = forward_hidden_states(self.verifier, mb["input_ids"], layer_ids=self.layer_ids,
                                          position_ids=mb["position_ids"])  # fmt: skip
        return aux.to(self.compute_dtype), last.to(self.compute_dtype)  # [B, S, 3H], [B, S, H]

    def _grouped_states(self, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The verifier over each row alone, right-padded, in groups of similar lengths each padded to its own
        longest (:meth:`eyas.training.batches.StepData._verifier_rows`), scattered into the packed batch's places;
        zeros elsewhere. For a verifier whose attention ignores packing, and as the packed forward's check."""
        from eyas.verifier.load import forward_hidden_states

        B, S = mb["input_ids"].shape
        H = self.cfg.target_hidden_size or self.cfg.hidden_size
        # the rows alone stay on the host until a forward needs them (batches.HOST_KEYS)
        ids, attn, src, dst = (mb[k].to(self.device, non_blocking=True) for k in ("row_ids", "row_attn", "src", "dst"))
        parts_a, parts_h = [], []
        for start, end, width in mb["row_groups"].tolist():
            a, h = forward_hidden_states(self.verifier, ids[start:end, :width], layer_ids=self.layer_ids,
                                         attention_mask=attn[start:end, :width])  # fmt: skip
            parts_a.append(a.reshape(-1, 3 * H))  # [rows * width, 3H]
            parts_h.append(h.reshape(-1, H))
        aux = torch.zeros(B * S, 3 * H, dtype=self.compute_dtype, device=self.device)
        last = torch.zeros(B * S, H, dtype=self.compute_dtype, device=self.device)
        aux[dst] = torch.cat(parts_a)[src].to(self.compute_dtype)
        last[dst] = torch.cat(parts_h)[src].to(self.compute_dtype)
        return aux.view(B, S, 3 * H), last.view(B, S, H)

    def _packing_kept_rows_apart(self, mb: dict[str, torch.Tensor], aux: torch.Tensor, last: torch.Tensor) -> bool:
        """Whether the packed forward's states on the first micro-batch equal each row's alone (the groups'): a
        verifier whose attention ignores ``position_ids`` would let packed rows attend to each other, silently.
        Equal means a mean relative difference per token under 5% (bfloat16 rounding through a few dozen
        layers stays near 1%; a row that sees another's tokens differs at the size of its states)."""
        ref_aux, ref_last = self._verifier_forward(lambda: self._grouped_states(mb))
        dst = mb["dst"].to(self.device)
        got = torch.cat([aux.flatten(0, 1)[dst], last.flatten(0, 1)[dst]], -1).float()  # [real tokens, 4H]
        ref = torch.cat([ref_aux.flatten(0, 1)[dst], ref_last.flatten(0, 1)[dst]], -1).float()
        diff = float(((got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)).mean())
        if diff < 0.05:
            return True
        if self.d.is_main:
            print(f"train: this verifier's attention does not keep packed rows apart (their states differ from "
                  f"each row's alone by {diff:.1%}); it runs on each row alone, in groups (slower)")  # fmt: skip
        return False

    def _forward(
        self, mb: dict[str, torch.Tensor], denom: torch.Tensor, timer: _Timer
    ) -> tuple[torch.Tensor, torch.Tensor]:
        aux, last = self._features(mb)
        timer.mark("verifier")  # online: the verifier's forward; offline: the features' gather only
        targets = self.head(last.flatten(0, 1), pad=self.c.ttt_steps, rows=mb.get("target_rows"))
        timer.mark("targets")
        with self.autocast:
            return self.model(mb["input_ids"], mb["doc_ids"], mb["position_ids"], aux, mb["loss_mask"],
                              targets.logits, targets.argmax, targets.in_vocab, denom,
                              inputs_embeds=mb.get("inputs_embeds"), scored_rows=mb.get("scored_rows"))  # fmt: skip

    def _to_device(self, item: dict[str, Any]) -> dict[str, Any]:
        """A loader item with its tensors (``denom`` and every micro-batch's) moved to the device."""
        return dict(item, denom=item["denom"].to(self.device, non_blocking=True),
                    micro_batches=[{k: v if k in HOST_KEYS else v.to(self.device, non_blocking=True)
                                    for k, v in mb.items()} for mb in item["micro_batches"]])  # fmt: skip

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
            for t in [item["denom"], *(v for mb in item["micro_batches"] for k, v in mb.items() if k not in HOST_KEYS)]:
                t.record_stream(compute)  # allocated on the side stream, used (and freed) on this one
            nxt = next(items, None)
            pending = load(nxt) if nxt is not None else None
            yield item

    def train_step(self, item: dict[str, Any], timer: _Timer) -> None:
        """One optimizer step on an item from :meth:`_prefetch` (its tensors on the device)."""
        denom, mbs = item["denom"], item["micro_batches"]
        for i, mb in enumerate(mbs):
            with self._sync(i == len(mbs) - 1):
                loss, stats = self._forward(mb, denom, timer)
                timer.mark("forward")
                (loss * self.loss_factor).backward()
                timer.mark("backward")
            self.meter.add(loss, stats)
        gnorm = clip_gradients(self.params, self.optimizers, self.c.clip) if self.c.clip > 0 else None
        f = lr_factor(self.global_step, total=self.total, warmup=self.warmup, schedule=self.c.schedule)
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

        meter = Meter(self.c.ttt_steps, self.device)
        items = self._prefetch(iter(self._loader(self.val_plan, 1)))
        for item in tqdm(items, total=len(self.val_plan), desc="validate", unit="step", leave=False,
                         disable=not self.d.is_main, dynamic_ncols=True):  # fmt: skip
            for mb in item["micro_batches"]:
                loss, stats = self._forward(mb, item["denom"], _Timer(self.device, False))
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
        from eyas.core.files import atomic_path

        local = [p.to_local() if hasattr(p, "to_local") else p for p in self.params]
        finite = torch.stack([torch.isfinite(p).all() for p in local]).all().float()
        if self.d.active:
            torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
        self._check({"finite": bool(finite)})
        msd, osd = self._state()
        # a validation since the last checkpoint with a higher tau than any before: this checkpoint's draft is
        # the best one
        fresh = self.last_val is not None and self.val_step == self.global_step
        better = fresh and (self.best is None or self.last_val["tau"] > self.best["tau"])
        if better:  # epochs: passes done (the epoch's end has advanced self.epoch; a --max-steps stop, a fraction)
            done = self.epoch + self.step_in_epoch / max(len(self.plans[min(self.epoch, len(self.plans) - 1)]), 1)
            self.best = {"step": self.global_step, "epochs": round(done, 3), "tau": self.last_val["tau"]}
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
            "metrics": json.dumps(
                {
                    "train": self.last_train,
                    "val": self.last_val,
                    "rates": self.rates,
                    "val_step": self.val_step,
                    "best": self.best,
                }
            ),
        }
        self.saved_step = self.global_step
        path = self.out / CHECKPOINTS / f"step-{self.global_step:08d}"
        try:
            with atomic_path(path, is_dir=True) as tmp:
                save_output(tmp, self.cfg, _draft_state(msd), **self.save_meta)
                torch.save(state, tmp / STATE_FILE)
        except (OSError, RuntimeError, EyasError) as e:  # a full disk reaches torch.save as a RuntimeError
            from eyas.core.files import out_of_room

            cause = e.__cause__ if isinstance(e, EyasError) and e.__cause__ is not None else e
            why = out_of_room(cause) or f"{type(cause).__name__}: {cause}"
            free = shutil.disk_usage(self.out).free / 2**30
            kept = checkpoint_dirs(self.out)
            raise EyasError(f"writing checkpoint {path} failed ({why}); {free:.1f} GiB free on its "
                            "disk. Nothing half-written was left; "
                            + (f"the newest complete checkpoint, {kept[-1].name}, is kept: " if kept else "")
                            + "free space (or lower --keep-checkpoints) and rerun the same command to resume"
                            ) from e  # fmt: skip
        if better:
            self._keep_best(path)
        for old in checkpoint_dirs(self.out)[: -max(1, self.c.keep_checkpoints)]:
            shutil.rmtree(old)
        self.d.barrier("checkpoint")

    def _keep_best(self, checkpoint: Path) -> None:
        """OUT/checkpoints/best becomes the draft of ``checkpoint`` (hard links to its files, so it costs no copy
        and outlives the checkpoint's removal) with ``best.json`` saying which step and tau it is."""
        from eyas.core.files import atomic_path

        with atomic_path(self.out / BEST, is_dir=True) as tmp:
            for f in checkpoint.iterdir():
                if f.is_file() and f.name != STATE_FILE:
                    try:
                        os.link(f, tmp / f.name)
                    except OSError:  # a filesystem without hard links
                        shutil.copy2(f, tmp / f.name)
            (tmp / BEST_FILE).write_text(json.dumps(self.best))

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
        self.val_step, self.best = metrics.get("val_step", -1), metrics.get("best")
        if self.d.is_main and self.best is not None and self._best_on_disk() != self.best["step"]:
            # killed between the checkpoint and the best draft's links: link it now (the newest checkpoint, so kept)
            kept = self.out / CHECKPOINTS / f"step-{self.best['step']:08d}"
            if kept.is_dir():
                self._keep_best(kept)
        self.rates = [tuple(r) for r in metrics.get("rates", [])]
        torch.set_rng_state(state["rng"])
        if self.cuda and state["cuda_rng"].numel():
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        return path

    def _best_on_disk(self) -> int | None:
        """The step of the draft OUT/checkpoints/best holds, if any."""
        best = read_best(self.out)
        return best.get("step") if isinstance(best, dict) else None

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

    def _phases(self) -> list[str]:
        """The step phases timed so far (``--profile-every``), in the order marked."""
        return list(dict.fromkeys(k for t in self.timings for k in t))

    def _log_train(self, log: RunLog, window_start: float) -> None:
        m = self.meter.collect(self.d)
        self._check(m)
        seconds = time.perf_counter() - window_start
        self.rates.append((m["tokens"], seconds))
        rec = {"split": "train", "step": self.global_step, "epoch": self.epoch, "lr": self.optimizers[-1].param_groups[0]["lr"],
               "grad_norm": m["grad_norm"], "tokens_per_s": m["tokens"] / max(seconds, 1e-9), **flat_metrics(m)}  # fmt: skip
        if self.timings:
            for name in self._phases():
                rec[f"ms_{name}"] = sum(t.get(name, 0.0) for t in self.timings) / len(self.timings)
        log.record(rec)
        self.last_train = m

    def _validate(self, log: RunLog) -> None:
        log.status("validating")
        self.last_val = self.validate()
        self.val_step = self.global_step
        log.status()
        if self.last_val is not None:
            log.record({"split": "val", "step": self.global_step, "epoch": self.epoch, **flat_metrics(self.last_val)})

    def _save(self, log: RunLog) -> None:
        log.status("writing checkpoint")  # seconds at real dims: fp32 weights and optimizer state, fsynced
        self.save()
        log.status()

    def run(self) -> dict[str, Any]:
        c = self.c
        resumed = self.resume()
        if resumed and self.d.is_main:
            print(f"resuming from {resumed} (step {self.global_step}, epoch {self.epoch + 1})")
        log = RunLog(self.out, enabled=self.d.is_main, total=self.total, start=self.global_step)
        try:
            while self.epoch < c.epochs and self.global_step < self.total:
                steps = self.plans[self.epoch]
                it = self._prefetch(iter(self._loader(steps[self.step_in_epoch :], c.grad_accum)))
                window = time.perf_counter()
                while self.step_in_epoch < len(steps) and self.global_step < self.total:
                    timer = _Timer(self.device, bool(c.profile_every) and self.global_step % c.profile_every == 0)
                    try:
                        item = next(it)
                    except RuntimeError as e:
                        raise loader_error(self.source, e) from e
                    timer.mark("data")
                    self.train_step(item, timer)
                    if timer.enabled:
                        self.timings.append(timer.ms)
                    self.global_step += 1
                    self.step_in_epoch += 1
                    end = self.step_in_epoch == len(steps) or self.global_step == self.total
                    save = not end and c.save_every > 0 and self.global_step % c.save_every == 0
                    if save or end or self.global_step % c.log_every == 0:
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
            "best": self.best,
        }
        if self.timings:
            out["ms_per_step"] = {k: float(np.median([t.get(k, 0.0) for t in self.timings]))
                                  for k in self._phases()}  # fmt: skip
        if self.cuda:
            out["peak_memory_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return out


def _worker_init(_worker_id: int) -> None:
    torch.set_num_threads(1)  # loaders slice and copy; the compute threads belong to the trainer
    # A time limit's SIGTERM reaches the whole process group (`timeout`, batch schedulers), the workers too: ended
    # by it, a worker's death surfaced in the trainer as a RuntimeError ahead of the interrupt that stops the run
    # cleanly. As a KeyboardInterrupt, torch's worker loop ends quietly (as on Ctrl-C) and the trainer's own
    # interrupt handling shuts the loader down.
    signal.signal(signal.SIGTERM, _worker_sigterm)


def _worker_sigterm(_signum: int, _frame: Any) -> None:
    """A loader worker's first SIGTERM as Ctrl-C; any later one ends it at once, without Python: the trainer's
    loader shutdown terminates a worker still exiting (slow on a busy machine), and an interrupt raised in its
    exit finalizers printed a traceback. The worker counts as exiting from here: its thread that hands the
    trainer the file descriptors of shared tensors (multiprocessing.resource_sharer) then drops a fetch the
    interrupted trainer abandoned quietly, where it printed that connection's traceback (it checks
    ``multiprocessing.util.is_exiting()``)."""
    import multiprocessing.util

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    multiprocessing.util._exiting = True  # what is_exiting() reads; its own exit handler sets it later
    raise KeyboardInterrupt
