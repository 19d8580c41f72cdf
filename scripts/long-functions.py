#!/usr/bin/env python3
"""Lists every Rust function whose body is longer than a limit (120 lines by default), so
that CI keeps functions short enough to read and name. A function runs from the line of its
`fn` to the line that closes its body; braces in comments, strings and character literals
do not count.

Prints each long function as PATH:LINE NAME (N lines) and exits 1 if there is any; exits 0
with one summary line otherwise. Standard library only, so CI needs nothing installed.

    scripts/long-functions.py [--max N] [--self-test] [DIR...]   (default: src crates tests benches)
"""
import importlib.util
import os
import re
import sys

FN_RE = re.compile(r"\bfn\s+([A-Za-z_][A-Za-z0-9_]*)")


def load_stripper():
    """import-circles.py's stripper of comments, strings and char literals (one copy of it)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "import-circles.py")
    spec = importlib.util.spec_from_file_location("import_circles", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.strip_comments_and_strings


strip_code = load_stripper()


def long_functions(text, limit):
    """Yields (line, name, length) for each function whose body spans more than `limit` lines."""
    code = strip_code(text)
    for m in FN_RE.finditer(code):
        # The body opens at the first `{` after the signature, unless a `;` comes first
        # (a declaration in a trait or an extern block).
        j = m.end()
        depth_paren = 0
        while j < len(code):
            ch = code[j]
            if ch in "([":
                depth_paren += 1
            elif ch in ")]":
                depth_paren -= 1
            elif depth_paren == 0 and ch in "{;":
                break
            j += 1
        if j >= len(code) or code[j] == ";":
            continue
        depth, k = 0, j
        while k < len(code):
            if code[k] == "{":
                depth += 1
            elif code[k] == "}":
                depth -= 1
                if depth == 0:
                    break
            k += 1
        start = code.count("\n", 0, m.start()) + 1
        end = code.count("\n", 0, k) + 1
        if end - start + 1 > limit:
            yield start, m.group(1), end - start + 1


def scan(dirs, limit):
    found = []
    for base in dirs:
        for root, subdirs, names in os.walk(base):
            subdirs[:] = [d for d in subdirs if d not in ("target", ".git")]
            for name in sorted(names):
                if not name.endswith(".rs"):
                    continue
                path = os.path.join(root, name)
                with open(path, encoding="utf-8") as f:
                    text = f.read()
                found += [(path, *hit) for hit in long_functions(text, limit)]
    return found


def self_test():
    body = "\n".join("    let x = 1;" for _ in range(5))
    text = (
        "fn short() {\n" + body + "\n}\n"
        "fn braces_in_text() { let s = \"}}}\"; let c = '}'; // }\n" + body + "\n}\n"
        "trait T { fn decl(&self); }\n"
        "fn generic<'a>(x: &'a [u8; 4]) -> impl Fn() { move || {\n" + body + "\n} }\n"
    )
    got = {name: n for _, name, n in long_functions(text, 3)}
    want = {"short": 7, "braces_in_text": 7, "generic": 7}
    assert got == want, got
    assert list(long_functions(text, 7)) == [], "a body of exactly the limit is allowed"
    print("long-functions: self-test passed")


def main(argv):
    limit, dirs = 120, []
    args = iter(argv)
    for a in args:
        if a == "--max":
            limit = int(next(args))
        elif a == "--self-test":
            self_test()
            return 0
        else:
            dirs.append(a)
    dirs = dirs or [d for d in ("src", "crates", "tests", "benches") if os.path.isdir(d)]
    found = scan(dirs, limit)
    for path, line, name, n in found:
        print(f"{path}:{line} {name} ({n} lines)")
    if found:
        print(f"long-functions: {len(found)} function(s) longer than {limit} lines", file=sys.stderr)
        return 1
    print(f"long-functions: no function longer than {limit} lines in {', '.join(dirs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
