#!/usr/bin/env python3
"""free_port.py [N]: print N (default 1) distinct free loopback TCP ports for a test's listeners.

They come from below the kernel's ephemeral range (net.ipv4.ip_local_port_range), not from a
bind to port 0: a port from the ephemeral range is also where every outgoing connection takes
its source port, so between this pick and the test's own bind any process connecting anywhere
could take it (seen: a test agent's "Address already in use" while cargo tests ran). Below that
range only a listener can hold a port, and each one here is checked free by binding it.
"""
import random
import socket
import sys

lo, hi = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
want = int(sys.argv[1]) if len(sys.argv) > 1 else 1
candidates = list(range(20000, lo)) if lo - 20000 >= 1000 else list(range(hi + 1, 65536))
random.shuffle(candidates)
out = []
for port in candidates:
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        continue
    finally:
        s.close()
    out.append(port)
    if len(out) == want:
        break
if len(out) < want:
    sys.exit(f"free_port.py: fewer than {want} free ports below the ephemeral range")
print(*out)
