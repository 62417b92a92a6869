"""EchoTask with hostile kernels: each episode's ``setup`` makes its kernel attack the host on the episode's lines,
one class of issue 64 after another, so every group of a training step holds several classes (tests/test_soak.py).

The setup runs inside the kernel before the first line and wraps the kernel program's reply builder: from the next
reply on (the model's ``submit(k)`` line), the kernel forges a reply of the wrong shape, packs lone surrogates and
NUL, raises its own output cap, forges 400 tool calls, sends a message of 4,000 shared frames, or floods the socket
with badly signed messages.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import ClassVar

from tests.toy import EchoTask

REACH = """
import gc, json, time
k = [o for o in gc.get_objects() if type(o).__name__ == "ReplKernel"][0]
sock = k.shell_stream.socket
plain_reply, seen = k._reply, []
def on_shell_thread(fn): k.shell_stream.io_loop.add_callback(fn)
def hostile(**p):
    seen.append(1)
    if len(seen) == 1:  # this setup's own reply
        return plain_reply(**p)
    ident = k._parent_ident["shell"]
"""
ATTACKS = {
    "forge": "    return {'status': 'ok', 'replrl': {'output': 5, 'calls': 'x'}}",
    "surrogate": ("    k.session.pack = lambda o: json.dumps(o, default=str).encode()\n"
                  "    p['output'] = 'a\\ud800b\\x00' * 50 + '\\n'\n    return plain_reply(**p)"),
    "cap": "    p['output'], p['truncated'] = 'x' * 1_000_000, False\n    return plain_reply(**p)",
    "calls": ("    p['calls'] = [{'name': 'submit', 'args': ['y' * 20000], 'kwargs': {}}] + "
              "[{'name': 'submit', 'args': [9], 'kwargs': {}}] * 400\n    return plain_reply(**p)"),
    "frames": ("    big = bytearray(1 << 16)\n"
               "    on_shell_thread(lambda: sock.send_multipart([*ident, b'<IDS|MSG>'] + [big] * 4000, copy=False))\n"
               "    time.sleep(1.0)\n    return plain_reply(**p)"),
    "flood": ("    junk = [*ident, b'<IDS|MSG>', b'forged', b'{}', b'{}', b'{}', b'{}']\n"
              "    on_shell_thread(lambda: [sock.send_multipart(junk) for _ in range(100_000)])\n"
              "    time.sleep(1.0)\n    return plain_reply(**p)"),
}


@dataclass
class HostileEchoTask(EchoTask):
    """EchoTask whose episodes' kernels attack the host, the classes of ``ATTACKS`` in turn."""

    name: ClassVar[str] = "hostile_echo"
    _turn: itertools.count = field(default_factory=itertools.count, repr=False)
    used: list[str] = field(default_factory=list, repr=False)

    def setup(self, row: dict) -> str:
        attack = list(ATTACKS)[next(self._turn) % len(ATTACKS)]
        self.used.append(attack)
        return REACH + ATTACKS[attack] + "\nk._reply = hostile\n"
