#!/usr/bin/env bash
# PyTorch on oxccl's libnccl.so.2 (on the GPU machine, which has PyTorch). Usage:
#
#   nccl/tests/torch/run.sh <directory holding oxccl's libnccl.so> [OUTDIR]
#
# Runs check.py twice with two ranks: on the gloo backend (the reference), then on the nccl
# backend with oxccl's library in LD_PRELOAD (PyTorch's wheel links libnccl.so.2 through an
# RPATH; a preloaded library of that SONAME serves its calls). One GPU: both ranks share it
# (OXCCL_ALLOW_SHARED_DEVICE=1). Prints each rank's checks and whether the DDP parameters of the
# two runs are bit-identical; exit status 0 when every check passed and they are.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
libdir="$(cd "${1:?usage: run.sh <directory holding libnccl.so> [OUTDIR]}" && pwd)"
out="${2:-$(mktemp -d)}"
mkdir -p "$out"
lib="$libdir/libnccl.so"
[[ -e "$lib" ]] || { echo "run.sh: no libnccl.so in $libdir" >&2; exit 2; }

MASTER_PORT=29533 timeout 180 python3 "$here/check.py" gloo "$out/gloo" > "$out/gloo.log" 2>&1
echo "gloo run: exit $?"
MASTER_PORT=29534 OXCCL_ALLOW_SHARED_DEVICE=1 NCCL_DEBUG=${NCCL_DEBUG:-INFO} NCCL_NVLS_ENABLE=0 \
  LD_PRELOAD="$lib" timeout 240 python3 "$here/check.py" nccl "$out/nccl" > "$out/nccl.log" 2>&1
echo "nccl (oxccl) run: exit $?"
grep -m2 "oxccl" "$out/nccl.log"
python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
bad = 0
runs = {}
for backend in ("gloo", "nccl"):
    for r in range(2):
        p = os.path.join(out, backend, f"rank{r}.json")
        if not os.path.exists(p):
            print(f"{backend} rank {r}: no result"); bad += 1; continue
        d = json.load(open(p))
        runs[(backend, r)] = d
        if "fatal" in d:
            print(f"{backend} rank {r}: FATAL {d['fatal']}"); bad += 1; continue
        print(f"{backend} rank {r}: torch.cuda.nccl.version() {d.get('nccl_version', '-')}, "
              f"libnccl mapped {d.get('libnccl_loaded', '-')}, destroyed {d.get('destroyed')}")
        for k, v in d["checks"].items():
            print(f"  {k:26} {v}")
            bad += v != "ok"
for r in range(2):
    a = runs.get(("gloo", r), {}).get("ddp_params_sha256")
    b = runs.get(("nccl", r), {}).get("ddp_params_sha256")
    same = a is not None and a == b
    print(f"rank {r}: DDP parameters after the steps {'bit-identical' if same else 'DIFFER'} (gloo {a and a[:16]}, oxccl {b and b[:16]})")
    bad += not same
print(f"torch checks: {'PASS' if bad == 0 else f'{bad} FAILED'}")
sys.exit(bad != 0)
PY
