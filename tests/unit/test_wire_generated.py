"""The committed protobuf/gRPC modules must match proto/ (regenerate: python -m freeride._wire.generate)."""

from __future__ import annotations

import pytest

from freeride._wire import generate


def test_generated_code_matches_the_proto_files(capsys: pytest.CaptureFixture[str]) -> None:
    code = generate.main(["--check"])
    assert code == 0, capsys.readouterr().out


def test_generated_code_is_imported_only_by_the_codec_and_the_two_edge_modules() -> None:
    import pathlib
    import re

    pattern = re.compile(r"^\s*from freeride\._wire import freeride_pb2|^\s*import freeride\._wire\.freeride_pb2", re.M)
    root = pathlib.Path(generate.__file__).resolve().parents[1]
    importers = sorted(
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if "_wire/freeride_pb2" not in str(p) and pattern.search(p.read_text())
    )
    assert importers == ["_manager/servicers.py", "_wire/client.py", "_wire/codec.py"]
