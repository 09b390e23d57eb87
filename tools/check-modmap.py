#!/usr/bin/env python3
"""Checks the module map of docs/ARCHITECTURE.md against the objects.

    tools/check-modmap.py [--doc docs/ARCHITECTURE.md] [--obj build/obj]

The table under "### Module map" has the columns module | owns | callers.
Every .c file under engine/, shm/, proto/, kvd/store/ and kvd/ must be named
in the module column of some row; a row may name several (`spill` + `iob`,
`kern_{scalar,avx2}`), by file name without .c, or by path without .c where
two directories hold the same name.  The callers column lists modules,
parenthesised notes, and the words in WORDS, which stand for code outside
these directories and are not checked.  A module named there must call the
row: its object leaves undefined a symbol that an object of the row defines
(nm on OBJ/<path>.o, so run make first).  Every module of these directories
that calls the row must be named, except the row's own modules.  And no
two of these files may call each other, directly or round a longer circle
(the layers, and the files within one, depend one way).

Each problem is printed with the line of the table to fix, and the row as it
should read where that can be computed, so that a merge that adds a module
ends in a table edit.  Exit status 1 on any problem, 2 when the table or an
object is missing.
"""
import argparse
import os
import re
import subprocess
import sys

DIRS = ("engine", "shm", "proto", "kvd/store", "kvd")
WORDS = ("tests", "bench", "fuzz", "client", "kvctl", "main")
HEADING = "### Module map"


def sources(root):
    out = []
    for d in DIRS:
        p = os.path.join(root, d)
        if not os.path.isdir(p):
            continue
        for f in sorted(os.listdir(p)):
            if f.endswith(".c") and os.path.isfile(os.path.join(p, f)):
                out.append(d + "/" + f[:-2])
    return out


def cells(line):
    """Splits a table line on |, except inside backticks or after a backslash."""
    out, cur, tick, i = [], "", False, 0
    s = line.strip()
    if s.startswith("|"):
        s = s[1:]
    if s.endswith("|") and not s.endswith("\\|"):
        s = s[:-1]
    while i < len(s):
        c = s[i]
        if c == "\\" and i + 1 < len(s) and s[i + 1] == "|":
            cur += "|"
            i += 2
            continue
        if c == "`":
            tick = not tick
        if c == "|" and not tick:
            out.append(cur.strip())
            cur = ""
        else:
            cur += c
        i += 1
    out.append(cur.strip())
    return out


def expand(name):
    """kern_{scalar,avx2} -> kern_scalar, kern_avx2 (one brace group)."""
    m = re.match(r"^([^{}]*)\{([^{}]*)\}([^{}]*)$", name)
    if not m:
        return [name]
    return [m.group(1) + alt.strip() + m.group(3) for alt in m.group(2).split(",")]


def read_table(doc):
    with open(doc, encoding="utf-8") as f:
        lines = f.read().split("\n")
    try:
        start = next(i for i, l in enumerate(lines) if l.strip() == HEADING)
    except StopIteration:
        sys.exit("%s: no \"%s\" section" % (doc, HEADING))
    rows, seen = [], False
    for i in range(start + 1, len(lines)):
        l = lines[i]
        if l.startswith("#"):
            break
        if not l.lstrip().startswith("|"):
            if seen:
                break
            continue
        c = cells(l)
        if not seen:
            seen = True
            if [x.lower() for x in c] != ["module", "owns", "callers"]:
                sys.exit("%s:%d: the module map's columns are %s, not module | owns | callers"
                         % (doc, i + 1, " | ".join(c)))
            continue
        if re.match(r"^[-: ]*$", "".join(c)):
            continue
        if len(c) != 3:
            sys.exit("%s:%d: a module map row has %d cells, not 3" % (doc, i + 1, len(c)))
        mods = []
        for span in re.findall(r"`([^`]*)`", c[0]):
            mods += expand(span.strip())
        rows.append({"line": i + 1, "text": l, "cells": c, "mods": mods})
    if not rows:
        sys.exit("%s:%d: the module map has no rows" % (doc, start + 1))
    return rows


def parse_callers(cell):
    """The callers column: module names and words, notes in parentheses dropped."""
    names, depth, cur = [], 0, ""
    for ch in cell:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(0, depth - 1)
        elif depth == 0:
            cur += ch
    for tok in re.split(r"[,;]|\band\b", cur):
        tok = tok.strip().strip("`").strip()
        if tok and tok not in ("—", "-", "none"):
            names.append(tok)
    return names


def symbols(obj):
    def nm(*args):
        r = subprocess.run(["nm"] + list(args) + [obj], capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit("nm %s: %s" % (obj, r.stderr.strip()))
        return r.stdout.splitlines()
    defs = {l.split()[-1] for l in nm("-g", "--defined-only") if len(l.split()) >= 3}
    uses = {l.split()[-1] for l in nm("-u") if l.split()}
    return defs, uses


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--doc", default="docs/ARCHITECTURE.md")
    ap.add_argument("--obj", default="build/obj")
    ap.add_argument("--root", default=".")
    a = ap.parse_args()

    srcs = sources(a.root)
    stem = {}
    for p in srcs:
        stem.setdefault(os.path.basename(p), []).append(p)

    def resolve(name):
        if name in srcs:
            return name
        hits = stem.get(name, [])
        return hits[0] if len(hits) == 1 else None

    defs, uses = {}, {}
    for p in srcs:
        o = os.path.join(a.obj, p + ".o")
        if not os.path.exists(o):
            print("check-modmap: %s is not built (make it first: make %s)" % (o, o),
                  file=sys.stderr)
            return 2
        defs[p], uses[p] = symbols(o)

    def calls(caller, mods):
        """The symbols of mods that caller uses."""
        got = set()
        for m in mods:
            got |= uses[caller] & defs[m]
        return got

    doc = a.doc
    rows = read_table(doc)
    problems = []
    named = {}
    for r in rows:
        r["paths"] = []
        for m in r["mods"]:
            p = resolve(m)
            if p is None:
                amb = stem.get(m, [])
                if amb:
                    problems.append("%s:%d: row `%s`: `%s` is %s; name it by path (%s)"
                                    % (doc, r["line"], r["mods"][0], m,
                                       " and ".join(x + ".c" for x in amb),
                                       ", ".join("`%s`" % x for x in amb)))
                else:
                    problems.append("%s:%d: row `%s`: there is no %s.c under %s; "
                                    "fix the name or remove it from the row"
                                    % (doc, r["line"], r["mods"][0], m, ", ".join(DIRS)))
                continue
            if p in named:
                problems.append("%s:%d: row `%s`: %s.c is already named on line %d; "
                                "name it in one row"
                                % (doc, r["line"], r["mods"][0], p, named[p]))
                continue
            named[p] = r["line"]
            r["paths"].append(p)

    def short(p):
        b = os.path.basename(p)
        return b if len(stem.get(b, [])) == 1 else p

    def real_callers(paths):
        return sorted((c for c in srcs if c not in paths and calls(c, paths)),
                  key=lambda c: (DIRS.index(os.path.dirname(c)), c))

    for r in rows:
        if not r["paths"]:
            continue
        callers = parse_callers(r["cells"][2])
        real = real_callers(r["paths"])
        wrong, listed = [], set()
        for n in callers:
            p = resolve(n)
            if p is None:
                if n not in WORDS:
                    wrong.append((n, "is neither a module of %s nor one of the words %s"
                              % (", ".join(DIRS), ", ".join(WORDS))))
                continue
            listed.add(p)
            if p in r["paths"]:
                wrong.append((n, "is this row's own module"))
            elif p not in real:
                wrong.append((n, "uses nothing that %s defines"
                          % " or ".join(x + ".c" for x in r["paths"])))
        missing = [c for c in real if c not in listed]
        if not wrong and not missing:
            continue
        msg = ["%s:%d: row `%s`:" % (doc, r["line"], r["mods"][0])]
        for n, why in wrong:
            msg.append("  callers names `%s`, which %s" % (n, why))
        for c in missing:
            used = sorted(calls(c, r["paths"]))
            msg.append("  %s.c calls it (%s%s) but the callers column omits `%s`"
                   % (c, ", ".join(used[:3]), ", ..." if len(used) > 3 else "", short(c)))
        drop = {n for n, _ in wrong}
        keep = [n for n in callers if n not in drop]
        fixed = keep + [short(c) for c in missing]
        notes = re.findall(r"\([^()]*\)", r["cells"][2])
        col = ", ".join(fixed + notes) if fixed or notes else "—"
        msg.append("  the callers column should read: %s" % col)
        problems.append("\n".join(msg))

    for p in srcs:
        if p in named:
            continue
        real = real_callers([p])
        col = ", ".join(short(c) for c in real) or "—"
        problems.append("%s: no row of the module map names %s.c; add one, e.g.\n"
                        "  | `%s` | <what it owns> | %s |" % (doc, p, short(p), col))

    # No two files call each other, directly or round a longer circle: the
    # layers (and the files within one) depend one way.
    graph = {c: [m for m in srcs if m != c and uses[c] & defs[m]] for c in srcs}
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in srcs:
        if v not in index:
            visit(v)
    for comp in circles:
        edges = ["%s -> %s (%s)" % (short(c), short(m), ", ".join(sorted(uses[c] & defs[m])[:3]))
                 for c in comp for m in graph[c] if m in comp]
        problems.append("circle of calls among %s:\n  %s"
                        % (", ".join(c + ".c" for c in comp), "\n  ".join(edges)))

    if problems:
        for m in problems:
            print(m)
        print("check-modmap: %d problem%s in %s's module map (callers from nm on %s/)"
              % (len(problems), "" if len(problems) == 1 else "s", doc, a.obj))
        return 1
    print("modmap: %d rows name all %d modules of %s; every callers column matches nm; "
          "no circle of calls" % (len(rows), len(srcs), ", ".join(DIRS)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
