"""``python -m dynshard.calibrate``: the device profile autodist's cost model reads, measured on this machine."""

import dataclasses
import os
import signal
import subprocess
import sys

import pytest
import torch

from dynshard.autodist.calibrate import SIZES, _payload, collective_fit
from dynshard.autodist.device_profile import DEFAULT_PROFILES, KINDS, DeviceProfile, load_profile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("kind", KINDS)
def test_the_fit_recovers_a_collectives_latency_and_bandwidth(kind):
    """Times made by ``alpha + ring * bytes / bandwidth`` (2 ranks: ring 1 for an all-reduce, 1/2 otherwise)
    give back alpha and bandwidth, with no error."""
    alpha, bandwidth, world = 3e-4, 1.5e9, 2
    ring = 1.0 if kind == "all_reduce" else 0.5
    times = [alpha + ring * _payload(kind, size, world) / bandwidth for size in SIZES]
    fitted_alpha, fitted_bandwidth, error = collective_fit(kind, times, world)
    assert fitted_alpha == pytest.approx(alpha, rel=1e-6)
    assert fitted_bandwidth == pytest.approx(bandwidth, rel=1e-6)
    assert error < 1e-9


def test_a_profiles_table_prices_each_size_as_measured_over_its_group_and_alpha_beta_elsewhere():
    """Measured (bytes, seconds) points: a call at a measured size costs what was measured, between two sizes
    the line between them, beyond the largest the last segment's slope, below the smallest its latency;
    calls split the bytes. A group of another size is priced by alpha and bandwidth."""
    base = DEFAULT_PROFILES["cpu"]
    profile = dataclasses.replace(base, table={"all_reduce": ((1e3, 1e-4), (1e6, 1e-3), (1e7, 2e-2))}, table_ranks=2)
    price = profile.collective_seconds
    assert price("all_reduce", 1e6, 2) == pytest.approx(1e-3)
    assert price("all_reduce", 5.5e6, 2) == pytest.approx(1e-3 + 0.5 * 1.9e-2)
    assert price("all_reduce", 2e7, 2) == pytest.approx(2e-2 + 1.9e-2 * 1e7 / 9e6)
    assert price("all_reduce", 10, 2) == pytest.approx(1e-4)
    assert price("all_reduce", 2e6, 2, calls=2) == pytest.approx(2e-3)
    assert price("all_reduce", 1e6, 4) == base.collective_seconds("all_reduce", 1e6, 4)      # (alpha-beta)
    assert price("all_gather", 1e6, 2) == base.alpha_s["all_gather"] + 0.5 * 1e6 / base.bandwidth["all_gather"]


def test_a_profile_reads_back_its_table_and_one_without_a_table_hashes_as_before_tables():
    profile = DEFAULT_PROFILES["cpu"]
    assert DeviceProfile.from_json(profile.to_json()) == profile and profile.table_ranks == 2
    plain = DEFAULT_PROFILES["cuda"]
    assert "table" not in plain.to_json() and DeviceProfile.from_json(plain.to_json()) == plain
    assert plain.launch_s > 0 and DeviceProfile.from_json(plain.to_json()).launch_s == plain.launch_s
    # (what it was before profiles had tables and launches)
    assert dataclasses.replace(plain, launch_s=0.0).digest() == "0d82bcf2bf53b077"


@pytest.mark.slow       # (about 30 s of measuring on 2 ranks)
def test_torchrun_calibrate_writes_a_profile_autodist_loads(tmp_path):
    out = str(tmp_path / "profile.json")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "dynshard.calibrate", "--out", out]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                               env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        log, _ = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        log, _ = process.communicate()
    assert process.returncode == 0, f"calibrate exited with {process.returncode}:\n{log[-6000:]}"
    profile = load_profile(out, "cpu")
    assert profile.name == "calibrated cpu/gloo, 2 rank(s), float32"
    assert profile.flops_per_s > 0 and profile.bytes_per_s > 0 and profile.skew >= 0
    assert set(profile.bandwidth) == set(KINDS) == set(profile.alpha_s)
    assert all(profile.bandwidth[k] > 0 and profile.alpha_s[k] > 0 for k in KINDS)
    assert profile.table_ranks == 2 and set(profile.table) == set(KINDS)
    assert all([b for b, _ in profile.table[k]] == [_payload(k, size, 2) for size in SIZES] for k in KINDS)
    assert "largest fit error per collective: all_reduce" in log


def test_a_kernel_launch_is_measured_in_microseconds():
    from dynshard.autodist.calibrate import launch_seconds

    assert 1e-8 < launch_seconds(torch.device("cpu")) < 1e-3
