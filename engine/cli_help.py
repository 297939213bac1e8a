"""What every command's --help and --version share: the installed package's version and a help
formatter that shows defaults. In engine/, the lowest layer, so ds4-gguf, ds4-kv and ds4-bench use
it as the agent does."""
from __future__ import annotations

import argparse

DIST = "ds4-agent"    # the distribution name in pyproject.toml (every console script is in it)


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(DIST)
    except PackageNotFoundError:     # run from a source tree that was never installed
        return "unknown (not installed)"


def add_version_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}",
                        help="print the version and exit")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """--help shows each option's default after its description, unless the description already
    says it or there is none worth showing (None, False: an unset option, a switch that is off)."""

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default
        if ("%(default)" in text or "default" in text or d is None or d is False or d is argparse.SUPPRESS
                or not action.option_strings or action.nargs == 0):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"

    def _fill_text(self, text, width, indent):
        # the epilog lists commands a line each, as written: the default reflow ran them together
        return "\n".join(indent + line for line in text.splitlines())


class ArgumentParser(argparse.ArgumentParser):
    """Every command's parser: a bad flag or value (`--ctx abc`, an unknown option, a missing
    argument) is one `error:` line and exit status 1, as the commands' own checks are; argparse's
    default printed the whole usage (19 lines for ds4-agent) and exited 2. Subcommand parsers are
    made of the same class (add_subparsers uses the parent's)."""

    def error(self, message):
        self.exit(1, f"error: {message} (`{self.prog} --help` lists the options)\n")
