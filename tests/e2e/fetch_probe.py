# SPDX-License-Identifier: AGPL-3.0-only
"""Run inside a sandbox by test_network.py and js/network.mjs: GET / by hand, so that the
address, the Host, the TLS name and the request target can each be chosen. argv[1] is a
JSON list of [where, port, host, sni, cafile, tls, target]; prints a JSON list of the lab echo servers' answers
({"server", "port", "headers"}) or "FAIL ..." strings. Every request carries
`X-Secret: from-sandbox`, which a header rule replaces."""
import json, socket, ssl, sys

def get(where, port, host, sni=None, cafile=None, tls=False, target="/"):
    try:
        s = socket.create_connection((where, port), timeout=5)
        if tls:
            ctx = ssl.create_default_context(cafile=cafile)
            s = ctx.wrap_socket(s, server_hostname=sni or host)
        s.settimeout(5)
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}\r\nX-Secret: from-sandbox\r\nConnection: close\r\n\r\n".encode())
        buf = b""
        while True:
            c = s.recv(65536)
            if not c:
                break
            buf += c
        head, _, body = buf.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            return "FAIL status: " + head.split(b"\r\n")[0].decode(errors="replace")
        return json.loads(body)
    except Exception as e:
        return f"FAIL {type(e).__name__}: {e}"

print(json.dumps([get(*c) for c in json.loads(sys.argv[1])]))
