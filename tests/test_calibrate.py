"""``python -m dynshard.calibrate``: the device profile autodist's cost model reads, measured on this machine."""

import os
import signal
import subprocess
import sys

import pytest

from dynshard.calibrate import SIZES, _payload, collective_fit
from dynshard.planning.cost_model import KINDS, load_profile

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
    assert "largest fit error per collective: all_reduce" in log
