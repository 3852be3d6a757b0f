"""`pagellm serve` settings: a config file under the flags, JSON logs, CORS, and keys, without loading a model."""

from __future__ import annotations

import json
import logging

import pytest
from fastapi.testclient import TestClient

from pagellm.cli import build_parser, given_flags_of, main, take_model_argument
from pagellm.config import EngineConfig, ServerConfig
from pagellm.server.api_server import build_app
from pagellm.server.run import JsonLogFormatter, configs_from


def configs(argv: list[str]):
    args = build_parser().parse_args(["serve", *argv])
    args.given_flags = given_flags_of(argv)
    take_model_argument(args)
    return configs_from(args, args.given_flags)


def test_the_model_may_be_given_as_vllm_takes_it(tmp_path, capsys):
    """`pagellm serve MODEL` as `vllm serve MODEL`: the same as --model, and it beats a config file's."""
    model = tmp_path / "m.gguf"
    (tmp_path / "serve.yaml").write_text("model: {model: other.gguf}")
    assert configs([str(model)])[0].model.model == str(model)
    assert configs([str(model), "--config", str(tmp_path / "serve.yaml")])[0].model.model == str(model)
    assert configs(["--model", str(model), str(model)])[0].model.model == str(model)
    # --served-model-name takes several names: a model after it would be one more, and is refused as such
    with pytest.raises(ValueError, match="give MODEL before --served-model-name"):
        configs(["--served-model-name", "coder", str(model)])
    assert configs([str(model), "--served-model-name", "coder", "alias"])[1].served_model_name == ("coder", "alias")
    assert configs([])[0].model.model is None  # the embedded model
    assert main(["serve", "a.gguf", "--model", "b.gguf"]) == 2
    assert "the model is given twice: 'a.gguf' and --model 'b.gguf'" in capsys.readouterr().err


def test_a_config_file_is_read_and_flags_given_override_it(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    keys = tmp_path / "keys"
    keys.write_text("k2\n# comment\n\nk3\n")
    path = tmp_path / "serve.yaml"
    path.write_text(f"""
model: {{max_model_len: 512, dtype: float32}}
scheduler: {{max_num_seqs: 4}}
server: {{port: 9001, max_waiting: 7, chat_template: {template}, api_key_file: {keys}, allowed_origins: ["*"]}}
""")
    engine, server = configs(["--config", str(path), "--max-num-seqs", "8", "--api-key", "k1"])
    assert engine.model.max_model_len == 512 and engine.model.dtype == "float32"
    assert engine.scheduler.max_num_seqs == 8  # the flag beats the file
    assert engine.cache == EngineConfig().cache  # untouched sections keep their defaults
    assert (server.port, server.max_waiting, server.allowed_origins) == (9001, 7, ("*",))
    assert server.chat_template == template.read_text() and server.api_keys == ("k1", "k2", "k3")
    json_path = tmp_path / "serve.json"
    json_path.write_text(json.dumps({"server": {"log_format": "json"}}))
    assert configs(["--config", str(json_path), "--port", "9002"])[1].port == 9002


@pytest.mark.parametrize("text, message", [
    ("modle: {}", "unknown section.*modle"),
    ("model: {max_model_length: 5}", "ModelConfig: unknown key.*max_model_length"),
    ("server: {prot: 1}", "server: unknown key.*prot"),
    ("server: {log_format: xml}", "log_format must be one of"),
    ("model: [1]", "must be a mapping"),
    ("a: [", "not valid YAML"),
])
def test_bad_config_files_name_what_is_wrong(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        configs(["--config", str(path)])


def test_json_log_lines():
    record = logging.LogRecord("pagellm.server", logging.WARNING, __file__, 1, "ignoring %r", ("x",), None)
    line = json.loads(JsonLogFormatter().format(record))
    assert line["level"] == "WARNING" and line["logger"] == "pagellm.server" and line["message"] == "ignoring 'x'"


def test_cors_is_off_by_default_and_answers_allowed_origins():
    plain = TestClient(build_app(EngineConfig()))  # no lifespan: the model is not loaded
    assert "access-control-allow-origin" not in plain.get("/health", headers={"Origin": "http://a.test"}).headers
    app = build_app(EngineConfig(), ServerConfig(allowed_origins=("http://a.test",), api_keys=("k",)))
    client = TestClient(app)
    preflight = client.options("/v1/completions", headers={"Origin": "http://a.test",
                                                          "Access-Control-Request-Method": "POST",
                                                          "Access-Control-Request-Headers": "authorization"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "http://a.test"
    other = client.options("/v1/completions", headers={"Origin": "http://b.test", "Access-Control-Request-Method": "POST"})
    assert other.headers.get("access-control-allow-origin") != "http://b.test"
    assert client.get("/v1/models", headers={"Origin": "http://a.test"}).status_code == 401  # auth still applies
