"""benchmarks/ is a small house of its own: its modules import one way (no cycles, imports inside
functions included, read from the source), every module's top level imports without running the
benchmark, and the harnesses that run a peer (``benchmarks/peers/``) start, time and stop it
through the one runner (``benchmarks/peers/runner.py``), which behaves as its docstring says."""
from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.append(str(BENCHMARKS))  # after everything else: benchmarks/ has generic module names
from peers import runner  # noqa: E402

#: not importable as a module: put on a peer's PYTHONPATH, it patches torch in that process
NOT_IMPORTED = {"peers.as_avx2.sitecustomize"}
#: process and environment handling that belongs to the runner in peers/: calls, keywords, strings
#: (``subprocess.run`` stays open for short probes: git, fincore, a version check in the peer's venv)
RUNNER_ONLY_CALLS = {"subprocess.Popen", "subprocess.call", "subprocess.check_call", "os.killpg", "os.setsid",
                     "signal.signal"}
RUNNER_ONLY_KEYWORDS = {"start_new_session", "preexec_fn"}
RUNNER_ONLY_STRINGS = ("libtcmalloc", "libiomp5")


def module_files(root: Path = BENCHMARKS) -> dict[str, Path]:
    """Every module under ``root``, named as it imports with ``root`` on ``sys.path``."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` imports anywhere in its source (``from a
    import b`` counts ``a.b`` where that is a module; importing ``a.b`` imports package ``a``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            found |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & known
    return found - {name}


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    return {name: imported_modules(name, path, set(modules)) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or ``None`` where it has none."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


# -- the layout ----------------------------------------------------------------------------------
def test_benchmark_modules_import_one_way():
    graph = import_graph(module_files())
    assert find_cycle(graph) is None, f"an import cycle among benchmarks/ modules: {' -> '.join(find_cycle(graph))}"


def test_the_cycle_check_finds_a_cycle_through_a_function_level_import(tmp_path):
    (tmp_path / "engine_run.py").write_text("import profile_steps\n")
    (tmp_path / "profile_steps.py").write_text("def prompts():\n    from engine_run import w1\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg import b\n")
    (tmp_path / "pkg" / "b.py").write_text("")
    graph = import_graph(module_files(tmp_path))
    assert graph["pkg.a"] == {"pkg", "pkg.b"}
    assert find_cycle(graph) == ["engine_run", "profile_steps", "engine_run"]


def test_every_benchmark_module_imports_without_running():
    names = sorted(set(module_files()) - NOT_IMPORTED)
    code = textwrap.dedent(f"""
        import importlib, sys
        sys.path.insert(0, {str(BENCHMARKS)!r})
        for name in {names!r}:
            importlib.import_module(name)
        print("imported", len({names!r}))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["imported", str(len(names))], (done.stdout[-2000:], done.stderr[-2000:])


def peer_harnesses(modules: dict[str, Path]) -> list[str]:
    """The modules in peers/ that run a peer: they start themselves again as its child process."""
    def starts_its_child(path: Path) -> bool:
        return any(isinstance(node, ast.Constant) and node.value in ("--child", "--vllm-child")
                   for node in ast.walk(ast.parse(path.read_text(), str(path))))

    return sorted(name for name, path in modules.items()
                  if name.startswith("peers.") and name != "peers.runner" and starts_its_child(path))


def test_every_peer_harness_uses_the_runner():
    modules = module_files()
    harnesses = peer_harnesses(modules)
    assert {"peers.vllm_w1_w2", "peers.vllm_speculative_w3", "peers.multi_turn_vs_vllm",
            "peers.vllm_connector_ttft", "peers.vllm_lmcache_peer"} <= set(harnesses)
    for name in harnesses:
        assert "peers.runner" in imported_modules(name, modules[name], set(modules)), \
            f"{modules[name]} runs a peer without benchmarks/peers/runner.py"


def test_the_harnesses_leave_process_and_preload_handling_to_the_runner():
    for name, path in module_files().items():
        if not name.startswith("peers.") or name == "peers.runner":
            continue
        for line, problem in runner_only_uses(ast.parse(path.read_text(), str(path))):
            pytest.fail(f"{path}:{line} {problem}; benchmarks/peers/runner.py does that")


def runner_only_uses(tree: ast.Module) -> list[tuple[int, str]]:
    """Where ``tree`` starts or stops a process, or names a preloaded library, itself: calls of
    :data:`RUNNER_ONLY_CALLS`, keywords of :data:`RUNNER_ONLY_KEYWORDS`, ``subprocess.run`` of the
    module's own file (its child), strings of :data:`RUNNER_ONLY_STRINGS` outside docstrings."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        is_call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        if is_call and isinstance(node.func.value, ast.Name):
            call = f"{node.func.value.id}.{node.func.attr}"
            if call in RUNNER_ONLY_CALLS:
                found.append((node.lineno, f"calls {call}"))
            elif call in ("subprocess.run", "subprocess.check_output") and any(
                    isinstance(n, ast.Name) and n.id == "__file__" for arg in node.args for n in ast.walk(arg)):
                found.append((node.lineno, f"starts its own child with {call}"))
        elif isinstance(node, ast.keyword) and node.arg in RUNNER_ONLY_KEYWORDS:
            found.append((node.value.lineno, f"passes {node.arg}="))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                and any(s in node.value for s in RUNNER_ONLY_STRINGS):
            found.append((node.lineno, "names a preloaded library"))
    return sorted(found)


def test_the_runner_check_sees_a_harness_doing_its_own_process_handling():
    tree = ast.parse(textwrap.dedent('''
        """Run me with LD_PRELOAD=/usr/lib/libtcmalloc_minimal.so.4 (a docstring may say so)."""
        import os, signal, subprocess, sys
        env = dict(os.environ, LD_PRELOAD="/usr/lib/libtcmalloc_minimal.so.4")
        subprocess.run([sys.executable, __file__, "--child"], env=env)
        proc = subprocess.Popen(["vllm"], start_new_session=True)
        os.killpg(proc.pid, signal.SIGKILL)
        subprocess.run(["git", "rev-parse", "HEAD"])
    '''))
    assert [problem for _, problem in runner_only_uses(tree)] == [
        "names a preloaded library", "starts its own child with subprocess.run", "calls subprocess.Popen",
        "passes start_new_session=", "calls os.killpg"]


# -- the runner ----------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _sigterm_handler_restored():
    """runner.start makes SIGTERM unwind the driver; the test process keeps its own handler."""
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)


def test_peer_env_preload_settings_and_scratch(tmp_path, monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/driver/own.so")
    monkeypatch.setenv("COREKV_BENCH_GONE", "1")
    assert runner.peer_env(preload=None)["LD_PRELOAD"] == "/driver/own.so"
    assert runner.peer_env(preload="")["LD_PRELOAD"] == ""
    assert runner.peer_env(preload="/x.so")["LD_PRELOAD"] == "/x.so"
    assert runner.peer_env()["LD_PRELOAD"] == runner.ld_preload(sys.executable)
    env = runner.peer_env(COREKV_BENCH_GONE=None, VLLM_CPU_NUM_OF_RESERVED_CPU=1)
    assert "COREKV_BENCH_GONE" not in env and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    env = runner.peer_env(scratch=tmp_path / "scratch", VLLM_CPU_KVCACHE_SPACE="3")
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"  # the harness's setting wins over the scratch default
    assert env["TMPDIR"] == str(tmp_path / "scratch" / "tmp") and (tmp_path / "scratch" / "tmp").is_dir()
    assert env["HF_HUB_OFFLINE"] == "1" and env["COREKV_DISABLE_PLUGIN_AUTOLOAD"] == "1"


def test_ld_preload_names_the_peer_venvs_openmp(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    assert "libiomp5" not in runner.ld_preload(venv / "bin" / "python")
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    assert runner.ld_preload(venv / "bin" / "python").split(":")[-1] == str(venv / "lib" / "libiomp5.so")


@pytest.mark.parametrize("user_policy, expected", [(None, None), ("PASSIVE", "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_peer_env_drops_corekvs_wait_policy_and_keeps_the_users(user_policy, expected):
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(BENCHMARKS)!r})
        import corekv  # sets OMP_WAIT_POLICY=PASSIVE for itself where the user set none
        from peers import runner
        print(json.dumps(runner.peer_env().get("OMP_WAIT_POLICY")))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if user_policy:
        env["OMP_WAIT_POLICY"] = user_policy
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == expected


def test_run_times_the_peer_and_kills_what_it_left_running(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    # the peer starts a long sleeper (as vLLM's engine core outlives its parent) and exits 3
    code = (f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); sys.exit(3)")
    finished = runner.run([sys.executable, "-c", code], env=runner.peer_env(preload=None))
    assert finished.returncode == 3 and 0 < finished.seconds < 60
    grandchild = int(pid_file.read_text())
    assert not _is_running(grandchild), "the peer's leftover process survived runner.run"


def test_process_tree_names_and_accounts_for_every_process_of_a_peer():
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
           "print('up', flush=True); sum(range(3_000_000)); time.sleep(60)"
    proc = runner.start([sys.executable, "-c", code], env=runner.peer_env(preload=None), stdout=subprocess.PIPE,
                        text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        before = {pid: dict(row, cpu_s=0.0) for pid, row in runner.process_tree({proc.pid: "peer"}).items()}
        tree = runner.process_tree({proc.pid: "peer"})
    finally:
        runner.stop(proc)
    names = sorted(row["name"] for row in tree.values())
    assert names[0] == "peer" and len(names) == 2 and names[1].startswith("peer/python"), names
    assert all(row["peak_rss"] > 0 for row in tree.values())
    assert runner.cpu_delta(before, tree)["peer"] > 0


def test_run_past_its_timeout_answers_none():
    finished = runner.run([sys.executable, "-c", "import time; time.sleep(60)"], env=runner.peer_env(preload=None),
                          timeout_s=0.5)
    assert finished.returncode is None and finished.seconds < 30


def test_stop_gives_a_grace_period_to_a_peer_that_handles_sigterm(tmp_path):
    marker = tmp_path / "cleaned"
    code = (f"import signal, sys, time\n"
            f"signal.signal(signal.SIGTERM, lambda *a: (open({str(marker)!r}, 'w').close(), sys.exit(0)))\n"
            f"print('up', flush=True)\ntime.sleep(60)\n")
    proc = runner.start([sys.executable, "-c", code], env=runner.peer_env(preload=None), stdout=subprocess.PIPE,
                        text=True)
    assert proc.stdout.readline().strip() == "up"
    runner.stop(proc, grace_s=20)
    assert marker.exists() and proc.returncode == 0


def test_child_runs_hand_over_the_spec_and_read_back_the_result(tmp_path):
    script = tmp_path / "harness.py"
    script.write_text(textwrap.dedent("""
        import json, sys
        assert sys.argv[1] == "--child"
        spec = json.load(open(sys.argv[2]))
        print("child log line")
        if spec["fail"]:
            sys.exit(2)
        json.dump({"token_ids": spec["token_ids"][::-1]}, open(sys.argv[3], "w"))
    """))
    children = runner.ChildRuns(script, tmp_path, runner.peer_env(preload=None))
    done = children.run("ok", {"token_ids": [1, 2, 3], "fail": False})
    assert done.result == {"token_ids": [3, 2, 1]} and "child log line" in done.log
    assert json.loads((done.folder / "spec.json").read_text())["token_ids"] == [1, 2, 3]
    with pytest.raises(RuntimeError, match=r"peer process bad failed \(2\)(.|\n)*child log line"):
        children.run("bad", {"token_ids": [], "fail": True})


def test_wait_ready_names_a_peer_that_exited(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("bind: address in use\n")
    proc = runner.start([sys.executable, "-c", "raise SystemExit(1)"], env=runner.peer_env(preload=None))
    with pytest.raises(RuntimeError, match="test server exited \\(1\\)(.|\n)*address in use"):
        runner.wait_ready(lambda: False, proc, timeout_s=30, what="test server", log=log)
    runner.stop(proc)


def _is_running(pid: int) -> bool:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        if state == "Z":  # killed, not yet reaped by init
            return False
        time.sleep(0.05)
    return True


def test_stop_sends_the_signal_asked_for(tmp_path):
    """py-spy writes its profile on SIGINT only: stop() must send the signal it is given."""
    marker = tmp_path / "got"
    script = ("import signal, sys, time\n"
              f"signal.signal(signal.SIGINT, lambda *a: (open({str(marker)!r}, 'w').write('int'), sys.exit(0)))\n"
              "print('up', flush=True)\ntime.sleep(60)\n")
    proc = runner.start([sys.executable, "-c", script], env=dict(os.environ), stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"up\n"
    runner.stop(proc, grace_s=10, signum=signal.SIGINT)
    assert marker.read_text() == "int"


#: py-spy's raw output of a vLLM run (--subprocesses): the driver, the engine core, the worker with
#: corekv's writer thread beside its forward; one command line spans two lines, as py-spy writes it
SPY_RAW = """\
process 10:"python peer.py --child";child (vllm_lmcache_peer.py:9);step (vllm/v1/engine/llm_engine.py:3) 50
process 10:"python peer.py --child";process 20:"python -c spawn_main";run_engine_core (vllm/v1/engine/core.py:1);EngineCoreProc.run_busy_loop (vllm/v1/engine/core.py:2);Scheduler.schedule (vllm/v1/core/sched/scheduler.py:4) 25
process 10:"python peer.py --child";process 20:"python -c spawn_main";run_engine_core (vllm/v1/engine/core.py:1);EngineCoreProc.run_busy_loop (vllm/v1/engine/core.py:2);get_num_new_matched_tokens (corekv/integrations/vllm/scheduler.py:7);contains (corekv/offload/facade.py:8) 5
process 10:"python peer.py --child";process 30:"python -c import x
spawn_main()";WorkerProc.worker_busy_loop (vllm/v1/executor/multiproc_executor.py:5);LlamaModel.forward (vllm/model_executor/models/llama.py:6) 400
process 10:"python peer.py --child";process 30:"python -c import x
spawn_main()";_bootstrap (threading.py:1);_run (corekv/offload/writer.py:11);put (tiers/shm.py:12) 20
process 10:"python peer.py --child";process 30:"python -c import x
spawn_main()";WorkerProc.worker_busy_loop (vllm/v1/executor/multiproc_executor.py:5);start_load_kv (lmcache/integration/vllm/lmcache_mp_connector.py:3) 5
"""


def test_spy_shares_count_each_process_by_its_role_and_each_sample_in_one_part(tmp_path):
    from peers import spy

    raw = tmp_path / "p.raw"
    raw.write_text(SPY_RAW)
    assert sum(count for _, count in spy.samples(raw)) == 505
    got = spy.shares(raw, rate=50)
    assert set(got) == {"driver", "engine core", "worker", "worker, other threads"}
    assert got["driver"]["seconds"] == pytest.approx(1.0) and got["driver"]["parts"] == {"other": 1.0}
    assert got["engine core"]["parts"] == pytest.approx({"scheduler": 0.5, "corekv": 0.1})
    assert got["worker"]["parts"] == pytest.approx({"model forward": 8.0, "lmcache": 0.1})
    assert got["worker"]["top"] == [("start_load_kv (lmcache/integration/vllm/lmcache_mp_connector.py:3)",
                                     pytest.approx(0.1))]
    # the writer thread has no WorkerProc frame: the worker's by its process, apart from its main thread
    assert got["worker, other threads"]["parts"] == pytest.approx({"corekv": 0.4})
    assert got["worker, other threads"]["top"] == [("put (tiers/shm.py:12)", pytest.approx(0.4))]
