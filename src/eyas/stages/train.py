"""``eyas train``: train the EAGLE-3 draft with training-time test, offline (feature shards) or online (verifier
in the loop), resumable, under ``torchrun`` with DDP or FSDP2.

What it optimises is what inference runs: :meth:`eyas.draft.model.Eagle3Draft.ttt`
calls the same ``step`` function ``eyas eval`` drafts with, and the loss
(:mod:`eyas.training.loss`) scores step ``k`` at index ``t`` against the verifier's
distribution at ``t+1+k`` over the draft vocab.

Data (:mod:`eyas.training.batches`). Rows are packed into sequences of at most ``--max-seq-len`` tokens with document
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

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from eyas.data.vocab_map import load_vocab
from eyas.training.batches import FeatureRows, PreparedRows, row_counts
from eyas.core import fields
from eyas.core.config import StageConfig, option, recorded_settings, stage_function
from eyas.core.errors import EyasError
from eyas.core.validate import ABOVE_0, AT_LEAST_0, AT_LEAST_1, SEQ_LEN, SHARE, TOKENS
from eyas.training.loss import CHUNK_TOKENS, TargetHead
from eyas.training.precision import use_working_weights
from eyas.training.log import METRICS, PLOT, accuracy_measure, plot_curves, print_summary
from eyas.training.trainer import BEST, CHECKPOINTS, Trainer, compile_draft, save_output

STAGE = "train"


@dataclass(kw_only=True, frozen=True)
class TrainConfig(StageConfig):
    """Train an EAGLE-3 draft for a verifier with training-time test; the output dir is a speculators checkpoint.

    Offline, --data is an `eyas extract` output; with --online it is an `eyas prepare` output and the verifier
    computes the features per batch. Rerun the same command to resume from the newest checkpoint. Distributed:
    ``torchrun --nproc-per-node N -m eyas.cli train ...`` (DDP, or --dist fsdp for FSDP2)."""

    stage: ClassVar[str] = "train"

    verifier: str = fields.verifier(aliases=("--verifier-path",))
    data: str = option(
        recorded=False,
        aliases=("--data-dir",),
        help="features from `eyas extract` (offline), or prepared rows from `eyas prepare` with --online.",
    )
    out: str = fields.out(
        ": the draft (config.json + model.safetensors), checkpoints/, metrics.jsonl, tensorboard/.",
        aliases=("--output-dir",),
    )
    vocab: str | None = option(
        None,
        recorded=False,
        aliases=("--vocab-mapping-dir",),
        help="an `eyas vocab` directory (d2t.npy, t2d.npy); default: the whole verifier vocab.",
    )
    online: bool = option(
        False, help="run the verifier in the loop on prepared rows (nothing written to disk but the draft)."
    )
    layers: list[int] | None = option(
        None,
        recorded=False,
        help="three aux layer ids (online only; offline they come from the features); default [2, L//2, L-3].",
    )
    epochs: int = option(10, range=AT_LEAST_1, help="passes over the training rows.")
    lr: float = option(1e-4, range=ABOVE_0, help="peak learning rate.")
    max_seq_len: int = option(
        2048, range=SEQ_LEN, help="tokens per packed sequence; longer rows are truncated (and counted)."
    )
    batch_tokens: int | None = option(
        None, range=TOKENS, help="tokens per micro-batch and rank, a multiple of --max-seq-len (default: one sequence)."
    )
    grad_accum: int = option(1, range=AT_LEAST_1, help="micro-batches per rank and optimizer step.")
    ttt_steps: int = option(
        3,
        range=AT_LEAST_1,
        help="training-time-test steps (tokens drafted per position); also the draft's speculative_tokens.",
    )
    step_loss_decay: float = option(
        1.0, range=AT_LEAST_0, help="weight of TTT step k is decay**k (1: every step equally)."
    )
    val_ratio: float = option(0.02, range=SHARE, help="share of rows held out for validation at each epoch's end.")
    num_workers: int = option(2, recorded=False, range=AT_LEAST_0, help="DataLoader worker processes.")
    warmup_steps: int | None = option(None, range=AT_LEAST_0, help="linear warmup steps (default: 3% of all steps).")
    schedule: Literal["cosine", "linear", "constant"] = option("cosine", help="learning-rate decay after warmup.")
    weight_decay: float = option(0.0, range=AT_LEAST_0, help="AdamW weight decay on matrices (norms never decay).")
    clip: float = option(0.5, range=AT_LEAST_0, help="gradient-norm clip (0: off).")
    seed: int = option(
        0, range=AT_LEAST_0, help="seeds the draft's init, the validation split and each epoch's packing order."
    )
    save_every: int = option(
        1000,
        recorded=False,
        range=AT_LEAST_0,
        help="checkpoint every N optimizer steps (and at each epoch's end; 0: only there).",
    )
    keep_checkpoints: int = option(2, recorded=False, range=AT_LEAST_1, help="how many checkpoints to keep.")
    log_every: int = option(
        10, recorded=False, range=AT_LEAST_1, help="log metrics (and sync the device) every N steps."
    )
    optimizer: Literal["adamw", "muon"] = option(
        "adamw", help="adamw, or muon (speculators' default: Muon on matrices, AdamW on norms and lm_head)."
    )
    freeze_lm_head: bool = option(
        False, help="keep lm_head at the verifier's rows (speculators 0.9 does; EAGLE trains it)."
    )
    drop_out_of_vocab: bool = option(
        False,
        help="no loss where the verifier's full-vocab argmax is outside the draft "
        "vocab (EAGLE's choice; needs --full-vocab-accuracy).",
    )
    aligned_loss: bool = option(
        False,
        recorded="when set",
        help="TTT step k carries loss only where the draft drew the verifier's token at every step before it "
        "(GRIFFIN's token-alignable training, top-1 for a chain): decoding never reaches step k past a rejected "
        "draft, so the step stops learning from states it is never fed.",
    )
    full_vocab_accuracy: bool = option(
        True,
        help="score accuracy against the verifier's full-vocab argmax (costs one "
        "pass over the head); without it accuracy is within the draft vocab "
        "and overstates tau.",
    )
    dist: Literal["ddp", "fsdp"] = option("ddp", help="under torchrun: ddp (replicated) or fsdp (FSDP2 fully_shard).")
    device: str | None = fields.device()
    device_map: str | dict[str, Any] | None = fields.device_map(
        "; with --online only, while the draft trains on --device."
    )
    # how a step runs, not what it computes (not recorded), from here to --loader-embeddings
    compile: bool | None = option(
        None,
        recorded=False,
        help="torch.compile the draft layer and the loss, and online the verifier's layers (symbolic shapes; "
        "default: on CUDA).",
    )
    verifier_attention: Literal["sdpa", "flex"] = option(
        "sdpa",
        recorded=False,
        help="online: the verifier's attention over the packed sequences: sdpa (transformers' block-diagonal "
        "mask, dense: every query against its sequence's whole length) or flex (transformers' flex_attention: "
        "the mask as a BlockMask, each query's own row's key blocks only).",
    )
    gradient_checkpointing: bool = option(
        False,
        recorded=False,
        help="recompute each TTT step's layer in backward: far less "
        "activation memory (long sequences, big drafts) for about a "
        "third more layer compute.",
    )
    working_weights: bool | None = option(
        None,
        recorded=False,
        help="compute with working copies of the weights cast once per "
        "optimizer step, the weight gradients coming out of their "
        "matmuls in fp32 (default: on, except under --dist fsdp, which "
        "casts its gathered shards itself).",
    )
    deferred_wgrad: bool | None = option(
        None,
        recorded=False,
        help="with working weights, accumulate each layer weight's gradient "
        "over the TTT steps in one fp32 buffer by its matmuls, handing "
        "autograd the sum once instead of forming one gradient per step "
        "and adding them (2 GiB less peak at Kimi-K2.5 dims; default: on "
        "with working weights and without --gradient-checkpointing, whose "
        "recomputed layer would use each weight again).",
    )
    loader_embeddings: bool | None = option(
        None,
        recorded=False,
        help="keep the frozen embedding in host memory and let the data "
        "loader look each batch's rows up, instead of holding the "
        "table on the device (1 GiB at Llama-3.1-8B's vocab, 2.2 GiB "
        "at Kimi-K2.5's; default: on for offline training on CUDA with "
        "loader workers and without --dist fsdp).",
    )
    # the draft's shape, from here to --head-dim (and --layers): recorded as the DraftConfig it makes
    norm_before_residual: bool = option(
        False,
        recorded=False,
        help="layout variant: residual = hidden_norm(h) (speculators' default; served by vLLM, by no SGLang release).",
    )
    norm_before_fc: bool = option(
        False,
        recorded=False,
        help="layout variant: one RMSNorm over the three concatenated aux states "
        "before fc (gpt-oss drafts; served by vLLM >= 0.19.0 and SGLang >= "
        "0.5.17).",
    )
    fc_norm: bool = option(
        False,
        recorded=False,
        help="layout variant (the EAGLE-3.1 paper's): an RMSNorm over each aux state before "
        "fc; excludes --norm-before-fc (served by vLLM >= 0.25.0 and SGLang >= 0.5.12).",
    )
    norm_output: bool = option(
        False,
        recorded=False,
        help="layout variant (EAGLE-3.1): the next step reads the normed output instead "
        "of the pre-norm one (served by vLLM >= 0.25.0 and SGLang >= 0.5.12).",
    )
    draft_arch: Literal["llama", "qwen3"] = option(
        "llama",
        recorded=False,
        help="the draft's decoder layer: llama (EAGLE-3), or qwen3 (an RMSNorm over each query and key head "
        "before RoPE, speculators' default draft layer; served by vLLM >= 0.24.0, by no SGLang release).",
    )
    num_layers: int = option(
        1,
        recorded=False,
        help="draft decoder layers: the first reads the token embedding and the hidden state, "
        "each later one the previous layer's output (served by vLLM >= 0.11.1 and SGLang "
        ">= 0.5.12).",
    )
    intermediate_size: int | None = option(
        None, recorded=False, range=AT_LEAST_1, help="draft MLP width (default: the verifier's)."
    )
    num_attention_heads: int | None = option(
        None,
        recorded=False,
        range=AT_LEAST_1,
        help="draft query heads (default: the verifier's; MLA verifiers: as many).",
    )
    num_key_value_heads: int | None = option(
        None, recorded=False, range=AT_LEAST_1, help="draft KV heads (default: the verifier's; MLA verifiers: 8)."
    )
    head_dim: int | None = option(
        None, recorded=False, range=AT_LEAST_1, help="draft head dim (default: the verifier's, or hidden / heads)."
    )
    # (recorded: the name config.json records; another one is another output)
    verifier_name: str | None = option(
        None, help="verifier name_or_path written into config.json for vLLM (default: the --verifier path)."
    )
    max_steps: int | None = option(
        None, range=AT_LEAST_1, help="stop after N optimizer steps (smoke runs and benchmarks)."
    )
    profile_every: int = option(
        0,
        recorded=False,
        range=AT_LEAST_0,
        help="every N steps, sync at phase boundaries and log data/verifier/targets/forward/backward/optimizer "
        "times (ms; verifier: the online forward).",
    )
    loss_chunk_tokens: int = option(
        CHUNK_TOKENS,
        recorded=False,
        range=AT_LEAST_1,
        help="positions per chunk of the fused loss (its logits buffer is "
        "this x the draft vocab); positions no TTT step scores "
        "(prompts, packing padding) are skipped in whole chunks of "
        "this size.",
    )

    def check(self) -> None:
        from eyas.verifier.info import check_aux_layer_ids

        if self.max_seq_len < self.ttt_steps + 2:
            raise EyasError(f"--ttt-steps must be >= 1 and --max-seq-len >= ttt_steps + 2 (got {self.ttt_steps}, "
                            f"{self.max_seq_len})")  # fmt: skip
        if self.batch_tokens is not None and self.batch_tokens % self.max_seq_len:
            raise EyasError(f"--batch-tokens {self.batch_tokens} must be a multiple of --max-seq-len "
                            f"{self.max_seq_len}")  # fmt: skip
        if self.drop_out_of_vocab and not self.full_vocab_accuracy:
            raise EyasError("--drop-out-of-vocab needs the verifier's full-vocab argmax (to know which positions "
                            "fall outside the draft vocab), which --no-full-vocab-accuracy skips computing: drop one "
                            "of them")  # fmt: skip
        if self.layers is not None:  # (the verifier's layer count is checked when it is read)
            check_aux_layer_ids(self.layers)


def run(c: TrainConfig) -> dict[str, Any]:
    """Run `eyas train` as ``c`` describes (see :class:`TrainConfig`); distributed when started under torchrun."""
    from eyas.core import dist as _dist

    kind = c.device or ("cuda" if torch.cuda.is_available() else "cpu")
    with _dist.init(device_type="cuda" if kind.startswith("cuda") else "cpu") as d:
        return _train(d, c)


train = stage_function(TrainConfig, run, "train")


def check_batch_memory(*, max_len: int, batch_tokens: int, grad_accum: int, hidden: int, dtype: torch.dtype,
                       where: torch.device) -> None:  # fmt: skip
    """Refuse, before anything is allocated, a batch that cannot fit: a step's batches hold ``grad_accum *
    batch_tokens`` padded positions, each with four verifier states of ``hidden`` (and its ids, positions, masks
    and targets) on the host, and again on a GPU. A lower bound (activations come on top), so it refuses only the
    impossible: without it, ``--max-seq-len 1000000000`` is killed by the kernel at 23 GB without a word."""
    from eyas.core.files import human_bytes
    from eyas.core.memory import free_memory
    from eyas.data.features import NUM_STATES

    per_token = NUM_STATES * hidden * dtype.itemsize + 4 * 8
    need = grad_accum * batch_tokens * per_token
    places = [("host memory", free_memory("cpu"))]
    if where.type == "cuda":
        places.append((f"memory free on {where}", free_memory(where)))
    for what, free in places:
        if free is not None and need > free:
            raise EyasError(f"--max-seq-len {max_len} (--batch-tokens {batch_tokens}, --grad-accum {grad_accum}) needs "
                            f"at least {human_bytes(need)} of {what} for a step's batches, but there is "
                            f"{human_bytes(free)}: lower --max-seq-len or --batch-tokens")  # fmt: skip


def _train(d, c: TrainConfig) -> dict[str, Any]:
    from eyas.draft.attention import default_attn_implementation
    from eyas.core.files import read_json, sha256_json
    from eyas.core.manifest import MANIFEST, StageOutput
    from eyas.draft.model import DraftConfig, Eagle3Draft
    from eyas.verifier.compile import compile_work
    from eyas.verifier.load import build_text_model, load_head_tensors
    from eyas.verifier.info import check_aux_layer_ids, fingerprint, resolve

    out = Path(c.out)
    info = resolve(c.verifier)
    where = d.device(c.device)
    cuda = where.type == "cuda"
    if cuda:
        torch.cuda.set_device(where)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    compute_dtype = torch.bfloat16 if cuda else torch.float32
    fp = fingerprint(info)
    batch_tokens = c.batch_tokens or c.max_seq_len

    # ---- inputs, all checked before anything runs
    if c.device_map is not None and (not c.online or d.active):
        raise EyasError("--device-map spreads the verifier of an --online run over the GPUs of one process; it "
                        "needs --online and no torchrun")  # fmt: skip
    if c.online:
        from eyas.data.prepared import prepared_verifier

        source = PreparedRows(c.data)
        if prepared_verifier(source.manifest) != fp:
            raise EyasError(f"the prepared rows in {c.data} were tokenized for another verifier "
                            f"({source.manifest.get('verifier_path', 'unknown')}), not {info.path}; run `eyas prepare` "
                            "with this --verifier")  # fmt: skip
        layer_ids = check_aux_layer_ids(c.layers or info.aux_layer_ids, info.num_hidden_layers)
    else:
        from eyas.data.features import read_features_manifest

        fm = read_features_manifest(c.data)
        if int(fm["hidden_size"]) != info.hidden_size:
            raise EyasError(f"the features in {c.data} have hidden size {fm['hidden_size']} but {info.path} has "
                            f"{info.hidden_size}")  # fmt: skip
        if fm.get("inputs", {}).get("verifier") != fp:
            raise EyasError(f"the features in {c.data} were extracted from another verifier "
                            f"({fm.get('verifier_path', 'unknown')}), not {info.path}: train with the verifier they "
                            "came from, or run `eyas extract` with this one")  # fmt: skip
        layer_ids = check_aux_layer_ids(fm["layer_ids"], info.num_hidden_layers,  # a damaged or hand-made manifest
                                        what=f"the layer_ids of {Path(c.data) / MANIFEST}")  # fmt: skip
        if c.layers is not None and sorted(c.layers) != layer_ids:
            raise EyasError(f"--layers {c.layers} differs from the layers the features hold ({layer_ids}); "
                            "drop --layers or extract those layers")  # fmt: skip
        source = FeatureRows(c.data, dtype=compute_dtype)
    d2t, t2d, vocab_id = load_vocab(c.vocab, vocab_size=info.vocab_size)
    overrides = {k: getattr(c, k) for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads",
                                            "head_dim") if getattr(c, k) is not None}  # fmt: skip
    try:
        cfg = DraftConfig.from_verifier(info.text_config, draft_vocab_size=len(d2t), aux_layer_ids=layer_ids,
                                        norm_before_residual=c.norm_before_residual,
                                        norm_before_fc=c.norm_before_fc, fc_norm=c.fc_norm,
                                        norm_output=c.norm_output, draft_arch=c.draft_arch,
                                        num_hidden_layers=c.num_layers, **overrides)  # fmt: skip
    except (ValueError, KeyError) as e:
        raise EyasError(f"cannot shape a draft for {info.path}: {e}") from e
    if c.dist == "fsdp" and c.optimizer == "muon" and d.active:
        raise EyasError("--optimizer muon needs whole matrices; use --dist ddp with it")
    check_batch_memory(max_len=c.max_seq_len, batch_tokens=batch_tokens, grad_accum=c.grad_accum,
                       hidden=info.hidden_size, dtype=compute_dtype, where=where)  # fmt: skip

    flat, offsets = source.masks()
    lengths, counts = row_counts(flat, offsets, max_len=c.max_seq_len, ttt_steps=c.ttt_steps)
    truncated = int((np.diff(offsets) > c.max_seq_len).sum())
    perm = np.random.default_rng(c.seed).permutation(len(lengths))
    n_val = int(round(len(lengths) * c.val_ratio)) if c.val_ratio > 0 else 0
    n_val = min(max(n_val, 1 if c.val_ratio > 0 and len(lengths) > 1 else 0), len(lengths) - 1)
    rows_val = np.sort(perm[:n_val])
    rows_train = np.sort(perm[n_val:])
    empty = int((counts[rows_train, 0] == 0).sum())
    rows_train = rows_train[counts[rows_train, 0] > 0]  # no scored position: nothing to learn from
    if not len(rows_train):
        raise EyasError(f"{c.data} has no training row with a loss-masked token past position 1")

    # the draft's shape (--layers, --num-layers, the layout variants) is recorded as the DraftConfig it makes
    settings = recorded_settings(c, batch_tokens=batch_tokens, world_size=d.world_size,
                                 dist=c.dist if d.active else None, draft=cfg.to_dict(),
                                 compute_dtype=str(compute_dtype).removeprefix("torch."))  # fmt: skip
    inputs = {"verifier": fp, "data": source.identity(), "vocab": vocab_id,
              # the template the rows were rendered with, for `eyas eval` to compare (offline: through extract)
              "chat_template_sha256": source.manifest.get("inputs", {}).get("chat_template_sha256")}  # fmt: skip
    run_id = sha256_json({"inputs": inputs, "settings": settings})

    with StageOutput(out, stage=STAGE, d=d) as output:

        def open_out() -> dict[str, Any] | None:  # on rank 0: the finished output, or None: there is work
            finished = output.up_to_date(inputs=inputs, settings=settings, other="a draft")
            if finished is None:
                for tmp in (out / CHECKPOINTS).glob(".step-*"):  # left by a killed run; the lock says none is alive
                    shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
            return finished

        m = d.run_on_main(open_out)
        if m is not None:
            if d.is_main:
                print(f"{out}: already trained ({m['outputs']['steps']} steps); nothing to do")
            return m["outputs"]
        d.barrier("output directory")

        # ---- the draft, its targets, the verifier (online)
        torch.manual_seed(c.seed)
        draft = Eagle3Draft(cfg, attn_implementation=default_attn_implementation(where))
        heads = load_head_tensors(info)
        target_ids = torch.arange(len(d2t)) + d2t
        draft.init_from_verifier(embed=heads.embed, lm_head_rows=heads.lm_head[target_ids])
        draft.set_vocab(d2t=d2t, t2d=t2d)
        draft.lm_head.weight.requires_grad_(not c.freeze_lm_head)
        draft.gradient_checkpointing = c.gradient_checkpointing
        fsdp = d.active and c.dist == "fsdp"
        # by default only with loader workers: the main process, which launches the GPU's work, gathers nothing
        on_host = c.loader_embeddings if c.loader_embeddings is not None else \
            cuda and not c.online and not fsdp and c.num_workers > 0  # fmt: skip
        if on_host and (c.online or fsdp):
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
        if c.freeze_lm_head and not fsdp:  # (an FSDP2 unit wants one dtype)
            draft.lm_head.to(compute_dtype)  # frozen too: no fp32 master copy either
        rest_ids = torch.from_numpy(np.flatnonzero(~t2d.numpy()))
        use_rest = c.full_vocab_accuracy and len(rest_ids) > 0
        accuracy = accuracy_measure(use_rest or len(rest_ids) == 0)
        head_w = draft.lm_head.weight
        # a frozen lm_head holds exactly the verifier's draft-vocab rows: the targets share its memory
        rows = head_w.detach() if c.freeze_lm_head and head_w.dtype == compute_dtype else \
            heads.lm_head[target_ids].to(where, compute_dtype)  # fmt: skip
        head = TargetHead.for_verifier(info, rows=rows, draft_target_ids=target_ids.to(where),
                                       rest=heads.lm_head[rest_ids].to(where, compute_dtype) if use_rest else None,
                                       rest_ids=rest_ids.to(where) if use_rest else None, dtype=compute_dtype,
                                       device=where)  # fmt: skip
        del heads
        working = c.working_weights if c.working_weights is not None else not fsdp
        if working and fsdp:
            raise EyasError("--working-weights does not combine with --dist fsdp (FSDP2 casts its gathered shards "
                            "itself); drop the flag")  # fmt: skip
        deferred = c.deferred_wgrad if c.deferred_wgrad is not None else \
            working and not c.gradient_checkpointing  # fmt: skip
        if deferred and (not working or c.gradient_checkpointing):
            raise EyasError("--deferred-wgrad needs working weights and no --gradient-checkpointing (a recomputed "
                            "layer would use each weight again); drop one of them")  # fmt: skip
        if working:
            # lm_head: the fused loss casts it once per micro-batch; fc runs once per forward, so a copy kept
            # between steps would only hold memory (0.3 GiB at Kimi-K2.5 dims)
            use_working_weights(draft, compute_dtype, skip=(draft.lm_head,), cast_per_call=(draft.fc,))
        compiled = c.compile if c.compile is not None else cuda
        if compiled:
            compile_draft(draft)
        # --verifier-attention flex: packed rows (the recipe's: about 320 tokens each in sequences of 2,048) under
        # SDPA's dense mask cost every sequence's whole length of keys a query; a BlockMask skips the blocks of other
        # rows. The first micro-batch's check against each row alone (Trainer._packing_kept_rows_apart) still runs.
        verifier_model = build_text_model(
            info, dtype=compute_dtype, device=None if c.device_map else where, device_map=c.device_map,
            attn_implementation="flex_attention" if c.verifier_attention == "flex" else None,
        ) if c.online else None  # fmt: skip
        archs = (
            []
            if info.gguf_file
            else read_json(info.checkpoint_dir / "config.json", what="verifier config").get("architectures") or []
        )
        if not archs:  # a GGUF file has no config.json: name transformers' class for its model type
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

            archs = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[info.text_model_type]] \
                if info.text_model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else []  # fmt: skip
        save_meta = {"verifier_name": c.verifier_name or info.path, "architectures": archs, "ttt_steps": c.ttt_steps}
        trainer = Trainer(c, d=d, device=where, cfg=cfg, draft=draft, head=head, source=source,
                          verifier_model=verifier_model, layer_ids=layer_ids, rows_train=rows_train, rows_val=rows_val,
                          lengths=lengths, counts=counts, compiled=compiled, deferred_wgrad=deferred,
                          fingerprint=run_id, save_meta=save_meta,
                          loader_embed=draft.embed_tokens.weight.detach() if on_host else None)  # fmt: skip
        if d.is_main:
            trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
            print(f"eyas train: {len(rows_train)} rows ({int(lengths[rows_train].sum()):,} tokens) for training, "
                  f"{len(rows_val)} for validation; {trainer.total} steps over {c.epochs} epoch(s), "
                  f"{d.world_size} rank(s) x {c.grad_accum} x {batch_tokens} tokens; draft {trainable / 1e6:.1f}M "
                  f"trainable parameters, vocab {len(d2t)}/{info.vocab_size}, layers {layer_ids}, "
                  f"{'online' if c.online else 'offline'}, {where}"
                  + (f"; {truncated} row(s) truncated to {c.max_seq_len}" if truncated else "")
                  + (f"; {empty} row(s) without loss tokens skipped" if empty else ""))  # fmt: skip
        compiled_before = compile_work()
        result = trainer.run()
        # what the defaults resolved to on this machine (the settings record what was asked for), and how often
        # torch.compile compiled in this run and for how long (the draft's TTT step, the loss, the verifier's
        # layers online): a shape that compiles again at every step shows as many compiles
        compiled_after = compile_work()
        result.update(working_weights=working, deferred_wgrad=deferred, loader_embeddings=on_host,
                      compiles=compiled_after[0] - compiled_before[0],
                      compile_seconds=round(compiled_after[1] - compiled_before[1], 1))  # fmt: skip
        state = trainer.final_state()
        if result["val"]:  # what the validation tau is an average over (it is not eval's tau: see `covers`)
            result["val"] = {**result["val"], "covers": validation_coverage(rows_val, lengths, counts)}
        val = result["val"]
        if d.is_main:
            save_output(out, cfg, state, **save_meta)
            plot_curves(out, c.ttt_steps, accuracy=accuracy)
            summary = {k: v for k, v in result.items() if k not in ("train", "val")}
            # val_rows: indices into --data's rows, which `eyas eval --offline` reads
            summary.update(train=result["train"], val=val, accuracy=accuracy, truncated_rows=truncated,
                           skipped_rows=empty, val_rows=rows_val.tolist())  # fmt: skip
            output.finish(outputs=summary, verifier_path=info.path, data_path=str(c.data))
            if result["train"]:
                print_summary(result["train"], label=f"training (last {c.log_every} steps)", accuracy=accuracy)
            if result["val"]:
                print_summary(result["val"], label="validation", accuracy=accuracy)
                print(f"  over {val['covers']['what']}")
            if result["compiles"]:
                print(f"torch.compile: {result['compiles']} compile(s), {result['compile_seconds']} s")
            print(f"\ndraft written to {out} (speculators format: config.json + model.safetensors); "
                  f"curves in {out / PLOT}, metrics in {out / METRICS}")  # fmt: skip
            if result.get("best"):
                b = result["best"]
                print(f"the best validation tau, {b['tau']:.3f}, was at step {b['step']} ({b['epochs']:g} epochs): "
                      f"that draft is in {out / BEST}" + (" (the same as the last)" if b["step"] == result["steps"]
                                                          else ""))  # fmt: skip
        d.barrier("end of training")
        return result


def validation_coverage(rows_val, lengths, counts) -> dict[str, Any]:
    """Which rows and lengths train's validation tau covers: its held-out rows, their token lengths, and the
    positions it pools. That tau is :func:`eyas.training.loss.implied_tau` of accuracy pooled over every loss-masked
    position of whole rows (every assistant turn, to its end), while decoding starts a round only where the last
    one ended and stops at eval's ``--max-new-tokens``: `eyas eval --offline` walks the turns as decoding does."""
    n = np.asarray(lengths)[rows_val] if len(rows_val) else np.zeros(0, dtype=np.int64)
    scored = int(np.asarray(counts)[rows_val, 0].sum()) if len(rows_val) else 0
    out = {"rows": int(len(rows_val)), "tokens": int(n.sum()), "scored_positions": scored,
           "row_tokens_mean": round(float(n.mean()), 1) if len(n) else 0.0,
           "row_tokens_max": int(n.max()) if len(n) else 0}  # fmt: skip
    out["what"] = (f"{out['rows']} held-out rows ({out['tokens']:,} tokens, {out['row_tokens_mean']:.0f} a row on "
                   f"average, at most {out['row_tokens_max']}), every one of their {scored:,} assistant positions "
                   "pooled, whole turns however long; eval's tau walks rounds over at most --max-new-tokens a turn "
                   "(`eyas eval --offline` predicts that)")  # fmt: skip
    return out
