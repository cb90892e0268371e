from __future__ import annotations

import pytest

from extproc.errors import ConfigError
from extproc.settings import Settings


def test_flags_beat_env_beat_file(tmp_path, state_file, monkeypatch):
    f = tmp_path / "settings.yaml"
    f.write_text(f"config: {state_file}\nlisten: 127.0.0.1:1111\nworkers: 3\nserver: threads\n")
    monkeypatch.setenv("ACE_EXTPROC_WORKERS", "5")
    s = Settings.from_args(["--settings", str(f), "--listen", "127.0.0.1:2222"])
    assert (s.listen, s.workers, s.server, s.config) == ("127.0.0.1:2222", 5, "threads", state_file)
    assert s.h2_max_streams == 4096
    assert Settings.from_args(["--config", str(state_file), "--h2-max-streams", "64"]).h2_max_streams == 64


@pytest.mark.parametrize("args", [["--listen", "nope"], ["--server", "tornado"], ["--workers", "0"],
                                  ["--workers", "x"], ["--h2-max-streams", "0"]])
def test_invalid_settings_are_config_errors(state_file, args):
    with pytest.raises(ConfigError):
        Settings.from_args(["--config", str(state_file), *args])


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError):
        Settings.from_args(["--config", str(tmp_path / "nope.yaml")])


def test_unknown_settings_key(tmp_path, state_file):
    f = tmp_path / "s.yaml"
    f.write_text("colour: blue\n")
    with pytest.raises(ConfigError):
        Settings.from_args(["--config", str(state_file), "--settings", str(f)])
