"""docs/figures.md, the measured-figures page, rendered from the benchmarks' own JSON (benchmarks/results/).

    .venv/bin/python benchmarks/figures_page.py --record fuzz -- benchmarks/fuzz_bench.py --seconds 20 --json
    .venv/bin/python benchmarks/figures_page.py            # render docs/figures.md from the recorded results
    .venv/bin/python benchmarks/figures_page.py --check    # exit 1 when docs/figures.md is not what they render

`--record NAME -- SCRIPT ARGS...` runs a benchmark script with this Python, keeps its JSON output with the
command, the date and the machine in results/NAME.json, and renders the page again: a figure in the docs is
always one a benchmark printed, never typed by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "figures.md"


def record(name: str, script: list[str]) -> Path:
    """Run `script` (a benchmark printing JSON on stdout) and keep its result beside how it was made."""
    if not script or not script[0].endswith(".py"):
        raise SystemExit("give the benchmark script and its arguments after --, e.g. -- benchmarks/fuzz_bench.py")
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, *script], cwd=ROOT, capture_output=True, text=True, check=False)
    if run.returncode:
        raise SystemExit(f"{' '.join(script)} failed (exit {run.returncode}):\n{run.stderr[-2000:]}")
    try:
        result = json.loads(run.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError) as e:
        raise SystemExit(f"{' '.join(script)} printed no JSON on its last line ({e}); pass its --json") from e
    entry = {"command": " ".join(["python", *script]), "date": time.strftime("%Y-%m-%d"),
             "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
             "seconds": round(time.monotonic() - t0, 1), "result": result}
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"{name}.json"
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(entry, indent=1) + "\n", encoding="utf-8")
    tmp.replace(out)
    return out


def _cell(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text.replace("|", "\\|")


def _grid(rows: list[tuple[str, dict[str, Any]]], first: str) -> list[str]:
    """Records of the same kind (per format, per prompt, per mode) as one table: a row each, a column per field."""
    cols = list(dict.fromkeys(k for _n, r in rows for k in r))
    out = [f"| {first} | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    return out + [f"| {_cell(n)} | " + " | ".join(_cell(r.get(c, "")) for c in cols) + " |" for n, r in rows]


def _tables(result: dict[str, Any]) -> list[str]:
    """A result as tables: its single figures in one, each group of records (a dict of dicts, a list of dicts)
    in its own."""
    single: list[str] = []
    groups: list[str] = []
    for key, value in result.items():
        if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            groups += ["", f"**{key}**", "", *_grid(list(value.items()), "")]
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            name = next((k for k in ("prompt", "name", "format", "mode") if k in value[0]), None)
            rows = [(str(v.get(name, i)) if name else str(i), {k: x for k, x in v.items() if k != name})
                    for i, v in enumerate(value)]
            groups += ["", f"**{key}**", "", *_grid(rows, name or "")]
        else:
            single.append(f"| {key} | {_cell(value)} |")
    return (["| figure | value |", "|---|---|", *single] if single else []) + groups


def render() -> str:
    lines = ["# Measured figures", "",
             "Every figure here was printed by a benchmark under `benchmarks/` and kept with its command in",
             "`benchmarks/results/`; `python benchmarks/figures_page.py` renders this page from them (do not edit it",
             "by hand). Timings are this machine's; ratios against a baseline run side by side travel better.", ""]
    for path in sorted(RESULTS.glob("*.json")):
        entry = json.loads(path.read_text(encoding="utf-8"))
        lines += [f"## {path.stem}", "", f"`{entry['command']}` — {entry['date']}, {entry['machine']}, "
                  f"{entry['seconds']} s", "", *_tables(entry["result"]), ""]
    return "\n".join(lines)


def main() -> None:
    argv = sys.argv[1:]
    script = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--record", metavar="NAME", help="run the benchmark after -- and keep its JSON as NAME")
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/figures.md is out of date")
    ap.add_argument("--page", type=Path, default=PAGE, help="the page to write or check (default: docs/figures.md)")
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if a.record:
        print(f"kept {record(a.record, script).relative_to(ROOT)}")
    page = render()
    if a.check:
        current = a.page.read_text(encoding="utf-8") if a.page.is_file() else ""
        if current != page:
            raise SystemExit(f"{a.page.name} is not what benchmarks/results/ renders: run "
                             "`python benchmarks/figures_page.py`")
        return
    a.page.write_text(page, encoding="utf-8")
    print(f"wrote {a.page}")


if __name__ == "__main__":
    main()
