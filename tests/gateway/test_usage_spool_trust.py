"""The usage spool trusts only its own directory (router/billing/usage_spool.py): the
next router bills whatever a spool holds, so no other user may plant one,
no link is followed, and a negative count is never billed."""

import os
from pathlib import Path

import pytest

from router.billing.usage import UsageDelta, UsageKey
from router.billing.usage_spool import UsageSpool

KEY = UsageKey(1, "m", "2026-12-04")
PLANTED = b'[{"key_id":1,"model":"m","day":"2026-12-04","requests":1,"errors":0,'


def planted(directory: Path, name: str, rows: bytes) -> None:
    """A spool file (and its free lock) as a stopped router would leave it."""
    (directory / f"{name}.json").write_bytes(rows)
    (directory / f"{name}.lock").write_bytes(b"")


def test_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir(mode=0o700)
    planted(spool_dir, "gone", PLANTED + b'"prompt_tokens":5,"completion_tokens":5}]')
    spool_dir.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by its group or others"):
        UsageSpool(spool_dir, "next").open()
    with pytest.raises(PermissionError, match="writable by its group or others"):
        UsageSpool(spool_dir, "next").save({KEY: UsageDelta(requests=1)})
    spool_dir.chmod(0o700)  # made safe: now it is read
    assert UsageSpool(spool_dir, "next").open() == {KEY: UsageDelta(1, 0, 5, 5)}


def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give the directory away")
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir(mode=0o700)
    os.chown(spool_dir, 65534, 65534)
    with pytest.raises(PermissionError, match="owned by uid 65534"):
        UsageSpool(spool_dir, "next").open()
    with pytest.raises(PermissionError, match="owned by uid 65534"):
        UsageSpool(spool_dir, "next").save({KEY: UsageDelta(requests=1)})


def test_a_symlinked_directory_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "spool").symlink_to(real)
    with pytest.raises(PermissionError, match="not a directory"):
        UsageSpool(tmp_path / "spool", "next").save({KEY: UsageDelta(requests=1)})
    assert list(real.iterdir()) == []


def test_links_in_the_directory_are_not_followed(tmp_path: Path) -> None:
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_bytes(PLANTED + b'"prompt_tokens":5,"completion_tokens":5}]')
    (spool_dir / "gone.json").symlink_to(elsewhere)
    (spool_dir / "gone.lock").write_bytes(b"")
    # A data file that is a link is not read (set aside, not billed).
    assert UsageSpool(spool_dir, "next").open() == {}
    # A lock that is a link is not opened: neither created through nor written.
    target = tmp_path / "target"
    spool = UsageSpool(spool_dir, "mine")
    spool._files.lock.symlink_to(target)
    with pytest.raises(OSError, match="locked"):
        spool.save({KEY: UsageDelta(requests=1)})
    assert not target.exists()
    # Nor is the file written aside before the rename.
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    spool = UsageSpool(spool_dir, "other")
    spool._files.data.with_suffix(".json.tmp").symlink_to(victim)
    with pytest.raises(OSError):
        spool.save({KEY: UsageDelta(requests=1)})
    assert victim.read_bytes() == b"keep"


def test_a_negative_count_is_never_billed(tmp_path: Path) -> None:
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir(mode=0o700)
    planted(spool_dir, "gone", PLANTED + b'"prompt_tokens":-1000000,"completion_tokens":5}]')
    assert UsageSpool(spool_dir, "next").open() == {}
    assert sorted(p.name for p in spool_dir.iterdir()) == ["gone.bad"]
