#!/bin/sh
# Runs libFuzzer targets for a fixed time each and adds them to the tally.
#   run.sh SECONDS BIN...
# Each BIN keeps its corpus in build/fuzz/corpus/<name>, also reads the
# committed seeds in tests/fuzz/seeds/<name> (never writes there) and the
# token dictionary tests/fuzz/seeds/<name>.dict when present, leaves
# its log in build/fuzz/<name>.log and any failing input as
# build/fuzz/<name>-crash-* (or -leak-, -timeout-, -oom-).  One line per
# target; exit 1 if any failed.  libFuzzer exits 77 on a crash: that is a
# failure here, not the test runner's skip.
secs=${1:?usage: run.sh SECONDS BIN...}
shift
tally=build/test-tally
mkdir -p build/fuzz
pass=0 fail=0
for bin in "$@"; do
	name=$(basename "$bin")
	corpus=build/fuzz/corpus/$name
	seeds=tests/fuzz/seeds/$name
	log=build/fuzz/$name.log
	mkdir -p "$corpus"
	# The loop's word list was expanded when it began, so the positional
	# parameters are free to hold this target's arguments (sh has no arrays).
	set -- "$corpus"
	[ -d "$seeds" ] && set -- "$@" "$seeds"
	[ -f "$seeds.dict" ] && set -- -dict="$seeds.dict" "$@"
	if [ ! -x "$bin" ]; then
		echo "$name: FAILED, no such fuzz binary $bin"
		fail=$((fail + 1))
		continue
	fi
	"$bin" -max_total_time="$secs" -timeout=10 -print_final_stats=0 \
		-artifact_prefix="build/fuzz/$name-" "$@" >"$log" 2>&1
	rc=$?
	runs=$(sed -n 's/^Done \([0-9]*\) runs in \([0-9]*\) second.*/\1 runs in \2 s/p' "$log" | tail -n1)
	if [ $rc = 0 ]; then
		echo "$name: ${runs:-? runs}, no crash"
		pass=$((pass + 1))
	else
		echo "$name: FAILED (status $rc), log $log:"
		grep -E 'ERROR|SUMMARY|Test unit written' "$log" | head -n 5
		grep -E '^ *#[0-9]+ .* in [^ ]+ [^ ]*(kvd|tests)/' "$log" | head -n 8
		fail=$((fail + 1))
	fi
done
echo "$pass $fail 0" >>"$tally"
[ "$fail" = 0 ]
