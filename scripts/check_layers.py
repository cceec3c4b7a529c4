#!/usr/bin/env python3
"""Checks the shape of src/ that docs/architecture.md promises:

- floors: a file includes only its own folder and the folders below it
  (FLOORS, lowest first), so no arrow runs back up;
- the Torch-free library (noloco_base in CMakeLists.txt) reaches no LibTorch
  header, directly or through our own headers;
- no function body is longer than MAX_FUNCTION_LINES.

Prints one line per breach and exits 1 if there is any. Run from anywhere:
    python3 scripts/check_layers.py
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src")
FLOORS = ["util", "wire", "config", "data", "model",
          "comm/store", "comm/membership", "comm/link", "comm/transport", "comm/view", "comm/launch",
          "optim", "pipeline", "sim", "train", "python", "cli"]
MAX_FUNCTION_LINES = 100
TORCH_HEADER = re.compile(r'#include\s*<(torch|ATen|c10)/')
OWN_HEADER = re.compile(r'#include\s*"([^"]+)"')


def floor_of(path):
    """The floor of a path relative to src/ (the longest folder that holds it)."""
    best = None
    for i, folder in enumerate(FLOORS):
        if path.startswith(folder + "/") and (best is None or len(folder) > len(FLOORS[best])):
            best = i
    return best


def code_only(text):
    """The text with comments and string/char literals blanked, newlines kept."""
    out, i, n = [], 0, len(text)
    while i < n:
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            k = text.find("(", i)
            end = ")" + text[i + 2:k] + '"'
            j = text.find(end, k)
            j = n if j < 0 else j + len(end)
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j
        elif text[i] in "\"'":
            quote, j = text[i], i + 1
            while j < n and text[j] not in (quote, "\n"):
                j += 2 if text[j] == "\\" else 1
            out.append(quote * 2)
            i = j + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def long_functions(text):
    """(first line, length) of each function body over the limit: a brace
    block outside any other function whose head ends in a parameter list."""
    code = code_only(text)
    stack, head, line = [], "", 1
    for ch in code:
        if ch == "\n":
            line += 1
        if ch == "{":
            if any(kind == "function" for kind, _ in stack):
                kind = "inner"
            else:
                last = head.strip().split("\n")[-1] if head.strip() else ""
                is_type = re.search(r"\b(namespace|class|struct|enum|union)\b", last)
                is_function = re.search(r"\)\s*(const|override|noexcept|final|mutable|->\s*[\w:<>,\s*&]+)*\s*$", head) \
                    or re.search(r"\)\s*:\s*\w", head)
                kind = "function" if is_function and not is_type else "block"
            stack.append((kind, line))
            head = ""
        elif ch == "}":
            if stack:
                kind, first = stack.pop()
                if kind == "function" and line - first + 1 > MAX_FUNCTION_LINES:
                    yield first, line - first + 1
            head = ""
        elif ch == ";":
            head = ""
        else:
            head += ch


def base_sources():
    cmake = open(os.path.join(ROOT, "CMakeLists.txt")).read()
    block = re.search(r"add_library\(noloco_base STATIC(.*?)\)", cmake, re.S).group(1)
    return [f[len("src/"):] for f in block.split() if f.startswith("src/")]


def main():
    files = {}
    for folder, _, names in os.walk(SRC):
        for name in names:
            if name.endswith((".h", ".cpp")):
                path = os.path.relpath(os.path.join(folder, name), SRC)
                files[path] = open(os.path.join(SRC, path)).read()
    breaches = []
    for path, text in sorted(files.items()):
        floor = floor_of(path)
        if floor is None:
            breaches.append(f"src/{path}: in no floor of scripts/check_layers.py")
            continue
        for n, l in enumerate(text.split("\n"), 1):
            m = OWN_HEADER.match(l.strip())
            if not m:
                continue
            target = floor_of(m.group(1))
            if target is not None and target > floor:
                breaches.append(f"src/{path}:{n}: {FLOORS[floor]} includes {m.group(1)}, a higher floor")
        for first, length in long_functions(text):
            breaches.append(f"src/{path}:{first}: function of {length} lines (at most {MAX_FUNCTION_LINES})")

    def reaches_torch(path, seen):
        if path in seen or path not in files:
            return None
        seen.add(path)
        if TORCH_HEADER.search(files[path]):
            return [path]
        for header in OWN_HEADER.findall(files[path]):
            chain = reaches_torch(header, seen)
            if chain:
                return [path] + chain
        return None

    for source in base_sources():
        chain = reaches_torch(source, set())
        if chain:
            breaches.append(f"src/{source}: in the Torch-free noloco_base but reaches LibTorch: {' -> '.join(chain)}")
    for b in breaches:
        print(b)
    print(f"check_layers: {len(files)} files, {len(breaches)} breaches")
    return 1 if breaches else 0


if __name__ == "__main__":
    sys.exit(main())
