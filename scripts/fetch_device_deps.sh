#!/usr/bin/env bash
# Run here (with network) before a device check: downloads what the GPU machine lacks into
# .device/ (ignored by git), which the device tool carries along (carry: [".device"]):
#   Boost's headers: Debian's libboost1.81-dev (Debian 12) or libboost1.83-dev (Debian 13) package,
#   unpacked there by scripts/device_check.sh (the GPU machine has no Boost and no network).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .device
debian_major=$(cut -d. -f1 /etc/debian_version 2>/dev/null || echo 0)
case "$debian_major" in
  12) package=libboost1.81-dev ;;
  *) package=libboost1.83-dev ;;
esac
if ! ls .device/"$package"_*.deb >/dev/null 2>&1; then
  (cd .device && apt-get download "$package")
fi
ls -l .device
