"""Process groups for ``torchrun``: one place that starts them, with a timeout, for every stage.

``torchrun --nproc-per-node N -m eyas.cli STAGE ...`` sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` and ``MASTER_ADDR``/``MASTER_PORT``; :func:`init`
reads them and returns a :class:`Dist`. Without them it returns the
single-process null object, so a stage writes one code path with no ``if
distributed`` branches.

The default backend is NCCL on CUDA and gloo on CPU. Control messages
(barriers, "rank 0 says stop" broadcasts, small Python objects) always go
through a gloo group, so they work the same on both and a barrier can be
*monitored*: a rank that died or hangs makes the others fail with its number
within the timeout instead of hanging forever (torch's ``monitored_barrier``
exists for gloo only).
"""

from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import torch

from eyas.core.errors import EyasError

#: How long a collective waits for the other ranks before giving up (seconds). torch's own default is 30
#: minutes for gloo and 10 for NCCL; a stage that does long per-rank work between barriers may need more.
DEFAULT_TIMEOUT_S = 1800.0
TIMEOUT_ENV = "EYAS_DIST_TIMEOUT_S"

T = TypeVar("T")


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        raise EyasError(f"environment variable {name}={os.environ[name]!r} is not an integer") from None


@dataclass
class Dist:
    """Who this process is in the job and how to talk to the others.

    With ``world_size == 1`` every collective is a no-op and :meth:`run_on_main`
    simply calls its function, so callers never test for distributed runs.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    _control: Any = field(default=None, repr=False)  # the gloo group for barriers and objects

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def device(self, kind: str | None = None) -> torch.device:
        """The device this rank computes on: ``cuda:LOCAL_RANK`` for CUDA, else ``kind`` (default: cuda if any)."""
        kind = kind or ("cuda" if torch.cuda.is_available() else "cpu")
        if kind == "cuda" or (kind.startswith("cuda:") and self.active):  # one GPU per rank under torchrun
            return torch.device("cuda", self.local_rank)
        return torch.device(kind)

    def barrier(self, what: str = "barrier") -> None:
        """Wait for every rank; a rank that died or is stuck makes this raise (naming it) within the timeout."""
        if not self.active:
            return
        import torch.distributed as td

        try:
            td.monitored_barrier(
                group=self._control, timeout=_dt.timedelta(seconds=self.timeout_s), wait_all_ranks=True
            )
        except RuntimeError as e:  # gloo reports dead peers and timeouts as RuntimeError subclasses
            raise EyasError(
                f"rank {self.rank}/{self.world_size}: another rank did not reach the {what} "
                f"within {self.timeout_s:.0f} s or died ({_first_line(e)}); stopping. Look at the other "
                f"ranks' output for the cause, then run the same command again to resume"
            ) from e

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank (any picklable object)."""
        if not self.active:
            return obj
        import torch.distributed as td

        box = [obj if self.is_main else None]
        try:
            td.broadcast_object_list(box, src=0, group=self._control)
        except RuntimeError as e:
            raise EyasError(f"rank {self.rank}: lost contact with rank 0 ({_first_line(e)}); stopping") from e
        return box[0]

    def all_gather(self, obj: T) -> list[T]:
        """Every rank's ``obj``, in rank order."""
        if not self.active:
            return [obj]
        import torch.distributed as td

        out: list[Any] = [None] * self.world_size
        try:
            td.all_gather_object(out, obj, group=self._control)
        except RuntimeError as e:
            raise EyasError(f"rank {self.rank}: lost contact with the other ranks ({_first_line(e)}); stopping") from e
        return out

    def run_on_main(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on rank 0 only and hand its result to every rank; if it raises an :class:`EyasError`, every
        rank raises the same message (instead of the others waiting at the next barrier until the timeout)."""
        result: tuple[str, Any] = ("ok", None)
        if self.is_main:
            try:
                result = ("ok", fn())
            except EyasError as e:
                if not self.active:
                    raise
                result = ("error", str(e))
        result = self.broadcast(result)
        if result[0] == "error":
            raise EyasError(result[1])
        return result[1]

    def __enter__(self) -> "Dist":
        return self

    def __exit__(self, exc_type, *_: object) -> None:
        # after an error a peer may be dead: no barrier that would only wait out the timeout
        self.close(sync=exc_type is None)

    def close(self, *, sync: bool = True) -> None:
        """Tear the process group down (safe to call twice, and on the null object).

        ``sync``: first wait for every rank to get here, so no rank closes its connections while a peer is still
        in a collective with it (one candidate cause of a rank's abort at the end of a run, seen once in CI). Pass
        ``sync=False`` on an error path, where a peer may be dead and the barrier would only wait out the
        timeout."""
        if self.active:
            import torch.distributed as td

            if td.is_initialized():
                if sync:
                    self.barrier("end of the run")
                td.destroy_process_group()


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0] if s else type(e).__name__


def init(*, device_type: str | None = None, timeout_s: float | None = None) -> Dist:
    """Join the ``torchrun`` job described by the environment, or return the single-process :class:`Dist`.

    ``device_type`` ("cuda" or "cpu") picks NCCL or gloo for the default group;
    control messages always use a gloo group. ``timeout_s`` (default
    ``$EYAS_DIST_TIMEOUT_S`` or 30 minutes) bounds every collective.
    """
    world = _env_int("WORLD_SIZE", 1)
    if timeout_s is None:
        try:
            timeout_s = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
        except ValueError:
            raise EyasError(f"{TIMEOUT_ENV}={os.environ[TIMEOUT_ENV]!r} is not a number of seconds") from None
    if world <= 1:
        return Dist(timeout_s=timeout_s)
    import torch.distributed as td

    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise EyasError(f"WORLD_SIZE={world} but {var} is not set: start distributed runs with torchrun")
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = "nccl" if device_type == "cuda" else "gloo"
    timeout = _dt.timedelta(seconds=timeout_s)
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
    if not td.is_initialized():
        try:
            td.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **kwargs)
        except (RuntimeError, ValueError) as e:
            raise EyasError(f"rank {rank}/{world}: could not join the process group ({_first_line(e)})") from e
    control = td.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    return Dist(rank=rank, world_size=world, local_rank=local_rank, backend=backend, timeout_s=timeout_s,
                _control=control)  # fmt: skip
