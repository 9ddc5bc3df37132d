# SPDX-License-Identifier: AGPL-3.0-only
"""The code-interpreter server of OpenDsec's `root/code-interpreter` image: the HTTP protocol
of E2B's code-interpreter template on port 49999, so the `e2b-code-interpreter` SDKs work
through the gateway.

  POST   /execute               {"code", "context_id"?, "language"?, "env_vars"?}
                                -> newline-delimited JSON, streamed: stdout/stderr as they
                                   come, results, an error, number_of_executions,
                                   end_of_execution
  POST   /contexts              {"language"?, "cwd"?} -> {"id", "language", "cwd"}
  GET    /contexts              -> [{"id", "language", "cwd"}, ...]
  DELETE /contexts/{id}
  POST   /contexts/{id}/restart
  GET    /health                -> "OK"

Each context is a Python process of its own that keeps its globals between executions (as a
Jupyter kernel does); the value of a trailing expression is the main result, and each
matplotlib figure left open is a result too (its PNG, and its data as E2B's chart: line,
scatter, bar, pie, or a superchart of several axes). Standard library only (matplotlib is
the image's).
"""

import json
import os
import subprocess
import sys
import threading
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT = 49999
MAX_BODY = 16 << 20

# Runs in each context's process: reads one JSON request per line on the fd named by its
# first argument, answers with JSON lines on the second; the user's code keeps stdin/stdout/stderr, which are sent on as
# messages while it runs.
WORKER = r'''
import ast, json, os, sys, traceback
from datetime import datetime, timezone
req_in = os.fdopen(int(sys.argv[1]), "r")
out = os.fdopen(int(sys.argv[2]), "w", buffering=1)
def send(**m):
    out.write(json.dumps(m) + "\n")
    out.flush()
def now():
    return datetime.now(timezone.utc).isoformat()
class Stream:
    """Sends whole lines as they are written (and the rest on flush), as a kernel does."""
    def __init__(self, kind):
        self.kind, self.buf = kind, ""
    def write(self, s):
        self.buf += s
        if "\n" in self.buf:
            head, _, self.buf = self.buf.rpartition("\n")
            send(type=self.kind, text=head + "\n", timestamp=now())
        return len(s)
    def flush(self):
        if self.buf:
            send(type=self.kind, text=self.buf, timestamp=now())
            self.buf = ""
    def isatty(self):
        return False
sys.stdout, sys.stderr = Stream("stdout"), Stream("stderr")
import base64, importlib.util, io
class _Inline:
    """matplotlib's backend here, `module://dsec_inline`: Agg canvases, and a show() that
    sends each open figure as a result (its PNG and its data as a chart) and closes it;
    figures still open at the end of an execution are sent then, as a notebook's inline
    backend does."""
    @staticmethod
    def find_spec(name, path=None, target=None):
        return importlib.util.spec_from_loader(name, _Inline) if name == "dsec_inline" else None
    @staticmethod
    def create_module(spec):
        return None
    @staticmethod
    def exec_module(m):
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        m.FigureCanvas = FigureCanvasAgg
        m.show = lambda *a, **k: figures()
sys.meta_path.append(_Inline)
os.environ.setdefault("MPLBACKEND", "module://dsec_inline")
MAX_POINTS = 10000
def _value(v):
    """A data value as JSON has it: numbers, or text (dates as ISO 8601)."""
    if hasattr(v, "item") and not isinstance(v, str):
        try:
            v = v.item()
        except Exception:
            pass
    if hasattr(v, "isoformat"):
        return v.isoformat()
    if isinstance(v, float) and v != v:
        return None
    return v if isinstance(v, (int, float, str)) or v is None else str(v)
def _label(artist):
    l = artist.get_label() or ""
    return "" if l.startswith("_") else l
def _xy(ax):
    return {"title": ax.get_title() or None, "x_label": ax.get_xlabel() or None,
            "y_label": ax.get_ylabel() or None, "x_unit": None, "y_unit": None}
def _ticks(ax, dates):
    return {"x_ticks": [_value(t) for t in ax.get_xticks()],
            "x_tick_labels": [t.get_text() for t in ax.get_xticklabels()],
            "x_scale": "datetime" if dates else ax.get_xscale(),
            "y_ticks": [_value(t) for t in ax.get_yticks()],
            "y_tick_labels": [t.get_text() for t in ax.get_yticklabels()],
            "y_scale": ax.get_yscale()}
def _axes_chart(ax):
    from matplotlib.collections import PathCollection
    from matplotlib.container import BarContainer
    from matplotlib.patches import Wedge
    wedges = [p for p in ax.patches if isinstance(p, Wedge)]
    if wedges:
        return {"type": "pie", "title": ax.get_title() or None,
                "elements": [{"label": _label(w), "angle": float(w.theta2 - w.theta1),
                              "radius": float(w.r)} for w in wedges]}
    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    if bars:
        ticks = dict(zip([float(t) for t in ax.get_xticks()],
                         [t.get_text() for t in ax.get_xticklabels()]))
        elements = []
        for c in bars:
            for r in c.patches:
                x = float(r.get_x() + r.get_width() / 2)
                near = min(ticks, key=lambda t: abs(t - x)) if ticks else None
                label = ticks[near] if near is not None and abs(near - x) < 1e-6 else str(_value(x))
                elements.append({"label": label, "group": _label(c), "value": _value(r.get_height())})
        return dict(type="bar", elements=elements, **_xy(ax))
    scatters = [c for c in ax.collections if isinstance(c, PathCollection)]
    lines = ax.get_lines()
    if scatters or lines:
        elements, dates = [], False
        for c in scatters:
            pts = [(_value(x), _value(y)) for x, y in c.get_offsets()[:MAX_POINTS]]
            elements.append({"label": _label(c), "points": pts})
        for l in lines:
            xs, ys = list(l.get_xdata())[:MAX_POINTS], list(l.get_ydata())[:MAX_POINTS]
            dates = dates or any(hasattr(x, "isoformat") or "datetime64" in type(x).__name__ for x in xs[:1])
            elements.append({"label": _label(l), "points": [(_value(x), _value(y)) for x, y in zip(xs, ys)]})
        kind = "scatter" if scatters and not lines else "line"
        return dict(type=kind, elements=elements, **_xy(ax), **_ticks(ax, dates))
    return None
def _chart(fig):
    charts = [c for c in (_axes_chart(ax) for ax in fig.axes) if c]
    if not charts:
        return None
    if len(charts) == 1:
        return charts[0]
    title = fig._suptitle.get_text() if getattr(fig, "_suptitle", None) else None
    return {"type": "superchart", "title": title, "elements": charts}
def figures():
    """Each figure left open, as a result: its text, PNG and chart; then closed."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    for num in plt.get_fignums():
        fig = plt.figure(num)
        r = {"text": repr(fig)}
        try:
            buf = io.BytesIO()
            fig.savefig(buf, format="png")
            r["png"] = base64.b64encode(buf.getvalue()).decode()
        except Exception:
            pass
        try:
            c = _chart(fig)
            if c:
                r["chart"] = c
        except Exception:
            pass
        plt.close(fig)
        send(type="result", is_main_result=False, **r)
scope = {"__name__": "__main__"}
count = 0
def formats(v):
    r = {"text": repr(v)}
    for attr, key in (("_repr_html_", "html"), ("_repr_markdown_", "markdown"),
                      ("_repr_svg_", "svg"), ("_repr_latex_", "latex"),
                      ("_repr_json_", "json"), ("_repr_png_", "png"), ("_repr_jpeg_", "jpeg")):
        f = getattr(v, attr, None)
        if callable(f):
            try:
                x = f()
            except Exception:
                continue
            if x is not None:
                r[key] = x
    return r
for line in req_in:
    req = json.loads(line)
    count += 1
    saved = dict(os.environ)
    os.environ.update(req.get("env_vars") or {})
    try:
        tree = ast.parse(req["code"], "<cell>", "exec")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "<cell>", "exec"), scope)
        if last is not None:
            v = eval(compile(ast.Expression(last.value), "<cell>", "eval"), scope)
            if v is not None:
                scope["_"] = v
                send(type="result", is_main_result=True, **formats(v))
    except BaseException as e:
        if isinstance(e, SystemExit) and not e.code:
            pass
        else:
            sys.stdout.flush()
            sys.stderr.flush()
            tb = traceback.format_exception(type(e), e, e.__traceback__.tb_next)
            send(type="error", name=type(e).__name__, value=str(e), traceback="".join(tb))
    finally:
        try:
            figures()
        except Exception:
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os.environ.clear()
        os.environ.update(saved)
    send(type="number_of_executions", execution_count=count)
    send(type="__done__")
'''


class Context:
    def __init__(self, language: str, cwd: str, cid: str | None = None):
        self.id = cid or uuid.uuid4().hex
        self.language = language
        self.cwd = cwd
        self.lock = threading.Lock()
        self.proc = None
        self.start()

    def start(self):
        req_r, req_w = os.pipe()
        out_r, out_w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-c", WORKER, str(req_r), str(out_w)], cwd=self.cwd,
            stdin=subprocess.DEVNULL, pass_fds=(req_r, out_w))
        os.close(req_r)
        os.close(out_w)
        self.requests = os.fdopen(req_w, "w", buffering=1)
        self.replies = os.fdopen(out_r, "r")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for f in (getattr(self, "requests", None), getattr(self, "replies", None)):
            try:
                f and f.close()
            except OSError:
                pass

    def restart(self):
        with self.lock:
            self.stop()
            self.start()

    def execute(self, code: str, env: dict):
        """Yields the messages of one execution."""
        with self.lock:
            if self.proc.poll() is not None:
                self.start()
            try:
                self.requests.write(json.dumps({"code": code, "env_vars": env}) + "\n")
            except OSError:
                self.restart_locked()
                self.requests.write(json.dumps({"code": code, "env_vars": env}) + "\n")
            while True:
                line = self.replies.readline()
                if not line:
                    # the process ended (os._exit, a crash): the next execution gets a new one
                    yield {"type": "error", "name": "DeadKernelError",
                           "value": "the context's process ended", "traceback": ""}
                    self.stop()
                    return
                m = json.loads(line)
                if m.get("type") == "__done__":
                    return
                yield m

    def restart_locked(self):
        self.stop()
        self.start()

    def json(self):
        return {"id": self.id, "language": self.language, "cwd": self.cwd}


CONTEXTS: dict[str, Context] = {}
DEFAULTS: dict[str, str] = {}
LOCK = threading.Lock()
HOME = os.environ.get("HOME", "/root")


def language_of(lang):
    lang = (lang or "python").lower()
    if lang not in ("python", "python3"):
        raise ValueError(f"language {lang!r} is not supported: this server runs python")
    return "python"


def default_context(lang: str) -> Context:
    with LOCK:
        cid = DEFAULTS.get(lang)
        if cid is None or cid not in CONTEXTS:
            c = Context(lang, HOME if os.path.isdir(HOME) else "/")
            CONTEXTS[c.id] = c
            DEFAULTS[lang] = c.id
        return CONTEXTS[DEFAULTS[lang]]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def reply(self, status: int, body, ctype="application/json"):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def error(self, status: int, message: str):
        self.reply(status, {"code": status, "message": message})

    def body(self):
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            raise ValueError(f"the request body is over {MAX_BODY >> 20} MiB")
        raw = self.rfile.read(n) if n else b"{}"
        v = json.loads(raw or b"{}")
        if not isinstance(v, dict):
            raise ValueError("the request body must be a JSON object")
        return v

    def do_GET(self):
        if self.path == "/health":
            return self.reply(200, b"OK", "text/plain")
        if self.path == "/contexts":
            return self.reply(200, [c.json() for c in list(CONTEXTS.values())])
        self.error(404, f"no route {self.path}")

    def do_DELETE(self):
        parts = self.path.strip("/").split("/")
        if len(parts) == 2 and parts[0] == "contexts":
            c = CONTEXTS.pop(parts[1], None)
            if c is None:
                return self.error(404, f"context {parts[1]} not found")
            c.stop()
            return self.reply(200, {})
        self.error(404, f"no route {self.path}")

    def do_POST(self):
        try:
            req = self.body()
        except (ValueError, json.JSONDecodeError) as e:
            return self.error(400, str(e))
        parts = self.path.strip("/").split("/")
        try:
            if parts == ["execute"]:
                return self.execute(req)
            if parts == ["contexts"]:
                lang = language_of(req.get("language"))
                cwd = req.get("cwd") or HOME
                if not os.path.isdir(cwd):
                    return self.error(400, f"cwd {cwd} is not a directory")
                c = Context(lang, cwd)
                CONTEXTS[c.id] = c
                return self.reply(200, c.json())
            if len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart":
                c = CONTEXTS.get(parts[1])
                if c is None:
                    return self.error(404, f"context {parts[1]} not found")
                c.restart()
                return self.reply(200, {})
        except ValueError as e:
            return self.error(400, str(e))
        self.error(404, f"no route {self.path}")

    def execute(self, req):
        code = req.get("code")
        if not isinstance(code, str):
            return self.error(400, "code must be a string")
        if req.get("context_id"):
            c = CONTEXTS.get(req["context_id"])
            if c is None:
                return self.error(404, f"context {req['context_id']} not found")
        else:
            c = default_context(language_of(req.get("language")))
        env = {str(k): str(v) for k, v in (req.get("env_vars") or {}).items()}
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def chunk(m):
            data = (json.dumps(m) + "\n").encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        try:
            for m in c.execute(code, env):
                chunk(m)
            chunk({"type": "end_of_execution"})
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True


if __name__ == "__main__":
    print(f"code interpreter on :{PORT} ({datetime.now(timezone.utc).isoformat()})", flush=True)
    ThreadingHTTPServer(("0.0.0.0", PORT), Handler).serve_forever()
