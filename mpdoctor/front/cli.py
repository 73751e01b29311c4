"""The command line: ``python -m mpdoctor demo | env | checks | run script.py [args ...]`` and ``--version``."""

from __future__ import annotations

import argparse

#: Where the generated rules reference lives (``python -m mpdoctor checks --update-docs``).
DOCS_CHECKS = "docs/checks.md"


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m mpdoctor``."""
    from .._version import __version__

    parser = argparse.ArgumentParser(prog="mpdoctor", description="Mixed-precision doctor for PyTorch / Hugging Face.")
    parser.add_argument("--version", action="version", version=f"mpdoctor {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("demo", help="diagnose and fix a small broken training setup on the CPU")
    sub.add_parser("env", help="print versions, device and precision support")
    checks = sub.add_parser("checks", help="list the rules: checks, runtime rules and crash families")
    checks.add_argument("--markdown", action="store_true", help="print the checks and runtime rules reference in markdown")
    checks.add_argument("--update-docs", metavar="PATH", nargs="?", const=DOCS_CHECKS,
                        help=f"rewrite the generated rules reference (default: {DOCS_CHECKS}) and the crash "
                        "families' page beside it (exception-families.md)")
    # The reference moved from the README to docs/checks.md; the old option rewrites it there.
    checks.add_argument("--update-readme", metavar="PATH", help=argparse.SUPPRESS)
    # argparse prints a REMAINDER argument as a bare "...", which reads as required: the usage says it is not.
    run = sub.add_parser("run", help="run a script; explain a mixed-precision crash after its traceback",
                         usage="mpdoctor run [-h] [--scan] [--probe-on-nan] script [args ...]")
    run.add_argument("--scan", action="store_true", help="also scan tensor values (NaN/Inf, fp16 range) in the crash report")
    run.add_argument("--probe-on-nan", action="store_true", help="probe the batch of the first non-finite loss")
    run.add_argument("script", help="the Python script, run as __main__")
    run.add_argument("script_args", nargs=argparse.REMAINDER, metavar="args",
                     help="the script's own arguments, passed untouched")
    args = parser.parse_args(argv)
    if args.command == "run":
        from ..attach.training.script_runner import run_script

        return run_script(args.script, args.script_args, scan=args.scan, probe_on_nan=args.probe_on_nan)
    if args.command is None:  # a bare `python -m mpdoctor` asks what it can do
        parser.print_help()
        return 0
    if args.command == "demo":
        from .demo import run_demo

        return run_demo()
    if args.command == "env":
        from ..diagnosis.environment import env_report

        print(env_report())
        return 0
    from .docs import rules_reference, update_checks_reference

    if args.update_docs or args.update_readme:
        path = args.update_docs or DOCS_CHECKS
        changed = update_checks_reference(path)
        print(f"{path}: rules reference {'updated' if changed else 'already up to date'}")
    elif args.markdown:
        print(rules_reference())
    else:
        print_rules()
    return 0


def print_rules() -> None:
    """One line per rule of every kind, sorted by slug: slug, kind, severity (the usual one first), title."""
    from ..render.formatting import rst_to_plain
    from ..rules.engine.rules import load_rules

    for slug, rule in sorted(load_rules().items()):
        print(f"{slug:<36} {rule.kind.value:<12} {rule.severity_label:<24} {rst_to_plain(rule.title)}")
