#!/usr/bin/env bash
# Builds tests/c/allreduce_sendrecv.c against oxccl's nccl.h and libnccl.so and runs it (on a
# machine with a GPU and the CUDA toolkit). Usage:
#
#   nccl/tests/c/run.sh <directory holding oxccl's libnccl.so>     e.g. target/release
#
# The program is compiled with nvcc (or, without it, gcc against $CUDA_HOME, default
# /usr/local/cuda), linked with -lnccl -lcudart -lcuda, and run with that directory first on the
# library path, so it loads oxccl's libnccl.so.2 rather than a system NCCL (checked with ldd).
# Exit status: the program's (0 and "C-ABI OK" when every check passed).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
libdir="$(cd "${1:?usage: run.sh <directory holding libnccl.so>}" && pwd)"
if [[ ! -e "$libdir/libnccl.so" ]]; then
    echo "run.sh: no libnccl.so in $libdir (cargo build --release -p oxccl-nccl makes target/release/libnccl.so)" >&2
    exit 2
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/oxccl-c-abi.XXXXXX")"
trap 'rm -rf "$work"' EXIT
# The linker resolves -lnccl through libnccl.so; the program then asks for the SONAME,
# libnccl.so.2: both names point at oxccl's library.
ln -s "$libdir/libnccl.so" "$work/libnccl.so"
ln -s "$libdir/libnccl.so" "$work/libnccl.so.2"

cuda="${CUDA_HOME:-/usr/local/cuda}"
src="$here/allreduce_sendrecv.c"
exe="$work/allreduce_sendrecv"
# oxccl's header comes first: a system nccl.h (/usr/include) must not be picked up.
if command -v nvcc >/dev/null 2>&1; then
    nvcc -O2 -I"$here/../../include" -o "$exe" "$src" -L"$work" -lnccl -lcudart -lcuda \
        -Xlinker -rpath -Xlinker "$work"
else
    gcc -O2 -std=gnu11 -Wall -I"$here/../../include" -I"$cuda/include" -o "$exe" "$src" \
        -L"$work" -lnccl -L"$cuda/lib64" -lcudart -L"$cuda/lib64/stubs" -lcuda -Wl,-rpath,"$work"
fi

export LD_LIBRARY_PATH="$work${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
resolved="$(ldd "$exe" | awk '$1 == "libnccl.so.2" { print $3 }')"
if [[ "$(readlink -f "$resolved")" != "$(readlink -f "$libdir/libnccl.so")" ]]; then
    echo "run.sh: the program would load libnccl.so.2 from '$resolved', not from $libdir" >&2
    exit 2
fi

export OXCCL_ALLOW_SHARED_DEVICE=1
export NCCL_NVLS_ENABLE=0
timeout "${OXCCL_C_ABI_TIMEOUT:-600}" "$exe"
