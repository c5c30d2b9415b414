"""Model id -> local directory, with every cache layout; never touches the network."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from verispec.errors import ModelNotFoundError
from verispec.loading.resolve import resolve_model

MODEL_ID = "acme/tiny-chat"
ENV_VARS = ("VERISPEC_MODEL_CACHE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")


@pytest.fixture
def clean_env(monkeypatch, tmp_path) -> Path:
    """No cache variables, an empty HOME, offline. Returns the fake HOME."""
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return home


def make_model_dir(path: Path, tag: str = "") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"model_type": "qwen3", "tag": "%s"}' % tag)
    return path


def make_hub_repo(root: Path, model_id: str, revisions: list[str], main: str | None) -> Path:
    repo = root / ("models--" + model_id.replace("/", "--"))
    for i, rev in enumerate(revisions):
        snap = make_model_dir(repo / "snapshots" / rev, rev)
        os.utime(snap, (1_000_000 + i, 1_000_000 + i))  # later revisions are newer
    if main is not None:
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(main + "\n")
    return repo


def test_local_directory(clean_env, tmp_path):
    model = make_model_dir(tmp_path / "some" / "model")
    assert resolve_model(str(model)) == model.resolve()
    assert resolve_model("some/model") == model.resolve()  # relative to the working directory


def test_local_directory_without_config_is_rejected(clean_env, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(str(tmp_path / "empty"))


@pytest.mark.parametrize("layout", ["flat", "models"])
def test_verispec_cache_plain_layouts(clean_env, monkeypatch, tmp_path, layout):
    root = tmp_path / "vcache"
    sub = root / MODEL_ID if layout == "flat" else root / "models" / MODEL_ID
    model = make_model_dir(sub)
    monkeypatch.setenv("VERISPEC_MODEL_CACHE", str(root))
    assert resolve_model(MODEL_ID) == model


def test_verispec_cache_hub_layout_follows_refs_main(clean_env, monkeypatch, tmp_path):
    root = tmp_path / "vcache"
    repo = make_hub_repo(root, MODEL_ID, ["aaa111", "bbb222"], main="aaa111")  # main is the older one
    monkeypatch.setenv("VERISPEC_MODEL_CACHE", str(root))
    assert resolve_model(MODEL_ID) == repo / "snapshots" / "aaa111"


def test_hub_layout_without_refs_takes_newest_snapshot(clean_env, monkeypatch, tmp_path):
    root = tmp_path / "hub"
    repo = make_hub_repo(root, MODEL_ID, ["aaa111", "bbb222"], main=None)
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    assert resolve_model(MODEL_ID) == repo / "snapshots" / "bbb222"


def test_verispec_cache_wins_over_hf_cache(clean_env, monkeypatch, tmp_path):
    ours = make_model_dir(tmp_path / "vcache" / MODEL_ID)
    make_hub_repo(tmp_path / "hub", MODEL_ID, ["ccc333"], main="ccc333")
    monkeypatch.setenv("VERISPEC_MODEL_CACHE", str(tmp_path / "vcache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model(MODEL_ID) == ours


def test_hf_hub_cache(clean_env, monkeypatch, tmp_path):
    repo = make_hub_repo(tmp_path / "hub", MODEL_ID, ["ddd444"], main="ddd444")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model(MODEL_ID) == repo / "snapshots" / "ddd444"


def test_hf_home_hub(clean_env, monkeypatch, tmp_path):
    repo = make_hub_repo(tmp_path / "hfhome" / "hub", MODEL_ID, ["eee555"], main="eee555")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    assert resolve_model(MODEL_ID) == repo / "snapshots" / "eee555"


def test_xdg_cache_home(clean_env, monkeypatch, tmp_path):
    repo = make_hub_repo(tmp_path / "xdg" / "huggingface" / "hub", MODEL_ID, ["fff666"], main="fff666")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_model(MODEL_ID) == repo / "snapshots" / "fff666"


def test_default_home_cache(clean_env):
    repo = make_hub_repo(clean_env / ".cache" / "huggingface" / "hub", MODEL_ID, ["ggg777"], main="ggg777")
    assert resolve_model(MODEL_ID) == repo / "snapshots" / "ggg777"


def test_other_model_in_cache_is_not_returned(clean_env, monkeypatch, tmp_path):
    make_hub_repo(tmp_path / "hub", "acme/other-model", ["hhh888"], main="hhh888")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFoundError):
        resolve_model(MODEL_ID)


def test_offline_and_missing_names_the_id_and_every_place(clean_env, monkeypatch, tmp_path):
    places = {
        "VERISPEC_MODEL_CACHE": tmp_path / "vcache",
        "HF_HUB_CACHE": tmp_path / "hub",
        "HF_HOME": tmp_path / "hfhome",
        "XDG_CACHE_HOME": tmp_path / "xdg",
    }
    for name, path in places.items():
        path.mkdir()
        monkeypatch.setenv(name, str(path))
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(MODEL_ID)
    msg = str(info.value)
    assert info.value.param == "model"
    assert MODEL_ID in msg
    for looked in (tmp_path / "vcache" / MODEL_ID, tmp_path / "vcache" / "models" / MODEL_ID,
                   tmp_path / "vcache", tmp_path / "hub", tmp_path / "hfhome" / "hub",
                   tmp_path / "xdg" / "huggingface" / "hub", clean_env / ".cache" / "huggingface" / "hub"):
        assert str(looked) in msg
    assert "offline" in msg


@pytest.mark.parametrize("bad", ["not a model!", "./no/such/dir", "/no/such/abs/dir", "a/b/c"])
def test_string_that_is_neither_a_dir_nor_an_id(clean_env, bad):
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(bad)
    assert bad in str(info.value)
    assert "org/name" in str(info.value)
