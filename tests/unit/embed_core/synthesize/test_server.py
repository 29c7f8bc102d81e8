"""The launched llama.cpp server's slots: the thread split, the config rules, the client sharing the
requests among the slots' endpoints (two scripted OpenAI-compatible servers), and the real
llama.cpp servers started, answering and stopped together."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from embed_core.config import parse_config
from embed_core.errors import ConfigError, EmbedpipeError
from embed_core.procs import descendants
from embed_core.schema import Record
from embed_core.synthesize.cache import RequestCache
from embed_core.synthesize.client import LLMClient
from embed_core.synthesize.config import LLMServerConfig, SamplingConfig, SynthesizeConfig
from embed_core.synthesize.jobs import generate, plan_jobs
from embed_core.synthesize.prompts import load_templates
from embed_core.synthesize.server import (LlamaCppServers, default_slots, default_threads, resolve_slots, slot_log_path,
                                          split_threads)
from tests.helpers.llm_server import ScriptedLLMServer, needs_llama

SOURCES = [{"name": "stsb", "kind": "sts", "path": "stsb/train.csv"}]


def _server(**server) -> LLMServerConfig:
    return parse_config({"prepare": {"sources": SOURCES}, "synthesize": {"server": server}},
                        origin="c.yaml").synthesize.server


def test_slots_share_the_threads_equally_and_every_server_gets_at_least_one():
    assert split_threads(8, 2) == 4 and split_threads(7, 2) == 3 and split_threads(8, 3) == 2
    assert split_threads(1, 2) == 1 and split_threads(2, 4) == 1
    assert split_threads(None, 1) == default_threads()  # the config leaves n_threads open: the rule, shared
    assert resolve_slots(_server(launch="llama_cpp", slots=3)) == 3
    assert resolve_slots(_server(launch="llama_cpp", slots=3, n_threads=8)) == 3


def test_auto_slots_are_two_servers_on_two_or_more_cores_and_one_where_llama_cpp_gets_one_thread():
    assert default_slots(cores=2) == 2 and default_slots(cores=16) == 2  # measured on 2 cores; more not measured
    assert default_slots(cores=1) == 1 and default_slots(cores=8, n_threads=1) == 1
    assert resolve_slots(_server(launch="llama_cpp", n_threads=1)) == 1


def test_every_slot_gets_its_own_port_log_and_threads_and_no_request_is_ever_interrupted(tmp_path):
    servers = LlamaCppServers("model.gguf", slots=3, model_alias="m", n_threads=7, log_path=tmp_path / "llama.log")
    ports = [s.port for s in servers.servers]
    assert len(set(ports)) == 3 and servers.threads_per_slot == 2
    assert [s.log_path.name for s in servers.servers] == ["llama.log", "llama-1.log", "llama-2.log"]
    assert slot_log_path(None, 1) is None
    command = servers.servers[0].command()
    assert command[command.index("--n_threads") + 1] == "2"
    assert command[command.index("--interrupt_requests") + 1] == "false"
    fixed = LlamaCppServers("model.gguf", slots=2, model_alias="m", port=9100)
    assert [s.base_url for s in fixed.servers] == ["http://127.0.0.1:9100/v1", "http://127.0.0.1:9101/v1"]
    fixed.stop()  # never started: nothing to stop, no error


@pytest.mark.parametrize("server, reason", [
    ({"base_url": "http://localhost:8000/v1", "launch": "llama_cpp", "slots": 2},
     "slots: 2 starts that many local llama.cpp servers, but base_url(s) name servers you run"),
    ({"base_urls": ["http://a:1/v1", "http://b:1/v1"], "slots": 2},
     "slots: 2 starts that many local llama.cpp servers, but base_url(s) name servers you run"),
    ({"slots": 2}, "slots: 2 needs launch: llama_cpp"),
    ({"launch": "llama_cpp", "slots": 4, "n_threads": 2}, "slots: 4 servers need a thread each, but n_threads is 2"),
    ({"launch": "llama_cpp", "slots": 3, "port": 65534}, "slots: 3 servers from port 65534 run past port 65535"),
    ({"launch": "llama_cpp", "slots": 0}, "server.slots: a number of llama.cpp servers, 1 to 64, or auto; got 0"),
    ({"launch": "llama_cpp", "slots": "many"}, "slots: a number of llama.cpp servers, 1 to 64, or auto; got 'many'"),
])
def test_slots_are_refused_in_one_line_naming_the_reason(server, reason):
    with pytest.raises(ConfigError, match=r"^c\.yaml: synthesize\.server(\.slots)?: ") as err:
        _server(**server)
    assert reason in str(err.value) and "\n" not in str(err.value)


def test_slots_default_to_auto_and_are_taken_with_the_launched_server():
    assert _server(launch="llama_cpp").slots == "auto" and _server(base_url="http://localhost:8000/v1").slots == "auto"
    assert _server(launch="llama_cpp", slots=2, n_threads=2).slots == 2


def test_the_client_shares_the_requests_among_the_launched_slots(tmp_path):
    cfg = LLMServerConfig(model="scripted", launch="llama_cpp", slots=2, max_concurrency=1, mode="chat")
    with ScriptedLLMServer() as a, ScriptedLLMServer() as b:
        async def launched() -> list[str]:
            return [a.base_url, b.base_url]

        client = LLMClient(cfg, SamplingConfig(), RequestCache(tmp_path / "requests.sqlite"),
                           before_first_request=launched)

        async def ask() -> list:
            prompts = [[{"role": "user", "content": f"Rewrite this sentence: cat number {i}."}] for i in range(6)]
            try:
                return await asyncio.gather(*(client.complete(prompt_name="p", prompt_version="1", prompt=p, stop=(),
                                                              schema=("text_answer", {"type": "object"}))
                                              for p in prompts))
            finally:
                await client.aclose()

        answers = asyncio.run(ask())
    assert len(answers) == 6 and client.base_url == a.base_url
    assert set(client.stats.endpoints) == {a.base_url, b.base_url}  # two slots: both get requests
    assert all(e["answered"] >= 1 and e["failed"] == 0 for e in client.stats.endpoints.values()), client.stats.endpoints
    assert len(a.answered) + len(b.answered) == 6



def _llama_servers_running() -> list[int]:
    """This process's descendants that are llama.cpp servers."""
    running = []
    for pid in descendants():
        try:
            if b"llama_cpp.server" in Path(f"/proc/{pid}/cmdline").read_bytes():
                running.append(pid)
        except OSError:
            pass
    return running




@pytest.mark.llama_server
@needs_llama
def test_two_real_llama_cpp_slots_both_answer_and_are_both_stopped(tmp_path):
    # 4 SciFact-like records, paraphrase only, one request in flight per slot: the first two go one to each
    cfg = SynthesizeConfig.model_validate({
        "server": {"launch": "llama_cpp", "slots": 2, "n_threads": 2, "max_concurrency": 1},
        "sampling": {"temperature": 0.0, "max_tokens": 32, "seed": 1},
        "strategies": ["paraphrase"], "max_parse_retries": 0})
    records = [Record(id=f"r{i}", dataset="scifact", task="retrieval", query=query, positives=[passage])
               for i, (query, passage) in enumerate([
                   ("Vitamin D lowers the risk of hip fractures.", "Low vitamin D was linked to more hip fractures."),
                   ("Sleep helps memory.", "Sleep after learning improved recall the next day."),
                   ("Aspirin prevents heart attacks.", "Daily aspirin reduced first heart attacks in men."),
                   ("Exercise lowers blood pressure.", "Aerobic training lowered systolic pressure by 5 mmHg.")])]
    jobs = plan_jobs(cfg, "scifact", records, load_templates(None), seed=0)
    outcomes, stats = generate(cfg, jobs, tmp_path, seed=0)
    server = stats["server"]
    assert len(outcomes) == 4 and server["launched"] and server["slots"] == 2 and server["threads_per_slot"] == 1
    assert set(stats["endpoints"]) == set(server["base_urls"])
    assert all(e["answered"] >= 1 and e["failed"] == 0 for e in stats["endpoints"].values()), stats["endpoints"]
    assert sum(e["answered"] for e in stats["endpoints"].values()) == stats["requests"] == 4
    assert (tmp_path / "logs" / "llama-server.log").is_file() and (tmp_path / "logs" / "llama-server-1.log").is_file()
    assert _llama_servers_running() == []  # both processes are gone, and their ports are closed
    for url in server["base_urls"]:
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1].split("/")[0])), timeout=1).close()


@pytest.mark.llama_server
@needs_llama
def test_one_slot_failing_to_start_stops_the_others_and_names_its_log(tmp_path):
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"not a gguf file")
    servers = LlamaCppServers(bad, slots=2, model_alias="m", n_threads=2, log_path=tmp_path / "llama-server.log",
                              startup_timeout_s=120)
    with pytest.raises(EmbedpipeError, match=r"exited with .* during startup \(log: .*llama-server(-1)?\.log\)"):
        servers.start()
    assert all(s.proc.poll() is not None for s in servers.servers) and _llama_servers_running() == []


def test_a_synthesize_section_without_a_server_to_ask_is_refused_at_load_with_one_line():
    """It used to plan its requests and fail each one ("16 of 16 requests ... got no answer")."""
    from embed_core.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        _server()
    line = str(refused.value)
    assert line.startswith("c.yaml: synthesize.server: no LLM server to ask: set base_url") and "\n" not in line
    assert "launch: llama_cpp (the packaged Gemma-3-270M" in line
