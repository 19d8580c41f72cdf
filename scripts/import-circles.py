#!/usr/bin/env python3
"""Finds import circles between the files of each crate of the workspace.

Each source file (a mod.rs included) is a node. There is an arrow from file A to file B when
A names an item that B defines: through a `use` declaration or a path written in the code
(`crate::...`, `super::...`, `self::...`, or a child module's name). Re-exports are followed
to the file that really defines the item: `pub use` in a mod.rs is no arrow unless the mod.rs
uses the name itself, and a use of the re-exported name is an arrow to the defining file, not to the
mod.rs that re-exports it. A circle is a strongly connected component of two or more files.

Prints every circle with the arrows that close it and exits 1 if there is any; exits 0 with
one summary line otherwise. Standard library only, so CI needs nothing installed.

    scripts/import-circles.py [CRATE_SRC_DIR ...]   (default: every crate of the workspace)
    scripts/import-circles.py --self-test            (checks the checker on made-up crates)
"""
import os
import re
import sys

ITEM_RE = re.compile(
    r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:(?:unsafe|async|const|extern\s+\"C\")\s+)*"
    r"(?:struct|enum|fn|trait|type|const|static|union|mod)\s+([A-Za-z_][A-Za-z0-9_]*)",
    re.M,
)
MACRO_RE = re.compile(r"^\s*macro_rules!\s*([A-Za-z_][A-Za-z0-9_]*)", re.M)
PATH_ATTR_RE = re.compile(r'#\[path\s*=\s*"([^"]+)"\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;')
MOD_DECL_RE = re.compile(
    r"^\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+([A-Za-z_][A-Za-z0-9_]*)\s*;", re.M
)
INLINE_MOD_RE = re.compile(r"\bmod\s+[A-Za-z_][A-Za-z0-9_]*\s*\{")
USE_RE = re.compile(r"^\s*(pub(?:\([^)]*\))?\s+)?use\s+([^;]*);", re.M | re.S)
PATH_RE = re.compile(r"\b((?:crate|super|self)(?:\s*::\s*[A-Za-z_][A-Za-z0-9_]*)+)")


def strip_comments_and_strings(text):
    """Blanks out comments, string and char literals, keeping line structure."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    if text[i] == "\n":
                        out.append("\n")
                    i += 1
        elif c == "r" and re.match(r'r#*"', text[i:i + 10]) and (i == 0 or not text[i - 1].isalnum()):
            m = re.match(r'r(#*)"', text[i:])
            end = text.find('"' + m.group(1), i + len(m.group(0)))
            end = n if end < 0 else end + 1 + len(m.group(1))
            out.append('""' + "\n" * text.count("\n", i, end))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i:i + 4]) or text.startswith("'\\", i):
            m = re.match(r"'(\\u\{[0-9a-fA-F]+\}|\\x[0-9a-fA-F]{2}|\\.|[^\\'])'", text[i:])
            if m:
                out.append("' '")
                i += len(m.group(0))
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def expand_use_tree(tree):
    """Expands `a::{b, c::{d as e}, f::*}` into (path segments, local name or '*') pairs."""
    results = []

    def walk_spaced(prefix, s):
        depth, parts, cur = 0, [], ""
        for ch in s:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
            else:
                cur += ch
        if cur.strip():
            parts.append(cur)
        for part in parts:
            part = part.strip()
            if not part:
                continue
            brace = part.find("{")
            if brace >= 0:
                head = [x.strip() for x in part[:brace].split("::") if x.strip()]
                walk_spaced(prefix + head, part[brace + 1:part.rfind("}")])
                continue
            m = re.match(r"^(.*?)\s+as\s+([A-Za-z_][A-Za-z0-9_]*)$", part, re.S)
            path, alias = (m.group(1), m.group(2)) if m else (part, None)
            segs = prefix + [x.strip() for x in path.split("::") if x.strip()]
            if segs and segs[-1] == "self":
                segs = segs[:-1]
            if not segs:
                continue
            local = "*" if segs[-1] == "*" else (alias or segs[-1])
            results.append((segs, local))

    walk_spaced([], re.sub(r"\s+", " ", tree))
    return results


class Module:
    def __init__(self, path, file, parent):
        self.path = path  # tuple of module names from the crate root
        self.file = file
        self.parent = parent
        self.children = {}
        self.inline = False


class Crate:
    def __init__(self, root_file):
        self.root_dir = os.path.dirname(root_file)
        self.files = {}  # file -> stripped text
        self.modules = {}  # path tuple -> Module
        self._inline = {}  # file -> spans of inline modules
        self.root = self._load((), root_file, None)

    def _load(self, path, file, parent):
        mod = Module(path, file, parent)
        self.modules[path] = mod
        raw = open(file, encoding="utf-8").read()
        text = strip_comments_and_strings(raw)
        self.files[file] = text
        base = os.path.dirname(file)
        stem = os.path.splitext(os.path.basename(file))[0]
        own_dir = base if stem in ("mod", "lib", "main") or path == () else os.path.join(base, stem)
        # `#[path = "x.rs"] mod name;` names its file relative to this file's directory.
        given = {m.group(2): os.path.join(base, m.group(1)) for m in PATH_ATTR_RE.finditer(raw)}
        for name in MOD_DECL_RE.findall(text):
            cands = [given[name]] if name in given else []
            cands += [os.path.join(own_dir, name + ".rs"), os.path.join(own_dir, name, "mod.rs")]
            for cand in cands:
                if os.path.exists(cand):
                    mod.children[name] = self._load(path + (name,), cand, mod)
                    break
        return mod

    def inline_depth(self, file, pos):
        """How many inline `mod name { ... }` blocks enclose position `pos` of the file."""
        if file not in self._inline:
            text, spans = self.files[file], []
            for m in INLINE_MOD_RE.finditer(text):
                depth, j = 1, m.end()
                while j < len(text) and depth:
                    depth += {"{": 1, "}": -1}.get(text[j], 0)
                    j += 1
                spans.append((m.end(), j))
            self._inline[file] = spans
        return sum(1 for a, b in self._inline[file] if a <= pos < b)

    def defined(self, file):
        text = self.files[file]
        return set(ITEM_RE.findall(text)) | set(MACRO_RE.findall(text))

    def uses(self, file):
        """(segments, local name, is_pub, inline depth) for every use declaration of the file."""
        out = []
        for m in USE_RE.finditer(self.files[file]):
            depth = self.inline_depth(file, m.start())
            for segs, local in expand_use_tree(m.group(2)):
                out.append((segs, local, bool(m.group(1)), depth))
        return out

    def resolve(self, mod, segs, seen=None, inline=0):
        """The files that define what `segs`, written in module `mod` (inside `inline` inline
        modules of its file), names."""
        seen = seen or set()
        key = (mod.path, tuple(segs))
        if key in seen or not segs:
            return set()
        seen.add(key)
        cur = mod
        i = 0
        first = segs[0]
        if first == "crate":
            cur, i = self.root, 1
        elif first in ("super", "self"):
            while i < len(segs) and segs[i] in ("super", "self"):
                if segs[i] == "super" and inline > 0:
                    inline -= 1
                elif segs[i] == "self" and inline > 0:
                    return {cur.file}
                elif segs[i] == "super":
                    if cur.parent is None:
                        return set()
                    cur = cur.parent
                i += 1
        elif first in mod.children:
            pass
        else:
            # A name brought in by a use of this module, or an external crate.
            for useg, local, _, _ in self.uses(mod.file):
                if local == first and useg[0] != first:
                    return self.resolve(mod, useg + segs[1:], seen)
            return set()
        while i < len(segs):
            s = segs[i]
            if s == "*":
                return {cur.file}
            if s in cur.children:
                cur = cur.children[s]
                i += 1
                continue
            if s in self.defined(cur.file):
                return {cur.file}
            found = set()
            for useg, local, is_pub, _ in self.uses(cur.file):
                if local == s:
                    found |= self.resolve(cur, useg, seen)
                elif local == "*" and is_pub:
                    found |= self.resolve(cur, useg[:-1] + [s], seen)
            return found
        return {cur.file}

    def edges(self):
        arrows = {}
        for mod in self.modules.values():
            text = self.files[mod.file]
            body = USE_RE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
            body = MOD_DECL_RE.sub("", body)
            # A re-export only passes a name on (whoever uses it gets an arrow to its definer),
            # unless the re-exporting file uses the name itself.
            paths = [
                (segs, depth)
                for segs, local, is_pub, depth in self.uses(mod.file)
                if not is_pub or local == "*" or re.search(r"\b%s\b" % re.escape(local), body)
            ]
            path_res = [PATH_RE]
            if mod.children:
                names = "|".join(map(re.escape, mod.children))
                path_res.append(re.compile(
                    r"(?<![:\w])((?:%s)(?:\s*::\s*[A-Za-z_][A-Za-z0-9_]*)+)" % names))
            for path_re in path_res:
                for m in path_re.finditer(body):
                    segs = [x.strip() for x in m.group(1).split("::")]
                    paths.append((segs, self.inline_depth(mod.file, m.start())))
            for segs, depth in paths:
                for target in self.resolve(mod, segs, inline=depth):
                    if target != mod.file:
                        arrows.setdefault(mod.file, {}).setdefault(target, "::".join(segs))
        return arrows


def circles(arrows):
    """Strongly connected components with more than one file (Tarjan, iterative)."""
    index, low, on, stack, sccs = {}, {}, set(), [], []
    counter = [0]
    nodes = set(arrows) | {t for ts in arrows.values() for t in ts}
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(arrows.get(start, {}))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            node, it = work[-1]
            advanced = False
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(arrows.get(nxt, {})))))
                    advanced = True
                    break
                if nxt in on:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    sccs.append(sorted(comp))
    return sccs


def crate_roots(repo):
    roots = []
    for d in [os.path.join(repo, "src")] + sorted(
        os.path.join(repo, "crates", c, "src") for c in os.listdir(os.path.join(repo, "crates"))
    ):
        for name in ("lib.rs", "main.rs"):
            if os.path.exists(os.path.join(d, name)):
                roots.append(os.path.join(d, name))
    return roots


def self_test():
    """The checker must see a circle through a use, a path in code and a parent's item, and
    must not see one through a facade's re-export or a test module's `super::*`."""
    import tempfile

    cases = {
        "use": ({"lib.rs": "mod a;\nmod b;", "a.rs": "use crate::b::B;\npub struct A;",
                 "b.rs": "use super::a::A;\npub struct B;"}, 1),
        "path in code": ({"lib.rs": "mod a;\nmod b;", "a.rs": "pub fn f() { crate::b::g() }",
                          "b.rs": "pub fn g() { super::a::f() }"}, 1),
        "parent and child": ({"lib.rs": "mod c;\npub struct P;\nfn f() { c::g() }",
                              "c.rs": "use super::P;\npub fn g() {}"}, 1),
        "facade": ({"lib.rs": "mod a;\nmod b;\npub use a::A;\npub use b::B;",
                    "a.rs": "pub struct A;\n#[cfg(test)]\nmod tests { use super::*; }",
                    "b.rs": "use crate::A;\npub struct B;"}, 0),
    }
    failed = 0
    for name, (files, want) in cases.items():
        with tempfile.TemporaryDirectory() as d:
            for f, text in files.items():
                with open(os.path.join(d, f), "w", encoding="utf-8") as out:
                    out.write(text + "\n")
            got = len(circles(Crate(os.path.join(d, "lib.rs")).edges()))
            if got != want:
                print(f"self-test {name!r}: {got} circles found, {want} expected")
                failed += 1
    print(f"import-circles self-test: {len(cases) - failed} of {len(cases)} cases right")
    return 1 if failed else 0


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    roots = []
    for arg in sys.argv[1:]:
        roots += [os.path.join(arg, n) for n in ("lib.rs", "main.rs") if os.path.exists(os.path.join(arg, n))]
    roots = roots or crate_roots(repo)
    found = 0
    files = 0
    for root in roots:
        crate = Crate(root)
        files += len(crate.files)
        arrows = crate.edges()
        for comp in circles(arrows):
            found += 1
            rel = lambda f: os.path.relpath(f, repo)
            print(f"import circle in {rel(crate.root_dir)}: {len(comp)} files")
            members = set(comp)
            for f in comp:
                for t, via in sorted(arrows.get(f, {}).items()):
                    if t in members:
                        print(f"  {rel(f)} -> {rel(t)}   ({via})")
    if found:
        print(f"{found} import circle(s) found in {len(roots)} crates ({files} files)")
        return 1
    print(f"no import circles in {len(roots)} crates ({files} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
