#!/bin/sh
# `make install` into a scratch DESTDIR, then use the installed tree the way
# a packager and a user of the library would:
#   - the FHS layout is there (binaries, the library with its soname links,
#     <kvd/kvc.h>, libkvclient.pc, man pages, docs, systemd unit, sysusers,
#     tmpfiles, the example config) and the unit points at the installed kvd;
#   - kvc.h compiles on its own (-std=c11 -Wall -Wextra -pedantic -Werror);
#   - a small program is built with `pkg-config --cflags --libs libkvclient`
#     (PKG_CONFIG_PATH and PKG_CONFIG_SYSROOT_DIR into the DESTDIR), linked
#     against the installed libkvclient.so, and run against the installed
#     kvd: kvc_connect to a socket nobody listens on fails with a message,
#     then it connects to the daemon, creates a profile and a sequence and
#     reads ServerStats; the installed kvctl sees that sequence and drains
#     the daemon, which exits 0;
#   - the man pages render without warnings (man -l), when man is there.
# Usage: tests/check-install.sh B   (B: the build directory, e.g. build)
# Exit 0 pass, 1 fail, 77 skip (no pkg-config or no C compiler).
set -u
B=${1:?usage: check-install.sh BUILD_DIR}
MAKE=${MAKE:-make}
CC=${CC:-cc}
prefix=/usr/local
say() { echo "check-install: $*"; }
if ! command -v pkg-config >/dev/null 2>&1; then
	say "SKIP, no pkg-config (apt-get install pkgconf)"
	exit 77
fi
if ! command -v "$CC" >/dev/null 2>&1; then
	say "SKIP, no C compiler $CC"
	exit 77
fi
tmp=$(mktemp -d /tmp/kvd-install.XXXXXX) || exit 1
dest=$tmp/root
kvd_pid=
cleanup() {
	[ -n "$kvd_pid" ] && kill "$kvd_pid" 2>/dev/null && wait "$kvd_pid" 2>/dev/null
	rm -rf "$tmp"
}
trap cleanup EXIT
fail() {
	say "FAILED: $*"
	exit 1
}

$MAKE --no-print-directory install B="$B" DESTDIR="$dest" PREFIX=$prefix >"$tmp/install.log" 2>&1 ||
	{ cat "$tmp/install.log"; fail "make install DESTDIR=$dest"; }

for f in bin/kvd bin/kvctl lib/libkvclient.so.3.1.0 include/kvd/kvc.h \
	lib/pkgconfig/libkvclient.pc share/man/man1/kvctl.1 share/man/man8/kvd.8 \
	share/doc/kvd/PROTOCOL.md share/doc/kvd/OPERATIONS.md \
	lib/systemd/system/kvd.service lib/sysusers.d/kvd.conf lib/tmpfiles.d/kvd.conf; do
	[ -f "$dest$prefix/$f" ] || fail "$prefix/$f not installed"
done
[ -f "$dest/etc/kvd/kvd.conf" ] || fail "/etc/kvd/kvd.conf not installed"
[ -x "$dest$prefix/bin/kvd" ] && [ -x "$dest$prefix/bin/kvctl" ] || fail "binaries not executable"
[ "$(readlink "$dest$prefix/lib/libkvclient.so.3")" = libkvclient.so.3.1.0 ] ||
	fail "lib/libkvclient.so.3 is not a link to libkvclient.so.3.1.0"
[ "$(readlink "$dest$prefix/lib/libkvclient.so")" = libkvclient.so.3 ] ||
	fail "lib/libkvclient.so is not a link to libkvclient.so.3"
soname=$(readelf -d "$dest$prefix/lib/libkvclient.so.3.1.0" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[ "$soname" = libkvclient.so.3 ] || fail "soname '$soname', want libkvclient.so.3"
grep -q "^ExecStart=$prefix/bin/kvd --config /etc/kvd/kvd.conf\$" "$dest$prefix/lib/systemd/system/kvd.service" ||
	fail "the installed unit's ExecStart is not $prefix/bin/kvd"
# A second install must keep an edited config.
echo "# edited" >>"$dest/etc/kvd/kvd.conf"
$MAKE --no-print-directory install B="$B" DESTDIR="$dest" PREFIX=$prefix >"$tmp/install.log" 2>&1 ||
	fail "second make install"
tail -n1 "$dest/etc/kvd/kvd.conf" | grep -q '^# edited$' || fail "make install overwrote /etc/kvd/kvd.conf"

export PKG_CONFIG_PATH="$dest$prefix/lib/pkgconfig" PKG_CONFIG_SYSROOT_DIR="$dest"
export PKG_CONFIG_LIBDIR="$PKG_CONFIG_PATH"     # nothing from the host's .pc files
flags=$(pkg-config --cflags --libs libkvclient) || fail "pkg-config --cflags --libs libkvclient"
version=$(pkg-config --modversion libkvclient)
say "pkg-config libkvclient $version: $flags"
case "$flags" in
*"-I$dest$prefix/include"*"-L$dest$prefix/lib"*"-lkvclient"*) ;;
*) fail "pkg-config flags do not point into DESTDIR: $flags" ;;
esac

# kvc.h stands alone, strictly.
printf '#include <kvd/kvc.h>\nint main(void) { return 0; }\n' >"$tmp/alone.c"
$CC -std=c11 -Wall -Wextra -pedantic -Werror $(pkg-config --cflags libkvclient) -c "$tmp/alone.c" \
	-o "$tmp/alone.o" || fail "kvd/kvc.h does not compile on its own"

cat >"$tmp/prog.c" <<'EOF'
#include <stdio.h>
#include <string.h>
#include <kvd/kvc.h>

int main(int argc, char **argv)
{
	struct kvc_opts o = { .socket_path = argv[2], .name = "installed" };
	struct kvc_opts bad = { .socket_path = argv[1] };
	struct kvc_model m = { .name = "installed", .layers = 2, .q_heads = 4, .kv_heads = 2,
			       .head_dim = 16, .K = 4, .L = 8, .c = 1, .sink = 4, .window = 16 };
	struct kvc_stats st;
	struct kvc_seq *s;
	struct kvc *c;
	int rc;

	if (argc != 3)
		return 2;
	/* no daemon there: fails, and says why */
	rc = kvc_connect(&bad, &c);
	if (rc == 0 || !strstr(kvc_last_error(c), "connect")) {
		fprintf(stderr, "kvc_connect to nothing: %d '%s'\n", rc, kvc_last_error(c));
		return 1;
	}
	kvc_close(c);
	if (kvc_connect(&o, &c) || kvc_profile(c, &m) || kvc_seq_create(c, &s) ||
	    kvc_server_stats(c, &st)) {
		fprintf(stderr, "against kvd: %s\n", kvc_last_error(c));
		return 1;
	}
	printf("%llu\n", (unsigned long long)kvc_seq_id(s));
	fflush(stdout);
	if (st.sequences != 1 || st.clients != 1) {
		fprintf(stderr, "ServerStats: %u sequences, %u clients\n", st.sequences, st.clients);
		return 1;
	}
	/* hold the connection (and the sequence) until stdin closes */
	while (getchar() != EOF)
		;
	kvc_close(c);
	return 0;
}
EOF
$CC -std=c11 -Wall -Wextra -Werror "$tmp/prog.c" -o "$tmp/prog" $flags ||
	fail "building a program with pkg-config's flags"
readelf -d "$tmp/prog" | grep -q 'NEEDED.*\[libkvclient.so.3\]' ||
	fail "the program does not need libkvclient.so.3"

export LD_LIBRARY_PATH="$dest$prefix/lib"
sock=$tmp/kvd.sock
"$dest$prefix/bin/kvd" --foreground --socket "$sock" --threads 1 --mem-limit 256M \
	--log-level warning --metrics-listen "" >"$tmp/kvd.log" 2>&1 &
kvd_pid=$!
i=0
while [ ! -S "$sock" ]; do
	i=$((i + 1))
	[ $i -gt 500 ] && { cat "$tmp/kvd.log"; fail "the installed kvd did not start"; }
	kill -0 $kvd_pid 2>/dev/null || { cat "$tmp/kvd.log"; fail "the installed kvd exited"; }
	sleep 0.02
done
mkfifo "$tmp/hold"
"$tmp/prog" "$tmp/nobody.sock" "$sock" <"$tmp/hold" >"$tmp/prog.out" &
prog_pid=$!
exec 9>"$tmp/hold"
i=0
while [ ! -s "$tmp/prog.out" ]; do
	i=$((i + 1))
	kill -0 $prog_pid 2>/dev/null || break
	[ $i -gt 500 ] && break
	sleep 0.02
done
seq=$(head -n1 "$tmp/prog.out")
[ -n "$seq" ] || { exec 9>&-; wait $prog_pid; fail "the program against the installed tree failed"; }
out=$("$dest$prefix/bin/kvctl" --socket "$sock" --json seqs) || fail "installed kvctl seqs"
case "$out" in
*"\"seq\":$seq,"*) ;;
*) fail "installed kvctl seqs does not list sequence $seq: $out" ;;
esac
exec 9>&-
wait $prog_pid || fail "the program against the installed tree exited $?"
"$dest$prefix/bin/kvctl" --socket "$sock" drain >/dev/null || fail "installed kvctl drain"
wait $kvd_pid
rc=$?
kvd_pid=
[ $rc = 0 ] || { cat "$tmp/kvd.log"; fail "kvd exited $rc after the drain"; }

if command -v man >/dev/null 2>&1; then
	for m in man1/kvctl.1 man8/kvd.8; do
		warn=$(LC_ALL=C.UTF-8 MANWIDTH=80 man --warnings -l "$dest$prefix/share/man/$m" 2>&1 >/dev/null)
		[ -z "$warn" ] || fail "man -l $m: $warn"
	done
fi
say "ok: installed under DESTDIR, built and ran a program with pkg-config libkvclient $version"
exit 0
