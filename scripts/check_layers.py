#!/usr/bin/env python3
"""Checks the include rules of docs/architecture.md: which folder may include which.

Every header under include/blockflow/<folder>/ and every source under lib/<folder>/ may include
BlockFlow headers only from the folders its own folder is allowed to use (RULES below); the core
library's folders may use the channel folder's in-process part only (channel.hpp, inproc_channel.hpp).
No file of include/ or lib/ is longer than MAX_LINES (a newcomer holds one in their head).
Prints one line per broken rule and exits 1, or prints "layers: ok (N files)".
usage: check_layers.py SOURCE_DIR
"""
import pathlib
import re
import sys

# folder -> folders whose headers it may include (its own always)
RULES = {
    "core": {"deploy", "observe", "channel"},
    "deploy": {"core"},
    "observe": {"core"},
    "channel": {"core"},
    "worker": {"core", "deploy", "observe", "channel", "serve"},
    "serve": {"core", "deploy", "observe", "channel"},
    "plan": {"core", "deploy", "observe", "channel"},
}
# The folders built into blockflow::core may use only these headers of channel/.
CORE_LIBRARY = {"core", "deploy", "observe"}
IN_PROCESS_CHANNEL = {"channel/channel.hpp", "channel/inproc_channel.hpp"}
MAX_LINES = 650
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]blockflow/([^>"]+)[>"]', re.M)


def folder_of(path, root):
    rel = path.relative_to(root).parts
    if rel[0] == "include" and len(rel) > 3:
        return rel[2]
    if rel[0] == "lib" and len(rel) > 2:
        return rel[1]
    return None


def main():
    root = pathlib.Path(sys.argv[1])
    files = [p for p in (root / "include" / "blockflow").rglob("*.hpp")]
    files += [p for p in (root / "lib").rglob("*") if p.suffix in (".cpp", ".hpp")]
    problems = []
    for path in sorted(files):
        lines = path.read_text(encoding="utf-8").count("\n")
        if lines > MAX_LINES:
            problems.append(f"{path.relative_to(root)}: {lines} lines, more than {MAX_LINES}: split it by responsibility")
        folder = folder_of(path, root)
        if folder is None:
            continue
        if folder not in RULES:
            problems.append(f"{path.relative_to(root)}: folder '{folder}' has no rule in check_layers.py")
            continue
        # the in-process channel is built into blockflow::core and follows its rules
        lib_folder = "core" if path.name in ("inproc_channel.cpp", "inproc_channel.hpp", "channel.hpp") else folder
        for included in INCLUDE.findall(path.read_text(encoding="utf-8")):
            target = included.split("/")[0]
            if "/" not in included or target == folder:
                continue
            if target not in RULES[folder] and not (lib_folder == "core" and included in IN_PROCESS_CHANNEL):
                problems.append(f"{path.relative_to(root)}: {folder}/ may not include blockflow/{included}")
            elif lib_folder in CORE_LIBRARY | {"core"} and target == "channel" and included not in IN_PROCESS_CHANNEL:
                problems.append(f"{path.relative_to(root)}: blockflow::core may not include blockflow/{included} "
                                "(the cross-process channels are blockflow::channels)")
    for p in problems:
        print(p)
    if problems:
        sys.exit(1)
    print(f"layers: ok ({len(files)} files)")


if __name__ == "__main__":
    main()
