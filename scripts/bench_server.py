"""A bounded loopback load test of ``hf-spec-cotrain vllm-serve``: clients generate without pause while weight updates
commit.

The server (tiny Llama target from `hf_spec_cotrain.testing`, an EAGLE-3 draft built from it, an API key, 127.0.0.1)
runs as a subprocess through the console command. ``--clients`` threads, each with a client of its own, send greedy
generate requests back to back while the main thread commits ``--commits`` policy updates (in chunks), alternating
two weight sets whose greedy completions differ for every prompt; each commit waits until some answer reports it,
so that every version is served. Reported:

* requests served, and their latency (p50, p99, max): a request waits for the commits queued before it on the
  engine thread;
* errors (goal: none): any request that failed;
* mixed outputs (goal: none): answers whose completions are not exactly the greedy completions, computed with
  transformers, of the weights of the policy version the answer reports;
* commit time (p50, max, each), from begin to the end of the commit: the upload, the checks, the sync, the
  read-back through vLLM's kernels and a few probe tokens, after the generations queued before it on the engine
  thread; the first commit also reads the engine's weights as the rollback point.

    OMP_NUM_THREADS=2 python scripts/bench_server.py                 # 4 clients, 8 commits
    OMP_NUM_THREADS=2 python scripts/bench_server.py --clients 8 --commits 20 --json figures.json
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_spec_cotrain.draft import Eagle3DraftModel
from hf_spec_cotrain.generation.client import VLLMServerClient
from hf_spec_cotrain.generation.protocol import API_KEY_ENV
from hf_spec_cotrain.testing import save_tiny_target


PROMPT_TEXTS = (
    "def fibonacci(n):\n",
    "The quick brown fox",
    "import torch\nx = torch.",
    "A long prompt that fills more than one key-value cache block, so that the prefix cache can hit. " * 2,
)
API_KEY = "bench-server-key"
STARTUP_TIMEOUT = 600.0


@dataclass
class Figures:
    clients: int
    commits: int
    max_tokens: int
    requests_served: int = 0
    errors: int = 0
    mixed_outputs: int = 0
    latency_p50_s: float = float("nan")
    latency_p99_s: float = float("nan")
    latency_max_s: float = float("nan")
    commit_p50_s: float = float("nan")
    commit_max_s: float = float("nan")
    commit_s: list[float] = field(default_factory=list)  # each commit, in order
    wall_s: float = 0.0
    first_errors: list[str] = field(default_factory=list)


def greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Transformers' greedy completions of exactly `max_tokens` tokens, one prompt at a time."""
    with torch.no_grad():
        return [
            model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,  # as the server's ignore_eos: EOS is a token like any other
            )[0, len(prompt) :].tolist()
            for prompt in prompts
        ]


def perturbed(state_dict: dict[str, torch.Tensor], *, seed: int, scale: float) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: tensor + scale * tensor.std() * torch.randn(tensor.shape, generator=generator)
        if tensor.is_floating_point()
        else tensor
        for name, tensor in state_dict.items()
    }


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(target: Path, draft: Path, port: int, log_path: Path) -> subprocess.Popen:
    executable = Path(sys.executable).with_name("hf-spec-cotrain")
    command = [str(executable)] if executable.exists() else [sys.executable, "-m", "hf_spec_cotrain.cli"]
    command += ["vllm-serve", "--model", str(target), "--draft", str(draft), "--num_speculative_tokens", "3"]
    command += ["--port", str(port), "--max_model_len", "256", "--llm_kwargs", json.dumps({"block_size": 32})]
    command += ["--log_level", "warning"]
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, API_KEY_ENV: API_KEY},
        )


def run(args: argparse.Namespace, workdir: Path) -> Figures:
    target_dir = save_tiny_target(workdir / "target", "llama")
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    draft_dir = workdir / "draft"
    Eagle3DraftModel.from_target(model, aux_layer_ids=(1, 3, 5)).save_pretrained(draft_dir)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = [[tokenizer.bos_token_id, *tokenizer(text).input_ids] for text in PROMPT_TEXTS]
    weights = {"original": {name: tensor.clone() for name, tensor in model.state_dict().items()}}
    weights["perturbed"] = perturbed(weights["original"], seed=11, scale=args.perturbation)
    completions = {"original": greedy(model, prompts, args.max_tokens)}
    model.load_state_dict(weights["perturbed"])
    completions["perturbed"] = greedy(model, prompts, args.max_tokens)
    if any(old == new for old, new in zip(completions["original"], completions["perturbed"])):
        raise SystemExit(
            f"--perturbation {args.perturbation} leaves a greedy completion unchanged: a mix would not show."
        )

    port = free_port()
    log_path = workdir / "server.log"
    process = start_server(target_dir, draft_dir, port, log_path)
    figures = Figures(clients=args.clients, commits=args.commits, max_tokens=args.max_tokens)
    try:
        url = f"http://127.0.0.1:{port}"
        VLLMServerClient(url, api_key=API_KEY).wait_until_ready(timeout=STARTUP_TIMEOUT)
        weights_of_version = {0: "original"}
        latencies: list[float] = []
        answers: list[int] = []  # versions served, in order
        errors: list[str] = []
        seen = threading.Condition()
        done = threading.Event()

        def generate_until_done() -> None:
            client = VLLMServerClient(url, api_key=API_KEY)
            while not done.is_set():
                started = time.perf_counter()
                try:
                    out = client.generate(prompts, max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
                except Exception as error:
                    with seen:
                        errors.append(f"{type(error).__name__}: {error}")
                        seen.notify_all()
                    continue
                latency = time.perf_counter() - started
                version = out.versions.policy
                mixed = out.completion_ids != completions[weights_of_version[version]]
                with seen:
                    latencies.append(latency)
                    answers.append(version)
                    figures.mixed_outputs += mixed
                    seen.notify_all()
            client.close()

        threads = [threading.Thread(target=generate_until_done, daemon=True) for _ in range(args.clients)]
        wall_started = time.perf_counter()
        for thread in threads:
            thread.start()
        updater = VLLMServerClient(url, api_key=API_KEY)
        commit_seconds = []
        for version in range(1, args.commits + 1):
            name = "perturbed" if version % 2 else "original"
            weights_of_version[version] = name
            with seen:
                start = len(answers)
            started = time.perf_counter()
            updater.sync_weights("policy", weights[name].items(), version=version, chunk_bytes=args.chunk_bytes)
            commit_seconds.append(time.perf_counter() - started)
            with seen:
                if not seen.wait_for(lambda start=start, version=version: version in answers[start:], timeout=600):
                    raise SystemExit(f"No answer reported version {version} within 600 s; see {log_path}.")
        done.set()
        for thread in threads:
            thread.join()
        figures.wall_s = time.perf_counter() - wall_started
    finally:
        process.terminate()
        process.wait(timeout=60)
    figures.requests_served = len(latencies)
    figures.errors = len(errors)
    figures.first_errors = errors[:3]
    if len(latencies) >= 2:
        percentiles = statistics.quantiles(latencies, n=100, method="inclusive")
        figures.latency_p50_s, figures.latency_p99_s = statistics.median(latencies), percentiles[98]
    figures.latency_max_s = max(latencies, default=float("nan"))
    figures.commit_p50_s, figures.commit_max_s = statistics.median(commit_seconds), max(commit_seconds)
    figures.commit_s = commit_seconds
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4, help="Concurrent generate clients.")
    parser.add_argument("--commits", type=int, default=8, help="Policy updates committed during the test.")
    parser.add_argument("--max_tokens", type=int, default=16, help="Greedy tokens per completion.")
    parser.add_argument("--chunk_bytes", type=int, default=200_000, help="Chunk size of the updates.")
    parser.add_argument("--perturbation", type=float, default=0.1, help="Scale of the second weight set's noise.")
    parser.add_argument("--json", type=Path, default=None, help="Also write the figures to this file.")
    args = parser.parse_args()
    if args.clients < 1 or args.commits < 1:
        parser.error("--clients and --commits must be at least 1.")
    with tempfile.TemporaryDirectory(prefix="bench-server-") as workdir:
        figures = run(args, Path(workdir))
    print(
        f"{figures.clients} clients, {figures.commits} commits ({figures.max_tokens}-token greedy completions of "
        f"{len(PROMPT_TEXTS)} prompts per request) in {figures.wall_s:.1f} s: {figures.requests_served} requests "
        f"served, latency p50 {figures.latency_p50_s:.2f} s, p99 {figures.latency_p99_s:.2f} s, max "
        f"{figures.latency_max_s:.2f} s; commits p50 {figures.commit_p50_s:.2f} s, max {figures.commit_max_s:.2f} s; "
        f"errors {figures.errors}, mixed outputs {figures.mixed_outputs}"
    )
    print("commits (s): " + ", ".join(f"{seconds:.2f}" for seconds in figures.commit_s))
    for error in figures.first_errors:
        print(f"  error: {error}")
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(figures), indent=2) + "\n")
    if figures.errors or figures.mixed_outputs:
        sys.exit(1)


if __name__ == "__main__":
    main()
