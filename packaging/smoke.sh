#!/usr/bin/env bash
# Smoke test of a packaged build, run as a user runs it:
#   bash packaging/smoke.sh dist/npustudio
# --version; `info default` (the embedded GGUF through transformers); a tiny random Llama through adapt → quantize →
# compile → bundle, and through the MNN back-end (`compile --backend mnn`, `chat --mnn`); `genie-run --preview`;
# `virtual-device` + `devices` + a `chat` there, with the bundle and with the MNN model; and `gui`, whose window
# must appear under Xvfb and close on Ctrl+Q. The tiny model is written by this checkout's .venv (test data; the
# build under test is DIST alone). Needs xvfb-run and xdotool for the window (Debian: xvfb, xdotool).
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: bash packaging/smoke.sh DIST_FOLDER" >&2; exit 2; }
root="$(cd "$(dirname "$0")/.." && pwd)"
dist="$(cd "$1" && pwd)"
app="$dist/npustudio"
[ -x "$app" ] || { echo "no executable $app: build it first (bash packaging/appimage/build.sh)" >&2; exit 2; }
for tool in xvfb-run xdotool; do
  command -v "$tool" >/dev/null || { echo "$tool is needed for the window check (apt-get install xvfb xdotool)" >&2; exit 2; }
done
work="$(mktemp -d)"
vd_pid=""
export XDG_CONFIG_HOME="$work/config" XDG_DATA_HOME="$work/data" XDG_CACHE_HOME="$work/cache"
export ANDROID_ADB_SERVER_PORT="${SMOKE_ADB_PORT:-5199}"  # a private adb server, never the user's 5037
adb="$(find "$dist" -type f -name adb -perm -u+x | head -1)"
cleanup() {
  [ -n "$vd_pid" ] && kill "$vd_pid" 2>/dev/null
  [ -n "$adb" ] && "$adb" -P "$ANDROID_ADB_SERVER_PORT" kill-server >/dev/null 2>&1
  rm -rf "$work"
}
trap cleanup EXIT
step() { printf '\n== %s\n' "$*"; }
t0=$SECONDS

step "--version"
"$app" --version

step "info default"
"$app" info default --json > "$work/info.json"
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["family"], d["layers"], "layers")' "$work/info.json"

step "a tiny random Llama through adapt, quantize, compile, bundle"
"$root/.venv/bin/python" - "$root" "$work/model" <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from tests.conftest import make_tiny_model
make_tiny_model(Path(sys.argv[2]), "llama64")
PY
"$app" adapt "$work/model" --project "$work/p" --ar 32 --cl 128 --eval-tokens 256 --decode-tokens 8
"$app" quantize --project "$work/p" --calib-samples 2 --calib-len 64 --eval-chars 1500
"$app" compile --project "$work/p" --verify-tokens 64
"$app" bundle --project "$work/p" --json > "$work/bundle.json"
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["validated"], d; print("bundle validated by libGenie")' "$work/bundle.json"

step "the MNN back-end: the tiny model exported by MNN's exporter, checked, and answering through MNN's runtime"
"$app" compile --backend mnn --project "$work/m" --model "$work/model" --mnn-bits 8 --mnn-block 0 --json > "$work/mnn.json"
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["top1_agreement"] > 0.9, d; print("MNN model: top-1", round(d["top1_agreement"], 3))' "$work/mnn.json"
"$app" chat --mnn --bundle "$work/m/stages/mnn" "Hello" < /dev/null

step "genie-run --preview"
"$app" genie-run -c "$work/p/stages/bundle/genie_config.json" -p "Hello" --preview

step "virtual-device + devices"
"$app" virtual-device --port 0 > "$work/vd.log" 2>&1 &
vd_pid=$!
for _ in $(seq 120); do grep -q "connected" "$work/vd.log" 2>/dev/null && break; sleep 0.5; done
"$app" devices --json > "$work/devices.json"
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); v=[x for x in d if x.get("virtual")]; assert v, d; print("virtual device:", v[0]["serial"], v[0]["soc"])' "$work/devices.json"
serial="$(python3 -c 'import json,sys; print([x for x in json.load(open(sys.argv[1])) if x.get("virtual")][0]["serial"])' "$work/devices.json")"

step "chat on the virtual device (the bundle deployed there, Genie on the HTP simulator)"
"$app" chat --device "$serial" --bundle "$work/p/stages/bundle" "Hello" < /dev/null

step "the MNN model on the virtual device (deployed, llm_demo there)"
"$app" chat --mnn --device "$serial" --bundle "$work/m/stages/mnn" "Hello" < /dev/null
kill "$vd_pid"; wait "$vd_pid" 2>/dev/null || true; vd_pid=""

step "gui: the window opens and closes on Ctrl+Q"
xvfb-run -a -s "-screen 0 1366x768x24" bash -c '
  "$1" gui --project "$2" > "$3/gui.log" 2>&1 &
  pid=$!
  id=$(timeout 180 xdotool search --sync --onlyvisible --name "^NPU Studio" | head -1)
  echo "window: $(xdotool getwindowname "$id")"
  xdotool windowfocus --sync "$id" key ctrl+q
  wait "$pid"' _ "$app" "$work/p" "$work"
if grep -q Traceback "$work/gui.log"; then cat "$work/gui.log"; exit 1; fi

step "passed in $((SECONDS - t0)) s"
