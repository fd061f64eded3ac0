"""`hf-spec-cotrain vllm-serve` run as a subprocess for the tests that need a rollout server (tests/generation/test_vllm_server.py,
tests/distributed/test_trainer_pp_vllm.py)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from hf_spec_cotrain.generation.client import VLLMServerClient
from hf_spec_cotrain.generation.protocol import API_KEY_ENV


# Short, so that the abandoned-transaction test waits only seconds; uploads here take milliseconds.
TRANSACTION_TIMEOUT = 5.0
STARTUP_TIMEOUT = 300.0
# The servers' key (given through the environment) and staging limits: small, so that tests reach them.
API_KEY = "test-key-3f9c2a71d0b84e65"
MAX_OPEN_TRANSACTIONS = 2
MAX_STAGED_BYTES = 32 * 2**20
MAX_CHUNKS = 64


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServerProcess:
    """`hf-spec-cotrain vllm-serve` for a model folder (and a draft) through the real console command, on a port of
    its own that it keeps across restarts; `api_key` goes through the environment variable. The environment is the
    one at construction: a restart from inside a trainer must not hand the server the trainer's distributed
    settings."""

    def __init__(self, model_dir: Path, log_dir: Path, *, draft_dir: Path | None = None, api_key: str | None = None):
        self.port = free_port()
        self.log_path = log_dir / "server.log"
        self.api_key = api_key
        executable = Path(sys.executable).with_name("hf-spec-cotrain")
        command = [str(executable)] if executable.exists() else [sys.executable, "-m", "hf_spec_cotrain.cli"]
        command += ["vllm-serve", "--model", str(model_dir)]
        if draft_dir is not None:
            command += ["--draft", str(draft_dir), "--num_speculative_tokens", "3"]
        command += [
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max_model_len",
            "256",
            # Small KV blocks let the test prompts hit the prefix cache, which every update must reset.
            "--llm_kwargs",
            json.dumps({"block_size": 32}),
            "--transaction_timeout",
            str(TRANSACTION_TIMEOUT),
            "--max_open_transactions",
            str(MAX_OPEN_TRANSACTIONS),
            "--max_staged_bytes",
            str(MAX_STAGED_BYTES),
            "--max_chunks",
            str(MAX_CHUNKS),
            "--log_level",
            "warning",
        ]
        self.command = command
        self.env = {key: value for key, value in os.environ.items() if key != API_KEY_ENV}
        if api_key is not None:
            self.env[API_KEY_ENV] = api_key
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def new_client(self, **kwargs) -> VLLMServerClient:
        return VLLMServerClient(self.base_url, timeout=120.0, connect_timeout=5.0, api_key=self.api_key, **kwargs)

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env
            )
        client = self.new_client()
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            if self.process.poll() is not None:
                pytest.fail(f"vllm-serve exited with {self.process.returncode}:\n{self.log_path.read_text()[-4000:]}")
            try:
                client.health()
                return
            except requests.ConnectionError:
                if time.monotonic() > deadline:
                    pytest.fail(f"vllm-serve not ready in {STARTUP_TIMEOUT} s:\n{self.log_path.read_text()[-4000:]}")
                time.sleep(0.5)

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)


def stop_process(process: subprocess.Popen) -> None:
    """SIGTERM the server's process group (its own session), then SIGKILL if it has not exited within 30 s."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
