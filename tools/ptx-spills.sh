#!/usr/bin/env bash
# ptx-spills — registers, stack frame and spill bytes of each kernel entry, from ptxas on this
# machine (no GPU needed): the figures the GPU's JIT reports (`oxccl info --kernels`), for the
# entries a pattern names, before a kernel change goes to the GPU.
#
# Usage (from the repository root):
#   tools/ptx-spills.sh ["PATTERN"]      e.g. "allreduce ring ll128 half sum", "ring"
#
# PATTERN is an OXCCL_ONLY_FUNCS pattern (README: Layout); without one, every entry (about 3 min
# on 2 cores for the nvptx build). The kernels are built as build.rs builds them, into
# target/ptx-spills (the release build's kernels are left alone), then each module is compiled
# with `ptxas -v -arch=sm_90 --maxrregcount=128` (the JIT's register cap for 512-thread blocks).
# Each module is first rewritten as the host rewrites it before the JIT (`host/cuda/ptx.rs`: the
# registers ptxas spills go to shared memory; `OXCCL_SMEM_SPILLING=0` compiles the modules as
# built, as the host loads them on drivers before CUDA 12.8). "stack" and "spill" are local
# memory; "smem" is shared memory per block, the kernel's own plus the spilled registers.
# Prints one line per entry, the spilling ones first, then a summary. Needs ptxas (12.8 or
# later): $PTXAS, or ptxas on PATH (`pip install nvidia-cuda-nvcc` installs one under
# site-packages/nvidia/*/bin).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
ptxas=${PTXAS:-$(command -v ptxas || true)}
if [[ -z "$ptxas" ]]; then
    echo "ptx-spills: no ptxas (set PTXAS, or put one on PATH: pip install nvidia-cuda-nvcc)" >&2
    exit 2
fi
sysroot=$(rustc --print sysroot)
host=$(rustc -vV | awk '/^host:/ { print $2 }')
export OXCCL_LLVM_BIN="$sysroot/lib/rustlib/$host/bin"
if [[ $# -gt 0 ]]; then export OXCCL_ONLY_FUNCS="$1"; else unset OXCCL_ONLY_FUNCS; fi
out="$root/target/ptx-spills"
cpu=$(sed -n 's/^const PTX_CPU: &str = "\(.*\)";/\1/p' build.rs)
CARGO_TARGET_DIR="$out" cargo rustc -q -p oxccl-gpu --profile ptx --target nvptx64-nvidia-cuda \
    -Zbuild-std=core --crate-type cdylib -- "-Ctarget-cpu=$cpu" "-Clinker=$root/tools/ptx-link.sh"
python3 - "$out/nvptx64-nvidia-cuda/ptx/deps/oxccl_gpu.ptx" "$ptxas" "$out/modules" <<'PY'
import os, re, subprocess, sys
ptx, ptxas, work = sys.argv[1], sys.argv[2], sys.argv[3]
os.makedirs(work, exist_ok=True)
smem_spilling = os.environ.get('OXCCL_SMEM_SPILLING', '1').strip() != '0'

def as_loaded(part):
    """host/cuda/ptx.rs `with_smem_spilling(part, 512)` for LLVM's modules: PTX ISA 8.7 and sm_75,
    `.maxntid 512, 1, 1` and `.minnctapersm 1` before each entry's body and the spilling pragma as its first line."""
    part = re.sub(r'(?m)^\.version 7\.0$', '.version 8.7', part)
    part = re.sub(r'(?m)^\.target sm_70$', '.target sm_75', part)
    return re.sub(r'(?m)^(\.visible )?(\.entry .*\n(?:(?!\{\n).*\n)*?)\{\n',
                  lambda m: (m.group(1) or '') + m.group(2) + '.maxntid 512, 1, 1\n.minnctapersm 1\n{\n\t.pragma "enable_smem_spilling";\n',
                  part)

rows = []
for i, part in enumerate(re.split(r'(?m)^(?=\.version)', open(ptx).read())):
    if '.entry' not in part:
        continue
    if smem_spilling:
        part = as_loaded(part)
    path = os.path.join(work, f'part{i}.ptx')
    open(path, 'w').write(part)
    r = subprocess.run([ptxas, '-v', '-arch=sm_90', '--maxrregcount=128', path, '-o', path + '.cubin'],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f'ptxas failed on {path}:\n{r.stderr}')
    entry, frame = None, None
    for line in r.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            entry = m.group(1)
        m = re.search(r'(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads', line)
        if m and entry:
            frame = tuple(int(x) for x in m.groups())
        m = re.search(r'Used (\d+) registers.*?(\d+) bytes smem', line)
        if m and entry and frame:
            rows.append((entry, int(m.group(1))) + frame + (int(m.group(2)),))
            entry, frame = None, None
rows.sort(key=lambda r: (-r[3], -r[5], r[0]))
print(f'{"entry":48} {"regs":>4} {"stack":>6} {"spill st":>8} {"spill ld":>8} {"smem":>6}')
for e, regs, stack, st, ld, smem in rows:
    print(f'{e:48} {regs:4} {stack:6} {st:8} {ld:8} {smem:6}')
spilling = [r for r in rows if r[3] > 0]
print(f'# {len(rows)} entries, {len(spilling)} with spills to local memory, {sum(r[3] for r in rows)} bytes '
      f'of spill stores; shared-memory spilling {"on" if smem_spilling else "off (OXCCL_SMEM_SPILLING=0)"}')
PY
