"""`--help` of every command line (`loopserve` and each subcommand, `python -m
loopserve.job`) describes every flag and shows its default where the default is a
value (a None default is "not set": the help says what that means where it matters)."""

from __future__ import annotations

import argparse

import pytest

from loopserve.cli import build_parser
from loopserve.job import build_parser as job_parser


def _commands(parser: argparse.ArgumentParser, name: str) -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(name, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                found += _commands(p, f"{name} {sub}")
    return found


COMMANDS = _commands(build_parser(), "loopserve") + [("python -m loopserve.job", job_parser())]


def test_every_subcommand_is_walked():
    assert {n for n, _ in COMMANDS} == {"loopserve", "loopserve generate", "loopserve serve",
                                        "loopserve client", "loopserve bench", "loopserve bench serve",
                                        "python -m loopserve.job"}


@pytest.mark.parametrize("name,parser", COMMANDS, ids=[n for n, _ in COMMANDS])
def test_every_option_has_help_and_its_default(name, parser):
    text = parser.format_help()
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        flag = action.option_strings[0] if action.option_strings else action.dest
        assert action.help and action.help.strip(), f"{name} {flag}: no help text"
        if action.option_strings and action.default not in (None, False, [], argparse.SUPPRESS):
            assert f"(default: {action.default})" in " ".join(text.split()), f"{name} {flag}: default not shown"


def test_client_help_shows_the_token_default(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["client", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "tokens to generate at most (default: 32)" in out
    assert "exit depth" in out
