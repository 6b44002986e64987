"""What training reports: per-TTT-step loss and accuracy summed on the device (:class:`Meter`), rank 0's
progress bar, ``metrics.jsonl`` and TensorBoard (:class:`RunLog`), ``training_curves.png`` and the printed
summary."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from eyas.training.loss import STAT_COLUMNS, summarize

METRICS = "metrics.jsonl"
PLOT = "training_curves.png"


class Meter:
    """Device-side sums since the last log (no host sync in the hot loop); :meth:`collect` reduces over ranks."""

    def __init__(self, ttt_steps: int, device: torch.device) -> None:
        self.ttt_steps, self.device = ttt_steps, device
        self.reset()

    def reset(self) -> None:
        self.stats = torch.zeros(self.ttt_steps, len(STAT_COLUMNS), dtype=torch.float64, device=self.device)
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


def plot_curves(out: Path, ttt_steps: int, *, accuracy: str) -> None:
    """``training_curves.png``: loss and accuracy per TTT step over training (lines) and validation (dots);
    ``accuracy`` (:func:`accuracy_measure`) titles the accuracy panel."""
    try:
        import matplotlib
    except ImportError:  # a dependency of eyas, but a bare GPU box running from source may lack it
        print(f"matplotlib is not installed: no {PLOT} (the metrics are in {METRICS})")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from eyas.core.files import atomic_path

    recs = [json.loads(ln) for ln in (out / METRICS).read_text().splitlines() if ln]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for k in range(ttt_steps):
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
