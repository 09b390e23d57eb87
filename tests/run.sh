#!/bin/sh
# Runs cmocka test binaries and keeps a tally across build variants.
#   run.sh LABEL BIN...      run the binaries (TEST_JOBS at once), print each
#                            one's output and wall time, add to the tally
#   run.sh --stage NAME CMD  run CMD as one stage of `make test`, timed; if it
#                            fails, print --total's summary so far
#   run.sh --reset           start a new tally
#   run.sh --total           print the ten slowest binaries, each stage's time
#                            and "N passed, N failed, N skipped"; exit 1 on
#                            failures
# A binary that exits 77 is a skip (no device, no feature) and says why.
tally=build/test-tally
times=build/test-times
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }
case "${1:-}" in
--reset) mkdir -p build; : >"$tally"; : >"$times"; exit 0 ;;
--stage)
	name=$2
	shift 2
	t0=$(now)
	"$@"
	rc=$?
	mkdir -p build
	echo "stage $(since "$t0") $name" >>"$times"
	# make stops at a failed stage and never reaches --total: summarise
	# here, so a failing `make test` still ends with where its time went.
	[ "$rc" = 0 ] || sh "$0" --total
	exit $rc
	;;
--one)
	# run.sh --one TMP IDX BIN: one binary of a parallel run (below);
	# run.sh --one TMP chain: the binaries of TMP/alone, one after another
	if [ "$3" = chain ]; then
		while read -r n t; do
			sh "$0" --one "$2" "$n" "$t"
		done <"$2/alone"
		exit 0
	fi
	t0=$(now)
	# A hung binary fails in 15 minutes instead of eating CI's 90 (the
	# slowest, test_tier under TSan, takes ~100 s on 2 cores).
	timeout -k 10 900 "$4" >"$2/$3.out" 2>&1
	rc=$?
	[ $rc = 124 ] && echo "run.sh: $4: killed after 900 s" >>"$2/$3.out"
	echo $rc >"$2/$3.rc"
	dt=$(since "$t0")
	echo "$dt" >"$2/$3.t"
	flock "$2/lock" sh -c 'cat "$1"; echo "run.sh: $2: $3 s"' sh "$2/$3.out" "$4" "$dt"
	exit 0
	;;
--total)
	if [ -s "$times" ]; then
		echo "slowest test binaries (s):"
		grep '^bin ' "$times" | sort -k2 -n -r | head -n 10 | awk '{printf "  %8.1f  %s\n", $2, $3}'
		echo "stages (s):"
		grep '^stage ' "$times" | awk '{printf "  %8.1f  %s\n", $2, $3; t+=$2} END {printf "  %8.1f  total\n", t}'
	fi
	awk '{p+=$1; f+=$2; s+=$3} END {printf "tests: %d passed, %d failed, %d skipped\n", p, f, s; exit (f > 0)}' "$tally"
	exit $?
	;;
esac
label=$1
shift
mkdir -p build
# TEST_JOBS binaries run at once (default: one per CPU), longest first by
# the times of earlier stages of this `make test`; each binary's output is
# printed whole when it ends.  The binaries that start a Redis Cluster
# (test_rcluster, test_remote) run one after another as a single job, first:
# their port probing is not meant to race another cluster's.
jobs=${TEST_JOBS:-$(nproc 2>/dev/null || echo 1)}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvd-run.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
i=0
for t in "$@"; do
	i=$((i + 1))
	prev=$(awk -v b="${t##*/}" '$1 == "bin" { n = split($3, p, "/"); if (p[n] == b) t = $2 } END { print t + 0 }' "$times" 2>/dev/null)
	case ${t##*/} in
	test_rcluster | test_remote) echo "$i $t" >>"$tmp/alone" ;;
	*) echo "${prev:-0} $i $t" >>"$tmp/all" ;;
	esac
done
[ -s "$tmp/alone" ] && echo "1e9 chain" >>"$tmp/all"
[ -s "$tmp/all" ] && sort -k1,1 -g -r "$tmp/all" | cut -d' ' -f2- |
	xargs -P "$jobs" -L 1 sh "$0" --one "$tmp"
pass=0 fail=0 skip=0
i=0
for t in "$@"; do
	i=$((i + 1))
	rc=$(cat "$tmp/$i.rc" 2>/dev/null || echo 127)
	echo "bin $(cat "$tmp/$i.t" 2>/dev/null || echo 0) $t" >>"$times"
	if [ "$rc" = 77 ]; then
		skip=$((skip + 1))
		continue
	fi
	out=$tmp/$i.out
	p=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' "$out" | tail -n1)
	f=$(sed -n 's/^\[  FAILED  \] \([0-9]*\) test.*/\1/p' "$out" | tail -n1)
	s=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) test.*/\1/p' "$out" | tail -n1)
	pass=$((pass + ${p:-0})); fail=$((fail + ${f:-0})); skip=$((skip + ${s:-0}))
	# A crash or a sanitizer report ends the binary without cmocka's summary.
	if [ "$rc" != 0 ] && [ "${f:-0}" = 0 ]; then
		echo "run.sh: $t exited with status $rc" >&2
		fail=$((fail + 1))
	fi
done
echo "$pass $fail $skip" >>"$tally"
echo "$label: $pass passed, $fail failed, $skip skipped"
[ "$fail" = 0 ]
