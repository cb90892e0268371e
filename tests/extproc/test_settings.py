from __future__ import annotations

import pytest

from extproc.errors import ConfigError
from extproc.settings import AgentTLS, Settings


def test_flags_beat_env_beat_file(tmp_path, state_file, monkeypatch):
    f = tmp_path / "settings.yaml"
    f.write_text(f"config: {state_file}\nlisten: 127.0.0.1:1111\nworkers: 3\nserver: threads\n")
    monkeypatch.setenv("ACE_EXTPROC_WORKERS", "5")
    s = Settings.from_args(["--settings", str(f), "--listen", "127.0.0.1:2222"])
    assert (s.listen, s.workers, s.server, s.config) == ("127.0.0.1:2222", 5, "threads", state_file)
    assert s.h2_max_streams == 4096
    assert Settings.from_args(["--config", str(state_file), "--h2-max-streams", "64"]).h2_max_streams == 64


@pytest.mark.parametrize("args", [["--listen", "nope"], ["--server", "tornado"], ["--workers", "0"],
                                  ["--workers", "x"], ["--h2-max-streams", "0"],
                                  ["--database-url", "mysql://db/ace"], ["--drain-handover-s", "-1"],
                                  ["--drain-handover-s", "soon"], ["--gil-switch-ms", "-1"],
                                  ["--gil-switch-ms", "101"], ["--gil-switch-ms", "nan"],
                                  ["--prefetch-hold-s", "-0.1"], ["--prefetch-hold-s", "61"],
                                  ["--prefetch-hold-s", "nan"], ["--prefetch-hold-s", "soon"],
                                  ["--prediction-context-steps", "-1"], ["--prediction-context-steps", "65"],
                                  ["--prediction-context-steps", "many"], ["--prediction-smoothing", "-1"],
                                  ["--prediction-smoothing", "101"], ["--prediction-smoothing", "nan"],
                                  ["--prediction-smoothing", "some"]])
def test_invalid_settings_are_config_errors(state_file, args):
    with pytest.raises(ConfigError):
        Settings.from_args(["--config", str(state_file), *args])


def test_the_drain_handover_defaults_to_10_s_and_0_turns_it_off(state_file):
    assert Settings.from_args(["--config", str(state_file)]).drain_handover_s == 10.0
    assert Settings.from_args(["--config", str(state_file), "--drain-handover-s", "0"]).drain_handover_s == 0.0


def test_a_bet_waits_half_a_second_at_most_for_its_requests_load_by_default(state_file):
    from extproc.fleet.speculation import HOLD_S

    assert Settings.from_args(["--config", str(state_file)]).prefetch_hold_s == HOLD_S == 0.5
    assert Settings.from_args(["--config", str(state_file), "--prefetch-hold-s", "0"]).prefetch_hold_s == 0.0


def test_the_request_path_waits_half_a_millisecond_at_most_for_the_gil_by_default(state_file):
    assert Settings.from_args(["--config", str(state_file)]).gil_switch_ms == 0.5
    assert Settings.from_args(["--config", str(state_file), "--gil-switch-ms", "0"]).gil_switch_ms == 0.0
    assert Settings.from_args(["--config", str(state_file)]).prediction_context_steps == 12
    assert Settings.from_args(["--config", str(state_file), "--prediction-context-steps", "0"]).prediction_context_steps == 0


def test_prediction_smoothing_defaults_to_1_and_reaches_the_planners_model(state_file):
    from extproc.policy.speculator import SpeculationSettings

    assert Settings.from_args(["--config", str(state_file)]).prediction_smoothing == 1.0
    assert Settings.from_args(["--config", str(state_file), "--prediction-smoothing", "0"]).prediction_smoothing == 0.0
    assert SpeculationSettings(smoothing=0.5).transition_model().smoothing == 0.5


def test_the_state_database_is_the_postgres_url_when_set_else_the_sqlite_file(tmp_path, state_file, monkeypatch):
    s = Settings.from_args(["--config", str(state_file), "--db", str(tmp_path / "gw.sqlite3")])
    assert s.state_db() == tmp_path / "gw.sqlite3"
    monkeypatch.setenv("ACE_EXTPROC_DATABASE_URL", "postgresql://ace@db:5432/ace")
    s = Settings.from_args(["--config", str(state_file)])
    assert s.state_db() == "postgresql://ace@db:5432/ace"


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError):
        Settings.from_args(["--config", str(tmp_path / "nope.yaml")])


def test_unknown_settings_key(tmp_path, state_file):
    f = tmp_path / "s.yaml"
    f.write_text("colour: blue\n")
    with pytest.raises(ConfigError):
        Settings.from_args(["--config", str(state_file), "--settings", str(f)])


def test_agent_tls_from_flags_env_and_file(tmp_path, state_file, monkeypatch):
    for name in ("ca.pem", "client.pem", "client.key"):
        (tmp_path / name).write_text("PEM")
    assert Settings.from_args(["--config", str(state_file)]).agent_tls() is None   # plaintext
    s = Settings.from_args(["--config", str(state_file), "--agent-tls-ca", str(tmp_path / "ca.pem"),
                            "--agent-tls-cert", str(tmp_path / "client.pem"),
                            "--agent-tls-key", str(tmp_path / "client.key"),
                            "--agent-tls-server-name", "agent.internal"])
    assert s.agent_tls() == AgentTLS(tmp_path / "ca.pem", tmp_path / "client.pem", tmp_path / "client.key",
                                     "agent.internal")
    f = tmp_path / "settings.yaml"
    f.write_text(f"config: {state_file}\nagent_tls_cert: {tmp_path / 'client.pem'}\n")
    monkeypatch.setenv("ACE_EXTPROC_AGENT_TLS_KEY", str(tmp_path / "client.key"))
    assert Settings.from_args(["--settings", str(f)]).agent_tls() == AgentTLS(
        None, tmp_path / "client.pem", tmp_path / "client.key")   # system roots, our certificate


@pytest.mark.parametrize("args, message", [
    (["--agent-tls-ca", "nope.pem"], "--agent-tls-ca nope.pem: no such file"),
    (["--agent-tls-cert", "{d}/client.pem"], "--agent-tls-cert and --agent-tls-key go together"),
    (["--agent-tls-key", "{d}/client.key"], "--agent-tls-cert and --agent-tls-key go together"),
    (["--agent-tls-server-name", "agent.internal"], "--agent-tls-server-name needs"),
])
def test_invalid_agent_tls_settings_are_config_errors(tmp_path, state_file, args, message):
    for name in ("client.pem", "client.key"):
        (tmp_path / name).write_text("PEM")
    with pytest.raises(ConfigError, match=message):
        Settings.from_args(["--config", str(state_file), *(a.format(d=tmp_path) for a in args)])


def test_protocol_and_secure_serving(tmp_path, state_file):
    base = ["--config", str(state_file)]
    ace = Settings.from_args(base)
    assert (ace.protocol, ace.serves_tls) == ("ace", False)         # ace's own drop-in: plaintext
    epp = Settings.from_args([*base, "--protocol", "epp"])
    assert epp.serves_tls and epp.tls_cert is None                  # epp: TLS, self-signed
    assert not Settings.from_args([*base, "--protocol", "epp", "--secure-serving", "false"]).serves_tls
    assert Settings.from_args([*base, "--secure-serving", "true"]).serves_tls
    (tmp_path / "c.pem").write_text("PEM")
    (tmp_path / "k.pem").write_text("PEM")
    s = Settings.from_args([*base, "--protocol", "epp", "--tls-cert", str(tmp_path / "c.pem"),
                            "--tls-key", str(tmp_path / "k.pem"), "--epp-fallbacks", "2", "--shed-load", "8"])
    assert (s.tls_cert, s.epp_fallbacks, s.shed_load) == (tmp_path / "c.pem", 2, 8)


@pytest.mark.parametrize("args", [["--protocol", "grpc"], ["--secure-serving", "maybe"],
                                  ["--tls-cert", "/nope.pem", "--tls-key", "/nope.key"],
                                  ["--epp-fallbacks", "-1"], ["--shed-load", "-1"]])
def test_invalid_epp_settings_are_config_errors(state_file, args):
    with pytest.raises(ConfigError):
        Settings.from_args(["--config", str(state_file), *args])


def test_self_signed_serving_cert_is_pem():
    from extproc.transport.serving_cert import self_signed
    cert = self_signed()
    assert cert.cert_pem.startswith(b"-----BEGIN CERTIFICATE-----") and b"PRIVATE KEY" in cert.key_pem
