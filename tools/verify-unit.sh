#!/bin/sh
# Checks the systemd files in systemd/:
#   - kvd.service with `systemd-analyze verify`.  The unit's ExecStart is
#     /usr/local/bin/kvd, which a build machine does not have and verify
#     refuses ("Command ... is not executable"), so a temporary copy is
#     verified with that one path replaced by /bin/true (arguments kept);
#     every other line is checked as written.  Any output from verify about
#     the unit is a failure, not only its exit status (verify reports some
#     problems as warnings and still exits 0).
#   - kvd.service with `systemd-analyze security --offline=yes` (same
#     stand-in copy): the overall exposure it prints must be at most
#     $max_exposure, so a hardening option dropped by accident fails here
#     rather than in production.  Needs systemd 250+ for --offline; older
#     ones skip this check and say so.
#   - kvd.tmpfiles gives /var/lib/kvd (and anything under it) no age: its
#     --persist spill files and quarantine/ must never be cleaned by
#     systemd-tmpfiles-clean.timer, however old.
#   - kvd.sysusers and kvd.tmpfiles, applied to a scratch root with
#     systemd-sysusers / systemd-tmpfiles --root (only as root: tmpfiles
#     chowns; skipped otherwise).
# Exit 0 when all pass, 1 on a failure, 77 when systemd-analyze is missing
# (apt-get install systemd).  Usage: tools/verify-unit.sh [SYSTEMD_DIR]
set -u
src=${1:-systemd}
max_exposure=1.5
if ! command -v systemd-analyze >/dev/null 2>&1; then
	echo "verify-unit: SKIP, no systemd-analyze (apt-get install systemd)"
	exit 77
fi
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT
fail=0

sed 's|^ExecStart=/usr/local/bin/kvd|ExecStart=/bin/true|' "$src/kvd.service" >"$tmp/kvd.service"
if ! grep -q '^ExecStart=/bin/true ' "$tmp/kvd.service"; then
	echo "verify-unit: FAILED, no ExecStart=/usr/local/bin/kvd line to stand in for"
	exit 1
fi
# verify also loads the units this one names (multi-user.target): those
# are the host's and not ours to judge, so only lines about kvd count.
out=$(cd "$tmp" && SYSTEMD_LOG_LEVEL=notice systemd-analyze verify --man=no ./kvd.service 2>&1)
rc=$?
ours=$(printf '%s\n' "$out" | grep -i 'kvd' || true)
if [ $rc != 0 ] || [ -n "$ours" ]; then
	echo "verify-unit: kvd.service FAILED (status $rc):"
	printf '%s\n' "$out"
	fail=1
else
	echo "verify-unit: kvd.service ok"
fi

if systemd-analyze security --help 2>&1 | grep -q -- '--offline'; then
	# C locale and no colours: the score is parsed, "0.5" not "0,5".
	out=$(cd "$tmp" && LC_ALL=C SYSTEMD_COLORS=0 systemd-analyze security --offline=yes \
		--no-pager ./kvd.service 2>&1)
	score=$(printf '%s\n' "$out" | sed -n 's/.*Overall exposure level for kvd\.service: *\([0-9][0-9.]*\).*/\1/p')
	if [ -z "$score" ]; then
		echo "verify-unit: kvd.service security FAILED, no exposure score:"
		printf '%s\n' "$out"
		fail=1
	elif awk -v s="$score" -v m="$max_exposure" 'BEGIN { exit !(s + 0 > m + 0) }'; then
		echo "verify-unit: kvd.service exposure $score FAILED (at most $max_exposure); what counts:"
		printf '%s\n' "$out" | grep -v -e '^+ ' -e '^✓ '
		fail=1
	else
		echo "verify-unit: kvd.service exposure $score ok (at most $max_exposure)"
	fi
else
	echo "verify-unit: kvd.service exposure not checked (systemd-analyze has no --offline)"
fi

# Type Path Mode User Group Age: any line for /var/lib/kvd or below with an
# age other than "-" would let systemd-tmpfiles-clean delete --persist files.
aged=$(awk '$1 !~ /^#/ && ($2 == "/var/lib/kvd" || index($2, "/var/lib/kvd/") == 1) &&
	   NF >= 6 && $6 != "-" { print FILENAME ":" FNR ": " $0 }' "$src/kvd.tmpfiles")
if ! grep -Eq '^[^#[:space:]]+[[:space:]]+/var/lib/kvd/?[[:space:]]' "$src/kvd.tmpfiles"; then
	echo "verify-unit: kvd.tmpfiles FAILED, no line for /var/lib/kvd"
	fail=1
elif [ -n "$aged" ]; then
	echo "verify-unit: kvd.tmpfiles FAILED, /var/lib/kvd must carry no age (persisted spill files):"
	printf '%s\n' "$aged"
	fail=1
else
	echo "verify-unit: kvd.tmpfiles leaves /var/lib/kvd unaged ok"
fi

if [ "$(id -u)" = 0 ] && command -v systemd-sysusers >/dev/null && command -v systemd-tmpfiles >/dev/null; then
	root=$tmp/root
	mkdir -p "$root/etc" "$root/usr/lib/sysusers.d" "$root/usr/lib/tmpfiles.d"
	cp "$src/kvd.sysusers" "$root/usr/lib/sysusers.d/kvd.conf"
	cp "$src/kvd.tmpfiles" "$root/usr/lib/tmpfiles.d/kvd.conf"
	# Both tools warn about a bad line as "FILE:LINE: ..." and go on.
	if ! out=$(systemd-sysusers --root="$root" 2>&1) ||
	   printf '%s\n' "$out" | grep -q 'kvd\.conf:[0-9]' ||
	   ! grep -q '^kvd:' "$root/etc/passwd" || ! grep -q '^kvd:' "$root/etc/group"; then
		echo "verify-unit: kvd.sysusers FAILED:"
		printf '%s\n' "$out"
		fail=1
	elif ! out=$(systemd-tmpfiles --root="$root" --create 2>&1) ||
	     [ -n "$out" ] || [ ! -d "$root/var/lib/kvd" ] || [ ! -d "$root/run/kvd" ]; then
		echo "verify-unit: kvd.tmpfiles FAILED:"
		printf '%s\n' "$out"
		fail=1
	else
		echo "verify-unit: kvd.sysusers, kvd.tmpfiles ok"
	fi
else
	echo "verify-unit: kvd.sysusers, kvd.tmpfiles not checked (needs root)"
fi
exit $fail
