#!/usr/bin/env bash
# AppImage of NPU Studio from the PyInstaller one-folder build.
#   bash packaging/appimage/build.sh         -> dist/NPU_Studio-x86_64.AppImage
# Needs: .venv (bootstrap.sh), pyinstaller (installed here), appimagetool on PATH or as APPIMAGETOOL
# (https://github.com/AppImage/appimagetool/releases; fetched by you, this script never downloads).
set -euo pipefail
cd "$(dirname "$0")/../.."
.venv/bin/python -m pip --disable-pip-version-check -q install "pyinstaller>=6.10"
.venv/bin/pyinstaller --noconfirm --distpath dist --workpath build/pyinstaller packaging/npustudio.spec
app=build/AppDir
rm -rf "$app"
mkdir -p "$app/usr/lib" "$app/usr/share/applications" "$app/usr/share/icons/hicolor/256x256/apps"
cp -a dist/npustudio "$app/usr/lib/npustudio"
cp packaging/npustudio.desktop "$app/npustudio.desktop"
cp packaging/npustudio.desktop "$app/usr/share/applications/"
cp resources/npustudio-256.png "$app/npustudio.png"
cp resources/npustudio-256.png "$app/usr/share/icons/hicolor/256x256/apps/npustudio.png"
cat > "$app/AppRun" <<'RUN'
#!/bin/sh
here="$(dirname "$(readlink -f "$0")")"
if [ $# -eq 0 ]; then set -- gui; fi
exec "$here/usr/lib/npustudio/npustudio" "$@"
RUN
chmod +x "$app/AppRun"
tool=${APPIMAGETOOL:-$(command -v appimagetool || true)}
if [ -z "$tool" ]; then
  echo "AppDir ready in $app; install appimagetool (or set APPIMAGETOOL) to pack it into an AppImage." >&2
  exit 2
fi
ARCH=x86_64 "$tool" "$app" dist/NPU_Studio-x86_64.AppImage
echo "dist/NPU_Studio-x86_64.AppImage"
