"""Command line: ``python -m mpdoctor demo | env | checks``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m mpdoctor``."""
    parser = argparse.ArgumentParser(prog="mpdoctor", description="Mixed-precision doctor for PyTorch / Hugging Face.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="diagnose and fix a small broken training setup on the CPU")
    sub.add_parser("env", help="print versions, device and precision support")
    checks = sub.add_parser("checks", help="list the checks")
    checks.add_argument("--markdown", action="store_true", help="print the full checks reference in markdown")
    checks.add_argument("--update-readme", metavar="PATH", help="rewrite the checks reference section of a README")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo()
    if args.command == "env":
        from . import env_report

        print(env_report())
        return 0
    from . import checks_reference
    from .checks import load

    if args.update_readme:
        from .docs import update_readme

        changed = update_readme(args.update_readme)
        print(f"{args.update_readme}: checks reference {'updated' if changed else 'already up to date'}")
    elif args.markdown:
        print(checks_reference())
    else:
        for slug, chk in sorted(load().items()):
            print(f"{slug:<36} {chk.severity:<8} {chk.summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
