#!/usr/bin/env bash
# Packs the llama.cpp peer (llama-cpp-python with its shared libraries and libgomp, plus gguf, diskcache, yaml) from
# this host's site-packages into .whl/peer.tar.xz (~3 MiB, git-ignored) for issue30_amx_e2e.sh on the device, which
# has no network. Install the peer here first:
#   pip install gguf && CMAKE_ARGS="-DGGML_NATIVE=ON" pip install --no-binary llama-cpp-python llama-cpp-python==0.3.36
# GGML_NATIVE builds for this host's ISA: the device's Xeon must have every flag this CPU has (check
# `python3 -c "import llama_cpp; print(llama_cpp.llama_print_system_info())"` here against the device's lscpu).
set -euo pipefail
cd "$(dirname "$0")/../../../.."
SP=$(python3 -c "import llama_cpp, os; print(os.path.dirname(os.path.dirname(llama_cpp.__file__)))")
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
cp -r "$SP"/gguf "$SP"/diskcache "$SP"/yaml "$TMP"/
mkdir -p "$TMP"/llama_cpp/lib
cp "$SP"/llama_cpp/*.py "$TMP"/llama_cpp/
for f in "$SP"/llama_cpp/lib/lib*.so.*.*; do   # the versioned files; the .so and .so.0 names become links
  base=$(basename "$f"); stem=${base%%.so.*}
  cp "$f" "$TMP"/llama_cpp/lib/
  ln -sf "$base" "$TMP"/llama_cpp/lib/"$stem".so.0
  ln -sf "$base" "$TMP"/llama_cpp/lib/"$stem".so
done
cp -L "$(ldconfig -p | awk '/libgomp.so.1 / {print $NF; exit}')" "$TMP"/llama_cpp/lib/
find "$TMP" -name __pycache__ -prune -exec rm -rf {} +
mkdir -p .whl
tar -cJf .whl/peer.tar.xz -C "$TMP" .
ls -la .whl/peer.tar.xz
