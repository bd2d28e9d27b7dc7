"""Every rank must compile the same plan: plans that differ issue collectives that do not match, which
gloo reports as a "collective mismatch" deep inside a step and NCCL answers with a hang.

At each backend call the ranks all-gather their plan key on a small gloo group of dynshard's own
(it works whatever the default group's backend, and has a short timeout). Keys that differ raise
:class:`PlanMismatchError` on every rank, after a second exchange that finds what differs.

The plan itself is made once per job: rank 0 runs the policy (or reads the plan in ``cache_dir``) and
broadcasts it on the same group; the other ranks install it as a stored plan (:class:`PlanChannel`).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import pickle
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .. import compat
from ..config import Config
from ..config.planner import Planner
from ..planning import PlanFileError
from ..runtime.job import current_job
from ..runtime.mesh import Layout
from .capture import GraphInput
from .plan_cache import modes_token

# How long a rank waits for the others at a compile (read at each compile). All ranks compile the same
# graphs at about the same time, so a long wait means a rank is not coming (it compiles other graphs, or
# it failed).
TIMEOUT = datetime.timedelta(seconds=300)
_KEY_BYTES = 64
# How long the other ranks wait for rank 0's plan (read at each compile): rank 0 runs the policy meanwhile,
# which may be a long search. A rank 0 whose planning raises sends its error at once, and one that exits
# closes its connections, so this bounds only a rank 0 that hangs.
PLAN_TIMEOUT = datetime.timedelta(minutes=30)

_FIX = ("Every rank must run the same model and code, with the same dynshard config, grad/autocast mode "
        "and input shapes (the ranks of one plan unit see the same batch)")


class PlanMismatchError(RuntimeError):
    """The ranks compiled different plans (or not all of them compiled): their collectives would not match."""


class PlanningFailedError(PlanMismatchError):
    """Rank 0 failed while planning (its policy raised): what the other ranks raise instead of waiting."""


class Agreement:
    """The gloo group the keys travel on (made at the job's first compile that checks them) and the count
    of compiles checked on it: a part of the job (:func:`_agreement`), as both belong to its default group."""

    def __init__(self) -> None:
        self.store: dist.Store | None = None
        self.group: dist.ProcessGroupGloo | None = None
        self.compiles = 0

    def check(self, key: str, describe: Callable[[], dict], family: str | None = None, unit: int = 1) -> bool:
        """Whether every rank compiles ``key``; where they do not, but every rank's ``family`` is the same and
        the ranks of each unit (``unit`` consecutive ranks, which read one batch) compile one key, False
        (each unit plans its own program, see .families); else raises."""
        self.ensure_group()
        gathered = self.all_gather(key.encode().ljust(_KEY_BYTES, b"\0") + (family or "").encode(), 2 * _KEY_BYTES)
        keys, families = {g[:_KEY_BYTES] for g in gathered}, {g[_KEY_BYTES:] for g in gathered}
        units_agree = all(len({g[:_KEY_BYTES] for g in gathered[first:first + unit]}) == 1
                          for first in range(0, len(gathered), unit))
        if len(keys) > 1 and family is not None and len(families) == 1 and units_agree:
            self.compiles += 1
            return False
        if len(keys) > 1:
            descriptions = self.all_gather_object(describe())
            raise PlanMismatchError(
                f"dynshard: the ranks compiled different plans at compile #{self.compiles}, so their "
                f"collectives would not match: {explain_mismatch(descriptions)}. {_FIX}")
        self.compiles += 1
        return True

    def ensure_group(self) -> None:
        """The group of this job, made at its first use; notes how far this rank got."""
        if self.store is None:      # (keyed by the job: a later job of this process may share the store)
            self.store = dist.PrefixStore(f"dynshard/agreement/{current_job().number}", compat.default_store())
        # how far this rank got, so that a rank left waiting can name the ranks that did not come
        self.store.set(f"reached/{dist.get_rank()}", str(self.compiles))
        if self.group is None:
            try:
                self.group = dist.ProcessGroupGloo(self.store, dist.get_rank(), dist.get_world_size(), TIMEOUT)
            except RuntimeError as error:
                raise PlanMismatchError(self._absent(error)) from error

    def all_gather(self, payload: bytes, size: int) -> list[bytes]:
        """Each rank's ``payload`` (at most ``size`` bytes, zero-padded)."""
        tensor = torch.zeros(size, dtype=torch.uint8)
        tensor[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        try:
            self.group.allgather([gathered], [tensor]).wait(TIMEOUT)
        except RuntimeError as error:
            raise PlanMismatchError(self._absent(error)) from error
        return [t.numpy().tobytes() for t in gathered]

    def broadcast(self, payload: bytes | None, timeout: datetime.timedelta) -> bytes:
        """Rank 0's ``payload`` on every rank (the others pass None). Raises gloo's RuntimeError."""
        def send(tensor: torch.Tensor) -> None:
            options = dist.BroadcastOptions()
            options.rootRank, options.rootTensor, options.timeout = 0, 0, timeout
            self.group.broadcast([tensor], options).wait(timeout)

        root = dist.get_rank() == 0
        size = torch.tensor([len(payload) if root else 0], dtype=torch.int64)
        send(size)
        data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if root
                else torch.empty(int(size.item()), dtype=torch.uint8))
        send(data)
        return payload if root else data.numpy().tobytes()

    def all_gather_object(self, obj: Any) -> list[Any]:
        payload = pickle.dumps(obj)
        sizes = self.all_gather(len(payload).to_bytes(8, "little"), 8)
        size = max(int.from_bytes(s, "little") for s in sizes)
        return [pickle.loads(data) for data in self.all_gather(payload, size)]

    def _absent(self, error: Exception) -> str:
        """The message for a rank left waiting: which ranks did not come, as far as the store knows."""
        late = []
        try:
            for other in range(dist.get_world_size()):
                key = f"reached/{other}"
                if not self.store.check([key]) or int(self.store.get(key)) < self.compiles:
                    late.append(other)
        except RuntimeError:      # the store itself is gone (rank 0 exited)
            late = []
        who = f"{_ranks(late)} did not reach it" if late else "some rank did not reach it or exited"
        where = "its first dynshard compile" if self.compiles == 0 else f"its dynshard compile #{self.compiles}"
        cause = _first_line(error)
        return (f"dynshard: rank {dist.get_rank()} waited (up to {TIMEOUT.total_seconds():.0f}s) at {where} for "
                f"the other ranks and {who} (gloo: {cause}). A rank that compiles other graphs (a graph "
                "break or code path only it takes), or that failed, leaves the others without a partner for "
                f"their collectives. {_FIX}. To wait longer, set dynshard.backend.agreement.TIMEOUT "
                "(a timedelta)")

    def end_job(self) -> None:
        self.group = None


def _agreement() -> Agreement:
    """The current job's agreement."""
    return current_job().part(Agreement)


def ensure_ranks_agree(key: str, code: str, inputs: Sequence[GraphInput], config: Config,
                       layout: Layout, family: str | None = None) -> bool:
    """Raise PlanMismatchError on every rank unless all ranks compile the plan ``key``, or, given a
    ``family`` (see .families), all ranks' programs are of that family and each unit's ranks compile one key:
    then returns False where the keys differ (units holding batches of their own sizes plan their own
    programs).

    One all-gather of the key on a dynshard gloo group; nothing when this process is the whole job.
    """
    if not _checks_agreement():
        return True
    return _agreement().check(key, lambda: describe_plan(key, code, inputs, config, layout), family,
                            layout.plan_ngpus)


def ensure_ranks_communicate_alike(what: str, describe: Callable[[], str]) -> None:
    """Raise PlanMismatchError on every rank unless every rank's ``describe()`` (what a program's
    collectives carry) is the same: programs the ranks planned on their own, at their own sizes."""
    if not _checks_agreement():
        return
    agreement = _agreement()
    agreement.ensure_group()
    mine = describe()
    digest = hashlib.sha256(mine.encode()).hexdigest()[:_KEY_BYTES].encode()
    digests = agreement.all_gather(digest, _KEY_BYTES)
    if len(set(digests)) > 1:
        others = [r for r, d in enumerate(digests) if d != digests[0]]
        raise PlanMismatchError(
            f"dynshard: the ranks planned their own programs for batches of their own sizes, and {_ranks(others)} "
            f"would not communicate as rank 0 does: {what} differ (rank {dist.get_rank()}: {mine[:300]}). "
            "Keep the model's code path the same for every batch size (no Python branch on a size), or give "
            "every rank batches of the same sizes (a collator's pad_to_multiple_of, drop_last=True)")


def unit_ranks_succeeded(succeeded: bool, layout: Layout) -> bool:
    """Whether every rank of this plan unit succeeded at a step they take together (a symbolic program's
    compile), so that they go on the same way: one byte over the unit's group. Only the unit's ranks take
    it: another unit may compile the frame at another step, or not at all (see .families)."""
    if not _checks_agreement() or layout.tp_mesh is None:
        return succeeded
    device = torch.device("cuda", torch.cuda.current_device()) if layout.device_type == "cuda" else "cpu"
    flag = torch.tensor([1 if succeeded else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=layout.tp_mesh.get_group())
    return bool(flag.item())


def ensure_ranks_agree_on_source(config: Config) -> None:
    """Raise PlanMismatchError on every rank unless all ranks take their plan from the same source: a plan
    file (``load_plan_path``), autodist's search, or the policy. The first two are sent by rank 0 before the
    layout exists; a rank that does not expect that message would meet it with another collective (gloo:
    a hang or a "collective mismatch"). One all-gather of a few bytes per compile."""
    if not _checks_agreement():
        return
    source = "file" if config.load_plan_path else "autodist" if config.policy == "autodist" else \
        "planner" if isinstance(config.policy, Planner) else "policy"
    agreement = _agreement()
    agreement.ensure_group()
    sources = [s.rstrip(b"\0").decode() for s in agreement.all_gather(source.encode(), 8)]
    if len(set(sources)) > 1:
        what = {"file": "from the plan file load_plan_path (DYNSHARD_LOAD_PLAN_PATH)",
                "autodist": "from autodist's search (policy='autodist')", "planner": "from a planner (rank 0's)",
                "policy": "from the policy"}
        groups = {s: [r for r, t in enumerate(sources) if t == s] for s in dict.fromkeys(sources)}
        raise PlanMismatchError(
            "dynshard: the ranks take their plan from different sources: " + "; ".join(
                f"{_ranks(ranks)} {what[s]}" for s, ranks in groups.items())
            + f". {_FIX}; set load_plan_path, and the policy, alike on every rank")


def from_rank0(read: Callable[[], str], raises: type[Exception] = PlanFileError, what: str = "read a plan file") -> str:
    """What ``read()`` returns on rank 0, on every rank (a file only rank 0 may see, a search only rank 0
    runs). When rank 0's ``read`` raises, every rank raises: rank 0 its error, the others ``raises`` with its
    message."""
    if not _checks_agreement():
        return read()
    agreement = _agreement()
    agreement.ensure_group()
    if dist.get_rank() == 0:
        try:
            text = read()
        except Exception as error:
            agreement.broadcast(b"E" + str(error).encode(), TIMEOUT)
            raise
        agreement.broadcast(b"T" + text.encode(), TIMEOUT)
        return text
    try:
        message = agreement.broadcast(None, TIMEOUT)
    except RuntimeError as error:
        raise PlanMismatchError(f"dynshard: rank {dist.get_rank()} waited for rank 0 to {what} and it did "
                                f"not send it (gloo: {_first_line(error)}). {_FIX}") from error
    if message[:1] == b"E":
        raise raises(f"{message[1:].decode()} (rank 0)")
    return message[1:].decode()


class PlanChannel:
    """Rank 0 -> the other ranks, one message per compile that plans: the plan (the JSON text of
    ``Plan.to_json()``, as kept in ``cache_dir``) or, when rank 0's planning raised before the
    plan was sent, its error.

    Every rank of such a compile takes part (the keys agree, so all the ranks miss the plan cache or none
    does): rank 0 sends exactly one message, each other rank takes exactly one, also when it fails itself
    (:meth:`abandon`), so that the group stays in step for the next compile.
    """

    _PLAN, _ERROR = b"P", b"E"

    def __init__(self, agreement: Agreement) -> None:
        self._agreement = agreement
        self.compile = agreement.compiles - 1      # the compile the agreement check just counted
        self.planner = dist.get_rank() == 0
        self.finished = False                      # this rank's part is done (or was tried)

    def send(self, plan: str) -> None:
        """Rank 0: the plan to the other ranks."""
        self._send(self._PLAN + plan.encode())

    def receive(self) -> str:
        """The other ranks: rank 0's plan; raises :class:`PlanningFailedError` when rank 0's planning failed."""
        assert not self.planner and not self.finished, "one message per compile"
        self.finished = True
        timeout = PLAN_TIMEOUT
        try:
            message = self._agreement.broadcast(None, timeout)
        except RuntimeError as error:
            raise PlanMismatchError(
                f"dynshard: rank {dist.get_rank()} was waiting at its dynshard compile #{self.compile} for the "
                f"plan rank 0 makes, and rank 0 did not send it (gloo: {_first_line(error)}). Rank 0 exited, or "
                f"planned for longer than {timeout.total_seconds():.0f}s; its own output says why. To wait "
                "longer, set dynshard.backend.agreement.PLAN_TIMEOUT (a timedelta)") from error
        kind, body = message[:1], message[1:].decode()
        if kind == self._ERROR:
            raise PlanningFailedError(f"dynshard: rank 0 failed while planning compile #{self.compile}, so this "
                                      f"rank has no plan to compile: {body}. Rank 0's output has the traceback")
        return body

    def abandon(self, error: BaseException) -> None:
        """This rank's planning raised ``error`` before its part was done: rank 0 sends the error instead
        of the plan; another rank takes rank 0's message and drops it (it raises its own error)."""
        if self.finished:
            return
        if self.planner:
            try:
                self._send(self._ERROR + f"{type(error).__name__}: {error}".strip().encode())
            except PlanMismatchError:
                pass            # the others are gone: this rank's own error is the one to see
        elif isinstance(error, Exception):      # (not on Ctrl-C: no waiting then)
            try:
                self.receive()
            except PlanMismatchError:
                pass

    def _send(self, message: bytes) -> None:
        assert self.planner and not self.finished, "one message per compile"
        self.finished = True
        try:
            self._agreement.broadcast(message, TIMEOUT)
        except RuntimeError as error:
            raise PlanMismatchError(
                f"dynshard: rank 0 could not send its plan of compile #{self.compile} to the other ranks (gloo: "
                f"{_first_line(error)}): some rank exited or stopped waiting. {_FIX}") from error


def agreed_compiles() -> int:
    """How many compiles the ranks have agreed on so far (in this job)."""
    return _agreement().compiles


def plan_channel() -> PlanChannel | None:
    """The channel of the compile whose keys :func:`ensure_ranks_agree` just checked; None when this process
    plans alone (no process group, one process, or a group that never communicates)."""
    agreement = _agreement()
    if not _checks_agreement() or agreement.group is None:
        return None
    return PlanChannel(agreement)


def _checks_agreement() -> bool:
    return dist.is_initialized() and dist.get_world_size() >= 2 and dist.get_backend() != "fake"


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__


def describe_plan(key: str, code: str, inputs: Sequence[GraphInput], config: Config, layout: Layout) -> dict:
    """What the plan key is made of, in a form one rank can compare with another's."""
    return {
        "key": key,
        "config": json.loads(config.cache_token()),
        "inputs": [(inp.name, f"{tuple(inp.shape)} {str(inp.dtype).replace('torch.', '')}", inp.token())
                   for inp in inputs],
        "graph": hashlib.sha256(code.encode()).hexdigest(),
        "modes": modes_token(),
        "layout": layout.token(),
        "torch": torch.__version__,
    }


def explain_mismatch(descriptions: list[dict]) -> str:
    """Which ranks differ from rank 0's plan, and in what."""
    by_key: dict[str, list[int]] = {}
    for rank, description in enumerate(descriptions):
        by_key.setdefault(description["key"], []).append(rank)
    reference = descriptions[0]
    parts = []
    for key, ranks in by_key.items():
        if key == reference["key"]:
            continue
        other = descriptions[ranks[0]]
        differences = _differences(reference, other, ranks[0])
        verb = "differs" if len(ranks) == 1 else "differ"
        parts.append(f"{_ranks(ranks)} {verb} from {_ranks(by_key[reference['key']])}: " + "; ".join(differences))
    return " | ".join(parts)


def _differences(reference: dict, other: dict, other_rank: int) -> list[str]:
    def per_rank(a: Any, b: Any) -> str:
        return f"{a} on rank 0, {b} on rank {other_rank}"

    found = []
    fields = sorted(set(reference["config"]) | set(other["config"]))
    for field in fields:
        mine, theirs = reference["config"].get(field), other["config"].get(field)
        if mine != theirs:
            found.append(f"config {field} is {per_rank(repr(mine), repr(theirs))}")
    for what, title in (("modes", "grad/autocast mode"), ("layout", "world layout"), ("torch", "torch version")):
        if reference[what] != other[what]:
            found.append(f"{title} is {per_rank(reference[what], other[what])}")
    if len(reference["inputs"]) != len(other["inputs"]):
        found.append("the captured graphs differ (another model or code path): "
                     + per_rank(f"{len(reference['inputs'])} graph inputs", len(other["inputs"])))
        return found
    for (name, shape, token), (other_name, other_shape, other_token) in zip(reference["inputs"], other["inputs"]):
        if token != other_token:
            if name == other_name and shape != other_shape:
                hint = (" (under dp and ZeRO, ranks may hold their own lengths when compiled with dynamic=True; "
                        "the ranks of one plan unit read one batch)") if token.startswith("input:") else ""
                found.append(f"input {name!r} has shape {per_rank(shape, other_shape)}{hint}")
            else:
                found.append(f"graph input {per_rank(token, other_token)}")
            break
    if not found:       # (input shapes baked into the graph's code change it too: not the cause then)
        found.append("the captured graphs differ (another model or code path)")
    return found


def _ranks(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> 'ranks 0-2, 5'."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    text = ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"
