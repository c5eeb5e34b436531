#!/usr/bin/env bash
# NPU Studio as an application: the PyInstaller one-folder build, then an AppImage of it.
#   bash packaging/appimage/build.sh   -> dist/npustudio/ (run dist/npustudio/npustudio),
#                                         and dist/NPU_Studio-x86_64.AppImage when appimagetool is there
# Needs: .venv (bootstrap.sh); pyinstaller is installed into it here. appimagetool on PATH or as APPIMAGETOOL
# (https://github.com/AppImage/appimagetool/releases; fetched by you, this script never downloads). Headless:
# nothing in the build opens a window. Check the result with: bash packaging/smoke.sh dist/npustudio
set -euo pipefail
cd "$(dirname "$0")/../.."
.venv/bin/python -m pip --disable-pip-version-check -q install "pyinstaller>=6.10"
.venv/bin/pyinstaller --noconfirm --distpath dist --workpath build/pyinstaller packaging/npustudio.spec
echo "dist/npustudio ($(du -sh dist/npustudio | cut -f1))"
tool=${APPIMAGETOOL:-$(command -v appimagetool || true)}
if [ -z "$tool" ]; then  # the one-folder build is the application; the AppImage only packs it into one file
  echo "No AppImage: appimagetool was not found (install it, or set APPIMAGETOOL, and run this again)." >&2
  exit 0
fi
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
ARCH=x86_64 "$tool" "$app" dist/NPU_Studio-x86_64.AppImage
rm -rf "$app"
echo "dist/NPU_Studio-x86_64.AppImage"
