"""Generate the Python gRPC stubs for proto/specsplit/v1 into the shared package.

Run with `make proto`. tests/test_packaging.py regenerates into a temporary
directory and fails if the committed stubs differ, so edit the .proto, then run this.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
DEFAULT_OUT = PROTO_ROOT.parent / "shared" / "src"
PROTO_FILES = ["specsplit/v1/specsplit.proto"]


def generate(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).resolve().parent / "_proto"
    for proto in PROTO_FILES:
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{PROTO_ROOT}",
                f"-I{include}",
                f"--python_out={out_dir}",
                f"--pyi_out={out_dir}",
                f"--grpc_python_out={out_dir}",
                str(PROTO_ROOT / proto),
            ]
        )
        if rc != 0:
            raise SystemExit(f"protoc failed on {proto} (exit {rc})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output root (default: shared/src)")
    args = parser.parse_args(argv)
    generate(args.out)
    print(f"stubs written under {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
