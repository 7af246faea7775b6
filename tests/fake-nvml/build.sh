#!/bin/bash
# Builds the fake NVML library into DIR (default: target/fake-nvml) as libnvidia-ml.so.1.
# Usage: tests/fake-nvml/build.sh [DIR]; prints the library's path.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${1:-$here/../../target/fake-nvml}"
mkdir -p "$out"
cc -shared -fPIC -O2 -Wall -Wextra -Werror -o "$out/libnvidia-ml.so.1" "$here/fake_nvml.c" -ldl -lpthread
echo "$out/libnvidia-ml.so.1"
