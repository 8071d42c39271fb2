#!/usr/bin/env bash
# ptx-link.sh — the "linker" rustc calls for the nvptx64-nvidia-cuda cdylib (build.rs passes it
# with -C linker=...). rustc hands it LLVM bitcode objects and rlibs, the way it would hand them to
# llvm-bitcode-linker (which the registry here does not ship):
#   --export-symbol K ... <inputs .o/.rlib> --target-cpu sm_XX [--target-feature=+ptxNN] -o out.ptx
# We do the same job with the llvm-tools binaries of the pinned toolchain:
#   llvm-link (rlib members --only-needed) -> per part of the kernels, in parallel: opt
#   internalize+globaldce (keep that part's kernels) -> opt -O3 -> llc -mcpu=sm_XX -mattr=+ptxNN
#   -> the parts' PTX joined into out.ptx
set -euo pipefail
bin=${OXCCL_LLVM_BIN:-"$(rustc --print sysroot)/lib/rustlib/x86_64-unknown-linux-gnu/bin"}
[[ -x "$bin/llvm-link" ]] || { echo "ptx-link: llvm-tools not found in $bin (rustup component add llvm-tools)" >&2; exit 1; }
exports=() objs=() rlibs=() cpu=sm_70 feat="" out=""
while (($#)); do
  case "$1" in
    --export-symbol) exports+=("$2"); shift 2 ;;
    --target-cpu) cpu=$2; shift 2 ;;
    --target-feature=*) feat=${1#--target-feature=}; shift ;;
    --target-feature) feat=$2; shift 2 ;;
    -o) out=$2; shift 2 ;;
    -L|--target) shift 2 ;;
    -O*|--debug) shift ;;
    *.rlib) rlibs+=("$1"); shift ;;
    *.o) objs+=("$1"); shift ;;
    *) shift ;;
  esac
done
[[ -n "$out" ]] || { echo "ptx-link: no -o given" >&2; exit 1; }
((${#objs[@]})) || { echo "ptx-link: no bitcode objects given" >&2; exit 1; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
# OXCCL_PTX_TIMES=FILE appends each step's wall time to FILE (build-time measurements).
t0=$(date +%s.%N)
step() { [[ -n "${OXCCL_PTX_TIMES:-}" ]] || return 0; local t; t=$(date +%s.%N); awk -v a="$t" -v b="$t0" -v s="$1" 'BEGIN { printf "%s %.1f s\n", s, a - b }' >> "$OXCCL_PTX_TIMES"; t0=$t; }
# llvm-link's --only-needed holds for every file after the first, so the crate's own objects
# (one per codegen unit when rustc does no LTO) are joined first, whole.
"$bin/llvm-link" "${objs[@]}" -o "$tmp/crate.bc"
link=("$bin/llvm-link" "$tmp/crate.bc")
i=0
for r in "${rlibs[@]}"; do
  d="$tmp/rlib$i"; i=$((i+1)); mkdir -p "$d"
  (cd "$d" && "$bin/llvm-ar" x "$r")
  for m in "$d"/*.o; do [[ -e "$m" ]] && link+=(--only-needed "$m"); done
done
"${link[@]}" -o "$tmp/linked.bc"; step llvm-link
# The kernels are cut into OXCCL_PTX_JOBS parts (default: the machine's cores, at most 4), each
# internalized to its own kernels, optimized and compiled on its own core; the parts' PTX texts
# are joined, each after a `// oxccl-ptx-part` line (build/ptx_split.rs splits them apart).
jobs=${OXCCL_PTX_JOBS:-$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)}
((jobs >= 1)) || jobs=1
((jobs <= 4)) || jobs=4
((jobs <= ${#exports[@]})) || jobs=${#exports[@]}
llc_args=(-mcpu="$cpu" -O3)
[[ -n "$feat" ]] && llc_args+=(-mattr="$feat")
part() { # $1 = part index: every jobs-th export from it
  local k=$1 keep=() i
  for ((i = k; i < ${#exports[@]}; i += jobs)); do keep+=("${exports[i]}"); done
  local list; list=$(IFS=,; echo "${keep[*]}")
  "$bin/opt" -passes=internalize,globaldce -internalize-public-api-list="$list" "$tmp/linked.bc" -o "$tmp/int$k.bc"
  "$bin/opt" -O3 "$tmp/int$k.bc" -o "$tmp/opt$k.bc"
  "$bin/llc" "${llc_args[@]}" "$tmp/opt$k.bc" -o "$tmp/part$k.ptx"
}
pids=()
for ((k = 0; k < jobs; k++)); do part "$k" & pids+=($!); done
for p in "${pids[@]}"; do wait "$p"; done
step "internalize+opt-O3+llc ($jobs parts)"
: > "$out"
for ((k = 0; k < jobs; k++)); do
  echo "// oxccl-ptx-part $k of $jobs" >> "$out"
  cat "$tmp/part$k.ptx" >> "$out"
done
