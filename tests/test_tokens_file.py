"""The devices' bearer tokens (`serve --tokens-file`): read as written, and checked without
failing anyone's call."""
from __future__ import annotations

from pathlib import Path

import pytest

from specsplit.server.auth import BearerTokenInterceptor, load_tokens


def _tokens(tmp_path: Path, text: str) -> dict[str, str]:
    path = tmp_path / "tokens"
    path.write_text(text, encoding="utf-8")
    return load_tokens(path)


def test_a_hash_inside_a_token_is_part_of_it_and_a_comment_is_a_whole_line(tmp_path) -> None:
    # Cut at the #, the file registered the prefix: the device's whole token was refused,
    # and whoever held the prefix let in.
    tokens = _tokens(tmp_path, "# laptops\n  # indented comment\n\nedge-1 Xk3#9vQ2mP8rT5wY7zL1nB4c\n")
    assert tokens == {"Xk3#9vQ2mP8rT5wY7zL1nB4c": "edge-1"}
    with pytest.raises(ValueError, match=r"tokens:1: expected 'DEVICE_ID TOKEN'"):
        _tokens(tmp_path, "edge-1 0123456789abcdef0123 # a comment after it\n")


def test_a_byte_order_mark_an_editor_wrote_is_not_part_of_the_first_line(tmp_path) -> None:
    # Read as part of it, the mark made a first comment a device line, refused as malformed.
    assert _tokens(tmp_path, "\ufeff# edges\nedge-1 0123456789abcdef0123\n") == {"0123456789abcdef0123": "edge-1"}


def test_a_token_no_device_could_send_is_refused_by_its_line(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"tokens:2: token of device dev-x is not printable ASCII"):
        _tokens(tmp_path, "dev-a aaaaaaaaaaaaaaaaaaaa\ndev-x tökenwithumlautsüüüüüü\n")


def test_checking_a_presented_token_never_raises() -> None:
    """A non-ASCII str in compare_digest raises TypeError: every call failed UNKNOWN."""
    check = BearerTokenInterceptor({"aaaaaaaaaaaaaaaaaaaa": "dev-a"})
    assert check.device_for("aaaaaaaaaaaaaaaaaaaa") == "dev-a"
    assert check.device_for("tökenwithumlautsüüüüüü") is None
    assert check.device_for("aaaaaaaaaaaaaaaaaaa") is None
