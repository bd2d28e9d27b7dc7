"""dynshard.compat.cpu_isa: Inductor's CPU ISA probe, made cheaper."""

from __future__ import annotations

import socket

from dynshard.compat.cpu_isa import _load_verdict_shared_on_host, first_valid


def test_a_libraries_load_check_runs_once_per_host_and_later_ranks_read_its_verdict(tmp_path):
    checked = []

    def load_in_child(isa, path):
        checked.append(path)
        return path.endswith("good.so")

    probe_load = _load_verdict_shared_on_host(load_in_child)
    good, bad = str(tmp_path / "good.so"), str(tmp_path / "bad.so")
    first = [probe_load(None, good), probe_load(None, bad)]
    again = [probe_load(None, good), probe_load(None, bad)]      # another rank of this host
    assert first == again == [True, False]
    assert checked == [good, bad]
    assert (tmp_path / f"good.so.{socket.gethostname()}.loads").read_text() == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"good.so.{socket.gethostname()}.loads", f"bad.so.{socket.gethostname()}.loads"])  # no temporaries left


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
