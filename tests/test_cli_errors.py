"""Config errors on the command line: one line per problem, naming the file and the field,
for `generate`'s engine YAML as for `serve`'s cluster YAML; exit status 2, no traceback."""

from __future__ import annotations

import pytest

from loopserve.cli import main


def _errors(capsys, argv: list[str]) -> list[str]:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and all(line.startswith(("loopserve: error: ", "loopserve job: error: ")) for line in err), err
    return err


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_yaml_syntax_error_names_the_file_and_line(tmp_path, capsys, command):
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  model: [tiny\n")
    argv = ["generate", "hi"] if command == "generate" else ["serve"]
    [line] = _errors(capsys, argv + ["--config", str(bad)])
    assert f"{bad}:3:1: YAML syntax error" in line


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_missing_file_is_one_line(tmp_path, capsys, command):
    missing = str(tmp_path / "missing.yaml")
    argv = ["generate", "hi"] if command == "generate" else ["serve"]
    [line] = _errors(capsys, argv + ["--config", missing])
    assert line.endswith(f"error: config file {missing!r} does not exist")


def test_generate_field_errors_are_one_line_each(tmp_path, capsys):
    bad = tmp_path / "engine.yaml"
    bad.write_text("model: tiny-ouro\nblok_size: 4\nnum_blocks: -1\n")
    err = _errors(capsys, ["generate", "hi", "--config", str(bad)])
    assert sorted(err) == [
        f"loopserve: error: {bad}: blok_size: unknown key (got 4)",
        f"loopserve: error: {bad}: num_blocks: Input should be greater than or equal to 1 (got -1)"]
