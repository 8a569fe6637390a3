#!/usr/bin/env python3
"""Checks that every example snippet in the README is the example source, character for character.

usage: check_readme_snippets.py README.md EXAMPLE.cpp...
The snippet of an example is the text between its `// [readme-start]` and `// [readme-end]` lines,
with the common indentation removed; the README must contain it inside a ```cpp block.
"""
import re
import sys
import textwrap


def snippet(path):
    text = open(path, encoding="utf-8").read()
    m = re.search(r"^[ \t]*// \[readme-start\]\n(.*?)^[ \t]*// \[readme-end\]", text, re.S | re.M)
    if not m:
        sys.exit(f"{path}: no // [readme-start] ... // [readme-end] markers")
    return textwrap.dedent(m.group(1)).strip("\n")


def main():
    readme = open(sys.argv[1], encoding="utf-8").read()
    blocks = [b.strip("\n") for b in re.findall(r"```cpp\n(.*?)```", readme, re.S)]
    failed = False
    for example in sys.argv[2:]:
        want = snippet(example)
        if any(want in block for block in blocks):
            print(f"ok: {example} is in the README")
        else:
            print(f"MISMATCH: the README has no ```cpp block containing the snippet of {example}:\n{want}")
            failed = True
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
