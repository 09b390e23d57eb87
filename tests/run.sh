#!/bin/sh
# Runs cmocka test binaries and keeps a tally across build variants.
#   run.sh DIR BIN...        run each binary, print its output and wall time,
#                            add to the tally
#   run.sh --stage NAME CMD  run CMD as one stage of `make test`, timed
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
	exit $rc
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
pass=0 fail=0 skip=0
for t in "$@"; do
	t0=$(now)
	out=$("$t" 2>&1)
	rc=$?
	dt=$(since "$t0")
	printf '%s\n' "$out"
	echo "run.sh: $t: $dt s"
	echo "bin $dt $t" >>"$times"
	if [ $rc = 77 ]; then
		skip=$((skip + 1))
		continue
	fi
	p=$(printf '%s\n' "$out" | sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' | tail -n1)
	f=$(printf '%s\n' "$out" | sed -n 's/^\[  FAILED  \] \([0-9]*\) test.*/\1/p' | tail -n1)
	s=$(printf '%s\n' "$out" | sed -n 's/^\[  SKIPPED \] \([0-9]*\) test.*/\1/p' | tail -n1)
	pass=$((pass + ${p:-0})); fail=$((fail + ${f:-0})); skip=$((skip + ${s:-0}))
	# A crash or a sanitizer report ends the binary without cmocka's summary.
	if [ $rc != 0 ] && [ "${f:-0}" = 0 ]; then
		echo "run.sh: $t exited with status $rc" >&2
		fail=$((fail + 1))
	fi
done
echo "$pass $fail $skip" >>"$tally"
echo "$label: $pass passed, $fail failed, $skip skipped"
[ "$fail" = 0 ]
