"""Phones and the virtual device: list them, start one, deploy a bundle."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.table import Table

from .console import err, live_state, out, print_json, stdout_is_for


def cmd_devices(a: argparse.Namespace) -> int:
    from ..core import device

    devs = [d.model_dump() for d in device.devices()]
    if a.json:
        print_json(devs)
        return 0
    if not devs:
        out.print("No device. Attach a phone with USB debugging on, or run `npustudio virtual-device`.")
        return 0
    t = Table(title=f"adb devices (server port {device.server_port()})")
    for col in ("serial", "state", "model", "SoC", "arch", "Android", "RAM", "free /data/local/tmp"):
        t.add_column(col)
    def gb(b: int | None) -> str:
        return f"{b / 1e9:.1f} GB" if b else "—"

    for d in devs:
        t.add_row(d["serial"] + ("  [virtual]" if d["virtual"] else ""), d["state"], d["model"],
                  f"{d['soc']} ({d['product']})" if d["soc"] else "", f"{d['dsp_arch']} / {d['soc_model']}",
                  d["android"], gb(d["ram_bytes"]), gb(d["free_bytes"]))
    out.print(t)
    return 0


def cmd_virtual_device(a: argparse.Namespace) -> int:
    import time

    from ..core import device

    vd = device.start_virtual(Path(a.root) if a.root else None, a.port, a.soc, a.preview)
    kind = "preview runner" if a.preview else "real Genie on the HTP simulator"
    err.print(f"virtual device {vd.serial} ({a.soc}, {kind}) is connected; its /data/local/tmp is "
              f"{vd.root / 'data/local/tmp'}. Ctrl-C stops it.")
    if vd.notice:
        err.print(vd.notice, style="yellow", markup=False, highlight=False)
    sys.stdout.write(vd.serial + "\n")
    sys.stdout.flush()
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        device.stop_virtual(vd)
    return 0


def cmd_deploy(a: argparse.Namespace) -> int:
    from ..core import device, layout, pipeline
    from ..core.device import deploy
    from ..core.genie.meta import read_metadata

    mnn = (Path(a.bundle) / layout.MNN_RESULT).is_file()  # a project's MNN model, not a Genie bundle
    if not mnn:
        read_metadata(Path(a.bundle))  # "not a bundle" before "no device"
    dev = device.pick(a.device)
    project = pipeline.project_of_bundle(Path(a.bundle))  # a project's bundle: the project records the deploy
    with live_state(quiet=a.json) as st, stdout_is_for(a.json):
        if mnn:
            res = pipeline.deploy_mnn(Path(a.bundle), dev, st, force=a.force)
        else:
            res = pipeline.deploy(project, dev, st, force=a.force) if project else \
                deploy.deploy(Path(a.bundle), dev, st, force=a.force)
    if a.json:
        print_json(res.model_dump())
    else:
        out.print(f"Deployed to {res.device}:{res.remote_dir}: {res.bytes_sent:,} B sent "
                  f"({res.rate_mb_s} MB/s), {res.bytes_skipped:,} B already there")
    return 0
