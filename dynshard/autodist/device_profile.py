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
    rates: dict = dataclasses.field(default_factory=dict)   # FLOPs' class -> FLOP/s where not flops_per_s (RATES)
    fused_attention: bool = False   # F.scaled_dot_product_attention runs as one fused kernel (a GPU's flash or
                                    # memory-efficient attention), priced as :mod:`.fused_attention` says
    node_ranks: int = 0     # ranks on one host; a group spanning hosts moves its bytes at ``inter_node_bandwidth``
    inter_node_bandwidth: dict = dataclasses.field(default_factory=dict)   # collective kind -> bus bandwidth
    overlap: bool = False   # collectives run beside compute (NCCL's own streams): see the cost model
    source: str = ""        # where the constants come from (the profile's documentation)

    def flop_seconds(self, flops: float, rate: str = "") -> float:
        """``flops`` of the class ``rate`` (:data:`RATES`) at the rate this device runs them."""
        return flops / self.rates.get(rate, self.flops_per_s) if flops else 0.0

    def spans_hosts(self, group: int, stride: int = 1) -> bool:
        """Whether a group of ``group`` ranks, ``stride`` apart, holds ranks of more than one host (ranks are
        numbered host by host, as torchrun numbers them)."""
        return self.node_ranks > 0 and (group - 1) * stride >= self.node_ranks

    def collective_seconds(self, kind: str, whole_bytes: float, group: int, calls: int = 1, stride: int = 1) -> float:
        """``calls`` calls of ``kind`` over ``group`` ranks ``stride`` apart moving ``whole_bytes`` between them:
        measured per size where the profile has a table for that group (gloo's bandwidth falls by half beyond a
        few MB, as the buffers leave the caches: no one line fits 4 KB and 16 MB), else ``alpha + ring * bytes /
        bandwidth``, at the inter-node bandwidth where the group spans hosts (a ring is as fast as its slowest
        link)."""
        if group <= 1 or whole_bytes <= 0:
            return 0.0
        points = self.table.get(kind) if group == self.table_ranks else None
        if points:
            return calls * _interpolated(points, whole_bytes / calls)
        ring = 2 * (group - 1) / group if kind == "all_reduce" else (group - 1) / group
        return calls * self.alpha_s[kind] + ring * whole_bytes / self.bus_bandwidth(kind, group, stride)

    def bus_bandwidth(self, kind: str, group: int, stride: int = 1) -> float:
        """A collective's bus bandwidth over ``group`` ranks ``stride`` apart: NVLink's inside a host, the
        network's across hosts."""
        if self.inter_node_bandwidth and self.spans_hosts(group, stride):
            return self.inter_node_bandwidth[kind]
        return self.bandwidth[kind]

    def meeting_seconds(self, meetings: float, compute_seconds: float) -> float:
        """What ``meetings`` collectives spread over ``compute_seconds`` of compute wait for the slowest rank."""
        return self.skew * math.sqrt(meetings * compute_seconds) if meetings > 0 and compute_seconds > 0 else 0.0

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        if not self.table:          # (a profile without one reads, and hashes, as before tables existed)
            del data["table"], data["table_ranks"]
        if not self.launch_s:       # (likewise)
            del data["launch_s"]
        for name, default in _LATER_FIELDS.items():     # (likewise)
            if data[name] == default:
                del data[name]
        return json.dumps(data, sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "DeviceProfile":
        data = json.loads(text)
        table = {k: tuple((float(b), float(t)) for b, t in data["table"][k]) for k in KINDS if k in data.get("table", {})}
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)}")
        return cls(data["name"], float(data["flops_per_s"]), float(data["bytes_per_s"]),
                   {k: float(data["alpha_s"][k]) for k in KINDS}, {k: float(data["bandwidth"][k]) for k in KINDS},
                   float(data.get("skew", 0.0)), table, int(data.get("table_ranks", 0)) if table else 0,
                   float(data.get("launch_s", 0.0)), {str(k): float(v) for k, v in data.get("rates", {}).items()},
                   bool(data.get("fused_attention", False)), int(data.get("node_ranks", 0)),
                   {k: float(data["inter_node_bandwidth"][k]) for k in KINDS} if data.get("inter_node_bandwidth")
                   else {}, bool(data.get("overlap", False)), str(data.get("source", "")))

    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]


_LATER_FIELDS = {"rates": {}, "fused_attention": False, "node_ranks": 0, "inter_node_bandwidth": {}, "overlap": False,
                 "source": ""}


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


# What a training step sustains of the kernels' rates measured alone (clocks under sustained power, NCCL's
# kernels sharing the SMs while they overlap compute): fitted on MosaicML's MPT-7B runs on 8 A100s (0.78) and
# 8 H100s (0.69), their geometric mean; checked against torchtitan's runs (docs/device-profiles.md)
SUSTAINED = 0.74


def _gpu(name: str, *, bf16: float, fp32: float, attention: float, hbm: float, all_reduce: float, ring: float,
         network: float, source: str) -> DeviceProfile:
    """A GPU of an 8-GPU host (NVLink inside, one NIC per GPU across hosts) with NCCL, from its kernels' rates
    measured alone: ``bf16`` large matmuls, ``fp32`` matmuls at torch's default precision (no TF32: the CUDA
    cores' peak times the matmuls' achieved share), ``attention`` flash attention's forward and backward (each
    at ``SUSTAINED`` of it in a step), ``hbm`` the memory's bandwidth, ``all_reduce`` and ``ring`` NCCL's bus
    bandwidth over the host's 8 GPUs (all-reduce; the ring collectives), ``network`` per GPU across hosts."""
    bf16, fp32, attention = SUSTAINED * bf16, SUSTAINED * fp32, SUSTAINED * attention
    return DeviceProfile(
        name, fp32, hbm, {k: 2e-5 for k in KINDS},
        {"all_reduce": all_reduce, "all_gather": ring, "reduce_scatter": ring, "all_to_all": ring},
        launch_s=1e-5, rates={"bfloat16": bf16, "float16": bf16, "float32": fp32, "attention.bfloat16": attention,
                              "attention.float16": attention, "attention.float32": fp32},
        fused_attention=True, node_ranks=8, inter_node_bandwidth={k: network for k in KINDS}, overlap=True,
        source=source)


# Each constant's source is in docs/device-profiles.md. Achieved, not datasheet peaks: matmuls at the best
# shape's measured rate (ml-engineering's "maximum achievable matmul FLOPS"); flash attention 2 (what torch's
# SDPA runs) at its published forward + backward rate, head dimension 128, sequence 8K; memory at 85% of the
# datasheet (an assumption); NCCL's bus bandwidth as nccl-tests measures it; the network at 400 Gb/s (NDR)
# or 200 Gb/s (HDR) a GPU as NCCL achieves it.
GPU_PROFILES = {
    "h100-sxm": _gpu("h100-sxm-nccl (built-in)", bf16=794.5e12, fp32=66.9e12 * 0.803, attention=3.2e14,
                     hbm=3.35e12 * 0.85, all_reduce=4.8e11, ring=3.7e11, network=4.7e10,
                     source="H100 SXM5 80 GB, 8 a host, NVLink 4, ConnectX-7 400 Gb/s a GPU"),
    "h200": _gpu("h200-nccl (built-in)", bf16=794.5e12, fp32=66.9e12 * 0.803, attention=3.2e14,
                 hbm=4.8e12 * 0.85, all_reduce=4.8e11, ring=3.614e11, network=4.7e10,
                 source="H200 SXM 141 GB, 8 a host, NVLink 4, ConnectX-7 400 Gb/s a GPU"),
    "a100-80gb": _gpu("a100-80gb-nccl (built-in)", bf16=271.2e12, fp32=19.5e12 * 0.869, attention=1.9e14,
                      hbm=2.039e12 * 0.85, all_reduce=2.35e11, ring=2.35e11, network=2.4e10,
                      source="A100 SXM 80 GB, 8 a host, NVLink 3, HDR 200 Gb/s a GPU"),
}
DEFAULT_PROFILES.update(GPU_PROFILES)


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
