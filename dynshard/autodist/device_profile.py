"""A device and its links as the cost model reads them (:class:`DeviceProfile`): achieved rates, each
collective's time by size, a kernel's launch and how long a collective waits for the slowest rank; the
built-in profiles (``"cpu"``: this project's machine, calibrated; ``"cuda"``: H100/NVLink estimates), and
:func:`load_profile` (a built-in by name, or a file ``python -m dynshard.calibrate`` wrote).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """One rank's device and its links: achieved rates, not datasheet peaks."""

    name: str
    flops_per_s: float
    bytes_per_s: float
    alpha_s: dict           # collective kind -> seconds per call
    bandwidth: dict         # collective kind -> bytes per second (bus bandwidth)
    skew: float = 0.0       # seconds per sqrt(second of compute since the last collective): its wait for peers
    table: dict = dataclasses.field(default_factory=dict)   # collective kind -> ((whole bytes, seconds a call), ...)
    table_ranks: int = 0    # the group size ``table`` was measured over (other sizes: alpha-beta)
    launch_s: float = 0.0   # seconds a kernel costs beyond its work: its launch and the host's work around it

    def collective_seconds(self, kind: str, whole_bytes: float, group: int, calls: int = 1) -> float:
        """``calls`` calls of ``kind`` over ``group`` ranks moving ``whole_bytes`` between them: measured per size
        where the profile has a table for that group (gloo's bandwidth falls by half beyond a few MB, as the
        buffers leave the caches: no one line fits 4 KB and 16 MB), else ``alpha + ring * bytes / bandwidth``."""
        if group <= 1 or whole_bytes <= 0:
            return 0.0
        points = self.table.get(kind) if group == self.table_ranks else None
        if points:
            return calls * _interpolated(points, whole_bytes / calls)
        ring = 2 * (group - 1) / group if kind == "all_reduce" else (group - 1) / group
        return calls * self.alpha_s[kind] + ring * whole_bytes / self.bandwidth[kind]

    def meeting_seconds(self, meetings: float, compute_seconds: float) -> float:
        """What ``meetings`` collectives spread over ``compute_seconds`` of compute wait for the slowest rank."""
        return self.skew * math.sqrt(meetings * compute_seconds) if meetings > 0 and compute_seconds > 0 else 0.0

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        if not self.table:          # (a profile without one reads, and hashes, as before tables existed)
            del data["table"], data["table_ranks"]
        if not self.launch_s:       # (likewise)
            del data["launch_s"]
        return json.dumps(data, sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "DeviceProfile":
        data = json.loads(text)
        table = {k: tuple((float(b), float(t)) for b, t in data["table"][k]) for k in KINDS if k in data.get("table", {})}
        return cls(data["name"], float(data["flops_per_s"]), float(data["bytes_per_s"]),
                   {k: float(data["alpha_s"][k]) for k in KINDS}, {k: float(data["bandwidth"][k]) for k in KINDS},
                   float(data.get("skew", 0.0)), table, int(data.get("table_ranks", 0)) if table else 0,
                   float(data.get("launch_s", 0.0)))

    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]


def _interpolated(points, size: float) -> float:
    """Seconds of one call moving ``size`` bytes, read off measured (bytes, seconds) points: linear between
    them, the smallest's below them (latency), the last segment's slope beyond them."""
    if size <= points[0][0]:
        return points[0][1]
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
        if size <= b1:
            return t0 + (t1 - t0) * (size - b0) / (b1 - b0)
    (b0, t0), (b1, t1) = points[-2], points[-1]
    return t1 + (t1 - t0) * (size - b1) / (b1 - b0)


def _uniform(name: str, flops: float, bandwidth: float, alpha: float, link: float) -> DeviceProfile:
    return DeviceProfile(name, flops, bandwidth, {k: alpha for k in KINDS}, {k: link for k in KINDS})


# Built-in constants when no calibration file is given: a CPU core per rank with gloo over loopback (what
# ``dynshard.calibrate`` measured on this project's 2-core x86 machine, 2 ranks, rounded; per size for groups
# of 2), and an H100 with
# NCCL over NVLink (achieved, not peak: ~60% of dense bf16 / HBM, NCCL's bus bandwidth; a launch as an H200's
# host issued one, measured).
DEFAULT_PROFILES = {
    "cpu": DeviceProfile("cpu-gloo (built-in)", 1e11, 5e10,
                         {"all_reduce": 2.5e-4, "all_gather": 2e-4, "reduce_scatter": 3.5e-4, "all_to_all": 1.5e-4},
                         {"all_reduce": 2e9, "all_gather": 1.5e9, "reduce_scatter": 5e8, "all_to_all": 1.5e9},
                         skew=0.027, table_ranks=2, table={      # (3 calibrations' mean, made non-decreasing)
        "all_reduce": ((4096, 0.00035), (16384, 0.00035), (65536, 0.0004), (262144, 0.0004), (1048576, 0.00059),
                       (4194304, 0.002), (16777216, 0.011)),
        "all_gather": ((8192, 0.00023), (32768, 0.00023), (131072, 0.00025), (524288, 0.00036), (2097152, 0.0009),
                       (8388608, 0.0038), (33554432, 0.031)),
        "reduce_scatter": ((4096, 0.00032), (16384, 0.00035), (65536, 0.0004), (262144, 0.00043),
                           (1048576, 0.00095), (4194304, 0.0035), (16777216, 0.014)),
        "all_to_all": ((4096, 0.00018), (16384, 0.00018), (65536, 0.00018), (262144, 0.00025), (1048576, 0.00046),
                       (4194304, 0.0013), (16777216, 0.0052))}, launch_s=3e-6),
    "cuda": dataclasses.replace(_uniform("cuda-nccl (built-in)", 4e14, 2e12, 2e-5, 1.5e11), launch_s=1e-5),
}


def load_profile(source: "str | os.PathLike | DeviceProfile | None", device_type: str) -> DeviceProfile:
    """A device profile: given, a built-in by name ("cpu", "cuda": planning offline for GPUs on a CPU
    machine), a file ``python -m dynshard.calibrate`` wrote, or (None) the built-in for ``device_type``.
    Raises ValueError saying what could not be read."""
    if isinstance(source, DeviceProfile):
        return source
    if source is None:
        return DEFAULT_PROFILES["cuda" if device_type == "cuda" else "cpu"]
    if source in DEFAULT_PROFILES:
        return DEFAULT_PROFILES[source]
    try:
        with open(os.fspath(source)) as f:
            return DeviceProfile.from_json(f.read())
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"dynshard: cannot read the device profile {os.fspath(source)!r}: {error}. Write one with "
                         "python -m dynshard.calibrate, or name a built-in: "
                         f"{', '.join(map(repr, DEFAULT_PROFILES))}") from error
