"""Hostile programs against the code sandbox, in every mode that works on this machine.

Every program is graded against a test whose expected output it never prints,
so each must be graded failed, within its limit. Each test then checks the
containment its attack targets. Where a mode does not guarantee something
(``sandbox.guarantees``), the test asserts that documented fallback instead.
All programs of a mode run concurrently (one fixture), so the suite takes a few
seconds per mode.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from areal_core.reward import grade_code, sandbox
from areal_core.reward.sandbox import SandboxLimits, guarantees, sandbox_mode

LIMITS = SandboxLimits(
    wall_s=3.0, cpu_s=2, memory_mb=256, max_processes=16, file_size_mb=1, disk_mb=8, max_open_files=64
)
SLACK_S = 6.0  # sandbox start-up and teardown on a busy 2-core machine
SECRET = "s3cr3t-4e9b1"
UNREACHABLE = "this output is never printed"

# name -> program; {port}, {outside}, {decoy}, {me} are filled in per run
PROGRAMS = {
    "infinite_loop": "while True:\n    pass\n",
    "sleep_past_limit": "import time\ntime.sleep(60)\n",
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    "thread_bomb": "import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(60,)).start()\n",
    "memory_bomb": "chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 2**20))\n",
    "disk_fill_many_files": (
        "i = 0\nwhile i < 64:\n    open(f'f{{i}}', 'wb').write(b'x' * 512 * 1024)\n    i += 1\nprint('wrote 32 MB')\n"
    ),
    "one_huge_file": "with open('big', 'wb') as f:\n    while True:\n        f.write(b'x' * 2**20)\n",
    "huge_output": "import sys\nwhile True:\n    sys.stdout.write('y' * 65536)\n",
    "huge_stderr": "import sys\nwhile True:\n    sys.stderr.write('y' * 65536)\n",
    "write_outside": "open({outside!r}, 'w').write('escaped')\nprint('wrote outside')\n",
    "append_etc_passwd": "open('/etc/passwd', 'a').write('evil::0:0::/:/bin/sh\\n')\n",
    "read_etc_shadow": "print(open('/etc/shadow').read())\n",
    "read_env_secret": "import os\nprint(os.environ.get('AREAL_HOSTILE_SECRET', 'no secret'))\n",
    "read_other_process_env": (
        "import os\nfor p in os.listdir('/proc'):\n    try:\n        d = open(f'/proc/{{p}}/environ', 'rb').read()\n"
        "    except OSError:\n        continue\n    if b'AREAL_HOSTILE_SECRET' in d:\n        print('leaked', d[:4000])\n"
    ),
    "network_connect": (
        "import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'pwned')\n"
        "print('connected')\n"
    ),
    "kill_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nimport time\ntime.sleep(60)\n",
    "kill_decoy_process": "import os, signal\nos.kill({decoy}, signal.SIGKILL)\nprint('killed the decoy')\n",
    "kill_test_process": "import os, signal\nos.kill({me}, signal.SIGKILL)\n",
    "kill_everything": "import os, signal\nos.kill(-1, signal.SIGKILL)\n",
    "daemon_left_behind": (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(60)\n"
        "    os._exit(0)\nprint('left a daemon')\n"
    ),
    "deep_recursion_segfault": "import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return f(n + 1)\nf(0)\n",
    "too_many_files": "fs = [open('/dev/null') for _ in range(100000)]\n",
    "mount_tmpfs": "import subprocess\nsubprocess.run(['mount', '-t', 'tmpfs', 'x', '/mnt'], check=True)\n",
    "fake_success_exit_0": "import os\nos._exit(0)\n",
}
# these can hit the test process itself when the sandbox shares its user id: run only where it does not
NEEDS_OWN_USER = {"kill_test_process", "kill_everything"}


def _modes() -> list[str]:
    best = sandbox_mode()
    return [best] if best == "rlimits" else [best, "rlimits"]


class _Listener:
    """A TCP server on ``host`` (all addresses: 0.0.0.0) recording whether an attack connected.

    Only a connection that sends the attacks' ``pwned`` counts: its port came from the kernel's free
    ones, and another test in the other pytest-xdist worker may have been handed the same port a moment
    before and poll it while its own server finds it taken (a launcher retries on another port). Such
    connections are kept apart in ``strays``."""

    HELLO = b"pwned"

    def __init__(self, host: str = "127.0.0.1"):
        self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.strays: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                first = self._first_bytes(conn)
            if first.startswith(self.HELLO):
                self.connections += 1
            else:
                self.strays.append(first)

    def _first_bytes(self, conn: socket.socket) -> bytes:
        conn.settimeout(2.0)
        got = b""
        try:
            while len(got) < len(self.HELLO):
                part = conn.recv(64)
                if not part:
                    break
                got += part
        except OSError:  # a timeout or a reset: what came so far
            pass
        return got

    def close(self):
        self._stop.set()
        self._thread.join()
        self.sock.close()


@contextlib.contextmanager
def _recorded_markers():
    """The run markers of the sandboxes started in this block (other tests, in other pytest-xdist
    workers, start sandboxes of their own at the same time: only ours are looked for)."""
    from areal_core.reward import sandbox

    markers, real = [], sandbox.scrubbed_env

    def recording(marker: str) -> dict[str, str]:
        markers.append(marker)
        return real(marker)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sandbox, "scrubbed_env", recording)
        yield markers


def _sandbox_processes(markers: list[str]) -> list[int]:
    """PIDs of processes still alive from the sandboxes with these markers (their environment holds one)."""
    wanted = [f"AREAL_SANDBOX_RUN={m}".encode() for m in set(markers)]
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read()
            except OSError:
                continue
            if any(w in env for w in wanted):
                found.append(int(pid))
    return found


@pytest.fixture(scope="module", params=_modes())
def hostile(request):
    mode = request.param
    old_mode = os.environ.get("AREAL_SANDBOX_MODE")
    os.environ["AREAL_SANDBOX_MODE"] = mode
    os.environ["AREAL_HOSTILE_SECRET"] = SECRET
    sandbox_mode.cache_clear()
    # a world-writable folder straight under /tmp: only the sandbox can keep a program out of it
    outside_dir = tempfile.mkdtemp(prefix=f"areal-outside-{mode}-", dir="/tmp")
    os.chmod(outside_dir, 0o777)
    outside = os.path.join(outside_dir, "escaped.txt")
    listener = _Listener()
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    own_user = guarantees(mode)["own_user"]
    fill = {"port": listener.port, "outside": outside, "decoy": decoy.pid, "me": os.getpid()}
    names = [n for n in PROGRAMS if own_user or n not in NEEDS_OWN_USER]
    tests = [{"testtype": "stdin", "input": "", "output": UNREACHABLE}]

    def run(name):
        t0 = time.monotonic()
        result = grade_code(PROGRAMS[name].format(**fill), tests, LIMITS)
        return name, result, time.monotonic() - t0

    try:
        with _recorded_markers() as markers, ThreadPoolExecutor(6) as pool:
            results = {name: (res, dt) for name, res, dt in pool.map(run, names)}
        assert len(markers) >= len(names)  # every program ran in a sandbox with its own marker
        time.sleep(0.2)
        leftovers = _sandbox_processes(markers)
        yield {
            "mode": mode,
            "results": results,
            "outside": outside,
            "listener": listener,
            "decoy": decoy,
            "leftovers": leftovers,
            "guarantees": guarantees(mode),
            "ran": names,
        }
    finally:
        listener.close()
        shutil.rmtree(outside_dir)
        decoy.kill()
        decoy.wait()
        os.environ.pop("AREAL_HOSTILE_SECRET", None)
        if old_mode is None:
            os.environ.pop("AREAL_SANDBOX_MODE", None)
        else:
            os.environ["AREAL_SANDBOX_MODE"] = old_mode
        sandbox_mode.cache_clear()


def test_at_least_twenty_hostile_programs_ran(hostile):
    assert len(PROGRAMS) >= 20
    skipped = set(PROGRAMS) - set(hostile["ran"])
    # the only programs left out are those a same-user sandbox cannot survive, and only where documented
    assert skipped <= NEEDS_OWN_USER
    assert not skipped or hostile["guarantees"]["own_user"] is False


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_graded_failed_within_limit(hostile, name):
    if name not in hostile["results"]:
        assert hostile["guarantees"]["own_user"] is False and name in NEEDS_OWN_USER
        return
    result, seconds = hostile["results"][name]
    assert result.passed is False, result
    assert seconds < LIMITS.wall_s + SLACK_S, (name, seconds)


def test_limits_give_the_expected_reasons(hostile):
    r = {name: res.reason for name, (res, _) in hostile["results"].items()}
    assert "time limit" in r["infinite_loop"]  # CPU, or wall time first on a busy machine
    assert "wall time limit" in r["sleep_past_limit"]
    for name in ("huge_output", "one_huge_file"):  # SIGXFSZ, or EFBIG where Python ignores SIGXFSZ
        assert "size limit" in r[name] or "File too large" in r[name], r[name]
    assert "MemoryError" in r["memory_bomb"]


def test_no_process_outlives_its_run(hostile):
    assert hostile["leftovers"] == []


def test_host_and_test_process_intact(hostile):
    with open("/etc/passwd") as f:
        assert "evil" not in f.read()
    if hostile["guarantees"]["own_user"]:
        assert hostile["decoy"].poll() is None  # another process of ours: out of reach
        assert "killed the decoy" not in _got(hostile, "kill_decoy_process")
    else:  # documented fallback: a same-user program can signal our other processes
        assert hostile["decoy"].poll() is not None
    # this test running at all shows kill_test_process / kill_everything did not reach us


def _got(hostile, name) -> str:
    res, _ = hostile["results"][name]
    return " ".join(d.get("got", "") + d.get("reason", "") for d in res.details)


def test_environment_scrubbed(hostile):
    assert SECRET not in _got(hostile, "read_env_secret")
    assert "no secret" in _got(hostile, "read_env_secret")
    if hostile["guarantees"]["own_user"]:
        assert SECRET not in _got(hostile, "read_other_process_env")


def test_network(hostile):
    if hostile["guarantees"]["no_network"]:
        assert hostile["listener"].connections == 0
        assert "connected" not in _got(hostile, "network_connect")
    else:  # documented fallback: no network isolation
        assert hostile["listener"].connections >= 1


def test_writes_outside_the_sandbox(hostile):
    if hostile["guarantees"]["writes_confined"]:
        assert not os.path.exists(hostile["outside"])
    else:  # documented fallback: world-writable host folders stay writable
        assert os.path.exists(hostile["outside"])


def test_disk_use_bounded(hostile):
    if hostile["guarantees"]["disk_bounded"]:
        assert "wrote 32 MB" not in _got(hostile, "disk_fill_many_files")
    else:  # documented fallback: only each file's size is bounded (the work folder is deleted after the run)
        assert "wrote 32 MB" in _got(hostile, "disk_fill_many_files")


def test_the_listener_counts_an_attack_and_keeps_a_stray_apart():
    """A client that only connects (another test polling a port it was handed too) is no attack; one
    that sends what the attacks send is, whatever else it sends after."""
    listener = _Listener()
    try:
        with socket.create_connection(("127.0.0.1", listener.port), timeout=2) as s:
            s.sendall(b"GET /health HTTP/1.1\r\n\r\n")
        with socket.create_connection(("127.0.0.1", listener.port), timeout=2):
            pass
        with socket.create_connection(("127.0.0.1", listener.port), timeout=2) as s:
            s.sendall(b"pw")
            time.sleep(0.1)
            s.sendall(b"ned and more")
        deadline = time.monotonic() + 10
        while listener.connections + len(listener.strays) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        listener.close()
    assert listener.connections == 1
    assert sorted(b[:5] for b in listener.strays) == [b"", b"GET /"]


def test_sandbox_mode_is_stated():
    mode = sandbox_mode()
    g = guarantees(mode)
    assert g["limits"] and g["scrubbed_env"]
    if mode == "namespaces":
        assert all(g.values())
    else:  # rlimits: the host's files stay readable and its world-writable folders writable
        assert not g["host_files_hidden"] and not g["writes_confined"] and not g["disk_bounded"]
        assert g["own_user"] == (os.geteuid() == 0)
        assert g["no_network"] == (sandbox._probe_netns() is None)


def test_forcing_an_unavailable_mode_is_an_error(monkeypatch):
    monkeypatch.setenv("AREAL_SANDBOX_MODE", "nonsense")
    sandbox_mode.cache_clear()
    try:
        with pytest.raises(ValueError):
            sandbox_mode()
    finally:
        monkeypatch.delenv("AREAL_SANDBOX_MODE")
        sandbox_mode.cache_clear()


# ---------------------------------------------------------------------------------------------------------------
# Forged passes: programs that do not solve the problem but try to be graded passed anyway, against each test style.
# The problem is "square a number"; none of these programs computes a square. Each must be graded failed with no test
# passed (partial credit is a reward too), in every mode, while the control (a correct program) passes.

FORGERY_LIMITS = SandboxLimits(
    wall_s=3.0, cpu_s=2, memory_mb=512, max_processes=16, file_size_mb=4, disk_mb=8, max_open_files=64
)
ASSERT_PREFIX = 'def close(a, b):\n    return abs(a - b) < 1e-9\n\n\ndef square(x):\n    """x squared."""\n'
STYLES = {
    "stdin": (
        [
            {"testtype": "stdin", "input": "7\n", "output": "49\n"},
            {"testtype": "stdin", "input": "12\n", "output": "144\n"},
        ],
        "print(int(input()) ** 2)\n",
    ),
    "functional": (
        [
            {"testtype": "functional", "input": "7", "output": "49", "fn_name": "square"},
            {"testtype": "functional", "input": "12", "output": "144", "fn_name": "square"},
        ],
        "def square(x):\n    return x * x\n",
    ),
    "assert": (
        [
            {
                "testtype": "assert",
                "prefix": ASSERT_PREFIX,
                "code": "def check(candidate):\n    assert close(candidate(7), 49)\n    assert close(candidate(12), 144)\n"
                "    assert candidate(-3) == 9\n\n\ncheck(square)\n",
                "entry_point": "square",
            }
        ],
        "def square(x):\n    return x * x\n",
    ),
}
# what a fake "everything passed" looks like in every format the graders have used (the old harness printed a
# per-run token followed by {"results": ...}; the checker writes {"results": ..., "calls": ...}; the functional
# runner writes {"i": k, "value": v}; the protocol starts with {"ready": true}). No fake carries a right answer.
_FAKES = (
    "ok\\nOK\\nPASSED\\nAll tests passed\\n1 passed\\nTrue\\n"
    '0123456789abcdef0123456789abcdef{\\"results\\": [{\\"ok\\": true, \\"value\\": 0}, {\\"ok\\": true, \\"value\\": 0}]}\\n'
    '{\\"results\\": [{\\"ok\\": true}, {\\"ok\\": true}, {\\"ok\\": true}], \\"calls\\": 3}\\n'
    '{\\"passed\\": true, \\"reason\\": \\"ok\\"}\\n{\\"ready\\": true}\\n{\\"v\\": true, \\"objs\\": []}\\n'
    '{\\"i\\": 0, \\"value\\": 0}\\n{\\"i\\": 1, \\"value\\": 0}\\n'
)
FORGERS = {
    # the old harness's secret: dig every token-like string out of the stack frames and the heap, print it with
    # fake results on every fd, exit 0 before any test runs
    "frames_token": (
        "import gc, json, os, re, sys\nfound = set()\nf = sys._getframe()\nwhile f is not None:\n"
        "    for scope in (f.f_locals, f.f_globals):\n        for v in list(scope.values()):\n"
        "            if isinstance(v, str) and 8 <= len(v) <= 200:\n                found.add(v)\n    f = f.f_back\n"
        "for o in gc.get_objects():\n    if isinstance(o, dict):\n        for v in list(o.values())[:50]:\n"
        "            if isinstance(v, str) and re.fullmatch('[0-9a-f]{16,64}', v):\n                found.add(v)\n"
        "res = json.dumps({'results': [{'ok': True, 'value': 0}] * 3})\n"
        "verdict = json.dumps({'results': [{'ok': True}] * 3, 'calls': 3})\n"
        "for tok in sorted(found):\n    for line in (tok, tok + res, tok + verdict, verdict):\n"
        "        for fd in (1, 2, 3, 4):\n            try:\n                os.write(fd, (line + '\\n').encode())\n"
        "            except OSError:\n                pass\nos._exit(0)\n"
    ),
    # look for the expected values or a token in stdin, argv, the environment and the work folder
    "stdin_argv_env": (
        "import json, os, re, sys\ndata = sys.stdin.read()\ntexts = [data, ' '.join(sys.argv), repr(dict(os.environ))]\n"
        "for name in os.listdir('.'):\n    try:\n        texts.append(open(name).read())\n    except OSError:\n"
        "        pass\nprint(*texts, sep='\\n')\ntable = {}\nfor t in texts:\n"
        '    for a, b in re.findall(r\'"input": "(-?\\d+)", "output": "(-?\\d+)"\', t):\n'
        "        table[int(a)] = int(b)\ndef square(x):\n    return table.get(x, 0)\n"
    ),
    # patch the exit and assert machinery and the builtins the tests use, then raise SystemExit(0) from the function
    "patch_exit_and_builtins": (
        "import builtins, os, sys\nexit_0 = SystemExit(0)\nsys.exit = lambda *a: os._exit(0)\n"
        "builtins.exit = builtins.quit = sys.exit\nbuiltins.AssertionError = type('AssertionError', (Warning,), {})\n"
        "builtins.abs = lambda x: 0\nbuiltins.print = lambda *a, **k: None\n"
        "builtins.__import__ = lambda *a, **k: sys\n__builtins__ = {'abs': lambda x: 0}\n"
        "def square(x):\n    raise exit_0\n"
    ),
    # tamper with the modules the harness uses: json.dumps always claims success, os._exit is a no-op
    "patch_json_and_sys_modules": (
        "import json, os, sys, types\nfake = types.ModuleType('json')\n"
        'fake.dumps = lambda *a, **k: \'{"v": true, "ok": true, "i": 0, "value": 49}\'\n'
        "fake.loads = lambda *a, **k: {'op': 'noop'}\nsys.modules['json'] = fake\n"
        "json.dumps = fake.dumps\nos._exit = lambda code: None\n"
        "sys.modules['builtins'].AssertionError = KeyError\ndef square(x):\n    return 0\n"
    ),
    # the classic: an object equal to everything, close to everything, truthy
    "always_equal": (
        "class Anything:\n    def __eq__(self, other):\n        return True\n    def __ne__(self, other):\n"
        "        return False\n    __lt__ = __le__ = __gt__ = __ge__ = __eq__\n    def __abs__(self):\n        return 0\n"
        "    def __sub__(self, other):\n        return self\n    __rsub__ = __add__ = __radd__ = __sub__\n"
        "    def __hash__(self):\n        return 0\ndef square(x):\n    return Anything()\n"
    ),
    "always_equal_int_subclass": (
        "class Anything(int):\n    def __eq__(self, other):\n        return True\n    def __ne__(self, other):\n"
        "        return False\n    __lt__ = __le__ = __gt__ = __ge__ = __eq__\n    def __abs__(self):\n        return 0\n"
        "    def __sub__(self, other):\n        return self\n    __rsub__ = __sub__\n    __hash__ = int.__hash__\n"
        "def square(x):\n    return Anything(0)\n"
    ),
    # redefine the tests' helpers (the prefix's close, builtins they call) and the check itself; one public
    # answer hard-coded so that `==` alone does not give it away
    "shadow_helpers": (
        "def close(a, b):\n    return True\ndef abs(x):\n    return 0\ndef check(candidate):\n    return None\n"
        "def is_same_list(a, b):\n    return True\ndef square(x):\n    return 9 if x == -3 else 0\n"
    ),
    # write what a grader might read: result, verdict and expected-output files, in the work folder and outside
    "write_expected_files": (
        'import os\nblob = \'49\\n144\\n{"results": [{"ok": true}], "calls": 3}\\n{"i": 0, "value": 49}\\n\'\n'
        "for p in ['stdout', 'verdict', 'verdict.json', 'results.json', 'expected_output', 'job.json', 'status',\n"
        "          '../stdout', '../stderr', '../status', '../spec.json', '../checker/stdout', '../checker/files/job.json',\n"
        "          '../check/job.json', '../check/stdout', '/tmp/check/job.json', '/tmp/check/stdout']:\n"
        "    try:\n        with open(p, 'w') as f:\n            f.write(blob)\n    except OSError:\n        pass\n"
        "def square(x):\n    return 0\n"
    ),
    "exit_os_exit_0": "import os\nos._exit(0)\n",
    "exit_sys_exit_0": "import sys\nsys.exit(0)\n",
    "exit_raise_systemexit_0": "raise SystemExit(0)\n",
    "exit_inside_the_call": "import os\ndef square(x):\n    os._exit(0)\n",
    "fake_success_lines": (
        f"import os, sys\nfakes = '{_FAKES}'\nprint(fakes, flush=True)\nprint(fakes, file=sys.stderr, flush=True)\n"
        "def square(x):\n    return 0\n"
    ),
    # a child that outlives its parent and, once the parent is gone, writes fake results on every fd (and, on
    # the protocol's fd, a well-formed conversation claiming a handle for the function and True for every call)
    "forked_child_late": (
        f"import os, time\nfakes = '{_FAKES}'.encode()\n"
        'talk = (\'{"ready": true}\\n{"v": null}\\n\' + \'{"v": {"handle": 0}}\\n\' * 3 + \'{"v": true}\\n\' * 50).encode()\n'
        "if os.fork() == 0:\n    os.setsid()\n    time.sleep(0.3)\n    for fd in range(1, 20):\n        try:\n"
        "            os.write(fd, talk if fd == 4 else fakes)\n        except OSError:\n            pass\n"
        "    time.sleep(0.5)\n    os._exit(0)\nos._exit(0)\n"
    ),
    # redirect stdout, close every other fd (the harness's channels), then claim success on the new stdout
    "redirect_and_close_fds": (
        "import os, sys\nnull = os.open('/dev/null', os.O_WRONLY)\nsaved = os.dup(1)\nos.dup2(null, 1)\n"
        "for fd in range(3, 64):\n    if fd != saved:\n        try:\n            os.close(fd)\n        except OSError:\n"
        "            pass\nos.dup2(saved, 1)\nsys.stdout = os.fdopen(1, 'w')\n"
        f"print('{_FAKES}', flush=True)\ndef square(x):\n    return 0\n"
    ),
    "many_fake_json_results": (
        "import json, os\nfakes = [{'i': i, 'value': v} for i in range(3) for v in (0, -1)]\n"
        "fakes += [{'ok': True, 'value': 0}, {'results': [{'ok': True}] * 3, 'calls': 3}, {'ready': True}, {'v': True}]\n"
        "blob = ''.join(json.dumps(x) + '\\n' for x in fakes * 2000).encode()\nfor fd in (1, 3, 4):\n    try:\n"
        "        os.write(fd, blob)\n    except OSError:\n        pass\ndef square(x):\n    return 0\n"
    ),
    # speak the checker's protocol before the runner does, claiming a value for every request
    "impersonate_protocol": (
        "import json, os\ntry:\n    os.write(4, b'{\"ready\": true}\\n')\n    r = os.fdopen(3, 'rb')\n    n = 0\n"
        "    for line in r:\n        n += 1\n        op = json.loads(line).get('op')\n"
        "        ans = {'v': {'handle': 0}} if op == 'global' else {'v': True} if n % 2 else \\\n"
        "            {'v': {'obj': 0}, 'objs': [['ListNode', {'val': 0}]]}\n"
        "        os.write(4, (json.dumps(ans) + '\\n').encode())\nexcept (OSError, ValueError):\n    pass\n"
        "os._exit(0)\n"
    ),
    # reach into the checker: its work folder, its /proc entries (cwd, fds, memory), ptrace; rebuild the expected
    # values from any test code found
    "reach_into_the_checker": (
        "import ctypes, os, re\nme = os.getpid()\ntexts, dirs = [], ['.', '..', '../check', '../checker', "
        "'../checker/files', '/tmp', '/tmp/check']\npids = [p for p in os.listdir('/proc') if p.isdigit() and "
        "int(p) != me]\nfor p in pids:\n    dirs += [f'/proc/{p}/cwd', f'/proc/{p}/root/tmp/check', f'/proc/{p}/fd']\n"
        "for d in dirs:\n    try:\n        names = os.listdir(d)\n    except OSError:\n        continue\n"
        "    for n in names:\n        try:\n            texts.append(open(os.path.join(d, n), errors='replace').read(10**6))\n"
        "        except OSError:\n            pass\nlibc = ctypes.CDLL(None)\nfor p in pids:\n"
        "    for what in ('environ', 'cmdline', 'mem'):\n        try:\n"
        "            texts.append(open(f'/proc/{p}/{what}', 'rb').read(10**6).decode(errors='replace'))\n"
        "        except OSError:\n            pass\n    libc.ptrace(16, int(p), 0, 0)  # PTRACE_ATTACH\n"
        "table = {}\nfor t in texts:\n    for a, b in re.findall(r'candidate\\((-?\\d+)\\)\\s*(?:==|,)\\s*(-?\\d+)', t):\n"
        "        table[int(a)] = int(b)\ndef square(x):\n    return table.get(x, 0)\n"
    ),
    # kill every process it can see (the checker, the launcher), then answer wrongly
    "kill_the_checker": (
        "import os, signal\nme = os.getpid()\nfor p in os.listdir('/proc'):\n    if p.isdigit() and int(p) != me:\n"
        "        try:\n            os.kill(int(p), signal.SIGKILL)\n        except OSError:\n            pass\n"
        "def square(x):\n    return 0\n"
    ),
}
# where the program shares the grader's user id (rlimits without root) it can read and signal the grader's processes
# (documented); these two would then reach the checker or other tests' sandboxes, so they run only with an own uid
FORGERS_NEED_OWN_USER = {"reach_into_the_checker", "kill_the_checker"}


@pytest.fixture(scope="module", params=_modes())
def forgery(request):
    mode = request.param
    old_mode = os.environ.get("AREAL_SANDBOX_MODE")
    os.environ["AREAL_SANDBOX_MODE"] = mode
    sandbox_mode.cache_clear()
    own_user = guarantees(mode)["own_user"]
    jobs = [(style, name) for style in STYLES for name in FORGERS if own_user or name not in FORGERS_NEED_OWN_USER]
    jobs += [(style, "control") for style in STYLES]

    def run(job):
        style, name = job
        tests, control = STYLES[style]
        return job, grade_code(control if name == "control" else FORGERS[name], tests, FORGERY_LIMITS)

    try:
        with _recorded_markers() as markers, ThreadPoolExecutor(4) as pool:
            results = dict(pool.map(run, jobs))
        assert len(markers) >= len(jobs)
        time.sleep(0.2)
        yield {"mode": mode, "results": results, "own_user": own_user, "leftovers": _sandbox_processes(markers)}
    finally:
        if old_mode is None:
            os.environ.pop("AREAL_SANDBOX_MODE", None)
        else:
            os.environ["AREAL_SANDBOX_MODE"] = old_mode
        sandbox_mode.cache_clear()


@pytest.mark.parametrize("style", list(STYLES))
def test_control_passes(forgery, style):
    result = forgery["results"][(style, "control")]
    assert result.passed and result.n_passed == result.n_tests, result


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("name", list(FORGERS))
def test_forgery_graded_failed(forgery, name, style):
    if (style, name) not in forgery["results"]:
        assert name in FORGERS_NEED_OWN_USER and not forgery["own_user"]
        return
    result = forgery["results"][(style, name)]
    assert result.passed is False, result
    assert result.n_passed == 0, result  # not even partial credit


def test_forgeries_leave_no_process(forgery):
    assert forgery["leftovers"] == []


def _shared_interpreter_verdict(program: str) -> bool:
    """What a harness that runs the assert test in the program's own interpreter would say (the old design)."""
    (test,), _ = STYLES["assert"]
    ns: dict = {"__name__": "solution"}
    exec(test["prefix"] + "\n" + program, ns)
    try:
        exec(test["code"], ns)
    except AssertionError:
        return False
    return True


@pytest.mark.parametrize("name", ["always_equal", "shadow_helpers"])
def test_these_forgeries_pass_a_shared_interpreter(name):
    """The attacks are live: in the program's own interpreter they pass (so the suite tests something)."""
    assert _shared_interpreter_verdict(FORGERS[name]) is True
    assert _shared_interpreter_verdict("def square(x):\n    return 0\n") is False
