"""The ``corekv`` command line, run both as the installed console script (a real subprocess) and
in-process through ``corekv.cli.main``: one-line errors without a traceback, exit codes, output."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

import corekv
from corekv import bench
from corekv.cli import main
from corekv.config import load_config

SCRIPT = Path(sys.executable).with_name("corekv")


def run(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``corekv ARGS`` as a user runs it (the console script pip installed next to python)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, env=full_env,
                          cwd=cwd, timeout=600)


def one_line_error(stderr: str) -> str:
    """The single ``corekv: error:`` line, asserting there is nothing else (no traceback)."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one error line, got:\n{stderr}"
    assert lines[0].startswith("corekv: error: ")
    return lines[0]


def test_the_console_script_is_installed():
    assert SCRIPT.exists(), f"{SCRIPT} is missing: reinstall with pip install -e ."


# -- errors ----------------------------------------------------------------------------------------
def test_a_config_error_is_one_line_with_exit_code_2(tmp_path):
    path = tmp_path / "cache.yaml"
    path.write_text("engine:\n  block_size: 24\n")
    result = run("config", "--config", str(path))
    assert result.returncode == 2
    assert result.stdout == ""
    assert one_line_error(result.stderr) == (
        "corekv: error: engine.block_size: got 24; expected a power of two (1, 2, 4, 8, 16, ...) "
        f"(in {path})")


def test_debug_shows_the_traceback(tmp_path):
    path = tmp_path / "cache.yaml"
    path.write_text("engine:\n  block_size: 24\n")
    result = run("--debug", "config", "--config", str(path))
    assert result.returncode == 1  # an uncaught exception
    assert "Traceback (most recent call last)" in result.stderr
    assert "corekv.errors.ConfigError: engine.block_size: got 24" in result.stderr


def test_a_misspelled_key_suggests_the_right_one(tmp_path):
    path = tmp_path / "cache.yaml"
    path.write_text("cache:\n  tiers:\n    - {type: host, sise: 2GiB}\n")
    result = run("config", "--config", str(path))
    assert result.returncode == 2
    assert one_line_error(result.stderr) == (
        "corekv: error: cache.tiers[0].sise: unknown key for tier 'host' (value '2GiB'); did you "
        f"mean 'size'? Valid keys: type, name, required, size, eviction (in {path})")


def test_corekv_config_names_the_file_and_env_overrides_apply(tmp_path):
    path = tmp_path / "cache.yaml"
    path.write_text("cache:\n  backend: hash_blocks\n")
    result = run("config", env={"COREKV_CONFIG": str(path), "COREKV_ENGINE__BLOCK_SIZE": "64"})
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed["cache"]["backend"] == "hash_blocks"
    assert printed["engine"]["block_size"] == 64
    result = run("config", env={"COREKV_ENGINE__BLOCK_SIZE": "48"})
    assert result.returncode == 2
    assert one_line_error(result.stderr).endswith("(set by COREKV_ENGINE__BLOCK_SIZE)")


def test_a_missing_config_file_is_a_config_error(tmp_path):
    result = run("config", "--config", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2
    assert "not found" in one_line_error(result.stderr)


def test_a_broken_plugin_is_a_runtime_error_naming_it(tmp_path):
    (tmp_path / "corekv_cli_broken_plugin.py").write_text("raise RuntimeError('boom\\nsecond line')\n")
    path = tmp_path / "cache.yaml"
    path.write_text("plugins: [corekv_cli_broken_plugin]\n")
    result = run("plugins", "--config", str(path), env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 1
    assert one_line_error(result.stderr) == (
        "corekv: error: plugin 'corekv_cli_broken_plugin' (listed in plugins:) failed to import "
        "(RuntimeError: boom second line); fix or uninstall the package that provides it")


@pytest.mark.parametrize("args, message", [
    (["generate"], "the following arguments are required: --prompt (see 'corekv generate --help')"),
    (["generate", "--prompt", "x", "--max-tokens", "0"],
     "argument --max-tokens: got 0; expected an integer >= 1 (see 'corekv generate --help')"),
    (["generate", "--prompt", "x", "--temperature", "-1"],
     "argument --temperature: got -1.0; expected a finite number >= 0 (see 'corekv generate --help')"),
    (["bench"], "the following arguments are required: BENCHMARK (see 'corekv bench --help')"),
    (["bench", "hit-rate", "--workloads", "multi_turn,paralel"],
     "--workloads: got 'paralel'; expected a comma-separated list of shared_system, multi_turn, "
     "few_shot, parallel; did you mean 'parallel'?"),
    ([], "the following arguments are required: COMMAND (see 'corekv --help')"),
    (["warm"], "warm needs --prompt TEXT (repeatable) or --prompts-file FILE (see 'corekv warm --help')"),
    (["warm", "--prompts-file", "/definitely/not/here.txt"],
     "--prompts-file: cannot read '/definitely/not/here.txt' ([Errno 2] No such file or directory: "
     "'/definitely/not/here.txt'); pass a text file with one prompt per line"),
    (["store", "clear", "--all-models", "--model", "0123456789ab", "--yes"],
     "--all-models and --model exclude each other; pass one"),
    (["store", "clear", "--model", "abc", "--yes"],
     "--model: got 'abc'; expected the 12 hex digits `corekv store stats` shows for a model"),
    (["store", "ls", "--limit", "0"],
     "argument --limit: got 0; expected an integer >= 1 (see 'corekv store ls --help')"),
    (["bench", "hit-rate", "--capacity", "32"],
     "--capacity: got 32; expected at least 64 tokens (one block of the largest block size in the table)"),
])
def test_usage_errors_are_one_line_with_exit_code_2(capsys, args, message):
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert one_line_error(captured.err) == f"corekv: error: {message}"


def test_config_errors_through_main_return_2(capsys):
    os.environ.pop("COREKV_CONFIG", None)
    assert main(["config", "--config", "/definitely/not/here.yaml"]) == 2
    assert one_line_error(capsys.readouterr().err).startswith(
        "corekv: error: config file '/definitely/not/here.yaml' not found")


# -- plugins ---------------------------------------------------------------------------------------
def test_plugins_json_lists_backends_and_tiers_with_their_distribution():
    result = run("plugins", "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info == corekv.available_plugins()
    for name in ("hash_blocks", "radix"):
        assert info["backends"][name]["distribution"] == "corekv"
    for name in ("host", "lmdb"):
        assert info["tiers"][name]["distribution"] == "corekv"
    assert info["plugins"]["pinned"] == {"distribution": "corekv"}


def test_plugins_shows_a_third_party_distribution(tmp_path):
    info_dir = tmp_path / "corekv_cli_thirdparty-1.0.dist-info"
    info_dir.mkdir()
    (info_dir / "METADATA").write_text("Metadata-Version: 2.1\nName: corekv-cli-thirdparty\nVersion: 1.0\n")
    (info_dir / "entry_points.txt").write_text("[corekv]\ncli_thirdparty = corekv_cli_thirdparty\n")
    (tmp_path / "corekv_cli_thirdparty.py").write_text(textwrap.dedent("""
        from corekv import hookimpl
        from corekv.plugin import TierSpec

        @hookimpl
        def corekv_register_tiers():
            return [TierSpec("cli_thirdparty_tier", factory=dict, description="from elsewhere")]
    """))
    env = {"PYTHONPATH": str(tmp_path), "COREKV_DISABLE_PLUGIN_AUTOLOAD": ""}
    result = run("plugins", env=env)
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if "cli_thirdparty_tier" in line)
    assert row.split()[:3] == ["cli_thirdparty_tier", "corekv-cli-thirdparty", "cli_thirdparty"]
    assert row.rstrip().endswith("from elsewhere")
    # the autoload switch hides it
    hidden = run("plugins", env={**env, "COREKV_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert "cli_thirdparty_tier" not in hidden.stdout


def test_plugins_text_has_a_section_per_kind(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    sections = re.findall(r"^(\w+):$", out, flags=re.M)
    assert sections == ["Backends", "Tiers", "Eviction", "Admission", "Plugins"]
    assert re.search(r"^  radix\s+corekv\s+radix\s+\S", out, flags=re.M)
    assert re.search(r"^  lfu\s+corekv\s+eviction\s+\S", out, flags=re.M)
    assert re.search(r"^  min_hits\s+corekv\s+admission\s+\S", out, flags=re.M)


# -- config ----------------------------------------------------------------------------------------
def test_config_prints_yaml_that_loads_back_to_the_same_config(tmp_path, capsys):
    path = tmp_path / "cache.yaml"
    path.write_text("engine: {num_blocks: 64}\ncache:\n  tiers:\n    - {type: host, size: 1GiB}\n"
                    "    - {type: lmdb, path: ./kv, size: 1.5GB}\n")
    assert main(["config", "--config", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "size: 1GiB" in printed and "size: 1500MB" in printed
    assert load_config(yaml.safe_load(printed), env={}) == load_config(path, env={})


def test_config_reference_is_the_markdown_reference(capsys):
    assert main(["config", "--reference"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| Field | Accepts | Default | Description |")
    assert "| `engine.block_size` |" in out and "### Tier `lmdb`" in out



def count_plugin_managers(monkeypatch) -> list:
    """Every plugin manager built from now on (the real ones, recorded)."""
    import corekv.config.reader
    import corekv.plugin

    made, real = [], corekv.plugin.make_plugin_manager

    def counting(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(corekv.plugin, "make_plugin_manager", counting)
    monkeypatch.setattr(corekv.config.reader, "make_plugin_manager", counting)
    return made


@pytest.mark.parametrize("reference", [False, True])
def test_config_uses_the_plugin_manager_it_read_the_config_with(tmp_path, capsys, monkeypatch,
                                                                reference):
    path = tmp_path / "cache.yaml"
    path.write_text("engine: {num_blocks: 64}\n")
    made = count_plugin_managers(monkeypatch)
    assert main(["config", "--config", str(path), *(["--reference"] if reference else [])]) == 0
    assert len(made) == 1 and capsys.readouterr().out


# -- bench -----------------------------------------------------------------------------------------
def test_bench_hit_rate_prints_the_table(capsys):
    assert main(["bench", "hit-rate", "--workloads", "multi_turn,parallel"]) == 0
    workloads = {n: w for n, w in bench.seed_workloads().items() if n in ("multi_turn", "parallel")}
    assert capsys.readouterr().out == bench.format_table(bench.hit_rate_table(workloads)) + "\n"


def test_bench_hit_rate_json_with_a_capacity(capsys):
    assert main(["bench", "hit-rate", "--workloads", "multi_turn", "--capacity", "1024", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    workloads = {"multi_turn": bench.seed_workloads()["multi_turn"]}
    assert rows == bench.hit_rate_table(workloads, capacity=1024)
    unbounded = bench.hit_rate_table(workloads)[0]
    assert rows[0]["radix"] < unbounded["radix"]  # a small pool evicts, which costs hits


# -- help ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", [[], ["plugins"], ["config"], ["bench"], ["bench", "hit-rate"],
                                     ["generate"], ["warm"], ["store"], ["store", "stats"],
                                     ["store", "ls"], ["store", "verify"], ["store", "clear"]])
def test_every_command_has_help_with_examples(capsys, command):
    assert main([*command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: corekv {' '.join(command)}".rstrip())
    examples = out.split("examples:\n", 1)[1].splitlines()
    assert examples and all(line.startswith("  corekv ") or "corekv " in line for line in examples if line)


def test_help_documents_exit_codes_and_the_default_config(capsys):
    assert main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "exit codes: 0 ok; 1 runtime error" in out and "2 usage or config error" in out
    assert "else the built-in defaults" in out and "corekv.load_config() in Python" in out


def test_help_runs_from_the_console_script():
    result = run("generate", "--help")
    assert result.returncode == 0
    assert "--max-tokens N" in result.stdout and "examples:" in result.stdout


# -- generate and warm on the real model -----------------------------------------------------------
@pytest.mark.slow
def test_generate_and_warm_print_what_the_engine_returns(tmp_path):
    """Loads SmolLM2 five times (the reference here and four CLI runs), so it is marked slow."""
    prompt = "What is the capital of France?"
    system = "You are a helpful assistant. Answer in one short sentence, without any preamble."
    cfg = load_config({"device": "cpu"}, env={})
    with corekv.Engine.from_config(cfg) as engine:
        expected = engine.generate([[{"role": "user", "content": prompt}]],
                                   corekv.SamplingParams(max_tokens=8, temperature=0.0))[0].text
        expected_warm = engine.warm(system, pin=True)
        expected_chat = engine.warm([{"role": "system", "content": system}], pin=False)
    assert expected and expected_warm > 0 and expected_chat > 0
    env = {"COREKV_DEVICE": "cpu"}
    result = run("generate", "--chat", "--prompt", prompt, "--max-tokens", "8", env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"
    result = run("warm", "--prompt", system, "--pin", env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    # the defaults' lmdb tier keeps the KV for later processes; the pin ends with the command
    assert result.stdout == (f"warmed {expected_warm} prompt tokens: kept in tier lmdb for later processes; "
                             "pinned until this command exits\n")
    result = run("warm", "--chat", "--prompt", system, "--quiet", env=env, cwd=tmp_path)
    assert result.stdout == f"warmed {expected_chat} prompt tokens: kept in tier lmdb for later processes\n"
    result = run("warm", "--prompt", "Hi", env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("warmed 0 prompt tokens")
    assert "shorter than one 16-token block" in result.stderr


def test_config_may_be_given_before_or_after_the_command(tmp_path, capsys):
    bad, good = tmp_path / "bad.yaml", tmp_path / "good.yaml"
    bad.write_text("engine: {block_size: 24}\n")
    good.write_text("engine: {block_size: 32}\n")
    assert main(["--config", str(good), "config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["engine"]["block_size"] == 32
    assert main(["--config", str(bad), "config", "--config", str(good)]) == 0  # the later one wins
    assert yaml.safe_load(capsys.readouterr().out)["engine"]["block_size"] == 32


def test_a_runtime_error_from_the_engine_is_one_line_with_exit_code_1(tmp_path):
    missing = tmp_path / "no-model-here"
    result = run("generate", "--prompt", "hi", env={"COREKV_MODEL": str(missing)}, cwd=tmp_path)
    assert result.returncode == 1
    line = one_line_error(result.stderr)
    assert str(missing) in line and "Traceback" not in result.stderr


def test_bench_draws_a_progress_bar_only_on_a_terminal(tmp_path):
    """stderr on a real pseudo-terminal (with a size, as a terminal window has) vs a pipe."""
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    args = [str(SCRIPT), "bench", "hit-rate", "--workloads", "multi_turn,parallel"]
    try:
        result = subprocess.run(args, stdout=subprocess.PIPE, stderr=follower, timeout=600)
    finally:
        os.close(follower)
    drawn = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed: everything was read
            break
        if not chunk:
            break
        drawn += chunk
    os.close(leader)
    assert result.returncode == 0
    assert b"hit-rate:" in drawn and b"2/2" in drawn
    piped = run("bench", "hit-rate", "--workloads", "multi_turn,parallel")
    assert piped.returncode == 0 and piped.stderr == ""
    assert piped.stdout.encode() == result.stdout


# -- doctor and prepare ----------------------------------------------------------------------------
def test_doctor_says_what_the_next_start_does_once_with_empty_caches(tmp_path):
    env = {"COREKV_CACHE_DIR": str(tmp_path / "cache"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    result = run("doctor", env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "SmolLM2-135M-Instruct.Q4_1.gguf (converted: not yet)" in result.stdout
    assert f"{tmp_path / 'ext'}/corekv_native-" in result.stdout and "(not built)" in result.stdout
    assert result.stdout.rstrip().endswith("the next start will convert the model (tens of seconds) and build "
                                           "the native kernels (a minute or more) once: `corekv prepare` "
                                           "does it now")
    assert "OpenMP wait: OMP_WAIT_POLICY=PASSIVE (yours)" in result.stdout  # as tests/conftest.py sets it
    without_policy = {k: v for k, v in {**os.environ, **env}.items() if k != "OMP_WAIT_POLICY"}
    result = subprocess.run([str(SCRIPT), "doctor"], capture_output=True, text=True, env=without_policy,
                            cwd=tmp_path, timeout=600)
    assert "OpenMP wait: passive (corekv's default)" in result.stdout, result.stdout + result.stderr


@pytest.mark.slow
def test_prepare_converts_the_model_so_that_doctor_finds_nothing_left(tmp_path):
    """A fresh model cache (the converted SmolLM2, tens of seconds); the native kernels' cache is
    the machine's, so that the build is not repeated here."""
    env = {"COREKV_CACHE_DIR": str(tmp_path / "cache"), "COREKV_DEVICE": "cpu"}
    result = run("prepare", env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("prepared smollm2-135m-instruct in ")
    assert "corekv: " not in result.stderr  # progress lines only on a terminal
    result = run("doctor", env=env, cwd=tmp_path)
    assert f"(converted: {tmp_path / 'cache' / 'models'}/SmolLM2-135M-Instruct.Q4_1-" in result.stdout
    assert result.stdout.rstrip().endswith("the next start reads everything from the caches")


@pytest.mark.slow
def test_generate_streams_on_a_terminal_the_text_it_prints_when_piped(tmp_path):
    """stdout a pseudo-terminal: the answer is printed as it is generated, ending as the piped
    output does (the whole text and a newline)."""
    import pty

    args = ("generate", "--chat", "--prompt", "Name three colors.", "--max-tokens", "12")
    env = {**os.environ, "COREKV_DEVICE": "cpu", "COREKV_QUIET": "1"}
    piped = run(*args, env=env, cwd=tmp_path)
    assert piped.returncode == 0, piped.stderr
    main_fd, child_fd = pty.openpty()
    try:
        proc = subprocess.run([str(SCRIPT), *args], stdout=child_fd, stderr=subprocess.PIPE, env=env,
                              cwd=tmp_path, timeout=600)
        os.close(child_fd)
        chunks = []
        while True:
            try:
                chunk = os.read(main_fd, 4096)
            except OSError:  # EIO: the terminal's other side is closed and drained
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(main_fd)
    assert proc.returncode == 0, proc.stderr
    assert b"".join(chunks).decode().replace("\r\n", "\n") == piped.stdout
