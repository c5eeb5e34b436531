#!/usr/bin/env bash
# Build GenieX's own model-spec loader (geniex-qairt-plugin's core/src/llm/llm_spec_loader.cpp, with the QNN API
# wrapper it links against) into tests/geniex/harness.cpp, for x86-64 with the system's g++.
#   SRC: a folder holding checkouts of github.com/qualcomm/geniex-qairt-plugin, github.com/qualcomm/geniex-proc,
#        github.com/xtensor-stack/xtensor and github.com/xtensor-stack/xtl under those names (BSD-3 licensed; not
#        part of NPU Studio's tree)
#   OUT: where the objects and the `harness` program go
# fmt's consteval format strings do not build with g++ 12 in C++20: FMT_CONSTEVAL is emptied (checked at runtime).
set -euo pipefail
SRC=$(cd "$1" && pwd); OUT=$2; HERE=$(cd "$(dirname "$0")" && pwd)
P=$SRC/geniex-qairt-plugin
mkdir -p "$OUT/obj" "$OUT/case"
ln -sf "$P/core/include/graph.h" "$OUT/case/Graph.h"  # included as Graph.h, a case-insensitive file system's habit
inc=(-I"$P/core/include" -I"$P/core/src" -I"$SRC/geniex-proc/include" -I"$SRC/xtensor/include" -I"$SRC/xtl/include"
     -I"$OUT/case")
while IFS= read -r d; do inc+=(-I"$d"); done < <(find "$P/qnn-api" -type d)
srcs=("$P"/core/src/llm/llm_spec_loader.cpp "$P"/core/src/llm/llm_utils.cpp "$P"/core/src/llm/input_provider.cpp
      "$P"/core/src/graph.cpp "$P"/core/src/logging.cpp "$P"/core/src/utils.cpp "$HERE/harness.cpp")
while IFS= read -r f; do srcs+=("$f"); done < <(find "$P/qnn-api/src" -name '*.cpp')
for f in "${srcs[@]}"; do
  o="$OUT/obj/$(echo "${f#"$SRC"/}" | tr '/' '_').o"
  [ "$o" -nt "$f" ] || g++ -std=c++20 -DFMT_CONSTEVAL= -O1 -w -c "$f" "${inc[@]}" -o "$o" &
  while [ "$(jobs -r | wc -l)" -ge "${JOBS:-2}" ]; do wait -n; done
done
wait
g++ -o "$OUT/harness" "$OUT"/obj/*.o -ldl -lpthread
