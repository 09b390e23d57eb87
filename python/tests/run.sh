#!/bin/sh
# make check-python: the Python package's tests (pytest) against a build's
# libkvclient.so and kvd, added to the tally of tests/run.sh.
#   python/tests/run.sh BUILD_DIR [pytest args...]
# Needs python3 with numpy and pytest (tools/deps.sh installs them, and
# torch, whose tests skip without it).
b=${1:?usage: run.sh BUILD_DIR [pytest args]}
shift
tally=build/test-tally
mkdir -p build
out=$(KVD_LIBKVCLIENT="$b/libkvclient.so" KVD_BIN="$b/kvd" PYTHONDONTWRITEBYTECODE=1 \
	/usr/bin/python3 -m pytest -p no:cacheprovider -q -rs python/tests "$@" 2>&1)
rc=$?
printf '%s\n' "$out"
last=$(printf '%s\n' "$out" | grep -E '(passed|failed|skipped|error|no tests ran)' | tail -n1)
count() { printf '%s\n' "$last" | sed -n "s/.*[^0-9]\([0-9][0-9]*\) $1.*/\1/p;s/^\([0-9][0-9]*\) $1.*/\1/p" | head -n1; }
pass=$(count passed); fail=$(count failed); skip=$(count skipped); err=$(count error)
pass=${pass:-0}; fail=$((${fail:-0} + ${err:-0})); skip=${skip:-0}
# pytest missing, a collection error, a crash: count it as a failure
if [ $rc != 0 ] && [ "$fail" = 0 ]; then
	echo "python/tests/run.sh: pytest exited with status $rc" >&2
	fail=1
fi
echo "$pass $fail $skip" >>"$tally"
echo "python: $pass passed, $fail failed, $skip skipped"
[ "$fail" = 0 ]
