"""The fuzz suite, short form (tests/fuzz_formats.py; benchmarks/fuzz_bench.py runs it for as long as it is given):
mutated inputs of every file format NPU Studio reads, and of the virtual device's adb wire protocol. Each input
is read or refused with a message; none may end in a traceback, a hang or a write outside its folder."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from npustudio.core import device
from npustudio.core.device.virtual import VirtualDevice
from npustudio.core.project import Project
from tests import fuzz_formats

INPUTS = 120  # per format: ~20 s for all of them here


@pytest.fixture(scope="module")
def seeds(genie_project: Project, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = genie_project.root.parent / "m"  # the tiny model the fixture made
    return fuzz_formats.make_seeds(tmp_path_factory.mktemp("fuzz") / "seeds", genie_project.root, model)


@pytest.mark.parametrize("seed", [0, 1])
def test_mutated_files_of_every_format_are_read_or_refused_with_a_message(seeds: Path, tmp_path: Path,
                                                                           seed: int) -> None:
    out = fuzz_formats.run(seeds, tmp_path, n=INPUTS, seed=seed)
    assert set(out) == {f.name for f in fuzz_formats.formats(seeds)} and len(out) >= 13
    for name, o in out.items():
        assert o.tried == INPUTS
        assert not o.crashes and not o.hangs and not o.writes_outside, (name, o.crashes[:3], o.hangs[:3])
    assert sum(o.refused for o in out.values()) > len(out) * INPUTS / 4  # the mutations reach the checks


def test_the_fuzzer_reports_a_reader_that_crashes(seeds: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite can fail: a reader that raises something else than a UserError is a finding, named."""
    from npustudio.core.genie import profile

    def broken(_path: Path) -> None:
        raise KeyError("header")

    monkeypatch.setattr(profile, "read", broken)
    out = fuzz_formats.run(seeds, tmp_path, n=3, only=["Genie profile"])
    assert len(out["Genie profile"].crashes) == 3 and "KeyError" in out["Genie profile"].crashes[0]


def test_mutated_adb_packets_never_stop_the_virtual_device(adb_server: list[str], tmp_path: Path) -> None:
    """Then a real adb client still connects and runs a command through the adb server."""
    vd = VirtualDevice(tmp_path / "phone").start()
    try:
        tried, findings = fuzz_formats.adb_wire(vd.port, random.Random(0), 150)
        assert tried == 150 and not findings, findings
        assert "connected" in str(device.client().connect(vd.serial, timeout=15))
        assert device.client().device(serial=vd.serial).shell("echo alive", timeout=30).strip() == "alive"
        device.client().disconnect(vd.serial)
    finally:
        vd.stop()
