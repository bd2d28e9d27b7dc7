"""dynshard.backend.compiler.cpu_isa_probe: Inductor's CPU ISA probe, made cheaper."""

from __future__ import annotations

import os
import socket

from dynshard.backend.compiler.cpu_isa_probe import _load_verdict_shared_on_host, first_valid


def test_a_passing_load_check_runs_once_per_host_and_build_and_a_failing_one_every_time(tmp_path):
    checked = []

    def load_in_child(isa, path):
        checked.append(os.path.basename(path))
        return path.endswith("good.so")

    probe_load = _load_verdict_shared_on_host(load_in_child)
    good, bad = tmp_path / "good.so", tmp_path / "bad.so"
    good.write_bytes(b"library")
    bad.write_bytes(b"library")
    first = [probe_load(None, str(good)), probe_load(None, str(bad))]
    again = [probe_load(None, str(good)), probe_load(None, str(bad))]      # another rank of this host
    assert first == again == [True, False]
    assert checked == ["good.so", "bad.so", "bad.so"]     # a failure may be a timeout: checked again
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(    # no temporaries left
        ["good.so", "bad.so", f"good.so.{socket.gethostname()}.loads"])
    good.write_bytes(b"library, built again")
    assert probe_load(None, str(good)) and checked[-1] == "good.so"


class FakeIsa:
    def __init__(self, name, valid, probed):
        self.name, self.valid, self.probed = name, valid, probed

    def __bool__(self):
        self.probed.append(self.name)
        return self.valid


def test_only_the_best_isa_that_builds_is_probed_and_listed():
    probed = []
    claimed = [FakeIsa("amx", False, probed), FakeIsa("avx512", True, probed), FakeIsa("avx2", True, probed)]
    assert [isa.name for isa in first_valid(claimed)] == ["avx512"]
    assert probed == ["amx", "avx512"]          # avx2 is never built
    assert first_valid([FakeIsa("avx2", False, probed)]) == []
