"""The help layout every loopserve command line shares."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written, and each option's default appended to its help, where the
    default is a value (a `None` default means "decided elsewhere", which the help says)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.option_strings and "%(default)" not in text and action.default is not None
                and action.default is not argparse.SUPPRESS and action.default is not False
                and action.default != []):
            text += " (default: %(default)s)"
        return text
