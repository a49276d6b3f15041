"""A socket listener that prints every byte it receives, run as another user (`runuser -u
nobody python -c LISTENER tcp PORT` or `... unix PATH`): the tests that check nothing
secret reaches a port or socket someone else took over."""

NOBODY = 65534
LISTENER = r"""
import socket, sys
kind, where = sys.argv[1], sys.argv[2]
if kind == "tcp":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", int(where)))
else:
    s = socket.socket(socket.AF_UNIX); s.bind(where)
s.listen(16)
print("listening", flush=True)
while True:
    c, _ = s.accept()
    c.settimeout(2)
    try:
        data = c.recv(65536)
    except OSError:
        data = b""
    print("got", data.hex(), flush=True)
    c.close()
"""
