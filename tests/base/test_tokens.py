"""Scoped tokens: stored hashed, matched to a name and role, added and revoked without a restart, from a
file or another source refreshed in the background."""

from __future__ import annotations

import os
import threading
import time

import pytest

from deltamesh.tokens import TokenError, TokenSpec, TokenStore, add_token, bearer_token, issue_token, revoke_token


def test_tokens_are_stored_hashed_and_name_their_holder(tmp_path):
    path = tmp_path / "tokens.toml"
    pool = add_token(path, TokenSpec("eu-1", "pool", ["policy"]))
    trainer = add_token(path, TokenSpec("policy-trainer", "trainer"))
    text = path.read_text()
    assert pool not in text and trainer not in text  # only digests are written
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    store = TokenStore(path)
    who = store.authenticate(pool)
    assert (who.name, who.role, who.models) == ("eu-1", "pool", ("policy",))
    assert who.may_use("policy") and not who.may_use("other")
    assert store.authenticate(trainer).role == "trainer" and store.authenticate(trainer).may_use("anything")
    assert store.authenticate(pool + "x") is None
    assert store.authenticate("") is None and store.authenticate(None) is None


def test_added_and_revoked_tokens_apply_without_a_restart(tmp_path):
    path = tmp_path / "tokens.toml"
    first = add_token(path, TokenSpec("a", "pool"))
    store = TokenStore(path)
    second = add_token(path, TokenSpec("b", "pool"))
    assert store.authenticate(second).name == "b"  # picked up on change
    assert revoke_token(path, "a") == 1
    assert store.authenticate(first) is None
    assert store.authenticate(second).name == "b"


def test_a_broken_file_keeps_the_tokens_in_force(tmp_path):
    path = tmp_path / "tokens.toml"
    token = add_token(path, TokenSpec("a", "pool"))
    store = TokenStore(path)
    path.write_text(path.read_text() + "\n[[token]\nbroken")
    os.utime(path, ns=(1, 1))
    assert store.authenticate(token).name == "a"
    with pytest.raises(TokenError):
        TokenStore(path)  # at start-up a bad file is an error, not an open door


@pytest.mark.parametrize("text, reason", [
    ('[[token]]\nname = "a"\nrole = "root"\nsha256 = "' + "0" * 64 + '"\n', "has role 'root'"),
    ('[[token]]\nname = "a"\nrole = "pool"\nsha256 = "abc"\n', "needs sha256"),
    ('[[token]]\nrole = "pool"\nsha256 = "' + "0" * 64 + '"\n', "needs a name"),
    ('[tokens]\n', "unknown tables"),
])
def test_bad_entries_are_named(tmp_path, text, reason):
    path = tmp_path / "tokens.toml"
    path.write_text(text)
    with pytest.raises(TokenError, match=reason):
        TokenStore(path)


def test_bearer_header_parsing():
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer ") is None
    assert bearer_token(None) is None


class ScriptedSource:
    """A token source in memory that records which threads read it, and fails while `broken` is set."""

    where = "scripted"

    def __init__(self, entries: list) -> None:
        self.entries, self.version, self.broken = entries, 0, ""
        self.readers: set[int] = set()

    def stamp(self):
        self.readers.add(threading.get_ident())
        if self.broken:
            raise TokenError(self.broken)
        return self.version

    def load(self):
        return self.stamp(), list(self.entries)


def eventually(check, within_s: float = 2.0) -> None:
    began = time.monotonic()
    while not check():
        assert time.monotonic() - began < within_s
        time.sleep(0.01)


def test_a_source_refreshed_in_the_background_is_never_read_by_authenticate(caplog):
    token, entry = issue_token(TokenSpec("a", "pool"), "scripted")
    source = ScriptedSource([entry])
    store = TokenStore(source=source, refresh_s=0.02)
    try:
        assert store.authenticate(token).name == "a"
        source.readers.clear()
        source.broken = "database down"
        for _ in range(50):  # the tokens last read stay in force, and the caller never waits on the source
            assert store.authenticate(token).name == "a"
            time.sleep(0.002)
        assert source.readers and threading.get_ident() not in source.readers
        assert [r.getMessage() for r in caplog.records if "not reloaded" in r.getMessage()] == [
            "tokens of scripted not reloaded, the previous tokens stay in force: database down"]  # once
        source.broken, source.entries, source.version = "", [], 1  # revoked
        eventually(lambda: store.authenticate(token) is None)
        source.entries = [entry]
        store.reload()  # SIGHUP: wakes the refresher even though the stamp did not move
        eventually(lambda: store.authenticate(token) is not None)
    finally:
        store.close()
    assert not store._refresher.is_alive()


def test_a_store_reads_a_file_or_a_source_not_both(tmp_path):
    with pytest.raises(ValueError, match="not both"):
        TokenStore(tmp_path / "tokens.toml", source=ScriptedSource([]))
