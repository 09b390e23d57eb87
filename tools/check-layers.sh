#!/bin/sh
# Checks that the layers include only downward (docs/ARCHITECTURE.md,
# "Module map"), from the #include lines themselves:
#   - engine/ includes nothing of the project outside engine/ (the client
#     links it too, without the daemon or the ABI);
#   - shm/ and proto/ (libkvabi) include nothing of kvd/ or gpu-client/;
#   - kvd/store/ includes no daemon header (kvd/*.h, directly under kvd/)
#     and nothing of gpu-client/: the store stands alone under the daemon.
# System headers (<...>) and the generated kvd.pb-c.h are allowed
# everywhere.  An include is resolved as the compiler does with -I.: a bare
# "x.h" is the including file's directory first, then the root.  Prints
# every offending include as FILE:LINE: INCLUDE (LAYER must not include
# ...).  Exit 0 when none, 1 otherwise.  Usage: tools/check-layers.sh [ROOT]
#
# `allow` would name an arrow that has to run back up, as FILE:INCLUDE;
# there is none.
set -u
allow=""
cd "${1:-.}" || exit 1
bad=0
n=0
for f in $(find engine shm proto kvd -name '*.[ch]' | sort); do
	dir=${f%/*}
	n=$((n + 1))
	# "path" includes only: <...> are system headers (isa-l, systemd).
	grep -n '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' "$f" |
	sed 's/^\([0-9]*\):.*"\([^"]*\)".*/\1 \2/' >"${TMPDIR:-/tmp}/check-layers.$$"
	while read -r line inc; do
		[ "$inc" = kvd.pb-c.h ] && continue
		case $inc in
		*/*) t=$inc ;;
		*) if [ -e "$dir/$inc" ]; then t=$dir/$inc; else t=$inc; fi ;;
		esac
		why=
		case $dir in
		engine)
			case $t in engine/*) ;; *) why="engine/ includes only engine/" ;; esac ;;
		shm | proto)
			case $t in kvd/* | gpu-client/*) why="$dir/ must not include kvd/ or gpu-client/" ;; esac ;;
		kvd/store)
			case $t in
			kvd/store/*) ;;
			kvd/*/*) ;;
			kvd/* | gpu-client/*) why="kvd/store/ must not include a daemon header or gpu-client/" ;;
			esac ;;
		esac
		case " $allow " in *" $f:$t "*) why= ;; esac
		if [ -n "$why" ]; then
			echo "check-layers: $f:$line: #include \"$inc\" ($why)"
			bad=1
		fi
	done <"${TMPDIR:-/tmp}/check-layers.$$"
done
rm -f "${TMPDIR:-/tmp}/check-layers.$$"
if [ $bad = 0 ]; then
	echo "check-layers: $n files of engine/, shm/, proto/, kvd/ include only downward"
fi
exit $bad
