#!/usr/bin/env bash
# ptx-link.sh — the "linker" rustc calls for the nvptx64-nvidia-cuda cdylib (build.rs passes it
# with -C linker=...). rustc hands it LLVM bitcode objects and rlibs, the way it would hand them to
# llvm-bitcode-linker (which the registry here does not ship):
#   --export-symbol K ... <inputs .o/.rlib> --target-cpu sm_XX [--target-feature=+ptxNN] -o out.ptx
# We do the same job with the llvm-tools binaries of the pinned toolchain:
#   llvm-link (rlib members --only-needed) -> opt internalize+globaldce (keep the kernels)
#   -> opt -O3 -> llc -mcpu=sm_XX -mattr=+ptxNN -> out.ptx
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
link=("$bin/llvm-link" "${objs[@]}")
i=0
for r in "${rlibs[@]}"; do
  d="$tmp/rlib$i"; i=$((i+1)); mkdir -p "$d"
  (cd "$d" && "$bin/llvm-ar" x "$r")
  for m in "$d"/*.o; do [[ -e "$m" ]] && link+=(--only-needed "$m"); done
done
"${link[@]}" -o "$tmp/linked.bc"; step llvm-link
keep=$(IFS=,; echo "${exports[*]}")
"$bin/opt" -passes=internalize,globaldce -internalize-public-api-list="$keep" "$tmp/linked.bc" -o "$tmp/int.bc"; step internalize
"$bin/opt" -O3 "$tmp/int.bc" -o "$tmp/opt.bc"; step opt-O3
llc_args=(-mcpu="$cpu" -O3)
[[ -n "$feat" ]] && llc_args+=(-mattr="$feat")
"$bin/llc" "${llc_args[@]}" "$tmp/opt.bc" -o "$out"; step llc
