"""The node's model cache is this user's own: a directory another user planted (owned by them,
writable by others, or a symbolic link) is refused, never used, so nobody can swap a model between
its check and its load."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from airflow_provider_batchinfer.registry import RegistryError, fetch_version, model_cache_dir
from airflow_provider_batchinfer.registry.fetch import cached_copy

SIG = {"inputs": {"text": "string"}, "outputs": {"length": "int64"}}


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_missing_cache_is_created_private(tmp_path):
    root = tmp_path / "nodes" / "cache"
    assert model_cache_dir(str(root)) == root
    assert _mode(root) == 0o700


def test_an_own_cache_that_others_could_only_read_is_tightened(tmp_path):
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(0o755)
    assert model_cache_dir(str(root)) == root
    assert _mode(root) == 0o700


def test_a_cache_others_can_write_is_refused(tmp_path):
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(RegistryError, match=r"model cache .*cache is writable by other users \(mode 0o777\)"):
        model_cache_dir(str(root))
    assert _mode(root) == 0o777  # refused, not repaired: something may already be planted in it


def test_another_users_cache_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(root, 65534, 65534)  # nobody's
    else:  # without root no file can be given away: this process pretends to be someone else
        me = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: me + 1)
    with pytest.raises(RegistryError, match=r"model cache .*cache belongs to uid \d+, not to this user"):
        model_cache_dir(str(root))


def test_a_symlinked_cache_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "cache").symlink_to(real)
    with pytest.raises(RegistryError, match=r"model cache .*cache is a symbolic link"):
        model_cache_dir(str(tmp_path / "cache"))


def test_a_cache_in_a_directory_others_can_replace_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # no sticky bit: anyone may rename our cache away and put theirs in its place
    with pytest.raises(RegistryError, match=r"shared is writable by other users"):
        model_cache_dir(str(shared / "cache"))


@pytest.fixture
def remote_model(s3_server, s3_bucket, tmp_path, monkeypatch):
    from airflow_provider_batchinfer.registry import ModelRegistry
    from tests.models import TextLength

    options = {"endpoint_url": s3_server, "region": "us-east-1", "access_key": "AKIDTEST", "secret_key": "unused"}
    monkeypatch.setenv("BATCHINFER_MODEL_CACHE", str(tmp_path / "cache"))
    registry = ModelRegistry(f"s3://{s3_bucket}/registry", options)
    return registry.log_model("len", "v1", "python", python_class=TextLength, signature=SIG), options


def test_a_planted_link_inside_the_cache_is_not_followed(remote_model, tmp_path):
    """A valid copy somewhere else, linked in where the version's cached copy goes: the link is
    refused, not followed (the copy behind it could change after the check)."""
    mv, options = remote_model
    path, _ = fetch_version(mv.uri, mv.sha256, options)
    planted = tmp_path / "planted"
    shutil.copytree(path, planted)
    shutil.rmtree(path)
    path.symlink_to(planted)
    assert cached_copy(tmp_path / "cache", mv.uri, mv.sha256) == path
    with pytest.raises(RegistryError, match=r"is a symbolic link"):
        fetch_version(mv.uri, mv.sha256, options)


def test_a_planted_cache_is_refused_before_anything_is_downloaded(remote_model, tmp_path):
    mv, options = remote_model
    (tmp_path / "cache").mkdir(mode=0o777)
    (tmp_path / "cache").chmod(0o777)
    with pytest.raises(RegistryError, match="is writable by other users"):
        fetch_version(mv.uri, mv.sha256, options)
    assert list((tmp_path / "cache").iterdir()) == []
