#!/usr/bin/env bash
# Installs the Debian packages quads builds with, when any is missing (Debian 12, as root).
set -euo pipefail
pkgs=(build-essential cmake ninja-build pkg-config libopenblas-dev nlohmann-json3-dev libcli11-dev
      libtomlplusplus-dev libfmt-dev libgtest-dev libbenchmark-dev libpcre2-dev libutf8proc-dev gnuplot-nox)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "quads: installing ${missing[*]}" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
