# Sourced by the scripts in scripts/gpu/ on the GPU machine (CUDA 13, cmake 4, g++ 13, no network):
# unpacks the Debian packages carried in .debs/ into a prefix of our own (never into /; see
# /work/shared/GPU.md), points pkg-config, the loader and cmake at it, and defines
#   gpu_build TARGET...   configure build-gpu (or $QUADS_GPU_BUILD) for sm_90 and build the targets
#                         (extra cmake arguments in $QUADS_GPU_CMAKE_ARGS, e.g. a -DCMAKE_CUDA_FLAGS variant).
# Sets root, prefix, build, logdir ($OUT or /tmp/quads-gpu-logs).
# .debs/ (an ignored folder, carried to the GPU machine) is filled here, on Debian 12, with
#   mkdir -p .debs && cd .debs && apt-get download nlohmann-json3-dev libcli11-dev libtomlplusplus-dev \
#     libtomlplusplus3 libfmt-dev libfmt9 libopenblas-dev libopenblas0-pthread libopenblas-pthread-dev \
#     libopenblas0 libgfortran5 libpcre2-dev libpcre2-8-0 libutf8proc-dev libutf8proc2
# (GPU.md's list lacks the last two: configure fails without them, the tokenizer's normalization.)
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
root=$PWD
prefix=/tmp/quads-deps
build=${QUADS_GPU_BUILD:-build-gpu}
logdir=${OUT:-/tmp/quads-gpu-logs}
mkdir -p "$prefix" "$logdir"
for f in .debs/*.deb; do dpkg -x "$f" "$prefix"; done
ls .debs/libutf8proc-dev_*.deb >/dev/null 2>&1 || echo "note: .debs/ has no libutf8proc-dev: configure will fail (see the list above)"
L=$prefix/usr/lib/x86_64-linux-gnu
export PKG_CONFIG_ALLOW_SYSTEM_CFLAGS=1 PKG_CONFIG_SYSROOT_DIR=$prefix
export PKG_CONFIG_PATH=$L/pkgconfig:$L/openblas-pthread/pkgconfig
export LD_LIBRARY_PATH=$L:$L/openblas-pthread:${LD_LIBRARY_PATH:-}
export PATH=/usr/local/cuda/bin:$PATH
[ -d .gpufix ] && export QUADS_FIXTURES=$root/.gpufix

gpu_build() {
  local start
  start=$(date +%s)
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix/usr" \
    -DQUADS_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DQUADS_BUILD_BENCH=OFF \
    -DCMAKE_PROJECT_INCLUDE="$root/scripts/gpu/add_gpu_bench.cmake" ${QUADS_GPU_CMAKE_ARGS:-} >"$logdir/configure.log" 2>&1 \
    || { tail -40 "$logdir/configure.log"; return 1; }
  cmake --build "$build" -j "$(nproc)" --target "$@" >"$logdir/build.log" 2>&1 \
    || { grep -E "error|Error" "$logdir/build.log" | head -40; tail -20 "$logdir/build.log"; return 1; }
  echo "build ($*): $(($(date +%s) - start)) s"
}
