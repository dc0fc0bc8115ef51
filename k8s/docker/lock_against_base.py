"""The training image's constraints file: its extras locked against the base image's own versions.

Run inside k8s/docker/Dockerfile.train on the base image (verl's vLLM image), before installing
k8s/docker/requirements-train.txt. Writes ``--out``, a pip constraints file holding

- every package the base has, at the version the base has (its ``pip freeze``): pip keeps them, and fails instead of
  replacing one of the base's CUDA builds (torch, vLLM, flash-attn) or its numpy / protobuf / transformers;
- every package of the project's lock (constraints.txt) that the base lacks, at the lock's version: what the extras
  pull in is what the test suite runs, not whatever is newest on the build day;

except the packages requirements-train.txt pins itself (its pin wins: Pillow, qwen-vl-utils). It first checks that the
base has every package k8s/docker/base-image-packages.txt names (that list is what the tests take as present in the
base), and exits 1 naming the missing ones otherwise. Standard library only: it runs in any base.
"""

from __future__ import annotations

import argparse
import re
import sys

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==\S+")


def canonical(name: str) -> str:
    """PEP 503 name: lower case, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(lines) -> dict[str, str]:
    """canonical name -> its ``name==version`` line (comments, options, editables and URLs are skipped)."""
    out = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        m = PIN.match(line)
        if m:
            out[canonical(m.group(1))] = line.split(";", 1)[0].strip()
    return out


def names(lines) -> set[str]:
    """The package names of a plain list (one a line, comments skipped)."""
    out = set()
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            out.add(canonical(re.split(r"[=<>!~\[; ]", line, maxsplit=1)[0]))
    return out


def lock(freeze: list[str], listed: list[str], requirements: list[str], project_lock: list[str]) -> list[str]:
    """The constraints lines; raises SystemExit when the base lacks a listed package."""
    base = pins(freeze)
    # verl: the base installs it for its dependencies, then uninstalls it (Dockerfile.train installs it --no-deps)
    missing = sorted(names(listed) - set(base) - {"verl"})
    if missing:
        raise SystemExit(f"the base image lacks {', '.join(missing)} (k8s/docker/base-image-packages.txt lists them)")
    own = set(pins(requirements)) | names(requirements)
    out = [line for name, line in sorted(base.items()) if name not in own]
    out += [line for name, line in sorted(pins(project_lock).items()) if name not in base and name not in own]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--freeze", required=True, help="pip freeze of the base image")
    p.add_argument("--listed", required=True, help="k8s/docker/base-image-packages.txt")
    p.add_argument("--requirements", required=True, help="k8s/docker/requirements-train.txt")
    p.add_argument("--lock", required=True, help="the project's constraints.txt")
    p.add_argument("--out", required=True, help="constraints file to write")
    args = p.parse_args(argv)

    def read(path):
        with open(path) as f:
            return f.read().splitlines()

    lines = lock(read(args.freeze), read(args.listed), read(args.requirements), read(args.lock))
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"{args.out}: {len(lines)} pins", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
