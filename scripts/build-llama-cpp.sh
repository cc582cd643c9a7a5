#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-quantize and llama-bench from the sources vendored in the PyPI sdist of
# llama-cpp-python (the peer that benchmarks/llamacpp.py compares against). llama.cpp is only a peer: nothing in the
# engine depends on it. Takes about 15 minutes on 2 cores.
# Usage: scripts/build-llama-cpp.sh [CACHE_DIR]   (default ~/.cache/pagedserve/llama.cpp)
set -euo pipefail
VERSION=0.3.36
CACHE=${1:-${PAGEDSERVE_LLAMA_CPP:-$HOME/.cache/pagedserve/llama.cpp}}
JOBS=${JOBS:-2}
BIN="$CACHE/bin"
if [[ -x "$BIN/llama-server" && -x "$BIN/llama-quantize" && -x "$BIN/llama-bench" ]]; then
    echo "llama.cpp: already built in $BIN"; exit 0
fi
mkdir -p "$CACHE/src"
cd "$CACHE/src"
SDIST=$(ls llama_cpp_python-$VERSION.tar.gz 2>/dev/null || true)
if [[ -z "$SDIST" ]]; then
    # --no-binary for this package only: with :all: pip builds its build dependencies from source too, for minutes
    python3 -m pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d .
    SDIST=llama_cpp_python-$VERSION.tar.gz
fi
[[ -d llama_cpp_python-$VERSION ]] || tar xzf "$SDIST"
SRC="$CACHE/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
[[ -f "$SRC/CMakeLists.txt" ]] || { echo "llama.cpp: no vendored sources at $SRC" >&2; exit 1; }
nice cmake -S "$SRC" -B "$CACHE/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
nice cmake --build "$CACHE/build" --config Release -j "$JOBS" --target llama-server llama-quantize llama-bench
mkdir -p "$BIN"
for t in llama-server llama-quantize llama-bench; do
    cp "$(find "$CACHE/build" -name "$t" -type f -perm -u+x | head -1)" "$BIN/$t"
done
# Shared libraries (libllama, libggml*) when the build makes them; the binaries find them through RPATH or this dir.
find "$CACHE/build" -name '*.so*' -exec cp -P {} "$BIN/" \; 2>/dev/null || true
echo "llama.cpp: built $BIN/llama-server"
