#!/bin/sh
# The device checks of docs/GPU.md in one command, for a machine with a GPU
# but not necessarily this project's Debian libraries: binaries built here
# (make with CUDA), the non-system shared libraries beside them in LIBDIR.
#   tools/gpu-check.sh [LIBDIR] [OUTDIR]    stages: tests, sanitizers, figures
# Each stage's log goes to OUTDIR; a summary line per check goes to stdout.
set -u
libdir=${1:-.devlibs}
out=${2:-${OUT:-/tmp/gpu-check}}
stages=${GPU_CHECK:-tests sanitize figures}
mkdir -p "$out"
export LD_LIBRARY_PATH="$(cd "$libdir" && pwd):/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
status=0
check() { # name command...
	name=$1
	shift
	t0=$(date +%s)
	"$@" >"$out/$name.log" 2>&1
	rc=$?
	printf '%-28s rc=%-3s %4ss  %s\n' "$name" "$rc" "$(($(date +%s) - t0))" \
		"$(grep -E 'PASSED|FAILED|ERROR SUMMARY' "$out/$name.log" | tr '\n' ' ' | cut -c1-90)"
	[ $rc = 0 ] || status=1
}
CS=/usr/local/cuda/bin/compute-sanitizer
for s in $stages; do
	case $s in
	tests)
		check gpu_plan build/tests/test_gpu_plan
		check cuda_kern build/tests/test_cuda_kern
		check cuda_kvc build/tests/test_cuda_kvc
		;;
	sanitize)
		for tool in memcheck racecheck initcheck synccheck; do
			check "cs_${tool}_kern" $CS --tool $tool --error-exitcode 1 build/tests/test_cuda_kern
		done
		check cs_memcheck_kvc $CS --tool memcheck --leak-check full --error-exitcode 1 build/tests/test_cuda_kvc
		check cs_initcheck_kvc $CS --tool initcheck --error-exitcode 1 build/tests/test_cuda_kvc
		check cs_memcheck_decode_kvd $CS --tool memcheck --error-exitcode 1 build/kvd-decode --attn=kvd --ctx 4k --batch 2 --layers 4 --steps 4
		check cs_memcheck_decode_dense $CS --tool memcheck --error-exitcode 1 build/kvd-decode --attn=gpu-dense --ctx 4k --batch 2 --layers 4 --steps 4
		;;
	figures)
		check decode_dense build/kvd-decode --json --attn=gpu-dense --ctx 96k --batch 4 --steps 32
		check decode_kvd build/kvd-decode --json --attn=kvd --ctx 96k --batch 4 --steps 32 --slot-size 16M
		check bench_gpu build/kvbench gpu --json --ctx 96k --dense-batch 4 --batch 4 --steps 32
		;;
	esac
done
exit $status
